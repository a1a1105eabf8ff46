"""The toy application: squares numbers. pgdef's worked example (docs and tests).

::

    aotattn pgdef init
    python -c 'import json; [print(json.dumps({"x": i})) for i in range(100)]' \\
        | aotattn pgdef dispatch --category toy,square --pool cpu --payloads - --app aotattn.pgdef.toy
    aotattn pgdef worker --app aotattn.pgdef.toy --processes 2 --exit-when-idle
    aotattn pgdef results --category toy,square
"""

from __future__ import annotations

from typing import Any

from aotattn.pgdef.errors import PayloadError
from aotattn.pgdef.model import TaskContext
from aotattn.pgdef.registry import App

app = App("toy", "squares numbers: pgdef's example application")


def check_number(payload: dict[str, Any]) -> None:
    """A square task needs ``x``, an integer or a finite float (bool is not a number here)."""
    x = payload.get("x")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise PayloadError(f"toy,square: expected payload {{'x': number}}, got {payload!r}")


@app.task("square", device="cpu", max_attempts=3, validate=check_number)
def square(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """y = x * x."""
    x = payload["x"]
    return {"y": x * x}
