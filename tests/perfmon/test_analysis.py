"""Faults, comparisons and plots from recorded numbers: a deliberately bad tuning patch caught.

The scenario of issue 15 at small scale: a patch makes the ``flash.backward`` table
choose the fused backward for bf16 head-dim-128 calls. The "measurements" are fabricated
the way that patch shows on a GPU (the operator now runs the slower fused backend, a
forced split beats it); the fault detector must point at the patched cells, ``compare``
must flag the regressions against the run before the patch, and the patch ``faults``
suggests must undo the damage.
"""

from __future__ import annotations

import math
import os
import random
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotattn.cli import app as cli
from aotattn.families.flash import rules
from aotattn.perfmon import analysis
from aotattn.perfmon.entries import declared, select
from aotattn.perfmon.perfdb import Perfdb, Record
from aotattn.perfmon.provenance import cell_of, parse_cell, suggest_patch
from aotattn.spec import Config, Functional
from aotattn.tuning import Database, parse_patch

PROJECT_TUNING = Path(__file__).resolve().parents[2] / "tuning"
ENTRIES = select(declared(), ["dense-bf16-*"])  # d64/d128/d256, full and causal, 512..16384
BAD_BLOCK = Functional.of({"dtype": "bf16", "BLOCK_D": 128, "PAD_HEAD": False, "MASK": 0, "VARLEN": False, "DROPOUT": False, "BIAS": 0, "DETERMINISTIC": False})
BAD_PATCH = """# deliberately bad: the fused backward for every bf16 d128 call without a mask
#! aotattn-patch 1
#! table flash.backward

[configs]
fused = backend=fused

[dtype=bf16 BLOCK_D=128 PAD_HEAD=False MASK=0 VARLEN=False DROPOUT=False BIAS=0 DETERMINISTIC=False]
seqlen_q=* seqlen_k=*: fused
"""


@pytest.fixture
def tuning_copy(tmp_path) -> Path:
    root = tmp_path / "tuning"
    # the seeded tables, no patches: the fabricated GPU below (split always faster) is not
    # the H200 the shipped patches were measured on
    shutil.copytree(PROJECT_TUNING, root, ignore=shutil.ignore_patterns("*.dbpatch"))
    return root


def _functional(entry) -> Functional:
    mask = rules.MASK_NONE if not entry.masked else rules.MASK_BOTTOM_RIGHT
    return Functional.of({"dtype": entry.dtype, "BLOCK_D": rules.head_dim_bucket(entry.head_dim), "PAD_HEAD": False,
                          "MASK": mask, "VARLEN": False, "DROPOUT": False, "BIAS": 0, "DETERMINISTIC": False})


def _choice(db: Database, entry) -> tuple[str, str]:
    sizes = {"seqlen_q": entry.seqlen_q, "seqlen_k": entry.seqlen_k}
    config = db.lookup("sm_90", rules.BACKWARD, _functional(entry), sizes)
    return config["backend"], cell_of("sm_90", rules.BACKWARD, _functional(entry), sizes, db)


def fabricate(db: Database, seed: int, tag: str) -> Perfdb:
    """A run as the GPU would record it under ``db``: split's backward takes 1.0 (x size),
    fused 1.6; the operator runs whichever ``db`` chooses; ~1% noise; peers alongside."""
    rng = random.Random(seed)
    run = Perfdb(header={"tag": tag, "arch": "sm_90", "gpu": "fabricated", "date": "2026-11-30",
                         "tuning": str(db.root)})
    for entry in ENTRIES:
        size = entry.flops("fwd") / 1e12  # ms at 1000 TFLOP/s: plausible magnitudes
        base = {"fwd": 2.5 * size, "bwd": 6.0 * size}
        backend, cell = _choice(db, entry)
        records = []
        for pass_ in entry.passes:
            def noisy(ms):
                return ms * rng.uniform(0.995, 1.005)
            times = {"aotattn:split": noisy(base[pass_]), "aotattn:fused": noisy(1.6 * base[pass_]),
                     "sdpa-flash": noisy(1.3 * base[pass_]), "sdpa-cudnn": noisy(0.8 * base[pass_])}
            if pass_ == "fwd":
                times = {"aotattn": times["aotattn:split"], "sdpa-flash": times["sdpa-flash"],
                         "sdpa-cudnn": times["sdpa-cudnn"]}
                note = ""
            else:
                times["aotattn"] = noisy(base[pass_] * (1.6 if backend == "fused" else 1.0))
                note = f"choice={backend} cell={cell}"
            for provider, ms in times.items():
                records.append(Record(entry.name, pass_, provider, ms, ms * 0.006, entry.flops(pass_) / ms / 1e9,
                                      ms / times["aotattn"], note if provider == "aotattn" else ""))
        run.add(entry, records)
    return run


def test_seeded_tables_have_no_fault_and_the_bad_patch_is_caught(tuning_copy, tmp_path):
    good = fabricate(Database(tuning_copy), 1, "before")
    assert analysis.faults(good) == []
    (tuning_copy / "nvidia" / "sm_90" / "flash.backward.0001-bad.dbpatch").write_text(BAD_PATCH)
    bad = fabricate(Database(tuning_copy), 2, "after")
    found = analysis.faults(bad)
    hit = [e for e in ENTRIES if e.head_dim == 128 and not e.masked]
    assert sorted(f.entry for f in found) == sorted(e.name for e in hit)
    for f in found:
        assert (f.pass_, f.choice, f.winner) == ("bwd", "fused", "split") and f.speedup > 1.5
        cell = parse_cell(f.cell)
        assert cell.table == "flash.backward" and cell.functional == BAD_BLOCK

    comparison = analysis.compare(good, bad)
    assert sorted(c.entry for c in comparison.regressions) == sorted(e.name for e in hit)
    assert all(c.pass_ == "bwd" and c.speed == pytest.approx(1 / 1.6, rel=0.02) for c in comparison.regressions)
    assert comparison.improvements == [] and comparison.failures == []
    means = comparison.geomeans()
    assert means[("dense", "fwd", "aotattn")][1] == pytest.approx(1.0, abs=0.01)
    share = len(hit) / len(ENTRIES)  # geometric mean over the group: 1/1.6 on a share of it
    assert means[("dense", "bwd", "aotattn")][1] == pytest.approx(1.6 ** -share, rel=0.01)

    # the patch the faults suggest undoes the damage, cell by cell
    changes = {parse_cell(f.cell): Config.of(backend=f.winner) for f in found}
    (text,) = suggest_patch(changes, ["test"]).values()
    parse_patch(rules.BACKWARD, text)
    (tuning_copy / "nvidia" / "sm_90" / "flash.backward.0002-fix.dbpatch").write_text(text)
    assert analysis.faults(fabricate(Database(tuning_copy), 3, "fixed")) == []
    assert all(_choice(Database(tuning_copy), e)[0] == "split" for e in hit)


def _pair(unforced: float, same: float, other: float, spread: float, choice: str = "split") -> Perfdb:
    entry = ENTRIES[0]
    forced = {"aotattn:split": same, "aotattn:fused": other} if choice == "split" else \
        {"aotattn:split": other, "aotattn:fused": same}
    run = Perfdb()
    run.add(entry, [Record(entry.name, "bwd", "aotattn", unforced, spread, note=f"choice={choice}")] +
            [Record(entry.name, "bwd", p, ms, spread) for p, ms in forced.items()])
    return run


@pytest.mark.parametrize("unforced, same, other, spread, faults", [
    (1.00, 1.00, 0.90, 0.01, 1),   # the other backend wins by 10%, noise 1%
    (1.00, 1.00, 0.995, 0.01, 0),  # a win inside the spread is noise
    (1.00, 0.93, 0.95, 0.001, 0),  # the same kernels timed twice differed by 7%: a 5% win is noise
    (1.00, 1.00, 1.20, 0.001, 0),  # the choice was right
])
def test_a_fault_needs_a_win_beyond_the_measured_noise(unforced, same, other, spread, faults):
    assert len(analysis.faults(_pair(unforced, same, other, spread))) == faults
    assert len(analysis.faults(_pair(unforced, same, other, spread, choice="fused"))) == faults


def test_compare_flags_only_changes_beyond_noise_and_threshold():
    entry = ENTRIES[0]
    other = ENTRIES[1]

    def run(ms_bwd: float | None, spread: float, extra: bool = False, batch: int | None = None) -> Perfdb:
        db = Perfdb()
        e = entry if batch is None else entry.__class__(**{**entry.__dict__, "batch": batch})
        db.add(e, [Record(e.name, "fwd", "aotattn", 1.0, 0.001),
                   Record(e.name, "bwd", "aotattn", ms_bwd, None if ms_bwd is None else spread,
                          note="" if ms_bwd is not None else "error: no image")])
        if extra:
            db.add(other, [Record(other.name, "fwd", "aotattn", 2.0, 0.01)])
        return db

    verdicts = lambda a, b: {(c.entry, c.pass_): c.verdict for c in analysis.compare(a, b).changes}  # noqa: E731
    assert verdicts(run(2.0, 0.01), run(2.2, 0.01))[(entry.name, "bwd")] == "regression"
    assert verdicts(run(2.0, 0.01), run(1.7, 0.01))[(entry.name, "bwd")] == "improvement"
    assert verdicts(run(2.0, 0.01), run(2.04, 0.001))[(entry.name, "bwd")] == "same"   # under the 3% floor
    assert verdicts(run(2.0, 0.2), run(2.3, 0.2))[(entry.name, "bwd")] == "same"      # inside the spreads
    assert verdicts(run(2.0, 0.01), run(None, 0.0))[(entry.name, "bwd")] == "failed in B"
    assert verdicts(run(None, 0.0), run(2.0, 0.01))[(entry.name, "bwd")] == "fixed in B"
    assert verdicts(run(2.0, 0.01, extra=True), run(2.0, 0.01))[(other.name, "fwd")] == "only in A"
    assert verdicts(run(2.0, 0.01), run(2.0, 0.01, extra=True))[(other.name, "fwd")] == "only in B"
    cut = Perfdb()  # B declares the entry and ran aotattn, but has no bwd figure (a run cut short)
    cut.add(entry, [Record(entry.name, "fwd", "aotattn", 1.0, 0.001)])
    assert verdicts(run(2.0, 0.01), cut)[(entry.name, "bwd")] == "failed in B"
    assert len(analysis.compare(run(2.0, 0.01), cut).failures) == 1
    changed = verdicts(run(2.0, 0.01), run(4.0, 0.01, batch=entry.batch * 2))
    assert changed[(entry.name, "bwd")] == "changed"  # another shape under the same name: no ratio
    means = analysis.compare(run(2.0, 0.01), run(2.5, 0.01)).geomeans()
    assert means[("dense", "bwd", "aotattn")] == (1, pytest.approx(0.8))
    assert means[("all", "fwd", "aotattn")] == (1, pytest.approx(1.0))
    # extreme but valid figures: the ratio 1e-300 / 1e300 underflowed to 0 (math domain error)
    means = analysis.compare(run(1e-300, 0.0), run(1e300, 0.0)).geomeans()
    assert means[("dense", "bwd", "aotattn")] == (1, 0.0)
    assert analysis.compare(run(1e300, 0.0), run(1e-300, 0.0)).geomeans()[("dense", "bwd", "aotattn")] == (1, math.inf)


def test_compare_names_the_plan_notes_that_changed():
    """A flagged change says whether the plan moved (backend choice, a kernel's
    configuration) or stayed: the same plan timed apart is drift, or changed kernel code."""
    entry = ENTRIES[0]

    def run(ms: float, note: str, peer_ms: float = 3.0) -> Perfdb:
        db = Perfdb()
        db.add(entry, [Record(entry.name, "bwd", "aotattn", ms, 0.01, note=note),
                       Record(entry.name, "bwd", "sdpa-flash", peer_ms, 0.01)])
        return db

    plain = "choice=split cell=x attn_bwd_dq=m64_n64 attn_bwd_dkdv=m64_n128"
    moved = "choice=ws cell=x attn_bwd_ws=m64_n128_st2"

    def change(a, b, provider="aotattn"):
        return next(c for c in analysis.compare(a, b, ()).changes if c.provider == provider)

    assert change(run(2.0, plain), run(1.0, plain)).plan_changes == ()
    assert change(run(2.0, plain), run(1.0, moved)).plan_changes == ("attn_bwd_dkdv", "attn_bwd_dq",
                                                                     "attn_bwd_ws", "choice")
    assert change(run(2.0, plain), run(1.0, plain), "sdpa-flash").plan_changes is None  # a peer has no plan
    assert change(run(2.0, plain), run(1.0, "")).plan_changes is None


def _write(run: Perfdb, root: Path, tag: str) -> Path:
    run.header["tag"] = tag
    return run.write(root / "sm_90" / f"{tag}.txt")


def test_cli_faults_compare_summary_and_plot(tuning_copy, tmp_path):
    root = tmp_path / "perfdb"
    _write(fabricate(Database(tuning_copy), 1, "before"), root, "before")
    (tuning_copy / "nvidia" / "sm_90" / "flash.backward.0001-bad.dbpatch").write_text(BAD_PATCH)
    _write(fabricate(Database(tuning_copy), 2, "after"), root, "after")
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, [*args, "--perfdb", str(root)])

    clean = invoke("perfdb", "faults", "before", "--fail")
    assert clean.exit_code == 0 and "no tuning faults" in clean.output
    patch_dir = tmp_path / "suggested"
    faulty = invoke("perfdb", "faults", "after", "--fail", "--patch", str(patch_dir))
    assert faulty.exit_code == 1 and "tuning fault" in faulty.output
    assert "BLOCK_D=128" in faulty.output and "fused" in faulty.output
    (suggested,) = patch_dir.glob("*.dbpatch")
    assert parse_patch(rules.BACKWARD, suggested.read_text()).edits
    one_file = tmp_path / "patches" / "flash.backward.0009-faults.dbpatch"  # a file name: that file, no folder
    invoke("perfdb", "faults", "after", "--patch", str(one_file))
    assert one_file.is_file() and one_file.read_text() == suggested.read_text()

    same = invoke("perfdb", "compare", "before", "before", "--fail-on-regression")
    assert same.exit_code == 0 and "0 regression(s)" in same.output
    worse = invoke("perfdb", "compare", "before", "after", "--fail-on-regression")
    assert worse.exit_code == 1 and "regression" in worse.output
    assert "dense-bf16-d128-s4096-full" in worse.output
    assert "plan changed: choice" in worse.output  # the bad patch moved the backend
    report = invoke("perfdb", "compare", "before", "after")
    assert report.exit_code == 0  # without the flag a regression is reported, not an error
    everyone = invoke("perfdb", "compare", "before", "after", "--provider", "all", "--all")
    assert "sdpa-cudnn" in everyone.output
    for command in (("compare", "before", "after", "--fail-on-regression"), ("costs", "after")):
        misspelt = invoke("perfdb", *command, "--provider", "sdpa_flash")  # matched nothing: "0 compared", exit 0
        assert misspelt.exit_code == 1 and "--provider 'sdpa_flash': expected one of" in misspelt.output
    missing = invoke("perfdb", "compare", "before", "nowhere")
    assert missing.exit_code != 0 and "no perfdb tag" in missing.output

    summary = invoke("perfdb", "summary", "after")
    assert summary.exit_code == 0 and "sdpa-flash" in summary.output

    png = tmp_path / "plot.png"
    drawn = invoke("perfdb", "plot", "after", "--out", str(png))
    assert drawn.exit_code == 0, drawn.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    assert not math.isclose(float(image.std()), 0.0)  # something was drawn
    nothing = invoke("perfdb", "plot", "after", "--group", "window", "--out", str(tmp_path / "none.png"))
    assert nothing.exit_code != 0 and "nothing to plot" in nothing.output


def test_plot_gives_each_provider_one_color_of_its_own(tuning_copy, tmp_path, monkeypatch):
    """Every provider (forced backends included) keeps one color over its causal and unmasked
    lines, and no two providers share one (the ws lines once took the color cycle's blue and
    orange, sdpa-flash's and flex's)."""
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure

    from aotattn.perfmon import plot
    from aotattn.perfmon.providers import ALL

    names = [*ALL, "some-new-peer", "another-peer"]
    assigned = plot.colors(random.sample(names, len(names)))
    assert set(assigned) == set(names) and len(set(assigned.values())) == len(names)
    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    plot.plot(fabricate(Database(tuning_copy), 1, "run"), tmp_path / "x.png")
    by_provider: dict[str, set[str]] = {}
    for ax in drawn[0].axes:
        for line in ax.get_lines():
            provider = line.get_label().rsplit(" (", 1)[0]
            by_provider.setdefault(provider, set()).add(to_hex(line.get_color()))
    assert {"aotattn", "aotattn:split", "sdpa-flash"} <= set(by_provider), sorted(by_provider)
    assert all(len(c) == 1 for c in by_provider.values()), by_provider
    assert len({c for (c,) in by_provider.values()}) == len(by_provider), by_provider


def _random_run(patterns: list[str], tag: str = "lines") -> Perfdb:
    """A run of the entries matching ``patterns``: random figures, aotattn and sdpa-flash per pass."""
    rng = random.Random()
    run = Perfdb(header={"tag": tag, "arch": "sm_90", "gpu": "fabricated", "date": "2026-12-07"})
    for entry in select(declared(), patterns):
        records = []
        for pass_ in entry.passes:
            ours = rng.uniform(0.05, 20.0)
            for provider, ms in (("aotattn", ours), ("sdpa-flash", ours * rng.uniform(0.5, 2.0))):
                records.append(Record(entry.name, pass_, provider, ms, 0.01 * ms, entry.flops(pass_) / ms / 1e9,
                                      ms / ours))
        run.add(entry, records)
    return run


@pytest.mark.parametrize("group, apart", [("gqa", {"g=4", "g=8"}), ("bias", {"bias=bias", "bias=bias-grad"}),
                                          ("odd-dim", {"Dv=192", "Dv=128"}),
                                          ("model", {"model-bert-large-uncased", "model-distilbert-base-uncased"})])
def test_plot_draws_each_distinct_call_as_its_own_line(group, apart, monkeypatch, tmp_path):
    """Entries differing in more than the sequence length (GQA group size, Dv, bias kind, the
    model) were joined into one zigzag line, two points at each x: every distinct call is a
    line of its own now, named in the legend."""
    import dataclasses

    from matplotlib.figure import Figure

    from aotattn.perfmon import plot

    run = _random_run([f"{group}-bf16-*", f"{group}-*"])
    by_figure = {(e.head_dim, r.pass_, r.provider, round(r.tflops, 9)): e for r in run.records
                 for e in [run.entries[r.entry]]}
    data = plot.series(run, group, "bf16")
    drawn = 0
    labels = set()
    for (dim, pass_), lines in data.items():
        for key, points in lines.items():
            xs = [x for x, _ in points]
            assert len(xs) == len(set(xs)), (dim, pass_, key, points)  # no zigzag
            provider, mask, line = key
            calls = {dataclasses.replace(by_figure[dim, pass_, provider, round(y, 9)], name="", seqlen_q=0,
                                         seqlen_k=0, batch=0, flex=False) for _, y in points}
            assert len(calls) == 1, (key, calls)  # one call along a line, whatever the sequence length
            drawn += len(points)
            labels.add(line)
    squares = [r for r in run.records for e in [run.entries[r.entry]]
               if e.dtype == "bf16" and e.seqlen_q == e.seqlen_k and e.mask_name in ("none", "causal")]
    assert drawn == len(squares)  # every point on a line
    assert apart <= labels, labels

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    plot.plot(run, tmp_path / "x.png", group, "bf16")
    for ax in figures[0].axes:
        names = [line.get_label() for line in ax.get_lines()]
        assert len(names) == len(set(names)), names  # each line of a panel named apart
        for line in ax.get_lines():
            xs = list(line.get_xdata())
            assert len(xs) == len(set(xs)), line.get_label()
    legend = {text.get_text() for text in figures[0].legends[0].get_texts()}
    assert apart <= legend and {"aotattn", "sdpa-flash"} <= legend, legend


def test_plot_out_ending_in_a_slash_is_a_folder(tmp_path):
    """`perfdb plot --out newdir/` wrote a PNG named newdir (a Path drops the slash)."""
    root = tmp_path / "perfdb"
    _write(_random_run(["dense-bf16-d64-*"], "lines"), root, "lines")
    for out in (tmp_path / "new" / "deeper", tmp_path / "other"):
        result = CliRunner().invoke(cli, ["perfdb", "plot", "lines", "--out", str(out) + os.sep, "--perfdb", str(root)])
        assert result.exit_code == 0, result.output
        assert out.is_dir() and (out / "lines.dense-bf16.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    named = tmp_path / "a-file.png"  # without the slash: the file named
    drawn = CliRunner().invoke(cli, ["perfdb", "plot", "lines", "--out", str(named), "--perfdb", str(root)])
    assert drawn.exit_code == 0, drawn.output
    assert named.is_file()


def test_a_fault_on_a_refinement_patches_the_refinement_not_its_fallback(tuning_copy):
    """A dropout call reads the dense block (the seeded operator table has only roots): its
    fault names the dropout cell, and the suggested patch adds the dropout block, leaving
    the dense calls that shared the fallback as they were."""
    db = Database(tuning_copy)
    dense = _functional(ENTRIES[0])
    dropout = Functional.of({**dense.as_dict(), "DROPOUT": True})
    sizes = {"seqlen_q": 1000, "seqlen_k": 1000}
    cell = parse_cell(cell_of("sm_90", rules.BACKWARD, dropout, sizes, db))
    assert cell.functional == dropout and dict(cell.buckets) == {"seqlen_q": 1024, "seqlen_k": 1024}
    (text,) = suggest_patch({cell: Config.of(backend="fused")}, ["test"]).values()
    (tuning_copy / "nvidia" / "sm_90" / "flash.backward.0009-fix.dbpatch").write_text(text)
    fixed = Database(tuning_copy)
    assert fixed.lint() == []
    assert fixed.lookup("sm_90", rules.BACKWARD, dropout, sizes)["backend"] == "fused"
    assert fixed.lookup("sm_90", rules.BACKWARD, dense, sizes)["backend"] == "split"
    assert fixed.lookup("sm_90", rules.BACKWARD, dropout, {"seqlen_q": 4000, "seqlen_k": 4000})["backend"] == "split"


def test_feature_costs_pair_each_entry_with_its_plain_twin(tmp_path):
    """A dropout, bias or deterministic entry is divided by the entry of the same call without
    the feature (same run), per pass and provider; entries without a twin are left out."""
    chosen = select(declared(), ["dropout-bf16-d64-s1024-*", "dense-bf16-d64-s1024-*", "bias-*",
                                 "dropout-bf16-d128-s512-full-*"])
    by = {e.name: e for e in chosen}
    assert "dense-bf16-d128-s512-full" not in by  # the d128 dropout entry's twin is missing from this run
    rng = random.Random(5)
    run = Perfdb(header={"tag": "costs", "arch": "sm_90"})
    plain_ms = {}
    for entry in chosen:
        feature = 1.0 + (0.5 if entry.dropout_p else 0.0) + (2.0 if entry.bias != "none" else 0.0)
        records = []
        for pass_ in entry.passes:
            base = rng.uniform(1.0, 2.0)
            plain_ms[(entry.name, pass_)] = base
            for provider, scale in (("aotattn", feature), ("sdpa-flash", 1.1)):
                records.append(Record(entry.name, pass_, provider, base * scale, 0.0, 1.0, 1.0))
        run.add(entry, records)
    costs = analysis.feature_costs(run)
    dropout = [c for c in costs if c.feature == "dropout"]
    assert {c.entry for c in dropout} == {"dropout-bf16-d64-s1024-full-p0.1", "dropout-bf16-d64-s1024-causal-p0.1"}
    for c in dropout:
        twin = by[c.plain]
        assert (twin.dropout_p, twin.causal, twin.seqlen_q) == (0.0, by[c.entry].causal, by[c.entry].seqlen_q)
        want = 1.5 if c.provider == "aotattn" else 1.0
        base = plain_ms[(c.entry, c.pass_)] / plain_ms[(c.plain, c.pass_)]
        assert c.ratio == pytest.approx(want * base)
    assert len(dropout) == 2 * 2 * 2  # two entries, two passes, two providers
    # the CLI prints the same pairs and the geometric means
    path = tmp_path / "costs.txt"
    run.write(path)
    result = CliRunner().invoke(cli, ["perfdb", "costs", str(path)])
    assert result.exit_code == 0, result.output
    assert "dropout-bf16-d64-s1024-causal-p0.1" in result.output and "dropout fwd aotattn" in result.output
    lonely = Perfdb(header={"tag": "lonely", "arch": "sm_90"})
    lonely.add(by["dropout-bf16-d128-s512-full-p0.1"], [Record("dropout-bf16-d128-s512-full-p0.1", "fwd", "aotattn",
                                                               1.0, 0.0, 1.0, 1.0)])
    lonely.write(tmp_path / "lonely.txt")
    result = CliRunner().invoke(cli, ["perfdb", "costs", str(tmp_path / "lonely.txt")])
    assert result.exit_code != 0 and "plain twin" in result.output


CELL = "flash.backward[dtype=bf16]@seqlen_q=1024,seqlen_k=1024"  # the text of a note's cell


def _shared_cell_run(times: dict[int, dict[str, float]], spread: float = 0.002, cell: str = CELL) -> Perfdb:
    """Entries that all read one flash.backward cell: ``{entry index: {provider: ms}}``, the
    unforced call under "aotattn" choosing split."""
    run = Perfdb(header={"arch": "sm_90", "gpu": "fabricated", "date": "2026-12-04"})
    for i, by_provider in times.items():
        entry = ENTRIES[i]
        run.add(entry, [Record(entry.name, "bwd", provider, ms, spread,
                               note=f"choice=split cell={cell}" if provider == "aotattn" else "")
                        for provider, ms in by_provider.items()])
    return run


@pytest.mark.parametrize("times, agreed, contested", [
    # one fault, the other entry on the cell did not time ws slower: the cell changes
    ({0: {"aotattn": 1.0, "aotattn:split": 1.0, "aotattn:ws": 0.8},
      1: {"aotattn": 2.0, "aotattn:split": 2.0, "aotattn:ws": 2.001}}, {CELL: "ws"}, None),
    # the other entry is 10% faster with split than with ws: the cell is contested
    ({0: {"aotattn": 1.0, "aotattn:split": 1.0, "aotattn:ws": 0.8},
      1: {"aotattn": 2.0, "aotattn:split": 2.0, "aotattn:ws": 2.2}}, {}, "is faster with split"),
    # two faults on the cell name different winners
    ({0: {"aotattn": 1.0, "aotattn:split": 1.0, "aotattn:ws": 0.8, "aotattn:fused": 1.1},
      1: {"aotattn": 2.0, "aotattn:split": 2.0, "aotattn:ws": 2.3, "aotattn:fused": 1.7}}, {},
     "faults disagree (fused, ws)"),
])
def test_a_cell_other_entries_read_faster_as_it_is_is_not_patched(times, agreed, contested):
    """The faults' patch changes a cell only when no entry reading it loses: a window entry
    and a dense entry that share a cell, or a grouped-query call and the same call without
    groups, can want different backends (seen on the H200, run s35-dense)."""
    run = _shared_cell_run(times)
    found = analysis.faults(run)
    assert found and all(f.cell == CELL for f in found)
    changes, left = analysis.patchable(run, found)
    assert changes == agreed
    if contested is None:
        assert left == {}
    else:
        assert list(left) == [CELL] and contested in " ".join(left[CELL])


def test_a_fault_whose_note_names_another_table_is_not_patched():
    """A note edited (or from another run) naming a forward cell gave that table a backend:
    `faults --patch` wrote `fused = ` (no knob of it) into flash.attn_fwd's patch."""
    other = "flash.attn_fwd[dtype=bf16]@seqlen_q=512,seqlen_k=512"
    run = _shared_cell_run({0: {"aotattn": 1.0, "aotattn:split": 1.0, "aotattn:fused": 0.5}}, cell=other)
    found = analysis.faults(run)
    assert [f.cell for f in found] == [other]
    changes, left = analysis.patchable(run, found)
    assert changes == {} and "not a flash.backward cell" in " ".join(left[other])


def test_cli_faults_leaves_contested_cells_out_of_the_patch(tmp_path):
    root = tmp_path / "perfdb"
    # a real cell name, so that a patch could be written for it
    cell = "flash.backward[dtype=bf16,BLOCK_D=128,PAD_HEAD=False,MASK=2,VARLEN=False,DROPOUT=False,BIAS=0," \
           "DETERMINISTIC=False]@seqlen_q=512,seqlen_k=512"
    run = _shared_cell_run({0: {"aotattn": 1.0, "aotattn:split": 1.0, "aotattn:ws": 0.8},
                            1: {"aotattn": 2.0, "aotattn:split": 2.0, "aotattn:ws": 2.2}}, cell=cell)
    _write(run, root, "shared")
    out = CliRunner().invoke(cli, ["perfdb", "faults", "shared", "--patch", str(tmp_path / "p"), "--fail",
                                   "--perfdb", str(root)])
    assert out.exit_code == 1
    assert "left out" in out.output and "is faster with split" in out.output.replace("\n", " ")
    assert "no patch written" in out.output and not (tmp_path / "p").exists()

    # beside it, a fault alone on its cell: the patch holds that cell only
    alone = cell.replace("seqlen_q=512,seqlen_k=512", "seqlen_q=1024,seqlen_k=1024")
    lone = _shared_cell_run({2: {"aotattn": 1.0, "aotattn:split": 1.0, "aotattn:ws": 0.7}}, cell=alone)
    for entry in lone.entries.values():
        run.add(entry, [r for r in lone.records if r.entry == entry.name])
    _write(run, root, "both")
    out = CliRunner().invoke(cli, ["perfdb", "faults", "both", "--patch", str(tmp_path / "p"), "--perfdb", str(root)])
    assert out.exit_code == 0 and "left out" in out.output
    (written,) = (tmp_path / "p").glob("*.dbpatch")
    edits = parse_patch(rules.BACKWARD, written.read_text()).edits
    assert "seqlen_q=1024 seqlen_k=1024: ws" in written.read_text() and "seqlen_q=512" not in written.read_text()
    assert edits


CURRENT = "flash.backward[dtype=bf16,BLOCK_D=128,PAD_HEAD=False,MASK=2,VARLEN=False,DROPOUT=False,BIAS=0," \
          "DETERMINISTIC=False]@seqlen_q=1024,seqlen_k=1024"
OLDER = "flash.backward[dtype=bf16,BLOCK_D=64,MASK=2,DETERMINISTIC=False]@seqlen_q=512,seqlen_k=512"  # s1 notes
UNGROUPED = "flash.backward[dtype=bf16,BLOCK_D=64,PAD_HEAD=False,MASK=2,VARLEN=False,DROPOUT=False,BIAS=0," \
            "DETERMINISTIC=False]@seqlen_q=1024,seqlen_k=1024"  # what a grouped call noted before GROUPED existed


def test_faults_patch_skips_cells_named_as_an_older_table_did(tmp_path):
    """`faults --patch` failed as a whole on a run whose notes name cells in an older format
    (before PAD_HEAD, VARLEN, DROPOUT and BIAS were axes). Such a cell is left out with a
    warning at its result line, and so is a grouped-query fault noted before GROUPED existed
    (patching it would edit the block of the calls without groups); the rest is patched."""
    rng = random.Random()
    dense, grouped = select(declared(), ["dense-bf16-d128-s1024-causal"])[0], \
        select(declared(), ["gqa-bf16-d64-g4-s1024-causal"])[0]
    plain = select(declared(), ["dense-bf16-d64-s512-causal"])[0]
    run = Perfdb(header={"tag": "old", "arch": "sm_90", "gpu": "fabricated", "date": "2026-11-30"})
    for entry, cell in ((plain, OLDER), (dense, CURRENT), (grouped, UNGROUPED)):
        ms = rng.uniform(1.0, 5.0)
        run.add(entry, [Record(entry.name, "bwd", "aotattn", ms, 0.001, note=f"choice=split cell={cell}"),
                        Record(entry.name, "bwd", "aotattn:split", ms, 0.001),
                        Record(entry.name, "bwd", "aotattn:fused", ms * rng.uniform(0.5, 0.8), 0.001)])
    root = tmp_path / "perfdb"
    path = _write(run, root, "old")
    lines = path.read_text().splitlines()
    out = CliRunner().invoke(cli, ["perfdb", "faults", "old", "--patch", str(tmp_path / "p"), "--perfdb", str(root)])
    assert out.exit_code == 0, out.output
    warned = [line for line in out.output.splitlines() if line.startswith(f"{path}:")]
    assert len(warned) == 2, out.output
    for entry, reason in ((plain, "the functional lacks axes PAD_HEAD, VARLEN, DROPOUT, BIAS"),
                          (grouped, "noted without GROUPED=True")):
        (line,) = [w for w in warned if entry.name in w]
        number = int(line[len(str(path)) + 1:].split(":")[0])
        assert lines[number - 1].split()[:3] == [entry.name, "bwd", "aotattn"] and reason in line, line
    (written,) = (tmp_path / "p").glob("*.dbpatch")
    text = written.read_text()
    assert parse_patch(rules.BACKWARD, text).edits
    assert "BLOCK_D=128" in text and "BLOCK_D=64" not in text  # the current cell only

    # only such cells: nothing to write, and the command says why
    alone = Perfdb(header=dict(run.header), entries={plain.name: plain},
                   records=[r for r in run.records if r.entry == plain.name])
    _write(alone, root, "older")
    out = CliRunner().invoke(cli, ["perfdb", "faults", "older", "--patch", str(tmp_path / "q"), "--perfdb", str(root)])
    assert out.exit_code == 0 and "no patch written: 1 cell(s) named as an older table did" in out.output, out.output
    assert not (tmp_path / "q").exists()


def test_note_problem_knows_every_axis_a_cell_name_may_leave_out():
    """A defaulted axis is left out of a cell's name at its default, so an old note reads as
    that default: perfmon must know how each such axis of flash.backward follows from an
    entry, or it cannot tell an old note from a current one."""
    assert set(dict(rules.BACKWARD.axis_defaults)) <= set(analysis.ENTRY_AXES)
    grouped = select(declared(), ["gqa-bf16-d64-g4-s1024-causal"])[0]
    plain = select(declared(), ["dense-bf16-d64-s1024-causal"])[0]
    assert analysis.note_problem(plain, UNGROUPED) is None
    noted_grouped = UNGROUPED.replace("DETERMINISTIC=False", "DETERMINISTIC=False,GROUPED=True")
    assert analysis.note_problem(grouped, noted_grouped) is None
    assert "GROUPED=True" in analysis.note_problem(grouped, UNGROUPED)
    assert "lacks axes" in analysis.note_problem(plain, OLDER)


def test_compare_fails_when_nothing_was_compared(tmp_path):
    """`compare --fail-on-regression` passed when B had none of A's entries ("0 lost ... 6
    compared", exit 0)."""
    root = tmp_path / "perfdb"
    _write(_random_run(["dense-bf16-d64-s512-*"]), root, "a")
    _write(_random_run(["dense-bf16-d128-s512-*"]), root, "b")
    _write(_random_run(["dense-bf16-d64-s512-*"]), root, "a2")

    def invoke(*args):
        return CliRunner().invoke(cli, ["perfdb", "compare", *args, "--perfdb", str(root)])

    apart = invoke("a", "b", "--fail-on-regression")
    assert apart.exit_code == 1 and "nothing was compared" in apart.output, apart.output
    assert invoke("a", "b").exit_code == 0  # without the flag: a report
    only_peers = invoke("a", "b", "--provider", "sdpa-flash", "--fail-on-regression")
    assert only_peers.exit_code == 1 and "sdpa-flash" in only_peers.output
    shared = invoke("a", "a2", "--fail-on-regression", "--threshold", "100")  # no regression beyond 100x
    assert shared.exit_code == 0 and "4 compared" in shared.output, shared.output


def test_a_peer_that_raises_is_reported_not_only_recorded(tmp_path):
    """A peer whose call raises leaves a record without a figure. ``peer_failures`` groups
    those by peer, pass and message (the run and ``perfdb summary`` print them), so a peer
    that fails on every entry (FlexAttention's backward before the thirtieth session) is
    seen. Peers the run chose not to call, and aotattn's own records, are not counted."""
    chosen = select(declared(), ["dense-bf16-d64-*"])
    refusal = "skipped: RuntimeError: This backward function was compiled with non-empty donated buffers"
    run = Perfdb(header={"tag": "peers", "arch": "sm_90"})
    for i, entry in enumerate(chosen):
        records = [Record(entry.name, "fwd", "flex", 1.0, 0.0, 1.0, 1.0),
                   Record(entry.name, "bwd", "flex", note=refusal),
                   Record(entry.name, "fwd", "sdpa-cudnn", note="skipped: not asked"),
                   Record(entry.name, "bwd", "aotattn", note="error: RuntimeError: out of memory")]
        if i == 0:
            records.append(Record(entry.name, "bwd", "sdpa-flash", note="skipped: while timing, ValueError: odd"))
        run.add(entry, records)
    found = analysis.peer_failures(run)
    assert found == [("flex", "bwd", len(chosen), refusal),
                     ("sdpa-flash", "bwd", 1, "skipped: while timing, ValueError: odd")]
    assert analysis.peer_failures(Perfdb(header={"tag": "empty"})) == []

    root = tmp_path / "perfdb"
    _write(run, root, "peers")
    shown = CliRunner().invoke(cli, ["perfdb", "summary", "peers", "--perfdb", str(root)])
    assert shown.exit_code == 0, shown.output
    assert f"flex bwd: raised on {len(chosen)} entries, no figure: RuntimeError" in shown.output
    assert "sdpa-flash bwd: raised on 1 entry" in shown.output and "not asked" not in shown.output


def test_standing_takes_each_entrys_latest_side_by_side_figure(tmp_path, monkeypatch):
    """``perfdb standing``: per entry and pass, the latest run (by date) that timed aotattn
    and the peer side by side; a later run without the peer flags the figure as re-timed,
    an entry redeclared with another shape under its name drops its older runs, and the
    CLI lists what is below the floor and says which runs were on other tables."""
    a, b, c = ENTRIES[:3]
    rng = random.Random()
    flex_a, flex_b = rng.uniform(0.5, 0.95), rng.uniform(1.05, 2.0)  # peer / aotattn in the old run

    def records(entry, ms, flex_ms=None, spread=0.01):
        out = [Record(entry.name, "fwd", "aotattn", ms, spread * ms)]
        if flex_ms is not None:
            out.append(Record(entry.name, "fwd", "flex", flex_ms, 0.02 * flex_ms, ratio=flex_ms / ms))
        return out

    old = Perfdb(header={"arch": "sm_90", "date": "2026-12-01T00:00:00+00:00", "tuning": "sha256:old (x)"})
    old.add(a, records(a, 1.0, flex_a))
    old.add(b, records(b, 2.0, 2.0 * flex_b))
    old.add(c, records(c, 3.0, 3.0 * flex_b))
    new = Perfdb(header={"arch": "sm_90", "date": "2026-12-03T00:00:00+00:00", "tuning": "sha256:new (x)"})
    new.add(a, records(a, 0.9))  # re-timed without the peer
    bigger = c.__class__(**{**c.__dict__, "batch": c.batch * 2})
    new.add(bigger, records(bigger, 6.0))  # another shape under c's name: c's old figure no longer counts
    mid = Perfdb(header={"arch": "sm_90", "date": "2026-12-02T00:00:00+00:00", "tuning": "sha256:old (x)"})
    mid.add(b, records(b, 1.5, 1.5 * 1.25))  # b's latest side by side

    found = {s.entry: s for s in analysis.standing([("mid", mid), ("new", new), ("old", old)], "flex")}
    assert set(found) == {a.name, b.name}
    assert found[a.name].ratio == pytest.approx(flex_a) and found[a.name].run == "old"
    assert found[a.name].newer == "2026-12-03T00:00:00+00:00" and found[a.name].spread == pytest.approx(0.02)
    assert found[b.name].ratio == pytest.approx(1.25) and found[b.name].run == "mid" and found[b.name].newer is None
    assert analysis.standing([("new", new)], "flex") == []

    root = tmp_path / "perfdb"
    for tag, run in (("old", old), ("mid", mid), ("new", new)):
        _write(run, root, tag)
    runner = CliRunner()
    from rich.console import Console

    # wide enough that the table shows whole names (a terminal's width otherwise: 80 in CI)
    monkeypatch.setattr("aotattn.perfmon.cli.console", Console(soft_wrap=True, width=240))

    def invoke(*args):
        return runner.invoke(cli, ["perfdb", "standing", *args, "--perfdb", str(root)])

    shown = invoke("--peer", "flex", "--fail")
    assert shown.exit_code == 1, shown.output
    assert a.name in shown.output and b.name not in shown.output and "re-timed 2026-12-03" in shown.output
    assert "1 of 2 entry passes at or above 1x flex, 1 below" in shown.output and "2 from runs on older tables" \
        in shown.output
    everything = invoke("--peer", "flex", "--all", "--floor", "0.1")
    assert everything.exit_code == 0 and a.name in everything.output and b.name in everything.output
    assert invoke("--peer", "flex", "-g", "window").exit_code != 0  # nothing selected
    assert "expected one of" in invoke("--peer", "nosuch").output
    assert invoke("--peer", "sdpa-cudnn").exit_code != 0  # no run timed it

    # --gpu: runs on other GPUs do not count (mid, b's latest, was on an H100)
    for tag, run, name in (("old", old, "NVIDIA H200"), ("mid", mid, "NVIDIA H100 80GB HBM3"),
                           ("new", new, "NVIDIA H200")):
        run.header["gpu"] = f"{name}, sm_90, 132 SMs"
        _write(run, root, tag)
    h200 = invoke("--peer", "flex", "--all", "--floor", "0.1", "--gpu", "h200")
    assert h200.exit_code == 0, h200.output
    stored = Perfdb.read(root / "sm_90" / "old.txt").by_key()  # the ratio as written (ms to a few digits)
    b_old = stored[b.name, "fwd", "flex"].ms / stored[b.name, "fwd", "aotattn"].ms
    assert f"{b_old:.3f}" in h200.output and "│ mid" not in h200.output  # b from "old" now
    assert "1.250" in invoke("--peer", "flex", "--all", "--floor", "0.1", "--gpu", "H100").output
    for bad in ("A100", " "):
        refused = invoke("--peer", "flex", "--gpu", bad)
        assert refused.exit_code != 0 and "--gpu" in refused.output and "NVIDIA H100 80GB HBM3" in refused.output


@pytest.mark.parametrize("args, option", [
    (["perfdb", "compare", "a", "b", "--threshold", "nan"], "--threshold"),
    (["perfdb", "compare", "a", "b", "--threshold", "-0.1"], "--threshold"),
    (["perfdb", "faults", "a", "--margin", "-10"], "--margin"),
    (["perfdb", "standing", "--peer", "flex", "--floor", "nan"], "--floor"),
    (["perfmon", "run", "--tag", "x", "--deadline", "nan"], "--deadline"),
    (["perfmon", "run", "--tag", "x", "--rounds", "0"], "--rounds"),
    (["perfmon", "images", "--arch", "sm_90", "--jobs", "0"], "--jobs"),
    (["tune", "compile", "plan.txt", "--jobs", "0"], "--jobs"),
])
def test_numeric_options_refuse_nan_and_out_of_range_values(args, option):
    """A NaN threshold made every comparison 'same' and --fail-on-regression pass; --jobs 0
    hung the compile pool."""
    from typer.testing import CliRunner

    from aotattn.cli import app

    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and option in result.output, result.output


def test_perfdb_errors_are_one_line_on_stderr_with_status_1(tmp_path, monkeypatch):
    import subprocess
    import sys

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for args, reason in ((["summary", "no-such-tag"], "no-such-tag"), (["faults", str(empty)], "an empty file")):
        done = subprocess.run([sys.executable, "-m", "aotattn.cli", "perfdb", *args], capture_output=True, text=True,
                              env={**os.environ, "AOTATTN_PERFDB": str(tmp_path)}, timeout=120)
        assert done.returncode == 1 and done.stdout == "", (args, done.stdout)
        assert done.stderr.count("\n") == 1 and reason in done.stderr and done.stderr.startswith("aotattn: error:")


def test_resume_refuses_a_run_measured_on_another_gpu_or_build(tmp_path):
    """`perfmon run --resume` used to append this machine's records under another GPU's header."""
    import torch

    from aotattn.cli import app
    from aotattn.perfmon.budget import Plan
    from aotattn.perfmon.measure import environment

    entry = select(declared(), ["dense-bf16-d64-s512-full"])[0]
    args = ["perfmon", "run", "--tag", "t", "--device", "cpu", "--match", entry.name, "--no-peers",
            "--rounds", "1", "--reps", "1", "--warmup", "0"]  # the timing of `here`
    here = {"tag": "t", **environment(torch.device("cpu"), Plan(rounds=1, reps=1, warmup=0))}
    for key, value in (("gpu", "NVIDIA H200, sm_90, 132 SMs"), ("tuning", "sha256:0123456789abcdef"),
                       ("torch", "2.0.0"), ("tag", "other")):
        path = tmp_path / f"{key}.txt"
        Perfdb(header={**here, key: value}, entries={entry.name: entry}).write(path)
        before = path.read_text()
        result = CliRunner().invoke(app, [*args, "--out", str(path), "--resume"])
        assert result.exit_code == 1 and f"{key} {value!r} there" in result.output, result.output
        assert "--force" in result.output and path.read_text() == before
    # the same machine and build resume: the measured entry is kept, nothing runs again
    same = tmp_path / "same.txt"
    Perfdb(header=here, entries={entry.name: entry}).write(same)
    result = CliRunner().invoke(app, [*args, "--out", str(same), "--resume"])
    assert result.exit_code == 0 and "0 of 1 entries to measure" in result.output, result.output


def test_resume_refuses_a_run_timed_with_other_options(tmp_path):
    """`perfmon run --resume` with other --reps, --rounds, --warmup or --hide-host-ms kept the
    stored '#! timing' header, which then lied about the entries measured on resuming."""
    import torch

    from aotattn.cli import app
    from aotattn.perfmon.budget import Plan
    from aotattn.perfmon.measure import environment

    rng = random.Random()
    rounds, reps, warmup = rng.randint(1, 4), rng.randint(1, 9), rng.randint(0, 3)
    entry = rng.choice(select(declared(), ["dense-*"]))
    path = tmp_path / "t.txt"
    here = {"tag": "t", **environment(torch.device("cpu"), Plan(rounds=rounds, reps=reps, warmup=warmup))}
    Perfdb(header=here, entries={entry.name: entry}).write(path)
    before = path.read_text()
    args = ["perfmon", "run", "--tag", "t", "--device", "cpu", "--match", entry.name, "--no-peers", "--out", str(path),
            "--resume"]
    same = ["--rounds", str(rounds), "--reps", str(reps), "--warmup", str(warmup)]
    for other in (["--rounds", str(rounds + 1), *same[2:]], [*same[:2], "--reps", str(reps + 1), *same[4:]],
                  [*same[:4], "--warmup", str(warmup + 1)], [*same, "--hide-host-ms", "0.5"]):
        result = CliRunner().invoke(app, [*args, *other])
        assert result.exit_code == 1 and "timing 'median of" in result.output and "--force" in result.output, \
            (other, result.output)
        assert path.read_text() == before
    result = CliRunner().invoke(app, [*args, *same])
    assert result.exit_code == 0 and "0 of 1 entries to measure" in result.output, result.output


def test_a_newline_in_an_argument_is_recorded_as_one_shell_line(tmp_path, monkeypatch):
    """`#! command` was the raw arguments joined by spaces: a newline in one (here in the
    --perfdb folder) ended the header line, and the run measured its first entry, then
    failed to write. The command is one shell line that runs the same arguments again."""
    import subprocess
    import sys

    import aotattn.perfmon.measure as measure
    from aotattn.cli import app

    entry = select(declared(), ["train-tiny-sdpa"])[0]
    measured = []

    def fake(e, device, options):  # the measuring is not what is tested: a figure for each pass
        measured.append(e.name)
        return [Record(e.name, p, "aotattn", 1.25, 0.01, 1.0, 1.0) for p in e.passes]

    monkeypatch.setattr(measure, "measure_entry", fake)
    root = tmp_path / "a\nb [results]"
    args = ["perfmon", "run", "--tag", "nl", "--device", "cpu", "-m", entry.name, "--no-peers", "--perfdb", str(root)]
    monkeypatch.setattr(sys, "argv", ["aotattn", *args])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    db = Perfdb.read(root / "cpu" / "nl.txt")
    assert measured == [entry.name] and list(db.entries) == [entry.name]
    command = db.header["command"]
    assert "\n" not in command and "$'" in command
    shell = shutil.which("bash")
    if shell:  # bash reads the line back into the same arguments
        words = subprocess.run([shell, "-c", f'printf "%s\\0" {command}'], capture_output=True, text=True,
                               check=True).stdout.split("\0")[:-1]
        assert words == ["aotattn", *args]

    # a header that would not read back is refused before anything is measured
    real = measure.environment
    monkeypatch.setattr(measure, "environment", lambda *a, **k: {**real(*a, **k), "gpu": "odd\n[entries]"})
    measured.clear()
    result = CliRunner().invoke(app, [*args[:3], "other", *args[4:]])
    assert result.exit_code == 1 and "would not read back" in result.output, result.output
    assert measured == [] and not (root / "cpu" / "other.txt").exists()


@pytest.mark.parametrize("selectors, named", [
    (["--group", "dense", "--group", "bogus"], "--group 'bogus'"),
    (["-m", "dense-bf16-d64-s512-full", "-m", "zzz*"], "--match 'zzz*'"),
    (["-m", "dense-*", "-m", "gqa-*", "-g", "dense"], "--match 'gqa-*'"),
    (["-m", "dense-*", "-g", "dense", "-g", "gqa"], "--group 'gqa'"),
])
@pytest.mark.parametrize("command", [["perfmon", "list"], ["perfmon", "images", "--dry-run"],
                                     ["perfmon", "run", "--tag", "t", "--device", "cpu"]])
def test_a_selector_that_matches_nothing_is_refused_beside_one_that_does(command, selectors, named, tmp_path,
                                                                          monkeypatch):
    """With several --match globs or --group names, one that matched nothing was ignored when
    another matched (a typo ran a different selection than asked)."""
    import aotattn.perfmon.measure as measure
    from aotattn.cli import app

    def refuse(*args, **kwargs):  # a run that got this far measured the other selection
        raise AssertionError("measured an entry")

    monkeypatch.setattr(measure, "measure_entry", refuse)
    result = CliRunner().invoke(app, [*command, *selectors, *(["--perfdb", str(tmp_path)] if "run" in command else [])])
    assert result.exit_code == 1 and named in result.output, result.output
    assert not list(tmp_path.rglob("*.txt"))


def test_run_without_a_gpu_is_refused_unless_the_interpreter_is_asked_for(tmp_path, monkeypatch):
    """Without --device on a CPU build, `perfmon run` started the interpreter on GPU-sized
    entries (hours for the first one) and wrote them under perfdb/cpu/."""
    import torch

    from aotattn.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(app, ["perfmon", "run", "--tag", "t", "-m", "model-gpt2", "--perfdb", str(tmp_path)])
    assert result.exit_code == 1 and "no CUDA GPU" in result.output and "--device cpu" in result.output
    assert not list(tmp_path.rglob("*.txt"))


def test_shell_line_gives_back_the_same_arguments():
    """`#! command`'s quoting: spaces, quotes, newlines, other unprintable characters, and the
    bytes of an argument that was not UTF-8, each read back by bash as it was given."""
    import subprocess

    from aotattn.perfmon.measure import shell_line

    shell = shutil.which("bash")
    if shell is None:
        pytest.skip("needs bash")
    rng = random.Random()
    pieces = [b"plain", b"two words", b"it's", b"new\nline", b"tab\t", b"back\\slash", b"$'x'", b"", b"\x01\x7f",
              "\u2028\x85\U0001F600".encode(), b"not utf-8 \xff\xfe", b"[results]", b"#! arch"]
    for _ in range(20):
        raw = [b"aotattn", *(b"".join(rng.sample(pieces, rng.randint(1, 3))) for _ in range(rng.randint(1, 6)))]
        line = shell_line([os.fsdecode(arg) for arg in raw])
        assert "\n" not in line and line.isprintable()
        words = subprocess.run([shell, "-c", f'printf "%s\\0" {line}'], capture_output=True, check=True)
        assert words.stdout.split(b"\0")[:-1] == raw, line
