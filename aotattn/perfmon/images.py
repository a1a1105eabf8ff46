"""The kernel images a perfmon run needs, and building exactly those.

On a GPU the operators run kernels compiled ahead of time; a run of every entry needs
each (kernel, functional, configuration) its calls resolve to for the target
architecture. :func:`needed_jobs` finds them by calling the public operators on
uninitialised CPU tensors of each entry's shape (one batch entry, one key head and its
query group: the sizes that choose a functional and a tuning cell) with the launch
replaced by nothing and each configuration looked up for ``arch``: the operators' own
code decides, so the list cannot drift from what a run loads. Forward and both backward
backends are planned, as perfmon forces each.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from aotattn import tuning
from aotattn.compiler.jobs import Job
from aotattn.perfmon import providers as P
from aotattn.perfmon.entries import Entry
from aotattn.perfmon.provenance import uncached_plans


class _NoLaunch:
    """Stands in for an interpreted kernel: indexing by a grid gives a call that does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def planning_for(arch: str, db: tuning.Database | None = None) -> Iterator[set[Job]]:
    """Inside the block, flash operators on CPU tensors plan for ``arch`` and run nothing;
    the jobs their plans name are collected into the yielded set.

    Three seams are used: the family's ``rules.config_for`` (every configuration a plan
    gets) answers with ``arch``'s database; the runtime's interpreter (where CPU launches
    go) hands out kernels that do nothing; and the operators' plan cache is a fresh one
    for the block, so no call is served a plan made before (its configurations would not
    be looked up) and no plan made for ``arch`` outlives the block.
    """
    from aotattn.families.flash import rules
    from aotattn.runtime import interpreter

    db = db or tuning.database()
    jobs: set[Job] = set()
    original_config_for, original_interpreted = rules.config_for, interpreter.interpreted_function

    def config_for(kernel, functional, device, **sizes):
        config = db.lookup(arch, kernel, functional, sizes)
        if hasattr(kernel, "arguments"):
            jobs.add(Job(arch, kernel.qualname, functional, config))
        return config

    rules.config_for = config_for
    interpreter.interpreted_function = lambda module, function: _NoLaunch()
    try:
        with uncached_plans():
            yield jobs
    finally:
        rules.config_for, interpreter.interpreted_function = original_config_for, original_interpreted


def planning_entry(entry: Entry) -> Entry:
    """The entry shrunk to the sizes that decide plans: one batch entry (varlen: its
    lengths), one key head and its query group."""
    shrunk = dataclasses.replace(entry, heads_q=entry.group_size, heads_k=1)
    return shrunk if entry.api == "varlen" else dataclasses.replace(shrunk, batch=1)


def needed_jobs(entries: Iterable[Entry], arch: str, db: tuning.Database | None = None) -> list[Job]:
    """Every kernel variant the entries' calls (forward, backward under each backend) use on ``arch``."""
    from aotattn.families.flash import rules

    backends = [b for b in rules.BACKENDS if b != "ws" or P.ws_backward_runs_on(arch)]
    with planning_for(arch, db) as jobs, torch.enable_grad():
        for entry in entries:
            small = dataclasses.replace(planning_entry(entry), passes=("fwd", "bwd"), training=False)
            x = P.make_inputs(small, torch.device("cpu"), 0, fill=False)
            for backend in backends:
                if backend == "ws" and not P.ws_backward_serves(small):
                    continue
                out = P.call_aotattn(small, x, backend)
                torch.autograd.grad(out, x.leaves(), x.dout)
    return sorted(jobs, key=lambda j: (j.table, str(j.functional), str(j.config)))


def build(entries: Iterable[Entry], arch: str, out: Path, cache: Path, workers: int, timeout: float,
          on_outcome=lambda outcome: None, db: tuning.Database | None = None):
    """Compile the entries' kernels (taking what the cache has) and pack them under ``out``.

    Returns (outcomes, archives).
    """
    from aotattn.compiler import builder

    jobs = needed_jobs(entries, arch, db)
    return builder.compile_and_pack(jobs, cache, out, workers, timeout, on_outcome)
