"""Execute a :class:`~aotattn.spec.LaunchPlan`.

CUDA tensors run prebuilt images through the CUDA driver, or Triton's JIT; CPU tensors
run the same source in Triton's interpreter (slow: for tests and debugging).
``AOTATTN_MODE`` chooses for CUDA tensors:

- ``auto`` (the default): the image when one is installed or built, else Triton's JIT,
  with one warning per kernel table naming the ``aotattn build`` command. Only a
  *missing* image falls back: a damaged or stale archive is an error. On AMD GPUs
  (a ROCm build of PyTorch), whose images are built and verified but not loaded yet,
  always the JIT.
- ``aot``: images only; a missing image is an error naming the command that builds it.
- ``jit``: Triton's JIT always (development, the tuner).

Triton is imported only by the JIT and the interpreter paths.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aotattn.errors import AotattnWarning
from aotattn.spec import KernelSpec, LaunchPlan

MODE_VAR = "AOTATTN_MODE"
MODES = ("auto", "aot", "jit")

# Triton's interpreter patches triton.language's functions for the duration of a launch
# (process-wide state): two interpreted launches from different threads corrupt each
# other (wrong numbers, seen up to 1e35 off, or interpreter errors). The JIT's first
# call of a specialization compiles and fills caches that are not guarded either. Both
# are development paths; launches through them are serialised. The AOT path is not.
_SERIAL = threading.Lock()


class JitFallbackWarning(AotattnWarning):
    """A kernel runs through Triton's JIT because no image of it is installed or built."""


_warned: set[str] = set()  # kernel tables (and "hip") already warned about in this process
_warned_lock = threading.Lock()


def mode() -> str:
    value = os.environ.get(MODE_VAR) or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_VAR}: expected one of {', '.join(MODES)}, got {value!r}")
    return value


def _device_of(args: tuple[Any, ...]) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    raise ValueError("a launch plan needs at least one tensor argument")


def jit_function(kernel: KernelSpec) -> Any:
    """The kernel's Triton (or Gluon) function, set to specialize like its images.

    Triton's JIT specializes every integer argument on its value: 1 becomes a constant,
    multiples of 16 get a divisibility hint. The images hint only the arguments the
    declaration marks ``aligned`` (by variant) and take the others as plain integers. A
    JIT variant with, say, ``max_seqlen_q`` folded to 1 is another program: one of them
    (the padded d256-bucket dK/dV at one query row) carries a wgmma register hazard the
    images do not have (the launcher's scan refused it). So the integers that are not
    declared aligned are passed to the JIT unspecialized, as the images take them.

    Integers also get the declared type rather than one picked by value: the JIT types a
    stride that fits 32 bits as an i32, where the images take the declared i64, and a
    kernel's ``row * stride`` then wrapped in 32 bits (a key row stride of 2**25 elements,
    which an (S, B, H, D) layout with B H D = 2**25 has, wrapped from key 64 of a 128-key
    block on: reads 2**31 elements before the tensor)."""
    from aotattn.runtime.interpreter import compiled_module  # not while another thread loads interpreted copies

    fn = getattr(compiled_module(kernel.module), kernel.function)
    if not getattr(fn, "_aotattn_specialized", False):
        params = {p.name: p for p in getattr(fn, "params", ())}
        for arg in kernel.arguments:
            param = params.get(arg.name)
            if param is None or arg.type.startswith("*"):
                continue
            if not arg.aligned:
                param.do_not_specialize = True
            # KernelParam's annotation and annotation_type are cached properties, read
            # when the JIT first builds its argument binder (at the first launch)
            param.__dict__["annotation"] = param.__dict__["annotation_type"] = arg.type
        fn.device_caches.clear()  # a binder built before (a launch outside the launcher) is rebuilt
        fn._aotattn_specialized = True
    return fn


def _warn_once(subject: str, message: str) -> None:
    with _warned_lock:
        if subject in _warned:
            return
        _warned.add(subject)
    warnings.warn(message, JitFallbackWarning, stacklevel=4)


def _image(plan: LaunchPlan, device: torch.device) -> Any:
    """The plan's loaded image, or None where the mode says Triton's JIT runs it."""
    current = mode()
    if current == "jit":
        return None
    if current == "auto" and torch.version.hip:
        _warn_once("hip", "aotattn: AMD GPUs run aotattn's kernels through Triton's JIT (their images are built and "
                          "verified, but not loaded yet): each new kernel variant compiles on its first call")
        return None
    from aotattn.runtime import image_loader
    from aotattn.runtime.images import ENV_VAR, ImageMissing, image_roots

    try:
        return image_loader.load(plan, device)
    except ImageMissing as exc:
        if current == "aot":
            raise
        # a mistyped $AOTATTN_IMAGES looks like images never built: say where it looked
        absent = [str(r) for r in image_roots() if not r.is_dir()]
        looked = (f" ({ENV_VAR}={absent[0]} is no folder)" if os.environ.get(ENV_VAR) and absent else "")
        _warn_once(exc.table, f"aotattn: no kernel image for {exc.table} on {exc.arch}{looked}: compiling with "
                              "Triton's JIT instead (seconds per new kernel variant, on its first call). Build the images "
                              f"once with: aotattn build --arch {exc.arch}   (all kernels; this one alone: "
                              f"{exc.command}). {MODE_VAR}=aot makes a missing image an error; said once per "
                              "kernel per process")
        return None


def _jit_options(plan: LaunchPlan) -> dict[str, Any]:
    """The JIT launch's keyword arguments: the variant's constexprs, warps and stages."""
    return {**plan.kernel.constexprs(plan.functional, plan.config), "num_warps": plan.config.num_warps,
            "num_stages": plan.config.num_stages}


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for a JIT launch (tensor descriptors made on the device): a fresh
    buffer per launch on the current device, as the image path allocates its own."""
    return torch.empty(size, dtype=torch.uint8, device="cuda")


def _jit_call(fn: Any, grid: tuple[int, ...], args: Sequence[Any], options: dict[str, Any],
              device: torch.device) -> None:
    with _SERIAL, torch.cuda.device(device):
        from triton.runtime import _allocation  # Triton's per-context allocator (a ContextVar)

        if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:  # the caller's own one is kept
            _allocation.set_allocator(_scratch)
        _check_once(fn[grid](*args, **options))


_checked: set[Any] = set()  # the JIT's compiled kernels already scanned (under _SERIAL)


def _check_once(compiled: Any) -> None:
    """The build's wgmma register-hazard scan (aotattn.compiler.ptx_hazards) on a kernel
    the JIT compiled, once per kernel: a hazard raises instead of returning its numbers."""
    key = getattr(compiled, "hash", None) or id(compiled)
    if key in _checked:
        return
    ptx = (getattr(compiled, "asm", None) or {}).get("ptx")
    if ptx:
        from aotattn.compiler import ptx_hazards

        ptx_hazards.check(ptx, getattr(compiled, "name", "a JIT kernel"))
    _checked.add(key)


def _launch_jit(plan: LaunchPlan, device: torch.device) -> None:
    _jit_call(jit_function(plan.kernel), plan.grid, plan.args, _jit_options(plan), device)


def _interpret(kernel: KernelSpec, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, Any]) -> None:
    from aotattn.runtime.interpreter import interpreted_function, typed_arguments

    fn = interpreted_function(kernel.module, kernel.function)
    args = typed_arguments(kernel.arguments, args)
    # The interpreter's own warnings (numpy overflow notes from exp2 of masked scores,
    # deprecations inside Triton 3.6) are not the caller's:
    # under `python -W error` or pytest's error filters they would fail every CPU call.
    # Filters are process-wide; the lock keeps other interpreted launches out meanwhile.
    with _SERIAL, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn[grid](*args, **constexprs)


def _launch_interpreted(plan: LaunchPlan) -> None:
    _interpret(plan.kernel, plan.grid, plan.args, plan.kernel.constexprs(plan.functional, plan.config))


def launch(plan: LaunchPlan) -> None:
    if 0 in plan.grid:
        return
    device = _device_of(plan.args)
    if device.type == "cuda":
        kernel = _image(plan, device)
        if kernel is not None:
            from aotattn.runtime.image_loader import launch_loaded

            launch_loaded(kernel, plan, device)
        else:
            _launch_jit(plan, device)
    elif device.type == "cpu":
        _launch_interpreted(plan)
    else:
        raise ValueError(f"no launcher for device type {device.type!r}")


def prepare(plan: LaunchPlan, dynamic: Sequence[tuple[int, int]]) -> Callable[[Sequence[torch.Tensor]], None]:
    """A launcher of this plan's kernel, grid and configuration for new tensors.

    ``dynamic`` lists ``(argument position, index into the tensors)``: the arguments that
    change from call to call. The others keep the plan's values; the plan's tensors at
    dynamic positions are not kept. Whether the image or the JIT runs it is decided here,
    once; on the image path the loaded kernel is resolved here too, and a call only packs
    pointers and launches.
    """
    device = _device_of(plan.args)
    positions = {pos for pos, _ in dynamic}
    kernel = _image(plan, device) if device.type == "cuda" and 0 not in plan.grid else None
    if kernel is not None:
        from aotattn.runtime.image_loader import prepare_loaded

        static = [None if i in positions else (a.data_ptr() if isinstance(a, torch.Tensor) else a)
                  for i, a in enumerate(plan.args)]
        return prepare_loaded(kernel, plan, device, static, dynamic)
    static_args = [None if i in positions else a for i, a in enumerate(plan.args)]
    if 0 in plan.grid:
        return lambda tensors: None
    # what does not change between calls is worked out once, here
    grid = plan.grid
    if device.type == "cuda":
        fn, options = jit_function(plan.kernel), _jit_options(plan)

        def run_on(args: list) -> None:
            _jit_call(fn, grid, args, options, device)
    elif device.type == "cpu":
        kernel, constexprs = plan.kernel, plan.kernel.constexprs(plan.functional, plan.config)

        def run_on(args: list) -> None:
            _interpret(kernel, grid, args, constexprs)
    else:
        raise ValueError(f"no launcher for device type {device.type!r}")

    def run(tensors: Sequence[torch.Tensor]) -> None:
        args = list(static_args)
        for pos, src in dynamic:
            args[pos] = tensors[src]
        run_on(args)

    return run
