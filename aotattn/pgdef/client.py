"""The Python API for applications: set up the database, dispatch tasks, follow them, read results.

::

    from aotattn.pgdef import Client

    with Client(dsn) as client:          # dsn None: $AOTATTN_PGDEF_DSN, else the embedded server
        client.init()                     # create or upgrade the schema (idempotent)
        client.dispatch("toy,square", "cpu", [{"x": i} for i in range(100)])
        client.wait("toy,square")         # until nothing is queued or running
        squares = {r.payload["x"]: r.output["y"] for r in client.results("toy,square")}

A Client is thread-safe (a psycopg_pool pool underneath).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from aotattn.pgdef import schema
from aotattn.pgdef.connection import PooledConnector, jsonb, redact, resolve_dsn
from aotattn.pgdef.errors import ConfigError
from aotattn.pgdef.model import (Category, Result, Selection, TaskSpec, check_payload, check_pool, check_seconds,
                                 check_list, check_task_ids, default_key, storable_text)
from aotattn.pgdef.queries import QUERIES
from aotattn.pgdef.registry import App, TaskKind, load_app

DISPATCH_CHUNK = 5000
DISPATCH_LOCK = 0x70676466  # the class of lock_dispatch's advisory locks
STATES = ("queued", "running", "done", "failed", "cancelled")


def _int32(value: object) -> bool:
    """An int PostgreSQL's ``integer`` holds (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and -2**31 <= value < 2**31


def _keys(keys: object) -> list[str] | None:
    """Task keys to select by (None: every key)."""
    if keys is None:
        return None
    listed = check_list(keys, "keys")
    bad = [k for k in listed if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"keys: expected strings, got {bad[0]!r}")
    return listed


@dataclass(frozen=True)
class DispatchReport:
    """``inserted`` new tasks; ``existing`` whose key was already there (nothing changed);
    ``repeated`` tasks of the call whose key an earlier task of the same call had (skipped: the
    first one counts). ``inserted + existing + repeated`` is the number of tasks given."""

    inserted: int
    existing: int
    repeated: int = 0

    def __str__(self) -> str:
        repeated = f", {self.repeated} repeated a key given before them" if self.repeated else ""
        return f"{self.inserted} queued, {self.existing} already there{repeated}"


@dataclass(frozen=True)
class Progress:
    """One category in one pool. ``expired``: running tasks whose lease has run out, not yet
    re-queued. ``rate_per_s``: completions per second over the status window (None: none)."""

    category: str
    pool: str
    queued: int
    running: int
    done: int
    failed: int
    cancelled: int
    expired: int
    rate_per_s: float | None

    @property
    def total(self) -> int:
        return self.queued + self.running + self.done + self.failed + self.cancelled

    @property
    def remaining(self) -> int:
        return self.queued + self.running

    @property
    def eta_s(self) -> float | None:
        """Seconds until nothing remains at the recent rate (0 when done, None when unknown)."""
        if self.remaining == 0:
            return 0.0
        return self.remaining / self.rate_per_s if self.rate_per_s else None


@dataclass(frozen=True)
class Status:
    progress: list[Progress]
    workers: list[dict[str, Any]]
    expired: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    batches: list[dict[str, Any]]

    @property
    def remaining(self) -> int:
        return sum(p.remaining for p in self.progress)


@dataclass(frozen=True)
class TaskInfo:
    id: int
    category: Category
    pool: str
    key: str
    priority: int
    payload: dict[str, Any]
    state: str
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    error: str | None


class Client:
    """A connection pool to one pgdef database and the operations on it.

    dsn: a libpq DSN; None means ``$AOTATTN_PGDEF_DSN``, else the embedded server in ``home``
    (default ``$AOTATTN_PGDEF_HOME`` or ``~/.cache/aotattn/pgdef``), started if needed.
    """

    def __init__(self, dsn: str | None = None, *, home: Path | None = None, max_connections: int = 4):
        resolved = resolve_dsn(dsn)
        if resolved is None:
            from aotattn.pgdef.embedded import embedded_dsn

            resolved = embedded_dsn(home)
        self.dsn = resolved
        self.db = PooledConnector(resolved, "pgdef-client", max_size=max_connections)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.db.close()

    def __repr__(self) -> str:
        return f"Client({redact(self.dsn)!r})"

    # -- schema -----------------------------------------------------------------------------
    def init(self) -> list[int]:
        """Create or upgrade the pgdef schema; returns the migration versions applied now."""
        return schema.migrate(self.dsn)

    # -- dispatch ---------------------------------------------------------------------------
    def dispatch(self, category: str | Category, pool: str, tasks: Iterable[dict[str, Any] | TaskSpec], *,
                 app: str | App | None = None, max_attempts: int | None = None) -> DispatchReport:
        """Queue tasks of one category for one pool, in bulk and idempotently.

        tasks: payload dicts or :class:`TaskSpec` (payload, key, priority, max_attempts). A
            task whose key (default: hash of its payload) exists in the category is skipped.
        app: when given, the category must be one of its kinds, whose validator checks every
            payload here (a :class:`PayloadError` names the task) and whose max_attempts is
            the default.
        max_attempts: default for tasks that do not set it (else the kind's, else 3).
        """
        category = Category.parse(category)
        check_pool(pool)
        kind = self._kind(app, category)
        default_attempts = max_attempts if max_attempts is not None else (kind.max_attempts if kind else 3)
        columns: dict[str, list[Any]] = {k: [] for k in
                                         ("apps", "subcategories", "pools", "keys", "priorities", "payloads",
                                          "max_attempts")}
        seen: set[str] = set()
        repeated = 0
        for index, task in enumerate(tasks):
            spec = task if isinstance(task, TaskSpec) else TaskSpec(task)
            payload = check_payload(spec.payload, f"task {index} payload")
            if kind is not None and kind.validate is not None:
                kind.validate(payload)
            key = spec.key if spec.key is not None else default_key(payload)
            if not isinstance(key, str) or not key or storable_text(key) != key:
                raise ConfigError(f"task {index} key: expected a non-empty string without NUL characters or "
                                  f"lone surrogates, got {key!r}")
            if key in seen:  # one statement cannot insert a key twice; the first one counts
                repeated += 1
                continue
            seen.add(key)
            attempts = spec.max_attempts if spec.max_attempts is not None else default_attempts
            if not _int32(spec.priority) or not _int32(attempts) or attempts < 1:
                raise ConfigError(f"task {index}: expected integer priority and max_attempts >= 1 (32-bit), "
                                  f"got {spec.priority!r}, {attempts!r}")
            for name, value in zip(columns, (category.app, category.subcategory, pool, key, spec.priority,
                                             jsonb(payload), attempts)):
                columns[name].append(value)
        total = len(columns["keys"])
        sql = QUERIES["dispatch"]

        def work(conn) -> int:  # every chunk or none: run again after a lost connection, it inserts the rest
            with conn.transaction():
                conn.execute(QUERIES["lock_dispatch"], {"lock_class": DISPATCH_LOCK, "category": str(category),
                                                        "pool": pool})
                return sum(len(conn.execute(sql, {name: values[start:start + DISPATCH_CHUNK]
                                                  for name, values in columns.items()}).fetchall())
                           for start in range(0, total, DISPATCH_CHUNK))

        inserted = self.db.run(work) if total else 0
        return DispatchReport(inserted=inserted, existing=total - inserted, repeated=repeated)

    @staticmethod
    def _kind(app: str | App | None, category: Category) -> TaskKind | None:
        if app is None:
            return None
        loaded = load_app(app)
        kind = loaded.kinds.get(str(category))
        if kind is None:
            raise ConfigError(f"application {loaded.name} has no task kind {category}; "
                              f"it has {', '.join(sorted(loaded.kinds)) or 'none'}")
        return kind

    # -- reading ----------------------------------------------------------------------------
    def results(self, category: str | Category | None = None, pool: str | None = None,
                keys: Sequence[str] | None = None) -> list[Result]:
        """Accepted results (one per done task) in task order, optionally only these keys."""
        rows = self.db.execute("results", {**Selection.of(category, pool).params(), "keys": _keys(keys)})
        return [Result.from_row(row) for row in rows]

    def tasks(self, category: str | Category | None = None, pool: str | None = None,
              states: Sequence[str] | None = None, keys: Sequence[str] | None = None) -> list[TaskInfo]:
        """Tasks in any state (``states`` from queued, running, done, failed, cancelled)."""
        if states is not None:
            states = check_list(states, "states")
            if not set(states) <= set(STATES):
                raise ConfigError(f"states: expected some of {STATES}, got {states}")
        rows = self.db.execute("tasks", {**Selection.of(category, pool).params(), "states": states,
                                         "keys": _keys(keys)})
        return [TaskInfo(id=r["id"], category=Category(r["app"], r["subcategory"]), pool=r["pool"],
                         key=r["task_key"], priority=r["priority"], payload=r["payload"], state=r["state"],
                         attempts=r["attempts"], max_attempts=r["max_attempts"], lease_owner=r["lease_owner"],
                         lease_expires_at=r["lease_expires_at"], error=r["error"]) for r in rows]

    def events(self, task_ids: Sequence[int]) -> list[dict[str, Any]]:
        """The recorded events (error, expired, retry, cancel, late_result, released) of tasks."""
        return self.db.execute("events", {"task_ids": check_task_ids(task_ids)})

    def status(self, category: str | Category | None = None, pool: str | None = None, *,
               window_s: float = 300.0, limit: int = 10) -> Status:
        """Progress per category and pool, live workers, expired leases, recent failures and
        open offline batches. Rates (and so ETAs) are over the last ``window_s`` seconds."""
        params = {**Selection.of(category, pool).params(), "window_s": check_seconds(window_s, "window_s"),
                  "limit": limit}
        progress = []
        for row in self.db.execute("status_counts", params):
            span = max(row["recent_span_s"] or 0.0, 1.0)
            rate = row["recent_done"] / span if row["recent_done"] else None
            progress.append(Progress(category=row["category"], pool=row["pool"], queued=row["queued"],
                                     running=row["running"], done=row["done"], failed=row["failed"],
                                     cancelled=row["cancelled"], expired=row["expired"], rate_per_s=rate))
        return Status(progress=progress, workers=self.db.execute("status_workers", params),
                      expired=self.db.execute("status_expired", params),
                      failures=self.db.execute("status_failures", params),
                      batches=self.db.execute("status_batches", params))

    def wait(self, category: str | Category | None = None, pool: str | None = None, *,
             timeout_s: float | None = None, poll_s: float = 1.0) -> Status:
        """Block until no selected task is queued or running; returns the final status.
        Raises TimeoutError after ``timeout_s``. Expired leases are re-queued while waiting."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.requeue_expired()
            status = self.status(category, pool)
            if status.remaining == 0:
                return status
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{status.remaining} tasks still queued or running after {timeout_s} s")
            time.sleep(poll_s)

    # -- changing -----------------------------------------------------------------------------
    def retry(self, category: str | Category | None = None, pool: str | None = None, *,
              task_ids: Sequence[int] | None = None, include_cancelled: bool = False) -> int:
        """Re-queue failed (and with ``include_cancelled``, cancelled) tasks with their attempts
        reset; returns how many."""
        states = ["failed", "cancelled"] if include_cancelled else ["failed"]
        rows = self.db.execute("retry", {**Selection.of(category, pool).params(), "states": states,
                                         "task_ids": check_task_ids(task_ids)})
        return rows[0]["n"]

    def cancel(self, category: str | Category | None = None, pool: str | None = None, *,
               task_ids: Sequence[int] | None = None) -> int:
        """Cancel tasks not yet done (queued, running, failed); returns how many. A running
        task's result, when it comes, is not accepted."""
        rows = self.db.execute("cancel", {**Selection.of(category, pool).params(),
                                          "task_ids": check_task_ids(task_ids)})
        return rows[0]["n"]

    def requeue_expired(self) -> int:
        """Return tasks whose lease has expired to the queue (failed after the last attempt)."""
        return len(self.db.execute("requeue_expired"))

    # -- offline batches ---------------------------------------------------------------------
    def checkout(self, pool: str, categories: Sequence[str | Category], path: Path, *, limit: int = 100,
                 lease_s: float = 86400.0, host: str | None = None, task_ids: Sequence[int] | None = None):
        """Claim up to ``limit`` tasks under one lease of ``lease_s`` into the batch file ``path``
        (see :mod:`aotattn.pgdef.offline`); None when nothing is queued."""
        from aotattn.pgdef.offline import checkout

        return checkout(self.db, pool, categories, Path(path), limit=limit, lease_s=lease_s, host=host,
                        task_ids=task_ids)

    def checkin(self, results: Sequence[Path]):
        """Record the results files of an offline batch (idempotent; see :mod:`aotattn.pgdef.offline`)."""
        from aotattn.pgdef.offline import checkin

        return checkin(self.db, [Path(p) for p in check_list(results, "checkin: results files")])
