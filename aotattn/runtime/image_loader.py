"""Launch prebuilt kernel images through the CUDA driver, no Triton.

Archives are opened lazily, one per (arch, kernel), and each kernel is loaded once per
process and device. A launch packs the arguments exactly as the compiled kernel takes
them: the runtime arguments in order (8-byte slots), then Triton 3.6's two trailing
scratch pointers (global, profile), on PyTorch's current stream, so CUDA-graph capture
works. Kernels over 48 KB of shared memory get their dynamic limit raised first. The
driver calls are the ctypes bindings of :mod:`aotattn.runtime.driver`.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from aotattn.runtime import driver as cuda
from aotattn.runtime.device import arch_of
from aotattn.runtime.images import (ENV_VAR, SUFFIX, Archive, Entry, ImageError, ImageMissing, archive_path,
                                    entry_key, image_roots, source_hash, triton_abi)
from aotattn.spec import LaunchPlan

# The argument layout LoadedKernel packs: Triton 3.6's (runtime arguments, then the global
# and profile scratch pointers). Images compiled by another Triton minor are refused.
TRITON_ABI = "3.6"
_SLOT = {"i32": "i4x", "i64": "q", "fp32": "f4x", "u32": "I4x", "u64": "Q", "i1": "?7x"}
DriverError = cuda.DriverError


def _driver() -> cuda.Driver:
    return cuda.driver()


def _raw_stream(index: int) -> int:
    """PyTorch's current stream on a device, as the driver's handle (what Triton's own
    launcher reads; the public ``torch.cuda.current_stream`` builds a Python object)."""
    return torch._C._cuda_getCurrentRawStream(index)


class LoadedKernel:
    """One kernel binary loaded into a device's context, with its argument packer."""

    def __init__(self, entry: Entry, binary: bytes, signature: list[str], device_index: int = 0):
        if entry.binary != "cubin":
            raise ImageError(f"{entry.key}: {entry.binary} images are built and verified, but loading them needs "
                             "the HIP runtime, which aotattn does not drive yet")
        self.driver = _driver()
        self.driver.use_primary_context(device_index)
        self.entry = entry
        self.device_index = device_index
        self.module, self.function = self.driver.load(binary, entry.symbol, entry.shared)
        slots = ["Q" if t.startswith("*") else _SLOT[t] for t in signature] + ["Q", "Q"]
        self.packer = struct.Struct("<" + "".join(slots))
        self.buffer = ctypes.create_string_buffer(self.packer.size)
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * len(slots))(*(base + 8 * i for i in range(len(slots))))
        self.params_address = ctypes.addressof(self.params)
        self.threads = entry.num_warps * entry.warp_size
        self.scratch = bool(entry.global_scratch_size or entry.profile_scratch_size)
        self.lock = threading.Lock()

    def _scratch_pointers(self, grid: tuple[int, int, int], device: torch.device) -> tuple[list, list[int]]:
        """Per-program scratch buffers (kept alive by the caller until the launch is queued)."""
        keep, pointers = [], []
        for size in (self.entry.global_scratch_size, self.entry.profile_scratch_size):
            if size:
                buf = torch.empty(size * grid[0] * grid[1] * grid[2], dtype=torch.uint8, device=device)
                keep.append(buf)
                pointers.append(buf.data_ptr())
            else:
                pointers.append(0)
        return keep, pointers

    def launch(self, grid: tuple[int, int, int], values: list, stream: int, device: torch.device) -> None:
        keep, pointers = self._scratch_pointers(grid, device) if self.scratch else ((), (0, 0))
        args = (self.function, grid[0], grid[1], grid[2], self.threads, 1, 1, self.entry.shared, stream,
                self.params_address, None)
        with self.lock:  # the driver copies the parameters during the call
            self.packer.pack_into(self.buffer, 0, *values, *pointers)
            err = self.driver.launch(*args)
            if err == cuda.CUDA_ERROR_INVALID_CONTEXT:  # a thread PyTorch has not yet bound to the device
                self.driver.use_primary_context(self.device_index)
                err = self.driver.launch(*args)
        if err:
            self.driver.check(err, f"cuLaunchKernel({self.entry.symbol})")
        del keep


def check_loadable(archive: Archive, arch: str, spec: Any) -> None:
    """Refuse an archive this runtime must not launch from: another arch or kernel, another
    Triton minor (another argument layout), or another source of the kernel's module or
    another declaration of the kernel (a stale image whose arguments may no longer match
    the host code)."""
    table, module = spec.qualname, spec.module
    rebuild = f"rebuild with: aotattn build --arch {arch} --kernel {table}"
    if archive.arch != arch or archive.table != table:
        raise ImageError(f"{archive.path}: holds {archive.arch} / {archive.table}, expected {arch} / {table}; "
                         f"{rebuild}")
    if triton_abi(archive.triton_version) != TRITON_ABI:
        raise ImageError(f"{archive.path}: compiled by Triton {archive.triton_version}, but this aotattn launches "
                         f"Triton {TRITON_ABI} kernels; {rebuild}")
    expected = source_hash(module, spec.declaration)
    if archive.source_hash != expected:
        raise ImageError(f"{archive.path}: compiled from another version of {module} or of {table}'s declaration "
                         f"(source hash "
                         f"{archive.source_hash[:12]}, installed {expected[:12]}); {rebuild} (or set AOTATTN_MODE=jit)")


class ImageStore:
    """The archives under some folders, opened on first use. A kernel comes from the first
    folder whose archive for its architecture and kernel holds it; every archive found is
    checked (:func:`check_loadable`) before any is used, so a stale or damaged one is an
    error even where another folder would have the kernel."""

    def __init__(self, roots: Sequence[Path]):
        self.roots = tuple(Path(r) for r in roots)
        self._archives: dict[tuple[str, str], tuple[Archive, ...]] = {}
        self._kernels: dict[tuple, LoadedKernel] = {}
        self._missing: dict[tuple, tuple[str, ...]] = {}  # key -> ImageMissing's arguments, if asked again
        self._lock = threading.Lock()

    def kernel(self, plan: LaunchPlan, device: torch.device) -> LoadedKernel:
        """The plan's kernel loaded on ``device``; :class:`ImageMissing` when no archive
        holds it, :class:`ImageError` when an archive cannot be used."""
        spec = plan.kernel
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, spec.qualname, plan.functional, plan.config)
        loaded = self._kernels.get(key)
        if loaded is not None:
            return loaded
        missing = self._missing.get(key)
        if missing is not None:
            raise ImageMissing(*missing)
        with self._lock:
            loaded = self._kernels.get(key)
            if loaded is None:
                arch = arch_of(device)
                archives = self.archives(arch, spec)
                variant = spec.variant(plan.functional)
                wanted = entry_key(plan.functional.as_dict(), plan.config.as_dict(), variant)
                found = next(((a, e) for a in archives if (e := a.entry(wanted)) is not None), None)
                if found is None:
                    why = (f"{', '.join(str(a.path) for a in archives)} hold(s) no such kernel" if archives else
                           f"no archive {arch}/{spec.qualname}{SUFFIX} under {', '.join(map(str, self.roots))}")
                    self._missing[key] = missing_image(arch, plan, why)
                    raise ImageMissing(*self._missing[key])
                archive, entry = found
                with torch.cuda.device(device):
                    loaded = LoadedKernel(entry, archive.binary(entry), list(spec.signature(plan.functional).values()),
                                          index)
                self._kernels[key] = loaded
        return loaded

    def archives(self, arch: str, spec: Any) -> tuple[Archive, ...]:
        """The archives of ``arch`` / ``spec``'s kernel under the roots, in order, opened and checked."""
        table = spec.qualname
        found = self._archives.get((arch, table))
        if found is None:
            found = tuple(Archive(path) for root in self.roots
                          if os.path.lexists(path := archive_path(root, arch, table)))
            for archive in found:
                check_loadable(archive, arch, spec)
            self._archives[(arch, table)] = found
        return found


def missing_image(arch: str, plan: LaunchPlan, why: str) -> tuple[str, str, str, str]:
    """The arguments of :class:`ImageMissing` for a plan's kernel: the message, the arch,
    the table and the command that builds the image."""
    spec = plan.kernel
    where = " ".join(f"{k}={v}" for k, v in plan.functional.items)
    command = f"aotattn build --arch {arch} --kernel {spec.qualname}" + (f' --where "{where}"' if where else "")
    if getattr(spec, "chosen_by", None) is not None:  # built only where its operator table chooses it, unless forced
        command += " --forced-backends"
    return (f"no kernel image for {arch} / {spec.qualname} / [{plan.functional}] / {plan.config} "
            f"({spec.variant(plan.functional)}): {why}. Build it with: {command}   (or run without AOTATTN_MODE=aot "
            "to compile it at run time with Triton's JIT)", arch, spec.qualname, command)


_stores: dict[str | None, ImageStore] = {}


def _store() -> ImageStore:
    """The store of the image folders the environment names now (:func:`image_roots`)."""
    named = os.environ.get(ENV_VAR)
    store = _stores.get(named)
    if store is None:
        store = _stores.setdefault(named, ImageStore(image_roots()))
    return store


def load(plan: LaunchPlan, device: torch.device) -> LoadedKernel:
    """The plan's kernel from the images, loaded on ``device`` (once per process and device).

    Raises:
        ImageMissing: no archive holds it (the default mode then compiles it with Triton).
        ImageError: an archive cannot be used (damaged, stale, another Triton), or the
            image is not one this runtime loads (AMD).
    """
    return _store().kernel(plan, device)


def prepare_loaded(kernel: LoadedKernel, plan: LaunchPlan, device: torch.device, static: list, dynamic) -> Any:
    """See :func:`aotattn.runtime.launcher.prepare`: static values are already pointers."""
    grid, index = plan.grid, kernel.device_index

    def run(tensors) -> None:
        values = list(static)
        for pos, src in dynamic:
            values[pos] = tensors[src].data_ptr()
        if torch.cuda.current_device() == index:
            kernel.launch(grid, values, _raw_stream(index), device)
        else:
            with torch.cuda.device(index):  # the driver launches into the current device's context
                kernel.launch(grid, values, _raw_stream(index), device)

    return run


def launch_loaded(kernel: LoadedKernel, plan: LaunchPlan, device: torch.device) -> None:
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in plan.args]
    with torch.cuda.device(kernel.device_index):  # the driver launches into the current device's context
        kernel.launch(plan.grid, values, _raw_stream(kernel.device_index), device)
