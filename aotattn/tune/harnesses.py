"""Which family harness tunes which table.

A harness is a module (one per family, e.g. :mod:`aotattn.tune.flash`) that provides
``TABLES``, ``supports``, ``default_tokens``, ``footprint``, ``current_config``, ``auxiliary``,
``image_key``, ``flops``, ``Problem``, ``timing_shape``, ``accuracy_shapes`` and
``errors`` (docs/tuner.md, "Adding a family"). Adding a family's tuning means adding
its module here; nothing else in the tuner names a family.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

HARNESSES = ("aotattn.tune.flash",)


@cache
def _modules() -> tuple[ModuleType, ...]:
    return tuple(importlib.import_module(name) for name in HARNESSES)


def tunable() -> list[str]:
    """Every table some harness can tune, ``family.name``."""
    return [table for module in _modules() for table in module.TABLES]


def harness(table: str) -> ModuleType:
    for module in _modules():
        if table in module.TABLES:
            return module
    raise ValueError(f"table: no tuner harness for {table!r} (tunable: {', '.join(tunable())})")


def supported(table: str, functional, cell: tuple[int, ...] | None = None, arch: str | None = None) -> bool:
    """Whether a harness can build problems for this functional of this table (at this cell,
    on this architecture)."""
    return table in tunable() and harness(table).supports(table, functional, cell, arch)
