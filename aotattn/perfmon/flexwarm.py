"""Compile FlexAttention's graphs for a run's entries in parallel processes, before timing.

FlexAttention is timed through ``torch.compile`` with one static graph a shape
(providers._compiled_flex): tracing, AOTAutograd and Inductor's lowering run in one Python
thread, about 20 s an entry on the H200 host, most of a ``--flex-all`` run. The calls a
run makes are made here first, a few entries at a time in ``jobs`` processes; what they
compile lands in Inductor's and AOTAutograd's on-disk caches (TORCHINDUCTOR_CACHE_DIR),
so the timing process finds its graphs there and only traces. Nothing here is timed: a
failure is reported and the run then records its own error for the entry.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed

from aotattn.perfmon import providers as P
from aotattn.perfmon.entries import Entry


def flex_passes(entry: Entry, flex: bool | str) -> list[str]:
    """The passes of ``entry`` in which a run with this ``flex`` setting calls FlexAttention."""
    return [p for p in entry.passes if P.unsupported(entry, "flex", p, flex) is None]


def _compile_entry(entry: Entry, device: str, flex: bool | str, seed: int) -> tuple[str, str | None]:
    """In a worker: make the entry's inputs and call FlexAttention in every pass a run
    times it in (forward and backward graphs), as measure.evaluate does."""
    import torch

    from aotattn.perfmon import measure

    try:
        x = P.make_inputs(entry, torch.device(device), seed)
        for pass_ in flex_passes(entry, flex):
            measure.evaluate(entry, x, pass_, "flex", 0.0)
        del x
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    except Exception as exc:  # the timed run meets it again and records it
        return entry.name, measure._one_line(exc)
    return entry.name, None


def warm(entries: Sequence[Entry], device: str, flex: bool | str, seed: int, jobs: int,
         on_done: Callable[[str, str | None], None] | None = None) -> dict[str, str | None]:
    """Compile FlexAttention for every entry that calls it, in ``jobs`` spawned processes.
    Returns {entry name: None, or why its compile failed}; ``on_done`` is told each as it ends."""
    todo = [e for e in entries if flex_passes(e, flex)]
    found: dict[str, str | None] = {}
    if not todo or jobs < 1:
        return found
    context = multiprocessing.get_context("spawn")  # a CUDA context does not survive fork
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=context) as pool:
        futures = {pool.submit(_compile_entry, e, device, flex, seed): e.name for e in todo}
        for future in as_completed(futures):
            try:
                name, error = future.result()
            except Exception as exc:  # the worker died (killed for memory, say)
                name, error = futures[future], f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
            found[name] = error
            if on_done is not None:
                on_done(name, error)
    return found
