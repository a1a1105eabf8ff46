"""Hand-picked seed tables for the tuning database (untuned; the tuner replaces them).

    python -m aotattn.families.flash.initial_tables [ROOT]

writes ``ROOT/nvidia/sm_90`` (every table in full), ``ROOT/nvidia/sm_80`` (``#! base
sm_90``, overriding the blocks whose sm_90 choices need more than the A100's 163 KB of
shared memory), sm_86 and sm_89 (``#! base sm_80``), ``ROOT/amd/gfx942`` (``#! base
sm_90``) and gfx90a, gfx950, gfx1100 (``#! base gfx942``), nothing overridden yet.
Three tables differ: ``flash.forward`` (which kernel computes the forward) is every
architecture's own, ``triton`` everywhere, never inherited; ``flash.attn_fwd_ws`` and
``flash.attn_bwd_ws`` (Gluon kernels for sm_90) exist for sm_90 alone.
The choices follow the H200 sweeps of 2026-11-29 (benchmarks/RESULTS.md) at s4096 and
are used for every sequence length.
"""

from __future__ import annotations

import sys
from pathlib import Path

from aotattn.arch import ARCHES
from aotattn.families.flash import rules
from aotattn.spec import Config, Functional
from aotattn.tuning import Table, write_table

UNTUNED = "# Seeded by hand (aotattn.families.flash.initial_tables), NOT TUNED: one choice for every sequence length."


def _cfg(bm: int, bn: int, w: int, s: int) -> Config:
    return Config.of(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _refinement(f: dict) -> bool:
    """An operator table's functional that is not a root: the seeds hold only roots."""
    return bool(f["PAD_HEAD"] or f["VARLEN"] or f["DROPOUT"] or f["BIAS"] or f["MASK"] == rules.MASK_TOP_LEFT
                or f.get("GROUPED"))


def sm90(kernel, f: dict) -> Config:
    if kernel is rules.DROPOUT_MASK:
        return Config.of(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)
    if kernel is rules.PHILOX_WORDS:
        return Config.of(BLOCK=128, num_warps=4, num_stages=1)
    if kernel in (rules.FORWARD, rules.BACKWARD) and _refinement(f):
        return None  # refinements fall back to their root (rules._operator_fallback)
    if kernel is rules.FORWARD:
        return Config.of(engine="triton")  # the tuned patch of sm_90 chooses ws where it wins
    if kernel is rules.ATTN_FWD_WS:
        if f["MASK"] == rules.MASK_TOP_LEFT:
            return None  # falls back to bottom-right (rules._fallback)
        # the prototype's best tiles at s4096-s16384 (RESULTS.md, fourteenth session)
        if f["BLOCK_D"] == 64:
            return Config.of(BLOCK_M=192, BLOCK_N=128, STAGES=3, PINGPONG=1, num_warps=4, num_stages=1)
        return Config.of(BLOCK_M=128, BLOCK_N=64, STAGES=3 if f["BLOCK_D"] == 128 else 2, PINGPONG=1, num_warps=4,
                         num_stages=1)
    if kernel is rules.ATTN_BWD_WS:
        if f["MASK"] == rules.MASK_TOP_LEFT:
            return None  # falls back to bottom-right (rules._fallback)
        # the prototypes' tiles at s4096-s16384 (RESULTS.md, fifteenth and sixteenth sessions):
        # at d256 one 64-key program whose consumers split the columns
        return Config.of(BLOCK_M=64, BLOCK_N=64 if f["BLOCK_D"] == 256 else 128, STAGES=2, num_warps=4,
                         num_stages=1)
    if kernel is rules.BACKWARD:
        return Config.of(backend="split")  # split beat fused-atomic at every benchmark shape
    if kernel is rules.ATTN_BWD_PREPROCESS:
        return Config.of(BLOCK_M=64 if f["BLOCK_DV"] <= 128 else 32, num_warps=4, num_stages=1)
    widest = max(f["BLOCK_D"], f["BLOCK_DV"])
    fp32 = f["dtype"] == "fp32"
    if kernel is rules.ATTN_FWD:
        if fp32:
            return _cfg(64, 32, 4, 2) if widest <= 64 else _cfg(32, 32, 4, 2) if widest <= 128 else _cfg(16, 32, 4, 1)
        if widest <= 64:
            return _cfg(128, 64, 8, 3)
        if widest <= 128:  # a bias tile is pipelined too: 128x128 would pass 227 KB
            return _cfg(128, 64 if f["BIAS"] else 128, 8, 3)
        return _cfg(128, 32, 8, 3)
    if fp32:
        return _cfg(32, 32, 4, 1) if widest <= 64 else _cfg(16, 16, 4, 1)
    if kernel is rules.ATTN_BWD_DQ:
        if widest <= 64:
            return _cfg(64, 64, 4, 2)
        return _cfg(128, 64 if f["BIAS"] else 128, 8, 2) if widest <= 128 else _cfg(64, 32, 8, 2)
    atomic = kernel is rules.ATTN_BWD_FUSED and f["ATOMIC_DQ"]
    return _cfg(64, 128, 8, 1 if atomic else 2) if widest <= 128 else _cfg(16, 64, 8, 2)


def sm80(kernel, f: dict) -> Config | None:
    """Where sm_90's choice does not fit the A100's shared memory; None keeps sm_90's."""
    if kernel is rules.ATTN_FWD and f["dtype"] != "fp32" and max(f["BLOCK_D"], f["BLOCK_DV"]) >= 128:
        return _cfg(128, 64, 8, 2) if f["BLOCK_D"] == 128 else _cfg(64, 32, 4, 2)
    if kernel is rules.ATTN_BWD_DQ and f["dtype"] != "fp32" and f["BLOCK_D"] == 128:
        return _cfg(128, 64, 8, 2)
    return None


def _name(config: Config) -> str:
    v = config.as_dict()
    if "backend" in v:
        return v["backend"]
    if "engine" in v:
        return v["engine"]
    if "STAGES" in v:
        return f"m{v['BLOCK_M']}_n{v['BLOCK_N']}_s{v['STAGES']}" + ("_pp" if v.get("PINGPONG") else "")
    if "BLOCK" in v:
        return f"b{v['BLOCK']}_w{v['num_warps']}"
    if "BLOCK_N" not in v:
        return f"m{v['BLOCK_M']}_w{v['num_warps']}_s{v['num_stages']}"
    return f"m{v['BLOCK_M']}_n{v['BLOCK_N']}_w{v['num_warps']}_s{v['num_stages']}"


def build_table(spec, arch: str, choose, base: str | None = None) -> Table:
    rows, cols = (len(spec.tuning_keys[0][1]) if spec.tuning_keys else 1,
                  len(spec.tuning_keys[1][1]) if len(spec.tuning_keys) > 1 else 1)
    table = Table(spec.qualname, arch, spec.tuning_keys, base, comments=[UNTUNED])
    for functional in spec.enumerate_functionals():
        config = choose(spec, functional.as_dict())
        if config is None:
            continue
        name = _name(config)
        table.configs.setdefault(name, config)
        table.blocks[Functional.of(functional.as_dict())] = [[name] * cols for _ in range(rows)]
    table.configs = dict(sorted(table.configs.items()))
    return table


def main(root: Path) -> None:
    inherit = lambda kernel, f: None  # noqa: E731  (a derived table that overrides nothing yet)
    choosers = {"sm_90": sm90, "sm_80": sm80}
    for a in ARCHES.values():
        vendor, arch, choose, base = a.vendor, a.name, choosers.get(a.name, inherit), a.base
        directory = root / vendor / arch
        directory.mkdir(parents=True, exist_ok=True)
        for spec in rules.TABLES:
            if not spec.runs_on(arch):
                continue
            if spec is rules.FORWARD:
                # never inherited: which kernel serves a cell is each architecture's own
                # finding (sm_80 and gfx942 would otherwise take sm_90's ws choices)
                table = build_table(spec, arch, sm90, None)
            else:
                table = build_table(spec, arch, choose, base)
            (directory / f"{spec.qualname}.txt").write_text(write_table(spec, table))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[3] / "tuning")
