"""The flash operators as ``torch.library`` custom ops, for ``torch.compile``.

Eager calls take the direct path of :mod:`.ops` (its plan cache is what the measured
host time per call rests on). Under ``torch.compile`` the public functions, having
validated the call while Dynamo traces them, call ``torch.ops.aotattn.flash_fwd``
instead: one opaque node with a shape-only fake, differentiable through
``flash_bwd``, rather than a graph break on data pointers and driver calls. Both ops
run the same planning as the eager path (:func:`.planning.run_forward`,
:func:`.planning.run_backward`).

Varlen calls pass their offsets as tensors, and a scale or dropout probability given as
a float argument of a function traced with ``dynamic=True`` is symbolic: their values
are checked (on the host) when the op runs, since a trace cannot read them.
"""

from __future__ import annotations

import torch

from aotattn.families.flash import planning
from aotattn.families.flash.checks import Problem, check_dropout, check_offsets, check_scale


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
             max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, mask: int, window_left: int,
             window_right: int, dropout_p: float) -> Problem:
    """The validated problem again, from the op's arguments: q ``(B, Sq, Hq, D)``, or
    ``(total_q, Hq, D)`` with offsets. Shapes only: the fakes use it too."""
    scalars = dict(dtype=q.dtype, softmax_scale=softmax_scale, mask=mask, window_left=window_left,
                   window_right=window_right, dropout_p=dropout_p)
    if cu_seqlens_q is not None:
        return Problem(cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2],
                       v.shape[2], varlen=True, **scalars)
    batch, seqlen_q, heads_q, head_dim = q.shape
    return Problem(batch, seqlen_q, k.shape[1], heads_q, k.shape[2], head_dim, v.shape[-1], **scalars)


@torch.library.custom_op("aotattn::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
              cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
              max_seqlen_k: int, softmax_scale: float, mask: int, window_left: int, window_right: int,
              dropout_p: float, heads_major: bool, backend: str | None,
              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, rng): rng holds the dropout (seed, offset) the backward replays.

    ``max_seqlen_*`` are read only with offsets (varlen). ``backend`` and
    ``deterministic`` are the backward's, carried to it."""
    if cu_seqlens_q is not None:
        check_offsets(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    softmax_scale = check_scale("softmax_scale", softmax_scale, q.shape[-1])
    dropout_p = check_dropout("dropout_p", dropout_p)
    p = _problem(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask, window_left, window_right,
                 dropout_p)
    (q, k, v), _ = planning.servable(p, q, k, v)
    c = planning.new_call(p, q, k, v, bias, cu_seqlens_q, cu_seqlens_k, bias_grad=False)
    out = planning.new_output(p, q, heads_major)
    lse = planning.run_forward(c, q, k, v, out)
    return out, lse, torch.tensor([c.seed, c.offset], dtype=torch.int64)


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, mask,
                    window_left, window_right, dropout_p, heads_major, backend, deterministic):
    p = _problem(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask, window_left, window_right,
                 dropout_p)
    lse = q.new_empty(planning.lse_shape(p, q), dtype=torch.float32)
    return planning.new_output(p, q, heads_major), lse, torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("aotattn::flash_bwd", mutates_args=())
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, bias: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
              cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int, rng: torch.Tensor,
              softmax_scale: float, mask: int, window_left: int, window_right: int, dropout_p: float,
              bias_grad: bool, backend: str | None,
              deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias); dbias is ``(B, Hq, Sq, Sk)`` in the bias's dtype, or empty
    when ``bias_grad`` is False."""
    p = _problem(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask, window_left, window_right,
                 dropout_p)
    seed, offset = rng.tolist()
    (q, k, v), _ = planning.servable(p, q, k, v)  # copies as the forward's, gradients of the same shapes
    c = planning.new_call(p, q, k, v, bias, cu_seqlens_q, cu_seqlens_k, bias_grad=bias_grad, rng=(seed, offset))
    dq, dk, dv, dbias = planning.run_backward(c, dout, q, k, v, out, lse, backend, deterministic)
    dbias = q.new_empty(0) if dbias is None else dbias.to(bias.dtype)
    return dq, dk, dv, dbias


@flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rng,
                    softmax_scale, mask, window_left, window_right, dropout_p, bias_grad, backend, deterministic):
    if bias_grad:
        batch, seqlen_q, heads_q, _ = q.shape
        dbias = q.new_empty((batch, heads_q, seqlen_q, k.shape[1]), dtype=bias.dtype)
    else:
        dbias = q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *scalars, _, backend, deterministic = inputs
    out, lse, rng = output
    ctx.mark_non_differentiable(lse, rng)  # as in eager calls (ops.py): no gradient flows through lse
    ctx.save_for_backward(q, k, v, out, lse, bias, cu_seqlens_q, cu_seqlens_k, rng)
    ctx.max_seqlens = max_seqlen_q, max_seqlen_k
    ctx.scalars = scalars  # softmax_scale, mask, window_left, window_right, dropout_p
    ctx.backend, ctx.deterministic = backend, deterministic


def _backward(ctx, dout, _dlse, _drng):
    q, k, v, out, lse, bias, cu_seqlens_q, cu_seqlens_k, rng = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = flash_bwd(dout, q, k, v, out, lse, bias, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens, rng,
                                  *ctx.scalars, bias_grad, ctx.backend, ctx.deterministic)
    return (dq, dk, dv, dbias if bias_grad else None) + (None,) * 12


flash_fwd.register_autograd(_backward, setup_context=_setup_context)
