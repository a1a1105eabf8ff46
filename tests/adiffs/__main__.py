"""``python -m tests.adiffs [--device cpu|cuda] [--update] [--only TEXT]``

Measures every accuracy case (tests/adiffs/cases.py) on the device and prints, per
case and quantity, the recorded and the measured maximum error. With ``--update`` it
writes the record (``tests/adiffs/<arch>.txt``); without, it exits 1 when a quantity
regressed beyond the margin or a case is missing from the record.

On the CPU, ``--update`` measures once per OpenBLAS kernel set in :data:`CORETYPES`
(each in a child process with ``OPENBLAS_CORETYPE`` set) and records the largest error:
the interpreter's products go through numpy's BLAS, which picks its kernels by the
processor, and their summation order moves fp32-level errors by up to 3x (seen: a record
made on an AVX-512 machine failed 8 cases on an AVX2 one).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from tests import adiffs
from tests.adiffs.cases import CASES
from tests.helpers import QUANTITIES

# OpenBLAS kernel sets an x86-64 CPU machine may pick (AVX-512, AVX2 on Intel and AMD, AVX, SSE3)
CORETYPES = ("SkylakeX", "Haswell", "Zen", "Sandybridge", "Prescott")


def _measure_under(coretype: str) -> dict[str, dict[str, float]]:
    """Every case's errors on the CPU with OpenBLAS's kernels for ``coretype``."""
    env = dict(os.environ, OPENBLAS_CORETYPE=coretype)
    done = subprocess.run([sys.executable, "-m", "tests.adiffs", "--json"], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"measuring under OPENBLAS_CORETYPE={coretype} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _largest(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {case: {q: max(run[case][q] for run in runs) for q in runs[0][case]} for case in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.adiffs", description=__doc__.split("\n\n")[1])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--update", action="store_true", help="write tests/adiffs/<arch>.txt")
    parser.add_argument("--only", default="", help="cases whose id contains this text (not with --update)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # one JSON line: what _measure_under reads
    args = parser.parse_args(argv)
    if args.update and args.only:
        parser.error("--update measures every case; drop --only")
    if args.json:
        print(json.dumps({case.id: adiffs.measure(*case.run(args.device)[::2]) for case in CASES}))
        return 0
    if args.update and args.device == "cpu":
        runs = []
        for coretype in CORETYPES:
            print(f"measuring with OPENBLAS_CORETYPE={coretype}", flush=True)
            runs.append(_measure_under(coretype))
        file = adiffs.path("cpu")
        adiffs.write(file, "cpu", _largest(runs))
        print(f"wrote {file} ({len(runs[0])} cases, the largest error over {', '.join(CORETYPES)})")
        return 0
    file = adiffs.path(args.device)
    recorded = adiffs.read(file) if file.exists() else {}
    measured, failed = {}, []
    for case in CASES:
        if args.only not in case.id:
            continue
        kernel, _, exact = case.run(args.device)
        measured[case.id] = values = adiffs.measure(kernel, exact)
        problems = (adiffs.regressions(values, recorded[case.id], args.device) if case.id in recorded
                    else ["not in the record"])
        cells = " ".join(f"{q} {recorded.get(case.id, {}).get(q, float('nan')):.2e}->{values[q]:.2e}"
                         for q in QUANTITIES if q in values)
        print(f"{case.id:40s} {cells}  {'; '.join(problems) or 'ok'}", flush=True)
        failed += [case.id] if problems else []
    if args.update:
        adiffs.write(file, adiffs.arch(args.device), measured)
        print(f"wrote {file} ({len(measured)} cases)")
        return 0
    print(f"{len(failed)} of {len(measured)} cases differ from {file.name}" if failed else f"all match {file.name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
