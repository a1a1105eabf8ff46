"""pgdef: a distributed execution framework whose only shared state is a PostgreSQL database.

Applications register task kinds (:class:`App`), dispatch tasks (:class:`Client`), and
workers on any number of hosts claim and run them (:class:`Worker`); hosts that cannot
reach the database run checked-out batches offline (:func:`run_offline`). pgdef knows
nothing about its applications. Design: docs/distributed-execution-framework.md.

The names that talk to the database (Client, Worker, ...) are imported on first use, so
that the offline runner works on a host without psycopg.
"""

from aotattn.pgdef.embedded import EmbeddedServer
from aotattn.pgdef.errors import (BatchError, ConfigError, ConnectionLost, PayloadError, PgdefError, SchemaError,
                                  ServerError)
from aotattn.pgdef.model import Category, Result, Task, TaskContext, TaskSpec
from aotattn.pgdef.offline import Batch, CheckinReport, OfflineReport, run_offline
from aotattn.pgdef.registry import App, TaskKind, load_app

_DATABASE_NAMES = {
    "aotattn.pgdef.client": ("Client", "DispatchReport", "Progress", "Status", "TaskInfo"),
    "aotattn.pgdef.worker": ("Worker", "WorkerConfig", "WorkerStats", "run_worker", "spawn_workers", "wait_workers"),
}


def __getattr__(name: str):
    import importlib

    for module, names in _DATABASE_NAMES.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'aotattn.pgdef' has no attribute {name!r}")


__all__ = [
    "App", "Batch", "BatchError", "Category", "CheckinReport", "Client", "ConfigError", "ConnectionLost",
    "DispatchReport", "EmbeddedServer", "OfflineReport", "PayloadError", "PgdefError", "Progress", "Result",
    "SchemaError", "ServerError", "Status", "Task", "TaskContext", "TaskInfo", "TaskKind", "TaskSpec", "Worker",
    "WorkerConfig", "WorkerStats", "load_app", "run_offline", "run_worker", "spawn_workers", "wait_workers",
]
