"""pgdef's exceptions: one hierarchy, psycopg errors translated at the boundary."""

from __future__ import annotations


class PgdefError(Exception):
    """Base of every error pgdef raises; the message is one line saying what to do."""


class ConfigError(PgdefError, ValueError):
    """A bad argument or setting: a category, pool, payload, DSN or file that cannot be used."""


class ConnectionLost(PgdefError):
    """The database could not be reached again within the reconnect deadline."""


class SchemaError(PgdefError):
    """The database has no pgdef schema, or a newer one than this code knows."""


class ServerError(PgdefError):
    """The embedded PostgreSQL server could not be found, initialised, started or stopped."""


class BatchError(PgdefError):
    """An offline batch or results file is malformed, or belongs to another database."""


class PayloadError(PgdefError, ValueError):
    """Raised by a handler (or a kind's validator) for a payload it cannot accept.

    The task fails at once, without further attempts: running it again cannot help.
    """
