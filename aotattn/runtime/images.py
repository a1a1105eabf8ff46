"""Kernel image archives: versioned, compressed, content-addressed (docs/image-archive-format.md).

An archive holds the compiled kernels of one kernel of one family for one architecture::

    magic  b"AOTIMG\\r\\n"                        8 bytes
    version                                      u32 little-endian
    index length                                 u64
    index sha256                                 32 bytes
    index                                        JSON, UTF-8
    blobs                                        lzma-compressed kernel binaries

Each index entry names its functional, configuration and variant, the metadata a launch
needs (symbol, shared memory, warps, scratch sizes), the Triton version, and where its
blob lies; blobs are addressed by the sha256 of their uncompressed bytes, so identical
binaries are stored once.

An archive is input from outside: reading it trusts nothing. Only a regular file below
:data:`MAX_ARCHIVE_BYTES` is read; the index must match its checksum and then the schema
(exact keys, types, ranges of the launch fields, unique keys): the index's frame when the
archive is opened, each entry before it is used. A blob is inflated at most to its
declared size. Every failure is one :class:`ImageError` line naming the file. Nothing
here imports Triton or touches a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import lzma
import os
import re
import shutil
import stat
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path, PurePosixPath
from typing import Any

from aotattn import paths
from aotattn.errors import AotattnError
from aotattn.spec import VARIANTS

MAGIC = b"AOTIMG\r\n"
VERSION = 1
_HEAD = struct.Struct("<8sIQ32s")
SUFFIX = ".aotimg"
ENV_VAR = "AOTATTN_IMAGES"

# Limits the reader enforces (docs/image-archive-format.md, "Limits"). The full sm_90 set
# is about 3500 kernels in 231 MB over nine archives; its largest cubin is under 2 MB.
MAX_ARCHIVE_BYTES = 1 << 30
MAX_INDEX_BYTES = 64 << 20
MAX_ENTRIES = 100_000
MAX_KERNEL_BYTES = 64 << 20  # one uncompressed binary
MAX_SHARED_BYTES = 1 << 20  # dynamic shared memory of one launch (H100: 227 KB)
MAX_SCRATCH_BYTES = 1 << 30  # per program
MAX_THREADS = 1024  # per block, on every supported GPU
_LZMA_MEMLIMIT = 128 << 20  # the writer's preset 6 needs about 9 MiB to inflate

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")
_VERSION = re.compile(r"[0-9]+(\.[0-9A-Za-z]+)*([+-][0-9A-Za-z.+_-]*)?")  # 3.6.0, 3.6.0+git1a2b, 3.7.0-rc1
_SHA256 = re.compile(r"[0-9a-f]{64}")
_VARIANTS = tuple(VARIANTS)
_BINARIES = ("cubin", "hsaco")


class ImageError(AotattnError):
    """An archive that is malformed, truncated, altered, hostile, stale, or lacks a kernel."""


class ImageMissing(ImageError):
    """No image of a kernel: no archive for its architecture and kernel, or none that holds
    it. The only image error the default mode falls back from (to Triton's JIT); a damaged,
    stale or refused archive stays an error.

    ``arch``, ``table``: whose image is missing; ``command``: the ``aotattn build`` command
    that makes it.
    """

    def __init__(self, message: str, arch: str = "", table: str = "", command: str = ""):
        super().__init__(message)
        self.arch, self.table, self.command = arch, table, command


@dataclass(frozen=True)
class Entry:
    key: str  # "functional|config|variant"
    functional: dict
    config: dict
    variant: str  # a spec.VARIANTS name: "aligned", "aligned8" or "generic"
    symbol: str
    shared: int
    num_warps: int
    warp_size: int
    global_scratch_size: int
    global_scratch_align: int
    profile_scratch_size: int
    binary: str  # "cubin" or "hsaco"
    file: str  # relative path used by `aotattn images extract`
    blob: str  # sha256 of the uncompressed binary
    offset: int = 0
    length: int = 0  # compressed bytes
    size: int = 0  # uncompressed bytes


@dataclass(frozen=True)
class Header:
    arch: str
    table: str  # "family.kernel"
    triton_version: str
    source_hash: str  # source_hash() of the kernel's module when it was compiled
    entries: tuple[Entry, ...]


def images_root() -> Path:
    """Where ``aotattn build`` writes: ``$AOTATTN_IMAGES``, else the checkout's ``images/``,
    else the user's cache (``~/.cache/aotattn/images``); see :mod:`aotattn.paths`."""
    return Path(os.environ.get(ENV_VAR) or paths.default_images()).expanduser()  # no shell expands it in a unit file


def image_roots() -> list[Path]:
    """Where the runtime and ``aotattn images`` look, in order: ``$AOTATTN_IMAGES`` alone
    when it is set; else :func:`images_root`, then the images installed with the package
    (a wheel built to carry them)."""
    if os.environ.get(ENV_VAR):
        return [Path(os.environ[ENV_VAR]).expanduser()]
    packaged = paths.package_data(paths.IMAGES)
    return [paths.default_images()] + ([packaged] if packaged is not None else [])


def entry_key(functional: dict, config: dict, variant: str) -> str:
    f = ",".join(f"{k}={functional[k]}" for k in sorted(functional))
    c = ",".join(f"{k}={config[k]}" for k in sorted(config))
    return f"{f}|{c}|{variant}"


def archive_path(root: Path, arch: str, table: str) -> Path:
    return Path(root) / arch / f"{table}{SUFFIX}"


def source_hash(module: str, declaration: str = "") -> str:
    """SHA-256 of the kernel module's source and of the modules of its own package it
    imports from (a family's shared kernel code), found without importing them (so
    without Triton), and of the kernel's ``declaration`` (``KernelSpec.declaration``: the
    argument types, hints and defaults the host code packs by, which the untyped kernel
    source does not show): what an archive records, and what the runtime compares."""
    digest = hashlib.sha256()
    for name, path in sorted(_kernel_sources(module).items()):
        digest.update(f"{name}\0".encode())
        digest.update(path.read_bytes())
    if declaration:
        digest.update(b"\0declaration\0" + declaration.encode())
    return digest.hexdigest()


# ``from <module> import`` at the start of a line or after a ``;`` (a function's own
# imports too): the import statements source_hash follows. A line scan, not ast.parse:
# parsing the Gluon kernel modules took 10-20 ms of a process's first call on the H200.
# A docstring line that reads like an import only adds that module's file to the hash.
_FROM_IMPORT = re.compile(rb"(?:^|;)[ \t]*from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]*(\([^)]*\)|[^\n;#]*)",
                          re.MULTILINE)
_IMPORT = re.compile(rb"(?:^|;)[ \t]*import[ \t]+([^\n;#]+)", re.MULTILINE)  # import pkg.mod [as m], ...


def _imported(names: bytes) -> list[str]:
    """The dotted names of an import list (``a as b, (c,\n d)``), aliases dropped."""
    text = names.decode(errors="replace").strip().strip("()").replace("\\\n", " ")
    return [part.split()[0] for part in text.split(",") if part.split()]


@functools.cache
def _kernel_sources(module: str) -> dict[str, Path]:
    """``module``'s source file and, transitively, those of the sibling modules it imports from."""
    package = module.rpartition(".")[0]
    sources: dict[str, Path] = {}
    pending = [module]
    found = importlib.util.find_spec(module)
    root = Path(found.origin).parent if found is not None and found.origin else Path()  # the package's folder
    while pending:
        name = pending.pop()
        if name in sources:
            continue
        found = importlib.util.find_spec(name)
        if found is None or not found.origin or not os.path.isfile(found.origin):
            raise ImageError(f"cannot find the source of kernel module {name}")
        sources[name] = Path(found.origin)
        text = sources[name].read_bytes()
        for dots, target, names in _FROM_IMPORT.findall(text):
            target = target.decode()
            if dots:
                target = importlib.util.resolve_name(dots.decode() + target, package)
            if target.startswith(package + "."):
                pending.append(target)
            if target == package or target.startswith(package + "."):  # `from . import common`: a module
                folder = root.joinpath(*target[len(package):].split(".")[1:])
                pending += [f"{target}.{n}" for n in _imported(names)
                            if (folder / f"{n}.py").is_file() or (folder / n / "__init__.py").is_file()]
        for names in _IMPORT.findall(text):
            pending += [n for n in _imported(names) if n.startswith(package + ".")]
    return sources


def triton_abi(version: str) -> str:
    """``major.minor`` of a Triton version: what decides a compiled kernel's argument layout."""
    return ".".join(version.split(".")[:2])


@dataclass(frozen=True)
class Packed:
    """A kernel binary as an archive stores it: ``data`` compressed (xz), ``blob`` the
    sha256 of the uncompressed bytes, ``size`` their length. Compressing is the slow part
    of packing (about 0.1 s for a 300 KB cubin), so the build does it in its compiler
    processes, and an archive rewritten with more kernels keeps the ones it had as they are."""

    blob: str
    size: int
    data: bytes

    @classmethod
    def of(cls, binary: bytes) -> "Packed":
        return cls(hashlib.sha256(binary).hexdigest(), len(binary), lzma.compress(binary, preset=6))

    def check(self, what: str) -> None:
        """Inflate and compare with the checksum (ImageError naming ``what`` if it fails)."""
        _inflate(self.data, self.size, self.blob, what)


def write_archive(path: Path, arch: str, table: str, triton_version: str, source_hash: str,
                  kernels: Iterable[tuple[Entry, bytes | Packed]]) -> Header:
    """Write atomically (temporary file, then rename); blobs deduplicated by content.

    ``kernels``: each entry with its binary, as bytes or already :class:`Packed`. Entries
    and blobs go in key order, so the same kernels give the same bytes whatever order they
    come in (a parallel build hands them over as they finish compiling)."""
    entries = sorted(((entry, binary if isinstance(binary, Packed) else Packed.of(binary))
                      for entry, binary in kernels), key=lambda x: x[0].key)
    blobs: dict[str, bytes] = {}
    for _, packed in entries:
        blobs.setdefault(packed.blob, packed.data)
    offsets, position = {}, 0
    for digest, data in blobs.items():
        offsets[digest] = position
        position += len(data)
    final = tuple(Entry(**{**asdict(e), "blob": p.blob, "offset": offsets[p.blob], "length": len(blobs[p.blob]),
                           "size": p.size}) for e, p in entries)
    header = Header(arch, table, triton_version, source_hash, final)
    index = _canonical(asdict(header))
    _header_from_json(json.loads(index), str(path), position)  # never write what the reader refuses
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.NamedTemporaryFile(dir=path.parent, delete=False)
    except OSError as exc:  # named the temporary file, and said nothing of what to do
        raise ImageError(f"cannot write {path}: {exc.strerror}: make {path.parent} writable, or write the images "
                         f"elsewhere (--out, or {ENV_VAR})") from None
    with tmp:
        try:
            tmp.write(_HEAD.pack(MAGIC, VERSION, len(index), hashlib.sha256(index).digest()))
            tmp.write(index)
            for data in blobs.values():
                tmp.write(data)
            tmp.flush()
            os.chmod(tmp.name, 0o644)  # NamedTemporaryFile creates 0600; an installed archive is world-readable
            os.replace(tmp.name, path)
        except BaseException:  # a full disk or an interrupt: no half-written file left beside the archives
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)
            raise
    return header


# ----------------------------------------------------------------------------- reading


def _read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; anything else is refused
    unread (a FIFO would block, a device never ends). Links to regular files are followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageError(f"{path}: not a regular file: an archive is a plain file")
        if info.st_size > limit:
            raise ImageError(f"{path}: larger than the {limit >> 20} MiB an archive may be")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise ImageError(f"{path}: cannot read: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise ImageError(f"{path}: larger than the {limit >> 20} MiB an archive may be")
    return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _canonical(data: Any) -> bytes:
    """The index exactly as :func:`write_archive` writes it."""
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _parse_index(index: bytes, where: str) -> Any:
    try:
        text = index.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ImageError(f"{where}: the index is not UTF-8 (byte {exc.start}): the archive is damaged") from None
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ImageError(f"{where}: the index nests too deeply: the archive is damaged or hostile") from None
    except ValueError as exc:  # JSONDecodeError included
        raise ImageError(f"{where}: the index is not valid JSON ({exc}): the archive is damaged") from None


_ENTRY_FIELDS = tuple(f.name for f in fields(Entry))
_ENTRY_KEYS = frozenset(_ENTRY_FIELDS)
_HEADER_FIELDS = tuple(f.name for f in fields(Header))
_STR_FIELDS = tuple(name for name, kind in Entry.__annotations__.items() if kind == "str")
_SCALARS = (str, int, bool)

# integer field of an entry, lowest and highest accepted value
_INT_BOUNDS = (
    ("shared", 0, MAX_SHARED_BYTES),
    ("num_warps", 1, MAX_THREADS // 32),
    ("warp_size", 32, 64),
    ("global_scratch_size", 0, MAX_SCRATCH_BYTES),
    ("global_scratch_align", 1, 1 << 16),
    ("profile_scratch_size", 0, MAX_SCRATCH_BYTES),
    ("offset", 0, MAX_ARCHIVE_BYTES),
    ("length", 1, MAX_ARCHIVE_BYTES),
    ("size", 1, MAX_KERNEL_BYTES),
)
_checked_names: set[str] = set()  # names in functionals and configs already matched against _NAME


def _object(value: Any, keys: tuple[str, ...], what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is a {type(value).__name__}, expected an object")
    missing = [k for k in keys if k not in value]
    extra = sorted(set(value) - set(keys))
    if missing or extra:
        raise ValueError(f"{what}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown key(s) {', '.join(extra)}"] if extra
                                                                      else [])))
    return value


def _names(mapping: dict) -> bool:
    if _checked_names.issuperset(mapping):
        return True
    if not all(isinstance(k, str) and _NAME.fullmatch(k) for k in mapping):
        return False
    _checked_names.update(mapping)
    return True


def _entry_from_json(raw: Any, what: str, data_size: int) -> Entry:
    """One entry, checked field by field against the schema."""
    if type(raw) is not dict or raw.keys() != _ENTRY_KEYS:
        _object(raw, _ENTRY_FIELDS, what)
    for name, lo, hi in _INT_BOUNDS:
        value = raw[name]
        if type(value) is not int or not lo <= value <= hi:
            raise ValueError(f"{what}: {name} is {value!r}, expected an integer {lo}..{hi}")
    for name in _STR_FIELDS:
        if type(raw[name]) is not str:
            raise ValueError(f"{what}: {name} is {raw[name]!r}, expected a string")
    for name in ("functional", "config"):
        mapping = raw[name]
        if type(mapping) is not dict or not _names(mapping) or not all(type(v) in _SCALARS for v in mapping.values()):
            raise ValueError(f"{what}: {name} must map names to strings, integers or booleans")
    entry = Entry(**raw)
    if entry.variant not in _VARIANTS:
        raise ValueError(f"{what}: variant is {entry.variant!r}, expected one of {', '.join(_VARIANTS)}")
    if entry.binary not in _BINARIES:
        raise ValueError(f"{what}: binary is {entry.binary!r}, expected one of {', '.join(_BINARIES)}")
    if not _NAME.fullmatch(entry.symbol):
        raise ValueError(f"{what}: symbol {entry.symbol!r} is not a kernel name")
    if not _SHA256.fullmatch(entry.blob):
        raise ValueError(f"{what}: blob {entry.blob!r} is not a SHA-256 in hex")
    if entry.warp_size not in (32, 64):
        raise ValueError(f"{what}: warp_size is {entry.warp_size}, expected 32 or 64")
    if entry.num_warps * entry.warp_size > MAX_THREADS:
        raise ValueError(f"{what}: num_warps {entry.num_warps} x warp_size {entry.warp_size} exceeds "
                         f"{MAX_THREADS} threads")
    if entry.global_scratch_align & (entry.global_scratch_align - 1):
        raise ValueError(f"{what}: global_scratch_align is {entry.global_scratch_align}, expected a power of two")
    expected = entry_key(entry.functional, entry.config, entry.variant)
    if entry.key != expected:
        raise ValueError(f"{what}: key {entry.key!r} does not spell its functional, config and variant "
                         f"({expected!r})")
    if entry.offset + entry.length > data_size:
        raise ValueError(f"truncated: the blob of {entry.key} runs past the end")
    return entry


def _frame(data: Any, data_size: int) -> dict[str, Any]:
    """The index's own fields checked, and its entries by key: each an object with a string
    ``key``, every key once (which of two would load is undefined), its blob inside the
    file (a truncated archive is refused when opened). Raises ValueError."""
    _object(data, _HEADER_FIELDS, "the index")
    for name in _HEADER_FIELDS[:-1]:
        if not isinstance(data[name], str):
            raise ValueError(f"the index: {name} is {data[name]!r}, expected a string")
    if not _NAME.fullmatch(data["arch"]) or not _TABLE.fullmatch(data["table"]):
        raise ValueError(f"the index names arch {data['arch']!r} / table {data['table']!r}")
    # printed by `images ls` and in errors: a control character there would reach the terminal
    if not _VERSION.fullmatch(data["triton_version"]) or not _SHA256.fullmatch(data["source_hash"]):
        raise ValueError(f"the index gives triton_version {data['triton_version']!r} / source_hash "
                         f"{data['source_hash']!r}, expected a version like 3.6.0 and a SHA-256 in hex")
    entries = data["entries"]
    if not isinstance(entries, list) or len(entries) > MAX_ENTRIES:
        raise ValueError(f"the index: entries must be a list of at most {MAX_ENTRIES}")
    by_key: dict[str, Any] = {}
    for i, raw in enumerate(entries):
        if type(raw) is not dict or type(raw.get("key")) is not str:
            raise ValueError(f"entry {i} is not an object with a string key")
        if by_key.setdefault(raw["key"], raw) is not raw:
            raise ValueError(f"key {raw['key']!r} is given twice (which one would load is undefined)")
        offset, length = raw.get("offset"), raw.get("length")
        if type(offset) is int and type(length) is int and offset + length > data_size:
            raise ValueError(f"truncated: the blob of {raw['key']} runs past the end")
    return by_key


REBUILD = "rebuild it with aotattn build"  # what to do about a damaged archive


def _refuse(where: str, exc: ValueError) -> ImageError:
    return ImageError(f"{where}: {exc}: the archive is damaged or hostile; {REBUILD}")


def _header_from_json(data: Any, where: str, data_size: int) -> Header:
    """The whole index, checked against the schema of docs/image-archive-format.md."""
    try:
        _frame(data, data_size)
        entries = tuple(_entry_from_json(e, f"entry {i}", data_size) for i, e in enumerate(data["entries"]))
    except ValueError as exc:
        raise _refuse(where, exc) from None
    return Header(data["arch"], data["table"], data["triton_version"], data["source_hash"], entries)


def _file_name_writable(name: str) -> bool:
    """Whether a file system takes the name: UTF-8 (a lone surrogate is not) and no part
    longer than 255 bytes."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return all(len(part) <= 255 for part in encoded.split(b"/"))


def _file_problems(entries: Iterable[Entry]) -> list[str]:
    """Why ``extract`` would refuse these entry paths: unsafe names, repeats, a name that is
    both a file and a folder, or the index's own name."""
    problems, names = [], {}
    for entry in entries:
        name = entry.file
        path = PurePosixPath(name)
        if (not name or len(name) > 1024 or any(ord(c) < 32 for c in name) or "\\" in name or path.is_absolute()
                or path.as_posix() != name or any(part in ("", ".", "..") for part in name.split("/"))
                or not _file_name_writable(name)):
            problems.append(f"entry {entry.key} names an unsafe path {name!r} (extract writes only plain relative "
                            "paths inside its folder)")
        elif name == "index.json":
            problems.append(f"entry {entry.key} is named index.json, which extract writes itself")
        elif name in names:
            problems.append(f"entry {entry.key} names the same file {name!r} as entry {names[name]}")
        else:
            names[name] = entry.key
    for name, key in names.items():
        for parent in PurePosixPath(name).parents:
            if parent.as_posix() in names:
                problems.append(f"{parent.as_posix()!r} is both a file and a folder (of {name!r}, entry {key})")
    return problems


class Archive:
    """An opened archive.

    Opening reads the file, checks the checksum and the index's frame (its own fields, the
    entry list, unique keys); each entry is checked in full against the schema before it
    is used (:meth:`entry`), all of them by :attr:`header` (``ls``, ``verify``,
    ``extract``, the build). The runtime, which loads one kernel of an archive of a
    thousand, so pays for one entry's check. Blobs are read on demand.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        raw = _read_regular_file(self.path, MAX_ARCHIVE_BYTES)
        if len(raw) < _HEAD.size:
            raise ImageError(f"{self.path}: truncated (no header): {REBUILD}")
        magic, version, length, digest = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            raise ImageError(f"{self.path}: not an aotattn image archive: remove it, or {REBUILD}")
        if version != VERSION:
            raise ImageError(f"{self.path}: archive format {version}, this aotattn reads {VERSION}: rebuild it with "
                             "aotattn build")
        if length > MAX_INDEX_BYTES:
            raise ImageError(f"{self.path}: an index of {length} bytes, above the {MAX_INDEX_BYTES >> 20} MiB limit")
        index = raw[_HEAD.size:_HEAD.size + length]
        if len(index) != length:
            raise ImageError(f"{self.path}: truncated index: {REBUILD}")
        if hashlib.sha256(index).digest() != digest:
            raise ImageError(f"{self.path}: index checksum mismatch (altered or corrupted): {REBUILD}")
        self._data = memoryview(raw)[_HEAD.size + length:]
        self._index_bytes = index
        self._index = _parse_index(index, str(self.path))
        try:
            self._raw = _frame(self._index, len(self._data))
        except ValueError as exc:
            raise _refuse(str(self.path), exc) from None
        self.arch: str = self._index["arch"]
        self.table: str = self._index["table"]
        self.triton_version: str = self._index["triton_version"]
        self.source_hash: str = self._index["source_hash"]
        self._entries: dict[str, Entry] = {}

    def entry(self, key: str) -> Entry | None:
        """The entry with this key, checked in full (ImageError), or None."""
        entry = self._entries.get(key)
        if entry is None:
            raw = self._raw.get(key)
            if raw is None:
                return None
            try:
                entry = _entry_from_json(raw, f"entry {key}", len(self._data))
            except ValueError as exc:
                raise _refuse(str(self.path), exc) from None
            self._entries[key] = entry
        return entry

    @functools.cached_property
    def header(self) -> Header:
        """The whole index, every entry checked, and the index byte for byte what the writer
        writes (so no key is given twice in one object, where parsers disagree)."""
        header = _header_from_json(self._index, str(self.path), len(self._data))
        if _canonical(self._index) != self._index_bytes:
            raise ImageError(f"{self.path}: the index is not in the canonical form aotattn writes (sorted keys, "
                             "each once, no spaces, ASCII): the archive was altered; rebuild it with aotattn build")
        return header

    def binary(self, entry: Entry) -> bytes:
        """The entry's binary, inflated at most to its declared size and checked."""
        return _inflate(self._data[entry.offset:entry.offset + entry.length], entry.size, entry.blob,
                        f"{self.path}: blob of {entry.key}")

    def packed(self, entry: Entry) -> Packed:
        """The entry's binary as stored (checked by inflating it), to write into another archive."""
        self.binary(entry)
        return Packed(entry.blob, entry.size, bytes(self._data[entry.offset:entry.offset + entry.length]))

    def verify(self) -> list[str]:
        """Every problem found: blob checksums, and entry paths ``extract`` would refuse."""
        problems = []
        for entry in self.header.entries:
            try:
                self.binary(entry)
            except ImageError as exc:
                problems.append(str(exc))
        problems += [f"{self.path}: {problem}" for problem in _file_problems(self.header.entries)]
        return problems

    def extract(self, target: Path) -> list[Path]:
        """Write each binary (and an index.json) into ``target``, a new or empty folder.

        Everything is written into a fresh staging folder beside ``target`` (no link can be
        there), each binary checked, and the folder renamed into place at the end (into an
        existing empty ``target``, its contents moved in: the folder itself, its mode, owner
        and inode, stays): on any failure nothing is left, and nothing outside ``target`` is
        ever written.
        """
        problems = _file_problems(self.header.entries)
        if problems:
            raise ImageError(f"{self.path}: {problems[0]}" + (f" (and {len(problems) - 1} more problem(s))"
                                                               if len(problems) > 1 else ""))
        target = Path(os.path.abspath(target))
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise ImageError(f"{self.path}: {target} is not a folder: extract into a new or empty folder")
        if target.is_dir() and any(target.iterdir()):
            raise ImageError(f"{self.path}: {target} is not empty: extract into a new or empty folder")
        created = [p for p in reversed(target.parents) if not p.exists()]
        staging = None
        moved: list[Path] = []
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            for entry in self.header.entries:
                out = staging / entry.file
                out.parent.mkdir(parents=True, exist_ok=True)
                _write_new(out, self.binary(entry))
            _write_new(staging / "index.json", json.dumps(asdict(self.header), indent=1, sort_keys=True).encode())
            if target.is_dir():  # the user's empty folder (the shell's own, maybe): fill it, keep it
                for child in sorted(staging.iterdir()):
                    os.rename(child, target / child.name)
                    moved.append(target / child.name)
                staging.rmdir()
            else:
                os.chmod(staging, 0o755)
                os.rename(staging, target)  # never follows a link
        except BaseException as exc:
            for path in moved:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            for folder in reversed(created):
                try:
                    folder.rmdir()
                except OSError:
                    pass
            if isinstance(exc, OSError):
                raise ImageError(f"{self.path}: cannot extract into {target}: {exc}") from None
            raise
        return [target / e.file for e in self.header.entries] + [target / "index.json"]


def _inflate(data: bytes | memoryview, size: int, blob: str, what: str) -> bytes:
    """``data`` inflated at most to ``size`` bytes, which must hash to ``blob``; ``what``
    names it in the ImageError otherwise."""
    inflater = lzma.LZMADecompressor(format=lzma.FORMAT_XZ, memlimit=_LZMA_MEMLIMIT)
    try:
        binary = inflater.decompress(data, max_length=size + 1)
    except lzma.LZMAError as exc:
        raise ImageError(f"{what} does not decompress: {exc}: {REBUILD}") from None
    if len(binary) > size:
        raise ImageError(f"{what} inflates past its declared size of {size} bytes (altered or hostile): {REBUILD}")
    if not inflater.eof or inflater.unused_data:
        raise ImageError(f"{what} {'ends early' if not inflater.eof else 'carries trailing data'} (altered or "
                         f"corrupted): {REBUILD}")
    if len(binary) != size or hashlib.sha256(binary).hexdigest() != blob:
        raise ImageError(f"{what} fails its checksum (altered or corrupted): {REBUILD}")
    return binary


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
