"""``aotattn pgdef``: init, dispatch, worker, status, retry, cancel, results, offline batches, server."""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from aotattn.pgdef.embedded import EmbeddedServer, default_home, embedded_dsn
from aotattn.pgdef.env import DSN_ENV, HOME_ENV
from aotattn.pgdef.errors import ConfigError, PgdefError

app = typer.Typer(help="pgdef: distributed execution on PostgreSQL (docs/distributed-execution-framework.md).",
                  no_args_is_help=True)
server_app = typer.Typer(help="The embedded PostgreSQL server used when no DSN is given.", no_args_is_help=True)
app.add_typer(server_app, name="server")
console = Console()
errors = Console(stderr=True)

DSN = typer.Option(None, "--dsn", envvar=DSN_ENV,
                   help=f"libpq DSN of the pgdef database (default: ${DSN_ENV}, else the embedded server)")
HOME = typer.Option(None, "--home", envvar=HOME_ENV, help="work folder of the embedded server "
                    "(default: ~/.cache/aotattn/pgdef)")
CATEGORY = typer.Option(None, "--category", "-c", help="app or app,subcategory")
POOL = typer.Option(None, "--pool", "-p", help="worker pool, e.g. sm_90 or cpu")
APPS = typer.Option(..., "--app", "-a", help="application, package.module[:attribute] (repeatable)")


def _errors(command):
    """Print pgdef's errors as one red line on stderr and exit 1 instead of a traceback."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PgdefError as exc:
            errors.print(f"aotattn pgdef: error: {escape(' '.join(str(exc).split()))}", style="red", soft_wrap=True)
            raise typer.Exit(1) from exc
    return wrapper


def _dsn(dsn: str | None, home: Path | None) -> str:
    from aotattn.pgdef.connection import resolve_dsn  # psycopg: not needed by run-offline

    return resolve_dsn(dsn) or embedded_dsn(home)


def _client(dsn: str | None, home: Path | None):
    from aotattn.pgdef.client import Client

    return Client(_dsn(dsn, home))


@app.command()
@_errors
def init(dsn: str = DSN, home: Path = HOME) -> None:
    """Create or upgrade the pgdef schema (starting the embedded server when there is no DSN)."""
    from aotattn.pgdef.connection import redact

    with _client(dsn, home) as client:
        applied = client.init()
        console.print(f"{redact(client.dsn)}: schema "
                      f"{'migrations ' + ', '.join(map(str, applied)) + ' applied' if applied else 'up to date'}")


def _read_payloads(payload: list[str], payloads: Path | None) -> list[Any]:
    lines: list[tuple[str, str]] = [("--payload", text) for text in payload]
    if payloads is not None:
        source = sys.stdin if str(payloads) == "-" else open(payloads)
        with source:
            lines += [(f"{payloads}:{n}", text) for n, text in enumerate(source, start=1) if text.strip()]
    out = []
    for where, text in lines:
        try:
            out.append(json.loads(text))
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            raise ConfigError(f"{where}: not JSON ({type(exc).__name__}: {exc}); expected one JSON object "
                              "per line") from exc
    return out


@app.command()
@_errors
def dispatch(
    category: str = typer.Option(..., "--category", "-c", help="app,subcategory of the tasks"),
    pool: str = typer.Option(..., "--pool", "-p", help="the pool whose workers may run them"),
    payload: list[str] = typer.Option([], "--payload", help="one task's JSON payload (repeatable)"),
    payloads: Path = typer.Option(None, "--payloads", help="file of JSON payloads, one per line ('-': stdin)"),
    priority: int = typer.Option(0, help="higher runs first"),
    max_attempts: int = typer.Option(None, "--max-attempts", help="attempts before a task fails (default: "
                                     "the kind's with --app, else 3)"),
    app_spec: str = typer.Option(None, "--app", "-a", help="validate payloads with this application's kind"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Queue tasks; a payload already queued in the category (same key) is not queued again."""
    from aotattn.pgdef.model import TaskSpec

    specs = [TaskSpec(p, priority=priority) if isinstance(p, dict) else p
             for p in _read_payloads(payload, payloads)]
    with _client(dsn, home) as client:
        report = client.dispatch(category, pool, specs, app=app_spec, max_attempts=max_attempts)
    console.print(f"{category} on {pool}: {report}")


@app.command()
@_errors
def worker(
    apps: list[str] = APPS,
    pool: str = typer.Option("cpu", "--pool", "-p", help="the pool to take tasks from, e.g. sm_90 or cpu"),
    gpu: int = typer.Option(None, "--gpu", help="run GPU kinds on this GPU index (one worker)"),
    gpus: str = typer.Option(None, "--gpus", help="one GPU worker process per index, e.g. 0,1,2,3"),
    processes: int = typer.Option(None, "--processes", "-n", help="CPU worker processes (default 1, or 0 "
                                  "with --gpus)"),
    lease: float = typer.Option(60.0, help="seconds a claimed task stays leased without a heartbeat"),
    heartbeat: float = typer.Option(None, help="seconds between heartbeats (default lease/4)"),
    poll: float = typer.Option(1.0, help="seconds between claims while the queue is empty"),
    claim_batch: int = typer.Option(1, "--claim-batch", help="tasks claimed per round trip"),
    max_tasks: int = typer.Option(None, "--max-tasks", help="stop after this many attempts"),
    exit_when_idle: bool = typer.Option(False, "--exit-when-idle", help="stop when nothing is queued or running"),
    reconnect_timeout: float = typer.Option(300.0, "--reconnect-timeout", help="give up after the database "
                                            "has been away this long"),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Run workers: claim tasks of the pool, run their handlers, write results."""
    from aotattn.pgdef.worker import WorkerConfig, run_worker, spawn_workers, wait_workers

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    gpu_list = parse_gpus(gpus) if gpus else []
    if processes is not None and processes < (0 if gpu_list else 1):
        raise typer.BadParameter(f"expected {'0 or more' if gpu_list else '1 or more'} CPU worker processes, "
                                 f"got {processes}", param_hint="--processes")
    processes = processes if processes is not None else (0 if gpu_list else 1)
    if gpu is not None and (gpu_list or processes > 1):  # the children were CPU workers, --gpu dropped
        raise typer.BadParameter("--gpu runs one worker: leave out --gpus and --processes, or use --gpus "
                                 "for one worker per GPU", param_hint="--gpu")
    # checked here, before any process starts (each would refuse it on its own)
    config = WorkerConfig(pool=pool, gpu=gpu, lease_s=lease, heartbeat_s=heartbeat, poll_s=poll,
                          claim_batch=claim_batch, max_tasks=max_tasks, exit_when_idle=exit_when_idle,
                          reconnect_timeout_s=reconnect_timeout)
    resolved = _dsn(dsn, home)
    if gpu_list or processes > 1:
        args = [f"--app={a}" for a in apps] + [
            "--pool", pool, "--lease", str(lease), "--poll", str(poll), "--claim-batch", str(claim_batch),
            "--reconnect-timeout", str(reconnect_timeout), "--dsn", resolved]
        args += ["--heartbeat", str(heartbeat)] if heartbeat is not None else []
        args += ["--max-tasks", str(max_tasks)] if max_tasks is not None else []
        args += ["--exit-when-idle"] if exit_when_idle else []
        args += ["--verbose"] if verbose else []
        procs = spawn_workers(args, processes=processes, gpus=gpu_list)
        codes = wait_workers(procs)
        console.print(f"{len(procs)} workers finished, exit codes {codes}")
        raise typer.Exit(max(codes, default=0))
    stats = run_worker(resolved, apps, config)
    console.print(f"worker done: {stats.done} results, {stats.errors} errors, {stats.late} late, "
                  f"{stats.lost} lost to the connection")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def render_status(status) -> Group:
    """The rich tables of ``aotattn pgdef status``."""
    progress = Table(title="progress", title_justify="left")
    for column in ("category", "pool", "queued", "running", "done", "failed", "cancelled", "expired", "per s", "ETA"):
        if column in ("category", "pool"):
            progress.add_column(column, overflow="fold")
        else:
            progress.add_column(column, justify="right", min_width=len(column))
    for p in status.progress:
        progress.add_row(escape(p.category), escape(p.pool), str(p.queued), str(p.running), str(p.done),
                         str(p.failed), str(p.cancelled), str(p.expired),
                         f"{p.rate_per_s:.1f}" if p.rate_per_s else "-", _age(p.eta_s))
    workers = Table(title=f"live workers ({len(status.workers)})", title_justify="left")
    for column in ("worker", "pool", "gpu", "categories", "holding", "results", "heartbeat"):
        workers.add_column(column)
    for w in status.workers:
        workers.add_row(escape(w["id"]), w["pool"], "-" if w["gpu"] is None else str(w["gpu"]),
                        escape(",".join(w["categories"]) if len(w["categories"]) < 4 else f"{len(w['categories'])} kinds"),
                        str(w["holding"]), str(w["done"]), _age(w["heartbeat_age_s"]) + " ago")
    parts: list[Any] = [progress, workers]
    if status.expired:
        expired = Table(title="expired leases (re-queued by the next worker pass)", title_justify="left")
        for column in ("task", "category", "pool", "lease owner", "attempts", "expired"):
            expired.add_column(column)
        for e in status.expired:
            expired.add_row(str(e["id"]), escape(e["category"]), e["pool"], escape(e["lease_owner"]),
                            str(e["attempts"]), _age(e["expired_for_s"]) + " ago")
        parts.append(expired)
    if status.failures:
        failures = Table(title="failures (aotattn pgdef retry re-queues them)", title_justify="left")
        for column in ("task", "category", "pool", "attempts", "error"):
            failures.add_column(column)
        for f in status.failures:
            failures.add_row(str(f["id"]), escape(f["category"]), f["pool"], str(f["attempts"]),
                             escape((f["error"] or "").splitlines()[0][:120] if f["error"] else "-"))
        parts.append(failures)
    if status.batches:
        batches = Table(title="offline batches not checked in", title_justify="left")
        for column in ("batch", "pool", "host", "tasks", "holding", "lease expires"):
            batches.add_column(column)
        for b in status.batches:
            batches.add_row(b["id"], b["pool"], escape(b["host"]), str(b["n_tasks"]), str(b["holding"]),
                            b["lease_expires_at"].isoformat(timespec="seconds") + (" (expired)" if b["expired"] else ""))
        parts.append(batches)
    return Group(*parts)


@app.command()
@_errors
def status(
    category: str = CATEGORY, pool: str = POOL,
    watch: bool = typer.Option(False, "--watch", "-w", help="refresh until interrupted"),
    interval: float = typer.Option(2.0, help="seconds between refreshes with --watch"),
    window: float = typer.Option(300.0, help="seconds over which the completion rate (and ETA) is measured"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Progress per category and pool, live workers, expired leases, failures and time left."""
    with _client(dsn, home) as client:
        if not watch:
            console.print(render_status(client.status(category, pool, window_s=window)))
            return
        try:
            with Live(render_status(client.status(category, pool, window_s=window)), console=console,
                      refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    live.update(render_status(client.status(category, pool, window_s=window)))
        except KeyboardInterrupt:
            pass


@app.command()
@_errors
def retry(
    category: str = CATEGORY, pool: str = POOL,
    task_id: list[int] = typer.Option([], "--id", help="only these task ids (repeatable)"),
    cancelled: bool = typer.Option(False, "--cancelled", help="re-queue cancelled tasks too"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Re-queue failed tasks (attempts start again from zero)."""
    with _client(dsn, home) as client:
        n = client.retry(category, pool, task_ids=task_id or None, include_cancelled=cancelled)
    console.print(f"{n} tasks re-queued")


@app.command()
@_errors
def cancel(
    category: str = CATEGORY, pool: str = POOL,
    task_id: list[int] = typer.Option([], "--id", help="only these task ids (repeatable)"),
    everything: bool = typer.Option(False, "--all", help="cancel every task not done (no --category/--pool/--id)"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Cancel tasks not yet done; results of running ones will not be accepted."""
    if not (category or pool or task_id or everything):
        raise ConfigError("cancel: give --category, --pool or --id, or --all to cancel every task")
    with _client(dsn, home) as client:
        n = client.cancel(category, pool, task_ids=task_id or None)
    console.print(f"{n} tasks cancelled")


@app.command()
@_errors
def results(category: str = CATEGORY, pool: str = POOL, dsn: str = DSN, home: Path = HOME) -> None:
    """Print accepted results as JSON lines: task id, category, key, payload, output."""
    with _client(dsn, home) as client:
        for r in client.results(category, pool):
            print(json.dumps({"task_id": r.task_id, "category": str(r.category), "key": r.key,
                              "payload": r.payload, "output": r.output, "worker": r.worker_id}))


@app.command()
@_errors
def checkout(
    category: list[str] = typer.Option(..., "--category", "-c", help="app,subcategory to take (repeatable)"),
    pool: str = typer.Option(..., "--pool", "-p", help="the pool of the offline host, e.g. sm_90"),
    out: Path = typer.Option(..., "--out", "-o", help="the batch file to write"),
    limit: int = typer.Option(100, help="at most this many tasks"),
    lease: float = typer.Option(86400.0, help="seconds before the batch's tasks return to the queue"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Claim a batch of tasks into a file for a host that cannot reach the database."""
    with _client(dsn, home) as client:
        batch = client.checkout(pool, category, out, limit=limit, lease_s=lease)
    if batch is None:
        console.print("nothing queued to check out")
        return
    console.print(f"batch {batch.id}: {len(batch.tasks)} tasks in {out}, lease until "
                  f"{batch.lease_expires_at.isoformat(timespec='seconds')}")


@app.command("run-offline")
@_errors
def run_offline_command(
    batch: Path = typer.Argument(..., help="batch file from `aotattn pgdef checkout`"),
    apps: list[str] = APPS,
    results_file: Path = typer.Option(..., "--results", "-r", help="results file to append to (JSON lines)"),
    shard: str = typer.Option("0/1", help="run every N-th task from I, as I/N (one shard per GPU)"),
    gpu: int = typer.Option(None, "--gpu", help="GPU index passed to handlers"),
) -> None:
    """Run a batch file's tasks with no database; resumable."""
    from aotattn.pgdef.offline import run_offline

    try:
        index, count = (int(part) for part in shard.split("/"))
    except ValueError as exc:
        raise ConfigError(f"--shard: expected I/N like 0/4, got {shard!r}") from exc
    report = run_offline(batch, results_file, apps, shard=(index, count), gpu=gpu)
    console.print(f"{report.ran} tasks run ({report.ok} ok, {report.errors} errors), {report.skipped} already "
                  f"in {report.results}")


@app.command()
@_errors
def checkin(
    results_files: list[Path] = typer.Argument(..., help="results files of one batch"),
    dsn: str = DSN, home: Path = HOME,
) -> None:
    """Record an offline batch's results; safe to repeat."""
    with _client(dsn, home) as client:
        r = client.checkin(results_files)
    console.print(f"batch {r.batch_id}: {r.accepted} results accepted, {r.already} already had one, "
                  f"{r.errors} errors recorded, {r.stale_errors} errors ignored, {r.released} tasks released")


@server_app.command("start")
@_errors
def server_start(home: Path = HOME,
                 fast: bool = typer.Option(False, "--fast", help="fsync off (tests, throw-away runs)")) -> None:
    """Start the embedded server (initialising it the first time) and print its DSN."""
    print(EmbeddedServer(home or default_home(), fast=fast).start())


@server_app.command("stop")
@_errors
def server_stop(home: Path = HOME) -> None:
    """Stop the embedded server."""
    stopped = EmbeddedServer(home or default_home()).stop()
    console.print("stopped" if stopped else "not running")


@server_app.command("status")
@_errors
def server_status(home: Path = HOME) -> None:
    """Say whether the embedded server runs, and its DSN."""
    server = EmbeddedServer(home or default_home())
    console.print(f"running: {server.dsn}" if server.running() else f"not running (work folder {server.home})")


def _ints(text: str, option: str, least: int, what: str, example: str) -> list[int]:
    """Comma-separated integers >= ``least`` (at least one), else one line naming ``option``."""
    try:
        found = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        found = []
    if not found or min(found) < least:
        raise typer.BadParameter(f"expected {what} separated by commas, e.g. {example}; got {text!r}",
                                 param_hint=option)
    return found


def _counts(text: str, option: str) -> list[int]:
    """Comma-separated positive integers, e.g. ``1,2,4,8``."""
    return _ints(text, option, 1, "positive integers", "1,2,4")


def parse_gpus(gpus: str) -> list[int]:
    """``--gpus 0,1,2,3``: distinct GPU indices, one worker process each (the perfmon and
    tuner workers take the same option)."""
    found = _ints(gpus, "--gpus", 0, "GPU indices >= 0", "0,1,2,3")
    if len(set(found)) != len(found):
        raise typer.BadParameter(f"expected each GPU once (one worker process per GPU), got {gpus!r}",
                                 param_hint="--gpus")
    return found


@app.command()
@_errors
def bench(
    tasks: int = typer.Option(20000, help="tasks to dispatch and run"),
    workers: str = typer.Option("1,2,4,8", help="worker threads per run, comma-separated"),
    claim_batch: str = typer.Option("1,16", "--claim-batch", help="tasks per claim, comma-separated"),
    dsn: Optional[str] = typer.Option(None, "--dsn", help="a scratch database (default: a fresh embedded "
                                      "server, deleted afterwards)"),
) -> None:
    """Measure claim throughput: no-op tasks claimed, run and completed per second."""
    from aotattn.pgdef.bench import run_bench

    rows = run_bench(dsn, tasks, _counts(workers, "--workers"), _counts(claim_batch, "--claim-batch"))
    table = Table(title=f"claim throughput, {tasks} no-op tasks per run")
    for column in ("workers", "claim batch", "seconds", "tasks/s"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["workers"]), str(row["claim_batch"]), f"{row['seconds']:.2f}", f"{row['rate']:.0f}")
    console.print(table)
