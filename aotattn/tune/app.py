"""The tuner as a pgdef application: one GPU task kind per tunable table.

Category ``tune,<family>.<table>`` (``tune,flash.attn_fwd``), pool = the architecture
(``sm_90``), payload ``{"task": Task.to_json(), "settings": Settings.to_json()}``, key =
the task's id (so dispatching a task twice queues it once; ``rerun`` adds a suffix).
Workers load it as ``--app aotattn.tune.app``: online (``aotattn pgdef worker``) or
offline (``aotattn pgdef run-offline``), with the image folder in ``$AOTATTN_IMAGES`` and
the per-task journals in ``$AOTATTN_TUNE_JOURNAL`` (``$AOTATTN_TUNE_DEVICE=cpu``: in the
interpreter, for tests; export refuses such results).

The handler's output is the task's result (docs/tuner.md, "Results"). A CUDA error that
leaves the device unusable ends the worker process (exit status 3) after journaling: a
dead context cannot run the next task; the restarted worker resumes from the journal.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

from aotattn.pgdef import App, PayloadError, TaskContext, TaskSpec
from aotattn.tune import harnesses
from aotattn.tune.runner import EXIT_DEVICE_LOST, DeviceLost, Settings, journal_dir, run_task
from aotattn.tune.tasks import SelectionError, Task

APP = "tune"
# "cpu" runs tasks in Triton's interpreter (tests of the plumbing; its times mean nothing)
DEVICE_VAR = "AOTATTN_TUNE_DEVICE"
log = logging.getLogger("aotattn.tune")

app = App(APP, "the tuner: one cell of one tuning table per task (docs/tuner.md)")


def category(table: str) -> str:
    return f"{APP},{table}"


def payload(task: Task, settings: Settings) -> dict[str, Any]:
    return {"task": task.to_json(), "settings": settings.to_json()}


def task_spec(task: Task, settings: Settings, rerun: str | None = None, priority: int = 0) -> TaskSpec:
    """A pgdef task for one tuning task; ``rerun`` (any text) makes a new key, to measure again."""
    return TaskSpec(payload(task, settings), key=task.id if rerun is None else f"{task.id}:{rerun}",
                    priority=priority)


def parse_payload(data: dict[str, Any]) -> tuple[Task, Settings]:
    try:
        task = Task.from_json(data.get("task"))
        settings = Settings.from_json(data.get("settings"))
    except (SelectionError, ValueError, TypeError, AttributeError) as exc:
        raise PayloadError(f"tune: bad payload ({exc}); expected {{'task': ..., 'settings': ...}} "
                           "as aotattn tune dispatch writes it") from exc
    if not harnesses.supported(task.table, task.functional, task.cell, task.arch):
        raise PayloadError(f"tune: no harness can build {task.describe()}")
    return task, settings


def _validate(data: dict[str, Any]) -> None:
    parse_payload(data)


def handle(data: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Tune one cell on this worker's GPU (its only visible one)."""
    import torch

    task, settings = parse_payload(data)
    device = os.environ.get(DEVICE_VAR, "cuda")
    if device not in ("cuda", "cpu"):
        raise RuntimeError(f"{DEVICE_VAR}: expected cuda or cpu, got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("tune tasks run on a GPU worker; this process sees no CUDA device "
                               f"({DEVICE_VAR}=cpu runs them in the interpreter, for tests)")
        from aotattn.runtime.device import arch_of

        found = arch_of(torch.device("cuda"))
        if found != task.arch:
            raise RuntimeError(f"this worker's GPU is {found}, the task is for {task.arch}: run it in pool {task.arch}")
    try:
        return run_task(task, settings, device=device, journal=journal_dir(), run_key=ctx.task.key,
                        log=lambda line: log.info("%s: %s", task.id, line))
    except DeviceLost as exc:
        print(f"tune: device lost in task {task.id} ({exc}); ending the worker so it restarts with a new "
              "context (the task resumes from its journal)", file=sys.stderr, flush=True)
        os._exit(EXIT_DEVICE_LOST)


def _register(tables: Iterable[str]) -> None:
    for table in tables:
        app.add(table, handle, device="gpu", max_attempts=3, validate=_validate,
                description=f"tune one cell of {table}")


_register(harnesses.tunable())
