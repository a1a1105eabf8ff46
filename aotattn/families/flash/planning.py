"""Planning: a validated call becomes launch plans, bound to the kernels' declarations by name.

The layer between the checks and the launcher. The public functions (:mod:`.ops`), the
autograd path and the ``torch.compile`` custom ops (:mod:`.custom_ops`) all import it;
it imports neither. A :class:`Call` is one validated call (the :class:`Problem` plus
its tensors' layout and RNG state); ``forward_plan`` and ``backward_plans`` turn it
into :class:`~aotattn.spec.LaunchPlan` s whose arguments are bound by name against the
kernel's :class:`~aotattn.spec.KernelSpec` (a missing or unknown name is an error);
``run_forward`` and ``run_backward`` allocate the outputs and launch them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from aotattn.families.flash import rules
from aotattn.families.flash.checks import Problem, check_backend
from aotattn.runtime import launch
from aotattn.runtime.device import arch_of, multiprocessors
from aotattn.spec import VARIANTS, Config, Functional, KernelSpec, LaunchPlan

LOG2E = 1.0 / math.log(2.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def philox_state(dropout_p: float) -> tuple[int, int]:
    """(seed, offset) of one dropout call, drawn from torch's default generator.

    ``torch.manual_seed`` therefore reproduces every mask; :func:`dropout_mask_plan`'s
    caller draws the same way, so with the generator in the same state it gets the
    call's mask.
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
        if self.bias is None:
            bias = rules.BIAS_NONE
        else:
            bias = rules.BIAS_GRAD if backward and self.bias_grad else rules.BIAS_ADD
        return {
            "dtype": rules.DTYPES[p.dtype],
            "BLOCK_D": bucket,
            "BLOCK_DV": bucket,
            # unpadded functionals assume 16-aligned tiles, padded ones rows of 16 bytes (rules._variant_of)
            "PAD_HEAD": p.head_dim != bucket or p.head_dim_v != bucket or not self.aligned,
            "MASK": rules.kernel_mask(p.mask, p.varlen, p.seqlen_q, p.seqlen_k),
            "VARLEN": p.varlen,
            "DROPOUT": p.dropout_p > 0.0,
            "BIAS": bias,
        }

    def tiles_aligned(self, *tensors: torch.Tensor, unit: int | None = None) -> bool:
        """Whether every tensor's pointer is 16-byte aligned and its (batch, head, row)
        strides are multiples of ``unit`` elements: TILE_UNIT (the default) for the
        unpadded variants, ROW_UNIT (rows of 16 bytes) for the padded ones."""
        return _tiles_aligned(self.p.varlen, tensors, TILE_UNIT if unit is None else unit)

    def rows(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, row) strides of q/k/v-like tensors: (B, S, H, D), or (T, H, D) under varlen."""
        return _rows(self.p.varlen, t)

    def tile_strides(self, kernel: KernelSpec, **tensors: torch.Tensor) -> dict[str, int]:
        """The (batch, head, row) stride arguments of q/k/v-like tensors, by the kernel's names."""
        bound: dict[str, int] = {}
        for name, t in tensors.items():
            bound.update(kernel.strides(name, self.rows(t)))
        return bound

    def lse_strides(self, kernel: KernelSpec, lse: torch.Tensor) -> dict[str, int]:
        """``lse`` is ``(B, Hq, Sq)``, or ``(Hq, total_q)`` under varlen."""
        return kernel.strides("l", (0, lse.stride(0)) if self.p.varlen else (lse.stride(0), lse.stride(1)))

    def stats_strides(self, kernel: KernelSpec, stats: torch.Tensor) -> dict[str, int]:
        """(batch, head, plane) strides of the backward's :func:`row_stats`."""
        if self.p.varlen:
            return kernel.strides("s", (0, stats.stride(1), stats.stride(0)))
        return kernel.strides("s", (stats.stride(1), stats.stride(2), stats.stride(0)))

    def sequences(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self.p.varlen:
            return {"CuSeqlensQ": self.cu_seqlens_q, "CuSeqlensK": self.cu_seqlens_k}
        unused = torch.empty(0, dtype=torch.int32, device=device)
        return {"CuSeqlensQ": unused, "CuSeqlensK": unused}

    def bias_args(self, kernel: KernelSpec, like: torch.Tensor) -> dict:
        """``Bias`` and its strides; without a bias, any pointer (never read) and zeros."""
        if self.bias is None:
            return {"Bias": like, **kernel.strides("b", (0, 0, 0, 0))}
        return {"Bias": self.bias, **kernel.strides("b", self.bias.stride())}

    def scalars(self, backward: bool = False) -> dict:
        """Sizes, scales, window and dropout: the scalar arguments of the attention kernels."""
        p = self.p
        left, right = p.kernel_window()
        values = {
            "max_seqlen_q": p.seqlen_q, "max_seqlen_k": p.seqlen_k, "num_heads_q": p.heads_q,
            "group_size": p.group_size, "head_dim": p.head_dim, "head_dim_v": p.head_dim_v,
            "qk_scale": p.softmax_scale * LOG2E, "window_left": left, "window_right": right,
            "dropout_threshold": dropout_threshold(p.dropout_p), "dropout_scale": 1.0 / (1.0 - p.dropout_p),
            "philox_seed": self.seed, "philox_offset": self.offset,
        }
        if backward:
            values["sm_scale"] = p.softmax_scale
        return values


# the stride units (elements) the variants assume (rules._variant_of): 16-aligned tiles
# (unpadded heads), rows of 16 bytes at 16 bits (padded heads)
TILE_UNIT, ROW_UNIT = VARIANTS["aligned"], VARIANTS["aligned8"]


def _rows(varlen: bool, t: torch.Tensor) -> tuple[int, int, int]:
    if varlen:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(2), t.stride(1)


def _tiles_aligned(varlen: bool, tensors, unit: int) -> bool:
    return all(t.data_ptr() % 16 == 0 and all(s % unit == 0 for s in _rows(varlen, t)) for t in tensors)


def servable(p: Problem, *tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], bool]:
    """q/k/v-like tensors as the kernels can read them, and whether any had to be copied.

    Every kernel assumes at least rows of 16 bytes (rules._variant_of): a pointer 16-byte
    aligned and batch, head and row strides that are multiples of 8 elements, which any
    contiguous layout with head dims that are multiples of 8 has (the operators pad the
    others, ops._attend). A tensor without them (a view at an odd offset, a row stride of
    an odd number of elements) is replaced by a contiguous copy, differentiably. Head dims
    that are not multiples of 8 raise: the caller pads them to the bucket first."""
    if p.head_dim % ROW_UNIT or p.head_dim_v % ROW_UNIT:
        raise ValueError(f"head dims {p.head_dim}/{p.head_dim_v} are not multiples of {ROW_UNIT}: pad them to "
                         "their bucket first (ops._attend does)")
    copied = tuple(t if _tiles_aligned(p.varlen, (t,), ROW_UNIT) else t.clone(memory_format=torch.contiguous_format)
                   for t in tensors)
    return copied, any(a is not b for a, b in zip(copied, tensors))


def dropout_threshold(dropout_p: float) -> int:
    """Keep an element when its 16-bit draw is >= this (:func:`.kernels.common.dropout_draws`):
    ``dropout_p * 2**16`` rounded, so the kept fraction is within 2**-17 of ``1 - dropout_p``."""
    return min(round(dropout_p * 2.0**16), 2**16)


def new_call(p: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
             cu_q: torch.Tensor | None = None, cu_k: torch.Tensor | None = None, *, bias_grad: bool | None = None,
             rng: tuple[int, int] | None = None) -> Call:
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
        if not c.tiles_aligned(q, k, v, unit=ROW_UNIT):  # the kernels would read misaligned vectors
            raise ValueError("q, k or v is not 16-byte aligned in its rows (pointer, or a stride not a multiple of "
                             f"{ROW_UNIT}): pass the tensors through planning.servable first")
    return c


def _plan(kernel: KernelSpec, functional: Mapping, p: Problem, device: torch.device, config: Config | None,
          grid: Callable[[Config], tuple[int, int, int]], args: dict) -> LaunchPlan:
    functional = kernel.canonical_functional(functional)
    if config is None:
        config = rules.config_for(kernel, functional, device, **p.tuning_sizes)
    return LaunchPlan(kernel, kernel.compiled_functional(functional), config, grid(config), kernel.bind(**args))


def lse_shape(p: Problem, q: torch.Tensor) -> tuple[int, ...]:
    return (p.heads_q, q.shape[0]) if p.varlen else (p.batch, p.heads_q, p.seqlen_q)


STATS_ROWS = 128  # every backward BLOCK_M divides it: a block of rows never runs past the stats


def row_stats(p: Problem, q: torch.Tensor) -> torch.Tensor:
    """The backward's per-row scratch (kernels/backward.py): ``(2, B, Hq, Sq rounded up to
    128)``, or ``(2, Hq, total_q rounded up to 16)`` under varlen; plane 0 delta, plane 1
    lse in base 2, written by the preprocess (fused backend) or the dQ kernel (split).
    Rounded so that every row, head and plane starts 16-aligned (vectorized loads) and,
    without varlen, a block of query rows never reads past it (loads without a mask; the
    writer fills the padding)."""
    if p.varlen:
        shape = (2, p.heads_q, _cdiv(q.shape[0], 16) * 16)
    else:
        shape = (2, p.batch, p.heads_q, _cdiv(p.seqlen_q, STATS_ROWS) * STATS_ROWS)
    return torch.empty(shape, dtype=torch.float32, device=q.device)


def new_output(p: Problem, q: torch.Tensor, heads_major: bool) -> torch.Tensor:
    """The output, laid out like q: ``(B, Sq, Hq, Dv)`` (stored ``(B, Hq, Sq, Dv)`` when
    ``heads_major``), or ``(total_q, Hq, Dv)`` under varlen."""
    if p.varlen:
        return torch.empty((q.shape[0], p.heads_q, p.head_dim_v), dtype=q.dtype, device=q.device)
    if heads_major:
        return torch.empty((p.batch, p.heads_q, p.seqlen_q, p.head_dim_v), dtype=q.dtype,
                           device=q.device).transpose(1, 2)
    return torch.empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim_v), dtype=q.dtype, device=q.device)


def _device_arch(device: torch.device) -> str | None:
    return arch_of(device) if device.type == "cuda" else None


def choose_engine(c: Call, device: torch.device, functional: dict | None = None) -> str:
    """The forward's kernel (rules.ENGINES): the ``flash.forward`` table's choice where the
    warp-specialized kernel serves the call on the device's architecture (rules.ws_serves),
    else ``triton``. On CPU tensors the table is the interpreter's (triton).
    ``functional``: the call's, when the caller has it at hand."""
    functional = c.functional() if functional is None else functional
    if not rules.ws_serves(functional, _device_arch(device)):
        return "triton"  # the table of another architecture than the kernel's included
    return rules.config_for(rules.FORWARD, Functional.of(functional), device, **c.p.tuning_sizes)["engine"]


def forward_plan(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, config: Config | None = None, engine: str | None = None) -> LaunchPlan:
    """Plan of the forward kernel; ``lse`` is ``(B, Hq, Sq)``, or ``(Hq, total_q)`` under varlen.

    ``engine`` (rules.ENGINES): which kernel; None, the table's choice (:func:`choose_engine`),
    or ``triton`` when a ``config`` is given without one (a configuration names one kernel's knobs)."""
    p, functional = c.p, c.functional()
    if engine is None:
        engine = "triton" if config is not None else choose_engine(c, q.device, functional)
    if engine == "ws":
        kernel = rules.ATTN_FWD_WS
        arch = _device_arch(q.device)
        if not rules.ws_serves(functional, arch):
            raise ValueError(f"engine 'ws': {kernel.qualname} does not serve this call ({Functional.of(functional)}"
                             f"{' on ' + arch if arch else ''}); engine='triton' serves every call")
        left, right = p.kernel_window()
        args = dict(Q=q, K=k, V=v, Out=out, Lse=lse, **c.tile_strides(kernel, q=q, k=k, v=v, o=out),
                    **c.lse_strides(kernel, lse), max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k, batch=p.batch,
                    num_heads_q=p.heads_q, group_size=p.group_size, qk_scale=p.softmax_scale * LOG2E,
                    window_left=left, window_right=right, head_dim=p.head_dim, head_dim_v=p.head_dim_v)
    elif engine == "triton":
        kernel = rules.ATTN_FWD
        args = dict(Q=q, K=k, V=v, Out=out, Lse=lse, **c.sequences(q.device), **c.bias_args(kernel, q),
                    **c.tile_strides(kernel, q=q, k=k, v=v, o=out), **c.lse_strides(kernel, lse), **c.scalars())
    else:
        raise ValueError(f"engine: expected one of {', '.join(rules.ENGINES)}, got {engine!r}")
    return _plan(kernel, functional, p, q.device, config, lambda cfg: _forward_grid(p, cfg, q.device), args)


def _tile_grid(blocks: int, heads: int, batch: int, cfg: Config, device: torch.device) -> tuple[int, int, int]:
    """(blocks, heads, B): a program per tile; with a ws kernel's PERSISTENT knob, a program
    per SM (at most one per tile) walking the tiles (kernels/forward_ws.py, backward_ws.py)."""
    if cfg.as_dict().get("PERSISTENT", 0):
        tiles = blocks * heads * batch
        return (min(tiles, multiprocessors(device) or tiles), 1, 1)
    return (blocks, heads, batch)


def _forward_grid(p: Problem, cfg: Config, device: torch.device) -> tuple[int, int, int]:
    """Tiles of BLOCK_M query rows of one query head (:func:`_tile_grid`)."""
    return _tile_grid(_cdiv(p.seqlen_q, cfg["BLOCK_M"]), p.heads_q, p.batch, cfg, device)


def run_forward(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                config: Config | None = None, engine: str | None = None) -> torch.Tensor:
    """Run the forward pass into ``out``; returns the log-sum-exp."""
    lse = torch.empty(lse_shape(c.p, q), dtype=torch.float32, device=q.device)
    launch(forward_plan(c, q, k, v, out, lse, config, engine))
    return lse


def visible_keys(c: Call) -> int:
    """How many leading keys some query sees: ``seqlen_k`` but under a top-left window whose
    right side ends before the keys do (SDPA's ``is_causal`` with fewer queries than keys:
    no row sees a key past ``seqlen_q - 1 + window_right``). Not under varlen (each sequence
    has its own lengths) or dropout (the keep-mask's draws are indexed by ``seqlen_k``)."""
    p = c.p
    if p.mask != rules.MASK_TOP_LEFT or p.varlen or p.dropout_p > 0.0 or p.window_right < 0 or p.seqlen_q == 0:
        return p.seqlen_k
    return min(p.seqlen_k, p.seqlen_q + p.window_right)


def trim_keys(c: Call) -> Call:
    """The call over only the keys some query sees (:func:`visible_keys`): what
    :func:`backward_plans` solve, and whose cell their callers choose the backend by. Its
    kernels launch no program for a block of keys no row sees, whose dK and dV are zero
    (:func:`backward_buffers` zeroes them), and look up the tuned cells of the problem they
    actually solve (a top-left causal call of Sq < Sk is a causal Sq x Sq one). Its tensors
    are views of the leading keys: same pointers and strides as the whole."""
    keys = visible_keys(c)
    return c if keys == c.p.seqlen_k else dataclasses.replace(c, p=dataclasses.replace(c.p, seqlen_k=keys))


def backward_plans(c: Call, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor, dq: torch.Tensor,
                   dk: torch.Tensor, dv: torch.Tensor, dbias: torch.Tensor | None, backend: str,
                   deterministic: bool, configs: Mapping[str, Config] | None = None) -> list[LaunchPlan]:
    """The launches of one backward pass, in order: split, dQ (which also writes the
    stats) then dK/dV; fused and ws, the preprocess (the stats) then the one kernel. They
    solve the call over the keys some query sees (:func:`trim_keys`).

    With ``backend="ws"``, or ``"fused"`` and not ``deterministic``, ``dq`` must be a zeroed
    fp32 buffer that the kernel accumulates dS K into (:func:`dq_accumulates`; dQ is
    ``finish_dq(dq, q, accumulated_dq_scale(c, backend, deterministic))``).
    """
    if check_backend(backend) is None:
        raise ValueError("backend: backward_plans needs a backend, got None")
    configs = configs or {}
    trimmed = trim_keys(c)  # only the keys some query sees (the others' dK/dV: backward_buffers)
    if trimmed is not c:
        c, keys = trimmed, trimmed.p.seqlen_k
        k, v, dk, dv = k[:, :keys], v[:, :keys], dk[:, :keys], dv[:, :keys]
    p = c.p
    f = c.functional(backward=True)
    dev = q.device

    def args(kernel: KernelSpec, **outputs: torch.Tensor) -> dict:
        """What every backward kernel reads, plus the gradients it writes (and their strides)."""
        bound = dict(Q=q, K=k, V=v, DO=dout, Stats=stats, **c.sequences(dev), **c.bias_args(kernel, q),
                     **c.tile_strides(kernel, q=q, k=k, v=v, do=dout), **c.stats_strides(kernel, stats),
                     **c.scalars(backward=True))
        for name, t in outputs.items():
            if name == "DBias":  # (B, Hq, Sq, Sk) fp32, unit stride along keys; absent: never written
                bound[name] = stats if t is None else t
                bound.update(kernel.strides("db", (0, 0, 0) if t is None else t.stride()[:3]))
            else:
                bound[name] = t
                bound.update(kernel.strides(name.lower(), c.rows(t)))
        return bound

    if backend == "ws":
        arch = _device_arch(dev)
        if not rules.ws_backward_serves(f, arch, deterministic):
            raise ValueError(f"backend 'ws': {rules.ATTN_BWD_WS.qualname} does not serve this call "
                             f"({Functional.of(f)}{', deterministic' if deterministic else ''}"
                             f"{' on ' + arch if arch else ''}); backend='split' serves every call")
    if backend == "split":
        dkdv, dq_kernel = rules.ATTN_BWD_DKDV, rules.ATTN_BWD_DQ
        # dQ first: its programs compute the stats of their rows, which dK/dV reads (without
        # varlen the last block of rows also fills the padding, up to stats_rows)
        return [_plan(dq_kernel, f, p, dev, configs.get(dq_kernel.name),
                      lambda cfg: (_cdiv(p.seqlen_q, cfg["BLOCK_M"]), p.heads_q, p.batch),
                      dict(args(dq_kernel, DQ=dq, DBias=dbias), Out=out, Lse=lse, stats_rows=stats.shape[-1],
                           **c.tile_strides(dq_kernel, o=out), **c.lse_strides(dq_kernel, lse))),
                _plan(dkdv, f, p, dev, configs.get(dkdv.name),
                      lambda cfg: (_cdiv(p.seqlen_k, cfg["BLOCK_N"]), p.heads_k, p.batch),
                      args(dkdv, DK=dk, DV=dv))]
    # the preprocess is aligned exactly when the attention kernels are (dout was checked for it)
    pre = rules.ATTN_BWD_PREPROCESS
    pre_f = {"dtype": f["dtype"], "BLOCK_DV": f["BLOCK_DV"], "PAD_HEAD": f["PAD_HEAD"], "VARLEN": p.varlen}
    # without varlen the preprocess fills every row of the stats, their padding too
    stats_rows = p.seqlen_q if p.varlen else stats.shape[-1]
    plans = [_plan(pre, pre_f, p, dev, configs.get(pre.name),
                   lambda cfg: (_cdiv(stats_rows, cfg["BLOCK_M"]), p.heads_q, p.batch),
                   dict(Out=out, DO=dout, Lse=lse, Stats=stats, CuSeqlensQ=c.sequences(dev)["CuSeqlensQ"],
                        **c.tile_strides(pre, o=out, do=dout), **c.lse_strides(pre, lse),
                        **c.stats_strides(pre, stats), max_seqlen_q=p.seqlen_q, head_dim_v=p.head_dim_v))]
    if backend == "ws":
        ws = rules.ATTN_BWD_WS
        scalars = c.scalars(backward=True)
        bound = dict(Q=q, K=k, V=v, DO=dout, DQ=dq, DK=dk, DV=dv, Stats=stats,
                     **c.tile_strides(ws, q=q, k=k, v=v, do=dout, dq=dq, dk=dk, dv=dv), **c.stats_strides(ws, stats),
                     **{arg.name: scalars[arg.name] for arg in ws.arguments if arg.name in scalars}, batch=p.batch)
        plans.append(_plan(ws, ws_functional(c), p, dev, configs.get(ws.name),
                           lambda cfg: _ws_backward_grid(p, cfg, dev), bound))
        return plans
    fused = rules.ATTN_BWD_FUSED

    def grid(cfg: Config) -> tuple[int, int, int]:
        programs = _cdiv(p.seqlen_k, cfg["BLOCK_N"])
        if deterministic:
            programs += p.group_size * _cdiv(p.seqlen_q, cfg["BLOCK_M"])
        return programs, p.heads_k, p.batch

    plans.append(_plan(fused, {**f, "ATOMIC_DQ": not deterministic}, p, dev, configs.get(fused.name), grid,
                       args(fused, DQ=dq, DK=dk, DV=dv, DBias=dbias)))
    return plans


def ws_functional(c: Call) -> Functional:
    """The warp-specialized backward's functional of a call: the backward kernels', whether
    it has fewer key/value heads than query heads (``GROUPED``) and more than
    ``rules.GROUP_WIDTH`` query heads a key head (``WIDE_GROUPS``, a table axis), each
    named when True."""
    group = c.p.group_size
    return rules.ATTN_BWD_WS.canonical_functional({**c.functional(backward=True), "GROUPED": group > 1,
                                                   "WIDE_GROUPS": rules.wide_groups(group)})


def _ws_backward_grid(p: Problem, cfg: Config, device: torch.device) -> tuple[int, int, int]:
    """Tiles of BLOCK_N keys of one key/value head (:func:`_tile_grid`)."""
    return _tile_grid(_cdiv(p.seqlen_k, cfg["BLOCK_N"]), p.heads_k, p.batch, cfg, device)


def choose_backend(c: Call, deterministic: bool, device: torch.device) -> str:
    """The backend when the caller names none: the ``flash.backward`` table's choice on GPUs."""
    if device.type == "cpu":
        return "split"
    kernel_functional = c.functional(backward=True)
    functional = rules.operator_functional(kernel_functional, deterministic, c.p.group_size > 1)
    backend = rules.config_for(rules.BACKWARD, functional, device, **c.p.tuning_sizes)["backend"]
    if backend == "ws" and not rules.ws_backward_serves(kernel_functional, _device_arch(device), deterministic):
        return "split"  # the table of another architecture than the kernel's, or a cell it does not serve
    return backend


def backward_dout(c: Call, dout: torch.Tensor, pad_head: bool | None = None) -> torch.Tensor:
    """``dout`` as the backward kernels read it: a contiguous copy where its layout would not
    meet the call's variant (unit last stride; tiles aligned to its unit, Call.tiles_aligned).
    ``pad_head``: the call's PAD_HEAD, when the caller has it at hand (the plan cache)."""
    if pad_head is None:
        pad_head = c.functional()["PAD_HEAD"]
    if dout.stride(-1) != 1 or not c.tiles_aligned(dout, unit=ROW_UNIT if pad_head else TILE_UNIT):
        return dout_copy(dout)
    return dout


def dout_copy(dout: torch.Tensor) -> torch.Tensor:
    """The copy :func:`backward_dout` makes (and a cached backward repeats where its first
    call made one): a fresh contiguous tensor meets the variant's assumptions, a view at an
    odd offset does not."""
    return dout.clone(memory_format=torch.contiguous_format)


def dq_accumulates(backend: str, deterministic: bool) -> bool:
    """Whether dQ is accumulated with atomics into a zeroed fp32 buffer (the ws backend, and
    the fused one without ``deterministic``)."""
    return backend == "ws" or (backend == "fused" and not deterministic)


def backward_buffers(c: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
                     deterministic: bool) -> tuple[torch.Tensor, ...]:
    """(stats, dq, dk, dv, dbias or None), fresh: the backward kernels' outputs (the stats:
    :func:`row_stats`), for the whole call ``c``, with the dK and dV of keys no query sees
    zeroed (:func:`trim_keys`: the plans never write them).

    The fused backend without ``deterministic`` and the ws one accumulate dQ unscaled into
    a zeroed fp32 buffer (:func:`finish_dq` scales and converts it)."""
    p, dev = c.p, q.device
    dk = torch.empty(tuple(k.shape), dtype=k.dtype, device=dev)
    dv = torch.empty(tuple(v.shape), dtype=v.dtype, device=dev)
    stats = row_stats(p, q)
    dq_dtype = torch.float32 if dq_accumulates(backend, deterministic) else q.dtype
    dq = torch.empty(tuple(q.shape), dtype=dq_dtype, device=dev)
    for t, first in zip((stats, dq, dk, dv), zeroed_rows(c, backend, deterministic)):
        if first is not None:
            zero_rows(t, 1, first)
    dbias = None
    if c.bias_grad:
        # tiles outside the mask are skipped, never written: their gradient is exactly 0
        dbias = torch.zeros((p.batch, p.heads_q, p.seqlen_q, p.seqlen_k), dtype=torch.float32, device=dev)
    return stats, dq, dk, dv, dbias


def zeroed_rows(c: Call, backend: str, deterministic: bool) -> tuple[int | None, ...]:
    """For each backward buffer (stats, dq, dk, dv): the first row along the sequence from
    which a fresh one must be zeroed (0: all of it), or None. An accumulated dQ
    (:func:`dq_accumulates`) is zeroed whole; the dK/dV of keys no query sees, which the
    trimmed call's kernels never write (:func:`trim_keys`), from the first of them."""
    keys = visible_keys(c)
    tail = keys if keys < c.p.seqlen_k else None
    return None, 0 if dq_accumulates(backend, deterministic) else None, tail, tail


def zero_rows(t: torch.Tensor, dim: int, first: int) -> None:
    """Zero the rows ``first:`` along ``dim`` of a fresh dense buffer ``t``; rows before
    ``first`` may be zeroed too (the kernels overwrite them).

    The rows are one block of memory only when every dimension laid out outside ``dim`` has
    one index; otherwise the fill strides, and a strided fill runs at under half the speed
    of a dense one (on the H200, 1.55 TB/s: the dK/dV tails of a top-left Sq 512 x Sk 4096
    call, B32 H16 D128, took 0.30 ms each). So a tail of more than half the rows that is not
    one block is zeroed with the whole buffer instead."""
    rows = t.shape[dim]
    if first >= rows:
        return
    outer = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride > t.stride(dim))
    if first > 0 and (outer == 1 or 2 * (rows - first) < rows):
        t.narrow(dim, first, rows - first).zero_()
    else:
        t.zero_()


def accumulated_dq_scale(c: Call, backend: str, deterministic: bool) -> float | None:
    """What :func:`finish_dq` multiplies an accumulated dQ by (:func:`dq_accumulates`): the
    softmax scale and dropout's 1 / (1 - p), which the kernels leave out of its sums. None
    where the kernels write dQ whole."""
    if not dq_accumulates(backend, deterministic):
        return None
    return c.p.softmax_scale / (1.0 - c.p.dropout_p)


def finish_dq(dq: torch.Tensor, q: torch.Tensor, scale: float | None) -> torch.Tensor:
    """dQ in q's dtype and layout. ``scale`` (:func:`accumulated_dq_scale`): None, ``dq`` is
    the kernels' as is; else it holds the fp32 sums of dS K and is multiplied by ``scale``
    into a new tensor, in one pass with the conversion. The scale comes after the sums
    because GPU float atomics and bulk reduce-adds flush subnormal values to zero: with it
    inside, a softmax_scale of 1e-38 made every dQ of the fused backend 0."""
    if scale is None:
        return dq
    return torch.mul(dq, scale, out=torch.empty_like(dq, dtype=q.dtype))


def run_backward(c: Call, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, backend: str | None, deterministic: bool,
                 configs: Mapping[str, Config] | None = None):
    """dQ, dK, dV (contiguous, shaped like q, k, v) and dBias (``(B, Hq, Sq, Sk)`` or None)."""
    dout = backward_dout(c, dout)
    backend = backend or choose_backend(trim_keys(c), deterministic, q.device)  # the cell the plans solve
    stats, dq, dk, dv, dbias = backward_buffers(c, q, k, v, backend, deterministic)
    for plan in backward_plans(c, dout, q, k, v, out, lse, stats, dq, dk, dv, dbias, backend, deterministic,
                               configs):
        launch(plan)
    return finish_dq(dq, q, accumulated_dq_scale(c, backend, deterministic)), dk, dv, dbias


def dropout_mask_plan(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, heads_q: int, dropout_p: float,
                      seed: int, offset: int) -> LaunchPlan:
    """Plan of the kernel writing the keep-mask (int8 ``(B, Hq, Sq, Sk)``) the attention kernels apply."""
    kernel = rules.DROPOUT_MASK
    config = rules.config_for(kernel, Functional.of({}), mask.device)
    args = kernel.bind(Mask=mask, **kernel.strides("m", mask.stride()[:3]), max_seqlen_q=seqlen_q,
                       max_seqlen_k=seqlen_k, num_heads_q=heads_q, dropout_threshold=dropout_threshold(dropout_p),
                       philox_seed=seed, philox_offset=offset)
    return LaunchPlan(kernel, Functional.of({}), config, (_cdiv(seqlen_q, config["BLOCK_M"]), heads_q, mask.shape[0]),
                      args)
