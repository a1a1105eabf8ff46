"""Perfmon on pgdef against a real PostgreSQL: online workers and an offline batch, each
ending in a perfdb file (tasks run in the interpreter: AOTATTN_PERFMON_DEVICE=cpu)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotattn.cli import app as cli
from aotattn.perfmon import app as perfmon_app
from aotattn.perfmon.budget import Plan
from aotattn.perfmon.entries import Entry
from aotattn.perfmon.measure import Options
from aotattn.perfmon.perfdb import Perfdb
from aotattn.pgdef import Client, PayloadError, Worker, run_offline
from tests.pgdef.conftest import admin_dsn, dsn, template  # noqa: F401  (a real PostgreSQL per test)
from tests.pgdef.conftest import fast_config

APP = "aotattn.perfmon.app"
TINY = Options(Plan(rounds=2, reps=1, warmup=0), peers=False)
ENTRIES = [Entry("t-one", "dense", "bf16", 1, 2, 2, 16, 16, 16, 16, passes=("fwd",)),
           Entry("t-two", "gqa", "fp16", 1, 2, 1, 16, 24, 16, 16, causal=True, passes=("fwd",))]


@pytest.fixture
def cpu_tasks(monkeypatch):
    monkeypatch.setenv(perfmon_app.DEVICE_VAR, "cpu")


def _specs(tag: str):
    return [perfmon_app.task_spec(tag, e, TINY) for e in ENTRIES]


def _check(db: Perfdb, tag: str) -> None:
    assert db.header["tag"] == tag and db.header["mode"] == "interpreter"
    assert list(db.entries) == [e.name for e in ENTRIES] and list(db.entries.values()) == ENTRIES
    ours = [r for r in db.records if r.provider == "aotattn"]
    assert len(ours) == 2 and all(r.ok and r.ms > 0 for r in ours)
    assert Perfdb.from_text(db.to_text()).to_text() == db.to_text()


def test_online_workers_then_export(dsn, cpu_tasks, tmp_path):
    with Client(dsn) as client:
        first = client.dispatch(perfmon_app.CATEGORY, "sm_90", _specs("run1"), app=APP)
        again = client.dispatch(perfmon_app.CATEGORY, "sm_90", _specs("run1"), app=APP)
        assert (first.inserted, again.inserted, again.existing) == (2, 0, 2)  # keyed by tag and entry
        with pytest.raises(PayloadError):
            client.dispatch(perfmon_app.CATEGORY, "sm_90", [{"tag": "run1", "entry": "x"}], app=APP)
        Worker(dsn, [APP], fast_config(pool="sm_90", gpu=0, lease_s=60.0)).run()
        results = client.results(perfmon_app.APP, "sm_90")
    assert sorted(r.key for r in results) == ["run1/t-one", "run1/t-two"]
    out = tmp_path / "run1.txt"
    exported = CliRunner().invoke(cli, ["perfmon", "export", "--tag", "run1", "--dsn", dsn, "--out", str(out)])
    assert exported.exit_code == 0, exported.output
    _check(Perfdb.read(out), "run1")
    none = CliRunner().invoke(cli, ["perfmon", "export", "--tag", "other", "--dsn", dsn, "--out", str(out)])
    assert none.exit_code != 0 and "no perfmon results for tag 'other'" in none.output


def test_offline_batch_then_export_from_the_results_file(dsn, cpu_tasks, tmp_path):
    batch, results = tmp_path / "batch.json", tmp_path / "results.jsonl"
    with Client(dsn) as client:
        client.dispatch(perfmon_app.CATEGORY, "sm_90", _specs("offline"), app=APP)
        assert client.checkout("sm_90", [perfmon_app.CATEGORY], batch) is not None
        report = run_offline(batch, results, [APP], gpu=0)
        assert (report.ran, report.ok, report.errors) == (2, 2, 0)
        assert [r.accepted for r in (client.checkin([results]), client.checkin([results]))] == [2, 0]
    out = tmp_path / "perfdb" / "cpu" / "offline.txt"
    exported = CliRunner().invoke(cli, ["perfmon", "export", "--tag", "offline", str(results),
                                        "--perfdb", str(tmp_path / "perfdb")])
    assert exported.exit_code == 0, exported.output
    _check(Perfdb.read(out), "offline")


@pytest.mark.parametrize("payload, words", [
    ({"tag": "x"}, "bad payload"),
    ({"tag": "x y", "entry": "e", "describe": ENTRIES[0].describe(), "options": {}}, "tag"),
    ({"tag": "x", "entry": "e", "describe": "dtype=bf16", "options": {}}, "missing fields"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 0, "reps": 1, "warmup": 0, "seed": 0,
                                                                "peers": True, "flex": True}}, "rounds"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 1}}, "options"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 1, "reps": 1, "warmup": 0, "seed": 0,
                                                                "peers": True, "flex": "some"}}, "flex a boolean or 'all'"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 1, "reps": 1, "warmup": 0, "seed": 0,
                                                                "peers": True, "flex": True, "hide_host_ms": -1}},
     "hide_host_ms"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 1, "reps": 1, "warmup": 0, "seed": 0,
                                                                "peers": True, "flex": True, "nope": 1}}, "optionally"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 1, "reps": 1, "warmup": 0, "seed": 2**64,
                                                                "peers": True, "flex": True}}, "seed in"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "options": {"rounds": 1, "reps": 1, "warmup": 0, "seed": -1,
                                                                "peers": True, "flex": True}}, "seed in"),
    ({**perfmon_app.payload("x", ENTRIES[0], TINY), "describe": 5}, "bad payload"),  # was an AttributeError
])
def test_malformed_payloads_are_refused(payload, words):
    with pytest.raises(PayloadError, match=words):
        perfmon_app.parse_payload(payload)


def test_a_payload_round_trips():
    tag, entry, options = perfmon_app.parse_payload(perfmon_app.payload("x", ENTRIES[1], TINY))
    assert (tag, entry, options) == ("x", ENTRIES[1], TINY)
    every = dataclasses.replace(TINY, flex="all")
    assert perfmon_app.parse_payload(perfmon_app.payload("x", ENTRIES[1], every))[2] == every
    hidden = dataclasses.replace(TINY, plan=dataclasses.replace(TINY.plan, hide_host_ms=0.5))
    assert perfmon_app.payload("x", ENTRIES[1], hidden)["options"]["hide_host_ms"] == 0.5
    assert "hide_host_ms" not in perfmon_app.payload("x", ENTRIES[1], TINY)["options"]  # older payloads unchanged
    assert perfmon_app.parse_payload(perfmon_app.payload("x", ENTRIES[1], hidden))[2] == hidden


def test_the_gpu_wait_counts_in_the_estimate_but_not_for_training_entries():
    from aotattn.perfmon import entries as E
    from aotattn.perfmon.budget import Plan, entry_seconds
    from aotattn.perfmon.cli import _providers

    dense = next(e for e in E.declared() if e.group == "dense")
    training = next(e for e in E.declared() if e.training)
    for e, extra in ((dense, True), (training, False)):
        providers = _providers(e, True, False)
        calls = 3 * 5 * sum(len(names) for names in providers.values())
        grew = entry_seconds(e, providers, Plan(hide_host_ms=2.0)) - entry_seconds(e, providers, Plan())
        assert grew == pytest.approx(calls * 2.0 / 1e3 if extra else 0.0)


def test_flex_all_times_flexattention_wherever_it_supports_the_entry():
    """``--flex-all``: FlexAttention on entries that do not ask for it, its compile in the
    estimate; never where it cannot run (dropout, bias, varlen, deterministic)."""
    from aotattn.perfmon import entries as E
    from aotattn.perfmon import providers as P
    from aotattn.perfmon.budget import Plan, entry_seconds
    from aotattn.perfmon.cli import _providers

    dense = next(e for e in E.declared() if e.group == "dense" and not e.flex)
    assert "not asked" in P.unsupported(dense, "flex", "fwd", True)
    assert P.unsupported(dense, "flex", "fwd", P.FLEX_ALL) is None and P.unsupported(dense, "flex", "fwd", False)
    for group in ("dropout", "bias", "varlen", "deterministic"):
        e = next(e for e in E.declared() if e.group == group)
        assert P.unsupported(e, "flex", "fwd", P.FLEX_ALL) is not None, group
    asked, every = _providers(dense, True, True), _providers(dense, True, P.FLEX_ALL)
    assert "flex" not in asked["fwd"] and "flex" in every["fwd"] and "flex" in every["bwd"]
    assert entry_seconds(dense, every, Plan()) > entry_seconds(dense, asked, Plan()) + 19


def test_flex_jobs_spread_the_compile_in_the_estimate():
    """``--flex-jobs N``: each entry's FlexAttention compile counts 1/N (the processes
    compiling ahead) plus its cached load, in ``list`` and ``run`` alike; entries without
    FlexAttention cost the same either way."""
    from aotattn.perfmon import entries as E
    from aotattn.perfmon import providers as P
    from aotattn.perfmon.budget import SETUP_S, Plan, entry_seconds
    from aotattn.perfmon.cli import _providers

    dense = next(e for e in E.declared() if e.group == "dense" and not e.flex)
    every, none = _providers(dense, True, P.FLEX_ALL), _providers(dense, True, False)
    serial, spread = entry_seconds(dense, every, Plan()), entry_seconds(dense, every, Plan(), flex_jobs=10)
    assert math.isclose(serial - spread, SETUP_S["flex"] * 0.9 - SETUP_S["flex_cached"])
    assert entry_seconds(dense, none, Plan(), flex_jobs=10) == entry_seconds(dense, none, Plan())

    def estimate(*args):
        result = CliRunner().invoke(cli, ["perfmon", "list", "-g", "model", "--flex-all", *args])
        assert result.exit_code == 0, result.output
        return float(result.output.split("~")[1].split(" s")[0])

    assert estimate("--flex-jobs", "7") < estimate() - 7 * 15
    bad = CliRunner().invoke(cli, ["perfmon", "list", "--flex-jobs", "-1"])
    assert bad.exit_code != 0


def _output(tag: str, **changes) -> dict:
    """A task output as the handler returns it, for an interpreter run of ENTRIES[0]."""
    from aotattn.perfmon.perfdb import Record

    env = {"arch": "cpu", "aotattn": "0.1.0", "tuning": "none", "triton": "3.6.0", "torch": "2.13.0", "gpu": "none",
           "date": "2026-12-05T00:00:00+00:00", "mode": "interpreter", "timing": "wall clock", "command": "test"}
    record = Record(ENTRIES[0].name, "fwd", "aotattn", 1.5, 0.01, 0.2, 1.0, "note")
    out = {"format": perfmon_app.RESULT_FORMAT, "tag": tag, "entry": ENTRIES[0].name,
           "describe": ENTRIES[0].describe(), "environment": env, "records": [perfmon_app.record_to_json(record)]}
    for key, value in changes.items():
        target, _, field = key.partition("__")
        if field:
            out[target] = {**out[target], field: value} if isinstance(out[target], dict) else out[target]
        else:
            out[key] = value
    return out


def test_export_trusts_nothing_in_a_result():
    """Results come from other hosts' files: an arch that is a path (it chose where the file
    was written: ../../tmp), an entry or note that makes an unreadable file, and records that
    are not a list are refused before anything is written."""
    from aotattn.perfmon import perfdb as store

    good = perfmon_app.collect([_output("ok")], "ok")
    assert Perfdb.from_text(good.to_text()).to_text() == good.to_text()
    evil = perfmon_app.collect([_output("ok", environment__arch="../../../tmp/escape")], "ok")
    with pytest.raises(store.PerfdbError, match="arch: expected an architecture like sm_90"):
        store.path_for("ok", evil.header["arch"])
    newline = _output("ok")
    newline["records"][0]["note"] = "line1\nline2"
    db = perfmon_app.collect([newline], "ok")
    with pytest.raises(store.PerfdbError, match="not written, it would not read back: .*a result line has 7 columns"):
        db.write(Path(tempfile.mkdtemp()) / "cpu" / "ok.txt")
    # an entry name that would not read back: with a space, or read as a comment (the file lost it)
    for name in ("bad name", "#" + ENTRIES[0].name, "[entries]"):
        spaced = _output("ok", entry=name)
        spaced["records"][0]["entry"] = name
        with pytest.raises(ValueError, match=f"malformed perfmon result for entry {re.escape(repr(name))}.*entry name"):
            perfmon_app.collect([_output("ok"), spaced], "ok")
    with pytest.raises(ValueError, match="malformed perfmon result .*records: expected a list"):
        perfmon_app.collect([_output("ok", records="notalist")], "ok")
    # a record's figures of another type: "ms": true was written as 1 ms, "ms": "fast" failed in the writer
    for field, value in (("ms", True), ("ms", "fast"), ("ms", float("nan")), ("tflops", -1.0), ("note", 5)):
        bad = _output("ok")
        bad["records"][0][field] = value
        with pytest.raises(ValueError, match=f"malformed perfmon result .*{field}: expected"):
            perfmon_app.collect([bad], "ok")
    # the header's sources: an output without its environment, its date, or with a list for it
    for change in ({"environment": ["x"]}, {"environment": {"arch": "sm_90"}}):
        with pytest.raises(ValueError, match="malformed perfmon result .*environment"):
            perfmon_app.collect([{**_output("ok"), **change}], "ok")
    no_tag = {k: v for k, v in _output("ok").items() if k != "tag"}
    with pytest.raises(ValueError, match="no perfmon results for tag"):
        perfmon_app.collect([no_tag], "ok")


def test_export_refuses_an_entry_named_like_a_comment(tmp_path):
    """An entry named '#...' in a results file was exported as a comment line: the file read
    back without it, and the export said nothing."""
    results = tmp_path / "results.jsonl"
    lines = [json.dumps({"format": "pgdef-results/1", "batch_id": "b" * 32, "host": "h"})]
    for i, name in enumerate([ENTRIES[0].name, "#" + ENTRIES[0].name]):
        output = _output("t", entry=name)
        output["records"][0]["entry"] = name
        lines.append(json.dumps({"task_id": i + 1, "attempt": 1, "ok": True, "output": output, "error": None,
                                 "permanent": False, "elapsed_s": 0.1, "worker_id": "w"}))
    results.write_text("\n".join(lines) + "\n")
    exported = CliRunner().invoke(cli, ["perfmon", "export", "--tag", "t", str(results), "--perfdb",
                                        str(tmp_path / "perfdb")])
    assert exported.exit_code != 0 and "entry name '#" in str(exported.output) + str(exported.exception)
    assert not list(tmp_path.rglob("t.txt"))


def test_export_from_the_cli_refuses_an_arch_that_is_a_path(tmp_path):
    results = tmp_path / "results.jsonl"
    line = {"task_id": 1, "attempt": 1, "ok": True, "output": _output("t", environment__arch="../escape"),
            "error": None, "permanent": False, "elapsed_s": 0.1, "worker_id": "w"}
    results.write_text(json.dumps({"format": "pgdef-results/1", "batch_id": "b" * 32, "host": "h"}) + "\n"
                       + json.dumps(line) + "\n")
    exported = CliRunner().invoke(cli, ["perfmon", "export", "--tag", "t", str(results), "--perfdb",
                                        str(tmp_path / "perfdb")])
    assert exported.exit_code == 1 and "arch: expected an architecture" in exported.output, exported.output
    assert not (tmp_path / "escape").exists() and not list(tmp_path.rglob("t.txt"))
