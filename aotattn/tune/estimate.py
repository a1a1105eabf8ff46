"""How long a task takes on the GPU, estimated before running it (to size batches).

A model, not a measurement: the timed problem's standard FLOP count at an assumed
throughput, times the calls the runner makes (accuracy, probe, full timing of the
finalists, the inputs made afresh before each call), plus fixed costs (the float64
reference, loading each candidate's kernel). Compare with the ``seconds`` every result
records, and adjust ``THROUGHPUT`` when they disagree.
"""

from __future__ import annotations

import math
from typing import Any

from aotattn.tune import timing
from aotattn.tune.harnesses import harness
from aotattn.tune.runner import Settings, task_candidates, timed_problem
from aotattn.tune.tasks import Task, table_spec

THROUGHPUT = 250e12  # FLOP/s of a typical candidate (H200, bf16: the seeds run 200-500)
FP64_THROUGHPUT = 20e12  # the reference's float64 einsums, memory-bound
PER_CANDIDATE_S = 0.05  # kernel load, accuracy launches, synchronizations
PER_TASK_S = 0.5  # problems, references' allocations, result


def gpu_seconds(task: Task, settings: Settings, db: Any = None) -> float:
    """``db``: the tuning database the task will run against; with it a kernel task's
    candidates are counted exactly (runner.task_candidates), without it bounded from above."""
    h = harness(task.table)
    shape = timed_problem(task, settings)
    call = h.flops(task.table, shape, task.functional) / THROUGHPUT + 20e-6
    # fresh inputs before each call: for a backward, a forward (2/5 of its FLOPs) and the refill
    fresh = call * 0.4 if task.table != "flash.attn_fwd" else call * 0.1
    spec = table_spec(task.table)
    # a kernel table: the limit, the current choice and its tile's knob variants (candidates.knob_variants)
    if not hasattr(spec, "arguments"):  # an operator table: its few choices
        candidates = len(spec.tuning_space[0][1])
    elif db is not None:
        current = h.current_config(db, task.arch, task.table, task.functional, task.cell)
        candidates = len(task_candidates(task, settings, current)[0])
    else:
        candidates = settings.limit + (knob_combinations(spec) if settings.knobs else 1)
    reference = sum(h.flops(task.table, s, task.functional) for s in
                    h.accuracy_shapes(task.functional, task.cell, settings.accuracy_batch,
                                      settings.accuracy_heads)) / FP64_THROUGHPUT
    repeats = timing.repeats_for(call * 1e3, settings.budget_ms, lowest=settings.repeats[0],
                                 highest=settings.repeats[1])
    finalists = min(candidates, settings.finalists + 1)
    return (PER_TASK_S + reference + candidates * (PER_CANDIDATE_S + 3 * (call + fresh))
            + finalists * (1 + repeats) * (call + fresh))


def knob_combinations(spec) -> int:
    """How many ways a kernel's extra knobs (``spec.knob_defaults``) combine: at most that
    many candidates come from the current choice's tile and its shallower stages (each
    setting once, :func:`aotattn.tune.candidates.knob_variants`)."""
    knobs = {name for name, _ in spec.knob_defaults}
    return math.prod(len(choices) for name, choices in spec.tuning_space if name in knobs)
