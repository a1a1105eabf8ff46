"""One tuning task end to end in the interpreter, the gate, the choice, the journal."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aotattn.families.flash import rules
from aotattn.spec import Config, Functional
from aotattn.tune import runner
from aotattn.tune import candidates as cand
from aotattn.tune import flash
from aotattn.tune.candidates import config_name
from aotattn.tune.tasks import Task
from aotattn.tuning import Database
from tests.tune.conftest import PROJECT_TUNING, TINY, forward_task


def test_gate():
    bound, eligible = runner.gate({"a": 1e-3, "b": 2.9e-3, "c": 3.1e-3, "d": math.nan, "e": math.inf}, 1e-2)
    assert bound == pytest.approx(3e-3) and eligible == {"a", "b"}
    bound, eligible = runner.gate({"a": 4e-3, "b": 1.1e-2}, 1e-2)  # the tolerance caps 3x
    assert bound == 1e-2 and eligible == {"a"}
    bound, eligible = runner.gate({"a": math.nan}, 1e-2)
    assert math.isnan(bound) and eligible == set()
    assert runner.gate({"a": 0.0, "b": 1e-9}, 1e-2)[1] == {"a"}


def test_choose_keeps_the_current_choice_unless_clearly_beaten():
    records = {"cur": {"median_ms": 1.00, "spread": 0.01}, "new": {"median_ms": 0.99, "spread": 0.005},
               "fast": {"median_ms": 0.5, "spread": 0.01}, "untimed": {}}
    assert runner.choose(records, {"cur", "new"}, "cur", 0.02) == "cur"  # 1% faster: noise
    assert runner.choose(records, {"cur", "new", "fast"}, "cur", 0.02) == "fast"
    assert runner.choose(records, {"new", "fast"}, "cur", 0.02) == "fast"  # the current one is not eligible
    noisy = {**records, "new": {"median_ms": 0.9, "spread": 0.2}}
    assert runner.choose(noisy, {"cur", "new"}, "cur", 0.02) == "cur"  # 10% faster within a 20% spread
    assert runner.choose(records, {"untimed"}, None, 0.02) is None


def test_settings_round_trip_and_refusals():
    assert runner.Settings.from_json(json.loads(json.dumps(TINY.to_json()))) == TINY
    for bad, message in [({"limit": 0}, "limit"), ({"nope": 1}, "unknown"), ({"error_multiple": 0.5}, "multiple"),
                         ({"repeats": [5, 2]}, "repeats"), ({"tokens": True}, "tokens"),
                         ({"min_traffic_bytes": -1}, "min_traffic_bytes"), ({"min_traffic_bytes": 1.5}, "byte count"),
                         ({"memory_bytes": "8G"}, "memory_bytes"), ({"knobs": "yes"}, "knobs"), ({"knobs": 1}, "knobs"),
                         ({"repeats": 5}, "repeats"), ({"repeats": "ab"}, "repeats"), ({"repeats": [5.5, 30]}, "repeats"),
                         ({"error_multiple": "x"}, "error_multiple"), ({"finalist_margin": None}, "finalist_margin"),
                         ({"error_multiple": float("nan")}, "error_multiple"), ({"min_gain": "x"}, "min_gain"),
                         ({"min_gain": -0.1}, "min_gain"), ({"min_gain": 1.0}, "min_gain"), ({"budget_ms": -1}, "budget_ms"),
                         ({"budget_ms": float("inf")}, "budget_ms")]:
        with pytest.raises(ValueError, match=message):
            runner.Settings.from_json(bad)


def test_forward_task_end_to_end(forward_results):
    results, _ = forward_results
    for result in results:
        assert result["format"] == runner.RESULT_FORMAT and result["clock"] == "cpu-perf-counter"
        assert Task.from_json(result["task"]).id == result["id"]
        by_name = {c["name"]: c for c in result["candidates"]}
        functional = Task.from_json(result["task"]).functional
        sizes = dict(zip(("seqlen_q", "seqlen_k"), result["task"]["cell"]))
        chosen = Database(PROJECT_TUNING).lookup("sm_90", rules.ATTN_FWD, functional, sizes)
        current = config_name(chosen)
        assert result["current"] == current and current in by_name  # always a candidate
        # the speed model's best TINY.limit, the current choice and its tile's knob variants
        variants = {config_name(c) for c in cand.knob_variants(rules.ATTN_FWD, [chosen], cand.space(rules.ATTN_FWD))}
        fitting, _ = cand.candidates(rules.ATTN_FWD, functional, "sm_90", flash.footprint("flash.attn_fwd"), sizes=sizes)
        assert {current} < variants and variants & {config_name(c) for c in fitting} <= set(by_name)
        assert len(by_name) <= TINY.limit + len(variants)
        for c in result["candidates"]:
            assert c["status"] in ("ok", "slow"), c
            # errors measured against the float64 reference, within bf16's tolerance, on both shapes
            assert len(c["errors"]) == 2 and all(0 < e < 1e-2 for e in c["errors"].values())
        winner = by_name[result["winner"]]
        assert winner["eligible"] and winner["median_ms"] > 0 and winner["repeats"] >= 1
        assert winner["error"] <= result["bound"] + 1e-15
        assert result["accuracy_shapes"][1] != result["accuracy_shapes"][0]  # the irregular lengths


def test_journal_resumes_and_marks_crashes(forward_results, tmp_path):
    results, journal = forward_results
    task = Task.from_json(results[0]["task"])
    lines = (journal / f"{task.id}.jsonl").read_text().splitlines()
    names = {json.loads(line)["start"] for line in lines if "start" in line}
    assert names == {c["name"] for c in results[0]["candidates"]}
    # replay the journal with the last candidate started and never finished: a crash
    crashed = sorted(names)[-1]
    kept = [line for line in lines if json.loads(line).get("done", {}).get("name") != crashed]
    (tmp_path / f"{task.id}.jsonl").write_text("\n".join(kept) + "\n")
    seen = []
    again = runner.run_task(task, TINY, device="cpu", db=Database(PROJECT_TUNING), journal=tmp_path, log=seen.append)
    # no candidate was checked or probed again (a new finalist may be timed in full)
    assert not [line for line in seen if "probe" in line], seen
    by_name = {c["name"]: c for c in again["candidates"]}
    assert by_name[crashed]["status"] == "crashed" and not by_name[crashed]["eligible"]
    assert again["winner"] != crashed


def test_a_journal_resumes_only_its_own_run(forward_results, tmp_path):
    """A journal written with other settings (here without the knob variants), for another
    pgdef key (``dispatch --rerun``) or before journals had a header is not resumed: its
    records were timed for another run. The result holds this run's candidates only."""
    import shutil

    results, journal = forward_results
    task = Task.from_json(results[0]["task"])
    before = {c["name"] for c in results[0]["candidates"]}
    db = Database(PROJECT_TUNING)

    def rerun(settings, run_key=None, strip_header=False):
        path = tmp_path / f"{task.id}.jsonl"
        shutil.copy(journal / f"{task.id}.jsonl", path)
        if strip_header:
            path.write_text("\n".join(path.read_text().splitlines()[1:]) + "\n")
        seen = []
        result = runner.run_task(task, settings, device="cpu", db=db, journal=tmp_path, run_key=run_key,
                                 log=seen.append)
        return result, [line for line in seen if "probe" in line]

    same, probed = rerun(TINY)
    assert not probed and {c["name"] for c in same["candidates"]} == before  # resumed
    fewer, probed = rerun(dataclasses.replace(TINY, knobs=False))
    names = {c["name"] for c in fewer["candidates"]}
    assert probed and len(probed) == len(names) and names < before  # measured afresh, its own candidates
    _, probed = rerun(TINY, run_key=f"{task.id}:again")
    assert len(probed) == len(before)
    _, probed = rerun(TINY, strip_header=True)
    assert len(probed) == len(before)
    header = json.loads((tmp_path / f"{task.id}.jsonl").read_text().splitlines()[0])
    assert header == {"journal": 1, "settings": json.loads(json.dumps(TINY.to_json())), "run": None}


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_fused_atomic_backward_candidates_each_start_from_zero(dtype):
    """dQ accumulates atomically: every candidate's accuracy run starts from a zeroed buffer
    (fp32 too, where the buffer has q's dtype: it was left poisoned with NaN) and is checked
    as the operator returns it (scaled after the sums, planning.finish_dq)."""
    f = dict(dtype=dtype, BLOCK_D=16, BLOCK_DV=16, PAD_HEAD=False, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0,
             ATOMIC_DQ=True)
    task = Task("sm_90", "flash.attn_bwd_fused", Functional.of(f), (16, 16))
    settings = dataclasses.replace(TINY, finalists=1, repeats=(1, 1))
    result = runner.run_task(task, settings, device="cpu", db=Database(PROJECT_TUNING), journal=None)
    errors = [c for c in result["candidates"] if c.get("errors")]
    assert len(errors) >= 2
    for c in errors:
        assert c["status"] in ("ok", "slow") and max(c["errors"].values()) < 5e-3, c
        assert {k.split()[-1] for k in c["errors"]} == {"dq", "dk", "dv"}


def test_bad_task_refused():
    f = Functional.of(dict(dtype="bf16", BLOCK_D=16, BLOCK_DV=16, PAD_HEAD=False, MASK=0, VARLEN=False,
                           DROPOUT=False, BIAS=1))
    with pytest.raises(ValueError, match="bias"):
        runner.run_task(Task("sm_90", "flash.attn_fwd", f, (16, 16)), TINY, device="cpu", journal=None)
    assert Config.of(BLOCK_M=16)  # spec types import cleanly beside the runner


def test_padded_operator_task_times_both_backends_on_odd_head_dims():
    """An operator cell of padded heads: both backends run on odd head dims (unaligned rows),
    within the tolerance, and the result names which one won."""
    f = Functional.of(dict(dtype="fp16", BLOCK_D=32, PAD_HEAD=True, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0,
                           DETERMINISTIC=False))
    task = Task("sm_90", "flash.backward", f, (32, 32))
    settings = dataclasses.replace(TINY, finalists=2, repeats=(1, 1))
    result = runner.run_task(task, settings, device="cpu", db=Database(PROJECT_TUNING), journal=None)
    by_name = {c["name"]: c for c in result["candidates"]}
    assert set(by_name) == {"split", "fused"} and result["winner"] in by_name
    dims = {key.split()[0] for c in by_name.values() for key in c["errors"]}
    assert any(not d.endswith("D32") for d in dims), dims  # an odd head dim was checked
    for c in by_name.values():
        assert c["eligible"] and max(c["errors"].values()) < 5e-3, c


@pytest.mark.parametrize("missing", ["current", "other"])
def test_a_kernel_the_batch_did_not_build_is_no_image_and_never_replaces_the_current_choice(missing, monkeypatch):
    """A candidate whose problem launches a kernel the image folder lacks (the ws tile of a
    grouped backward, built for the ungrouped cell) is ``no-image``, not ``failed``; when
    that is the current choice nothing was compared with it, so the result has no winner
    (export keeps the cell) rather than handing the cell to the other backend."""
    from aotattn.runtime.images import ImageMissing

    f = Functional.of(dict(dtype="fp16", BLOCK_D=32, PAD_HEAD=True, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0,
                           DETERMINISTIC=False))
    task = Task("sm_90", "flash.backward", f, (32, 32))
    db = Database(PROJECT_TUNING)
    current = config_name(flash.current_config(db, "sm_90", task.table, f, task.cell))
    lacking = current if missing == "current" else ({"split", "fused"} - {current}).pop()
    runner_of = flash.Problem.runner

    def runner_lacking_one_kernel(self, config):
        if config_name(config) == lacking:
            def launch():
                raise ImageMissing("no kernel image for sm_90 / flash.attn_bwd_ws / [GROUPED=True] / ...",
                                   "sm_90", "flash.attn_bwd_ws")
            return launch
        return runner_of(self, config)

    monkeypatch.setattr(flash.Problem, "runner", runner_lacking_one_kernel)
    seen = []
    settings = dataclasses.replace(TINY, finalists=2, repeats=(1, 1))
    result = runner.run_task(task, settings, device="cpu", db=db, journal=None, log=seen.append)
    by_name = {c["name"]: c for c in result["candidates"]}
    assert by_name[lacking]["status"] == "no-image" and "flash.attn_bwd_ws" in by_name[lacking]["message"]
    assert not by_name[lacking]["eligible"]
    other = ({"split", "fused"} - {lacking}).pop()
    assert by_name[other]["status"] == "ok" and by_name[other]["median_ms"] > 0
    if missing == "current":
        assert result["winner"] is None and result["current"] == lacking
        assert "flash.attn_bwd_ws" in result["no_winner"] and "tune compile" in result["no_winner"]
        assert any("no winner" in line for line in seen)
    else:
        assert result["winner"] == other and result["no_winner"] is None


@pytest.mark.parametrize("table, extra", [("flash.attn_fwd", {}), ("flash.attn_bwd_dkdv", {}),
                                          ("flash.attn_bwd_fused", {"ATOMIC_DQ": True}),
                                          ("flash.backward", {"DETERMINISTIC": False})],
                         ids=["fwd", "dkdv", "fused", "operator"])
def test_dropout_task_is_checked_under_the_kernels_mask(table, extra):
    """A dropout cell's candidates run at dropout_p 0.1 and match the float64 reference applied
    with the keep-mask the kernels draw (without it, dropout's errors are of order one)."""
    f = dict(dtype="fp16", BLOCK_D=16, BLOCK_DV=16, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=True, BIAS=0,
             **extra)
    if table == "flash.backward":
        del f["BLOCK_DV"]
    task = Task("sm_90", table, Functional.of(f), (32, 32))
    settings = dataclasses.replace(TINY, finalists=1, repeats=(1, 1))
    result = runner.run_task(task, settings, device="cpu", db=Database(PROJECT_TUNING), journal=None)
    checked = [c for c in result["candidates"] if c.get("errors")]
    assert checked and result["winner"] in {c["name"] for c in checked}
    for c in checked:
        assert c["eligible"] and 0 < max(c["errors"].values()) < 5e-3, c


def test_dropout_problem_draws_one_mask_and_needs_the_mask_kernel():
    from aotattn.tune import flash

    f = Functional.of(dict(dtype="fp16", BLOCK_D=16, BLOCK_DV=16, PAD_HEAD=False, MASK=0, VARLEN=False,
                           DROPOUT=True, BIAS=0))
    a, b = (flash.Problem("flash.attn_fwd", f, flash.Shape(1, 2, 32, 32, 16), "cpu") for _ in range(2))
    assert a.call.p.dropout_p == flash.DROPOUT_P and (a.call.seed, a.call.offset) != (b.call.seed, b.call.offset)
    assert a.call.functional()["DROPOUT"]
    assert ("flash.dropout_mask", Functional.of({})) in flash.auxiliary("flash.attn_fwd", f)
    plain = Functional.of({**f.as_dict(), "DROPOUT": False})
    assert flash.auxiliary("flash.attn_fwd", plain) == []


def test_the_warp_specialized_kernels_are_planned_only_where_they_run():
    """The ws kernels exist on sm_90 alone: elsewhere their tables are no task, and a backward
    problem's forward needs no ws image (a sm_80 plan asked for attn_fwd_ws configurations the
    sm_80 database cannot have, and planned 132 attn_fwd_ws tasks that export then refused)."""
    from aotattn.tune import flash, harnesses

    d = random.choice([64, 128, 256])
    forward = Functional.of(dict(dtype="bf16", BLOCK_D=d, BLOCK_DV=d, PAD_HEAD=False, MASK=random.choice([0, 2]),
                                 VARLEN=False, DROPOUT=False, BIAS=0))
    cell = (1024, 1024)
    for arch in ("sm_80", "sm_90"):
        here = arch == "sm_90"
        assert harnesses.supported("flash.attn_fwd_ws", forward, cell, arch) is here
        assert harnesses.supported("flash.forward", forward, cell, arch) is here
        needs = {t for t, _ in flash.auxiliary("flash.attn_bwd_dkdv", forward, arch)}
        assert ("flash.attn_fwd_ws" in needs) is here and "flash.attn_fwd" in needs
    assert harnesses.supported("flash.attn_fwd_ws", forward, cell)  # no architecture: where it runs


def test_grouped_operator_task_runs_with_groups_and_sums_each_key_heads_gradients():
    """A grouped-query operator cell (flash.backward GROUPED=True) is timed on a problem with
    GROUP query heads per key/value head: both backends run and match the float64 reference,
    whose dK/dV sum each group's heads (a reference per query head alone would be off by
    order one). A mutant problem without groups selects the ungrouped functional and is refused."""
    from aotattn.tune import flash

    f = Functional.of(dict(dtype="fp16", BLOCK_D=32, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0,
                           DETERMINISTIC=False, GROUPED=True))
    assert flash.supports("flash.backward", f, (32, 32))
    shapes = flash.accuracy_shapes(f, (32, 32))
    assert all(s.group == flash.GROUP and s.heads % s.group == 0 and s.heads > s.group for s in shapes)
    timed = flash.timing_shape(f, (1024, 1024))
    assert timed.group == flash.GROUP and timed.heads % flash.GROUP == 0 and "G4" in str(timed)
    problem = flash.Problem("flash.backward", f, shapes[0], "cpu")
    assert problem.k.shape[2] * flash.GROUP == problem.q.shape[2]
    reference = problem.reference()
    assert reference["dk"].shape == problem.k.shape
    for backend in ("split", "fused"):
        problem.reset()
        problem.runner(Config.of(backend=backend))()
        errors = flash.errors(problem.outputs(), reference)
        assert max(errors.values()) < 5e-3, (backend, errors)
    task = Task("sm_90", "flash.backward", f, (32, 32))
    settings = dataclasses.replace(TINY, finalists=2, repeats=(1, 1))
    result = runner.run_task(task, settings, device="cpu", db=Database(PROJECT_TUNING), journal=None)
    assert {c["name"] for c in result["candidates"]} == {"split", "fused"}
    with pytest.raises(ValueError, match="selects functional"):
        flash.Problem("flash.backward", f, dataclasses.replace(shapes[0], group=1), "cpu")


@settings(max_examples=200, deadline=None)
@given(d=st.sampled_from(rules.HEAD_DIM_BUCKETS), dtype=st.sampled_from(["fp16", "bf16", "fp32"]),
       seqlen_q=st.sampled_from(rules.SEQLEN_BUCKETS), seqlen_k=st.sampled_from(rules.SEQLEN_BUCKETS),
       grouped=st.booleans(), tokens=st.sampled_from([2**10, 2**17, 2**19, 2**21]),
       memory=st.sampled_from([1 << 26, 1 << 30, 8 << 30]), least=st.sampled_from([0, 1 << 20, 128 << 20, 1 << 30]))
def test_timed_problem_fills_the_gpu_and_moves_more_than_asked(d, dtype, seqlen_q, seqlen_k, grouped, tokens, memory,
                                                                least):
    """The timed problem holds the tokens asked for (rounded down to whole heads), reads and
    writes at least ``min_traffic`` bytes (q, k, v, o) where memory allows, and its tensors
    and their gradients fit ``memory_bytes`` (one batch of heads at the least)."""
    from aotattn.tune import flash

    f = Functional.of(dict(dtype=dtype, BLOCK_D=d, BLOCK_DV=d, PAD_HEAD=False, MASK=0, VARLEN=False, DROPOUT=False,
                           BIAS=0, DETERMINISTIC=False, GROUPED=grouped))
    shape = flash.timing_shape(f, (seqlen_q, seqlen_k), tokens, memory, least)
    element = 4 if dtype == "fp32" else 2
    per_row = element * (2 * seqlen_q + 2 * seqlen_k) * d
    rows = shape.batch * shape.heads
    fit = max(1, memory // (2 * per_row))
    moved = element * d * (2 * seqlen_q * rows + 2 * seqlen_k * rows // shape.group)  # k, v once per key head
    assert (shape.seqlen_q, shape.seqlen_k, shape.head_dim) == (seqlen_q, seqlen_k, d)
    assert shape.heads % shape.group == 0 and shape.group == (flash.GROUP if grouped else 1)
    assert rows >= min(tokens // seqlen_q, fit) // shape.heads * shape.heads
    if fit // shape.heads * shape.heads * per_row * (2 * seqlen_q + 2 * seqlen_k // shape.group) \
            >= least * (2 * seqlen_q + 2 * seqlen_k):
        assert moved >= least
    if least == 0:  # as before the floor: the tokens alone
        assert shape.batch == max(1, min(tokens // seqlen_q, fit) // shape.heads)
    assert rows == shape.heads or 2 * rows * per_row <= memory


def test_small_key_cells_are_timed_at_the_size_perfmon_times_them():
    """With the default settings, the cells whose 2^17-token problem fit the L2 (d64
    4096x128: B1 H32, 33 MiB) are timed where perfmon's non-square entries are (B4 H32); a
    d128 s4096 problem (128 MiB) is unchanged."""
    from aotattn.tune import flash

    def shape(d, cell):
        f = Functional.of(dict(dtype="bf16", BLOCK_D=d, BLOCK_DV=d, PAD_HEAD=False, MASK=0, VARLEN=False,
                               DROPOUT=False, BIAS=0))
        settings = runner.Settings.for_table("flash.attn_fwd")
        return str(flash.timing_shape(f, cell, settings.tokens, settings.memory_bytes, settings.min_traffic_bytes))

    assert shape(64, (4096, 128)) == "B4 H32 Sq4096 Sk128 D64"
    grouped = Functional.of(dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=False, MASK=2, VARLEN=False,
                                 DROPOUT=False, BIAS=0, GROUPED=True))
    settings = runner.Settings.for_table("flash.attn_bwd_ws")
    # K and V are read once per key head: 8 x 16 query heads in groups of 4 move 80 MiB
    assert str(flash.timing_shape(grouped, (1024, 1024), settings.tokens, settings.memory_bytes,
                                  settings.min_traffic_bytes)) == "B13 H16 G4 Sq1024 Sk1024 D128"
    assert shape(128, (4096, 512)) == "B4 H16 Sq4096 Sk512 D128"
    assert shape(128, (4096, 4096)) == "B2 H16 Sq4096 Sk4096 D128"


def test_the_traffic_floor_is_a_gpus_only(tmp_path):
    """The planned settings carry a 128 MiB floor on the timed problem; on the CPU it made
    the interpreter time a batch of thousands (a d64 s128 task ran for hours): there
    ``tokens`` alone sizes it, and the result records that shape."""
    from aotattn.tune import flash
    from aotattn.tune.runner import run_task

    settings = dataclasses.replace(TINY, min_traffic_bytes=128 << 20)
    task = forward_task(cell=(16, 16))
    result = run_task(task, settings, device="cpu", db=Database(PROJECT_TUNING), journal=tmp_path)
    tokens_only = flash.timing_shape(task.functional, task.cell, settings.tokens, settings.memory_bytes, 0)
    floored = flash.timing_shape(task.functional, task.cell, settings.tokens, settings.memory_bytes, 128 << 20)
    assert result["shape"] == str(tokens_only) != str(floored)
    assert result["settings"]["min_traffic_bytes"] == 128 << 20  # the task's settings are kept as dispatched


def test_no_knobs_plans_only_the_limit_and_the_current_choice(tmp_path):
    """`tune plan --no-knobs` writes settings without the current tile's knob variants, and
    its batch compiles fewer kernels; the default keeps them (candidates.knob_variants)."""
    from typer.testing import CliRunner

    from aotattn.cli import app
    from aotattn.tune import ahead
    from aotattn.tune.tasks import read_batch_settings

    counts = {}
    for flag in ("--knobs", "--no-knobs"):
        out = tmp_path / f"{flag}.jsonl"
        result = CliRunner().invoke(app, ["tune", "plan", "-c", "flash,attn_fwd_ws", "--head-dim", "128",
                                          "--dtype", "bf16", "--cells", "4096x128,1024x1024", "--limit", "4",
                                          flag, "--out", str(out)])
        assert result.exit_code == 0, result.output
        batch = [(task, runner.Settings.of_line(task.table, data))
                 for task, data in read_batch_settings(out.read_text())]
        assert {s.knobs for _, s in batch} == {flag == "--knobs"}
        counts[flag] = len(ahead.plan(batch, Database(PROJECT_TUNING)))
        assert f"{counts[flag]} kernels to compile" in result.output
    assert counts["--no-knobs"] < counts["--knobs"]


def test_the_estimate_counts_a_tasks_candidates_with_its_database():
    """With the database the estimate counts the candidates the worker will time (the
    limit's tiles, the current choice, its tile's fitting knob variants); without it, the
    knob combinations bound them from above (the ws backward's 24, of which 2-6 fit)."""
    from aotattn.tune import estimate, flash

    db = Database(PROJECT_TUNING)
    d, mask = random.choice([64, 128, 256]), random.choice([0, 2])
    f = Functional.of(dict(dtype="bf16", BLOCK_D=d, BLOCK_DV=d, PAD_HEAD=False, MASK=mask, VARLEN=False,
                           DROPOUT=False, BIAS=0))
    task = Task("sm_90", "flash.attn_bwd_ws", f, (random.choice([512, 1024, 4096]),) * 2)
    settings = dataclasses.replace(runner.Settings.for_table(task.table), limit=4, finalists=1)  # finalists: 2 either way
    spec = rules.KERNELS["attn_bwd_ws"]
    current = flash.current_config(db, task.arch, task.table, task.functional, task.cell)
    counted = len(runner.task_candidates(task, settings, current)[0])
    assert 4 <= counted < 4 + estimate.knob_combinations(spec)
    exact, bound = estimate.gpu_seconds(task, settings, db), estimate.gpu_seconds(task, settings)
    per_candidate = (estimate.gpu_seconds(task, dataclasses.replace(settings, limit=5))
                     - estimate.gpu_seconds(task, settings))  # one more candidate, without the database
    assert exact < bound and math.isclose(bound - exact, (4 + estimate.knob_combinations(spec) - counted) * per_candidate)
