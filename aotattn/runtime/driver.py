"""The few CUDA driver entry points the AOT runtime calls, bound with :mod:`ctypes`.

Why not ``cuda.bindings``: measured on the H200 host (benchmarks/RESULTS.md), importing
``cuda.bindings.driver`` took 16-20 ms of a first call's 40 ms, and its argument
conversion made a tiny forward call 2.2x PyTorch SDPA's host time. The runtime needs
nine functions with plain C signatures; PyTorch has already loaded ``libcuda`` and
initialized the driver, so binding them costs microseconds.

Each function is bound through a :func:`ctypes.CFUNCTYPE` prototype, so the same
signatures serve the real library and a fake one in tests (Python callables wrapped
by the same prototypes go through the same argument conversions).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable, Mapping
from ctypes import POINTER, c_char_p, c_int, c_uint, c_void_p

from aotattn.errors import AotattnError

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

# name -> argument types; every driver function returns a CUresult (int)
PROTOTYPES: dict[str, tuple] = {
    "cuInit": (c_uint,),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuCtxGetCurrent": (POINTER(c_void_p),),
    "cuCtxSetCurrent": (c_void_p,),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuModuleLoadData": (POINTER(c_void_p), c_char_p),
    "cuModuleGetFunction": (POINTER(c_void_p), c_void_p, c_char_p),
    "cuFuncSetAttribute": (c_void_p, c_int, c_int),
    # function, grid x/y/z, block x/y/z, dynamic shared bytes, stream, params, extra
    "cuLaunchKernel": (c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p,
                       c_void_p),
}


class DriverError(AotattnError, RuntimeError):
    """A CUDA driver call failed."""


def _library() -> ctypes.CDLL:
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        return ctypes.CDLL(name)
    except OSError as exc:
        raise DriverError(f"cannot load the CUDA driver library {name}: {exc} (is an NVIDIA driver installed? "
                          "AOTATTN_MODE=jit compiles with Triton instead)") from exc


class Driver:
    """The bound entry points, with checked wrappers for the slow path and the raw
    ``launch`` (``cuLaunchKernel``) for the hot one."""

    def __init__(self, functions: Mapping[str, Callable] | None = None):
        """``functions``: name -> Python callable standing in for the driver (tests)."""
        lib = _library() if functions is None else None
        for name, argtypes in PROTOTYPES.items():
            prototype = ctypes.CFUNCTYPE(c_int, *argtypes)
            setattr(self, name, prototype((name, lib)) if lib is not None else prototype(functions[name]))
        self.check(self.cuInit(0), "cuInit")
        self.launch = self.cuLaunchKernel

    def error_name(self, code: int) -> str:
        name = c_char_p()
        if self.cuGetErrorName(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {code}"
        return name.value.decode()

    def check(self, code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise DriverError(f"{what} failed: {self.error_name(code)}")

    def use_primary_context(self, device_index: int) -> None:
        """Make the device's primary context (PyTorch's) current on this thread, if none is."""
        current = c_void_p()
        self.check(self.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        device, ctx = c_int(), c_void_p()
        self.check(self.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self.check(self.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load(self, image: bytes, symbol: str, shared: int) -> tuple[int, int]:
        """Load a cubin into the current context: (module, function) handles. Kernels
        over 48 KB of shared memory get their dynamic limit raised to ``shared``."""
        module, function = c_void_p(), c_void_p()
        self.check(self.cuModuleLoadData(ctypes.byref(module), image), f"cuModuleLoadData({symbol})")
        self.check(self.cuModuleGetFunction(ctypes.byref(function), module, symbol.encode()),
                   f"cuModuleGetFunction({symbol})")
        if shared > 48 * 1024:
            self.check(self.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
                       f"cuFuncSetAttribute({symbol}: {shared} bytes of dynamic shared memory)")
        return module.value, function.value


_driver: Driver | None = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's driver binding, made on first use (once, whichever thread comes first)."""
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = Driver()
    return _driver
