"""The warp-specialized forward (``flash.attn_fwd_ws``, Gluon, sm_90) and the ``flash.forward``
table that chooses it.

On the CPU machine: what it serves and where (rules, tables, build, tuner), what it
compiles to for sm_90 (warp partitions with their register budgets, wgmma, bulk tensor
copies, no spills, the PTX hazard scan), and that CPU calls never plan it. On the GPU: the
same calls as the Triton kernel's tests, forced onto it with every tuning knob's values,
against the float64 reference, and the backward on its log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

import aotattn
from aotattn import tuning
from aotattn.compiler import builder
from aotattn.compiler.jobs import Job, compile_job
from aotattn.families.flash import ops, planning, rules
from aotattn.runtime import launch
from aotattn.spec import Config, Functional
from aotattn.tune import candidates
from aotattn.tune import flash as tune_flash
from tests.compiler.test_machine_code import CUOBJDUMP, sass
from tests.families.flash.helpers import (assert_forward_matches, dense_functional, forced_kernel, make_qkv, problem,
                                         seed_from)
from tests.helpers import TOLERANCE, rel_err

TABLE = "flash.attn_fwd_ws"
SM_90 = candidates.target("sm_90")


functional = dense_functional


def fitting(d: int, dtype: str = "bf16", mask: int = rules.MASK_NONE) -> list[Config]:
    """Every configuration of the tuning space the tuner's pruning keeps at head dim d."""
    kept, _ = candidates.candidates(rules.ATTN_FWD_WS, Functional.of(functional(dtype, d, mask)), "sm_90",
                                    tune_flash.footprint(TABLE))
    return kept


def covering(d: int, mask: int = rules.MASK_NONE) -> list[Config]:
    """Few fitting configurations that together take every value of every knob that fits at d
    (under a mask, PERSISTENT=2's sections too)."""
    kept = fitting(d, mask=mask)
    chosen: list[Config] = []

    def knob_of(c: Config, knob: str):  # configurations leave knobs at their default out
        return {**dict(rules.ATTN_FWD_WS.knob_defaults), **c.as_dict()}[knob]

    for knob, values in rules.ATTN_FWD_WS.tuning_space:
        for value in values:
            if any(knob_of(c, knob) == value for c in chosen):
                continue
            match = next((c for c in kept if knob_of(c, knob) == value), None)
            if match is not None:
                chosen.append(match)
    return chosen


# ----------------------------------------------------------------------------- CPU


def test_it_serves_plain_fp16_bf16_calls_on_sm_90_only():
    served = [f.as_dict() for f in rules.ATTN_FWD_WS.enumerate_functionals()]
    assert len(served) == 2 * 3 * 3 * 2  # dtype x head dim 64/128/256 x mask x padded heads
    assert {(f["dtype"], f["BLOCK_D"], f["MASK"], f["PAD_HEAD"]) for f in served} == set(
        itertools.product(("fp16", "bf16"), (64, 128, 256), (0, 1, 2), (False, True)))
    assert rules.ws_serves(functional(), "sm_90") and rules.ws_serves(functional(PAD_HEAD=True), "sm_90")
    assert not rules.ws_serves(functional(), "sm_80") and not rules.ws_serves(functional(), "gfx942")
    for change in ({"dtype": "fp32"}, {"BLOCK_D": 32, "BLOCK_DV": 32}, {"BLOCK_DV": 64},
                   {"VARLEN": True}, {"DROPOUT": True}, {"BIAS": rules.BIAS_ADD}):
        assert not rules.ws_serves(functional(**change), "sm_90"), change
    assert rules.ATTN_FWD_WS.language == "gluon" and rules.ATTN_FWD.language == "triton"
    assert rules.ATTN_FWD_WS.chosen_by.operator == rules.FORWARD.qualname
    assert set(rules.ENGINES) == set(dict(rules.FORWARD.tuning_space)["engine"])


def test_cpu_calls_plan_the_triton_kernel_and_never_interpret_gluon():
    q, k, v = make_qkv(1, 70, 90, 2, 2, 64, 64, torch.bfloat16, "cpu")
    p = problem(q, k, v, causal=True)
    c = planning.new_call(p, q, k, v)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 70)
    assert planning.choose_engine(c, q.device) == "triton"  # the interpreter's table
    assert planning.forward_plan(c, q, k, v, out, lse).kernel is rules.ATTN_FWD
    with pytest.raises(ValueError, match="engine: expected one of triton, ws"):
        planning.forward_plan(c, q, k, v, out, lse, engine="cudnn")
    small = make_qkv(1, 70, 90, 2, 2, 24, 24, torch.bfloat16, "cpu")  # head bucket 32: no ws kernel
    with pytest.raises(ValueError, match="engine 'ws'.*does not serve"):
        planning.forward_plan(planning.new_call(problem(*small), *small), *small, torch.empty_like(small[0]), lse,
                              engine="ws")
    # padded heads: the descriptors span the real head dims (kernels/forward_ws.py)
    padded = make_qkv(1, 70, 90, 2, 2, 72, 40, torch.bfloat16, "cpu")
    pc = planning.new_call(problem(*padded), *padded)
    plan = planning.forward_plan(pc, *padded, torch.empty(1, 70, 2, 40, dtype=torch.bfloat16), lse, config=Config.of(
        BLOCK_M=128, BLOCK_N=64, STAGES=2, PINGPONG=1, num_warps=4, num_stages=1), engine="ws")
    assert plan.kernel is rules.ATTN_FWD_WS and plan.functional["PAD_HEAD"] and plan.functional["BLOCK_D"] == 128
    # planned on CPU tensors (perfmon plans calls so, for a GPU's tables), never interpreted
    plan = planning.forward_plan(c, q, k, v, out, lse, config=Config.of(
        BLOCK_M=128, BLOCK_N=64, STAGES=2, PINGPONG=1, num_warps=4, num_stages=1), engine="ws")
    assert plan.kernel is rules.ATTN_FWD_WS and plan.grid == (1, 2, 1)
    with pytest.raises(ValueError, match="Gluon kernel: Triton's interpreter cannot run it"):
        launch(plan)


def test_the_forward_table_is_each_architectures_own():
    """sm_80 and the AMD targets inherit sm_90's kernel tables; the forward's choice of
    kernel must not follow (they have no Gluon kernel): their tables stand alone and say
    triton in every cell, and the build lists no attn_fwd_ws job for them."""
    db = tuning.database()
    for arch in db.archs():
        assert "#! base" not in db.table_path(arch, rules.FORWARD.qualname).read_text()
        table = db.effective(arch, rules.FORWARD.qualname)
        engines = {table.configs[name]["engine"] for grid in table.blocks.values() for row in grid for name in row}
        if arch != "sm_90":
            assert engines == {"triton"}, arch
            assert not db.table_path(arch, TABLE).exists()
        assert engines <= set(rules.ENGINES)
    others = [a for a in db.archs() if a != "sm_90"]
    for forced in (False, True):
        assert not builder.enumerate_jobs(db, others, [TABLE], forced=forced)
    # sm_90: a ws kernel is built exactly in the cells whose forward table chooses it
    jobs = builder.enumerate_jobs(db, ["sm_90"], [TABLE])
    forward = db.effective("sm_90", rules.FORWARD.qualname)
    chooses = any(forward.configs[n]["engine"] == "ws" for grid in forward.blocks.values() for row in grid for n in row)
    assert bool(jobs) == chooses
    assert len(builder.enumerate_jobs(db, ["sm_90"], [TABLE], forced=True)) >= 18


def test_the_tuners_pruning_follows_the_rings_and_register_budgets():
    fp = tune_flash.footprint(TABLE)

    def why(d, **knobs):
        values = {"BLOCK_M": 128, "BLOCK_N": 64, "STAGES": 2, "PINGPONG": 1, "num_warps": 4, "num_stages": 1, **knobs}
        return candidates.why_pruned(fp, Functional.of(functional(d=d)), Config.of(values), SM_90)

    # the ring is exactly STAGES deep: d256 BLOCK_N 64 fits two slots (64 KB of Q + 2 x 64 KB), not three
    assert why(256) is None
    assert "shared memory" in why(256, STAGES=3)
    assert candidates.shared_bytes(fp, Functional.of(functional(d=256)), Config.of(
        BLOCK_M=128, BLOCK_N=64, STAGES=2, PINGPONG=1, num_warps=4, num_stages=1), SM_90) == 128 * 256 * 2 * 3
    # three consumers hold 160 registers each: d64 128-key blocks fit, d128 ones do not
    assert why(64, BLOCK_M=192, BLOCK_N=128, STAGES=3) is None
    assert "budget" in why(128, BLOCK_M=192, BLOCK_N=128)
    assert "budget" in why(256, BLOCK_M=192, BLOCK_N=32)
    assert len(fitting(64)) > len(fitting(256)) >= 4
    # a second Q slot loads the next tile's Q ahead: with PERSISTENT only, and it costs a Q tile
    assert "PERSISTENT" in why(128, Q_SLOTS=2)
    assert why(128, BLOCK_N=128, PERSISTENT=1, Q_SLOTS=2) is None
    slots = [candidates.shared_bytes(fp, Functional.of(functional(d=128)), Config.of(
        BLOCK_M=128, BLOCK_N=128, STAGES=2, PINGPONG=1, PERSISTENT=1, Q_SLOTS=q, num_warps=4, num_stages=1), SM_90)
        for q in (1, 2)]
    assert slots[1] - slots[0] == 128 * 128 * 2
    assert "shared memory" in why(256, PERSISTENT=1, Q_SLOTS=2)  # 128 KB of Q and a 64-key ring: too much
    staged = [candidates.shared_bytes(fp, Functional.of(functional(d=128)), Config.of(
        BLOCK_M=128, BLOCK_N=64, STAGES=2, PINGPONG=1, TMA_STORE=t, num_warps=4, num_stages=1), SM_90) for t in (0, 1)]
    assert staged[1] - staged[0] == 128 * 128 * 2  # TMA_STORE's staging tiles
    for d in (64, 128, 256):
        assert {c.as_dict().get("Q_SLOTS", 1) for c in covering(d)} == {1, 2}, d
        assert {c.as_dict().get("TMA_STORE", 0) for c in covering(d)} == {0, 1}, d
        assert all(c.as_dict().get("PERSISTENT") for c in fitting(d) if c.as_dict().get("Q_SLOTS", 1) == 2)
    # the tuner times it where it serves, as a forward
    f = Functional.of(functional())
    assert tune_flash.supports(TABLE, f) and tune_flash.supports("flash.forward", f)
    assert not tune_flash.supports(TABLE, Functional.of(functional(DROPOUT=True)))
    assert not tune_flash.supports("flash.forward", Functional.of(functional(dtype="fp32")))
    shape = tune_flash.Shape(2, 4, 100, 100, 128)
    assert tune_flash.flops("flash.forward", shape, f) == tune_flash.flops("flash.attn_fwd", shape, f)
    assert {t for t, _ in tune_flash.auxiliary("flash.forward", f)} == {"flash.attn_fwd", TABLE}


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton package carries no cuobjdump")
@pytest.mark.parametrize("persistent, q_slots, tma_store", [(0, 1, 0), (1, 1, 0), (1, 2, 0), (1, 1, 1), (2, 1, 1)])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_it_compiles_to_warp_partitions_with_wgmma_and_bulk_copies(d, persistent, q_slots, tma_store):
    """What makes it the kernel it is, in the sm_90 machine code: more warps than it was
    compiled with (the partitions), registers moved between them (setmaxnreg), wgmma
    (HGMMA), tensor-map bulk copies (UTMALDG) waited on with mbarriers, and no local
    memory (a spill of the accumulators would be 2-3x slower), one tile per program or
    many (PERSISTENT), with one Q slot or two, the output stored from registers or by a bulk
    copy (UTMASTG, TMA_STORE). compile_job also ran the wgmma register-hazard scan over its PTX."""
    base = {**covering(d)[0].as_dict(), "PERSISTENT": persistent, "Q_SLOTS": q_slots, "TMA_STORE": tma_store}
    if q_slots == 2 or tma_store:  # room for the second Q tile or the staging tiles: a small K/V ring
        base.update(BLOCK_N=min(base["BLOCK_N"], 64 if d < 256 else 32), STAGES=2)
    config = Config.of(base)
    masked = Functional.of(functional(d=d, mask=rules.MASK_BOTTOM_RIGHT))
    assert candidates.why_pruned(tune_flash.footprint(TABLE), masked, config, SM_90) is None
    entry, cubin = compile_job(Job("sm_90", TABLE, masked, config))
    assert entry.num_warps == 4 * (config["BLOCK_M"] // 64 + 1)  # consumers and the loader's warpgroup
    assert entry.shared <= SM_90.shared_memory and entry.global_scratch_size > 0  # descriptors made on the device
    code = sass(cubin)
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16", code)
    assert "UTMALDG" in code and "SYNCS" in code and "USETMAXREG" in code
    stores = re.findall(r"\bSTG\.E\S*", code)
    if tma_store:  # the output by bulk copies; the log-sum-exp alone from registers
        assert "UTMASTG" in code and len(stores) <= 4, stores
    else:
        assert "UTMASTG" not in code and len(stores) > 8
    local = re.findall(r"\b(?:LDL|STL)\b", code)
    if persistent:  # d256: a few scalars of the tile loop kept on the stack (once per tile), not the accumulators
        assert len(local) <= 12, f"local memory: {len(local)} spill loads and stores"
    else:
        assert not local, "local memory: the consumers spill"


# ----------------------------------------------------------------------------- GPU


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]  # batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim
    kwargs: dict = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16
    head_dim_v: int | None = None  # None: head_dim

    @property
    def dims(self) -> tuple[int, int]:
        """(head_dim, head_dim_v)"""
        return self.shape[5], self.shape[5] if self.head_dim_v is None else self.head_dim_v

    @property
    def bucket(self) -> int:
        return rules.head_dim_bucket(max(self.dims))


CASES = [
    Case("full", (2, 2048, 3001, 8, 8, 128)),
    Case("full-gqa-fp16", (2, 1024, 4096, 16, 4, 64), dtype=torch.float16),
    Case("full-d256", (1, 1000, 1777, 4, 4, 256)),
    Case("causal", (2, 4096, 4096, 8, 8, 128), {"causal": True}),
    Case("causal-d256-fp16", (1, 2000, 2000, 4, 4, 256), {"causal": True}, torch.float16),
    Case("causal-top-left", (1, 1500, 3000, 8, 8, 64), {"causal": True, "diagonal": "top_left"}),
    Case("causal-sq-longer", (1, 3000, 1500, 8, 8, 64), {"causal": True}),  # rows that see no key
    Case("window", (2, 4096, 4096, 8, 8, 128), {"window_size": (40, 7)}),
    Case("narrow-window", (1, 2048, 2048, 8, 8, 64), {"window_size": (3, 0)}),
    Case("one-key", (2, 2048, 3001, 8, 2, 128), {"window_size": (0, 0)}),
    Case("shorter-than-a-block", (2, 40, 50, 4, 4, 64)),
    Case("one-query", (3, 1, 333, 4, 4, 128), {"causal": True}),
    Case("one-key-column", (2, 300, 1, 4, 4, 256)),
    Case("negative-scale", (1, 1000, 2000, 4, 4, 64), {"softmax_scale": -0.2}),
    Case("long", (1, 8192, 8192, 2, 2, 128), {"causal": True}),
    # PERSISTENT walks the heads of unmasked calls in sections whose K and V fit in 24 MB:
    # d256 s8192 keys, three key heads a section (3, 3, 2 here; 9 and 3 query heads with
    # the groups of three, the first section spanning both sequences)
    Case("l2-sections", (1, 700, 8192, 8, 8, 256)),
    Case("l2-sections-gqa", (2, 1500, 8192, 6, 2, 256), dtype=torch.float16),
    # PERSISTENT=2 under a mask with few query blocks (at most programs / 8): sections of
    # programs // (4 query blocks) query heads, whole groups; the last one narrower
    Case("causal-short-sections", (3, 512, 512, 11, 11, 64), {"causal": True}),
    Case("causal-short-sections-gqa", (3, 1000, 1000, 12, 4, 128), {"causal": True}),
    Case("window-short-sections", (4, 1024, 1024, 12, 12, 64), {"window_size": (100, 20)}),
    # padded heads (PAD_HEAD): zero columns from the bulk copies past the real head dims
    Case("padded-d72-causal", (2, 1024, 1024, 8, 8, 72), {"causal": True}),
    Case("padded-d96-dv64", (2, 1000, 1777, 8, 4, 96), head_dim_v=64),
    Case("padded-d80-window-fp16", (1, 2048, 2048, 8, 8, 80), {"window_size": (100, 0)}, torch.float16),
    Case("padded-d200-causal", (1, 1500, 1500, 4, 4, 200), {"causal": True}),
    Case("padded-d160-dv224-gqa-fp16", (2, 700, 3000, 6, 2, 160), dtype=torch.float16, head_dim_v=224),
    Case("padded-d40-one-query", (3, 1, 333, 4, 4, 40), {"causal": True}),
]


@pytest.fixture
def engine(monkeypatch):
    """``use(config)``: from then on every forward the table lets the ws kernel serve runs
    it, with ``config``."""
    use = forced_kernel(monkeypatch, rules.FORWARD, Config.of(engine="ws"), rules.ATTN_FWD_WS)
    yield use
    ops._PLANS.entries.clear()


def _configs(case: Case) -> list[Config]:
    masked = case.kwargs.get("causal") or "window_size" in case.kwargs
    return covering(case.bucket, rules.MASK_BOTTOM_RIGHT if masked else rules.MASK_NONE)


def _name(config: Config) -> str:
    return candidates.config_name(config)


def _served(case: Case) -> bool:
    b, sq, sk, hq, hk, _ = case.shape
    q, k, v = make_qkv(b, 2, 2, hq, hk, *case.dims, case.dtype, "cpu")
    c = planning.new_call(problem(q, k, v, **case.kwargs), q, k, v)
    return rules.ws_serves(c.functional(), "sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_it_matches_the_reference_with_every_knob_value(case, engine, request):
    assert _served(case), case
    seed_from(request.node.name)
    q, k, v = make_qkv(*case.shape[:5], *case.dims, case.dtype, "cuda")
    for config in _configs(case):
        engine(config)
        c = planning.new_call(problem(q, k, v, **case.kwargs), q, k, v)
        assert planning.choose_engine(c, q.device) == "ws"
        out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, **case.kwargs)
        try:
            assert_forward_matches(out, lse, q, k, v, **case.kwargs)
        except AssertionError as exc:
            raise AssertionError(f"{_name(config)}: {exc}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("causal", "full-gqa-fp16", "window", "full-d256",
                                                                   "padded-d96-dv64", "padded-d200-causal")],
                         ids=lambda c: c.name)
def test_the_backward_runs_on_its_log_sum_exp(case, engine, request):
    """A training call: the backward reads the ws forward's out and lse."""
    seed_from(request.node.name)
    q, k, v = make_qkv(*case.shape[:5], *case.dims, case.dtype, "cuda", requires_grad=True)
    engine(covering(case.bucket)[0])
    out = aotattn.flash_attn_func(q, k, v, **case.kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    from aotattn import reference

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.attention(*ref_in, **case.kwargs)
    ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
    assert rel_err(out.detach(), ref.detach()) < TOLERANCE[case.dtype]
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) < 2 * TOLERANCE[case.dtype], f"d{name}"


def _tuned_choices(table) -> list[tuple[Functional, str, tuple[int, int]]]:
    """(functional, configuration name, its first cell) for each configuration the sm_90 table
    chooses, once per (masked or not, padded or not, head-dim block): the tuner times each cell
    at one size with random inputs; these calls add odd lengths, grouped heads and the other
    mask sides."""
    (_, rows), (_, cols) = table.keys
    first: dict[tuple, tuple[Functional, str, tuple[int, int]]] = {}
    for f, grid in table.blocks.items():
        axes = f.as_dict()
        for i, row in enumerate(grid):
            for j, name in enumerate(row):
                key = (name, axes["MASK"] > 0, axes["PAD_HEAD"], axes["BLOCK_D"])
                first.setdefault(key, (f, name, (rows[i], cols[j])))
    return list(first.values())


TUNED_TABLE = tuning.database().effective("sm_90", TABLE)
TUNED = _tuned_choices(TUNED_TABLE)


def _tuned_case(f: Functional, cell: tuple[int, int]) -> Case:
    """A call the table sends to ``f`` near ``cell``: lengths off the cell (capped at 2048: eight
    float64 references at once stay under 4 GB of scores), 6 query heads on 3 key heads, head
    dims that bucket into ``f``."""
    axes = f.as_dict()
    assert not (axes["VARLEN"] or axes["DROPOUT"] or axes["BIAS"]), f"{f}: a functional this test cannot call yet"
    mask = {0: {}, 1: {"causal": True, "diagonal": "top_left"}, 2: {"causal": True}}[axes["MASK"]]
    sq, sk = max(1, min(cell[0], 2048) - 7), min(cell[1], 2048) + 13  # never equal: top-left stays top-left
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[axes["dtype"]]
    pads = (8, 24, 40) if axes["PAD_HEAD"] else (0,)
    for d, dv in itertools.product([axes["BLOCK_D"] - p for p in pads], [axes["BLOCK_DV"] - p for p in pads]):
        case = Case(f"{f}", (2, sq, sk, 6, 3, d), mask, dtype, dv)
        q, k, v = make_qkv(1, 2, 3, 6, 3, d, dv, dtype, "cpu")
        if Functional.of(planning.new_call(problem(q, k, v, **mask), q, k, v).functional()) == f:
            return case
    raise AssertionError(f"no head dims near {axes['BLOCK_D']}/{axes['BLOCK_DV']} plan {f}")


def test_each_tuned_choice_has_a_call_that_plans_it():
    """The GPU test below covers every configuration the table chooses (one call each)."""
    chosen = {name for grid in TUNED_TABLE.blocks.values() for row in grid for name in row}
    assert {name for _, name, _ in TUNED} == chosen
    for f, _, cell in TUNED:
        case = _tuned_case(f, cell)
        assert case.shape[1] != case.shape[2] and 1 <= case.shape[1] <= 2041, case
        assert _served(case), case


@pytest.mark.gpu
@pytest.mark.parametrize("choice", TUNED, ids=lambda c: f"{c[1]}-mask{c[0].as_dict()['MASK']}-d{c[0].as_dict()['BLOCK_D']}"
                         f"{'-pad' if c[0].as_dict()['PAD_HEAD'] else ''}")
def test_every_tuned_choice_matches_the_reference_off_its_cell(choice, engine, request):
    f, name, cell = choice
    case = _tuned_case(f, cell)
    seed_from(request.node.name)
    q, k, v = make_qkv(*case.shape[:5], *case.dims, case.dtype, "cuda")
    engine(TUNED_TABLE.configs[name])
    c = planning.new_call(problem(q, k, v, **case.kwargs), q, k, v)
    assert Functional.of(c.functional()) == f and planning.choose_engine(c, q.device) == "ws"
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, **case.kwargs)
    assert_forward_matches(out, lse, q, k, v, **case.kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 256])
def test_keys_shared_by_every_sequence_stride_0_views(d, engine, request):
    """K and V expanded over the batch (a batch stride of 0 in the 4-D descriptors), causal
    with fewer queries than keys, with every knob value (PERSISTENT walks the batch)."""
    seed_from(request.node.name)
    q = torch.randn(6, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2000, 2, d, device="cuda", dtype=torch.bfloat16).expand(6, -1, -1, -1) for _ in range(2))
    assert k.stride(0) == 0
    for config in covering(d):
        engine(config)
        out, lse = aotattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
        try:
            assert_forward_matches(out, lse, q, k, v, causal=True)
        except AssertionError as exc:
            raise AssertionError(f"{_name(config)}: {exc}") from None


@pytest.mark.gpu
def test_sdpa_layout_and_cached_plans(engine):
    """SDPA's (B, H, S, D) views, twice through the plan cache with fresh inputs."""
    engine(covering(128)[0])
    for seed in (1, 2):
        torch.manual_seed(seed)
        q = torch.randn(2, 16, 1500, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 4, 1500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = aotattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert_forward_matches(out.transpose(1, 2), None, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               causal=True)


WS_PATCH = """#! aotattn-patch 1
#! table flash.forward

[configs]
ws = engine=ws

[dtype=bf16 BLOCK_D=128 BLOCK_DV=128 PAD_HEAD=False MASK=0 VARLEN=False DROPOUT=False BIAS=0]
seqlen_q=4096 seqlen_k=4096: ws
"""


def test_where_the_table_chooses_it_the_build_and_perfmon_compile_it(tmp_path):
    """A patch choosing ws in one cell: the build lists attn_fwd_ws jobs for that functional
    only, and perfmon's image list (the operators planned on CPU tensors for sm_90's
    tables) holds the ws kernel for a call in that cell and the Triton one elsewhere."""
    import shutil

    from aotattn.perfmon.images import planning_for

    root = tmp_path / "db"
    shutil.copytree(tuning.database().root, root)
    for tuned in (root / "nvidia" / "sm_90").glob("flash.forward.*.dbpatch"):
        tuned.unlink()  # the seed alone (triton everywhere), then one cell of ws
    (root / "nvidia" / "sm_90" / "flash.forward.0900-ws.dbpatch").write_text(WS_PATCH)
    db = tuning.Database(root)
    jobs = builder.enumerate_jobs(db, ["sm_90"], [TABLE])
    assert {(j.functional["dtype"], j.functional["BLOCK_D"], j.functional["MASK"]) for j in jobs} == {("bf16", 128, 0)}
    for seqlen, kernel in ((4096, TABLE), (1024, "flash.attn_fwd")):
        with planning_for("sm_90", db) as planned:
            q, k, v = make_qkv(1, seqlen, seqlen, 1, 1, 128, 128, torch.bfloat16, "cpu")
            aotattn.flash_attn_func(q, k, v)
        forward = {j.table for j in planned if j.table in ("flash.attn_fwd", TABLE)}
        assert forward == {kernel}, seqlen
