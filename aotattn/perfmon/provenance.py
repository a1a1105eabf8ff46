"""Which tuning-database cell a call's choices came from.

While perfmon runs the unforced operator once (untimed), it records every lookup the
operator makes (:func:`recording_lookups`); :func:`cell_of` then names the table, the
functional the call asked for and the cell each came from (resolved, through the declared
fallbacks, the way :meth:`aotattn.tuning.Database.lookup` does). A fault points at such a cell, and
:func:`suggest_patch` writes the edit that would set it to the faster choice.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aotattn import families, tuning
from aotattn.spec import Config, Functional
from aotattn.tune.candidates import config_name
from aotattn.tuning.format import (Edit, Patch, block_for, fallback_chain, format_functional, parse_functional,
                                   write_patch)

_CELL = re.compile(r"^(?P<table>[A-Za-z0-9_]+\.[A-Za-z0-9_]+)\[(?P<functional>[^\]]*)\]@(?P<keys>\S*)$")


@dataclass(frozen=True)
class Lookup:
    """One lookup the operator made: the spec, the functional asked for, the call's sizes
    and the configuration it got."""

    spec: Any
    functional: Functional
    sizes: tuple[tuple[str, int], ...]
    config: Config


@contextlib.contextmanager
def uncached_plans(family: str = "flash") -> Iterator[None]:
    """Inside the block, ``family``'s operators plan every call the long way: their plan
    cache is a fresh one, dropped on exit (a cached call looks nothing up, and a plan made
    inside, under a seam, must not serve calls made after)."""
    ops = importlib.import_module(f"aotattn.families.{family}.ops")
    original = ops._PLANS
    ops._PLANS = type(original)()
    try:
        yield
    finally:
        ops._PLANS = original


@contextlib.contextmanager
def recording_lookups(family: str = "flash") -> Iterator[list[Lookup]]:
    """Record every configuration lookup of ``family``'s operators inside the block.

    The operators resolve configurations through their rules module's ``config_for``;
    it is wrapped here (the operators run unchanged, planning each call anew: see
    :func:`uncached_plans`) and restored on exit.
    """
    rules = importlib.import_module(f"aotattn.families.{family}.rules")
    original = rules.config_for
    seen: list[Lookup] = []

    def recorded(kernel, functional, device, **sizes):
        config = original(kernel, functional, device, **sizes)
        seen.append(Lookup(kernel, functional, tuple(sorted(sizes.items())), config))
        return config

    rules.config_for = recorded
    try:
        with uncached_plans(family):
            yield seen
    finally:
        rules.config_for = original


def cell_of(arch: str, spec: Any, functional: Functional, sizes: Mapping[str, int],
            db: tuning.Database | None = None) -> str:
    """``table[functional]@key=bucket,...``: the cell of the functional the call asked for.

    Its block may be a fallback's (a dropout call reads the dense block until a patch
    gives dropout its own): a patch for this cell then adds the refinement's block, so
    fixing a fault never changes the calls that only shared the fallback. Raises
    :class:`aotattn.tuning.TuningError` when neither the functional nor a fallback has a block.
    """
    db = db or tuning.database()
    chain = fallback_chain(spec.fallback, functional)
    table = db.effective(arch, spec.qualname, only=frozenset(chain))
    block_for(table, chain, f"{arch} / {spec.qualname}")
    keys = ",".join(f"{name}={buckets[tuning.bucket_index(buckets, sizes[name])]}"
                    for name, buckets in spec.tuning_keys)
    return f"{spec.qualname}[{format_functional(spec, functional)[1:-1].replace(' ', ',')}]@{keys}"


@dataclass(frozen=True)
class Cell:
    """A parsed cell name: table, block functional, and one bucket per key."""

    table: str
    functional: Functional
    buckets: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        spec = families.tables()[self.table]
        return (f"{self.table}[{format_functional(spec, self.functional)[1:-1].replace(' ', ',')}]@"
                + ",".join(f"{k}={v}" for k, v in self.buckets))


def parse_cell(text: str) -> Cell:
    """The inverse of :func:`cell_of`; ``ValueError`` for text that names no cell."""
    match = _CELL.match(text)
    if not match:
        raise ValueError(f"cell: expected table[axis=value,...]@key=bucket,..., got {text!r}")
    spec = families.tables().get(match["table"])
    if spec is None:
        raise ValueError(f"cell: no table {match['table']!r} is declared (have: {', '.join(families.tables())})")
    try:
        functional = parse_functional(spec, match["functional"].replace(",", " "), "cell")
    except tuning.TuningError as exc:
        raise ValueError(f"cell {text!r}: {exc}") from exc
    buckets = []
    for token in filter(None, match["keys"].split(",")):
        name, _, value = token.partition("=")
        declared = dict(spec.tuning_keys)
        if name not in declared or not value.isdigit() or int(value) not in declared[name]:
            raise ValueError(f"cell {text!r}: {token!r} is not a bucket of {spec.qualname}")
        buckets.append((name, int(value)))
    if [k for k, _ in buckets] != [k for k, _ in spec.tuning_keys]:
        raise ValueError(f"cell {text!r}: expected one bucket for each of {[k for k, _ in spec.tuning_keys]}")
    return Cell(match["table"], functional, tuple(buckets))


def suggest_patch(changes: Mapping[Cell, Config], comments: list[str]) -> dict[str, str]:
    """Patch texts (one per table) that set each cell to its configuration."""
    by_table: dict[str, Patch] = {}
    for cell, config in sorted(changes.items(), key=lambda item: str(item[0])):
        patch = by_table.setdefault(cell.table, Patch(cell.table, comments=[f"# {c}" for c in comments]))
        name = config_name(config)
        patch.configs[name] = config
        patch.edits.append(Edit(cell.functional, tuple((v,) for _, v in cell.buckets), name, 0))
    for patch in by_table.values():
        patch.edits.sort(key=lambda e: (str(e.functional), e.selection))
    return {table: write_patch(families.tables()[table], patch) for table, patch in by_table.items()}
