"""Connections to the pgdef database: DSN resolution, TCP keepalives, reconnection with backoff.

Every connection pgdef opens goes through :func:`connect`, so every one has TCP keepalives
(a peer that vanished is noticed within about 25 s instead of the kernel's two hours) and
a connect timeout. :class:`Connector` wraps one connection for a long-lived process (a
worker, its heartbeat, a dispatcher): it runs named queries and, when the connection is
lost, reconnects with exponential backoff and runs the statement once more on the new
connection. Every statement in ``queries.sql`` may be run twice that way: each is one
atomic statement and either idempotent (dispatch, complete, fail, release, retry, cancel,
renew) or harmless when repeated (a claim whose reply was lost leaves a task under a
lease nobody renews, so it expires and returns to the queue).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from aotattn.pgdef.env import DSN_ENV
from aotattn.pgdef.errors import ConfigError, ConnectionLost, PgdefError, SchemaError
from aotattn.pgdef.queries import QUERIES

log = logging.getLogger("aotattn.pgdef")
# psycopg_pool warns on every failed connection attempt; without a handler Python's last resort
# printed them to stderr, ten lines before a CLI's one-line error (where logging is configured,
# they still reach its handlers)
logging.getLogger("psycopg.pool").addHandler(logging.NullHandler())

# libpq settings on every connection. Keepalive probes after 10 s idle, every 5 s, 3 lost
# probes: a dead peer is detected in about 25 s. tcp_user_timeout bounds unacknowledged sends.
CONNECT_OPTIONS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30000,
    "connect_timeout": 10,
}

T = TypeVar("T")

dumps = partial(json.dumps, allow_nan=False, separators=(",", ":"))


def jsonb(value: Any) -> Jsonb:
    """``value`` as a jsonb parameter; NaN and infinities are refused (JSON has none)."""
    return Jsonb(value, dumps=dumps)


def redact(dsn: str) -> str:
    """The DSN without its password, for messages."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    params.pop("password", None)
    return make_conninfo(**params)


def with_database(dsn: str, dbname: str) -> str:
    """The same server and credentials as ``dsn``, another database."""
    return make_conninfo(dsn, dbname=dbname)


def resolve_dsn(dsn: str | None) -> str | None:
    """The DSN to use: the argument, else ``$AOTATTN_PGDEF_DSN``, else None (embedded server)."""
    dsn = dsn or os.environ.get(DSN_ENV) or None
    if dsn is not None:
        try:
            conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as exc:
            raise ConfigError(f"invalid DSN {dsn!r}: {exc}; expected e.g. "
                              "postgresql://user@host:5432/dbname") from exc
    return dsn


# SQLSTATEs that mean the session is gone: class 08 (connection exception), administrator or
# crash shutdown, and "cannot connect now" while the server starts or stops.
_LOST_STATES = ("57P01", "57P02", "57P03")


# SQLSTATE class 40: the server rolled the transaction back (deadlock, serialization
# failure); the connection is fine and the same work may simply run again. psycopg's
# classes for them do not share a base below OperationalError.
_ROLLED_BACK = (psycopg.errors.TransactionRollback, psycopg.errors.SerializationFailure,
                psycopg.errors.DeadlockDetected)


def is_connection_error(exc: BaseException) -> bool:
    """True when ``exc`` means the connection is gone (not that the statement was wrong)."""
    if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return False
    state = getattr(exc, "sqlstate", None)
    return state is None or state.startswith("08") or state in _LOST_STATES


def refuses_data(exc: BaseException) -> bool:
    """True when the database refused a statement for the values it was given (SQLSTATE class
    22, data exception; 54, program limit: a jsonb too large or too deep), so sending the same
    values again fails again; not for a lock or statement timeout, a full disk and the like."""
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    state = getattr(cause, "sqlstate", None) or ""
    return state[:2] in ("22", "54")


def connect(dsn: str, application_name: str = "pgdef") -> psycopg.Connection:
    """Open an autocommit connection with keepalives whose rows are dicts.

    Raises :class:`ConnectionLost` (with the server named, password removed) on failure.
    """
    try:
        return psycopg.connect(dsn, autocommit=True, row_factory=dict_row,
                               application_name=application_name[:63], **CONNECT_OPTIONS)
    except psycopg.Error as exc:
        raise ConnectionLost(f"cannot connect to {redact(dsn)}: {_first_line(exc)}; "
                             f"check that the server runs and the DSN (--dsn or ${DSN_ENV}) is right") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# libpq's words for a server that is not up, or not yet: worth waiting for (other failures,
# a missing database or role, a bad password or option, are not)
_NOT_UP = ("connection refused", "timeout expired", "starting up", "shutting down", "no such file or directory",
           "in recovery mode")


def _may_come_up(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(words in text for words in _NOT_UP)


class Runner:
    """Runs work on a connection, once more on a fresh one when the connection is lost.

    Subclasses say how a connection is acquired (:meth:`_call`) and what to do after a loss
    (:meth:`_recover`). psycopg errors are translated here: a lost connection (twice) to
    :class:`ConnectionLost`, a missing schema to :class:`SchemaError`, anything else to
    :class:`PgdefError`.
    """

    dsn: str

    def _call(self, work: Callable[[psycopg.Connection], T]) -> T:
        raise NotImplementedError

    def _recover(self) -> None:
        raise NotImplementedError

    def run(self, work: Callable[[psycopg.Connection], T]) -> T:
        """``work(conn)``; if the connection is lost, recover and run it once more."""
        if not self.schema_checked:
            self._check_schema()
        for attempt in (0, 1):
            try:
                return self._call(work)
            except _ROLLED_BACK as exc:
                # A deadlock (two dispatchers inserting the same keys in other orders, a cancel
                # crossing a check-in) or a serialization failure rolled the work back on a
                # connection still usable: run it once more, as after a lost connection.
                if attempt == 1:
                    raise PgdefError(f"database error: {_first_line(exc)} (twice); run the command again") from exc
                log.warning("%s; running it again", _first_line(exc))
            except (psycopg.OperationalError, psycopg.InterfaceError, ConnectionLost) as exc:
                if not isinstance(exc, ConnectionLost) and not is_connection_error(exc):
                    raise PgdefError(f"database error: {_first_line(exc)}") from exc
                if attempt == 1:
                    raise ConnectionLost(f"connection to {redact(self.dsn)} lost twice: {_first_line(exc)}") from exc
                if not self._worth_waiting_for(exc):
                    raise
                log.warning("connection lost (%s); reconnecting", _first_line(exc))
                self._recover()
            except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction) as exc:
                raise SchemaError(f"no pgdef schema in {redact(self.dsn)} ({_first_line(exc)}); "
                                  "run `aotattn pgdef init` with the same DSN") from exc
            except psycopg.Error as exc:
                raise PgdefError(f"database error: {_first_line(exc)}") from exc
        raise AssertionError("unreachable")

    def _worth_waiting_for(self, exc: BaseException) -> bool:
        """Whether to recover from this loss rather than report it."""
        return True

    schema_checked = False

    def _check_schema(self) -> None:
        """A schema newer than this code's is refused before the first work (only ``init``
        refused it, and an older release's dispatch and workers wrote into it)."""
        from aotattn.pgdef.schema import LATEST

        self.schema_checked = True  # the check's own run
        try:
            version = self.run(lambda conn: conn.execute(QUERIES["schema_version"]).fetchone()["version"])
        except BaseException:
            self.schema_checked = False
            raise
        if version > LATEST:
            self.schema_checked = False
            raise SchemaError(f"database schema version {version} is newer than this pgdef's {LATEST}; "
                              "upgrade aotattn")

    def execute(self, name: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Run the named query with ``params`` and return its rows (empty when it returns none)."""
        sql = QUERIES[name]

        def work(conn: psycopg.Connection) -> list[dict[str, Any]]:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []

        return self.run(work)


class Connector(Runner):
    """One database connection for a long-lived component, re-established when lost.

    After a loss it reconnects with exponential backoff (from ``backoff_s`` doubling to
    ``max_backoff_s``, with jitter) for at most ``reconnect_timeout_s``; ``stop`` (an event)
    ends the wait early. Not thread-safe: one Connector per thread.
    """

    def __init__(self, dsn: str, application_name: str = "pgdef", *, reconnect_timeout_s: float = 300.0,
                 backoff_s: float = 0.05, max_backoff_s: float = 5.0, stop: threading.Event | None = None):
        self.dsn = dsn
        self.application_name = application_name
        self.reconnect_timeout_s = reconnect_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stop = stop or threading.Event()
        self._conn: psycopg.Connection | None = None
        self.reconnects = 0
        self.connected = False  # once: a later refusal may be a restart, the first is the DSN

    @property
    def conn(self) -> psycopg.Connection:
        """The live connection, opened on first use."""
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.dsn, self.application_name)
            self.connected = True
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _call(self, work: Callable[[psycopg.Connection], T]) -> T:
        return work(self.conn)

    def _recover(self) -> None:
        self.reconnect()

    def _worth_waiting_for(self, exc: BaseException) -> bool:
        """Not where this connector never connected and a server that answers refuses (no such
        database or role, a bad password): the DSN is wrong and no wait mends it (a worker
        given one waited its 300 s of reconnect timeout)."""
        return self.connected or _may_come_up(exc)

    def reconnect(self) -> None:
        """Drop the connection and open a new one, backing off while the server is away."""
        self.close()
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay = self.backoff_s
        while True:
            try:
                self._conn = connect(self.dsn, self.application_name)
                self.reconnects += 1
                self.connected = True
                return
            except ConnectionLost as exc:
                if not self._worth_waiting_for(exc):
                    raise
                if time.monotonic() + delay > deadline:
                    raise ConnectionLost(f"gave up reconnecting after {self.reconnect_timeout_s:.0f} s: {exc}") from exc
                log.info("database unreachable (%s); retrying in %.2f s", _first_line(exc), delay)
                if self.stop.wait(delay * random.uniform(0.5, 1.0)):
                    raise ConnectionLost("stopped while reconnecting") from exc
                delay = min(delay * 2, self.max_backoff_s)


class PooledConnector(Runner):
    """A psycopg_pool ConnectionPool (for the thread-safe :class:`~aotattn.pgdef.client.Client`).

    The pool checks each connection before lending it and reopens lost ones in the
    background with its own backoff; a statement whose connection was lost runs once more
    on another.
    """

    def __init__(self, dsn: str, application_name: str = "pgdef-client", *, max_size: int = 4,
                 timeout_s: float = 60.0):
        from psycopg_pool import ConnectionPool

        self.dsn = dsn
        kwargs = {"autocommit": True, "row_factory": dict_row, "application_name": application_name[:63],
                  **CONNECT_OPTIONS}
        # One connection first, for its error: a server that answers and refuses (no such
        # database or role, bad password) is not waited for, and the pool's own error would
        # only say that it gave up.
        cause = None
        try:
            psycopg.connect(dsn, **kwargs).close()
        except psycopg.Error as exc:
            if not _may_come_up(exc):
                raise ConnectionLost(f"cannot connect to {redact(dsn)}: {_first_line(exc)}; check the DSN "
                                     f"(--dsn or ${DSN_ENV})") from exc
            cause = exc  # not up (yet): wait for it below, as the pool does
        self.pool = ConnectionPool(dsn, min_size=1, max_size=max_size, kwargs=kwargs, timeout=timeout_s,
                                   reconnect_timeout=timeout_s, check=ConnectionPool.check_connection,
                                   open=False, name=application_name)
        try:
            self.pool.open(wait=True, timeout=min(timeout_s, CONNECT_OPTIONS["connect_timeout"] * 2))
        except psycopg.Error as exc:
            self.pool.close()
            raise ConnectionLost(f"cannot connect to {redact(dsn)}: {_first_line(cause or exc)}; "
                                 f"check that the server runs and the DSN (--dsn or ${DSN_ENV}) is right") from exc

    def _call(self, work: Callable[[psycopg.Connection], T]) -> T:
        with self.pool.connection() as conn:
            return work(conn)

    def _recover(self) -> None:
        self.pool.check()

    def close(self) -> None:
        self.pool.close()
