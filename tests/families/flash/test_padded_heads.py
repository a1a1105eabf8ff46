"""Head dims off the buckets (72, 57, 200, ...): multiples of 8 run the padded-head
kernels on the caller's tensors; the others (and every one under
``AOTATTN_PAD_HEADS=copy``) are padded with zeros to the bucket, run the bucket's aligned
kernels, and the output is sliced back; autograd slices the gradients. Checked against
the float64 reference on every layout, with the kernels that ran recorded, on CPU and at
GPU sizes."""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn import reference
from aotattn.families.flash import ops, rules
from aotattn.perfmon.provenance import recording_lookups
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import make_qkv, seed_from
from tests.families.flash.test_varlen import make_varlen


def _check(out, grads, ref_in, ref, dout, dtype):
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    assert out.shape == ref.shape and rel_err(out, ref) < TOLERANCE[dtype]
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and rel_err(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_heads", ["copy", "kernel"])
@pytest.mark.parametrize("dims", [(72, 72), (57, 40), (9, 9), (200, 136), (200, 130), (121, 121), (8, 8)])
def test_off_bucket_head_dims_run_the_bucket_kernels(request, monkeypatch, device, pad_heads, dims):
    """``AOTATTN_PAD_HEADS=copy`` runs the bucket's unpadded kernels; ``kernel`` (the
    default) the padded-head ones where both head dims are multiples of 8 (rows of 16
    bytes, what they assume) and pads the others by copy. All match the reference."""
    monkeypatch.setenv(ops.PAD_HEADS_VAR, pad_heads)
    seed_from(request.node.nodeid)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sq, sk = (21, 34) if device == "cpu" else (1000, 1537)
    q, k, v = make_qkv(2, sq, sk, 6, 2, dims[0], dims[1], dtype, device, requires_grad=True)
    with recording_lookups() as lookups:
        out = aotattn.flash_attn_func(q, k, v, causal=True, window_size=(300, -1))
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.attention(*ref_in, causal=True, window_size=(300, -1))
    _check(out, grads, ref_in, ref, dout, dtype)
    bucket = rules.head_dim_bucket(max(dims))
    functionals = [l.functional.as_dict() for l in lookups if "PAD_HEAD" in l.functional.as_dict()]
    padded = pad_heads == "kernel" and dims[0] % 8 == 0 and dims[1] % 8 == 0
    assert functionals and all(f["PAD_HEAD"] is padded and f.get("BLOCK_D", f.get("BLOCK_DV")) == bucket
                               for f in functionals)


def test_a_bad_pad_heads_setting_is_one_line(monkeypatch):
    monkeypatch.setenv(ops.PAD_HEADS_VAR, "bogus")
    q = torch.randn(1, 8, 2, 24)
    with pytest.raises(ValueError, match="AOTATTN_PAD_HEADS: expected copy or kernel, got 'bogus'"):
        aotattn.flash_attn_func(q, q, q)


@pytest.mark.parametrize("device", DEVICES)
def test_off_bucket_sdpa_layout_gqa_and_bias(request, monkeypatch, device):
    seed_from(request.node.nodeid)
    dtype = torch.float32 if device == "cpu" else torch.float16
    s = 29 if device == "cpu" else 777
    query = torch.randn(2, 8, s, 80, dtype=dtype, device=device, requires_grad=True)
    key = torch.randn(2, 2, s + 5, 80, dtype=dtype, device=device, requires_grad=True)
    value = torch.randn(2, 2, s + 5, 80, dtype=dtype, device=device, requires_grad=True)
    mask = torch.randn(1, 8, s, s + 5, dtype=dtype, device=device)
    out = aotattn.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (query, key, value)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=mask.double(), enable_gqa=True)
    _check(out, grads, ref_in, ref, dout, dtype)
    # D 80 is a multiple of 8: the padded-head kernels read the tensors as they are, and
    # the plan cache keeps the call (a hit gives the same output); padded by copy, it does not
    plain = query.detach(), key.detach(), value.detach()
    ops._PLANS.entries.clear()
    again = aotattn.scaled_dot_product_attention(*plain, enable_gqa=True)
    assert again.shape == (2, 8, s, 80) and len(ops._PLANS.entries) == 1
    assert torch.equal(aotattn.scaled_dot_product_attention(*plain, enable_gqa=True), again)
    monkeypatch.setenv(ops.PAD_HEADS_VAR, "copy")
    ops._PLANS.entries.clear()
    copied = aotattn.scaled_dot_product_attention(*plain, enable_gqa=True)
    assert not ops._PLANS.entries and rel_err(copied, again) < TOLERANCE[dtype]
    ops._PLANS.entries.clear()


@pytest.mark.parametrize("device", DEVICES)
def test_off_bucket_varlen_with_dropout(request, device):
    seed_from(request.node.nodeid)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(device, torch.float32, head_dim=24, requires_grad=True)
    state = torch.get_rng_state()
    out = aotattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.25, causal=True)
    torch.set_rng_state(state)
    batch = cu_q.numel() - 1
    keep = aotattn.dropout_mask(batch, q.shape[1], max_q, max_k, 0.25, device=device)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    refs = []
    for b in range(batch):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        r, _ = reference.attention(ref_in[0][None, qs], ref_in[1][None, ks], ref_in[2][None, ks], causal=True,
                                   dropout_mask=keep[b:b + 1, :, :lq, :lk], dropout_p=0.25)
        refs.append(r[0])
    _check(out, grads, ref_in, torch.cat(refs), dout, torch.float32)


@pytest.mark.parametrize("layout, copied", [("contiguous", False), ("packed-qkv", False), ("row-of-100", True),
                                            ("offset-4-bytes", True)])
def test_off_bucket_layouts_are_read_in_place_or_copied(request, monkeypatch, layout, copied):
    """D 72 (a multiple of 8, padded kernels): a contiguous tensor and q/k/v sliced out of
    one packed (B, S, 3, H, 72) tensor have rows of 16 bytes and are read in place; a slice
    of heads 100 wide (head stride 100) or a view 4 bytes off is copied first
    (planning.servable). Each matches the reference."""
    from aotattn.families.flash import planning

    seed_from(request.node.nodeid)
    b, s, h, d = 2, 19, 3, 72
    if layout == "packed-qkv":
        q, k, v = torch.randn(b, s, 3, h, d, dtype=torch.float16).unbind(2)
    elif layout == "row-of-100":
        q, k, v = (torch.randn(b, s, h, 100, dtype=torch.float16)[..., :d] for _ in range(3))
    elif layout == "offset-4-bytes":
        q, k, v = (torch.randn(b * s * h * d + 2, dtype=torch.float16)[2:].view(b, s, h, d) for _ in range(3))
    else:
        q, k, v = (torch.randn(b, s, h, d, dtype=torch.float16) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seen = []
    servable = planning.servable

    def recorded(p, *tensors):
        result = servable(p, *tensors)
        seen.append(result[1])
        return result

    monkeypatch.setattr(planning, "servable", recorded)
    ops._PLANS.entries.clear()  # a cached plan would answer before the operators look at the tensors
    with recording_lookups() as lookups:
        out = aotattn.flash_attn_func(q, k, v, causal=True)
    assert seen == [copied]
    assert all(l.functional.as_dict()["PAD_HEAD"] for l in lookups if "PAD_HEAD" in l.functional.as_dict())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.attention(*ref_in, causal=True)
    _check(out, grads, ref_in, ref, dout, torch.float16)
