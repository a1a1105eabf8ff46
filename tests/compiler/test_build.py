"""The AOT build on a CPU machine: sm_90 and gfx942 images compiled, packed, listed,
extracted and verified; corrupted and path-traversing archives rejected."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotattn.compiler import build, enumerate_jobs
from aotattn.compiler.jobs import Job
from aotattn.families import kernels as rules_kernels
from aotattn.families.flash import rules
from aotattn.families.flash.rules import SEQLEN_BUCKETS
from aotattn.cli import app
from aotattn.runtime.images import Archive, Entry, ImageError, write_archive
from aotattn.spec import Functional
from aotattn.tuning import Database

WHERE = "dtype=bf16 BLOCK_DV=64 VARLEN=False"
TABLES = ["flash.attn_bwd_preprocess", "flash.dropout_mask"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One small build for both targets, shared by the tests below."""
    root = tmp_path_factory.mktemp("images")
    report = build(["sm_90", "gfx942"], TABLES, WHERE, root / "images", root / "cache", workers=2, timeout=300,
                   db=Database())
    return root, report


def test_build_compiles_for_nvidia_and_amd(built):
    root, report = built
    assert not report.failures, [o.message for o in report.failures]
    assert {o.status for o in report.outcomes} == {"compiled"}
    assert sorted(p.relative_to(root / "images").as_posix() for p in report.archives) == [
        "gfx942/flash.attn_bwd_preprocess.aotimg", "gfx942/flash.dropout_mask.aotimg",
        "sm_90/flash.attn_bwd_preprocess.aotimg", "sm_90/flash.dropout_mask.aotimg"]
    sm90 = Archive(root / "images/sm_90/flash.attn_bwd_preprocess.aotimg")
    kinds = {e.variant: e for e in sm90.header.entries}
    assert set(kinds) == {"aligned", "aligned8"}  # PAD_HEAD False / True (rules._variant_of)
    assert kinds["aligned"].binary == "cubin" and kinds["aligned"].symbol == "attn_bwd_preprocess"
    assert sm90.binary(kinds["aligned"])[:4] == b"\x7fELF"
    amd = Archive(root / "images/gfx942/flash.dropout_mask.aotimg")
    assert amd.header.entries[0].binary == "hsaco" and amd.header.entries[0].warp_size == 64


def test_build_is_incremental(built):
    root, first = built
    again = build(["sm_90"], TABLES, WHERE, root / "images", root / "cache", workers=2, timeout=300, db=Database())
    assert {o.status for o in again.outcomes} == {"cached"}
    assert len(Archive(root / "images/sm_90/flash.attn_bwd_preprocess.aotimg").header.entries) == 2


def test_jobs_follow_the_tuning_database():
    jobs = enumerate_jobs(Database(), ["sm_90", "sm_80"], ["flash.attn_fwd"],
                          "dtype=bf16 BLOCK_D=128 MASK=0 VARLEN=False DROPOUT=False BIAS=0 PAD_HEAD=False")
    db = Database()
    spec = rules_kernels()["flash.attn_fwd"]
    for arch in ("sm_90", "sm_80"):
        # one job per configuration the arch's table names for the functional, over every cell
        functional = next(job.functional for job in jobs if job.arch == arch)
        named = {db.lookup(arch, spec, functional, {"seqlen_q": q, "seqlen_k": k})
                 for q in SEQLEN_BUCKETS for k in SEQLEN_BUCKETS}
        assert {job.config for job in jobs if job.arch == arch} == named
    assert {job.config["num_stages"] for job in jobs if job.arch == "sm_80"} == {2}  # sm_80 overrides its base


def test_the_build_holds_the_tile_every_group_width_launches():
    """A grouped call of either width launches the grouped ws tile with its own cell's
    configuration (the wide cells' hand-set tiles included): wherever the operator table
    chooses ws, the default build has that kernel, and the table axis adds none of its own."""
    db = Database()
    jobs = enumerate_jobs(db, ["sm_90"], ["flash.attn_bwd_ws"], "BLOCK_D=128 MASK=2 GROUPED=True PAD_HEAD=False")
    assert jobs and not any("WIDE_GROUPS" in job.functional.as_dict() for job in jobs)
    keys = {job.key for job in jobs}
    checked = 0
    for dtype in ("bf16", "fp16"):
        plain = {"dtype": dtype, "BLOCK_D": 128, "BLOCK_DV": 128, "PAD_HEAD": False, "MASK": rules.MASK_BOTTOM_RIGHT,
                 "VARLEN": False, "DROPOUT": False, "BIAS": rules.BIAS_NONE}
        for s in SEQLEN_BUCKETS:
            sizes = {"seqlen_q": s, "seqlen_k": s}
            if db.lookup("sm_90", rules.BACKWARD, rules.operator_functional(plain, False, True), sizes)["backend"] != "ws":
                continue
            for wide in (False, True):
                functional = Functional.of({**plain, "GROUPED": True, **({"WIDE_GROUPS": True} if wide else {})})
                config = db.lookup("sm_90", rules.ATTN_BWD_WS, functional, sizes)
                assert Job("sm_90", "flash.attn_bwd_ws", functional, config).key in keys, (dtype, s, wide, config)
                checked += 1
    assert checked >= 16  # ws from s1024 at least, both widths and dtypes


def test_backend_kernels_are_built_only_where_the_operator_table_chooses_them(tmp_path):
    """The fused backward's kernels are listed only in the cells where ``flash.backward``
    chooses fused (for the call's own functional or the block it falls back to), the split
    kernels where it chooses split; ``forced`` lists every cell, for calls that force a backend."""
    import shutil

    from aotattn import tuning
    from aotattn.families.flash import rules
    from aotattn.spec import Functional

    root = tmp_path / "tuning"
    shutil.copytree(Path(tuning.database().root), root, ignore=shutil.ignore_patterns("*.dbpatch"))
    where = "dtype=bf16 BLOCK_D=64 MASK=0 PAD_HEAD=False VARLEN=False BIAS=0"
    fused = ["flash.attn_bwd_fused"]
    assert enumerate_jobs(Database(root), ["sm_90"], fused, where) == []  # seeded: split everywhere
    forced = enumerate_jobs(Database(root), ["sm_90"], fused, where, forced=True)
    assert {j.functional["DROPOUT"] for j in forced} == {False, True} and len(forced) >= 4
    (root / "nvidia/sm_90/flash.backward.0001-t.dbpatch").write_text(
        "#! aotattn-patch 1\n#! table flash.backward\n\n[configs]\nfused = backend=fused\n\n"
        "[dtype=bf16 BLOCK_D=64 PAD_HEAD=False MASK=0 VARLEN=False DROPOUT=False BIAS=0 DETERMINISTIC=False]\n"
        "seqlen_q=1024 seqlen_k=1024: fused\n")
    db = Database(root)
    jobs = enumerate_jobs(db, ["sm_90"], fused, where)
    spec = rules.ATTN_BWD_FUSED
    expected = set()
    for dropout in (False, True):  # the dropout call falls back to the patched dense block
        f = Functional.of(dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=False, MASK=0, VARLEN=False,
                               DROPOUT=dropout, BIAS=0, ATOMIC_DQ=True))
        expected.add((f, db.lookup("sm_90", spec, f, {"seqlen_q": 1024, "seqlen_k": 1024})))
    assert {(j.functional, j.config) for j in jobs} == expected  # atomic only: deterministic stays split
    split = enumerate_jobs(db, ["sm_90"], ["flash.attn_bwd_dq"], where)
    assert split and split == enumerate_jobs(db, ["sm_90"], ["flash.attn_bwd_dq"], where, forced=True)


def test_cli_ls_extract_verify(built, tmp_path):
    root, _ = built
    runner = CliRunner()
    result = runner.invoke(app, ["images", "ls", str(root / "images")])
    assert result.exit_code == 0 and "gfx942" in result.output and "sm_90" in result.output
    result = runner.invoke(app, ["images", "verify", str(root / "images")])
    assert result.exit_code == 0 and "4 archive(s), 0 problem(s)" in result.output
    archive = root / "images/sm_90/flash.attn_bwd_preprocess.aotimg"
    result = runner.invoke(app, ["images", "extract", str(archive), str(tmp_path / "out")])
    assert result.exit_code == 0
    index = json.loads((tmp_path / "out/index.json").read_text())
    files = [tmp_path / "out" / e["file"] for e in index["entries"]]
    assert all(f.is_file() and f.read_bytes()[:4] == b"\x7fELF" for f in files)


def test_a_truncated_or_altered_archive_is_rejected(built, tmp_path):
    root, _ = built
    raw = (root / "images/sm_90/flash.dropout_mask.aotimg").read_bytes()
    truncated = tmp_path / "truncated.aotimg"
    truncated.write_bytes(raw[:-100])
    with pytest.raises(ImageError, match="truncated"):
        Archive(truncated)
    altered = tmp_path / "altered.aotimg"
    flipped = bytearray(raw)
    flipped[-50] ^= 0xFF  # inside the compressed kernel
    altered.write_bytes(bytes(flipped))
    archive = Archive(altered)
    with pytest.raises(ImageError, match="does not decompress|fails its checksum"):
        archive.binary(archive.header.entries[0])
    index_altered = tmp_path / "index.aotimg"
    flipped = bytearray(raw)
    flipped[struct.calcsize("<8sIQ32s") + 10] ^= 0x01  # inside the index
    index_altered.write_bytes(bytes(flipped))
    with pytest.raises(ImageError, match="index checksum mismatch"):
        Archive(index_altered)
    runner = CliRunner()
    result = runner.invoke(app, ["images", "verify", str(truncated), str(altered)])
    assert result.exit_code == 1 and "2 archive(s), 2 problem(s)" in result.output


def _evil_archive(path: Path) -> None:
    entry = Entry(key="||generic", functional={}, config={}, variant="generic", symbol="k", shared=0, num_warps=4,
                  warp_size=32, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, binary="cubin",
                  file="../../escaped.cubin", blob="")
    write_archive(path, "sm_90", "flash.dropout_mask", "3.6.0", "0" * 64, [(entry, b"\x7fELF evil")])


def test_a_path_traversing_archive_is_rejected(tmp_path):
    evil = tmp_path / "evil.aotimg"
    _evil_archive(evil)
    target = tmp_path / "a" / "b"
    with pytest.raises(ImageError, match="unsafe path"):
        Archive(evil).extract(target)
    assert not (tmp_path / "escaped.cubin").exists() and not (tmp_path / "a" / "escaped.cubin").exists()
    assert any("unsafe path" in p for p in Archive(evil).verify())
    result = CliRunner().invoke(app, ["images", "extract", str(evil), str(target)])
    assert result.exit_code == 1 and "unsafe path" in result.output


def test_build_reports_failures_without_stopping(tmp_path, monkeypatch):
    from aotattn.compiler import builder

    real = builder.compile_job

    def sometimes_broken(job, line_info):
        if job.functional["PAD_HEAD"]:
            raise RuntimeError("boom")
        return real(job, line_info)

    monkeypatch.setattr(builder, "compile_job", sometimes_broken)
    report = build(["sm_90"], ["flash.attn_bwd_preprocess"], WHERE, tmp_path / "i", tmp_path / "c", workers=2,
                   timeout=300, db=Database())
    assert [o.status for o in report.outcomes].count("failed") == 1
    assert "boom" in report.failures[0].message
    assert len(Archive(report.archives[0]).header.entries) == 1  # the other kernel still packed


def test_build_kills_a_hanging_compile(tmp_path, monkeypatch):
    import time

    from aotattn.compiler import builder

    monkeypatch.setattr(builder, "compile_job", lambda job, line_info: time.sleep(60))
    report = build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "i", tmp_path / "c", workers=1, timeout=1.0,
                   db=Database())
    assert [o.status for o in report.outcomes] == ["timeout"]


# ------------------------------------------------------------ issue 16, item 3: what is built, how big


def _section_names(cubin: bytes) -> set[str]:
    """The ELF section names of a cubin (from its section-name string table)."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    table = headers[names_at][4]
    return {cubin[table + h[0]:cubin.index(b"\0", table + h[0])].decode() for h in headers} - {""}


def test_images_leave_line_info_out_unless_asked(tmp_path):
    from aotattn.compiler.jobs import cache_key

    kept = build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "kept", tmp_path / "cache", workers=1,
                 timeout=300, db=Database(), line_info=True)
    lean = build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "lean", tmp_path / "cache", workers=1,
                 timeout=300, db=Database())
    assert [o.status for o in kept.outcomes + lean.outcomes] == ["compiled", "compiled"]  # one cache, two keys
    job = lean.outcomes[0].job
    assert cache_key(job) != cache_key(job, line_info=True)
    binaries = {}
    for name, report in (("kept", kept), ("lean", lean)):
        archive = Archive(report.archives[0])
        binaries[name] = archive.binary(archive.header.entries[0])
    debug = {".debug_line", ".nv_debug_line_sass", ".nv_debug_ptx_txt"}
    assert debug <= _section_names(binaries["kept"])
    assert not debug & _section_names(binaries["lean"]) and ".text.dropout_mask_kernel" in _section_names(
        binaries["lean"])
    assert len(binaries["lean"]) < len(binaries["kept"]) / 2


def test_a_damaged_cache_entry_is_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    first = build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "images", cache, workers=1, timeout=300,
                  db=Database())
    blob, = (cache / "sm_90" / "flash.dropout_mask").glob("*.xz")
    blob.write_bytes(blob.read_bytes()[:-7])
    again = build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "images", cache, workers=1, timeout=300,
                  db=Database())
    assert [o.status for o in first.outcomes + again.outcomes] == ["compiled", "compiled"]
    archive = Archive(again.archives[0])
    assert not archive.verify() and archive.binary(archive.header.entries[0])[:4] == b"\x7fELF"


def test_packing_compresses_nothing_in_the_parent(built, monkeypatch):
    """Compressing is the slow part of packing: the compiler processes do it; a repack
    keeps the archive's compressed kernels as they are."""
    from aotattn.compiler import builder
    from aotattn.runtime import images

    root, report = built
    before = {p: p.read_bytes() for p in report.archives}

    def refuse(binary):
        raise AssertionError("the parent compressed a kernel")

    monkeypatch.setattr(images.Packed, "of", staticmethod(refuse))
    jobs = [o.job for o in report.outcomes]
    written = builder.pack(jobs, root / "cache", root / "images")
    assert sorted(written) == sorted(before)
    for path in written:
        assert path.read_bytes() == before[path]  # the same kernels, their compressed bytes kept


def test_one_kernel_per_functional_and_configuration_shared_between_cells(tmp_path):
    """A block whose cells name two configurations builds two kernels; every other
    functional's block names one, however many cells it has."""
    import shutil

    from aotattn import families
    from aotattn.tuning import write_table

    shutil.copytree(Path(__file__).resolve().parents[2] / "tuning", tmp_path / "tuning")
    db = Database(tmp_path / "tuning")
    table = db.effective("sm_90", "flash.attn_bwd_preprocess")
    own = db.own_table("sm_90", "flash.attn_bwd_preprocess")
    functional = next(iter(own.blocks))
    first = own.blocks[functional][0][0]
    assert len(own.blocks[functional]) == 11 and {len(row) for row in own.blocks[functional]} == {1}
    other = next(name for name, config in table.configs.items() if config != table.configs[first])
    own.configs[other] = table.configs[other]
    own.blocks[functional] = [[first]] * 5 + [[other]] * 6  # rows: the seqlen_q buckets
    spec = families.kernels()["flash.attn_bwd_preprocess"]
    path = db.table_path("sm_90", "flash.attn_bwd_preprocess")
    path.write_text(write_table(spec, own))
    jobs = enumerate_jobs(Database(tmp_path / "tuning"), ["sm_90"], ["flash.attn_bwd_preprocess"])
    per_functional = {}
    for job in jobs:
        per_functional.setdefault(job.functional, set()).add(job.config)
    assert len(jobs) == len(set(jobs)) == sum(map(len, per_functional.values()))
    assert per_functional[functional] == {table.configs[first], table.configs[other]}
    assert all(len(configs) == 1 for f, configs in per_functional.items() if f != functional)
    assert len(per_functional) == len(list(spec.enumerate_functionals()))


def _fake_compiled(cache: Path, job, binary: bytes) -> None:
    """``job`` in the build cache as if compiled, its binary a stand-in (no compiler run)."""
    from aotattn.compiler import builder
    from aotattn.runtime.images import Packed

    entry = Entry(key=job.key, functional=job.functional.as_dict(), config=job.config.as_dict(), variant=job.variant,
                  symbol="dropout_mask_kernel", shared=0, num_warps=4, warp_size=32, global_scratch_size=0,
                  global_scratch_align=1, profile_scratch_size=0, binary="cubin", file=job.file(), blob="")
    builder._store(cache, job, False, entry, Packed.of(binary))


@pytest.mark.parametrize("arch, table", [("sm_80", "flash.dropout_mask"), ("sm_90", "flash.philox_words")])
def test_a_build_never_merges_an_archive_of_another_arch_or_kernel_copied_into_place(tmp_path, arch, table):
    """The build keeps what the existing archive holds; one copied or renamed into this
    arch's and kernel's place (same source, same Triton) had its binaries relabelled: an
    sm_80 cubin in an archive that says sm_90 (or philox_words' in dropout_mask's, the same
    kernel module), which the runtime then loads."""
    import triton

    from aotattn.compiler import builder
    from aotattn.runtime import images

    job, = enumerate_jobs(Database(), ["sm_90"], ["flash.dropout_mask"])
    _fake_compiled(tmp_path / "cache", job, b"\x7fELF sm_90 dropout_mask")
    stranger = Entry(key="|BLOCK_M=64|generic", functional={}, config={"BLOCK_M": 64}, variant="generic",
                     symbol="other", shared=0, num_warps=4, warp_size=32, global_scratch_size=0,
                     global_scratch_align=1, profile_scratch_size=0, binary="cubin", file="x/other.cubin", blob="")
    path = images.archive_path(tmp_path / "images", "sm_90", "flash.dropout_mask")
    write_archive(path, arch, table, triton.__version__, images.source_hash(rules_kernels()[table].module, rules_kernels()[table].declaration),
                  [(stranger, b"\x7fELF a stranger")])
    assert builder.pack([job], tmp_path / "cache", tmp_path / "images") == [path]
    archive = Archive(path)
    assert (archive.arch, archive.table) == ("sm_90", "flash.dropout_mask")
    assert [e.key for e in archive.header.entries] == [job.key]
    assert archive.binary(archive.header.entries[0]) == b"\x7fELF sm_90 dropout_mask"


def test_two_builds_packing_into_one_folder_at_once_keep_both_kernels(tmp_path, monkeypatch):
    """Packing reads the archive, merges and renames a new one into place: two builds of
    different kernels into one folder each wrote what they read plus their own, and the
    later rename dropped the other's kernel. The first build here stalls between reading
    and writing, the second packs meanwhile."""
    import threading
    import time

    from aotattn.compiler import builder
    from aotattn.compiler.jobs import Job
    from aotattn.spec import Config

    first, = enumerate_jobs(Database(), ["sm_90"], ["flash.dropout_mask"])
    second = Job("sm_90", "flash.dropout_mask", first.functional, Config.of(BLOCK_M=64, BLOCK_N=64, num_warps=4,
                                                                             num_stages=1))
    for job, binary in ((first, b"\x7fELF first"), (second, b"\x7fELF second")):
        _fake_compiled(tmp_path / "cache", job, binary)
    writing, real_write = threading.Event(), builder.write_archive

    def stalled_write(path, *args):
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            time.sleep(0.5)  # the other build packs now, unless it waits its turn
        return real_write(path, *args)

    monkeypatch.setattr(builder, "write_archive", stalled_write)
    thread = threading.Thread(target=builder.pack, args=([first], tmp_path / "cache", tmp_path / "images"))
    thread.start()
    assert writing.wait(30)
    builder.pack([second], tmp_path / "cache", tmp_path / "images")
    thread.join()
    archive = Archive(tmp_path / "images/sm_90/flash.dropout_mask.aotimg")
    assert sorted(archive.binary(e) for e in archive.header.entries) == [b"\x7fELF first", b"\x7fELF second"]


@pytest.mark.parametrize("timeout", ["nan", "0", "-5"])
def test_a_timeout_that_abandons_no_compile_or_every_one_is_refused(tmp_path, timeout):
    """``--timeout nan`` never killed a hanging compile (every comparison with NaN is
    false); 0 or less killed each one at once. Refused before anything is compiled."""
    result = CliRunner().invoke(app, ["build", "--arch", "sm_90", "--kernel", "dropout_mask", "--timeout", timeout,
                                      "--out", str(tmp_path / "images"), "--cache", str(tmp_path / "cache")])
    assert result.exit_code == 1 and "--timeout: expected a number of seconds above 0" in result.output, result.output
    assert not (tmp_path / "cache").exists() and not (tmp_path / "images").exists()


@pytest.mark.parametrize("damage", [{"shared": -1}, {"num_warps": "4"}, {"key": "|BLOCK_M=1|generic"},
                                    {"shared": 1}, {"num_warps": 8}, {"symbol": "dropout_mask_kernel_"}])
def test_a_cache_entry_whose_launch_fields_are_damaged_is_compiled_again(tmp_path, damage):
    """Only the cached binary's checksum was checked: an entry out of the archive schema was
    taken as cached, and this build and every later one failed writing the archive. One
    still in the schema (another shared size, warp count or symbol) was packed as it was and
    launched wrong: the entry has a checksum too."""
    cache = tmp_path / "cache"
    build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "images", cache, workers=1, timeout=300, db=Database())
    meta, = (cache / "sm_90" / "flash.dropout_mask").glob("*.json")
    record = json.loads(meta.read_text())
    true = dict(record["entry"])
    record["entry"].update(damage)
    meta.write_text(json.dumps(record))
    again = build(["sm_90"], ["flash.dropout_mask"], None, tmp_path / "images", cache, workers=1, timeout=300,
                  db=Database())
    assert [o.status for o in again.outcomes] == ["compiled"]
    archive = Archive(again.archives[0])
    entry = archive.header.entries[0]
    assert not archive.verify() and (entry.shared, entry.num_warps, entry.symbol) == (
        true["shared"], true["num_warps"], true["symbol"])
    assert json.loads(meta.read_text())["entry"] == true


def test_a_kernel_source_edited_while_it_compiles_is_not_packed(tmp_path, monkeypatch):
    """The binaries come from the source as it was when compiling began; the archive records
    the source hash read when packing. An edit in between labelled old binaries with the new
    source, which the runtime then took as current: now the pack refuses and says build again."""
    from aotattn.compiler import builder

    job, = enumerate_jobs(Database(), ["sm_90"], ["flash.dropout_mask"])
    _fake_compiled(tmp_path / "cache", job, b"\x7fELF before the edit")
    hashes = iter(["source as compiled", "source as edited"])
    monkeypatch.setattr(builder, "source_hash", lambda spec: next(hashes))
    with pytest.raises(ValueError, match="kernel source changed while it compiled.*build again"):
        builder.compile_and_pack([job], tmp_path / "cache", tmp_path / "images", workers=1, timeout=60)
    assert not (tmp_path / "images").exists() or not list((tmp_path / "images").rglob("*.aotimg"))


def test_a_damaged_archive_is_rewritten_with_a_warning(tmp_path):
    """An archive that cannot be read loses the kernels this build does not bring: said, with
    the command that restores them (it went silently from 4 kernels to 1)."""
    from aotattn.compiler import builder
    from aotattn.runtime import images

    job, = enumerate_jobs(Database(), ["sm_90"], ["flash.dropout_mask"])
    _fake_compiled(tmp_path / "cache", job, b"\x7fELF kept")
    path = images.archive_path(tmp_path / "images", "sm_90", "flash.dropout_mask")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"AOTIMG but not really")
    warnings = []
    assert builder.pack([job], tmp_path / "cache", tmp_path / "images", warn=warnings.append) == [path]
    assert len(warnings) == 1 and "unreadable" in warnings[0] and "--kernel flash.dropout_mask" in warnings[0]
    assert [e.key for e in Archive(path).header.entries] == [job.key]


@pytest.mark.parametrize("args, words", [
    (["--arch", "sm_80", "--kernel", "attn_fwd_ws"], "run only on sm_90, not on sm_80"),
    (["--arch", "sm_90", "--kernel", "flash.attn_bwd_fused", "--where",
      "ATOMIC_DQ=False BIAS=0 BLOCK_D=64 BLOCK_DV=64 DROPOUT=False MASK=0 PAD_HEAD=False VARLEN=False dtype=fp16"],
     "add --forced-backends"),
])
def test_a_build_that_selects_nothing_says_why(args, words, tmp_path):
    """A selection that builds no kernel was `0 kernel(s)`, exit 0: ImageMissing's own command
    for a forced backend's kernel built nothing. Now one line saying why, exit 1."""
    result = CliRunner().invoke(app, ["build", *args, "--out", str(tmp_path / "img"), "--dry-run"])
    assert result.exit_code == 1 and words in result.output, result.output


def test_the_command_an_image_missing_error_gives_for_a_backend_kernel_builds_it():
    """A kernel an operator table chooses (a backward backend's) is built only where chosen:
    the command in ImageMissing adds --forced-backends, and that command plans the kernel."""
    import shlex

    from aotattn.runtime.image_loader import missing_image
    from aotattn.spec import LaunchPlan

    spec = rules_kernels()["flash.attn_bwd_fused"]
    job = next(j for j in enumerate_jobs(Database(), ["sm_90"], ["flash.attn_bwd_fused"], forced=True)
               if j.functional.as_dict()["dtype"] == "fp16" and j.functional.as_dict()["MASK"] == 0)
    plan = LaunchPlan(spec, job.functional, job.config, grid=(1, 1, 1), args=())
    message, arch, table, command = missing_image("sm_90", plan, "not built")
    assert command.endswith("--forced-backends") and command in message
    argv = shlex.split(command)[1:]
    where = argv[argv.index("--where") + 1]
    planned = enumerate_jobs(Database(), ["sm_90"], [table], where, forced="--forced-backends" in argv)
    assert (job.functional, job.config) in {(j.functional, j.config) for j in planned}


def test_where_filters_an_axis_left_at_its_default():
    """GROUPED (an axis functionals leave out at its default, False) filters like any other:
    `--where GROUPED=True` listed every kernel, the ungrouped ones too."""
    spec = rules_kernels()["flash.attn_bwd_ws"]
    every = enumerate_jobs(Database(), ["sm_90"], ["flash.attn_bwd_ws"], forced=True)
    grouped = enumerate_jobs(Database(), ["sm_90"], ["flash.attn_bwd_ws"], "GROUPED=True", forced=True)
    ungrouped = enumerate_jobs(Database(), ["sm_90"], ["flash.attn_bwd_ws"], "GROUPED=False", forced=True)
    defaults = dict(spec.axis_defaults)
    assert grouped and ungrouped and len(grouped) + len(ungrouped) == len(every)
    assert all({**defaults, **j.functional.as_dict()}["GROUPED"] is True for j in grouped)
    assert all({**defaults, **j.functional.as_dict()}["GROUPED"] is False for j in ungrouped)


@pytest.mark.parametrize("garbage", ["nested", "fifo"])
def test_a_garbage_cache_entry_is_a_miss(tmp_path, garbage):
    """JSON nested past the parser's depth was an internal RecursionError, and a FIFO at an
    entry's place hung the build: both are a miss now (the kernel is compiled again)."""
    import os

    from aotattn.compiler import builder

    job, = enumerate_jobs(Database(), ["sm_90"], ["flash.dropout_mask"])
    _fake_compiled(tmp_path / "cache", job, b"\x7fELF cached")
    assert builder._cached(tmp_path / "cache", job, False, check=False) is not None
    meta, _ = builder._cache_paths(tmp_path / "cache", job, False)
    meta.unlink()
    if garbage == "nested":
        meta.write_text("[" * 100_000 + "]" * 100_000)
    else:
        os.mkfifo(meta)
    assert builder._cached(tmp_path / "cache", job, False) is None
