"""GPU timing that means what users get, for any callable.

A measurement is the median of ``repeats`` timed calls after ``warmup`` untimed ones.
Before every call (timed or not):

1. fresh inputs are made by ``inputs()`` (untimed), so no call reads what a previous one
   left in caches, and data-dependent shortcuts cannot hide behind one lucky input;
2. on a GPU, the L2 cache is flushed by writing a buffer larger than it (twice the L2
   size, at least 64 MiB), *after* the inputs were made: the timed call reads its
   operands from memory, as a layer in a model does;
3. the call is bracketed by two CUDA events on the current stream; the host never waits
   between calls, so the flush ahead of each call also hides the call's host launch time
   (as a training step's queue does). All events are read after one synchronize.
   The flush lasts tens of microseconds; a call whose host work takes longer (a backward
   through autograd, 0.1-0.3 ms) shows it in its time. ``hide_host_ms`` queues a GPU wait
   of that long before the flush, so the host issues the whole call while the GPU waits
   and the events time the GPU alone.

On a CPU (Triton's interpreter, tests) the same loop runs with ``time.perf_counter`` and
no flush: that clock only exercises the code path; its figures mean nothing for speed.

Importing this module needs neither a GPU nor Triton; the GPU is touched on the first
measurement of a CUDA callable.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T")

CLOCK_CUDA = "cuda-events"
CLOCK_CPU = "cpu-perf-counter"

# Floor on the flush buffer when the driver does not report an L2 size (or reports a
# small one): 64 MiB exceeds the L2 of every GPU aotattn targets except the MI300
# family's 256 MB Infinity Cache, which the 2x-L2 rule covers when reported.
_MIN_FLUSH_BYTES = 64 << 20


@dataclass(frozen=True)
class Timing:
    """A measurement: milliseconds per call.

    Attributes:
        median_ms: the median of ``samples_ms``, the figure to compare.
        samples_ms: every timed call, in order.
        clock: ``"cuda-events"`` (meaningful) or ``"cpu-perf-counter"`` (interpreter: a
            code-path check, not a speed).
        flushed_bytes: bytes written before each call to evict the L2 (0: no flush).
    """

    median_ms: float
    samples_ms: tuple[float, ...]
    clock: str
    flushed_bytes: int = 0

    @property
    def repeats(self) -> int:
        return len(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: the run-to-run noise, relative."""
        return relative_spread(self.samples_ms)

    @property
    def meaningful(self) -> bool:
        """Whether the figure is a speed (a GPU clock) rather than a code-path check."""
        return self.clock == CLOCK_CUDA

    def tflops(self, flops: float) -> float:
        """Throughput for a call of ``flops`` floating-point operations."""
        return flops / (self.median_ms * 1e-3) / 1e12

    def as_dict(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "spread": self.spread,
                "repeats": self.repeats, "clock": self.clock, "flushed_bytes": self.flushed_bytes}


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of ``values`` (non-empty)."""
    if not values:
        raise ValueError("quantile: expected at least one value, got none")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile: expected q in [0, 1], got {q}")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def relative_spread(samples: Sequence[float]) -> float:
    """(75th - 25th percentile) / median; 0 for a single sample."""
    median = statistics.median(samples)
    if median <= 0:
        return 0.0
    return (quantile(samples, 0.75) - quantile(samples, 0.25)) / median


# ----------------------------------------------------------------------------- L2 flush

_FLUSH_BUFFERS: dict[int, torch.Tensor] = {}


def l2_bytes(device: torch.device) -> int:
    """The L2 cache size the driver reports for ``device`` (0 when it reports none)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 0)


def flush_buffer(device: torch.device) -> torch.Tensor:
    """The per-device int8 buffer whose overwrite evicts the L2: 2x its size, >= 64 MiB."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    buffer = _FLUSH_BUFFERS.get(index)
    if buffer is None:
        size = max(2 * l2_bytes(torch.device("cuda", index)), _MIN_FLUSH_BYTES)
        buffer = torch.empty(size, dtype=torch.int8, device=torch.device("cuda", index))
        _FLUSH_BUFFERS[index] = buffer
    return buffer


# ----------------------------------------------------------------------------- measuring


# SM clock cycles per millisecond a GPU wait counts (torch.cuda._sleep spins for cycles):
# at most 2 GHz on the GPUs aotattn targets, so a wait lasts at least what was asked
_CYCLES_PER_MS = 2_000_000
MAX_HIDE_HOST_MS = 100.0  # the longest GPU wait before a call (hide_host_ms)


def _check_counts(warmup: int, repeats: int, hide_host_ms: float = 0.0) -> None:
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup: expected an integer >= 0, got {warmup!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats!r}")
    if not valid_hide_host_ms(hide_host_ms):
        raise ValueError(f"hide_host_ms: expected milliseconds in [0, {MAX_HIDE_HOST_MS:g}], got {hide_host_ms!r}")


def valid_hide_host_ms(value: Any) -> bool:
    """Whether ``value`` is a GPU wait :func:`measure` takes: milliseconds in [0, MAX_HIDE_HOST_MS]."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value <= MAX_HIDE_HOST_MS


def measure(fn: Callable[[T], Any], inputs: Callable[[], T], *, device: torch.device | str,
            warmup: int = 3, repeats: int = 20, flush: bool = True, hide_host_ms: float = 0.0) -> Timing:
    """Time ``fn(inputs())`` as users run it: the median of ``repeats`` calls after ``warmup``.

    Args:
        fn: the callable timed; it receives what ``inputs()`` returned, and must enqueue
            its GPU work on the current stream (every aotattn launch and torch op does).
        inputs: makes fresh inputs, called before every call (warm-up included), untimed.
            Returning the same tensors refilled in place (``t.normal_()``) is as fresh
            and saves allocations at large sizes.
        device: where ``fn`` runs: a CUDA device (event timing, L2 flush) or ``"cpu"``
            (wall clock, no flush; a code-path check, never a speed).
        warmup: untimed calls first (loading, first-call work).
        repeats: timed calls; the median is reported.
        flush: evict the L2 before each call (GPU only).
        hide_host_ms: a GPU wait of this many milliseconds queued before each call (GPU
            only; 0: none), so the host's work for the call hides behind it and the figure
            is the GPU's time alone.

    Returns:
        A :class:`Timing`. An exception raised by ``fn`` (or a CUDA error surfacing at the
        final synchronize) propagates: a caller treats it as a failed candidate.
    """
    _check_counts(warmup, repeats, hide_host_ms)
    if not callable(fn) or not callable(inputs):
        raise TypeError(f"fn and inputs: expected callables, got {type(fn).__name__} and {type(inputs).__name__}")
    device = torch.device(device)
    if device.type == "cuda":
        return _measure_cuda(fn, inputs, device, warmup, repeats, flush, hide_host_ms)
    if device.type == "cpu":
        return _measure_cpu(fn, inputs, warmup, repeats)
    raise ValueError(f"device: expected a cuda or cpu device, got {device}")


def _measure_cpu(fn: Callable[[T], Any], inputs: Callable[[], T], warmup: int, repeats: int) -> Timing:
    for _ in range(warmup):
        fn(inputs())
    samples = []
    for _ in range(repeats):
        args = inputs()
        start = time.perf_counter()
        fn(args)
        samples.append((time.perf_counter() - start) * 1e3)
    return Timing(statistics.median(samples), tuple(samples), CLOCK_CPU, 0)


def _measure_cuda(fn: Callable[[T], Any], inputs: Callable[[], T], device: torch.device, warmup: int,
                  repeats: int, flush: bool, hide_host_ms: float = 0.0) -> Timing:
    with torch.cuda.device(device):
        buffer = flush_buffer(device) if flush else None
        for _ in range(warmup):
            fn(inputs())
        torch.cuda.synchronize(device)
        events = []
        for _ in range(repeats):
            args = inputs()
            if hide_host_ms > 0:
                torch.cuda._sleep(int(hide_host_ms * _CYCLES_PER_MS))  # the host runs ahead meanwhile
            if buffer is not None:
                buffer.zero_()  # after the inputs: they, too, must come from memory
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(args)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        samples = tuple(start.elapsed_time(end) for start, end in events)
    return Timing(statistics.median(samples), samples, CLOCK_CUDA, 0 if buffer is None else buffer.numel())


def repeats_for(estimate_ms: float, budget_ms: float, *, lowest: int = 5, highest: int = 100) -> int:
    """How many timed calls fit ``budget_ms`` at ``estimate_ms`` each, within [lowest, highest].

    The tuner times one call first, then sizes each candidate's measurement with this so
    a slow candidate cannot eat a slice's device time.
    """
    if lowest < 1 or highest < lowest:
        raise ValueError(f"lowest, highest: expected 1 <= lowest <= highest, got {lowest}, {highest}")
    if not estimate_ms > 0:
        return highest
    return max(lowest, min(highest, int(budget_ms / estimate_ms)))
