"""Offline batches: GPU hosts that cannot reach the database still run pgdef tasks.

1. **checkout** (on a host that reaches the database): claim up to N queued tasks of one
   pool under one long lease owned by ``batch:<id>`` and write them to a batch file (JSON).
2. **run** (on the offline host, no database): :func:`run_offline` runs every task of the
   file with the registered handlers and appends one JSON line per attempt to a results
   file, synced after each line; run again, it skips tasks already in the file.
3. **checkin** (back where the database is): :func:`checkin` records the results in one
   transaction. A result is accepted if its task has none yet (the same rule as online
   workers: the first result wins), so checking in twice, or after the lease expired and
   another worker redid the task, creates no second result. Errors count as failed attempts
   while the batch still holds the task. Tasks the files have no outcome for are released
   to the queue without counting an attempt.

A batch never checked in holds its tasks until its lease expires; then they return to the
queue like any expired lease, and a late check-in can still contribute the results of
tasks nobody has finished since.

Files: the batch is ``{"format": "pgdef-batch/1", "batch_id", "pool", "created_at",
"lease_expires_at", "tasks": [Task.to_json(), ...]}``. The results file is JSON lines: a
header ``{"format": "pgdef-results/1", "batch_id", "host"}`` and one line per attempt
``{"task_id", "attempt", "ok", "output", "error", "permanent", "elapsed_s", "worker_id"}``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotattn.pgdef.errors import BatchError, ConfigError
from aotattn.pgdef.model import (Category, Outcome, Task, TaskContext, canonical_json, check_pool, check_seconds,
                                 check_list, check_task_ids, storable_json, storable_text)
from aotattn.pgdef.queries import QUERIES
from aotattn.pgdef.registry import App, kinds_of, run_attempt

if TYPE_CHECKING:  # the offline runner must import on hosts without psycopg
    import psycopg

    from aotattn.pgdef.connection import Runner

log = logging.getLogger("aotattn.pgdef.offline")

BATCH_FORMAT = "pgdef-batch/1"
RESULTS_FORMAT = "pgdef-results/1"


@dataclass(frozen=True)
class Batch:
    id: str
    pool: str
    created_at: datetime
    lease_expires_at: datetime
    tasks: list[Task]

    @property
    def owner(self) -> str:
        return f"batch:{self.id}"

    def to_json(self) -> dict[str, Any]:
        return {"format": BATCH_FORMAT, "batch_id": self.id, "pool": self.pool,
                "created_at": self.created_at.isoformat(), "lease_expires_at": self.lease_expires_at.isoformat(),
                "tasks": [t.to_json() for t in self.tasks]}

    @classmethod
    def read(cls, path: Path) -> Batch:
        try:
            obj = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise BatchError(f"{path}: not a readable batch file ({exc}); expected a {BATCH_FORMAT} file "
                             "from `aotattn pgdef checkout`") from exc
        if not isinstance(obj, dict) or obj.get("format") != BATCH_FORMAT:
            raise BatchError(f"{path}: expected a {BATCH_FORMAT} file from `aotattn pgdef checkout`")
        try:
            return cls(id=str(obj["batch_id"]), pool=check_pool(obj["pool"]),
                       created_at=_aware(obj["created_at"], "created_at"),
                       lease_expires_at=_aware(obj["lease_expires_at"], "lease_expires_at"),
                       tasks=[Task.from_json(t) for t in obj["tasks"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise BatchError(f"{path}: malformed batch file ({type(exc).__name__}: {exc})") from exc


def _aware(text: str, name: str) -> datetime:
    """An ISO 8601 time with its offset (checkout writes them so; without one it is ambiguous)."""
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        raise ValueError(f"{name} {text!r} has no time zone offset")
    return moment


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- checkout ---------------------------------------------------------------------------------
def checkout(db: Runner, pool: str, categories: Sequence[str | Category], path: Path, *, limit: int = 100,
             lease_s: float = 86400.0, host: str | None = None, task_ids: Sequence[int] | None = None) -> Batch | None:
    """Claim up to ``limit`` queued tasks of ``pool`` and ``categories`` (and, given
    ``task_ids``, only among those: a batch sized from a listing claims no task it did not
    see) into the batch file ``path`` under one lease of ``lease_s`` seconds. None (and no
    file) when none is queued."""
    check_pool(pool)
    names = [str(Category.parse(c)) for c in check_list(categories, "checkout: categories")]
    if not names:
        raise ConfigError("checkout: expected at least one --category app,subcategory")
    if not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"checkout: expected limit >= 1, got {limit!r}")
    check_seconds(lease_s, "lease_s")
    ids = check_task_ids(task_ids)
    batch_id = uuid.uuid4().hex
    owner = f"batch:{batch_id}"

    def work(conn: psycopg.Connection) -> tuple[list[dict[str, Any]], datetime | None, datetime | None]:
        with conn.transaction():
            # Run again after a lost connection: the first run may have committed.
            made = conn.execute(QUERIES["batch"], {"batch_id": batch_id}).fetchone()
            if made is not None:
                rows = conn.execute(QUERIES["batch_held"], {"owner": owner}).fetchall()
                return rows, made["lease_expires_at"], None
            rows = conn.execute(QUERIES["claim"], {"pool": pool, "categories": names, "limit": limit, "task_ids": ids,
                                                   "owner": owner, "lease_s": lease_s}).fetchall()
            if not rows:
                return [], None, None
            expires = conn.execute(QUERIES["create_batch"], {
                "batch_id": batch_id, "pool": pool, "host": host or socket.gethostname(),
                "task_ids": [r["id"] for r in rows], "lease_s": lease_s}).fetchone()["lease_expires_at"]
            now = conn.execute(QUERIES["now"]).fetchone()["now"]
            return rows, expires, now

    rows, expires, created = db.run(work)
    if not rows:
        return None
    tasks = sorted((Task.from_row(r) for r in rows), key=lambda t: (-t.priority, t.id))
    batch = Batch(id=batch_id, pool=pool, created_at=created or datetime.now(timezone.utc),
                  lease_expires_at=expires, tasks=tasks)
    try:
        _write_atomically(Path(path), json.dumps(batch.to_json(), indent=1) + "\n")
    except OSError as exc:
        def give_back(conn: psycopg.Connection) -> None:  # the tasks, and the batch row nobody holds
            with conn.transaction():
                conn.execute(QUERIES["release"], {"owner": owner, "task_ids": [t.id for t in tasks]})
                conn.execute(QUERIES["drop_batch"], {"batch_id": batch_id})

        db.run(give_back)
        raise BatchError(f"cannot write batch file {path} ({exc}); its tasks were released") from exc
    return batch


# -- run, offline ------------------------------------------------------------------------------
@dataclass(frozen=True)
class OfflineReport:
    ran: int
    ok: int
    errors: int
    skipped: int
    results: Path


def _parse_shard(shard: tuple[int, int]) -> tuple[int, int]:
    index, count = shard
    if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
        raise ConfigError(f"shard: expected (index, count) with 0 <= index < count, got {shard!r}")
    return index, count


def run_offline(batch_path: Path, results_path: Path, apps: Iterable[str | App], *,
                shard: tuple[int, int] = (0, 1), gpu: int | None = None,
                worker_id: str | None = None) -> OfflineReport:
    """Run the tasks of a batch file (those of ``shard`` = (index, count): every count-th task
    from index) with the handlers of ``apps``, appending outcomes to ``results_path``.
    Needs no database. Tasks already in the results file are skipped (resume after a crash)."""
    batch = Batch.read(Path(batch_path))
    index, count = _parse_shard(shard)
    mine = batch.tasks[index::count]
    kinds = kinds_of(apps)
    missing = sorted({str(t.category) for t in mine} - set(kinds))
    if missing:
        raise ConfigError(f"no handler for categories {', '.join(missing)} in the applications given (--app)")
    if datetime.now(timezone.utc) > batch.lease_expires_at:
        log.warning("batch %s: lease expired at %s; results are accepted only for tasks nobody finished since",
                    batch.id, batch.lease_expires_at.isoformat())
    worker_id = worker_id or f"offline:{socket.gethostname().split('.')[0]}:{os.getpid()}"
    results_path = Path(results_path)
    done = _resume(results_path, batch.id)
    ran = ok = 0
    with open(results_path, "a", encoding="utf-8") as out:
        for task in mine:
            if task.id in done:
                continue
            outcome = run_attempt(kinds[str(task.category)], task, TaskContext(task, worker_id, gpu))
            line = {"task_id": task.id, "attempt": task.attempt, "ok": outcome.ok, "output": outcome.output,
                    "error": outcome.error, "permanent": outcome.permanent, "elapsed_s": outcome.elapsed_s,
                    "worker_id": worker_id}
            out.write(canonical_json(line) + "\n")
            out.flush()
            os.fsync(out.fileno())
            ran += 1
            ok += outcome.ok
    return OfflineReport(ran=ran, ok=ok, errors=ran - ok, skipped=len(mine) - ran, results=results_path)


def _resume(path: Path, batch_id: str) -> set[int]:
    """The task ids already in a results file; writes the header to a new file."""
    if not path.exists() or path.stat().st_size == 0:
        _write_atomically(path, canonical_json({"format": RESULTS_FORMAT, "batch_id": batch_id,
                                                "host": socket.gethostname()}) + "\n")
        return set()
    found_batch, outcomes = read_results(path)
    if found_batch != batch_id:
        raise BatchError(f"{path} holds results of batch {found_batch}, not {batch_id}; use another results file")
    _end_with_a_full_line(path)
    return {o.task_id for o in outcomes}


def _end_with_a_full_line(path: Path) -> None:
    """Cut a last line that :func:`read_results` ignored (cut short by a crash, or blank),
    or end a whole one whose newline was not written, so that the next line appended
    starts a line of its own and the file reads back as it did."""
    with open(path, "rb+") as handle:
        data = handle.read()
        body = data[:-1] if data.endswith(b"\n") else data
        start = body.rfind(b"\n") + 1
        whole = _parses(body[start:])
        if data.endswith(b"\n") and whole:
            return
        if whole or start == 0:  # a whole line (or the header) whose newline was not written: end it
            handle.write(b"\n")
        else:  # cut short, or blank: read_results ignored it
            handle.truncate(start)
        handle.flush()
        os.fsync(handle.fileno())


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


def read_results(path: Path) -> tuple[str, list[Outcome]]:
    """A results file's batch id and outcomes. A last line cut short (a crash mid-write) is
    ignored; any other malformed line is an error naming ``path:line``."""
    try:
        data = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise BatchError(f"cannot read results file {path} ({exc})") from exc
    lines = data.splitlines()
    # every line is written with its newline: a last line without one was cut short, even
    # where the cut fell just after a "}" (the end of the output object)
    unterminated = not data.endswith("\n")
    try:
        header = json.loads(lines[0]) if lines else None
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != RESULTS_FORMAT or "batch_id" not in header:
        raise BatchError(f"{path}:1: expected a {RESULTS_FORMAT} header (a file from `aotattn pgdef run-offline`)")
    outcomes = []
    for number, text in enumerate(lines[1:], start=2):
        parsed = False
        try:
            obj, parsed = json.loads(text), True
            outcomes.append(_storable(_outcome_of(obj)))
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            if number == len(lines) and (unterminated or not (parsed or text.endswith("}"))):
                log.warning("%s:%d: ignoring a line cut short", path, number)
                break
            raise BatchError(f"{path}:{number}: malformed result line ({type(exc).__name__}: {exc})") from exc
    return str(header["batch_id"]), outcomes


_REQUIRED = object()


def _typed(obj: dict, key: str, kind: str, default: object = _REQUIRED) -> object:
    """``obj[key]`` if it has the JSON type ``kind`` ("int", "bool", "number", "text or
    null"), else TypeError: a checked-in line is recorded as it reads, so nothing is coerced
    (``bool("no")`` made a failed line a result, ``int(3.9)`` another task's)."""
    if key not in obj and default is not _REQUIRED:
        return default
    value = obj[key]
    fits = {"int": isinstance(value, int) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= 0,
            "text or null": value is None or isinstance(value, str)}[kind]
    if not fits:
        raise TypeError(f"{key}: expected {'a non-negative number' if kind == 'number' else kind}, got {value!r}")
    return value


def _outcome_of(obj: object) -> Outcome:
    """One result line's outcome, every field of the type ``run_offline`` writes."""
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object, got {type(obj).__name__}")
    ok, error = _typed(obj, "ok", "bool"), _typed(obj, "error", "text or null", None)
    if ok == (error is not None):
        raise ValueError(f"expected an error exactly when ok is false, got ok {ok} and error {error!r}")
    attempt = _typed(obj, "attempt", "int")
    if attempt < 1:
        raise ValueError(f"attempt: expected 1 or more, got {attempt}")
    return Outcome(task_id=_typed(obj, "task_id", "int"), attempt=attempt, ok=ok, output=obj.get("output"),
                   error=error, permanent=_typed(obj, "permanent", "bool", False),
                   elapsed_s=float(_typed(obj, "elapsed_s", "number", 0.0)),
                   worker_id=_typed(obj, "worker_id", "text or null", None))


def _storable(outcome: Outcome) -> Outcome:
    """The outcome as the database can record it, by the online workers' rules: an output
    ``jsonb`` refuses fails the attempt for good; error texts and worker ids are escaped."""
    error = None if outcome.error is None else storable_text(outcome.error)
    worker = None if outcome.worker_id is None else storable_text(outcome.worker_id)
    if outcome.ok:
        try:
            storable_json(outcome.output)
        except ValueError as exc:
            return replace(outcome, ok=False, output=None, permanent=True, worker_id=worker,
                           error=f"TypeError: handler output is not JSON the database can store: {exc}")
    return replace(outcome, error=error, worker_id=worker)


# -- checkin ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckinReport:
    """accepted: results recorded now; already: results not needed (the task had one, or was
    cancelled); errors: failed attempts recorded; stale_errors: errors of tasks the batch no
    longer held; released: tasks without an outcome, back in the queue."""

    batch_id: str
    accepted: int
    already: int
    errors: int
    stale_errors: int
    released: int
    first_checkin: bool


def checkin(db: Runner, paths: Sequence[Path]) -> CheckinReport:
    """Record the outcomes in results files of one batch; idempotent (see the module docstring)."""
    from aotattn.pgdef.connection import jsonb

    paths = check_list(paths, "checkin: results files")
    if not paths:
        raise ConfigError("checkin: expected at least one results file")
    batch_id: str | None = None
    best: dict[int, Outcome] = {}
    for path in paths:
        found, outcomes = read_results(Path(path))
        if batch_id is not None and found != batch_id:
            raise BatchError(f"{path} belongs to batch {found}, the other files to {batch_id}; check in one batch at a time")
        batch_id = found
        for outcome in outcomes:
            if outcome.task_id not in best or (outcome.ok and not best[outcome.task_id].ok):
                best[outcome.task_id] = outcome
    assert batch_id is not None
    owner = f"batch:{batch_id}"

    def work(conn: psycopg.Connection) -> CheckinReport:
        with conn.transaction():
            batch = conn.execute(QUERIES["batch"], {"batch_id": batch_id}).fetchone()
            if batch is None:
                raise BatchError(f"batch {batch_id} is unknown to this database; check it in where it was checked out")
            foreign = sorted(set(best) - set(batch["task_ids"]))
            if foreign:
                raise BatchError(f"results for tasks {foreign[:5]} that are not in batch {batch_id}; "
                                 "the results file was edited or mixed up")
            first = batch["checked_in_at"] is None
            accepted = already = errors = stale = 0
            for outcome in best.values():
                worker = outcome.worker_id or owner
                if outcome.ok:
                    taken = conn.execute(QUERIES["complete"], {
                        "task_id": outcome.task_id, "output": jsonb(outcome.output), "worker_id": worker,
                        "attempt": outcome.attempt, "elapsed_s": outcome.elapsed_s}).fetchall()
                    accepted += bool(taken)
                    already += not taken
                    if not taken and first:
                        conn.execute(QUERIES["record_late_result"], {"task_id": outcome.task_id, "owner": owner,
                                                                     "attempt": outcome.attempt})
                else:
                    recorded = conn.execute(QUERIES["fail"], {
                        "task_id": outcome.task_id, "owner": owner, "attempt": outcome.attempt,
                        "permanent": outcome.permanent, "error": outcome.error}).fetchall()
                    errors += bool(recorded)
                    stale += not recorded
            held = [r["id"] for r in conn.execute(QUERIES["batch_held"], {"owner": owner}) if r["id"] not in best]
            released = len(conn.execute(QUERIES["release"], {"owner": owner, "task_ids": held}).fetchall()) if held else 0
            conn.execute(QUERIES["finish_batch"], {"batch_id": batch_id, "n_accepted": accepted})
            return CheckinReport(batch_id, accepted, already, errors, stale, released, first)

    return db.run(work)
