"""The perfmon declaration: what it covers, its FLOP counts, and that the operators take every entry."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aotattn import reference
from aotattn.families.flash import rules
from aotattn.perfmon import images
from aotattn.perfmon.entries import Entry, declared, select, visible_pairs

ENTRIES = declared()


def test_names_unique_and_every_entry_valid():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    assert all(" " not in n and n for n in names)
    for e in ENTRIES:
        e.validate()
        assert Entry.parse(e.name, e.describe()) == e


def test_the_grid_covers_what_the_issue_asks():
    synthetic = [e for e in ENTRIES if e.group not in ("model", "training")]
    assert len(synthetic) >= 250
    assert {e.dtype for e in synthetic} == {"fp16", "bf16", "fp32"}
    dims = {e.head_dim for e in synthetic}
    assert {64, 128, 256} <= dims and any(d not in rules.HEAD_DIM_BUCKETS for d in dims)
    assert any(e.head_dim != e.head_dim_v for e in synthetic)
    assert {e.mask_name.split("(")[0] for e in synthetic} >= {"none", "causal", "window"}
    assert any(e.seqlen_q < e.seqlen_k for e in synthetic) and any(e.seqlen_q > e.seqlen_k for e in synthetic)
    assert any(e.group_size > 1 for e in synthetic) and any(e.api == "varlen" for e in synthetic)
    assert any(e.dropout_p for e in synthetic) and {e.bias for e in synthetic} == {"none", "bias", "bias-grad"}
    assert all("bwd" in e.passes for e in synthetic)
    # sized to fill the GPU: every non-varlen synthetic call has at least 2^17 query rows over B x H
    assert all(e.batch * e.heads_q * e.seqlen_q >= 2**17 for e in synthetic if e.api != "varlen")
    training = [e for e in ENTRIES if e.training]
    assert training and all(e.passes == ("fwd", "fwdbwd") and e.seqlen_q <= 512 for e in training)


@pytest.mark.parametrize("name, batch, heads_q, heads_k, seqlen, head_dim, causal", [
    ("model-roberta-large", 512, 16, 16, 384, 64, False),
    ("model-bert-large-uncased", 192, 16, 16, 512, 64, False),
    ("model-distilbert-base-uncased", 384, 12, 12, 512, 64, False),
    ("model-gpt2", 72, 12, 12, 1024, 64, True),
    ("model-video-dit-s6630", 1, 32, 32, 6630, 128, False),
    ("model-video-dit-s15300", 1, 32, 32, 15300, 128, False),
    ("model-gqa-lm-s4096", 4, 32, 8, 4096, 128, True),
])
def test_model_shapes_are_the_issues(name, batch, heads_q, heads_k, seqlen, head_dim, causal):
    e = {e.name: e for e in ENTRIES}[name]
    assert (e.batch, e.heads_q, e.heads_k, e.seqlen_q, e.seqlen_k, e.head_dim, e.causal) == \
        (batch, heads_q, heads_k, seqlen, seqlen, head_dim, causal)
    assert e.passes == ("fwd", "bwd")


@given(sq=st.integers(1, 70), sk=st.integers(1, 70), causal=st.booleans(), left=st.integers(-1, 80),
       right=st.integers(-1, 80), diagonal=st.sampled_from(["bottom_right", "top_left"]))
def test_visible_pairs_counts_the_reference_mask(sq, sk, causal, left, right, diagonal):
    keep = reference.visible(sq, sk, causal=causal, window_size=(left, right), diagonal=diagonal)
    assert visible_pairs(sq, sk, causal, (left, right), diagonal) == int(keep.sum())


def _standard_forward(e: Entry) -> float:
    """The conventional count, written independently of the module: 4·B·H·Sq·Sk·D (two
    matmuls of 2 FLOPs per multiply-add, (D + Dv)/2 per head dim), halved when causal on a
    square problem; otherwise the reference mask's visible pairs."""
    total = 0.0
    for sq, sk in (zip(e.lengths, e.lengths) if e.api == "varlen" else [(e.seqlen_q, e.seqlen_k)] * e.batch):
        if not e.masked:
            pairs = sq * sk
        elif e.causal and e.window[0] < 0 and sq == sk:
            pairs = sq * sk / 2
        else:
            pairs = int(reference.visible(sq, sk, causal=e.causal, window_size=e.window, diagonal=e.diagonal).sum())
        total += 2 * e.heads_q * pairs * (e.head_dim + e.head_dim_v)
    return total


def test_flop_counts_are_standard():
    # every mask and shape kind of the declaration, at a size the reference mask can draw
    rng = random.Random(7)
    kinds = {}
    for e in ENTRIES:
        kinds.setdefault((e.mask_name, e.api, e.seqlen_q == e.seqlen_k, e.diagonal), e)
    for e in kinds.values():
        small = dataclasses.replace(e, seqlen_q=min(e.seqlen_q, rng.randint(300, 700)),
                                    seqlen_k=min(e.seqlen_k, rng.randint(300, 700)), batch=2)
        if e.seqlen_q == e.seqlen_k:
            small = dataclasses.replace(small, seqlen_k=small.seqlen_q)
        if e.api == "varlen":
            small = dataclasses.replace(small, lengths=(e.lengths[0] % 500 + 1, 300), batch=2,
                                        seqlen_q=300, seqlen_k=300)
        assert small.flops("fwd") == pytest.approx(_standard_forward(small), rel=1e-12), e.name
        assert small.flops("bwd") == pytest.approx(2.5 * small.flops("fwd"))
        assert small.flops("fwdbwd") == pytest.approx(3.5 * small.flops("fwd"))
    gpt2 = {e.name: e for e in ENTRIES}["model-gpt2"]
    assert gpt2.flops("fwd") == 4 * 72 * 12 * 1024 * 1024 * 64 / 2
    full = next(e for e in ENTRIES if e.name == "dense-bf16-d128-s4096-full")
    assert full.flops("fwd") == 4 * full.batch * full.heads_q * 4096 * 4096 * 128


def test_bad_declarations_are_refused():
    good = Entry("x", "dense", "bf16", 2, 4, 2, 64, 64, 64, 64)
    for change, words in [(dict(dtype="fp8"), "dtype"), (dict(heads_k=3), "multiple"), (dict(head_dim=300), "1..256"),
                          (dict(api="sdpa", window=(8, 0)), "top-left"), (dict(passes=("fwd", "fwd")), "passes"),
                          (dict(api="varlen", lengths=(10,)), "one length"), (dict(training=True), "training"),
                          (dict(dropout_p=1.0), "dropout_p"), (dict(bias="alibi"), "bias")]:
        with pytest.raises(ValueError, match=words):
            dataclasses.replace(good, **change).validate()
    with pytest.raises(ValueError, match="unknown field"):
        Entry.parse("x", "dtype=bf16 colour=red")
    with pytest.raises(ValueError, match="bad value"):
        Entry.parse("x", good.describe().replace("B=2", "B=two"))
    # numbers in plain ASCII digits, each field once (the last of two silently won)
    for text in (good.describe().replace("B=2", "B=\uff12"), good.describe().replace("Sq=64", "Sq=6_4"),
                 good.describe().replace("B=2", "B= 2"), good.describe() + " dropout_p=0.0_1"):
        with pytest.raises(ValueError, match="bad value|unknown field"):
            Entry.parse("x", text)
    with pytest.raises(ValueError, match="dtype given twice"):
        Entry.parse("x", good.describe() + " dtype=fp16")
    with pytest.raises(ValueError, match="pass"):
        good.flops("forward")


def test_select():
    assert {e.group for e in select(ENTRIES, groups=["model"])} == {"model"}
    assert [e.name for e in select(ENTRIES, ["model-gpt*"])] == ["model-gpt2"]
    assert select(ENTRIES, ["no-such-*"]) == []


def test_unmatched_names_each_selector_that_adds_nothing():
    """With several globs or groups, one that matched nothing was ignored beside one that did."""
    from aotattn.perfmon.entries import unmatched

    assert unmatched(ENTRIES, ["dense-*", "model-gpt*"], ["dense", "model"]) == []
    assert unmatched(ENTRIES, ["dense-bf16-d64-s512-full", "zzz*"]) == [("match", "zzz*")]
    assert unmatched(ENTRIES, groups=["dense", "bogus"]) == [("group", "bogus")]
    # a glob outside the groups asked for, a group without an entry the globs match
    assert unmatched(ENTRIES, ["dense-*", "gqa-*"], ["dense"]) == [("match", "gqa-*")]
    assert unmatched(ENTRIES, ["dense-*"], ["dense", "gqa"]) == [("group", "gqa")]


# one entry per kind of call (dtype, head-dim bucket, mask, api, dropout, bias, determinism,
# padded or unequal heads); the whole declaration is planned by `aotattn perfmon images
# --dry-run` (the smallest of each kind: planning allocates the entry's tensors)
KINDS = list({(e.dtype, rules.head_dim_bucket(max(e.head_dim, e.head_dim_v)), e.mask_name.split("(")[0], e.api,
               e.dropout_p > 0, e.bias, e.deterministic, e.head_dim % 16 == 0, e.head_dim == e.head_dim_v): e
              for e in sorted(ENTRIES, key=lambda e: -e.seqlen_q * e.seqlen_k)}.values())


def test_the_operators_take_every_kind_of_entry_and_the_sm90_database_has_its_cells():
    """Each kind is called through the public operator (nothing launched) and its plans
    resolved in the shipped sm_90 tables: the functionals they select match the entry."""
    for e in KINDS:
        jobs = images.needed_jobs([e], "sm_90")
        # one forward kernel: the Triton one, or the warp-specialized one where flash.forward chooses it
        fwd = [j.functional.as_dict() for j in jobs if j.table in ("flash.attn_fwd", "flash.attn_fwd_ws")]
        assert len(fwd) == 1, e.name
        f = fwd[0]
        # over equal lengths (not varlen) a top-left window runs the bottom-right variant (rules.kernel_mask)
        own_top_left = e.diagonal == "top_left" and (e.api == "varlen" or e.seqlen_q != e.seqlen_k)
        mask = rules.MASK_NONE if not e.masked else (rules.MASK_TOP_LEFT if own_top_left else rules.MASK_BOTTOM_RIGHT)
        assert f["dtype"] == e.dtype and f["BLOCK_D"] == rules.head_dim_bucket(max(e.head_dim, e.head_dim_v))
        assert f["MASK"] == mask, e.name
        assert f["VARLEN"] == (e.api == "varlen") and f["DROPOUT"] == (e.dropout_p > 0)
        # off-bucket head dims (all multiples of 8 in the entries) run the padded kernels (ops._bucketed)
        off_bucket = (e.head_dim, e.head_dim_v) != (f["BLOCK_D"], f["BLOCK_D"])
        assert f["BIAS"] == (e.bias != "none") and f["PAD_HEAD"] is off_bucket, e.name
        tables = {j.table for j in jobs}
        assert {"flash.attn_bwd_dkdv", "flash.attn_bwd_dq", "flash.attn_bwd_fused",
                "flash.attn_bwd_preprocess"} <= tables, e.name
        fused = [j.functional["ATOMIC_DQ"] for j in jobs if j.table == "flash.attn_bwd_fused"]
        assert fused == [not e.deterministic]
