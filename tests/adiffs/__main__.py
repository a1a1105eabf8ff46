"""``python -m tests.adiffs [--device cpu|cuda] [--update] [--only TEXT]``

Measures every accuracy case (tests/adiffs/cases.py) on the device and prints, per
case and quantity, the recorded and the measured maximum error. With ``--update`` it
writes the record (``tests/adiffs/<arch>.txt``); without, it exits 1 when a quantity
regressed beyond the margin or a case is missing from the record.
"""

from __future__ import annotations

import argparse
import sys

from tests import adiffs
from tests.adiffs.cases import CASES
from tests.helpers import QUANTITIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.adiffs", description=__doc__.split("\n\n")[1])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--update", action="store_true", help="write tests/adiffs/<arch>.txt")
    parser.add_argument("--only", default="", help="cases whose id contains this text (not with --update)")
    args = parser.parse_args(argv)
    if args.update and args.only:
        parser.error("--update measures every case; drop --only")
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
