"""What pgdef moves around: categories, selections, tasks, results and handler outcomes."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from aotattn.pgdef.errors import ConfigError

_APP = re.compile(r"^[a-z][a-z0-9_.-]*$")
_SUB = re.compile(r"^[a-z0-9_.-]+$")
_POOL = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True, order=True)
class Category:
    """``app[,subcategory]``: the application a task belongs to and, within it, its kind.

    ``app`` is lower case (``[a-z][a-z0-9_.-]*``); ``subcategory`` is empty or
    ``[a-z0-9_.-]+``. ``str(category)`` is the ``app,sub`` form the CLI takes.
    """

    app: str
    subcategory: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.app, str) or not _APP.match(self.app):
            raise ConfigError(f"category app: expected lower-case [a-z][a-z0-9_.-]*, got {self.app!r}")
        if not isinstance(self.subcategory, str) or (self.subcategory and not _SUB.match(self.subcategory)):
            raise ConfigError(f"subcategory: expected [a-z0-9_.-]+ or empty, got {self.subcategory!r}")

    @classmethod
    def parse(cls, text: str | Category) -> Category:
        """``"tune"`` or ``"tune,attn_fwd"`` (the CLI's ``--category``) as a Category."""
        if isinstance(text, Category):
            return text
        if not isinstance(text, str):
            raise ConfigError(f"category: expected 'app[,subcategory]', got {text!r}")
        app, _, sub = text.strip().partition(",")
        return cls(app, sub)

    def __str__(self) -> str:
        return f"{self.app},{self.subcategory}" if self.subcategory else self.app


# Durations a lease, heartbeat or status window may take: past this PostgreSQL's intervals
# and timestamps overflow ("interval out of range"), and no task waits ten years.
MAX_SECONDS = 10 * 365 * 86400.0
MAX_TASK_ID = 2**63 - 1  # pgdef_task.id is a bigint


def check_seconds(value: float, name: str, zero: bool = False) -> float:
    """A duration in seconds, above 0 (or, with ``zero``, at least 0) and at most MAX_SECONDS
    (NaN and infinity refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value if zero else 0 < value) or not value <= MAX_SECONDS:
        raise ConfigError(f"{name}: expected seconds {'from 0' if zero else 'above 0'} and at most "
                          f"{MAX_SECONDS:.0f} (ten years), got {value!r}")
    return float(value)


def check_list(values: Any, name: str) -> list[Any]:
    """A list of values from any iterable but a bare string, bytes or mapping (a key, pool or
    path given where a list of them is expected would otherwise be split into characters)."""
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
        raise ConfigError(f"{name}: expected a list, got {values!r}; wrap a single one: [{values!r}]")
    return list(values)


def check_task_ids(task_ids: Any) -> list[int] | None:
    """Task ids as a list (None: every task), each a positive bigint."""
    if task_ids is None:
        return None
    ids = check_list(task_ids, "task ids")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= MAX_TASK_ID]
    if bad:
        raise ConfigError(f"task ids: expected integers from 1 to {MAX_TASK_ID}, got {bad[0]!r}")
    return ids


def check_pool(pool: str) -> str:
    """A pool name (``sm_90``, ``cpu``, ``gfx942``): letters, digits and ``_.-``."""
    if not isinstance(pool, str) or not _POOL.match(pool):
        raise ConfigError(f"pool: expected a name like sm_90 or cpu ([A-Za-z0-9_.-]+), got {pool!r}")
    return pool


@dataclass(frozen=True)
class Selection:
    """Which tasks a command acts on: ``category`` ``app`` (all its subcategories) or
    ``app,sub`` (exactly that), and ``pool``; None selects everything."""

    category: Category | None = None
    whole_app: bool = True
    pool: str | None = None

    @classmethod
    def of(cls, category: str | Category | None = None, pool: str | None = None) -> Selection:
        if pool is not None:
            check_pool(pool)
        if category is None:
            return cls(None, True, pool)
        parsed = Category.parse(category)
        return cls(parsed, not parsed.subcategory, pool)

    def params(self) -> dict[str, Any]:
        """The ``app``, ``subcategory``, ``pool`` parameters of the queries that select."""
        return {
            "app": self.category.app if self.category else None,
            "subcategory": None if self.category is None or self.whole_app else self.category.subcategory,
            "pool": self.pool,
        }


def check_payload(payload: Any, where: str = "payload") -> dict[str, Any]:
    """A payload is a JSON object the database can store (:func:`storable_json`)."""
    if not isinstance(payload, dict):
        raise ConfigError(f"{where}: expected a JSON object (dict), got {type(payload).__name__}")
    try:
        storable_json(payload)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: not representable as JSON ({exc})") from exc
    return payload


def canonical_json(value: Any) -> str:
    """Sorted keys, no spaces, no NaN: equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def storable_json(value: Any) -> str:
    """:func:`canonical_json` of a value PostgreSQL's ``jsonb`` also takes: ValueError for a
    string (or key) holding a NUL character or a lone surrogate, which JSON text can carry
    as an escape and ``jsonb`` refuses."""
    try:
        text = canonical_json(value)
        if "\\u0000" in text or "\\ud" in text:  # escapes json.dumps writes for both; rare otherwise, then walked
            _check_strings(value)
    except RecursionError:  # a handler's output or a payload nested past the encoder's depth
        raise ValueError("nested deeper than JSON encoding goes here (about 1000 levels)") from None
    return text


def _check_strings(value: Any) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"a NUL character in string {storable_text(value)[:60]!r}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"a lone surrogate in string {storable_text(value)[:60]!r}") from exc
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_strings(item)


def storable_text(text: str) -> str:
    """``text`` with what a PostgreSQL text column refuses written as escapes: NUL as ``\\x00``,
    lone surrogates as ``\\udXXX`` (for error messages, which must reach the database)."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def default_key(payload: dict[str, Any]) -> str:
    """The task key when the dispatcher gives none: a hash of the payload, so dispatching the
    same payload twice to one category and pool makes one task."""
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class TaskSpec:
    """A task to dispatch. ``key`` (default: hash of the payload) makes dispatch idempotent;
    higher ``priority`` runs first; ``max_attempts`` defaults to the kind's (else 3)."""

    payload: dict[str, Any]
    key: str | None = None
    priority: int = 0
    max_attempts: int | None = None


@dataclass(frozen=True)
class Task:
    """A claimed task as a handler's runner sees it."""

    id: int
    category: Category
    pool: str
    key: str
    priority: int
    payload: dict[str, Any]
    attempt: int
    max_attempts: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Task:
        return cls(id=row["id"], category=Category(row["app"], row["subcategory"]), pool=row["pool"],
                   key=row["task_key"], priority=row["priority"], payload=row["payload"],
                   attempt=row["attempts"], max_attempts=row["max_attempts"])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "category": str(self.category), "pool": self.pool, "key": self.key,
                "priority": self.priority, "payload": self.payload, "attempt": self.attempt,
                "max_attempts": self.max_attempts}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Task:
        return cls(id=int(obj["id"]), category=Category.parse(obj["category"]), pool=check_pool(obj["pool"]),
                   key=str(obj["key"]), priority=int(obj["priority"]), payload=check_payload(obj["payload"]),
                   attempt=int(obj["attempt"]), max_attempts=int(obj["max_attempts"]))


@dataclass(frozen=True)
class Result:
    """An accepted result: the task it answers and what its handler returned."""

    task_id: int
    category: Category
    pool: str
    key: str
    payload: dict[str, Any]
    output: Any
    worker_id: str
    attempt: int
    elapsed_s: float
    created_at: datetime

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Result:
        return cls(task_id=row["id"], category=Category(row["app"], row["subcategory"]), pool=row["pool"],
                   key=row["task_key"], payload=row["payload"], output=row["output"], worker_id=row["worker_id"],
                   attempt=row["attempt"], elapsed_s=row["elapsed_s"], created_at=row["created_at"])


@dataclass(frozen=True)
class TaskContext:
    """What a handler knows about the run besides the payload."""

    task: Task
    worker_id: str
    gpu: int | None = None


@dataclass(frozen=True)
class Outcome:
    """One attempt's end: an output (ok) or an error text; ``permanent`` errors are not retried."""

    task_id: int
    attempt: int
    ok: bool
    output: Any = None
    error: str | None = None
    permanent: bool = False
    elapsed_s: float = 0.0
    worker_id: str | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.elapsed_s):
            raise ValueError(f"elapsed_s: expected a finite number, got {self.elapsed_s}")
