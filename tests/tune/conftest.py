"""Fixtures of the tuner's tests: tiny tasks run for real in Triton's interpreter.

The interpreter's clock says nothing about speed; these runs exercise every step of a
task (candidates, accuracy against the float64 reference, probe and full timing, gate,
journal, result) at sizes where one task takes seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aotattn.spec import Functional
from aotattn.tune.runner import Settings
from aotattn.tune.tasks import Task
from aotattn.tuning import Database
from tests.pgdef.conftest import admin_dsn, client, dsn, template  # noqa: F401  (a real PostgreSQL per test)

PROJECT_TUNING = Path(__file__).resolve().parents[2] / "tuning"
# finalist_margin: every probed candidate may be a finalist (the interpreter's clock is noise)
TINY = Settings(tokens=64, min_traffic_bytes=0, accuracy_batch=2, accuracy_heads=2, limit=2, finalists=2, finalist_margin=1e3,
                repeats=(1, 2))


def forward_task(cell=(16, 16), head_dim=16, mask=2, dtype="bf16") -> Task:
    f = dict(dtype=dtype, BLOCK_D=head_dim, BLOCK_DV=head_dim, PAD_HEAD=False, MASK=mask, VARLEN=False,
             DROPOUT=False, BIAS=0)
    return Task("sm_90", "flash.attn_fwd", Functional.of(f), cell)


@pytest.fixture
def tuning_copy(tmp_path) -> Database:
    """A private copy of the project's tuning database without its tuner-written patches
    (exports write into it, numbering and merging as on a database never tuned)."""
    root = tmp_path / "tuning"
    shutil.copytree(PROJECT_TUNING, root, ignore=shutil.ignore_patterns("*-tuned.dbpatch"))
    return Database(root)


@pytest.fixture(scope="session")
def forward_results(tmp_path_factory):
    """Two real forward tasks (cells 16 and 32), run once for the session, and their journal folder."""
    from aotattn.tune.runner import run_task

    journal = tmp_path_factory.mktemp("journal")
    db = Database(PROJECT_TUNING)
    results = [run_task(forward_task(cell=(s, s)), TINY, device="cpu", db=db, journal=journal) for s in (16, 32)]
    return results, journal
