"""Workers: results, handler errors, malformed payloads, retry, cancel, GPU kinds, status."""

from __future__ import annotations

import random
import threading
import time

import pytest

from aotattn.pgdef import App, ConfigError, Worker, WorkerConfig
from tests.pgdef.conftest import count_results, fast_config, run_workers


def test_squares_match_float64(client, dsn):
    rng = random.Random()
    xs = [rng.randint(-10**9, 10**9) for _ in range(60)] + [rng.uniform(-1e3, 1e3) for _ in range(60)]
    client.dispatch("testapp,square", "cpu", [{"x": x} for x in xs])
    (worker,) = run_workers(dsn)
    assert worker.stats.done == len(set(xs))
    results = client.results("testapp,square")
    assert len(results) == len(set(xs))
    for r in results:
        x = r.payload["x"]
        if isinstance(x, int):
            assert r.output["y"] == x * x  # exact in Python's integers and in JSON
        else:
            assert r.output["y"] == pytest.approx(float(x) ** 2, rel=1e-15)
        assert r.attempt == 1 and r.worker_id == worker.id and r.elapsed_s >= 0
    assert set(count_results(dsn).values()) == {1}


@pytest.mark.parametrize("payload, error", [({"msg": "kaput"}, "ValueError: boom: kaput"),
                                            ({"msg": "", "exit": 3}, "SystemExit: 3")], ids=["raises", "sys_exit"])
def test_handler_exception_fails_after_max_attempts_and_the_worker_goes_on(client, dsn, payload, error):
    """A handler's exception, SystemExit included (it used to end the worker silently, the
    task left running until its lease expired), is a failed attempt; the worker goes on."""
    client.dispatch("testapp,boom", "cpu", [payload], max_attempts=3)
    client.dispatch("testapp,square", "cpu", [{"x": i} for i in range(20)])
    (worker,) = run_workers(dsn)
    (task,) = client.tasks("testapp,boom")
    assert task.state == "failed" and task.attempts == 3
    assert error in task.error and "apps.py" in task.error  # message and where
    errors = [e for e in client.events([task.id]) if e["event"] == "error"]
    assert [e["attempt"] for e in errors] == [1, 2, 3]
    assert len(client.results("testapp,square")) == 20
    assert worker.stats.errors == 3 and worker.stats.done == 20


def test_flaky_task_succeeds_on_a_later_attempt(client, dsn):
    client.dispatch("testapp,flaky", "cpu", [{"fail_times": 2}], app="tests.pgdef.apps")
    run_workers(dsn)
    (result,) = client.results("testapp,flaky")
    assert result.output == {"attempt": 3} and result.attempt == 3
    assert client.tasks("testapp,flaky")[0].error is None


@pytest.mark.parametrize("category, payload, error", [
    ("testapp,square", {"z": 1}, "PayloadError: toy,square: expected payload"),  # the kind's validator
    ("testapp,square", {"x": [1]}, "PayloadError"),
    ("testapp,strict", {"m": 1}, "PayloadError: strict needs n"),  # raised by the handler
    ("testapp,junk", {}, "TypeError: handler output is not JSON"),
    ("testapp,deep", {}, "handler output is not JSON: nested deeper"),
])
def test_malformed_payloads_and_outputs_fail_at_once(client, dsn, category, payload, error):
    client.dispatch(category, "cpu", [payload], max_attempts=5)
    client.dispatch("testapp,square", "cpu", [{"x": 7}])
    run_workers(dsn)
    (task,) = [t for t in client.tasks(category) if t.payload == payload]
    assert task.state == "failed" and task.attempts == 1  # permanent: not retried
    assert error in task.error
    assert [r.output["y"] for r in client.results("testapp,square") if r.payload == {"x": 7}] == [49]


@pytest.mark.parametrize("payload", [{"what": "nul"}, {"what": "surrogate"}, {"what": "nul", "as": "key"},
                                     {"what": "surrogate", "as": "key"}])
def test_output_the_database_refuses_fails_the_task_and_the_worker_goes_on(client, dsn, payload):
    """jsonb takes neither a NUL character nor a lone surrogate, which JSON text can carry."""
    client.dispatch("testapp,unstorable", "cpu", [payload], max_attempts=3)
    client.dispatch("testapp,square", "cpu", [{"x": x} for x in range(4)])
    run_workers(dsn)
    (task,) = client.tasks("testapp,unstorable")
    assert task.state == "failed" and task.attempts == 1  # permanent
    assert "handler output is not JSON" in task.error and ("NUL" in task.error or "surrogate" in task.error)
    assert sorted(r.output["y"] for r in client.results("testapp,square")) == [0, 1, 4, 9]


@pytest.mark.parametrize("what, shown", [("nul", "a\\x00b"), ("surrogate", "\\ud800")])
def test_an_error_text_the_database_refuses_is_recorded_escaped(client, dsn, what, shown):
    client.dispatch("testapp,unstorable", "cpu", [{"what": what, "raise": True}], max_attempts=2)
    client.dispatch("testapp,square", "cpu", [{"x": 3}])
    run_workers(dsn)
    (task,) = client.tasks("testapp,unstorable")
    assert task.state == "failed" and task.attempts == 2  # an ordinary error: retried, then failed
    assert f"RuntimeError: bad {shown} byte" in task.error
    assert [r.output["y"] for r in client.results("testapp,square")] == [9]


def test_retry_requeues_failed_tasks_with_fresh_attempts(client, dsn):
    client.dispatch("testapp,boom", "cpu", [{"msg": str(i)} for i in range(3)], max_attempts=2)
    client.dispatch("testapp,strict", "cpu", [{"n": 1}])
    run_workers(dsn)
    assert [t.state for t in client.tasks("testapp,boom")] == ["failed"] * 3
    assert client.retry("testapp,strict") == 0  # that one is done
    assert client.retry("testapp,boom") == 3
    assert all(t.state == "queued" and t.attempts == 0 and t.error is None for t in client.tasks("testapp,boom"))
    assert client.retry("testapp,boom") == 0
    run_workers(dsn)
    boom = client.tasks("testapp,boom")
    assert all(t.state == "failed" and t.attempts == 2 for t in boom)
    assert [e["event"] for e in client.events([boom[0].id])].count("retry") == 1


def test_cancel_queued_and_running_tasks(client, dsn):
    client.dispatch("testapp,square", "cpu", [{"x": i} for i in range(10)])
    client.dispatch("testapp,sleep", "cpu", [{"x": 3, "s": 1.0}])
    assert client.cancel("testapp,square", task_ids=[t.id for t in client.tasks("testapp,square")[:4]]) == 4
    (sleeper,) = client.tasks("testapp,sleep")
    worker = Worker(dsn, ["tests.pgdef.apps"], fast_config())
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 20
    while client.tasks("testapp,sleep")[0].state != "running" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.cancel(task_ids=[sleeper.id]) == 1
    thread.join(30)
    assert not thread.is_alive()
    states = [t.state for t in client.tasks("testapp,square")]
    assert states.count("cancelled") == 4 and states.count("done") == 6
    assert client.tasks("testapp,sleep")[0].state == "cancelled"
    assert client.results("testapp,sleep") == []  # the running attempt's result was not accepted
    assert [e["event"] for e in client.events([sleeper.id])] == ["cancel", "late_result"]
    assert client.retry(include_cancelled=True) == 5


def test_gpu_kinds_run_only_in_gpu_workers(client, dsn):
    client.dispatch("testapp,gpusquare", "sm_90", [{"x": 5}])
    client.dispatch("testapp,square", "sm_90", [{"x": 6}])
    run_workers(dsn, pool="sm_90")  # a CPU worker of that pool
    assert [r.output["y"] for r in client.results(pool="sm_90")] == [36]
    run_workers(dsn, pool="sm_90", gpu=3)
    (gpu_result,) = client.results("testapp,gpusquare")
    assert gpu_result.output == {"y": 25, "gpu": 3}
    gpu_only = App("gpuonly")
    gpu_only.add("k", lambda p, c: None, device="gpu")
    with pytest.raises(ConfigError, match="no cpu task kinds"):
        Worker(dsn, [gpu_only], WorkerConfig())


def test_claim_batches_and_stop_releases_unstarted_tasks(client, dsn):
    client.dispatch("testapp,sleep", "cpu", [{"x": i, "s": 0.2} for i in range(8)])
    worker = Worker(dsn, ["tests.pgdef.apps"], fast_config(claim_batch=5, exit_when_idle=False))
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 20
    while not client.results("testapp,sleep") and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    thread.join(20)
    tasks = client.tasks("testapp,sleep")
    assert [t.state for t in tasks].count("running") == 0
    queued = [t for t in tasks if t.state == "queued"]
    assert len(queued) >= 3 and all(t.attempts == 0 for t in queued)  # released, attempt not counted
    assert {e["event"] for e in client.events([t.id for t in queued])} <= {"released"}
    run_workers(dsn, claim_batch=5)
    assert len(client.results("testapp,sleep")) == 8


def test_worker_config_is_checked():
    for bad in (dict(lease_s=0), dict(lease_s=2, heartbeat_s=3), dict(claim_batch=0), dict(pool="a b"), dict(gpu=-1),
                dict(max_tasks=0), dict(max_tasks=-3), dict(max_tasks=True), dict(max_tasks=2.0)):
        with pytest.raises(ConfigError):
            WorkerConfig(**bad)
    assert WorkerConfig(max_tasks=1).max_tasks == 1


def test_status_counts_workers_failures_and_eta(client, dsn):
    client.dispatch("testapp,square", "cpu", [{"x": i} for i in range(30)])
    client.dispatch("testapp,boom", "cpu", [{"msg": "x"}], max_attempts=1)
    client.dispatch("testapp,square", "sm_90", [{"x": 1}])
    before = client.status()
    assert [(p.category, p.pool, p.queued) for p in before.progress] == [
        ("testapp,boom", "cpu", 1), ("testapp,square", "cpu", 30), ("testapp,square", "sm_90", 1)]
    assert all(p.eta_s is None and p.rate_per_s is None for p in before.progress)
    worker = Worker(dsn, ["tests.pgdef.apps"], fast_config(exit_when_idle=False))
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + 20
    while client.status(pool="cpu").remaining and time.monotonic() < deadline:
        time.sleep(0.05)
    live = client.status()
    worker.stop()
    thread.join(10)
    assert [w["id"] for w in live.workers] == [worker.id] and live.workers[0]["done"] == 30
    cpu_square = next(p for p in live.progress if p.category == "testapp,square" and p.pool == "cpu")
    assert (cpu_square.done, cpu_square.remaining, cpu_square.eta_s) == (30, 0, 0.0)
    assert cpu_square.rate_per_s > 0
    sm90 = next(p for p in live.progress if p.pool == "sm_90")
    assert sm90.queued == 1 and sm90.eta_s is None  # nothing done there: no rate, no estimate
    assert [f["category"] for f in live.failures] == ["testapp,boom"] and "boom: x" in live.failures[0]["error"]
    assert client.status().workers == []  # stopped workers are not live
    only_app = client.status("testapp,boom")
    assert [p.category for p in only_app.progress] == ["testapp,boom"]
