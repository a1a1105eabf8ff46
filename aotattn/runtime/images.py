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
binaries are stored once. Reading checks the index checksum and every blob's size and
checksum: a truncated or altered archive is reported, never loaded. Nothing here imports
Triton or touches a GPU.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

MAGIC = b"AOTIMG\r\n"
VERSION = 1
_HEAD = struct.Struct("<8sIQ32s")
SUFFIX = ".aotimg"


class ImageError(Exception):
    """An archive that is malformed, truncated, altered, or lacks a kernel."""


@dataclass(frozen=True)
class Entry:
    key: str  # "functional|config|variant"
    functional: dict
    config: dict
    variant: str  # "aligned" or "generic"
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
    source_hash: str
    entries: tuple[Entry, ...]


def entry_key(functional: dict, config: dict, variant: str) -> str:
    f = ",".join(f"{k}={functional[k]}" for k in sorted(functional))
    c = ",".join(f"{k}={config[k]}" for k in sorted(config))
    return f"{f}|{c}|{variant}"


def archive_path(root: Path, arch: str, table: str) -> Path:
    return Path(root) / arch / f"{table}{SUFFIX}"


def write_archive(path: Path, arch: str, table: str, triton_version: str, source_hash: str,
                  kernels: Iterable[tuple[Entry, bytes]]) -> Header:
    """Write atomically (temporary file, then rename); blobs deduplicated by content."""
    blobs: dict[str, bytes] = {}
    entries = []
    for entry, binary in kernels:
        digest = hashlib.sha256(binary).hexdigest()
        if digest not in blobs:
            blobs[digest] = lzma.compress(binary, preset=6)
        entries.append((entry, digest, len(binary)))
    offsets, position = {}, 0
    for digest, data in blobs.items():
        offsets[digest] = position
        position += len(data)
    final = tuple(Entry(**{**asdict(e), "blob": d, "offset": offsets[d], "length": len(blobs[d]), "size": n})
                  for e, d, n in sorted(entries, key=lambda x: x[0].key))
    header = Header(arch, table, triton_version, source_hash, final)
    index = json.dumps(asdict(header), sort_keys=True, separators=(",", ":")).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as tmp:
        tmp.write(_HEAD.pack(MAGIC, VERSION, len(index), hashlib.sha256(index).digest()))
        tmp.write(index)
        for data in blobs.values():
            tmp.write(data)
    os.chmod(tmp.name, 0o644)  # NamedTemporaryFile creates 0600; an installed archive is world-readable
    os.replace(tmp.name, path)
    return header


class Archive:
    """An opened archive: its index is read and checked; blobs are read on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise ImageError(f"{self.path}: cannot read: {exc}") from exc
        if len(raw) < _HEAD.size:
            raise ImageError(f"{self.path}: truncated (no header)")
        magic, version, length, digest = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            raise ImageError(f"{self.path}: not an aotattn image archive")
        if version != VERSION:
            raise ImageError(f"{self.path}: archive format {version}, this aotattn reads {VERSION}")
        index = raw[_HEAD.size:_HEAD.size + length]
        if len(index) != length:
            raise ImageError(f"{self.path}: truncated index")
        if hashlib.sha256(index).digest() != digest:
            raise ImageError(f"{self.path}: index checksum mismatch (altered or corrupted)")
        data = json.loads(index)
        self.header = Header(**{**data, "entries": tuple(Entry(**e) for e in data["entries"])})
        self._data = memoryview(raw)[_HEAD.size + length:]
        for entry in self.header.entries:
            if entry.offset < 0 or entry.offset + entry.length > len(self._data):
                raise ImageError(f"{self.path}: truncated (blob of {entry.key} runs past the end)")
        self.entries = {e.key: e for e in self.header.entries}

    def binary(self, entry: Entry) -> bytes:
        compressed = bytes(self._data[entry.offset:entry.offset + entry.length])
        try:
            binary = lzma.decompress(compressed)
        except lzma.LZMAError as exc:
            raise ImageError(f"{self.path}: blob of {entry.key} does not decompress: {exc}") from exc
        if len(binary) != entry.size or hashlib.sha256(binary).hexdigest() != entry.blob:
            raise ImageError(f"{self.path}: blob of {entry.key} fails its checksum (altered or corrupted)")
        return binary

    def verify(self) -> list[str]:
        """Every problem found: blob checksums, and entry paths that would leave a folder."""
        problems = []
        for entry in self.header.entries:
            try:
                self.binary(entry)
            except ImageError as exc:
                problems.append(str(exc))
            if not _safe_relative(entry.file):
                problems.append(f"{self.path}: entry {entry.key} names an unsafe path {entry.file!r}")
        return problems

    def extract(self, target: Path) -> list[Path]:
        """Write each binary (and an index.json) under ``target``; never outside it."""
        target = Path(target).resolve()
        for entry in self.header.entries:
            if not _safe_relative(entry.file) or not (target / entry.file).resolve().is_relative_to(target):
                raise ImageError(f"{self.path}: entry {entry.key} would write outside {target}: {entry.file!r}")
        written = []
        for entry in self.header.entries:
            out = target / entry.file
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(self.binary(entry))
            written.append(out)
        index = target / "index.json"
        index.write_text(json.dumps(asdict(self.header), indent=1, sort_keys=True))
        return written + [index]


def _safe_relative(name: str) -> bool:
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name
