"""Public operators of the flash-attention family.

Data flows one way: public call -> checks (:mod:`.checks`) -> launch plan (functional,
configuration, grid, arguments) -> :func:`aotattn.runtime.launch`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from aotattn.families.flash import rules
from aotattn.families.flash.checks import (Problem, check_bias, check_bool, check_flash, check_sdpa,
                                           check_varlen)
from aotattn.runtime import launch, prepare
from aotattn.runtime.launcher import MODE_VAR
from aotattn.spec import Config, Functional, KernelSpec, LaunchPlan

LOG2E = 1.0 / math.log(2.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the operators hand to a kernel comes from here (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)




def philox_state(dropout_p: float) -> tuple[int, int]:
    """(seed, offset) of one dropout call, drawn from torch's default generator.

    ``torch.manual_seed`` therefore reproduces every mask; :func:`dropout_mask` draws
    the same way, so with the generator in the same state it returns the call's mask.
    """
    if dropout_p == 0.0:
        return 0, 0
    seed, offset = torch.randint(0, 2**62, (2,), dtype=torch.int64).tolist()
    return seed, offset


@dataclass(frozen=True)
class Call:
    """One attention call, validated: the problem plus its optional tensors and RNG state."""

    p: Problem
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # (B, Hq, Sq, Sk) view in q's dtype
    bias_grad: bool = False
    seed: int = 0
    offset: int = 0
    aligned: bool = True  # every q/k/v pointer 16-byte aligned and tile stride divisible by 16

    def functional(self, backward: bool = False) -> dict:
        """The compile-time choices shared by the attention kernels."""
        p = self.p
        bucket = rules.head_dim_bucket(max(p.head_dim, p.head_dim_v))  # see rules._unequal_head_buckets
        bias = 0 if self.bias is None else (2 if backward and self.bias_grad else 1)
        return {
            "dtype": rules.DTYPES[p.dtype],
            "BLOCK_D": bucket,
            "BLOCK_DV": bucket,
            # the unpadded functionals are built with alignment hints (rules._aligned_when)
            "PAD_HEAD": p.head_dim != bucket or p.head_dim_v != bucket or not self.aligned,
            "MASK": p.mask,
            "VARLEN": p.varlen,
            "DROPOUT": p.dropout_p > 0.0,
            "BIAS": bias,
        }

    def tiles_aligned(self, *tensors: torch.Tensor) -> bool:
        return all(t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in self.rows(t)) for t in tensors)

    def rows(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, row) strides of q/k/v-like tensors: (B, S, H, D), or (T, H, D) under varlen."""
        if self.p.varlen:
            return 0, t.stride(1), t.stride(0)
        return t.stride(0), t.stride(2), t.stride(1)

    def sequences(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.p.varlen:
            return self.cu_seqlens_q, self.cu_seqlens_k
        unused = torch.empty(0, dtype=torch.int32, device=device)
        return unused, unused

    def bias_args(self, like: torch.Tensor) -> tuple:
        if self.bias is None:
            return (like, 0, 0, 0, 0)
        return (self.bias, *self.bias.stride())

    def window(self) -> tuple[int, int]:
        return self.p.kernel_window()

    def dropout(self) -> tuple[int, float, int, int]:
        """(threshold, scale, seed, offset): keep an element when its Philox word >= threshold."""
        p = self.p.dropout_p
        return min(int(p * 2.0**32), 2**32), 1.0 / (1.0 - p), self.seed, self.offset

    def sizes(self) -> tuple[int, ...]:
        p = self.p
        return p.seqlen_q, p.seqlen_k, p.heads_q, p.group_size, p.head_dim, p.head_dim_v


def _plan(kernel: KernelSpec, functional: Mapping, p: Problem, device: torch.device, config: Config | None,
          grid: Callable[[Config], tuple[int, int, int]], args: tuple) -> LaunchPlan:
    functional = Functional.of(functional)
    if config is None:
        config = rules.config_for(kernel, functional, device, seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k)
    return LaunchPlan(kernel, functional, config, grid(config), args)


def forward_plan(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, config: Config | None = None) -> LaunchPlan:
    """Plan of the forward kernel; ``lse`` is ``(B, Hq, Sq)``, or ``(Hq, total_q)`` under varlen."""
    p = c.p
    lse_strides = (0, lse.stride(0)) if p.varlen else (lse.stride(0), lse.stride(1))
    left, right = c.window()
    threshold, scale, seed, offset = c.dropout()
    args = (q, k, v, out, lse, *c.sequences(q.device), c.bias_args(q)[0],
            *c.rows(q), *c.rows(k), *c.rows(v), *c.rows(out), *lse_strides, *c.bias_args(q)[1:],
            *c.sizes(), p.softmax_scale * LOG2E, left, right, threshold, scale, seed, offset)
    return _plan(rules.ATTN_FWD, c.functional(), p, q.device, config,
                 lambda cfg: (_cdiv(p.seqlen_q, cfg["BLOCK_M"]), p.heads_q, p.batch), args)


def _lse_shape(p: Problem, q: torch.Tensor) -> tuple[int, ...]:
    return (p.heads_q, q.shape[0]) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)


def attention_forward(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      config: Config | None = None) -> torch.Tensor:
    """Run the forward pass into ``out``; returns the log-sum-exp."""
    lse = _empty(_lse_shape(c.p, q), torch.float32, q.device)
    launch(forward_plan(c, q, k, v, out, lse, config))
    return lse


def backward_plans(c: Call, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor, dbias: torch.Tensor | None, backend: str,
                   deterministic: bool, configs: Mapping[str, Config] | None = None) -> list[LaunchPlan]:
    """The launches of one backward pass, in order: preprocess, then the backend's kernels.

    With ``backend="fused"`` and not ``deterministic``, ``dq`` must be a zeroed fp32
    buffer that the kernel accumulates into with atomics.
    """
    configs = configs or {}
    p = c.p
    f = c.functional(backward=True)
    dev = q.device
    lse_strides = (0, lse.stride(0)) if p.varlen else (lse.stride(0), lse.stride(1))
    cu_q, cu_k = c.sequences(dev)
    # the preprocess is aligned exactly when the attention kernels are (dout was checked for it)
    pre_f = {"dtype": f["dtype"], "BLOCK_DV": f["BLOCK_DV"], "PAD_HEAD": f["PAD_HEAD"], "VARLEN": p.varlen}
    plans = [_plan(rules.ATTN_BWD_PREPROCESS, pre_f, p, dev, configs.get("attn_bwd_preprocess"),
                   lambda cfg: (_cdiv(p.seqlen_q, cfg["BLOCK_M"]), p.heads_q, p.batch),
                   (out, dout, delta, cu_q, *c.rows(out), *c.rows(dout), *lse_strides, p.seqlen_q, p.head_dim_v))]
    bias, *bias_strides = c.bias_args(q)
    if dbias is None:
        dbias_args, dbias_strides = delta, (0, 0, 0)
    else:
        dbias_args, dbias_strides = dbias, dbias.stride()[:3]
    left, right = c.window()
    scalars = (*c.sizes(), p.softmax_scale, p.softmax_scale * LOG2E, left, right, *c.dropout())
    inputs = (*c.rows(q), *c.rows(k), *c.rows(v), *c.rows(dout))
    dkdv_strides = (*c.rows(dk), *c.rows(dv))
    if backend == "split":
        plans.append(_plan(rules.ATTN_BWD_DKDV, f, p, dev, configs.get("attn_bwd_dkdv"),
                           lambda cfg: (_cdiv(p.seqlen_k, cfg["BLOCK_N"]), p.heads_k, p.batch),
                           (q, k, v, dout, dk, dv, lse, delta, cu_q, cu_k, bias, *inputs, *dkdv_strides,
                            *lse_strides, *bias_strides, *scalars)))
        plans.append(_plan(rules.ATTN_BWD_DQ, f, p, dev, configs.get("attn_bwd_dq"),
                           lambda cfg: (_cdiv(p.seqlen_q, cfg["BLOCK_M"]), p.heads_q, p.batch),
                           (q, k, v, dout, dq, lse, delta, cu_q, cu_k, bias, dbias_args, *inputs, *c.rows(dq),
                            *lse_strides, *bias_strides, *dbias_strides, *scalars)))
    elif backend == "fused":
        fused_f = {**f, "ATOMIC_DQ": not deterministic}

        def grid(cfg: Config) -> tuple[int, int, int]:
            programs = _cdiv(p.seqlen_k, cfg["BLOCK_N"])
            if deterministic:
                programs += p.group_size * _cdiv(p.seqlen_q, cfg["BLOCK_M"])
            return programs, p.heads_k, p.batch

        plans.append(_plan(rules.ATTN_BWD_FUSED, fused_f, p, dev, configs.get("attn_bwd_fused"), grid,
                           (q, k, v, dout, dq, dk, dv, lse, delta, cu_q, cu_k, bias, dbias_args, *inputs,
                            *c.rows(dq), *dkdv_strides, *lse_strides, *bias_strides, *dbias_strides, *scalars)))
    else:
        raise ValueError(f"backend: expected one of {rules.BACKENDS} or None, got {backend!r}")
    return plans


def choose_backend(c: Call, deterministic: bool, device: torch.device) -> str:
    """The backend when the caller names none: the ``flash.backward`` table's choice on GPUs."""
    if device.type == "cpu":
        return "split"
    f = c.functional()
    functional = Functional.of({"dtype": f["dtype"], "BLOCK_D": f["BLOCK_D"], "MASK": f["MASK"],
                                "DETERMINISTIC": deterministic})
    config = rules.config_for(rules.BACKWARD, functional, device, seqlen_q=c.p.seqlen_q, seqlen_k=c.p.seqlen_k)
    return config["backend"]


def attention_backward(c: Call, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, backend: str | None, deterministic: bool,
                       configs: Mapping[str, Config] | None = None):
    """dQ, dK, dV (contiguous, shaped like q, k, v) and dBias (``(B, Hq, Sq, Sk)`` or None)."""
    if dout.stride(-1) != 1 or (c.functional()["PAD_HEAD"] is False and not c.tiles_aligned(dout)):
        dout = dout.contiguous()  # a fresh contiguous tensor meets the aligned variant's assumptions
    p = c.p
    backend = backend or choose_backend(c, deterministic, q.device)
    dev = q.device
    dk = _empty(tuple(k.shape), k.dtype, dev)
    dv = _empty(tuple(v.shape), v.dtype, dev)
    delta = _empty(_lse_shape(p, q), torch.float32, dev)
    atomic = backend == "fused" and not deterministic
    dq = (torch.zeros(tuple(q.shape), dtype=torch.float32, device=dev) if atomic
          else _empty(tuple(q.shape), q.dtype, dev))
    dbias = None
    if c.bias_grad:
        # tiles outside the mask are skipped, never written: their gradient is exactly 0
        dbias = torch.zeros((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), dtype=torch.float32, device=dev)
    for plan in backward_plans(c, dout, q, k, v, out, lse, delta, dq, dk, dv, dbias, backend, deterministic,
                               configs):
        launch(plan)
    return (dq.to(q.dtype) if atomic else dq), dk, dv, dbias


def new_output(p: Problem, q: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """The output, laid out like q: ``(B, Sq, Hq, Dv)`` (stored ``(B, Hq, Sq, Dv)`` when
    ``heads_major``), or ``(total_q, Hq, Dv)`` under varlen."""
    if p.varlen:
        return _empty((q.shape[0], p.heads_q, p.head_dim_v), q.dtype, q.device)
    if heads_major:
        return _empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim_v), q.dtype, q.device).transpose(1, 2)
    return _empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim_v), q.dtype, q.device)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, c, heads_major, backend, deterministic):
        out = new_output(c.p, q, heads_major)
        lse = attention_forward(c, q, k, v, out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = c
        ctx.backend = backend
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dbias = attention_backward(ctx.call, dout, q, k, v, out, lse, ctx.backend, ctx.deterministic)
        return dq, dk, dv, (None if dbias is None else dbias.to(ctx.call.bias.dtype)), None, None, None, None


def _check_backend(backend: object) -> str | None:
    if backend is not None and backend not in rules.BACKENDS:
        raise ValueError(f"backend: expected one of {rules.BACKENDS} or None, got {backend!r}")
    return backend


def _run(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_major: bool,
         backend: str | None, deterministic: bool, cache_key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, c.bias)):
        return _FlashAttention.apply(q, k, v, c.bias, c, heads_major, backend, deterministic)
    out = new_output(c.p, q, heads_major)
    lse = _empty(_lse_shape(c.p, q), torch.float32, q.device)
    plan = forward_plan(c, q, k, v, out, lse)
    if cache_key is not None and c.bias is None and c.p.dropout_p == 0.0 and not c.p.varlen:
        _PLANS.store(cache_key, plan, q, k, v, out, lse, out.transpose(1, 2) if heads_major else out)
    launch(plan)
    return out, lse


def _attend(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
            heads_major: bool, backend: object, deterministic: object, cache_key: tuple | None = None,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A validated call: run eagerly, or under ``torch.compile`` as one custom op (:mod:`.library`)."""
    backend, deterministic = _check_backend(backend), _deterministic(deterministic)
    if not torch.compiler.is_compiling():
        return _run(_new_call(p, q, k, v, bias, cu_seqlens_q, cu_seqlens_k), q, k, v, heads_major, backend,
                    deterministic, cache_key)
    max_q, max_k = (p.seqlen_q, p.seqlen_k) if p.varlen else (0, 0)
    out, lse, _ = torch.ops.aotattn.flash_fwd(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                              p.softmax_scale, p.mask, p.window_left, p.window_right, p.dropout_p,
                                              heads_major, backend, deterministic)
    return out, lse


def _cacheable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: object, extra: object) -> bool:
    """Inference calls without dropout or bias: those the plan cache serves."""
    return extra is None and dropout_p == 0.0 and not (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def _new_call(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
              cu_q=None, cu_k=None, *, bias_grad: bool | None = None, rng: tuple[int, int] | None = None) -> Call:
    """``bias_grad``: default, whether autograd wants the bias's gradient; ``rng``: a
    dropout (seed, offset) to replay, else one drawn from torch's generator."""
    seed, offset = rng if rng is not None else philox_state(p.dropout_p)
    if cu_q is not None:
        # the kernels read offsets at unit stride: a strided view (cu[::2]) would make them
        # read past its storage (seen as heap corruption); this copies only such views
        cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    if bias_grad is None:
        bias_grad = bias is not None and bias.requires_grad and torch.is_grad_enabled()
    c = Call(p, cu_q, cu_k, bias, bias_grad, seed, offset)
    if not c.tiles_aligned(q, k, v):
        c = dataclasses.replace(c, aligned=False)
    return c


class _PlanCache:
    """Launch-plan cache of the inference forward: the hot path of small calls.

    A forward call without autograd, dropout or bias is decided entirely by its tensors'
    metadata (shapes, strides, dtypes, device, 16-byte alignment) and its arguments; a
    call that repeats those repeats every check's outcome and the whole plan. So the
    first call goes the long way (checks, plan) and stores a template; the next ones
    only allocate the outputs and launch with new pointers.
    """

    SIZE = 256

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple] = {}
        self.lock = threading.Lock()

    @staticmethod
    def key(q, k, v, *flags) -> tuple | None:
        """None when an argument is unhashable (the full path then reports it).

        Each flag is keyed with its type (and a window's sides with theirs): ``True == 1``
        and ``2.0 == 2`` in Python, so a value-only key would let ``causal=1`` hit the
        entry of a valid ``causal=True`` call and skip the check that rejects it. Only
        calls that passed the checks are stored, so a hit is a call the checks accept.
        """
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
        typed = tuple((type(f), tuple((type(x), x) for x in f) if type(f) in (tuple, list) else f) for f in flags)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, aligned, os.environ.get(MODE_VAR), typed)
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def store(self, key: tuple, plan: LaunchPlan, q, k, v, out, lse, out_base: torch.Tensor) -> None:
        """``out`` is the view the kernel writes, ``out_base`` the tensor it views."""
        source = {id(t): i for i, t in enumerate((q, k, v, out, lse))}
        dynamic = [(pos, source[id(a)]) for pos, a in enumerate(plan.args) if id(a) in source]
        entry = (prepare(plan, dynamic), tuple(out_base.shape), tuple(lse.shape), out.shape != out_base.shape)
        with self.lock:  # threads may store at once; lookups are plain dict reads
            if len(self.entries) >= self.SIZE:
                self.entries.pop(next(iter(self.entries)))
            self.entries[key] = entry

    def run(self, key: tuple, q, k, v) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the output as stored, the log-sum-exp), or None on a miss."""
        entry = self.entries.get(key) if key is not None else None
        if entry is None:
            return None
        run, out_shape, lse_shape, transposed = entry
        out = _empty(out_shape, q.dtype, q.device)
        lse = _empty(lse_shape, torch.float32, q.device)
        run((q, k, v, out.transpose(1, 2) if transposed else out, lse))
        return out, lse


_PLANS = _PlanCache()


def _deterministic(value: object) -> bool:
    return check_bool("deterministic", value) or torch.are_deterministic_algorithms_enabled()


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
                    deterministic: bool = False, return_lse: bool = False, *,
                    bias: torch.Tensor | None = None, backend: str | None = None):
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
        dropout_p: probability of dropping an attention weight (Philox, drawn from torch's
            default generator; :func:`aotattn.dropout_mask` returns the mask a call used).
        softmax_scale: multiplies ``q . k`` before the softmax; default ``1/sqrt(D)``.
            Any finite value, zero and negative included.
        causal: ``right = 0`` on the chosen diagonal.
        window_size: ``(left, right)``; -1 leaves a side unbounded.
        diagonal: ``"bottom_right"`` or ``"top_left"``.
        deterministic: bitwise reproducible gradients (no atomics in the backward pass).
            Also on when ``torch.use_deterministic_algorithms(True)`` is in effect.
        return_lse: also return the log-sum-exp (natural log, fp32, ``(B, Hq, Sq)``).
        bias: additive, broadcastable to ``(B, Hq, Sq, Sk)``, added to the scaled scores;
            differentiable (its gradient materialises a ``(B, Hq, Sq, Sk)`` fp32 buffer).
        backend: the backward pass: ``"split"`` (a dK/dV kernel, then a dQ kernel),
            ``"fused"`` (one launch) or None to let aotattn choose. For tests and
            measurement; both compute the same gradients.

    Returns:
        ``out (B, Sq, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    key = None
    if not torch.compiler.is_compiling() and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) \
            and isinstance(v, torch.Tensor) and _cacheable(q, k, v, dropout_p, bias):
        key = _PLANS.key(q, k, v, "flash", softmax_scale, causal, window_size, diagonal, return_lse)
        hit = _PLANS.run(key, q, k, v)
        if hit is not None:
            return hit if return_lse else hit[0]
    p = check_flash(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                    window_size=window_size, diagonal=diagonal)
    return_lse = check_bool("return_lse", return_lse)
    out, lse = _attend(p, q, k, v, check_bias("bias", bias, p, q), False, backend, deterministic, key)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), diagonal: str = "bottom_right",
                           deterministic: bool = False, return_lse: bool = False, *,
                           backend: str | None = None):
    """Attention over a batch of sequences of different lengths, packed (flash-attn layout).

    Sequence b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v; it attends only within itself.
    The mask is :func:`flash_attn_func`'s applied per sequence: on the bottom-right
    diagonal each sequence uses its own ``d = seqlen_k - seqlen_q``. Empty sequences
    are allowed.

    Args:
        q: ``(total_q, Hq, D)``; k: ``(total_k, Hk, D)``; v: ``(total_k, Hk, Dv)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, starting at 0, non-decreasing,
            ending at total_q / total_k, on q's device.
        max_seqlen_q, max_seqlen_k: at least the longest sequence.
        Other arguments: as in :func:`flash_attn_func`.

    Returns:
        ``out (total_q, Hq, Dv)``, or ``(out, lse)`` with lse ``(Hq, total_q)`` fp32.
    """
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
                     softmax_scale=softmax_scale, causal=causal, window_size=window_size, diagonal=diagonal,
                     read_offsets=not torch.compiler.is_compiling())
    return_lse = check_bool("return_lse", return_lse)
    out, lse = _attend(p, q, k, v, None, False, backend, deterministic, None, cu_seqlens_q, cu_seqlens_k)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, deterministic: bool = False,
                                 backend: str | None = None) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention`.

    PyTorch semantics: ``is_causal`` keeps key j for query i iff ``j <= i`` (top-left
    diagonal), whatever the lengths; a float ``attn_mask`` is added to the scaled scores,
    a boolean one keeps positions where it is True. Rows that see no key give 0.

    Args:
        query: ``(B, Hq, Sq, D)``; key: ``(B, Hk, Sk, D)``; value: ``(B, Hk, Sk, Dv)``.
            Hk must equal Hq unless ``enable_gqa``.
        attn_mask: bool or float, broadcastable to ``(B, Hq, Sq, Sk)``.
        dropout_p: as in :func:`flash_attn_func`.
        is_causal: top-left causal mask.
        scale: default ``1/sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hk.
        deterministic, backend: as in :func:`flash_attn_func` (aotattn's additions).

    Returns:
        ``(B, Hq, Sq, Dv)`` in query's dtype.
    """
    cache_key = None
    if not torch.compiler.is_compiling() and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) \
            and isinstance(value, torch.Tensor) and _cacheable(query, key, value, dropout_p, attn_mask):
        cache_key = _PLANS.key(query, key, value, "sdpa", is_causal, scale, enable_gqa)
        hit = _PLANS.run(cache_key, query, key, value)
        if hit is not None:
            return hit[0]
    p = check_sdpa(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    bias = check_bias("attn_mask", attn_mask, p, query, sdpa_mask=True)
    out, _ = _attend(p, q, k, v, bias, True, backend, deterministic, cache_key)
    return out.transpose(1, 2)


def dropout_mask(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, dropout_p: float,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The keep-mask (bool, ``(batch, heads_q, seqlen_q, seqlen_k)``) of a dropout call.

    Draws its Philox state from torch's default generator exactly as an attention call
    does: put the generator in the state that call saw (``torch.manual_seed(s)`` before
    both, or ``torch.set_rng_state``) and this returns the very mask the call applied.
    Element ``[b, h, i, j]`` is True where weight (i, j) of query head h of batch entry b
    was kept. Under varlen, pass the number of sequences and ``max_seqlen_q/k``; sequence
    b's mask is ``[b, :, :seqlen_q_b, :seqlen_k_b]``.
    """
    device = torch.device(device)
    dropout_p = float(dropout_p)
    if not 0.0 < dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in (0, 1), got {dropout_p}")
    seed, offset = philox_state(dropout_p)
    mask = _empty((batch, heads_q, seqlen_q, seqlen_k), torch.int8, device)
    kernel = rules.DROPOUT_MASK
    config = rules.config_for(kernel, Functional.of({}), device)
    launch(LaunchPlan(kernel, Functional.of({}), config, (_cdiv(seqlen_q, config["BLOCK_M"]), heads_q, batch),
                      (mask, *mask.stride()[:3], seqlen_q, seqlen_k, heads_q, min(int(dropout_p * 2.0**32), 2**32),
                       seed, offset)))
    return mask.bool()
