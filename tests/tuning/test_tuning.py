"""The tuning database: format, round trips, patches, bases, lookup rules, validation, CLI."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from aotattn import families, tuning
from aotattn.cli import app
from aotattn.spec import Config, Functional, OperatorSpec
from aotattn.tuning import Database, TuningError, parse_patch, parse_table, write_table
from aotattn.tuning.format import fallback_chain

TOY = OperatorSpec(
    family="toy", name="k",
    functionals=(("dtype", ("fp16", "bf16")), ("PAD", (False, True))),
    tuning_space=(("BLOCK", (16, 32, 64)), ("num_warps", (4, 8))),
    tuning_keys=(("seqlen_q", (16, 32, 64)), ("seqlen_k", (16, 32, 64))),
    fallback=lambda f: {**f, "PAD": False} if f["PAD"] else None,
)
SPECS = {TOY.qualname: TOY}
HEADER = "#! aotattn-tuning 1\n#! table toy.k\n#! arch {arch}\n{base}#! keys seqlen_q=16,32,64 seqlen_k=16,32,64\n"
TABLE = textwrap.dedent("""\
    # a comment that survives round trips
    #! aotattn-tuning 1
    #! table toy.k
    #! arch sm_90
    #! keys seqlen_q=16,32,64 seqlen_k=16,32,64

    [configs]
    big = BLOCK=64 num_warps=8
    small = BLOCK=16 num_warps=4

    [dtype=fp16 PAD=False]
    seqlen_q=16..32: small*2 big
    seqlen_q=64: big*3

    [dtype=bf16 PAD=False]
    seqlen_q=16: small .*2
    seqlen_q=32..64: big*3
    """)


def f(dtype="fp16", pad=False):
    return Functional.of({"dtype": dtype, "PAD": pad})


def make_db(tmp_path: Path, files: dict[str, str]) -> Database:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return Database(tmp_path, SPECS)


def test_round_trip_is_byte_exact():
    table = parse_table(TOY, TABLE)
    assert write_table(TOY, table) == TABLE
    assert parse_table(TOY, write_table(TOY, table)) == table


def test_run_length_encoding_and_row_ranges():
    table = parse_table(TOY, TABLE)
    assert table.blocks[f()] == [["small", "small", "big"], ["small", "small", "big"], ["big"] * 3]
    assert table.blocks[f("bf16")][0] == ["small", ".", "."]
    # the writer finds the runs itself
    table.blocks[f()][1] = ["big", "big", "small"]
    text = write_table(TOY, table)
    assert "seqlen_q=16: small*2 big\nseqlen_q=32: big*2 small\nseqlen_q=64: big*3\n" in text


@pytest.mark.parametrize("value, bucket", [(1, 16), (16, 16), (17, 32), (64, 64), (10**6, 64), (0, 16)])
def test_bucket_is_the_smallest_at_least_the_value_clamped(tmp_path, value, bucket):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    table = db.effective("sm_90", "toy.k")
    expected = table.configs[table.blocks[f()][[16, 32, 64].index(bucket)][2]]
    assert db.lookup("sm_90", TOY, f(), {"seqlen_q": value, "seqlen_k": 64}) == expected


def test_patches_apply_in_numeric_order(tmp_path):
    patch = "#! aotattn-patch 1\n#! table toy.k\n[dtype=fp16 PAD=False]\nseqlen_q=64 seqlen_k=16: {}\n"
    db = make_db(tmp_path, {
        "nvidia/sm_90/toy.k.txt": TABLE,
        "nvidia/sm_90/toy.k.0002-second.dbpatch": patch.format("big"),
        "nvidia/sm_90/toy.k.0010-third.dbpatch": "#! aotattn-patch 1\n#! table toy.k\n[configs]\nmid = BLOCK=32 "
                                                 "num_warps=4\n[dtype=fp16 PAD=False]\nseqlen_q=* seqlen_k=16..32: mid\n",
        "nvidia/sm_90/toy.k.0001-first.dbpatch": patch.format("small"),
    })
    assert [p.name for p in db.patch_paths("sm_90", "toy.k")] == [
        "toy.k.0001-first.dbpatch", "toy.k.0002-second.dbpatch", "toy.k.0010-third.dbpatch"]
    after_two = db.effective("sm_90", "toy.k", patches=2)
    assert after_two.blocks[f()][2][0] == "big"
    final = db.effective("sm_90", "toy.k")
    assert [row[:2] for row in final.blocks[f()]] == [["mid", "mid"]] * 3
    assert db.lookup("sm_90", TOY, f(), {"seqlen_q": 64, "seqlen_k": 20}) == Config.of(BLOCK=32, num_warps=4)


def test_base_inheritance_overrides_only_what_differs(tmp_path):
    derived = HEADER.format(arch="sm_80", base="#! base sm_90\n") + (
        "\n[configs]\ntiny = BLOCK=16 num_warps=4\n\n[dtype=bf16 PAD=False]\nseqlen_q=16..64: tiny*3\n")
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_80/toy.k.txt": derived})
    assert db.lookup("sm_80", TOY, f("bf16"), {"seqlen_q": 64, "seqlen_k": 64})["BLOCK"] == 16
    assert db.lookup("sm_80", TOY, f(), {"seqlen_q": 64, "seqlen_k": 64})["BLOCK"] == 64  # from sm_90
    assert parse_table(TOY, derived).base == "sm_90" and write_table(TOY, parse_table(TOY, derived)) == derived


def test_fallback_and_missing_entries_are_clear_errors(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    # a padded functional falls back to its unpadded twin
    assert db.lookup("sm_90", TOY, f(pad=True), {"seqlen_q": 64, "seqlen_k": 16})["BLOCK"] == 64
    with pytest.raises(TuningError, match=r"sm_90 / toy.k / \[PAD=False,dtype=bf16\]: cell seqlen_q=16 seqlen_k=32 "
                                          r"has no entry"):
        db.lookup("sm_90", TOY, f("bf16", True), {"seqlen_q": 3, "seqlen_k": 20})
    lonely = TABLE.replace("[dtype=bf16 PAD=False]\nseqlen_q=16: small .*2\nseqlen_q=32..64: big*3\n", "")
    db = make_db(tmp_path / "b", {"nvidia/sm_90/toy.k.txt": lonely})
    with pytest.raises(TuningError, match=r"sm_90 / toy.k: no block for functional \[PAD=True,dtype=bf16\] nor its "
                                          r"fallbacks \[PAD=False,dtype=bf16\]"):
        db.lookup("sm_90", TOY, f("bf16", True), {"seqlen_q": 16, "seqlen_k": 16})
    with pytest.raises(TuningError, match="no architecture 'sm_75'"):
        db.lookup("sm_75", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16})


BAD_TABLES = [
    ("unknown config", TABLE.replace("small*2 big", "small*2 huge"), 12, "unknown configuration 'huge'"),
    ("row outside keys", TABLE.replace("seqlen_q=64: big*3", "seqlen_q=128: big*3"), 13,
     "seqlen_q=128 is not a bucket"),
    ("too many cells", TABLE.replace("seqlen_q=64: big*3", "seqlen_q=64: big*4"), 13, "expected 3 cells"),
    ("missing row", TABLE.replace("seqlen_q=64: big*3\n", ""), 11, "has no rows for seqlen_q=64"),
    ("row twice", TABLE.replace("seqlen_q=64: big*3", "seqlen_q=32..64: big*3"), 13, "row seqlen_q=32 given twice"),
    ("unknown knob", TABLE.replace("big = BLOCK=64", "big = BLOK=64"), 8, "unknown tuning knob 'BLOK'"),
    ("knob value", TABLE.replace("big = BLOCK=64", "big = BLOCK=48"), 8, "BLOCK: '48' is not one of 16, 32, 64"),
    ("axis value", TABLE.replace("[dtype=fp16 PAD=False]", "[dtype=fp8 PAD=False]"), 11, "dtype: 'fp8'"),
    ("unknown axis", TABLE.replace("[dtype=fp16 PAD=False]", "[dtype=fp16 PAD=False X=1]"), 11, "no axis 'X'"),
    ("missing axis", TABLE.replace("[dtype=fp16 PAD=False]", "[dtype=fp16]"), 11, "lacks axes PAD"),
    ("functional twice", TABLE.replace("[dtype=bf16 PAD=False]", "[dtype=fp16 PAD=False]"), 15, "appears twice"),
    ("bad run", TABLE.replace("small*2 big", "small*x big"), 12, "expected name*count"),
    ("keys mismatch", TABLE.replace("seqlen_k=16,32,64", "seqlen_k=16,32"), 5, "expected '#! keys"),
    ("wrong table", TABLE.replace("#! table toy.k", "#! table toy.j"), 3, "expected '#! table toy.k'"),
    ("no version", TABLE.replace("#! aotattn-tuning 1\n", ""), 1, "expected '#! aotattn-tuning 1'"),
]


@pytest.mark.parametrize("case", BAD_TABLES, ids=[c[0] for c in BAD_TABLES])
def test_validation_errors_carry_line_numbers(case):
    _, text, line, message = case
    with pytest.raises(TuningError) as info:
        parse_table(TOY, text, "t.txt")
    assert info.value.where == f"t.txt:{line}"
    assert message in str(info.value)


def test_patch_touching_an_absent_functional(tmp_path):
    only_fp16 = TABLE.split("[dtype=bf16")[0]
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": only_fp16,
                            "nvidia/sm_90/toy.k.0001-x.dbpatch": "#! aotattn-patch 1\n#! table toy.k\n\n"
                                                                 "[dtype=bf16 PAD=False]\nseqlen_q=* seqlen_k=*: big\n"})
    with pytest.raises(TuningError) as info:
        db.effective("sm_90", "toy.k")
    assert info.value.where.endswith("toy.k.0001-x.dbpatch:5")
    assert "edits a functional the table does not have" in str(info.value)


def test_base_cycles_and_missing_bases(tmp_path):
    a = HEADER.format(arch="sm_80", base="#! base sm_86\n")
    b = HEADER.format(arch="sm_86", base="#! base sm_80\n")
    db = make_db(tmp_path, {"nvidia/sm_80/toy.k.txt": a, "nvidia/sm_86/toy.k.txt": b})
    with pytest.raises(TuningError, match=r"#! base cycle: sm_80 -> sm_86 -> sm_80") as info:
        db.effective("sm_80", "toy.k")
    assert info.value.where.endswith("sm_86/toy.k.txt:4")
    db = make_db(tmp_path / "m", {"nvidia/sm_80/toy.k.txt": HEADER.format(arch="sm_80", base="#! base sm_99\n")})
    with pytest.raises(TuningError, match="#! base sm_99: no such architecture"):
        db.effective("sm_80", "toy.k")


def test_lint_and_squash(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE,
                            "nvidia/sm_90/toy.k.0001-x.dbpatch": "#! aotattn-patch 1\n#! table toy.k\n\n"
                                                                 "[dtype=fp16 PAD=False]\nseqlen_q=16 seqlen_k=*: big\n",
                            "nvidia/sm_90/notes.md": "hello"})
    problems = db.lint()
    assert len(problems) == 1 and "not a table" in str(problems[0])
    (tmp_path / "nvidia/sm_90/notes.md").unlink()
    before = db.effective("sm_90", "toy.k")
    removed = db.squash("sm_90", "toy.k")
    assert [p.name for p in removed] == ["toy.k.0001-x.dbpatch"] and not removed[0].exists()
    assert Database(tmp_path, SPECS).effective("sm_90", "toy.k").blocks == before.blocks
    assert Database(tmp_path, SPECS).lint() == []


def test_cli_show_diff_lint_squash(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "tables", lambda: SPECS)
    other = TABLE.replace("#! arch sm_90", "#! arch sm_80").replace("seqlen_q=64: big*3", "seqlen_q=64: small*3")
    make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_80/toy.k.txt": other})
    runner = CliRunner()
    result = runner.invoke(app, ["tuning", "show", "--arch", "sm_90", "--table", "toy.k", "--tuning-db", str(tmp_path)])
    assert result.exit_code == 0 and "[dtype=fp16 PAD=False]" in result.output and "b: small" in result.output
    result = runner.invoke(app, ["tuning", "diff", "--arch", "sm_90", "--against", "sm_80", "--table", "toy.k",
                                 "--tuning-db", str(tmp_path)])
    assert result.exit_code == 0 and "1 difference(s)" in result.output and "seqlen_q=64" in result.output
    assert runner.invoke(app, ["tuning", "lint", "--tuning-db", str(tmp_path)]).exit_code == 0
    (tmp_path / "nvidia/sm_80/toy.k.txt").write_text(other.replace("big*3", "bigg*3"))
    result = runner.invoke(app, ["tuning", "lint", "--tuning-db", str(tmp_path)])
    assert result.exit_code == 1 and "unknown configuration 'bigg'" in result.output
    result = runner.invoke(app, ["tuning", "squash", "--arch", "sm_90", "--table", "toy.k", "--tuning-db", str(tmp_path)])
    assert result.exit_code == 0 and "folded 0 patch(es)" in result.output


def test_environment_variable_selects_another_database(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_VAR, str(tmp_path))
    assert tuning.database().root == tmp_path


def test_the_project_database_is_valid_and_complete():
    """Every functional of every table has a block, its own or a declared fallback's (the
    operator table seeds only its roots); sm_80 and gfx942 resolve through bases."""
    db = tuning.database()
    assert db.lint() == []

    for spec in families.tables().values():
        for arch in db.archs():
            if not spec.runs_on(arch):  # a kernel of one architecture (a Gluon kernel's) has no table elsewhere
                assert not db.table_path(arch, spec.qualname).exists(), (arch, spec.qualname)
                continue
            table = db.effective(arch, spec.qualname)
            missing = [fn for fn in spec.enumerate_functionals()
                       if not any(f in table.blocks for f in fallback_chain(spec.fallback, fn))]
            assert not missing, f"{arch} / {spec.qualname}: {len(missing)} functionals without a block"


def test_lookup_reads_only_the_blocks_it_needs(tmp_path):
    """The runtime parses one block (and its fallbacks), with bases and patches, of a table of
    hundreds; it must agree with the fully resolved table, and a broken block elsewhere is
    lint's to report, not the lookup's."""
    broken = TABLE.replace("seqlen_q=16: small .*2", "seqlen_q=16: small nosuch .")
    patch = ("#! aotattn-patch 1\n#! table toy.k\n\n[dtype=fp16 PAD=False]\nseqlen_q=64 seqlen_k=16: small\n"
             "[dtype=bf16 PAD=False]\nseqlen_q=64 seqlen_k=64: small\n"
             "[dtype=bf16 PAD=True]\nseqlen_q=48 seqlen_k=16: small\n")  # not a bucket: lint's, unread here
    derived = HEADER.format(arch="sm_80", base="#! base sm_90\n") + "\n[configs]\n"
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": broken, "nvidia/sm_90/toy.k.0001-p.dbpatch": patch,
                            "nvidia/sm_80/toy.k.txt": derived})
    for arch in ("sm_90", "sm_80"):
        assert db.lookup(arch, TOY, f(), {"seqlen_q": 64, "seqlen_k": 16}) == Config.of(BLOCK=16, num_warps=4)
        assert db.lookup(arch, TOY, f(pad=True), {"seqlen_q": 16, "seqlen_k": 64}) == Config.of(BLOCK=64, num_warps=8)
        with pytest.raises(TuningError, match="unknown configuration 'nosuch'"):
            db.lookup(arch, TOY, f("bf16"), {"seqlen_q": 16, "seqlen_k": 16})
    problems = [str(e) for e in db.lint()]
    assert any("unknown configuration 'nosuch'" in p for p in problems)
    assert any("seqlen_q=48 is not a bucket" in p for p in problems), problems
    with pytest.raises(TuningError, match="nosuch|seqlen_q=48"):  # a call that needs those blocks fails
        Database(tmp_path, SPECS).lookup("sm_90", TOY, f("bf16", pad=True), {"seqlen_q": 64, "seqlen_k": 64})


def test_lookup_agrees_with_the_fully_resolved_project_tables():
    import random

    rng = random.Random()
    db = tuning.database()
    for spec in families.tables().values():
        for arch in filter(spec.runs_on, db.archs()):
            full = db.effective(arch, spec.qualname)
            functionals = list(full.blocks)
            edited = sorted({edit.functional for path in db.patch_paths(arch, spec.qualname)  # the patches'
                             for edit in parse_patch(spec, path.read_text(), str(path)).edits}, key=str)
            for functional in (rng.sample(functionals, min(3, len(functionals)))
                               + rng.sample(edited, min(3, len(edited)))):
                sizes = {name: rng.choice(buckets) for name, buckets in spec.tuning_keys}
                expected = full.configs[tuning.format.cell(full, functional, sizes)]
                assert db.lookup(arch, spec, functional, sizes) == expected, (arch, spec.qualname, functional)


def test_patch_round_trip():
    text = ("# why\n#! aotattn-patch 1\n#! table toy.k\n\n[configs]\nmid = BLOCK=32 num_warps=4\n\n"
            "[dtype=fp16 PAD=False]\nseqlen_q=16 seqlen_k=*: mid\nseqlen_q=32..64 seqlen_k=16: big\n")
    assert tuning.write_patch(TOY, parse_patch(TOY, text)) == text


def test_cli_diff_against_a_git_revision(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(families, "tables", lambda: SPECS)
    repo = tmp_path / "repo"
    make_db(repo / "tuning", {"nvidia/sm_90/toy.k.txt": TABLE})
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "seed"], check=True)
    subprocess.run(git + ["tag", "v1"], check=True)
    (repo / "tuning/nvidia/sm_90/toy.k.0001-faster.dbpatch").write_text(
        "#! aotattn-patch 1\n#! table toy.k\n[dtype=fp16 PAD=False]\nseqlen_q=16 seqlen_k=16: big\n")
    result = CliRunner().invoke(app, ["tuning", "diff", "--arch", "sm_90", "--table", "toy.k", "--rev", "v1",
                                      "--tuning-db", str(repo / "tuning")])
    assert result.exit_code == 0, result.output
    assert "1 difference(s)" in result.output and "seqlen_q=16 seqlen_k=16: small" in result.output
    result = CliRunner().invoke(app, ["tuning", "diff", "--arch", "sm_90", "--table", "toy.k", "--without-patches",
                                      "--tuning-db", str(repo / "tuning")])
    assert "1 difference(s)" in result.output


def test_cli_diff_after_some_patches_lists_what_later_patches_override(tmp_path, monkeypatch):
    """--after-patches 1: a later patch that sets a cell back masks the first patch's (the tuner's) choice."""
    monkeypatch.setattr(families, "tables", lambda: SPECS)
    root = tmp_path / "tuning"
    make_db(root, {
        "nvidia/sm_90/toy.k.txt": TABLE,
        "nvidia/sm_90/toy.k.0001-tuned.dbpatch":
            "#! aotattn-patch 1\n#! table toy.k\n[dtype=fp16 PAD=False]\nseqlen_q=16 seqlen_k=16: big\n"
            "seqlen_q=32 seqlen_k=16: big\n",
        "nvidia/sm_90/toy.k.0002-old-faults.dbpatch":
            "#! aotattn-patch 1\n#! table toy.k\n[dtype=fp16 PAD=False]\nseqlen_q=16 seqlen_k=16: small\n"})
    run = lambda *args: CliRunner().invoke(app, ["tuning", "diff", "--arch", "sm_90", "--table", "toy.k",  # noqa: E731
                                                 "--tuning-db", str(root), *args])
    result = run("--after-patches", "1")
    assert result.exit_code == 0, result.output
    assert "1 difference(s)" in result.output and "seqlen_q=16 seqlen_k=16: big" in result.output
    assert "seqlen_q=32" not in result.output
    assert "0 difference(s)" in run("--after-patches", "2").output
    before = run("--after-patches", "0").output  # == --without-patches: 0002 put q16/k16 back as it was
    assert "1 difference(s)" in before and "seqlen_q=32 seqlen_k=16: small" in before
    for bad in (["--after-patches", "3"], ["--after-patches", "1", "--without-patches"],
                ["--after-patches", "1", "--against", "sm_80"], ["--after-patches", "-1"]):
        result = run(*bad)
        assert result.exit_code != 0 and "Traceback" not in result.output, (bad, result.output)


def test_the_tuning_package_imports_no_family():
    """Specs are passed down (issue 12): no module of aotattn/tuning but its command line
    (which sits above the families and hands their tables down) imports aotattn.families."""
    import ast

    for path in Path(tuning.__file__).parent.glob("*.py"):
        if path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("aotattn.families") for n in names), f"{path.name} imports {names}"


def test_a_database_knows_the_tables_it_is_given_and_learns_from_lookups(tmp_path):
    make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    bare = Database(tmp_path, {})
    with pytest.raises(TuningError, match=r"no table 'toy.k' is declared by any family \(have: \)"):
        bare.effective("sm_90", "toy.k")
    assert bare.lookup("sm_90", TOY, f(), {"seqlen_q": 20, "seqlen_k": 64}) == Config.of(BLOCK=64, num_warps=8)
    assert bare.effective("sm_90", "toy.k").blocks[f("bf16")][0] == ["small", ".", "."]  # learnt from the lookup
    # no specs given: the registry the package root handed down (every family's tables)
    assert Database(tmp_path).specs == families.tables()


def test_use_tables_names_the_default_registry(tmp_path, monkeypatch):
    import importlib

    module = importlib.import_module("aotattn.tuning.database")  # the package's `database` is the function
    monkeypatch.setattr(module, "_default_tables", module._default_tables)  # restored after the test
    tuning.use_tables(lambda: SPECS)
    make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    assert Database(tmp_path).effective("sm_90", "toy.k").configs["small"] == Config.of(BLOCK=16, num_warps=4)


def test_a_patch_may_add_a_refinement_block_that_starts_from_its_fallback(tmp_path):
    """The seeded operator table holds only roots: a patch adds a padded-head block, which
    starts as a copy of the root's grid; only its edited cells differ; lookups of the
    refinement and of refinements of it see the new block, the root is untouched."""
    import shutil

    from aotattn.families.flash import rules

    root = tmp_path / "tuning"
    shutil.copytree(Path(tuning.database().root), root, ignore=shutil.ignore_patterns("*.dbpatch"))
    base = dict(dtype="bf16", BLOCK_D=64, PAD_HEAD=False, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0,
                DETERMINISTIC=False)
    padded = {**base, "PAD_HEAD": True}
    patch = ("#! aotattn-patch 1\n#! table flash.backward\n\n[configs]\nfused = backend=fused\n\n"
             "[dtype=bf16 BLOCK_D=64 PAD_HEAD=True MASK=0 VARLEN=False DROPOUT=False BIAS=0 DETERMINISTIC=False]\n"
             "seqlen_q=512 seqlen_k=512: fused\n")
    (root / "nvidia" / "sm_90" / "flash.backward.0001-t.dbpatch").write_text(patch)
    db = Database(root)
    assert db.lint() == []

    def backend(f, s):
        return db.lookup("sm_90", rules.BACKWARD, Functional.of(f), {"seqlen_q": s, "seqlen_k": s})["backend"]

    assert backend(padded, 500) == "fused" and backend(padded, 4096) == "split"
    assert backend(base, 500) == "split"
    assert backend({**padded, "DROPOUT": True, "BIAS": 2}, 500) == "fused"  # falls back through the new block
    full = db.effective("sm_90", "flash.backward")
    assert full.blocks[Functional.of(padded)][5][6] == full.blocks[Functional.of(base)][5][6]
    # a functional outside the table's axes is still refused
    (root / "nvidia" / "sm_90" / "flash.backward.0002-bad.dbpatch").write_text(
        patch.replace("PAD_HEAD=True", "PAD_HEAD=True NOPE=1"))
    assert any("NOPE" in str(e) or "axis" in str(e) for e in Database(root).lint())


TOY_PATCH = "#! aotattn-patch 1\n#! table toy.k\n\n"


def _toy_db(tmp_path, *patches: str) -> Database:
    files = {"nvidia/sm_90/toy.k.txt": TABLE}
    files.update({f"nvidia/sm_90/toy.k.{i + 1:04d}-p.dbpatch": TOY_PATCH + text for i, text in enumerate(patches)})
    make_db(tmp_path, files)
    return Database(tmp_path, SPECS)


@pytest.mark.parametrize("order", ["refinement first", "root first", "later patch"])
def test_a_refinement_follows_its_fallbacks_final_cells_where_no_patch_set_its_own(tmp_path, order):
    """A block a patch adds for a refinement differs from its fallback only in the cells
    patches set: a later edit of the fallback (in a later patch or later in the same
    patch) moves the refinement's other cells with it, and never its own."""
    refine = "[dtype=fp16 PAD=True]\nseqlen_q=16 seqlen_k=16: big\n"
    root = "[dtype=fp16 PAD=False]\nseqlen_q=16..32 seqlen_k=32..64: big\nseqlen_q=64 seqlen_k=16: small\n"
    patches = {"refinement first": [refine + "\n" + root], "root first": [root + "\n" + refine],
               "later patch": [refine, root]}[order]
    db = _toy_db(tmp_path, *patches)
    assert db.lint() == []
    table = db.effective("sm_90", "toy.k")
    plain, padded = (table.blocks[Functional.of(dict(dtype="fp16", PAD=p))] for p in (False, True))
    assert padded[0][0] == "big" and plain[0][0] == "small"  # its own cell
    assert all(padded[r][c] == plain[r][c] for r in range(3) for c in range(3) if (r, c) != (0, 0))
    assert plain[0][1] == plain[1][2] == "big" and plain[2][0] == "small"  # the root's later edits
    f = Functional.of(dict(dtype="fp16", PAD=True))
    assert db.lookup("sm_90", TOY, f, {"seqlen_q": 20, "seqlen_k": 40})["BLOCK"] == 64
    assert db.lookup("sm_90", TOY, f, {"seqlen_q": 64, "seqlen_k": 16})["BLOCK"] == 16


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.integers(0, 2), st.sampled_from(["big", "small"])),
                      min_size=1, max_size=12),
       cuts=st.lists(st.integers(0, 12), max_size=2))
def test_any_patch_sequence_gives_a_refinement_its_fallback_overlaid_with_its_own_edits(tmp_path_factory, edits, cuts):
    """Whatever the edits and however they are split into patches: the root is its table
    block with its edits applied in order, and the refinement is the final root with the
    refinement's edits applied in order over it."""
    buckets = (16, 32, 64)
    texts = []
    for chunk in (edits[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(edits)])):
        if chunk:
            texts.append("".join(f"[dtype=fp16 PAD={pad}]\nseqlen_q={buckets[r]} seqlen_k={buckets[c]}: {name}\n\n"
                                 for pad, r, c, name in chunk))
    db = _toy_db(tmp_path_factory.mktemp("db"), *texts)
    root = [["small", "small", "big"], ["small", "small", "big"], ["big", "big", "big"]]
    for pad, r, c, name in edits:
        if not pad:
            root[r][c] = name
    refinement = [list(row) for row in root]
    for pad, r, c, name in edits:
        if pad:
            refinement[r][c] = name
    table = db.effective("sm_90", "toy.k")
    assert table.blocks[Functional.of(dict(dtype="fp16", PAD=False))] == root
    if any(pad for pad, *_ in edits):
        assert table.blocks[Functional.of(dict(dtype="fp16", PAD=True))] == refinement


def test_the_first_patches_and_squash_see_the_same_refinement_cells(tmp_path):
    """``effective(patches=n)`` resolves a refinement against the fallback after n patches,
    and a squashed table holds what the lookups saw before squashing."""
    refine = "[dtype=fp16 PAD=True]\nseqlen_q=16 seqlen_k=16: big\n"
    root = "[dtype=fp16 PAD=False]\nseqlen_q=64 seqlen_k=64: small\nseqlen_q=32 seqlen_k=32: big\n"
    db = _toy_db(tmp_path, refine, root)
    padded = Functional.of(dict(dtype="fp16", PAD=True))
    first = db.effective("sm_90", "toy.k", patches=1).blocks[padded]
    full = db.effective("sm_90", "toy.k").blocks[padded]
    assert first[1][1] == "small" and full[1][1] == "big" and first[0][0] == full[0][0] == "big"
    assert len(db.squash("sm_90", "toy.k")) == 2
    assert not list(tmp_path.glob("nvidia/sm_90/*.dbpatch"))
    assert Database(tmp_path, SPECS).effective("sm_90", "toy.k").blocks[padded] == full


def test_a_knob_with_a_default_may_be_left_out_and_is_written_without_it():
    """The forward's OVERLAP came after its tables: a configuration without it means 0, one
    that spells OVERLAP=0 is the same configuration, and the writer leaves the default out
    (tables, image keys and configuration names stay what they were)."""
    from aotattn.families.flash import rules
    from aotattn.tuning.format import format_config, parse_config

    spec = rules.ATTN_FWD
    plain = parse_config(spec, "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3", "t:1")
    spelled = parse_config(spec, "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 OVERLAP=0", "t:2")
    overlapped = parse_config(spec, "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 OVERLAP=1", "t:3")
    assert plain == spelled != overlapped
    assert format_config(spelled, spec) == "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3"
    assert format_config(overlapped, spec) == "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 OVERLAP=1"
    with pytest.raises(TuningError, match="lacks knobs num_stages"):
        parse_config(spec, "BLOCK_M=128 BLOCK_N=64 num_warps=8", "t:4")
    with pytest.raises(TuningError, match=r"t:5"):
        parse_config(spec, "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 OVERLAP=2", "t:5")
    with pytest.raises(TuningError, match="unknown tuning knob 'OVERLAP'"):
        parse_config(rules.ATTN_BWD_DQ, "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 OVERLAP=1", "t:6")


def test_set_knobs_rewrites_a_copy_and_back_byte_for_byte(tmp_path):
    """`aotattn tuning set-knobs` gives every configuration of a table and its patches the
    knob values (an A/B over a whole table); from a table whose knobs are at their defaults,
    setting the defaults again restores the files exactly; an unknown knob or value is an
    error naming the file and the configuration."""
    import shutil

    from aotattn.families.flash import rules

    root = Path(__file__).resolve().parents[2] / "tuning"
    copy = tmp_path / "tuning"
    shutil.copytree(root, copy)
    runner = CliRunner()
    # the tuned tables choose knobs per cell: first every configuration at the defaults
    result = runner.invoke(app, ["tuning", "set-knobs", "OVERLAP=0", "TMA=0", "--tuning-db", str(copy)])
    assert result.exit_code == 0, result.output
    plain = {path.name: path.read_text() for path in (copy / "nvidia/sm_90").glob("flash.attn_fwd*")}
    assert plain and not any(" TMA=" in text or " OVERLAP=" in text for text in plain.values())
    result = runner.invoke(app, ["tuning", "set-knobs", "OVERLAP=1", "TMA=1", "--tuning-db", str(copy)])
    assert result.exit_code == 0, result.output
    db = Database(copy, families.tables())
    effective = db.effective("sm_90", "flash.attn_fwd")
    assert effective.configs and all(c.as_dict().get("OVERLAP") == 1 and c.as_dict().get("TMA") == 1
                                     for c in effective.configs.values())
    assert not db.lint()
    functional = next(iter(effective.blocks))
    sizes = {"seqlen_q": 4096, "seqlen_k": 4096}
    assert db.lookup("sm_90", rules.ATTN_FWD, functional, sizes).as_dict()["TMA"] == 1
    # the other tables are untouched
    for name in ("flash.attn_bwd_dq.txt", "flash.backward.txt"):
        assert (copy / "nvidia/sm_90" / name).read_text() == (root / "nvidia/sm_90" / name).read_text()
    result = runner.invoke(app, ["tuning", "set-knobs", "OVERLAP=0", "TMA=0", "--tuning-db", str(copy)])
    assert result.exit_code == 0, result.output
    for name, text in plain.items():
        assert (copy / "nvidia/sm_90" / name).read_text() == text
    for bad, message in (("FOO=1", "unknown tuning knob 'FOO'"), ("TMA=3", "TMA: '3' is not one of 0, 1, 2"),
                         ("TMA", "expected knob=value")):
        result = runner.invoke(app, ["tuning", "set-knobs", bad, "--tuning-db", str(copy)])
        assert result.exit_code != 0 and message in str(result.output) + str(result.exception), (bad, result.output)


def test_an_axis_at_its_default_is_left_out_of_functionals_headers_and_cells():
    """flash.backward's GROUPED axis came after tables, patches and recorded perfdb cells
    were written. A functional at GROUPED=False leaves the axis out, so those stay valid and
    callers naming eight axes look up the same cell; a grouped functional names it."""
    from aotattn.families.flash import rules
    from aotattn.perfmon.provenance import cell_of, parse_cell
    from aotattn.tuning.format import format_functional, functional_key, header_key, parse_functional

    plain = "dtype=bf16 BLOCK_D=64 PAD_HEAD=False MASK=2 VARLEN=False DROPOUT=False BIAS=0 DETERMINISTIC=False"
    f = parse_functional(rules.BACKWARD, plain, "test")
    assert "GROUPED" not in f.as_dict()
    assert parse_functional(rules.BACKWARD, plain + " GROUPED=False", "test") == f  # spelled out: the same
    assert rules.BACKWARD.canonical_functional({**f.as_dict(), "GROUPED": False}) == f
    assert format_functional(rules.BACKWARD, f) == f"[{plain}]"
    assert functional_key(f) == header_key(plain) == header_key(plain + " GROUPED=False", rules.BACKWARD)
    grouped = parse_functional(rules.BACKWARD, plain + " GROUPED=True", "test")
    assert grouped.as_dict()["GROUPED"] is True
    assert format_functional(rules.BACKWARD, grouped) == f"[{plain} GROUPED=True]"
    assert functional_key(grouped) == header_key(plain + " GROUPED=True", rules.BACKWARD)
    with pytest.raises(TuningError, match="lacks axes"):
        parse_functional(rules.BACKWARD, plain.replace(" DETERMINISTIC=False", ""), "test")  # no default
    defaults = rules.BACKWARD.axis_defaults  # what `tuning show --where` and `tune plan --where` match with
    assert f.matches("GROUPED=False", defaults) and not f.matches("GROUPED=True", defaults)
    assert grouped.matches("GROUPED=True", defaults) and not grouped.matches("GROUPED=False", defaults)
    rules.BACKWARD.check_functional(f.as_dict())
    assert f in set(rules.BACKWARD.enumerate_functionals()) and grouped in set(rules.BACKWARD.enumerate_functionals())
    db = tuning.database()
    sizes = {"seqlen_q": 1000, "seqlen_k": 1000}
    full = Functional.of({**f.as_dict(), "GROUPED": False})
    assert db.lookup("sm_90", rules.BACKWARD, full, sizes) == db.lookup("sm_90", rules.BACKWARD, f, sizes)
    # a cell recorded before the axis existed is the ungrouped one's
    old = ("flash.backward[dtype=bf16,BLOCK_D=64,PAD_HEAD=False,MASK=2,VARLEN=False,DROPOUT=False,BIAS=0,"
           "DETERMINISTIC=False]@seqlen_q=1024,seqlen_k=1024")
    assert parse_cell(old).functional == f and str(parse_cell(old)) == old
    assert cell_of("sm_90", rules.BACKWARD, f, sizes) == old
    assert cell_of("sm_90", rules.BACKWARD, grouped, sizes) == old.replace("DETERMINISTIC=False]",
                                                                             "DETERMINISTIC=False,GROUPED=True]")
