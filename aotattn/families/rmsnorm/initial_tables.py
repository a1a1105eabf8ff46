"""Seed table of the RMSNorm family (untuned): ``python -m aotattn.families.rmsnorm.initial_tables``."""

from __future__ import annotations

import sys
from pathlib import Path

from aotattn.arch import ARCHES
from aotattn.families.rmsnorm import rules
from aotattn.spec import Config, Functional
from aotattn.tuning import Table, write_table


def main(root: Path) -> None:
    spec = rules.RMSNORM_FWD
    table = Table(spec.qualname, "sm_90", spec.tuning_keys,
                  comments=["# Seeded by hand (aotattn.families.rmsnorm.initial_tables), NOT TUNED: warps grow with the row."])
    for warps in (1, 4, 8, 16):
        table.configs[f"w{warps}"] = Config.of(num_warps=warps, num_stages=1)
    for functional in spec.enumerate_functionals():
        name = {256: "w1", 1024: "w4", 4096: "w8", 16384: "w16"}[functional["BLOCK"]]
        table.blocks[Functional.of(functional.as_dict())] = [[name] for _ in spec.tuning_keys[0][1]]
    path = root / "nvidia" / "sm_90" / f"{spec.qualname}.txt"
    path.write_text(write_table(spec, table))
    for a in ARCHES.values():
        if a.base is not None:
            derived = Table(spec.qualname, a.name, spec.tuning_keys, a.base, comments=table.comments)
            (root / a.vendor / a.name / f"{spec.qualname}.txt").write_text(write_table(spec, derived))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[3] / "tuning")
