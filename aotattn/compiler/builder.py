"""``aotattn build``: enumerate, compile in parallel, cache, pack into image archives."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aotattn import arch as arches
from aotattn import families, paths
from aotattn.files import write_atomically
from aotattn.compiler.jobs import Job, cache_key, compile_job, source_hash
from aotattn.runtime.images import (Archive, Entry, ImageError, Packed, _entry_from_json, _read_regular_file,
                                    archive_path, write_archive)
from aotattn.spec import Functional, parse_where
from aotattn.tuning import Database, TuningError
from aotattn.tuning.format import block_for, fallback_chain

DEFAULT_OUT = paths.default_images()  # a checkout's images/, else ~/.cache/aotattn/images
DEFAULT_CACHE = paths.default_build_cache()  # a checkout's build/cache/, else ~/.cache/aotattn/build
_CACHE_FILE_LIMIT = 64 << 20  # one kernel's cache entry or compressed binary: a few hundred KB at most


def check_archs(archs: Sequence[str]) -> None:
    """Every name one of :data:`aotattn.arch.ARCHES` (ValueError naming them otherwise)."""
    for name in archs:
        try:
            arches.arch(name)
        except ValueError as exc:
            raise ValueError(f"--arch: {exc}") from None


def _resolved(db: Database, arch: str, spec: Any, functional: Functional) -> list[list[str]]:
    """The grid of cell names ``functional``'s lookups read (its block or a fallback's)."""
    table = db.effective(arch, spec.qualname)
    return table.blocks[block_for(table, fallback_chain(spec.fallback, functional), f"{arch} / {spec.qualname}")]


def _chosen_cells(db: Database, arch: str, spec: Any, functional: Functional) -> set[tuple[int, int]]:
    """The cells where the operator table that runs ``spec`` (``spec.chosen_by``) chooses it."""
    chosen = spec.chosen_by
    operator = families.tables()[chosen.operator]
    if operator.tuning_keys != spec.tuning_keys:
        raise TuningError(f"{spec.qualname} is chosen by {chosen.operator}, whose keys differ")
    configs = db.effective(arch, chosen.operator).configs
    cells = set()
    for f in chosen.functionals(functional.as_dict()):
        grid = _resolved(db, arch, operator, Functional.of(f))
        cells |= {(r, c) for r, row in enumerate(grid) for c, name in enumerate(row)
                  if name != "." and configs[name][chosen.knob] == chosen.value}
    return cells


def enumerate_jobs(db: Database, archs: Sequence[str], tables: Sequence[str], where: str | None = None,
                   forced: bool = False) -> list[Job]:
    """Every functional of the selected kernels x every configuration its table names for it.

    ``where`` (``"dtype=bf16 BLOCK_D=128"``) selects functionals; an axis or value none of
    the kernels has, or a filter that matches nothing, is a ValueError. A kernel an
    operator table chooses (a backward backend's, ``KernelSpec.chosen_by``) is listed only
    in the cells where that table chooses it, unless ``forced``: then also what a call
    that forces the choice (``backend="fused"``) runs.
    """
    specs = [families.kernels()[name] for name in tables]
    wanted = parse_where(where, specs)
    if not any(f.matches(wanted, spec.axis_defaults) for spec in specs for f in spec.enumerate_functionals()):
        raise ValueError(f"--where {where!r} matches no functional of {', '.join(tables)} (some combinations "
                         "are never built: see the family's rules)")
    jobs = []
    for arch in archs:
        for name, spec in zip(tables, specs):
            if not spec.runs_on(arch):  # a kernel for one architecture's instructions (a Gluon kernel)
                continue
            table = db.effective(arch, name)
            for functional in spec.enumerate_functionals():
                if not functional.matches(wanted, spec.axis_defaults):
                    continue
                grid = _resolved(db, arch, spec, functional)
                cells = {(r, c) for r in range(len(grid)) for c in range(len(grid[r]))}
                if spec.chosen_by is not None and not forced:
                    cells &= _chosen_cells(db, arch, spec, functional)
                names = sorted({grid[r][c] for r, c in cells} - {"."})
                jobs += [Job(arch, name, functional, table.configs[n]) for n in names]
    return list(dict.fromkeys(jobs))  # functionals differing in table axes alone are one job


@dataclass
class Outcome:
    job: Job
    status: str  # "compiled", "cached", "failed", "timeout"
    seconds: float = 0.0
    message: str = ""
    entry: Entry | None = None


def _child(job: Job, cache_dir: Path, line_info: bool, conn: Any) -> None:
    start = time.monotonic()
    try:
        entry, binary = compile_job(job, line_info)
        _store(cache_dir, job, line_info, entry, Packed.of(binary))  # compressed here, in parallel
        conn.send(("compiled", time.monotonic() - start, "", entry))
    except BaseException as exc:  # report, never take the build down
        conn.send(("failed", time.monotonic() - start, f"{type(exc).__name__}: {exc}"[:2000], None))
    finally:
        conn.close()


def _cache_paths(cache_dir: Path, job: Job, line_info: bool) -> tuple[Path, Path]:
    """The entry (JSON) and the compressed binary of a compiled job in the cache."""
    base = cache_dir / job.arch / job.table / cache_key(job, line_info)
    return base.with_suffix(".json"), base.with_suffix(".xz")


def _store(cache_dir: Path, job: Job, line_info: bool, entry: Entry, packed: Packed) -> None:
    meta, blob = _cache_paths(cache_dir, job, line_info)
    meta.parent.mkdir(parents=True, exist_ok=True)
    record = {"entry": asdict(entry), "blob": packed.blob, "size": packed.size,
              "entry_sha256": _entry_digest(asdict(entry))}
    for path, data in ((blob, packed.data), (meta, json.dumps(record).encode())):  # the entry last: it marks done
        write_atomically(path, data)


def _entry_digest(entry: dict) -> str:
    """sha256 of a cache entry's canonical JSON: a damaged entry that still reads as one
    (say ``shared`` 98304 -> 98305, or another ``num_warps``) would otherwise be packed and
    launched with the wrong launch fields."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _cached(cache_dir: Path, job: Job, line_info: bool, check: bool = True) -> tuple[Entry, Packed] | None:
    """The job's entry and binary from the cache, the binary inflated and checked unless
    ``check`` is False, the entry always checked against its checksum; None if absent,
    damaged or written before entries had one (then it is compiled again)."""
    meta, blob = _cache_paths(cache_dir, job, line_info)
    try:
        # regular files only (a FIFO there hung the build), of an archive's size at most
        record = json.loads(_read_regular_file(meta, _CACHE_FILE_LIMIT))
        if record["entry_sha256"] != _entry_digest(record["entry"]):
            raise ValueError(f"{meta}: the entry does not match its checksum")
        packed = Packed(record["blob"], record["size"], _read_regular_file(blob, _CACHE_FILE_LIMIT))
        if check:
            packed.check(str(blob))
        # the entry checked as an archive's would be, with this blob: a damaged one (say a negative
        # shared size) was taken as cached, and every later build then failed writing the archive
        raw = {**record["entry"], "blob": packed.blob, "offset": 0, "length": len(packed.data), "size": packed.size}
        entry = _entry_from_json(raw, str(meta), len(packed.data))
        if entry.key != job.key:
            raise ValueError(f"{meta} holds {entry.key}, not {job.key}")
        return entry, packed
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ImageError, RecursionError):
        return None  # RecursionError: JSON nested deeper than the parser goes is garbage too


def check_timeout(timeout: float) -> float:
    """A compile's time limit: a number of seconds above 0 (NaN passes a range check, and a
    compile is then never abandoned; 0 or less abandons them all)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"--timeout: expected a number of seconds above 0, got {timeout}")
    return timeout


def run_jobs(jobs: Sequence[Job], cache_dir: Path, workers: int, timeout: float,
             on_outcome: Callable[[Outcome], None], line_info: bool = False) -> list[Outcome]:
    """Compile ``jobs`` not yet in the cache in up to ``workers`` forked processes, each
    killed after ``timeout`` s; the same job twice is compiled once."""
    check_timeout(timeout)
    outcomes = []
    pending = []
    for job in dict.fromkeys(jobs):
        if _cached(cache_dir, job, line_info) is not None:
            outcome = Outcome(job, "cached")
            outcomes.append(outcome)
            on_outcome(outcome)
        else:
            pending.append(job)
    ctx = mp.get_context("fork")
    running: dict[Any, tuple[Any, Job, float]] = {}
    pending.reverse()
    while pending or running:
        while pending and len(running) < workers:
            job = pending.pop()
            receiver, sender = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_child, args=(job, cache_dir, line_info, sender), daemon=True)
            process.start()
            sender.close()
            running[receiver] = (process, job, time.monotonic())
        ready = multiprocessing.connection.wait(list(running), timeout=0.5)
        now = time.monotonic()
        for receiver in list(running):
            process, job, started = running[receiver]
            outcome = None
            if receiver in ready:
                try:
                    status, seconds, message, entry = receiver.recv()
                    outcome = Outcome(job, status, seconds, message, entry)
                except EOFError:
                    process.join(1)
                    outcome = Outcome(job, "failed", now - started, f"the compiler process died ({process.exitcode})")
            elif now - started > timeout:
                process.kill()
                outcome = Outcome(job, "timeout", now - started, f"killed after {timeout:.0f} s")
            if outcome is not None:
                process.join(1)
                receiver.close()
                del running[receiver]
                outcomes.append(outcome)
                on_outcome(outcome)
    return outcomes


@dataclass
class BuildReport:
    outcomes: list[Outcome] = field(default_factory=list)
    archives: list[Path] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in ("failed", "timeout")]


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """Held while an archive in ``folder`` is read, merged and rewritten: two builds into one
    folder would each write what they read plus their own kernels, and the later rename
    would drop what the other one added."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when closed
        yield
    finally:
        os.close(fd)


def pack(jobs: Iterable[Job], cache_dir: Path, out: Path, line_info: bool = False,
         sources: dict[str, str] | None = None, warn: Callable[[str], None] = lambda line: None) -> list[Path]:
    """Write one archive per (arch, table) with the cached binaries of ``jobs`` (those
    :func:`run_jobs` compiled or found cached), merged with what the existing archive holds
    for the same source and compiler (kept compressed as they are). ``sources``: each
    table's :func:`source_hash` taken before compiling (:func:`compile_and_pack`); a kernel
    source edited since is refused, since its binaries would be labelled with the new one.
    ``warn``: told of an existing archive that could not be read (rebuilt from the cache)."""
    import triton

    groups: dict[tuple[str, str], list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.arch, job.table), []).append(job)
    written = []
    for (arch, table), group in sorted(groups.items()):
        spec = families.kernels()[table]
        digest = source_hash(spec)
        if sources is not None and sources.get(table, digest) != digest:
            raise ValueError(f"{table}: its kernel source changed while it compiled ({spec.module}); build again")
        kernels: dict[str, tuple[Entry, Packed]] = {}
        path = archive_path(out, arch, table)
        with _folder_lock(path.parent):  # what it reads stays what it merges into until it is written
            if path.is_file():
                try:
                    old = Archive(path)
                    # one copied or renamed into place holds another arch's or kernel's binaries, which the
                    # merged archive would then label as this one's (the runtime refuses only the label)
                    if ((old.header.arch, old.header.table) == (arch, table) and old.header.source_hash == digest
                            and old.header.triton_version == triton.__version__):
                        kernels = {e.key: (e, old.packed(e)) for e in old.header.entries}
                except ImageError as exc:  # its kernels come back only from the cache: say so
                    warn(f"{path}: unreadable ({exc}); rewritten with this build's kernels only (build every "
                         f"kernel of {table} again to restore the others: aotattn build --arch {arch} --kernel {table})")
            for job in group:
                found = _cached(cache_dir, job, line_info, check=False)  # run_jobs checked or wrote it
                if found is not None:
                    kernels[found[0].key] = found
            if kernels:
                write_archive(path, arch, table, triton.__version__, digest, kernels.values())
                written.append(path)
    return written


def compile_and_pack(jobs: Sequence[Job], cache_dir: Path, out: Path, workers: int, timeout: float,
                     on_outcome: Callable[[Outcome], None] = lambda o: None, line_info: bool = False,
                     warn: Callable[[str], None] = lambda line: None) -> tuple[list[Outcome], list[Path]]:
    """:func:`run_jobs` then :func:`pack` of what compiled or was cached, the kernel sources'
    hashes taken before compiling and checked before packing."""
    sources = {table: source_hash(families.kernels()[table]) for table in {job.table for job in jobs}}
    outcomes = run_jobs(jobs, cache_dir, workers, timeout, on_outcome, line_info)
    archives = pack([o.job for o in outcomes if o.status in ("compiled", "cached")], cache_dir, out, line_info,
                    sources, warn)
    return outcomes, archives


def build(archs: Sequence[str], tables: Sequence[str], where: str | None, out: Path, cache_dir: Path,
          workers: int, timeout: float, db: Database,
          on_outcome: Callable[[Outcome], None] = lambda o: None,
          on_plan: Callable[[list[Job]], None] = lambda jobs: None, line_info: bool = False,
          forced: bool = False, warn: Callable[[str], None] = lambda line: None) -> BuildReport:
    """Compile what :func:`enumerate_jobs` lists (the cache's binaries where it has them)
    and pack it into ``out``. ``line_info``: keep source line tables in the binaries
    (for profilers; about 2.5 times the size, see :mod:`aotattn.compiler.jobs`)."""
    check_archs(archs)
    start = time.monotonic()
    jobs = enumerate_jobs(db, archs, tables, where, forced)
    on_plan(jobs)
    outcomes, archives = compile_and_pack(jobs, cache_dir, out, workers, timeout, on_outcome, line_info, warn)
    return BuildReport(outcomes, archives, time.monotonic() - start)
