"""Declarative description of the flash-attention kernels.

The build, the runtime, the tuner and the tests read these specs; nothing else repeats
the argument lists, the compile-time axes or the tuning space.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from aotattn import tuning
from aotattn.runtime.device import arch_of
from aotattn.spec import Arg, ChosenBy, Config, Functional, KernelSpec, OperatorSpec

FAMILY = "flash"
# the backward's backends: split (dQ, then dK/dV), fused (one Triton kernel), ws (one
# warp-specialized Gluon kernel, sm_90, atomic dQ: never deterministic)
BACKENDS = ("split", "fused", "ws")
_KERNELS = "aotattn.families.flash.kernels"  # a package, one module per pass
FORWARD_MODULE, FORWARD_WS_MODULE, BACKWARD_MODULE, BACKWARD_WS_MODULE, DROPOUT_MODULE = (
    f"{_KERNELS}.{m}" for m in ("forward", "forward_ws", "backward", "backward_ws", "dropout"))
ENGINES = ("triton", "ws")  # the forward's kernels: attn_fwd (Triton), attn_fwd_ws (Gluon, sm_90)

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

# MASK axis: which diagonal a window (causal included) is aligned to.
MASK_NONE, MASK_TOP_LEFT, MASK_BOTTOM_RIGHT = 0, 1, 2
# BIAS axis: no bias, an additive bias, an additive bias whose gradient is wanted (backward only).
BIAS_NONE, BIAS_ADD, BIAS_GRAD = 0, 1, 2


def kernel_mask(mask: int, varlen: bool, seqlen_q: int, seqlen_k: int) -> int:
    """The MASK variant a call of these lengths runs: a top-left window over equal lengths (no
    varlen) is the bottom-right one (both diagonals are column = row), so it shares that
    variant's images and tuned cells (the tuner times MASK 0 and 2; gpt2's causal forward
    ran a seeded tile at 0.87x SDPA-flash, RESULTS.md, fifth session)."""
    if mask == MASK_TOP_LEFT and not varlen and seqlen_q == seqlen_k:
        return MASK_BOTTOM_RIGHT
    return mask


def head_dim_bucket(head_dim: int) -> int:
    """The compiled head-dim bucket holding ``head_dim`` (next power of two, at least 16)."""
    for bucket in HEAD_DIM_BUCKETS:
        if head_dim <= bucket:
            return bucket
    raise ValueError(f"head dim {head_dim} exceeds {MAX_HEAD_DIM}")


def _unequal_head_buckets(functional: Mapping[str, Any]) -> bool:
    """Q/K and V head dims share one bucket.

    Triton 3.6 miscompiles the ``p @ v`` wgmma when the V bucket is narrower than the
    Q/K one: with BLOCK_D=64, BLOCK_DV=32 on an H200, compute-sanitizer reports
    ``HGMMA.64x32x16 ... tnspB`` reading shared memory out of bounds (wrong results or
    an illegal address, depending on the configuration). Padding both to the bucket of
    max(D, Dv) avoids it and keeps every built variant one the GPU tests cover.
    """
    return functional["BLOCK_D"] != functional["BLOCK_DV"]


def _derive(functional: Mapping[str, Any]) -> dict[str, Any]:
    # fp32 inputs are computed in full fp32 ("ieee"), never tf32
    return {"PRECISION": "ieee" if functional["dtype"] == "fp32" else "tf32"}


def _strides(*names: str) -> tuple[Arg, ...]:
    return tuple(Arg(name, "i64") for name in names)


def _tile_strides(*names: str) -> tuple[Arg, ...]:
    """Batch, head and row strides of q/k/v-like tensors: divisible by the variant's unit (_variant_of)."""
    return tuple(Arg(name, "i64", aligned=True) for name in names)


def _tile(name: str, type_: str = "*{dtype}") -> Arg:
    """A q/k/v-like tensor: 16-byte aligned in every variant (_variant_of)."""
    return Arg(name, type_, aligned=True)


def _variant_of(functional: Mapping[str, Any]) -> str:
    """Every attention functional is built with alignment hints (vectorized, pipelined
    loads). Unpadded heads: 16-byte tile pointers, strides divisible by 16 (and head dims
    equal to the block). Padded heads: 16-byte tile pointers, strides and head dims
    divisible by 8, so that each row is whole 16-byte vectors at 16 bits and the head-dim
    mask is constant over each (the unhinted twin loaded element by element, 2-3x slower).
    The operators copy inputs that meet neither first (planning.servable), as flash-attn
    pads head dims to a multiple of 8."""
    return "aligned8" if functional["PAD_HEAD"] else "aligned"


def _no_bias_under_varlen(functional: Mapping[str, Any]) -> bool:
    return bool(functional.get("VARLEN")) and bool(functional.get("BIAS"))


def _disabled(functional: Mapping[str, Any]) -> bool:
    return _unequal_head_buckets(functional) or _no_bias_under_varlen(functional)


SEQLEN_BUCKETS = tuple(2**i for i in range(4, 15))  # 16 .. 16384
_SEQ_KEYS = (("seqlen_q", SEQLEN_BUCKETS), ("seqlen_k", SEQLEN_BUCKETS))


def _fallback(functional: Mapping[str, Any]) -> dict[str, Any] | None:
    """The simpler twin a table falls back to when it has no block for a functional."""
    f = dict(functional)
    for axis, plain in (("PAD_HEAD", False), ("DROPOUT", False), ("VARLEN", False), ("MASK", MASK_BOTTOM_RIGHT)):
        if axis in f and f[axis] != plain and not (axis == "MASK" and f[axis] == MASK_NONE):
            return {**f, axis: plain}
    return None


def _without_groups(functional: Mapping[str, Any]) -> dict[str, Any] | None:
    """A grouped functional's call without key/value groups (GROUPED=False is left out, the
    axis' default), the first fallback of the tables with a GROUPED axis; None if not grouped."""
    return _dropped(functional, "GROUPED")


def _dropped(functional: Mapping[str, Any], axis: str) -> dict[str, Any] | None:
    """``functional`` without ``axis`` (at its default, False) where it has it True, else None."""
    if functional.get(axis):
        return {name: value for name, value in functional.items() if name != axis}
    return None


def _derive_fused(functional: Mapping[str, Any]) -> dict[str, Any]:
    # atomics accumulate dQ in a zeroed fp32 buffer; otherwise dQ is written in place
    return {**_derive(functional), "dq_type": "fp32" if functional["ATOMIC_DQ"] else functional["dtype"]}


_I32, _I64, _F32 = "i32", "i64", "fp32"
_SEQUENCES = (Arg("CuSeqlensQ", "*i32"), Arg("CuSeqlensK", "*i32"))
_QKV_DO_STRIDES = _tile_strides("stride_qz", "stride_qh", "stride_qm", "stride_kz", "stride_kh", "stride_kn",
                           "stride_vz", "stride_vh", "stride_vn", "stride_doz", "stride_doh", "stride_dom")
_DKDV_STRIDES = _tile_strides("stride_dkz", "stride_dkh", "stride_dkn", "stride_dvz", "stride_dvh", "stride_dvn")
_DQ_STRIDES = _tile_strides("stride_dqz", "stride_dqh", "stride_dqm")
_LSE_STRIDES = _strides("stride_lz", "stride_lh")
# the backward's per-row scratch (planning.row_stats): 16-aligned by construction, so its
# hints hold in every call of the aligned variant; (batch, head, plane) strides
_STATS = Arg("Stats", "*fp32", aligned=True)
_STATS_STRIDES = _tile_strides("stride_sz", "stride_sh", "stride_sp")
_BIAS_STRIDES = _strides("stride_bz", "stride_bh", "stride_bm", "stride_bn")
_DBIAS_STRIDES = _strides("stride_dbz", "stride_dbh", "stride_dbm")
# head dims: the block (unpadded) or multiples of 8 (padded), see _variant_of
_SIZES = (Arg("max_seqlen_q", _I32), Arg("max_seqlen_k", _I32), Arg("num_heads_q", _I32),
          Arg("group_size", _I32), Arg("head_dim", _I32, aligned=True), Arg("head_dim_v", _I32, aligned=True))
_DROPOUT = (Arg("dropout_threshold", _I64), Arg("dropout_scale", _F32), Arg("philox_seed", _I64),
            Arg("philox_offset", _I64))
_BWD_SCALARS = (*_SIZES, Arg("sm_scale", _F32), Arg("qk_scale", _F32), Arg("window_left", _I32),
                Arg("window_right", _I32), *_DROPOUT)
_COMMON_AXES = (
    ("dtype", ("fp16", "bf16", "fp32")),
    ("BLOCK_D", HEAD_DIM_BUCKETS),
    ("BLOCK_DV", HEAD_DIM_BUCKETS),
    ("PAD_HEAD", (False, True)),
    ("MASK", (MASK_NONE, MASK_TOP_LEFT, MASK_BOTTOM_RIGHT)),
    ("VARLEN", (False, True)),
    ("DROPOUT", (False, True)),
)
_FWD_AXES = _COMMON_AXES + (("BIAS", (BIAS_NONE, BIAS_ADD)),)
_BWD_AXES = _COMMON_AXES + (("BIAS", (BIAS_NONE, BIAS_ADD, BIAS_GRAD)),)
_TUNING = (
    ("BLOCK_M", (16, 32, 64, 128)),
    ("BLOCK_N", (16, 32, 64, 128)),
    ("num_warps", (1, 2, 4, 8)),
    ("num_stages", (1, 2, 3, 4)),
)
# The forward's knobs beyond the tiles (kernels/forward.py), each 0 where a configuration
# leaves it out: OVERLAP=1 issues each interior key block's scores one block ahead of its
# softmax; TMA=1 loads K, TMA=2 K and V, through tensor descriptors (padded heads: spanning the real head dim).
_FWD_TUNING = _TUNING + (("OVERLAP", (0, 1)), ("TMA", (0, 1, 2)))
_FWD_KNOB_DEFAULTS = (("OVERLAP", 0), ("TMA", 0))
# The split backward's: TMA=1 streams its loop's tiles (dQ: K and V; dK/dV: q and dO)
# through tensor descriptors (kernels/backward.py).
_BWD_TUNING = _TUNING + (("TMA", (0, 1)),)
_BWD_KNOB_DEFAULTS = (("TMA", 0),)


def _split_calls(functional: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The backward operator's functionals whose split backend runs this dK/dV or dQ kernel."""
    return [operator_functional(functional, deterministic, grouped).as_dict()
            for deterministic in (False, True) for grouped in (False, True)]


def _fused_calls(functional: Mapping[str, Any]) -> list[dict[str, Any]]:
    """... whose fused backend runs this fused kernel (atomic dQ unless deterministic)."""
    return [operator_functional(functional, not functional["ATOMIC_DQ"], grouped).as_dict()
            for grouped in (False, True)]


_SPLIT = ChosenBy("flash.backward", "backend", "split", _split_calls)
_FUSED = ChosenBy("flash.backward", "backend", "fused", _fused_calls)


def _attention_kernel(name: str, module: str, arguments: tuple[Arg, ...], functionals,
                      derive=_derive, chosen_by: ChosenBy | None = None, tuning_space=_TUNING,
                      knob_defaults=()) -> KernelSpec:
    """An attention kernel: the flash tuning space, keys, fallbacks and alignment rule."""
    return KernelSpec(family=FAMILY, name=name, module=module, function=name, arguments=arguments,
                      functionals=functionals, tuning_space=tuning_space, derive=derive, disabled=_disabled,
                      tuning_keys=_SEQ_KEYS, fallback=_fallback, variant_of=_variant_of, chosen_by=chosen_by,
                      knob_defaults=knob_defaults)


ATTN_FWD = _attention_kernel(
    "attn_fwd", FORWARD_MODULE,
    (
        _tile("Q"), _tile("K"), _tile("V"),
        _tile("Out"), Arg("Lse", "*fp32"), *_SEQUENCES, Arg("Bias", "*{dtype}"),
        *_tile_strides("stride_qz", "stride_qh", "stride_qm", "stride_kz", "stride_kh", "stride_kn",
                       "stride_vz", "stride_vh", "stride_vn", "stride_oz", "stride_oh", "stride_om"),
        *_LSE_STRIDES, *_BIAS_STRIDES, *_SIZES,
        Arg("qk_scale", _F32), Arg("window_left", _I32), Arg("window_right", _I32), *_DROPOUT,
    ),
    _FWD_AXES,
    tuning_space=_FWD_TUNING,
    knob_defaults=_FWD_KNOB_DEFAULTS,
)


def _ws_unserved(functional: Mapping[str, Any]) -> bool:
    """What the warp-specialized forward does not compute (kernels/forward_ws.py): fp32,
    head buckets below 64 (not built: small heads stay with the Triton kernel), unequal
    head buckets, varlen, dropout, a bias. Those calls run attn_fwd whatever the forward
    table says. Padded heads it computes: its descriptors span the real head dims."""
    return (functional["dtype"] == "fp32" or functional["BLOCK_D"] < 64 or _unequal_head_buckets(functional)
            or functional["VARLEN"] or functional["DROPOUT"] or functional["BIAS"] != BIAS_NONE)


def _ws_calls(functional: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The forward operator's functionals whose ``ws`` choice runs this kernel functional
    (the two tables share their axes)."""
    return [dict(functional)]


# The warp-specialized forward (Gluon, sm_90 only): BLOCK_M rows per program, 64 per
# consumer warpgroup (128: two, 192: three); BLOCK_N keys per step; STAGES slots in each
# of the K and V rings; PINGPONG, the consumers take turns issuing their products;
# PERSISTENT, one program per SM walks the tiles, costliest first (planning.forward_plan's grid;
# 2: under a mask, short sequences in sections of a few heads, kernels/forward_ws._decode);
# Q_SLOTS, the Q tiles a consumer holds (2: the next tile's Q loads a tile ahead; PERSISTENT only);
# TMA_STORE, the output leaves through a shared staging tile and a bulk copy.
_WS_TUNING = (
    ("BLOCK_M", (128, 192)),
    ("BLOCK_N", (32, 64, 128)),
    ("STAGES", (2, 3, 4)),
    ("PINGPONG", (0, 1)),
    ("PERSISTENT", (0, 1, 2)),
    ("Q_SLOTS", (1, 2)),
    ("TMA_STORE", (0, 1)),
    ("num_warps", (4,)),
    ("num_stages", (1,)),
)
_WS_KNOB_DEFAULTS = (("PERSISTENT", 0), ("Q_SLOTS", 1), ("TMA_STORE", 0))

def _ws_kernel(name: str, module: str, arguments: tuple[Arg, ...], functionals, tuning_space,
               unserved, chosen_by: ChosenBy, knob_defaults=(), axis_defaults=(), fallback=None,
               table_axes=()) -> KernelSpec:
    """A warp-specialized Gluon kernel for sm_90, run only where its operator table chooses
    it; ``unserved(functional)``: what it does not compute (those calls run a Triton kernel)."""
    return KernelSpec(family=FAMILY, name=name, module=module, function=name, arguments=arguments,
                      functionals=functionals, tuning_space=tuning_space,
                      disabled=lambda f: _disabled(f) or unserved(f), tuning_keys=_SEQ_KEYS,
                      fallback=fallback or _fallback, variant_of=_variant_of, chosen_by=chosen_by,
                      knob_defaults=knob_defaults, axis_defaults=axis_defaults, language="gluon", archs=("sm_90",),
                      table_axes=table_axes)


def _ws_computes(kernel: KernelSpec, functional: Mapping[str, Any], arch: str | None) -> bool:
    """Whether ``kernel`` computes ``functional`` on ``arch`` (None: on the architectures it
    has; CPU tensors planned for a GPU's tables, the tuner's tasks)."""
    return (arch is None or kernel.runs_on(arch)) and not kernel.disabled(functional)


ATTN_FWD_WS = _ws_kernel(
    "attn_fwd_ws", FORWARD_WS_MODULE,
    (
        _tile("Q"), _tile("K"), _tile("V"), _tile("Out"), Arg("Lse", "*fp32"),
        *_tile_strides("stride_qz", "stride_qh", "stride_qm", "stride_kz", "stride_kh", "stride_kn",
                       "stride_vz", "stride_vh", "stride_vn", "stride_oz", "stride_oh", "stride_om"),
        *_LSE_STRIDES, Arg("max_seqlen_q", _I32), Arg("max_seqlen_k", _I32), Arg("batch", _I32),
        Arg("num_heads_q", _I32), Arg("group_size", _I32), Arg("qk_scale", _F32), Arg("window_left", _I32),
        Arg("window_right", _I32), Arg("head_dim", _I32, aligned=True), Arg("head_dim_v", _I32, aligned=True),
    ),
    _FWD_AXES, _WS_TUNING, _ws_unserved, ChosenBy("flash.forward", "engine", "ws", _ws_calls),
    knob_defaults=_WS_KNOB_DEFAULTS,
)


def ws_serves(functional: Mapping[str, Any], arch: str | None = None) -> bool:
    """Whether attn_fwd_ws computes this forward functional on ``arch`` (_ws_computes)."""
    return _ws_computes(ATTN_FWD_WS, functional, arch)


ATTN_BWD_PREPROCESS = KernelSpec(
    family=FAMILY,
    name="attn_bwd_preprocess",
    module=BACKWARD_MODULE,
    function="attn_bwd_preprocess",
    arguments=(
        _tile("Out"), _tile("DO"), Arg("Lse", "*fp32"), _STATS, Arg("CuSeqlensQ", "*i32"),
        *_tile_strides("stride_oz", "stride_oh", "stride_om", "stride_doz", "stride_doh", "stride_dom"),
        *_LSE_STRIDES, *_STATS_STRIDES, Arg("max_seqlen_q", _I32), Arg("head_dim_v", _I32, aligned=True),
    ),
    functionals=(
        ("dtype", ("fp16", "bf16", "fp32")),
        ("BLOCK_DV", HEAD_DIM_BUCKETS),
        ("PAD_HEAD", (False, True)),
        ("VARLEN", (False, True)),
    ),
    tuning_space=(("BLOCK_M", (16, 32, 64, 128)), ("num_warps", (1, 2, 4, 8)), ("num_stages", (1,))),
    tuning_keys=(_SEQ_KEYS[0],),
    fallback=_fallback,
    variant_of=_variant_of,
)

ATTN_BWD_DKDV = _attention_kernel(
    "attn_bwd_dkdv", BACKWARD_MODULE,
    (
        _tile("Q"), _tile("K"), _tile("V"), _tile("DO"),
        _tile("DK"), _tile("DV"), _STATS,
        *_SEQUENCES, Arg("Bias", "*{dtype}"),
        *_QKV_DO_STRIDES, *_DKDV_STRIDES, *_STATS_STRIDES, *_BIAS_STRIDES, *_BWD_SCALARS,
    ),
    _BWD_AXES, chosen_by=_SPLIT, tuning_space=_BWD_TUNING, knob_defaults=_BWD_KNOB_DEFAULTS,
)

ATTN_BWD_DQ = _attention_kernel(
    "attn_bwd_dq", BACKWARD_MODULE,
    (
        _tile("Q"), _tile("K"), _tile("V"), _tile("DO"),
        _tile("DQ"), _tile("Out"), Arg("Lse", "*fp32"), _STATS, *_SEQUENCES,
        Arg("Bias", "*{dtype}"), Arg("DBias", "*fp32"),
        *_QKV_DO_STRIDES, *_DQ_STRIDES, *_tile_strides("stride_oz", "stride_oh", "stride_om"), *_LSE_STRIDES,
        *_STATS_STRIDES, Arg("stats_rows", _I32), *_BIAS_STRIDES, *_DBIAS_STRIDES, *_BWD_SCALARS,
    ),
    _BWD_AXES, chosen_by=_SPLIT, tuning_space=_BWD_TUNING, knob_defaults=_BWD_KNOB_DEFAULTS,
)

ATTN_BWD_FUSED = _attention_kernel(
    "attn_bwd_fused", BACKWARD_MODULE,
    (
        _tile("Q"), _tile("K"), _tile("V"), _tile("DO"),
        _tile("DQ", "*{dq_type}"), _tile("DK"), _tile("DV"),
        _STATS, *_SEQUENCES, Arg("Bias", "*{dtype}"), Arg("DBias", "*fp32"),
        *_QKV_DO_STRIDES, *_DQ_STRIDES, *_DKDV_STRIDES, *_STATS_STRIDES, *_BIAS_STRIDES, *_DBIAS_STRIDES,
        *_BWD_SCALARS,
    ),
    _BWD_AXES + (("ATOMIC_DQ", (False, True)),), derive=_derive_fused, chosen_by=_FUSED,
)


def _ws_bwd_unserved(functional: Mapping[str, Any]) -> bool:
    """What the warp-specialized backward does not compute (kernels/backward_ws.py): the
    forward's exclusions, and head-dim buckets other than 64, 128 and 256."""
    return _ws_unserved(functional) or functional["BLOCK_D"] not in (64, 128, 256)


def _ws_bwd_calls(functional: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The backward operator's functionals whose ws backend runs this kernel functional:
    the non-deterministic ones (dQ is accumulated with atomics) of its grouping."""
    return [operator_functional(functional, False, functional.get("GROUPED", False)).as_dict()]


# Query heads per key/value head that the grouped cells are timed at (tune.flash.group_of):
# GROUPED at GROUP_WIDTH, WIDE_GROUPS at WIDE_GROUP_WIDTH. A call with more than
# GROUP_WIDTH reads the wide cells (Llama-3 70B has 8; Llama-3 8B and Mistral 7B have 4).
GROUP_WIDTH, WIDE_GROUP_WIDTH = 4, 8


def wide_groups(group_size: int) -> bool:
    """Whether a call with ``group_size`` query heads per key/value head reads the ws
    backward's ``WIDE_GROUPS`` cells."""
    return group_size > GROUP_WIDTH


def _ws_bwd_fallback(functional: Mapping[str, Any]) -> dict[str, Any] | None:
    """A functional of wide groups reads the cell of narrow ones, a grouped one the cell of
    the same call without groups, until a patch says otherwise (as the operator table,
    :func:`_operator_fallback`); then :func:`_fallback`."""
    return _dropped(functional, "WIDE_GROUPS") or _without_groups(functional) or _fallback(functional)


def _ws_bwd_disabled(functional: Mapping[str, Any]) -> bool:
    """What the ws backward does not compute (:func:`_ws_bwd_unserved`), and wide groups
    of a call without groups."""
    return _ws_bwd_unserved(functional) or (functional.get("WIDE_GROUPS", False) and not functional.get("GROUPED"))


# The warp-specialized backward (Gluon, sm_90 only): BLOCK_N keys per tile, 64 per
# consumer warpgroup (two); BLOCK_M query rows per step; STAGES slots in the q and dO rings;
# PERSISTENT, one program per SM walks the tiles (planning.backward_plans' grid; 2: masked
# tiles in wider sections, kernels/backward_ws._key_tile). Its GROUPED axis (a call with
# fewer key/value heads than query heads) is compiled in (a tile of an ungrouped call steps
# over query blocks alone) and keyed in its table: the persistent grid deals few long tiles
# of a grouped call unevenly (d128 g8 s1024 causal, H200: PERSISTENT=1 0.77 ms, the
# one-tile grid 0.62 ms) where the same call without groups runs 1.24x faster persistent.
# WIDE_GROUPS (more than GROUP_WIDTH query heads a key head) keys the table alone (a
# table axis, not compiled): a tile of g8 walks twice the query rows of g4's, and its K, V,
# Q and dO no longer stay in the L2 together; on the H100 the bf16 d128 s4096 causal tile
# timed best at g4 read 1.61x the DRAM bytes at g8 as at g4 and ran 1.13x slower there than
# PERSISTENT=2, which g4 ran 1.16x slower (benchmarks/grouped_l2_model.py, RESULTS.md).
_WS_BWD_AXES = _BWD_AXES + (("GROUPED", (False, True)), ("WIDE_GROUPS", (False, True)))
_WS_BWD_TUNING = (
    ("BLOCK_M", (64, 128)),
    ("BLOCK_N", (64, 128)),  # 128: the consumers split the keys (d64, d128); 64: the columns (d256)
    ("STAGES", (1, 2, 3)),  # 1: only with KV_SLOTS=2 (the second K/V slot fits beside one q/dO slot at d128)
    ("PERSISTENT", (0, 1, 2)),
    ("NARROW", (0, 1)),  # 1: padded heads up to 192 split 128 + 64 (kernels/backward_ws.NARROW_D)
    ("TMA_STORE", (0, 1)),  # 1: dK and dV leave by bulk stores from a staging tile (not with NARROW)
    ("KV_SLOTS", (1, 2)),  # 2: the next tile's K and V load into a second slot during this one (PERSISTENT)
    ("num_warps", (4,)),
    ("num_stages", (1,)),
)
_WS_BWD_KNOB_DEFAULTS = (("PERSISTENT", 0), ("NARROW", 0), ("TMA_STORE", 0), ("KV_SLOTS", 1))

ATTN_BWD_WS = _ws_kernel(
    "attn_bwd_ws", BACKWARD_WS_MODULE,
    (
        _tile("Q"), _tile("K"), _tile("V"), _tile("DO"), _tile("DQ", "*fp32"), _tile("DK"), _tile("DV"), _STATS,
        *_QKV_DO_STRIDES, *_DQ_STRIDES, *_DKDV_STRIDES, *_STATS_STRIDES,
        Arg("max_seqlen_q", _I32), Arg("max_seqlen_k", _I32), Arg("batch", _I32), Arg("num_heads_q", _I32),
        Arg("group_size", _I32), Arg("sm_scale", _F32), Arg("qk_scale", _F32), Arg("window_left", _I32),
        Arg("window_right", _I32), Arg("head_dim", _I32), Arg("head_dim_v", _I32),
    ),
    _WS_BWD_AXES, _WS_BWD_TUNING, _ws_bwd_disabled, ChosenBy("flash.backward", "backend", "ws", _ws_bwd_calls),
    knob_defaults=_WS_BWD_KNOB_DEFAULTS, axis_defaults=(("GROUPED", False), ("WIDE_GROUPS", False)),
    fallback=_ws_bwd_fallback, table_axes=("WIDE_GROUPS",),
)


def ws_backward_serves(functional: Mapping[str, Any], arch: str | None = None, deterministic: bool = False) -> bool:
    """Whether attn_bwd_ws computes this backward functional on ``arch`` (_ws_computes);
    never a deterministic call."""
    return not deterministic and _ws_computes(ATTN_BWD_WS, functional, arch)


DROPOUT_MASK = KernelSpec(
    family=FAMILY,
    name="dropout_mask",
    module=DROPOUT_MODULE,
    function="dropout_mask_kernel",
    arguments=(
        Arg("Mask", "*i8"), *_strides("stride_mz", "stride_mh", "stride_mm"),
        Arg("max_seqlen_q", _I32), Arg("max_seqlen_k", _I32), Arg("num_heads_q", _I32),
        Arg("dropout_threshold", _I64), Arg("philox_seed", _I64), Arg("philox_offset", _I64),
    ),
    functionals=(),
    tuning_space=(("BLOCK_M", (16, 32, 64)), ("BLOCK_N", (16, 32, 64, 128)), ("num_warps", (4,)),
                  ("num_stages", (1,))),
)

PHILOX_WORDS = KernelSpec(
    family=FAMILY,
    name="philox_words",
    module=DROPOUT_MODULE,
    function="philox_words",
    arguments=(Arg("Out", "*i64"), Arg("seed", _I64), Arg("offset", _I64), Arg("base", _I64), Arg("n", _I32)),
    functionals=(),
    tuning_space=(("BLOCK", (128,)), ("num_warps", (4,)), ("num_stages", (1,))),
)

def _operator_fallback(functional: Mapping[str, Any]) -> dict[str, Any] | None:
    """The seeded operator table holds only the roots (unpadded, dense, no dropout, no bias,
    mask none or bottom-right, not grouped); patches add refinements where the backend
    differs. A refinement drops its key/value grouping first (a grouped call reads the cell
    of the same call without groups until a patch says otherwise), then its bias, dropout,
    varlen and top-left mask, and its padding last: the tuner times padded cells, so a
    padded call with dropout falls back to them."""
    ungrouped = _without_groups(functional)
    if ungrouped is not None:
        return ungrouped
    for axis, plain in (("BIAS", BIAS_NONE), ("DROPOUT", False), ("VARLEN", False), ("MASK", MASK_BOTTOM_RIGHT),
                        ("PAD_HEAD", False)):
        if functional[axis] != plain and not (axis == "MASK" and functional[axis] == MASK_NONE):
            return {**functional, axis: plain}
    return None


# Operator level: which backward backend runs, per cell. Padding, varlen, dropout and a bias
# change which backend wins (perfmon, 2026-11-30: fused 1.1-1.8x faster with odd head dims,
# dropout, a bias, fp32), so they are axes; deterministic calls have their own rows. So do
# grouped-query calls (Hq > Hk): the split dK/dV kernel loops over a group's query heads in
# each program, and at d64 s1024 causal ws ran 1.14-1.42x faster on groups of 4 and 8 where
# the same call without groups is 7% faster fused (perfmon s35-dense, 2026-12-04).
BACKWARD = OperatorSpec(
    family=FAMILY,
    name="backward",
    functionals=(
        ("dtype", ("fp16", "bf16", "fp32")),
        ("BLOCK_D", HEAD_DIM_BUCKETS),
        ("PAD_HEAD", (False, True)),
        ("MASK", (MASK_NONE, MASK_TOP_LEFT, MASK_BOTTOM_RIGHT)),
        ("VARLEN", (False, True)),
        ("DROPOUT", (False, True)),
        ("BIAS", (BIAS_NONE, BIAS_ADD, BIAS_GRAD)),
        ("DETERMINISTIC", (False, True)),
        ("GROUPED", (False, True)),
    ),
    tuning_space=(("backend", BACKENDS),),
    tuning_keys=_SEQ_KEYS,
    fallback=_operator_fallback,
    axis_defaults=(("GROUPED", False),),  # a call without groups is named as before the axis existed
)


# Operator level: which kernel computes the forward, per cell: the Triton kernel (every
# functional, every architecture) or the warp-specialized one where it serves and wins
# (rules.ws_serves; tuned on the H200). Its axes are the forward kernels', so a cell of
# this table and a cell of attn_fwd_ws name the same calls.
FORWARD = OperatorSpec(
    family=FAMILY,
    name="forward",
    functionals=_FWD_AXES,
    tuning_space=(("engine", ENGINES),),
    tuning_keys=_SEQ_KEYS,
    fallback=_operator_fallback,
    disabled=_disabled,
)


def operator_functional(kernel_functional: Mapping[str, Any], deterministic: bool,
                        grouped: bool = False) -> Functional:
    """The ``flash.backward`` functional of a call whose (backward) kernel functional is
    given; ``grouped``: the call has fewer key/value heads than query heads (GQA, MQA)."""
    names = [name for name, _ in BACKWARD.functionals if name not in ("DETERMINISTIC", "GROUPED")]
    return BACKWARD.canonical_functional({**{n: kernel_functional[n] for n in names},
                                          "DETERMINISTIC": deterministic, "GROUPED": grouped})

KERNELS = {spec.name: spec for spec in (ATTN_FWD, ATTN_FWD_WS, ATTN_BWD_PREPROCESS, ATTN_BWD_DKDV, ATTN_BWD_DQ,
                                        ATTN_BWD_FUSED, ATTN_BWD_WS, DROPOUT_MASK, PHILOX_WORDS)}
TABLES = (*KERNELS.values(), FORWARD, BACKWARD)


# The interpreter runs one program at a time on numpy: small tiles keep every code path
# (several key blocks, masked and unmasked runs) exercised at test sizes. It is not an
# architecture of the tuning database.
INTERPRETER_CONFIGS = {
    FORWARD.name: Config.of(engine="triton"),  # the interpreter cannot run the Gluon kernel
    DROPOUT_MASK.name: Config.of(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1),
    PHILOX_WORDS.name: Config.of(BLOCK=128, num_warps=4, num_stages=1),
}
INTERPRETER_CONFIG = Config.of(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def config_for(kernel: KernelSpec, functional: Functional, device: torch.device, **sizes: int) -> Config:
    """The configuration a launch uses: the tuning database's on GPUs, fixed in the interpreter."""
    if device.type == "cpu":
        return INTERPRETER_CONFIGS.get(kernel.name, INTERPRETER_CONFIG)
    return tuning.database().lookup(arch_of(device), kernel, functional, sizes)
