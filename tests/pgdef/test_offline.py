"""Offline batches: checkout, run with no database, idempotent checkin, expiry."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rich.console import Console

from aotattn.pgdef import BatchError, ConfigError, run_offline
from aotattn.pgdef.cli import render_status
from aotattn.pgdef.offline import Batch, read_results
from tests.pgdef.conftest import count_results, run_workers

APPS = ["tests.pgdef.apps"]
REPO = Path(__file__).resolve().parents[2]


def _dispatch(client, n, pool="sm_90"):
    xs = random.Random().sample(range(-10**6, 10**6), n)
    client.dispatch("testapp,square", pool, [{"x": x} for x in xs])
    return xs


def test_batch_checked_in_twice_gives_one_result_each(client, dsn, tmp_path):
    xs = _dispatch(client, 20)
    batch = client.checkout("sm_90", ["testapp,square"], tmp_path / "batch.json", limit=50, lease_s=600)
    assert len(batch.tasks) == 20 and {t.attempt for t in batch.tasks} == {1}
    assert {t.state for t in client.tasks()} == {"running"}
    assert [b["id"] for b in client.status().batches] == [batch.id]
    assert Batch.read(tmp_path / "batch.json") == batch

    report = run_offline(tmp_path / "batch.json", tmp_path / "results.jsonl", APPS)
    assert (report.ran, report.ok, report.skipped) == (20, 20, 0)
    again = run_offline(tmp_path / "batch.json", tmp_path / "results.jsonl", APPS)  # resumes: nothing left
    assert (again.ran, again.skipped) == (0, 20)

    first = client.checkin([tmp_path / "results.jsonl"])
    assert (first.accepted, first.already, first.released, first.first_checkin) == (20, 0, 0, True)
    second = client.checkin([tmp_path / "results.jsonl"])
    assert (second.accepted, second.already, second.first_checkin) == (0, 20, False)
    results = client.results("testapp,square")
    assert sorted(r.payload["x"] for r in results) == sorted(xs)
    assert all(r.output["y"] == r.payload["x"] ** 2 for r in results)
    assert set(count_results(dsn).values()) == {1} and len(count_results(dsn)) == 20
    assert client.status().batches == []
    assert not any(e["event"] == "late_result" for e in client.events([t.id for t in batch.tasks]))


def test_batch_never_checked_in_returns_to_the_queue(client, dsn, tmp_path):
    xs = _dispatch(client, 6)
    batch = client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json", lease_s=1.0)
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS, shard=(0, 2))  # half of it, never checked in
    time.sleep(1.2)
    status = client.status()
    assert [b["expired"] for b in status.batches] == [True]
    assert len(status.expired) == 6 and {e["lease_owner"] for e in status.expired} == {batch.owner}
    console = Console(width=200, record=True)
    console.print(render_status(status))
    shown = console.export_text()
    assert "expired leases" in shown and f"{batch.id}" in shown and "(expired)" in shown
    (worker,) = run_workers(dsn, pool="sm_90")
    assert worker.stats.requeued == 6
    results = client.results("testapp,square")
    assert sorted(r.payload["x"] for r in results) == sorted(xs)
    assert {r.attempt for r in results} == {2} and {r.worker_id for r in results} == {worker.id}
    # A late check-in of the expired batch adds nothing: every task has its result.
    late = client.checkin([tmp_path / "r.jsonl"])
    assert (late.accepted, late.already, late.released) == (0, 3, 0)
    assert set(count_results(dsn).values()) == {1}
    assert {e["event"] for e in client.events([t.id for t in batch.tasks])} == {"expired", "late_result"}


def test_expired_batch_still_counts_for_tasks_nobody_finished(client, dsn, tmp_path):
    _dispatch(client, 4)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json", lease_s=0.5)
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    time.sleep(0.7)
    assert client.requeue_expired() == 4
    report = client.checkin([tmp_path / "r.jsonl"])
    assert report.accepted == 4
    assert {t.state for t in client.tasks()} == {"done"}


def test_partial_results_release_the_rest_and_errors_count(client, dsn, tmp_path):
    xs = _dispatch(client, 6)
    client.dispatch("testapp,boom", "sm_90", [{"msg": "offline"}], max_attempts=1)
    client.dispatch("testapp,flaky", "sm_90", [{"fail_times": 1}], max_attempts=3)
    batch = client.checkout("sm_90", ["testapp,square", "testapp,boom", "testapp,flaky"], tmp_path / "b.json")
    assert len(batch.tasks) == 8
    shard0 = run_offline(tmp_path / "b.json", tmp_path / "r0.jsonl", APPS, shard=(0, 2))
    shard1 = run_offline(tmp_path / "b.json", tmp_path / "r1.jsonl", APPS, shard=(1, 2))
    assert shard0.ran + shard1.ran == 8
    # Keep the boom and flaky outcomes and two squares; lose the rest (as if the host died).
    squares = sorted(t.id for t in batch.tasks if str(t.category) == "testapp,square")
    kept_ids = {t.id for t in batch.tasks if str(t.category) != "testapp,square"} | set(squares[:2])
    lines = [tmp_path.joinpath("r0.jsonl").read_text().splitlines()[0]]
    for name in ("r0.jsonl", "r1.jsonl"):
        lines += [ln for ln in tmp_path.joinpath(name).read_text().splitlines()[1:] if json.loads(ln)["task_id"] in kept_ids]
    tmp_path.joinpath("kept.jsonl").write_text("\n".join(lines) + "\n")
    report = client.checkin([tmp_path / "kept.jsonl"])
    assert (report.accepted, report.errors, report.released) == (2, 2, 4)
    boom = client.tasks("testapp,boom")[0]
    assert boom.state == "failed" and "ValueError: boom: offline" in boom.error
    flaky = client.tasks("testapp,flaky")[0]
    assert flaky.state == "queued" and flaky.attempts == 1  # a failed attempt, retried later
    released = [t for t in client.tasks("testapp,square") if t.state == "queued"]
    assert len(released) == 4 and {t.attempts for t in released} == {0}
    run_workers(dsn, pool="sm_90")
    assert sorted(r.payload["x"] for r in client.results("testapp,square")) == sorted(xs)
    assert client.results("testapp,flaky")[0].output == {"attempt": 2}


def test_bad_files_are_refused(client, tmp_path):
    _dispatch(client, 3)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json")
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    header, *lines = tmp_path.joinpath("r.jsonl").read_text().splitlines()

    cut = tmp_path / "cut.jsonl"  # a crash mid-line: the cut line is ignored
    cut.write_text("\n".join([header, *lines[:2], lines[2][:15]]))
    assert [o.task_id for o in read_results(cut)[1]] == [json.loads(ln)["task_id"] for ln in lines[:2]]

    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join([header, "{not json}", *lines]) + "\n")
    with pytest.raises(BatchError, match="broken.jsonl:2"):
        client.checkin([broken])
    stranger = tmp_path / "stranger.jsonl"
    stranger.write_text("\n".join([header.replace(json.loads(header)["batch_id"], "f" * 32), *lines]) + "\n")
    with pytest.raises(BatchError, match="unknown to this database"):
        client.checkin([stranger])
    with pytest.raises(BatchError, match="belongs to batch"):
        client.checkin([tmp_path / "r.jsonl", stranger])
    forged = tmp_path / "forged.jsonl"
    line = json.loads(lines[0])
    forged.write_text("\n".join([header, json.dumps({**line, "task_id": 10**9})]) + "\n")
    with pytest.raises(BatchError, match="not in batch"):
        client.checkin([forged])
    with pytest.raises(BatchError, match="pgdef-batch/1"):
        run_offline(tmp_path / "r.jsonl", tmp_path / "x.jsonl", APPS)
    with pytest.raises(BatchError, match="results of batch"):
        other = tmp_path / "other.json"
        other.write_text(tmp_path.joinpath("b.json").read_text().replace(json.loads(header)["batch_id"], "e" * 32))
        run_offline(other, tmp_path / "r.jsonl", APPS)
    with pytest.raises(ConfigError, match="no handler for categories testapp,square"):
        run_offline(tmp_path / "b.json", tmp_path / "y.jsonl", ["aotattn.pgdef.toy"])
    assert client.checkin([tmp_path / "r.jsonl"]).accepted == 3  # the good file still checks in


@pytest.mark.parametrize("change, message", [
    ({"ok": "no", "output": None}, "ok: expected bool, got 'no'"),  # bool("no") made it a result
    ({"task_id": "1"}, "task_id: expected int"),
    ({"task_id": 1.9}, "task_id: expected int"),  # int(1.9) named another task
    ({"attempt": True}, "attempt: expected int"),
    ({"attempt": 0}, "attempt: expected 1 or more"),
    ({"elapsed_s": -1.0}, "elapsed_s: expected a non-negative number"),
    ({"permanent": 1}, "permanent: expected bool"),
    ({"worker_id": 7}, "worker_id: expected text or null"),
    ({"ok": False}, "expected an error exactly when ok is false"),
    ({"error": "RuntimeError: x"}, "expected an error exactly when ok is false"),
    ("[1, 2]", "expected a JSON object"),
])
def test_a_result_line_of_the_wrong_types_is_refused_not_coerced(client, tmp_path, change, message):
    """Every field is read as run_offline writes it; a tampered or hand-edited line is an
    error naming path:line, and the batch checks in once fixed."""
    _dispatch(client, 2)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json")
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    header, first, second = tmp_path.joinpath("r.jsonl").read_text().splitlines()
    bad = change if isinstance(change, str) else json.dumps({**json.loads(second), **change})
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join([header, first, bad]) + "\n")
    with pytest.raises(BatchError, match=re.escape("edited.jsonl:3: malformed result line") + ".*" + re.escape(message)):
        client.checkin([edited])
    assert client.checkin([tmp_path / "r.jsonl"]).accepted == 2
    assert all(t.state == "done" for t in client.tasks("testapp,square"))


@pytest.mark.parametrize("cut_at", [15, -1])  # mid-line; a whole line whose newline was not written
def test_a_resumed_run_continues_on_a_line_of_its_own(client, tmp_path, cut_at):
    xs = _dispatch(client, 4)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json")
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    text = tmp_path.joinpath("r.jsonl").read_text()
    last = text.rstrip("\n").rfind("\n") + 1
    tmp_path.joinpath("r.jsonl").write_text(text[:last + cut_at] if cut_at > 0 else text[:-1])  # the crash
    report = run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    assert (report.ran, report.skipped) == ((1, 3) if cut_at > 0 else (0, 4))
    assert len(read_results(tmp_path / "r.jsonl")[1]) == 4
    assert run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS).ran == 0  # and again
    assert client.checkin([tmp_path / "r.jsonl"]).accepted == 4
    assert sorted(r.payload["x"] for r in client.results("testapp,square")) == sorted(xs)


def test_a_line_cut_after_its_output_object_is_ignored_and_resumed(client, tmp_path):
    """A crash can cut a line right after the output's closing brace: the file then ends in
    "}" without being JSON. It is still a cut last line (no newline ends it): resume and
    checkin must treat it so, not refuse the file as malformed."""
    xs = _dispatch(client, 3)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json")
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    text = tmp_path.joinpath("r.jsonl").read_text()
    last = text.rstrip("\n").rfind("\n") + 1
    cut = text[:text.index('},"permanent"', last) + 1]  # ...,"output":{"attempt":1,"y":..}
    assert cut.endswith("}") and not cut.endswith("\n")
    tmp_path.joinpath("r.jsonl").write_text(cut)
    assert len(read_results(tmp_path / "r.jsonl")[1]) == 2
    report = run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    assert (report.ran, report.skipped) == (1, 2)
    assert client.checkin([tmp_path / "r.jsonl"]).accepted == 3
    assert sorted(r.payload["x"] for r in client.results("testapp,square")) == sorted(xs)


def test_checkin_fails_an_output_the_database_refuses_and_records_the_rest(client, tmp_path):
    """The online workers' rule: such an output fails its task for good; the batch's other
    results are recorded (one bad line used to roll the whole check-in back)."""
    client.dispatch("testapp,unstorable", "sm_90", [{"what": "nul"}])
    xs = _dispatch(client, 2)
    client.checkout("sm_90", ["testapp,square", "testapp,unstorable"], tmp_path / "b.json")
    report = run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS)
    assert (report.ok, report.errors) == (2, 1)
    header, *lines = tmp_path.joinpath("r.jsonl").read_text().splitlines()
    # a results file whose writer did not check (an older version, an edit): the same outcome
    edited = tmp_path / "edited.jsonl"
    forged = [json.dumps({**json.loads(ln), "ok": True, "output": {"s": "a\x00b"}, "error": None})
              if json.loads(ln)["ok"] is False else ln for ln in lines]
    edited.write_text("\n".join([header, *forged]) + "\n")
    done = client.checkin([edited])
    assert (done.accepted, done.errors) == (2, 1)
    (task,) = client.tasks("testapp,unstorable")
    assert task.state == "failed" and "NUL" in task.error
    assert sorted(r.payload["x"] for r in client.results("testapp,square")) == sorted(xs)


def test_a_batch_file_with_times_without_an_offset_is_refused(client, tmp_path):
    _dispatch(client, 1)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json")
    data = json.loads(tmp_path.joinpath("b.json").read_text())
    data["lease_expires_at"] = "2030-01-01T00:00:00"
    tmp_path.joinpath("naive.json").write_text(json.dumps(data))
    with pytest.raises(BatchError, match="lease_expires_at .* has no time zone offset"):
        run_offline(tmp_path / "naive.json", tmp_path / "r.jsonl", APPS)


def test_nothing_to_check_out(client, tmp_path):
    assert client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json") is None
    assert not (tmp_path / "b.json").exists()
    with pytest.raises(ConfigError):
        client.checkout("sm_90", [], tmp_path / "b.json")


def test_a_batch_file_that_cannot_be_written_gives_back_its_tasks_and_batch(client, tmp_path):
    xs = _dispatch(client, 7)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(BatchError, match="cannot write batch file .*its tasks were released"):
        client.checkout("sm_90", ["testapp,square"], tmp_path / "a-file" / "batch.json", limit=5)
    assert [t.state for t in client.tasks()] == ["queued"] * 7
    assert {t.attempts for t in client.tasks()} == {0}
    assert client.status().batches == []  # no open batch that nobody holds
    batch = client.checkout("sm_90", ["testapp,square"], tmp_path / "batch.json", limit=50)
    assert sorted(t.payload["x"] for t in batch.tasks) == sorted(xs)
    assert [b["id"] for b in client.status().batches] == [batch.id]


def test_offline_runner_needs_no_psycopg(client, tmp_path):
    """The GPU host has no network, so maybe no psycopg: `aotattn pgdef run-offline` (and the
    whole `aotattn` CLI) must work with psycopg missing."""
    xs = random.Random().sample(range(-10**6, 10**6), 3)
    client.dispatch("toy,square", "sm_90", [{"x": x} for x in xs])
    client.checkout("sm_90", ["toy,square"], tmp_path / "b.json")
    code = ("import sys\n"
            "sys.modules['psycopg'] = None\n"  # any `import psycopg` now raises ImportError
            "sys.modules['psycopg_pool'] = None\n"
            "from aotattn.cli import app\n"
            f"app(['pgdef', 'run-offline', {str(tmp_path / 'b.json')!r}, '--app', 'aotattn.pgdef.toy',"
            f" '-r', {str(tmp_path / 'r.jsonl')!r}])\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "3 tasks run (3 ok" in done.stdout
    assert client.checkin([tmp_path / "r.jsonl"]).accepted == 3
    assert sorted(r.output["y"] for r in client.results()) == sorted(x * x for x in xs)


@pytest.mark.parametrize("tail", ["\n", "   \n"])
def test_a_resumed_run_after_blank_trailing_lines_checks_in(client, tmp_path, tail):
    """read_results ignores a blank last line; resuming appended after it, and the blank
    line, now in the middle, made the file impossible to check in (malformed result line)."""
    xs = _dispatch(client, 4)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json")
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS, shard=(0, 2))
    with open(tmp_path / "r.jsonl", "a") as out:
        out.write(tail)
    run_offline(tmp_path / "b.json", tmp_path / "r.jsonl", APPS, shard=(1, 2))
    assert len(read_results(tmp_path / "r.jsonl")[1]) == 4
    assert client.checkin([tmp_path / "r.jsonl"]).accepted == 4
    assert sorted(r.payload["x"] for r in client.results("testapp,square")) == sorted(xs)


def test_json_nested_past_the_parsers_depth_is_a_one_line_error(client, tmp_path):
    """A batch, a results file or a payload nested 5000 deep was an internal RecursionError."""
    from aotattn.pgdef.errors import ConfigError
    from aotattn.pgdef.model import check_payload

    deep = "[" * 5000 + "]" * 5000
    (tmp_path / "b.json").write_text(deep)
    with pytest.raises(BatchError, match="not a readable batch file"):
        Batch.read(tmp_path / "b.json")
    _dispatch(client, 1)
    client.checkout("sm_90", ["testapp,square"], tmp_path / "b2.json")
    run_offline(tmp_path / "b2.json", tmp_path / "r.jsonl", APPS)
    header, line = tmp_path.joinpath("r.jsonl").read_text().splitlines()
    tmp_path.joinpath("bad.jsonl").write_text("\n".join([header, deep, line]) + "\n")
    with pytest.raises(BatchError, match="bad.jsonl:2: malformed result line"):
        read_results(tmp_path / "bad.jsonl")
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(ConfigError, match="nested deeper"):
        check_payload({"x": nested})


def test_an_idle_worker_does_not_wait_for_a_checked_out_batch(client, dsn, tmp_path):
    """A worker that exits when idle waited out the lease of tasks checked out in an offline
    batch (a day by default): they come back by checkin, never to this worker. It still
    runs what is queued, then exits."""
    import time

    _dispatch(client, 2)
    assert client.checkout("sm_90", ["testapp,square"], tmp_path / "b.json") is not None
    client.dispatch("testapp,square", "sm_90", [{"x": 11}])
    start = time.monotonic()
    run_workers(dsn, pool="sm_90", timeout_s=30)
    assert time.monotonic() - start < 20
    assert [r.output["y"] for r in client.results("testapp,square")] == [121]
    assert sum(t.state == "running" for t in client.tasks("testapp,square")) == 2  # still the batch's
