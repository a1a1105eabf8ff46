"""Test applications for pgdef: handlers that sleep, fail, cut their own connection, return junk."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from aotattn.pgdef import App, PayloadError, TaskContext
from aotattn.pgdef.toy import check_number

app = App("testapp", "pgdef test kinds")


@app.task("square", validate=check_number)
def square(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return {"y": payload["x"] * payload["x"], "attempt": ctx.task.attempt}


@app.task("sleep")
def sleep(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Sleeps ``first_s`` on the first attempt and ``s`` on later ones, then squares ``x``."""
    time.sleep(payload.get("first_s", payload.get("s", 0)) if ctx.task.attempt == 1 else payload.get("s", 0))
    return {"y": payload["x"] * payload["x"], "worker": ctx.worker_id}


@app.task("flaky", max_attempts=5)
def flaky(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Fails on its first ``fail_times`` attempts."""
    if ctx.task.attempt <= payload["fail_times"]:
        raise RuntimeError(f"flaky failure on attempt {ctx.task.attempt}")
    return {"attempt": ctx.task.attempt}


@app.task("boom")
def boom(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Raises ValueError, or with ``exit`` SystemExit (a handler calling sys.exit)."""
    if "exit" in payload:
        raise SystemExit(payload["exit"])
    raise ValueError(f"boom: {payload['msg']}")


@app.task("strict")
def strict(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    if "n" not in payload:
        raise PayloadError(f"strict needs n, got keys {sorted(payload)}")
    return {"n": payload["n"]}


@app.task("junk")
def junk(payload: dict[str, Any], ctx: TaskContext) -> Any:
    return {"not json": {1, 2}}


@app.task("deep")
def deep(payload: dict[str, Any], ctx: TaskContext) -> Any:
    """Output nested past the JSON encoder's depth (it took the worker down, task after task)."""
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    return {"deep": nested}


@app.task("unstorable")
def unstorable(payload: dict[str, Any], ctx: TaskContext) -> Any:
    """Output or an error text PostgreSQL refuses: a NUL character or a lone surrogate."""
    text = {"nul": "a\x00b", "surrogate": "\ud800"}[payload["what"]]
    if payload.get("raise"):
        raise RuntimeError(f"bad {text} byte")
    return {"s": text} if payload.get("as") != "key" else {text: 1}


@app.task("cut")
def cut(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Terminates this worker's own database sessions (claims and heartbeat) mid-task."""
    time.sleep(payload.get("wait_s", 0))
    with psycopg.connect(payload["admin_dsn"], autocommit=True) as admin:
        killed = admin.execute(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name IN (%s, %s)) AS t",
            (f"pgdef-worker:{ctx.worker_id}", f"pgdef-heartbeat:{ctx.worker_id}")).fetchone()[0]
    return {"y": payload["x"] * payload["x"], "killed": killed}


@app.task("gpusquare", device="gpu")
def gpusquare(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    return {"y": payload["x"] * payload["x"], "gpu": ctx.gpu}
