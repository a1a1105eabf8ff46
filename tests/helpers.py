"""Helpers shared by the tests (imported, never taken from ``conftest``).

- devices and error norms: :data:`DEVICES`, :data:`TOLERANCE`, :func:`rel_err`;
- the rounding floor: float64 attention with only the roundings a flash kernel must make
  (:func:`floor_attention`), beside the exact float64 reference (:func:`exact_attention`)
  and the kernel's own results (:func:`kernel_attention`);
- an independent Philox4x32-10 in numpy (:func:`philox_first_word`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import aotattn
from aotattn import reference

HAS_CUDA = torch.cuda.is_available()

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# Relative error norms ||out - ref|| / ||ref|| against the float64 reference.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; NaN anywhere gives inf so it never passes."""
    out = out.to(torch.float64)
    ref = ref.to(torch.float64)
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| over the elements where ref is finite; NaN gives inf."""
    out = out.to(torch.float64)
    ref = ref.to(torch.float64)
    finite = torch.isfinite(ref)
    if torch.isnan(out).any() or not torch.equal(torch.isfinite(out), finite):
        return float("inf")
    if not finite.any():
        return 0.0
    return (out[finite] - ref[finite]).abs().max().item()


# ------------------------------------------------------------------ the rounding floor

QUANTITIES = ("out", "lse", "dq", "dk", "dv")
LN2, LOG2E = math.log(2.0), 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Results:
    """One attention call's results in flash-attn layouts; gradients None without dout.

    ``noise`` (the floor's only): per output and gradient, the expected norm of the error
    its roundings make (a rounding to nearest of x errs uniformly within half an ulp:
    variance ``ulp(x)^2 / 12``), the distribution the floor's own pattern is one draw from.
    ``parts``: the pieces of that error's variance that one number spreads over many
    elements (a pair's P or dS times a whole row of V, K, Q or dO; a row's delta), each
    as (variance, effective count of such numbers): they stray as that many draws do.
    """

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    noise: dict[str, float] = field(default_factory=dict)
    parts: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def get(self, name: str) -> torch.Tensor | None:
        return getattr(self, name)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to ``dtype`` (to nearest, ties to even) and widened back to float64."""
    return x.to(dtype).to(torch.float64)


def _rounding_variance(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ulp(x)^2 / 12 in ``dtype``: the variance of rounding x to nearest; 0 where x is
    representable (a row that sees one key has P = 1 and its output is V, exactly). On CPU
    tensors too: aotattn gives Triton's interpreter the GPU's float32 -> bfloat16 rounding
    (aotattn/runtime/interpreter.py; Triton 3.6's own truncated)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x)  # |x| in [2^(e-1), 2^e)
    ulp = info.eps * torch.clamp(torch.exp2(exponent.to(torch.float64) - 1), min=info.tiny)
    return torch.where(rounded(x, dtype) == x, 0.0, ulp.square() / 12)


def _by_key_head(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, Sk, Hq, D) summed over each key head's group of query heads: (B, Sk, Hk, D)."""
    b, s, hq, d = x.shape
    return x.reshape(b, s, heads_k, hq // heads_k, d).sum(3)


def _effective_count(weights: torch.Tensor) -> float:
    """How many equal independent draws spread like draws of these variances: (sum w)^2 / sum w^2."""
    total, squares = weights.sum().item(), torch.linalg.vector_norm(weights).item() ** 2  # no squared copy
    return total**2 / squares if squares > 0 else 1.0


def floor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None, *,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
                    dropout_mask: torch.Tensor | None = None, dropout_p: float = 0.0) -> Results:
    """Attention in float64 with only the roundings a flash kernel must make.

    The inputs are taken as given (already in their dtype). The products a kernel
    accumulates in fp32 are computed in fp32 here too (torch's fp32 matmul: the scores
    ``scale * Q K^T``, ``dP = dO V^T`` and ``delta = rowsum(dO * O)``, from the stored
    output); lse is held in fp32 (the saved log-sum-exp) and ``P`` is recomputed from it
    for the backward; ``P`` and ``dS = P (dP - delta)`` are rounded to the input dtype
    before their products (the tensor-core operands); every output is rounded to its
    dtype (the stores). All else (the exponentials, the sums over keys, the products
    with V, K and Q) is exact float64. A correct kernel's error is a small multiple of
    this floor's (its own accumulation order, ``exp2`` in the log2 domain and the online
    softmax's rescaling add the rest); a kernel with one more rounding, or a biased one,
    is not.

    With ``dropout_mask`` (the keep-mask, broadcastable to ``(B, Hq, Sq, Sk)``) the kept
    ``P`` is what is rounded before ``P V`` and ``dV``, and ``dP`` is masked and scaled by
    ``1 / (1 - dropout_p)``; the scale itself is taken as exact (the kernels apply it in
    fp32, on the sums).
    """
    dtype, fp32 = q.dtype, torch.float32
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    _, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    kk, vv = k64.repeat_interleave(group, 2), v64.repeat_interleave(group, 2)
    q32, k32, v32 = (t.detach().to(fp32) for t in (q, kk, vv))
    scores = (torch.einsum("bqhd,bkhd->bhqk", q32, k32) * scale).to(torch.float64)
    keep = reference.visible(seqlen_q, seqlen_k, causal=causal, window_size=window_size, diagonal=diagonal,
                             device=q.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    safe = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)
    p = torch.exp(safe - lse).masked_fill(empty, 0.0)
    if dropout_mask is None:
        z, keep_scale = 1.0, 1.0
    else:
        z, keep_scale = dropout_mask.to(torch.float64), 1.0 / (1.0 - dropout_p)
    out_unrounded = torch.einsum("bhqk,bkhd->bqhd", rounded(p * z, dtype), vv) * keep_scale
    out = rounded(out_unrounded, dtype)
    lse = rounded(torch.where(empty, float("inf"), lse), fp32)

    def variance(x: torch.Tensor) -> torch.Tensor:
        return _rounding_variance(x, dtype)

    noises: dict[str, float] = {}
    parts: dict[str, list[tuple[float, float]]] = {}

    def record(name: str, unrounded: torch.Tensor, elementwise: torch.Tensor, *shared: torch.Tensor) -> None:
        """The noise of ``name``: its store's rounding and ``elementwise`` variances, one per
        element, and each of ``shared``, one variance per number that errs across many."""
        pieces = [(w.sum().item(), _effective_count(w)) for w in shared]
        noises[name] = math.sqrt(variance(unrounded).sum().item() + elementwise.sum().item() + sum(v for v, _ in pieces))
        parts[name] = pieces

    # P's exponent is an fp32 number in the log2 domain: half an ulp of |s log2(e)| (and, in
    # the backward, of |lse log2(e)|) is an error of P that no rounding to the dtype shows;
    # so are the fp32 constant scale * log2(e) the scores are multiplied by, off by up to
    # u32 of itself (one error for the whole call, sized here as if drawn per element),
    # and the scores' own fp32 sums, which the kernel adds in another order than the fp32
    # product above (about u32 times the sum of |terms|, as for dP below). Only fp32
    # inputs see these: 16-bit ones round P itself 2^13 times more coarsely.
    u32 = torch.finfo(fp32).eps / 2
    finite = torch.where(keep, scores, 0.0)
    score_sums = torch.where(keep, torch.einsum("bqhd,bkhd->bhqk", q64.abs(), kk.abs()) * abs(scale), 0.0)
    exponent = (_rounding_variance(finite * LOG2E, fp32)
                + ((finite.square() + score_sums.square()) * (LOG2E * u32) ** 2) / 3) * LN2**2
    p_var = (variance(p * z) + (p * z).square() * exponent) * keep_scale**2

    def accumulated(terms: torch.Tensor) -> torch.Tensor:
        """The variance of a kernel's fp32 sum whose |terms| add up to ``terms``: about u32
        times that sum (as for dP below). The floor sums in float64; where the terms cancel
        (an fp32 dV of one key, its dO summing to 1e-3 of their magnitudes: 11x the floor
        in the long fuzz, 2026-12-05) this is all of a correct kernel's error."""
        return (terms * u32).square() / 3

    def per_key(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, D) -> squared norms (B, H, 1, S)
        return x.square().sum(-1).transpose(1, 2)[:, :, None, :]

    def per_query(x: torch.Tensor) -> torch.Tensor:  # (B, S, H, D) -> squared norms (B, H, S, 1)
        return x.square().sum(-1).transpose(1, 2)[..., None]

    # a pair's rounded P errs across its whole row of V
    record("out", out_unrounded, accumulated(torch.einsum("bhqk,bkhd->bqhd", p * z, vv.abs()) * keep_scale),
           p_var * per_key(vv))
    if dout is None:
        return Results(out, lse.squeeze(-1), noise=noises, parts=parts)
    do = dout.detach().to(torch.float64)
    p = torch.exp(safe - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0)  # from the stored lse
    dv = _by_key_head(torch.einsum("bhqk,bqhd->bkhd", rounded(p * z, dtype), do), heads_k) * keep_scale
    do32 = dout.detach().to(fp32)
    dp = torch.einsum("bqhd,bkhd->bhqk", do32, v32).to(torch.float64) * z * keep_scale
    delta = (do32 * out.to(fp32)).sum(-1).transpose(1, 2).to(torch.float64)  # (B, Hq, Sq)
    ds_unrounded = p * (dp - delta[..., None])
    ds = rounded(ds_unrounded, dtype)
    dq = scale * torch.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = scale * _by_key_head(torch.einsum("bhqk,bqhd->bkhd", ds, q64), heads_k)
    # dS_ij = P_ij (dP_ij - delta_i): P's exponent, dP's and delta's fp32 sums (about u32 times
    # the sum of |terms| each) and the output's rounding, through delta, all reach it
    # the saved lse is the forward's base-2 value times ln 2 and the backward's times log2(e):
    # two roundings at |lse log2(e)| (the fp32 store itself is in ``lse`` above)
    exponent = exponent + 2 * _rounding_variance(lse.masked_fill(empty, 0.0) * LOG2E, fp32) * LN2**2
    dp_sum = torch.einsum("bqhd,bkhd->bhqk", do.abs(), vv.abs()) * u32
    delta_sum = (do.abs() * out.abs()).sum(-1).transpose(1, 2)[..., None] * u32
    p2 = (variance(p * z) + (p * z).square() * exponent) * keep_scale**2
    ds2 = (variance(ds_unrounded) + ds_unrounded.square() * exponent
           + (p * z * keep_scale).square() * dp_sum.square() / 3) * scale**2
    # delta reads the stored output, so the forward's rounding of P reaches it too: an error e_k
    # of P_ik moves O_i by e_k V_k and delta_i by e_k (dO_i . V_k), comparable to the output's
    # own rounding where a row sees a few keys (unmodelled until 2026-12-07; that day's failing
    # fuzz example, dK of one query seeing two keys, moved from 2.2x to 2.04x the floor by it:
    # the rest was floor_error's count of elements)
    do_v = torch.einsum("bqhd,bkhd->bhqk", do, vv)
    delta2 = ((do.square() * variance(out_unrounded)).sum(-1).transpose(1, 2)[..., None]
              + (p_var * do_v.square()).sum(-1, keepdim=True) + delta_sum.square() / 3) * scale**2
    # a pair's P (dV) or dS (dQ, dK) errs across a whole row of dO, K or Q, and a row's delta
    # across every key and element it reaches: as many draws as pairs and rows, not elements
    dq_delta = (delta2.transpose(1, 2) * torch.einsum("bhqk,bkhd->bqhd", p, kk).square()).sum(-1)  # (B, Sq, Hq)
    dk_delta = delta2 * (p.square().sum(-1, keepdim=True) * per_query(q64))  # (B, Hq, Sq, 1)
    record("dv", dv, accumulated(torch.einsum("bhqk,bqhd->bkhd", p * z, do.abs()) * keep_scale), p2 * per_query(do))
    record("dq", dq, accumulated(abs(scale) * torch.einsum("bhqk,bkhd->bqhd", ds.abs(), kk.abs())),
           ds2 * per_key(kk), dq_delta)
    record("dk", dk, accumulated(abs(scale) * torch.einsum("bhqk,bqhd->bkhd", ds.abs(), q64.abs())),
           ds2 * per_query(q64), dk_delta)
    return Results(out, lse.squeeze(-1), rounded(dq, dtype), rounded(dk, dtype), rounded(dv, dtype), noises, parts)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None,
                    **mask) -> Results:
    """The float64 reference (:mod:`aotattn.reference`) and its autograd gradients."""
    inputs = [t.detach().to(torch.float64).requires_grad_(dout is not None) for t in (q, k, v)]
    with torch.enable_grad():
        out, lse = reference.attention(*inputs, **mask)
        if dout is None:
            return Results(out.detach(), lse.detach())
        dq, dk, dv = torch.autograd.grad(out, inputs, dout.to(torch.float64))
    return Results(out.detach(), lse.detach(), dq, dk, dv)


def kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None, *,
                     backend: str | None = None, deterministic: bool = False, **mask) -> Results:
    """aotattn's forward (and backward with ``dout``) on fresh leaves of q, k, v."""
    leaves = [t.detach().requires_grad_(dout is not None) for t in (q, k, v)]
    with torch.enable_grad():
        out, lse = aotattn.flash_attn_func(*leaves, return_lse=True, backend=backend,
                                           deterministic=deterministic, **mask)
        if dout is None:
            return Results(out.detach(), lse)
        dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return Results(out.detach(), lse, dq, dk, dv)


# ------------------------------------------------------------- checks against the floor

# Kernel error / floor error, normwise (the floor's error taken as at least its expected
# size, see floor_error). Measured at the CPU sizes of tests/adiffs/cases.py and on 1000
# random problems (shapes, masks, scales, magnitudes as tests/test_fuzz.py draws them):
# at most 1.3 in fp16, 1.8 in fp32 and 1.7 in bf16 on the CPU, when Triton's interpreter
# still converted fp32 to bf16 by truncation (aotattn now gives it the GPU's rounding to
# nearest: aotattn/runtime/interpreter.py). fp32 keeps a wider margin for the GPU's approximate exp2 (~2 ulp),
# which the floor does not model. SLACK covers quantities whose floor is 0. The fp32
# figure predates the floor's exponent terms for fp32 (the scores' sums and the
# scale * log2(e) constant, 2026-12-01): without them an fp32 problem at magnitude 4 with
# dropout 0.9 read dV at 3.6x the floor (median over 20 masks, up to 8.9); with them 1.1
# (up to 1.6). fp16 and bf16 floors are unchanged by those terms.
SLACK = 1e-6


def multiple(dtype: torch.dtype, device: str) -> float:
    """How many times the floor's error a kernel may make."""
    if dtype == torch.float16:
        return 2.0
    if dtype == torch.bfloat16:
        return 2.0
    return 4.0


def assert_empty_rows_exact(kernel: Results, exact: Results) -> None:
    """Rows that see no key: output 0, log-sum-exp +inf and dQ 0, exactly."""
    empty = torch.isinf(exact.lse)  # (B, Hq, Sq)
    assert torch.equal(torch.isinf(kernel.lse), empty), "rows with +inf log-sum-exp differ from the reference"
    assert torch.isposinf(kernel.lse[empty]).all(), "a row that sees no key has lse != +inf"
    rows = empty.transpose(1, 2)  # (B, Sq, Hq)
    assert (kernel.out[rows] == 0).all(), "a row that sees no key has a nonzero output"
    if kernel.dq is not None:
        assert (kernel.dq[rows] == 0).all(), "a row that sees no key has a nonzero dQ"


def assert_within_floor(kernel: Results, floor: Results, exact: Results, dtype: torch.dtype, device: str) -> None:
    """No NaN; rows that see no key exact; every quantity within :func:`multiple` x the floor's error."""
    for name in QUANTITIES:
        value = kernel.get(name)
        if value is not None:
            assert not torch.isnan(value).any(), f"{name}: NaN"
    assert_empty_rows_exact(kernel, exact)
    times = multiple(dtype, device)
    finite = torch.isfinite(exact.lse)
    lse_scale = 1.0 + (exact.lse[finite].abs().max().item() if finite.any() else 0.0)
    lse_err, lse_floor = max_abs_err(kernel.lse, exact.lse), max_abs_err(floor.lse, exact.lse)
    assert lse_err <= times * lse_floor + SLACK * lse_scale, \
        f"lse: max error {lse_err:.3e} > {times} x floor {lse_floor:.3e}"
    for name in ("out", "dq", "dk", "dv"):
        if kernel.get(name) is None:
            continue
        err, bound = rel_err(kernel.get(name), exact.get(name)), floor_error(floor, exact, name)
        assert err <= times * bound + SLACK, f"{name}: relative error {err:.3e} > {times} x floor {bound:.3e}"


def _spread(count: float) -> float:
    """How far a norm of ``count`` independent errors may stray above its expected size."""
    return 1.0 + 3.0 / math.sqrt(count)


def floor_error(floor: Results, exact: Results, name: str) -> float:
    """The floor's relative error, or its expected size if that is larger.

    One rounding pattern is one draw: on a handful of elements the floor can be lucky
    where the kernel is not. So the bound is at least the floor's expected rounding error
    (``Results.noise``), widened by ``3 / sqrt(n)`` for the n nonzero elements of the
    reference (the spread of a norm over n independent errors; the gradients of keys no
    query sees are exactly 0 and add no error); on large problems the two agree. Counting
    every element once made a dK of two nonzero rows among 91 keys fail at 2.04x
    (bf16, one query seeing two keys; the GPU's long fuzz, 2026-12-07). The pieces that
    one number carries over many elements (``Results.parts``: a pair's P or dS, a row's
    delta) spread as their own effective count instead: two queries, one seeing two keys,
    bf16, head dim 163 put all of dQ's 163 nonzero elements on one delta error, 2.25x a
    floor spread as 163 draws (the GPU's second long fuzz, same day; at seed 21 on CPU data
    dQ 2.18x and dK 2.40x, now 0.73x and 0.75x).
    """
    ref = exact.get(name)
    denom = ref.norm().item() or 1.0  # rel_err is absolute where the reference is 0
    n = max(int(torch.count_nonzero(ref)), 1)
    shared = floor.parts.get(name, [])
    rest = max(floor.noise[name] ** 2 - sum(v for v, _ in shared), 0.0)
    expected = math.sqrt(rest * _spread(n) ** 2 + sum(v * _spread(min(count, n)) ** 2 for v, count in shared)) / denom
    return max(rel_err(floor.get(name), ref), expected)


# ------------------------------------------------------------------------- Philox

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_LOW32 = np.uint64(0xFFFFFFFF)


def philox_words(seed: int, offset: int, idx: np.ndarray) -> list[np.ndarray]:
    """The four 32-bit words of Philox4x32-10 (Salmon et al., SC'11), key ``seed`` (64
    bits), counter ``(idx_lo, idx_hi, offset_lo, offset_hi)``, for an array of 64-bit ``idx``.

    Written from the paper's round function, independently of the kernels, so that a
    test can predict which elements a dropout call keeps without materialising its mask.
    """
    idx = np.asarray(idx, dtype=np.int64).astype(np.uint64)
    seed, offset = np.uint64(seed % 2**64), np.uint64(offset % 2**64)
    c = [idx & _LOW32, idx >> np.uint64(32), np.full_like(idx, offset & _LOW32), np.full_like(idx, offset >> np.uint64(32))]
    k0, k1 = seed & _LOW32, seed >> np.uint64(32)
    for _ in range(10):
        p0, p1 = c[0] * _PHILOX_M[0], c[2] * _PHILOX_M[1]  # 32 x 32 -> 64 bits, exact in uint64
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _LOW32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _LOW32]
        k0, k1 = (k0 + _PHILOX_W[0]) & _LOW32, (k1 + _PHILOX_W[1]) & _LOW32
    return c


def philox_first_word(seed: int, offset: int, idx: np.ndarray) -> np.ndarray:
    return philox_words(seed, offset, idx)[0]


def dropout_keeps(seed: int, offset: int, dropout_p: float, row: np.ndarray, col: np.ndarray,
                  seqlen_k: int) -> np.ndarray:
    """Whether a dropout call keeps element (row, col), by the documented mapping: with
    ``col = 32 g + 8 h + 2 p + a``, half ``a`` (0: low 16 bits, 1: high) of word ``h`` of
    Philox at counter ``row * 4 * ceil(seqlen_k / 32) + 4 g + p`` is at least
    ``round(dropout_p * 2**16)``, where ``row = (b * Hq + h) * max_seqlen_q + i`` and
    ``seqlen_k`` is ``max_seqlen_k``."""
    row, col = np.broadcast_arrays(np.asarray(row, dtype=np.int64), np.asarray(col, dtype=np.int64))
    g, h, p, a = col // 32, (col // 8) % 4, (col // 2) % 4, col % 2
    words = np.stack(philox_words(seed, offset, row * (4 * (-(-seqlen_k // 32))) + 4 * g + p))
    word = np.take_along_axis(words, h[None], 0)[0]
    draw = (word >> (16 * a).astype(np.uint64)) & np.uint64(0xFFFF)
    return draw >= np.uint64(min(round(dropout_p * 2**16), 2**16))