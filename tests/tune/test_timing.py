"""The timing loop: fresh inputs every call, warm-up untimed, median of the timed calls.

On CPU only the code path is checked (the wall clock means nothing for speed); the GPU
test checks the event clock and the L2 flush on a real device.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from aotattn.tune import timing


def _recording():
    made, seen = [], []

    def inputs():
        t = torch.randn(64)
        made.append(t)
        return t

    def fn(t):
        seen.append(t)
        return (t * 2).sum()

    return made, seen, inputs, fn


def test_cpu_calls_fresh_inputs_each_time_and_times_only_the_repeats():
    made, seen, inputs, fn = _recording()
    result = timing.measure(fn, inputs, device="cpu", warmup=2, repeats=7)
    assert len(made) == len(seen) == 9
    assert all(a is b for a, b in zip(made, seen))
    assert len({id(t) for t in seen}) == 9 and not any(torch.equal(seen[0], t) for t in seen[1:])
    assert result.repeats == 7 and result.clock == timing.CLOCK_CPU and not result.meaningful
    assert result.median_ms == statistics.median(result.samples_ms)
    assert result.flushed_bytes == 0 and result.min_ms <= result.median_ms


def test_exception_of_the_callable_propagates():
    def broken(_):
        raise RuntimeError("candidate crashed")

    with pytest.raises(RuntimeError, match="candidate crashed"):
        timing.measure(broken, lambda: None, device="cpu", warmup=0, repeats=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"warmup": -1}, "warmup"), ({"repeats": 0}, "repeats"), ({"repeats": 2.5}, "repeats"),
    ({"device": "meta"}, "device"), ({"hide_host_ms": -1.0}, "hide_host_ms"), ({"hide_host_ms": True}, "hide_host_ms"),
    ({"hide_host_ms": "1"}, "hide_host_ms"), ({"hide_host_ms": 1e3}, "hide_host_ms"),
])
def test_bad_arguments(kwargs, message):
    args = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError, match=message):
        timing.measure(lambda t: t, lambda: 1, **args)
    with pytest.raises(TypeError, match="callables"):
        timing.measure(1, lambda: 1, device="cpu")


def test_quantiles_and_spread_against_numpy():
    import numpy as np

    values = torch.rand(31).tolist()
    for q in (0.0, 0.25, 0.5, 0.9, 1.0):
        assert timing.quantile(values, q) == pytest.approx(float(np.quantile(values, q)))
    expected = (np.quantile(values, 0.75) - np.quantile(values, 0.25)) / np.median(values)
    assert timing.relative_spread(values) == pytest.approx(expected)
    assert timing.relative_spread([3.0]) == 0.0
    with pytest.raises(ValueError):
        timing.quantile([], 0.5)
    with pytest.raises(ValueError):
        timing.quantile([1.0], 1.5)


def test_tflops_and_repeats_for():
    t = timing.Timing(2.0, (1.0, 2.0, 3.0), timing.CLOCK_CUDA)
    assert t.tflops(4e12) == pytest.approx(2000.0)
    assert timing.repeats_for(0.5, 10.0) == 20
    assert timing.repeats_for(100.0, 10.0) == 5
    assert timing.repeats_for(0.001, 10.0, highest=50) == 50
    with pytest.raises(ValueError):
        timing.repeats_for(1.0, 1.0, lowest=0)


def test_offline_path_imports_without_psycopg():
    """The GPU host has no database client: the offline runner must not need one."""
    code = ("import sys; sys.modules['psycopg'] = None; sys.modules['psycopg_pool'] = None; "
            "import aotattn.tune.offline, aotattn.tune.app")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import aotattn.tune.timing; "
            "assert 'triton' not in [m for m in sys.modules if sys.modules[m] is not None]")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
def test_a_gpu_wait_hides_the_host_work_of_a_call():
    """A call whose host work (2 ms of Python) dwarfs its GPU work (a small copy): timed
    as it is, the events see the host; behind a 5 ms GPU wait, the GPU alone."""
    import time as clock

    x = torch.randn(1 << 16, device="cuda")

    def slow_host(t):
        clock.sleep(0.002)
        t.mul_(1.0001)

    plain = timing.measure(slow_host, lambda: x, device="cuda", warmup=1, repeats=5)
    hidden = timing.measure(slow_host, lambda: x, device="cuda", warmup=1, repeats=5, hide_host_ms=5.0)
    assert plain.median_ms > 1.5, plain.samples_ms
    assert hidden.median_ms < 0.5, hidden.samples_ms


@pytest.mark.gpu
def test_cuda_events_and_flush():
    n = 1 << 22
    made, seen, _, _ = _recording()

    def inputs():
        t = torch.randn(n, device="cuda")
        made.append(t)
        return t

    result = timing.measure(lambda t: seen.append(t.mul_(2)), inputs, device="cuda", warmup=1, repeats=5)
    assert result.clock == timing.CLOCK_CUDA and result.meaningful and len(seen) == 6
    assert result.flushed_bytes >= 2 * timing.l2_bytes(torch.device("cuda"))
    assert all(s > 0 for s in result.samples_ms)
