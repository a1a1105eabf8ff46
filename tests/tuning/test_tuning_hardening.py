"""Hostile and careless tuning files (issue 10, items 8-11; issue 16's lint): each ends as a
clear TuningError with ``path:line``, never a MemoryError, UnicodeDecodeError or
RecursionError, and ``lint --fix`` never deletes what it does not understand."""

from __future__ import annotations

import tracemalloc

import pytest
from typer.testing import CliRunner

from aotattn import families
from aotattn.cli import app
from aotattn.spec import Config
from aotattn.tuning import Database, TuningError, parse_patch, parse_table
from aotattn.tuning.database import MAX_BASE_DEPTH
from tests.tuning.test_tuning import HEADER, SPECS, TABLE, TOY, f, make_db

PATCH_HEAD = "#! aotattn-patch 1\n#! table toy.k\n"
PATCH = PATCH_HEAD + "\n[dtype=fp16 PAD=False]\nseqlen_q=16 seqlen_k=*: big\n"


def lint_cli(root):
    return CliRunner().invoke(app, ["tuning", "lint", "--tuning-db", str(root)])


# --------------------------------------------------------------------------- item 8: run lengths


@pytest.mark.parametrize("count", [4, 100_000_000, 1_000_000_000_000, 10**400], ids=["4", "1e8", "1e12", "1e400"])
def test_a_run_longer_than_the_row_is_refused_before_it_is_expanded(count):
    text = TABLE.replace("seqlen_q=64: big*3", f"seqlen_q=64: big*{count}")
    tracemalloc.start()
    try:
        with pytest.raises(TuningError) as info:
            parse_table(TOY, text, "t.txt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.where == "t.txt:13" and "expected 3 cells" in str(info.value)
    assert peak < 1 << 20, f"{peak / 2**20:.0f} MiB to refuse one row"


def test_runs_that_together_overflow_the_row_are_refused():
    text = TABLE.replace("seqlen_q=64: big*3", "seqlen_q=64: big*2 small*99999999999")
    with pytest.raises(TuningError, match="expected 3 cells"):
        parse_table(TOY, text, "t.txt")


# --------------------------------------------------------------------------- item 9: UTF-8


def test_a_file_that_is_not_utf8_is_reported_with_path_and_line(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "tables", lambda: SPECS)
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    path = tmp_path / "nvidia/sm_90/toy.k.txt"
    path.write_bytes(TABLE.replace("# a comment", "# caf\xe9 comment").encode("latin-1"))
    with pytest.raises(TuningError, match="UTF-8") as info:
        db.lookup("sm_90", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16})
    assert info.value.where == f"{path}:1"
    assert [p.where for p in Database(tmp_path, SPECS).lint()] == [f"{path}:1"]
    runner = CliRunner()
    for args in (["tuning", "lint"], ["tuning", "show", "--arch", "sm_90", "--table", "toy.k"]):
        result = runner.invoke(app, args + ["--tuning-db", str(tmp_path)])
        assert result.exit_code == 1 and f"{path}:1" in result.output and "UTF-8" in result.output, result.output
        assert isinstance(result.exception, SystemExit)


def test_a_patch_that_is_not_utf8_is_reported_with_its_line(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    patch = tmp_path / "nvidia/sm_90/toy.k.0001-x.dbpatch"
    patch.write_bytes(PATCH.replace("[dtype", "# \xff\n[dtype").encode("latin-1"))
    with pytest.raises(TuningError, match="UTF-8") as info:
        db.effective("sm_90", "toy.k")
    assert info.value.where == f"{patch}:4"


# --------------------------------------------------------------------------- item 10: directives


def test_an_unknown_directive_is_an_error_naming_the_likely_one():
    text = TABLE.replace("#! arch sm_90\n", "#! arch sm_90\n#! bsae sm_80\n")
    with pytest.raises(TuningError, match=r"unknown directive '#! bsae'.*did you mean 'base'") as info:
        parse_table(TOY, text, "t.txt")
    assert info.value.where == "t.txt:5"


def test_a_directive_after_the_header_is_an_error():
    text = TABLE.replace("[dtype=bf16 PAD=False]", "#! base sm_80\n[dtype=bf16 PAD=False]")
    with pytest.raises(TuningError, match="directive") as info:
        parse_table(TOY, text, "t.txt")
    assert info.value.where == "t.txt:15"


def test_an_empty_directive_is_an_error():
    text = TABLE.replace("#! arch sm_90\n", "#! arch sm_90\n#! base\n")
    with pytest.raises(TuningError, match="base") as info:
        parse_table(TOY, text, "t.txt")
    assert info.value.where == "t.txt:5"


def test_base_inside_a_patch_is_an_error():
    with pytest.raises(TuningError, match="#! base") as info:
        parse_patch(TOY, PATCH.replace("#! table toy.k\n", "#! table toy.k\n#! base sm_80\n"), "p.dbpatch")
    assert info.value.where == "p.dbpatch:3"


def test_an_arch_directive_must_name_its_folder(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_80/toy.k.txt": TABLE.replace("#! arch sm_90", "#! arch gfx942")})
    with pytest.raises(TuningError, match="gfx942.*sm_80") as info:
        db.effective("sm_80", "toy.k")
    assert info.value.where.endswith("sm_80/toy.k.txt:4")
    assert any("gfx942" in str(p) for p in db.lint())


def test_lint_fix_never_deletes_what_it_does_not_understand(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "tables", lambda: SPECS)
    typo = TABLE.replace("#! arch sm_90\n", "#! arch sm_90\n#! bsae sm_80\n").replace("small*2 big", "small small big")
    commented = TABLE.replace("[dtype=bf16 PAD=False]", "# why bf16 differs\n[dtype=bf16 PAD=False]").replace(
        "big*3\n", "big big big\n", 1)
    uncanonical = TABLE.replace("small*2 big", "small small big")
    make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": typo, "nvidia/sm_80/toy.k.txt": commented.replace("sm_90", "sm_80"),
                       "nvidia/sm_86/toy.k.txt": uncanonical.replace("sm_90", "sm_86")})
    before = {p: p.read_text() for p in tmp_path.rglob("*.txt")}
    result = CliRunner().invoke(app, ["tuning", "lint", "--fix", "--tuning-db", str(tmp_path)])
    assert result.exit_code == 1
    after = {p: p.read_text() for p in tmp_path.rglob("*.txt")}
    sm90, sm80, sm86 = (tmp_path / f"nvidia/{a}/toy.k.txt" for a in ("sm_90", "sm_80", "sm_86"))
    assert after[sm90] == before[sm90] and after[sm80] == before[sm80]  # not understood: untouched
    assert after[sm86] == TABLE.replace("sm_90", "sm_86")  # understood: made canonical
    assert "unknown directive '#! bsae'" in result.output
    assert "# why bf16 differs" in after[sm80] and "drop the comment" in result.output, result.output


def test_lint_fix_keeps_a_body_comment_that_repeats_a_header_one(tmp_path, monkeypatch):
    """The lost-comment check compared texts as sets: a body comment with the text of a
    header comment looked kept, and --fix dropped it. Each occurrence counts now."""
    monkeypatch.setattr(families, "tables", lambda: SPECS)
    header_comment = TABLE.splitlines()[0]
    repeated = TABLE.replace("[dtype=bf16 PAD=False]", f"{header_comment}\n[dtype=bf16 PAD=False]")
    make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": repeated})
    path = tmp_path / "nvidia/sm_90/toy.k.txt"
    line = repeated.splitlines().index("[dtype=bf16 PAD=False]")  # the comment's line number (1-based)
    result = CliRunner().invoke(app, ["tuning", "lint", "--fix", "--tuning-db", str(tmp_path)])
    assert result.exit_code == 1 and f"drop the comment on line(s) {line}:" in result.output, result.output
    assert path.read_text() == repeated


# --------------------------------------------------------------------------- item 11: base depth


def test_a_long_base_chain_ends_in_a_clear_error(tmp_path):
    files = {f"nvidia/a{i}/toy.k.txt": HEADER.format(arch=f"a{i}", base=f"#! base a{i + 1}\n") for i in range(1000)}
    files["nvidia/a1000/toy.k.txt"] = TABLE.replace("sm_90", "a1000")
    db = make_db(tmp_path, files)
    with pytest.raises(TuningError, match=rf"#! base chain deeper than {MAX_BASE_DEPTH}") as info:
        db.effective("a0", "toy.k")
    assert "a0 -> a1 -> " in str(info.value) and "\n" not in str(info.value)
    shallow = f"a{1000 - MAX_BASE_DEPTH}"
    assert db.lookup(shallow, TOY, f(), {"seqlen_q": 64, "seqlen_k": 64})["BLOCK"] == 64


# --------------------------------------------------------------------------- lint (issue 16)


def test_lint_reports_every_error_of_a_file(tmp_path):
    broken = (TABLE.replace("big = BLOCK=64", "big = BLOCK=48\nbig2 = BLOK=64")
              .replace("small*2 big", "small*2 huge").replace("[dtype=bf16 PAD=False]", "[dtype=bf16 PAD=Nope]"))
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": broken})
    where = [p.where.rsplit(":", 1)[1] for p in db.lint()]
    assert where == ["8", "9", "13", "16"], [str(p) for p in db.lint()]


def test_lint_reports_a_bad_directive_and_the_errors_below_it(tmp_path):
    # a typo in the header must not hide the body's errors (nor one directive error the others)
    broken = (TABLE.replace("#! arch sm_90\n", "#! arch sm_90\n#! bsae sm_80\n#! base\n")
              .replace("seqlen_q=64: big*3", "seqlen_q=64: big*100000000"))
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": broken})
    problems = db.lint()
    assert [p.where.rsplit(":", 1)[1] for p in problems] == ["5", "6", "15"], [str(p) for p in problems]
    assert "did you mean 'base'" in str(problems[0]) and "expected 3 cells" in str(problems[2])
    with pytest.raises(TuningError, match="unknown directive '#! bsae'"):  # a lookup still refuses at once
        parse_table(TOY, broken, "t.txt")


def test_lint_names_each_problem_once_with_the_archs_it_affects(tmp_path):
    derived = HEADER.format(arch="sm_80", base="#! base sm_90\n")
    patch_of_absent = PATCH.replace("dtype=fp16", "dtype=bf16").replace("seqlen_q=16", "seqlen_q=32")
    only_fp16 = TABLE.split("\n[dtype=bf16")[0].replace("small*2 big", "small*2 huge")
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": only_fp16, "nvidia/sm_80/toy.k.txt": derived,
                            "nvidia/sm_90/toy.k.0001-x.dbpatch": patch_of_absent,
                            "nvidia/sm_86/toy.k.txt": TABLE.replace("sm_90", "sm_86")})
    problems = db.lint()
    assert len(problems) == 1, [str(p) for p in problems]
    assert problems[0].archs == ("sm_80", "sm_90") and "unknown configuration 'huge'" in str(problems[0])
    (tmp_path / "nvidia/sm_90/toy.k.txt").write_text(only_fp16.replace("huge", "big"))
    problems = Database(tmp_path, SPECS).lint()
    assert len(problems) == 1 and problems[0].archs == ("sm_80", "sm_90")
    assert "edits a functional the table does not have" in str(problems[0])


def test_lint_of_a_missing_or_empty_database_is_an_error(tmp_path):
    with pytest.raises(TuningError, match="no tuning database"):
        Database(tmp_path / "nowhere", SPECS).lint()
    with pytest.raises(TuningError, match="no tables"):
        Database(tmp_path, SPECS).lint()
    (tmp_path / "nvidia/sm_90").mkdir(parents=True)
    with pytest.raises(TuningError, match="no tables"):
        Database(tmp_path, SPECS).lint()


def test_lint_refuses_a_table_no_family_declares(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_90/toy.zz.txt": TABLE})
    problems = db.lint()
    assert len(problems) == 1 and "toy.zz" in str(problems[0]) and "toy.k" in str(problems[0])


def test_lint_reports_every_bad_edit_of_a_patch(tmp_path):
    two = PATCH + "seqlen_q=32 seqlen_k=*: nosuch1\nseqlen_q=64 seqlen_k=16: nosuch2\n"
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_90/toy.k.0001-x.dbpatch": two})
    problems = db.lint()
    assert [p.where.rsplit(":", 1)[1] for p in problems] == ["6", "7"], [str(p) for p in problems]
    assert "nosuch1" in str(problems[0]) and "nosuch2" in str(problems[1])
    with pytest.raises(TuningError, match="nosuch1"):  # a lookup still stops at the first
        db.lookup("sm_90", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16})


def test_a_knob_given_twice_is_an_error_in_tables_and_patches(tmp_path):
    twice = "#! aotattn-patch 1\n#! table toy.k\n\n[configs]\nwz = BLOCK=16 num_warps=8 num_warps=4\n"
    with pytest.raises(TuningError, match="knob num_warps given twice") as info:
        parse_patch(TOY, twice, "p.dbpatch")
    assert info.value.where == "p.dbpatch:5"
    with pytest.raises(TuningError, match="knob BLOCK given twice"):
        parse_table(TOY, TABLE.replace("big = BLOCK=64", "big = BLOCK=64 BLOCK=16"), "t.txt")


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0c", "\x1c", "\x0b", "\r"])
def test_only_a_newline_ends_a_line(tmp_path, separator):
    """Python's splitlines also splits at these; inside a comment they must not make the
    rest of it a live edit, a directive or a config (a lone \\r included)."""
    hidden = PATCH + f"# was big{separator}seqlen_q=16 seqlen_k=*: small\n"
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_90/toy.k.0001-x.dbpatch": hidden})
    assert db.lint() == []
    assert db.lookup("sm_90", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16})["BLOCK"] == 64  # the patch's big
    commented = TABLE.replace("# a comment that survives round trips", f"# a comment{separator}#! base sm_80")
    assert parse_table(TOY, commented, "t.txt").base is None


def test_crlf_line_ends_read_as_newlines(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    (tmp_path / "nvidia/sm_90/toy.k.txt").write_bytes(TABLE.replace("\n", "\r\n").encode())
    assert db.lookup("sm_90", TOY, f(), {"seqlen_q": 64, "seqlen_k": 64})["BLOCK"] == 64


def test_an_architecture_under_two_vendors_is_an_error(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "zzz/sm_90/toy.k.txt": "garbage\n"})
    with pytest.raises(TuningError, match="sm_90 is in two vendor folders, nvidia/ and zzz/"):
        db.lint()
    with pytest.raises(TuningError, match="two vendor folders"):
        db.lookup("sm_90", TOY, f(), {"seqlen_q": 64, "seqlen_k": 64})
    assert lint_cli(tmp_path).exit_code == 1


def test_a_folder_named_like_a_table_or_patch_is_reported_not_a_crash(tmp_path):
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    (tmp_path / "nvidia/sm_90/toy.k.0002-x.dbpatch").mkdir()
    (tmp_path / "nvidia/sm_80/toy.k.txt").mkdir(parents=True)
    problems = [str(p) for p in db.lint()]
    assert any("sm_80/toy.k.txt" in p and "a folder" in p for p in problems), problems
    assert any("0002-x.dbpatch" in p and "folder" in p for p in problems), problems
    with pytest.raises(TuningError, match="a folder named like a patch"):
        db.lookup("sm_90", TOY, f(), {"seqlen_q": 64, "seqlen_k": 64})
    result = lint_cli(tmp_path)
    assert result.exit_code == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_show_refuses_a_limit_below_one(limit):
    result = CliRunner().invoke(app, ["tuning", "show", "--limit", limit, "--where", "dtype=bf16 BLOCK_D=128"])
    assert result.exit_code == 2 and "--limit" in result.output and "more" not in result.output


def test_lint_fix_writes_utf8_whatever_the_locale(tmp_path):
    """Tables are UTF-8 and are read as such; ``--fix`` (and squash, set-knobs) wrote them in
    the locale's encoding: under LC_ALL=C a comment's 'é' failed the rewrite with a codec
    error and left an empty ``.tmp`` beside the table, which lint then reported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    project = Path(__file__).resolve().parents[2]
    table = tmp_path / "nvidia/sm_90/flash.philox_words.txt"
    table.parent.mkdir(parents=True)
    canonical = "# réglé à la main\n" + (project / "tuning/nvidia/sm_90/flash.philox_words.txt").read_text("utf-8")
    table.write_bytes(canonical.replace("\n[configs]\n", "\n\n[configs]\n").encode())  # not canonical
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0",
           "PYTHONPATH": str(project)}
    done = subprocess.run([sys.executable, "-c", "from aotattn.cli import app; app()", "tuning", "lint", "--fix",
                           "--tuning-db", str(tmp_path)], env=env, cwd=project, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert table.read_bytes() == canonical.encode("utf-8")
    assert [p.name for p in table.parent.iterdir()] == [table.name]


def test_a_base_without_the_table_is_an_error_at_the_base_line(tmp_path):
    """The docs: a base that does not exist is an error pointing at the ``#! base`` line.
    A base architecture that exists but lacks the table was reported as a missing file of
    that architecture, naming neither the table that asked for it nor the line."""
    db = make_db(tmp_path, {"nvidia/sm_86/toy.k.txt": HEADER.format(arch="sm_86", base="#! base sm_80\n")})
    (tmp_path / "nvidia/sm_80").mkdir()  # the architecture, without this table
    with pytest.raises(TuningError, match=r"#! base sm_80: sm_80 has no toy.k table") as info:
        db.effective("sm_86", "toy.k")
    assert info.value.where == f"{tmp_path / 'nvidia/sm_86/toy.k.txt'}:4"
    assert [p.where for p in Database(tmp_path, SPECS).lint()] == [info.value.where]


def test_a_byte_order_mark_is_named_not_read_as_a_missing_header(tmp_path):
    """An editor's BOM (invisible) made the first line something else: the error said the
    '#! aotattn-tuning 1' line that is plainly there was missing."""
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE})
    path = tmp_path / "nvidia/sm_90/toy.k.txt"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    with pytest.raises(TuningError, match="byte-order mark.*save it as UTF-8 without one") as info:
        db.lookup("sm_90", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16})
    assert info.value.where == f"{path}:1"
    assert [str(p) for p in Database(tmp_path, SPECS).lint()] == [str(info.value)]


def test_a_tab_after_a_directive_separates_it_from_its_value():
    text = TABLE.replace("#! table toy.k", "#! table\ttoy.k").replace("#! arch sm_90", "#!\tarch \t sm_90")
    assert parse_table(TOY, text, "t.txt").blocks == parse_table(TOY, TABLE, "t.txt").blocks


def test_a_patch_cannot_redefine_a_configuration_the_table_names(tmp_path, monkeypatch):
    """A patch adds configurations and sets cells: one redefining ``big`` (knobs other than
    the table's) silently moved every cell naming it, and lint passed. Now an error at the
    definition's line; the same knobs under the same name stay allowed (a tuner's patch
    names a configuration by its knobs)."""
    monkeypatch.setattr(families, "tables", lambda: SPECS)
    same = "#! aotattn-patch 1\n#! table toy.k\n\n[configs]\nbig = BLOCK=64 num_warps=8\n\n[dtype=fp16 PAD=False]\n" \
           "seqlen_q=16 seqlen_k=16: big\n"
    other = same.replace("big = BLOCK=64 num_warps=8", "big = BLOCK=16 num_warps=4")
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_90/toy.k.0001-same.dbpatch": same})
    assert db.lint() == []
    assert dict(db.lookup("sm_90", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16}).items) == {"BLOCK": 64, "num_warps": 8}
    patch = tmp_path / "nvidia/sm_90/toy.k.0002-other.dbpatch"
    patch.write_text(other)
    db = Database(tmp_path, SPECS)
    (problem,) = db.lint()
    assert problem.where == f"{patch}:5" and "configuration 'big' is already defined with other knobs" in str(problem)
    with pytest.raises(TuningError, match="'big' is already defined"):
        db.lookup("sm_90", TOY, f(), {"seqlen_q": 64, "seqlen_k": 64})
    assert lint_cli(tmp_path).exit_code == 1


@pytest.mark.parametrize("separator", [" ", "\t", " \t "])
def test_lint_reads_a_base_separated_by_a_tab_as_the_parser_does(tmp_path, separator):
    """The parser splits '#! base<TAB>sm_90' like '#! base sm_90'; lint's helpers matched
    only one space, so the archs a problem affects and the base line were wrong."""
    derived = HEADER.format(arch="sm_80", base=f"#! base{separator}sm_90\n")
    uncanonical = TABLE.replace("small*2 big", "small small big")  # a problem of the file, not of a lookup
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": uncanonical, "nvidia/sm_80/toy.k.txt": derived})
    problems = db.lint()
    (problem,) = [p for p in problems if p.where == str(tmp_path / "nvidia/sm_90/toy.k.txt")]
    assert "not in canonical form" in str(problem) and problem.archs == ("sm_80", "sm_90")
    assert len(problems) == 1 + (separator != " ")  # --fix writes the tab as a space
    cyclic_text = TABLE.replace("#! keys", f"#! base{separator}sm_80\n#! keys")
    cyclic = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": cyclic_text})
    with pytest.raises(TuningError, match="#! base cycle") as info:
        cyclic.lookup("sm_80", TOY, f(), {"seqlen_q": 16, "seqlen_k": 16})
    base_line = 1 + next(n for n, line in enumerate(cyclic_text.splitlines()) if line.startswith("#! base"))
    assert info.value.where.endswith(f":{base_line}")


def test_lint_reports_a_table_outside_an_architecture_folder(tmp_path):
    """tuning/nvidia/toy.k.txt (an architecture folder forgotten) was never read and lint
    said nothing; other files (a README) stay allowed."""
    make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/toy.k.txt": TABLE, "toy.k.0001-x.dbpatch": PATCH,
                       "nvidia/README.md": "notes\n"})
    problems = Database(tmp_path, SPECS).lint()
    assert sorted(p.where for p in problems) == [str(tmp_path / "nvidia/toy.k.txt"), str(tmp_path / "toy.k.0001-x.dbpatch")]
    assert all("outside an architecture folder is never read" in str(p) for p in problems)
    assert lint_cli(tmp_path).exit_code == 1


@pytest.mark.parametrize("header", ["[dtype=fp16 PAD=True]  # hand-picked", "[dtype=fp16 PAD=True", "[dtype=fp16 PAD=True]]"])
@pytest.mark.parametrize("where", ["table", "patch"])
def test_a_malformed_header_is_an_error_not_a_silent_fallback(tmp_path, header, where):
    """A lookup parses only its own blocks; a header it could not match (a comment after
    its "]", a bracket missing or doubled) was skipped, and the call ran its fallback's
    configuration (``PAD=False``'s) with lint the only one to say so."""
    pad_block = f"\n{header}\nseqlen_q=16..64: small*3\n"
    files = {"nvidia/sm_90/toy.k.txt": TABLE + (pad_block if where == "table" else "")}
    if where == "patch":
        files["nvidia/sm_90/toy.k.0001-hand.dbpatch"] = PATCH_HEAD + pad_block
    db = make_db(tmp_path, files)
    with pytest.raises(TuningError, match=r"toy\.k\.(txt|0001-hand\.dbpatch):[0-9]+: (unclosed section header|PAD: 'True\]')"):
        db.lookup("sm_90", TOY, f(pad=True), {"seqlen_q": 64, "seqlen_k": 64})
    assert len(db.lint()) == 1


def test_a_refused_configuration_name_is_one_problem_not_one_per_use(tmp_path):
    table = TABLE.replace("big = BLOCK=64 num_warps=8", "1big = BLOCK=64 num_warps=8").replace("big", "1big") \
        .replace("11big", "1big")
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": table})
    problems = db.lint()
    assert len(problems) == 1 and "expected 'name = knob=value ...'" in str(problems[0])


def test_a_derived_table_fills_a_refinement_its_base_patched_from_its_own_blocks(tmp_path):
    """sm_90's patch sets one cell of a PAD=True block (which its table lacks); sm_80 is
    based on sm_90 with its own PAD=False root. sm_80's PAD=True cells the patch did not set
    follow sm_80's root, not sm_90's (they took sm_90's tiles, all of them, before)."""
    base = HEADER.format(arch="sm_90", base="") + "\n[configs]\nbig = BLOCK=64 num_warps=8\n\n" \
        "[dtype=fp16 PAD=False]\nseqlen_q=16..64: big*3\n"
    derived = HEADER.format(arch="sm_80", base="#! base sm_90\n") + "\n[configs]\nsmall = BLOCK=16 num_warps=4\n\n" \
        "[dtype=fp16 PAD=False]\nseqlen_q=16..64: small*3\n"
    patch = PATCH_HEAD + "\n[configs]\nmid = BLOCK=32 num_warps=4\n\n[dtype=fp16 PAD=True]\nseqlen_q=64 seqlen_k=64: mid\n"
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": base, "nvidia/sm_80/toy.k.txt": derived,
                            "nvidia/sm_90/toy.k.0001-pad.dbpatch": patch})
    big, small, mid = (Config.of(c) for c in ({"BLOCK": 64, "num_warps": 8}, {"BLOCK": 16, "num_warps": 4},
                                              {"BLOCK": 32, "num_warps": 4}))
    for arch, other in (("sm_90", big), ("sm_80", small)):
        assert db.lookup(arch, TOY, f(pad=True), {"seqlen_q": 64, "seqlen_k": 64}) == mid
        for sq, sk in ((16, 16), (64, 16), (32, 64)):
            assert db.lookup(arch, TOY, f(pad=True), {"seqlen_q": sq, "seqlen_k": sk}) == other, (arch, sq, sk)
        assert db.lookup(arch, TOY, f(), {"seqlen_q": 64, "seqlen_k": 64}) == other
    assert not db.lint()


def test_set_knobs_refuses_a_table_with_a_base(tmp_path):
    derived = HEADER.format(arch="sm_80", base="#! base sm_90\n") + "\n[configs]\nsmall = BLOCK=16 num_warps=4\n\n" \
        "[dtype=fp16 PAD=False]\nseqlen_q=16..64: small*3\n"
    db = make_db(tmp_path, {"nvidia/sm_90/toy.k.txt": TABLE, "nvidia/sm_80/toy.k.txt": derived})
    before = (tmp_path / "nvidia/sm_80/toy.k.txt").read_text()
    with pytest.raises(TuningError, match="takes its other cells from sm_90"):
        db.set_knobs("sm_80", "toy.k", {"num_warps": "8"})
    assert (tmp_path / "nvidia/sm_80/toy.k.txt").read_text() == before
    assert db.set_knobs("sm_90", "toy.k", {"num_warps": "8"})
    assert {c.as_dict()["num_warps"] for c in db.effective("sm_80", "toy.k").configs.values()} == {4, 8}
    assert db.lookup("sm_80", TOY, f("bf16"), {"seqlen_q": 64, "seqlen_k": 64}).as_dict()["num_warps"] == 8
