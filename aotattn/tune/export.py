"""Tuning results -> ``.dbpatch`` layers of the tuning database.

Each (architecture, table) gets one patch, ``<table>.<NNNN>-tuned.dbpatch``, written with
the tuning package's writer and checked by applying it (with every other patch) before
it replaces the old file. Its header says what made it (tuner version, GPU, dates, the
number of cells); each tuned cell has a comment line with the winner's measured time,
error and the current choice it replaced. Exporting again merges: the cells of the new
results replace the same cells in the existing patch; the patch's other cells stay.

A result whose task found no eligible candidate changes nothing (its comment says so).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotattn.files import write_atomically
from aotattn.spec import Config, Functional
from aotattn.tune.candidates import config_name
from aotattn.tune.runner import RESULT_FORMAT, TUNER_VERSION
from aotattn.tune.tasks import Task, table_spec
from aotattn.tune.timing import CLOCK_CUDA
from aotattn.tuning import Database, Patch, TuningError, parse_patch, write_patch
from aotattn.tuning.database import read_text
from aotattn.tuning.format import Edit, apply_patch, follow_fallbacks, format_functional, text_lines

PATCH_WHAT = "tuned"
_CELL_PREFIX = "# cell "
_HEADER_PREFIX = "# Tuned by aotattn tune"


@dataclass
class TableExport:
    """What one export did to one table's patch."""

    arch: str
    table: str
    path: Path
    cells: int = 0  # cells the new results set
    kept: int = 0  # cells of the old patch kept
    unchanged: int = 0  # results whose winner is the current choice (written all the same)
    empty: list[str] = field(default_factory=list)  # "task: why" for the tasks without a winner (cell kept)
    masked: dict[str, str] = field(default_factory=dict)  # task -> the later patch that sets its cell otherwise
    unmasked: dict[str, list[str]] = field(default_factory=dict)  # later patch -> the tuned cells taken out of it
    removed: list[str] = field(default_factory=list)  # later patches left empty, deleted


def latest(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One result per task (the newest by date), each checked to be a tuner result."""
    newest: dict[str, dict[str, Any]] = {}
    for result in results:
        if not isinstance(result, Mapping) or result.get("format") != RESULT_FORMAT:
            raise ValueError(f"expected tuner results ({RESULT_FORMAT}), got {str(result)[:120]!r}")
        if not isinstance(result.get("task"), Mapping):
            raise ValueError(f"result {result.get('id')}: no task; expected a result file from aotattn tune")
        task = Task.from_json(result["task"])
        if result.get("id") != task.id:
            raise ValueError(f"result id {result.get('id')} does not match its task ({task.id}: {task.describe()})")
        _check_winner(result)
        kept = newest.get(task.id)
        if kept is None or str(result.get("date", "")) >= str(kept.get("date", "")):
            newest[task.id] = dict(result)
    return list(newest.values())


def _check_winner(result: Mapping[str, Any]) -> None:
    """The result's winner is one of its candidates, measured and eligible as the runner
    chooses: an edited, cut or corrupt result must not put a configuration nobody timed (or
    a NaN, infinite or negative time) in the database."""
    where = f"result {result.get('id')}"
    what = "a result file from aotattn tune; re-run its task (aotattn tune dispatch --rerun LABEL) or leave it out"
    if not isinstance(result.get("date"), str) or not isinstance(result.get("versions"), Mapping) \
            or not all(isinstance(result.get(k), str) for k in ("device", "shape")):
        raise ValueError(f"{where}: date, device, shape or versions missing; expected {what}")
    candidates = result.get("candidates")
    if not isinstance(candidates, list) or not all(isinstance(c, Mapping) and "name" in c for c in candidates):
        raise ValueError(f"{where}: candidates: expected a list of named candidates; expected {what}")
    winner = result.get("winner")
    if winner is None:
        return
    found = next((c for c in candidates if c["name"] == winner), None)
    if found is None:
        raise ValueError(f"{where}: winner {winner} is not one of its candidates; expected {what}")
    for name in ("median_ms", "error"):
        value = found.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                or (name == "median_ms" and value == 0):
            raise ValueError(f"{where}: winner {winner} has {name} {value!r}, not a measurement; expected {what}")
    if found.get("eligible") is not True:
        raise ValueError(f"{where}: winner {winner} is not eligible (status {found.get('status')!r}); expected {what}")
    if found.get("config") != result.get("winner_config"):
        raise ValueError(f"{where}: winner_config {result.get('winner_config')} is not the config of its winner "
                         f"{winner} ({found.get('config')}); expected {what}")


def _cell_label(spec: Any, functional: Functional, cell: tuple[int, ...]) -> str:
    keys = " ".join(f"{name}={value}" for (name, _), value in zip(spec.tuning_keys, cell)) or "*"
    return f"{format_functional(spec, functional)} {keys}"


def _ms(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f} ms"


def _comment(spec: Any, result: Mapping[str, Any]) -> str:
    task = Task.from_json(result["task"])
    label = _cell_label(spec, task.functional, task.cell)
    by_name = {c["name"]: c for c in result["candidates"]}
    winner = result.get("winner")
    if winner is None:
        return f"{_CELL_PREFIX}{label}: no eligible candidate of {len(by_name)} (kept {result.get('current')})"
    w = by_name[winner]
    text = f"{_CELL_PREFIX}{label}: {winner} {_ms(w.get('median_ms'))}, error {w['error']:.2e}"
    current = by_name.get(result.get("current") or "")
    if current is not None and current["name"] != winner and current.get("median_ms") and w.get("median_ms"):
        text += f"; was {current['name']} {_ms(current['median_ms'])} ({current['median_ms'] / w['median_ms']:.2f}x)"
    elif current is not None and current["name"] == winner:
        text += " (the current choice)"
    return text + f"; {result['shape']}, {result['device']}, {result['date'][:10]}"


def _patch_path(db: Database, arch: str, table: str) -> Path:
    existing = [p for p in db.patch_paths(arch, table) if p.name.endswith(f"-{PATCH_WHAT}.dbpatch")]
    if existing:
        return existing[-1]
    numbers = [int(re.match(r".*\.(\d{4})-", p.name).group(1)) for p in db.patch_paths(arch, table)]
    return db.arch_dir(arch) / f"{table}.{max(numbers, default=0) + 1:04d}-{PATCH_WHAT}.dbpatch"


def build_patch(spec: Any, results: list[Mapping[str, Any]], old: Patch | None,
                where: str | None = None, needed: Iterable[str] = ()) -> tuple[Patch, int]:
    """The merged patch for one table: the new results' cells, then the old patch's other
    cells (where it sets a cell twice, the later line, which the lookup applies). ``needed``:
    configuration names later patches use; those the old patch defines stay defined.
    Returns (patch, old cells kept)."""
    new_cells: dict[tuple[Functional, tuple[int, ...]], tuple[str, Config | None, str]] = {}
    comments: dict[str, str] = {}
    for result in sorted(results, key=lambda r: Task.from_json(r["task"]).describe()):
        task = Task.from_json(result["task"])
        functional = spec.canonical_functional(task.functional)  # as the patch's blocks name it
        label = _cell_label(spec, functional, task.cell)
        comments[label] = _comment(spec, result)
        if result.get("winner") is not None:
            space = dict(spec.tuning_space)
            outside = [f"{k}={v}" for k, v in Config.of(result["winner_config"]).items
                       if k not in space or v not in space[k]]
            if outside:  # an edited or foreign result: the database would name a kernel nobody builds
                raise ValueError(f"result {result.get('id')}: winner_config {result['winner_config']}: "
                                 f"{', '.join(outside)} outside {spec.qualname}'s tuning space "
                                 f"({', '.join(f'{k} {vs}' for k, vs in space.items())}); re-run its task "
                                 "(aotattn tune dispatch --rerun LABEL) or leave it out")
            config = spec.canonical(Config.of(result["winner_config"]))  # a knob at its default is not spelled
            new_cells[(functional, task.cell)] = (config_name(config), config, label)
    patch = Patch(spec.qualname)
    kept = 0
    if old is not None:
        for line in old.comments:
            if line.startswith(_CELL_PREFIX):
                label = _label_of_comment(line, where)
                comments.setdefault(label, line)
        old_cells: dict[tuple[Functional, tuple[int, ...]], Edit] = {}
        for edit in old.edits:  # a cell set twice: the later line is the one the lookup applies
            line = f"{where}:{edit.line}" if where else f"line {edit.line}"
            if any(len(chosen) != 1 for chosen in edit.selection):
                raise TuningError(f"{spec.qualname}: the tuner's patch holds a range edit; it writes single cells "
                                  "only (edit another patch instead)", line)
            old_cells[(spec.canonical_functional(edit.functional), tuple(c[0] for c in edit.selection))] = edit
        for key, edit in old_cells.items():
            if key not in new_cells:  # a name the patch does not define is the table's (else _check says so)
                new_cells[key] = (edit.config, old.configs.get(edit.config), "")
                kept += 1
        for name in needed:
            if name in old.configs:
                patch.configs[name] = old.configs[name]
    order = {f: i for i, f in enumerate(spec.enumerate_functionals())}
    for (functional, cell), (name, config, _) in sorted(new_cells.items(), key=lambda kv: (order.get(kv[0][0], -1),
                                                                                           kv[0][1])):
        if config is not None:
            patch.configs.setdefault(name, config)
        patch.edits.append(Edit(functional, tuple((value,) for value in cell), name, 0))
    patch.configs = dict(sorted(patch.configs.items()))
    patch.comments = [comments[label] for label in sorted(comments)]
    return patch, kept


def _label_of_comment(line: str, where: str | None = None) -> str:
    """The ``[functional] seqlen_q=.. seqlen_k=..`` label of one of our cell comments."""
    body = line[len(_CELL_PREFIX):]
    close = body.find("]")
    if not body.startswith("[") or close < 0:
        raise TuningError(f"a '{_CELL_PREFIX.strip()}' comment without its [functional] label: {line[:80]!r}; the "
                          "tuner writes '# cell [functional] seqlen_q=..: ...': fix or remove the line", where)
    rest = body[close + 1:].split(":", 1)[0]
    return body[:close + 1] + rest


@dataclass(frozen=True)
class Timed:
    """What a cell's comment in the tuner's patch says it was timed on: the problem as the
    result recorded it (the harness's shape, e.g. ``B4 H32 G4 Sq1024 Sk1024 D64``) and the
    device's name; both None where no candidate was eligible (the comment names neither)."""

    problem: str | None
    device: str | None


def timed_cells(db: Database, arch: str, table: str) -> dict[str, Timed]:
    """Each cell of the tuner's patch, by its ``[functional] seqlen_q=.. seqlen_k=..`` label,
    and what it was timed on (its comment: ``...; B4 H32 Sq1024 Sk1024 D64, NVIDIA H200, date``)."""
    path = _patch_path(db, arch, table)
    if not path.is_file():
        return {}
    cells: dict[str, Timed] = {}
    for line in parse_patch(table_spec(table), read_text(path), str(path)).comments:
        if line.startswith(_CELL_PREFIX):
            if ": no eligible candidate" in line:
                cells[_label_of_comment(line, str(path))] = Timed(None, None)
                continue
            problem, _, rest = line.rsplit("; ", 1)[-1].partition(", ")  # a device's name may hold ", "
            cells[_label_of_comment(line, str(path))] = Timed(problem, rest.rpartition(", ")[0] or None)
    return cells


def stale(tasks: Iterable[Task], problems: Mapping[Task, str], db: Database,
          gpu: str | None = None) -> tuple[list[Task], list[Task]]:
    """The tasks whose cell the tuner timed on another problem than ``problems`` names (the
    problem each would be timed on now: older settings, such as the 128 MiB floor on what a
    timed problem moves, chose smaller ones), on a device whose name does not hold ``gpu``
    (any case, e.g. ``H200``: cells timed on an H100 for an H200 target), or where it found
    no eligible candidate; and the tasks whose cell it never timed (a hand-seeded choice)."""
    recorded: dict[tuple[str, str], dict[str, Timed]] = {}
    chosen, never = [], []
    for task in tasks:
        if (task.arch, task.table) not in recorded:
            recorded[(task.arch, task.table)] = timed_cells(db, task.arch, task.table)
        timed = recorded[(task.arch, task.table)].get(_cell_label(table_spec(task.table), task.functional, task.cell))
        if timed is None:
            never.append(task)
        elif (timed.problem != problems[task]
              or (gpu is not None and gpu.lower() not in (timed.device or "").lower())):
            chosen.append(task)
    return chosen, never


def _header(results: list[Mapping[str, Any]], cells: int) -> list[str]:
    devices = sorted({r["device"] for r in results})
    dates = sorted(r["date"][:10] for r in results)
    versions = sorted({f"aotattn {r['versions'].get('aotattn')}, triton {r['versions'].get('triton')}" for r in results})
    return [f"{_HEADER_PREFIX} {TUNER_VERSION} (docs/tuner.md): {cells} cells; the last export's {len(results)} on "
            f"{', '.join(devices)}, {dates[0]}..{dates[-1]} ({', '.join(versions)}), each other cell's run in its comment.",
            "# Each cell: the winner, its median time at the timed shape and its relative error against the "
            "float64 reference; the choice it replaced."]


def export(results: Iterable[Mapping[str, Any]], db: Database, *, dry_run: bool = False,
           allow_cpu_clock: bool = False, unmask: bool = False) -> list[TableExport]:
    """Write (or with ``dry_run`` only compute) the patches for ``results``; returns what each table got.

    Results timed with the CPU clock (the interpreter) are refused unless
    ``allow_cpu_clock`` (tests): their times say nothing about a GPU. ``unmask``: a later
    patch's lines that set exactly a tuned cell (a hand patch the tuner has now re-timed,
    its choice among the candidates as the current one) are taken out of it, and a patch
    left without lines is deleted; a line over more cells than the tuned one stays (masked).
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for result in latest(results):
        if result.get("clock") != CLOCK_CUDA and not allow_cpu_clock:
            raise ValueError(f"result {result['id']} was timed with {result.get('clock')!r}, not CUDA events: "
                             "its times mean nothing for a GPU (interpreter run?); export GPU results only")
        task = Task.from_json(result["task"])
        groups.setdefault((task.arch, task.table), []).append(result)
    done = []
    for (arch, table), group in sorted(groups.items()):
        spec = table_spec(table)
        path = _patch_path(db, arch, table)
        old_text = read_text(path) if path.is_file() else None
        old = parse_patch(spec, old_text, str(path)) if old_text is not None else None
        later = _later_patches(db, spec, arch, table, path)
        patch, kept = build_patch(spec, group, old, str(path), needed={e.config for _, _, p in later for e in p.edits})
        old_header = [c for c in (old.comments if old else []) if not c.startswith(_CELL_PREFIX)
                      and not c.startswith(_HEADER_PREFIX) and not c.startswith("# Each cell:")]
        patch.comments = (_header(group, len(patch.edits)) + old_header + patch.comments
                          + (_body_comments(old_text) if old_text is not None else []))
        changes: dict[Path, str | None] = {path: write_patch(spec, patch)}
        report = TableExport(arch, table, path, cells=sum(r.get("winner") is not None for r in group), kept=kept,
                             unchanged=sum(r.get("winner") is not None and r.get("winner") == r.get("current")
                                           for r in group),
                             empty=[f"{Task.from_json(r['task']).describe()}: {r.get('no_winner') or 'no eligible candidate'}"
                                    for r in group if r.get("winner") is None])
        if unmask:
            report.unmasked, report.removed, rewrites = _unmask(spec, path, later, group)
            changes.update(rewrites)
        _check(db, arch, table, changes)
        if not dry_run:
            for changed, text in changes.items():
                if text is None:
                    changed.unlink()
                else:
                    write_atomically(changed, text)
        report.masked = _masked(db, arch, table, path, group, skip=report.unmasked if dry_run else {})
        done.append(report)
    return done


def _later_patches(db: Database, spec: Any, arch: str, table: str, path: Path) -> list[tuple[Path, str, Patch]]:
    """The patches applied after ``path``, in order: each file, its text and the patch parsed."""
    later = []
    for p in db.patch_paths(arch, table):
        if p.name > path.name:
            text = read_text(p)
            later.append((p, text, parse_patch(spec, text, str(p))))
    return later


def _body_comments(text: str) -> list[str]:
    """The comments below a patch's header, which a rewrite would drop (a patch keeps
    comments in its header only): rewritten patches keep them there."""
    body, in_header = [], True
    for line in text_lines(text):
        stripped = line.strip()
        if in_header and (not stripped or stripped.startswith("#")):
            continue
        in_header = False
        if stripped.startswith("#") and not stripped.startswith("#!"):
            body.append(stripped)
    return body


def _covers_exactly(spec: Any, edit: Edit, task: Task) -> bool:
    """Whether a patch line sets ``task``'s cell and no other."""
    return (edit.functional == spec.canonical_functional(task.functional)
            and all(tuple(chosen) == (size,) for size, chosen in zip(task.cell, edit.selection)))


def _unmask(spec: Any, path: Path, later: list[tuple[Path, str, Patch]], results: list[Mapping[str, Any]],
            ) -> tuple[dict[str, list[str]], list[str], dict[Path, str | None]]:
    """Take the tuned cells out of the patches applied after ``path`` (:func:`export`'s
    ``unmask``): (patch name -> the cells taken out, the patches deleted, the new text of
    each patch changed, None for one deleted). A patch keeps the configurations later
    patches use, and is deleted only when it has neither lines nor such configurations."""
    tasks = [Task.from_json(r["task"]) for r in results if r.get("winner") is not None]
    unmasked: dict[str, list[str]] = {}
    removed: list[str] = []
    rewrites: dict[Path, str | None] = {}
    used_after: list[set[str]] = [set()]  # [i]: the names the patches after later[-1 - i] use
    for _, _, patch in reversed(later[1:]):
        used_after.append(used_after[-1] | {edit.config for edit in patch.edits})
    for i, (later_path, text, patch) in enumerate(later):
        kept, cells = [], []
        for edit in patch.edits:
            task = next((t for t in tasks if _covers_exactly(spec, edit, t)), None)
            if task is None:
                kept.append(edit)
            else:
                cells.append(task.describe())
        if not cells:
            continue
        unmasked[later_path.name] = cells
        used = {edit.config for edit in kept} | used_after[len(later) - 1 - i]
        patch.configs = {name: c for name, c in patch.configs.items() if name in used}
        if not kept and not patch.configs:
            removed.append(later_path.name)
            rewrites[later_path] = None
            continue
        patch.edits = kept
        patch.comments = [*patch.comments, *_body_comments(text),
                          f"# {len(cells)} cell(s) re-tuned and taken out by `aotattn tune export --unmask` into "
                          f"{path.name}"]
        rewrites[later_path] = write_patch(spec, patch)
    return unmasked, removed, rewrites


def _masked(db: Database, arch: str, table: str, path: Path, results: list[Mapping[str, Any]],
            skip: Mapping[str, list[str]] | None = None) -> dict[str, str]:
    """The results' cells that a patch applied after ``path`` sets to another configuration
    (a hand patch over the cells tuned: the export would change nothing a call runs),
    task -> that patch's file name; ``skip``: patch name -> cells a dry run's unmask would
    take out."""
    spec = table_spec(table)
    later = [p for p in db.patch_paths(arch, table) if p.name > path.name]
    masked: dict[str, str] = {}
    for later_path in later:
        patch = parse_patch(spec, read_text(later_path), str(later_path))
        for result in results:
            if result.get("winner") is None:
                continue
            task = Task.from_json(result["task"])
            if task.describe() in (skip or {}).get(later_path.name, ()):
                continue
            functional = spec.canonical_functional(task.functional)  # as patch blocks name it
            for edit in patch.edits:  # a selection holds bucket values, as a task's cell does
                covers = all(size in chosen for size, chosen in zip(task.cell, edit.selection))
                if edit.functional == functional and covers \
                        and patch.configs.get(edit.config) != Config.of(result["winner_config"]):
                    masked[task.describe()] = later_path.name
    return masked


def _check(db: Database, arch: str, table: str, changes: Mapping[Path, str | None]) -> None:
    """The table resolves with ``changes`` (path -> new text, None: deleted) in place of
    its files: every patch, before and after the changed ones, applied in order."""
    spec = table_spec(table)
    for path, text in changes.items():
        if text is not None and write_patch(spec, parse_patch(spec, text, str(path))) != text:
            raise TuningError("the exported patch does not round-trip through the tuning format", str(path))
    base = Database(db.root, db.specs)
    merged, inherited = base.resolve(arch, table, patches=0)
    added = {functional: set(cells) for functional, cells in inherited.items()}
    for path in sorted(set(base.patch_paths(arch, table)) | set(changes), key=lambda p: p.name):
        text = changes[path] if path in changes else read_text(path)
        if text is not None:
            merged = apply_patch(merged, parse_patch(spec, text, str(path)), str(path), fallback=spec.fallback,
                                 added=added)
    follow_fallbacks(merged, added, spec.fallback)
