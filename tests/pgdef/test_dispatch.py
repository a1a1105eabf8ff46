"""Dispatching: bulk, idempotent by key, validated at the boundary."""

from __future__ import annotations

import math
import random

import pytest

from aotattn.pgdef import Category, ConfigError, PayloadError, TaskSpec
from aotattn.pgdef.model import default_key
from tests.pgdef.conftest import run_workers


def test_dispatch_twice_inserts_once(client):
    rng = random.Random()
    payloads = [{"x": rng.randint(-10**6, 10**6), "tag": i} for i in range(300)]
    first = client.dispatch("testapp,square", "cpu", payloads)
    assert (first.inserted, first.existing) == (300, 0)
    again = client.dispatch("testapp,square", "cpu", payloads[::-1] + payloads[:10])
    assert (again.inserted, again.existing) == (0, 300)
    tasks = client.tasks("testapp,square")
    assert len(tasks) == 300
    assert {t.key for t in tasks} == {default_key(p) for p in payloads}
    assert all(t.state == "queued" and t.attempts == 0 and t.max_attempts == 3 for t in tasks)


def test_explicit_keys_priorities_and_the_same_key_elsewhere(client):
    specs = [TaskSpec({"x": i}, key=f"k{i % 5}", priority=i) for i in range(10)]
    assert client.dispatch("testapp,square", "cpu", specs).inserted == 5
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
