"""The CLI end to end: the toy application on the embedded default with two worker
processes and one offline batch; one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from aotattn.pgdef import EmbeddedServer, cli
from aotattn.pgdef.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture
def embedded_env(tmp_path, monkeypatch):
    """No DSN anywhere: every command uses the embedded server in a private work folder."""
    home = tmp_path / "home"
    monkeypatch.delenv("AOTATTN_PGDEF_DSN", raising=False)
    monkeypatch.setenv("AOTATTN_PGDEF_HOME", str(home))
    yield home
    EmbeddedServer(home).destroy()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    monkeypatch.setattr(cli.console, "width", 200)


def _stopped_workers(home: Path) -> set[str]:
    with psycopg.connect(EmbeddedServer(home).dsn) as conn:
        return {row[0] for row in conn.execute("SELECT id FROM pgdef_worker WHERE stopped_at IS NOT NULL")}


def _ok(*args: str, input: str | None = None) -> str:
    result = runner.invoke(app, list(args), input=input)
    assert result.exit_code == 0, result.output
    return result.output


def test_toy_end_to_end_on_the_embedded_default(embedded_env, tmp_path):
    # fsync off keeps the test fast; without `server start`, `init` would start it with fsync on.
    assert _ok("server", "start", "--fast").startswith("postgresql://postgres@127.0.0.1:")
    assert "migrations 1" in _ok("init")
    payloads = "".join(json.dumps({"x": x}) + "\n" for x in range(-20, 40))
    assert "60 queued, 0 already" in _ok("dispatch", "-c", "toy,square", "-p", "cpu", "--payloads", "-",
                                         "--app", "aotattn.pgdef.toy", input=payloads)
    assert "0 queued, 60 already" in _ok("dispatch", "-c", "toy,square", "-p", "cpu", "--payloads", "-",
                                         input=payloads)
    _ok("dispatch", "-c", "toy,square", "-p", "sm_90", "--payload", '{"x": 1000}', "--payload", '{"x": 1001}')
    env = {k: v for k, v in os.environ.items() if k != "AOTATTN_PGDEF_DSN"}
    start = time.monotonic()
    workers = subprocess.run(
        [sys.executable, "-m", "aotattn.pgdef", "worker", "--app", "aotattn.pgdef.toy", "--processes", "2",
         "--exit-when-idle", "--poll", "0.1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert workers.returncode == 0, workers.stderr
    assert "2 workers finished, exit codes [0, 0]" in workers.stdout
    print(f"two worker processes took {time.monotonic() - start:.1f} s")
    lines = [json.loads(line) for line in _ok("results", "-c", "toy,square", "-p", "cpu").splitlines()]
    assert sorted(r["payload"]["x"] for r in lines) == list(range(-20, 40))
    assert all(r["output"]["y"] == r["payload"]["x"] ** 2 for r in lines)
    done = [int(line.split()[2]) for line in workers.stdout.splitlines() if line.startswith("worker done:")]
    assert len(done) == 2 and sum(done) == 60  # two workers ran (a fast one may take every task)
    stopped = _stopped_workers(embedded_env)
    assert len(stopped) == 2 and {r["worker"] for r in lines} <= stopped

    # The sm_90 tasks go through one offline batch, checked in twice.
    batch, results = tmp_path / "batch.json", tmp_path / "results.jsonl"
    assert "2 tasks in" in _ok("checkout", "-c", "toy,square", "-p", "sm_90", "-o", str(batch))
    assert "2 tasks run (2 ok" in _ok("run-offline", str(batch), "--app", "aotattn.pgdef.toy", "-r", str(results))
    assert "2 results accepted" in _ok("checkin", str(results))
    assert "0 results accepted, 2 already had one" in _ok("checkin", str(results))
    offline = [json.loads(line) for line in _ok("results", "-p", "sm_90").splitlines()]
    assert sorted(r["output"]["y"] for r in offline) == [1000 ** 2, 1001 ** 2]

    status = _ok("status")
    assert "toy,square" in status and "sm_90" in status and "live workers (0)" in status
    assert "running: postgresql://" in _ok("server", "status")
    assert "stopped" in _ok("server", "stop")
    assert "not running" in _ok("server", "status")


def test_cli_errors_are_one_line(dsn, tmp_path):
    bad = runner.invoke(app, ["dispatch", "-c", "toy,square", "-p", "cpu", "--payload", "{x", "--dsn", dsn])
    assert bad.exit_code == 1 and "not JSON" in bad.output and "Traceback" not in bad.output
    assert "give --category" in runner.invoke(app, ["cancel", "--dsn", dsn]).output
    unknown = runner.invoke(app, ["worker", "--app", "no.such.module", "--dsn", dsn])
    assert unknown.exit_code == 1 and "cannot import application module" in unknown.output
    shard = runner.invoke(app, ["run-offline", str(tmp_path / "b.json"), "--app", "aotattn.pgdef.toy",
                                "-r", str(tmp_path / "r"), "--shard", "2"])
    assert shard.exit_code == 1 and "I/N" in shard.output
    missing = runner.invoke(app, ["checkin", str(tmp_path / "nothing.jsonl"), "--dsn", dsn])
    assert missing.exit_code == 1 and "cannot read results file" in missing.output
    for name in (".relative", ":app"):  # a relative name was "internal error: TypeError", an empty one bare
        bad_app = runner.invoke(app, ["dispatch", "-c", "toy,square", "-p", "cpu", "--payload", "{}", "--app", name,
                                      "--dsn", dsn])
        assert bad_app.exit_code == 1 and "cannot import application module" in bad_app.output, bad_app.output
        assert "expected --app package.module[:attribute]" in bad_app.output and "internal" not in bad_app.output


def test_a_server_that_is_down_gives_one_line_after_the_pools_wait(tmp_path):
    """psycopg_pool's warning on each failed attempt went to stderr through Python's last-resort
    handler: ten lines before the one-line error."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "AOTATTN_PGDEF_DSN"}
    done = subprocess.run([sys.executable, "-m", "aotattn.pgdef", "status", "--dsn",
                           f"postgresql://postgres@127.0.0.1:{port}/x"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "cannot connect" in done.stderr, done.stderr


@pytest.mark.parametrize("args, words", [
    (["worker", "--app", "aotattn.pgdef.toy", "--lease", "inf"], "lease_s"),
    (["worker", "--app", "aotattn.pgdef.toy", "--poll", "nan"], "poll_s"),
    (["worker", "--app", "aotattn.pgdef.toy", "--reconnect-timeout", "-1"], "reconnect_timeout_s"),
    (["worker", "--app", "aotattn.pgdef.toy", "--gpus", "a"], "--gpus"),
    (["worker", "--app", "aotattn.pgdef.toy", "--gpus", "0,-1"], "--gpus"),
    (["worker", "--app", "aotattn.pgdef.toy", "--gpus", "1,0,1"], "each GPU once"),  # two workers on GPU 1
    (["worker", "--app", "aotattn.pgdef.toy", "--processes", "-1"], "--processes"),  # ran one worker
    (["worker", "--app", "aotattn.pgdef.toy", "--processes", "0"], "1 or more CPU worker processes"),
    (["worker", "--app", "aotattn.pgdef.toy", "--gpus", "0", "--processes", "-2"], "0 or more CPU worker"),
    # the children were CPU workers: --gpu was dropped from their arguments
    (["worker", "--app", "aotattn.pgdef.toy", "--gpu", "0", "--processes", "2"], "--gpu runs one worker"),
    (["worker", "--app", "aotattn.pgdef.toy", "--gpu", "0", "--gpus", "1"], "--gpu runs one worker"),
    (["worker", "--app", "aotattn.pgdef.toy", "--max-tasks", "0"], "max_tasks"),  # exited at once, rc 0
    (["bench", "--workers", "x"], "--workers"),  # was "invalid literal for int()"
    (["bench", "--claim-batch", "4,0"], "--claim-batch"),
    (["status", "--window", "nan"], "window_s"),
    (["retry", "--id", str(2**64)], "task ids"),
    (["cancel", "--id", "0"], "task ids"),
    (["checkout", "-c", "toy,square", "-p", "cpu", "--lease", "1e300", "--out", "{tmp}/b.json"], "lease_s"),
])
def test_out_of_range_durations_and_ids_are_refused_before_the_database_sees_them(args, words, dsn, tmp_path):
    """They reached PostgreSQL as 'interval out of range', 'timestamp out of range' or
    'bigint out of range'; a bad --gpus was 'invalid literal for int()'."""
    result = runner.invoke(app, [a.format(tmp=tmp_path) for a in args] + ["--dsn", dsn])
    assert result.exit_code in (1, 2) and words in result.output and "out of range" not in result.output, \
        result.output
    assert "Traceback" not in result.output and not (tmp_path / "b.json").exists()


def test_cli_errors_go_to_stderr_on_one_line_also_through_python_m(dsn, admin_dsn):
    """`python -m aotattn.pgdef` is the same CLI, errors included; a server that answers and
    refuses (no such database) is reported at once with its reason, not after a wait."""
    from aotattn.pgdef.connection import with_database

    env = {k: v for k, v in os.environ.items() if k != "AOTATTN_PGDEF_DSN"}
    cases = [(["dispatch", "-c", "toy,square", "-p", "cpu", "--payloads", "/no/such/file", "--dsn", dsn],
              "No such file"),
             (["status", "--dsn", "notadsn"], "invalid DSN"),
             (["status", "--dsn", with_database(admin_dsn, "pgdef_no_such_database")], "does not exist"),
             # a worker waited its 300 s of reconnect timeout, as if a live connection had been lost
             (["worker", "--app", "aotattn.pgdef.toy", "--exit-when-idle", "--dsn",
               with_database(admin_dsn, "pgdef_no_such_database")], "does not exist")]
    for args, reason in cases:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "aotattn.pgdef", *args], capture_output=True, text=True,
                              cwd=REPO, env=env, timeout=120)
        assert done.returncode == 1 and done.stdout == "", (args, done.stdout)
        lines = [line for line in done.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and reason in lines[0] and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)  # no warnings before it
        assert time.monotonic() - start < 15, args


def test_cli_retry_cancel_and_status_on_a_dsn(dsn):
    _ok("dispatch", "-c", "testapp,boom", "-p", "cpu", "--payload", '{"msg": "cli"}', "--max-attempts", "1",
        "--dsn", dsn)
    _ok("dispatch", "-c", "testapp,square", "-p", "cpu", "--payload", '{"x": 2}', "--dsn", dsn)
    assert "1 tasks cancelled" in _ok("cancel", "-c", "testapp,square", "--dsn", dsn)
    from tests.pgdef.conftest import run_workers

    run_workers(dsn)
    status = _ok("status", "--dsn", dsn)
    assert "failures" in status and "boom: cli" in status
    assert "1 tasks re-queued" in _ok("retry", "-c", "testapp", "--dsn", dsn)
    assert "1 tasks re-queued" in _ok("retry", "--cancelled", "--dsn", dsn)


def test_sigterm_to_a_multi_process_worker_stops_its_workers(dsn):
    """SIGTERM to `pgdef worker -n 2` reaches both workers, which stop (and say so in the
    database); before, the parent died and its workers ran on, orphaned, claiming tasks."""
    import signal

    env = {k: v for k, v in os.environ.items() if k != "AOTATTN_PGDEF_DSN"}
    parent = subprocess.Popen(
        [sys.executable, "-m", "aotattn.pgdef", "worker", "--app", "aotattn.pgdef.toy", "--processes", "2",
         "--poll", "0.1", "--dsn", dsn], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)  # its own group: only the parent gets the signal
    try:
        deadline = time.monotonic() + 60
        with psycopg.connect(dsn, autocommit=True) as conn:
            while conn.execute("SELECT count(*) FROM pgdef_worker").fetchone()[0] < 2:
                assert time.monotonic() < deadline and parent.poll() is None, parent.communicate()
                time.sleep(0.2)
        parent.send_signal(signal.SIGTERM)
        out, err = parent.communicate(timeout=60)
        assert parent.returncode == 0 and "2 workers finished, exit codes [0, 0]" in out, out + err
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT count(*) FROM pgdef_worker WHERE stopped_at IS NULL").fetchone()[0] == 0
    finally:  # the whole group: the workers too, should they have outlived their parent
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
