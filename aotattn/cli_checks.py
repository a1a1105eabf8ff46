"""Option checks shared by the command lines (click's ranges let NaN and infinities through)."""

from __future__ import annotations

import math

import typer


def finite(value: float | None, option: str, least: float = 0.0) -> None:
    """Refuse NaN, infinities and values below ``least`` as a bad ``option``."""
    if value is not None and not (math.isfinite(value) and value >= least):
        raise typer.BadParameter(f"expected a finite number >= {least:g}, got {value}", param_hint=option)
