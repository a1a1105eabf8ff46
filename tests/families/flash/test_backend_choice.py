"""The backward backend is looked up with everything that changes which backend wins:
padding, the mask's diagonal, varlen, dropout, a bias (and whether its gradient is
wanted), determinism (on CPU no GPU is needed: the lookup is recorded, not run)."""

from __future__ import annotations

import shutil

import pytest
import torch

from aotattn import tuning
from aotattn.families.flash import planning, rules
from aotattn.families.flash.checks import check_bias, check_flash
from aotattn.spec import Config, Functional

CUDA = torch.device("cuda")  # only named: config_for is recorded, nothing runs there


def _choice(monkeypatch, q, k, v, *, bias=None, bias_grad=False, deterministic=False, **mask):
    seen = []

    def recorded(kernel, functional, device, **sizes):
        seen.append((kernel, functional, sizes))
        return tuning.database().lookup("sm_90", kernel, functional, sizes)

    monkeypatch.setattr(rules, "config_for", recorded)
    monkeypatch.setattr(planning, "_device_arch", lambda device: "sm_90")  # the architecture looked up
    p = check_flash(q, k, v, dropout_p=mask.pop("dropout_p", 0.0), softmax_scale=None,
                    window_size=mask.pop("window_size", (-1, -1)), causal=mask.pop("causal", False),
                    diagonal=mask.pop("diagonal", "bottom_right"))
    c = planning.new_call(p, q, k, v, None if bias is None else check_bias("bias", bias, p, q), bias_grad=bias_grad)
    backend = planning.choose_backend(c, deterministic, CUDA)
    ((kernel, functional, sizes),) = seen
    assert kernel is rules.BACKWARD and backend in rules.BACKENDS
    return functional.as_dict(), sizes


def _qkv(d=64, sq=300, sk=300, dtype=torch.bfloat16, heads_k=4):
    return (torch.randn(2, sq, 4, d, dtype=dtype), torch.randn(2, sk, heads_k, d, dtype=dtype),
            torch.randn(2, sk, heads_k, d, dtype=dtype))


@pytest.mark.parametrize("case, expect", [
    (dict(), {}),
    (dict(d=40), {"PAD_HEAD": True}),
    (dict(causal=True), {"MASK": rules.MASK_BOTTOM_RIGHT}),
    (dict(causal=True, diagonal="top_left", sk=500), {"MASK": rules.MASK_TOP_LEFT}),
    (dict(dropout_p=0.3), {"DROPOUT": True}),
    (dict(bias=True), {"BIAS": rules.BIAS_ADD}),
    (dict(bias=True, bias_grad=True), {"BIAS": rules.BIAS_GRAD}),
    (dict(deterministic=True), {"DETERMINISTIC": True}),
    (dict(dtype=torch.float32, d=200), {"dtype": "fp32", "BLOCK_D": 256, "PAD_HEAD": True}),
    (dict(heads_k=2), {"GROUPED": True}),
    (dict(heads_k=1, causal=True), {"GROUPED": True, "MASK": rules.MASK_BOTTOM_RIGHT}),
])
def test_the_operator_lookup_names_every_axis_of_the_call(monkeypatch, case, expect):
    case = dict(case)
    q, k, v = _qkv(case.pop("d", 64), 300, case.pop("sk", 300), case.pop("dtype", torch.bfloat16),
                   case.pop("heads_k", 4))
    bias = torch.randn(2, 4, q.shape[1], k.shape[1], dtype=q.dtype) if case.pop("bias", False) else None
    functional, sizes = _choice(monkeypatch, q, k, v, bias=bias, **case)
    base = dict(dtype="bf16", BLOCK_D=64, PAD_HEAD=False, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0,
                DETERMINISTIC=False)  # GROUPED=False is left out (rules.BACKWARD.axis_defaults)
    assert functional == {**base, **expect}
    assert sizes == {"seqlen_q": 300, "seqlen_k": k.shape[1]}


def test_every_operator_functional_resolves_in_the_shipped_database():
    """Each refinement falls back to a block: no call can meet a missing operator cell."""
    db = tuning.database()
    for functional in rules.BACKWARD.enumerate_functionals():
        for s in (16, 1000, 20000):
            config = db.lookup("sm_90", rules.BACKWARD, functional, {"seqlen_q": s, "seqlen_k": s})
            assert config["backend"] in rules.BACKENDS


def test_operator_fallback_drops_grouping_first_and_padding_last():
    f = dict(dtype="bf16", BLOCK_D=64, PAD_HEAD=True, MASK=rules.MASK_TOP_LEFT, VARLEN=True, DROPOUT=True,
             BIAS=rules.BIAS_GRAD, DETERMINISTIC=False, GROUPED=True)
    chain = [f]
    while (twin := rules.BACKWARD.fallback(chain[-1])) is not None:
        chain.append(twin)
    dropped = [next(a for a in f if chain[i][a] != chain[i + 1].get(a, False)) for i in range(len(chain) - 1)]
    assert dropped == ["GROUPED", "BIAS", "DROPOUT", "VARLEN", "MASK", "PAD_HEAD"]
    assert "GROUPED" not in chain[1]  # an ungrouped functional leaves the axis out
    assert chain[-1] == {**{a: v for a, v in f.items() if a != "GROUPED"}, "PAD_HEAD": False,
                         "MASK": rules.MASK_BOTTOM_RIGHT, "VARLEN": False, "DROPOUT": False, "BIAS": rules.BIAS_NONE}
    assert Functional.of(chain[-1]) in tuning.database().effective("sm_90", "flash.backward").blocks
    assert Config.of(backend="split") in tuning.database().effective("sm_90", "flash.backward").configs.values()


def test_a_varlen_call_looks_up_its_own_operator_cell(monkeypatch):
    from aotattn.families.flash.checks import check_varlen

    seen = []

    def recorded(kernel, functional, device, **sizes):
        seen.append((functional.as_dict(), sizes))
        return tuning.database().lookup("sm_90", kernel, functional, sizes)

    monkeypatch.setattr(rules, "config_for", recorded)
    cu = torch.tensor([0, 100, 100, 350], dtype=torch.int32)
    q, k, v = (torch.randn(350, 4, 128, dtype=torch.float16) for _ in range(3))
    p = check_varlen(q, k, v, cu, cu, 250, 250, dropout_p=0.0, softmax_scale=None, causal=True,
                     window_size=(-1, -1), diagonal="bottom_right")
    planning.choose_backend(planning.new_call(p, q, k, v, None, cu, cu), True, CUDA)
    ((functional, sizes),) = seen
    assert functional == dict(dtype="fp16", BLOCK_D=128, PAD_HEAD=False, MASK=rules.MASK_BOTTOM_RIGHT, VARLEN=True,
                              DROPOUT=False, BIAS=0, DETERMINISTIC=True)
    assert sizes == {"seqlen_q": 250, "seqlen_k": 250}


@pytest.mark.parametrize("window, causal, sq, sk, expect", [
    ((256, 0), False, 4096, 4096, (257, 257)),      # sliding window: tiles of a 257-key causal call
    ((128, 128), False, 8192, 8192, (257, 257)),
    ((256, -1), True, 4096, 4096, (257, 257)),      # causal sets right = 0: the same window
    ((100, 20), False, 50, 3000, (50, 121)),        # fewer queries than the span
    ((2000, 2000), False, 3000, 3000, (3000, 3000)),  # wider than the keys: the lengths
    ((-1, 0), False, 4096, 4096, (4096, 4096)),     # causal: the lengths
    ((256, -1), False, 4096, 4096, (4096, 4096)),   # unbounded on one side
])
def test_a_windowed_call_is_looked_up_at_its_span(monkeypatch, window, causal, sq, sk, expect):
    """Every program of a narrow window loops over at most left + right + 1 keys: its
    backend and every kernel's tiles are those of a call of that span, whatever the lengths."""
    q, k, v = _qkv(64, sq, sk)
    _, sizes = _choice(monkeypatch, q, k, v, window_size=window, causal=causal)
    assert sizes == {"seqlen_q": expect[0], "seqlen_k": expect[1]}
    seen = []

    def recorded(kernel, functional, device, **sizes):
        seen.append((kernel.name, sizes))
        return tuning.database().lookup("sm_90", kernel, functional, sizes)

    monkeypatch.setattr(rules, "config_for", recorded)
    p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, window_size=window, causal=causal,
                    diagonal="bottom_right")
    c = planning.new_call(p, q, k, v, None)
    out = planning.new_output(p, q, False)
    lse = torch.empty(planning.lse_shape(p, q))
    plan = planning.forward_plan(c, q, k, v, out, lse)
    span = {"seqlen_q": expect[0], "seqlen_k": expect[1]}
    # which forward kernel (the flash.forward table), then that kernel's tiles: both at the span
    assert seen == [("forward", span), (plan.kernel.name, span)]
    blocks = -(-sq // plan.config["BLOCK_M"])  # the programs still cover every query
    if plan.config.as_dict().get("PERSISTENT", 0):  # the ws grid walking the tiles: one per tile without an SM count
        assert plan.grid == (blocks * q.shape[2] * q.shape[0], 1, 1)
    else:
        assert plan.grid == (blocks, q.shape[2], q.shape[0])


def _operator_patch(cells: dict[tuple[str, int, bool], str]) -> str:
    """A flash.backward patch setting the causal s1024 cell of each (dtype, head dim,
    grouped) to a backend."""
    lines = ["#! aotattn-patch 1", "#! table flash.backward", "", "[configs]"]
    lines += [f"{b} = backend={b}" for b in sorted(set(cells.values()))]
    for (dtype, d, grouped), backend in cells.items():
        lines += ["", f"[dtype={dtype} BLOCK_D={d} PAD_HEAD=False MASK=2 VARLEN=False DROPOUT=False BIAS=0 "
                      f"DETERMINISTIC=False{' GROUPED=True' if grouped else ''}]",
                  f"seqlen_q=1024 seqlen_k=1024: {backend}"]
    return "\n".join(lines) + "\n"


def test_grouped_calls_read_their_own_cells_and_fall_back_to_the_ungrouped_ones(monkeypatch, tmp_path):
    """A grouped-query call (Hq > Hk) looks up the GROUPED=True refinement: where a patch
    gives the grouped s1024 cell one backend and the same call without groups another, each
    call reads its own; a head dim without grouped cells (d32: the tuner's grouped cells are
    d64 and d128) reads the ungrouped ones, at every length."""
    root = tmp_path / "db"
    shutil.copytree(tuning.database().root, root)
    sm90 = root / "nvidia" / "sm_90"
    assert not any("GROUPED" in line and "BLOCK_D=32 " in line
                   for patch in sm90.glob("flash.backward*") for line in patch.read_text().splitlines())
    cells = {(dtype, d, grouped): backend for dtype in ("bf16", "fp16")
             for d, grouped, backend in ((64, False, "fused"), (64, True, "split"), (32, False, "fused"))}
    (sm90 / "flash.backward.0900-test.dbpatch").write_text(_operator_patch(cells))
    db = tuning.Database(root)
    assert db.lint() == []
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for d in (64, 32):
            choices = {}
            for heads_k in (4, 2, 1):
                for seqlen in (1000, 300, 3000):
                    q, k, v = _qkv(d, seqlen, seqlen, torch_dtype, heads_k)
                    functional, sizes = _choice(monkeypatch, q, k, v, causal=True)
                    assert functional.get("GROUPED", False) is (heads_k < 4)
                    choices[(heads_k, seqlen)] = db.lookup("sm_90", rules.BACKWARD, Functional.of(functional),
                                                           sizes)["backend"]
                    monkeypatch.undo()
            assert choices[(4, 1000)] == "fused"
            if d == 64:  # its own cell, not the ungrouped call's
                assert choices[(2, 1000)] == choices[(1, 1000)] == "split"
            else:  # no grouped cell: the ungrouped call's, at every length
                for seqlen in (1000, 300, 3000):
                    assert choices[(2, seqlen)] == choices[(1, seqlen)] == choices[(4, seqlen)], (dtype, seqlen)
