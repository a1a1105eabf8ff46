"""Interpreted copies of kernel modules, for CPU tensors.

Triton decides at decoration time whether ``@triton.jit`` builds a compiled or an
interpreted function, from ``triton.knobs.runtime.interpret``. To run the same kernels on
CPU tensors in a process that also compiles them, each module holding kernels is loaded
a second time, under another name, with that knob set while it executes. Kernels it
imports from other modules (a family's shared building blocks) arrive as compiled
functions, which the interpreter cannot call: they are rebound to the same functions
of those modules' interpreted copies, so a family can split its kernels over modules
of one package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import threading
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import triton
import triton.language as tl
# Imported before any kernel is interpreted: Triton 3.6's interpreter first imports Gluon
# from inside a launch (jit.mangle_type, while it has patched triton.language's builtins),
# and Gluon's builtins then wrap the patched functions for good: every later Gluon compile
# in the process fails ("Did you forget to add @triton.gluon.jit ?").
import triton.experimental.gluon  # noqa: F401
from triton.runtime.jit import JITFunction

# Held while a copy loads (a module's copy loads the copies of the modules it imports from).
# Triton's interpret knob is process-wide: a kernel module first imported by another thread
# while a copy loads would get interpreted functions for good (its GPU launches and builds
# then run the interpreter); so kernel modules are imported under it (compiled_module).
_lock = threading.RLock()
_modules: dict[str, ModuleType] = {}


def compiled_module(module: str) -> ModuleType:
    """``module`` imported as it is (compiled kernels), never while a copy is loading."""
    with _lock:
        return importlib.import_module(module)


def _bfloat16_conversions_as_on_gpus() -> None:
    """Make Triton 3.6's interpreter convert between float32 and bfloat16 as a GPU does.

    Its generic converter (``triton.runtime.interpreter._convert_float``) truncates float32
    to bfloat16 where the GPU rounds to nearest even, and turns subnormal float32 values
    into unrelated ones (2e-39 became 4.2e-39, -6.4e-39 became -1.0e-39): a bf16 call with
    softmax_scale 1e-38 had CPU gradients 2.6-4x off while the same kernels were right in
    fp32 (found by the long fuzz profile, tests/test_fuzz.py). Both formats share float32's
    exponent, so the conversion is a rounding of the top 16 bits; every other conversion
    stays Triton's. Installed once, before the first kernel is interpreted."""
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "aotattn_bfloat16", False):
        return

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            values = np.ascontiguousarray(data, dtype=np.float32)
            bits = values.view(np.uint32)
            if rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ:
                top = bits >> np.uint32(16)
            else:  # to nearest, ties to even (what the GPU's cvt.rn does; None: the default cast)
                top = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            top = np.where(np.isnan(values), (bits >> np.uint32(16)) | np.uint32(0x40), top)  # stays a (quiet) NaN
            return top.astype(np.uint16).reshape(np.shape(data))
        if input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            return (np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << np.uint32(16)).reshape(
                np.shape(data))
        return original(data, input_dtype, output_dtype, rounding_mode)

    convert.aotattn_bfloat16 = True
    interpreter._convert_float = convert


def _scalar_index_on_any_numpy() -> None:
    """Make Triton 3.6's interpreter index with its scalars under numpy 2.4 and later.

    The interpreter holds a kernel's scalars as 1-element arrays, and a scalar used where
    Python wants an integer (``range(lo, hi, BLOCK_N)`` over a tensor's bounds) goes
    through ``tensor.__index__``, which it defines as ``int(data)``: numpy 2.4 refuses
    that conversion of a 1-d array (triton-lang/triton#9171, fixed after Triton 3.6), so
    every CPU call whose key loop has computed bounds failed with "only 0-dimensional
    arrays can be converted to Python scalars". The tensor patch is wrapped so that the
    index reads the one element instead; everything else stays Triton's.
    Installed once, before the first kernel is interpreted."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "aotattn_index", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        # the scope restores attributes in reverse order: this one goes first, Triton's next
        scope.set_attr(tensor, "__index__", _index)

    patch.aotattn_index = True
    interpreter._patch_lang_tensor = patch


def _index(self) -> int:
    """An interpreted scalar as a Python integer (a block of more than one element has none)."""
    data = self.handle.data
    if data.size != 1:
        raise TypeError(f"a block of {data.size} elements cannot be used as an integer")
    return int(data.reshape(-1)[0])


def interpreted_module(module: str) -> ModuleType:
    """The interpreted copy of ``module`` (loaded once per process)."""
    with _lock:
        _bfloat16_conversions_as_on_gpus()
        _scalar_index_on_any_numpy()
        copy = _modules.get(module)
        if copy is None:
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                raise ImportError(f"no kernel module {module!r}")
            copy_spec = importlib.util.spec_from_file_location(f"{module}.__interpreted__", spec.origin)
            copy = importlib.util.module_from_spec(copy_spec)
            # the modules it imports from must be loaded compiled, before the knob flips
            importlib.import_module(module)
            previous = triton.knobs.runtime.interpret
            triton.knobs.runtime.interpret = True
            try:
                copy_spec.loader.exec_module(copy)
            finally:
                triton.knobs.runtime.interpret = previous
            package = module.rpartition(".")[0] + "."
            for name, value in list(vars(copy).items()):
                # imported from a sibling module: compiled, not interpreted (Triton's own jit
                # helpers, such as the combine functions tl.reduce takes, stay as they are)
                if isinstance(value, JITFunction) and value.fn.__module__.startswith(package):
                    setattr(copy, name, getattr(interpreted_module(value.fn.__module__), value.fn.__name__))
            _modules[module] = copy
        return copy


def interpreted_function(module: str, function: str) -> Any:
    """The interpreted copy of ``module.function``; a Gluon kernel (explicit GPU layouts,
    barriers and warp partitions) has none: ValueError."""
    compiled = getattr(compiled_module(module), function)
    if getattr(compiled, "is_gluon", lambda: False)():
        raise ValueError(f"{module}.{function} is a Gluon kernel: Triton's interpreter cannot run it on CPU tensors "
                         "(plan the family's Triton kernel for them instead)")
    return getattr(interpreted_module(module), function)


_WIDE = {"i64": (tl.int64, np.int64), "u64": (tl.uint64, np.uint64)}


@functools.cache
def _wide(arguments: tuple[Any, ...]) -> tuple[tuple[int, Any, Any], ...]:
    """(position, Triton dtype, numpy dtype) of each argument declared 64-bit."""
    return tuple((i, *_WIDE[a.type]) for i, a in enumerate(arguments) if a.type in _WIDE)


def typed_arguments(arguments: tuple[Any, ...], args: Sequence[Any]) -> list[Any]:
    """``args`` with each integer declared 64-bit (``arguments``: the kernel's
    :class:`aotattn.spec.Arg` tuple) made the interpreter's 64-bit scalar. The interpreter
    types a Python int by its value, an i32 below 2**31, so a kernel's ``row * stride``
    wrapped in 32 bits where the compiled kernels, which take the declared i64, do not (a
    key row stride of 2**28 elements read outside the tensor from key 8 on: a segmentation
    fault). The conversion is the one the interpreter would make of the int itself."""
    from triton.runtime.interpreter import TensorHandle

    out = list(args)
    for i, dtype, np_dtype in _wide(arguments):
        value = out[i]
        if isinstance(value, int) and not isinstance(value, bool):
            out[i] = tl.tensor(TensorHandle(np.array([value], dtype=np_dtype), dtype), dtype)
    return out
