"""Schema migrations and the named-queries file."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest

from aotattn.pgdef import Client, PgdefError, SchemaError, schema
from aotattn.pgdef.queries import QUERIES, parse

PACKAGE = Path(__file__).resolve().parents[2] / "aotattn" / "pgdef"


def test_migrate_is_idempotent_and_reports_the_version(dsn):
    assert schema.version(dsn) == schema.LATEST
    assert schema.migrate(dsn) == []  # the template already had it
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT version FROM pgdef_migration ORDER BY version").fetchall()
    assert [r[0] for r in rows] == list(range(1, schema.LATEST + 1))


def test_migrate_an_empty_database_and_refuse_a_newer_one(admin_dsn, dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE pgdef_event, pgdef_batch, pgdef_worker, pgdef_result, pgdef_task, pgdef_migration")
        conn.execute("DROP FUNCTION pgdef_selected")
    assert schema.version(dsn) == 0
    with pytest.raises(SchemaError, match="aotattn pgdef init"):
        Client(dsn).status()
    assert schema.migrate(dsn) == list(range(1, schema.LATEST + 1))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO pgdef_migration (version, name) VALUES (%s, 'future')", (schema.LATEST + 1,))
    with pytest.raises(SchemaError, match="newer"):
        schema.migrate(dsn)


def test_every_client_and_worker_refuses_a_newer_schema(dsn, tmp_path):
    """Only init refused it: an older release's dispatch queued tasks into the newer schema and
    its workers ran them."""
    from aotattn.pgdef import Worker, WorkerConfig

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO pgdef_migration (version, name) VALUES (%s, 'future')", (schema.LATEST + 1,))
    calls = [lambda c: c.dispatch("toy,square", "cpu", [{"x": 1}]), lambda c: c.status(),
             lambda c: c.results(), lambda c: c.cancel("toy,square"),
             lambda c: c.checkout("cpu", ["toy,square"], tmp_path / "batch.json")]
    for call in calls:
        with Client(dsn) as client, pytest.raises(SchemaError, match=f"version {schema.LATEST + 1} is newer"):
            call(client)
    with pytest.raises(SchemaError, match="newer"):
        Worker(dsn, ["aotattn.pgdef.toy"], WorkerConfig(exit_when_idle=True)).run()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pgdef_task").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM pgdef_worker").fetchone()[0] == 0
    assert not (tmp_path / "batch.json").exists()


def test_query_file_parses_into_named_statements():
    parsed = parse("-- header\n-- name: one\n-- says what\nSELECT 1\n\n-- name: two\nSELECT %(x)s\n-- inner\n")
    assert parsed == {"one": "SELECT 1", "two": "SELECT %(x)s\n-- inner"}
    with pytest.raises(ValueError, match="twice"):
        parse("-- name: a\nSELECT 1\n-- name: a\nSELECT 2\n")
    with pytest.raises(ValueError, match="empty"):
        parse("-- name: a\n-- only a comment\n-- name: b\nSELECT 1\n")


def test_every_named_query_is_used_and_every_use_exists():
    """The declaration (queries.sql) checked against its users, both ways."""
    source = "\n".join(p.read_text() for p in PACKAGE.glob("*.py"))
    used = set(re.findall(r'QUERIES\["([a-z_]+)"\]', source)) | set(re.findall(r'execute\("([a-z_]+)"', source))
    assert used - set(QUERIES) == set()
    assert set(QUERIES) - used == set()


def test_database_errors_are_translated(client):
    with pytest.raises(PgdefError, match="database error"):
        client.db.execute("dispatch", {"apps": ["BAD"], "subcategories": [""], "pools": ["cpu"], "keys": ["k"],
                                       "priorities": [0], "payloads": [None], "max_attempts": [1]})
