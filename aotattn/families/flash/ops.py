"""Public operators of the flash-attention family.

Data flows one way: public call -> checks (:mod:`.checks`) -> planning (:mod:`.planning`:
launch plans bound by name to the kernels' declarations) -> :func:`aotattn.runtime.launch`.
Under ``torch.compile`` the call goes through the custom ops of :mod:`.custom_ops`, which
plan the same way. This module adds the autograd Function and the plan cache.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading

import torch

from aotattn.errors import type_name
from aotattn.families.flash import planning, rules
from aotattn.families.flash.checks import (Problem, check_backend, check_bias, check_bool, check_dropout,
                                           check_flash, check_flash_attn_extras, check_grid, check_sdpa, check_seqlen,
                                           check_tensor, check_varlen, forward_ad_active)
from aotattn.families.flash.planning import (Call, accumulated_dq_scale, backward_buffers, backward_dout,
                                             backward_plans, choose_backend, dout_copy, dropout_mask_plan, finish_dq,
                                             forward_plan, lse_shape, new_call, new_output, philox_state,
                                             run_backward, run_forward, trim_keys, zeroed_rows)
from aotattn.runtime import launch, prepare
from aotattn.runtime.images import ENV_VAR as IMAGES_VAR
from aotattn.runtime.launcher import MODE_VAR
from aotattn.tuning import ENV_VAR as TUNING_DB_VAR
from aotattn.spec import LaunchPlan


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, c, heads_major, backend, deterministic, cached):
        """``cached``: the plan cache's entry for this call's key, or None (see :class:`_PlanCache`)."""
        if cached is not None:
            out, lse = cached.forward(q, k, v)
        else:
            out = new_output(c.p, q, heads_major)
            lse = run_forward(c, q, k, v, out)
        # the bias and offsets too: changed in place before the backward, they would give it
        # other gradients (or offsets past the tensors); saved, autograd's version check refuses
        ctx.save_for_backward(q, k, v, out, lse, *(t for t in _call_tensors(c) if t is not None))
        ctx.call = c
        ctx.backend = backend
        ctx.deterministic = deterministic
        ctx.cached = cached
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *saved = ctx.saved_tensors
        if saved:  # the call with the tensors as unpacked (a non-reentrant checkpoint's recomputed ones)
            it = iter(saved)
            tensors = [None if t is None else next(it) for t in _call_tensors(ctx.call)]
            ctx.call = dataclasses.replace(ctx.call, **dict(zip(_CALL_TENSORS, tensors)))
        if ctx.cached is not None:
            dq, dk, dv = _without_grad(ctx.cached.backward, dout, q, k, v, out, lse, ctx.backend, ctx.deterministic)
            dbias = None
        else:
            dq, dk, dv, dbias = _without_grad(run_backward, ctx.call, dout, q, k, v, out, lse, ctx.backend,
                                              ctx.deterministic)
            dbias = None if dbias is None else dbias.to(ctx.call.bias.dtype)
        dq, dk, dv, dbias = _first_order((dq, dk, dv, dbias), (dout, q, k, v, ctx.call.bias))
        return dq, dk, dv, dbias, None, None, None, None, None


_CALL_TENSORS = ("bias", "cu_seqlens_q", "cu_seqlens_k")


def _call_tensors(c: Call) -> tuple:
    return c.bias, c.cu_seqlens_q, c.cu_seqlens_k


class _CachedAttention(torch.autograd.Function):
    """A plan-cache hit under autograd, kept lean: autograd's bookkeeping grows with each
    argument, output and view, and on tiny calls it is most of the host time. ``q, k, v``
    come in the caller's layout (the prepared launch reads only their pointers, so SDPA's
    ``(B, H, S, D)`` needs no transposes, and none of their backward nodes run); the
    log-sum-exp is saved for the backward, not returned. ``hit``: ``(entry, backend,
    deterministic)``."""

    @staticmethod
    def forward(ctx, q, k, v, hit):
        out, lse = hit[0].launch(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.hit = hit
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        entry, backend, deterministic = ctx.hit
        dq, dk, dv = _without_grad(entry.backward, dout, q, k, v, out, lse, backend, deterministic, True)
        dq, dk, dv = _first_order((dq, dk, dv), (dout, q, k, v))
        return dq, dk, dv, None


_DOUBLE_BACKWARD = ("aotattn's attention has no double backward: its gradients (taken with create_graph=True) "
                    "cannot be differentiated again; for second-order gradients use PyTorch's math attention")


class _NoDoubleBackward(torch.autograd.Function):
    """The backward's gradients (the first ``n`` arguments) again, out of a node whose
    inputs are what they depend on (the rest: dout, q, k, v, bias), so that differentiating
    them reaches this node, which raises. A node without those edges (PyTorch's
    DelayedError on detached gradients) is pruned by ``torch.autograd.grad(..., inputs=q)``,
    and a gradient penalty silently lost its second-order term."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tensors[:n]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD)


def _without_grad(fn, *args):
    """``fn(*args)`` with grad mode off: it is on in a backward only under
    ``create_graph=True`` (:func:`_first_order` then marks what comes out), and entering
    ``torch.no_grad()`` where it is already off costs a tiny call's backward ~2 µs."""
    if not torch.is_grad_enabled():
        return fn(*args)
    with torch.no_grad():
        return fn(*args)


def _first_order(grads: tuple, inputs: tuple) -> tuple:
    """The backward's gradients. Under ``create_graph=True`` (grad mode on in a backward)
    where the gradients depend on inputs that require grad, they come out of a node that
    raises when differentiated (:class:`_NoDoubleBackward`), as PyTorch's flash backend
    does: the kernels have no backward, and a gradient with no graph would make a
    second-order one silently wrong."""
    sources = [t for t in inputs if t is not None and t.requires_grad]
    if not torch.is_grad_enabled() or not sources:
        return grads
    present = [g for g in grads if g is not None]
    marked = iter(_NoDoubleBackward.apply(len(present), *present, *sources))
    return tuple(None if g is None else next(marked) for g in grads)


# autograd.Function.apply's Python wrapper (setup_context binding, functorch checks) costs
# about a fifth of a tiny training call's host time; the C++ apply under it does the work.
_C_APPLY = getattr(torch._C._FunctionBase, "__dict__", {}).get("apply")


def _apply(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, through the C++ apply directly where that is all the
    wrapper would do: no functorch transform active, ``forward`` taking ``ctx`` (no
    ``setup_context``)."""
    if _C_APPLY is None or torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return _C_APPLY.__get__(None, function)(*args)


def _environment() -> tuple:
    """The environment variables a cached plan depends on (launch mode, tuning database,
    image folder: a plan holds the kernel loaded from it), read from ``os.environ``'s own
    dict: ``os.environ.get`` encodes and decodes each name and value, two microseconds of a
    tiny call's host time."""
    data = getattr(os.environ, "_data", None)
    if data is None or _ENV_KEYS is None:
        return os.environ.get(MODE_VAR), os.environ.get(TUNING_DB_VAR), os.environ.get(IMAGES_VAR)
    return data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]), data.get(_ENV_KEYS[2])


try:
    _ENV_KEYS = tuple(os.environ.encodekey(name) for name in (MODE_VAR, TUNING_DB_VAR, IMAGES_VAR))
except AttributeError:  # not CPython's os._Environ
    _ENV_KEYS = None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _run(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_major: bool, backend: str | None,
         deterministic: bool, cache_key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) in flash-attn's layout; lse is None for a heads-major (SDPA) call under
    autograd that the plan cache serves (SDPA returns none)."""
    cached = None
    if cache_key is not None and c.bias is None and c.p.dropout_p == 0.0 and not c.p.varlen:
        cached = _PLANS.store(cache_key, c, q, k, v, heads_major)
    if _needs_grad(q, k, v, c.bias):
        if cached is not None and heads_major:
            # what a cache hit runs (PlanCache.run): the same tensors saved, in SDPA's layout,
            # so a non-reentrant checkpoint, whose recomputation hits, finds what it saved
            out = _apply(_CachedAttention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         (cached, backend, deterministic))
            return out.transpose(1, 2), None
        return _apply(_FlashAttention, q, k, v, c.bias, c, heads_major, backend, deterministic, cached)
    if cached is not None:
        return cached.forward(q, k, v)
    out = new_output(c.p, q, heads_major)
    return out, run_forward(c, q, k, v, out)


PAD_HEADS_VAR = "AOTATTN_PAD_HEADS"


def _pad_by_copy() -> bool:
    """``AOTATTN_PAD_HEADS``: ``kernel`` (the default) runs the padded-head kernels on the
    caller's tensors where both head dims are multiples of 8; ``copy`` pads every off-bucket
    head dim with zeros on the way in and runs the bucket's kernels (see :func:`_attend`).
    On the H200 (benchmarks/RESULTS.md, thirteenth session, 40 odd-dim entries) the kernels
    run the forward 1.49x and the backward 1.07x faster than the copies (geomean)."""
    value = os.environ.get(PAD_HEADS_VAR) or "kernel"
    if value not in ("copy", "kernel"):
        raise ValueError(f"{PAD_HEADS_VAR}: expected copy or kernel, got {value!r}")
    return value == "copy"


def _bucketed(p: Problem) -> int | None:
    """The head-dim bucket a call with head dims off the buckets is padded to, else None:
    always for head dims that are not multiples of 8 (the padded kernels read rows of
    16 bytes, rules._variant_of, as flash-attn pads to a multiple of 8), for the others
    under ``AOTATTN_PAD_HEADS=copy``."""
    bucket = rules.head_dim_bucket(max(p.head_dim, p.head_dim_v))  # one bucket for both: rules._unequal_head_buckets
    if p.head_dim == bucket and p.head_dim_v == bucket:
        return None
    odd = p.head_dim % planning.ROW_UNIT or p.head_dim_v % planning.ROW_UNIT
    return bucket if odd or _pad_by_copy() else None


def _attend(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
            heads_major: bool, backend: object, deterministic: object, cache_key: tuple | None = None,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A validated call: run eagerly, or under ``torch.compile`` as one custom op (:mod:`.custom_ops`).

    Head dims off the buckets that are multiples of 8 (72, 96, 200, ...) run the
    padded-head kernels on the caller's tensors. Others (57, 9, ...), and every off-bucket
    dim under ``AOTATTN_PAD_HEADS=copy``, are zero-padded to their bucket here, by
    differentiable copies, and the output sliced back (a view, as flash-attn and PyTorch's
    flash backend return). Zero columns add nothing to ``q . k`` and give zero output
    columns; the softmax scale was already taken from the real head dim; autograd slices
    the gradients back. Costs the copies' memory traffic and memory.
    """
    bucket = _bucketed(p)
    if bucket is not None:
        pad = lambda t, d: torch.nn.functional.pad(t, (0, bucket - d))  # noqa: E731
        p_full = dataclasses.replace(p, head_dim=bucket, head_dim_v=bucket)
        out, lse = _attend(p_full, pad(q, p.head_dim), pad(k, p.head_dim), pad(v, p.head_dim_v), bias, heads_major,
                           backend, deterministic, None, cu_seqlens_q, cu_seqlens_k)
        return out[..., :p.head_dim_v], lse
    backend, deterministic = check_backend(backend), _deterministic(deterministic)
    if not torch.compiler.is_compiling() and not q.is_meta:  # meta: the custom op's fake, shapes only
        (q, k, v), copied = planning.servable(p, q, k, v)
        if copied:  # the plan cache keys the caller's tensors; a hit would skip the copies
            cache_key = None
        return _run(new_call(p, q, k, v, bias, cu_seqlens_q, cu_seqlens_k), q, k, v, heads_major, backend,
                    deterministic, cache_key)
    max_q, max_k = (p.seqlen_q, p.seqlen_k) if p.varlen else (0, 0)
    out, lse, _ = torch.ops.aotattn.flash_fwd(q, k, v, bias, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                                              p.softmax_scale, p.mask, p.window_left, p.window_right, p.dropout_p,
                                              heads_major, backend, deterministic)
    return out, lse


def _cacheable(q: object, k: object, v: object, dropout_p: object, extra: object) -> bool:
    """Calls without dropout or bias, with or without autograd, that are not padded by
    copy (:func:`_bucketed`): those the plan cache serves."""
    tensor, strided = torch.Tensor, torch.strided
    if (torch.compiler.is_compiling() or forward_ad_active()  # a dual input must meet check_untransformed
            or not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)
                    and q.dim() and k.dim() and v.dim()
                    and q.layout is strided and k.layout is strided and v.layout is strided and not q.is_meta
                    and not (q.is_nested or k.is_nested or v.is_nested))  # strided too; no shape to read
            # a plain 0 only: the cache key leaves dropout_p out, so a hit must not skip its check
            or extra is not None or (type(dropout_p) is not float and type(dropout_p) is not int)
            or dropout_p != 0.0):
        return False
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv and d in _BUCKETS:
        return True
    return d % planning.ROW_UNIT == 0 and dv % planning.ROW_UNIT == 0 and not _pad_by_copy()


_BUCKETS = frozenset(rules.HEAD_DIM_BUCKETS)
_NUMBERS = (float, int)


# Which call tensor each kernel argument stands for, by the declarations' argument names:
# forward (q, k, v, out, lse), backward (dout, q, k, v, out, lse, stats, dq, dk, dv). Without
# a bias the kernels' Bias (and DBias) pointers are placeholders bound to q (and the stats).
_FORWARD_ROLES = {"Q": 0, "K": 1, "V": 2, "Out": 3, "Lse": 4, "Bias": 0}
_BACKWARD_ROLES = {"DO": 0, "Q": 1, "K": 2, "V": 3, "Out": 4, "Lse": 5, "Stats": 6, "DQ": 7, "DK": 8, "DV": 9,
                   "Bias": 1, "DBias": 6}


def _prepare(plan: LaunchPlan, roles: dict[str, int]):
    """A launcher of ``plan`` for new tensors: the arguments named in ``roles`` come from the
    tensors of each call (by role, never by identity: ``f(x, x, x)`` binds Q, K and V to
    one tensor, and a later ``f(q, k, v)`` must not reuse that binding)."""
    return prepare(plan, [(pos, roles[name]) for pos, name in enumerate(plan.kernel.argument_names)
                          if name in roles])


class _Entry:
    """One cached call: its validated :class:`Call`, the prepared forward launch and,
    filled on first use, the prepared backward launches per backward choice."""

    def __init__(self, c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_major: bool):
        self.call = c
        out = new_output(c.p, q, heads_major)
        lse = torch.empty(lse_shape(c.p, q), dtype=torch.float32, device=q.device)
        self.out_shape = tuple(out.transpose(1, 2).shape if heads_major else out.shape)
        self.lse_shape = tuple(lse.shape)
        self.heads_major = heads_major
        self.launch_forward = _prepare(forward_plan(c, q, k, v, out, lse), _FORWARD_ROLES)
        self.pad_head = c.functional()["PAD_HEAD"]
        self.backwards: dict[tuple, tuple] = {}

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out as stored, lse). The launch reads only data pointers, so q, k and v may be
        passed in either layout of the call (SDPA's or flash-attn's): no view is made."""
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        self.launch_forward((q, k, v, out, lse))
        return out, lse

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in flash-attn's layout, lse), for inputs in flash-attn's layout."""
        out, lse = self.launch(q, k, v)
        return (out.transpose(1, 2) if self.heads_major else out), lse

    def backward(self, dout, q, k, v, out, lse, backend: str | None, deterministic: bool,
                 caller_layout: bool = False):
        """dQ, dK, dV shaped like q, k, v. With ``caller_layout`` the tensors come in the
        caller's layout (SDPA's for a heads-major entry): the prepared launches read only
        their pointers, so no view is made (``dout``'s layout picks the launches and whether
        it is copied), and the gradients are allocated in the caller's layout directly."""
        flip = caller_layout and self.heads_major  # views of the same memory, heads and rows swapped
        # dout's layout as it comes decides whether the kernels need a copy of it and which
        # launches run, so a hit neither makes a view of it nor checks it again
        choice = (dout.stride(), dout.data_ptr() % 16 == 0, backend, deterministic, flip)
        prepared = self.backwards.get(choice)
        if prepared is None:  # this call launches on the dout planning read (its copy, if it made one)
            prepared, dout = self._prepare_backward(dout, q, k, v, out, lse, backend, deterministic, flip)
            self.backwards[choice] = prepared  # a race stores an equal value twice
        elif prepared[3]:  # a fresh contiguous copy: the layout the launches were prepared for
            dout = dout_copy(dout.transpose(1, 2) if flip else dout)
        launches, layouts, dq_scale, _ = prepared
        device = q.device
        stats, dq, dk, dv = (_buffer(layout, device) for layout in layouts)
        tensors = (dout, q, k, v, out, lse, stats, dq, dk, dv)
        for launch_one in launches:
            launch_one(tensors)
        return finish_dq(dq, q, dq_scale), dk, dv

    def _prepare_backward(self, dout, q, k, v, out, lse, backend: str | None, deterministic: bool,
                          flip: bool) -> tuple:
        """((launches, buffer layouts, dQ's scale, whether dout is copied) for a dout laid
        out like this one, and the dout planning read: its copy, or a view of ``dout``);
        planning reads flash-attn's layout, so a flipped call's tensors are viewed in it here
        (the launches read only pointers, so either view serves)."""
        c = self.call
        if flip:
            dout, q, k, v, out = (t.transpose(1, 2) for t in (dout, q, k, v, out))
        ready = backward_dout(c, dout, self.pad_head)
        chosen = backend or choose_backend(trim_keys(c), deterministic, q.device)  # the cell the plans solve
        buffers = backward_buffers(c, q, k, v, chosen, deterministic)[:4]
        plans = backward_plans(c, ready, q, k, v, out, lse, *buffers, None, chosen, deterministic)
        zeroed = zeroed_rows(c, chosen, deterministic)  # zeroed anew in every call's buffers
        layouts = tuple(_layout(t, zero, i > 0 and flip) for i, (t, zero) in enumerate(zip(buffers, zeroed)))
        scale = accumulated_dq_scale(c, chosen, deterministic)
        return ([_prepare(plan, _BACKWARD_ROLES) for plan in plans], layouts, scale, ready is not dout), ready


def _layout(t: torch.Tensor, zero_from: int | None, flip: bool) -> tuple:
    """``(shape, stride, dtype, zeroing)`` of a backward buffer like ``t``, with dims 1 and 2
    swapped when ``flip`` (the caller's layout of a heads-major entry). ``zero_from``: the
    first row (along the sequence) each fresh buffer zeroes to its end, 0 for all of it;
    None, none."""
    shape, stride = tuple(t.shape), t.stride()
    rows_dim = 1
    if flip:
        shape = (shape[0], shape[2], shape[1], *shape[3:])
        stride = (stride[0], stride[2], stride[1], *stride[3:])
        rows_dim = 2
    return shape, stride, t.dtype, None if zero_from is None else (rows_dim, zero_from)


def _buffer(layout: tuple, device: torch.device) -> torch.Tensor:
    """A fresh backward buffer of a recorded :func:`_layout`."""
    shape, stride, dtype, zeroing = layout
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if zeroing is not None:
        planning.zero_rows(t, *zeroing)
    return t


class _PlanCache:
    """Launch-plan cache: the hot path of small calls, inference and training alike.

    A call without dropout or bias is decided entirely by its tensors' metadata (shapes,
    strides, dtypes, device, 16-byte alignment) and its arguments; a call that repeats
    those repeats every check's outcome and the whole plan. So the first call goes the
    long way (checks, plans) and stores an :class:`_Entry`; the next ones only allocate
    their outputs and launch with new pointers, under autograd too (the backward's
    launches are prepared on its first run). Buffers are fresh on every call, never
    reused, so CUDA-graph capture of a cached call is safe.
    """

    SIZE = 256

    def __init__(self) -> None:
        self.entries: dict[tuple, _Entry] = {}
        self.lock = threading.Lock()

    @staticmethod
    def key(q, k, v, *flags) -> tuple | None:
        """Hashed only where it is looked up or stored: a key with an unhashable argument
        misses and is not stored (the full path then reports the argument). None for
        tensors without a data pointer (a ``torch.func`` transform's: the checks refuse
        them; catching here costs the hot path nothing, a test of each tensor would not).

        A tensor flag (a 0-d ``scale``) misses: a key would hold the tensor by identity, and a
        value changed in place (a learned temperature) would hit the old value's entry.

        Each flag is keyed with its type (and a window's sides with theirs): ``True == 1``
        and ``2.0 == 2`` in Python, so a value-only key would let ``causal=1`` hit the
        entry of a valid ``causal=True`` call and skip the check that rejects it. Only
        calls that passed the checks are stored, so a hit is a call the checks accept.
        """
        try:
            aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
        except RuntimeError:
            return None
        typed = []
        for f in flags:
            kind = type(f)
            if isinstance(f, torch.Tensor):  # a 0-d scale: hashed by identity, its value may change in place
                return None
            typed.append((kind, tuple([(type(x), x) for x in f])) if kind is tuple or kind is list else (kind, f))
        return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
                q.device, k.device, v.device, aligned, _environment(), tuple(typed))

    def store(self, key: tuple, c: Call, q, k, v, heads_major: bool) -> _Entry:
        entry = _Entry(c, q, k, v, heads_major)
        try:
            hash(key)
        except TypeError:
            return entry
        with self.lock:  # threads may store at once; lookups are plain dict reads
            if len(self.entries) >= self.SIZE:
                self.entries.pop(next(iter(self.entries)))
            self.entries[key] = entry
        return entry

    def run(self, key: tuple | None, q, k, v, backend: str | None, deterministic: bool,
            want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(out, lse) with out in the caller's layout, or None on a miss. ``q, k, v`` in the
        caller's layout: SDPA's ``(B, H, S, D)`` for an entry stored heads-major. Under
        autograd without ``want_lse``, lse is None (:class:`_CachedAttention`)."""
        try:
            entry = self.entries.get(key) if key is not None else None
        except TypeError:  # an unhashable argument
            return None
        if entry is None:
            return None
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            if not want_lse:
                return _apply(_CachedAttention, q, k, v, (entry, backend, deterministic)), None
            if entry.heads_major:  # autograd sees the flash-attn layout the Function was planned for
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out, lse = _apply(_FlashAttention, q, k, v, None, entry.call, entry.heads_major, backend, deterministic,
                              entry)
            return (out.transpose(1, 2) if entry.heads_major else out), lse
        return entry.launch(q, k, v)


_PLANS = _PlanCache()


def _deterministic(value: object) -> bool:
    return check_bool("deterministic", value) or torch.are_deterministic_algorithms_enabled()


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, diagonal: str = "bottom_right", return_lse: bool = False,
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
            last-dim stride; tensors whose rows are 16-byte aligned (pointer, and strides
            multiples of 8) are read without a copy (docs/semantics.md).
        dropout_p: probability of dropping an attention weight (Philox, drawn from torch's
            default generator; :func:`aotattn.dropout_mask` returns the mask a call used).
        softmax_scale: multiplies ``q . k`` before the softmax; default ``1/sqrt(D)``.
            Any finite value up to 2.35e38 in magnitude, zero and negative included.
        causal: ``right = 0`` on the chosen diagonal.
        window_size: ``(left, right)``; -1 leaves a side unbounded.
        diagonal: ``"bottom_right"`` or ``"top_left"``.
        deterministic: bitwise reproducible gradients (no atomics in the backward pass).
            Also on when ``torch.use_deterministic_algorithms(True)`` is in effect.
        return_lse: also return the log-sum-exp (natural log, fp32, ``(B, Hq, Sq)``).
        bias: additive, broadcastable to ``(B, Hq, Sq, Sk)``, added to the scaled scores;
            differentiable (its gradient materialises a ``(B, Hq, Sq, Sk)`` fp32 buffer).
        backend: the backward pass: ``"split"`` (a dK/dV kernel, then a dQ kernel),
            ``"fused"`` (one launch), ``"ws"`` (one warp-specialized launch on sm_90:
            fp16/bf16, head dims 33-256, dense, not deterministic) or None to let
            aotattn choose. For tests and measurement; all compute the same gradients.
        softcap, alibi_slopes, return_attn_probs: flash-attn's, in its positions, so that
            its calls run unchanged: softcap 0 and alibi_slopes None only (pass ALiBi as a
            ``bias``); ``return_attn_probs`` returns ``(out, lse, None)`` as flash-attn does
            without dropout (refused with dropout: see :func:`aotattn.dropout_mask`).

    Returns:
        ``out (B, Sq, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with ``return_lse``, or
        ``(out, lse, None)`` with ``return_attn_probs``.
    """
    key = None
    if (alibi_slopes is not None or return_attn_probs is not False or not isinstance(softcap, _NUMBERS)
            or isinstance(softcap, bool) or softcap != 0):
        return_attn_probs = check_flash_attn_extras(softcap, alibi_slopes, return_attn_probs,
                                                    check_dropout("dropout_p", dropout_p))
        if return_attn_probs:
            check_bool("return_lse", return_lse)
            out, lse = flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, deterministic=deterministic,
                                       diagonal=diagonal, return_lse=True, bias=bias, backend=backend)
            return out, lse, None
    if _cacheable(q, k, v, dropout_p, bias):
        key = _PLANS.key(q, k, v, "flash", softmax_scale, causal, window_size, diagonal, return_lse, deterministic,
                         backend)
        hit = _PLANS.run(key, q, k, v, backend, deterministic or torch.are_deterministic_algorithms_enabled(),
                         bool(return_lse))
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
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None, *,
                           diagonal: str = "bottom_right", return_lse: bool = False, backend: str | None = None):
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
        block_table: flash-attn's paged KV cache: None only.
        Other arguments: as in :func:`flash_attn_func`.

    Returns:
        ``out (total_q, Hq, Dv)``, or ``(out, lse)`` with lse ``(Hq, total_q)`` fp32 with
        ``return_lse``, or ``(out, lse, None)`` with ``return_attn_probs``.
    """
    return_attn_probs = check_flash_attn_extras(softcap, alibi_slopes, return_attn_probs,
                                                check_dropout("dropout_p", dropout_p), block_table)
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=dropout_p,
                     softmax_scale=softmax_scale, causal=causal, window_size=window_size, diagonal=diagonal,
                     read_offsets=not (torch.compiler.is_compiling() or getattr(q, "is_meta", False)))
    return_lse = check_bool("return_lse", return_lse)
    out, lse = _attend(p, q, k, v, None, False, backend, deterministic, None, cu_seqlens_q, cu_seqlens_k)
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, deterministic: bool = False,
                                 backend: str | None = None) -> torch.Tensor:
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention`.

    PyTorch semantics: ``is_causal`` keeps key j for query i iff ``j <= i`` (top-left
    diagonal), whatever the lengths; a float ``attn_mask`` is added to the scaled scores,
    a boolean one keeps positions where it is True. Rows that see no key give 0. In a
    ``torch.autocast`` region it runs in the region's dtype, as PyTorch's does.

    Args:
        query: ``(B, Hq, Sq, D)``; key: ``(B, Hk, Sk, D)``; value: ``(B, Hk, Sk, Dv)``.
            Hk must equal Hq unless ``enable_gqa``. Other ranks from 2 up, ``(..., L, E)``,
            as in PyTorch, with one rank and (past 4) one set of leading dims for all three.
        attn_mask: bool or float, broadcastable to ``(B, Hq, Sq, Sk)``.
        dropout_p: as in :func:`flash_attn_func`.
        is_causal: top-left causal mask.
        scale: default ``1/sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hk.
        deterministic, backend: as in :func:`flash_attn_func` (aotattn's additions).

    Returns:
        ``(B, Hq, Sq, Dv)`` in query's dtype.
    """
    if torch._C._is_any_autocast_enabled():
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    if isinstance(query, torch.Tensor) and query.dim() != 4:
        return _sdpa_any_rank(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                              enable_gqa=enable_gqa, deterministic=deterministic, backend=backend)
    cache_key = None
    if _cacheable(query, key, value, dropout_p, attn_mask):
        cache_key = _PLANS.key(query, key, value, "sdpa", is_causal, scale, enable_gqa, deterministic, backend)
        hit = _PLANS.run(cache_key, query, key, value, backend,
                         deterministic or torch.are_deterministic_algorithms_enabled(), False)
        if hit is not None:
            return hit[0]
    p = check_sdpa(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                   enable_gqa=enable_gqa)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    bias = check_bias("attn_mask", attn_mask, p, query, sdpa_mask=True)
    out, _ = _attend(p, q, k, v, bias, True, backend, deterministic, cache_key)
    return out.transpose(1, 2)


def _sdpa_any_rank(query: torch.Tensor, key: object, value: object, attn_mask: object, **options) -> torch.Tensor:
    """PyTorch's SDPA takes ``(..., L, E)`` of any rank from 2 (heads at dim -3 for GQA):
    lower ranks run as ``(1, ..., L, E)``, higher ones with their leading dims flattened
    into the batch (a float or boolean mask broadcast to them first), and the output
    takes the query's leading dims back. Unlike PyTorch's, q, k and v must share one rank
    and, past 4, one set of leading dims (no broadcasting between them)."""
    tensors = (query, check_tensor("key", key), check_tensor("value", value))
    ranks = [t.dim() for t in tensors]
    if ranks[0] < 2:
        raise ValueError(f"query: expected (..., L, E), at least 2 dimensions, got shape {tuple(query.shape)}")
    if len(set(ranks)) > 1:
        raise ValueError(f"query, key, value: expected one rank, got {ranks[0]}, {ranks[1]}, {ranks[2]} dimensions")
    lead = tuple(query.shape[:-3])
    if ranks[0] < 4:
        pad = (None,) * (4 - ranks[0])
        q4, k4, v4 = (t[pad] for t in tensors)
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dim() < 4:
            attn_mask = attn_mask[(None,) * (4 - attn_mask.dim())]
    else:
        if any(tuple(t.shape[:-3]) != lead for t in tensors):
            raise ValueError(f"query, key, value: expected the same leading dims before (H, L, E), got shapes "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        batch = math.prod(lead)  # not -1: a reshape of 0 elements cannot infer it
        q4, k4, v4 = (t.reshape(batch, *t.shape[-3:]) for t in tensors)
        if isinstance(attn_mask, torch.Tensor):
            full = (*lead, query.shape[-3], query.shape[-2], key.shape[-2])
            try:
                attn_mask = torch.broadcast_to(attn_mask, full).reshape(batch, *full[-3:])
            except RuntimeError:
                raise ValueError(f"attn_mask: expected a shape broadcastable to {full}, got "
                                 f"{tuple(attn_mask.shape)}") from None
    out = scaled_dot_product_attention(q4, k4, v4, attn_mask, **options)
    return out.reshape(*query.shape[:-1], out.shape[-1])


def _autocast(*tensors: object) -> tuple:
    """The arguments as PyTorch's SDPA sees them in a ``torch.autocast`` region of their
    device: it is on autocast's lower-precision list, so floating tensors other than
    float64 (a float ``attn_mask`` too) are cast to the region's dtype."""
    device = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), None)
    if device is None or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


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
    sizes = {"batch": batch, "heads_q": heads_q, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int >= 0, got {type_name(value)}")
        if value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: expected a CPU or CUDA device, got {device!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected a CPU or CUDA device, got {device}")
    check_grid("batch", batch, heads_q, device)  # the attention calls' limits: the mask's kernel has their grid
    check_seqlen("seqlen_q", seqlen_q)
    check_seqlen("seqlen_k", seqlen_k)
    dropout_p = check_dropout("dropout_p", dropout_p)
    if dropout_p == 0.0:
        raise ValueError("dropout_p: expected a float in (0, 1), got 0.0 (a call without dropout keeps everything)")
    seed, offset = philox_state(dropout_p)
    mask = torch.empty((batch, heads_q, seqlen_q, seqlen_k), dtype=torch.int8, device=device)
    launch(dropout_mask_plan(mask, seqlen_q, seqlen_k, heads_q, dropout_p, seed, offset))
    return mask.bool()
