"""Run a batch of tuning tasks on a host with no database: ``python -m aotattn.tune.offline``.

Two batch formats:

* a pgdef batch (``aotattn tune checkout``): run with pgdef's offline runner
  (:func:`aotattn.pgdef.offline.run_offline`, the ``aotattn.tune.app`` handlers), results
  appended to ``<results>/results-<shard>.jsonl`` for ``aotattn pgdef checkin``;
* JSON lines of tasks (``aotattn tune plan --out``): run here, one result file per task
  (``<results>/<task id>.json``), for ``aotattn tune export <results>`` directly.

Both resume: a task that has a result is skipped. No typer or rich is needed (the GPU
host may lack them); the session script ``benchmarks/tune_session.sh`` calls this.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aotattn.files import write_atomically
from aotattn.tune.runner import EXIT_DEVICE_LOST, DeviceLost, Settings, journal_dir, run_task
from aotattn.tune.tasks import read_batch_settings


def parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError as exc:
        raise ValueError(f"--shard: expected I/N like 0/2, got {text!r}") from exc
    if not 0 <= index < count:
        raise ValueError(f"--shard: expected 0 <= I < N, got {text!r}")
    return index, count


def pgdef_batch(text: str) -> dict | None:
    """The batch, when ``text`` is one JSON document of format ``pgdef-batch/...`` (whatever
    its spacing); None for JSON lines (``tune plan --out``), whose lines are task payloads."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    format_ = data.get("format") if isinstance(data, dict) else None
    return data if isinstance(format_, str) and format_.startswith("pgdef-batch/") else None


def is_pgdef_batch(path: Path) -> bool:
    return pgdef_batch(Path(path).read_text(encoding="utf-8")) is not None


def run_batch(batch: Path, results: Path, *, shard: str = "0/1", device: str | None = None,
              deadline_s: float | None = None, db: Any = None,
              log: Callable[[str], None] = lambda line: None) -> int:
    """Run the shard's tasks of a ``tune plan --out`` file without pgdef; returns how many ran."""
    start = time.monotonic()
    index, count = parse_shard(shard)
    entries = read_batch_settings(Path(batch).read_text(encoding="utf-8"), str(batch), Settings.of_line)[index::count]
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    ran = 0
    for task, line_settings in entries:
        out = results / f"{task.id}.json"
        if out.is_file():
            continue
        if deadline_s is not None and time.monotonic() - start > deadline_s:
            log(f"deadline: {len(entries)} tasks in the shard, stopping before {task.describe()}")
            break
        log(f"{task.describe()}")
        result = run_task(task, line_settings, device=device, db=db,
                          journal=journal_dir(), log=log)
        write_atomically(out, json.dumps(result, indent=1, allow_nan=False) + "\n")
        ran += 1
    return ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotattn.tune.offline", description=__doc__.split("\n")[0])
    parser.add_argument("batch", type=Path)
    parser.add_argument("--results", type=Path, required=True, help="folder for the results")
    parser.add_argument("--shard", default="0/1", help="I/N: every N-th task from I (one shard per GPU)")
    parser.add_argument("--gpu", type=int, default=None, help="GPU index (passed to pgdef handlers)")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no task after this many seconds "
                        "(JSON-lines batches; for pgdef batches the session script's timeout stops the run)")
    args = parser.parse_args(argv)
    index, count = parse_shard(args.shard)
    try:
        if is_pgdef_batch(args.batch):
            from aotattn.pgdef.offline import run_offline

            report = run_offline(args.batch, args.results / f"results-{index}.jsonl", ["aotattn.tune.app"],
                                 shard=(index, count), gpu=args.gpu)
            print(f"{report.ran} tasks run ({report.ok} ok, {report.errors} errors), {report.skipped} already done")
        else:
            ran = run_batch(args.batch, args.results, shard=args.shard, deadline_s=args.deadline_s,
                            log=lambda line: print(line, flush=True))
            print(f"{ran} tasks run into {args.results}")
    except DeviceLost as exc:
        print(f"device lost: {exc}; rerun to resume", file=sys.stderr, flush=True)
        os._exit(EXIT_DEVICE_LOST)
    return 0


if __name__ == "__main__":
    sys.exit(main())
