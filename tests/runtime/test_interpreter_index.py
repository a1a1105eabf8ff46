"""Interpreted kernels use their scalars as integers under numpy 2.4 and later.

Triton 3.6's interpreter holds a kernel's scalars as 1-element arrays and defines a
tensor's ``__index__`` as ``int(data)``, which numpy 2.4 refuses for a 1-d array
(triton-lang/triton#9171): every CPU call whose key loop runs over computed bounds
(``range(lo, hi, BLOCK_N)``) failed with "only 0-dimensional arrays can be converted to
Python scalars" (seen on the GPU machine's numpy 2.5.2). Older numpy warns instead
(a DeprecationWarning, the launcher's interpreted calls silence it), so these tests turn
that warning into an error and call the kernels without the launcher.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from aotattn.runtime import interpreter as aot_interpreter
from tests.helpers import rel_err


@triton.jit
def strided_sum(X, Out, lo, hi, step):
    """Out[0] = sum of X[lo:hi:step], the loop's bounds and step taken as Python integers."""
    acc = tl.full((1,), 0.0, tl.float32)
    for i in range(lo, hi, step):
        acc += tl.load(X + i + tl.arange(0, 1))
    tl.store(Out + tl.arange(0, 1), acc)


class _StrictArray(np.ndarray):
    """A 1-element array that refuses ``int()``, as numpy 2.4's arrays do."""

    def __int__(self):
        if self.ndim:
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
        return super().__int__()


class _Scalar:
    def __init__(self, data):
        self.handle = type("Handle", (), {"data": data})()


def test_the_mended_index_reads_the_one_element_without_converting_the_array():
    value = int(np.random.default_rng().integers(-2**40, 2**40))
    for dtype in (np.int32, np.int64, np.uint64):
        data = np.array([value % 2**31], dtype=dtype).view(_StrictArray)
        with pytest.raises(TypeError):
            int(data)  # what Triton 3.6's __index__ does
        assert aot_interpreter._index(_Scalar(data)) == value % 2**31
    with pytest.raises(TypeError, match="block of 4 elements"):
        aot_interpreter._index(_Scalar(np.arange(4)))


@pytest.mark.parametrize("bounds", [(0, 37, 1), (5, 64, 7), (63, 0, -3), (9, 9, 1)])
def test_an_interpreted_loop_over_scalar_bounds_runs_with_conversion_warnings_as_errors(bounds):
    aot_interpreter.interpreted_module("aotattn.families.flash.kernels.forward")  # installs the mends
    kernel = aot_interpreter.interpreted_function(__name__, "strided_sum")
    x = torch.randn(64, dtype=torch.float32)
    out = torch.full((1,), float("nan"))
    lo, hi, step = bounds
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        kernel[(1,)](x, out, lo, hi, step)
    want = sum(float(x[i]) for i in range(lo, hi, step))
    assert abs(float(out) - want) <= 1e-5 * (1 + abs(want)), (float(out), want)


def test_a_window_call_on_cpu_runs_its_kernels_with_conversion_warnings_as_errors(monkeypatch):
    """The public call whose key loops have computed bounds (a window with an unbounded left
    side: the case the GPU machine's numpy 2.5 failed), with the launcher's silencing of the
    interpreter's warnings lifted."""
    import aotattn
    from aotattn import reference
    from aotattn.runtime import launcher

    def loud(kernel, grid, args, constexprs):
        fn = aot_interpreter.interpreted_function(kernel.module, kernel.function)
        with launcher._SERIAL, warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            fn[grid](*aot_interpreter.typed_arguments(kernel.arguments, args), **constexprs)

    monkeypatch.setattr(launcher, "_interpret", loud)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    q, k, v = (torch.randn(1, n, 2, 24, generator=gen, dtype=torch.float64).float().requires_grad_()
               for n in (45, 70, 70))
    out = aotattn.flash_attn_func(q, k, v, window_size=(-1, 5))
    out.backward(torch.ones_like(out))
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.attention(*inputs, window_size=(-1, 5))
    ref.backward(torch.ones_like(ref))
    assert rel_err(out.double(), ref) < 1e-4
    for got, want in zip((q, k, v), inputs):
        assert rel_err(got.grad.double(), want.grad) < 1e-4
