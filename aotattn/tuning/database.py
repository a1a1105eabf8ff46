"""A tuning database on disk: table files per architecture, bases, patches, lookup.

Layout: ``<root>/<vendor>/<arch>/<family>.<name>.txt`` and, beside it, patches
``<family>.<name>.<NNNN>-<what>.dbpatch`` applied in numeric order. The root is the
database installed with aotattn (package data; a checkout's top-level ``tuning/``, see
:mod:`aotattn.paths`) unless ``AOTATTN_TUNING_DB`` (or ``--tuning-db``) names another,
so a tuning can be tried without touching the installed one.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from aotattn.files import TEMPORARY_SUFFIX, write_atomically
from aotattn.paths import installed_tuning_db
from aotattn.spec import Config, Functional
from aotattn.tuning.format import (NO_ENTRY, NoEntryError, Table, TuningError, apply_patch, block_for, bucket_index,
                                   fallback_chain, follow_fallbacks, format_config, parse_config, parse_patch,
                                   parse_table, split_directive, text_lines, write_patch, write_table)

ENV_VAR = "AOTATTN_TUNING_DB"
MAX_BASE_DEPTH = 16  # `#! base` hops from a table to its root (the project's longest is 1)
PROJECT_ROOT = installed_tuning_db()  # the database installed with aotattn
_PATCH_NAME = re.compile(r"^(?P<table>[A-Za-z0-9_]+\.[A-Za-z0-9_]+)\.(?P<number>\d{4})-(?P<what>[A-Za-z0-9_.-]+)\.dbpatch$")


def default_root() -> Path:
    """``$AOTATTN_TUNING_DB``, else the database installed with aotattn."""
    return Path(os.environ.get(ENV_VAR) or PROJECT_ROOT)


_default_tables: Callable[[], Mapping[str, Any]] = dict


def use_tables(registry: Callable[[], Mapping[str, Any]]) -> None:
    """Name the tables a :class:`Database` knows when it is given none: ``registry()``
    maps ``family.name`` to the spec that validates the table.

    The tuning package knows no family: the package root (``aotattn/__init__.py``), which
    sits above the families, hands their registry down here once, at import.
    """
    global _default_tables
    _default_tables = registry


class Database:
    """Tables under one root, resolved and cached.

    ``specs`` maps ``family.name`` to the spec each table is validated against (default:
    the registry handed over by :func:`use_tables`, every family's tables). A lookup also
    learns the spec it is given.
    """

    def __init__(self, root: Path | str | None = None, specs: Mapping[str, Any] | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.specs = dict(_default_tables() if specs is None else specs)
        self._effective: dict[tuple[str, str, int | None, frozenset | None], Table] = {}
        # the cells patches set in the blocks they added (refinements), per effective table:
        # an architecture based on this one re-follows the other cells of those blocks to its own
        self._added: dict[tuple[str, str, int | None, frozenset | None], dict[Functional, set[tuple[int, int]]]] = {}
        self._lookups: dict[tuple, Config] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ files
    def archs(self) -> dict[str, str]:
        """arch -> vendor, for every ``<vendor>/<arch>`` directory under the root."""
        if not self.root.is_dir():
            return {}
        found: dict[str, str] = {}
        for vendor in sorted(self.root.iterdir()):
            for arch in sorted(vendor.iterdir()) if vendor.is_dir() else ():
                if arch.is_dir() and found.setdefault(arch.name, vendor.name) != vendor.name:
                    raise TuningError(f"architecture {arch.name} is in two vendor folders, {found[arch.name]}/ and "
                                      f"{vendor.name}/: an architecture's name is unique, keep one", str(self.root))
        return found

    def arch_dir(self, arch: str) -> Path:
        vendor = self.archs().get(arch)
        if vendor is None and not self.root.is_dir():
            hint = ("this aotattn was installed without its database: reinstall it" if self.root == PROJECT_ROOT
                    else f"name an existing one with --tuning-db or {ENV_VAR}")
            raise TuningError(f"no tuning database at {self.root}: {hint}")
        if vendor is None:
            raise TuningError(f"no architecture {arch!r} in the tuning database {self.root} "
                              f"(have: {', '.join(self.archs()) or 'none'})")
        return self.root / vendor / arch

    def spec(self, table: str) -> Any:
        if table not in self.specs:
            raise TuningError(f"no table {table!r} is declared by any family (have: {', '.join(self.specs)})")
        return self.specs[table]

    def table_path(self, arch: str, table: str) -> Path:
        return self.arch_dir(arch) / f"{table}.txt"

    def patch_paths(self, arch: str, table: str) -> list[Path]:
        found = []
        for path in self.arch_dir(arch).glob(f"{table}.*.dbpatch"):
            if not path.is_file():
                raise TuningError("a folder named like a patch: remove or rename it", str(path))
            match = _PATCH_NAME.match(path.name)
            if not match or match["table"] != table:
                raise TuningError(f"a patch is named <family>.<name>.<NNNN>-<what>.dbpatch, got {path.name!r}",
                                  str(path))
            found.append((int(match["number"]), path))
        numbers = [n for n, _ in found]
        if len(set(numbers)) != len(numbers):
            raise TuningError(f"two patches of {table} share a number: {sorted(p.name for _, p in found)}",
                              str(self.arch_dir(arch)))
        return [path for _, path in sorted(found)]

    # ------------------------------------------------------------------ resolution
    def own_table(self, arch: str, table: str, only: frozenset[Functional] | None = None) -> Table:
        path = self.table_path(arch, table)
        if not path.is_file():
            raise TuningError(f"no table file for {arch} / {table}: expected {path}")
        return parse_table(self.spec(table), read_text(path), str(path), only, arch=arch)

    def effective(self, arch: str, table: str, patches: int | None = None, _stack: tuple[str, ...] = (),
                  only: frozenset[Functional] | None = None, errors: list[TuningError] | None = None) -> Table:
        """The table after its base chain and its first ``patches`` patches (all when None).

        ``only``: resolve just these functionals' blocks (see :func:`parse_table`).
        ``errors``: collect the patches' edits in error there, leave them out and go on
        (``lint``: every bad edit, not the first); the result is then not cached.
        """
        return self.resolve(arch, table, patches, _stack, only, errors)[0]

    def resolve(self, arch: str, table: str, patches: int | None = None, _stack: tuple[str, ...] = (),
                only: frozenset[Functional] | None = None, errors: list[TuningError] | None = None,
                ) -> tuple[Table, dict[Functional, set[tuple[int, int]]]]:
        """:meth:`effective` and the cells the patches (this table's and its bases') set in
        the blocks they added (the caller's to read, not change)."""
        key = (arch, table, patches, only)
        with self._lock:
            cached = self._effective.get(key) if errors is None else None
            if cached is not None:
                return cached, self._added[key]
        own = self.own_table(arch, table, only)
        path = self.table_path(arch, table)
        if own.base:
            where = f"{path}:{_directive_line(path, 'base')}"
            if own.base in _stack + (arch,):
                raise TuningError(f"#! base cycle: {' -> '.join(_stack + (arch, own.base))}", where)
            if len(_stack) >= MAX_BASE_DEPTH:
                chain = _stack + (arch, own.base)
                raise TuningError(f"#! base chain deeper than {MAX_BASE_DEPTH} ({' -> '.join(chain[:3])} -> ... -> "
                                  f"{' -> '.join(chain[-2:])}): base this table on a nearer relative", where)
            if own.base not in self.archs():
                raise TuningError(f"#! base {own.base}: no such architecture in {self.root}", where)
            if not self.table_path(own.base, table).is_file():  # an error at the line that names it, as above
                raise TuningError(f"#! base {own.base}: {own.base} has no {table} table (expected "
                                  f"{self.table_path(own.base, table)}): add it, or base this table on another", where)
            base, base_added = self.resolve(own.base, table, None, _stack + (arch,), only, None)
            merged = base.copy()
            merged.arch, merged.base, merged.comments = arch, own.base, own.comments
            merged.configs.update(own.configs)
            merged.blocks.update(own.blocks)
            # a block the base's patches added keeps the cells they set; its other cells follow
            # this table's blocks (its own root, say), not the base's
            added = {f: set(cells) for f, cells in base_added.items() if f not in own.blocks}
        else:
            merged = own
            added = {}
        spec = self.spec(table)
        for patch_path in self.patch_paths(arch, table)[:patches]:
            patch = parse_patch(spec, read_text(patch_path), str(patch_path), only=only)
            merged = apply_patch(merged, patch, str(patch_path), only, spec.fallback, added, errors)
        follow_fallbacks(merged, added, spec.fallback)
        if errors is None:
            with self._lock:
                self._effective[key] = merged
                self._added[key] = added
        return merged, added

    # ------------------------------------------------------------------ lookup
    def lookup(self, arch: str, spec: Any, functional: Functional, sizes: Mapping[str, int]) -> Config:
        """The configuration for one call; a missing block or cell is an error, never a default.
        An axis at its ``axis_defaults`` value may be given or left out (the same cell)."""
        cell_index = tuple(bucket_index(buckets, sizes[name]) for name, buckets in spec.tuning_keys)
        key = (arch, spec.qualname, functional, cell_index)
        found = self._lookups.get(key)
        if found is not None:
            return found
        self.specs.setdefault(spec.qualname, spec)
        if spec.axis_defaults:  # on a miss only: a hit costs what it did before the first such axis
            functional = spec.canonical_functional(functional)
        chain = fallback_chain(spec.fallback, functional)
        table = self.effective(arch, spec.qualname, only=frozenset(chain))
        used = block_for(table, chain, f"{arch} / {spec.qualname}", str(self.table_path(arch, spec.qualname)))
        grid = table.blocks[used]
        name = grid[cell_index[0] if cell_index else 0][cell_index[1] if len(cell_index) > 1 else 0]
        if name == NO_ENTRY:
            where = " ".join(f"{k}={buckets[i]}" for (k, buckets), i in zip(spec.tuning_keys, cell_index))
            raise NoEntryError(f"{arch} / {spec.qualname} / [{used}]: cell {where} has no entry ('.')")
        config = table.configs[name]
        self._lookups[key] = config
        return config

    # ------------------------------------------------------------------ maintenance
    def lint(self) -> list[TuningError]:
        """Every problem in the database, each once, with ``archs`` set to the architectures
        whose effective tables it affects (a table's own and those that inherit it).

        Every error of each file is found (not only the first); then each table is resolved
        with its bases and patches. A missing or empty database is an error, not a pass.
        """
        if not self.root.exists():
            raise TuningError(f"no tuning database at {self.root}: name one with --tuning-db or {ENV_VAR}")
        if not self.root.is_dir():
            raise TuningError(f"{self.root} is not a folder: a tuning database is a folder of <vendor>/<arch>/ tables")
        archs = self.archs()
        tables = {arch: sorted(p.stem for p in self.arch_dir(arch).glob("*.txt")) for arch in archs}
        if not any(tables.values()):
            raise TuningError(f"no tables in {self.root}: expected <vendor>/<arch>/<family>.<kernel>.txt files")
        found: dict[str, TuningError] = {}

        def add(problem: TuningError, affected) -> None:
            kept = found.setdefault(str(problem), problem)
            kept.archs = tuple(sorted(set(kept.archs) | set(affected)))

        for stray in self._strays():
            add(TuningError("a table or patch outside an architecture folder is never read: move it into "
                            "<vendor>/<arch>/", str(stray)), ())
        for arch in archs:
            directory = self.arch_dir(arch)
            for path in sorted(directory.iterdir()):
                table, errors = self._lint_file(arch, path)
                for error in errors:
                    add(error, self._inheritors(arch, table) if table else (arch,))
        for arch, names in tables.items():
            for table in names:
                if table in self.specs:
                    edits: list[TuningError] = []
                    try:
                        self.effective(arch, table, errors=edits)
                    except TuningError as exc:
                        edits.append(exc)
                    for exc in edits:
                        add(exc, (arch,))
        return list(found.values())

    def _strays(self) -> list[Path]:
        """Tables and patches at the root or in a vendor folder, where no lookup reads them."""
        folders = [self.root] + sorted(p for p in self.root.iterdir() if p.is_dir())
        return [path for folder in folders for path in sorted(folder.iterdir())
                if path.is_file() and path.suffix in (".txt", ".dbpatch")]

    def _lint_file(self, arch: str, path: Path) -> tuple[str | None, list[TuningError]]:
        """The table a file belongs to (None if none) and every error inside the file."""
        name = path.name
        if not path.is_file():
            return None, [TuningError("not a table (.txt) or a patch (.dbpatch) file: a folder or other kind of file "
                                      "has no place here", str(path))]
        if name.endswith(".dbpatch"):
            match = _PATCH_NAME.match(name)
            if not match:
                return None, [TuningError("a patch is named <family>.<name>.<NNNN>-<what>.dbpatch", str(path))]
            table = match["table"]
            if not (path.parent / f"{table}.txt").is_file():
                return table, [TuningError(f"a patch of {table}, which has no table here", str(path))]
        elif name.endswith(".txt"):
            table = name[:-4]
        elif name.startswith(".") and name.endswith(TEMPORARY_SUFFIX):
            return None, [TuningError("a temporary file a writer killed mid-write left behind (the table it was "
                                      "writing is as it was before): delete it", str(path))]
        else:
            return None, [TuningError("not a table (.txt) or a patch (.dbpatch)", str(path))]
        errors: list[TuningError] = []
        try:
            spec = self.spec(table)
            text = read_text(path)
            if name.endswith(".dbpatch"):
                parse_patch(spec, text, str(path), errors=errors)
            else:
                own = parse_table(spec, text, str(path), arch=arch, errors=errors)
                if not errors and write_table(spec, own) != text:
                    lost = _lost_comments(text, write_table(spec, own))
                    errors.append(TuningError(
                        "not in canonical form" + (f"; --fix would drop the comment on line(s) {', '.join(lost)}: "
                                                   "move it above the #! lines (the only place comments are kept), "
                                                   "then run aotattn tuning lint --fix" if lost else
                                                   " (aotattn tuning lint --fix rewrites it)"), str(path)))
        except TuningError as exc:
            errors.append(exc)
        return table, errors

    def _inheritors(self, arch: str, table: str) -> set[str]:
        """``arch`` and every architecture whose ``#! base`` chain for ``table`` reaches it."""
        bases = {a: _declared_base(self.arch_dir(a) / f"{table}.txt") for a in self.archs()}
        reached = {arch}
        for start in bases:
            seen, current = [], start
            while current is not None and current not in seen and len(seen) <= MAX_BASE_DEPTH:
                seen.append(current)
                if current == arch:
                    reached.add(start)
                    break
                current = bases.get(current)
        return reached

    def fix(self) -> list[Path]:
        """Rewrite in canonical form every table that parses without error and loses no
        comment in the rewrite; returns the files rewritten. A file it does not fully
        understand is left as it is (``lint`` says why)."""
        fixed = []
        for arch in self.archs():
            for path in sorted(self.arch_dir(arch).glob("*.txt")):
                errors: list[TuningError] = []
                try:
                    spec = self.spec(path.stem)
                    text = read_text(path)
                    canonical = write_table(spec, parse_table(spec, text, str(path), arch=arch, errors=errors))
                except TuningError:
                    continue
                if not errors and canonical != text and not _lost_comments(text, canonical):
                    write_atomically(path, canonical)
                    fixed.append(path)
        self._effective.clear()
        self._added.clear()
        self._lookups.clear()
        return fixed

    def squash(self, arch: str, table: str) -> list[Path]:
        """Fold the patches into the table file; returns the patch files, now deleted."""
        spec = self.spec(table)
        own = self.own_table(arch, table)
        before = self.effective(arch, table, patches=0)
        after = self.effective(arch, table)
        out = own.copy()
        out.configs = dict(after.configs)
        for functional, grid in after.blocks.items():
            if functional in own.blocks or before.blocks.get(functional) != grid:
                out.blocks[functional] = [list(row) for row in grid]
        used = {name for grid in out.blocks.values() for row in grid for name in row}
        out.configs = {n: c for n, c in out.configs.items() if n in used or n in own.configs}
        path = self.table_path(arch, table)
        write_atomically(path, write_table(spec, out))
        patches = self.patch_paths(arch, table)
        for patch in patches:
            patch.unlink()
        self._effective.clear()
        self._added.clear()
        self._lookups.clear()
        return patches

    def set_knobs(self, arch: str, table: str, knobs: Mapping[str, str]) -> list[Path]:
        """Give every configuration of a table and its patches these knob values (``{knob:
        value}`` as written in a table); returns the files rewritten. For experiments, on
        a copy of a database: every cell then runs its tiles with those knobs."""
        spec = self.spec(table)
        base = self.own_table(arch, table).base
        if base:  # its inherited cells would keep the base's knobs: only some cells would change
            raise TuningError(f"{arch} / {table} takes its other cells from {base} (#! base): set-knobs rewrites one "
                              f"architecture's files, so those would keep their knobs; set them on {base} in the copy "
                              "(every architecture based on it changes with it)", str(self.table_path(arch, table)))
        setting = " ".join(f"{knob}={value}" for knob, value in knobs.items())
        written = []
        for path in [self.table_path(arch, table), *self.patch_paths(arch, table)]:
            if not path.exists():
                continue
            text = read_text(path)
            is_patch = path.suffix != ".txt"
            parsed = parse_patch(spec, text, str(path)) if is_patch else parse_table(spec, text, str(path), arch=arch)
            configs = {}
            for name, config in parsed.configs.items():
                others = Config.of({k: v for k, v in config.as_dict().items() if k not in knobs})
                configs[name] = parse_config(spec, f"{format_config(others, spec)} {setting}", f"{path}: {name}")
            parsed.configs = configs
            write_atomically(path, write_patch(spec, parsed) if is_patch else write_table(spec, parsed))
            written.append(path)
        self._effective.clear()
        self._added.clear()
        self._lookups.clear()
        return written


def diff(spec: Any, a: Table, b: Table) -> list[str]:
    """Cell-by-cell differences of two effective tables, compared by configuration values.

    One line per functional and change (``X -> Y``), with the cells it covers.
    """
    lines = []
    rows = spec.tuning_keys[0][1] if spec.tuning_keys else ("*",)
    cols = spec.tuning_keys[1][1] if len(spec.tuning_keys) > 1 else ("*",)
    for functional in sorted(set(a.blocks) | set(b.blocks), key=str):
        if functional not in a.blocks or functional not in b.blocks:
            lines.append(f"[{functional}]: only in {'B' if functional not in a.blocks else 'A'}")
            continue
        changes: dict[tuple[str, str], list[str]] = {}
        for r, row in enumerate(rows):
            for c, col in enumerate(cols):
                ca, cb = a.blocks[functional][r][c], b.blocks[functional][r][c]
                va = a.configs.get(ca) if ca != NO_ENTRY else None
                vb = b.configs.get(cb) if cb != NO_ENTRY else None
                if va != vb:
                    where = " ".join(f"{k}={v}" for (k, _), v in zip(spec.tuning_keys, (row, col)))
                    changes.setdefault((f"{ca} ({va})", f"{cb} ({vb})"), []).append(where)
        for (before, after), cells in changes.items():
            listed = "every cell" if len(cells) == len(rows) * len(cols) else (
                ", ".join(cells) if len(cells) <= 4 else f"{len(cells)} cells")
            lines.append(f"[{functional}] {listed}: {before} -> {after}")
    return lines


def _directive_line(path: Path, directive: str) -> int:
    for number, line in enumerate(text_lines(read_text(path)), start=1):
        if line.startswith("#!") and split_directive(line)[0] == directive:
            return number
    return 1


def _declared_base(path: Path) -> str | None:
    """The ``#! base`` a table file names, read leniently (for lint, whatever else is wrong)."""
    try:
        for line in text_lines(path.read_bytes().decode("utf-8", "replace")):
            key, value = split_directive(line) if line.startswith("#!") else ("", "")
            if key == "base":
                return value.split()[0] if value.split() else None
            if line.startswith("["):
                break
    except OSError:
        pass
    return None


def _lost_comments(text: str, rewritten: str) -> list[str]:
    """Line numbers of the comments in ``text`` that ``rewritten`` no longer has, each
    occurrence counted (a body comment repeating a header one is a comment of its own)."""
    kept = Counter(line.rstrip() for line in text_lines(rewritten))
    lost = []
    for n, line in enumerate(text_lines(text), start=1):
        comment = line.rstrip()
        if line.lstrip().startswith("#") and not line.startswith("#!"):
            if kept[comment] > 0:
                kept[comment] -= 1
            else:
                lost.append(str(n))
    return lost


def read_text(path: Path) -> str:
    """A tuning file's text; bytes that are not UTF-8 are an error at their line."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # invisible in an editor: the header's first line would read as unknown
        raise TuningError("the file starts with a byte-order mark (bytes EF BB BF): save it as UTF-8 without one",
                          f"{path}:1")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise TuningError(f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at column {column}): save the file as "
                          "UTF-8", f"{path}:{line}") from None


@lru_cache(maxsize=8)
def _database_for(root: str) -> Database:
    return Database(root)


def database() -> Database:
    """The database the operators use: ``AOTATTN_TUNING_DB`` or the project's ``tuning/``."""
    return _database_for(str(default_root()))
