"""Export of real (interpreter) results as .dbpatch layers of a copy of the database."""

from __future__ import annotations

import copy

import pytest

from aotattn.families.flash import rules
from aotattn.spec import Config
from aotattn.tune import export
from aotattn.tune.tasks import Task
from aotattn.tuning import Database, parse_patch


def _lookup(db: Database, result: dict, cell=None) -> Config:
    task = Task.from_json(result["task"])
    sq, sk = cell or task.cell
    return Database(db.root).lookup("sm_90", rules.ATTN_FWD, task.functional, {"seqlen_q": sq, "seqlen_k": sk})


def test_export_sets_exactly_the_tuned_cells(forward_results, tuning_copy):
    results, _ = forward_results
    before = {cell: _lookup(tuning_copy, results[0], cell) for cell in ((64, 64), (16, 32), (32, 16))}
    done = export.export(results, tuning_copy, allow_cpu_clock=True)
    assert len(done) == 1 and done[0].cells == 2 and done[0].kept == 0
    path = done[0].path
    assert path.name == "flash.attn_fwd.0001-tuned.dbpatch"
    for result in results:
        assert _lookup(tuning_copy, result) == Config.of(result["winner_config"])
    for cell, config in before.items():  # neighbours, off-diagonal cells: untouched
        assert _lookup(tuning_copy, results[0], cell) == config
    text = path.read_text()
    assert text.startswith("# Tuned by aotattn tune 1") and "2 cells" in text.splitlines()[0]
    for result in results:
        winner = next(c for c in result["candidates"] if c["name"] == result["winner"])
        assert f"{winner['median_ms']:.4f} ms, error {winner['error']:.2e}" in text
    assert not Database(tuning_copy.root).lint()  # valid and canonical with the patch in place


def test_reexport_replaces_only_its_cells(forward_results, tuning_copy):
    results, _ = forward_results
    export.export(results, tuning_copy, allow_cpu_clock=True)
    # a later run of the first task chooses another (eligible, timed) candidate
    rerun = copy.deepcopy(results[0])
    other = next(c for c in rerun["candidates"] if c["name"] != rerun["winner"] and c.get("median_ms"))
    rerun.update(winner=other["name"], winner_config=other["config"], date="2999-01-01T00:00:00+00:00")
    done = export.export([rerun], tuning_copy, allow_cpu_clock=True)
    assert done[0].cells == 1 and done[0].kept == 1
    assert _lookup(tuning_copy, rerun) == Config.of(other["config"])
    assert _lookup(tuning_copy, results[1]) == Config.of(results[1]["winner_config"])
    patch = parse_patch(rules.ATTN_FWD, done[0].path.read_text())
    assert len(patch.edits) == 2
    cell_lines = [c for c in patch.comments if c.startswith("# cell ")]
    assert len(cell_lines) == 2 and sum(other["name"] in c for c in cell_lines) >= 1
    # the newest result of a task wins when both come at once
    assert export.latest([results[0], rerun])[0]["winner"] == other["name"]


def test_refusals(forward_results, tuning_copy):
    results, _ = forward_results
    with pytest.raises(ValueError, match="CUDA events"):
        export.export(results, tuning_copy)
    with pytest.raises(ValueError, match="tuner results"):
        export.export([{"format": "something else"}], tuning_copy)
    forged = copy.deepcopy(results[0])
    forged["id"] = "0" * 20
    with pytest.raises(ValueError, match="does not match"):
        export.export([forged], tuning_copy, allow_cpu_clock=True)
    nothing = copy.deepcopy(results[0])
    nothing.update(winner=None, winner_config=None)
    done = export.export([nothing], tuning_copy, allow_cpu_clock=True, dry_run=True)
    assert done[0].cells == 0 and len(done[0].empty) == 1 and not done[0].path.exists()
