"""Compile-ahead: the jobs a batch needs, and images the worker finds its candidates in."""

from __future__ import annotations

import dataclasses

import pytest

import torch

from aotattn.families.flash import rules
from aotattn.spec import Functional
from aotattn.tune import ahead, flash
from aotattn.tune.estimate import knob_combinations
from aotattn.tune import candidates as cand
from aotattn.tune.runner import Settings, image_lookup
from aotattn.tune.tasks import Task
from aotattn.tuning import Database
from tests.tune.conftest import PROJECT_TUNING, forward_task


def test_backward_tasks_need_their_auxiliary_kernels():
    f = dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0)
    db = Database(PROJECT_TUNING)
    settings = Settings(limit=3)
    dq = Task("sm_90", "flash.attn_bwd_dq", Functional.of(f), (1024, 1024))
    jobs = ahead.task_jobs(dq, settings, db)
    tables = [j.table for j in jobs]
    assert 3 <= tables.count("flash.attn_bwd_dq") <= 4  # 3 ranked + the current choice
    # the problem's forward runs the kernel flash.forward chooses: both are built
    assert {"flash.attn_fwd", "flash.attn_fwd_ws", "flash.attn_bwd_preprocess"} <= set(tables)
    fwd = next(j for j in jobs if j.table == "flash.attn_fwd")
    assert fwd.functional == Functional.of(f) and fwd.config == db.lookup("sm_90", fwd.spec(), fwd.functional,
                                                                          {"seqlen_q": 1024, "seqlen_k": 1024})
    op = Task("sm_90", "flash.backward", Functional.of(dict(dtype="bf16", BLOCK_D=64, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0, DETERMINISTIC=True)),
              (1024, 1024))
    op_tables = {j.table for j in ahead.task_jobs(op, settings, db)}
    assert op_tables == {"flash.attn_fwd", "flash.attn_fwd_ws", "flash.attn_bwd_preprocess", "flash.attn_bwd_dkdv",
                         "flash.attn_bwd_dq", "flash.attn_bwd_fused"}  # deterministic: not the ws backward
    nondet = dataclasses.replace(op, functional=Functional.of({**op.functional.as_dict(), "DETERMINISTIC": False}))
    assert "flash.attn_bwd_ws" in {j.table for j in ahead.task_jobs(nondet, settings, db)}
    fused = next(j for j in ahead.task_jobs(op, settings, db) if j.table == "flash.attn_bwd_fused")
    assert fused.functional["ATOMIC_DQ"] is False  # deterministic: no atomics
    both = ahead.plan([(dq, settings), (dq, settings), (op, settings)], db)
    assert len(both) == len({(j.table, j.functional, j.config) for j in both})


def test_a_grouped_backward_task_builds_the_grouped_ws_tiles():
    """A grouped problem's ws backward launches the GROUPED=True tile; the task must build
    that image, not the ungrouped cell's (the tuner found ws missing on every grouped cell)."""
    db = Database(PROJECT_TUNING)
    settings = Settings(limit=3)
    for d, cell in ((64, (1024, 1024)), (128, (4096, 4096)), (64, (16, 16))):
        f = dict(dtype="fp16", BLOCK_D=d, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0,
                 DETERMINISTIC=False, GROUPED=True)
        task = Task("sm_90", "flash.backward", Functional.of(f), cell)
        ws = [j for j in ahead.task_jobs(task, settings, db) if j.table == "flash.attn_bwd_ws"]
        assert ws and all(j.functional["GROUPED"] is True for j in ws)
        problem = dataclasses.replace(task, functional=Functional.of(f))
        shapes = [*flash.accuracy_shapes(problem.functional, cell, settings.accuracy_batch, settings.accuracy_heads)]
        for shape in shapes:  # the configuration the launch plan looks up, for each problem size
            grouped = db.lookup("sm_90", rules.ATTN_BWD_WS, ws[0].functional,
                                {"seqlen_q": shape.seqlen_q, "seqlen_k": shape.seqlen_k})
            assert grouped in {j.config for j in ws}
        plain = dataclasses.replace(task, functional=Functional.of({**f, "GROUPED": False}))
        ungrouped = [j for j in ahead.task_jobs(plain, settings, db) if j.table == "flash.attn_bwd_ws"]
        assert ungrouped and all("GROUPED" not in j.functional.as_dict() for j in ungrouped)


def test_compiled_images_hold_every_candidate(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from aotattn.runtime.images import Archive, archive_path

    task = forward_task(cell=(4096, 4096), head_dim=16)
    settings = dataclasses.replace(Settings(), limit=1)
    jobs = ahead.plan([(task, settings)], Database(PROJECT_TUNING))
    # the speed model's best, the current choice and its tile's knob variants (OVERLAP, TMA)
    assert 1 <= len(jobs) <= 1 + knob_combinations(rules.ATTN_FWD)
    report = ahead.compile_ahead(jobs, tmp_path / "images", tmp_path / "cache", workers=2)
    assert not report.failures and report.seconds_per_kernel() > 0
    archive = Archive(archive_path(tmp_path / "images", "sm_90", task.table))
    for job in jobs:
        entry = archive.entry(flash.image_key(task.table, task.functional, job.config))
        assert entry is not None and entry.shared > 0
    # what the worker looks up before timing on a GPU (no GPU is touched to look)
    monkeypatch.setenv("AOTATTN_IMAGES", str(tmp_path / "images"))
    monkeypatch.setenv("AOTATTN_MODE", "aot")
    lookup = image_lookup(task, torch.device("cuda"))
    assert all(lookup(job.config) is not None for job in jobs)
    missing = next(c for c in cand.space(rules.ATTN_FWD) if c not in {j.config for j in jobs})
    assert lookup(missing) is None
    assert image_lookup(task, torch.device("cpu")) is None
    monkeypatch.setenv("AOTATTN_IMAGES", str(tmp_path / "nowhere"))
    assert image_lookup(task, torch.device("cuda"))(jobs[0].config) is None
