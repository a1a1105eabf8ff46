"""Dropout: Philox known answers, keep rate, and forward/backward against the reference
applied with the exact mask the kernel reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aotattn
from aotattn import reference
from aotattn.families.flash import rules
from aotattn.runtime import launch
from aotattn.spec import Config, Functional, LaunchPlan
from tests.helpers import DEVICES, TOLERANCE, dropout_keeps, rel_err
from tests.families.flash.helpers import make_qkv, seed_from
from tests.families.flash.test_varlen import make_varlen
from tests.test_fuzz import check_dropout_problem


def _signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key, counter, expected", [
    # Random123's known-answer vectors for Philox4x32-10: key (k0, k1), counter (c0..c3), first word
    ((0, 0), (0, 0, 0, 0), 0x6627E8D5),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 4, 0x408F276D),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0xD16CFE09),
])
def test_philox_known_answers(device, key, counter, expected):
    seed = _signed(key[0] | key[1] << 32)
    idx = _signed(counter[0] | counter[1] << 32)
    offset = _signed(counter[2] | counter[3] << 32)
    out = torch.empty(1, dtype=torch.int64, device=device)
    launch(LaunchPlan(rules.PHILOX_WORDS, Functional.of({}), Config.of(BLOCK=128, num_warps=4, num_stages=1),
                      (1, 1, 1), (out, seed, offset, idx, 1)))
    assert out.item() == expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqlen_k", [13, 64, 70, 200])
def test_the_mask_is_the_documented_philox_mapping(device, seqlen_k):
    """Element (b, h, i, j), j = 32 g + 8 e + 2 p + a, is kept iff half a (low or high 16
    bits) of word e of Philox4x32-10 at counter ((b * Hq + h) * Sq + i) * 4 * ceil(Sk / 32)
    + 4 g + p (offset in the high half) is >= round(p * 2^16), checked element by element
    against the tests' numpy Philox (the forward, the backward and dropout_mask all use
    this mapping)."""
    batch, heads, seqlen_q, dropout_p = 2, 3, 5, 0.4
    torch.manual_seed(11)
    state = torch.get_rng_state()
    mask = aotattn.dropout_mask(batch, heads, seqlen_q, seqlen_k, dropout_p, device=device).cpu()
    torch.set_rng_state(state)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()  # the call's draw
    rows = np.arange(batch * heads * seqlen_q)[:, None]  # (b * Hq + h) * Sq + i
    want = dropout_keeps(seed, offset, dropout_p, rows, np.arange(seqlen_k)[None, :], seqlen_k)
    assert torch.equal(mask.reshape(-1, seqlen_k), torch.from_numpy(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_keep_rate_and_reproducibility(device, dropout_p):
    n = (2, 2, 64, 100) if device == "cpu" else (8, 16, 512, 1000)
    torch.manual_seed(3)
    mask = aotattn.dropout_mask(*n, dropout_p, device=device)
    total = mask.numel()
    assert abs(mask.float().mean().item() - (1 - dropout_p)) < 5 * (dropout_p * (1 - dropout_p) / total) ** 0.5
    torch.manual_seed(3)
    assert torch.equal(mask, aotattn.dropout_mask(*n, dropout_p, device=device))
    assert not torch.equal(mask, aotattn.dropout_mask(*n, dropout_p, device=device))  # state advanced


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout_p,kept", [(2.0**-18, 1.0), (1 - 2.0**-18, 0.0), (2.0**-16, None)])
def test_extreme_probabilities_follow_the_16_bit_threshold(request, device, dropout_p, kept):
    """Draws are 16 bits, kept when >= round(p * 2^16): a p below 2^-17 drops nothing (the
    kept weights still scaled by 1 / (1 - p)), a p within 2^-17 of 1 keeps nothing (output
    0), and p = 2^-16 drops exactly the draws equal to 0, as the numpy Philox predicts."""
    seed_from(request.node.nodeid)
    n = (2, 3, 40, 70) if device == "cpu" else (4, 8, 1000, 1000)
    state = torch.get_rng_state()
    mask = aotattn.dropout_mask(*n, dropout_p, device=device)
    torch.set_rng_state(state)
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    rows = np.arange(n[0] * n[1] * n[2])[:, None]
    want = dropout_keeps(seed, offset, dropout_p, rows, np.arange(n[3])[None, :], n[3])
    assert torch.equal(mask.cpu().reshape(-1, n[3]), torch.from_numpy(want))
    if kept is not None:
        assert mask.float().mean().item() == kept
    q, k, v = make_qkv(2, 33, 47, 3, 3, 16, 16, torch.float32, device)
    state = torch.get_rng_state()
    out = aotattn.flash_attn_func(q, k, v, dropout_p=dropout_p, causal=True)
    torch.set_rng_state(state)
    keep = aotattn.dropout_mask(2, 3, 33, 47, dropout_p, device=device)
    ref, _ = reference.attention(q.double(), k.double(), v.double(), dropout_mask=keep, dropout_p=dropout_p,
                                 causal=True)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]
    if kept == 0.0:
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [("split", False), ("fused", False), ("fused", True)],
                         ids=["split", "fused-atomic", "fused-deterministic"])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_size": (7, 3), "diagonal": "top_left"}],
                         ids=["full", "causal", "window-tl"])
def test_dropout_forward_and_backward(request, device, variant, mask):
    seed_from(request.node.nodeid)
    dropout_p = 0.3
    seqlen_q, seqlen_k = (37, 45) if device == "cpu" else (700, 1100)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, 32, torch.float32, device, requires_grad=True)
    state = torch.get_rng_state()
    out = aotattn.flash_attn_func(q, k, v, dropout_p=dropout_p, backend=variant[0], deterministic=variant[1],
                                  **mask)
    torch.set_rng_state(state)
    keep = aotattn.dropout_mask(2, 4, seqlen_q, seqlen_k, dropout_p, device=device)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention(*ref_in, dropout_mask=keep, dropout_p=dropout_p, **mask)
    assert rel_err(out, ref_out) < TOLERANCE[torch.float32]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_err(g, r) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [("split", False), ("fused", False), ("fused", True)],
                         ids=["split", "fused-atomic", "fused-deterministic"])
@pytest.mark.parametrize("head_dims", [(256, 256), (1, 129), (128, 128)], ids=lambda d: f"d{d[0]}-dv{d[1]}")
def test_dropout_gradients_at_wide_heads_with_a_key_tail(request, device, variant, head_dims):
    """Every gradient within the rounding floor's multiple (tests/helpers.assert_within_floor)
    at head widths padded to 256 and 128, with a key count that leaves the last key block
    part empty. The fused d256 dropout cells pipeline the dK product, whose A operand sat
    in registers a tail select for dQ later overwrote (Triton 3.6's code): dK on the H200
    was off by 28-255x the bound while dQ and the split backend passed."""
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k = (19, 45) if device == "cpu" else (333, 1001)
    problem = dict(shape=dict(batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_k=2, heads_q=2,
                              head_dim=head_dims[0], head_dim_v=head_dims[1]),
                   mask=dict(causal=False, window_size=(-1, -1), diagonal="bottom_right", softmax_scale=None),
                   dtype=torch.float16, magnitude=1.0, backend=variant, seed=int(torch.randint(0, 2**31, ())))
    check_dropout_problem(problem, 0.1, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [("split", False), ("fused", False), ("fused", True)],
                         ids=["split", "fused-atomic", "fused-deterministic"])
def test_dropout_with_a_bias_gradient(request, device, variant):
    """dBias is ds = p (z dp / (1 - p) - delta): the kernels sum ds (1 - p) in their loops and
    scale once at the end, so the bias gradient, written inside the loop, is scaled there."""
    seed_from(request.node.nodeid)
    dropout_p = 0.25
    b, h, sq, sk = (2, 3, 29, 41) if device == "cpu" else (2, 8, 500, 900)
    q, k, v = make_qkv(b, sq, sk, h, h, 32, 32, torch.float32, device, requires_grad=True)
    bias = torch.randn(1, h, sq, sk, device=device, requires_grad=True)
    state = torch.get_rng_state()
    out = aotattn.flash_attn_func(q, k, v, bias=bias, dropout_p=dropout_p, causal=True, backend=variant[0],
                                  deterministic=variant[1])
    torch.set_rng_state(state)
    keep = aotattn.dropout_mask(b, h, sq, sk, dropout_p, device=device)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref_out, _ = reference.attention(*ref_in[:3], bias=ref_in[3], causal=True, dropout_mask=keep,
                                     dropout_p=dropout_p)
    assert rel_err(out, ref_out) < TOLERANCE[torch.float32]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert rel_err(g, r) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_varlen(request, device):
    seed_from(request.node.nodeid)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(device, torch.float32)
    state = torch.get_rng_state()
    out = aotattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.2, causal=True)
    torch.set_rng_state(state)
    keep = aotattn.dropout_mask(len(cu_q) - 1, q.shape[1], max_q, max_k, 0.2, device=device)
    ref_out, _ = reference.attention_varlen(q, k, v, cu_q, cu_k, dropout_mask=keep, dropout_p=0.2, causal=True)
    assert rel_err(out, ref_out) < TOLERANCE[torch.float32]


def test_dropout_changes_with_the_generator():
    q, k, v = make_qkv(1, 16, 16, 1, 1, 16, 16, torch.float32, "cpu")
    torch.manual_seed(1)
    a = aotattn.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    b = aotattn.flash_attn_func(q, k, v, dropout_p=0.5)
    c = aotattn.flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_philox_compiles_for_each_target(arch):
    """The Philox multiplies take the inline-PTX widening multiply only when the compile
    target is NVIDIA (the target's backend, not this machine's driver): sm_90 machine code
    has IMAD.WIDE.U32 and no IMAD.HI (the high and low halves from one instruction), and an
    AMD target, which cannot take PTX, compiles the portable path."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    from aotattn.compiler.jobs import Job, compile_job

    config = Config.of(BLOCK=128, num_warps=4, num_stages=1)
    entry, binary = compile_job(Job(arch, rules.PHILOX_WORDS.qualname, Functional.of({}), config))
    assert binary and entry.binary == ("cubin" if arch == "sm_90" else "hsaco")
    if arch != "sm_90":
        return
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "philox.cubin"
        path.write_bytes(binary)
        sass = subprocess.run([str(cuobjdump), "--dump-sass", str(path)], check=True, capture_output=True,
                              text=True).stdout
    assert sass.count("IMAD.WIDE.U32") >= 18 and "IMAD.HI" not in sass
