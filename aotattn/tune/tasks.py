"""Tuning tasks: one per (architecture, table, functional, cell), and their selection.

A task names one cell of one tuning table: the table (``flash.attn_fwd``, or an
operator table such as ``flash.backward``), the functional (every compile-time axis),
and one bucket per tuning key (``seqlen_q=4096 seqlen_k=4096``). Tasks are plain data:
they serialize to JSON payloads for a task queue or an offline batch file and back.

Selection is family-agnostic: ``--category flash[,kernel]`` picks tables, ``--where``
restricts any axis to a list of values, ``--seqlen`` the buckets; by default only the
*root* functionals are tuned: those the family's fallback leaves unchanged (for flash:
unpadded, dense, no dropout, no bias, causal on the bottom-right diagonal or no mask),
since the others are refinements that reuse their root's tuning unless tuned apart.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aotattn.spec import Functional

CELLS = ("diagonal", "grid", "off-diagonal")


class SelectionError(ValueError):
    """A selection of tasks that names no table, axis or bucket the families declare."""


@dataclass(frozen=True)
class Task:
    """One cell of one table on one architecture.

    Attributes:
        arch: ``sm_90``, ...
        table: ``family.name`` of a kernel or operator table.
        functional: the block's functional.
        cell: one bucket per tuning key of the table, in the keys' order (``()`` when the
            table has no keys).
    """

    arch: str
    table: str
    functional: Functional
    cell: tuple[int, ...]

    @property
    def family(self) -> str:
        return self.table.split(".", 1)[0]

    @property
    def kernel(self) -> str:
        return self.table.split(".", 1)[1]

    @property
    def category(self) -> str:
        """``family,name``: what ``--category`` selects."""
        return f"{self.family},{self.kernel}"

    def describe(self) -> str:
        cell = " ".join(f"{k}={v}" for k, v in zip(_key_names(self.table), self.cell)) or "*"
        return f"{self.arch} {self.table} [{self.functional}] {cell}"

    @property
    def id(self) -> str:
        """A stable name: the same task always gets the same id (results replace, never add)."""
        return hashlib.sha256(self.describe().encode()).hexdigest()[:20]

    def to_json(self) -> dict[str, Any]:
        return {"arch": self.arch, "table": self.table, "functional": self.functional.as_dict(),
                "cell": list(self.cell)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Task":
        """A task from its payload, validated against the family's declaration."""
        try:
            arch, table, functional, cell = data["arch"], data["table"], data["functional"], data["cell"]
        except (KeyError, TypeError) as exc:
            raise SelectionError(f"a tune task payload needs arch, table, functional and cell, got {data!r}") from exc
        spec = table_spec(table)
        if not isinstance(functional, Mapping):
            raise SelectionError(f"functional: expected an object, got {functional!r}")
        spec.check_functional(functional)
        keys = spec.tuning_keys
        if not isinstance(cell, (list, tuple)) or len(cell) != len(keys):
            raise SelectionError(f"cell: expected {len(keys)} bucket(s) ({', '.join(k for k, _ in keys)}), got {cell!r}")
        for value, (name, buckets) in zip(cell, keys):
            if value not in buckets:
                raise SelectionError(f"cell: {name}={value!r} is not a bucket of {table} ({buckets})")
        return cls(str(arch), table, Functional.of(functional), tuple(int(v) for v in cell))


def table_spec(table: str) -> Any:
    from aotattn import families

    specs = families.tables()
    if table not in specs:
        raise SelectionError(f"table: no family declares {table!r} (have: {', '.join(specs)})")
    return specs[table]


def _key_names(table: str) -> tuple[str, ...]:
    return tuple(name for name, _ in table_spec(table).tuning_keys)


def parse_category(text: str) -> tuple[str, str | None]:
    """``flash`` or ``flash,attn_fwd`` -> (family, kernel or None)."""
    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= 2 or not all(parts):
        raise SelectionError(f"--category: expected family or family,kernel (e.g. flash,attn_fwd), got {text!r}")
    return parts[0], parts[1] if len(parts) == 2 else None


def parse_where(text: str | None) -> dict[str, tuple[str, ...]]:
    """``"dtype=fp16,bf16 BLOCK_D=64"`` -> {axis: allowed values as written}."""
    allowed: dict[str, tuple[str, ...]] = {}
    for token in (text or "").split():
        axis, eq, values = token.partition("=")
        if not eq or not axis or not values:
            raise SelectionError(f"--where: expected axis=value[,value...], got {token!r}")
        if axis in allowed:
            raise SelectionError(f"--where: axis {axis} given twice")
        allowed[axis] = tuple(v for v in values.split(",") if v)
        if not allowed[axis]:
            raise SelectionError(f"--where: expected axis=value[,value...], got {token!r} (no value)")
    return allowed


def is_root(spec: Any, functional: Functional) -> bool:
    """True when the family's fallback leaves this functional as it is."""
    return spec.fallback is None or spec.fallback(functional.as_dict()) is None


def select_tables(categories: Sequence[str], tunable: Iterable[str]) -> list[str]:
    """The tunable tables the categories name, in declaration order."""
    tunable = list(tunable)
    chosen = []
    for text in categories:
        family, kernel = parse_category(text)
        names = [t for t in tunable if t.split(".", 1)[0] == family and (kernel is None or t.split(".", 1)[1] == kernel)]
        if not names:
            raise SelectionError(f"--category {text}: no tunable table matches (tunable: {', '.join(tunable)})")
        chosen += [n for n in names if n not in chosen]
    return chosen


def _cells(spec: Any, seqlens: Sequence[int] | None, layout: str) -> list[tuple[int, ...]]:
    keys = spec.tuning_keys
    if not keys:
        return [()]
    chosen = []
    for name, buckets in keys:
        picked = tuple(buckets) if not seqlens else tuple(b for b in buckets if b in set(seqlens))
        bad = [s for s in (seqlens or ()) if s not in buckets]
        if bad:
            raise SelectionError(f"--seqlen: {', '.join(map(str, bad))} not a bucket of {name} "
                                 f"({', '.join(map(str, buckets))})")
        chosen.append(picked)
    if layout == "diagonal" and len(keys) == 2:
        return [(b, b) for b in chosen[0] if b in chosen[1]]
    if layout not in CELLS:
        return _listed_cells(keys, layout)
    pairs = list(itertools.product(*chosen))
    return [cell for cell in pairs if len(set(cell)) > 1] if layout == "off-diagonal" and len(keys) == 2 else pairs


def _listed_cells(keys: Sequence[tuple[str, Sequence[int]]], text: str) -> list[tuple[int, ...]]:
    """Cells named one by one, ``128x16384,512x4096`` (seqlen_q x seqlen_k; each a bucket)."""
    expected = f"one of {', '.join(CELLS)} or cells like 128x16384,512x4096"
    cells = []
    for item in (v for v in text.split(",") if v):
        try:
            cell = tuple(int(v) for v in item.split("x"))
        except ValueError:
            raise SelectionError(f"--cells: expected {expected}, got {text!r}") from None
        if len(cell) != len(keys):
            raise SelectionError(f"--cells {item}: {len(keys)} sizes a cell ({' x '.join(n for n, _ in keys)})")
        for (name, buckets), size in zip(keys, cell):
            if size not in buckets:
                raise SelectionError(f"--cells {item}: {size} not a bucket of {name} ({', '.join(map(str, buckets))})")
        if cell not in cells:
            cells.append(cell)
    if not cells:
        raise SelectionError(f"--cells: expected {expected}, got {text!r}")
    return cells


def enumerate_tasks(arch: str, tables: Sequence[str], where: Mapping[str, Sequence[str]] | None = None,
                    seqlens: Sequence[int] | None = None, cells: str = "diagonal",
                    all_functionals: bool = False) -> Iterator[Task]:
    """Every task of the selection: tables x functionals x cells.

    Args:
        arch: the target architecture.
        tables: ``family.name`` of each table (see :func:`select_tables`).
        where: axis -> allowed values (as written in the database, ``fp16``, ``True``); an
            axis a table does not have is ignored for that table, a value it never takes
            is an error, and so is an axis no table of the selection has (a typo).
        seqlens: buckets kept on every tuning key (default: all).
        cells: ``diagonal`` (seqlen_q = seqlen_k, the square problems), ``grid`` (every
            pair of the chosen buckets), ``off-diagonal`` (the pairs with seqlen_q !=
            seqlen_k: the non-square problems, once the diagonal is tuned), or cells named
            one by one, ``128x16384,1024x1024`` (``seqlens`` then does not apply).
        all_functionals: also the refinements (padded heads, varlen, ...), not only roots.
    """
    where = dict(where or {})
    known = {axis for table in tables for axis, _ in (*table_spec(table).functionals, *table_spec(table).axis_defaults)}
    for axis in where:
        if axis not in known:
            raise SelectionError(f"--where {axis}: no table of the selection has that axis (axes: "
                                 f"{', '.join(sorted(known))})")
    for table in tables:
        spec = table_spec(table)
        choices = {axis: {str(v) for v in values} for axis, values in spec.functionals}
        for axis, values in where.items():
            unknown = [v for v in values if axis in choices and v not in choices[axis]]
            if unknown:
                raise SelectionError(f"--where {axis}: {', '.join(unknown)} not one of "
                                     f"{', '.join(sorted(choices[axis]))} ({table})")
        table_cells = _cells(spec, seqlens, cells)
        for functional in spec.enumerate_functionals():
            values = {axis: str(v) for axis, v in (*spec.axis_defaults, *functional.items)}
            if any(axis in values and values[axis] not in allowed for axis, allowed in where.items()):
                continue
            if not all_functionals and not is_root(spec, functional):
                continue
            for cell in table_cells:
                yield Task(arch, table, functional, cell)


def write_batch(tasks: Iterable[Task], settings: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """JSON lines, one task payload each (the offline batch format of the tuner's core).

    ``settings``: per table, how its tasks are measured (``Settings.to_json``), written into
    each line so the offline worker and ``tune compile`` use the limit and size the batch
    was planned with; a line without it is measured with its table's defaults.
    """
    lines = []
    for t in tasks:
        line: dict[str, Any] = {"id": t.id, **t.to_json()}
        if settings is not None and t.table in settings:
            line["settings"] = dict(settings[t.table])
        lines.append(json.dumps(line, sort_keys=True) + "\n")
    return "".join(lines)


def read_batch_settings(text: str, where: str = "<batch>",
                        settings_of: Callable[[str, dict[str, Any] | None], Any] | None = None) -> list[tuple[Task, Any]]:
    """Each line's task and the settings it carries (None: the table's defaults); with
    ``settings_of`` (``Settings.of_line``), those settings made and checked, an error
    naming the line."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SelectionError(f"{where}:{number}: not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise SelectionError(f"{where}:{number}: expected a JSON object, got {type(data).__name__}")
        settings = data.pop("settings", None)
        if settings is not None and not isinstance(settings, dict):
            raise SelectionError(f"{where}:{number}: settings: expected an object, got {settings!r}")
        try:
            task = Task.from_json(data)
        except ValueError as exc:
            raise SelectionError(f"{where}:{number}: {exc}") from exc
        if "id" in data and data["id"] != task.id:
            raise SelectionError(f"{where}:{number}: id {data['id']} does not match the task ({task.id})")
        if settings_of is not None:
            try:
                settings = settings_of(task.table, settings)
            except (ValueError, TypeError) as exc:
                raise SelectionError(f"{where}:{number}: {exc}") from exc
        out.append((task, settings))
    return out


def read_batch(text: str, where: str = "<batch>") -> list[Task]:
    return [task for task, _ in read_batch_settings(text, where)]
