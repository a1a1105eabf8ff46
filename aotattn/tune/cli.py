"""``aotattn tune``: plan, dispatch, checkout, compile, worker, run, export (docs/tuner.md)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from aotattn.cli_checks import finite

app = typer.Typer(help="The tuner: each cell's configuration chosen at GPU-filling sizes (docs/tuner.md).",
                  no_args_is_help=True)
console = Console(soft_wrap=True)

CATEGORY = typer.Option(["flash"], "--category", "-c", help="family or family,kernel (repeatable), e.g. "
                        "flash,attn_fwd or flash,backward")
WHERE = typer.Option(None, help='axes and values, e.g. "dtype=fp16,bf16 BLOCK_D=64,128 MASK=0,2"')
DTYPE = typer.Option(None, "--dtype", help="dtypes (the dtype axis; default fp16,bf16)")
HEAD_DIM = typer.Option(None, "--head-dim", help="head-dim buckets, e.g. 64,128 (the BLOCK_D axis; default all)")
SEQLEN = typer.Option(None, "--seqlen", help="sequence-length buckets, e.g. 1024,4096 (default all)")
CELLS = typer.Option("diagonal", "--cells",
                     help="diagonal (seqlen_q = seqlen_k), grid (every pair), off-diagonal (seqlen_q != "
                     "seqlen_k), or cells one by one: 128x16384,1024x1024 (seqlen_q x seqlen_k)")
ARCH = typer.Option("sm_90", "--arch", help="architecture (also the pgdef pool)")
ALL = typer.Option(False, "--all-functionals", help="also refinements (padded heads, ...), not only roots")
LIMIT = typer.Option(None, "--limit", help="candidates per cell kept by the speed model (plus the current choice "
                     "and its tile's knob variants; "
                     "default: the harness's per table, 8 for most)")
KNOBS = typer.Option(True, "--knobs/--no-knobs", help="also time every knob variant of the current choice's "
                     "tile (the speed model ranks tiles, not knobs; --no-knobs: fewer kernels to compile)")
TOKENS = typer.Option(None, "--tokens", help="batch x heads x seqlen_q of the timed problem (default: the "
                      "harness's per table: 2^17 for kernel tables, 2^19 for flash.backward)")
STALE = typer.Option(False, "--stale", help="only cells the tuner timed on another problem than these settings time "
                     "(older settings, such as before the 128 MiB floor, timed smaller ones) or found nothing "
                     "eligible in; cells it never timed are left out (--untimed)")
STALE_GPU = typer.Option(None, "--gpu", help="with --stale: also the cells timed on a device whose name does not "
                         "hold this text (any case), e.g. H200 to re-time on the H200 what an H100 tuned")
UNTIMED = typer.Option(False, "--untimed", help="only cells the tuner never timed (their choice was set by hand "
                       "or seeded); with --stale, those and the stale ones")
TUNING_DB = typer.Option(None, "--tuning-db", help="tuning database root (default: $AOTATTN_TUNING_DB or tuning/)")
DSN = typer.Option(None, "--dsn", envvar="AOTATTN_PGDEF_DSN", help="pgdef database (default: the embedded server)")
HOME = typer.Option(None, "--home", envvar="AOTATTN_PGDEF_HOME", help="work folder of pgdef's embedded server")


def _db(root: Path | None):
    from aotattn.tuning import Database

    if root is not None and not root.is_dir():  # planned silently without the database's current configurations
        raise typer.BadParameter(f"no tuning database at {root} (a folder of <vendor>/<arch>/ tables): name an "
                                 "existing one, or leave the option out for the installed database",
                                 param_hint="--tuning-db")
    return Database(root) if root else Database()


def _select(category: list[str], where: str | None, dtype: str, head_dim: str | None, seqlen: str | None,
            cells: str, arch: str, all_functionals: bool):
    """(tasks the harnesses support, how many the selection had)."""
    from aotattn.tune import harnesses, tasks

    filters = tasks.parse_where(where)
    for option, axis, given in (("--dtype", "dtype", dtype), ("--head-dim", "BLOCK_D", head_dim)):
        if given is not None and axis in filters:
            raise tasks.SelectionError(f"{option} and --where {axis}=... both given: give the {axis} values once")
        if given is not None:
            filters[axis] = tuple(v for v in given.split(",") if v)
            if not filters[axis]:  # "" or "," selected every value
                raise tasks.SelectionError(f"{option}: expected values separated by commas, got {given!r}")
    filters.setdefault("dtype", ("fp16", "bf16"))
    try:
        lengths = [int(v) for v in seqlen.split(",") if v] if seqlen is not None else None
        if lengths is not None and not lengths:  # ",,," selected every bucket
            raise ValueError(seqlen)
    except ValueError as exc:
        raise tasks.SelectionError(f"--seqlen: expected buckets like 1024,4096, got {seqlen!r}") from exc
    tables = tasks.select_tables(category, harnesses.tunable())
    found = list(tasks.enumerate_tasks(arch, tables, filters, lengths, cells, all_functionals))
    chosen = [t for t in found if harnesses.supported(t.table, t.functional, t.cell, t.arch)]
    if not chosen and any(harnesses.supported(t.table, t.functional, t.cell) for t in found):
        elsewhere = sorted({t.table for t in found if harnesses.supported(t.table, t.functional, t.cell)})
        raise tasks.SelectionError(f"the selection holds no task the tuner can run on {arch}: "
                                   f"{', '.join(elsewhere)} run only on other architectures (--arch)")
    if not chosen:
        raise tasks.SelectionError("the selection holds no task the tuner can run (bias and varlen "
                                   "functionals are not tuned yet)")
    return chosen, len(found)


def _check_gpu(stale: bool, gpu: str | None) -> None:
    if gpu is not None and not stale:
        raise typer.BadParameter("--gpu selects among stale cells: give --stale with it", param_hint="--gpu")
    if gpu is not None and not gpu.strip():
        raise typer.BadParameter("expected part of a GPU's name, e.g. H200", param_hint="--gpu")


def _outdated(chosen, limit: int | None, tokens: int | None, knobs: bool, db, stale: bool, untimed: bool,
              gpu: str | None):
    """The tasks of ``chosen`` whose cells are stale (``--stale [--gpu]``) or never timed
    (``--untimed``), in their order, said on the console; all of them when neither is given."""
    from aotattn.tune import export
    from aotattn.tune.runner import timed_problem

    if not (stale or untimed):
        return chosen
    settings = _settings_by_table(chosen, limit, tokens, knobs)
    now = {t: str(timed_problem(t, settings[t.table])) for t in chosen}
    by_table: dict[str, list] = {}
    for task in chosen:
        by_table.setdefault(task.table, []).append(task)
    found, never, lines = [], [], []
    for table, tasks in sorted(by_table.items()):
        old, untouched = export.stale(tasks, now, db, gpu)
        found += old
        never += untouched
        lines.append(f"  {table}: {len(old)} stale, {len(untouched)} never timed, "
                     f"{len(tasks) - len(old) - len(untouched)} up to date")
    where, current = f" or off {gpu}" if gpu else "", len(chosen) - len(found) - len(never)
    if stale and not untimed:
        console.print(f"--stale: {len(found)} of {len(chosen)} cells timed on other problems than these settings "
                      f"time{where} ({len(never)} never timed by the tuner, {current} up to date)")
    elif untimed and not stale:
        console.print(f"--untimed: {len(never)} of {len(chosen)} cells never timed by the tuner ({len(found)} "
                      f"timed on other problems than these settings time, {current} up to date)")
    else:
        console.print(f"--stale --untimed: {len(found) + len(never)} of {len(chosen)} cells: {len(found)} timed on "
                      f"other problems than these settings time{where}, {len(never)} never timed by the tuner "
                      f"({current} up to date)")
    if len(lines) > 1:
        console.print("\n".join(lines))
    kept = set((found if stale else []) + (never if untimed else []))
    if not kept:
        raise typer.Exit(0)
    return [task for task in chosen if task in kept]


def _settings(limit: int | None, tokens: int | None, table: str, knobs: bool = True):
    """A task's settings: ``limit`` and ``tokens`` when given, else its table's harness defaults."""
    from aotattn.tune.runner import Settings

    given = {"limit": limit, "tokens": tokens, "knobs": None if knobs else False}
    return Settings.of_line(table, {name: value for name, value in given.items() if value is not None})


def _settings_by_table(chosen, limit: int, tokens: int | None, knobs: bool = True) -> dict[str, Any]:
    return {table: _settings(limit, tokens, table, knobs) for table in {t.table for t in chosen}}


def _summary(chosen, unsupported: int, limit: int, tokens: int | None, db, knobs: bool = True) -> None:
    from aotattn.tune import ahead
    from aotattn.tune.estimate import gpu_seconds

    settings = _settings_by_table(chosen, limit, tokens, knobs)
    jobs = ahead.plan([(t, settings[t.table]) for t in chosen], db)
    functionals = {(t.table, t.functional) for t in chosen}
    seconds = sum(gpu_seconds(t, settings[t.table], db) for t in chosen)
    console.print(f"{len(chosen)} tasks ({unsupported} unsupported left out) over {len(functionals)} "
                  f"functionals; {len(jobs)} kernels to compile; about {seconds / 60:.1f} GPU-minutes")


@app.command()
def plan(category: list[str] = CATEGORY, where: str = WHERE, dtype: str = DTYPE, head_dim: str = HEAD_DIM,
         seqlen: str = SEQLEN, cells: str = CELLS, arch: str = ARCH, all_functionals: bool = ALL,
         limit: int = LIMIT, knobs: bool = KNOBS, tokens: int = TOKENS, stale: bool = STALE,
         gpu: str = STALE_GPU, untimed: bool = UNTIMED, tuning_db: Path = TUNING_DB,
         out: Path = typer.Option(None, "--out", help="write the tasks as JSON lines (a batch for `tune run`)")) -> None:
    """Show what a selection holds (tasks, kernels to compile, GPU time); optionally write it as a batch."""
    from aotattn.files import write_atomically
    from aotattn.tune.tasks import write_batch

    chosen, total = _select(category, where, dtype, head_dim, seqlen, cells, arch, all_functionals)
    db, unsupported = _db(tuning_db), total - len(chosen)
    _check_gpu(stale, gpu)
    chosen = _outdated(chosen, limit, tokens, knobs, db, stale, untimed, gpu)
    _summary(chosen, unsupported, limit, tokens, db, knobs)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        settings = _settings_by_table(chosen, limit, tokens, knobs)
        write_atomically(out, write_batch(chosen, {table: s.to_json() for table, s in settings.items()}))
        console.print(f"wrote {out}")


@app.command()
def dispatch(category: list[str] = CATEGORY, where: str = WHERE, dtype: str = DTYPE, head_dim: str = HEAD_DIM,
             seqlen: str = SEQLEN, cells: str = CELLS, arch: str = ARCH, all_functionals: bool = ALL,
             limit: int = LIMIT, knobs: bool = KNOBS, tokens: int = TOKENS, stale: bool = STALE,
             gpu: str = STALE_GPU, untimed: bool = UNTIMED, tuning_db: Path = TUNING_DB,
             rerun: str = typer.Option(None, "--rerun", help="any label: queue tasks again even if done before"),
             priority: int = typer.Option(0, help="higher runs first"),
             dsn: str = DSN, home: Path = HOME) -> None:
    """Queue tuning tasks in pgdef (category tune,<table>, pool = the architecture)."""
    from aotattn.pgdef import Client
    from aotattn.tune.app import category as category_of
    from aotattn.tune.app import task_spec

    chosen, total = _select(category, where, dtype, head_dim, seqlen, cells, arch, all_functionals)
    unsupported = total - len(chosen)
    _check_gpu(stale, gpu)
    chosen = _outdated(chosen, limit, tokens, knobs, _db(tuning_db), stale, untimed, gpu)
    settings = _settings_by_table(chosen, limit, tokens, knobs)
    by_table: dict[str, list] = {}
    for task in chosen:
        by_table.setdefault(task.table, []).append(task_spec(task, settings[task.table], rerun, priority))
    with Client(dsn, home=home) as client:
        client.init()
        for table, specs in by_table.items():
            report = client.dispatch(category_of(table), arch, specs, app="aotattn.tune.app")
            console.print(f"{category_of(table)} on {arch}: {report}")
    if unsupported:
        console.print(f"{unsupported} selected tasks left out (bias, varlen: not tuned yet)")


@app.command()
def checkout(arch: str = ARCH, out: Path = typer.Option(..., "--out", "-o", help="the batch file to write"),
             minutes: float = typer.Option(7.0, help="GPU minutes the batch should take (estimated)"),
             gpus: int = typer.Option(1, min=1, help="GPUs that will run it (the batch holds minutes x gpus)"),
             max_kernels: int = typer.Option(1000, "--max-kernels", min=1, help="at most this many kernels to compile "
                                             "(images travel to the GPU host: ~60 KB each)"),
             tuning_db: Path = TUNING_DB,
             lease: float = typer.Option(86400.0, help="seconds before unreturned tasks are queued again"),
             dsn: str = DSN, home: Path = HOME) -> None:
    """Claim queued tuning tasks into an offline batch sized to fit ``--minutes`` of GPU time."""
    from aotattn.pgdef import Client, PayloadError
    from aotattn.tune import ahead
    from aotattn.tune.app import APP, parse_payload
    from aotattn.tune.estimate import gpu_seconds

    if not (math.isfinite(minutes) and minutes > 0):  # NaN claimed every queued task, -5 one of them
        raise typer.BadParameter(f"expected a finite number of minutes above 0, got {minutes}", param_hint="--minutes")
    db = _db(tuning_db)
    with Client(dsn, home=home) as client:
        queued = [t for t in client.tasks(APP, arch, states=["queued"])]
        queued.sort(key=lambda t: (-t.priority, t.id))  # pgdef's claiming order
        budget, spent, count, jobs = minutes * 60.0 * gpus, 0.0, 0, set()
        for info in queued:
            try:
                task, settings = parse_payload(info.payload)
            except PayloadError as exc:  # dispatched without the app's check: say which, and what to do
                raise PayloadError(f"queued task {info.id} ({info.category}) cannot be tuned: {exc}; cancel it "
                                   f"(aotattn pgdef cancel --id {info.id}) and check out again") from exc
            needed = {(j.table, j.functional, j.config) for j in ahead.task_jobs(task, settings, db)}
            cost = gpu_seconds(task, settings, db)
            if count and (spent + cost > budget or len(jobs | needed) > max_kernels):
                break
            spent, count, jobs = spent + cost, count + 1, jobs | needed
        if not count:
            console.print(f"nothing queued for {arch}")
            return
        chosen = queued[:count]
        categories = sorted({str(info.category) for info in chosen})
        # the tasks sized above and no others (another claimer may take some meanwhile: fewer, never others)
        batch = client.checkout(arch, categories, out, limit=count, lease_s=lease, task_ids=[t.id for t in chosen])
    if batch is None:
        console.print(f"nothing queued for {arch} any more (claimed meanwhile by another worker or checkout)")
        return
    if len(batch.tasks) < count:
        kept = {t.id for t in batch.tasks}
        spent = sum(gpu_seconds(*parse_payload(t.payload), db) for t in chosen if t.id in kept)
    console.print(f"batch {batch.id}: {len(batch.tasks)} tasks (~{spent / 60:.1f} GPU-minutes, {len(jobs)} kernels) "
                  f"in {out}")


def _batch_tasks(path: Path):
    """Tasks and settings of a pgdef batch file or a `tune plan --out` file."""
    from aotattn.tune.offline import pgdef_batch
    from aotattn.tune.runner import Settings
    from aotattn.tune.tasks import read_batch_settings

    text = path.read_text(encoding="utf-8")
    batch = pgdef_batch(text)
    if batch is not None:
        from aotattn.tune.app import parse_payload

        tasks = batch.get("tasks")
        if not isinstance(tasks, list) or not all(isinstance(t, dict) and "payload" in t for t in tasks):
            raise ValueError(f"{path}: a pgdef batch whose tasks are not a list of tasks with payloads "
                             "(aotattn tune checkout writes them)")
        return [parse_payload(t["payload"]) for t in tasks]
    return read_batch_settings(text, str(path), Settings.of_line)


@app.command("compile")
def compile_command(batch: Path = typer.Argument(..., help="pgdef batch file or `tune plan --out` file"),
                    images: Path = typer.Option(..., "--images", help="image folder to fill (carry it to the GPU)"),
                    jobs: int = typer.Option(os.cpu_count() or 1, "--jobs", min=1, help="parallel compiler processes"),
                    cache: Path = typer.Option(None, help="compiled-kernel cache (default: build/cache/)"),
                    timeout: float = typer.Option(600.0, help="seconds before one compile is abandoned"),
                    tuning_db: Path = TUNING_DB,
                    dry_run: bool = typer.Option(False, "--dry-run", help="only count the kernels")) -> None:
    """Compile every kernel a batch needs, ahead of the GPU slice, into an image folder."""
    from aotattn.compiler.builder import DEFAULT_CACHE, check_timeout
    from aotattn.tune import ahead

    check_timeout(timeout)
    db = _db(tuning_db)
    pairs = _batch_tasks(batch)
    needed = ahead.plan(pairs, db)
    console.print(f"{len(pairs)} tasks need {len(needed)} kernels")
    if dry_run:
        return
    start = time.monotonic()
    failed = []
    report = ahead.compile_ahead(needed, images, cache or DEFAULT_CACHE, jobs, timeout,
                                 on_outcome=lambda o: failed.append(o) if o.status in ("failed", "timeout") else None)
    for outcome in failed:
        last = outcome.message.splitlines()[-1] if outcome.message else ""
        console.print(escape(f"FAILED {outcome.job.table} [{outcome.job.functional}] {outcome.job.config}: {last}"),
                      style="red")
    counts: dict[str, int] = {}
    for outcome in report.outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    size = sum(p.stat().st_size for p in report.archives)
    per = report.seconds_per_kernel()
    console.print(f"{', '.join(f'{n} {s}' for s, n in sorted(counts.items()))} in {time.monotonic() - start:.0f} s "
                  f"with {jobs} processes ({'-' if per is None else f'{per:.1f}'} CPU-s per compiled kernel); "
                  f"{len(report.archives)} archives, {size / 2**20:.1f} MiB in {images}")


@app.command()
def worker(arch: str = ARCH, gpus: str = typer.Option("0", "--gpus", help="one worker per GPU index, e.g. 0,1"),
           images: Path = typer.Option(None, "--images", help="image folder of the candidates (AOTATTN_IMAGES)"),
           journal: Path = typer.Option(Path("build/tune/journal"), "--journal", help="per-task journals (resume)"),
           exit_when_idle: bool = typer.Option(False, "--exit-when-idle"),
           dsn: str = DSN, home: Path = HOME) -> None:
    """Run GPU workers that take tuning tasks from pgdef (online; offline hosts: benchmarks/tune_session.sh).

    ``aotattn pgdef worker --app aotattn.tune.app --pool ARCH --gpus ...`` with the image
    folder and the journals in the environment.
    """
    import subprocess
    import sys

    from aotattn.pgdef.worker import wait_workers
    from aotattn.tune.runner import JOURNAL_VAR

    env = dict(os.environ, **{JOURNAL_VAR: str(journal.resolve())})
    if images:
        env["AOTATTN_IMAGES"] = str(images.resolve())
    command = [sys.executable, "-m", "aotattn.pgdef", "worker", "--app", "aotattn.tune.app", "--pool", arch,
               "--gpus", gpus, *(["--exit-when-idle"] if exit_when_idle else []), *(["--dsn", dsn] if dsn else []),
               *(["--home", str(home)] if home else [])]
    raise typer.Exit(wait_workers([subprocess.Popen(command, env=env)])[0])  # SIGTERM reaches the workers


@app.command()
def run(batch: Path = typer.Argument(..., help="a `tune plan --out` file (JSON lines of tasks)"),
        results: Path = typer.Option(..., "--results", help="folder of result files (one JSON per task)"),
        shard: str = typer.Option("0/1", help="run every N-th task from I, as I/N"),
        device: str = typer.Option(None, help="cuda (default when present) or cpu (the interpreter)"),
        deadline: float = typer.Option(None, "--deadline-s", help="start no task after this many seconds"),
        tuning_db: Path = TUNING_DB) -> None:
    """Run tasks without pgdef: results as files, resumable (skips tasks that have one)."""
    from aotattn.tune.offline import run_batch

    finite(deadline, "--deadline-s")
    if device not in (None, "cuda", "cpu"):
        raise typer.BadParameter(f"expected cuda or cpu, got {device!r}", param_hint="--device")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("this torch sees no CUDA GPU: run on a GPU machine, or pass --device cpu for "
                                     "Triton's interpreter", param_hint="--device")
    done = run_batch(batch, results, shard=shard, device=device, deadline_s=deadline, db=_db(tuning_db),
                     log=lambda line: console.print(escape(line)))
    console.print(f"{done} tasks run into {results}")


def _load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Tuner results from pgdef results files (JSON lines), result folders or single result files."""
    from aotattn.tune.runner import RESULT_FORMAT

    found: list[dict[str, Any]] = []
    for path in paths:
        # in a folder, *.json and *.jsonl only: `tune run` may leave a .<id>.json.<...>.tmp when killed mid-write
        files = sorted(f for f in path.rglob("*.json*") if f.suffix in (".json", ".jsonl")) if path.is_dir() else [path]
        for file in files:
            text = file.read_text(encoding="utf-8")
            if file.suffix == ".jsonl":
                if '"format":"pgdef-results/' not in text[:200].replace(" ", ""):
                    continue  # a journal
                from aotattn.pgdef.offline import read_results

                found += [o.output for o in read_results(file)[1] if o.ok]
            else:
                try:
                    data = json.loads(text)
                except ValueError as exc:
                    raise ValueError(f"{file}: not JSON ({exc}); expected a tuner result file or a pgdef "
                                     "results file (leave it out, or re-run its task)") from exc
                found += data if isinstance(data, list) else [data]
    return [r for r in found if isinstance(r, dict) and r.get("format") == RESULT_FORMAT]


@app.command()
def export(results: list[Path] = typer.Argument(None, help="result files or folders (default: pgdef's results)"),
           tuning_db: Path = TUNING_DB, dry_run: bool = typer.Option(False, "--dry-run"),
           arch: str = typer.Option(None, "--arch", help="only results for this architecture"),
           unmask: bool = typer.Option(False, "--unmask", help="take the tuned cells out of later patches that set "
                                       "exactly them (hand patches the tuner re-timed, their choice as the current "
                                       "one), deleting a patch left empty"),
           dsn: str = DSN, home: Path = HOME) -> None:
    """Write the winners as .dbpatch layers of the tuning database (re-export replaces only their cells)."""
    from aotattn.tune import export as exporter

    if results:
        found = _load_results(results)
    else:
        from aotattn.pgdef import Client
        from aotattn.tune.app import APP

        with Client(dsn, home=home) as client:
            found = [r.output for r in client.results(APP, arch)]
    found = [r for r in exporter.latest(found) if arch is None or r["task"]["arch"] == arch]
    if not found:
        raise ValueError("no tuner results to export (check in offline batches first: aotattn pgdef checkin)")
    for table in exporter.export(found, _db(tuning_db), dry_run=dry_run, unmask=unmask):
        empty = f"; {len(table.empty)} without a winner, left as they were" if table.empty else ""
        console.print(f"{table.arch} {table.table}: {table.cells} cells from results ({table.unchanged} keep the "
                      f"current choice), {table.kept} kept from before{empty} -> {table.path}"
                      + (" (dry run)" if dry_run else ""), soft_wrap=True)
        for why in table.empty[:3]:
            console.print(f"  no winner: {why}", soft_wrap=True, markup=False)
        if len(table.empty) > 3:
            console.print(f"  ... and {len(table.empty) - 3} more")
        for name, cells in table.unmasked.items():
            gone = " (left empty: deleted)" if name in table.removed else ""
            console.print(f"{'would take' if dry_run else 'took'} {len(cells)} tuned cell(s) out of {name}{gone}")
        if table.masked:
            patches = ", ".join(sorted(set(table.masked.values())))
            console.print(f"[yellow]warning[/]: {len(table.masked)} of these cells are set otherwise by a later patch "
                          f"({patches}): calls keep running its choice; remove it where the export should "
                          f"win (--unmask takes out lines that set exactly a tuned cell), e.g. "
                          f"{next(iter(table.masked))}")

