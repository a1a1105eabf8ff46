"""A fake libcuda for the image-loader tests on CPU."""

from __future__ import annotations

import ctypes

from aotattn.runtime import driver as cuda


class FakeDriver:
    """A stand-in libcuda: Python functions behind the runtime's own ctypes prototypes
    (so arguments go through the same conversions as with the real library). Records
    every call; ``fail`` maps a function name to the CUresult it returns."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, int] = {}
        self.context = 0
        functions = {name: self._recorder(name) for name in cuda.PROTOTYPES}
        self.driver = cuda.Driver(functions)

    def _recorder(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name in self.fail:
                return self.fail.pop(name)
            if name == "cuGetErrorName":
                args[1][0] = self._names.get(args[0], b"CUDA_ERROR_UNKNOWN")
            elif name == "cuCtxGetCurrent":
                args[0][0] = self.context
            elif name == "cuDevicePrimaryCtxRetain":
                args[0][0] = 0xC0
            elif name == "cuCtxSetCurrent":
                self.context = args[0]
            elif name == "cuModuleLoadData":
                args[0][0] = 0x111
            elif name == "cuModuleGetFunction":
                args[0][0] = 0x222
            elif name == "cuLaunchKernel":
                params = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))
                self.launched = [ctypes.string_at(params[i], 8) for i in range(self.slots)]
            return 0
        return call

    _names = {cuda.CUDA_ERROR_INVALID_CONTEXT: b"CUDA_ERROR_INVALID_CONTEXT", 700: b"CUDA_ERROR_ILLEGAL_ADDRESS"}

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]
