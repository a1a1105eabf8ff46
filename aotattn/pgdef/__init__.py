"""pgdef: a distributed execution framework whose only shared state is a PostgreSQL database.

Applications register task kinds (:class:`App`), dispatch tasks (:class:`Client`), and
workers on any number of hosts claim and run them (:class:`Worker`); hosts that cannot
reach the database run checked-out batches offline (:mod:`aotattn.pgdef.offline`).
pgdef knows nothing about its applications. Design: docs/distributed-execution-framework.md.
"""

from aotattn.pgdef.client import Client, DispatchReport, Progress, Status, TaskInfo
from aotattn.pgdef.embedded import EmbeddedServer
from aotattn.pgdef.errors import (BatchError, ConfigError, ConnectionLost, PayloadError, PgdefError, SchemaError,
                                  ServerError)
from aotattn.pgdef.model import Category, Result, Task, TaskContext, TaskSpec
from aotattn.pgdef.offline import Batch, CheckinReport, OfflineReport, run_offline
from aotattn.pgdef.registry import App, TaskKind, load_app
from aotattn.pgdef.worker import Worker, WorkerConfig, WorkerStats, run_worker, spawn_workers

__all__ = [
    "App", "Batch", "BatchError", "Category", "CheckinReport", "Client", "ConfigError", "ConnectionLost",
    "DispatchReport", "EmbeddedServer", "OfflineReport", "PayloadError", "PgdefError", "Progress", "Result",
    "SchemaError", "ServerError", "Status", "Task", "TaskContext", "TaskInfo", "TaskKind", "TaskSpec", "Worker",
    "WorkerConfig", "WorkerStats", "load_app", "run_offline", "run_worker", "spawn_workers",
]
