"""Hostile and broken image archives (issue 10, items 3-7): each ends as one clear
``ImageError`` line, in the reader, ``aotattn images`` and the runtime loader, with no
internal traceback, no unbounded memory, no write outside the target folder."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import lzma
import os
import struct
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aotattn import families
from aotattn.cli import app
from aotattn.runtime import image_loader, images
from aotattn.runtime.images import Archive, Entry, ImageError, write_archive

HEAD = struct.Struct("<8sIQ32s")
TABLE = "flash.dropout_mask"


def kernel_entry(name: str, **fields) -> Entry:
    functional = {"dtype": "bf16", "BLOCK_D": int(name)} if name.isdigit() else {"name": name}
    config = {"BLOCK_M": 64, "num_warps": 4}
    values = dict(key=images.entry_key(functional, config, "generic"), functional=functional, config=config,
                  variant="generic", symbol="kern", shared=1024, num_warps=4, warp_size=32, global_scratch_size=0,
                  global_scratch_align=1, profile_scratch_size=0, binary="cubin", file=f"{TABLE}/{name}.cubin",
                  blob="")
    values.update(fields)
    return Entry(**values)


def make_archive(path: Path, names=("a", "b"), table: str = TABLE, triton_version: str = "3.6.0",
                 source_hash: str | None = None, **fields) -> dict[str, bytes]:
    """A valid archive with one random binary per name; returns name -> binary."""
    binaries = {name: b"\x7fELF" + os.urandom(300) for name in names}
    spec = families.kernels()[table]
    write_archive(path, "sm_90", table, triton_version,
                  source_hash if source_hash is not None else images.source_hash(spec.module, spec.declaration),
                  [(kernel_entry(name, **fields), binary) for name, binary in binaries.items()])
    return binaries


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    _, _, length, _ = HEAD.unpack_from(raw)
    return json.loads(raw[HEAD.size:HEAD.size + length]), raw[HEAD.size + length:]


def rewrite(path: Path, index: bytes | dict, blobs: bytes) -> None:
    """Write ``index`` (with a valid checksum: only the schema stands between it and the reader),
    a dict as canonical JSON, as the writer writes it."""
    data = index if isinstance(index, bytes) else json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    path.write_bytes(HEAD.pack(images.MAGIC, images.VERSION, len(data), hashlib.sha256(data).digest()) + data + blobs)


def mutate(path: Path, change) -> None:
    index, blobs = split(path)
    change(index)
    rewrite(path, index, blobs)


def one_line_error(exc: BaseException, path: Path) -> str:
    text = str(exc)
    assert "\n" not in text and str(path) in text, text
    return text


def cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert not isinstance(result.exception, (TypeError, KeyError, AttributeError, ValueError, RecursionError,
                                             UnicodeDecodeError, OSError)), result.exception
    return result


# --------------------------------------------------------------------------- item 3: bombs


def test_a_decompression_bomb_stops_at_the_declared_size(tmp_path):
    """64 MiB of zeros (10 KB compressed) behind an entry that declares 304 bytes: the
    reader must stop after the declared size, not inflate the whole blob first."""
    path = tmp_path / "bomb.aotimg"
    make_archive(path, names=("a",))
    index, _ = split(path)
    bomb = lzma.compress(bytes(64 << 20), preset=0)
    index["entries"][0]["length"] = len(bomb)
    rewrite(path, index, bomb)
    archive = Archive(path)
    tracemalloc.start()
    try:
        with pytest.raises(ImageError, match="declared size") as info:
            archive.binary(archive.header.entries[0])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    one_line_error(info.value, path)
    assert peak < 4 << 20, f"peak {peak / 2**20:.0f} MiB while refusing a bomb"
    result = cli("images", "verify", str(path))
    assert result.exit_code == 1 and "declared size" in result.output


def test_a_declared_size_beyond_the_limit_is_refused_before_decompressing(tmp_path):
    path = tmp_path / "big.aotimg"
    make_archive(path, names=("a",))
    mutate(path, lambda index: index["entries"][0].update(size=images.MAX_KERNEL_BYTES + 1))
    with pytest.raises(ImageError, match="size") as info:
        Archive(path).header
    one_line_error(info.value, path)


@pytest.mark.parametrize("damage", ["truncated", "trailing"])
def test_a_blob_that_ends_early_or_carries_more_is_refused(tmp_path, damage):
    path = tmp_path / "x.aotimg"
    binaries = make_archive(path, names=("a",))
    index, blobs = split(path)
    if damage == "truncated":
        blobs = blobs[:-7]
    else:
        blobs = blobs + lzma.compress(b"more")
    index["entries"][0]["length"] = len(blobs)
    rewrite(path, index, blobs)
    archive = Archive(path)
    with pytest.raises(ImageError) as info:
        archive.binary(archive.header.entries[0])
    one_line_error(info.value, path)
    assert len(binaries["a"]) == archive.header.entries[0].size


# --------------------------------------------------------------------------- item 4: the index schema


def _drop(key):
    return lambda index: index["entries"][0].pop(key)


def _set(key, value):
    return lambda index: index["entries"][0].__setitem__(key, value)


SCHEMA_CASES = {
    "extra header key": lambda index: index.__setitem__("extra", 1),
    "extra entry key": _set("surprise", "x"),
    "missing header key": lambda index: index.pop("source_hash"),
    "missing entry field": _drop("num_warps"),
    "wrong type": _set("shared", "1024"),
    "bool for int": _set("offset", True),
    "float for int": _set("size", 304.0),
    "entries not a list": lambda index: index.__setitem__("entries", {"a": 1}),
    "entry not an object": lambda index: index["entries"].__setitem__(0, [1, 2]),
    "nested functional value": lambda index: index["entries"][0]["functional"].__setitem__("dtype", {"x": [1]}),
    "arch not a string": lambda index: index.__setitem__("arch", 90),
    "bad blob digest": _set("blob", "zz"),
    "unknown variant": _set("variant", "fast"),
    "unknown binary kind": _set("binary", "ptx"),
    "symbol with NUL": _set("symbol", "kern\x00evil"),
    "negative offset": _set("offset", -5),
}


@pytest.mark.parametrize("change", SCHEMA_CASES.values(), ids=SCHEMA_CASES.keys())
def test_an_index_outside_the_schema_is_refused_in_one_line(tmp_path, change):
    """Opening checks the index's frame; every entry is checked before it is used, and all
    of them by ``header`` (what ls, verify and extract read)."""
    path = tmp_path / "x.aotimg"
    make_archive(path)
    mutate(path, change)
    with pytest.raises(ImageError) as info:
        archive = Archive(path)
        archive.header
    one_line_error(info.value, path)
    if "archive" in locals():  # an entry's error: the runtime meets it when it loads that entry
        with pytest.raises(ImageError) as info:
            archive.entry(split(path)[0]["entries"][0]["key"])
        one_line_error(info.value, path)
    for command in (["images", "ls", str(path)], ["images", "verify", str(path)],
                    ["images", "extract", str(path), str(tmp_path / "out")]):
        result = cli(*command)
        assert result.exit_code == 1 and str(path.name) in result.output, (command, result.output)
    assert not (tmp_path / "out").exists()


RAW_INDEXES = {
    "invalid UTF-8": b'{"arch": "sm_\xff90"}',
    "deeply nested": b"[" * 200_000 + b"]" * 200_000,
    "not an object": b"[1, 2, 3]",
    "not JSON": b"hello",
    "NaN": b'{"arch": NaN}',
    "duplicate JSON key": b'{"arch": "sm_90", "arch": "sm_80"}',
}


@pytest.mark.parametrize("raw", RAW_INDEXES.values(), ids=RAW_INDEXES.keys())
def test_an_index_that_is_not_valid_json_text_is_refused_in_one_line(tmp_path, raw):
    path = tmp_path / "x.aotimg"
    rewrite(path, raw, b"")
    with pytest.raises(ImageError) as info:
        Archive(path)
    one_line_error(info.value, path)
    result = cli("images", "verify", str(path))
    assert result.exit_code == 1 and "1 problem(s)" in result.output


def test_a_key_given_twice_in_one_json_object_is_refused(tmp_path):
    """JSON parsers disagree on which of two equal keys counts: the index must be the
    canonical JSON the writer writes."""
    path = tmp_path / "x.aotimg"
    make_archive(path)
    index, blobs = split(path)
    text = json.dumps(index, sort_keys=True, separators=(",", ":"))
    assert '"shared":1024' in text
    rewrite(path, text.replace('"shared":1024', '"shared":0,"shared":1024', 1).encode(), blobs)
    with pytest.raises(ImageError, match="canonical") as info:
        Archive(path).header
    one_line_error(info.value, path)
    assert cli("images", "verify", str(path)).exit_code == 1


def test_the_runtime_loader_reports_archive_errors_as_one_image_error(tmp_path, monkeypatch):
    spec = families.kernels()[TABLE]
    path = images.archive_path(tmp_path, "sm_90", TABLE)
    path.parent.mkdir(parents=True)
    make_archive(path)
    mutate(path, SCHEMA_CASES["wrong type"])
    archive, = image_loader.ImageStore([tmp_path]).archives("sm_90", spec)
    broken, fine = (e["key"] for e in split(path)[0]["entries"])
    with pytest.raises(ImageError) as info:
        archive.entry(broken)
    assert "shared" in one_line_error(info.value, path)
    assert archive.binary(archive.entry(fine))[:4] == b"\x7fELF"
    mutate(path, SCHEMA_CASES["extra header key"])
    with pytest.raises(ImageError) as info:
        image_loader.ImageStore([tmp_path]).archives("sm_90", spec)
    assert "extra" in one_line_error(info.value, path)


def _flip_index_byte(raw: bytes) -> bytes:
    at = HEAD.size + 5
    return raw[:at] + bytes([raw[at] ^ 0x20]) + raw[at + 1:]


def _flip_last_blob_byte(raw: bytes) -> bytes:
    return raw[:-20] + bytes([raw[-20] ^ 0xFF]) + raw[-19:]


@pytest.mark.parametrize("damage", [
    lambda raw: raw[:HEAD.size - 3],  # no whole header
    lambda raw: raw[:HEAD.size + 10],  # the index cut short
    _flip_index_byte,  # the index altered: its checksum fails
    _flip_last_blob_byte,  # a binary altered: it no longer inflates, or fails its checksum
    lambda raw: b"NOTIMAGE" + raw[8:],  # not an archive at all
], ids=["no header", "truncated index", "altered index", "altered blob", "not an archive"])
def test_a_damaged_archive_the_runtime_reads_says_to_rebuild_it(tmp_path, damage):
    """A user's attention call that meets a damaged archive gets a one-line error that
    says what to do (rebuild it), as the schema errors and a stale archive's do."""
    spec = families.kernels()[TABLE]
    path = images.archive_path(tmp_path, "sm_90", TABLE)
    path.parent.mkdir(parents=True)
    make_archive(path, names=("a",))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ImageError) as info:
        archive, = image_loader.ImageStore([tmp_path]).archives("sm_90", spec)
        archive.binary(archive.header.entries[0])
    assert "aotattn build" in one_line_error(info.value, path)
    result = cli("images", "verify", str(tmp_path))
    assert result.exit_code == 1 and "aotattn build" in result.output


# --------------------------------------------------------------------------- item 5: extract


def test_extract_writes_every_binary_and_the_index(tmp_path):
    path = tmp_path / "x.aotimg"
    binaries = make_archive(path)
    written = Archive(path).extract(tmp_path / "new" / "out")
    out = tmp_path / "new" / "out"
    assert sorted(p.relative_to(out).as_posix() for p in written) == [f"{TABLE}/a.cubin", f"{TABLE}/b.cubin",
                                                                       "index.json"]
    assert {name: (out / TABLE / f"{name}.cubin").read_bytes() for name in binaries} == binaries
    assert json.loads((out / "index.json").read_text())["table"] == TABLE
    assert sorted(os.listdir(tmp_path / "new")) == ["out"]  # no staging folder left behind


def test_extract_into_an_existing_empty_folder_keeps_that_folder(tmp_path, monkeypatch):
    """The folder was replaced by the staging one: a private 0700 folder became 0755 under a
    new inode, and extracting into ``.`` left the shell in a deleted folder."""
    path = tmp_path / "x.aotimg"
    binaries = make_archive(path)
    out = tmp_path / "private"
    out.mkdir(mode=0o700)
    os.chmod(out, 0o700)
    before = os.stat(out)
    monkeypatch.chdir(out)
    written = Archive(path).extract(Path("."))
    after = os.stat(out)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert {name: (out / TABLE / f"{name}.cubin").read_bytes() for name in binaries} == binaries
    assert sorted(os.listdir(".")) == [TABLE, "index.json"] and all(p.exists() for p in written)
    assert sorted(os.listdir(tmp_path)) == ["private", "x.aotimg"]  # no staging folder left behind


@pytest.mark.parametrize("field, value", [("triton_version", "3.6.0\x1b]0;pwned\x07"),
                                          ("triton_version", "3.6.0\x1b[2J"), ("source_hash", "\x1b[2J" + "0" * 60)])
def test_an_index_string_that_would_reach_the_terminal_is_refused(tmp_path, field, value):
    """``images ls`` prints the Triton version and errors name the hashes: an escape sequence
    there (clear the screen, set the window title) reached the terminal, and passed verify."""
    path = tmp_path / "x.aotimg"
    make_archive(path)  # the writer refuses such strings: a hostile archive is written otherwise
    index, blobs = split(path)
    rewrite(path, {**index, field: value}, blobs)
    with pytest.raises(ImageError, match=f"{field}.*expected a version like 3.6.0") as info:
        Archive(path).header
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value)
    result = cli("images", "ls", str(tmp_path))
    assert result.exit_code == 1 and "\x1b" not in result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_folder_is_one_line_naming_the_archive(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    os.chmod(folder, 0o555)
    try:
        with pytest.raises(ImageError, match=r"cannot write .*x\.aotimg: Permission denied: make .* writable") as info:
            make_archive(folder / "x.aotimg")
        assert "\n" not in str(info.value) and "tmp" not in str(info.value).rsplit("/", 1)[-1]
    finally:
        os.chmod(folder, 0o755)


def test_an_archive_whose_folder_is_a_file_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ImageError, match=r"cannot write .*x\.aotimg: .*write the images elsewhere"):
        make_archive(tmp_path / "file" / "x.aotimg")


def test_a_tilde_in_the_images_variable_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(images.ENV_VAR, "~/aotimgs")
    assert images.images_root() == tmp_path / "aotimgs" and images.image_roots() == [tmp_path / "aotimgs"]


def test_extract_never_follows_a_link_in_the_target(tmp_path):
    path = tmp_path / "x.aotimg"
    make_archive(path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "out"
    target.mkdir()
    (target / "index.json").symlink_to(victim)
    with pytest.raises(ImageError, match="not empty") as info:
        Archive(path).extract(target)
    one_line_error(info.value, path)
    assert victim.read_text() == "precious" and os.listdir(target) == ["index.json"]
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ImageError, match="folder"):
        Archive(path).extract(linked)
    assert not (tmp_path / "elsewhere").exists()


FILE_CASES = {
    "same file twice": ("a.cubin", "a.cubin", "names the same file"),
    "named index.json": ("index.json", "b.cubin", "index.json"),
    "dot": (".", "b.cubin", "unsafe path"),
    "NUL": ("a\x00.cubin", "b.cubin", "unsafe path"),
    "parent": ("../a.cubin", "b.cubin", "unsafe path"),
    "absolute": ("/tmp/a.cubin", "b.cubin", "unsafe path"),
    "file and folder": ("x/a", "x/a/b", "both a file and a folder"),
    "empty": ("", "b.cubin", "unsafe path"),
    "not normalised": ("x//a", "b.cubin", "unsafe path"),
    # names no file system takes: verify passed them and extract failed naming neither archive nor entry
    "lone surrogate": ("\ud800.cubin", "b.cubin", "unsafe path"),
    "part over 255 bytes": ("x/" + "a" * 256, "b.cubin", "unsafe path"),
}


@pytest.mark.parametrize("first, second, message", FILE_CASES.values(), ids=FILE_CASES.keys())
def test_extract_refuses_unsafe_or_colliding_names_and_writes_nothing(tmp_path, first, second, message):
    path = tmp_path / "x.aotimg"
    make_archive(path)

    def rename(index):
        index["entries"][0]["file"], index["entries"][1]["file"] = first, second

    mutate(path, rename)
    target = tmp_path / "deep" / "out"
    with pytest.raises(ImageError, match=message) as info:
        Archive(path).extract(target)
    one_line_error(info.value, path)
    assert not (tmp_path / "deep").exists()
    assert any(message in problem for problem in Archive(path).verify())
    result = cli("images", "extract", str(path), str(target))
    assert result.exit_code == 1 and message in result.output
    assert not (tmp_path / "deep").exists()


def test_a_non_string_file_name_is_a_schema_error(tmp_path):
    path = tmp_path / "x.aotimg"
    make_archive(path)
    mutate(path, _set("file", 7))
    with pytest.raises(ImageError, match="file"):
        Archive(path).header


def test_a_corrupt_later_binary_leaves_nothing_on_disk(tmp_path):
    path = tmp_path / "x.aotimg"
    make_archive(path, names=("a", "b", "c"))
    index, blobs = split(path)
    last = max(index["entries"], key=lambda e: e["offset"])
    damaged = bytearray(blobs)
    damaged[last["offset"] + last["length"] // 2] ^= 0xFF
    rewrite(path, index, bytes(damaged))
    target = tmp_path / "out"
    with pytest.raises(ImageError, match=last["key"].replace("|", r"\|")):
        Archive(path).extract(target)
    assert os.listdir(tmp_path) == ["x.aotimg"]


# --------------------------------------------------------------------------- item 6: keys and launch fields


def test_a_duplicate_key_is_refused(tmp_path):
    path = tmp_path / "x.aotimg"
    make_archive(path)

    def duplicate(index):
        second = index["entries"][1]
        second.update(key=index["entries"][0]["key"], functional=index["entries"][0]["functional"])

    mutate(path, duplicate)
    with pytest.raises(ImageError, match="twice") as info:
        Archive(path)
    one_line_error(info.value, path)
    result = cli("images", "verify", str(path))
    assert result.exit_code == 1 and "twice" in result.output


def test_a_key_that_does_not_spell_its_functional_is_refused(tmp_path):
    path = tmp_path / "x.aotimg"
    make_archive(path)
    mutate(path, lambda index: index["entries"][0]["functional"].__setitem__("name", "other"))
    with pytest.raises(ImageError, match="key"):
        Archive(path).header


LAUNCH_CASES = {
    "negative shared": ("shared", -1),
    "huge shared": ("shared", 2**32),
    "zero warps": ("num_warps", 0),
    "too many threads": ("num_warps", 64),
    "odd warp size": ("warp_size", 48),
    "negative scratch": ("global_scratch_size", -8),
    "scratch align not a power of two": ("global_scratch_align", 3),
    "negative profile scratch": ("profile_scratch_size", -1),
    "empty symbol": ("symbol", ""),
    "zero size": ("size", 0),
}


@pytest.mark.parametrize("field, value", LAUNCH_CASES.values(), ids=LAUNCH_CASES.keys())
def test_launch_fields_outside_their_range_are_refused(tmp_path, field, value):
    path = tmp_path / "x.aotimg"
    make_archive(path)
    mutate(path, _set(field, value))
    with pytest.raises(ImageError, match=field) as info:
        Archive(path).header
    one_line_error(info.value, path)


def _open_for_runtime(tmp_path, **kwargs):
    spec = families.kernels()[TABLE]
    path = images.archive_path(tmp_path, "sm_90", TABLE)
    path.parent.mkdir(parents=True, exist_ok=True)
    make_archive(path, **kwargs)
    return image_loader.ImageStore([tmp_path]).archives("sm_90", spec)[0], path


def test_the_runtime_refuses_another_triton_abi_naming_both_versions(tmp_path):
    archive, _ = _open_for_runtime(tmp_path)  # the current one loads
    assert archive.header.table == TABLE
    with pytest.raises(ImageError, match=r"Triton 3\.5\.1.*Triton 3\.6") as info:
        _open_for_runtime(tmp_path / "old", triton_version="3.5.1")
    assert "aotattn build --arch sm_90 --kernel flash.dropout_mask" in one_line_error(
        info.value, images.archive_path(tmp_path / "old", "sm_90", TABLE))


def test_the_runtime_refuses_images_of_another_kernel_source_naming_both_hashes(tmp_path):
    expected = images.source_hash(families.kernels()[TABLE].module, families.kernels()[TABLE].declaration)
    with pytest.raises(ImageError, match="source") as info:
        _open_for_runtime(tmp_path, source_hash="0" * 64)
    text = info.value.args[0]
    assert "0" * 12 in text and expected[:12] in text and "aotattn build" in text and "\n" not in text
    result = cli("images", "verify", str(tmp_path))
    assert result.exit_code == 1 and expected[:12] in result.output


@pytest.mark.parametrize("change", ["an argument widened", "an alignment hint", "a knob default"])
def test_the_runtime_refuses_images_built_under_another_declaration(tmp_path, monkeypatch, change):
    """Triton kernels are untyped: argument types, hints and defaults live in the family's
    declaration (rules.py), which the kernel source's hash did not cover. An archive built
    before such a change loaded, and its binary was launched with the new argument layout."""
    import dataclasses

    spec = families.kernels()[TABLE]
    _open_for_runtime(tmp_path)  # built under today's declaration: loads
    arg = next(a for a in spec.arguments if a.type in ("i32", "i64"))
    if change == "an argument widened":
        changed = dataclasses.replace(spec, arguments=tuple(
            dataclasses.replace(a, type="i64" if a.type == "i32" else "i32") if a is arg else a for a in spec.arguments))
    elif change == "an alignment hint":
        changed = dataclasses.replace(spec, arguments=tuple(
            dataclasses.replace(a, aligned=not a.aligned) if a is arg else a for a in spec.arguments))
    else:
        changed = dataclasses.replace(spec, knob_defaults=(*spec.knob_defaults, ("NEW_KNOB", 0)))
    assert changed.declaration != spec.declaration
    with pytest.raises(ImageError, match="another version of .* or of flash.dropout_mask's declaration") as info:
        image_loader.ImageStore([tmp_path]).archives("sm_90", changed)
    assert "aotattn build --arch sm_90 --kernel flash.dropout_mask" in info.value.args[0]


def test_the_runtime_refuses_an_archive_of_another_kernel_in_its_place_saying_what_to_do(tmp_path):
    """An archive of another kernel copied into this one's place: the runtime names both and the
    command that builds the right one."""
    other = "flash.philox_words"
    path = images.archive_path(tmp_path, "sm_90", TABLE)
    path.parent.mkdir(parents=True)
    make_archive(path, names=("a",), table=other)
    with pytest.raises(ImageError, match=other) as info:
        image_loader.ImageStore([tmp_path]).archives("sm_90", families.kernels()[TABLE])
    assert f"aotattn build --arch sm_90 --kernel {TABLE}" in one_line_error(info.value, path)


def test_the_source_hash_is_computed_without_importing_triton():
    code = ("import sys; from aotattn.runtime import images; "
            "h = images.source_hash('aotattn.families.flash.kernels.forward'); "
            "print(len(h), 'triton' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["64", "False"], run.stderr[-2000:]


# --------------------------------------------------------------------------- item 7: regular files only


def test_ls_and_verify_do_not_hang_on_a_fifo(tmp_path):
    folder = tmp_path / "images" / "sm_90"
    folder.mkdir(parents=True)
    fifo = folder / "flash.attn_fwd.aotimg"
    os.mkfifo(fifo)
    make_archive(folder / f"{TABLE}.aotimg")
    results = {}

    def run():
        results["ls"] = cli("images", "ls", str(tmp_path / "images"))
        results["verify"] = cli("images", "verify", str(tmp_path / "images"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # release the blocked reader, then fail
        for _ in range(2):
            with open(fifo, "wb"):
                pass
        thread.join(10)
        pytest.fail("images ls/verify blocked on a FIFO")
    for result in results.values():
        assert result.exit_code == 1 and "not a regular file" in result.output
    assert "2 archive(s), 1 problem(s)" in results["verify"].output


def test_an_archive_above_the_size_limit_is_refused_unread(tmp_path):
    path = tmp_path / "huge.aotimg"
    with open(path, "wb") as f:
        f.truncate(images.MAX_ARCHIVE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ImageError, match="larger than") as info:
        Archive(path)
    one_line_error(info.value, path)


def test_a_link_to_dev_zero_is_refused_without_reading(tmp_path):
    """In a child with 1 GiB of address space: a reader that reads /dev/zero dies there, not here."""
    link = tmp_path / "zero.aotimg"
    link.symlink_to("/dev/zero")
    code = f"""
import importlib.util, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
spec = importlib.util.spec_from_file_location("images", {str(Path(images.__file__))!r})
module = sys.modules["images"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
try:
    module.Archive({str(link)!r})
except module.ImageError as exc:
    print("refused:", exc)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "refused:" in run.stdout and "not a regular file" in run.stdout, run.stderr[-2000:]


def test_source_hash_covers_the_sibling_modules_a_kernel_imports(tmp_path, monkeypatch):
    """A kernel split over modules: editing the shared module changes its kernels' hash."""
    package = tmp_path / "kpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "common.py").write_text("X = 1\n")
    (package / "forward.py").write_text("from kpkg.common import X\nimport os\n"
                                        "def f():\n    from .inner import (Z,\n        W)\n"
                                        "import sys; from .tail import T\n"
                                        "from . import (helpers as h,  # a module by name\n    tail)\n"
                                        "import kpkg.dotted as d, json\nfrom kpkg import byname, X as Y\n")
    for name in ("tail", "helpers", "dotted", "byname"):
        (package / f"{name}.py").write_text(f"{name.upper()} = 0\n")
    (package / "inner.py").write_text("Z = W = 0\n")
    (package / "other.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    images._kernel_sources.cache_clear()
    before = images.source_hash("kpkg.forward")
    assert set(images._kernel_sources("kpkg.forward")) == {"kpkg.forward", "kpkg.common", "kpkg.inner", "kpkg.tail",
                                                           "kpkg.helpers", "kpkg.dotted", "kpkg.byname"}
    for name in ("helpers", "dotted", "byname"):  # `from . import m`, `import pkg.m`, `from pkg import m`
        (package / f"{name}.py").write_text(f"{name.upper()} = 1\n")
        images._kernel_sources.cache_clear()
        assert images.source_hash("kpkg.forward") != before, name
        before = images.source_hash("kpkg.forward")
    (package / "inner.py").write_text("Z = W = 1\n")  # imported inside a function, relatively
    images._kernel_sources.cache_clear()
    assert images.source_hash("kpkg.forward") != before
    before = images.source_hash("kpkg.forward")
    (package / "other.py").write_text("Y = 3\n")  # not imported: no effect
    images._kernel_sources.cache_clear()
    assert images.source_hash("kpkg.forward") == before
    (package / "common.py").write_text("X = 2\n")
    images._kernel_sources.cache_clear()
    assert images.source_hash("kpkg.forward") != before


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a name inside a module, not a package
        return False


@pytest.mark.parametrize("module", sorted({spec.module for spec in families.kernels().values()}))
def test_the_import_scan_finds_what_the_parser_finds(module):
    """source_hash follows ``from ... import`` lines by a line scan (fast on the first call):
    for every kernel module it must find the sibling modules Python's parser finds."""
    package = module.rpartition(".")[0]
    parsed, pending = set(), [module]
    while pending:
        name = pending.pop()
        if name in parsed:
            continue
        parsed.add(name)
        tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_bytes())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = (importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                          if node.level else node.module)
                if target and target.startswith(package + "."):
                    pending.append(target)
                if target and (target == package or target.startswith(package + ".")):  # from . import module
                    pending += [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
            elif isinstance(node, ast.Import):
                pending += [a.name for a in node.names if a.name.startswith(package + ".")]
    assert set(images._kernel_sources(module)) == parsed


def test_the_same_kernels_in_any_order_give_the_same_bytes(tmp_path):
    """A parallel build hands kernels over as they finish: the archive must not depend on it
    (a repack then keeps every byte, and two builds of one tree are identical)."""
    spec = families.kernels()[TABLE]
    kernels = [(kernel_entry(name), b"\x7fELF" + os.urandom(200 + 37 * i)) for i, name in enumerate("dcaeb")]
    kernels.append((kernel_entry("f"), kernels[0][1]))  # a blob two entries share
    paths = []
    for n, order in enumerate([kernels, kernels[::-1], kernels[2:] + kernels[:2]]):
        paths.append(tmp_path / f"{n}.aotimg")
        write_archive(paths[-1], "sm_90", TABLE, "3.6.0", images.source_hash(spec.module, spec.declaration), order)
    assert paths[0].read_bytes() == paths[1].read_bytes() == paths[2].read_bytes()
    archive = Archive(paths[0])
    assert not archive.verify()
    by_key = {entry.key: binary for entry, binary in kernels}
    assert [archive.binary(e) for e in archive.header.entries] == [by_key[e.key] for e in archive.header.entries]
    offsets = [e.offset for e in archive.header.entries]
    assert len(set(offsets)) == 5 and sorted(set(offsets)) == sorted(set(offsets), key=offsets.index)  # key order


def test_ls_lists_the_other_archives_when_one_has_an_entry_out_of_its_schema(tmp_path):
    """``ls`` reports a bad archive and lists the others; an entry out of its schema (found
    when the whole index is checked, after the archive opened) ended the command instead."""
    folder = tmp_path / "images" / "sm_90"
    make_archive(folder / f"{TABLE}.aotimg")
    make_archive(folder / "flash.philox_words.aotimg", table="flash.philox_words")
    mutate(folder / f"{TABLE}.aotimg", lambda index: index["entries"][1].update(shared=-1))
    result = cli("images", "ls", str(tmp_path / "images"))
    assert result.exit_code == 1 and "shared is -1" in result.output
    assert "flash.philox_words" in result.output and "2 archive(s)" in result.output


@pytest.mark.parametrize("place", ["sm_80/flash.dropout_mask.aotimg", "sm_90/flash.philox_words.aotimg"])
def test_verify_reports_an_archive_copied_into_another_ones_place(tmp_path, place):
    """The runtime opens <arch>/<table>.aotimg and refuses one that holds another arch or
    kernel; ``verify``, which reports what the runtime would refuse, passed it."""
    make_archive(tmp_path / "images" / place)  # holds sm_90 / flash.dropout_mask
    result = cli("images", "verify", str(tmp_path / "images"))
    assert result.exit_code == 1 and "1 archive(s), 1 problem(s)" in result.output, result.output
    assert "holds sm_90 / flash.dropout_mask, but lies where the runtime looks for" in result.output
    make_archive(tmp_path / "elsewhere" / "kept.aotimg")  # not in an image folder's layout: nothing to compare
    assert cli("images", "verify", str(tmp_path / "elsewhere")).exit_code == 0



def test_verify_from_inside_the_arch_folder_finds_no_problem(tmp_path, monkeypatch):
    """The placement check read a relative path as typed: `verify .` inside sm_90/ (or the
    file's bare name) compared "" with the arch and reported an archive in its right place."""
    make_archive(tmp_path / "images" / "sm_90" / "flash.dropout_mask.aotimg")
    monkeypatch.chdir(tmp_path / "images" / "sm_90")
    for target in (".", "flash.dropout_mask.aotimg"):
        result = cli("images", "verify", target)
        assert result.exit_code == 0 and "0 problem(s)" in result.output, result.output


def test_a_failed_archive_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk mid-write (EFBIG here) left a 0600 temporary file beside the archives."""
    import errno
    import tempfile

    real = tempfile.NamedTemporaryFile

    class Full:
        def __init__(self, *args, **kwargs):
            self.inner = real(*args, **kwargs)
            self.name = self.inner.name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

        def write(self, data):
            raise OSError(errno.EFBIG, "File too large")

        def flush(self):
            pass

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", Full)
    with pytest.raises(OSError, match="too large"):
        make_archive(tmp_path / "sm_90" / "flash.dropout_mask.aotimg")
    assert list((tmp_path / "sm_90").iterdir()) == []
