"""Task selection and serialization."""

from __future__ import annotations

import json
import random

import pytest

from aotattn.families.flash import rules
from aotattn.spec import Functional
from aotattn.tune import harnesses, tasks


def test_category_selects_tables():
    tunable = harnesses.tunable()
    assert tasks.select_tables(["flash"], tunable) == tunable
    assert tasks.select_tables(["flash,attn_fwd", "flash,backward", "flash,attn_fwd"], tunable) == \
        ["flash.attn_fwd", "flash.backward"]
    for bad in ("nosuch", "flash,nosuch", "flash,attn_fwd,x", ",attn_fwd"):
        with pytest.raises(tasks.SelectionError):
            tasks.select_tables([bad], tunable)


def test_roots_diagonal_default():
    found = list(tasks.enumerate_tasks("sm_90", ["flash.attn_fwd"], where={"dtype": ("fp16", "bf16")}))
    # roots: unpadded, dense, no dropout; MASK 0 or 2 (1 falls back to 2); BIAS 0 or 1; 5 head dims
    functionals = {t.functional for t in found}
    assert len(functionals) == 2 * 5 * 2 * 2
    assert all(not f["PAD_HEAD"] and not f["VARLEN"] and not f["DROPOUT"] and f["MASK"] != 1 for f in functionals)
    assert {t.cell for t in found} == {(b, b) for b in rules.SEQLEN_BUCKETS}
    assert len(found) == len(functionals) * len(rules.SEQLEN_BUCKETS)
    assert len({t.id for t in found}) == len(found)


def test_where_seqlen_grid_and_all_functionals():
    where = tasks.parse_where("dtype=bf16 BLOCK_D=64,128 MASK=0")
    found = list(tasks.enumerate_tasks("sm_90", ["flash.attn_bwd_fused", "flash.backward"], where=where,
                                       seqlens=[1024, 4096], cells="grid"))
    fused = [t for t in found if t.table == "flash.attn_bwd_fused"]
    assert {t.cell for t in fused} == {(1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096)}
    off = list(tasks.enumerate_tasks("sm_90", ["flash.attn_bwd_fused"], where=where, seqlens=[512, 1024, 4096],
                                     cells="off-diagonal"))
    assert {t.cell for t in off} == {(q, k) for q in (512, 1024, 4096) for k in (512, 1024, 4096) if q != k}
    assert len(off) == 6 * len({t.functional for t in fused})
    assert {t.functional["ATOMIC_DQ"] for t in fused} == {False, True}
    assert {t.functional["DETERMINISTIC"] for t in found if t.table == "flash.backward"} == {False, True}
    every = list(tasks.enumerate_tasks("sm_90", ["flash.attn_fwd"], where=where, seqlens=[64], all_functionals=True))
    assert any(t.functional["PAD_HEAD"] for t in every) and len(every) > len(
        list(tasks.enumerate_tasks("sm_90", ["flash.attn_fwd"], where=where, seqlens=[64])))


def test_cells_named_one_by_one():
    """``--cells 128x16384,...``: exactly those cells (seqlen_q x seqlen_k), each once, in order."""
    where = tasks.parse_where("dtype=bf16 BLOCK_D=128 MASK=2")
    found = list(tasks.enumerate_tasks("sm_90", ["flash.attn_bwd_ws", "flash.backward"], where=where,
                                       cells="128x16384,1024x1024,128x16384,512x4096"))
    functionals = {(t.table, t.functional) for t in found}
    assert {table for table, _ in functionals} == {"flash.attn_bwd_ws", "flash.backward"}
    for table, functional in functionals:
        assert [t.cell for t in found if (t.table, t.functional) == (table, functional)] == [
            (128, 16384), (1024, 1024), (512, 4096)]


@pytest.mark.parametrize("bad, message", [
    ({"where": {"dtype": ("fp64",)}}, "fp64"), ({"seqlens": [100]}, "100"), ({"cells": "square"}, "cells"),
    ({"cells": "128x100"}, "100 not a bucket of seqlen_k"), ({"cells": "128"}, "2 sizes a cell"),
    ({"cells": "128x16384x4"}, "2 sizes a cell"), ({"cells": ","}, "cells like"),
    ({"where": {"MSAK": ("2",)}}, "--where MSAK: no table of the selection has that axis")])
def test_bad_selections(bad, message):
    with pytest.raises(tasks.SelectionError, match=message):
        list(tasks.enumerate_tasks("sm_90", ["flash.attn_fwd"], **bad))
    with pytest.raises(tasks.SelectionError, match="where"):
        tasks.parse_where("dtype")


def test_payload_round_trip_and_validation():
    all_tasks = list(tasks.enumerate_tasks("sm_90", harnesses.tunable(), seqlens=[256, 2048]))
    sample = random.sample(all_tasks, 20)
    text = tasks.write_batch(sample)
    assert tasks.read_batch(text) == sample
    payload = sample[0].to_json()
    assert tasks.Task.from_json(json.loads(json.dumps(payload))) == sample[0]
    for broken, message in [({**payload, "cell": [100, 100]}, "bucket"), ({**payload, "cell": [256]}, "cell"),
                            ({**payload, "table": "flash.nosuch"}, "table"), ({"arch": "sm_90"}, "payload"),
                            ({**payload, "functional": {**payload["functional"], "dtype": "fp64"}}, "dtype"),
                            # 0 == False and 1 == True in Python: of another type, not the same value
                            ({**payload, "functional": {**payload["functional"], "VARLEN": 0}}, "VARLEN=0"),
                            ({**payload, "functional": {**payload["functional"], "BIAS": False}}, "BIAS=False")]:
        with pytest.raises(ValueError, match=message):
            tasks.Task.from_json(broken)
    first = json.loads(text.splitlines()[0])
    with pytest.raises(tasks.SelectionError, match=r"^b\.jsonl:2: cell: "):  # the line named, as settings errors are
        tasks.read_batch(text.splitlines()[0] + "\n" + json.dumps({**first, "cell": [3, 3]}), "b.jsonl")
    line = json.dumps({**json.loads(text.splitlines()[0]), "id": "0" * 20})
    with pytest.raises(tasks.SelectionError, match="id"):
        tasks.read_batch(line)
    with pytest.raises(tasks.SelectionError, match=":1: not JSON"):
        tasks.read_batch("{")


def test_describe_names_the_cell():
    f = Functional.of(dict(dtype="bf16", BLOCK_D=64, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=False, BIAS=0,
                           DETERMINISTIC=False))
    t = tasks.Task("sm_90", "flash.backward", f, (512, 1024))
    assert t.describe() == ("sm_90 flash.backward [BIAS=0,BLOCK_D=64,DETERMINISTIC=False,DROPOUT=False,MASK=2,"
                            "PAD_HEAD=False,VARLEN=False,dtype=bf16] seqlen_q=512 seqlen_k=1024")
    assert t.category == "flash,backward"


def test_cells_a_call_never_looks_up_are_not_tuned():
    """Top-left cells on the diagonal run the bottom-right variant (rules.kernel_mask); a
    top-left backward with fewer queries than keys and no dropout plans only the keys some
    query sees (planning.trim_keys): the tuner leaves both out; the forward, dropout and
    Sq > Sk cells stay."""
    where = tasks.parse_where("dtype=bf16 BLOCK_D=128 MASK=1 PAD_HEAD=False VARLEN=False BIAS=0")
    tables = ["flash.attn_fwd", "flash.attn_bwd_fused", "flash.backward"]
    found = list(tasks.enumerate_tasks("sm_90", tables, where=where, seqlens=[512, 4096], cells="grid",
                                       all_functionals=True))
    kept = {(t.table, t.functional["DROPOUT"], t.cell) for t in found
            if harnesses.supported(t.table, t.functional, t.cell)}
    for table in tables:
        assert (table, False, (512, 512)) not in kept and (table, False, (4096, 512)) in kept
        assert ((table, False, (512, 4096)) in kept) == (table == "flash.attn_fwd")
        assert (table, True, (512, 4096)) in kept


@pytest.mark.parametrize("args, message", [
    (["--dtype", "bf16", "--where", "dtype=fp16"], "--dtype and --where dtype=... both given"),
    (["--head-dim", "64", "--where", "BLOCK_D=128"], "--head-dim and --where BLOCK_D=... both given"),
    (["--where", "MSAK=2"], "--where MSAK: no table of the selection has that axis"),
    (["--where", "MASK=,"], "--where: expected axis=value[,value...], got 'MASK=,' (no value)"),  # said: bias, varlen
])
def test_plan_refuses_a_where_that_would_silently_select_something_else(args, message):
    from typer.testing import CliRunner

    from aotattn.cli import app

    result = CliRunner().invoke(app, ["tune", "plan", "-c", "flash,attn_fwd", *args])
    assert result.exit_code == 1 and message in result.output, result.output


def test_a_batch_line_with_bad_settings_is_named():
    """`tune compile` and the offline runner read a batch's settings through one reader: a
    bad value is refused in one line naming the file and the line (was a bare message)."""
    from aotattn.tune.runner import Settings
    from aotattn.tune.tasks import SelectionError, read_batch_settings, write_batch
    from tests.tune.conftest import forward_task

    tasks = [forward_task(cell=(16, 16)), forward_task(cell=(32, 32))]
    settings = Settings.for_table("flash.attn_fwd").to_json()
    lines = write_batch(tasks, {"flash.attn_fwd": settings}).splitlines()
    read = read_batch_settings("\n".join(lines), "b.jsonl", Settings.of_line)
    assert [s for _, s in read] == [Settings.for_table("flash.attn_fwd")] * 2
    for bad in ({"repeats": 5}, {"min_gain": "x"}, {"knobs": "no"}):
        edited = json.loads(lines[1])
        edited["settings"].update(bad)
        text = "\n".join([lines[0], json.dumps(edited)])
        with pytest.raises(SelectionError, match=f"^b.jsonl:2: settings.{next(iter(bad))}"):
            read_batch_settings(text, "b.jsonl", Settings.of_line)
