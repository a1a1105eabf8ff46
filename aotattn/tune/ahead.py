"""Compile a batch's candidates ahead of the GPU slice, with the build's compiler.

Every candidate of every task (the same pruning and ranking the worker applies, so the
lists agree) and the configurations the database holds for the other kernels a task's
problems launch (the forward before a backward kernel, the preprocess, ...) become build
jobs, compiled in parallel into the build's cache and packed into one image folder
(``<images>/<arch>/<table>.aotimg``) that the GPU host loads through the runtime, as
users do. Compiling needs no GPU: run it on the CPU machine and carry the folder, or on
the GPU host when its cores are worth more than its device time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotattn.compiler.builder import Outcome, compile_and_pack
from aotattn.compiler.jobs import Job
from aotattn.spec import Functional
from aotattn.tune.harnesses import harness
from aotattn.tune.runner import Settings, task_candidates, timed_problem
from aotattn.tune.tasks import Task, table_spec


def _sizes(shape: Any) -> tuple[int, int]:
    return shape.seqlen_q, shape.seqlen_k


def task_jobs(task: Task, settings: Settings, db: Any) -> list[Job]:
    """The kernels one task needs: its candidates, and the database's choices for the
    other kernels at every size its problems have."""
    h = harness(task.table)
    spec = table_spec(task.table)
    jobs = []
    if hasattr(spec, "arguments"):  # a kernel table: its candidates
        current = h.current_config(db, task.arch, task.table, task.functional, task.cell)
        configs, _ = task_candidates(task, settings, current)
        jobs += [Job(task.arch, task.table, task.functional, config) for config in configs]
    shapes = [*h.accuracy_shapes(task.functional, task.cell, settings.accuracy_batch, settings.accuracy_heads),
              timed_problem(task, settings)]
    for table, functional in h.auxiliary(task.table, task.functional, task.arch):
        for shape in shapes:
            config = h.current_config(db, task.arch, table, functional, _sizes(shape))
            if config is None:
                raise ValueError(f"{task.arch} / {table}: the database has no configuration for [{functional}] "
                                 f"at {shape}; a {task.table} problem needs one")
            jobs.append(Job(task.arch, table, functional, config))
    return jobs


def plan(tasks: Iterable[tuple[Task, Settings]], db: Any) -> list[Job]:
    """Every kernel a batch of ``(task, its settings)`` needs, each once, in first-needed order."""
    seen: dict[tuple[str, str, Functional, Any], Job] = {}
    for task, settings in tasks:
        for job in task_jobs(task, settings, db):
            seen.setdefault((job.arch, job.table, job.functional, job.config), job)
    return list(seen.values())


@dataclass
class AheadReport:
    outcomes: list[Outcome]
    archives: list[Path]

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in ("failed", "timeout")]

    def seconds_per_kernel(self) -> float | None:
        """Compile time per kernel actually compiled (what sizes the next batch)."""
        compiled = [o.seconds for o in self.outcomes if o.status == "compiled"]
        return sum(compiled) / len(compiled) if compiled else None


def compile_ahead(jobs: Sequence[Job], images: Path, cache: Path, workers: int, timeout: float = 600.0,
                  on_outcome: Callable[[Outcome], None] = lambda o: None) -> AheadReport:
    """Compile ``jobs`` (cached ones are reused) and pack them into the image folder ``images``.

    A failed compile is reported and leaves that candidate out of the images; the worker
    records it as ``no-image``.
    """
    outcomes, archives = compile_and_pack(jobs, Path(cache), Path(images), workers, timeout, on_outcome)
    return AheadReport(outcomes, archives)
