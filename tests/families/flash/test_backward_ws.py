"""The warp-specialized Hopper backward (kernels/backward_ws.py, ``flash.attn_bwd_ws``).

CPU: which calls it serves, how the backward table's ``ws`` choice falls back where it
does not, what the tuner may time, and what its sm_90 machine code holds. GPU: every
fitting knob value against the float64 reference over the masks, GQA, tails, rows that
see no key and keys no row sees, and through the plan cache in SDPA's layout.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
import torch

import aotattn
from aotattn import reference, tuning
from aotattn.compiler import builder
from aotattn.compiler.jobs import Job, compile_job
from aotattn.families.flash import ops, planning, rules
from aotattn.runtime import launch
from aotattn.spec import Config, Functional
from aotattn.tune import candidates
from aotattn.tune import flash as tune_flash
from tests.compiler.test_machine_code import CUOBJDUMP, sass
from tests.families.flash.helpers import dense_functional, forced_kernel, make_qkv, problem, seed_from
from tests.helpers import TOLERANCE, rel_err

TABLE = rules.ATTN_BWD_WS.qualname


functional = dense_functional


def fitting(d: int, mask: int = rules.MASK_BOTTOM_RIGHT, pad: bool = False) -> list[Config]:
    """The configurations the tuner may time at head-dim bucket d (under a mask: every value
    of every knob; the GPU tests force each of them on masked and unmasked calls alike),
    of heads that fill it or (``pad``) do not."""
    kept, _ = candidates.candidates(rules.ATTN_BWD_WS, Functional.of(functional(d=d, mask=mask, PAD_HEAD=pad)),
                                    "sm_90", tune_flash.footprint(TABLE))
    return kept


# ----------------------------------------------------------------------------- CPU


def test_it_serves_dense_fp16_bf16_head_buckets_of_64_128_and_256_on_sm_90_only():
    served = [f.as_dict() for f in rules.ATTN_BWD_WS.enumerate_functionals()]
    assert {(f["dtype"], f["BLOCK_D"], f["MASK"], f["PAD_HEAD"]) for f in served} == {
        (t, d, m, pad) for t in ("fp16", "bf16") for d in (64, 128, 256) for m in (0, 1, 2) for pad in (False, True)}
    assert all(f["BIAS"] == rules.BIAS_NONE and not f["DROPOUT"] and not f["VARLEN"] for f in served)
    assert rules.ws_backward_serves(functional(), "sm_90") and rules.ws_backward_serves(functional(d=64))
    assert not rules.ws_backward_serves(functional(), "sm_80")
    assert not rules.ws_backward_serves(functional(), "sm_90", deterministic=True)  # dQ by atomics
    assert rules.ws_backward_serves(functional(d=256), "sm_90")
    assert rules.ws_backward_serves(functional(d=256, PAD_HEAD=True), "sm_90")  # d160-d248: the real dims
    for change in ({"dtype": "fp32"}, {"BLOCK_D": 96, "BLOCK_DV": 96}, {"BLOCK_D": 32, "BLOCK_DV": 32},
                   {"BLOCK_DV": 64}, {"BLOCK_D": 32, "BLOCK_DV": 32, "PAD_HEAD": True}, {"VARLEN": True},
                   {"DROPOUT": True},
                   {"BIAS": rules.BIAS_ADD}, {"BIAS": rules.BIAS_GRAD}):
        assert not rules.ws_backward_serves(functional(**change), "sm_90"), change
    assert rules.ATTN_BWD_WS.language == "gluon" and rules.ATTN_BWD_WS.archs == ("sm_90",)
    assert rules.ATTN_BWD_WS.chosen_by.operator == rules.BACKWARD.qualname
    assert "ws" in rules.BACKENDS and set(rules.BACKENDS) == set(dict(rules.BACKWARD.tuning_space)["backend"])


def test_explicit_ws_where_it_does_not_serve_says_what_does_in_one_line():
    q, k, v = make_qkv(1, 70, 90, 2, 2, 24, 24, torch.bfloat16, "cpu", requires_grad=True)  # bucket 32
    out = aotattn.flash_attn_func(q, k, v, backend="ws")
    with pytest.raises(ValueError, match=r"^backend 'ws': flash.attn_bwd_ws does not serve .*backend='split' serves"):
        out.sum().backward()
    q, k, v = make_qkv(1, 70, 90, 2, 2, 64, 64, torch.bfloat16, "cpu", requires_grad=True)
    out = aotattn.flash_attn_func(q, k, v, backend="ws", deterministic=True)
    with pytest.raises(ValueError, match="deterministic"):
        out.sum().backward()
    with pytest.raises(ValueError, match="backend: expected one of"):
        aotattn.flash_attn_func(q, k, v, backend="cudnn")


def test_cpu_tensors_plan_it_but_the_interpreter_refuses_to_run_it(monkeypatch):
    """perfmon plans calls on CPU tensors for a GPU's tables: the plan is made (dQ zeroed
    fp32, the stats first; with PERSISTENT a grid of at most one program per SM), and a
    launch of it on CPU is refused in one line."""
    q, k, v = make_qkv(2, 300, 500, 4, 2, 64, 64, torch.bfloat16, "cpu")
    c = planning.new_call(problem(q, k, v, causal=True), q, k, v)
    out, dout = torch.empty_like(q), torch.randn_like(q)
    lse = torch.zeros(2, 4, 300)
    stats, dq, dk, dv, _ = planning.backward_buffers(c, q, k, v, "ws", False)
    assert dq.dtype == torch.float32 and not dq.any() and planning.dq_accumulates("ws", False)
    config = Config.of(BLOCK_M=64, BLOCK_N=128, STAGES=2, num_warps=4, num_stages=1)
    plans = planning.backward_plans(c, dout, q, k, v, out, lse, stats, dq, dk, dv, None, "ws", False,
                                    {rules.ATTN_BWD_WS.name: config})
    assert [p.kernel for p in plans] == [rules.ATTN_BWD_PREPROCESS, rules.ATTN_BWD_WS]
    assert plans[1].grid == (4, 2, 2)  # key blocks of 128, key heads, batch
    assert plans[1].functional["GROUPED"] is True  # 4 query heads, 2 key heads
    assert rules.ATTN_BWD_WS.constexprs(plans[1].functional, config)["GROUPED"] is True
    names = [arg.name for arg in rules.ATTN_BWD_WS.arguments]
    assert plans[1].args[names.index("batch")] == 2
    persistent = Config.of({**config.as_dict(), "PERSISTENT": 1})
    walking = planning.backward_plans(c, dout, q, k, v, out, lse, stats, dq, dk, dv, None, "ws", False,
                                      {rules.ATTN_BWD_WS.name: persistent})[1]
    assert walking.grid == (4 * 2 * 2, 1, 1)  # one program per tile without an SM count (CPU), at most one per SM
    monkeypatch.setattr(planning, "multiprocessors", lambda device: 5)
    walking = planning.backward_plans(c, dout, q, k, v, out, lse, stats, dq, dk, dv, None, "ws", False,
                                      {rules.ATTN_BWD_WS.name: persistent})[1]
    assert walking.grid == (5, 1, 1)
    assert planning.choose_backend(c, False, q.device) == "split"  # CPU: the interpreter's backend
    with pytest.raises(ValueError, match="Gluon kernel: Triton's interpreter cannot run it"):
        launch(plans[1])


def test_a_call_without_groups_runs_the_variant_of_a_group_of_one():
    """GROUPED is the call's (Hq > Hk), named only when True (the cells and image keys of
    ungrouped calls are as before the axis), and passed to the kernel either way."""
    config = Config.of(BLOCK_M=64, BLOCK_N=128, STAGES=2, num_warps=4, num_stages=1)
    for heads_k, grouped in ((4, False), (2, True), (1, True)):
        q, k, v = make_qkv(1, 200, 300, 4, heads_k, 128, 128, torch.float16, "cpu")
        c = planning.new_call(problem(q, k, v), q, k, v)
        stats, dq, dk, dv, _ = planning.backward_buffers(c, q, k, v, "ws", False)
        ws = planning.backward_plans(c, torch.randn_like(q), q, k, v, torch.empty_like(q), torch.zeros(1, 4, 200),
                                     stats, dq, dk, dv, None, "ws", False, {rules.ATTN_BWD_WS.name: config})[1]
        assert ("GROUPED" in ws.functional.as_dict()) is grouped
        assert rules.ATTN_BWD_WS.constexprs(ws.functional, config)["GROUPED"] is grouped
        assert "GROUPED" not in planning.backward_plans(
            c, torch.randn_like(q), q, k, v, torch.empty_like(q), torch.zeros(1, 4, 200), *planning.backward_buffers(
                c, q, k, v, "split", False)[:4], None, "split", False)[0].functional.as_dict()


def test_a_grouped_call_reads_its_own_cell_and_else_the_ungrouped_one(tmp_path):
    """The kernel table's grouped cells fall back to the same call without groups; a patch
    block with GROUPED=True changes the grouped calls' choice only."""
    root = tmp_path / "db"
    shutil.copytree(tuning.database().root, root)
    for tuned in (root / "nvidia" / "sm_90").glob(f"{TABLE}.*.dbpatch"):
        tuned.unlink()  # the seed alone: no grouped block
    ungrouped = Functional.of(functional(d=128, mask=rules.MASK_BOTTOM_RIGHT))
    grouped = Functional.of({**ungrouped.as_dict(), "GROUPED": True})
    sizes = dict(seqlen_q=1024, seqlen_k=1024)
    before = tuning.Database(root).lookup("sm_90", rules.ATTN_BWD_WS, ungrouped, sizes)
    assert tuning.Database(root).lookup("sm_90", rules.ATTN_BWD_WS, grouped, sizes) == before
    other = Config.of({**before.as_dict(), "PERSISTENT": 0 if before.as_dict().get("PERSISTENT") else 1})
    knobs = " ".join(f"{k}={v}" for k, v in other.items)
    (root / "nvidia" / "sm_90" / f"{TABLE}.0900-grouped.dbpatch").write_text(
        f"#! aotattn-patch 1\n#! table {TABLE}\n\n[configs]\nother = {knobs}\n\n"
        f"[{' '.join(f'{a}={tuning.format.format_value(v)}' for a, v in grouped.items)}]\n"
        f"seqlen_q=1024 seqlen_k=1024: other\n")
    db = tuning.Database(root)
    assert db.lint() == []
    assert db.lookup("sm_90", rules.ATTN_BWD_WS, grouped, sizes) == rules.ATTN_BWD_WS.canonical(other)
    assert db.lookup("sm_90", rules.ATTN_BWD_WS, ungrouped, sizes) == before
    assert db.lookup("sm_90", rules.ATTN_BWD_WS, grouped, dict(seqlen_q=2048, seqlen_k=2048)) == \
        db.lookup("sm_90", rules.ATTN_BWD_WS, ungrouped, dict(seqlen_q=2048, seqlen_k=2048))


def test_the_tuner_times_grouped_cells_on_grouped_calls():
    """A grouped cell's problems have groups of tune_flash.GROUP (the timing shape too); a
    problem of the other grouping is refused (it would time the other variant)."""
    for grouped in (False, True):
        f = Functional.of({**functional(d=64, mask=rules.MASK_BOTTOM_RIGHT), **({"GROUPED": True} if grouped else {})})
        shape = tune_flash.accuracy_shapes(f, (64, 64))[0]
        group = tune_flash.GROUP if grouped else 1
        assert shape.group == group and tune_flash.timing_shape(f, (1024, 1024)).group == group
        made = tune_flash.Problem(TABLE, f, shape, "cpu")
        assert made.q.shape[2] == made.k.shape[2] * group
        other = dataclasses.replace(shape, heads=8, group=1 if grouped else 4)
        with pytest.raises(ValueError, match="selects functional"):
            tune_flash.Problem(TABLE, f, other, "cpu")


def _ws_patch(root, block: Functional, knobs: Config) -> None:
    """A patch of the ws table giving ``block``'s s1024 cell the configuration ``knobs``."""
    text = " ".join(f"{k}={v}" for k, v in knobs.items)
    header = " ".join(f"{a}={tuning.format.format_value(v)}" for a, v in block.items)
    (root / "nvidia" / "sm_90" / f"{TABLE}.0900-wide.dbpatch").write_text(
        f"#! aotattn-patch 1\n#! table {TABLE}\n\n[configs]\nwide = {text}\n\n[{header}]\n"
        "seqlen_q=1024 seqlen_k=1024: wide\n")


def test_wide_groups_key_the_table_and_never_the_kernel(monkeypatch, tmp_path):
    """A call with more than GROUP_WIDTH query heads a key head reads the WIDE_GROUPS cells
    (else the narrow grouped ones, then the ungrouped ones); the axis reaches no kernel, no
    plan and no image key: both widths launch one compiled grouped tile."""
    d, heads_q = 128, 16
    asked = []
    real = rules.config_for
    monkeypatch.setattr(rules, "config_for",
                        lambda kernel, f, device, **sizes: asked.append((kernel, f)) or real(kernel, f, device, **sizes))
    for heads_k, group in ((16, 1), (8, 2), (4, 4), (2, 8), (1, 16)):
        q, k, v = make_qkv(1, 96, 96, heads_q, heads_k, d, d, torch.bfloat16, "cpu")
        c = planning.new_call(problem(q, k, v, causal=True), q, k, v)
        wanted = planning.ws_functional(c).as_dict()
        assert wanted.get("GROUPED", False) is (group > 1) and wanted.get("WIDE_GROUPS", False) is (group > 4)
        stats, dq, dk, dv, _ = planning.backward_buffers(c, q, k, v, "ws", False)
        asked.clear()
        ws = planning.backward_plans(c, torch.randn_like(q), q, k, v, torch.empty_like(q),
                                     torch.zeros(1, heads_q, 96), stats, dq, dk, dv, None, "ws", False, {})[1]
        assert [f.as_dict() for kernel, f in asked if kernel is rules.ATTN_BWD_WS] == [wanted]  # looked up wide
        assert "WIDE_GROUPS" not in ws.functional.as_dict()  # launched as the grouped tile
        assert ws.functional == rules.ATTN_BWD_WS.compiled_functional(Functional.of(wanted))
        assert "WIDE_GROUPS" not in rules.ATTN_BWD_WS.constexprs(ws.functional, ws.config)
        assert "WIDE_GROUPS" not in rules.ATTN_BWD_WS.constexprs(Functional.of(wanted), ws.config)
    # the tables: a wide block changes the wide calls' choice only
    root = tmp_path / "db"
    shutil.copytree(tuning.database().root, root)
    for patch in (root / "nvidia" / "sm_90").glob(f"{TABLE}.*.dbpatch"):
        if "WIDE_GROUPS=True" in patch.read_text():
            patch.unlink()  # no wide block: the grouped one serves
    sizes = dict(seqlen_q=1024, seqlen_k=1024)
    plain = functional(d=d, mask=rules.MASK_BOTTOM_RIGHT)
    grouped = Functional.of({**plain, "GROUPED": True})
    wide = Functional.of({**plain, "GROUPED": True, "WIDE_GROUPS": True})
    before = tuning.Database(root).lookup("sm_90", rules.ATTN_BWD_WS, grouped, sizes)
    assert tuning.Database(root).lookup("sm_90", rules.ATTN_BWD_WS, wide, sizes) == before  # falls back
    other = Config.of(BLOCK_M=64, BLOCK_N=128, STAGES=2, PERSISTENT=2 if before.as_dict().get("PERSISTENT") != 2
                      else 1, num_warps=4, num_stages=1)
    _ws_patch(root, wide, other)
    db = tuning.Database(root)
    assert db.lint() == []
    assert db.lookup("sm_90", rules.ATTN_BWD_WS, wide, sizes) == other
    assert db.lookup("sm_90", rules.ATTN_BWD_WS, grouped, sizes) == before
    assert db.lookup("sm_90", rules.ATTN_BWD_WS, wide, dict(seqlen_q=4096, seqlen_k=4096)) == \
        db.lookup("sm_90", rules.ATTN_BWD_WS, grouped, dict(seqlen_q=4096, seqlen_k=4096))
    # the build compiles the grouped tile with the wide cell's configuration, each job once
    jobs = builder.enumerate_jobs(db, ["sm_90"], [TABLE], "dtype=bf16 BLOCK_D=128 MASK=2 GROUPED=True", forced=True)
    assert all("WIDE_GROUPS" not in job.functional.as_dict() for job in jobs) and len(set(jobs)) == len(jobs)
    assert Job("sm_90", TABLE, grouped, other) in jobs
    assert Job("sm_90", TABLE, wide, other) == Job("sm_90", TABLE, grouped, other)
    assert Job("sm_90", TABLE, wide, other).key == Job("sm_90", TABLE, grouped, other).key
    assert tune_flash.image_key(TABLE, wide, other) == tune_flash.image_key(TABLE, grouped, other)
    # never wide without groups
    assert not any(f.as_dict().get("WIDE_GROUPS") and not f.as_dict().get("GROUPED")
                   for f in rules.ATTN_BWD_WS.enumerate_functionals())
    assert any(f.as_dict().get("WIDE_GROUPS") for f in rules.ATTN_BWD_WS.enumerate_functionals())
    with pytest.raises(ValueError, match="disabled"):
        rules.ATTN_BWD_WS.check_functional({**plain, "WIDE_GROUPS": True})


def test_the_tuner_times_wide_cells_on_wide_groups():
    """A WIDE_GROUPS task's problems have groups of tune_flash.WIDE_GROUP; one of narrow
    groups is refused (it reads the other cell), and its other kernels are the plain ones."""
    f = Functional.of({**functional(d=128, mask=rules.MASK_BOTTOM_RIGHT), "GROUPED": True, "WIDE_GROUPS": True})
    assert tune_flash.group_of(f) == tune_flash.WIDE_GROUP > tune_flash.GROUP == rules.GROUP_WIDTH
    shape = tune_flash.accuracy_shapes(f, (64, 64))[0]
    timed = tune_flash.timing_shape(f, (4096, 4096))
    assert shape.group == timed.group == tune_flash.WIDE_GROUP and timed.heads % tune_flash.WIDE_GROUP == 0
    made = tune_flash.Problem(TABLE, f, shape, "cpu")
    assert made.q.shape[2] == made.k.shape[2] * tune_flash.WIDE_GROUP
    with pytest.raises(ValueError, match="selects functional"):
        tune_flash.Problem(TABLE, f, dataclasses.replace(shape, group=tune_flash.GROUP), "cpu")
    assert all("WIDE_GROUPS" not in g.as_dict() and "GROUPED" not in g.as_dict()
               for _, g in tune_flash.auxiliary(TABLE, f, "sm_90"))


def test_a_table_axis_needs_a_default():
    with pytest.raises(ValueError, match="table axes \\['WIDE'\\] need an axis_defaults value"):
        dataclasses.replace(rules.ATTN_BWD_WS, table_axes=("WIDE",))


def test_the_tables_ws_choice_falls_back_where_the_kernel_does_not_serve(monkeypatch):
    """A backward table saying ws (sm_80 inherits sm_90's cells) runs split for
    deterministic calls, head-dim buckets below 64, and on other architectures; padded
    heads of the buckets 64, 128 and 256 run ws."""
    monkeypatch.setattr(planning, "_device_arch", lambda device: arch)
    gpu = torch.device("cuda")
    monkeypatch.setattr(rules, "config_for", lambda kernel, f, device, **sizes: Config.of(backend="ws"))
    for arch, d, deterministic, expected in (("sm_90", 128, False, "ws"), ("sm_90", 64, False, "ws"),
                                            ("sm_90", 128, True, "split"), ("sm_90", 256, False, "ws"),
                                            ("sm_90", 96, False, "ws"), ("sm_90", 200, False, "ws"),
                                            ("sm_90", 40, False, "ws"), ("sm_90", 24, False, "split"),
                                            ("sm_80", 128, False, "split")):
        q, k, v = make_qkv(1, 64, 64, 2, 2, d, d, torch.float16, "cpu")
        c = planning.new_call(problem(q, k, v), q, k, v)
        assert planning.choose_backend(c, deterministic, gpu) == expected, (arch, d, deterministic)


def test_the_tuner_times_it_where_it_serves_within_its_budgets():
    assert {c["STAGES"] for c in fitting(128)} == {1, 2, 3} and {c["BLOCK_M"] for c in fitting(128)} == {64}
    # a second K/V slot (KV_SLOTS=2): persistent programs only; at d128 beside one q/dO slot
    # alone (STAGES=1 exists for it), at d64 beside every ring, at d256 nowhere
    for d, mask in ((64, rules.MASK_NONE), (64, rules.MASK_BOTTOM_RIGHT), (128, rules.MASK_NONE),
                    (128, rules.MASK_BOTTOM_RIGHT)):
        two = [c.as_dict() for c in fitting(d, mask) if c.as_dict().get("KV_SLOTS", 1) == 2]
        assert two and all(c["PERSISTENT"] for c in two)
        assert {c["PERSISTENT"] for c in two} == ({1, 2} if mask else {1})
        assert {c["STAGES"] for c in two} == ({1} if d == 128 else {2, 3})
        assert all(c.as_dict().get("KV_SLOTS", 1) == 2 for c in fitting(d, mask) if c["STAGES"] == 1)
    assert not any(c.as_dict().get("KV_SLOTS", 1) == 2 for pad in (False, True) for c in fitting(256, pad=pad))
    # 128 rows in 3 stages would need 232448 bytes of tiles, and the mbarriers beside them
    assert {(c["BLOCK_M"], c["STAGES"]) for c in fitting(64)} == {(64, 2), (64, 3), (128, 2)}
    assert {c["BLOCK_N"] for d in (64, 128) for c in fitting(d)} == {128}  # the key split
    # d256: the column split, its one fitting tile (q in 2 slots, dO in 1, P^T and dS^T twice)
    assert [(c["BLOCK_M"], c["BLOCK_N"], c["STAGES"]) for c in fitting(256)] == [(64, 64, 2)] * 6
    # padded heads in the d256 bucket: also the 128 + 64 split (NARROW), nowhere else; the
    # bulk dK/dV stores (TMA_STORE) of the halves, not of NARROW's split
    knobs = lambda c: tuple(c.as_dict().get(k, 0) for k in ("NARROW", "TMA_STORE", "PERSISTENT"))  # noqa: E731
    assert sorted(map(knobs, fitting(256, pad=True))) \
        == sorted([(0, t, p) for t in (0, 1) for p in (0, 1, 2)] + [(1, 0, p) for p in (0, 1, 2)])
    assert not any(c.as_dict().get("NARROW", 0) for d in (64, 128) for pad in (False, True)
                   for c in fitting(d, pad=pad)) and not any(c.as_dict().get("NARROW", 0) for c in fitting(256))
    # dK and dV by bulk stores from the dQ staging tiles' bytes (TMA_STORE), at every tile of
    # both splits; NARROW keeps its register stores
    for d in (64, 128, 256):
        assert {c.as_dict().get("TMA_STORE", 0) for c in fitting(d)} == {0, 1}
        assert len([c for c in fitting(d) if c.as_dict().get("TMA_STORE", 0)]) * 2 == len(fitting(d))
    assert not any(c.as_dict().get("TMA_STORE", 0) and c.as_dict().get("NARROW", 0) for c in fitting(256, pad=True))
    # one tile per program or one program per SM walking the tiles, at every tile size; the
    # wider masked sections (2) only under a mask, where they order anything
    for d in (64, 128, 256):
        for mask, walks in ((rules.MASK_BOTTOM_RIGHT, {0, 1, 2}), (rules.MASK_NONE, {0, 1})):
            by_tile = {}
            for c in fitting(d, mask):
                if c.as_dict().get("KV_SLOTS", 1) == 2:
                    continue  # above
                tile = (c["BLOCK_M"], c["BLOCK_N"], c["STAGES"])
                by_tile.setdefault(tile, set()).add(c.as_dict().get("PERSISTENT", 0))
            assert set(map(frozenset, by_tile.values())) == {frozenset(walks)}, (d, mask)
    f = Functional.of(functional())
    assert tune_flash.supports(TABLE, f) and tune_flash.supports(TABLE, Functional.of(functional(d=256)))
    assert not tune_flash.supports(TABLE, Functional.of(functional(d=96)))
    shape = tune_flash.Shape(2, 4, 100, 100, 128)
    assert tune_flash.flops(TABLE, shape, f) == tune_flash.flops("flash.attn_bwd_dkdv", shape, f)
    operator = Functional.of({**{n: v for n, v in functional().items() if n != "BLOCK_DV"}, "DETERMINISTIC": False})
    assert (TABLE, Functional.of(functional())) in tune_flash.auxiliary("flash.backward", operator)
    det = Functional.of({**operator.as_dict(), "DETERMINISTIC": True})
    assert TABLE not in {t for t, _ in tune_flash.auxiliary("flash.backward", det)}


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
@pytest.mark.parametrize("persistent", [0, 1, 2])
@pytest.mark.parametrize("d, pad", [(64, False), (128, False), (256, False), (64, True), (256, True)],
                         ids=["d64", "d128", "d256", "d64-padded", "d256-padded"])
def test_it_compiles_to_warp_partitions_with_wgmma_and_bulk_copies_and_reduces(d, pad, persistent):
    """In the sm_90 machine code: the partitions (more warps than compiled with, setmaxnreg),
    wgmma with a register A operand (dV, dK: P and dS from registers; at d256, the column
    split, from shared memory, 128 columns per consumer, and S^T, dP^T of 32 queries) and
    both operands transposed from shared memory (dQ), tensor-map loads and the bulk reduce
    that adds dQ. The tuner's estimate of its shared memory (the largest fitting tiles) is Triton's figure
    within 1 KB: the pruning of tiles past the limit rests on it. Padded heads: the same program
    (descriptors of the real head dims, masked dK/dV stores), no wgmma hazard (compile_job checks)."""
    f = Functional.of(functional(d=d, mask=rules.MASK_BOTTOM_RIGHT, PAD_HEAD=pad))
    footprint = tune_flash.footprint(TABLE)
    config = max((c for c in fitting(d) if c.as_dict().get("PERSISTENT", 0) == persistent),
                 key=lambda c: candidates.shared_bytes(footprint, f, c, candidates.target("sm_90")))
    entry, cubin = compile_job(Job("sm_90", TABLE, f, config))
    assert entry.num_warps == 12  # two consumer warpgroups and the loader's
    assert abs(candidates.shared_bytes(footprint, f, config, candidates.target("sm_90")) - entry.shared) <= 1024
    code = sass(cubin)
    if d == 256:
        assert re.search(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, gdesc\[UR\d+\]\.tnspB", code)  # dV, dK
        assert re.search(r"HGMMA\.64x32x16\.F32\.BF16 R\d+, gdesc", code)  # S^T, dP^T
        assert not re.search(r"HGMMA\.\S+ R\d+, R\d+, gdesc", code)
    else:
        assert re.search(rf"HGMMA\.64x{d}x16\.F32\.BF16 R\d+, R\d+, gdesc", code)  # A from registers
    assert "tnspA.tnspB" in code
    assert "UTMALDG" in code and "UTMAREDG" in code and "USETMAXREG" in code
    # the dQ reduce is not waited for where it is issued (Triton's descriptor_reduce would wait for its read
    # there, DEPBAR.LE SB0 after the flush: 10-20% of the kernel's time, RESULTS.md, sixteenth session)
    instructions = [line.split(";")[0].split("*/")[-1].strip() for line in code.splitlines()
                    if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    issued = [i for i, op in enumerate(instructions) if "UTMAREDG" in op]
    assert issued and not any(op.startswith("DEPBAR") for i in issued for op in instructions[i + 1:i + 4])


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
def test_without_groups_the_steps_divide_by_nothing():
    """GROUPED=False compiles the group of one in: the step's query head and block come
    without the integer division by the group size (each a MUFU.RCP in sm_90 code) that
    the grouped variant does per step in the loader and both consumers."""
    config = Config.of(BLOCK_M=64, BLOCK_N=128, STAGES=2, num_warps=4, num_stages=1)
    f = functional(d=128, mask=rules.MASK_BOTTOM_RIGHT)
    codes = {g: sass(compile_job(Job("sm_90", TABLE, Functional.of({**f, "GROUPED": g}), config))[1])
             for g in (False, True)}
    assert codes[False].count("MUFU.RCP") + 3 <= codes[True].count("MUFU.RCP")


WS_PATCH = """#! aotattn-patch 1
#! table flash.backward

[configs]
ws = backend=ws

[dtype=bf16 BLOCK_D=128 PAD_HEAD=False MASK=0 VARLEN=False DROPOUT=False BIAS=0 DETERMINISTIC=False]
seqlen_q=4096 seqlen_k=4096: ws
"""


def test_where_the_backward_table_chooses_it_the_build_compiles_it(tmp_path):
    root = tmp_path / "db"
    shutil.copytree(tuning.database().root, root)
    for tuned in (root / "nvidia" / "sm_90").glob("flash.backward.*.dbpatch"):
        tuned.unlink()  # the seed alone (split everywhere), then one cell of ws
    (root / "nvidia" / "sm_90" / "flash.backward.0900-ws.dbpatch").write_text(WS_PATCH)
    db = tuning.Database(root)
    assert db.lint() == []
    jobs = builder.enumerate_jobs(db, ["sm_90"], [TABLE])
    assert {(j.functional["dtype"], j.functional["BLOCK_D"], j.functional["MASK"]) for j in jobs} == {("bf16", 128, 0)}
    # grouped calls of the cell read it too (the operator's grouped cell falls back to it)
    assert {j.functional.as_dict().get("GROUPED", False) for j in jobs} == {False, True}
    assert not builder.enumerate_jobs(db, [a for a in db.archs() if a != "sm_90"], [TABLE], forced=True)


# ----------------------------------------------------------------------------- GPU


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]  # batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim
    kwargs: dict = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16
    scale_q: float = 1.0  # q multiplied by it: large scores make rows see one key
    head_dim_v: int | None = None  # default: head_dim


CASES = [
    Case("full-tails", (2, 1000, 1777, 8, 8, 128)),
    Case("full-gqa-fp16", (2, 1024, 4096, 16, 4, 64), dtype=torch.float16),
    Case("causal", (2, 4096, 4096, 8, 8, 128), {"causal": True}),
    Case("causal-fp16", (1, 2000, 2000, 4, 4, 128), {"causal": True}, torch.float16),
    Case("causal-top-left", (1, 1500, 3000, 8, 8, 64), {"causal": True, "diagonal": "top_left"}),
    Case("causal-sq-longer", (1, 3000, 1500, 8, 8, 64), {"causal": True}),  # rows that see no key
    Case("window", (2, 2048, 2048, 8, 8, 128), {"window_size": (40, 7)}),
    Case("narrow-window-gqa", (1, 2048, 2048, 8, 2, 64), {"window_size": (3, 0)}),
    Case("one-key", (2, 2048, 3001, 8, 2, 128), {"window_size": (0, 0)}),
    Case("one-key-peaked-fp16", (1, 1000, 1000, 4, 4, 128), {"causal": True}, torch.float16, scale_q=12.0),
    Case("shorter-than-a-block", (2, 40, 50, 4, 4, 64)),
    Case("one-query", (3, 1, 333, 4, 4, 128), {"causal": True}),
    Case("one-key-column", (2, 300, 1, 4, 4, 128)),
    Case("negative-scale", (1, 1000, 2000, 4, 2, 64), {"softmax_scale": -0.2}),
    Case("long", (1, 8192, 8192, 2, 2, 128), {"causal": True}),
    # head dim 256: the column split
    Case("d256-full-tails", (2, 1000, 1777, 4, 4, 256)),
    Case("d256-causal-gqa-fp16", (2, 1024, 1500, 8, 2, 256), {"causal": True}, torch.float16),
    Case("d256-window-top-left", (1, 1500, 900, 4, 4, 256), {"window_size": (50, 3), "diagonal": "top_left"}),
    Case("d256-causal-sq-longer", (1, 2000, 1000, 4, 4, 256), {"causal": True}),  # rows that see no key
    Case("d256-one-key-peaked", (1, 700, 900, 4, 2, 256), {"window_size": (0, 0)}, scale_q=12.0),
    Case("d256-one-query", (3, 1, 333, 2, 1, 256), {"softmax_scale": -0.3}),
    Case("d256-long", (1, 8192, 8192, 2, 2, 256), {"causal": True}),
    Case("d256-one-key-column", (2, 300, 1, 4, 4, 256)),
    # short queries, long keys: many tiles per program under PERSISTENT (the rings, K/V and
    # dS buffers' phases run on across tiles), some of them seen by no query (zero steps)
    Case("many-tiles-gqa", (8, 128, 8192, 16, 8, 64)),
    Case("many-tiles-causal", (4, 256, 8192, 8, 8, 128), {"causal": True}),
    Case("many-tiles-window-fp16", (4, 100, 6000, 8, 4, 128), {"window_size": (900, 3)}, torch.float16),
    Case("d256-many-tiles-window", (4, 200, 6000, 4, 2, 256), {"window_size": (700, 50)}),
    Case("d256-shorter-than-a-block", (2, 40, 50, 4, 2, 256), {"causal": True, "diagonal": "top_left"}),
    # padded heads: the descriptors span the real head dims (zeros past them), dK/dV stores masked
    Case("d192-full-tails", (2, 1000, 1777, 4, 4, 192)),
    Case("d160-causal-gqa-fp16", (2, 1024, 1500, 8, 2, 160), {"causal": True}, torch.float16),
    Case("d96-window-top-left", (1, 1500, 900, 4, 4, 96), {"window_size": (50, 3), "diagonal": "top_left"}),
    Case("d72-causal-sq-longer", (1, 2000, 1000, 4, 4, 72), {"causal": True}),  # rows that see no key
    Case("d40-negative-scale", (2, 700, 900, 4, 2, 40), {"softmax_scale": -0.3}),
    Case("d224-one-query", (3, 1, 333, 2, 1, 224)),
    Case("d200-one-key-peaked", (1, 700, 900, 4, 2, 200), {"window_size": (0, 0)}, scale_q=12.0),
    Case("d96-dv80-causal-gqa", (2, 800, 1100, 8, 2, 96), {"causal": True}, head_dim_v=80),
    Case("d248-dv192-shorter-than-a-block", (2, 40, 50, 4, 4, 248), {"causal": True}, torch.float16, head_dim_v=192),
]


@pytest.fixture
def backend(monkeypatch):
    """``use(config)``: from then on every backward the ws kernel serves runs it with ``config``."""
    use = forced_kernel(monkeypatch, rules.BACKWARD, Config.of(backend="ws"), rules.ATTN_BWD_WS)
    yield use
    ops._PLANS.entries.clear()


def _reference_grads(q, k, v, dout, **kwargs):
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.attention(*ref_in, **kwargs)
    return torch.autograd.grad(ref, ref_in, dout.double())


def _assert_grads(grads, ref_grads, dtype, what):
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == dtype and torch.isfinite(g).all(), f"{what}: d{name} not finite"
        err = rel_err(g, r)
        if r.norm() > 1e-6:  # one key column: dq and dk are exactly 0 in the reference
            assert err < 2 * TOLERANCE[dtype], f"{what}: d{name} {err:.2e}"
        else:
            assert g.abs().max() < 1e-3, f"{what}: d{name} should be 0"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_it_matches_the_reference_with_every_knob_value(case, backend, request):
    seed_from(request.node.name)
    q, k, v = make_qkv(*case.shape, case.head_dim_v or case.shape[5], case.dtype, "cuda")
    q = (q.float() * case.scale_q).to(case.dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=case.dtype, device="cuda")
    ref_grads = _reference_grads(q, k, v, dout, **case.kwargs)
    bucket = rules.head_dim_bucket(case.shape[5])
    for config in fitting(bucket, pad=bucket not in (case.shape[5], case.head_dim_v or bucket)):
        backend(config)
        c = planning.new_call(problem(q, k, v, **case.kwargs), q, k, v)
        assert planning.choose_backend(c, False, q.device) == "ws"
        out = aotattn.flash_attn_func(q, k, v, **case.kwargs)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        _assert_grads(grads, ref_grads, case.dtype, candidates.config_name(config))


def one_per_code_path(configs: list[Config]) -> list[Config]:
    """The first configuration of each combination of the knobs that choose code paths
    (PERSISTENT, TMA_STORE, KV_SLOTS, ...), whatever its tiles."""
    tiles = {"BLOCK_M", "BLOCK_N", "STAGES", "num_warps", "num_stages"}
    first: dict[tuple, Config] = {}
    for config in configs:
        first.setdefault(tuple(sorted((k, v) for k, v in config.as_dict().items() if k not in tiles)), config)
    return list(first.values())


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_a_tiny_softmax_scale_keeps_its_subnormal_dq(d, backend, request):
    """softmax_scale -1.175e-38 (the smallest normal float32) makes dQ 1e-39..1e-36: what
    one key contributes is subnormal in float32. The bulk reduce-adds that sum dQ see it unscaled (dS K), the
    scale coming after (planning.finish_dq): scaled inside, GPU float atomics flush such
    sums to zero (the fused backend's dQ came out all 0 on the H100). One configuration per
    code path (both splits, every walk and store)."""
    seed_from(request.node.name)
    q, k, v = make_qkv(2, 300, 300, 4, 4, d, d, torch.bfloat16, "cuda", requires_grad=True)
    dout = torch.randn_like(q)
    kwargs = dict(causal=True, softmax_scale=-1.175494351e-38)
    ref_grads = _reference_grads(q, k, v, dout, **kwargs)
    # H100, 2026-12-05: max |dQ| 3.4e-37..4.1e-37 (300 keys of randn); a key's share of it,
    # scaled inside the kernels, would be below float32's smallest normal 1.18e-38
    assert 0 < ref_grads[0].abs().max() < 2e-36
    for config in one_per_code_path(fitting(d)):
        backend(config)
        grads = torch.autograd.grad(aotattn.flash_attn_func(q, k, v, **kwargs), (q, k, v), dout)
        for name, g, r in zip("qkv", grads, ref_grads):
            assert rel_err(g, r) < 0.03, f"{candidates.config_name(config)}: d{name} {rel_err(g, r):.2e}"


@pytest.mark.gpu
def test_sdpa_layout_cached_plans_and_deterministic_calls(backend):
    """SDPA's (B, H, S, D) views through the plan cache, twice with fresh inputs (dQ's fp32
    buffer zeroed for each call); a deterministic call runs split instead."""
    backend(fitting(128)[0])
    for seed in (1, 2):
        torch.manual_seed(seed)
        q = torch.randn(2, 16, 1500, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, 4, 1500, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        dout = torch.randn_like(q)
        out = aotattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        t = lambda x: x.detach().transpose(1, 2)  # noqa: E731
        ref = _reference_grads(t(q), t(k), t(v), t(dout), causal=True)
        _assert_grads([g.transpose(1, 2) for g in grads], ref, torch.bfloat16, f"sdpa seed {seed}")
    q, k, v = make_qkv(1, 512, 512, 4, 4, 128, 128, torch.bfloat16, "cuda", requires_grad=True)
    c = planning.new_call(problem(q, k, v), q, k, v)
    assert planning.choose_backend(c, True, q.device) == "split"
    first, second = (torch.autograd.grad(aotattn.flash_attn_func(q, k, v, deterministic=True).sum(), (q,))[0]
                     for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 256])
def test_keys_shared_by_every_sequence_stride_0_views(d, backend, request):
    """K and V expanded over the batch (one prefix shared by every sequence: a batch stride of
    0, which the 4-D descriptors of a persistent program step over), causal with fewer
    queries than keys: every fitting configuration against the reference, dK and dV summed
    over the batch by autograd."""
    seed_from(request.node.name)
    q = torch.randn(6, 300, 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k1, v1 = (torch.randn(1, 2000, 2, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    k, v = k1.expand(6, -1, -1, -1), v1.expand(6, -1, -1, -1)
    assert k.stride(0) == 0
    ref_grads = _reference_grads(q, k, v, dout, causal=True)
    ref_grads = (ref_grads[0], ref_grads[1].sum(0, keepdim=True), ref_grads[2].sum(0, keepdim=True))
    for config in fitting(d):
        backend(config)
        grads = torch.autograd.grad(aotattn.flash_attn_func(q, k, v, causal=True), (q, k1, v1), dout)
        _assert_grads(grads, ref_grads, torch.bfloat16, candidates.config_name(config))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_rows_of_16_bytes_at_a_buckets_head_dim_run_the_padded_variant(d, backend, request):
    """q, k, v sliced from wider rows (strides multiples of 8, not 16): the padded variant,
    whose bulk copies need only 16-byte rows, at the bucket's own head dim."""
    seed_from(request.node.name)
    wide = [torch.randn(2, 900, 4, d + 8, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    q, k, v = (t[..., :d].requires_grad_() for t in wide)
    c = planning.new_call(problem(q, k, v, causal=True), q, k, v)
    assert c.functional(backward=True)["PAD_HEAD"]
    dout = torch.randn(2, 900, 4, d, device="cuda", dtype=torch.bfloat16)
    ref_grads = _reference_grads(q, k, v, dout, causal=True)
    for config in fitting(d):
        backend(config)
        assert planning.choose_backend(c, False, q.device) == "ws"
        grads = torch.autograd.grad(aotattn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
        _assert_grads(grads, ref_grads, torch.bfloat16, candidates.config_name(config))


def test_perfmon_forces_it_only_where_it_runs():
    from aotattn.perfmon import providers as P
    from aotattn.perfmon.entries import declared

    BY_NAME = {e.name: e for e in declared()}  # noqa: N806

    assert P.FORCED["aotattn:ws"] == "ws"
    assert P.unsupported(BY_NAME["dense-bf16-d128-s4096-causal"], "aotattn:ws", "bwd") is None
    assert P.unsupported(BY_NAME["dense-bf16-d128-s4096-causal"], "aotattn:ws", "fwd") is not None
    assert P.unsupported(BY_NAME["dense-fp16-d256-s4096-causal"], "aotattn:ws", "bwd") is None
    assert P.unsupported(BY_NAME["odd-dim-bf16-d96-s4096-causal"], "aotattn:ws", "bwd") is None  # padded heads
    assert P.ws_backward_runs_on("sm_90") and not P.ws_backward_runs_on("sm_80")
    assert not P.ws_backward_runs_on(None)
