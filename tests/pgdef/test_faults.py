"""Faults against a real server: a killed worker, a terminated connection, a restarted
server, and eight workers racing over thousands of tasks."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import psycopg.sql
import pytest

from aotattn.pgdef import Client, EmbeddedServer, Worker, schema
from tests.pgdef.conftest import count_results, fast_config, run_workers

REPO = Path(__file__).resolve().parents[2]


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def test_sigkilled_worker_task_completes_elsewhere_after_lease_expiry(client, dsn):
    client.dispatch("testapp,sleep", "cpu", [{"x": 12, "first_s": 60, "s": 0}])
    victim = subprocess.Popen(
        [sys.executable, "-m", "aotattn.pgdef", "worker", "--app", "tests.pgdef.apps", "--dsn", dsn,
         "--lease", "2", "--heartbeat", "0.4", "--poll", "0.05"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        task = _wait_for(lambda: [t for t in client.tasks("testapp,sleep") if t.state == "running"],
                         60, "the worker to claim the task")[0]
        assert task.attempts == 1
        # Heartbeats renew the lease while the handler sleeps.
        _wait_for(lambda: client.tasks("testapp,sleep")[0].lease_expires_at > task.lease_expires_at,
                  10, "a heartbeat to renew the lease")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    (rescuer,) = run_workers(dsn, lease_s=2.0)
    (result,) = client.results("testapp,sleep")
    assert result.output["y"] == 144 and result.attempt == 2 and result.worker_id == rescuer.id
    assert rescuer.stats.requeued == 1
    events = client.events([task.id])
    assert [e["event"] for e in events] == ["expired"] and events[0]["owner"] == task.lease_owner
    assert count_results(dsn) == {task.id: 1}


def test_terminated_connection_mid_task_gives_one_result(client, dsn, admin_dsn):
    """The handler terminates its own worker's sessions (claims and heartbeat) with
    pg_terminate_backend while it runs; the result is written on a new connection."""
    client.dispatch("testapp,cut", "cpu", [{"x": 9, "admin_dsn": admin_dsn, "wait_s": 0.5}])
    client.dispatch("testapp,square", "cpu", [{"x": i} for i in range(5)])
    (worker,) = run_workers(dsn)
    (cut,) = client.results("testapp,cut")
    assert cut.output == {"y": 81, "killed": 2} and cut.attempt == 1
    assert worker.db.reconnects >= 1 and worker.stats.lost == 0
    assert len(client.results("testapp,square")) == 5
    assert set(count_results(dsn).values()) == {1}


def test_eight_workers_over_thousands_of_tasks(client, dsn):
    n = 2000
    client.dispatch("testapp,square", "cpu", [{"x": i} for i in range(n)])
    workers = run_workers(dsn, n=8, timeout_s=120)
    results = client.results("testapp,square")
    assert len(results) == n
    assert sorted(r.payload["x"] for r in results) == list(range(n))
    assert all(r.output["y"] == r.payload["x"] ** 2 and r.attempt == 1 for r in results)
    assert sum(w.stats.done for w in workers) == n
    assert sum(w.stats.late + w.stats.errors + w.stats.lost for w in workers) == 0
    assert sum(1 for w in workers if w.stats.done) >= 2  # they did share the work
    counts = count_results(dsn)
    assert len(counts) == n and set(counts.values()) == {1}


@pytest.fixture
def private_server(tmp_path):
    server = EmbeddedServer(tmp_path / "pgdef-home", fast=True)
    server.start()
    yield server
    server.destroy()


def test_server_restart_during_a_run(private_server):
    dsn = private_server.dsn
    schema.migrate(dsn)
    n = 300
    with Client(dsn) as client:
        client.dispatch("testapp,sleep", "cpu", [{"x": i, "s": 0.01} for i in range(n)])
    workers = [Worker(dsn, ["tests.pgdef.apps"], fast_config(lease_s=3.0, reconnect_timeout_s=60))
               for _ in range(3)]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for t in threads:
        t.start()

    def done() -> int:
        with psycopg.connect(dsn) as conn:
            return conn.execute("SELECT count(*) FROM pgdef_result").fetchone()[0]

    _wait_for(lambda: done() >= 40, 60, "40 results before the restart")
    private_server.restart()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert sum(w.db.reconnects for w in workers) >= 1
    with Client(dsn) as client:
        results = client.results("testapp,sleep")
        assert sorted(r.payload["x"] for r in results) == list(range(n))
        assert all(r.output["y"] == r.payload["x"] ** 2 for r in results)
        assert {t.state for t in client.tasks()} == {"done"}
    assert set(count_results(dsn).values()) == {1}


def test_a_heartbeat_that_meets_a_database_error_keeps_beating(client, dsn):
    """A heartbeat refused by the database for a while (here a lock timeout: someone holds
    the worker's row) misses those beats only; it used to end the heartbeat thread, so the
    running task's lease expired under a live worker and the task was re-queued."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("ALTER DATABASE {} SET lock_timeout = '100ms'").format(
            psycopg.sql.Identifier(conn.info.dbname)))
    client.dispatch("testapp,sleep", "cpu", [{"x": 3, "s": 4}])
    worker = Worker(dsn, ["tests.pgdef.apps"], fast_config(lease_s=2.0, heartbeat_s=0.3))
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    (task,) = _wait_for(lambda: client.tasks("testapp,sleep", states=["running"]), 30, "the claim")
    with psycopg.connect(dsn) as locker:
        locker.execute("SELECT 1 FROM pgdef_worker WHERE id = %s FOR UPDATE", (worker.id,))
        time.sleep(1.0)  # the beats meanwhile time out waiting for the row
    while thread.is_alive():  # any other worker's pass over expired leases
        client.requeue_expired()
        thread.join(0.1)
    assert [e["event"] for e in client.events([task.id])] == []
    (result,) = client.results("testapp,sleep")
    assert result.attempt == 1 and worker.stats.done == 1


def test_a_result_refused_for_a_passing_reason_is_retried_not_failed_for_good(client, dsn):
    """`complete` meeting a lock timeout (someone holds pgdef_result) said nothing about the
    output, yet the worker recorded "the database refused the output" as a permanent
    failure: a good result lost and the task failed. It is a failed attempt, retried."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("ALTER DATABASE {} SET lock_timeout = '100ms'").format(
            psycopg.sql.Identifier(conn.info.dbname)))
    client.dispatch("testapp,square", "cpu", [{"x": 5}], max_attempts=5)
    (task,) = client.tasks("testapp,square")
    done: list = []
    with psycopg.connect(dsn) as locker:
        locker.execute("LOCK TABLE pgdef_result IN EXCLUSIVE MODE")  # inserts wait, then time out
        thread = threading.Thread(target=lambda: done.extend(run_workers(dsn)), daemon=True)
        thread.start()
        _wait_for(lambda: any(e["event"] == "error" for e in client.events([task.id])), 30, "a failed complete")
    thread.join(60)
    (after,) = client.tasks("testapp,square")
    assert after.state == "done" and after.attempts >= 2
    (result,) = client.results("testapp,square")
    assert result.output["y"] == 25
    errors = [e for e in client.events([task.id]) if e["event"] == "error"]
    assert errors and all("could not be recorded" in e["detail"] and "lock timeout" in e["detail"] for e in errors)
