"""Execute a :class:`~aotattn.spec.LaunchPlan`.

CUDA tensors run prebuilt images through the CUDA driver (``AOTATTN_MODE=aot``, the
default) or compile with Triton's JIT (``AOTATTN_MODE=jit``, for development and the
tuner); CPU tensors run the same source in Triton's interpreter (slow: for tests and
debugging). Triton is imported only by the JIT and the interpreter paths.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aotattn.spec import KernelSpec, LaunchPlan

MODE_VAR = "AOTATTN_MODE"
MODES = ("aot", "jit")

# Triton's interpreter patches triton.language's functions for the duration of a launch
# (process-wide state): two interpreted launches from different threads corrupt each
# other (wrong numbers, seen up to 1e35 off, or interpreter errors). The JIT's first
# call of a specialization compiles and fills caches that are not guarded either. Both
# are development paths; launches through them are serialised. The AOT path is not.
_SERIAL = threading.Lock()


def mode() -> str:
    value = os.environ.get(MODE_VAR, "aot")
    if value not in MODES:
        raise ValueError(f"{MODE_VAR}: expected one of {MODES}, got {value!r}")
    return value


def _device_of(args: tuple[Any, ...]) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    raise ValueError("a launch plan needs at least one tensor argument")


def jit_function(kernel: KernelSpec) -> Any:
    return getattr(importlib.import_module(kernel.module), kernel.function)


def launch(plan: LaunchPlan) -> None:
    if 0 in plan.grid:
        return
    device = _device_of(plan.args)
    if device.type == "cuda":
        if mode() == "aot":
            from aotattn.runtime.image_loader import launch_aot

            launch_aot(plan, device)
            return
        fn = jit_function(plan.kernel)
        with _SERIAL, torch.cuda.device(device):
            fn[plan.grid](*plan.args, **plan.kernel.constexprs(plan.functional, plan.config),
                          num_warps=plan.config.num_warps, num_stages=plan.config.num_stages)
    elif device.type == "cpu":
        from aotattn.runtime.interpreter import interpreted_function

        fn = interpreted_function(plan.kernel.module, plan.kernel.function)
        # The interpreter's own warnings (numpy 2.3's array-to-scalar deprecation inside
        # Triton 3.6, numpy overflow notes from exp2 of masked scores) are not the caller's:
        # under `python -W error` or pytest's error filters they would fail every CPU call.
        # Filters are process-wide; the lock keeps other interpreted launches out meanwhile.
        with _SERIAL, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn[plan.grid](*plan.args, **plan.kernel.constexprs(plan.functional, plan.config))
    else:
        raise ValueError(f"no launcher for device type {device.type!r}")


def prepare(plan: LaunchPlan, dynamic: Sequence[tuple[int, int]]) -> Callable[[Sequence[torch.Tensor]], None]:
    """A launcher of this plan's kernel, grid and configuration for new tensors.

    ``dynamic`` lists ``(argument position, index into the tensors)``: the arguments that
    change from call to call. The others keep the plan's values; the plan's tensors at
    dynamic positions are not kept. On the AOT path the loaded kernel is resolved here,
    once, and a call only packs pointers and launches.
    """
    device = _device_of(plan.args)
    positions = {pos for pos, _ in dynamic}
    if device.type == "cuda" and mode() == "aot":
        from aotattn.runtime.image_loader import prepare_aot

        static = [None if i in positions else (a.data_ptr() if isinstance(a, torch.Tensor) else a)
                  for i, a in enumerate(plan.args)]
        return prepare_aot(plan, device, static, dynamic)
    static_args = [None if i in positions else a for i, a in enumerate(plan.args)]
    bare = dataclasses.replace(plan, args=())

    def run(tensors: Sequence[torch.Tensor]) -> None:
        args = list(static_args)
        for pos, src in dynamic:
            args[pos] = tensors[src]
        launch(dataclasses.replace(bare, args=tuple(args)))

    return run
