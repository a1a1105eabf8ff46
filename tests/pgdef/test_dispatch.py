"""Dispatching: bulk, idempotent by key, validated at the boundary."""

from __future__ import annotations

import math
import random
import threading
import time

import psycopg
import pytest

from aotattn.pgdef import Category, Client, ConfigError, PayloadError, TaskSpec
from aotattn.pgdef.client import DispatchReport
from aotattn.pgdef.model import default_key
from tests.pgdef.conftest import run_workers


def test_dispatch_twice_inserts_once(client):
    rng = random.Random()
    payloads = [{"x": rng.randint(-10**6, 10**6), "tag": i} for i in range(300)]
    first = client.dispatch("testapp,square", "cpu", payloads)
    assert (first.inserted, first.existing, first.repeated) == (300, 0, 0)
    assert str(first) == "300 queued, 0 already there"
    again = client.dispatch("testapp,square", "cpu", payloads[::-1] + payloads[:10])
    assert (again.inserted, again.existing, again.repeated) == (0, 300, 10)
    assert str(again) == "0 queued, 300 already there, 10 repeated a key given before them"
    tasks = client.tasks("testapp,square")
    assert len(tasks) == 300
    assert {t.key for t in tasks} == {default_key(p) for p in payloads}
    assert all(t.state == "queued" and t.attempts == 0 and t.max_attempts == 3 for t in tasks)


def test_explicit_keys_priorities_and_the_same_key_elsewhere(client):
    specs = [TaskSpec({"x": i}, key=f"k{i % 5}", priority=i) for i in range(10)]
    report = client.dispatch("testapp,square", "cpu", specs)
    assert (report.inserted, report.existing, report.repeated) == (5, 0, 5)
    # The first spec of a key counts.
    assert sorted(t.priority for t in client.tasks("testapp,square")) == [0, 1, 2, 3, 4]
    # A key is per category and pool: the same key elsewhere is another task.
    assert client.dispatch("testapp,sleep", "cpu", [TaskSpec({"x": 1}, key="k0")]).inserted == 1
    assert client.dispatch("testapp,square", "sm_90", [TaskSpec({"x": 1}, key="k0")]).inserted == 1
    assert len(client.tasks("testapp")) == 7


def test_claims_follow_priority(client, dsn):
    client.dispatch("testapp,square", "cpu", [TaskSpec({"x": i}, priority=p) for i, p in enumerate([1, 9, 5, 9])])
    (worker,) = run_workers(dsn)  # one worker: claims happen one after the other
    assert worker.stats.done == 4
    done = sorted(client.results("testapp,square"), key=lambda r: r.created_at)
    assert [r.payload["x"] for r in done] == [1, 3, 2, 0]


@pytest.mark.parametrize("bad, match", [
    ("Tune", "lower-case"), ("tune,Attn", "subcategory"), (",x", "lower-case"), ("a b", "lower-case"),
])
def test_bad_categories(client, bad, match):
    with pytest.raises(ConfigError, match=match):
        client.dispatch(bad, "cpu", [{"x": 1}])


@pytest.mark.parametrize("payload, match", [
    ([1, 2], "JSON object"), ("x", "JSON object"), ({"x": math.nan}, "not representable"),
    ({"x": {1, 2}}, "not representable"), ({1: object()}, "not representable"),
    ({"x": "a\x00b"}, "task 1 payload: .*NUL"), ({"x\x00": 1}, "NUL"), ({"x": ["\udfff"]}, "lone surrogate"),
])
def test_malformed_payloads_are_refused_at_dispatch(client, payload, match):
    with pytest.raises(ConfigError, match=match):
        client.dispatch("testapp,square", "cpu", [{"x": 1}, payload])
    assert client.tasks() == []  # nothing half-dispatched


def test_pool_key_and_app_validation(client):
    with pytest.raises(ConfigError, match="pool"):
        client.dispatch("testapp,square", "sm 90", [{"x": 1}])
    with pytest.raises(ConfigError, match="key"):
        client.dispatch("testapp,square", "cpu", [TaskSpec({"x": 1}, key="")])
    with pytest.raises(PayloadError, match="expected payload"):
        client.dispatch("testapp,square", "cpu", [{"x": 1}, {"x": "two"}], app="tests.pgdef.apps")
    with pytest.raises(ConfigError, match="no task kind testapp,nope"):
        client.dispatch("testapp,nope", "cpu", [{"x": 1}], app="tests.pgdef.apps")
    with pytest.raises(ConfigError, match="cannot import"):
        client.dispatch("testapp,square", "cpu", [{"x": 1}], app="tests.pgdef.no_such_module")
    assert client.dispatch("testapp,flaky", "cpu", [{"fail_times": 0}], app="tests.pgdef.apps").inserted == 1
    assert client.tasks("testapp,flaky")[0].max_attempts == 5  # the kind's default


def test_category_parsing():
    assert Category.parse("tune") == Category("tune", "")
    assert str(Category.parse("tune,attn_fwd")) == "tune,attn_fwd"
    with pytest.raises(ConfigError):
        Category.parse(3)


@pytest.mark.parametrize("spec, match", [
    (TaskSpec({"x": -1}, priority=2**31), "task 5001: expected integer priority"),
    (TaskSpec({"x": -1}, priority=True), "task 5001: expected integer priority"),
    (TaskSpec({"x": -1}, max_attempts=0), "max_attempts >= 1"),
    (TaskSpec({"x": -1}, max_attempts=2**31), "max_attempts >= 1"),
    (TaskSpec({"x": 1}, key="k\x00"), "task 5001 key"),
])
def test_a_bad_task_past_the_first_chunk_dispatches_nothing(client, spec, match):
    """Dispatch validates every task first and inserts every chunk in one transaction."""
    good = [{"x": x} for x in range(5001)]
    with pytest.raises(ConfigError, match=match):
        client.dispatch("testapp,square", "cpu", [*good, spec])
    assert client.tasks() == []


def test_max_attempts_zero_is_refused_not_replaced(client):
    with pytest.raises(ConfigError, match="max_attempts >= 1"):
        client.dispatch("testapp,square", "cpu", [{"x": 1}], max_attempts=0)
    assert client.dispatch("testapp,square", "cpu", [{"x": 1}], max_attempts=1).inserted == 1
    assert client.tasks()[0].max_attempts == 1


def test_concurrent_dispatchers_that_deadlock_still_insert_each_key_once(client, dsn):
    """Two dispatchers inserting the same keys in different orders wait on each other's
    uncommitted rows; PostgreSQL aborts one with a deadlock. Re-running that transaction is
    safe (ON CONFLICT DO NOTHING), so the dispatch must succeed, not fail with "deadlock"."""
    with psycopg.connect(dsn) as other:  # another dispatcher, mid-transaction, holding key a
        other.execute("SET deadlock_timeout = '60s'")  # the client detects the deadlock, not this one
        other.execute("INSERT INTO pgdef_task (app, subcategory, pool, task_key, payload) "
                      "VALUES ('testapp', 'square', 'cpu', 'a', '{\"x\": 1}')")
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_dispatch_or_error(
            client, [TaskSpec({"x": 2}, key="b"), TaskSpec({"x": 1}, key="a")])))
        thread.start()
        deadline = time.monotonic() + 30
        with psycopg.connect(dsn, autocommit=True) as watch:  # the client has b and waits for a
            while not watch.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                                    "'pgdef-client' AND wait_event_type = 'Lock'").fetchone()[0]:
                assert time.monotonic() < deadline, "the client never waited for the other transaction"
                time.sleep(0.05)
        other.execute("INSERT INTO pgdef_task (app, subcategory, pool, task_key, payload) "
                      "VALUES ('testapp', 'square', 'cpu', 'b', '{\"x\": 2}')")  # waits for b: a cycle
    thread.join(30)
    assert outcome == [DispatchReport(inserted=0, existing=2)]
    assert sorted(t.key for t in client.tasks()) == ["a", "b"]


def _dispatch_or_error(client, specs):
    try:
        return client.dispatch("testapp,square", "cpu", specs)
    except Exception as exc:  # compared above
        return exc


def test_two_clients_dispatching_the_same_keys_in_opposite_orders(client, dsn):
    """Each dispatch waits for the other's uncommitted rows of the same keys; in opposite
    orders that was a deadlock that failed one of them (and again on a re-run)."""
    specs = [TaskSpec({"x": i}, key=f"k{i:05d}") for i in range(20000)]
    with Client(dsn) as other:
        outcome: list = []
        threads = [threading.Thread(target=lambda c=c, s=s: outcome.append(_dispatch_or_error(c, s)))
                   for c, s in ((client, specs), (other, specs[::-1]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(outcome, key=str) == [DispatchReport(0, 20000), DispatchReport(20000, 0)]
    assert len(client.tasks()) == 20000


@pytest.mark.parametrize("call, match", [
    (lambda c: c.results("testapp,echo", "cpu", keys="a"), "keys: expected a list"),
    (lambda c: c.results(keys=[1]), "keys: expected strings"),
    (lambda c: c.tasks(keys=b"a"), "keys: expected a list"),
    (lambda c: c.tasks(states="done"), "states: expected a list"),
    (lambda c: c.tasks(states={"done": 1}), "states: expected a list"),
    (lambda c: c.events(7), "task ids: expected a list"),
    (lambda c: c.cancel(task_ids="12"), "task ids: expected a list"),
    (lambda c: c.retry(task_ids=3), "task ids: expected a list"),
    (lambda c: c.checkout("cpu", "testapp,echo", "/nonexistent/batch.jsonl"), "categories: expected a list"),
    (lambda c: c.checkin("results.jsonl"), "results files: expected a list"),
])
def test_a_bare_value_where_a_list_is_expected_is_refused(client, call, match):
    # a string would otherwise be split into characters (keys "a" selecting nothing, categories
    # "t", "e", ...), an int would die in list()
    task = client.dispatch("testapp,echo", "cpu", [TaskSpec({"x": 1}, key="a")])
    assert task.inserted == 1
    with pytest.raises(ConfigError, match=match):
        call(client)
    assert [t.key for t in client.tasks(keys=["a"], states=("queued",))] == ["a"]
