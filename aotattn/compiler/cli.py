"""``aotattn build`` and ``aotattn images ls|extract|verify``."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table as RichTable
from rich.text import Text

from aotattn.arch import ARCHES
from aotattn.runtime.images import ENV_VAR, SUFFIX, Archive, ImageError, image_roots, images_root

console = Console(soft_wrap=True)  # one problem, one line, whatever the terminal's width
images_app = typer.Typer(help="List, extract and verify kernel image archives (docs/image-archive-format.md).",
                         no_args_is_help=True)


def _default_arch() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            from aotattn.runtime.device import arch_of

            return arch_of(torch.device("cuda"))
    except Exception:  # no usable GPU: the documented default
        pass
    return "sm_90"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or
    ``taskset`` narrows), the default number of compiler processes."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def build_command(
    arch: list[str] = typer.Option(None, "--arch", help=f"target (repeatable): {' '.join(ARCHES)}; default: the "
                                   "GPU present, else sm_90"),
    family: list[str] = typer.Option(None, "--family", help="only these families (repeatable)"),
    kernel: list[str] = typer.Option(None, "--kernel", help="only these kernels, family.kernel or kernel (repeatable)"),
    where: str = typer.Option(None, help='only functionals matching, e.g. "dtype=bf16 BLOCK_D=128"'),
    jobs: int = typer.Option(None, min=1, help="parallel compiler processes (default: every core this process may "
                             "use)"),
    timeout: float = typer.Option(600.0, help="seconds before one kernel's compilation is abandoned"),
    out: Path = typer.Option(None, help="where the archives go (default: $AOTATTN_IMAGES, else images/ in a "
                             "checkout, else ~/.cache/aotattn/images)"),
    cache: Path = typer.Option(None, help="compiled-kernel cache (default: build/cache/ in a checkout, else "
                               "~/.cache/aotattn/build)"),
    tuning_db: Path = typer.Option(None, "--tuning-db", help="tuning database root (default: $AOTATTN_TUNING_DB, "
                                   "else the one installed with aotattn)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="only list what would be compiled"),
    line_info: bool = typer.Option(False, "--line-info", help="keep source line tables in the kernels (profilers, "
                                   "compute-sanitizer; about 2.5 times the size, and other machine code)"),
    forced_backends: bool = typer.Option(False, "--forced-backends", help="also the kernels only a call that forces "
                                         "a backend runs (backend='fused' where the tuning database chooses split; "
                                         "without them such a call compiles through Triton's JIT once)"),
) -> None:
    """Compile every kernel variant the tuning database names, for each arch, into image archives.

    Incremental: a variant whose source, options and compiler are unchanged is taken from the
    cache. A failing or hanging kernel is reported and does not stop the others.
    """
    from aotattn import families
    from aotattn.compiler.builder import DEFAULT_CACHE, build, check_archs, check_timeout, enumerate_jobs
    from aotattn.tuning import Database

    check_timeout(timeout)
    archs = list(dict.fromkeys(arch or [_default_arch()]))  # `--arch sm_90 --arch sm_90` builds it once
    check_archs(archs)
    known = families.kernels()
    tables = [name for name in known
              if (not family or name.split(".")[0] in family)
              and (not kernel or name in kernel or name.split(".", 1)[1] in kernel)]
    if not tables:
        raise ValueError(f"--family/--kernel: no kernel matches {' '.join(family or [])} {' '.join(kernel or [])} "
                         f"(kernels: {', '.join(known)})")
    db = Database(tuning_db, families.tables()) if tuning_db else Database(specs=families.tables())
    planned = enumerate_jobs(db, archs, tables, where, forced_backends)  # refuses a bad --where before anything starts
    if not planned:  # say why, instead of building nothing and exiting 0
        specs = [known[name] for name in tables]
        if not any(spec.runs_on(a) for spec in specs for a in archs):
            where_run = sorted({a for spec in specs for a in getattr(spec, "archs", None) or ()})
            raise ValueError(f"{', '.join(tables)} run only on {', '.join(where_run) or 'other architectures'}, "
                             f"not on {', '.join(archs)} (--arch)")
        if not forced_backends and any(spec.chosen_by is not None for spec in specs):
            raise ValueError(f"the tuning database chooses {', '.join(tables)} for none of these calls on "
                             f"{', '.join(archs)}: add --forced-backends to build what a call forcing that backend runs")
        raise ValueError(f"the tuning database names no configuration of {', '.join(tables)} for this selection "
                         f"on {', '.join(archs)}")
    if dry_run:
        for job in planned:
            console.print(f"{job.arch} {job.table} [{job.functional}] {job.config} ({job.variant})", markup=False)
        per_table: dict[str, int] = {}
        for job in planned:
            per_table[f"{job.arch} {job.table}"] = per_table.get(f"{job.arch} {job.table}", 0) + 1
        console.print(f"{len(planned)} kernel(s): " + ", ".join(f"{k} {n}" for k, n in per_table.items()), markup=False)
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    failures = []
    with progress:
        task = progress.add_task("compiling", total=len(planned))

        def done(outcome):
            progress.advance(task)
            if outcome.status in ("failed", "timeout"):
                failures.append(outcome)
                job, last = outcome.job, outcome.message.splitlines()[-1] if outcome.message else ""
                progress.console.print(escape(f"FAILED {job.arch} {job.table} [{job.functional}] {job.config}: {last}"),
                                       style="red")

        out, cache = (out or images_root()).expanduser(), (cache or DEFAULT_CACHE).expanduser()  # --out=~/x
        report = build(archs, tables, where, out, cache, jobs or usable_cores(), timeout, db, on_outcome=done,
                       line_info=line_info, forced=forced_backends,
                       warn=lambda line: progress.console.print(escape(f"warning: {line}"), style="yellow"))
    counts = {}
    for outcome in report.outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    size = sum(p.stat().st_size for p in report.archives)
    console.print(f"{len(report.outcomes)} kernel(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                  + f"; {len(report.archives)} archive(s), {size / 2**20:.1f} MiB; {report.seconds:.1f} s")
    for path in report.archives:
        console.print(f"  {path}", markup=False, highlight=False)
    if failures:
        raise typer.Exit(1)


_FOLDERS = ("archives or folders (default: the folders the runtime reads: $AOTATTN_IMAGES alone when set, else "
            "the build's default folder and the images installed with aotattn)")


def _archives(paths: list[Path] | None) -> list[Path]:
    """The archives under ``paths`` (default: the folders the runtime reads, which exist).
    A named path that is not a folder is taken as an archive (the reader refuses what is
    not a plain file)."""
    if not paths:
        paths = [root for root in image_roots() if root.is_dir()] or [images_root()]
    found = []
    for path in paths:
        if path.is_dir():
            found += sorted(path.rglob(f"*{SUFFIX}"))
        elif os.path.lexists(path):
            found.append(path)
        else:
            raise ImageError(f"no image folder or archive {path}: build images with aotattn build --arch <arch> "
                             f"(--out, or {ENV_VAR}, says where they go)")
    return found


@images_app.command("ls")
def ls(paths: list[Path] = typer.Argument(None, help=_FOLDERS)) -> None:
    """List archives: architecture, kernel table, how many kernels, Triton version, size."""
    table = RichTable("archive", "arch", "table", "kernels", "triton", "size")
    bad = 0
    found = _archives(paths)
    for path in found:
        try:
            h = Archive(path).header  # every entry checked: one out of its schema makes this archive bad, not ls fail
        except ImageError as exc:
            console.print(escape(str(exc)), style="red")
            bad += 1
            continue
        table.add_row(*(Text(cell) for cell in (str(path), h.arch, h.table, str(len(h.entries)), h.triton_version,
                                                 f"{path.stat().st_size / 1024:.0f} KiB")))  # never markup
    console.print(table)
    console.print(f"{len(found)} archive(s)")
    if bad:
        raise typer.Exit(1)


@images_app.command()
def extract(archive: Path = typer.Argument(..., help="an archive"),
            target: Path = typer.Argument(..., help="a new or empty folder to write into")) -> None:
    """Write an archive's kernels (and index.json) into a new or empty folder; never outside it."""
    written = Archive(archive).extract(target)
    console.print(f"{len(written)} file(s) under {target}", markup=False, highlight=False)


@images_app.command()
def verify(paths: list[Path] = typer.Argument(None, help=_FOLDERS)) -> None:
    """Check every archive, every kernel in it, and that this aotattn would load it.

    The header, the index's checksum and schema, each kernel's size and checksum, the
    paths extract would write, the Triton version and the kernel source it was built from.
    """
    from aotattn import families
    from aotattn.runtime.image_loader import check_loadable

    archives = _archives(paths)
    if not archives:
        raise ImageError(f"no image archives under {' '.join(map(str, paths or image_roots()))}: build them with "
                         "aotattn build --arch <arch>")
    problems = []
    for path in archives:
        try:
            archive = Archive(path)
            problems += archive.verify()
            spec = families.kernels().get(archive.table)
            if spec is None:
                problems.append(f"{path}: no kernel family declares {archive.table}")
            else:
                check_loadable(archive, archive.arch, spec)
            # the runtime opens <arch>/<table>.aotimg under an image folder and refuses one holding another arch
            # or kernel: one copied or renamed into another's place is a problem where it lies
            placed = Path(archive.arch, f"{archive.table}{SUFFIX}")
            where = path.absolute()  # `verify .` inside sm_90/: the folder's name, not ""
            if ((where.parent.name in ARCHES or where.name.removesuffix(SUFFIX) in families.kernels())
                    and Path(*where.parts[-2:]) != placed):
                problems.append(f"{path}: holds {archive.arch} / {archive.table}, but lies where the runtime looks for "
                                f"{where.parent.name} / {where.name.removesuffix(SUFFIX)} (and would refuse it): move "
                                f"it to {placed} under its image folder, or rebuild this one with aotattn build")
        except ImageError as exc:
            problems.append(str(exc))
    for problem in problems:
        console.print(escape(problem), style="red")
    console.print(f"{len(archives)} archive(s), {len(problems)} problem(s)")
    if problems:
        raise typer.Exit(1)
