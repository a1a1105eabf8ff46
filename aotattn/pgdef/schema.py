"""The pgdef schema: versioned migrations in ``migrations/NNNN_name.sql``, applied in order.

Each migration runs once, inside one transaction together with its row in
``pgdef_migration``; concurrent ``migrate`` calls serialise on an advisory lock, so two
workers starting at once against a new database are safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

import psycopg

from aotattn.pgdef.connection import connect, redact
from aotattn.pgdef.errors import SchemaError
from aotattn.pgdef.queries import QUERIES

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# pg_advisory_xact_lock key: "pgdef" in ASCII.
MIGRATION_LOCK = 0x7067646566


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations() -> list[Migration]:
    """The packaged migrations in version order; versions run 1, 2, 3 ... without gaps."""
    found = []
    for entry in resources.files("aotattn.pgdef").joinpath("migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match.group(1)), match.group(2), entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise SchemaError(f"pgdef migrations must be numbered 1..N without gaps, found {versions}")
    return found


LATEST = migrations()[-1].version


def migrate(dsn: str) -> list[int]:
    """Bring the database at ``dsn`` to the latest schema; return the versions applied now.

    Raises :class:`SchemaError` when the database has a version newer than this code.
    """
    with connect(dsn, "pgdef-migrate") as conn:
        try:
            return _migrate(conn)
        except psycopg.Error as exc:
            raise SchemaError(f"migrating {redact(dsn)} failed: {exc}") from exc


def _migrate(conn: psycopg.Connection) -> list[int]:
    applied_now = []
    with conn.transaction():
        conn.execute(QUERIES["lock_migrations"], {"lock_id": MIGRATION_LOCK})
        conn.execute(QUERIES["create_migration_table"])
        applied = {row["version"] for row in conn.execute(QUERIES["applied_migrations"])}
        if applied and max(applied) > LATEST:
            raise SchemaError(f"database schema version {max(applied)} is newer than this pgdef's {LATEST}; "
                              "upgrade aotattn")
        for migration in migrations():
            if migration.version in applied:
                continue
            # A migration file holds several statements: executed without parameters, as one script.
            conn.execute(migration.sql.encode())
            conn.execute(QUERIES["record_migration"], {"version": migration.version, "name": migration.name})
            applied_now.append(migration.version)
    return applied_now


def version(dsn: str) -> int:
    """The schema version of the database at ``dsn`` (0: no pgdef schema)."""
    with connect(dsn, "pgdef-schema") as conn:
        if not conn.execute(QUERIES["schema_present"]).fetchone()["present"]:
            return 0
        return conn.execute(QUERIES["schema_version"]).fetchone()["version"]
