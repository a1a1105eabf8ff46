"""The perfdb file: canonical text, round trip, refusals with path:line, tags, tuning revision."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from aotattn.perfmon import perfdb as store
from aotattn.perfmon.entries import declared
from aotattn.perfmon.perfdb import Perfdb, PerfdbError, Record

PROJECT_TUNING = Path(__file__).resolve().parents[2] / "tuning"


def random_run(seed: int, n: int = 12) -> Perfdb:
    """A run over ``n`` declared entries with random figures, a skipped peer and a failed one."""
    rng = random.Random(seed)
    db = Perfdb(header={"tag": f"t{seed}", "arch": "sm_90", "gpu": "NVIDIA H200, sm_90, 132 SMs",
                        "date": "2026-11-30T00:00:00+00:00", "tuning": "sha256:0123 (sm_90 under tuning/)"})
    for entry in rng.sample(declared(), n):
        records = []
        for pass_ in entry.passes:
            ours = rng.uniform(0.01, 50)
            for provider in ("aotattn", "aotattn:split", "aotattn:fused", "sdpa-flash", "flex"):
                if provider == "flex":
                    records.append(Record(entry.name, pass_, provider, note="skipped: not asked (compiles per shape)"))
                    continue
                ms = ours if provider == "aotattn" else ours * rng.uniform(0.5, 2)
                note = "choice=split cell=flash.backward[dtype=bf16,BLOCK_D=128,PAD_HEAD=False,MASK=0,VARLEN=False,DROPOUT=False,BIAS=0,DETERMINISTIC=False]" \
                       "@seqlen_q=4096,seqlen_k=4096" if provider == "aotattn" and pass_ != "fwd" else ""
                records.append(Record(entry.name, pass_, provider, ms, ms * rng.uniform(0, 0.05),
                                      entry.flops(pass_) / ms / 1e9, ms / ours, note))
        db.add(entry, records)
    return db


def _rounded(db: Perfdb) -> list[tuple]:
    return [(r.entry, r.pass_, r.provider, r.note) for r in db.records]


def test_round_trip_is_canonical(tmp_path):
    for seed in range(3):
        db = random_run(seed)
        text = db.to_text()
        again = Perfdb.from_text(text)
        assert again.to_text() == text  # parse(write(x)) writes the same bytes
        assert again.header == db.header and again.entries == db.entries
        assert sorted(_rounded(again)) == sorted(_rounded(db))
        for a, b in zip(sorted(again.records, key=lambda r: r.key), sorted(db.records, key=lambda r: r.key)):
            assert a.key == b.key and (a.ms is None) == (b.ms is None)
            if a.ms is not None:  # four significant digits in the file
                assert a.ms == pytest.approx(b.ms, rel=1e-3) and a.tflops == pytest.approx(b.tflops, rel=1e-3)
        path = db.write(tmp_path / "sm_90" / f"t{seed}.txt")
        assert Perfdb.read(path).to_text() == text
        assert not list(tmp_path.rglob("*.tmp"))


def test_one_line_per_entry_pass_and_provider():
    db = random_run(4, n=5)
    lines = db.to_text().split("[results]\n", 1)[1].splitlines()[1:]
    assert len(lines) == len(db.records) == len({r.key for r in db.records})
    for line in lines:
        name, pass_, provider = line.split()[:3]
        assert name in db.entries and pass_ in db.entries[name].passes


@pytest.mark.parametrize("mutate, message, line", [
    (lambda t: t.replace("#! aotattn-perfdb 1", "#! aotattn-perfdb 9"), "first line", 1),
    (lambda t: t.replace("[results]\n", "[results]\nghost fwd aotattn 1 1 1 1\n"), "undeclared entry", None),
    (lambda t: t + t.split("[results]\n", 1)[1].splitlines()[1] + "\n", "two results", None),
    (lambda t: t.replace("skipped: not asked", "x").replace(" -          -", " abc        -", 1), "ms", None),
    (lambda t: t.replace("[results]\n", "[results]\n" + t.split("[entries]\n")[1].split()[0] + " fwd zeroed 0 1 1 1\n"),
     "ms: expected a finite positive number, got '0'", None),
    (lambda t: t.replace("[entries]\n", "[entries]\nbroken group=dense dtype=bf16\n"), "missing fields B, Hq", 9),
    (lambda t: t.replace("[entries]\n", "[entries]\nbroken group=dense dtype=bf17 B=1 Hq=1 Hk=1 Sq=1 Sk=1 D=1 Dv=1\n"),
     "dtype 'bf17'", 9),
    (lambda t: t.replace("[entries]", "[stuff]"), "expected \\[entries\\]", None),
    (lambda t: t.replace("[results]\n", "[results]\n" + t.split("[entries]\n")[1].split()[0] + " fwdd aotattn 1 1 1 1\n"),
     "pass 'fwdd': entry .* declares passes", None),
    # the header: a typo, a bare "#!" and a repeated directive (the later date won: `standing` orders runs by it)
    (lambda t: t.replace("#! tag ", "#! tga ", 1), "unknown directive '#! tga'", 2),
    (lambda t: t.replace("#! arch", "#!\n#! arch", 1), "unknown directive '#!'", 3),
    (lambda t: t.replace("#! arch", "#! date 1999-01-01T00:00:00+00:00\n#! arch", 1), "'#! date' given twice", None),
    # sections: one [entries] then one [results], which a file cut short lacks
    (lambda t: t.split("\n[results]")[0] + "\n", "no \\[results\\] section: the file is cut short", None),
    (lambda t: t.replace("[results]\n", "[results]\n[entries]\n"), "\\[entries\\] again", None),
    # a run without its [entries] section read as a run of no entries (compare then passed on it)
    (lambda t: t.split("\n\n[entries]")[0] + "\n\n[results]\n", "\\[results\\] before \\[entries\\]", 8),
    # a directive without a value: an empty arch was checked against the folder as "" ("move it to /")
    (lambda t: t.replace("#! arch sm_90", "#! arch"), "directive '#! arch' has no value", 3),
    (lambda t: t.replace("#! gpu NVIDIA", "#! gpu  \n#! x NVIDIA"), "directive '#! gpu' has no value", 5),
    # an entry line whose name holds a tab (a token of its own for the result lines)
    (lambda t: t.replace("[entries]\n", "[entries]\nbad\tname group=dense dtype=bf16 B=1 Hq=1 Hk=1 Sq=1 Sk=1 D=1 "
                         "Dv=1\n"),
     "entry name 'bad\\\\tname'", 9),
    # numbers: float() reads "1_5" as 15; a spread without a time
    (lambda t: t.replace("[results]\n", "[results]\n" + t.split("[entries]\n")[1].split()[0] + " fwd odd 1_5 1 1 1\n"),
     "ms: expected a number or '-', got '1_5'", None),
    (lambda t: t.replace("[results]\n", "[results]\n" + t.split("[entries]\n")[1].split()[0] + " fwd odd - 3 - -\n"),
     "spread%: expected '-' where ms is '-'", None),
])
def test_malformed_files_are_refused_with_their_line(mutate, message, line):
    text = random_run(5, n=3).to_text()
    with pytest.raises(PerfdbError, match=message) as info:
        Perfdb.from_text(mutate(text), "runs/x.txt")
    assert info.value.where.startswith("runs/x.txt:")
    if line is not None:
        assert info.value.where == f"runs/x.txt:{line}"


def test_a_run_stored_under_another_architecture_is_refused(tmp_path):
    """perfdb/<arch>/<tag>.txt: a file whose '#! arch' names another folder's architecture
    would be counted as that folder's run; a file outside the store's folders is read as is."""
    text = random_run(2, n=2).to_text()
    misplaced = tmp_path / "sm_80" / "t2.txt"
    misplaced.parent.mkdir()
    misplaced.write_text(text)
    with pytest.raises(PerfdbError, match="'#! arch sm_90' in folder sm_80/.*move it to sm_90/") as info:
        Perfdb.read(misplaced)
    assert info.value.where == f"{misplaced}:3"
    elsewhere = tmp_path / "out" / "t2.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_text(text)
    assert Perfdb.read(elsewhere).to_text() == text


def test_tags_and_where_files_live(tmp_path):
    for bad in ("", "-x", "a b", "../up", "x/y"):
        with pytest.raises(PerfdbError, match="tag"):
            store.check_tag(bad)
    assert store.path_for("h200", "sm_90", tmp_path) == tmp_path / "sm_90" / "h200.txt"
    random_run(1, 2).write(tmp_path / "sm_90" / "h200.txt")
    assert store.resolve("h200", base=tmp_path) == tmp_path / "sm_90" / "h200.txt"
    with pytest.raises(PerfdbError, match="no perfdb tag"):
        store.resolve("other", base=tmp_path)
    other = random_run(1, 2)
    other.header["arch"] = "sm_80"  # a run is stored under its own architecture
    other.write(tmp_path / "sm_80" / "h200.txt")
    with pytest.raises(PerfdbError, match="--arch"):
        store.resolve("h200", base=tmp_path)
    assert store.resolve("h200", "sm_80", tmp_path) == tmp_path / "sm_80" / "h200.txt"
    with pytest.raises(PerfdbError, match="aotattn perfmon run --tag nothing"):
        Perfdb.read(tmp_path / "sm_90" / "nothing.txt")


def test_tuning_revision_follows_the_tables_and_their_bases(tmp_path):
    root = tmp_path / "tuning"
    shutil.copytree(PROJECT_TUNING, root)
    before = store.tuning_revision(root, "sm_90")
    assert before.startswith("sha256:") and store.tuning_revision(root, "sm_90") == before
    patch = root / "nvidia" / "sm_90" / "flash.backward.0001-x.dbpatch"
    patch.write_text("#! aotattn-patch 1\n#! table flash.backward\n")
    after = store.tuning_revision(root, "sm_90")
    patches_before = int(before.split(", ")[1].split()[0])
    assert after != before and f"{patches_before + 1} patches" in after
    assert store.tuning_revision(root, "sm_99").startswith("none")
    # a base architecture's tables are part of the revision; unrelated ones are not
    for arch, text in (("sm_90", "#! base sm_80\n"), ("sm_80", "x\n"), ("sm_86", "y\n")):
        (tmp_path / "db" / "nvidia" / arch).mkdir(parents=True)
        (tmp_path / "db" / "nvidia" / arch / "f.t.txt").write_text(text)
    first = store.tuning_revision(tmp_path / "db", "sm_90")
    assert "sm_90, sm_80" in first
    (tmp_path / "db" / "nvidia" / "sm_86" / "f.t.txt").write_text("changed\n")
    assert store.tuning_revision(tmp_path / "db", "sm_90") == first
    (tmp_path / "db" / "nvidia" / "sm_80" / "f.t.txt").write_text("changed\n")
    assert store.tuning_revision(tmp_path / "db", "sm_90") != first


@pytest.mark.parametrize("field, message", [("Hk=1", "sizes must be positive"), ("window=", "two sides")])
def test_declarations_that_would_crash_later_are_refused_at_their_line(field, message):
    text = random_run(5, n=1).to_text()
    name = text.split("[entries]\n")[1].split()[0]
    line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
    import re

    if field == "Hk=1":
        bad = re.sub(r" Hk=\d+ ", " Hk=0 ", line)
    else:
        bad = re.sub(r" window=\S+", "", line) + " window=5"
    with pytest.raises(PerfdbError, match=message):
        Perfdb.from_text(text.replace(line, bad), "runs/x.txt")


def test_a_file_that_is_not_text_names_itself_and_the_fix(tmp_path):
    path = random_run(6, n=2).write(tmp_path / "sm_90" / "t6.txt")
    path.write_bytes(path.read_bytes().replace(b"[results]", b"[res\xff\xfeults]"))
    with pytest.raises(PerfdbError, match="not UTF-8 text .*restore it from git") as info:
        Perfdb.read(path)
    assert str(path) in str(info.value)


def test_a_run_is_not_written_into_another_architectures_folder(tmp_path):
    """`perfmon run --out .../sm_90/x.txt` of a CPU run wrote a file every perfdb command
    refused (the folder rule); now refused before any entry is measured."""
    from typer.testing import CliRunner

    from aotattn.cli import app

    out = tmp_path / "sm_90" / "z.txt"
    result = CliRunner().invoke(app, ["perfmon", "run", "--tag", "z", "-m", "train-tiny-sdpa", "--device", "cpu",
                                      "--out", str(out)])
    assert result.exit_code == 1 and "'#! arch cpu' in folder sm_90/" in result.output, result.output
    assert not out.exists()
    db = random_run(3, n=1)
    with pytest.raises(PerfdbError, match="not written, it would not read back: .*in folder sm_80/"):
        db.write(tmp_path / "sm_80" / "t3.txt")
    assert db.write(tmp_path / "sm_90" / "t3.txt").exists()


def test_a_run_in_an_architectures_folder_declares_its_arch(tmp_path):
    """docs/perfmon.md: a file under sm_90/ must declare `#! arch`; one without was read, and
    summaries and the standing counted it as that architecture's."""
    db = random_run(3, n=1)
    text = "\n".join(line for line in db.to_text().splitlines() if not line.startswith("#! arch")) + "\n"
    for folder in ("sm_90", "cpu"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "t.txt").write_text(text)
        with pytest.raises(PerfdbError, match=f"no '#! arch' line in folder {folder}/"):
            Perfdb.read(tmp_path / folder / "t.txt")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "t.txt").write_text(text)
    assert Perfdb.read(tmp_path / "elsewhere" / "t.txt").header.get("arch") is None


def test_a_bad_arch_line_is_reported_at_its_line(tmp_path):
    """'#! arch' with no value was reported at line 1 as "move it to /"; with extra spaces
    ('#!  arch  sm_80') the folder error named line 1 too."""
    text = random_run(7, n=2).to_text()
    lines = text.splitlines()
    at = next(n for n, line in enumerate(lines, start=1) if line.startswith("#! arch"))
    (tmp_path / "sm_90").mkdir()
    for line, message in (("#! arch", "directive '#! arch' has no value"),
                          ("#! arch   ", "directive '#! arch' has no value"),
                          ("#!  arch  sm_80", "'#! arch sm_80' in folder sm_90/: .*move it to sm_80/")):
        path = tmp_path / "sm_90" / "t.txt"
        path.write_text("\n".join([*lines[:at - 1], line, *lines[at:]]) + "\n")
        with pytest.raises(PerfdbError, match=message) as info:
            Perfdb.read(path)
        assert info.value.where == f"{path}:{at}", info.value
        assert "move it to /" not in str(info.value)


@pytest.mark.parametrize("name", ["#" + declared()[0].name, "[results]", "two words", "tab\tname", "new\nline",
                                  "sep\x1carator", ""])
def test_an_entry_name_that_would_not_read_back_is_refused(tmp_path, name):
    """An entry named '#...' (from another host's results) was written as a comment line: the
    file silently lost it and its records. Names are checked where entries are parsed and
    added, and `write` refuses a text that does not read back as the same run."""
    import dataclasses

    from aotattn.perfmon.entries import Entry

    entry = declared()[0]
    with pytest.raises(ValueError, match="entry name"):
        Entry.parse(name, entry.describe())
    db = random_run(8, n=2)
    with pytest.raises(PerfdbError, match="entry name"):
        db.add(dataclasses.replace(entry, name=name), [])
    # past the checks (the fields set by hand): the write finds what would not read back
    db.entries[name] = dataclasses.replace(entry, name=name)
    db.records.append(Record(name, "fwd", "aotattn", 1.5, 0.01, 2.0, 1.0))
    path = tmp_path / "sm_90" / "t8.txt"
    with pytest.raises(PerfdbError, match="not written, it would not read back"):
        db.write(path)
    assert not path.exists()


def test_write_refuses_what_reads_back_as_other_data(tmp_path):
    """`write` promised to write only what reads back; it checked that the text parsed, not
    that it parsed to the same run (a header value's spaces, a comment's trailing blank)."""
    for change in (lambda db: db.header.update(gpu=" NVIDIA H200"), lambda db: db.comments.append("trailing ")):
        db = random_run(9, n=2)
        change(db)
        path = tmp_path / "sm_90" / "t9.txt"
        with pytest.raises(PerfdbError, match="reads back as"):
            db.write(path)
        assert not path.exists()
    db = random_run(9, n=2)
    assert Perfdb.read(db.write(tmp_path / "sm_90" / "t9.txt")).to_text() == db.to_text()


def test_providers_are_written_in_their_declaration_order():
    """aotattn:ws was missing from the writer's order and sorted after flex."""
    from aotattn.perfmon.providers import ALL

    entry = next(e for e in declared() if e.group == "dense" and "bwd" in e.passes)
    rng = random.Random()
    providers = list(ALL)
    rng.shuffle(providers)
    db = Perfdb(header={"tag": "order"})
    db.add(entry, [Record(entry.name, "bwd", p, rng.uniform(0.1, 9)) for p in providers])
    written = [line.split()[2] for line in db.to_text().split("[results]\n", 1)[1].splitlines()[1:]]
    assert written == list(ALL)


def test_every_committed_run_still_reads_and_rewrites_to_the_same_lines():
    """The committed perfdb files read; written again, only lines' order may change (the
    aotattn:ws lines, sorted after flex before the writer took the providers' order)."""
    paths = sorted((Path(__file__).resolve().parents[2] / "perfdb").glob("*/*.txt"))
    assert paths
    for path in paths:
        text = path.read_text(encoding="utf-8")
        again = Perfdb.read(path).to_text()
        assert sorted(again.splitlines()) == sorted(text.splitlines()), path
        assert Perfdb.from_text(again).to_text() == again
