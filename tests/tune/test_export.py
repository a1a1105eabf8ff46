"""Export of real (interpreter) results as .dbpatch layers of a copy of the database."""

from __future__ import annotations

import copy
import math

import pytest

from aotattn.families.flash import rules
from aotattn.spec import Config
from aotattn.tune import export
from aotattn.tune.candidates import config_name
from aotattn.tune.tasks import Task
from aotattn.tuning import Database, parse_patch
from aotattn.tuning.format import format_functional


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
    assert text.startswith("# Tuned by aotattn tune 1") and "2 cells; the last export's 2 on" in text.splitlines()[0]
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
    for task in (None, "sm_90", ["sm_90"]):  # a result without its task: one line, not a KeyError
        taskless = {k: v for k, v in copy.deepcopy(results[0]).items() if k != "task"}
        if task is not None:
            taskless["task"] = task
        with pytest.raises(ValueError, match="no task"):
            export.export([taskless], tuning_copy, allow_cpu_clock=True)
    forged = copy.deepcopy(results[0])
    forged["id"] = "0" * 20
    with pytest.raises(ValueError, match="does not match"):
        export.export([forged], tuning_copy, allow_cpu_clock=True)
    nothing = copy.deepcopy(results[0])
    nothing.update(winner=None, winner_config=None)
    done = export.export([nothing], tuning_copy, allow_cpu_clock=True, dry_run=True)
    assert done[0].cells == 0 and len(done[0].empty) == 1 and not done[0].path.exists()
    assert done[0].empty[0].endswith(": no eligible candidate")  # a result from before `no_winner`
    nothing["no_winner"] = "the current choice split launches a kernel the batch lacks (...)"
    (why,) = export.export([nothing], tuning_copy, allow_cpu_clock=True, dry_run=True)[0].empty
    assert why.endswith(nothing["no_winner"]) and why.startswith(Task.from_json(nothing["task"]).describe())


def _edit_winner(result: dict, **changes) -> dict:
    edited = copy.deepcopy(result)
    winner = next(c for c in edited["candidates"] if c["name"] == edited["winner"])
    winner.update(changes)
    return edited


@pytest.mark.parametrize("edit, match", [
    (lambda r: {**r, "winner": "m999_n1_w1_s1"}, "winner m999_n1_w1_s1 is not one of its candidates"),
    (lambda r: {**r, "candidates": []}, "is not one of its candidates"),
    (lambda r: _edit_winner(r, median_ms=math.nan), "median_ms nan"),
    (lambda r: _edit_winner(r, median_ms=math.inf), "median_ms inf"),
    (lambda r: _edit_winner(r, median_ms=-0.5), "median_ms -0.5"),
    (lambda r: _edit_winner(r, median_ms=None), "median_ms None"),
    (lambda r: _edit_winner(r, error=None), "error None"),
    (lambda r: _edit_winner(r, eligible=False), "not eligible"),
    (lambda r: {**r, "winner_config": {**r["winner_config"], "BLOCK_N": 2 * r["winner_config"]["BLOCK_N"]}},
     "winner_config .* is not the config of its winner"),
    (lambda r: {k: v for k, v in r.items() if k != "date"}, "date"),
])
def test_a_result_whose_winner_was_not_measured_is_refused(forward_results, tuning_copy, edit, match):
    """An edited, cut or corrupt result must not write an unmeasured configuration into the
    database (it did: a NaN or negative time was exported as a winner), nor end in a
    KeyError: a ValueError names the result."""
    results, _ = forward_results
    bad = edit(copy.deepcopy(results[0]))
    with pytest.raises(ValueError, match=f"result {results[0]['id']}: .*{match}"):
        export.export([bad, results[1]], tuning_copy, allow_cpu_clock=True, dry_run=True)


@pytest.mark.parametrize("knob, value", [("FOO", 1), ("BLOCK_M", 3)])
def test_a_winner_outside_the_tuning_space_is_refused(forward_results, tuning_copy, knob, value):
    """A winner with a knob the table does not declare (or a value outside its space) was
    exported: the knob dropped from the configuration, its name kept (``..._foo1``)."""
    results, _ = forward_results
    bad = copy.deepcopy(results[0])
    winner = next(c for c in bad["candidates"] if c["name"] == bad["winner"])
    winner["config"] = bad["winner_config"] = {**bad["winner_config"], knob: value}
    with pytest.raises(ValueError, match=f"result {bad['id']}: winner_config .*{knob}={value} outside "
                                         "flash.attn_fwd's tuning space"):
        export.export([bad], tuning_copy, allow_cpu_clock=True, dry_run=True)


def test_an_export_under_a_later_patch_says_so(forward_results, tuning_copy):
    """A hand patch numbered after the tuned one sets the cell otherwise: the export changes
    nothing a call runs, and says which patch to remove (2026-12-05: patch 0003 over the ws
    forward's short tiles masked what the tuner wrote under it)."""
    results, _ = forward_results
    result = results[0]
    task = Task.from_json(result["task"])
    done = export.export([result], tuning_copy, allow_cpu_clock=True)
    assert not done[0].masked
    other = next(c for c in result["candidates"] if c["name"] != result["winner"])
    header = format_functional(rules.ATTN_FWD, task.functional)
    hand = done[0].path.with_name("flash.attn_fwd.0009-by-hand.dbpatch")
    hand.write_text("#! aotattn-patch 1\n#! table flash.attn_fwd\n\n[configs]\n"
                    f"{other['name']} = {' '.join(f'{k}={v}' for k, v in other['config'].items())}\n\n"
                    f"{header}\nseqlen_q={task.cell[0]} seqlen_k={task.cell[1]}: {other['name']}\n")
    assert _lookup(tuning_copy, result) == Config.of(other["config"])  # the hand patch wins the lookup
    done = export.export([result], tuning_copy, allow_cpu_clock=True, dry_run=True)
    assert done[0].masked == {task.describe(): hand.name}
    # the same configuration as the winner: nothing masked
    winner = Config.of(result["winner_config"])
    hand.write_text(hand.read_text().replace(other["name"], config_name(winner)).replace(
        " ".join(f"{k}={v}" for k, v in other["config"].items()), " ".join(f"{k}={v}" for k, v in winner.items)))
    assert not export.export([result], tuning_copy, allow_cpu_clock=True, dry_run=True)[0].masked


def test_unmask_takes_the_tuned_cells_out_of_later_patches(forward_results, tuning_copy):
    """``export(unmask=True)``: a later hand patch's line that sets exactly a tuned cell is
    taken out, lines over other cells or over a range stay (still masking, said), and a patch
    left without lines is deleted; the database then runs the export's winners. The hand
    patch's choice was the current one when the cell was tuned, so it was a candidate."""
    results, _ = forward_results
    first, second = results[0], results[1]
    done = export.export(results, tuning_copy, allow_cpu_clock=True)
    t1, t2 = Task.from_json(first["task"]), Task.from_json(second["task"])
    other = next(c for c in first["candidates"] if c["name"] != first["winner"])
    values = " ".join(f"{k}={v}" for k, v in other["config"].items())
    header = format_functional(rules.ATTN_FWD, t1.functional)
    assert header == format_functional(rules.ATTN_FWD, t2.functional) and t1.cell != t2.cell
    hand = done[0].path.with_name("flash.attn_fwd.0009-by-hand.dbpatch")
    untouched = (16, 32) if (16, 32) not in (tuple(t1.cell), tuple(t2.cell)) else (32, 16)
    hand.write_text("# measured by hand\n#! aotattn-patch 1\n#! table flash.attn_fwd\n\n[configs]\n"
                    f"{other['name']} = {values}\n\n{header}\n"
                    f"seqlen_q={t1.cell[0]} seqlen_k={t1.cell[1]}: {other['name']}\n"
                    f"seqlen_q={untouched[0]} seqlen_k={untouched[1]}: {other['name']}\n")
    later = done[0].path.with_name("flash.attn_fwd.0010-more.dbpatch")
    later.write_text("#! aotattn-patch 1\n#! table flash.attn_fwd\n\n[configs]\n"
                     f"{other['name']} = {values}\n\n{header}\n"
                     f"seqlen_q={t2.cell[0]} seqlen_k={t2.cell[1]}: {other['name']}\n")
    assert _lookup(tuning_copy, first) == Config.of(other["config"])  # masked before
    # a dry run says what it would do and touches nothing
    before = (hand.read_text(), later.read_text())
    dry = export.export(results, tuning_copy, allow_cpu_clock=True, dry_run=True, unmask=True)[0]
    assert dry.unmasked == {hand.name: [t1.describe()], later.name: [t2.describe()]} and dry.removed == [later.name]
    assert not dry.masked and (hand.read_text(), later.read_text()) == before
    done = export.export(results, tuning_copy, allow_cpu_clock=True, unmask=True)[0]
    assert done.unmasked == dry.unmasked and done.removed == [later.name] and not done.masked
    assert not later.exists() and hand.exists()
    patch = parse_patch(rules.ATTN_FWD, hand.read_text())
    assert [e.selection for e in patch.edits] == [((untouched[0],), (untouched[1],))]
    assert patch.comments[0] == "# measured by hand" and "--unmask" in patch.comments[-1]
    for result in (first, second):
        assert _lookup(tuning_copy, result) == Config.of(result["winner_config"])
    assert _lookup(tuning_copy, first, untouched) == Config.of(other["config"])
    assert not Database(tuning_copy.root).lint()
    # a line over a range of cells stays: still masked, and said so
    hand.write_text(hand.read_text().replace(f"seqlen_q={untouched[0]} seqlen_k={untouched[1]}",
                                             f"seqlen_q=* seqlen_k={t1.cell[1]}"))
    again = export.export([first], tuning_copy, allow_cpu_clock=True, unmask=True)[0]
    assert not again.unmasked and again.masked == {t1.describe(): hand.name}


def test_stale_cells_are_those_timed_on_another_problem(forward_results, tuning_copy):
    """``export.stale``: a tuned cell whose comment records another problem than the one its
    task would be timed on now is stale; the same problem is up to date; a cell the tuner never
    timed is counted apart; a cell where nothing was eligible is stale (its record names no
    problem). The GQA backward cells timed at 40 MiB before the 128 MiB floor were 1.3x off at
    the perfmon size on an H100 (benchmarks/RESULTS.md, fifty-first session)."""
    from aotattn.tune.runner import Settings, timed_problem
    from tests.tune.conftest import TINY

    results, _ = forward_results
    first, second = results
    export.export(results, tuning_copy, allow_cpu_clock=True)
    t1, t2 = Task.from_json(first["task"]), Task.from_json(second["task"])
    assert export.timed_cells(tuning_copy, "sm_90", "flash.attn_fwd") == {
        f"{format_functional(rules.ATTN_FWD, t.functional)} seqlen_q={t.cell[0]} seqlen_k={t.cell[1]}":
        export.Timed(r["shape"], r["device"]) for t, r in ((t1, first), (t2, second))}
    never = Task(t1.arch, t1.table, t1.functional, (64, 64))
    recorded = {t1: first["shape"], t2: second["shape"], never: "B1 H1 Sq64 Sk64 D16"}
    assert export.stale([t1, t2, never], recorded, tuning_copy) == ([], [never])
    # today's settings on a GPU: more batch than the interpreter's 64 tokens, so both cells are stale
    now = {t: str(timed_problem(t, Settings.for_table(t.table))) for t in (t1, t2, never)}
    assert now[t1] != first["shape"] and now[t2] != second["shape"]
    assert export.stale([t1, t2, never], now, tuning_copy) == ([t1, t2], [never])
    # the same shape computed on the CPU (no traffic floor, the results' own settings): up to date
    cpu = {t: str(timed_problem(t, TINY, "cpu")) for t in (t1, t2)}
    assert cpu == {t1: first["shape"], t2: second["shape"]}
    assert export.stale([t1, t2], cpu, tuning_copy) == ([], [])
    # --gpu: the same problems, one cell timed on an H100 and one on an H200, for an H200 target
    for result, device in ((first, "NVIDIA H200"), (second, "NVIDIA H100 80GB HBM3")):
        export.export([{**result, "device": device}], tuning_copy, allow_cpu_clock=True)
    assert export.stale([t1, t2], recorded, tuning_copy) == ([], [])
    assert export.stale([t1, t2], recorded, tuning_copy, gpu="h200") == ([t2], [])
    assert export.stale([t1, t2], recorded, tuning_copy, gpu="H100") == ([t1], [])
    # no eligible candidate: its comment names no problem, so it is stale whatever the settings
    empty = copy.deepcopy(first)
    empty.update(winner=None, winner_config=None, date="2999-01-01T00:00:00+00:00")
    export.export([empty], tuning_copy, allow_cpu_clock=True)
    assert export.stale([t1, t2], recorded, tuning_copy) == ([t1], [])
    # a database without the tuner's patch: every cell was never timed
    fresh = Database(tuning_copy.root)
    for path in fresh.patch_paths("sm_90", "flash.attn_fwd"):
        if path.name.endswith("-tuned.dbpatch"):
            path.unlink()
    assert export.stale([t1, t2], recorded, fresh) == ([], [t1, t2])


def test_plan_stale_selects_the_cells_timed_on_other_problems(forward_results, tuning_copy, tmp_path):
    """``tune plan --stale``: the interpreter-timed cells (64 tokens, no traffic floor) are stale
    for the GPU settings, the selection's other cells were never timed; --out writes only the
    stale ones; a selection with none stale says so and writes nothing."""
    from typer.testing import CliRunner

    from aotattn.cli import app
    from aotattn.tune.tasks import read_batch

    results, _ = forward_results
    export.export(results, tuning_copy, allow_cpu_clock=True)
    out = tmp_path / "stale.jsonl"
    args = ["tune", "plan", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "16", "--where", "MASK=2",
            "--seqlen", "16,32,64", "--tuning-db", str(tuning_copy.root), "--stale"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "--stale: 2 of 3 cells timed on other problems than these settings time (1 never timed" in result.output
    tasks = read_batch(out.read_text())
    assert sorted(tuple(t.cell) for t in tasks) == sorted(tuple(Task.from_json(r["task"]).cell) for r in results)
    # --gpu needs --stale; with it, the cells timed on a CPU are off the H200 as well
    refused = CliRunner().invoke(app, [*args[:-1], "--gpu", "H200"])
    assert refused.exit_code == 2 and "give --stale with it" in refused.output, refused.output
    both = CliRunner().invoke(app, [*args, "--gpu", "H200"])
    assert both.exit_code == 0 and "--stale: 2 of 3 cells timed on other problems than these settings time or off " \
                                   "H200 (1 never timed" in both.output, both.output
    # two tables: a line each
    two = CliRunner().invoke(app, [*args[:2], "-c", "flash,attn_bwd_dq", *args[2:]])
    assert two.exit_code == 0, two.output
    assert "  flash.attn_fwd: 2 stale, 1 never timed, 0 up to date" in two.output, two.output
    assert "  flash.attn_bwd_dq: 0 stale, 3 never timed, 0 up to date" in two.output, two.output
    # only a cell the tuner never timed: nothing stale, nothing written
    none = tmp_path / "none.jsonl"
    result = CliRunner().invoke(app, [*args[:-5], "--seqlen", "64", "--tuning-db", str(tuning_copy.root), "--stale",
                                      "--out", str(none)])
    assert result.exit_code == 0, result.output
    assert "--stale: 0 of 1 cells timed on other problems than these settings time (1 never timed" in result.output
    assert not none.exists()


def test_plan_untimed_selects_the_cells_the_tuner_never_timed(forward_results, tuning_copy, tmp_path):
    """``tune plan --untimed``: only the cells without a record in the tuner's patch (hand-set or
    seeded choices, such as the grouped backward's wide-group cells before their first run);
    with ``--stale`` those and the stale ones; a selection the tuner timed all of writes nothing."""
    from typer.testing import CliRunner

    from aotattn.cli import app
    from aotattn.tune.tasks import read_batch

    results, _ = forward_results
    export.export(results, tuning_copy, allow_cpu_clock=True)
    timed = sorted(tuple(Task.from_json(r["task"]).cell) for r in results)
    args = ["tune", "plan", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "16", "--where", "MASK=2",
            "--seqlen", "16,32,64", "--tuning-db", str(tuning_copy.root)]
    cells = sorted(tuple(t.cell) for t in read_batch(_planned(args, tmp_path / "all.jsonl")))
    untimed = tmp_path / "untimed.jsonl"
    result = CliRunner().invoke(app, [*args, "--untimed", "--out", str(untimed)])
    assert result.exit_code == 0, result.output
    assert "--untimed: 1 of 3 cells never timed by the tuner (2 timed on other problems" in result.output
    assert [tuple(t.cell) for t in read_batch(untimed.read_text())] == [c for c in cells if c not in timed]
    both = tmp_path / "both.jsonl"
    result = CliRunner().invoke(app, [*args, "--untimed", "--stale", "--out", str(both)])
    assert result.exit_code == 0, result.output
    assert "--stale --untimed: 3 of 3 cells: 2 timed on other problems than these settings time, 1 never timed" \
        in result.output
    assert sorted(tuple(t.cell) for t in read_batch(both.read_text())) == cells
    # the timed cells alone: none never timed, nothing written
    none = tmp_path / "none.jsonl"
    only_timed = ",".join(f"{q}x{k}" for q, k in timed)
    result = CliRunner().invoke(app, [*args[:-4], "--cells", only_timed, "--tuning-db", str(tuning_copy.root),
                                      "--untimed", "--out", str(none)])
    assert result.exit_code == 0, result.output
    assert "--untimed: 0 of 2 cells never timed by the tuner" in result.output and not none.exists()
    # --gpu still selects among the stale cells only
    refused = CliRunner().invoke(app, [*args, "--untimed", "--gpu", "H200"])
    assert refused.exit_code == 2 and "give --stale with it" in refused.output, refused.output


def _planned(args: list[str], out) -> str:
    from typer.testing import CliRunner

    from aotattn.cli import app

    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out.read_text()


def test_dispatch_stale_queues_only_the_stale_cells(forward_results, tuning_copy, dsn):
    """``tune dispatch --stale --rerun``: the two cells timed on other problems are queued again
    (a new label, since their tasks are keyed by id), the never-timed one is not; ``--untimed``
    then queues that one alone."""
    from typer.testing import CliRunner

    from aotattn.cli import app
    from aotattn.pgdef import Client

    results, _ = forward_results
    export.export(results, tuning_copy, allow_cpu_clock=True)
    result = CliRunner().invoke(app, ["tune", "dispatch", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "16",
                                      "--where", "MASK=2", "--seqlen", "16,32,64", "--tuning-db", str(tuning_copy.root),
                                      "--stale", "--rerun", "stale-1", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    assert "--stale: 2 of 3 cells" in result.output and "tune,flash.attn_fwd on sm_90: 2 queued" in result.output
    with Client(dsn) as client:
        cells = sorted(tuple(t.payload["task"]["cell"]) for t in client.tasks("tune"))
    assert cells == sorted(tuple(Task.from_json(r["task"]).cell) for r in results)
    # --untimed: the one never timed joins them
    result = CliRunner().invoke(app, ["tune", "dispatch", "-c", "flash,attn_fwd", "--dtype", "bf16", "--head-dim", "16",
                                      "--where", "MASK=2", "--seqlen", "16,32,64", "--tuning-db", str(tuning_copy.root),
                                      "--untimed", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    assert "--untimed: 1 of 3 cells" in result.output and "tune,flash.attn_fwd on sm_90: 1 queued" in result.output
    with Client(dsn) as client:
        assert len({tuple(t.payload["task"]["cell"]) for t in client.tasks("tune")}) == 3


@pytest.mark.parametrize("broken", ["# cell seqlen_q=16 seqlen_k=16: m16_n16 (the label lost)",
                                    "# cell [dtype=bf16 BLOCK_D=16 seqlen_q=16: no closing bracket"])
def test_a_hand_broken_cell_comment_is_one_line_naming_the_patch(forward_results, tuning_copy, broken):
    """A ``# cell`` comment edited by hand out of the tuner's form: ``--stale`` and a
    re-export say which file and what to do, not a bare ValueError from ``str.index``."""
    from aotattn.tuning import TuningError

    results, _ = forward_results
    done = export.export(results[:1], tuning_copy, allow_cpu_clock=True)
    path = done[0].path
    path.write_text(path.read_text().replace("# Each cell:", broken + "\n# Each cell:", 1))
    task = Task.from_json(results[0]["task"])
    for attempt in (lambda: export.stale([task], {task: results[0]["shape"]}, tuning_copy),
                    lambda: export.export(results[1:], tuning_copy, allow_cpu_clock=True, dry_run=True)):
        with pytest.raises(TuningError, match=r"flash\.attn_fwd\.0001-tuned\.dbpatch: a '# cell' comment without its "
                                              r"\[functional\] label: .*fix or remove the line") as raised:
            attempt()
        assert "\n" not in str(raised.value)


def _hand_patch(path, configs: dict[str, dict], lines: list[tuple[str, tuple[int, int], str]], head: str = "") -> None:
    """A hand patch: ``configs`` name -> knobs, ``lines`` (functional header, cell, config name)."""
    text = head + "#! aotattn-patch 1\n#! table flash.attn_fwd\n"
    if configs:
        text += "\n[configs]\n" + "".join(f"{n} = {' '.join(f'{k}={v}' for k, v in c.items())}\n"
                                          for n, c in configs.items())
    for header, (sq, sk), name in lines:
        text += f"\n{header}\nseqlen_q={sq} seqlen_k={sk}: {name}\n"
    path.write_text(text)


def test_a_reexport_keeps_the_configurations_later_patches_use(forward_results, tuning_copy):
    """A later patch may name a configuration the tuner's patch defines; when a re-export
    no longer uses it for any cell, it stays defined (the later patch's lookups raised
    'unknown configuration' after an export that exited 0)."""
    results, _ = forward_results
    first = results[0]
    done = export.export([first], tuning_copy, allow_cpu_clock=True)
    task = Task.from_json(first["task"])
    header = format_functional(rules.ATTN_FWD, task.functional)
    neighbour = (16, 32) if task.cell != (16, 32) else (32, 16)
    hand = done[0].path.with_name("flash.attn_fwd.0009-by-hand.dbpatch")
    _hand_patch(hand, {}, [(header, neighbour, first["winner"])])  # the tuner's winner, defined by its patch only
    assert _lookup(tuning_copy, first, neighbour) == Config.of(first["winner_config"])
    rerun = copy.deepcopy(first)
    other = next(c for c in rerun["candidates"] if c["name"] != rerun["winner"] and c.get("median_ms"))
    rerun.update(winner=other["name"], winner_config=other["config"], date="2999-01-01T00:00:00+00:00")
    export.export([rerun], tuning_copy, allow_cpu_clock=True)
    assert not Database(tuning_copy.root).lint()
    assert _lookup(tuning_copy, rerun) == Config.of(other["config"])
    assert _lookup(tuning_copy, first, neighbour) == Config.of(first["winner_config"])


def test_unmask_keeps_a_patch_whose_configurations_a_later_one_uses(forward_results, tuning_copy):
    results, _ = forward_results
    first = results[0]
    done = export.export([first], tuning_copy, allow_cpu_clock=True)
    task = Task.from_json(first["task"])
    header = format_functional(rules.ATTN_FWD, task.functional)
    other = next(c for c in first["candidates"] if c["name"] != first["winner"])
    neighbour = (16, 32) if task.cell != (16, 32) else (32, 16)
    hand = done[0].path.with_name("flash.attn_fwd.0009-by-hand.dbpatch")
    _hand_patch(hand, {other["name"]: other["config"]}, [(header, task.cell, other["name"])])
    after = done[0].path.with_name("flash.attn_fwd.0010-uses-it.dbpatch")
    _hand_patch(after, {}, [(header, neighbour, other["name"])], head="# keep\n")
    text = after.read_text()
    after.write_text(text + "# why: measured on the H200, 2026-12-07\n")  # a body comment
    report = export.export([first], tuning_copy, allow_cpu_clock=True, unmask=True)[0]
    assert report.unmasked == {hand.name: [task.describe()]} and report.removed == []
    assert hand.exists() and parse_patch(rules.ATTN_FWD, hand.read_text()).edits == []
    assert not Database(tuning_copy.root).lint()
    assert _lookup(tuning_copy, first) == Config.of(first["winner_config"])
    assert _lookup(tuning_copy, first, neighbour) == Config.of(other["config"])
    # the body comment of a rewritten patch is kept (in its header)
    _hand_patch(hand, {other["name"]: other["config"]}, [(header, task.cell, other["name"]),
                                                         (header, neighbour, other["name"])])
    hand.write_text(hand.read_text() + "# the neighbour: by hand\n")
    export.export([first], tuning_copy, allow_cpu_clock=True, unmask=True)
    assert "# the neighbour: by hand" in parse_patch(rules.ATTN_FWD, hand.read_text()).comments


def test_a_cell_the_tuners_patch_sets_twice_keeps_its_later_line(forward_results, tuning_copy):
    """The lookup applies the later of two lines over one cell; a re-export of other cells
    kept the earlier (and so changed the cell, silently). A ``.`` line is kept as ``.``."""
    results, _ = forward_results
    first, second = results
    done = export.export([first], tuning_copy, allow_cpu_clock=True)
    path = done[0].path
    task = Task.from_json(first["task"])
    header = format_functional(rules.ATTN_FWD, task.functional)
    other = next(c for c in first["candidates"] if c["name"] != first["winner"])
    values = " ".join(f"{k}={v}" for k, v in other["config"].items())
    path.write_text(path.read_text().replace("[configs]\n", f"[configs]\n{other['name']} = {values}\n")
                    + f"\n{header}\nseqlen_q={task.cell[0]} seqlen_k={task.cell[1]}: {other['name']}\n")
    assert not Database(tuning_copy.root).lint()
    assert _lookup(tuning_copy, first) == Config.of(other["config"])
    export.export([second], tuning_copy, allow_cpu_clock=True)
    assert _lookup(tuning_copy, first) == Config.of(other["config"])
    assert _lookup(tuning_copy, second) == Config.of(second["winner_config"])
    path.write_text(path.read_text() + f"\n{header}\nseqlen_q={task.cell[0]} seqlen_k={task.cell[1]}: .\n")
    report = export.export([second], tuning_copy, allow_cpu_clock=True)[0]  # was KeyError: '.'
    assert report.kept == 1
    from aotattn.tuning import NoEntryError

    with pytest.raises(NoEntryError, match="has no entry"):
        _lookup(tuning_copy, first)


def test_a_tuners_patch_line_naming_no_configuration_is_one_line(forward_results, tuning_copy):
    from aotattn.tuning import TuningError

    results, _ = forward_results
    done = export.export(results[:1], tuning_copy, allow_cpu_clock=True)
    task = Task.from_json(results[0]["task"])
    header = format_functional(rules.ATTN_FWD, task.functional)
    path = done[0].path
    path.write_text(path.read_text() + f"\n{header}\nseqlen_q=64 seqlen_k=64: nosuch\n")
    with pytest.raises(TuningError, match=r"0001-tuned\.dbpatch:\d+: unknown configuration 'nosuch'$"):
        export.export(results[1:], tuning_copy, allow_cpu_clock=True, dry_run=True)
    path.write_text(path.read_text().replace("seqlen_q=64 seqlen_k=64: nosuch", "seqlen_q=* seqlen_k=64: "
                                             + results[0]["winner"]))
    with pytest.raises(TuningError, match=r"0001-tuned\.dbpatch:\d+: flash\.attn_fwd: the tuner's patch holds a range"):
        export.export(results[1:], tuning_copy, allow_cpu_clock=True, dry_run=True)


def test_a_result_spelling_an_axis_at_its_default_sets_the_same_cell():
    """flash.backward's GROUPED=False may be spelled or left out (the same functional): a
    result spelling it replaces the patch's line, it does not add a second one (which lost
    to the old line, written after it)."""
    spec = rules.BACKWARD
    functional = next(iter(spec.enumerate_functionals()))
    spelled = {**functional.as_dict(), "GROUPED": False}
    old = parse_patch(spec, "#! aotattn-patch 1\n#! table flash.backward\n\n"
                      f"{format_functional(spec, functional)}\nseqlen_q=1024 seqlen_k=1024: ws\n")
    result = {"task": {"arch": "sm_90", "table": spec.qualname, "functional": spelled, "cell": [1024, 1024]},
              "candidates": [{"name": "split", "config": {"backend": "split"}, "median_ms": 1.0, "error": 0.0},
                             {"name": "ws", "config": {"backend": "ws"}, "median_ms": 2.0, "error": 0.0}],
              "winner": "split", "winner_config": {"backend": "split"}, "current": "ws",
              "shape": "B1 H1 Sq1024 Sk1024 D16", "device": "test", "date": "2026-12-07"}
    patch, kept = export.build_patch(spec, [result], old)
    assert kept == 0 and [(e.selection, e.config) for e in patch.edits] == [(((1024,), (1024,)), "split")]


def test_export_reads_the_patches_as_utf8_whatever_the_locale(forward_results, tuning_copy, tmp_path):
    """Export and ``--stale`` read the tuner's patch with Path.read_text(), in the locale's
    encoding: under LC_ALL=C a comment's 'é' (which lint accepts) failed both with an
    'ascii' codec error."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    results, _ = forward_results
    done = export.export(results[:1], tuning_copy, allow_cpu_clock=True)
    path = done[0].path
    path.write_bytes(("# réglé à la main\n" + path.read_text("utf-8")).encode("utf-8"))
    assert not Database(tuning_copy.root).lint()
    (tmp_path / "results.json").write_text(json.dumps(results[1:]))
    project = Path(__file__).resolve().parents[2]
    script = (f"import json; from aotattn.tune import export; from aotattn.tune.tasks import Task; "
              f"from aotattn.tuning import Database; db = Database({str(tuning_copy.root)!r}); "
              f"r = json.load(open({str(tmp_path / 'results.json')!r})); "
              f"export.export(r, db, allow_cpu_clock=True); t = Task.from_json(r[0]['task']); "
              f"print(export.stale([t], {{t: r[0]['shape']}}, db))")
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(project)}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=project, capture_output=True, timeout=300)
    assert run.returncode == 0, run.stderr.decode(errors="replace")
    assert "# réglé à la main" in path.read_text("utf-8")
    assert _lookup(tuning_copy, results[1]) == Config.of(results[1]["winner_config"])


def test_current_config_is_none_only_where_the_database_names_none(tuning_copy):
    """A database that does not resolve is an error for the tuner, not "no current choice"
    (plans and timings went on without it, silently)."""
    from aotattn.tune import flash
    from aotattn.tuning import TuningError
    from tests.tune.conftest import forward_task

    task = forward_task(cell=(1024, 1024))
    assert flash.current_config(tuning_copy, "sm_90", task.table, task.functional, task.cell) is not None
    patch = tuning_copy.arch_dir("sm_90") / "flash.attn_fwd.0099-broken.dbpatch"
    header = format_functional(rules.ATTN_FWD, task.functional)
    patch.write_text(f"#! aotattn-patch 1\n#! table flash.attn_fwd\n\n{header}\nseqlen_q=1024 seqlen_k=1024: nosuch\n")
    with pytest.raises(TuningError, match="0099-broken.dbpatch:5: unknown configuration 'nosuch'"):
        flash.current_config(Database(tuning_copy.root), "sm_90", task.table, task.functional, task.cell)
    patch.write_text(patch.read_text().replace("nosuch", "."))
    assert flash.current_config(Database(tuning_copy.root), "sm_90", task.table, task.functional, task.cell) is None


@pytest.mark.parametrize("timeout", ["0", "-5", "nan"])
def test_tune_compile_refuses_a_timeout_that_is_not_above_zero(timeout, tmp_path):
    from typer.testing import CliRunner

    from aotattn.cli import app

    result = CliRunner().invoke(app, ["tune", "compile", str(tmp_path / "batch.jsonl"), "--images",
                                      str(tmp_path / "images"), "--timeout", timeout])
    assert result.exit_code == 1 and "--timeout: expected a number of seconds above 0" in result.output, result.output
    assert not (tmp_path / "images").exists()
