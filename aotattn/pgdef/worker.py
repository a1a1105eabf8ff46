"""Workers: claim tasks of one pool, run their handlers, write results; a heartbeat keeps leases.

A :class:`Worker` is one process's (or thread's) loop::

    register -> [requeue expired leases] -> claim -> run handler -> complete | fail -> claim ...

It holds two connections: one for claims and results, one for its heartbeat thread, which
every ``heartbeat_s`` marks the worker alive and extends the leases of the tasks it holds
(by id). If the process dies, the heartbeat stops, the leases run out after ``lease_s``,
and any worker's next expired-lease pass puts the tasks back in the queue. A lost
connection is re-established with backoff; the statement that met the loss runs once more
on the new connection, so a finished handler's result is not lost to a dropped
connection or a restarted server.

GPU kinds run in workers that own one GPU each (:func:`spawn_workers` starts one process
per GPU with ``CUDA_VISIBLE_DEVICES`` set); CPU kinds run in CPU workers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from aotattn.pgdef.connection import Connector, jsonb, refuses_data
from aotattn.pgdef.errors import ConfigError, ConnectionLost, PgdefError
from aotattn.pgdef.model import Outcome, Task, TaskContext, check_pool, check_seconds, storable_text
from aotattn.pgdef.registry import App, TaskKind, kinds_of, run_attempt

log = logging.getLogger("aotattn.pgdef.worker")


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker claims and keeps tasks.

    lease_s: a claimed task returns to the queue this long after the worker's last heartbeat.
    heartbeat_s: how often leases are renewed (default lease_s / 4).
    poll_s: the pause when nothing is queued (jittered, so idle workers do not poll in step).
    claim_batch: tasks claimed per round trip (more: fewer round trips for tiny tasks; the
        unstarted ones are released when the worker stops).
    max_tasks: stop after this many attempts (None: no limit).
    exit_when_idle: stop when no task of the worker's categories and pool is queued or running on a
        worker (tasks checked out in an offline batch come back by checkin, not to it).
    reconnect_timeout_s: give up (ConnectionLost) after the database has been away this long.
    """

    pool: str = "cpu"
    gpu: int | None = None
    lease_s: float = 60.0
    heartbeat_s: float | None = None
    poll_s: float = 1.0
    claim_batch: int = 1
    max_tasks: int | None = None
    exit_when_idle: bool = False
    reconnect_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        check_pool(self.pool)
        check_seconds(self.lease_s, "lease_s")
        if self.heartbeat_s is not None and not 0 < self.heartbeat_s < self.lease_s:
            raise ConfigError(f"heartbeat_s: expected between 0 and lease_s={self.lease_s}, got {self.heartbeat_s}")
        check_seconds(self.poll_s, "poll_s", zero=True)
        check_seconds(self.reconnect_timeout_s, "reconnect_timeout_s")
        if not isinstance(self.claim_batch, int) or self.claim_batch < 1:
            raise ConfigError(f"claim_batch: expected an integer >= 1, got {self.claim_batch!r}")
        if self.max_tasks is not None and (isinstance(self.max_tasks, bool) or not isinstance(self.max_tasks, int)
                                           or self.max_tasks < 1):
            raise ConfigError(f"max_tasks: expected an integer >= 1 (or none for no limit), got {self.max_tasks!r}")
        if self.gpu is not None and (not isinstance(self.gpu, int) or self.gpu < 0):
            raise ConfigError(f"gpu: expected a GPU index >= 0, got {self.gpu!r}")

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 4


@dataclass
class WorkerStats:
    """What one worker did: attempts that ended in an accepted result, in a result another
    attempt had already given (late), in an error, or that were lost to the connection."""

    done: int = 0
    late: int = 0
    errors: int = 0
    lost: int = 0
    requeued: int = 0

    @property
    def attempts(self) -> int:
        return self.done + self.late + self.errors + self.lost


def new_worker_id(gpu: int | None = None) -> str:
    host = socket.gethostname().split(".")[0][:24]
    suffix = f"-gpu{gpu}" if gpu is not None else ""
    return f"{host}-{os.getpid()}{suffix}-{uuid.uuid4().hex[:6]}"


class Worker:
    """Runs tasks of ``apps`` from ``dsn`` until stopped (see the module docstring)."""

    def __init__(self, dsn: str, apps: Iterable[str | App], config: WorkerConfig | None = None,
                 worker_id: str | None = None):
        self.dsn = dsn
        self.config = config or WorkerConfig()
        device = "gpu" if self.config.gpu is not None else "cpu"
        self.kinds: dict[str, TaskKind] = {name: kind for name, kind in kinds_of(apps).items() if kind.device == device}
        if not self.kinds:
            raise ConfigError(f"the applications given have no {device} task kinds for this worker; "
                              f"{'pass --gpu for GPU kinds' if device == 'cpu' else 'CPU kinds run without --gpu'}")
        self.id = worker_id or new_worker_id(self.config.gpu)
        self.stats = WorkerStats()
        self._stop = threading.Event()
        self._held: set[int] = set()
        self._held_lock = threading.Lock()
        self.db = Connector(dsn, f"pgdef-worker:{self.id}", reconnect_timeout_s=self.config.reconnect_timeout_s,
                            stop=self._stop)

    @property
    def categories(self) -> list[str]:
        return sorted(self.kinds)

    def stop(self) -> None:
        """Ask the worker to stop after the attempt in progress (safe from signal handlers)."""
        self._stop.set()

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> WorkerStats:
        """Work until stopped, idle (``exit_when_idle``) or ``max_tasks``; returns the stats."""
        cfg = self.config
        self.db.execute("register_worker", {
            "worker_id": self.id, "host": socket.gethostname(), "pid": os.getpid(), "pool": cfg.pool,
            "categories": self.categories, "gpu": cfg.gpu, "lease_s": cfg.lease_s})
        heartbeat = threading.Thread(target=self._heartbeat, name=f"pgdef-heartbeat-{self.id}", daemon=True)
        heartbeat.start()
        queue: list[Task] = []
        next_reap = 0.0
        try:
            while not self._stop.is_set():
                if cfg.max_tasks is not None and self.stats.attempts >= cfg.max_tasks:
                    break
                if time.monotonic() >= next_reap:
                    self.stats.requeued += len(self.db.execute("requeue_expired"))
                    next_reap = time.monotonic() + cfg.heartbeat_interval
                if not queue:
                    queue = self._claim()
                if not queue:
                    if cfg.exit_when_idle and not self._anything_open():
                        break
                    self._stop.wait(cfg.poll_s * random.uniform(0.5, 1.0))
                    continue
                task = queue.pop(0)
                self._report(task, self._attempt(task))
        finally:
            self._stop.set()
            heartbeat.join(timeout=5)
            self._shutdown(queue)
        return self.stats

    def _claim(self) -> list[Task]:
        rows = self.db.execute("claim", {"pool": self.config.pool, "categories": self.categories, "task_ids": None,
                                         "limit": self.config.claim_batch, "owner": self.id,
                                         "lease_s": self.config.lease_s})
        tasks = sorted((Task.from_row(row) for row in rows), key=lambda t: (-t.priority, t.id))
        with self._held_lock:
            self._held.update(t.id for t in tasks)
        return tasks

    def _anything_open(self) -> bool:
        rows = self.db.execute("open_count", {"pool": self.config.pool, "categories": self.categories})
        return rows[0]["n"] > 0

    def _attempt(self, task: Task) -> Outcome:
        ctx = TaskContext(task=task, worker_id=self.id, gpu=self.config.gpu)
        return run_attempt(self.kinds[str(task.category)], task, ctx)

    def _report(self, task: Task, outcome: Outcome) -> None:
        """Write the attempt's end. A connection lost here is retried once on a new connection;
        if that fails too the outcome is dropped and the task comes back when its lease expires."""
        try:
            if outcome.ok:
                try:
                    accepted = self.db.execute("complete", {
                        "task_id": task.id, "output": jsonb(outcome.output), "worker_id": self.id,
                        "attempt": task.attempt, "elapsed_s": outcome.elapsed_s})
                except ConnectionLost:
                    raise
                except PgdefError as exc:
                    # the database refused the output (its value): the attempt fails, for good; any
                    # other refusal (a lock timeout, a full disk) is a failed attempt, retried
                    refused = refuses_data(exc)
                    outcome = dataclasses.replace(outcome, ok=False, output=None, permanent=refused, error=storable_text(
                        f"the database refused the output: {exc}" if refused else
                        f"the result could not be recorded: {exc}"))
                else:
                    if accepted:
                        self.stats.done += 1
                    else:
                        self.stats.late += 1
                        self.db.execute("record_late_result", {"task_id": task.id, "owner": self.id,
                                                               "attempt": task.attempt})
                    return
            self.stats.errors += 1
            log.warning("task %s (%s) attempt %d failed: %s", task.id, task.category, task.attempt,
                        (outcome.error or "").splitlines()[0] if outcome.error else "")
            self.db.execute("fail", {"task_id": task.id, "owner": self.id, "attempt": task.attempt,
                                     "permanent": outcome.permanent, "error": outcome.error})
        except ConnectionLost as exc:
            self.stats.lost += 1
            log.error("task %s: outcome not recorded (%s); it returns to the queue when its lease expires",
                      task.id, exc)
        finally:
            with self._held_lock:
                self._held.discard(task.id)

    def _shutdown(self, unstarted: list[Task]) -> None:
        try:
            if unstarted:
                self.db.execute("release", {"owner": self.id, "task_ids": [t.id for t in unstarted]})
            self.db.execute("stop_worker", {"worker_id": self.id})
        except ConnectionLost as exc:
            log.warning("worker %s: could not say goodbye (%s); its leases will expire", self.id, exc)
        finally:
            self.db.close()

    # -- the heartbeat thread ---------------------------------------------------------------
    def _heartbeat(self) -> None:
        beat = Connector(self.dsn, f"pgdef-heartbeat:{self.id}", reconnect_timeout_s=self.config.lease_s,
                         stop=self._stop)
        try:
            try:
                beat.conn  # connect now, not at the first beat
            except ConnectionLost as exc:
                log.warning("heartbeat of %s cannot connect yet (%s)", self.id, exc)
            while not self._stop.wait(self.config.heartbeat_interval):
                with self._held_lock:
                    held = sorted(self._held)
                try:
                    renewed = beat.execute("renew_leases", {"owner": self.id, "task_ids": held,
                                                            "lease_s": self.config.lease_s})
                except PgdefError as exc:  # lost connection, or refused (a lock timeout, ...): the next beat
                    log.warning("heartbeat of %s missed (%s)", self.id, exc)  # tries again, within the lease
                    continue
                lost = set(held) - {row["id"] for row in renewed}
                with self._held_lock:
                    lost &= self._held
                if lost:
                    log.warning("worker %s lost the lease of tasks %s (expired and re-queued); "
                                "its results will still be accepted if they come first", self.id, sorted(lost))
        finally:
            beat.close()


def run_worker(dsn: str, apps: Iterable[str | App], config: WorkerConfig | None = None,
               handle_signals: bool = True) -> WorkerStats:
    """Run one worker in this process until it stops; SIGTERM/SIGINT stop it after the
    attempt in progress."""
    worker = Worker(dsn, apps, config)
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.stop())
    log.info("worker %s: pool %s, categories %s", worker.id, worker.config.pool, ", ".join(worker.categories))
    return worker.run()


def spawn_workers(args: Sequence[str], *, processes: int = 0, gpus: Sequence[int] = (),
                  env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start worker processes running ``aotattn pgdef worker <args>``: ``processes`` CPU
    workers and one per GPU index in ``gpus`` (``CUDA_VISIBLE_DEVICES`` set to it, ``--gpu``
    passed). Returns the processes; the caller waits for them."""
    base = [sys.executable, "-m", "aotattn.pgdef", "worker", *args]
    procs = []
    for _ in range(processes):
        procs.append(subprocess.Popen(base, env=env))
    for gpu in gpus:
        child_env = dict(env if env is not None else os.environ, CUDA_VISIBLE_DEVICES=str(gpu))
        procs.append(subprocess.Popen([*base, "--gpu", str(gpu)], env=child_env))
    return procs


def wait_workers(procs: Sequence[subprocess.Popen]) -> list[int]:
    """Wait for worker processes and return their exit codes. SIGTERM or SIGINT sent to this
    process is passed on to each of them, which stops it after its attempt in progress (before,
    a SIGTERM to the parent left its workers running, orphaned, still claiming tasks)."""
    def forward(sig, _frame) -> None:
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(sig)
                except ProcessLookupError:  # it ended between the poll and the signal
                    pass

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
