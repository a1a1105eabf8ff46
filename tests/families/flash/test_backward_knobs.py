"""The split backward's TMA knob (kernels/backward.py, tuning knob of ``flash.attn_bwd_dq``
and ``flash.attn_bwd_dkdv``).

TMA=1 streams the loop's tiles through tensor descriptors: K and V in dQ, q and dO (over
the GQA group's query heads, one 3-d descriptor) in dK/dV. It is the same arithmetic in
the same order, so in the interpreter dQ, dK, dV and dBias equal the plain loop's bit for
bit on every path the forward's knob tests cover (masks on both diagonals, windows, rows
that see one key or none, GQA, varlen, dropout, a bias, padded heads (descriptors spanning
the real head dims),
fp32); on the GPU they must match the float64 reference and the plain loop. The split
backend is forced (the fused one has no knob); the plan cache is emptied around each test.
"""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn.families.flash import ops, rules
from aotattn.spec import Config
from tests.families.flash.helpers import config_override, make_qkv, seed_from
from tests.families.flash.test_forward_knobs import CASES, Case, _reference
from tests.helpers import TOLERANCE, rel_err

KERNELS = (rules.ATTN_BWD_DQ.name, rules.ATTN_BWD_DKDV.name)


@pytest.fixture
def backward_tma(monkeypatch):
    """``set(value)``: the split backward's kernels run with TMA=value from then on."""
    use = config_override(monkeypatch)

    def set_tma(value: int) -> None:
        def with_tma(kernel, functional, config):
            if kernel.name not in KERNELS:
                return config
            return rules.KERNELS[kernel.name].canonical(Config.of({**config.as_dict(), "TMA": value}))

        use(with_tma)

    yield set_tma
    ops._PLANS.entries.clear()


def _grads(case: Case, q, k, v, device: str, seed: int):
    """(out, dq, dk, dv, dbias or None, the call's keyword arguments) of one forward and
    backward through the split backend with a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kwargs = dict(case.kwargs)
    bias = None
    if kwargs.pop("bias", False):
        b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
        generator = torch.Generator(device=device).manual_seed(seed)
        bias = torch.randn(b, hq, sq, k.shape[1], generator=generator, device=device, dtype=q.dtype)
        bias.requires_grad_()
        kwargs["bias"] = bias
    torch.manual_seed(seed)  # the dropout draws
    out = aotattn.flash_attn_func(*leaves, backend="split", **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator(device=device).manual_seed(seed + 1),
                       device=device, dtype=out.dtype)
    inputs = leaves + ([bias] if bias is not None else [])
    grads = torch.autograd.grad(out, inputs, dout)
    return out, grads, dout, kwargs


def _both(case: Case, device: str, set_tma, name: str):
    seed_from(name)
    q, k, v = make_qkv(*case.shape(device), case.dtype, device)
    set_tma(0)
    plain = _grads(case, q, k, v, device, seed=11)
    set_tma(1)
    knobbed = _grads(case, q, k, v, device, seed=11)
    return plain, knobbed, (q, k, v)


def _reference_grads(case: Case, q, k, v, kwargs: dict, dout, device: str, seed: int):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_kwargs = dict(kwargs)
    inputs = list(leaves)
    if "bias" in ref_kwargs:
        ref_kwargs["bias"] = ref_kwargs["bias"].detach().double().requires_grad_()
        inputs.append(ref_kwargs["bias"])
    ref, _ = _reference(*leaves, ref_kwargs, device, seed=seed)
    return torch.autograd.grad(ref, inputs, dout.double())


def _split_grads(call, leaves, dout, value: int, set_tma):
    """(out, (dq, dk, dv)) of ``call(*leaves)`` with the split backward at TMA=value."""
    set_tma(value)
    inputs = [t.detach().clone().requires_grad_() for t in leaves]
    out = call(*inputs)
    return out, torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tma_matches_the_plain_loop_bit_for_bit_in_the_interpreter(case, backward_tma, request):
    (out0, plain, dout, kwargs), (out1, knobbed, _, _), (q, k, v) = _both(case, "cpu", backward_tma, request.node.name)
    assert torch.equal(out0, out1)
    for a, b in zip(plain, knobbed):
        assert torch.equal(a, b)
    ref = _reference_grads(case, q, k, v, kwargs, dout, "cpu", seed=11)
    for got, want in zip(knobbed, ref):
        assert rel_err(got, want) < TOLERANCE[case.dtype] * (4 if case.kwargs.get("bias") else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tma_matches_the_reference_on_the_gpu(case, backward_tma, request):
    (_, plain, dout, kwargs), (_, knobbed, _, _), (q, k, v) = _both(case, "cuda", backward_tma, request.node.name)
    ref = _reference_grads(case, q, k, v, kwargs, dout, "cuda", seed=11)
    for got, base, want in zip(knobbed, plain, ref):
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < TOLERANCE[case.dtype] * (4 if case.kwargs.get("bias") else 1)
        assert rel_err(got, base.to(torch.float64)) < TOLERANCE[case.dtype]


def test_varlen_tma_matches_the_plain_loop(backward_tma):
    """Packed sequences of unequal lengths (one empty, one shorter than a block), GQA,
    causal: each sequence's descriptors start at its own first row, and the dK/dV
    descriptor spans the group's query heads."""
    torch.manual_seed(5)
    lengths, heads_q, heads_k, d = [70, 13, 0, 41, 1], 4, 2, 16
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = sum(lengths)
    q = torch.randn(total, heads_q, d, dtype=torch.float16)
    k, v = (torch.randn(total, heads_k, d, dtype=torch.float16) for _ in range(2))
    dout = torch.randn(total, heads_q, d, dtype=torch.float16)

    def call(q, k, v):
        return aotattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                              backend="split")

    _, plain = _split_grads(call, (q, k, v), dout, 0, backward_tma)
    _, knobbed = _split_grads(call, (q, k, v), dout, 1, backward_tma)
    for a, b in zip(plain, knobbed):
        assert torch.equal(a, b)
    assert all(torch.isfinite(g).all() for g in knobbed)


def test_tma_is_a_knob_of_the_split_kernels_only():
    """The knob parses and writes like the forward's (left out at its default); the fused
    kernel's space has none; the tuner gives it to padded heads too (their descriptors span
    the real head dims)."""
    from aotattn.tune import candidates
    from aotattn.tune import flash as tune_flash
    from aotattn.spec import Functional

    for spec in (rules.ATTN_BWD_DQ, rules.ATTN_BWD_DKDV):
        assert dict(spec.tuning_space)["TMA"] == (0, 1)
        tiles = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        assert spec.canonical(Config.of({**tiles, "TMA": 0})) == Config.of(tiles)
        assert spec.canonical(Config.of({**tiles, "TMA": 1})).as_dict()["TMA"] == 1
        padded = Functional.of(dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=True, MASK=0, VARLEN=False,
                                    DROPOUT=False, BIAS=0))
        footprint = tune_flash.footprint(f"flash.{spec.name}")
        for config in (Config.of({**tiles, "TMA": 1}), Config.of(tiles)):
            assert candidates.why_pruned(footprint, padded, config, candidates.target("sm_90")) is None
    assert "TMA" not in dict(rules.ATTN_BWD_FUSED.tuning_space)


@pytest.mark.parametrize("layout", ["sdpa-gqa", "packed-qkv", "sliced-heads"])
def test_tma_follows_the_callers_strides(layout, backward_tma):
    """The descriptors take the caller's strides: SDPA's (B, H, S, D) with GQA (the dK/dV
    descriptor's head stride is S * D), q, k, v viewed out of one packed (B, S, 3, H, D)
    tensor (row stride 3 * H * D), and every other head of a wider tensor."""
    torch.manual_seed(hash(layout) % 2**31)
    b, s, d = 2, 75, 32
    if layout == "sdpa-gqa":
        q = torch.randn(b, 6, s, d, dtype=torch.float16)
        k, v = (torch.randn(b, 2, s, d, dtype=torch.float16) for _ in range(2))

        def call(q, k, v):
            return aotattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend="split")
    elif layout == "packed-qkv":
        qkv = torch.randn(b, s, 3, 4, d, dtype=torch.float16)
        q, k, v = qkv.unbind(2)

        def call(q, k, v):
            return aotattn.flash_attn_func(q, k, v, causal=True, backend="split")
    else:
        wide = [torch.randn(b, s, 8, d, dtype=torch.float16) for _ in range(3)]
        q, k, v = (t[:, :, ::2] for t in wide)

        def call(q, k, v):
            return aotattn.flash_attn_func(q, k, v, window_size=(20, 3), backend="split")
    dout = torch.randn(q.shape, dtype=q.dtype)
    out0, plain = _split_grads(call, (q, k, v), dout, 0, backward_tma)
    out1, knobbed = _split_grads(call, (q, k, v), dout, 1, backward_tma)
    assert torch.equal(out0, out1)
    for a, b_ in zip(plain, knobbed):
        assert torch.isfinite(b_).all()
        assert torch.equal(a, b_)
