"""Candidate configurations: a table's declared tuning space, pruned before compiling.

The space a family declares (``tuning_space`` in its rules) is a product of knobs; for a
flash kernel 4 x 4 x 4 x 4 = 256 configurations, most of which cannot run well or at
all for a given functional. Pruning is a pure function of the configuration, the
functional, the kernel's *footprint* and the target:

* **shared memory**: the tiles the kernel keeps in shared memory, those reloaded every
  loop iteration multiplied by the pipeline depth, must fit the target's per-block
  limit (227 KB on sm_90). The estimate follows what Triton 3.6 allocates, measured on
  compiled sm_90 kernels (docs/tuner.md): with warp-group MMAs (Hopper, the MMA's M
  dimension at least 64 and warps a multiple of 4) a loaded tile is buffered
  ``num_stages`` deep, otherwise ``max(num_stages - 1, 1)`` deep. It is only an
  estimate: the build reports the exact figure, and the worker drops a compiled
  candidate whose image needs more than the target has.
* **registers**: fp32 accumulators alive across the loop, per thread, must not exceed
  the 255 registers a thread can have; beyond that they spill to local memory.
* **work per warp**: each warp needs at least one 16 x 8 MMA tile of the loop's
  ``rows x columns`` block (fp32's FMA dots: one element per thread); more warps than
  that only wait.

The configuration the database holds today for a cell is always kept (the tuner must
be able to say "keep it").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aotattn import arch as arches
from aotattn.arch import Arch
from aotattn.spec import Config, Functional

ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 1, "int64": 8}  # int64: an mbarrier


def target(name: str) -> Arch:
    """The architecture's limits (:mod:`aotattn.arch`: shared memory, registers, warp size, wgmma)."""
    return arches.arch(name)


@dataclass(frozen=True)
class Tile:
    """A 2-D tile; ``rows``/``cols`` name a knob or axis (``BLOCK_M``) or are numbers.

    ``element``: ``"input"`` (the functional's dtype) or a dtype name (``"fp32"``).
    ``when``: an axis that must be truthy in the functional for the tile to exist
    (``BIAS``), or a predicate of the functional's and configuration's values (a kernel
    whose knobs change what it keeps).
    """

    rows: str | int
    cols: str | int
    element: str = "input"
    when: str | Callable[[Mapping[str, Any]], bool] | None = None

    def elements(self, values: Mapping[str, Any]) -> int:
        size = 1
        for dim in (self.rows, self.cols):
            size *= dim if isinstance(dim, int) else int(values[dim])
        return size

    def present(self, values: Mapping[str, Any]) -> bool:
        if callable(self.when):
            return self.when(values)
        return self.when is None or bool(values.get(self.when))

    def bytes(self, values: Mapping[str, Any]) -> int:
        element = values["dtype"] if self.element == "input" else self.element
        return self.elements(values) * ELEMENT_BYTES[element]


@dataclass(frozen=True)
class Footprint:
    """What one program of a kernel holds: the basis of the estimates.

    Attributes:
        resident: tiles loaded once into shared memory.
        pipelined: tiles loaded every loop iteration (buffered by the pipeline).
        accumulators: fp32 tiles alive in registers across the loop.
        mma_rows, mma_cols: the knobs giving the loop's MMA block (M and N of its dots);
            ``mma_rows`` is also how many times each streamed tile is reused.
        pads: (knob, tuning key): the knob's block tiles that size (``BLOCK_M`` tiles
            ``seqlen_q``), so a block longer than the size computes padding.
        tensor_cores: whether the functional's dots run on tensor cores (fp16/bf16).
        inert: why a configuration's knobs change nothing for this functional (a knob the
            kernel ignores there: it would time the same code twice), or None.
        stages: the knob giving the pipeline depth: ``num_stages`` (Triton's software
            pipeliner, buffering as :func:`pipeline_depth` measured) or a kernel's own ring
            of shared-memory slots (``STAGES`` of a warp-specialized kernel: exactly that deep).
        budget: why a configuration exceeds a kernel's own limits beyond shared memory and
            the thread's 255 registers (a warp-specialized partition's register budget), or
            cannot run in the cell at all (an operator choice whose kernel does not serve it),
            or None. It sees the functional, the configuration and ``arch`` (the target's name).
        loop: (knob, tuning key) of the main loop: its block walks that size (``BLOCK_N``
            over ``seqlen_k``), so a short size means few iterations, whose loads and stores
            only other resident programs can hide (:func:`score`); None: not modelled.
    """

    resident: tuple[Tile, ...] = ()
    pipelined: tuple[Tile, ...] = ()
    accumulators: tuple[Tile, ...] = ()
    mma_rows: str = "BLOCK_M"
    mma_cols: str = "BLOCK_N"
    pads: tuple[tuple[str, str], ...] = ()
    tensor_cores: Callable[[Mapping[str, Any]], bool] = field(
        default=lambda values: values.get("dtype") in ("fp16", "bf16"), compare=False)
    inert: Callable[[Mapping[str, Any]], str | None] = field(default=lambda values: None, compare=False)
    stages: str = "num_stages"
    budget: Callable[[Mapping[str, Any]], str | None] = field(default=lambda values: None, compare=False)
    loop: tuple[str, str] | None = None


def _values(functional: Functional, config: Config) -> dict[str, Any]:
    return {**functional.as_dict(), **config.as_dict()}


def pipeline_depth(footprint: Footprint, values: Mapping[str, Any], tgt: Arch) -> int:
    if footprint.stages != "num_stages":
        return int(values[footprint.stages])  # the kernel's own ring of slots
    stages = int(values.get("num_stages", 1))
    if not footprint.tensor_cores(values):
        return stages  # fp32 (FMA dots): measured num_stages deep
    warpgroup = (tgt.warpgroup_mma and int(values[footprint.mma_rows]) >= 64
                 and int(values.get("num_warps", 4)) % 4 == 0)
    return stages if warpgroup else max(stages - 1, 1)


def shared_bytes(footprint: Footprint, functional: Functional, config: Config, tgt: Arch) -> int:
    """Estimated shared memory of one program (bytes)."""
    values = _values(functional, config)
    resident = sum(t.bytes(values) for t in footprint.resident if t.present(values))
    pipelined = sum(t.bytes(values) for t in footprint.pipelined if t.present(values))
    return resident + (pipeline_depth(footprint, values, tgt) * pipelined if pipelined else 0)


def accumulator_registers(footprint: Footprint, functional: Functional, config: Config, tgt: Arch) -> float:
    """fp32 accumulator registers per thread (elements of the accumulator tiles / threads)."""
    values = _values(functional, config)
    threads = int(values.get("num_warps", 4)) * tgt.warp_size
    return sum(t.elements(values) for t in footprint.accumulators if t.present(values)) / threads


def why_pruned(footprint: Footprint, functional: Functional, config: Config, tgt: Arch) -> str | None:
    """The reason this configuration is not worth compiling, or None when it is a candidate."""
    values = _values(functional, config)
    inert = footprint.inert(values)
    if inert is not None:
        return inert
    over = footprint.budget({**values, "arch": tgt.name})
    if over is not None:
        return over
    smem = shared_bytes(footprint, functional, config, tgt)
    if smem > tgt.shared_memory:
        return f"shared memory ~{smem} B > {tgt.shared_memory} B"
    regs = accumulator_registers(footprint, functional, config, tgt)
    if regs > tgt.registers:
        return f"accumulators ~{regs:.0f} registers/thread > {tgt.registers}"
    warps = int(values.get("num_warps", 4))
    if footprint.mma_rows in values and footprint.mma_cols in values:
        block = int(values[footprint.mma_rows]) * int(values[footprint.mma_cols])
        # a 16 x 8 MMA tile per warp; FMA dots (fp32) need one element per thread
        if block < (16 * 8 if footprint.tensor_cores(values) else tgt.warp_size) * warps:
            return f"{values[footprint.mma_rows]}x{values[footprint.mma_cols]} block too small for {warps} warps"
    return None


# The arithmetic intensity (flops per byte streamed, = the MMA rows a streamed tile is
# reused by) where an H200 stops being bandwidth-bound: ~990 TFLOP/s of bf16 MMAs over
# ~4.8 TB/s of HBM is ~200; L2 hits (every program of a head streams the same tiles)
# lower it. Only a ranking uses it.
BALANCE = 128


def score(footprint: Footprint, functional: Functional, config: Config, tgt: Arch,
          sizes: Mapping[str, int]) -> float:
    """A rough speed model (higher is faster), only used to rank fitting configurations.

    The product of: the MMA's efficiency (warp-group MMAs on Hopper, full; the older MMA,
    half); how far the streamed tiles' reuse (``mma_rows``) is from the bandwidth balance
    point; the per-iteration overhead of the loop (softmax rescaling, address updates,
    barriers: ``cols / (cols + 16)``); the fraction of each block that is not padding at
    these sizes; the pipelining (one stage: loads never overlap math, 0.8; two: 0.95);
    register pressure (over 128 accumulator registers a thread: 0.9); and, for a kernel
    whose ``loop`` is declared, latency hiding: a program's first load and last store
    overlap only its own other iterations or other programs resident on the SM (by shared
    memory), so ``sqrt(min(1, iterations x programs / 4))``. On the H200 the d128 forward
    with 128 keys ran 1.22x faster with 32-key blocks (4 iterations, 2 programs an SM) than
    with 128 (1 and 1), which this term alone ranks first (docs/tuner.md).
    """
    values = _values(functional, config)
    rows, cols = int(values[footprint.mma_rows]), int(values[footprint.mma_cols])
    warpgroup = (footprint.stages != "num_stages"  # a kernel with its own rings issues wgmma itself
                 or pipeline_depth(footprint, {**values, "num_stages": 2}, tgt) == 2)
    mma = 1.0 if warpgroup or not tgt.warpgroup_mma else 0.5
    reuse = min(1.0, rows / BALANCE) ** 0.5
    loop = cols / (cols + 16)
    useful = 1.0
    for knob, key in footprint.pads:
        if knob in values and key in sizes:
            block, size = int(values[knob]), int(sizes[key])
            useful *= size / (-(-size // block) * block)
    stages = int(values.get(footprint.stages, 2))
    pipelined = 0.8 if stages == 1 else 0.95 if stages == 2 else 1.0
    pressure = 0.9 if accumulator_registers(footprint, functional, config, tgt) > 128 else 1.0
    return mma * reuse * loop * useful * pipelined * pressure * hiding(footprint, functional, config, tgt, sizes)


def hiding(footprint: Footprint, functional: Functional, config: Config, tgt: Arch,
           sizes: Mapping[str, int]) -> float:
    """How well a short loop's loads and stores are hidden, 1.0 when the loop is long (:func:`score`)."""
    if footprint.loop is None or footprint.loop[1] not in sizes:
        return 1.0
    knob, key = footprint.loop
    values = _values(functional, config)
    iterations = -(-int(sizes[key]) // int(values[knob]))
    programs = max(1, tgt.shared_memory // max(1, shared_bytes(footprint, functional, config, tgt)))
    return min(1.0, iterations * programs / 4) ** 0.5


def space(spec: Any) -> list[Config]:
    """Every configuration of the declared tuning space, in declaration order."""
    names = [name for name, _ in spec.tuning_space]
    return [spec.canonical(Config.of(dict(zip(names, values))))
            for values in itertools.product(*(c for _, c in spec.tuning_space))]


def candidates(spec: Any, functional: Functional, arch: str, footprint: Footprint | None,
               keep: Iterable[Config] = (), sizes: Mapping[str, int] | None = None,
               limit: int | None = None, knobs: bool = True) -> tuple[list[Config], dict[Config, str]]:
    """(candidates, pruned -> reason) for one functional of one table on ``arch``.

    Configurations that cannot fit are pruned (:func:`why_pruned`); of the rest, with a
    ``limit``, the ``limit`` first by :func:`tiles_first` ranking are kept, and (``knobs``)
    every fitting knob variant of a kept configuration's tile (:func:`knob_variants`). ``keep``:
    configurations kept whatever the estimates say (the
    database's current choices), in addition to the limit. Without a footprint nothing is
    pruned; an operator table's (its choices are not kernels) has only a budget.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit: expected at least 1 or None, got {limit}")
    tgt = target(arch)
    keep = list(keep)
    fitting, pruned = [], {}
    for config in space(spec):
        reason = None if footprint is None else why_pruned(footprint, functional, config, tgt)
        if reason is None:
            fitting.append(config)
        elif config not in keep:
            pruned[config] = reason
    # an operator table's footprint has no tiles: its few choices are all kept, unranked
    if limit is not None and footprint is not None and footprint.pipelined and len(fitting) > limit:
        ranked = tiles_first(spec, sorted(fitting, key=lambda c: -score(footprint, functional, c, tgt, sizes or {})))
        for config in ranked[limit:]:
            pruned[config] = f"ranked below the best {limit} by the speed model"
        chosen = set(ranked[:limit]) | set(knob_variants(spec, keep, fitting) if knobs else ())
        fitting = [c for c in fitting if c in chosen]
        for config in chosen:
            pruned.pop(config, None)
    kept = fitting + [c for c in keep if c not in fitting]
    for config in keep:
        pruned.pop(config, None)
    return kept, pruned


def tile_of(spec: Any, config: Config) -> tuple:
    """A configuration's values outside the kernel's extra knobs (``spec.knob_defaults``)."""
    knobs = {name for name, _ in spec.knob_defaults}
    return tuple((k, v) for k, v in config.items if k not in knobs)


def knob_variants(spec: Any, configs: Iterable[Config], among: Iterable[Config]) -> list[Config]:
    """The configurations of ``among`` that share a tile with one of ``configs``: with the
    database's current choice, the knobs (``PERSISTENT``, ``Q_SLOTS``, ``TMA_STORE``,
    ``KV_SLOTS``, ``OVERLAP``, ``TMA``) around the best tile known so far. The speed model
    does not rank knobs, so a limit smaller than the number of tiles kept none of them: the
    ws forward's short-tile cells at ``--limit 24`` (36 tiles) timed no ``Q_SLOTS=2`` or
    ``TMA_STORE=1`` variant (H100, 2026-12-05), though they won 1.08-2.2x there by hand.

    A knob setting that does not fit the tile (a second Q slot beside three K/V stages at
    d128) is taken from the same tile one pipeline stage shallower, and so on down: the
    d128 s1024 forward's current ``STAGES=3`` tile had no fitting knob variant at all, while
    ``STAGES=2`` with both knobs was 1.11x on the H200 (hand patch 0003)."""
    among = list(among)
    knob_names = {name for name, _ in spec.knob_defaults}
    by_tile: dict[tuple, list[Config]] = {}
    for config in among:
        by_tile.setdefault(tile_of(spec, config), []).append(config)
    chosen: set[Config] = set()
    for config in configs:
        tile, seen = tile_of(spec, config), set()
        for depth in [tile, *_shallower(spec, tile)]:
            for variant in by_tile.get(depth, ()):
                setting = tuple((k, v) for k, v in variant.items if k in knob_names)
                if depth == tile or setting not in seen:
                    chosen.add(variant)
                seen.add(setting)
    return [c for c in among if c in chosen]


_DEPTH_AXES = ("STAGES", "num_stages")  # software-pipeline depth: a knob that does not fit may fit one shallower


def _shallower(spec: Any, tile: tuple) -> list[tuple]:
    """``tile`` with its pipeline depth lowered one declared value at a time (deepest first)."""
    values, space = dict(tile), dict(spec.tuning_space)
    axis = next((a for a in _DEPTH_AXES if a in values and len(space.get(a, ())) > 1), None)
    if axis is None:
        return []
    lower = sorted((v for v in space[axis] if v < values[axis]), reverse=True)
    return [tuple((k, d if k == axis else v) for k, v in tile) for d in lower]


def tiles_first(spec: Any, ranked: list[Config]) -> list[Config]:
    """``ranked`` (best first) reordered so that every tile comes before any tile's second
    variant: first the best variant of each tile in rank order, then each tile's second,
    and so on. A tile is a configuration's values outside the kernel's extra knobs
    (``spec.knob_defaults``, e.g. the forward's ``OVERLAP`` and ``TMA``).

    :func:`score` does not rank those knobs, so a tile's variants tie and used to fill a
    small ``--limit`` side by side (six forward variants a tile). On the H200's measured
    forward candidates (``tests/tune/data/h200_attn_fwd_probes.json``, the whole space of 8
    cells), the best kept at ``--limit 8`` was at worst 1.21x slower than the fastest
    candidate; with the tiles first, 1.008x. The variants are within 1-3% of each other there.
    """
    seen: dict[tuple, int] = {}
    variant = {}
    for config in ranked:
        tile = tile_of(spec, config)
        variant[config] = seen.get(tile, 0)
        seen[tile] = variant[config] + 1
    return sorted(ranked, key=lambda c: variant[c])  # stable: rank order within each round


def config_name(config: Config) -> str:
    """A name spelling the values: ``m128_n64_w8_s3``, ``split`` (an operator choice)."""
    values = config.as_dict()
    short = {"BLOCK_M": "m", "BLOCK_N": "n", "num_warps": "w", "num_stages": "s", "BLOCK": "b", "OVERLAP": "o",
             "TMA": "tma", "STAGES": "st", "PINGPONG": "pp", "Q_SLOTS": "qs", "KV_SLOTS": "kv"}
    if len(values) == 1 and isinstance(next(iter(values.values())), str):
        return str(next(iter(values.values())))
    return "_".join(f"{short.get(k, k.lower())}{v}" for k, v in _ordered(values))


def _ordered(values: Mapping[str, Any]) -> list[tuple[str, Any]]:
    order = ("BLOCK", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "OVERLAP", "TMA")
    return sorted(values.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))
