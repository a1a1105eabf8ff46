"""Public operators of the flash-attention family.

Data flows one way: public call -> checks (:mod:`.checks`) -> launch plan (functional,
configuration, grid, arguments) -> :func:`aotattn.runtime.launch`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from aotattn.families.flash import rules
from aotattn.families.flash.checks import Problem, check_bool, check_flash, check_sdpa
from aotattn.runtime import launch
from aotattn.spec import Config, Functional, KernelSpec, LaunchPlan

LOG2E = 1.0 / math.log(2.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the operators hand to a kernel comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _bshd_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B, S, H, D) view."""
    return t.stride(0), t.stride(2), t.stride(1)


def attention_functional(p: Problem) -> Functional:
    """The compile-time choices shared by the forward and backward attention kernels."""
    bucket = rules.head_dim_bucket(max(p.head_dim, p.head_dim_v))  # see rules._unequal_head_buckets
    return Functional.of({
        "dtype": rules.DTYPES[p.dtype],
        "BLOCK_D": bucket,
        "BLOCK_DV": bucket,
        "PAD_HEAD": p.head_dim != bucket or p.head_dim_v != bucket,
        "MASK": p.mask,
    })


def _plan(kernel: KernelSpec, functional: Functional, device: torch.device, config: Config | None,
          grid: Callable[[Config], tuple[int, int, int]], args: tuple) -> LaunchPlan:
    if config is None:
        config = rules.default_config(kernel, functional, device)
    return LaunchPlan(kernel, functional, config, grid(config), args)


def _scalars(p: Problem) -> tuple:
    left, right = p.kernel_window()
    return (p.seqlen_q, p.seqlen_k, p.group_size, p.head_dim, p.head_dim_v,
            p.softmax_scale, p.softmax_scale * LOG2E, left, right)


def forward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, p: Problem, config: Config | None = None) -> LaunchPlan:
    """Plan of the forward kernel on ``(B, S, H, D)`` views; ``lse`` is ``(B, Hq, Sq)``."""
    left, right = p.kernel_window()
    args = (q, k, v, out, lse, *_bshd_strides(q), *_bshd_strides(k), *_bshd_strides(v),
            *_bshd_strides(out), lse.stride(0), lse.stride(1),
            p.seqlen_q, p.seqlen_k, p.group_size, p.head_dim, p.head_dim_v,
            p.softmax_scale * LOG2E, left, right)
    return _plan(rules.ATTN_FWD, attention_functional(p), q.device, config,
                 lambda c: (_cdiv(p.seqlen_q, c["BLOCK_M"]), p.heads_q, p.batch), args)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      p: Problem, config: Config | None = None) -> torch.Tensor:
    """Run the forward pass into ``out`` (a ``(B, Sq, Hq, Dv)`` view); returns the LSE."""
    lse = _empty((p.batch, p.heads_q, p.seqlen_q), torch.float32, q.device)
    launch(forward_plan(q, k, v, out, lse, p, config))
    return lse


def backward_plans(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor, p: Problem, backend: str, deterministic: bool,
                   configs: Mapping[str, Config] | None = None) -> list[LaunchPlan]:
    """The launches of one backward pass, in order: preprocess, then the backend's kernels.

    With ``backend="fused"`` and not ``deterministic``, ``dq`` must be a zeroed fp32
    buffer that the kernel accumulates into with atomics.
    """
    configs = configs or {}
    f = attention_functional(p)
    dev = q.device
    lse_strides = (lse.stride(0), lse.stride(1))
    pre_f = Functional.of({"dtype": f["dtype"], "BLOCK_DV": f["BLOCK_DV"],
                           "PAD_HEAD": p.head_dim_v != f["BLOCK_DV"]})
    plans = [_plan(rules.ATTN_BWD_PREPROCESS, pre_f, dev, configs.get("attn_bwd_preprocess"),
                   lambda c: (_cdiv(p.seqlen_q, c["BLOCK_M"]), p.heads_q, p.batch),
                   (out, dout, delta, *_bshd_strides(out), *_bshd_strides(dout), *lse_strides,
                    p.seqlen_q, p.head_dim_v))]
    inputs = (*_bshd_strides(q), *_bshd_strides(k), *_bshd_strides(v), *_bshd_strides(dout))
    dkdv_strides = (*_bshd_strides(dk), *_bshd_strides(dv))
    if backend == "split":
        plans.append(_plan(rules.ATTN_BWD_DKDV, f, dev, configs.get("attn_bwd_dkdv"),
                           lambda c: (_cdiv(p.seqlen_k, c["BLOCK_N"]), p.heads_k, p.batch),
                           (q, k, v, dout, dk, dv, lse, delta, *inputs, *dkdv_strides, *lse_strides,
                            *_scalars(p))))
        plans.append(_plan(rules.ATTN_BWD_DQ, f, dev, configs.get("attn_bwd_dq"),
                           lambda c: (_cdiv(p.seqlen_q, c["BLOCK_M"]), p.heads_q, p.batch),
                           (q, k, v, dout, dq, lse, delta, *inputs, *_bshd_strides(dq), *lse_strides,
                            *_scalars(p))))
    elif backend == "fused":
        fused_f = Functional.of({**f.as_dict(), "ATOMIC_DQ": not deterministic})

        def grid(c: Config) -> tuple[int, int, int]:
            programs = _cdiv(p.seqlen_k, c["BLOCK_N"])
            if deterministic:
                programs += p.group_size * _cdiv(p.seqlen_q, c["BLOCK_M"])
            return programs, p.heads_k, p.batch

        plans.append(_plan(rules.ATTN_BWD_FUSED, fused_f, dev, configs.get("attn_bwd_fused"), grid,
                           (q, k, v, dout, dq, dk, dv, lse, delta, *inputs, *_bshd_strides(dq),
                            *dkdv_strides, *lse_strides, *_scalars(p))))
    else:
        raise ValueError(f"backend: expected one of {rules.BACKENDS} or None, got {backend!r}")
    return plans


def choose_backend(p: Problem, deterministic: bool) -> str:
    """The backend when the caller names none (until the tuning database decides).

    On the H200 the split backend beat fused-with-atomics at every benchmark shape
    (benchmarks/RESULTS.md, 2026-11-29): fp32 atomics on dQ cost more than the two
    extra matrix products the split dQ kernel recomputes.
    """
    return "split"


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, p: Problem, backend: str | None,
                       deterministic: bool, configs: Mapping[str, Config] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (``(B, S, H, D)``, contiguous) from the upstream gradient ``dout``."""
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    backend = backend or choose_backend(p, deterministic)
    dev = q.device
    dk = _empty(tuple(k.shape), k.dtype, dev)
    dv = _empty(tuple(v.shape), v.dtype, dev)
    delta = _empty((p.batch, p.heads_q, p.seqlen_q), torch.float32, dev)
    atomic = backend == "fused" and not deterministic
    dq = (torch.zeros(tuple(q.shape), dtype=torch.float32, device=dev) if atomic
          else _empty(tuple(q.shape), q.dtype, dev))
    for plan in backward_plans(dout, q, k, v, out, lse, delta, dq, dk, dv, p, backend, deterministic, configs):
        launch(plan)
    return (dq.to(q.dtype) if atomic else dq), dk, dv


def new_output(p: Problem, like: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """The output as a ``(B, Sq, Hq, Dv)`` view; ``heads_major`` stores it as ``(B, Hq, Sq, Dv)``."""
    if heads_major:
        return _empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim_v), like.dtype, like.device).transpose(1, 2)
    return _empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim_v), like.dtype, like.device)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p, heads_major, backend, deterministic):
        out = new_output(p, q, heads_major)
        lse = attention_forward(q, k, v, out, p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = p
        ctx.backend = backend
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.problem, ctx.backend, ctx.deterministic)
        return dq, dk, dv, None, None, None, None


def _check_backend(backend: object) -> str | None:
    if backend is not None and backend not in rules.BACKENDS:
        raise ValueError(f"backend: expected one of {rules.BACKENDS} or None, got {backend!r}")
    return backend


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem, heads_major: bool,
         backend: str | None, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _FlashAttention.apply(q, k, v, p, heads_major, backend, deterministic)
    out = new_output(p, q, heads_major)
    return out, attention_forward(q, k, v, out, p)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
                    deterministic: bool = False, return_lse: bool = False, *, backend: str | None = None):
    """Attention on flash-attn layouts.

    Query row i sees key column j iff ``i + d - left <= j <= i + d + right``, where
    ``(left, right) = window_size`` (-1: unbounded) and ``d = Sk - Sq`` for
    ``diagonal="bottom_right"`` (flash-attn's alignment, the default) or 0 for
    ``"top_left"`` (PyTorch's). ``causal=True`` sets ``right = 0``. With Sq = 5, Sk = 7,
    causal, bottom-right (``x`` attends)::

        x x x . . . .
        x x x x . . .
        x x x x x . .
        x x x x x x .
        x x x x x x x

    Rows that see no key give output 0 and log-sum-exp ``+inf``.

    Args:
        q: ``(B, Sq, Hq, D)``, float16, bfloat16 or float32.
        k: ``(B, Sk, Hk, D)``, Hq a multiple of Hk (GQA/MQA).
        v: ``(B, Sk, Hk, Dv)``. D and Dv are any of 1..256. Any strides with a unit
            last-dim stride are used without a copy.
        dropout_p: must be 0.0 for now.
        softmax_scale: multiplies ``q . k`` before the softmax; default ``1/sqrt(D)``.
            Any finite value, zero and negative included.
        causal: ``right = 0`` on the chosen diagonal.
        window_size: ``(left, right)``; -1 leaves a side unbounded.
        diagonal: ``"bottom_right"`` or ``"top_left"``.
        deterministic: bitwise reproducible gradients (no atomics in the backward pass).
            Also on when ``torch.use_deterministic_algorithms(True)`` is in effect.
        return_lse: also return the log-sum-exp (natural log, fp32, ``(B, Hq, Sq)``).
        backend: the backward pass: ``"split"`` (a dK/dV kernel, then a dQ kernel),
            ``"fused"`` (one launch) or None to let aotattn choose. For tests and
            measurement; both compute the same gradients.

    Returns:
        ``out (B, Sq, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    p = check_flash(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    window_size=window_size, diagonal=diagonal)
    return_lse = check_bool("return_lse", return_lse)
    deterministic = check_bool("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    out, lse = _run(q, k, v, p, False, _check_backend(backend), deterministic)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, deterministic: bool = False,
                                 backend: str | None = None) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention`.

    PyTorch semantics: ``is_causal`` keeps key j for query i iff ``j <= i`` (top-left
    diagonal), whatever the lengths; rows that see no key give 0.

    Args:
        query: ``(B, Hq, Sq, D)``; key: ``(B, Hk, Sk, D)``; value: ``(B, Hk, Sk, Dv)``.
            Hk must equal Hq unless ``enable_gqa``.
        attn_mask: must be None for now.
        dropout_p: must be 0.0 for now.
        is_causal: top-left causal mask.
        scale: default ``1/sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hk.
        deterministic, backend: as in :func:`flash_attn_func` (aotattn's additions).

    Returns:
        ``(B, Hq, Sq, Dv)`` in query's dtype.
    """
    p = check_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                   scale=scale, enable_gqa=enable_gqa)
    deterministic = check_bool("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, _ = _run(q, k, v, p, True, _check_backend(backend), deterministic)
    return out.transpose(1, 2)
