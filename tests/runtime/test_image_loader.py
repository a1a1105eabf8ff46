"""The AOT launch path against a fake CUDA driver (CPU): argument packing, the trailing
scratch pointers, the dynamic shared-memory attribute, threads per block, error text."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from aotattn.runtime import image_loader
from aotattn.runtime import driver as cuda
from aotattn.runtime.images import Entry, ImageError
from aotattn.spec import Config, Functional, LaunchPlan
from tests.runtime.fake_driver import FakeDriver


def entry(shared: int, global_scratch: int = 0) -> Entry:
    return Entry(key="k", functional={}, config={}, variant="generic", symbol="kern", shared=shared, num_warps=8,
                 warp_size=32, global_scratch_size=global_scratch, global_scratch_align=1, profile_scratch_size=0,
                 binary="cubin", file="f.cubin", blob="")


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(image_loader, "_driver", lambda: fake.driver)
    return fake


def test_arguments_are_packed_in_8_byte_slots_then_two_scratch_pointers(driver):
    kernel = image_loader.LoadedKernel(entry(shared=1024), b"\x7fELF", ["*bf16", "i32", "i64", "fp32", "*fp32"])
    driver.slots = 7
    kernel.launch((3, 2, 1), [0x1000, -7, 2**40 + 5, 0.5, 0x2000], stream=99, device=torch.device("cpu"))
    name, args = driver.calls[-1]
    assert name == "cuLaunchKernel"
    assert args[:9] == (0x222, 3, 2, 1, 256, 1, 1, 1024, 99) and args[10] is None
    slots = driver.launched
    assert struct.unpack("<Q", slots[0])[0] == 0x1000
    assert struct.unpack("<i", slots[1][:4])[0] == -7
    assert struct.unpack("<q", slots[2])[0] == 2**40 + 5
    assert struct.unpack("<f", slots[3][:4])[0] == 0.5
    assert struct.unpack("<Q", slots[4])[0] == 0x2000
    assert slots[5] == slots[6] == bytes(8)  # no scratch: null pointers
    assert "cuFuncSetAttribute" not in driver.names()
    # loading made PyTorch's primary context current (none was), then loaded the cubin
    assert driver.names()[:6] == ["cuInit", "cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                                  "cuCtxSetCurrent", "cuModuleLoadData"]
    assert ("cuModuleGetFunction", (0x111, b"kern")) == (driver.calls[6][0], driver.calls[6][1][1:])


def test_large_shared_memory_raises_the_dynamic_limit_first(driver):
    image_loader.LoadedKernel(entry(shared=200 * 1024), b"\x7fELF", ["*fp16"])
    assert ("cuFuncSetAttribute", (0x222, 8, 200 * 1024)) in driver.calls


def test_global_scratch_is_allocated_per_program(driver):
    kernel = image_loader.LoadedKernel(entry(shared=0, global_scratch=128), b"\x7fELF", ["*fp16"])
    driver.slots = 3
    kernel.launch((4, 1, 2), [0x10], stream=0, device=torch.device("cpu"))
    assert struct.unpack("<Q", driver.launched[1])[0] != 0  # an 8*128-byte buffer
    assert driver.launched[2] == bytes(8)


def test_a_thread_without_a_context_gets_the_primary_one_and_the_launch_is_retried(driver):
    kernel = image_loader.LoadedKernel(entry(shared=0), b"\x7fELF", ["*fp16"])
    driver.slots, driver.context = 3, 0
    driver.fail["cuLaunchKernel"] = cuda.CUDA_ERROR_INVALID_CONTEXT
    kernel.launch((1, 1, 1), [0x10], stream=0, device=torch.device("cpu"))
    assert driver.names()[-6:] == ["cuLaunchKernel", "cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                                "cuCtxSetCurrent", "cuLaunchKernel"]
    assert driver.context == 0xC0


def test_driver_errors_carry_the_function_and_the_error_name(driver):
    kernel = image_loader.LoadedKernel(entry(shared=0), b"\x7fELF", ["*fp16"])
    driver.slots = 3
    driver.fail["cuLaunchKernel"] = 700
    with pytest.raises(cuda.DriverError, match=r"cuLaunchKernel\(kern\) failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        kernel.launch((1, 1, 1), [0x10], stream=0, device=torch.device("cpu"))
    driver.fail["cuModuleLoadData"] = 200
    with pytest.raises(cuda.DriverError, match=r"cuModuleLoadData\(kern\) failed: CUDA_ERROR_UNKNOWN"):
        image_loader.LoadedKernel(entry(shared=0), b"\x7fELF", ["*fp16"])


def test_without_a_driver_library_the_error_says_so(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda.ctypes, "CDLL", missing)
    with pytest.raises(cuda.DriverError, match=r"cannot load the CUDA driver library libcuda.so.1.*AOTATTN_MODE=jit"):
        cuda.Driver()


def test_amd_images_are_refused_with_a_reason(driver):
    with pytest.raises(ImageError, match="HIP runtime"):
        image_loader.LoadedKernel(Entry(**{**entry(0).__dict__, "binary": "hsaco"}), b"", [])


def test_a_missing_image_says_how_to_build_it():
    spec = SimpleNamespace(qualname="flash.attn_fwd", variant=lambda f: "aligned")
    plan = LaunchPlan(spec, Functional.of({"dtype": "bf16", "MASK": 0}), Config.of(BLOCK_M=128), (1, 1, 1), ())
    text, arch, table, command = image_loader.missing_image("sm_90", plan, "no archive x")
    assert (arch, table, command) == (
        "sm_90", "flash.attn_fwd", 'aotattn build --arch sm_90 --kernel flash.attn_fwd --where "MASK=0 dtype=bf16"')
    assert "no kernel image for sm_90 / flash.attn_fwd / [MASK=0,dtype=bf16]" in text
    assert 'aotattn build --arch sm_90 --kernel flash.attn_fwd --where "MASK=0 dtype=bf16"' in text
