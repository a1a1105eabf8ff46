"""Float64 reference of the attention contract (docs/semantics.md), in plain PyTorch.

Slow and memory-hungry (it materialises the Sq x Sk matrix), exact up to float64
rounding: the kernels are tested against it.
"""

from __future__ import annotations

import math

import torch


def visible(seqlen_q: int, seqlen_k: int, *, causal: bool = False,
            window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
            device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``(seqlen_q, seqlen_k)`` matrix: True where query row i sees key column j.

    Row i sees column j iff ``i + d - left <= j <= i + d + right`` with
    ``d = seqlen_k - seqlen_q`` on the bottom-right diagonal and 0 on the top-left one;
    -1 leaves a side unbounded and ``causal`` sets ``right = 0``.
    """
    left, right = window_size
    if causal:
        right = 0
    d = seqlen_k - seqlen_q if diagonal == "bottom_right" else 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i + d - left
    if right >= 0:
        keep &= j <= i + d + right
    return keep


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              softmax_scale: float | None = None, causal: bool = False,
              window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
              bias: torch.Tensor | None = None, dropout_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64 on flash-attn layouts.

    Args:
        q: ``(B, Sq, Hq, D)``; k: ``(B, Sk, Hk, D)``; v: ``(B, Sk, Hk, Dv)``, Hq a multiple of Hk.
        softmax_scale: multiplies ``q . k``; default ``1 / sqrt(D)``.
        causal, window_size, diagonal: the mask, as in :func:`visible`.
        bias: added to the scaled scores, broadcastable to ``(B, Hq, Sq, Sk)``.
        dropout_mask: boolean keep-mask broadcastable to ``(B, Hq, Sq, Sk)``; kept
            probabilities are divided by ``1 - dropout_p``.

    Returns:
        ``out (B, Sq, Hq, Dv)`` and ``lse (B, Hq, Sq)`` in float64. Rows that see no key
        give ``out = 0`` and ``lse = +inf``.
    """
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    _, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    group = heads_q // heads_k
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    keep = visible(seqlen_q, seqlen_k, causal=causal, window_size=window_size,
                   diagonal=diagonal, device=q.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    # rows that see no key (all -inf) get a finite stand-in so autograd stays NaN-free
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    safe = scores.masked_fill(empty, 0.0)
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)
    # softmax, not exp(s - lse): where every score of a row is near the float range's end
    # (a bias of torch.finfo(torch.float32).min), the lse rounds its log of the sum away
    probs = torch.softmax(safe, dim=-1).masked_fill(empty, 0.0)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(torch.float64) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    lse = torch.where(empty, float("inf"), lse).squeeze(-1)
    return out, lse


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, *, dropout_mask: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences, computed sequence by sequence with :func:`attention`.

    ``q (total_q, Hq, D)``; returns ``out (total_q, Hq, Dv)`` and ``lse (Hq, total_q)``.
    ``dropout_mask`` is ``(batch, Hq, max_seqlen_q, max_seqlen_k)``, as
    :func:`aotattn.dropout_mask` returns it.
    """
    outs, lses = [], []
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b, (q0, q1, k0, k1) in enumerate(zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:])):
        mask = None if dropout_mask is None else dropout_mask[b:b + 1, :, :q1 - q0, :k1 - k0]
        out, lse = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dropout_mask=mask, **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)
