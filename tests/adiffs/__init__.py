"""The accuracy record: the measured maximum errors of each accuracy case, per architecture.

``tests/adiffs/<arch>.txt`` (``cpu.txt`` for Triton's interpreter, ``sm_90.txt`` for the
H200, ...) holds, per case of :mod:`tests.adiffs.cases`, ``max |kernel - float64
reference|`` of the output, the log-sum-exp and the three gradients, so that an accuracy
regression is a diff. ``tests/test_common_mistakes.py::test_within_floor`` measures each
case and fails when a quantity exceeds its recorded value by more than :data:`MARGIN`.

Refresh (after a deliberate change of the kernels' numerics; review the diff)::

    python -m tests.adiffs --update                  # cpu.txt
    python -m tests.adiffs --update --device cuda    # sm_90.txt on the H200 (from images, as the GPU tests run)
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import QUANTITIES, Results, max_abs_err

FOLDER = Path(__file__).resolve().parent

# How far a measured maximum error may exceed the recorded one. The interpreter is
# deterministic on one machine, but its fp32 products go through numpy's BLAS, whose
# rounding order differs between CPUs; GPU runs vary with the fused backward's atomics
# order and with the tuned block sizes.
MARGIN = {"cpu": 1.5, "cuda": 2.0}
# Errors below this are recorded as is but never count as a regression (fp32 noise).
FLOOR = 1e-9


def arch(device: str) -> str:
    """The record's name for ``device``: ``cpu``, or the GPU's architecture (``sm_90``)."""
    if device == "cpu":
        return "cpu"
    from aotattn.runtime.device import arch_of

    return arch_of(torch.device(device))


def path(device: str) -> Path:
    return FOLDER / f"{arch(device)}.txt"


def measure(kernel: Results, exact: Results) -> dict[str, float]:
    """max |kernel - exact| per quantity (inf for NaN or a mismatched +inf pattern)."""
    return {q: max_abs_err(kernel.get(q), exact.get(q)) for q in QUANTITIES if kernel.get(q) is not None}


def read(file: Path) -> dict[str, dict[str, float]]:
    """{case id: {quantity: max error}} from a record file."""
    record = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, *values = line.split()
        if len(values) != len(QUANTITIES):
            raise ValueError(f"{file}:{number}: expected a case and {len(QUANTITIES)} numbers, got {line!r}")
        if name in record:
            raise ValueError(f"{file}:{number}: case {name} recorded twice")
        record[name] = {q: float(v) for q, v in zip(QUANTITIES, values) if v != "-"}
    return record


def write(file: Path, arch_name: str, record: dict[str, dict[str, float]]) -> None:
    width = max(map(len, record), default=4) + 2
    lines = [
        f"# aotattn accuracy record, {arch_name}: max |kernel - float64 reference| per case and quantity.",
        "# Cases: tests/adiffs/cases.py. Refresh: python -m tests.adiffs --update"
        + ("" if arch_name == "cpu" else " --device cuda") + " (then review the diff).",
        "# " + "case".ljust(width - 2) + "".join(q.ljust(11) for q in QUANTITIES).rstrip(),
    ]
    for name, values in record.items():
        cells = [f"{values[q]:.3e}" if q in values else "-" for q in QUANTITIES]
        lines.append(name.ljust(width) + "".join(c.ljust(11) for c in cells).rstrip())
    tmp = file.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(file)


def regressions(measured: dict[str, float], recorded: dict[str, float], device: str) -> list[str]:
    """Quantities whose measured error exceeds the recorded one by more than the margin."""
    margin = MARGIN["cpu" if device == "cpu" else "cuda"]
    return [f"{q}: {measured[q]:.3e} > {margin} x recorded {recorded.get(q, 0.0):.3e}"
            for q in measured if measured[q] > max(margin * recorded.get(q, 0.0), FLOOR)]
