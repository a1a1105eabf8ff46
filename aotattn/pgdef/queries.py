"""The named SQL queries of ``queries.sql``, loaded once into :data:`QUERIES`."""

from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$")


def parse(text: str) -> dict[str, str]:
    """Split a named-queries file into ``{name: sql}``.

    A line ``-- name: NAME`` starts a query; the comment lines right after it are its
    description (dropped); the query runs to the next ``-- name:`` line. Duplicate names
    and empty queries are errors.
    """
    queries: dict[str, str] = {}
    name: str | None = None
    body: list[str] = []

    def close() -> None:
        if name is None:
            return
        sql = "\n".join(body).strip()
        if not sql:
            raise ValueError(f"query {name!r} is empty")
        queries[name] = sql

    for line in text.splitlines():
        match = _NAME.match(line)
        if match:
            close()
            name, body = match.group(1), []
            if name in queries:
                raise ValueError(f"query {name!r} is defined twice")
        elif name is not None and (body or not line.startswith("--")):
            body.append(line)
    close()
    return queries


def _load() -> dict[str, str]:
    return parse(resources.files("aotattn.pgdef").joinpath("queries.sql").read_text(encoding="utf-8"))


QUERIES: dict[str, str] = _load()
