"""``aotattn perfmon`` (measure) and ``aotattn perfdb`` (read what was measured)."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from aotattn.arch import arch as known_arch
from aotattn.cli_checks import finite
from aotattn.files import write_atomically
from aotattn.perfmon import perfdb as store
from aotattn.perfmon.budget import MAX_SEED
from aotattn.perfmon.entries import DTYPES, Entry
from aotattn.pgdef.cli import DSN, HOME
from aotattn.tune import timing

console = Console(soft_wrap=True)  # one line per message, whatever the terminal's width
perfmon_app = typer.Typer(help="Measure the public operators on the declared entries (docs/perfmon.md).",
                          no_args_is_help=True)
perfdb_app = typer.Typer(help="Compare, plot and check runs in the performance database (docs/perfmon.md).",
                         no_args_is_help=True)

MATCH = typer.Option(None, "--match", "-m", help="only entries whose name matches this glob (repeatable)")
GROUP = typer.Option(None, "--group", "-g", help="only entries of this group (repeatable)")
ROOT = typer.Option(None, "--perfdb", help=f"perfdb root (default: ${store.ENV_VAR} or perfdb/)")
ARCH = typer.Option(None, "--arch", help="architecture folder (default: the one holding the tag)")


def _provider_names(names: list[str], option: str, also: str = "") -> tuple[str, ...]:
    """Provider names as perfdb files spell them: a misspelt one matched nothing, and
    `compare --fail-on-regression` passed on "0 compared"."""
    from aotattn.perfmon import providers as P

    unknown = [name for name in names if name not in P.ALL]
    if unknown:
        raise _fail(f"{option} {unknown[0]!r}: expected one of {also}{', '.join(P.ALL)}")
    return tuple(names)


def _fail(message: str) -> typer.Exit:
    """One line on stderr, exit status 1 (aotattn/cli.py's promise)."""
    typer.echo(f"aotattn: error: {' '.join(message.split())}", err=True)
    return typer.Exit(1)


def _entries(match: list[str] | None, group: list[str] | None) -> list[Entry]:
    from aotattn.perfmon.entries import declared, select

    _check_selectors(declared(), match, group, " (list them with `aotattn perfmon list -v`)")
    chosen = select(declared(), match or (), group or ())
    if not chosen:
        raise _fail("no entry matches --match/--group (list them with `aotattn perfmon list`)")
    return chosen


def _check_selectors(entries: list[Entry], match: list[str] | None, group: list[str] | None, where: str) -> None:
    """Refuse a --match or --group that selects nothing: beside one that matched, it was ignored."""
    from aotattn.perfmon.entries import unmatched

    for kind, value in unmatched(entries, match or (), group or ()):
        if kind == "match":
            scope = f" of --group {', '.join(group)}" if group else ""
            raise _fail(f"no entry{scope} matches --match {value!r}{where}")
        wanted = f" matching --match {' '.join(match)}" if match else ""
        raise _fail(f"no entry{wanted} in --group {value!r}{where}")


FLEX_ALL = typer.Option(False, "--flex-all", help="time FlexAttention on every entry it supports, not only those "
                        "that ask for it (about 20 s of compiling per entry; see run --flex-jobs)")


SEED = typer.Option(0, min=0, max=MAX_SEED, help="inputs and dropout draws")
FLEX_JOBS = typer.Option(0, "--flex-jobs", min=0, help="first compile FlexAttention's graphs for the entries in "
                         "this many processes (Inductor's disk cache then serves the run)")


def _flex(no_flex: bool, flex_all: bool) -> bool | str:
    if no_flex and flex_all:
        raise _fail("--no-flex and --flex-all: choose one")
    return False if no_flex else ("all" if flex_all else True)


def _providers(entry: Entry, peers: bool, flex: bool | str) -> dict[str, list[str]]:
    from aotattn.perfmon import providers as P

    return {p: [name for name in P.ALL if P.unsupported(entry, name, p, flex) is None
                and (peers or name not in P.PEERS)] for p in entry.passes}


def _plan(entries: list[Entry], rounds: int, reps: int | None, warmup: int, budget: float | None,
          peers: bool, flex: bool | str, hide_host_ms: float = 0.0, flex_jobs: int = 0):
    """The repetitions: ``reps`` as given, or the most (1..20) whose estimate fits ``budget`` seconds."""
    from aotattn.perfmon.budget import Plan, entry_seconds

    def total(plan: Plan) -> float:
        return sum(entry_seconds(e, _providers(e, peers, flex), plan, flex_jobs) for e in entries)

    if reps is not None:
        plan = Plan(rounds, reps, warmup, hide_host_ms)
        return plan, total(plan)
    if budget is None:
        plan = Plan(rounds, 5, warmup, hide_host_ms)
        return plan, total(plan)
    best = Plan(rounds, 1, warmup, hide_host_ms)
    for candidate in range(1, 21):
        plan = Plan(rounds, candidate, warmup, hide_host_ms)
        if total(plan) > budget:
            break
        best = plan
    return best, total(best)


HIDE_HOST = typer.Option(0.0, "--hide-host-ms", min=0.0, max=timing.MAX_HIDE_HOST_MS,
                         help="queue a GPU wait this long before each timed call (not the training entries), so "
                              "a call's host work does not show in its time (0: none)")


@perfmon_app.command("list")
def list_entries(match: list[str] = MATCH, group: list[str] = GROUP,
                 rounds: int = typer.Option(3, min=1, help="interleaved rounds"),
                 reps: int = typer.Option(None, min=1, help="timed calls per round (default: 5, or what --budget allows)"),
                 budget: float = typer.Option(None, "--budget", help="seconds on an H200 to size --reps to"),
                 no_peers: bool = typer.Option(False, "--no-peers"), no_flex: bool = typer.Option(False, "--no-flex"),
                 flex_all: bool = FLEX_ALL, hide_host_ms: float = HIDE_HOST, flex_jobs: int = FLEX_JOBS,
                 verbose: bool = typer.Option(False, "--verbose", "-v", help="one row per entry")) -> None:
    """The declared entries, their FLOPs and the estimated H200 time of a run."""
    from aotattn.perfmon.budget import entry_seconds

    entries = _entries(match, group)
    flex = _flex(no_flex, flex_all)
    finite(budget, "--budget")  # as run checks it (NaN sized 20 reps)
    plan, seconds = _plan(entries, rounds, reps, 2, budget, not no_peers, flex, hide_host_ms, flex_jobs)
    table = Table("entry" if verbose else "group", "entries" if not verbose else "shape", "GFLOP (fwd)",
                  "est. s", title=f"{len(entries)} entries; {plan.rounds} rounds x {plan.reps} reps: "
                                  f"~{seconds:.0f} s on an H200")
    if verbose:
        for e in entries:
            table.add_row(e.name, e.describe(), f"{e.flops('fwd') / 1e9:.1f}",
                          f"{entry_seconds(e, _providers(e, not no_peers, flex), plan, flex_jobs):.2f}")
    else:
        groups: dict[str, list[Entry]] = {}
        for e in entries:
            groups.setdefault(e.group, []).append(e)
        for name, members in groups.items():
            seconds_of = sum(entry_seconds(e, _providers(e, not no_peers, flex), plan, flex_jobs) for e in members)
            table.add_row(name, str(len(members)), f"{sum(e.flops('fwd') for e in members) / 1e9:.0f}",
                          f"{seconds_of:.0f}")
    console.print(table)


@perfmon_app.command()
def run(tag: str = typer.Option(..., "--tag", help="the run's name: perfdb/<arch>/<tag>.txt"),
        match: list[str] = MATCH, group: list[str] = GROUP,
        rounds: int = typer.Option(3, min=1, help="interleaved rounds (the spread is their range)"),
        reps: int = typer.Option(None, min=1, help="timed calls per provider and round (default: 5, or what --budget allows)"),
        warmup: int = typer.Option(2, min=0, help="untimed calls per provider first"),
        budget: float = typer.Option(None, "--budget", help="size --reps so the estimate fits this many seconds"),
        deadline: float = typer.Option(None, "--deadline", help="start no entry after this many seconds"),
        no_peers: bool = typer.Option(False, "--no-peers", help="time aotattn only"),
        no_flex: bool = typer.Option(False, "--no-flex", help="skip FlexAttention (it compiles per shape)"),
        flex_all: bool = FLEX_ALL, hide_host_ms: float = HIDE_HOST,
        resume: bool = typer.Option(False, "--resume", help="keep the tag's measured entries, run the others"),
        flex_jobs: int = FLEX_JOBS,
        force: bool = typer.Option(False, "--force", help="replace an existing file of this tag (even with --resume)"),
        device: str = typer.Option(None, help="cuda (the default; refused without a GPU) or cpu (the interpreter: "
                                    "tiny entries only)"),
        seed: int = SEED,
        out: Path = typer.Option(None, "--out", help="write here instead of perfdb/<arch>/<tag>.txt"),
        root: Path = ROOT) -> None:
    """Measure entries on one GPU, without a database, into a perfdb file (written after every entry)."""
    import torch

    from aotattn.perfmon.measure import Options, environment, measure_entry

    store.check_tag(tag)
    finite(deadline, "--deadline")
    finite(budget, "--budget")
    if device is None and not torch.cuda.is_available():
        # the declared entries are GPU-sized: the interpreter would take hours on the first one
        raise _fail("this torch sees no CUDA GPU: perfmon times the operators on a GPU; run on a GPU machine "
                    "(`aotattn perfmon list --budget` estimates the time), or pass --device cpu for Triton's "
                    "interpreter (tiny entries only)")
    device = device or "cuda"
    if device not in ("cuda", "cpu"):
        raise _fail(f"--device: expected cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise _fail("--device cuda: this torch sees no CUDA GPU; run on a GPU machine, or --device cpu for the "
                    "interpreter (tiny entries only)")
    dev = torch.device(device)
    entries = _entries(match, group)
    flex = _flex(no_flex, flex_all)
    plan, estimate = _plan(entries, rounds, reps, warmup, budget, not no_peers, flex, hide_host_ms, flex_jobs)
    options = Options(plan, peers=not no_peers, flex=flex, seed=seed)
    header = {"tag": tag, **environment(dev, plan)}
    path = out or store.path_for(tag, header["arch"], root)
    db = store.Perfdb(header=header)
    try:
        store.check_folder(path, header["arch"])  # before measuring: write() would refuse it after the first entry
        if path.exists() and not force:
            if not resume:
                raise _fail(f"{path} exists: pass --resume to complete it or --force to replace it")
            db = store.Perfdb.read(path)
            _check_resumable(db.header, header, path)
            db.comments.append(f"resumed {header['date']}: {header['command']}")
        db.checked_text(path)  # the header and comments read back (not only at the first write)
    except store.PerfdbError as exc:
        raise _fail(str(exc)) from exc
    todo = [e for e in entries if e.name not in db.entries or db.entries[e.name] != e]
    for e in todo:
        if e.name in db.entries:  # declared differently since: measure it again
            del db.entries[e.name]
            db.records = [r for r in db.records if r.entry != e.name]
    console.print(f"{len(todo)} of {len(entries)} entries to measure on {header['gpu']} "
                  f"({plan.rounds} rounds x {plan.reps} reps, estimate ~{estimate:.0f} s for all) -> {path}")
    if flex and flex_jobs:
        _warm_flex(todo, device, flex, seed, flex_jobs)
    start = time.monotonic()
    done = 0
    for entry in todo:
        if deadline is not None and time.monotonic() - start > deadline:
            break
        t0 = time.monotonic()
        records = measure_entry(entry, dev, options)
        db.add(entry, records)
        db.write(path)
        done += 1
        console.print(escape(_progress(entry, records, time.monotonic() - t0, done, len(todo))), highlight=False)
    problems = [r for r in db.records if r.provider.startswith("aotattn") and not r.ok
                and not r.note.startswith("skipped")]
    left = len(todo) - done
    if done or path.exists():
        console.print(f"{done} entries in {time.monotonic() - start:.0f} s -> {path}"
                      + (f"; {left} not started (deadline): rerun with --resume" if left else ""))
    else:  # nothing measured, nothing written: --resume has nothing to resume
        console.print(f"no entry measured (the deadline came first); nothing written to {path}")
    for r in problems:
        console.print(escape(f"  {r.entry} {r.pass_} {r.provider}: {r.note}"), style="red")
    _print_peer_failures(db)
    _print_faults(db, path.stem)
    if problems:
        raise typer.Exit(1)


# a resumed run keeps one header: records of another GPU, build, tuning or timing (--reps,
# --rounds, --warmup, --hide-host-ms) would hide under it
RESUME_KEYS = ("tag", "arch", "gpu", "mode", "aotattn", "tuning", "triton", "torch", "timing")


def _check_resumable(stored: dict[str, str], header: dict[str, str], path: Path) -> None:
    differ = [f"{key} {stored.get(key)!r} there, {header[key]!r} here"
              for key in RESUME_KEYS if stored.get(key) != header[key]]
    if differ:
        raise _fail(f"--resume: {path} was measured elsewhere or timed otherwise ({'; '.join(differ)}): "
                    "resume it where it ran, with its timing options, or pass --force to measure every entry again")


def _warm_flex(entries: list[Entry], device: str, flex: bool | str, seed: int, jobs: int) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from aotattn.perfmon import flexwarm

    count = sum(1 for e in entries if flexwarm.flex_passes(e, flex))
    if not count:
        return
    start = time.monotonic()
    with Progress(TextColumn("compiling FlexAttention"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("flex", total=count)

        def done(name: str, error: str | None) -> None:
            progress.advance(task)
            if error:
                progress.console.print(escape(f"  FlexAttention on {name} did not compile: {error}"), style="yellow")

        errors = sum(1 for e in flexwarm.warm(entries, device, flex, seed, jobs, done).values() if e)
    console.print(f"FlexAttention compiled for {count - errors} of {count} entries in {jobs} processes, "
                  f"{time.monotonic() - start:.0f} s")


def _progress(entry: Entry, records, seconds: float, done: int, total: int) -> str:
    parts = []
    for r in records:
        if r.provider == "aotattn":
            parts.append(f"{r.pass_} " + (f"{r.tflops:.0f} TF/s" if r.ok else r.note.split(":")[0]))
    best = {}
    for r in records:
        if r.ok and r.ratio is not None and not r.provider.startswith("aotattn"):
            best[r.pass_] = min(best.get(r.pass_, math.inf), r.ratio)
    peers = ", ".join(f"{p} {v:.2f}x the best peer's speed" for p, v in best.items())
    return f"[{done}/{total}] {entry.name} {seconds:.1f}s: {'; '.join(parts)}" + (f" ({peers})" if peers else "")


@perfmon_app.command()
def images(arch: str = typer.Option("sm_90", help="target architecture"),
           match: list[str] = MATCH, group: list[str] = GROUP,
           out: Path = typer.Option(None, "--out", help="image folder (default: images/)"),
           cache: Path = typer.Option(None, "--cache", help="compiled-kernel cache (default: build/cache/)"),
           jobs: int = typer.Option(os.cpu_count() or 1, "--jobs", min=1, help="parallel compiler processes"),
           timeout: float = typer.Option(600.0, help="seconds before one kernel's compilation is abandoned"),
           dry_run: bool = typer.Option(False, "--dry-run", help="only list the kernels")) -> None:
    """Compile exactly the kernels a run of these entries loads (forward, every backward backend)."""
    from aotattn.compiler.builder import DEFAULT_CACHE, DEFAULT_OUT
    from aotattn.perfmon import images as imaging

    entries = _entries(match, group)
    if dry_run:
        found = imaging.needed_jobs(entries, arch)
        for job in found:
            console.print(f"{job.table} [{job.functional}] {job.config} ({job.variant})", markup=False)
        console.print(f"{len(found)} kernel(s) for {len(entries)} entries on {arch}")
        return
    start = time.monotonic()
    failures = []

    def outcome(o) -> None:
        if o.status in ("failed", "timeout"):
            failures.append(o)
            console.print(escape(f"FAILED {o.job.table} [{o.job.functional}] {o.job.config}: "
                                 f"{o.message.splitlines()[-1] if o.message else ''}"), style="red")

    outcomes, archives = imaging.build(entries, arch, out or DEFAULT_OUT, cache or DEFAULT_CACHE, jobs, timeout,
                                       on_outcome=outcome)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    console.print(f"{len(outcomes)} kernel(s) for {len(entries)} entries: "
                  + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                  + f"; {len(archives)} archive(s) in {out or DEFAULT_OUT}; {time.monotonic() - start:.0f} s")
    if failures:
        raise typer.Exit(1)


@perfmon_app.command("bad-patch")
def bad_patch_command(tuning_db: Path = typer.Option(..., "--tuning-db", help="a COPY of the tuning database"),
                      arch: str = typer.Option("sm_90", "--arch"),
                      table: list[str] = typer.Option(["flash.attn_bwd_dkdv", "flash.attn_bwd_dq"], "--table",
                                                      help="tables to damage (repeatable)"),
                      where: str = typer.Option("dtype=bf16 BLOCK_D=128 PAD_HEAD=False", help="blocks to damage"),
                      config: str = typer.Option("BLOCK_M=32 BLOCK_N=32 num_warps=4 num_stages=1",
                                                 help="the configuration every cell gets")) -> None:
    """Write a deliberately bad patch into a copy of the tuning database (to show perfmon catches it)."""
    from aotattn.perfmon.demo import bad_patch
    from aotattn.tuning.database import PROJECT_ROOT

    if tuning_db.resolve() == PROJECT_ROOT.resolve():
        raise _fail("--tuning-db: expected a copy of the tuning database, got the project's own tuning/")
    for path in bad_patch(tuning_db, arch, table, where, config):
        console.print(f"wrote {path}")


# ---------------------------------------------------------------------------- on pgdef

@perfmon_app.command()
def dispatch(tag: str = typer.Option(..., "--tag", help="the run's name: perfdb/<arch>/<tag>.txt"),
             arch: str = typer.Option("sm_90", "--arch", help="the worker pool: GPU architecture"),
             match: list[str] = MATCH, group: list[str] = GROUP,
             rounds: int = typer.Option(3, min=1, help="interleaved rounds"),
             reps: int = typer.Option(5, min=1, help="timed calls per provider and round"),
             warmup: int = typer.Option(2, min=0, help="untimed calls per provider first"),
             no_peers: bool = typer.Option(False, "--no-peers"), no_flex: bool = typer.Option(False, "--no-flex"),
             flex_all: bool = FLEX_ALL, hide_host_ms: float = HIDE_HOST,
             seed: int = SEED,
             priority: int = typer.Option(0, help="higher runs first"),
             dsn: str = DSN, home: Path = HOME) -> None:
    """Queue one pgdef task per entry (category perfmon,entry; pool = the architecture)."""
    from aotattn.perfmon.app import CATEGORY, task_spec
    from aotattn.perfmon.budget import Plan
    from aotattn.perfmon.measure import Options
    from aotattn.pgdef import Client

    try:
        known_arch(arch)  # a pool no worker serves: the tasks would wait for ever
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--arch") from None
    entries = _entries(match, group)
    options = Options(Plan(rounds, reps, warmup, hide_host_ms), peers=not no_peers, flex=_flex(no_flex, flex_all),
                      seed=seed)
    with Client(dsn, home=home) as client:
        client.init()
        report = client.dispatch(CATEGORY, arch, [task_spec(tag, e, options, priority) for e in entries],
                                 app="aotattn.perfmon.app")
    console.print(f"{CATEGORY} on {arch}, tag {tag}: {report.inserted} queued, {report.existing} already there")


@perfmon_app.command()
def worker(arch: str = typer.Option("sm_90", "--arch", help="the pool to take tasks from"),
           gpus: str = typer.Option("0", "--gpus", help="one worker per GPU index, e.g. 0,1"),
           images_dir: Path = typer.Option(None, "--images", help="kernel images (AOTATTN_IMAGES)"),
           exit_when_idle: bool = typer.Option(False, "--exit-when-idle"),
           dsn: str = DSN, home: Path = HOME) -> None:
    """Run GPU workers that take perfmon tasks from pgdef (offline hosts: `aotattn pgdef run-offline`)."""
    from aotattn.pgdef.cli import parse_gpus
    from aotattn.pgdef.worker import spawn_workers, wait_workers

    gpu_list = parse_gpus(gpus)
    env = dict(os.environ)
    if images_dir:
        env["AOTATTN_IMAGES"] = str(images_dir.resolve())
    args = ["--app=aotattn.perfmon.app", "--pool", arch] + (["--exit-when-idle"] if exit_when_idle else [])
    args += ["--dsn", dsn] if dsn else []
    args += ["--home", str(home)] if home else []
    procs = spawn_workers(args, gpus=gpu_list, env=env)
    codes = wait_workers(procs)
    console.print(f"{len(procs)} workers finished, exit codes {codes}")
    raise typer.Exit(max(codes, default=0))


def load_outputs(paths: list[Path]) -> list[dict]:
    """Task outputs from pgdef offline results files (JSON lines) or folders of them."""
    from aotattn.pgdef.offline import read_results

    found = []
    for path in paths:
        for file in (sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]):
            found += [o.output for o in read_results(file)[1] if o.ok]
    return found


@perfmon_app.command()
def export(tag: str = typer.Option(..., "--tag", help="the run to gather"),
           results: list[Path] = typer.Argument(None, help="offline results files or folders (default: the "
                                                "database's results)"),
           arch: str = typer.Option(None, "--arch", help="the pool (default: every pool)"),
           out: Path = typer.Option(None, "--out", help="write here instead of perfdb/<arch>/<tag>.txt"),
           root: Path = ROOT, dsn: str = DSN, home: Path = HOME) -> None:
    """Gather a run's task results into its perfdb file."""
    from aotattn.perfmon.app import APP, collect

    if results:
        outputs = load_outputs(results)
    else:
        from aotattn.pgdef import Client

        with Client(dsn, home=home) as client:
            outputs = [r.output for r in client.results(APP, arch)]
    db = collect(outputs, tag)
    path = db.write(out or store.path_for(tag, db.header["arch"], root))
    console.print(f"{len(db.entries)} entries, {len(db.records)} records -> {path}")
    _print_faults(db, tag)


# ---------------------------------------------------------------------------- perfdb

def _read(tag: str, arch: str | None, root: Path | None) -> tuple[store.Perfdb, Path]:
    try:
        path = store.resolve(tag, arch, root)
        return store.Perfdb.read(path), path
    except store.PerfdbError as exc:
        raise _fail(str(exc)) from exc


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


@perfdb_app.command()
def compare(a: str = typer.Argument(..., help="the baseline: a tag or a perfdb file"),
            b: str = typer.Argument(..., help="the run to judge: a tag or a perfdb file"),
            arch: str = ARCH, root: Path = ROOT,
            provider: list[str] = typer.Option(None, "--provider", help="providers to compare (repeatable; "
                                               "default aotattn; 'all' for every one)"),
            threshold: float = typer.Option(0.03, help="a change smaller than this fraction is never flagged"),
            all_rows: bool = typer.Option(False, "--all", help="list every entry, not only the changes"),
            fail: bool = typer.Option(False, "--fail-on-regression",
                                      help="exit 1 on a regression or a lost figure")) -> None:
    """Per-entry ratios B against A, geometric means per group, regressions beyond the noise."""
    from aotattn.perfmon.analysis import compare as compare_runs

    finite(threshold, "--threshold")
    da, pa = _read(a, arch, root)
    dbb, pb = _read(b, arch, root)
    chosen = () if provider and "all" in provider else _provider_names(provider or ["aotattn"], "--provider", "'all', ")
    result = compare_runs(da, dbb, chosen, threshold)
    console.print(escape(f"A = {pa} ({da.header.get('date', '?')}, tuning {da.header.get('tuning', '?')})"))
    console.print(escape(f"B = {pb} ({dbb.header.get('date', '?')}, tuning {dbb.header.get('tuning', '?')})"))
    means = Table("group", "pass", "provider", "entries", "speed B/A (geomean)",
                  title="speed of B against A (above 1: B faster)")
    for (group, pass_, prov), (n, mean) in result.geomeans().items():
        style = "red" if mean < 1 - threshold else "green" if mean > 1 + threshold else None
        means.add_row(group, pass_, prov, str(n), f"{mean:.3f}", style=style)
    console.print(means)
    rows = result.changes if all_rows else [c for c in result.changes if c.verdict != "same"]
    for c in rows:
        style = {"regression": "red", "failed in B": "red", "improvement": "green"}.get(c.verdict)
        speed = "" if c.speed is None else f" (speed {c.speed:.3f}, noise {c.noise_ms:.3g} ms)"
        plan = ("" if c.plan_changes is None or c.verdict not in ("regression", "improvement")
                else f"; plan changed: {', '.join(c.plan_changes)}" if c.plan_changes else "; same plan")
        console.print(escape(f"  {c.verdict}: {c.entry} {c.pass_} {c.provider}: {_ms(c.a_ms)} -> {_ms(c.b_ms)} ms"
                             f"{speed}{plan}"), style=style, highlight=False)
    both = result.in_both
    console.print(f"{len(result.regressions)} regression(s), {len(result.failures)} lost figure(s), "
                  f"{len(result.improvements)} improvement(s) beyond noise and {threshold:.0%}, "
                  f"{len(both)} compared, {len(result.changes) - len(both)} in one run only or declared differently")
    if fail and not both:  # "0 regression(s)" of nothing is no pass
        raise _fail(f"--fail-on-regression: no (entry, pass, provider) of {', '.join(chosen) or 'any provider'} "
                    f"is in both {pa} and {pb} with the same declaration: nothing was compared")
    if fail and (result.regressions or result.failures):
        raise typer.Exit(1)


def _print_peer_failures(db: store.Perfdb) -> None:
    from aotattn.perfmon.analysis import peer_failures

    for provider, pass_, count, note in peer_failures(db):
        console.print(escape(f"  {provider} {pass_}: raised on {count} entr{'y' if count == 1 else 'ies'}, no figure: "
                             f"{note.removeprefix('skipped: ')}"), style="yellow", highlight=False)


def _print_faults(db: store.Perfdb, tag: str, margin: float = 0.0):
    from aotattn.perfmon.analysis import faults as find_faults

    found = find_faults(db, margin)
    if not found:
        console.print(f"{tag}: no tuning faults (no forced backend beat the operator's choice beyond the noise)")
        return found
    console.print(f"{tag}: {len(found)} tuning fault(s): a forced backend beat the operator's choice beyond the noise",
                  style="red")
    for f in found:
        console.print(escape(f"  {f.entry} {f.pass_}: chose {f.choice} {f.choice_ms:.4g} ms, {f.winner} forced "
                             f"{f.winner_ms:.4g} ms ({f.speedup:.2f}x faster, noise {f.noise_ms:.3g} ms) <- "
                             f"{f.cell or 'no database cell (interpreter)'}"), highlight=False)
    return found


@perfdb_app.command()
def faults(tag: str = typer.Argument(..., help="a tag or a perfdb file"), arch: str = ARCH, root: Path = ROOT,
           margin: float = typer.Option(0.0, help="also require the win to exceed this fraction of the time"),
           patch: Path = typer.Option(None, "--patch", help="write the patch that sets each faulty cell to the "
                                      "faster backend: into this folder (one .dbpatch per table), or into "
                                      "this file when it ends in .dbpatch"),
           fail: bool = typer.Option(False, "--fail", help="exit 1 when there is a fault")) -> None:
    """Tuning faults: a forced backend beat the operator's own choice by more than the noise."""
    from aotattn.perfmon.provenance import parse_cell, suggest_patch
    from aotattn.spec import Config

    finite(margin, "--margin")
    db, path = _read(tag, arch, root)
    found = _print_faults(db, path.stem, margin)
    if patch is not None and found:
        from aotattn.perfmon.analysis import note_problem, patchable

        # a note naming its cell as an older table did is not evidence about a cell of today's
        stale: dict[tuple[str, str], list] = {}
        for f in found:
            problem = note_problem(db.entries[f.entry], f.cell) if f.cell else None
            if problem is not None:
                stale.setdefault((f.cell, problem), []).append(f)
        for (cell, problem), skipped in stale.items():
            first = skipped[0]
            console.print(escape(f"{path}:{db.lines.get((first.entry, first.pass_, 'aotattn'), '?')}: left out "
                                 f"{cell} ({first.entry} {first.pass_}"
                                 + (f" and {len(skipped) - 1} more fault(s)" if len(skipped) > 1 else "")
                                 + f"): {problem}"), style="yellow", highlight=False)
        found = [f for f in found if not any(f in skipped for skipped in stale.values())]
        # a cell the run's entries disagree about is left for a person (or the tuner) to settle
        agreed, contested = patchable(db, found)
        for cell, reasons in contested.items():
            console.print(escape(f"left out {cell}: {'; '.join(reasons)}"), style="yellow", highlight=False)
        changes = {parse_cell(cell): Config.of(backend=backend) for cell, backend in agreed.items()}
        if not changes:
            cellless = sum(1 for f in found if not f.cell)
            why = [f"{len(contested)} contested cell(s)"] if contested else []
            why += [f"{len({cell for cell, _ in stale})} cell(s) named as an older table did"] if stale else []
            if cellless:
                why.append(f"{cellless} fault(s) name no database cell (a run in the interpreter reads none)")
            console.print(f"no patch written: {', '.join(why)}")
            if fail:
                raise typer.Exit(1)
            return
        texts = suggest_patch(changes, [f"from `aotattn perfdb faults {tag}` ({db.header.get('gpu', '?')}, "
                                        f"{db.header.get('date', '?')})"])
        as_file = patch.suffix == ".dbpatch"
        if as_file and len(texts) > 1:
            raise typer.BadParameter(f"the faults touch {len(texts)} tables ({', '.join(sorted(texts))}): give a "
                                     "folder, not one .dbpatch file", param_hint="--patch")
        (patch.parent if as_file else patch).mkdir(parents=True, exist_ok=True)
        for table, text in texts.items():
            target = patch if as_file else patch / f"{table}.perfmon-faults.dbpatch"
            write_atomically(target, text)
            console.print(f"wrote {target} (rename to <table>.<NNNN>-<what>.dbpatch in tuning/<vendor>/<arch>/ "
                          "to apply it)")
    if fail and found:
        raise typer.Exit(1)


@perfdb_app.command()
def plot(tag: str = typer.Argument(..., help="a tag or a perfdb file"), arch: str = ARCH, root: Path = ROOT,
         out: str = typer.Option(None, "--out", help="PNG to write, or a folder (existing, or ending in /) "
                                 "to write it into (default: beside the perfdb file)"),
         group: str = typer.Option("dense", help="entry group to draw (square sequences)"),
         dtype: str = typer.Option("bf16", help="fp16, bf16 or fp32")) -> None:
    """TFLOP/s against sequence length, per head dim and pass, aotattn beside its peers."""
    from aotattn.perfmon.plot import plot as draw

    if dtype not in DTYPES:
        raise typer.BadParameter(f"expected one of {', '.join(DTYPES)}, got {dtype!r}", param_hint="--dtype")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", group):
        raise typer.BadParameter(f"expected an entry group such as dense or gqa, got {group!r}", param_hint="--group")
    db, path = _read(tag, arch, root)
    name = f"{path.stem}.{group}-{dtype}.png"
    # a Path drops the trailing slash: "--out new/" wrote a PNG named "new"
    folder = out is not None and (out.endswith(tuple(filter(None, (os.sep, os.altsep)))) or Path(out).is_dir())
    target = Path(out) / name if folder else Path(out) if out else path.with_name(name)
    try:
        draw(db, target, group, dtype)
    except store.PerfdbError as exc:
        raise _fail(str(exc)) from exc
    console.print(f"wrote {target}")


@perfdb_app.command()
def summary(tag: str = typer.Argument(..., help="a tag or a perfdb file"), arch: str = ARCH, root: Path = ROOT) -> None:
    """aotattn against every provider, per group and pass: geometric mean of aot/x."""
    from aotattn.perfmon.providers import ALL

    db, path = _read(tag, arch, root)
    logs: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in db.records:
        if r.ok and r.ratio:
            logs.setdefault((db.entries[r.entry].group, r.pass_), {}).setdefault(r.provider, []).append(
                math.log(r.ratio))
    table = Table("group", "pass", "provider", "entries", "x / aotattn", title=f"{path.stem}: each provider's time "
                  "over aotattn's, geometric mean (above 1: aotattn is faster)")
    for (group, pass_), by in sorted(logs.items()):
        for provider in [p for p in ALL if p != "aotattn" and p in by]:
            values = by[provider]
            table.add_row(group, pass_, provider, str(len(values)), f"{math.exp(sum(values) / len(values)):.2f}")
    console.print(escape(" ".join(f"{k}: {v};" for k, v in db.header.items() if k in ("gpu", "tuning", "date"))))
    console.print(table)
    _print_peer_failures(db)


@perfdb_app.command()
def costs(tag: str = typer.Argument(..., help="a tag or a perfdb file"), arch: str = ARCH, root: Path = ROOT,
          provider: list[str] = typer.Option(["aotattn", "sdpa-flash"], "--provider", "-p",
                                             help="providers to show (repeatable)")) -> None:
    """What dropout, a bias and the deterministic backward cost: each such entry's time over its
    plain twin's (the same call without the feature) in the same run, per pass and provider."""
    from aotattn.perfmon.analysis import feature_costs

    provider = list(_provider_names(provider, "--provider"))
    db, path = _read(tag, arch, root)
    found = [c for c in feature_costs(db) if c.provider in provider]
    if not found:
        raise _fail(f"{path}: no entry with dropout, a bias or the deterministic backward has its plain twin "
                    "(the same call without the feature) in this run")
    by_entry: dict[tuple[str, str], dict[str, float]] = {}
    for c in found:
        by_entry.setdefault((c.entry, c.pass_), {})[c.provider] = c.ratio
    shown = [p for p in provider if any(p in v for v in by_entry.values())]
    table = Table("entry", "pass", *shown, title=f"{path.stem}: each entry's time over its plain twin's (1.30: the "
                  "feature costs 30%)")
    for (entry, pass_), ratios in sorted(by_entry.items()):
        table.add_row(entry, pass_, *(f"{ratios[p]:.2f}" if p in ratios else "-" for p in shown))
    console.print(table)
    for feature in sorted({c.feature for c in found}):
        for pass_ in ("fwd", "bwd"):
            for p in shown:
                ratios = [c.ratio for c in found if (c.feature, c.pass_, c.provider) == (feature, pass_, p)]
                if ratios:
                    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
                    console.print(f"{feature} {pass_} {p}: geometric mean {mean:.2f}, "
                                  f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} entries")


@perfdb_app.command()
def standing(peer: str = typer.Option("flex", "--peer", "-p", help="the provider to stand against"),
             arch: str = typer.Option("sm_90", "--arch", help="architecture folder"), root: Path = ROOT,
             match: list[str] = MATCH, group: list[str] = GROUP,
             floor: float = typer.Option(1.0, "--floor", help="list the entries below this peer/aotattn ratio"),
             all_rows: bool = typer.Option(False, "--all", help="list every entry, not only those below the floor"),
             fail: bool = typer.Option(False, "--fail", help="exit 1 when an entry is below the floor"),
             gpu: str = typer.Option(None, "--gpu", help="only runs on this GPU (a part of the run's `gpu` "
                                     "header, any case: H200)")) -> None:
    """Every entry against one peer, from the latest run that timed both: where the
    repository stands (e.g. --peer sdpa-cudnn --floor 0.9 -m '*d128*' --gpu H200)."""
    from aotattn import tuning
    from aotattn.perfmon.analysis import standing as stand
    from aotattn.perfmon.entries import select
    from aotattn.perfmon.providers import ALL

    finite(floor, "--floor")
    if peer not in ALL or peer == "aotattn":
        raise _fail(f"--peer {peer}: expected one of {', '.join(p for p in ALL if p != 'aotattn')}")
    folder = (root or store.root()) / arch
    paths = sorted(folder.glob("*.txt"))
    if not paths:
        raise _fail(f"no perfdb runs under {folder}: run `aotattn perfmon run --tag TAG` first")
    runs = [(path.stem, _read(str(path), arch, root)[0]) for path in paths]
    if gpu is not None:
        on = [(tag, db) for tag, db in runs if gpu.strip().lower() in db.header.get("gpu", "").lower()]
        if not gpu.strip() or not on:
            seen = sorted({db.header.get("gpu", "?").split(",")[0] for _, db in runs})
            raise _fail(f"--gpu {gpu!r}: no run under {folder} on such a GPU (its runs' GPUs: {', '.join(seen)})")
        runs = on
    stored = [e for _, db in runs for e in db.entries.values()]
    _check_selectors(stored, match, group, f" in the runs under {folder}")
    chosen = {e.name for e in select(stored, match or (), group or ())}
    found = [s for s in stand(runs, peer) if s.entry in chosen]
    if not found:
        raise _fail(f"no entry{' of this selection' if match or group else ''} has aotattn and {peer} timed "
                    f"side by side under {folder}")
    current = store.tuning_revision(tuning.database().root, arch).split()[0]
    tuned = {tag: db.header.get("tuning", "").split(" ")[0] == current for tag, db in runs}
    below = [s for s in found if s.ratio < floor]
    table = Table(title=f"{arch}: each entry's latest side-by-side figure against {peer} (above 1: aotattn is "
                  f"faster); tables: the run's tuning against the current ({current})")
    for column in ("entry", "pass", f"{peer} / aotattn", "aotattn ms", f"{peer} ms", "spread", "run", "tables"):
        table.add_column(column, overflow="fold")  # whole names, wrapped, in a narrow terminal
    for s in found if all_rows else below:
        stale = [] if tuned[s.run] else ["older"]
        stale += [f"aotattn re-timed {s.newer[:10]}"] if s.newer else []
        table.add_row(s.entry, s.pass_, f"{s.ratio:.3f}", _ms(s.aot_ms), _ms(s.peer_ms), f"{s.spread:.1%}", s.run,
                      ", ".join(stale) or "current", style="red" if s.ratio < floor else None)
    if all_rows or below:
        console.print(table)
    lowest = min(found, key=lambda s: s.ratio)
    console.print(f"{len(found) - len(below)} of {len(found)} entry passes at or above {floor:g}x {peer}, "
                  f"{len(below)} below (lowest {lowest.ratio:.3f}: {lowest.entry} {lowest.pass_}); "
                  f"{sum(not tuned[s.run] for s in found)} from runs on older tables")
    if fail and below:
        raise typer.Exit(1)
