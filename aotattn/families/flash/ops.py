"""Public operators of the flash-attention family.

Data flows one way: public call -> checks (:mod:`.checks`) -> launch plan (functional,
configuration, grid, arguments) -> :func:`aotattn.runtime.launch`.
"""

from __future__ import annotations

import math

import torch

from aotattn.families.flash import rules
from aotattn.families.flash.checks import Problem, check_flash, check_sdpa
from aotattn.runtime import launch
from aotattn.spec import Config, Functional, LaunchPlan

LOG2E = 1.0 / math.log(2.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the operators hand to a kernel comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


def forward_functional(p: Problem) -> Functional:
    bucket = rules.head_dim_bucket(max(p.head_dim, p.head_dim_v))  # see rules._unequal_head_buckets
    return Functional.of({
        "dtype": rules.DTYPES[p.dtype],
        "BLOCK_D": bucket,
        "BLOCK_DV": bucket,
        "PAD_HEAD": p.head_dim != bucket or p.head_dim_v != bucket,
        "MASK": p.mask,
    })


def forward_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, p: Problem, config: Config | None = None) -> LaunchPlan:
    """Plan of the forward kernel on ``(B, S, H, D)`` views; ``lse`` is ``(B, Hq, Sq)``."""
    kernel = rules.ATTN_FWD
    functional = forward_functional(p)
    if config is None:
        config = rules.default_config(kernel, functional, q.device)
    left, right = p.kernel_window()
    grid = (_cdiv(p.seqlen_q, config["BLOCK_M"]), p.heads_q, p.batch)
    args = (
        q, k, v, out, lse,
        q.stride(0), q.stride(2), q.stride(1),
        k.stride(0), k.stride(2), k.stride(1),
        v.stride(0), v.stride(2), v.stride(1),
        out.stride(0), out.stride(2), out.stride(1),
        lse.stride(0), lse.stride(1),
        p.seqlen_q, p.seqlen_k, p.group_size, p.head_dim, p.head_dim_v,
        p.softmax_scale * LOG2E, left, right,
    )
    return LaunchPlan(kernel, functional, config, grid, args)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      p: Problem, config: Config | None = None) -> torch.Tensor:
    """Run the forward pass into ``out`` (a ``(B, Sq, Hq, Dv)`` view); returns the LSE."""
    lse = _empty((p.batch, p.heads_q, p.seqlen_q), torch.float32, q.device)
    launch(forward_plan(q, k, v, out, lse, p, config))
    return lse


def new_output(p: Problem, like: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """The output as a ``(B, Sq, Hq, Dv)`` view; ``heads_major`` stores it as ``(B, Hq, Sq, Dv)``."""
    if heads_major:
        return _empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim_v), like.dtype, like.device).transpose(1, 2)
    return _empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim_v), like.dtype, like.device)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, p, heads_major):
        out = new_output(p, q, heads_major)
        lse = attention_forward(q, k, v, out, p)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = p
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError("the backward pass of aotattn is not implemented yet")


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: Problem,
         heads_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _FlashAttention.apply(q, k, v, p, heads_major)
    out = new_output(p, q, heads_major)
    return out, attention_forward(q, k, v, out, p)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
                    return_lse: bool = False):
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
        return_lse: also return the log-sum-exp (natural log, fp32, ``(B, Hq, Sq)``).

    Returns:
        ``out (B, Sq, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    p = check_flash(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    window_size=window_size, diagonal=diagonal)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    out, lse = _run(q, k, v, p, heads_major=False)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
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

    Returns:
        ``(B, Hq, Sq, Dv)`` in query's dtype.
    """
    p = check_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                   scale=scale, enable_gqa=enable_gqa)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out, _ = _run(q, k, v, p, heads_major=True)
    return out.transpose(1, 2)
