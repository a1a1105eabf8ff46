"""Perfmon as a pgdef application: one task per entry, results gathered into a perfdb file.

Category ``perfmon,entry``, pool = the architecture (``sm_90``), key ``<tag>/<entry>``
(dispatching a run twice queues each entry once), payload::

    {"tag": "h200-seeded", "entry": "<name>", "describe": "<Entry.describe()>",
     "options": {"rounds": 3, "reps": 5, "warmup": 2, "peers": true, "flex": true, "seed": 0}}

The payload carries the whole entry, so a worker measures what was dispatched even where
its own declaration differs. The handler measures every pass of the entry on the
worker's GPU (``$AOTATTN_PERFMON_DEVICE=cpu``: in the interpreter, for tests) and
returns its records with the worker's environment; :func:`collect` turns results into a
:class:`~aotattn.perfmon.perfdb.Perfdb`. Online: ``aotattn perfmon worker``; offline
hosts: ``aotattn pgdef run-offline BATCH --app aotattn.perfmon.app``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from aotattn.perfmon.budget import MAX_SEED, Plan
from aotattn.perfmon.entries import Entry, by_name, declared
from aotattn.perfmon.perfdb import Perfdb, Record, check_tag
from aotattn.pgdef import App, PayloadError, TaskContext, TaskSpec
from aotattn.tune import timing

APP = "perfmon"
KIND = "entry"
CATEGORY = f"{APP},{KIND}"
DEVICE_VAR = "AOTATTN_PERFMON_DEVICE"
RESULT_FORMAT = "aotattn-perfmon-result/1"
_OPTION_FIELDS = ("rounds", "reps", "warmup", "peers", "flex", "seed")
_OPTIONAL_FIELDS = {"hide_host_ms": 0.0}  # added later: a payload without it means the default

app = App(APP, "perfmon: the public operators timed on one entry per task (docs/perfmon.md)")


def payload(tag: str, entry: Entry, options: Any) -> dict[str, Any]:
    """The task of measuring ``entry`` for run ``tag`` with ``options`` (:class:`~aotattn.perfmon.measure.Options`)."""
    plan = options.plan
    return {"tag": check_tag(tag), "entry": entry.name, "describe": entry.describe(),
            "options": {"rounds": plan.rounds, "reps": plan.reps, "warmup": plan.warmup, "peers": options.peers,
                        "flex": options.flex, "seed": options.seed,
                        **({"hide_host_ms": plan.hide_host_ms} if plan.hide_host_ms else {})}}


def task_spec(tag: str, entry: Entry, options: Any, priority: int = 0) -> TaskSpec:
    return TaskSpec(payload(tag, entry, options), key=f"{tag}/{entry.name}", priority=priority)


def parse_payload(data: Any):
    """(tag, entry, options) of a payload; :class:`PayloadError` saying what is wrong."""
    from aotattn.perfmon.measure import Options

    expected = "expected {'tag', 'entry', 'describe', 'options'} as `aotattn perfmon dispatch` writes it"
    if not isinstance(data, Mapping) or not {"tag", "entry", "describe", "options"} <= set(data):
        raise PayloadError(f"perfmon: bad payload; {expected}")
    try:
        tag = check_tag(data["tag"])
        entry = Entry.parse(data["entry"], data["describe"])
        raw = data["options"]
        if not isinstance(raw, Mapping) or not set(_OPTION_FIELDS) <= set(raw) <= {*_OPTION_FIELDS, *_OPTIONAL_FIELDS}:
            got = sorted(raw) if isinstance(raw, Mapping) else raw
            raise ValueError(f"options: expected keys {_OPTION_FIELDS} (and optionally {tuple(_OPTIONAL_FIELDS)}), "
                             f"got {got}")
        hide = raw.get("hide_host_ms", _OPTIONAL_FIELDS["hide_host_ms"])
        counts = [raw[k] for k in ("rounds", "reps", "warmup", "seed")]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts) or min(counts[:2]) < 1 \
                or counts[2] < 0 or not 0 <= counts[3] <= MAX_SEED or not isinstance(raw["peers"], bool) \
                or not (isinstance(raw["flex"], bool) or raw["flex"] == "all") \
                or not timing.valid_hide_host_ms(hide):
            raise ValueError(f"options: rounds, reps >= 1, warmup >= 0, seed integers (seed in [0, 2**63)), peers a boolean, flex a "
                             f"boolean or 'all', hide_host_ms milliseconds in [0, {timing.MAX_HIDE_HOST_MS:g}]; "
                             f"got {raw}")
        options = Options(Plan(raw["rounds"], raw["reps"], raw["warmup"], float(hide)), raw["peers"], raw["flex"],
                          raw["seed"])
    except (ValueError, TypeError, AttributeError) as exc:  # AttributeError: a describe that is no text
        raise PayloadError(f"perfmon: bad payload ({exc}); {expected}") from exc
    return tag, entry, options


def _validate(data: dict[str, Any]) -> None:
    parse_payload(data)


def record_to_json(record: Record) -> dict[str, Any]:
    return {("pass" if k == "pass_" else k): v for k, v in dataclasses.asdict(record).items()}


_RECORD_NUMBERS = ("ms", "spread_ms", "tflops", "ratio")


def record_from_json(data: Mapping[str, Any]) -> Record:
    """A task output's record, each field of the type a worker writes (TypeError otherwise:
    ``"ms": true`` was exported as 1 ms, ``"ms": "fast"`` failed in the writer)."""
    if not isinstance(data, Mapping):
        raise TypeError(f"a record: expected an object, got {type(data).__name__}")
    record = Record(**{("pass_" if k == "pass" else k): v for k, v in data.items()})
    for name in ("entry", "pass_", "provider", "note"):
        if not isinstance(getattr(record, name), str):
            raise TypeError(f"{name}: expected text, got {getattr(record, name)!r}")
    for name in _RECORD_NUMBERS:
        value = getattr(record, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value < 0):
            raise TypeError(f"{name}: expected a finite number >= 0 or null, got {value!r}")
    return record


@app.task(KIND, device="gpu", max_attempts=2, validate=_validate)
def handle(data: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """Measure one entry on this worker's GPU (its only visible one)."""
    import torch

    from aotattn.perfmon.measure import environment, measure_entry

    tag, entry, options = parse_payload(data)
    device = os.environ.get(DEVICE_VAR, "cuda")
    if device not in ("cuda", "cpu"):
        raise RuntimeError(f"{DEVICE_VAR}: expected cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"perfmon tasks run on a GPU worker; this process sees no CUDA device "
                           f"({DEVICE_VAR}=cpu runs them in the interpreter, for tests)")
    dev = torch.device(device)
    records = measure_entry(entry, dev, options)
    env = environment(dev, options.plan, command=f"pgdef worker {ctx.worker_id}, task {ctx.task.id}")
    return {"format": RESULT_FORMAT, "tag": tag, "entry": entry.name, "describe": entry.describe(),
            "environment": env, "records": [record_to_json(r) for r in records]}


def collect(outputs: Iterable[Mapping[str, Any]], tag: str) -> Perfdb:
    """The perfdb of run ``tag`` from task outputs (others ignored), entries in declaration order.

    The header is the first result's environment; workers whose environment differs
    (another GPU, tuning revision or version) are listed in the comments.
    """
    chosen = [o for o in outputs if isinstance(o, Mapping) and o.get("format") == RESULT_FORMAT and o.get("tag") == tag]
    for output in chosen:  # what the header is made of, checked before it is used
        env = output.get("environment")
        if not isinstance(output.get("entry"), str) or not isinstance(env, Mapping) \
                or not isinstance(env.get("date"), str):
            raise ValueError(f"a malformed perfmon result for entry {output.get('entry')!r} of tag {tag} (entry, "
                             "environment or its date missing): measure it again")
    if not chosen:
        raise ValueError(f"no perfmon results for tag {tag!r} (offline batches are checked in with "
                         "`aotattn pgdef checkin`)")
    order = {name: i for i, name in enumerate(by_name(declared()))}
    chosen.sort(key=lambda o: (order.get(o["entry"], len(order)), o["entry"]))
    first = chosen[0]["environment"]
    db = Perfdb(header={"tag": tag, **first})
    db.header["date"] = max(o["environment"]["date"] for o in chosen)
    db.header["command"] = f"aotattn perfmon export --tag {tag} ({len(chosen)} pgdef tasks)"
    for key in ("arch", "gpu", "tuning", "triton", "torch", "aotattn", "mode", "timing"):
        others = sorted({o["environment"].get(key) for o in chosen} - {first.get(key)}, key=str)
        if others:
            db.comments.append(f"{key} differs between workers: also {'; '.join(map(str, others))}")
    for output in chosen:
        if output["entry"] in db.entries:
            raise ValueError(f"two results for entry {output['entry']} of tag {tag}")
        try:
            records = output["records"]
            if not isinstance(records, list):
                raise TypeError(f"records: expected a list, got {type(records).__name__}")
            db.add(Entry.parse(output["entry"], output["describe"]), [record_from_json(r) for r in records])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"a malformed perfmon result for entry {output.get('entry')!r} of tag {tag} "
                             f"({type(exc).__name__}: {exc}): measure it again") from None
    return db
