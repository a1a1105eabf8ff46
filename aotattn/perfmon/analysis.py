"""What a perfdb says: tuning faults within one run, regressions between two.

Both work on recorded numbers only, so they are the same on the GPU host, in CI and on
a laptop.

A *tuning fault*: on a backward pass, a forced backend beat the operator's own choice by
more than the measured noise. The noise of a pass is the largest of the unforced and
the forced runs' spreads and the difference between the unforced call and the forced
call of the backend it chose (the same kernels, timed twice: a direct measure of the
run-to-run noise). The fault points at the ``flash.backward`` cell the choice came from.

A *regression*: an entry that got slower by more than ``threshold`` and by more than the
two runs' spreads together; an *improvement* likewise the other way.

A *feature cost*: within one run, an entry with dropout, a bias or the deterministic
backward against its *plain twin*, the entry of the same call without that feature: the
time ratio per pass, for aotattn and for each peer that timed both.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace

from aotattn.perfmon.entries import BACKWARD_PASSES, Entry
from aotattn.perfmon.perfdb import Perfdb, Record
from aotattn.perfmon.providers import AOTATTN, FORCED, PEERS

BACKEND_TABLE = "flash.backward"  # the operator table whose cells choose a backward's backend


@dataclass(frozen=True)
class Fault:
    entry: str
    pass_: str
    choice: str
    choice_ms: float
    winner: str
    winner_ms: float
    noise_ms: float
    cell: str | None

    @property
    def speedup(self) -> float:
        """How much faster the forced backend was than the operator's choice."""
        return self.choice_ms / self.winner_ms


def _noise(*records: Record | None) -> float:
    spreads = [r.spread_ms or 0.0 for r in records if r is not None and r.ok]
    return max(spreads, default=0.0)


def _backward_passes(db: Perfdb, records: dict[tuple[str, str, str], Record]):
    """(entry, pass, unforced record, its backend choice, noise of that choice) of every
    backward pass whose choice was recorded (``records``: ``db.by_key()``). The noise is
    :func:`_noise` of the unforced and the forced runs of the chosen backend and the
    difference between them."""
    for name in db.entries:
        for pass_ in BACKWARD_PASSES:
            unforced = records.get((name, pass_, AOTATTN))
            if unforced is None or not unforced.ok:
                continue
            choice = unforced.notes().get("choice")
            if choice not in FORCED.values():
                continue
            same = records.get((name, pass_, f"{AOTATTN}:{choice}"))
            noise = _noise(unforced, same)
            if same is not None and same.ok:
                noise = max(noise, abs(unforced.ms - same.ms))
            yield name, pass_, unforced, choice, noise


def _forced(records: dict[tuple[str, str, str], Record], name: str, pass_: str) -> dict[str, Record]:
    """backend -> the forced run of it, for the backends that ran (``records``: Perfdb.by_key)."""
    found = {}
    for provider, backend in FORCED.items():
        other = records.get((name, pass_, provider))
        if other is not None and other.ok:
            found[backend] = other
    return found


def faults(db: Perfdb, margin: float = 0.0) -> list[Fault]:
    """Every tuning fault in a run; ``margin``: also require the forced backend to win by
    this fraction of the choice's time."""
    found = []
    records = db.by_key()
    for name, pass_, unforced, choice, noise in _backward_passes(db, records):
        for backend, other in _forced(records, name, pass_).items():
            if backend == choice:
                continue
            threshold = max(noise, _noise(other)) + margin * unforced.ms
            if unforced.ms - other.ms > threshold:
                found.append(Fault(name, pass_, choice, unforced.ms, backend, other.ms,
                                   max(noise, _noise(other)), unforced.notes().get("cell")))
    return found


# Axes a table leaves out of a cell's name at their default (``axis_defaults``) whose value an
# entry's own fields decide. A note written before such an axis existed reads as its default;
# where the entry's call has another value, it reads another cell now. (A test checks that
# every such axis of flash.backward is here.)
ENTRY_AXES = {"GROUPED": lambda entry: entry.group_size > 1}


def note_problem(entry: Entry, cell: str) -> str | None:
    """Why the cell a note names is not a cell ``entry``'s call reads with the tables as
    declared now, or None: a cell named in an older format (before the table had some of its
    axes), or one without an axis the entry decides (:data:`ENTRY_AXES`: a grouped-query
    call noted before ``GROUPED`` existed reads the ``GROUPED=True`` cell now). A patch made
    from such a note would edit a block the timed call no longer reads."""
    from aotattn.perfmon.provenance import parse_cell

    try:
        parsed = parse_cell(cell)
    except ValueError as exc:
        reason = str(exc).removeprefix(f"cell {cell!r}: ").removeprefix("cell: ")
        return f"not a cell of the tables as declared now ({reason}): measure the entry again"
    return _axis_problem(entry, parsed)


def _axis_problem(entry: Entry, parsed) -> str | None:
    from aotattn import families

    defaults = dict(getattr(families.tables()[parsed.table], "axis_defaults", ()))
    values = parsed.functional.as_dict()
    for axis, decide in ENTRY_AXES.items():
        if axis in defaults and values.get(axis, defaults[axis]) != decide(entry):
            return (f"noted without {axis}={decide(entry)}, which the entry's call has: noted before {parsed.table} "
                    "had that axis, the call reads another cell now (measure the entry again)")
    return None


def patchable(db: Perfdb, found: list[Fault]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The backend each faulty cell can be set to, and the cells left alone with why.

    Several entries can read one ``flash.backward`` cell (a window-span lookup reads the
    cell of its span; a grouped-query call reads the cell of the same call without groups).
    A cell is changed only when every entry of the run that reads it agrees. It is
    contested when two faults on it name different winners, or when another entry reading
    it timed the winner slower than its current choice by more than the noise. Setting that
    cell would trade one entry's speed for another's.

    Returns ``({cell: backend}, {cell: [reasons]})``, with the cells as the notes spell them.
    """
    winners: dict[str, set[str]] = defaultdict(set)
    for f in found:
        if f.cell:
            winners[f.cell].add(f.winner)
    contested: dict[str, list[str]] = {cell: [f"faults disagree ({', '.join(sorted(w))})"]
                                       for cell, w in winners.items() if len(w) > 1}
    for cell in winners:  # a note edited or from another run: a patch would give that table a backend
        if cell.partition("[")[0] != BACKEND_TABLE:
            contested.setdefault(cell, []).append(f"not a {BACKEND_TABLE} cell: the backend choice is made there")
    changes = {cell: next(iter(w)) for cell, w in winners.items() if len(w) == 1}
    records = db.by_key()
    parsed: dict[str, object] = {}
    for name, pass_, unforced, choice, noise in _backward_passes(db, records):
        cell = unforced.notes().get("cell")
        backend = changes.get(cell)
        if backend is None or backend == choice or _reads_another_cell_now(db.entries[name], cell, parsed):
            continue
        other = _forced(records, name, pass_).get(backend)
        if other is not None and other.ms - unforced.ms > max(noise, _noise(other)):
            contested.setdefault(cell, []).append(
                f"{name} {pass_} is faster with {choice} ({unforced.ms:.4g} ms against {backend} {other.ms:.4g} ms)")
    return {cell: b for cell, b in changes.items() if cell not in contested}, contested


def _reads_another_cell_now(entry: Entry, cell: str, parsed: dict[str, object]) -> bool:
    """The entry's note names ``cell`` as a table did before an axis the entry decides: its
    timing says nothing about that cell now (``parsed``: a cache of parsed cells)."""
    from aotattn.perfmon.provenance import parse_cell

    if cell not in parsed:
        try:
            parsed[cell] = parse_cell(cell)
        except ValueError:
            parsed[cell] = None  # not a cell of today's tables: the faults' own check says so
    return parsed[cell] is not None and _axis_problem(entry, parsed[cell]) is not None


@dataclass(frozen=True)
class Change:
    """One (entry, pass, provider) in two runs. ``speed``: A's time over B's (above 1: B is faster)."""

    entry: str
    group: str
    pass_: str
    provider: str
    a_ms: float | None
    b_ms: float | None
    noise_ms: float
    verdict: str  # regression, improvement, same, failed in B, fixed in B, not measured, only in A/B, changed
    # the plan's notes (backend choice, each kernel's configuration) that differ between the
    # runs: () for the same plan, None where a run has no plan to compare (peers, failures)
    plan_changes: tuple[str, ...] | None = None

    @property
    def speed(self) -> float | None:
        if self.a_ms is None or self.b_ms is None:
            return None
        return self.a_ms / self.b_ms


@dataclass
class Comparison:
    changes: list[Change]

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == "regression"]

    @property
    def failures(self) -> list[Change]:
        """Measured in A, no figure in B (an error, a wrong result, a skipped peer)."""
        return [c for c in self.changes if c.verdict == "failed in B"]

    @property
    def improvements(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == "improvement"]

    @property
    def in_both(self) -> list[Change]:
        """The (entry, pass, provider) records both runs have, of the same declaration: what
        was compared (none: a pass of `--fail-on-regression` would mean nothing)."""
        return [c for c in self.changes if c.verdict not in ("only in A", "only in B", "changed")]

    def geomeans(self) -> dict[tuple[str, str, str], tuple[int, float]]:
        """(group, pass, provider) -> (entries compared, geometric mean of the speed)."""
        logs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        for c in self.changes:
            if c.speed is not None:  # the logs apart: a/b of 1e-300 and 1e300 ms underflows to 0
                logged = math.log(c.a_ms) - math.log(c.b_ms)
                logs[(c.group, c.pass_, c.provider)].append(logged)
                logs[("all", c.pass_, c.provider)].append(logged)
        return {key: (len(v), _exp(sum(v) / len(v))) for key, v in sorted(logs.items())}


def _exp(x: float) -> float:
    """``math.exp``, infinite past the float range (a mean log ratio of extreme but valid figures)."""
    return math.exp(x) if x < 709.0 else math.inf


# a peer's record whose call raised ("skipped: <Exception>: ..."), not one the run chose
# not to make ("skipped: no sliding window")
_RAISED = re.compile(r"skipped: (while timing, )?[A-Za-z_.]*(Error|Exception|Interrupt)\b")


def peer_failures(db: Perfdb) -> list[tuple[str, str, int, str]]:
    """(peer, pass, entries, message) for each way a peer's call raised in this run, most
    entries first: a peer that raises on every entry (FlexAttention's backward before the
    thirtieth session) leaves no figure to compare with, which a summary would not show."""
    counts = Counter((r.provider, r.pass_, r.note) for r in db.records
                     if r.provider in PEERS and not r.ok and _RAISED.match(r.note))
    return [(provider, pass_, n, note) for (provider, pass_, note), n in counts.most_common()]


def compare(a: Perfdb, b: Perfdb, providers: tuple[str, ...] = (AOTATTN,), threshold: float = 0.03) -> Comparison:
    """Entry by entry, B against A, for ``providers`` (empty: all)."""
    ra, rb = a.by_key(), b.by_key()
    keys = [k for k in ra if k not in rb] + list(rb)
    ran_in_b = {provider for _, _, provider in rb}
    changes = []
    for key in keys:
        name, pass_, provider = key
        if providers and provider not in providers:
            continue
        entry = b.entries.get(name) or a.entries[name]
        ea, eb = a.entries.get(name), b.entries.get(name)
        x, y = ra.get(key), rb.get(key)
        a_ms = x.ms if x is not None else None
        b_ms = y.ms if y is not None else None
        noise = _noise(x) + _noise(y)
        same_entry = ea is not None and eb is not None and ea.describe() == eb.describe()
        if y is None and a_ms is not None and same_entry and provider in ran_in_b:
            verdict = "failed in B"  # B declares the entry and ran the provider, and has no figure for it
        elif x is None or y is None:
            verdict = "only in A" if y is None else "only in B"
        elif not same_entry:
            verdict, a_ms, b_ms = "changed", None, None
        elif a_ms is None or b_ms is None:
            verdict = "failed in B" if b_ms is None and a_ms is not None else (
                "fixed in B" if b_ms is not None else "not measured")
        elif b_ms > a_ms * (1 + threshold) and b_ms - a_ms > noise:
            verdict = "regression"
        elif a_ms > b_ms * (1 + threshold) and a_ms - b_ms > noise:
            verdict = "improvement"
        else:
            verdict = "same"
        changes.append(Change(name, entry.group, pass_, provider, a_ms, b_ms, noise, verdict, _plan_changes(x, y)))
    return Comparison(changes)


def _plan_changes(x: Record | None, y: Record | None) -> tuple[str, ...] | None:
    """The plan notes (``choice=``, ``attn_bwd_ws=``, ...) that differ between two records of
    one entry, sorted; None unless both ran and noted a plan. A timing change with the same
    plan is drift between runs, or a change of kernel code under the same configurations."""
    if x is None or y is None or not x.ok or not y.ok:
        return None
    na, nb = x.notes(), y.notes()
    if not na or not nb:
        return None
    return tuple(sorted(k for k in na.keys() | nb.keys() if na.get(k) != nb.get(k)))


# The features a cost is measured for, and the entry fields that switch them off.
FEATURES = {"dropout": {"dropout_p": 0.0}, "bias": {"bias": "none"}, "deterministic": {"deterministic": False}}


@dataclass(frozen=True)
class Cost:
    entry: str  # the entry with the feature
    plain: str  # its plain twin
    feature: str
    pass_: str
    provider: str
    ms: float
    plain_ms: float

    @property
    def ratio(self) -> float:
        """The feature's time over the plain call's (1.3: the feature costs 30%)."""
        return self.ms / self.plain_ms


def _call(entry) -> tuple:
    """What makes two entries the same call: every field but the name, the group and the
    run's own choices (Flex, which passes)."""
    return replace(entry, name="", group="", flex=False, passes=())


def feature_costs(db: Perfdb) -> list[Cost]:
    """Every entry of a feature against its plain twin in the same run (entries without a
    twin are left out), for each pass and provider both timed."""
    calls = {_call(e): name for name, e in db.entries.items()}
    twins = {}  # entry -> [(feature, its plain twin)]
    for name, entry in db.entries.items():
        for feature, off in FEATURES.items():
            if any(getattr(entry, field) != value for field, value in off.items()):  # it uses the feature
                plain = calls.get(_call(replace(entry, **off)))
                if plain is not None:
                    twins.setdefault(name, []).append((feature, plain))
    records = db.by_key()
    costs = []
    for (name, pass_, provider), r in records.items():
        for feature, plain in twins.get(name, ()):
            twin = records.get((plain, pass_, provider))
            if r.ok and twin is not None and twin.ok:
                costs.append(Cost(name, plain, feature, pass_, provider, r.ms, twin.ms))
    return costs


@dataclass(frozen=True)
class Standing:
    """An entry's pass against one peer, from the latest run that timed both side by side."""

    entry: str
    group: str
    pass_: str
    peer: str
    aot_ms: float
    peer_ms: float
    spread: float  # the larger of the two relative spreads (round medians' range / median)
    run: str  # the run's tag
    date: str
    newer: str | None  # the date of a later run that timed aotattn here without the peer

    @property
    def ratio(self) -> float:
        """The peer's time over aotattn's (above 1: aotattn is faster)."""
        return self.peer_ms / self.aot_ms


def standing(runs: Iterable[tuple[str, Perfdb]], peer: str) -> list[Standing]:
    """Every entry and pass against ``peer``, each from the latest run (by its ``date``
    header) in which aotattn and the peer both have a figure: where the repository stands
    on a peer when no one run times everything (FlexAttention compiles per shape, so its runs
    are split by group). A run that declares an entry with other fields than the latest
    declaration of that name (another shape under the same name) does not count for it.
    ``newer`` flags a figure that later tuning may have moved: a later run timed aotattn
    on that entry and pass without the peer."""
    ordered = sorted(runs, key=lambda run: run[1].header.get("date", ""))
    declared = {name: entry.describe() for _, db in ordered for name, entry in db.entries.items()}
    found: dict[tuple[str, str], Standing] = {}
    last: dict[tuple[str, str], tuple[str, str]] = {}  # (entry, pass) -> (tag, date) of aotattn's latest figure
    for tag, db in ordered:
        date = db.header.get("date", "")
        records = db.by_key()
        for (name, pass_, provider), ours in records.items():
            entry = db.entries[name]
            if provider != AOTATTN or not ours.ok or entry.describe() != declared[name]:
                continue
            last[name, pass_] = tag, date
            theirs = records.get((name, pass_, peer))
            if theirs is None or not theirs.ok:
                continue
            spread = max((r.spread_ms or 0.0) / r.ms for r in (ours, theirs))
            found[name, pass_] = Standing(name, entry.group, pass_, peer, ours.ms, theirs.ms, spread, tag, date, None)
    return [replace(s, newer=None if last[key][0] == s.run else last[key][1]) for key, s in sorted(found.items())]
