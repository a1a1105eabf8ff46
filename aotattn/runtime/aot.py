"""Launch prebuilt kernel images through the CUDA driver (``cuda.bindings``), no Triton.

Archives are opened lazily, one per (arch, kernel), and each kernel is loaded once per
process and device. A launch packs the arguments exactly as the compiled kernel takes
them: the runtime arguments in order (8-byte slots), then Triton 3.6's two trailing
scratch pointers (global, profile), on PyTorch's current stream, so CUDA-graph capture
works. Kernels over 48 KB of shared memory get their dynamic limit raised first.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from pathlib import Path
from typing import Any

import torch

from aotattn.runtime.device import arch_of
from aotattn.runtime.images import Archive, Entry, ImageError, archive_path, entry_key
from aotattn.spec import LaunchPlan

ENV_VAR = "AOTATTN_IMAGES"
PROJECT_IMAGES = Path(__file__).resolve().parents[2] / "images"
_SLOT = {"i32": "i4x", "i64": "q", "fp32": "f4x", "u32": "I4x", "u64": "Q", "i1": "?7x"}


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


def images_root() -> Path:
    return Path(os.environ.get(ENV_VAR) or PROJECT_IMAGES)


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DriverError("running prebuilt images needs the cuda-bindings package (pip install cuda-bindings), "
                          "or AOTATTN_MODE=jit to compile with Triton instead") from exc
    return driver


def _check(result: tuple, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    driver = _driver()
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise DriverError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


class LoadedKernel:
    """One kernel binary loaded into the current context, with its argument packer."""

    def __init__(self, entry: Entry, binary: bytes, signature: list[str]):
        driver = _driver()
        if entry.binary != "cubin":
            raise ImageError(f"{entry.key}: {entry.binary} images are built and verified, but loading them needs "
                             "the HIP runtime, which aotattn does not drive yet")
        current = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is None or int(current) == 0:  # no context on this thread yet: PyTorch's primary one
            device = _check(driver.cuDeviceGet(torch.cuda.current_device()), "cuDeviceGet")
            ctx = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
            _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.entry = entry
        self.module = _check(driver.cuModuleLoadData(binary), f"cuModuleLoadData({entry.symbol})")
        self.function = _check(driver.cuModuleGetFunction(self.module, entry.symbol.encode()),
                               f"cuModuleGetFunction({entry.symbol})")
        if entry.shared > 48 * 1024:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self.function, attr, entry.shared), "cuFuncSetAttribute")
        slots = ["Q" if t.startswith("*") else _SLOT[t] for t in signature] + ["Q", "Q"]
        self.packer = struct.Struct("<" + "".join(slots))
        self.buffer = ctypes.create_string_buffer(self.packer.size)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * len(slots))(*(base + 8 * i for i in range(len(slots))))
        self.params_address = ctypes.addressof(self.params)
        self.threads = entry.num_warps * entry.warp_size
        self.lock = threading.Lock()

    def launch(self, grid: tuple[int, int, int], values: list, stream: int, device: torch.device) -> None:
        scratch = []
        for size in (self.entry.global_scratch_size, self.entry.profile_scratch_size):
            if size:
                buf = torch.empty(size * grid[0] * grid[1] * grid[2], dtype=torch.uint8, device=device)
                scratch.append(buf)
        pointers = [t.data_ptr() for t in scratch] + [0] * (2 - len(scratch))
        if self.entry.profile_scratch_size and not self.entry.global_scratch_size:
            pointers = [0, scratch[0].data_ptr()]
        with self.lock:  # the driver copies the parameters during the call
            self.packer.pack_into(self.buffer, 0, *values, *pointers)
            result = _driver().cuLaunchKernel(self.function, grid[0], grid[1], grid[2], self.threads, 1, 1,
                                              self.entry.shared, stream, self.params_address, 0)
        _check(result, f"cuLaunchKernel({self.entry.symbol})")


class ImageStore:
    """Archives under one root, opened on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._archives: dict[tuple[str, str], Archive] = {}
        self._kernels: dict[tuple, LoadedKernel] = {}
        self._lock = threading.Lock()

    def kernel(self, plan: LaunchPlan, device: torch.device) -> LoadedKernel:
        spec = plan.kernel
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, spec.qualname, plan.functional, plan.config)
        loaded = self._kernels.get(key)
        if loaded is not None:
            return loaded
        with self._lock:
            loaded = self._kernels.get(key)
            if loaded is None:
                arch = arch_of(device)
                archive = self._archive(arch, spec.qualname, plan)
                variant = spec.variant(plan.functional)
                entry = archive.entries.get(entry_key(plan.functional.as_dict(), plan.config.as_dict(), variant))
                if entry is None:
                    raise ImageError(self._missing(arch, plan, f"{archive.path} has no such kernel"))
                with torch.cuda.device(device):
                    loaded = LoadedKernel(entry, archive.binary(entry), list(spec.signature(plan.functional).values()))
                self._kernels[key] = loaded
        return loaded

    def _archive(self, arch: str, table: str, plan: LaunchPlan) -> Archive:
        archive = self._archives.get((arch, table))
        if archive is None:
            path = archive_path(self.root, arch, table)
            if not path.is_file():
                raise ImageError(self._missing(arch, plan, f"no archive {path}"))
            archive = Archive(path)
            if archive.header.arch != arch or archive.header.table != table:
                raise ImageError(f"{path}: holds {archive.header.arch} / {archive.header.table}, "
                                 f"expected {arch} / {table}")
            self._archives[(arch, table)] = archive
        return archive

    @staticmethod
    def _missing(arch: str, plan: LaunchPlan, why: str) -> str:
        spec = plan.kernel
        where = " ".join(f"{k}={v}" for k, v in plan.functional.items)
        return (f"no kernel image for {arch} / {spec.qualname} / [{plan.functional}] / {plan.config} "
                f"({spec.variant(plan.functional)}): {why}. Build it with: aotattn build --arch {arch} "
                f"--kernel {spec.qualname} --where \"{where}\"   (or set AOTATTN_MODE=jit to compile at run time)")


_stores: dict[Path, ImageStore] = {}


def _store() -> ImageStore:
    root = images_root()
    store = _stores.get(root)
    if store is None:
        store = _stores.setdefault(root, ImageStore(root))
    return store


def prepare_aot(plan: LaunchPlan, device: torch.device, static: list, dynamic) -> Any:
    """See :func:`aotattn.runtime.launcher.prepare`: static values are already pointers."""
    kernel = _store().kernel(plan, device)
    grid = plan.grid

    def run(tensors) -> None:
        values = list(static)
        for pos, src in dynamic:
            values[pos] = tensors[src].data_ptr()
        kernel.launch(grid, values, torch.cuda.current_stream(device).cuda_stream, device)

    return run


def launch_aot(plan: LaunchPlan, device: torch.device) -> None:
    kernel = _store().kernel(plan, device)
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in plan.args]
    kernel.launch(plan.grid, values, torch.cuda.current_stream(device).cuda_stream, device)
