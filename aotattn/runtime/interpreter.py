"""Interpreted copies of kernel modules, for CPU tensors.

Triton decides at decoration time whether ``@triton.jit`` builds a compiled or an
interpreted function, from ``triton.knobs.runtime.interpret``. To run the same kernels on
CPU tensors in a process that also compiles them, the module holding them is loaded a
second time, under another name, with that knob set while it executes. Its jit functions
then call each other as interpreted functions.
"""

from __future__ import annotations

import importlib.util
import threading
from types import ModuleType
from typing import Any

import triton

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}


def interpreted_module(module: str) -> ModuleType:
    """The interpreted copy of ``module`` (loaded once per process)."""
    with _lock:
        copy = _modules.get(module)
        if copy is None:
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                raise ImportError(f"no kernel module {module!r}")
            copy_spec = importlib.util.spec_from_file_location(f"{module}.__interpreted__", spec.origin)
            copy = importlib.util.module_from_spec(copy_spec)
            previous = triton.knobs.runtime.interpret
            triton.knobs.runtime.interpret = True
            try:
                copy_spec.loader.exec_module(copy)
            finally:
                triton.knobs.runtime.interpret = previous
            _modules[module] = copy
        return copy


def interpreted_function(module: str, function: str) -> Any:
    return getattr(interpreted_module(module), function)
