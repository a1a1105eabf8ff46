"""A deliberately bad tuning patch, to show that perfmon catches one (issue 15).

:func:`bad_patch` writes, into a copy of the tuning database, patches that set every cell
of the selected blocks to one configuration (small tiles everywhere, say). Measured with
``AOTATTN_TUNING_DB`` pointing at the copy, the run's ``compare`` against the shipped
database must flag the regressions, and ``faults`` must report the backward cells where
the other backend now wins.
"""

from __future__ import annotations

import re
from pathlib import Path

from aotattn.spec import parse_where
from aotattn.tune.candidates import config_name
from aotattn.tuning import Database
from aotattn.tuning.format import Edit, Patch, format_config, parse_config, write_patch

_NUMBER = re.compile(r"\.(\d{4})-")


def bad_patch(root: Path, arch: str, tables: list[str], where: str, config: str, what: str = "bad") -> list[Path]:
    """Write one patch per table under ``root`` setting every cell of each block matching
    ``where`` (``"dtype=bf16 BLOCK_D=128"``) to ``config`` (``"BLOCK_M=32 BLOCK_N=32
    num_warps=4 num_stages=1"``, parsed against each table's tuning space); returns the files."""
    db = Database(root)
    parse_where(where, [db.spec(table) for table in tables])  # a typo's unknown axis matched every block
    written = []
    for table in tables:
        spec = db.spec(table)
        parsed = parse_config(spec, config, f"--config for {table}")
        name = config_name(parsed)
        effective = db.effective(arch, table)
        chosen = [f for f in effective.blocks if f.matches(where)]
        if not chosen:
            raise ValueError(f"{arch} / {table}: no block matches {where!r}")
        patch = Patch(table, {name: parsed},
                      [Edit(f, tuple(tuple(b) for _, b in spec.tuning_keys), name, 0) for f in chosen],
                      [f"# deliberately bad ({what}): every cell of [{where}] set to {format_config(parsed, spec)}"])
        numbers = [int(m.group(1)) for p in db.patch_paths(arch, table) if (m := _NUMBER.search(p.name))]
        path = db.arch_dir(arch) / f"{table}.{max(numbers, default=0) + 1:04d}-{what}.dbpatch"
        path.write_text(write_patch(spec, patch))
        written.append(path)
    return written
