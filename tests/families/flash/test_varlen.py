"""Variable-length batches against the reference computed sequence by sequence."""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn import reference
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import assert_lse_close, seed_from

# lengths 0 and 1, primes, and one long sequence
LENGTHS = {
    "cpu": ([0, 1, 7, 13, 2, 41, 0, 5], [3, 1, 11, 13, 0, 37, 4, 29]),
    "cuda": ([0, 1, 7, 131, 2, 1021, 0, 509, 3001], [3, 1, 11, 127, 0, 1031, 4, 499, 2999]),
}
MASKS = [
    pytest.param({}, id="full"),
    pytest.param({"causal": True}, id="causal-br"),
    pytest.param({"window_size": (6, 2)}, id="window-br"),
    pytest.param({"window_size": (4, 3), "diagonal": "top_left"}, id="window-tl"),
    pytest.param({"causal": True, "window_size": (9, -1), "diagonal": "top_left"}, id="causal-left-tl"),
]


def make_varlen(device, dtype, heads=(4, 2), head_dim=32, requires_grad=False):
    lens_q, lens_k = LENGTHS[device]
    cu_q = torch.tensor([0] + lens_q, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(sum(lens_q), heads[0], head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    k = torch.randn(sum(lens_k), heads[1], head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    v = torch.randn(sum(lens_k), heads[1], head_dim, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", MASKS)
def test_varlen_forward_per_sequence_windows(request, device, dtype, mask):
    """Per-sequence bottom-right windows: what a host-side shift of one window cannot do."""
    seed_from(request.node.nodeid)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(device, dtype)
    out, lse = aotattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **mask)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, **mask)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert rel_err(out, ref_out) < TOLERANCE[dtype]
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [("split", False), ("fused", False), ("fused", True)],
                         ids=["split", "fused-atomic", "fused-deterministic"])
@pytest.mark.parametrize("mask", MASKS[1:3])
def test_varlen_gradients(request, device, variant, mask):
    seed_from(request.node.nodeid)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(device, torch.float16, requires_grad=True)
    out = aotattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, backend=variant[0],
                                         deterministic=variant[1], **mask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention_varlen(*ref_in, cu_q, cu_k, **mask)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_err(g, r) < TOLERANCE[torch.float16], name


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_matches_padded_batch(request, device):
    """Equal lengths: varlen equals the dense call on the same tokens."""
    seed_from(request.node.nodeid)
    q = torch.randn(3, 37, 4, 32, device=device, dtype=torch.float32)
    k = torch.randn(3, 29, 2, 32, device=device, dtype=torch.float32)
    v = torch.randn(3, 29, 2, 32, device=device, dtype=torch.float32)
    cu_q = torch.arange(0, 4 * 37, 37, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, 4 * 29, 29, dtype=torch.int32, device=device)
    dense = aotattn.flash_attn_func(q, k, v, causal=True)
    packed = aotattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                            37, 29, causal=True)
    torch.testing.assert_close(packed, dense.flatten(0, 1), rtol=0, atol=1e-6)


def _varlen_args(**changes):
    q, k, v = torch.randn(10, 2, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32), max_seqlen_q=6, max_seqlen_k=7)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, exc, message", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, "cu_seqlens_q: expected dtype torch.int32"),
    (dict(cu_seqlens_q=torch.tensor([1, 4, 10], dtype=torch.int32)), ValueError, "first offset to be 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 11], dtype=torch.int32)), ValueError,
     "cu_seqlens_k: expected the last offset to equal the number of tokens 12"),
    (dict(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32)), ValueError, "cu_seqlens_k: expected 3 offsets"),
    # a count that differs is named before a last offset that differs with it
    (dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)), ValueError, "cu_seqlens_k: expected 3 offsets"),
    (dict(cu_seqlens_q=torch.tensor([[0, 4, 10]], dtype=torch.int32)), ValueError, "cu_seqlens_q: expected a 1-D"),
    (dict(cu_seqlens_q=[0, 4, 10]), TypeError, "cu_seqlens_q: expected a torch.Tensor"),
    (dict(max_seqlen_q=5), ValueError, "max_seqlen_q: expected at least the longest sequence, 6"),
    (dict(max_seqlen_k=7.0), TypeError, "max_seqlen_k: expected an int"),
    # int32 arguments of the kernels: beyond, the interpreter looped over 2**31 rows without end
    (dict(max_seqlen_q=2**31), ValueError, "max_seqlen_q: expected at most 2147418112 (2**31 - 2**16"),
    (dict(max_seqlen_k=2**40), ValueError, "max_seqlen_k: expected at most 2147418112"),
    # rounded up to blocks in int32, a length within a block of 2**31 wrapped
    (dict(max_seqlen_q=2**31 - 1), ValueError, "max_seqlen_q: expected at most 2147418112"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k: expected a length, 0 or more, got -1"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32).to_sparse()), ValueError,
     "cu_seqlens_k: expected a dense (strided) tensor"),
    (dict(q=torch.randn(1, 10, 2, 16)), ValueError, "q: expected a 3-D tensor"),
    # the caller's strides in the message (a leading dim added for the shared checks showed 4)
    (dict(q=torch.randn(10, 2, 16, 2)[..., 0]), ValueError,
     "q: expected a unit stride in the last dimension, got strides (64, 32, 2)"),
    (dict(k=torch.randn(12, 3, 16), v=torch.randn(12, 3, 16)), ValueError, "multiple of k's 3"),
])
def test_varlen_rejects(changes, exc, message):
    with pytest.raises(exc) as info:
        aotattn.flash_attn_varlen_func(**_varlen_args(**changes))
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_a_negative_max_seqlen_is_refused_without_the_offsets(name):
    """On meta tensors the offsets have no values, but a negative length needs none (it
    was accepted there, and on CPU named as below the longest sequence)."""
    args = {key: value.to("meta") if isinstance(value, torch.Tensor) else value
            for key, value in _varlen_args(**{name: -5}).items()}
    with pytest.raises(ValueError, match=f"{name}: expected a length, 0 or more, got -5"):
        aotattn.flash_attn_varlen_func(**args)
    args[name] = 7
    out = aotattn.flash_attn_varlen_func(**args)
    assert out.shape == (10, 2, 16) and out.is_meta
