"""Measuring for real, on CPU tensors in Triton's interpreter, at tiny sizes.

The interpreter's clock says nothing about speed: these runs exercise every step (inputs,
checks against the float64 reference slice, forced backends, peers, interleaved timing,
records, provenance, the file) on calls that take a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch

import aotattn
from aotattn.perfmon import measure
from aotattn.perfmon import providers as P
from aotattn.perfmon.budget import Plan
from aotattn.perfmon.entries import Entry
from aotattn.perfmon.perfdb import Perfdb

CPU = torch.device("cpu")
QUICK = measure.Options(Plan(rounds=2, reps=1, warmup=0), seed=11)

SQUARE = Entry("t-square", "dense", "fp32", 1, 2, 2, 16, 16, 16, 16)
# packed sequences, a sliding window and a query group in one; dropout and a bias with its gradient in another
VARLEN = Entry("t-varlen", "varlen", "fp16", 2, 2, 1, 17, 17, 24, 24, window=(5, 2), api="varlen", lengths=(5, 17))
DROPOUT_BIAS = Entry("t-dropout-bias", "bias", "bf16", 1, 2, 2, 16, 24, 16, 16, dropout_p=0.3, bias="bias-grad",
                     passes=("bwd",))
TRAINING = Entry("t-train", "training", "bf16", 1, 2, 2, 16, 16, 16, 16, causal=True, diagonal="top_left", api="sdpa",
                 training=True, passes=("fwd", "fwdbwd"))


def by_key(records):
    return {(r.pass_, r.provider): r for r in records}


def test_run_writes_every_provider_of_every_pass(tmp_path):
    entries = [SQUARE, TRAINING]
    seen = []
    db = measure.run(entries, CPU, QUICK, "cpu-test", on_entry=lambda e, r, s: seen.append(e.name))
    assert seen == [e.name for e in entries]
    assert db.header["tag"] == "cpu-test" and db.header["mode"] == "interpreter"
    for key in ("aotattn", "tuning", "triton", "torch", "gpu", "date", "timing"):
        assert db.header[key]
    for entry in entries:
        records = by_key(r for r in db.records if r.entry == entry.name)
        assert set(records) == {(p, name) for p in entry.passes for name in P.ALL}
        for pass_ in entry.passes:
            ours = records[(pass_, "aotattn")]
            assert ours.ok and ours.ms > 0 and ours.spread_ms >= 0 and ours.ratio == 1.0
            assert ours.tflops == pytest.approx(entry.flops(pass_) / ours.ms / 1e9)
            forced = [records[(pass_, p)] for p in P.FORCED]
            if pass_ == "fwd":
                assert all(not r.ok and r.note.startswith("skipped: a forward pass") for r in forced)
            else:
                assert ours.notes()["choice"] == "split"  # the interpreter's rule: no database
                ws = records[(pass_, "aotattn:ws")]  # a Gluon kernel: sm_90 only
                assert not ws.ok and ws.note.startswith("skipped: the ws backend")
                assert all(r.ok and r.ratio == pytest.approx(r.ms / ours.ms) for r in forced if r is not ws)
            flex = records[(pass_, "flex")]
            assert not flex.ok and "not asked" in flex.note
    square = by_key(r for r in db.records if r.entry == SQUARE.name)
    # PyTorch's CPU flash kernel runs the square fp32 entry; cuDNN and the efficient kernel have no CPU code
    assert square[("fwd", "sdpa-flash")].ok and square[("bwd", "sdpa-flash")].ok
    assert square[("fwd", "sdpa-cudnn")].note.startswith("skipped: RuntimeError")
    text = db.to_text()
    assert Perfdb.from_text(text).to_text() == text
    path = db.write(tmp_path / "cpu" / "cpu-test.txt")
    assert Perfdb.read(path).entries == {e.name: e for e in entries}


def test_varlen_windows_gqa_dropout_and_bias_pass_the_reference_check():
    for entry in (VARLEN, DROPOUT_BIAS):
        records = by_key(measure.measure_entry(entry, CPU, QUICK))
        for pass_ in entry.passes:
            for provider in ("aotattn", "aotattn:split", "aotattn:fused"):
                if pass_ == "fwd" and provider != "aotattn":
                    continue
                assert records[(pass_, provider)].ok, (entry.name, pass_, provider, records[(pass_, provider)].note)
            for provider in P.PEERS:  # each says why it did not run; none ran wrong
                assert records[(pass_, provider)].note.startswith("skipped: "), records[(pass_, provider)]
        if entry is VARLEN:
            assert records[("fwd", "sdpa-flash")].note == "skipped: no packed-sequence API"


def test_the_dropout_mask_of_the_first_sequence_does_not_depend_on_the_batch():
    """The reference slice draws the mask of one batch entry; it must be the call's."""
    torch.manual_seed(5)
    full = aotattn.dropout_mask(3, 2, 16, 24, 0.4)
    torch.manual_seed(5)
    first = aotattn.dropout_mask(1, 2, 16, 24, 0.4)
    assert torch.equal(full[:1], first)


def test_wrong_results_get_no_figure(monkeypatch):
    real = P.call

    def tampered(entry, x, provider, dropout_p=None):
        out = real(entry, x, provider, dropout_p)
        if provider == "aotattn:fused":
            return out * 1.05  # wrong output, and gradients scaled with it
        if provider == "sdpa-flash":
            return torch.nan_to_num(out * math.nan)  # zeros
        return out

    monkeypatch.setattr(P, "call", tampered)
    records = by_key(measure.measure_entry(dataclasses.replace(SQUARE, passes=("bwd",)), CPU, QUICK))
    fused, flash = records[("bwd", "aotattn:fused")], records[("bwd", "sdpa-flash")]
    assert not fused.ok and fused.note.startswith("wrong: ") and "float64 reference" in fused.note
    assert not flash.ok and flash.note.startswith("wrong: ")
    assert records[("bwd", "aotattn")].ok and records[("bwd", "aotattn:split")].ok


def test_a_failing_operator_is_recorded_not_hidden(monkeypatch):
    def broken(entry, x, backend=None, dropout_p=None):
        raise ValueError("no image for this kernel: run aotattn build")

    monkeypatch.setattr(P, "call_aotattn", broken)
    records = by_key(measure.measure_entry(SQUARE, CPU, measure.Options(Plan(2, 1, 0), peers=False)))
    ours = records[("fwd", "aotattn")]
    assert not ours.ok and ours.note == "error: ValueError: no image for this kernel: run aotattn build"
    assert records[("fwd", "sdpa-flash")].note == "skipped: peers not asked for (--no-peers)"


def test_provenance_names_the_backward_cell_the_choice_came_from():
    from aotattn.families.flash import rules
    from aotattn.perfmon.provenance import Lookup, cell_of, parse_cell
    from aotattn.spec import Config, Functional

    functional = Functional.of({"dtype": "bf16", "BLOCK_D": 128, "PAD_HEAD": False, "MASK": 2, "VARLEN": False, "DROPOUT": False, "BIAS": 0, "DETERMINISTIC": False})
    lookups = [Lookup(rules.BACKWARD, functional, (("seqlen_k", 3000), ("seqlen_q", 1000)), Config.of(backend="fused")),
               Lookup(rules.ATTN_BWD_FUSED, Functional.of({"x": 1}), (), Config.of(BLOCK_M=64, BLOCK_N=32,
                                                                                   num_warps=4, num_stages=2))]
    note = measure.provenance_note(lookups, "bwd", "sm_90")
    tokens = dict(t.split("=", 1) for t in note.split())
    assert tokens["choice"] == "fused" and tokens["attn_bwd_fused"] == "m64_n32_w4_s2"
    cell = parse_cell(tokens["cell"])
    assert cell.table == "flash.backward" and dict(cell.buckets) == {"seqlen_q": 1024, "seqlen_k": 4096}
    assert cell.functional == functional and str(cell) == tokens["cell"]
    assert tokens["cell"] == cell_of("sm_90", rules.BACKWARD, functional, {"seqlen_q": 1000, "seqlen_k": 3000})
    assert measure.provenance_note(lookups, "bwd", None) == "choice=fused"  # the interpreter: no cells
    for bad in ("flash.backward", "nope.table[x=1]@a=1", "flash.backward[dtype=bf16]@seqlen_q=16,seqlen_k=16",
                "flash.backward[dtype=bf16,BLOCK_D=128,PAD_HEAD=False,MASK=2,VARLEN=False,DROPOUT=False,BIAS=0,DETERMINISTIC=False]@seqlen_q=17,seqlen_k=16"):
        with pytest.raises(ValueError, match="cell"):
            parse_cell(bad)


def test_recording_lookups_sees_the_unforced_choice_and_restores_the_rules():
    from aotattn.families.flash import rules
    from aotattn.perfmon.provenance import recording_lookups

    original = rules.config_for
    x = P.make_inputs(SQUARE, CPU, 0)
    with recording_lookups() as seen:
        out = P.call(SQUARE, x, "aotattn")
        torch.autograd.grad(out, x.leaves(), x.dout)
    assert rules.config_for is original
    # the split backend (the interpreter's): dQ writes the stats, no preprocess is launched
    assert {lk.spec.name for lk in seen} == {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"}


def test_a_provider_failing_while_timed_loses_its_figure_and_the_others_keep_theirs(monkeypatch):
    from aotattn.tune import timing

    real = timing.measure
    calls = {"n": 0}

    def flaky(fn, inputs, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second provider timed in the first round
            raise RuntimeError("CUDA out of memory")
        return real(fn, inputs, **kwargs)

    monkeypatch.setattr(timing, "measure", flaky)
    records = by_key(measure.measure_entry(dataclasses.replace(SQUARE, passes=("bwd",)), CPU,
                                           measure.Options(Plan(2, 1, 0), peers=False)))
    timed = [records[("bwd", p)] for p in ("aotattn", "aotattn:split", "aotattn:fused")]
    lost = [r for r in timed if not r.ok]
    assert len(lost) == 1 and lost[0].note == "error: while timing, RuntimeError: CUDA out of memory"
    assert all(r.ok for r in timed if r is not lost[0])


def test_inputs_that_cannot_be_made_leave_every_record_without_figures(monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(P, "make_inputs", no_memory)
    records = measure.measure_entry(SQUARE, CPU, QUICK)
    assert len(records) == len(SQUARE.passes) * len(P.ALL)
    assert all(not r.ok and r.note.startswith("error: inputs: RuntimeError: CUDA out of memory") for r in records)


def test_flexattention_compiles_one_static_graph_a_shape():
    """A run times FlexAttention over many shapes. Each shape gets its own static graph:
    with automatic dynamic shapes, the third shape reused a dynamic graph compiled at the
    second, and past Dynamo's recompile limit (8) the calls would have gone eager. Each
    result matches the float64 reference."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    for seqlen in (128, 256, 384):
        entry = dataclasses.replace(SQUARE, name=f"t-flex-{seqlen}", seqlen_q=seqlen, seqlen_k=seqlen, causal=True,
                                    flex=True, passes=("fwd",))  # FlexAttention has no CPU backward
        x = P.make_inputs(entry, CPU, seed=seqlen)
        out = P.call_flex(entry, x)
        want, _ = aotattn.reference.attention(x.q.double(), x.k.double(), x.v.double(), causal=True)
        assert (out.double() - want).abs().max().item() < 1e-4
    assert counters["stats"]["unique_graphs"] - before == 3


def test_flex_graphs_compiled_ahead_in_other_processes_serve_the_run(tmp_path, monkeypatch):
    """``perfmon run --flex-jobs``: FlexAttention's graphs compiled in spawned processes land
    in Inductor's disk cache, so the timing process's own compile of the same call is a
    cache hit (and its result is still right); an entry that fails to compile there is
    reported, not raised; entries that never call FlexAttention are not started."""
    from torch._dynamo.utils import counters

    from aotattn.perfmon import flexwarm

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    entry = dataclasses.replace(SQUARE, name="t-flex-warm", seqlen_q=208, seqlen_k=208, head_dim=32, head_dim_v=32,
                                causal=True, flex=True, passes=("fwd",))  # FlexAttention has no CPU backward
    broken = dataclasses.replace(entry, name="t-flex-warm-bwd", passes=("fwd", "bwd"))
    unasked = dataclasses.replace(entry, name="t-flex-unasked", flex=False)
    errors = flexwarm.warm([entry, broken, unasked], "cpu", True, seed=3, jobs=2)
    assert set(errors) == {entry.name, broken.name}
    assert errors[entry.name] is None and "backward" in errors[broken.name]
    assert any((tmp_path / "inductor").rglob("*")), "nothing reached the disk cache"

    before = counters["inductor"]["fxgraph_cache_hit"]
    x = P.make_inputs(entry, CPU, seed=3)
    with torch.no_grad():
        out = P.call_flex(entry, x)
    assert counters["inductor"]["fxgraph_cache_hit"] - before >= 1
    want, _ = aotattn.reference.attention(x.q.double(), x.k.double(), x.v.double(), causal=True)
    assert (out.double() - want).abs().max().item() < 1e-4
    assert flexwarm.warm([unasked], "cpu", True, seed=3, jobs=2) == {}


@pytest.mark.gpu
def test_flexattention_backward_is_timed_on_the_gpu():
    """FlexAttention's backward pass is timed like every provider's: the backward of one
    forward run again and again. Compiled with donated buffers, AOTAutograd refused that,
    and every FlexAttention backward record was the refusal instead of a figure."""
    entry = Entry("t-flex-gpu", "dense", "bf16", 2, 4, 4, 384, 384, 64, 64, causal=True, flex=True,
                  passes=("fwd", "bwd"))
    options = measure.Options(Plan(rounds=2, reps=2, warmup=1), seed=5)
    records = by_key(measure.measure_entry(entry, torch.device("cuda"), options))
    for pass_ in entry.passes:
        flex = records[(pass_, "flex")]
        assert flex.ok and flex.ms > 0, (pass_, flex.note)
        assert records[(pass_, "aotattn")].ok


def test_host_bound_training_entries_take_more_samples_a_round(monkeypatch):
    """On a GPU, a training entry's call is host-bound and jitters with the host: each round
    times at least TRAINING_REPS calls of every provider (five left round medians 20-85%
    apart on the H200 host); other entries, and the interpreter, keep the plan's count. The
    estimate and the run's header count them too."""
    from aotattn.perfmon.budget import TRAINING_REPS, entry_seconds
    from aotattn.tune import timing

    asked = []

    def fake(fn, inputs, *, device, warmup, repeats, flush, hide_host_ms):
        asked.append((torch.device(device).type, repeats, flush))
        samples = tuple(0.1 + 0.01 * i for i in range(repeats))
        return timing.Timing(statistics.median(samples), samples, timing.CLOCK_CUDA, 0)

    monkeypatch.setattr(timing, "measure", fake)
    runners = {"aotattn": lambda: None, "sdpa-flash": lambda: None}
    gpu = torch.device("cuda")
    timed, failed = measure._time(TRAINING, runners, QUICK.plan, gpu)
    assert not failed and set(timed) == set(runners)
    assert asked == [("cuda", TRAINING_REPS, False)] * (len(runners) * QUICK.plan.rounds)
    asked.clear()
    measure._time(SQUARE, runners, QUICK.plan, gpu)
    assert set(asked) == {("cuda", QUICK.plan.reps, True)}
    asked.clear()
    measure._time(TRAINING, runners, QUICK.plan, CPU)
    assert set(asked) == {("cpu", QUICK.plan.reps, False)}

    many = Plan(rounds=2, reps=TRAINING_REPS + 7, warmup=0)
    assert many.reps_for(TRAINING) == TRAINING_REPS + 7 and QUICK.plan.reps_for(TRAINING) == TRAINING_REPS
    assert QUICK.plan.reps_for(SQUARE) == QUICK.plan.reps
    providers = {"fwd": ["aotattn"]}
    assert entry_seconds(TRAINING, providers, QUICK.plan) > TRAINING_REPS * QUICK.plan.rounds * 0.1e-3
    assert f"{TRAINING_REPS} samples a round" in measure.environment(CPU, QUICK.plan)["timing"]


@pytest.mark.parametrize("shape", [(3, 5, 7, 11), (1, 1, 40, 9), (1, 257), (6, 1, 1, 1, 13), (0, 4), ()])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 24])
def test_rel_diff_in_pieces_equals_the_whole_in_float64(shape, chunk):
    """The check of a forced backend or a peer against aotattn's whole result goes a piece at
    a time (a whole gradient of a large entry in float64 does not fit beside the inputs):
    same figure as one float64 pass, whatever the strides, no piece over the bound."""
    g = torch.Generator().manual_seed(len(shape) * 1000 + chunk % 997)
    b = torch.randn(shape, generator=g, dtype=torch.float64)
    a = (b + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(torch.bfloat16)
    whole = (a.double() - b).norm().item() / b.norm().item() if b.numel() else 0.0
    strided = a.transpose(0, -1).contiguous().transpose(0, -1) if a.dim() >= 2 else a  # same values, other strides
    for x in (a, strided):
        assert P.rel_diff(x, b, chunk=chunk) == pytest.approx(whole, rel=1e-9, abs=1e-300)
        pieces = list(P._pieces(x, chunk))
        assert sum(p.numel() for p in pieces) == x.numel()
        assert all(p.numel() <= chunk or p.dim() == 0 for p in pieces)
        assert [p.shape for p in pieces] == [p.shape for p in P._pieces(b, chunk)]
    if b.numel():
        a.view(-1)[b.numel() // 2] = float("nan")
        assert P.rel_diff(a, b, chunk=chunk) == math.inf
    with pytest.raises(ValueError, match="shapes"):
        P.rel_diff(a, b.unsqueeze(0))
