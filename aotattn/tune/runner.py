"""Run one tuning task: every candidate checked for accuracy, timed, gated, one chosen.

For a task (one cell of one table) on one device:

1. **Candidates**: the declared tuning space, pruned (:mod:`.candidates`) and ranked to
   ``limit`` at the cell's sizes, plus the database's current choice. On a GPU a
   candidate whose image is missing from the image folder, or whose compiled kernel
   needs more shared memory than the target has, is dropped with that reason.
2. **Accuracy apart**, at batch 3 x 5 heads: the cell's own lengths, then irregular
   lengths (and, for padded functionals, head dims) near it, against the float64
   reference. NaN, inf or an exception disqualifies; so does an error above the
   library's tolerance for the dtype.
3. **Timing at a GPU-filling size** (``batch x heads x seqlen_q ~ 2**17``), from images,
   L2 flushed and inputs fresh before every call (:mod:`.timing`): first a probe of two
   calls per accurate candidate; the ``finalists`` fastest within ``finalist_margin`` of
   the best probe, and the current choice, are then timed in full (median of 5-30
   calls, as many as fit ``budget_ms``). The timed outputs must be finite.
4. **The gate**: eligible are the timed candidates whose error is within
   ``error_multiple`` (3) times the most accurate candidate's error (and within the
   tolerance). The winner is the fastest eligible one; the current choice is kept
   unless the winner beats it by more than ``min_gain`` (2%) or the measured spread,
   whichever is larger.

A journal (one JSON line per candidate started and finished) makes a task resumable: a
rerun skips the candidates already measured, and a candidate that was started but never
finished (the process died: an illegal address kills the CUDA context) is recorded as
crashed. After a CUDA error the context is unusable, so the task ends the process
(:data:`EXIT_DEVICE_LOST`); its rerun resumes from the journal.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from aotattn.spec import Config
from aotattn.tune import candidates as cand
from aotattn.tune import timing
from aotattn.tune.tasks import Task, table_spec

TUNER_VERSION = "1"
RESULT_FORMAT = "aotattn-tune-result/1"
JOURNAL_VAR = "AOTATTN_TUNE_JOURNAL"
EXIT_DEVICE_LOST = 3

# The library's accuracy bounds, relative error norms against the float64 reference by
# dtype: the same numbers the tests (tests/helpers.py) and `aotattn check` hold kernels to.
TOLERANCE = {"bf16": 1e-2, "fp16": 5e-3, "fp32": 1e-5}

OK, INACCURATE, NAN, FAILED, CRASHED, NO_IMAGE, TOO_LARGE, SLOW = (
    "ok", "inaccurate", "nan", "failed", "crashed", "no-image", "too-large", "slow")
# a candidate's own kernel is not in the image folder; any other no-image is a kernel its
# problem launches beside it (the preprocess, the forward, the ws tile) that the batch lacks
NOT_BUILT = "not in the image folder (not built, or its compile failed)"


@dataclass(frozen=True)
class Settings:
    """How a task is measured; carried in the task payload so every worker does the same.

    Attributes:
        tokens: ``batch x heads x seqlen_q`` of the timed problem.
        memory_bytes: cap on the timed problem's tensors.
        min_traffic_bytes: the least the timed problem reads and writes (more batch than
            ``tokens`` where it would move less; 0: none). A smaller working set mostly
            lives in the L2 (50 MB on the H200: the output written there, K and V read from
            it after the first touch) and its timings rank latency rather than bandwidth:
            the small-key forward cells timed at 2^17 tokens (33 MiB at d64) kept
            configurations 1.3-1.5x slower at the perfmon entries' 132 MiB
            (benchmarks/RESULTS.md, 2026-12-04, thirty-fourth session). A CUDA device's
            only: on the CPU the interpreter times ``tokens`` alone.
        accuracy_batch, accuracy_heads: the accuracy problems' batch and heads.
        error_multiple: eligible within this multiple of the most accurate candidate's error.
        limit: candidates per cell kept by the speed model (plus the current choice).
        knobs: also every knob variant of the current choice's tile (candidates.knob_variants).
        finalists: candidates timed in full after the probe (plus the current choice).
        finalist_margin: a finalist's probe is within this factor of the best probe.
        budget_ms: device time for one candidate's full measurement.
        repeats: fewest and most timed calls of a full measurement.
        min_gain: the winner must beat the current choice by this fraction (or its spread).
    """

    tokens: int = 2**17
    memory_bytes: int = 8 << 30
    min_traffic_bytes: int = 128 << 20
    accuracy_batch: int = 3
    accuracy_heads: int = 5
    error_multiple: float = 3.0
    limit: int = 8
    knobs: bool = True
    finalists: int = 4
    finalist_margin: float = 1.25
    budget_ms: float = 150.0
    repeats: tuple[int, int] = (5, 30)
    min_gain: float = 0.02

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "Settings":
        data = dict(data or {})
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"settings: unknown keys {', '.join(unknown)} (known: {', '.join(known)})")
        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        def whole(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        repeats = data.get("repeats", cls.repeats)
        if not (isinstance(repeats, (list, tuple)) and len(repeats) == 2 and all(whole(r) for r in repeats)
                and 1 <= repeats[0] <= repeats[1]):
            raise ValueError(f"settings.repeats: expected [fewest, most], integers with 1 <= fewest <= most, "
                             f"got {repeats!r}")
        data["repeats"] = tuple(repeats)
        settings = cls(**data)
        for name in ("tokens", "accuracy_batch", "accuracy_heads", "limit", "finalists"):
            value = getattr(settings, name)
            if not whole(value) or value < 1:
                raise ValueError(f"settings.{name}: expected an integer >= 1, got {value!r}")
        for name in ("memory_bytes", "min_traffic_bytes"):
            value = getattr(settings, name)
            if not whole(value) or value < 0:
                raise ValueError(f"settings.{name}: expected a byte count >= 0, got {value!r}")
        if not isinstance(settings.knobs, bool):
            raise ValueError(f"settings.knobs: expected true or false, got {settings.knobs!r}")
        for name in ("error_multiple", "finalist_margin"):
            value = getattr(settings, name)
            if not number(value) or value < 1.0:
                raise ValueError(f"settings.{name}: expected a number >= 1, got {value!r}")
        if not number(settings.budget_ms) or settings.budget_ms <= 0:
            raise ValueError(f"settings.budget_ms: expected a number of milliseconds above 0, got {settings.budget_ms!r}")
        if not number(settings.min_gain) or not 0 <= settings.min_gain < 1:
            raise ValueError(f"settings.min_gain: expected a fraction in [0, 1), got {settings.min_gain!r}")
        return settings

    @classmethod
    def of_line(cls, table: str, data: Mapping[str, Any] | None) -> "Settings":
        """A batch line's settings: the table's defaults, with what the line carries."""
        default = cls.for_table(table)
        return default if not data else cls.from_json({**default.to_json(), **data})

    @classmethod
    def for_table(cls, table: str, **changes: Any) -> "Settings":
        """The defaults, timed at the table's own size (its harness's ``default_tokens``), with
        its harness's ``default_limit`` where it has one (a small space timed whole)."""
        from aotattn.tune.harnesses import harness

        h = harness(table)
        defaults: dict[str, Any] = {"tokens": h.default_tokens(table)}
        if hasattr(h, "default_limit"):
            defaults["limit"] = h.default_limit(table)
        return cls(**{**defaults, **changes})


def task_candidates(task: Task, settings: Settings,
                    current: Config | None) -> tuple[list[Config], dict[Config, str]]:
    """A kernel task's (candidates, pruned -> reason), the same for the compile ahead, the
    estimate and the worker: the limit's best, the current choice and, with
    ``settings.knobs``, its tile's knob variants. Computed once per (task, settings,
    current choice): `tune plan` asks twice per task (kernels and GPU time)."""
    kept, pruned = _task_candidates(task, settings, current)
    return list(kept), dict(pruned)


@functools.lru_cache(maxsize=8192)
def _task_candidates(task: Task, settings: Settings, current: Config | None):
    spec = table_spec(task.table)
    return cand.candidates(spec, task.functional, task.arch, _harness(task.table).footprint(task.table),
                           keep=[current] if current is not None else [],
                           sizes=dict(zip((k for k, _ in spec.tuning_keys), task.cell)),
                           limit=settings.limit, knobs=settings.knobs)


class DeviceLost(RuntimeError):
    """A CUDA error left the context unusable: the process must end (the task resumes)."""


# ----------------------------------------------------------------------------- the gate


def gate(errors: Mapping[str, float], tolerance: float, multiple: float = 3.0) -> tuple[float, set[str]]:
    """(bound, eligible names): errors within ``multiple`` x the smallest finite error and
    within ``tolerance``. NaN and inf are never eligible; no finite error: bound NaN."""
    finite = {name: e for name, e in errors.items() if math.isfinite(e)}
    if not finite:
        return math.nan, set()
    bound = min(tolerance, multiple * min(finite.values()))
    return bound, {name for name, e in finite.items() if e <= bound}


def choose(records: Mapping[str, Mapping[str, Any]], eligible: set[str], current: str | None,
           min_gain: float) -> str | None:
    """The fastest eligible timed candidate; the current one unless beaten by more than
    ``min_gain`` or the larger of the two spreads."""
    timed = {n: r for n, r in records.items() if n in eligible and r.get("median_ms") is not None}
    if not timed:
        return None
    best = min(timed, key=lambda n: (timed[n]["median_ms"], n))
    if current in timed and best != current:
        margin = max(min_gain, timed[best].get("spread") or 0.0, timed[current].get("spread") or 0.0)
        if timed[best]["median_ms"] >= timed[current]["median_ms"] * (1.0 - margin):
            return current
    return best


# ----------------------------------------------------------------------------- journal


class Journal:
    """Per-task JSON lines: a header ``{"journal": 1, "settings": ..., "run": ...}``, then
    ``{"start": name}`` and ``{"done": record}`` per candidate; fsync'd.

    A journal resumes only the run it was written for: the same settings (a record timed at
    another size or limit is not comparable) and the same ``run`` (the pgdef key, which
    ``tune dispatch --rerun`` changes to measure again). Any other journal of the task,
    one without a header included, is started afresh."""

    def __init__(self, directory: Path | None, task: Task, settings: Settings | None = None,
                 run: str | None = None):
        self.path = None if directory is None else Path(directory) / f"{task.id}.jsonl"
        self.header = {"journal": 1, "settings": None if settings is None else settings.to_json(), "run": run}
        self.fresh = True  # the file holds no line of this run yet: the first append rewrites it

    def load(self) -> dict[str, dict[str, Any]]:
        """Finished records by name; a candidate started and never finished is crashed."""
        if self.path is None or not self.path.is_file():
            return {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            first = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            first = None
        if first != json.loads(json.dumps(self.header)):
            return {}  # another run's journal (or none of ours): rewritten at the first append
        self.fresh = False
        done: dict[str, dict[str, Any]] = {}
        started: list[str] = []
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the crash
            if "start" in entry:
                started.append(entry["start"])
            elif "done" in entry:
                done[entry["done"]["name"]] = entry["done"]
        for name in started:
            if name not in done:
                done[name] = {"name": name, "status": CRASHED,
                              "message": "the process died while running it (see the worker's log)"}
        return done

    def _append(self, entry: dict[str, Any]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w" if self.fresh else "a") as out:
            if self.fresh:
                out.write(json.dumps(self.header) + "\n")
                self.fresh = False
            out.write(json.dumps(entry, allow_nan=True) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def start(self, name: str) -> None:
        self._append({"start": name})

    def done(self, record: dict[str, Any]) -> None:
        self._append({"done": record})


def journal_dir() -> Path | None:
    value = os.environ.get(JOURNAL_VAR)
    return Path(value) if value else None


# ----------------------------------------------------------------------------- running


def _harness(table: str) -> Any:
    from aotattn.tune import harnesses

    return harnesses.harness(table)


def timed_problem(task: Task, settings: Settings, device_type: str = "cuda") -> Any:
    """The problem a task is timed on (its harness's shape; ``str`` of it is the result's
    ``shape``). The floor on what it moves is for a GPU's bandwidth: the interpreter's clock
    says nothing of it, and 128 MiB of interpreted rows took hours a task."""
    return _harness(task.table).timing_shape(task.functional, task.cell, settings.tokens, settings.memory_bytes,
                                             settings.min_traffic_bytes if device_type == "cuda" else 0)


def _device_ok(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except RuntimeError:
        return False


def _gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def image_lookup(task: Task, device: torch.device) -> Callable[[Config], Any] | None:
    """``config -> Entry or None`` in the task's image archive when the runtime will load
    kernels from images (a CUDA device in AOT mode, a kernel table); else None."""
    if device.type != "cuda" or os.environ.get("AOTATTN_MODE", "aot") != "aot" or \
            not hasattr(table_spec(task.table), "arguments"):
        return None
    from aotattn.runtime.images import Archive, ImageError, archive_path, images_root

    harness = _harness(task.table)
    try:
        archive = Archive(archive_path(images_root(), task.arch, task.table))
    except ImageError:
        return lambda config: None
    return lambda config: archive.entry(harness.image_key(task.table, task.functional, config))


class _Run:
    """State of one task's run on one device."""

    def __init__(self, task: Task, settings: Settings, device: torch.device, db: Any, journal: Journal,
                 log: Callable[[str], None]):
        self.task, self.settings, self.device, self.db, self.journal, self.log = task, settings, device, db, journal, log
        self.spec = table_spec(task.table)
        self.harness = _harness(task.table)
        self.tolerance = TOLERANCE.get(task.functional.as_dict().get("dtype"), TOLERANCE["fp32"])
        self.records = journal.load()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(time.time_ns() % 2**63)

    def candidates(self) -> tuple[list[Config], dict[Config, str], Config | None]:
        t = self.task
        current = self.harness.current_config(self.db, t.arch, t.table, t.functional, t.cell)
        kept, pruned = task_candidates(t, self.settings, current)
        return kept, pruned, current

    def _record(self, config: Config, **fields_: Any) -> dict[str, Any]:
        record = {"name": cand.config_name(config), "config": config.as_dict(), **fields_}
        self.records[record["name"]] = record
        self.journal.done(record)
        return record

    def _guard(self, config: Config, what: Callable[[], Any]) -> tuple[Any, str | None, str]:
        """Run ``what``; an exception becomes a message and a status (``no-image`` for an
        image the batch lacks, a kernel the problem launches beside the candidate; else
        ``failed``), a dead device ends the task."""
        from aotattn.runtime.images import ImageMissing

        try:
            return what(), None, OK
        except Exception as exc:  # the candidate's failure, recorded
            if not _device_ok(self.device):
                raise DeviceLost(f"{cand.config_name(config)}: {type(exc).__name__}: {exc}") from exc
            return None, f"{type(exc).__name__}: {exc}"[:1000], NO_IMAGE if isinstance(exc, ImageMissing) else FAILED

    def accuracy(self, config: Config, problems: list[Any], references: list[dict[str, torch.Tensor]]) -> dict:
        errors: dict[str, float] = {}
        for problem, ref in zip(problems, references):
            def run(problem=problem):
                problem.reset()
                problem.runner(config)()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                return self.harness.errors(problem.outputs(), ref)

            found, message, status = self._guard(config, run)
            if message is not None:
                return {"status": status, "message": message, "errors": errors}
            for name, err in found.items():
                errors[f"{problem.shape} {name}"] = err
        worst = max(errors.values(), key=lambda e: math.inf if math.isnan(e) else e) if errors else math.nan
        if not all(math.isfinite(e) for e in errors.values()):
            return {"status": NAN, "error": None, "errors": {k: _json_float(v) for k, v in errors.items()},
                    "message": "NaN or inf in the output"}
        status = OK if worst <= self.tolerance else INACCURATE
        return {"status": status, "error": worst, "errors": errors}

    def measure(self, config: Config, problem: Any, warmup: int,
                repeats: int) -> tuple[timing.Timing | None, str | None, str]:
        def run():
            call = problem.runner(config)
            result = timing.measure(lambda _: call(), problem.refill, device=self.device, warmup=warmup,
                                    repeats=repeats)
            if not all(torch.isfinite(t).all() for t in problem.outputs().values()):
                raise FloatingPointError("non-finite values in the timed problem's outputs")
            return result

        return self._guard(config, run)


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run_task(task: Task, settings: Settings | None = None, *, device: torch.device | str | None = None,
             db: Any = None, journal: Path | None = None, run_key: str | None = None,
             log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Tune one task; returns its result (JSON-ready; see docs/tuner.md, "Results").

    Args:
        task: the cell to tune.
        settings: how to measure (default :class:`Settings`).
        device: ``cuda`` (default when present) or ``cpu`` (the interpreter: tiny sizes,
            a CPU clock that only exercises the code path).
        db: the tuning database whose current choice is kept unless beaten (default:
            the one the operators use).
        journal: folder of per-task journals (default ``$AOTATTN_TUNE_JOURNAL``; None: none).
        run_key: names this run (the pgdef task's key): a journal of another run is not resumed.
        log: receives one line per candidate.

    Raises:
        DeviceLost: a CUDA error made the context unusable; end the process and rerun.
    """
    start = time.monotonic()
    settings = settings or Settings.for_table(task.table)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if db is None:
        from aotattn import tuning

        db = tuning.database()
    run = _Run(task, settings, device, db,
               Journal(journal if journal is not None else journal_dir(), task, settings, run_key), log)
    h = run.harness
    configs, pruned, current = run.candidates()
    names = {cand.config_name(c) for c in configs}  # the journal's records of these candidates only
    run.records = {name: record for name, record in run.records.items() if name in names}
    images = image_lookup(task, device)
    limit = cand.target(task.arch).shared_memory
    problems = [h.Problem(task.table, task.functional, shape, device, run.generator)
                for shape in h.accuracy_shapes(task.functional, task.cell, settings.accuracy_batch,
                                               settings.accuracy_heads)]
    references = [p.reference() for p in problems]
    timed_shape = timed_problem(task, settings, device.type)
    timed = h.Problem(task.table, task.functional, timed_shape, device, run.generator)

    # 1-2: images, accuracy; 3a: the probe
    probes: dict[str, float] = {}
    for config in configs:
        name = cand.config_name(config)
        previous = run.records.get(name)
        if previous is not None:
            if previous.get("probe_ms") is not None and previous["status"] in (OK, SLOW):
                probes[name] = previous["probe_ms"]
            continue
        if images is not None:
            entry = images(config)
            if entry is None:
                run._record(config, status=NO_IMAGE, message=NOT_BUILT)
                continue
            if entry.shared > limit:
                run._record(config, status=TOO_LARGE, shared=entry.shared,
                            message=f"compiled kernel needs {entry.shared} B of shared memory > {limit} B")
                continue
        run.journal.start(name)
        found = run.accuracy(config, problems, references)
        if found["status"] != OK:
            run._record(config, **found)
            log(f"{name}: {found['status']} {found.get('message', '')}")
            continue
        probe, message, status = run.measure(config, timed, warmup=1, repeats=2)
        if message is not None:
            run._record(config, status=status, message=message, error=found["error"], errors=found["errors"])
            log(f"{name}: {status} {message}")
            continue
        probes[name] = probe.median_ms
        run._record(config, status=OK, error=found["error"], errors=found["errors"], probe_ms=probe.median_ms)
        log(f"{name}: error {found['error']:.2e}, probe {probe.median_ms:.4f} ms")

    # 3b: the finalists, timed in full; 4: the gate
    current_name = cand.config_name(current) if current is not None else None
    by_name = {cand.config_name(c): c for c in configs}
    best_probe = min(probes.values()) if probes else math.nan
    ranked = sorted(probes, key=lambda n: (probes[n], n))
    finalists = [n for n in ranked if probes[n] <= settings.finalist_margin * best_probe][:settings.finalists]
    if current_name in probes and current_name not in finalists:
        finalists.append(current_name)
    for name in ranked:
        if name not in finalists and run.records[name].get("median_ms") is None:
            run.records[name].update(status=SLOW, message=f"probe {probes[name]:.4f} ms > "
                                                          f"{settings.finalist_margin} x the best {best_probe:.4f} ms")
            run.journal.done(run.records[name])
    # the gate compares every accurate candidate's error (timed in full or not)
    errors = {n: r["error"] for n, r in run.records.items() if r["status"] in (OK, SLOW) and r.get("error") is not None}
    bound, eligible = gate(errors, run.tolerance, settings.error_multiple)

    def time_in_full(name: str) -> None:
        record = run.records[name]
        if record.get("median_ms") is not None:
            return
        repeats = timing.repeats_for(probes[name], settings.budget_ms, lowest=settings.repeats[0],
                                     highest=settings.repeats[1])
        result, message, status = run.measure(by_name[name], timed, warmup=1, repeats=repeats)
        if message is not None:
            record.update(status=status, message=message)
            eligible.discard(name)
        else:
            record.update(status=OK, median_ms=result.median_ms, spread=result.spread, repeats=result.repeats,
                          tflops=result.tflops(h.flops(task.table, timed_shape, task.functional)))
            record.pop("message", None)
            log(f"{name}: {result.median_ms:.4f} ms (spread {result.spread:.1%}, {result.repeats} calls)")
        run.journal.done(record)

    for name in finalists:
        if name in by_name:
            time_in_full(name)
    # no finalist eligible: the eligible ones are timed in full, in probe order, until one is
    spare = [n for n in ranked if n in eligible and n not in finalists and n in by_name]
    while spare and not any(run.records[n].get("median_ms") is not None for n in eligible):
        time_in_full(spare.pop(0))
    winner = choose(run.records, eligible, current_name, settings.min_gain)
    no_winner = None if winner is not None else "no eligible candidate"
    unbuilt = run.records.get(current_name, {})
    if unbuilt.get("status") == NO_IMAGE and unbuilt.get("message") != NOT_BUILT:
        # the current choice ran into a kernel the batch did not build beside it: it was not
        # compared, so nothing replaces it (the cell stays as it is; compile the batch again)
        no_winner = (f"the current choice {current_name} launches a kernel the batch lacks "
                     f"({unbuilt['message'][:300]}); compile the batch again (aotattn tune compile)")
        log(f"no winner: {no_winner}")
        winner = None
    for name, record in run.records.items():
        record["eligible"] = name in eligible
    return {
        "format": RESULT_FORMAT, "tuner": TUNER_VERSION, "id": task.id, "task": task.to_json(),
        "settings": settings.to_json(), "device": _gpu_name(device), "clock": timing.CLOCK_CUDA if device.type == "cuda"
        else timing.CLOCK_CPU, "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - start, 3), "shape": str(timed_shape),
        "accuracy_shapes": [str(p.shape) for p in problems], "tolerance": run.tolerance,
        "bound": _json_float(bound), "current": current_name, "winner": winner, "no_winner": no_winner,
        "winner_config": run.records[winner]["config"] if winner else None,
        "pruned": len(pruned), "candidates": [_clean(r) for r in run.records.values()],
    }


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    """JSON without NaN: non-finite errors become None (their status says why)."""
    out = dict(record)
    if "errors" in out:
        out["errors"] = {k: _json_float(v) if isinstance(v, float) else v for k, v in out["errors"].items()}
    for key in ("error", "median_ms", "probe_ms", "spread", "tflops"):
        if isinstance(out.get(key), float):
            out[key] = _json_float(out[key])
    return out


def _versions() -> dict[str, str]:
    import aotattn

    versions = {"aotattn": aotattn.__version__, "torch": torch.__version__}
    try:
        from importlib.metadata import version

        versions["triton"] = version("triton")
    except Exception:  # triton need not be installed where images run
        versions["triton"] = "not installed"
    return versions
