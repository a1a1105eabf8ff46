"""pgdef tests run against a real PostgreSQL: each test gets a fresh database cloned from a
template that holds the migrated schema.

The server: ``$AOTATTN_PGDEF_TEST_DSN`` (a DSN whose user may create databases), default
``postgresql://postgres@127.0.0.1:5432/postgres``; ``.ci/run`` starts one where none runs.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from aotattn.pgdef import Client, Worker, WorkerConfig, schema
from aotattn.pgdef.connection import with_database

TEST_DSN_ENV = "AOTATTN_PGDEF_TEST_DSN"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
APPS = ["tests.pgdef.apps"]


@pytest.fixture(scope="session")
def admin_dsn() -> str:
    dsn = os.environ.get(TEST_DSN_ENV, DEFAULT_DSN)
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        pytest.fail(f"no PostgreSQL at {dsn} ({exc}); start one or set {TEST_DSN_ENV}", pytrace=False)
    return dsn


def _drop(admin: psycopg.Connection, name: str) -> None:
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def template(admin_dsn: str) -> Iterator[str]:
    """A database with the pgdef schema, cloned by every test (one per xdist process)."""
    name = f"pgdef_tpl_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{os.getpid()}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        _drop(admin, name)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    schema.migrate(with_database(admin_dsn, name))
    yield name
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        _drop(admin, name)


@pytest.fixture
def dsn(admin_dsn: str, template: str) -> Iterator[str]:
    """A fresh database with the current schema, dropped after the test."""
    name = f"pgdef_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                       sql.Identifier(template)))
    yield with_database(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        _drop(admin, name)


@pytest.fixture
def client(dsn: str) -> Iterator[Client]:
    with Client(dsn) as c:
        yield c


FAST = dict(lease_s=10.0, heartbeat_s=0.5, poll_s=0.05, exit_when_idle=True)


def fast_config(**overrides) -> WorkerConfig:
    """Quick polls; fault tests pass shorter leases (a lease long enough that a loaded CI
    machine never lets one expire where a test does not mean it to)."""
    return WorkerConfig(**{**FAST, **overrides})


def run_workers(dsn: str, n: int = 1, apps=APPS, timeout_s: float = 60.0, **config) -> list[Worker]:
    """Run ``n`` workers in threads until they are idle; fail the test if they hang."""
    workers = [Worker(dsn, apps, fast_config(**config)) for _ in range(n)]
    errors: list[BaseException] = []

    def target(w: Worker) -> None:
        try:
            w.run()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        for w in workers:
            w.stop()
        pytest.fail(f"workers still running after {timeout_s} s")
    if errors:
        raise errors[0]
    return workers


def count_results(dsn: str) -> dict[int, int]:
    """Result rows per task id, read straight from the table."""
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("SELECT task_id, count(*) FROM pgdef_result GROUP BY task_id").fetchall())
