"""The unforced operator under two tuning databases, side by side in one process (issue 14).

    python benchmarks/bench_tuned.py --baseline build/tuning-seeded [--group dense --group model ...]
        [--images DIR] [--compile --jobs 16] [--json out.json]
    python benchmarks/bench_tuned.py --baseline ... --group all --images DIR --compile-only   (then one
        process per GPU on disjoint groups, CUDA_VISIBLE_DEVICES=i)

For every selected perfmon entry (default groups: dense, model, odd-dim, nonsquare, gqa,
training) and each of its passes, the public operator is timed as users call it (no
backend forced) once with the database under test (``--tuning-db``, default the
project's ``tuning/``: the tuned patches) and once with ``--baseline`` (for example a copy
of ``tuning/`` without its ``*-tuned.dbpatch`` files: the hand-seeded tables), in
interleaved rounds (perfmon's timing: L2 flushed, median of event-timed calls; training
entries back to back). The database is switched through ``AOTATTN_TUNING_DB``, which the
operators' plan cache keys on, so both run from the same images. Prints one line per entry
and pass, then the count of entries faster, within noise and slower beyond noise (and
those whose launches are the very same kernels under both databases, "same plan": their
differences are noise whatever the spread says), and the geometric mean of the speed-up
per group.

``--compile`` first builds the kernels both databases select for the entries into
``--images`` (what ``aotattn perfmon images`` builds, once per database, into one folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from aotattn import tuning
from aotattn.tuning.database import default_root
from aotattn.perfmon import entries as E
from aotattn.perfmon import measure
from aotattn.perfmon import providers as P
from aotattn.perfmon.budget import Plan

GROUPS = ("dense", "model", "odd-dim", "nonsquare", "gqa", "training")


@contextlib.contextmanager
def database(root: Path):
    """Calls inside use the tuning database at ``root``."""
    old = os.environ.get(tuning.ENV_VAR)
    os.environ[tuning.ENV_VAR] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(tuning.ENV_VAR, None)
        else:
            os.environ[tuning.ENV_VAR] = old


def runner_under(entry, x, pass_: str, root: Path):
    """perfmon's timed call of the unforced operator, made and run under ``root``'s database
    (a backward pass's forward is made there too: it decides the plans the backward uses)."""
    with database(root):
        inner = measure._runner(entry, x, pass_, P.AOTATTN)

    def run():
        with database(root):
            return inner()
    return run


def chosen(entry, x, pass_: str, root: Path) -> tuple:
    """The (kernel, functional, configuration) of every launch the pass makes under
    ``root``'s database: equal under both databases means the same kernels run."""
    from aotattn.perfmon.provenance import recording_lookups

    with database(root), P.quiet(), recording_lookups() as lookups:
        measure.evaluate(entry, x, pass_, P.AOTATTN, entry.dropout_p)
    return tuple(sorted({(l.spec.qualname, str(l.functional), str(l.config)) for l in lookups}))


def compile_images(selected, roots: list[Path], images: Path, jobs: int) -> None:
    from aotattn.perfmon.images import build

    for root in roots:
        start = time.perf_counter()
        outcomes, _ = build(selected, "sm_90", images, Path("build/cache"), jobs, 600.0,
                            db=tuning.Database(root))
        failed = [o for o in outcomes if o.status not in ("compiled", "cached")]
        print(f"images for {root}: {len(outcomes)} kernels ({len(failed)} failed) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the tuning database to compare against")
    ap.add_argument("--tuning-db", type=Path, default=None, help="the database under test (default: tuning/)")
    ap.add_argument("--group", action="append", default=None, help=f"entry groups (default: {', '.join(GROUPS)})")
    ap.add_argument("--match", action="append", default=[], help="entry name globs")
    ap.add_argument("--images", type=Path, default=None)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="build the images, time nothing (then run "
                    "several processes, one per GPU, on disjoint --group selections)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tested = (args.tuning_db or default_root()).resolve()
    baseline = args.baseline.resolve()
    groups = args.group or ([] if args.match else GROUPS)
    if "all" in groups:
        groups = sorted({e.group for e in E.declared()})
    selected = E.select(E.declared(), args.match, groups)
    if args.images:
        os.environ["AOTATTN_IMAGES"] = str(args.images.resolve())
    if args.compile or args.compile_only:
        compile_images(selected, [tested, baseline], args.images, args.jobs)
    if args.compile_only:
        return 0
    device = torch.device("cuda")
    plan = Plan(rounds=args.rounds, reps=args.reps, warmup=2)
    rows = []
    print(f"{'entry':44} {'pass':7} {'baseline ms':>11} {'tested ms':>10} {'speed-up':>8}  noise", flush=True)
    for entry in selected:
        x = P.make_inputs(entry, device, 0)
        for pass_ in entry.passes:
            runners = {"baseline": runner_under(entry, x, pass_, baseline),
                       "tested": runner_under(entry, x, pass_, tested)}
            timed, failed = measure._time(entry, runners, plan, device)
            if failed:
                print(f"{entry.name:44} {pass_:7} failed: {failed}", flush=True)
                continue
            (b_ms, b_spread), (t_ms, t_spread) = timed["baseline"], timed["tested"]
            noise = max(b_spread, t_spread)
            verdict = "faster" if b_ms - t_ms > noise else "slower" if t_ms - b_ms > noise else "same"
            if chosen(entry, x, pass_, baseline) == chosen(entry, x, pass_, tested):
                verdict = "same plan"  # the very same kernels: any difference is noise
            rows.append(dict(entry=entry.name, group=entry.group, pass_=pass_, baseline_ms=b_ms, tested_ms=t_ms,
                             noise_ms=noise, speedup=b_ms / t_ms, verdict=verdict))
            print(f"{entry.name:44} {pass_:7} {b_ms:11.4f} {t_ms:10.4f} {b_ms / t_ms:8.3f}  {noise:.4f} {verdict}",
                  flush=True)
        del x
        torch.cuda.empty_cache()

    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("faster", "same", "slower", "same plan")}
    print(f"\n{len(rows)} entry passes: {counts['faster']} faster, {counts['same']} within noise, "
          f"{counts['slower']} slower beyond noise, {counts['same plan']} with the same kernels under both "
          f"(tested {tested} against baseline {baseline})")
    for group in sorted({r["group"] for r in rows}):
        for pass_ in sorted({r["pass_"] for r in rows if r["group"] == group}):
            part = [r["speedup"] for r in rows if r["group"] == group and r["pass_"] == pass_]
            mean = math.exp(sum(map(math.log, part)) / len(part))
            print(f"  {group:10} {pass_:7} {len(part):3} entries: geometric mean {mean:.3f}x, "
                  f"min {min(part):.3f}x, max {max(part):.3f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
