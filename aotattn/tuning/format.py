"""Text format of tuning tables and patches: parser and canonical writer.

docs/tuning-database-format.md specifies it. In short, a table file::

    # free comments (kept)
    #! aotattn-tuning 1
    #! table flash.attn_fwd
    #! arch sm_90
    #! base sm_80                                  (optional)
    #! keys seqlen_q=16,32,...,16384 seqlen_k=16,32,...,16384

    [configs]
    m128_n64_w8_s3 = BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3

    [dtype=bf16 BLOCK_D=128 ... BIAS=0]
    seqlen_q=16..512: m128_n64_w8_s3*11
    seqlen_q=1024: m128_n64_w8_s3*5 m128_n128_w8_s3*6

A row names its bucket (or a run of identical rows ``lo..hi``) and lists one cell per
column bucket, runs of equal cells written ``name*count``; ``.`` is a cell with no
entry. A patch file holds a ``[configs]`` section and single-config edits::

    #! aotattn-patch 1
    #! table flash.attn_fwd
    [dtype=bf16 ...]
    seqlen_q=4096 seqlen_k=1024..16384: m128_n128_w8_s3
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aotattn.errors import AotattnError
from aotattn.spec import Config, Functional

FORMAT_VERSION = 1
NO_ENTRY = "."


class TuningError(AotattnError, ValueError):
    """A tuning file that cannot be used; ``where`` is ``path:line`` when known.

    ``archs``: set by ``Database.lint``, the architectures whose effective tables the
    problem affects.
    """

    def __init__(self, message: str, where: str | None = None):
        self.where = where
        self.archs: tuple[str, ...] = ()
        super().__init__(f"{where}: {message}" if where else message)



class NoEntryError(TuningError):
    """The database resolves but names no configuration for a call: no block for its
    functional (nor a fallback's), or a ``.`` cell."""


class _Report:
    """Where parse errors go: raised at once (the default), or collected so that one pass
    finds every error of a file (``aotattn tuning lint``)."""

    def __init__(self, collect: list[TuningError] | None):
        self.found = collect

    def __call__(self, error: TuningError) -> None:
        if self.found is None:
            raise error
        self.found.append(error)


# The directives each kind of file may have: a typo or a misplaced one is an error, never
# ignored (an ignored "#! bsae" would silently drop the table's inheritance).
DIRECTIVES = {"tuning": ("aotattn-tuning", "table", "arch", "base", "keys"), "patch": ("aotattn-patch", "table")}


@dataclass
class Table:
    """One table file, or an effective table after bases and patches."""

    table: str  # "family.kernel"
    arch: str
    keys: tuple[tuple[str, tuple[int, ...]], ...]
    base: str | None = None
    configs: dict[str, Config] = field(default_factory=dict)
    blocks: dict[Functional, list[list[str]]] = field(default_factory=dict)
    comments: list[str] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        rows = len(self.keys[0][1]) if self.keys else 1
        cols = len(self.keys[1][1]) if len(self.keys) > 1 else 1
        return rows, cols

    def copy(self) -> "Table":
        return Table(self.table, self.arch, self.keys, self.base, dict(self.configs),
                     {f: [list(r) for r in rows] for f, rows in self.blocks.items()}, list(self.comments))


@dataclass
class Edit:
    functional: Functional
    selection: tuple[tuple[int, ...], ...]  # per key, the buckets the edit covers
    config: str
    line: int


@dataclass
class Patch:
    table: str
    configs: dict[str, Config] = field(default_factory=dict)
    edits: list[Edit] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    config_lines: dict[str, str] = field(default_factory=dict, compare=False)  # name -> "path:line" of its definition


# ----------------------------------------------------------------------------- values


def format_value(value: Any) -> str:
    return str(value)


def parse_value(token: str, choices: Sequence[Any], what: str, where: str) -> Any:
    for choice in choices:
        if format_value(choice) == token:
            return choice
    raise TuningError(f"{what}: {token!r} is not one of {', '.join(map(format_value, choices))}", where)


def _axis_defaults(spec: Any) -> dict[str, Any]:
    return dict(getattr(spec, "axis_defaults", ()))


def format_functional(spec: Any, functional: Functional) -> str:
    """``[axis=value ...]`` in the spec's axis order, leaving out the axes a functional may
    omit at their default (``axis_defaults``: written the same before and after such an
    axis was added)."""
    values, defaults = functional.as_dict(), _axis_defaults(spec)
    return "[" + " ".join(f"{axis}={format_value(values[axis])}" for axis in spec.axes
                          if axis in values and not (axis in defaults and values[axis] == defaults[axis])) + "]"


def parse_functional(spec: Any, text: str, where: str) -> Functional:
    choices = dict(spec.functionals)
    values: dict[str, Any] = {}
    for token in text.split():
        axis, eq, raw = token.partition("=")
        if not eq:
            raise TuningError(f"expected axis=value in the functional, got {token!r}", where)
        if axis not in choices:
            raise TuningError(f"{spec.qualname} has no axis {axis!r} (axes: {', '.join(spec.axes)})", where)
        if axis in values:
            raise TuningError(f"axis {axis} given twice", where)
        values[axis] = parse_value(raw, choices[axis], axis, where)
    defaults = _axis_defaults(spec)
    missing = [a for a in spec.axes if a not in values and a not in defaults]
    if missing:
        raise TuningError(f"the functional lacks axes {', '.join(missing)}", where)
    if spec.disabled is not None and spec.disabled({**defaults, **values}):
        raise TuningError(f"functional {text.strip()} is disabled for {spec.qualname}", where)
    return spec.canonical_functional(values) if defaults else Functional.of(values)


def format_config(config: Config, spec: Any) -> str:
    values = config.as_dict()
    return " ".join(f"{knob}={format_value(values[knob])}" for knob, _ in spec.tuning_space if knob in values)


def parse_config(spec: Any, text: str, where: str) -> Config:
    space = dict(spec.tuning_space)
    values: dict[str, Any] = {}
    for token in text.split():
        knob, eq, raw = token.partition("=")
        if not eq or knob not in space:
            raise TuningError(f"unknown tuning knob {knob!r} for {spec.qualname} "
                              f"(knobs: {', '.join(space)})", where)
        if knob in values:
            raise TuningError(f"knob {knob} given twice: give each knob once", where)
        values[knob] = parse_value(raw, space[knob], knob, where)
    missing = [k for k in space if k not in values and k not in dict(spec.knob_defaults)]
    if missing:
        raise TuningError(f"the configuration lacks knobs {', '.join(missing)}", where)
    return spec.canonical(Config.of(values))


def _keys_line(keys: Sequence[tuple[str, Sequence[int]]]) -> str:
    return " ".join(f"{name}={','.join(map(str, buckets))}" for name, buckets in keys)


def _is_name(token: str) -> bool:
    return token.replace("_", "").replace("-", "").isalnum() and not token[0].isdigit()


# ----------------------------------------------------------------------------- parsing


def text_lines(text: str) -> list[str]:
    """The lines of a tuning file: split at ``\\n`` only (a ``\\r`` before it is trailing
    space). Python's ``splitlines`` also splits at form feeds, NEL and Unicode's line
    separators, which a comment may hold: the rest of it would become a live line."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _lines(text: str, path: str):
    """(number, line, "path:number") of each non-blank line (blank lines mean nothing)."""
    for number, line in enumerate(text_lines(text), start=1):
        line = line.rstrip()
        if line:
            yield number, line, f"{path}:{number}"


def _blank_other_sections(text: str, only: Collection[Functional] | None, spec: Any = None) -> str:
    """``text`` with the lines of functional sections not of ``only`` blanked (line
    numbers kept): a lookup then neither parses nor numbers them. ``only`` None: ``text``."""
    if only is None:
        return text
    wanted = {functional_key(f) for f in only}
    lines = text_lines(text)
    keep = True
    for i, line in enumerate(lines):
        if line.startswith("["):
            stripped = line.rstrip()
            header = stripped[1:-1]
            well_formed = stripped.endswith("]") and "[" not in header and "]" not in header
            # a malformed header is left to the parser, which reports it: blanked, a call's own
            # block with a comment after its "]" would be skipped for its fallback's, silently
            keep = not well_formed or header == "configs" or header_key(header, spec) in wanted
        if not keep:
            lines[i] = ""
    return "\n".join(lines)


def _selection(spec: Any, text: str, where: str, allow_ranges: bool) -> tuple[tuple[int, ...], ...]:
    """The buckets each key covers in ``seqlen_q=16..64 seqlen_k=*`` (``*`` alone: no keys)."""
    keys = spec.tuning_keys
    tokens = text.split()
    if not keys:
        if tokens != ["*"]:
            raise TuningError(f"{spec.qualname} has no tuning keys: a row is written '*:'", where)
        return ()
    if len(tokens) != (len(keys) if allow_ranges else 1):
        expected = " ".join(f"{k}=..." for k, _ in (keys if allow_ranges else keys[:1]))
        raise TuningError(f"expected '{expected}:', got {text.strip()!r}", where)
    selection = []
    for token, (name, buckets) in zip(tokens, keys):
        key, eq, raw = token.partition("=")
        if key != name or not eq:
            raise TuningError(f"expected key {name}=, got {token!r}", where)
        if raw == "*" and allow_ranges:
            selection.append(tuple(buckets))
            continue
        lo, dots, hi = raw.partition("..")
        try:
            lo_v, hi_v = int(lo), int(hi) if dots else int(lo)
        except ValueError:
            raise TuningError(f"{name}: expected a bucket or lo..hi, got {raw!r}", where) from None
        for v in (lo_v, hi_v):
            if v not in buckets:
                raise TuningError(f"{name}={v} is not a bucket of {spec.qualname} "
                                  f"({', '.join(map(str, buckets))})", where)
        if hi_v < lo_v:
            raise TuningError(f"{name}: empty range {raw}", where)
        selection.append(tuple(b for b in buckets if lo_v <= b <= hi_v))
    return tuple(selection)


def split_directive(line: str) -> tuple[str, str]:
    """A ``#!`` line's key and value (a tab separates them as a space does)."""
    key, _, value = line[2:].strip().replace("\t", " ").partition(" ")
    return key, value


def _header(spec: Any, text: str, path: str, kind: str,
            report: _Report) -> tuple[dict[str, str], dict[str, str], list[str], list]:
    """Directives (``#! key value``), where each was given (``path:line``), leading
    comments, and the remaining numbered lines.

    The directives are ``DIRECTIVES[kind]``, each once and with a value; anything else is
    an error at its line, sent to ``report`` and the line left out: lint then goes on to
    the body, so a typo in the header does not hide the file's other errors (a lookup's
    report raises at once, as before).
    """
    directives: dict[str, str] = {}
    given: dict[str, str] = {}
    comments: list[str] = []
    rest = []
    in_header = True
    allowed = DIRECTIVES[kind]
    for number, line, where in _lines(text, path):
        if in_header and line.startswith("#!"):
            key, value = split_directive(line)
            if key not in allowed:
                near = difflib.get_close_matches(key, allowed, n=1)
                other = [k for k, names in DIRECTIVES.items() if key in names]
                report(TuningError(f"unknown directive '#! {key}'" + (f" in a {kind} file" if other else "")
                                   + (f" (did you mean '{near[0]}'?)" if near and not other else "")
                                   + f"; a {kind} file's directives are {', '.join(allowed)}", where))
                continue
            if key in directives:
                report(TuningError(f"directive #! {key} given twice", where))
                continue
            if not value.strip() and key != "keys":  # a table without tuning keys writes "#! keys"
                report(TuningError(f"directive #! {key} has no value", where))
                continue
            directives[key] = value.strip()
            given[key] = where
            continue
        if in_header and line.startswith("#"):
            comments.append(line)
            continue
        if in_header and not line:
            continue
        in_header = False
        rest.append((number, line, where))
    magic = f"aotattn-{kind}"
    if directives.get(magic) != str(FORMAT_VERSION):
        raise TuningError(f"expected '#! {magic} {FORMAT_VERSION}' in the header", f"{path}:1")
    if directives.get("table") != spec.qualname:
        raise TuningError(f"expected '#! table {spec.qualname}', got {directives.get('table')!r}",
                          given.get("table", f"{path}:1"))
    return directives, given, comments, rest


def _sections(rest, spec: Any, path: str, report: _Report):
    """Yield (header, header_where, [(number, line, where), ...]) per ``[...]`` section; a
    line that belongs to no section is reported (with a bad header, its whole section)."""
    current = None
    for number, line, where in rest:
        if line.startswith("#!"):
            report(TuningError(f"directive '#! {(line[2:].split() or [''])[0]}' after the header: directives come "
                               "first, before [configs]", where))
            continue
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            if current:
                yield current
            current = (line[1:-1], where, []) if line.endswith("]") else ()
            if not current:
                report(TuningError(f"unclosed section header {line!r}", where))
            continue
        if current is None:
            report(TuningError(f"expected a [section] before {line!r}", where))
        elif current:
            current[2].append((number, line, where))
    if current:
        yield current


def _parse_configs(spec: Any, body, configs: dict[str, Config], report: _Report, broken: set[str],
                   lines: dict[str, str] | None = None) -> None:
    """``broken``: names whose definition is in error (so their uses are not errors too);
    ``lines``: filled with each name's ``path:line``."""
    for _, line, where in body:
        name, eq, values = line.partition("=")
        name = name.strip()
        try:
            if eq and name and name != NO_ENTRY and not _is_name(name):
                broken.add(name)  # its uses are not errors of their own
            if not eq or not name or not _is_name(name) or name == NO_ENTRY:
                raise TuningError(f"expected 'name = knob=value ...', got {line!r}", where)
            if name in configs or name in broken:
                raise TuningError(f"configuration {name!r} defined twice", where)
            broken.add(name)
            configs[name] = parse_config(spec, values, where)
            broken.discard(name)
            if lines is not None:
                lines[name] = where
        except TuningError as exc:
            report(exc)


def header_key(text: str, spec: Any = None) -> tuple[str, ...]:
    """A section header's ``axis=value`` tokens, order-free: what matching a block needs
    (``spec``: the table, whose axes at their ``axis_defaults`` a header may spell out)."""
    spelled = {f"{axis}={format_value(value)}" for axis, value in _axis_defaults(spec).items()}
    return tuple(sorted(t for t in text.split() if t not in spelled))


def functional_key(functional: Functional) -> tuple[str, ...]:
    return tuple(sorted(f"{axis}={format_value(value)}" for axis, value in functional.items))


def parse_table(spec: Any, text: str, path: str = "<table>", only: Collection[Functional] | None = None,
                arch: str | None = None, errors: list[TuningError] | None = None) -> Table:
    """Parse and validate a table file.

    ``only``: parse just the blocks of these functionals (the runtime's lookup, which
    needs one block of a table of hundreds); the other blocks are skipped unread, so
    errors inside them surface in ``aotattn tuning lint``, not here.
    ``arch``: the architecture of the file's folder, which ``#! arch`` must name.
    ``errors``: collect the errors of the body (each config line, section and row) here
    and go on, instead of raising the first; the blocks in error are left out. Header
    errors always raise.
    """
    report = _Report(errors)
    text = _blank_other_sections(text, only, spec)
    directives, given, comments, rest = _header(spec, text, path, "tuning", report)
    table_arch = directives.get("arch")
    if not table_arch:
        raise TuningError("expected '#! arch <arch>' in the header", f"{path}:1")
    if arch is not None and table_arch != arch:
        raise TuningError(f"#! arch {table_arch} in the folder of {arch}: a table's arch is its folder's name "
                          "(move the file, or correct the line)", given["arch"])
    keys_text = directives.get("keys", "")
    if keys_text != _keys_line(spec.tuning_keys):
        raise TuningError(f"expected '#! keys {_keys_line(spec.tuning_keys)}' (the keys {spec.qualname} declares), "
                          f"got {keys_text!r}", given.get("keys", f"{path}:1"))
    table = Table(spec.qualname, table_arch, spec.tuning_keys, directives.get("base"), comments=comments)
    broken: set[str] = set()
    for header, where, body in _sections(rest, spec, path, report):
        if header == "configs":
            _parse_configs(spec, body, table.configs, report, broken)
            continue
        try:
            functional = parse_functional(spec, header, where)
            if functional in table.blocks:
                raise TuningError(f"functional [{header}] appears twice", where)
        except TuningError as exc:
            report(exc)
            continue
        grid = _parse_grid(spec, table, header, where, body, report, broken)
        if grid is not None:
            table.blocks[functional] = grid
    return table


def _parse_grid(spec: Any, table: Table, header: str, where: str, body, report: _Report,
                broken: set[str]) -> list[list[str]] | None:
    """One block's rows; None when any of them is in error (each reported)."""
    rows_n, cols_n = table.shape
    row_buckets = spec.tuning_keys[0][1] if spec.tuning_keys else (None,)
    grid: list[list[str] | None] = [None] * rows_n
    failed = False
    for _, line, lwhere in body:
        try:
            selector, colon, cells_text = line.partition(":")
            if not colon:
                raise TuningError(f"expected 'row: cells', got {line!r}", lwhere)
            rows = _selection(spec, selector, lwhere, allow_ranges=False)
            cells = _cells(spec, cells_text, cols_n, lwhere)
            for name in cells:
                if name != NO_ENTRY and name not in table.configs and name not in broken:
                    raise TuningError(f"unknown configuration {name!r} (not defined in [configs] above)", lwhere)
            for bucket in (rows[0] if rows else (None,)):
                index = row_buckets.index(bucket)
                if grid[index] is not None:
                    raise TuningError(f"row {spec.tuning_keys[0][0]}={bucket} given twice", lwhere)
                grid[index] = list(cells)
        except TuningError as exc:
            report(exc)
            failed = True
    if failed:
        return None
    missing = [str(row_buckets[i]) for i, row in enumerate(grid) if row is None]
    if missing:
        report(TuningError(f"functional [{header}] has no rows for "
                           f"{spec.tuning_keys[0][0] if spec.tuning_keys else '*'}={', '.join(missing)}", where))
        return None
    return grid  # type: ignore[return-value]


def _cells(spec: Any, text: str, width: int, where: str) -> list[str]:
    """A row's cells, ``name*count`` runs expanded. The counts are summed and checked against
    the row's width first: ``big*100000000`` must be an error, not a billion cells."""
    runs = []
    for token in text.split():
        name, star, count = token.partition("*")
        try:
            n = int(count) if star else 1
        except ValueError:
            raise TuningError(f"expected name*count, got {token!r}", where) from None
        if n < 1:
            raise TuningError(f"a run must repeat at least once, got {token!r}", where)
        runs.append((name, n))
    total = sum(n for _, n in runs)
    if total != width:
        raise TuningError(f"expected {width} cells (one per "
                          f"{spec.tuning_keys[1][0] if len(spec.tuning_keys) > 1 else 'row'}), "
                          f"got {total if total < 10**12 else 'far more'}", where)
    return [name for name, n in runs for _ in range(n)]


def parse_patch(spec: Any, text: str, path: str = "<patch>", errors: list[TuningError] | None = None,
                only: Collection[Functional] | None = None) -> Patch:
    """Parse a patch; ``errors`` and ``only`` as in :func:`parse_table` (edits in error are
    left out; with ``only``, the edits of other functionals are skipped unread)."""
    report = _Report(errors)
    text = _blank_other_sections(text, only, spec)
    _, _, comments, rest = _header(spec, text, path, "patch", report)
    patch = Patch(spec.qualname, comments=comments)
    broken: set[str] = set()
    for header, where, body in _sections(rest, spec, path, report):
        if header == "configs":
            _parse_configs(spec, body, patch.configs, report, broken, patch.config_lines)
            continue
        try:
            functional = parse_functional(spec, header, where)
        except TuningError as exc:
            report(exc)
            continue
        for number, line, lwhere in body:
            selector, colon, name = line.partition(":")
            name = name.strip()
            try:
                if not colon or not name or " " in name:
                    raise TuningError(f"expected 'selection: config', got {line!r}", lwhere)
                selection = _selection(spec, selector, lwhere, allow_ranges=True)
            except TuningError as exc:
                report(exc)
                continue
            patch.edits.append(Edit(functional, selection, name, number))
    return patch


# ----------------------------------------------------------------------------- writing


def _runs(cells: Sequence[str]) -> str:
    out = []
    i = 0
    while i < len(cells):
        j = i
        while j < len(cells) and cells[j] == cells[i]:
            j += 1
        out.append(cells[i] if j - i == 1 else f"{cells[i]}*{j - i}")
        i = j
    return " ".join(out)


def write_table(spec: Any, table: Table) -> str:
    """The canonical text of a table: parse(write(t)) == t, write(parse(text)) == text."""
    lines = list(table.comments)
    lines += [f"#! aotattn-tuning {FORMAT_VERSION}", f"#! table {table.table}", f"#! arch {table.arch}"]
    if table.base:
        lines.append(f"#! base {table.base}")
    lines.append(f"#! keys {_keys_line(table.keys)}")
    if table.configs:
        lines += ["", "[configs]"]
        lines += [f"{name} = {format_config(config, spec)}" for name, config in table.configs.items()]
    order = {f: i for i, f in enumerate(spec.enumerate_functionals())}
    for functional in sorted(table.blocks, key=lambda f: order.get(f, len(order))):
        lines += ["", format_functional(spec, functional)]
        grid = table.blocks[functional]
        if not table.keys:
            lines.append(f"*: {_runs(grid[0])}")
            continue
        name, buckets = table.keys[0]
        i = 0
        while i < len(grid):
            j = i
            while j + 1 < len(grid) and grid[j + 1] == grid[i]:
                j += 1
            label = str(buckets[i]) if i == j else f"{buckets[i]}..{buckets[j]}"
            lines.append(f"{name}={label}: {_runs(grid[i])}")
            i = j + 1
    return "\n".join(lines) + "\n"


def write_patch(spec: Any, patch: Patch) -> str:
    lines = list(patch.comments) + [f"#! aotattn-patch {FORMAT_VERSION}", f"#! table {patch.table}"]
    if patch.configs:
        lines += ["", "[configs]"] + [f"{n} = {format_config(c, spec)}" for n, c in patch.configs.items()]
    current = None
    for edit in patch.edits:
        if edit.functional != current:
            lines += ["", format_functional(spec, edit.functional)]
            current = edit.functional
        if not spec.tuning_keys:
            lines.append(f"*: {edit.config}")
            continue
        parts = []
        for (name, buckets), chosen in zip(spec.tuning_keys, edit.selection):
            if tuple(chosen) == tuple(buckets):
                parts.append(f"{name}=*")
            elif len(chosen) == 1:
                parts.append(f"{name}={chosen[0]}")
            else:
                parts.append(f"{name}={chosen[0]}..{chosen[-1]}")
        lines.append(f"{' '.join(parts)}: {edit.config}")
    return "\n".join(lines) + "\n"


def apply_patch(table: Table, patch: Patch, path: str = "<patch>",
                only: Collection[Functional] | None = None, fallback: Any = None,
                added: dict[Functional, set[tuple[int, int]]] | None = None,
                errors: list[TuningError] | None = None) -> Table:
    """A copy of ``table`` with the patch's configurations added and its cells set.

    ``only``: the table holds just these functionals' blocks; edits of others are skipped.
    ``fallback``: the spec's fallback; a patch may then add a block for a functional the
    table lacks (a refinement), starting as a copy of the block its lookup falls back to.
    ``added``: the blocks patches added so far and the cells they set, updated in place;
    :func:`follow_fallbacks` then gives the other cells the fallback blocks' final values.
    ``errors``: as in :func:`parse_table` (an edit in error is left out).
    """
    report = _Report(errors)
    out = table.copy()
    for name, config in patch.configs.items():
        if out.configs.get(name, config) != config:  # the earlier one stays (an error, when collected)
            report(TuningError(f"configuration {name!r} is already defined with other knobs: a patch adds "
                               "configurations and cannot change one (every cell naming it would move); give "
                               "this one a new name", patch.config_lines.get(name, path)))
            continue
        out.configs[name] = config
    index = [{b: i for i, b in enumerate(buckets)} for _, buckets in table.keys]
    for edit in patch.edits:
        where = f"{path}:{edit.line}"
        if only is not None and edit.functional not in only:
            continue
        if edit.functional not in out.blocks and (grid := _fallback_grid(out, edit.functional, fallback)) is not None:
            out.blocks[edit.functional] = grid
            if added is not None:
                added[edit.functional] = set()
        if edit.functional not in out.blocks:
            report(TuningError(f"the patch edits a functional the table does not have: "
                               f"{dict(edit.functional.items)}", where))
            continue
        if edit.config != NO_ENTRY and edit.config not in out.configs:
            report(TuningError(f"unknown configuration {edit.config!r}", where))
            continue
        grid = out.blocks[edit.functional]
        rows = [index[0][b] for b in edit.selection[0]] if table.keys else [0]
        cols = [index[1][b] for b in edit.selection[1]] if len(table.keys) > 1 else [0]
        for r in rows:
            for c in cols:
                grid[r][c] = edit.config
        if added is not None and edit.functional in added:
            added[edit.functional].update((r, c) for r in rows for c in cols)
    return out


def follow_fallbacks(table: Table, added: Mapping[Functional, Collection[tuple[int, int]]], fallback: Any) -> None:
    """Give each block the patches added (``added``: its functional and the cells the patches
    set) its fallback block's final cells wherever no patch set one, in place.

    A refinement's block differs from the block its lookups fell back to only in the
    cells patches set, whatever later patches (or later edits of the same patch) do to
    that fallback: a re-tuned root moves the refinement's other cells with it."""
    done: set[Functional] = set()

    def resolve(functional: Functional) -> None:
        if functional in done:
            return
        done.add(functional)
        twin = _nearest_fallback(table, functional, fallback)
        if twin is None:
            return
        if twin in added:
            resolve(twin)
        grid, source, own = table.blocks[functional], table.blocks[twin], added[functional]
        for r, row in enumerate(grid):
            for c in range(len(row)):
                if (r, c) not in own:
                    row[c] = source[r][c]

    for functional in added:  # every one has its block: apply_patch adds it before recording it
        resolve(functional)


def fallback_chain(fallback: Any, functional: Functional) -> list[Functional]:
    """``functional`` and its declared fallbacks, in the order a lookup tries them."""
    chain = [functional]
    while fallback is not None and (twin := fallback(chain[-1].as_dict())) is not None:
        chain.append(Functional.of(twin))
    return chain


def block_for(table: Table, chain: Sequence[Functional], where: str, source: str = "") -> Functional:
    """The first functional of ``chain`` (:func:`fallback_chain`) that ``table`` has a block
    for; a :class:`TuningError` naming ``where`` (and the file, ``source``) when none has."""
    used = next((f for f in chain if f in table.blocks), None)
    if used is None:
        raise NoEntryError(f"{where}: no block for functional [{chain[0]}]"
                          + (f" nor its fallbacks [{'], ['.join(map(str, chain[1:]))}]" if len(chain) > 1 else "")
                          + (f" in {source}" if source else ""))
    return used


def _nearest_fallback(table: Table, functional: Functional, fallback: Any) -> Functional | None:
    """The nearest functional of ``functional``'s fallback chain that ``table`` has a block for, or None."""
    return next((f for f in fallback_chain(fallback, functional)[1:] if f in table.blocks), None)


def _fallback_grid(table: Table, functional: Functional, fallback: Any) -> list[list[str]] | None:
    """A copy of the grid of the nearest block in ``functional``'s fallback chain, or None."""
    found = _nearest_fallback(table, functional, fallback)
    return None if found is None else [list(row) for row in table.blocks[found]]


def bucket_index(buckets: Sequence[int], value: int) -> int:
    """Smallest bucket at least ``value``, clamped to the largest."""
    for i, bucket in enumerate(buckets):
        if value <= bucket:
            return i
    return len(buckets) - 1


def cell(table: Table, functional: Functional, sizes: Mapping[str, int]) -> str:
    grid = table.blocks[functional]
    r = bucket_index(table.keys[0][1], sizes[table.keys[0][0]]) if table.keys else 0
    c = bucket_index(table.keys[1][1], sizes[table.keys[1][0]]) if len(table.keys) > 1 else 0
    return grid[r][c]
