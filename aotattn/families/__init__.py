"""Kernel families: one directory each (kernels, rules, reference, operators).

Adding a family means adding its directory and its name to ``FAMILIES``; the build, the
runtime and the tuning database find its kernels and tables through :func:`tables`.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

FAMILIES = ("flash", "rmsnorm")


@cache
def tables() -> dict[str, Any]:
    """Every kernel and operator spec that has a tuning table, by ``family.name``."""
    found: dict[str, Any] = {}
    for family in FAMILIES:
        rules = importlib.import_module(f"aotattn.families.{family}.rules")
        for spec in rules.TABLES:
            found[spec.qualname] = spec
    return found


def kernels() -> dict[str, Any]:
    """Every kernel spec (the tables that compile to a kernel), by ``family.name``."""
    return {name: spec for name, spec in tables().items() if hasattr(spec, "arguments")}
