"""The performance database: ``perfdb/<arch>/<tag>.txt``, one file per run, committed.

A file reads top to bottom as: header directives (what was measured with what), the
entries (each declared call with its sizes), then one result line per entry, pass and
provider::

    #! aotattn-perfdb 1
    #! tag h200-seeded
    #! arch sm_90
    #! aotattn 0.1.0
    #! tuning sha256:3f0c9a7b12de4c55 (tuning/nvidia/sm_90: 9 tables, 0 patches)
    #! triton 3.6.0
    ...

    [entries]
    dense-bf16-d128-s4096-causal  group=dense dtype=bf16 B=4 Hq=16 Hk=16 Sq=4096 Sk=4096 D=128 Dv=128 ...

    [results]
    # entry                                  pass    provider        ms        spread%  TFLOP/s   aot/x  note
    dense-bf16-d128-s4096-causal       bwd     aotattn         2.540     0.4      270.6     1.000  choice=split ...

``ms`` is the median, ``spread%`` the run-to-run spread (largest minus smallest of the
round medians) in percent of it, ``aot/x`` the provider's time over aotattn's unforced
time (above 1: aotattn is faster). A provider that could not run, or whose result was
wrong, has ``-`` figures and says why in its note. Files are written atomically and in a
canonical order, so two runs diff line by line.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aotattn.files import write_atomically
from aotattn.perfmon.entries import Entry, check_name
from aotattn.perfmon.providers import ALL as _PROVIDERS

FORMAT_VERSION = 1
ENV_VAR = "AOTATTN_PERFDB"
PROJECT_ROOT = Path(__file__).resolve().parents[2] / "perfdb"
ARCH_FOLDER = re.compile(r"sm_\d+|gfx[0-9a-f]+|cpu")  # the store's folders: perfdb/<arch>/<tag>.txt
HEADER_KEYS = ("tag", "arch", "aotattn", "tuning", "triton", "torch", "gpu", "date", "mode", "timing", "command")
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_COLUMNS = ("entry", "pass", "provider", "ms", "spread%", "TFLOP/s", "aot/x", "note")
_WIDTHS = (44, 7, 16, 10, 8, 9, 7)
MISSING = "-"


class PerfdbError(ValueError):
    """A perfdb file or tag that cannot be used; ``where`` is ``path:line`` when known."""

    def __init__(self, message: str, where: str | None = None):
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


@dataclass(frozen=True)
class Record:
    """One provider's figures for one pass of one entry; figures None when it did not run."""

    entry: str
    pass_: str
    provider: str
    ms: float | None = None
    spread_ms: float | None = None
    tflops: float | None = None
    ratio: float | None = None  # this provider's ms / aotattn's unforced ms
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.ms is not None

    @property
    def key(self) -> tuple[str, str, str]:
        return self.entry, self.pass_, self.provider

    def notes(self) -> dict[str, str]:
        """The note's ``key=value`` tokens (``choice``, ``cell``, ``configs``, ...)."""
        return dict(token.split("=", 1) for token in self.note.split() if "=" in token)


@dataclass
class Perfdb:
    """One run: header, the entries it measured, and their records."""

    header: dict[str, str] = field(default_factory=dict)
    entries: dict[str, Entry] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    # where each directive ("#! arch": "arch") and each record (its key) was read: line numbers
    lines: dict[str | tuple[str, str, str], int] = field(default_factory=dict, compare=False, repr=False)

    def by_key(self) -> dict[tuple[str, str, str], Record]:
        return {r.key: r for r in self.records}

    def add(self, entry: Entry, records: Iterable[Record]) -> None:
        try:
            check_name(entry.name)  # a name read as a comment: the file would silently lose the entry
        except ValueError as exc:
            raise PerfdbError(str(exc)) from None
        self.entries[entry.name] = entry
        self.records.extend(records)

    # ------------------------------------------------------------------ text
    def to_text(self) -> str:
        lines = [f"#! aotattn-perfdb {FORMAT_VERSION}"]
        for key in HEADER_KEYS:
            if key in self.header:
                lines.append(f"#! {key} {self.header[key]}")
        for key in sorted(set(self.header) - set(HEADER_KEYS)):
            lines.append(f"#! {key} {self.header[key]}")
        lines += [f"# {c}" if c else "#" for c in self.comments]
        lines += ["", "[entries]"]
        width = max((len(n) for n in self.entries), default=0)
        for name, entry in self.entries.items():
            lines.append(f"{name:<{width}}  {entry.describe()}")
        lines += ["", "[results]", _row(("# " + _COLUMNS[0], *_COLUMNS[1:]))]
        order = {name: i for i, name in enumerate(self.entries)}
        for r in sorted(self.records, key=lambda r: (order.get(r.entry, len(order)), _pass_order(r.pass_),
                                                     _provider_order(r.provider))):
            lines.append(_row((r.entry, r.pass_, r.provider, _num(r.ms, ".4g"),
                               _num(None if r.ms is None or r.spread_ms is None else 100 * r.spread_ms / r.ms, ".1f"),
                               _num(r.tflops, ".4g"), _num(r.ratio, ".3f"), r.note)))
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str, path: str = "<perfdb>") -> "Perfdb":
        db = cls()
        section = None
        seen: set[tuple[str, str, str]] = set()
        if not text.strip():
            raise PerfdbError(f"an empty file: expected '#! aotattn-perfdb {FORMAT_VERSION}' on the first line",
                              f"{path}:1")
        for number, raw in enumerate(text.splitlines(), start=1):
            where = f"{path}:{number}"
            line = raw.rstrip()
            if number == 1:
                if line != f"#! aotattn-perfdb {FORMAT_VERSION}":
                    raise PerfdbError(f"expected '#! aotattn-perfdb {FORMAT_VERSION}' on the first line", where)
                continue
            if line.startswith("#!"):
                if section is not None:
                    raise PerfdbError("header directives come before [entries]", where)
                key, _, value = line[2:].strip().partition(" ")
                if key not in HEADER_KEYS:
                    raise PerfdbError(f"unknown directive {'#! ' + key if key else '#!'!r} (a perfdb header has "
                                      f"{', '.join(HEADER_KEYS)})", where)
                if key in db.header:
                    raise PerfdbError(f"directive '#! {key}' given twice", where)
                if not value.strip():  # an empty arch was checked against the folder as "" ("move it to /")
                    raise PerfdbError(f"directive '#! {key}' has no value: write '#! {key} VALUE' or drop the line",
                                      where)
                db.header[key] = value.strip()
                db.lines[key] = number
                continue
            if not line.strip():
                continue
            if line.startswith("#"):
                if section is None:
                    db.comments.append(line[2:] if line.startswith("# ") else line[1:])
                continue
            if line in ("[entries]", "[results]"):
                if line[1:-1] == section or (section == "results" and line == "[entries]"):
                    raise PerfdbError(f"{line} again: a perfdb file has one [entries] then one [results]", where)
                if section is None and line == "[results]":  # a run with no entries still has its section
                    raise PerfdbError("[results] before [entries]: a perfdb file has one [entries] then one "
                                      "[results]", where)
                section = line[1:-1]
                continue
            if section == "entries":
                name, _, rest = line.partition(" ")
                if name in db.entries:
                    raise PerfdbError(f"entry {name} declared twice", where)
                try:
                    db.entries[name] = Entry.parse(name, rest)
                except ValueError as exc:
                    raise PerfdbError(str(exc), where) from exc
            elif section == "results":
                record = _parse_record(line, where)
                if record.entry not in db.entries:
                    raise PerfdbError(f"result for undeclared entry {record.entry}", where)
                passes = db.entries[record.entry].passes
                if record.pass_ not in passes:
                    raise PerfdbError(f"pass {record.pass_!r}: entry {record.entry} declares passes "
                                      f"{','.join(passes)}", where)
                if record.key in seen:
                    raise PerfdbError(f"two results for {' / '.join(record.key)}", where)
                seen.add(record.key)
                db.records.append(record)
                db.lines[record.key] = number
            else:
                raise PerfdbError(f"expected [entries] or [results] before {line[:40]!r}", where)
        if section != "results":
            raise PerfdbError("no [results] section: the file is cut short (measure it again, or restore it from "
                              "git)", f"{path}:{number}")
        return db

    @classmethod
    def read(cls, path: Path | str) -> "Perfdb":
        path = Path(path)
        if not path.is_file():
            raise PerfdbError(f"no perfdb file {path}: run `aotattn perfmon run --tag {path.stem}` to make it")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise PerfdbError(f"not UTF-8 text (byte {exc.start}): a perfdb file is text written by "
                              "`aotattn perfmon run`; restore it from git or measure it again", str(path)) from exc
        db = cls.from_text(text, str(path))
        db._check_folder(path, str(path))
        return db

    def _check_folder(self, path: Path, shown: str) -> None:
        """:func:`check_folder`, at the ``#! arch`` line as read (``shown``: the text's name)."""
        line = self.lines.get("arch")
        check_folder(path, self.header.get("arch"), f"{shown}:{line}" if line else None)

    def checked_text(self, path: Path | str) -> str:
        """The text :meth:`write` writes to ``path``, refused unless it reads back as this run
        (a name with a space, a note with a newline or an entry named like a comment, say,
        from another host's results): call it before measuring, as a run would only find out
        at its first write."""
        text = self.to_text()
        try:
            again = Perfdb.from_text(text, "<the text to write>")
            again._check_folder(Path(path), "<the text to write>")
        except PerfdbError as exc:
            raise PerfdbError(f"not written, it would not read back: {exc}", str(path)) from None
        back = again.to_text()
        if back != text:  # read without an error, yet not the same run (a line read as a comment)
            number, ours, theirs = next((n, a, b) for n, (a, b) in enumerate(
                zip([*text.splitlines(), ""], [*back.splitlines(), ""]), start=1) if a != b)
            raise PerfdbError(f"not written, it would not read back: line {number} {ours[:60]!r} reads back as "
                              f"{theirs[:60]!r}", str(path))
        return text

    def write(self, path: Path | str) -> Path:
        """Write atomically (a temporary file, then a rename) what :meth:`read` reads back as
        this run (:meth:`checked_text`), or nothing."""
        path = Path(path)
        text = self.checked_text(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_atomically(path, text)


def _row(cells) -> str:
    """Columns padded to fixed widths (stable across runs, so diffs stay line by line)."""
    return " ".join(cell.ljust(_WIDTHS[i]) if i < len(_WIDTHS) else cell
                    for i, cell in enumerate(map(str, cells))).rstrip()


def _num(value: float | None, spec: str) -> str:
    if value is None:
        return MISSING
    return format(value, spec)


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.ASCII | re.IGNORECASE)


def _parse_float(token: str, what: str, where: str, positive: bool = False) -> float | None:
    if token == MISSING:
        return None
    try:
        if not _NUMBER.fullmatch(token):  # float() also reads "0_3633" (3633) and other scripts' digits
            raise ValueError(token)
        value = float(token)
    except ValueError as exc:
        raise PerfdbError(f"{what}: expected a number or '-', got {token!r}", where) from exc
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise PerfdbError(f"{what}: expected a finite {'positive' if positive else 'non-negative'} number, "
                          f"got {token!r}", where)
    return value


def _parse_record(line: str, where: str) -> Record:
    parts = line.split(None, 7)
    if len(parts) < 7:
        raise PerfdbError(f"a result line has 7 columns and a note ({' '.join(_COLUMNS)}), got {len(parts)}", where)
    entry, pass_, provider, ms, spread, tflops, ratio = parts[:7]
    note = parts[7] if len(parts) > 7 else ""
    ms_v = _parse_float(ms, "ms", where, positive=True)
    spread_v = _parse_float(spread, "spread%", where)
    if ms_v is None and spread_v is not None:
        raise PerfdbError(f"spread%: expected '-' where ms is '-', got {spread!r}", where)
    return Record(entry, pass_, provider, ms_v, None if ms_v is None or spread_v is None else ms_v * spread_v / 100,
                  _parse_float(tflops, "TFLOP/s", where), _parse_float(ratio, "aot/x", where), note)


_PASS_ORDER = ("fwd", "bwd", "fwdbwd")
_PROVIDER_ORDER = _PROVIDERS  # the providers' declaration order (a list here left aotattn:ws out, after flex)


def _pass_order(name: str) -> tuple[int, str]:
    return (_PASS_ORDER.index(name) if name in _PASS_ORDER else len(_PASS_ORDER), name)


def _provider_order(name: str) -> tuple[int, str]:
    return (_PROVIDER_ORDER.index(name) if name in _PROVIDER_ORDER else len(_PROVIDER_ORDER), name)


# ---------------------------------------------------------------------------- where files live

def root() -> Path:
    """``AOTATTN_PERFDB`` or the project's ``perfdb/``."""
    return Path(os.environ.get(ENV_VAR) or PROJECT_ROOT)


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG.match(tag):
        raise PerfdbError(f"tag: expected letters, digits, '.', '_' or '-' (not starting with a symbol), got {tag!r}")
    return tag


def check_folder(path: Path, arch: str | None, where: str | None = None) -> None:
    """A file in a store folder named like an architecture is that architecture's run."""
    folder = Path(path).absolute().parent.name
    if ARCH_FOLDER.fullmatch(folder) and arch is None:
        raise PerfdbError(f"no '#! arch' line in folder {folder}/: a run stored under an architecture's folder "
                          f"declares it ('#! arch {folder}')", str(path) if where is None else where)
    if arch is not None and ARCH_FOLDER.fullmatch(folder) and folder != arch:
        raise PerfdbError(f"'#! arch {arch}' in folder {folder}/: a run is stored under its own architecture "
                          f"(move it to {arch}/)", where)


def path_for(tag: str, arch: str, base: Path | None = None) -> Path:
    if not isinstance(arch, str) or not ARCH_FOLDER.fullmatch(arch):  # a folder under the root, never a path
        raise PerfdbError(f"arch: expected an architecture like sm_90, gfx942 or cpu, got {arch!r}")
    return (base or root()) / arch / f"{check_tag(tag)}.txt"


def resolve(tag_or_path: str, arch: str | None = None, base: Path | None = None) -> Path:
    """A tag (``perfdb/<arch>/<tag>.txt``; the arch may be left out when one folder holds
    the tag) or a path to a file."""
    as_path = Path(tag_or_path)
    if tag_or_path.endswith(".txt") or os.sep in tag_or_path:
        return as_path
    base = base or root()
    check_tag(tag_or_path)
    if arch is not None:
        return path_for(tag_or_path, arch, base)
    found = sorted(base.glob(f"*/{tag_or_path}.txt")) if base.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise PerfdbError(f"no perfdb tag {tag_or_path!r} under {base}: list them with `ls {base}/*/`")
    raise PerfdbError(f"tag {tag_or_path!r} exists for several architectures "
                      f"({', '.join(p.parent.name for p in found)}): pass --arch")


# ---------------------------------------------------------------------------- tuning revision

def tuning_revision(db_root: Path, arch: str) -> str:
    """A content hash of the tuning tables and patches one architecture resolves through
    (its folder and every ``#! base`` it names), with what was hashed."""
    digest = hashlib.sha256()
    tables = patches = 0
    seen: list[str] = []
    todo = [arch]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        folders = sorted(db_root.glob(f"*/{current}"))
        if not folders:
            continue
        for path in sorted(folders[0].iterdir()):
            if not path.is_file():
                continue
            data = path.read_bytes()
            digest.update(f"{current}/{path.name}\0{len(data)}\0".encode())
            digest.update(data)
            tables += path.suffix == ".txt"
            patches += path.suffix == ".dbpatch"
            for match in re.finditer(rb"^#! base (\S+)", data, re.M):
                todo.append(match.group(1).decode())
    if len(seen) == 1 and not tables and not patches:
        return f"none (no tuning folder for {arch} under {db_root})"
    return (f"sha256:{digest.hexdigest()[:16]} ({', '.join(seen)} under {db_root.name}/: "
            f"{tables} tables, {patches} patches)")


def merge_header(header: Mapping[str, str], **values: str) -> dict[str, str]:
    out = dict(header)
    out.update({k: v for k, v in values.items() if v is not None})
    return out
