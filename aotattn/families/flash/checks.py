"""Argument checks of the public operators: the one place where input is validated.

Every problem is a ``TypeError`` or ``ValueError`` that names the argument and says what
was expected and what came.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

from aotattn.errors import type_name
from aotattn.families.flash.rules import (BACKENDS, DTYPES, MASK_BOTTOM_RIGHT, MASK_NONE, MASK_TOP_LEFT,
                                          MAX_HEAD_DIM)

DIAGONALS = ("bottom_right", "top_left")


@dataclass(frozen=True)
class Problem:
    """A validated attention call, in flash-attn terms (``q (B, Sq, Hq, D)``)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    softmax_scale: float
    mask: int  # MASK_NONE, MASK_TOP_LEFT or MASK_BOTTOM_RIGHT
    window_left: int  # -1: unbounded
    window_right: int  # -1: unbounded
    dropout_p: float = 0.0
    varlen: bool = False  # batch = number of sequences, seqlen_q/k = the longest

    @property
    def group_size(self) -> int:
        """Query heads per key/value head; 1 for a call with no heads (an empty result)."""
        return self.heads_q // self.heads_k if self.heads_k else 1

    @property
    def tuning_sizes(self) -> dict[str, int]:
        """The lengths the tuning tables are looked up at.

        The sequence lengths, except under a window bounded on both sides (causal with a
        left bound included) narrower than the keys: every program then loops over at most
        ``left + right + 1`` keys (or queries), however long the sequences, so its tiles
        are those of a causal call of that span (the tuned cells are full and causal
        ones); the sequences' length only adds programs.
        """
        span = self.window_left + self.window_right + 1
        if self.window_left < 0 or self.window_right < 0 or span >= self.seqlen_k:
            return {"seqlen_q": self.seqlen_q, "seqlen_k": self.seqlen_k}
        return {"seqlen_q": min(self.seqlen_q, span), "seqlen_k": span}

    def kernel_window(self) -> tuple[int, int]:
        """Window sides for the kernels: unbounded (or wider than useful) becomes Sq + Sk."""
        wide = self.seqlen_q + self.seqlen_k
        left = wide if self.window_left < 0 else min(self.window_left, wide)
        right = wide if self.window_right < 0 else min(self.window_right, wide)
        return left, right


def check_tensor(name: str, t: object) -> torch.Tensor:
    """A plain dense tensor: not a sparse or nested one (a strided nested tensor reports the
    strided layout, and PyTorch raised an internal error at its first shape read), nor one
    of a ``torch.func`` transform (:func:`check_untransformed`)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type_name(t)}")
    if t.is_nested:
        raise ValueError(f"{name}: expected a dense tensor, got a nested tensor (pack its sequences for "
                         "flash_attn_varlen_func, or pad them and pass an attn_mask)")
    if t.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    check_untransformed(name, t)
    return t


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (one module global read)."""
    return forward_ad._current_level >= 0


def check_untransformed(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor of a ``torch.func`` transform (vmap's batched tensors, grad's and
    jacrev's wrappers): it has no storage, and the kernels read data pointers (without
    this, torch raised "Cannot access data pointer of Tensor that doesn't have storage").
    Not while Dynamo traces (it cannot trace the test; its graphs hold no such tensors).

    Refuse a dual tensor of forward-mode AD too: the operators have no JVP rule, and
    without this its tangent was silently dropped (the output had none)."""
    if torch.compiler.is_compiling():
        return
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        raise ValueError(f"{name}: expected a plain tensor, got one wrapped by a torch.func transform (vmap, grad, "
                         "jacrev, ...), which aotattn's operators do not support; loop over the batch instead of "
                         "vmap, use torch.autograd.grad instead of torch.func.grad")
    if forward_ad_active() and forward_ad.unpack_dual(t).tangent is not None:
        raise ValueError(f"{name}: expected a plain tensor, got a dual tensor of forward-mode AD (make_dual), which "
                         "aotattn's operators do not support (no JVP rule); use reverse mode: backward() or "
                         "torch.autograd.grad")


def check_tensors(names: tuple[str, str, str], q: object, k: object, v: object, layout: str, rank: int = 4) -> None:
    """Types, ranks, dtypes, devices and strides shared by every operator."""
    tensors = [check_tensor(n, t) for n, t in zip(names, (q, k, v))]
    for name, t in zip(names, tensors):
        if t.dim() != rank:
            raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {tuple(t.shape)}")
    qn = names[0]
    if tensors[0].dtype not in DTYPES:
        raise TypeError(f"{qn}: expected dtype float16, bfloat16 or float32, got {tensors[0].dtype}")
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != tensors[0].dtype:
            raise TypeError(f"{name}: expected dtype {tensors[0].dtype} (the dtype of {qn}), got {t.dtype}")
        if t.device != tensors[0].device:
            raise ValueError(f"{name}: expected device {tensors[0].device} (the device of {qn}), got {t.device}")
    if tensors[0].device.type not in ("cpu", "cuda", "meta"):  # meta: shapes only (ops._attend)
        raise ValueError(f"{qn}: expected a CUDA, CPU or meta tensor, got device {tensors[0].device}")
    for name, t in zip(names, tensors):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride in the last dimension, got strides {t.stride()} "
                             f"(pass {name}.contiguous())")


# the largest |softmax_scale| whose product with log2(e), the kernels' factor, is finite in float32
MAX_SCALE = 2.35e38
# built once: under torch.compile(dynamic=True) Dynamo cannot trace a float format on every call
_SCALE_RANGE = f"a magnitude up to {MAX_SCALE:.3g}"


def _scalar(value: object) -> object:
    """A 0-d real tensor as its Python number, as PyTorch's float arguments take one (SDPA's
    ``scale`` and ``dropout_p``); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        return value.item()
    return value


def _real(name: str, value: numbers.Real, expected: str) -> float:
    """``value`` as a float; an int or fraction too large for one is refused as out of range."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}: expected {expected}, got a number beyond the float range") from None


def check_scale(name: str, scale: object, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` for None, else a finite float. While
    ``torch.compile`` traces, the value is not checked here: a float argument of a function
    traced with ``dynamic=True`` is symbolic, and a trace cannot read it. The custom op
    checks it when it runs (:mod:`.custom_ops`), naming it ``softmax_scale``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = _scalar(scale)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name}: expected a real number or None, got {type_name(scale)}")
    value = _real(name, scale, _SCALE_RANGE)
    if torch.compiler.is_compiling():
        return value
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {scale}")
    if abs(value) > MAX_SCALE:
        raise ValueError(f"{name}: expected {_SCALE_RANGE} (the kernels scale by scale * log2(e) in float32), "
                         f"got {scale}")
    return value


def check_dropout(name: str, dropout_p: object) -> float:
    """``dropout_p`` as a float in [0, 1). While ``torch.compile`` traces, the range is
    checked when the custom op runs, as :func:`check_scale`'s value (a symbolic float
    cannot be put in the message)."""
    dropout_p = _scalar(dropout_p)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name}: expected a float in [0, 1), got {type_name(dropout_p)}")
    value = _real(name, dropout_p, "a float in [0, 1)")
    if torch.compiler.is_compiling():
        return value
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: expected a float in [0, 1), got {dropout_p}")
    return value


def check_bias(name: str, bias: object, p: Problem, like: torch.Tensor, sdpa_mask: bool = False) -> torch.Tensor | None:
    """An additive bias as a (B, Hq, Sq, Sk) view in q's dtype (broadcast dimensions stride 0).

    ``sdpa_mask``: PyTorch's ``attn_mask`` convention, where a boolean mask keeps True.
    """
    if bias is None:
        return None
    bias = check_tensor(name, bias)
    if bias.device != like.device:
        raise ValueError(f"{name}: expected device {like.device} (the device of the inputs), got {bias.device}")
    if bias.dtype == torch.bool and sdpa_mask:
        bias = torch.zeros(bias.shape, dtype=like.dtype, device=like.device).masked_fill_(~bias, float("-inf"))
    elif not bias.dtype.is_floating_point or bias.dtype == torch.float64:
        allowed = "float16, bfloat16, float32" + (" or bool" if sdpa_mask else "")
        raise TypeError(f"{name}: expected dtype {allowed}, got {bias.dtype}")
    full = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
    try:
        shape = torch.broadcast_shapes(bias.shape, full)
    except RuntimeError:
        shape = None
    if bias.dim() > 4 or shape != full:
        raise ValueError(f"{name}: expected a shape broadcastable to (B, Hq, Sq, Sk) = {full}, "
                         f"got {tuple(bias.shape)}")
    return bias.to(like.dtype).expand(full)


def check_backend(backend: object) -> str | None:
    """The backward backend a caller forces: one of ``BACKENDS``, or None to let aotattn choose."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS} or None, got {backend!r}")
    return backend


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type_name(value)}")
    return value


def check_flash_attn_extras(softcap: object, alibi_slopes: object, return_attn_probs: object, dropout_p: float,
                            block_table: object = None) -> bool:
    """flash-attn's arguments that aotattn does not implement take their defaults (each
    refusal says what to do instead); ``return_attn_probs`` is checked and returned: without
    dropout flash-attn returns no probabilities (``S_dmask`` None), and neither does aotattn."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float, got {type_name(softcap)}")
    if softcap != 0:
        shown = "a nonzero value" if torch.compiler.is_compiling() else softcap  # a symbolic float cannot be shown
        raise ValueError(f"softcap: expected 0.0, got {shown} (aotattn has no logit soft-capping: use "
                         f"flash-attn or PyTorch's flex_attention for it)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: expected None (aotattn has no ALiBi slopes: pass the ALiBi bias, "
                         "-slope * |i + Sk - Sq - j| per head, as bias=)")
    if block_table is not None:
        raise ValueError("block_table: expected None (aotattn has no paged KV cache)")
    return_attn_probs = check_bool("return_attn_probs", return_attn_probs)
    if return_attn_probs and dropout_p > 0.0:
        raise ValueError("return_attn_probs: aotattn returns no attention probabilities; with dropout, "
                         "aotattn.dropout_mask(...) returns the keep-mask a call used (docs/semantics.md, Dropout)")
    return return_attn_probs


def check_window(window_size: object) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: expected sizes >= 0, or -1 for unbounded, got {(left, right)}")
    return left, right


# Sequence lengths (and max_seqlen_q/k) are int32 arguments of the kernels, which round them
# up to whole blocks (``(seqlen + BLOCK - 1) // BLOCK``) and index a block past a row: the
# limit leaves 2**16 below 2**31 for that arithmetic.
MAX_SEQLEN = 2**31 - 2**16


def check_seqlen(name: str, seqlen: int) -> None:
    """Past the limit (rows of stride 0 reach it: ``expand``) the GPU launch failed packing
    the length or its block count wrapped, and the interpreter ran without end."""
    if seqlen > MAX_SEQLEN:
        raise ValueError(f"{name}: expected a sequence length of at most {MAX_SEQLEN} (2**31 - 2**16: int32 "
                         f"block arithmetic in the kernels), got {seqlen}")


def check_shapes(names: tuple[str, str, str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 batch_dim: int, seq_dim: int, heads_axis: int) -> tuple[int, ...]:
    """Shape agreement; returns (B, Sq, Sk, Hq, Hk, D, Dv)."""
    qn, kn, vn = names
    batch = q.shape[batch_dim]
    for name, t in ((kn, k), (vn, v)):
        if t.shape[batch_dim] != batch:
            raise ValueError(f"{name}: expected batch size {batch} (that of {qn}), got {t.shape[batch_dim]}")
    if v.shape[seq_dim] != k.shape[seq_dim]:
        raise ValueError(f"{vn}: expected sequence length {k.shape[seq_dim]} (that of {kn}), got {v.shape[seq_dim]}")
    if v.shape[heads_axis] != k.shape[heads_axis]:
        raise ValueError(f"{vn}: expected {k.shape[heads_axis]} heads (those of {kn}), got {v.shape[heads_axis]}")
    heads_q, heads_k = q.shape[heads_axis], k.shape[heads_axis]
    if heads_k == 0 and heads_q > 0:
        raise ValueError(f"{kn}: expected at least one head, got 0")
    if heads_k > 0 and heads_q % heads_k != 0:
        raise ValueError(f"{qn}: expected a number of heads that is a multiple of {kn}'s {heads_k}, got {heads_q}")
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{kn}: expected head dim {head_dim} (that of {qn}), got {k.shape[-1]}")
    for name, d in ((qn, head_dim), (vn, head_dim_v)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim in 1..{MAX_HEAD_DIM}, got {d}")
    check_seqlen(qn, q.shape[seq_dim])
    check_seqlen(kn, k.shape[seq_dim])
    check_grid(qn, batch, heads_q, q.device)
    return batch, q.shape[seq_dim], k.shape[seq_dim], heads_q, heads_k, head_dim, head_dim_v


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z sizes: the kernels' heads and sequences


def check_grid(qn: str, batch: int, heads: int, device: torch.device) -> None:
    """Sequences and query heads within CUDA's grid limits on a CUDA device (the kernels'
    grids are (blocks, heads, sequences); past the limit the launch failed with the driver's
    CUDA_ERROR_INVALID_VALUE). The interpreter has no such limit."""
    if device.type != "cuda":
        return
    for what, n in (("sequences (batch size)", batch), ("heads", heads)):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{qn}: expected at most {MAX_GRID_YZ} {what} on a CUDA device (a grid dimension of the "
                             f"kernels), got {n}: split the call")
    if batch * heads > 2**31 - 1:  # the kernels number (sequence, head) pairs in int32
        raise ValueError(f"{qn}: expected at most 2**31 - 1 (sequence, head) pairs on a CUDA device (int32 in the "
                         f"kernels), got {batch} x {heads}: split the call")


def mask_mode(causal: bool, window: tuple[int, int], diagonal: str) -> tuple[int, int, int]:
    """(MASK, left, right): causal is a window with right = 0 on the chosen diagonal."""
    left, right = window
    if causal:
        right = 0
    if left < 0 and right < 0:
        return MASK_NONE, -1, -1
    return (MASK_BOTTOM_RIGHT if diagonal == "bottom_right" else MASK_TOP_LEFT), left, right


def check_flash(q: object, k: object, v: object, *, dropout_p: object, softmax_scale: object,
                causal: object, window_size: object, diagonal: object) -> Problem:
    """Checks of :func:`aotattn.flash_attn_func` (``q (B, Sq, Hq, D)``)."""
    names = ("q", "k", "v")
    check_tensors(names, q, k, v, "(batch, seqlen, heads, head_dim)")
    dims = check_shapes(names, q, k, v, batch_dim=0, seq_dim=1, heads_axis=2)
    dropout_p = check_dropout("dropout_p", dropout_p)
    causal = check_bool("causal", causal)
    window = check_window(window_size)
    if diagonal not in DIAGONALS:
        raise ValueError(f"diagonal: expected one of {DIAGONALS}, got {diagonal!r}")
    scale = check_scale("softmax_scale", softmax_scale, dims[5])
    mask, left, right = mask_mode(causal, window, diagonal)
    return Problem(*dims, dtype=q.dtype, softmax_scale=scale, mask=mask, window_left=left, window_right=right,
                   dropout_p=dropout_p)


def _check_cu_seqlens(name: str, cu: object, device: torch.device) -> torch.Tensor:
    """dtype, device and rank of one offsets tensor (its values: :func:`check_offsets`)."""
    cu = check_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {cu.device}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name}: expected a 1-D tensor of batch + 1 offsets, got shape {tuple(cu.shape)}")
    return cu


def _offsets(name: str, cu: torch.Tensor, total: int) -> list[int]:
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name}: expected the first offset to be 0, got {offsets[0]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets}")
    if offsets[-1] != total:
        raise ValueError(f"{name}: expected the last offset to equal the number of tokens {total}, got {offsets[-1]}")
    return offsets


def _check_longest(name: str, offsets: list[int], max_seqlen: int) -> None:
    longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
    if max_seqlen < longest:
        raise ValueError(f"{name}: expected at least the longest sequence, {longest}, got {max_seqlen}")


def check_offsets(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                  max_seqlen_q: int, max_seqlen_k: int) -> None:
    """The offsets' values (read on the host): first 0, non-decreasing, last the number of
    tokens, no sequence longer than its max_seqlen."""
    offsets_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    offsets_k = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    _check_longest("max_seqlen_q", offsets_q, max_seqlen_q)
    _check_longest("max_seqlen_k", offsets_k, max_seqlen_k)


def check_varlen(q: object, k: object, v: object, cu_seqlens_q: object, cu_seqlens_k: object,
                 max_seqlen_q: object, max_seqlen_k: object, *, dropout_p: object, softmax_scale: object,
                 causal: object, window_size: object, diagonal: object, read_offsets: bool = True) -> Problem:
    """Checks of :func:`aotattn.flash_attn_varlen_func` (``q (total_q, Hq, D)``).

    ``read_offsets=False`` leaves the offsets' values to :func:`check_offsets` (under
    ``torch.compile`` they are checked when the op runs, not while tracing)."""
    names = ("q", "k", "v")
    tensors = [check_tensor(n, t) for n, t in zip(names, (q, k, v))]
    check_tensors(names, *tensors, "(total_tokens, heads, head_dim)", rank=3)  # messages with the caller's strides
    _, _, _, heads_q, heads_k, head_dim, head_dim_v = check_shapes(
        names, *(t.unsqueeze(0) for t in tensors), batch_dim=0, seq_dim=1, heads_axis=2)
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, tensors[0].device)
    if read_offsets:
        offsets_q = _offsets("cu_seqlens_q", cu_q, tensors[0].shape[0])
    cu_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, tensors[0].device)
    if cu_q.numel() != cu_k.numel():  # before k's values, whose last offset would be named instead
        raise ValueError(f"cu_seqlens_k: expected {cu_q.numel()} offsets (those of cu_seqlens_q), "
                         f"got {cu_k.numel()}")
    if read_offsets:
        offsets_k = _offsets("cu_seqlens_k", cu_k, tensors[1].shape[0])
    check_grid(names[0], cu_q.numel() - 1, heads_q, tensors[0].device)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {type_name(value)}")
        if value < 0:  # checked without the offsets' values (meta tensors, torch.compile's tracing)
            raise ValueError(f"{name}: expected a length, 0 or more, got {value}")
        if value > MAX_SEQLEN:
            # the kernels take it as an int32: beyond, the GPU launch failed packing it and the
            # interpreter ran a program per block of 2**31 rows (no error, no end)
            raise ValueError(f"{name}: expected at most {MAX_SEQLEN} (2**31 - 2**16: int32 block arithmetic in "
                             f"the kernels), got {value}")
        if read_offsets:
            _check_longest(name, offsets_q if name == "max_seqlen_q" else offsets_k, int(value))
    dropout_p = check_dropout("dropout_p", dropout_p)
    causal = check_bool("causal", causal)
    window = check_window(window_size)
    if diagonal not in DIAGONALS:
        raise ValueError(f"diagonal: expected one of {DIAGONALS}, got {diagonal!r}")
    scale = check_scale("softmax_scale", softmax_scale, head_dim)
    mask, left, right = mask_mode(causal, window, diagonal)
    return Problem(cu_q.numel() - 1, int(max_seqlen_q), int(max_seqlen_k), heads_q, heads_k, head_dim,
                   head_dim_v, dtype=tensors[0].dtype, softmax_scale=scale, mask=mask, window_left=left,
                   window_right=right, dropout_p=dropout_p, varlen=True)


def check_sdpa(query: object, key: object, value: object, *, dropout_p: object,
               is_causal: object, scale: object, enable_gqa: object) -> Problem:
    """Checks of :func:`aotattn.scaled_dot_product_attention` (``query (B, H, S, D)``)."""
    names = ("query", "key", "value")
    check_tensors(names, query, key, value, "(batch, heads, seqlen, head_dim)")
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    dims = check_shapes(names, query, key, value, batch_dim=0, seq_dim=2, heads_axis=1)
    if not enable_gqa and dims[3] != dims[4]:
        raise ValueError(f"key: expected {dims[3]} heads (those of query) unless enable_gqa=True, got {dims[4]}")
    dropout_p = check_dropout("dropout_p", dropout_p)
    causal = check_bool("is_causal", is_causal)
    softmax_scale = check_scale("scale", scale, dims[5])
    mask, left, right = mask_mode(causal, (-1, -1), "top_left")
    return Problem(*dims, dtype=query.dtype, softmax_scale=softmax_scale, mask=mask,
                   window_left=left, window_right=right, dropout_p=dropout_p)
