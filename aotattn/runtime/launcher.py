"""Execute a :class:`~aotattn.spec.LaunchPlan`.

CUDA tensors run the kernel through Triton's JIT; CPU tensors run the same source in
Triton's interpreter (slow: for tests and debugging).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from aotattn.runtime.interpreter import interpreted_function
from aotattn.spec import KernelSpec, LaunchPlan


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
    constexprs = plan.kernel.constexprs(plan.functional, plan.config)
    if device.type == "cpu":
        fn = interpreted_function(plan.kernel.module, plan.kernel.function)
        fn[plan.grid](*plan.args, **constexprs)
    elif device.type == "cuda":
        fn = jit_function(plan.kernel)
        with torch.cuda.device(device):
            fn[plan.grid](*plan.args, **constexprs, num_warps=plan.config.num_warps,
                          num_stages=plan.config.num_stages)
    else:
        raise ValueError(f"no launcher for device type {device.type!r}")
