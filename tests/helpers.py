"""Helpers shared by the tests (imported, never taken from ``conftest``).

- devices and error norms: :data:`DEVICES`, :data:`TOLERANCE`, :func:`rel_err`;
- the rounding floor: float64 attention with only the roundings a flash kernel must make
  (:func:`floor_attention`), beside the exact float64 reference (:func:`exact_attention`)
  and the kernel's own results (:func:`kernel_attention`);
- an independent Philox4x32-10 in numpy (:func:`philox_first_word`);
- a kernel's positional arguments bound by name (:func:`bind`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Results:
    """One attention call's results in flash-attn layouts; gradients None without dout."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None

    def get(self, name: str) -> torch.Tensor | None:
        return getattr(self, name)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to ``dtype`` (to nearest, ties to even) and widened back to float64."""
    return x.to(dtype).to(torch.float64)


def _by_key_head(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, Sk, Hq, D) summed over each key head's group of query heads: (B, Sk, Hk, D)."""
    b, s, hq, d = x.shape
    return x.reshape(b, s, heads_k, hq // heads_k, d).sum(3)


def floor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None = None, *,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right") -> Results:
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
    out = rounded(torch.einsum("bhqk,bkhd->bqhd", rounded(p, dtype), vv), dtype)
    lse = rounded(torch.where(empty, float("inf"), lse), fp32)
    if dout is None:
        return Results(out, lse.squeeze(-1))
    do = dout.detach().to(torch.float64)
    p = torch.exp(safe - lse.masked_fill(empty, 0.0)).masked_fill(empty, 0.0)  # from the stored lse
    dv = rounded(_by_key_head(torch.einsum("bhqk,bqhd->bkhd", rounded(p, dtype), do), heads_k), dtype)
    do32 = dout.detach().to(fp32)
    dp = torch.einsum("bqhd,bkhd->bhqk", do32, v32).to(torch.float64)
    delta = (do32 * out.to(fp32)).sum(-1).transpose(1, 2).to(torch.float64)  # (B, Hq, Sq)
    ds = rounded(p * (dp - delta[..., None]), dtype)
    dq = rounded(scale * torch.einsum("bhqk,bkhd->bqhd", ds, kk), dtype)
    dk = rounded(scale * _by_key_head(torch.einsum("bhqk,bqhd->bkhd", ds, q64), heads_k), dtype)
    return Results(out, lse.squeeze(-1), dq, dk, dv)


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


# ------------------------------------------------------------------------- Philox

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_LOW32 = np.uint64(0xFFFFFFFF)


def philox_first_word(seed: int, offset: int, idx: np.ndarray) -> np.ndarray:
    """First 32-bit word of Philox4x32-10 (Salmon et al., SC'11), key ``seed`` (64 bits),
    counter ``(idx_lo, idx_hi, offset_lo, offset_hi)``, for an array of 64-bit ``idx``.

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
    return c[0]


# ----------------------------------------------------------- kernels launched directly


def bind(spec, **values) -> tuple:
    """A kernel's runtime arguments in its declaration's order, given by name.

    Missing or extra names raise, so a test that launches a kernel directly states what
    each argument is and cannot drift from the declaration (``aotattn.spec.KernelSpec``).
    """
    names = [a.name for a in spec.arguments]
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in names]
    if missing or extra:
        raise TypeError(f"{spec.name}: missing arguments {missing}, unknown arguments {extra}")
    return tuple(values[n] for n in names)
