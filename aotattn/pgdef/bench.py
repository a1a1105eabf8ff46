"""Claim throughput: how many no-op tasks per second workers claim, run and complete.

``aotattn pgdef bench`` dispatches ``tasks`` no-op tasks and runs ``workers`` worker
threads (each with its own two connections) until the queue is empty, for each
combination of worker count and claim batch. By default it runs on a fresh embedded
server on loopback TCP (fsync on, the default settings), deleted afterwards.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from typing import Any

from aotattn.pgdef.client import Client
from aotattn.pgdef.embedded import EmbeddedServer
from aotattn.pgdef.model import TaskSpec
from aotattn.pgdef.registry import App
from aotattn.pgdef.worker import Worker, WorkerConfig

def noop(payload: dict[str, Any], ctx) -> dict[str, Any]:
    """Returns its payload's index."""
    return {"i": payload["i"]}


def _one_run(client: Client, tasks: int, workers: int, claim_batch: int) -> dict[str, Any]:
    run = f"run{uuid.uuid4().hex[:8]}"
    client.dispatch(f"pgdefbench,{run}", "bench", [TaskSpec({"i": i}, key=str(i)) for i in range(tasks)])
    bench_app = App("pgdefbench")
    bench_app.add(run, noop)
    config = WorkerConfig(pool="bench", lease_s=30, poll_s=0.05, claim_batch=claim_batch, exit_when_idle=True)
    pool = [Worker(client.dsn, [bench_app], config) for _ in range(workers)]
    threads = [threading.Thread(target=w.run) for w in pool]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    done = len(client.results(f"pgdefbench,{run}"))
    if done != tasks:
        raise RuntimeError(f"benchmark run {run}: {done} results for {tasks} tasks; not reporting a rate")
    return {"workers": workers, "claim_batch": claim_batch, "seconds": seconds, "rate": tasks / seconds}


def run_bench(dsn: str | None, tasks: int, workers: list[int], claim_batches: list[int]) -> list[dict[str, Any]]:
    """One row per (workers, claim batch): seconds and tasks per second. Refuses to report a
    run in which not every task got exactly one result."""
    server = None
    home = None
    if dsn is None:
        home = tempfile.TemporaryDirectory(prefix="pgdef-bench-")
        server = EmbeddedServer(home.name)
        dsn = server.start()
    try:
        with Client(dsn, max_connections=2) as client:
            client.init()
            return [_one_run(client, tasks, w, b) for w in workers for b in claim_batches]
    finally:
        if server is not None:
            server.destroy()
            home.cleanup()
