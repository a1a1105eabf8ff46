"""The tuner on pgdef, against a real PostgreSQL: online workers and an offline batch,
each ending in an export (tasks run in the interpreter: AOTATTN_TUNE_DEVICE=cpu)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from aotattn.cli import app as cli
from aotattn.pgdef import Client, PayloadError
from aotattn.spec import Config
from aotattn.tune import app as tune_app
from aotattn.tune import export, offline
from aotattn.tune.cli import _load_results
from aotattn.tune.runner import JOURNAL_VAR
from tests.tune.conftest import TINY, forward_task

APP = "aotattn.tune.app"


@pytest.fixture
def cpu_tasks(monkeypatch, tmp_path):
    monkeypatch.setenv(tune_app.DEVICE_VAR, "cpu")
    monkeypatch.setenv(JOURNAL_VAR, str(tmp_path / "journal"))
    monkeypatch.setenv("AOTATTN_TUNING_DB", str(tmp_path / "tuning"))


def _winner(db, result) -> Config:
    from aotattn.families.flash import rules
    from aotattn.tuning import Database

    task = forward_task(cell=tuple(result["task"]["cell"]))
    return Database(db.root).lookup("sm_90", rules.ATTN_FWD, task.functional,
                                    dict(zip(("seqlen_q", "seqlen_k"), task.cell)))


def test_online_worker_then_export(dsn, cpu_tasks, tuning_copy, tmp_path):
    task = forward_task(cell=(16, 16))
    with Client(dsn) as client:
        first = client.dispatch(tune_app.category(task.table), "sm_90", [tune_app.task_spec(task, TINY)], app=APP)
        again = client.dispatch(tune_app.category(task.table), "sm_90", [tune_app.task_spec(task, TINY)], app=APP)
        assert (first.inserted, again.inserted, again.existing) == (1, 0, 1)  # keyed by the task id
        with pytest.raises(PayloadError):
            client.dispatch(tune_app.category(task.table), "sm_90", [{"task": {"arch": "sm_90"}}], app=APP)
        # `aotattn tune worker`: one pgdef worker process for "GPU 0" (the interpreter here)
        worker = CliRunner().invoke(cli, ["tune", "worker", "--gpus", "0", "--exit-when-idle", "--dsn", dsn,
                                          "--journal", str(tmp_path / "journal")])
        assert worker.exit_code == 0, worker.output
        results = client.results("tune", "sm_90")
    assert len(results) == 1 and results[0].key == task.id
    assert (tmp_path / "journal" / f"{task.id}.jsonl").is_file()
    output = results[0].output
    assert output["id"] == task.id and output["winner"] is not None, output["candidates"]
    export.export([output], tuning_copy, allow_cpu_clock=True)
    assert _winner(tuning_copy, output) == Config.of(output["winner_config"])


def test_offline_batch_checkin_twice_then_export(dsn, cpu_tasks, tmp_path, tuning_copy):
    task = forward_task(cell=(32, 32))
    batch, results = tmp_path / "batch.json", tmp_path / "results"
    with Client(dsn) as client:
        client.dispatch(tune_app.category(task.table), "sm_90", [tune_app.task_spec(task, TINY)], app=APP)
        assert client.checkout("sm_90", [tune_app.category(task.table)], batch) is not None
        assert offline.is_pgdef_batch(batch)
        assert offline.main([str(batch), "--results", str(results), "--gpu", "0"]) == 0
        assert offline.main([str(batch), "--results", str(results)]) == 0  # resumes: nothing left to run
        files = sorted(results.glob("results-*.jsonl"))
        assert [r.accepted for r in (client.checkin(files), client.checkin(files))] == [1, 0]
        stored = client.results("tune")
    found = _load_results([results])
    assert len(found) == 1 and found[0] == stored[0].output
    export.export(found, tuning_copy, allow_cpu_clock=True)
    assert _winner(tuning_copy, found[0]) == Config.of(found[0]["winner_config"])


def test_cli_dispatch_and_plan(dsn, tmp_path):
    runner = CliRunner()
    out = tmp_path / "tasks.jsonl"
    plan = runner.invoke(cli, ["tune", "plan", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "64",
                               "--seqlen", "1024,4096", "--out", str(out)])
    assert plan.exit_code == 0, plan.output
    assert "4 tasks" in plan.output and len(out.read_text().splitlines()) == 4
    args = ["tune", "dispatch", "-c", "flash,attn_fwd", "-c", "flash,backward", "--dtype", "bf16", "--head-dim", "64",
            "--seqlen", "1024", "--dsn", dsn]
    first, second = runner.invoke(cli, args), runner.invoke(cli, args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "tune,flash.attn_fwd on sm_90: 2 queued" in first.output
    assert "tune,flash.backward on sm_90: 4 queued" in first.output  # MASK 0, 2 x deterministic or not
    assert "0 queued, 2 already there" in second.output
    with Client(dsn) as client:
        payloads = [t.payload for t in client.tasks("tune")]
    assert all(tune_app.parse_payload(p)[0].arch == "sm_90" for p in payloads) and len(payloads) == 6
    # each table timed at its harness's size: kernels 2^17 tokens, the operator table 2^19
    tokens = {(t.table, s.tokens) for t, s in map(tune_app.parse_payload, payloads)}
    assert tokens == {("flash.attn_fwd", 2**17), ("flash.backward", 2**19)}, tokens
    # a batch sized by the estimate: a tiny budget still takes the first task, in pgdef's claim order
    batch = tmp_path / "batch.json"
    taken = runner.invoke(cli, ["tune", "checkout", "--minutes", "0.0001", "-o", str(batch), "--dsn", dsn])
    assert taken.exit_code == 0 and "1 tasks" in taken.output, taken.output
    assert offline.is_pgdef_batch(batch) and len(json.loads(batch.read_text())["tasks"]) == 1
    counted = runner.invoke(cli, ["tune", "compile", str(batch), "--images", str(tmp_path / "img"), "--dry-run"])
    assert counted.exit_code == 0 and "1 tasks need" in counted.output, counted.output
    # the same batch minified (or pretty-printed): the offline runner and `tune compile` agree it is one
    for indent, separators in ((None, (",", ":")), (4, (", ", ": "))):
        respaced = tmp_path / f"batch-{indent}.json"
        respaced.write_text(json.dumps(json.loads(batch.read_text()), indent=indent, separators=separators))
        assert offline.is_pgdef_batch(respaced)
        again = runner.invoke(cli, ["tune", "compile", str(respaced), "--images", str(tmp_path / "img"), "--dry-run"])
        assert again.exit_code == 0 and "1 tasks need" in again.output, again.output
    assert not offline.is_pgdef_batch(out)  # `tune plan --out`: JSON lines
    with Client(dsn) as client:
        assert len(client.tasks("tune", states=["queued"])) == 5
    # --tokens overrides the harness's size
    forced = runner.invoke(cli, ["tune", "dispatch", "-c", "flash,backward", "--dtype", "bf16", "--head-dim", "64",
                                 "--seqlen", "1024", "--tokens", "4096", "--rerun", "small", "--dsn", dsn])
    assert forced.exit_code == 0 and "4 queued" in forced.output, forced.output
    with Client(dsn) as client:
        small = [tune_app.parse_payload(t.payload)[1].tokens for t in client.tasks("tune")
                 if t.payload["task"]["table"] == "flash.backward"]
    assert sorted(small) == [4096] * 4 + [2**19] * 4, small
    bad = runner.invoke(cli, ["tune", "plan", "-c", "flash,nosuch"])
    assert bad.exit_code == 1 and "no tunable table" in bad.output


def test_core_batch_resumes_and_stops_at_the_deadline(forward_results, tmp_path):
    results, _ = forward_results
    tasks = [forward_task(cell=tuple(r["task"]["cell"])) for r in results]
    batch = tmp_path / "tasks.jsonl"
    from aotattn.tune.tasks import write_batch

    batch.write_text(write_batch(tasks))
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{tasks[0].id}.json").write_text(json.dumps(results[0]))
    seen = []
    assert offline.run_batch(batch, out, deadline_s=0.0, log=seen.append) == 0  # task 0 done, task 1 past deadline
    assert len(seen) == 1 and "deadline" in seen[0]
    assert _load_results([out]) == [json.loads(json.dumps(results[0]))]
    with pytest.raises(ValueError, match="shard"):
        offline.run_batch(batch, out, shard="2/2")


def test_a_planned_batch_is_measured_with_its_limit_and_size(tmp_path, monkeypatch):
    """`tune plan --limit --tokens --out`: the offline worker and `tune compile` use what was planned."""
    from aotattn.tune import runner as tune_runner

    runner = CliRunner()
    plans = {}
    for name, extra in (("default", []), ("small", ["--limit", "2", "--tokens", "4096"])):
        plans[name] = tmp_path / f"{name}.jsonl"
        planned = runner.invoke(cli, ["tune", "plan", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "64",
                                      "--seqlen", "1024", "--where", "MASK=0 DROPOUT=False", *extra,
                                      "--out", str(plans[name])])
        assert planned.exit_code == 0, planned.output
    lines = [json.loads(line) for line in plans["small"].read_text().splitlines()]
    assert lines and all(line["settings"]["limit"] == 2 and line["settings"]["tokens"] == 4096 for line in lines)
    counts = {}
    for name, path in plans.items():
        counted = runner.invoke(cli, ["tune", "compile", str(path), "--images", str(tmp_path / "img"), "--dry-run"])
        assert counted.exit_code == 0, counted.output
        counts[name] = int(counted.output.split("need")[1].split()[0])
    assert counts["small"] < counts["default"], counts
    seen = []
    monkeypatch.setattr(offline, "run_task", lambda task, settings, **_: seen.append(settings) or {"id": task.id})
    assert offline.run_batch(plans["small"], tmp_path / "out") == len(lines)
    default = tune_runner.Settings.for_table("flash.attn_fwd")
    assert [(s.limit, s.tokens, s.finalists) for s in seen] == [(2, 4096, default.finalists)] * len(lines)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({**lines[0], "settings": {"limit": 0}}) + "\n")
    with pytest.raises(ValueError, match="limit"):
        offline.run_batch(broken, tmp_path / "out2")
    broken.write_text(json.dumps({**lines[0], "settings": [2]}) + "\n")
    with pytest.raises(ValueError, match="settings"):
        offline.run_batch(broken, tmp_path / "out3")


def test_export_of_a_folder_skips_a_result_cut_by_a_crash(forward_results, tmp_path):
    """`tune run` writes <id>.json.tmp and renames it; a crash leaves the half-written tmp
    file in the results folder, which `tune export DIR` read as a result (a JSON error that
    named no file). A malformed result file is named in the error."""
    results, _ = forward_results
    out = tmp_path / "out"
    out.mkdir()
    (out / f"{results[0]['id']}.json").write_text(json.dumps(results[0]))
    (out / f"{results[1]['id']}.json.tmp").write_text(json.dumps(results[1])[:100])  # the crash
    assert _load_results([out]) == [json.loads(json.dumps(results[0]))]
    (out / "edited.json").write_text("{not json")
    with pytest.raises(ValueError, match="edited.json: not JSON"):
        _load_results([out])


def test_checkout_names_a_queued_task_it_cannot_read(dsn, tmp_path):
    """A tune task dispatched without the app's validation (`aotattn pgdef dispatch` with no
    --app) made every `tune checkout` fail with the parse error of a payload it did not name."""
    with Client(dsn) as client:
        client.dispatch("tune,flash.attn_fwd", "sm_90", [{"task": {"arch": "sm_90"}}])
        (bad,) = client.tasks("tune")
    failed = CliRunner().invoke(cli, ["tune", "checkout", "-o", str(tmp_path / "b.json"), "--dsn", dsn])
    assert failed.exit_code == 1
    assert f"queued task {bad.id} (tune,flash.attn_fwd)" in failed.output
    assert f"aotattn pgdef cancel --id {bad.id}" in failed.output
    with Client(dsn) as client:
        assert [t.state for t in client.tasks("tune")] == ["queued"]  # nothing claimed


def test_checkout_claims_the_tasks_it_sized_and_no_others(dsn, tmp_path, monkeypatch):
    """`tune checkout` sizes its batch from a listing, then claims: a task dispatched (or
    re-prioritised) between the two used to be claimed in place of a sized one, and a batch
    whose tasks were all taken meanwhile crashed on None."""
    from aotattn.pgdef import Client as PgClient, TaskSpec

    runner = CliRunner()
    args = ["tune", "dispatch", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "64", "--seqlen", "1024",
            "--dsn", dsn]
    assert runner.invoke(cli, args).exit_code == 0
    listed = PgClient.tasks

    def list_then_a_newcomer(self, *a, **kw):
        seen = listed(self, *a, **kw)
        with PgClient(dsn) as other:  # arrives after the listing, at a higher priority
            other.dispatch("tune,flash.attn_fwd", "sm_90", [TaskSpec(seen[0].payload, key="newcomer", priority=9)])
        return seen

    monkeypatch.setattr(PgClient, "tasks", list_then_a_newcomer)
    batch = tmp_path / "batch.json"
    taken = runner.invoke(cli, ["tune", "checkout", "-o", str(batch), "--dsn", dsn])
    monkeypatch.undo()
    assert taken.exit_code == 0, taken.output
    with PgClient(dsn) as client:
        newcomer = [t for t in client.tasks("tune") if t.key == "newcomer"]
        sized = [t.id for t in client.tasks("tune") if t.key != "newcomer"]
    assert [t["id"] for t in json.loads(batch.read_text())["tasks"]] == sorted(sized)
    assert [t.state for t in newcomer] == ["queued"]

    def list_then_all_taken(self, *a, **kw):
        seen = listed(self, *a, **kw)
        with PgClient(dsn) as other:
            other.cancel("tune")
        return seen

    monkeypatch.setattr(PgClient, "tasks", list_then_all_taken)
    assert runner.invoke(cli, args + ["--rerun", "again"]).exit_code == 0
    again = runner.invoke(cli, ["tune", "checkout", "-o", str(tmp_path / "b2.json"), "--dsn", dsn])
    assert again.exit_code == 0 and "claimed meanwhile" in again.output, again.output
    assert not (tmp_path / "b2.json").exists()
