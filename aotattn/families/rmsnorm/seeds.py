"""Seed table of the RMSNorm family (untuned): ``python -m aotattn.families.rmsnorm.seeds``."""

from __future__ import annotations

import sys
from pathlib import Path

from aotattn.families.rmsnorm import rules
from aotattn.spec import Config, Functional
from aotattn.tuning import Table, write_table


def main(root: Path) -> None:
    spec = rules.RMSNORM_FWD
    table = Table(spec.qualname, "sm_90", spec.tuning_keys,
                  comments=["# Seeded by hand (aotattn.families.rmsnorm.seeds), NOT TUNED: warps grow with the row."])
    for warps in (1, 4, 8, 16):
        table.configs[f"w{warps}"] = Config.of(num_warps=warps, num_stages=1)
    for functional in spec.enumerate_functionals():
        name = {256: "w1", 1024: "w4", 4096: "w8", 16384: "w16"}[functional["BLOCK"]]
        table.blocks[Functional.of(functional.as_dict())] = [[name] for _ in spec.tuning_keys[0][1]]
    path = root / "nvidia" / "sm_90" / f"{spec.qualname}.txt"
    path.write_text(write_table(spec, table))
    for vendor, arch, base in (("nvidia", "sm_80", "sm_90"), ("nvidia", "sm_86", "sm_80"), ("nvidia", "sm_89", "sm_80"),
                               ("amd", "gfx942", "sm_90"), ("amd", "gfx90a", "gfx942"), ("amd", "gfx950", "gfx942"),
                               ("amd", "gfx1100", "gfx942")):
        derived = Table(spec.qualname, arch, spec.tuning_keys, base, comments=table.comments)
        (root / vendor / arch / f"{spec.qualname}.txt").write_text(write_table(spec, derived))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[3] / "tuning")
