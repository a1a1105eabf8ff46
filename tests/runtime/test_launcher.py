"""Which path runs a CUDA launch (issue 16, item 2), on CPU: a fake libcuda behind the
image loader, a fake Triton JIT function, the device seen as ``cuda:0``.

The default mode launches an image when one is there and otherwise Triton's JIT, with one
warning per kernel table naming the ``aotattn build`` command; a damaged or stale archive
is an error, never a fallback; ``AOTATTN_MODE=aot`` makes a missing image an error and
``AOTATTN_MODE=jit`` never reads the images.
"""

from __future__ import annotations

import contextlib
import random
import struct
import warnings

import pytest
import torch

from aotattn import families
from aotattn.runtime import image_loader, images, launcher
from aotattn.runtime.images import ImageError, ImageMissing, write_archive
from aotattn.spec import Config, Functional, LaunchPlan
from tests.runtime.fake_driver import FakeDriver

PHILOX = families.kernels()["flash.philox_words"]  # arguments: Out *i64, seed, offset, base (i64), n (i32)
MASK = families.kernels()["flash.dropout_mask"]
CONFIGS = {PHILOX.qualname: Config.of(BLOCK=128, num_warps=4, num_stages=1),
           MASK.qualname: Config.of(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)}


class FakeJit:
    """Stands in for a ``@triton.jit`` function: ``fn[grid](*args, **options)`` is recorded."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **options: self.calls.append((grid, args, options))


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """The launcher sees cuda:0 (an sm_90), its images under ``tmp_path``, a fake driver
    and a fake JIT; no warning has been given yet in this "process"."""
    fake = FakeDriver()
    fake.slots = len(PHILOX.arguments) + 2
    jit = FakeJit()
    monkeypatch.setattr(image_loader, "_driver", lambda: fake.driver)
    monkeypatch.setattr(image_loader, "arch_of", lambda device: "sm_90")
    monkeypatch.setattr(image_loader, "_raw_stream", lambda index: 77)
    monkeypatch.setattr(image_loader, "_stores", {})
    monkeypatch.setattr(launcher, "_device_of", lambda args: torch.device("cuda", 0))
    monkeypatch.setattr(launcher, "jit_function", lambda kernel: jit)
    monkeypatch.setattr(launcher, "_warned", set())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv(images.ENV_VAR, str(tmp_path))
    monkeypatch.delenv(launcher.MODE_VAR, raising=False)
    fake.jit = jit
    return fake


def plan(spec=PHILOX, values: tuple | None = None) -> LaunchPlan:
    rng = random.Random()
    if values is None:
        values = (torch.empty(256, dtype=torch.int64), rng.getrandbits(62), rng.getrandbits(40), 0, 256)
    return LaunchPlan(spec, Functional.of({}), CONFIGS[spec.qualname], (rng.randint(1, 9), 1, 1), values)


def build_image(root, spec=PHILOX, source_hash: str | None = None) -> bytes:
    """An archive holding ``spec``'s kernel (a random stand-in binary); returns the binary."""
    config = CONFIGS[spec.qualname]
    key = images.entry_key({}, config.as_dict(), "generic")
    entry = images.Entry(key=key, functional={}, config=config.as_dict(), variant="generic", symbol="philox_words",
                         shared=0, num_warps=4, warp_size=32, global_scratch_size=0, global_scratch_align=1,
                         profile_scratch_size=0, binary="cubin", file=f"{spec.qualname}/x.cubin", blob="")
    # no NUL byte: the fake driver sees the image through a char pointer, up to the first NUL
    binary = b"\x7fELF" + bytes(random.randint(1, 255) for _ in range(200))
    write_archive(images.archive_path(root, "sm_90", spec.qualname), "sm_90", spec.qualname, "3.6.0",
                  source_hash or images.source_hash(spec.module, spec.declaration), [(entry, binary)])
    return binary


def jit_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, launcher.JitFallbackWarning)]


def test_the_image_runs_when_it_is_there(gpu, tmp_path):
    binary = build_image(tmp_path)
    p = plan()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        launcher.launch(p)
    assert not jit_warnings(record) and not gpu.jit.calls
    loaded = [args for name, args in gpu.calls if name == "cuModuleLoadData"]
    assert len(loaded) == 1 and loaded[0][1] == binary
    name, args = gpu.calls[-1]
    assert name == "cuLaunchKernel" and args[1:4] == p.grid and args[4] == 128 and args[8] == 77
    assert struct.unpack("<Q", gpu.launched[0])[0] == p.args[0].data_ptr()
    assert [struct.unpack("<q", gpu.launched[i])[0] for i in (1, 2)] == list(p.args[1:3])


def test_a_missing_image_runs_through_the_jit_with_one_warning_per_kernel_table(gpu, tmp_path):
    first, second, other = plan(), plan(), plan(MASK, (torch.empty(4, dtype=torch.int8), 1, 1, 1, 1, 1, 1, 2, 3, 4))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for p in (first, second, other):
            launcher.launch(p)
    said = jit_warnings(record)
    assert len(said) == 2, said
    assert "no kernel image for flash.philox_words on sm_90" in said[0]
    assert "aotattn build --arch sm_90" in said[0] and "AOTATTN_MODE=aot" in said[0]
    assert "flash.dropout_mask" in said[1]
    assert [call[0] for call in gpu.jit.calls] == [first.grid, second.grid, other.grid]
    grid, args, options = gpu.jit.calls[1]
    assert args == second.args and options == {**PHILOX.constexprs(second.functional, second.config),
                                                "num_warps": 4, "num_stages": 1}
    assert "cuLaunchKernel" not in gpu.names()


def test_the_fallback_warning_names_an_images_folder_that_does_not_exist(gpu, tmp_path, monkeypatch):
    """A mistyped AOTATTN_IMAGES read as images never built: the warning did not name it."""
    from aotattn.runtime import image_loader
    from aotattn.runtime.images import ENV_VAR

    typo = tmp_path / "imagse"
    monkeypatch.setenv(ENV_VAR, str(typo))
    image_loader._stores.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        launcher.launch(plan())
    said = jit_warnings(record)
    assert len(said) == 1 and f"{ENV_VAR}={typo} is no folder" in said[0], said
    image_loader._stores.clear()


def test_a_prepared_launch_decides_once(gpu, tmp_path):
    p = plan()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run = launcher.prepare(p, [(0, 0)])
        outs = [torch.empty(256, dtype=torch.int64) for _ in range(3)]
        for out in outs:
            run([out])
    assert len(jit_warnings(record)) == 1
    assert [call[1][0] for call in gpu.jit.calls] == outs and all(call[1][1:] == p.args[1:] for call in gpu.jit.calls)
    build_image(tmp_path)  # built later: the prepared launcher keeps its choice, a new one takes the image
    image_loader._stores.clear()
    launcher.prepare(p, [(0, 0)])([outs[0]])
    assert gpu.names()[-1] == "cuLaunchKernel" and struct.unpack("<Q", gpu.launched[0])[0] == outs[0].data_ptr()


def test_a_prepared_jit_launch_works_out_its_constexprs_once(gpu, monkeypatch):
    """The host's per-call work on the JIT path is packing pointers: the variant's
    constexprs (a walk over the declaration's argument types) are computed when the
    launch is prepared, not on every call, and every call passes the same options."""
    from aotattn.spec import KernelSpec

    computed = []
    original = KernelSpec.constexprs
    monkeypatch.setattr(KernelSpec, "constexprs", lambda self, f, c: computed.append(1) or original(self, f, c))
    p = plan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = launcher.prepare(p, [(0, 0)])
        for _ in range(5):
            run([torch.empty(256, dtype=torch.int64)])
    assert len(computed) == 1 and len(gpu.jit.calls) == 5
    assert all(call[0] == p.grid and call[2] == {**original(p.kernel, p.functional, p.config), "num_warps": 4,
                                                 "num_stages": 1} for call in gpu.jit.calls)


def test_aot_mode_makes_a_missing_image_an_error(gpu, monkeypatch):
    monkeypatch.setenv(launcher.MODE_VAR, "aot")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(ImageMissing, match=r"aotattn build --arch sm_90 --kernel flash.philox_words") as info:
            launcher.launch(plan())
        with pytest.raises(ImageMissing):
            launcher.prepare(plan(), [(0, 0)])
    assert "\n" not in str(info.value) and not jit_warnings(record) and not gpu.jit.calls


@pytest.mark.parametrize("mode", ["auto", "aot"])
def test_a_stale_or_damaged_archive_is_an_error_not_a_fallback(gpu, tmp_path, monkeypatch, mode):
    monkeypatch.setenv(launcher.MODE_VAR, mode)
    build_image(tmp_path, source_hash="0" * 64)  # compiled from another version of the kernels
    with pytest.raises(ImageError, match="another version") as info:
        launcher.launch(plan())
    assert not isinstance(info.value, ImageMissing)
    path = images.archive_path(tmp_path, "sm_90", PHILOX.qualname)
    build_image(tmp_path)
    path.write_bytes(path.read_bytes()[:-5])  # truncated
    image_loader._stores.clear()
    with pytest.raises(ImageError) as info:
        launcher.launch(plan())
    assert not isinstance(info.value, ImageMissing) and not gpu.jit.calls


def test_jit_mode_never_reads_the_images(gpu, tmp_path, monkeypatch):
    monkeypatch.setenv(launcher.MODE_VAR, "jit")
    path = images.archive_path(tmp_path, "sm_90", PHILOX.qualname)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an archive")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        launcher.launch(plan())
    assert len(gpu.jit.calls) == 1 and not jit_warnings(record) and "cuModuleLoadData" not in gpu.names()


def test_a_later_image_folder_is_searched_when_the_first_lacks_the_kernel(gpu, tmp_path, monkeypatch):
    first, second = tmp_path / "built", tmp_path / "packaged"
    binary = build_image(second)
    monkeypatch.delenv(images.ENV_VAR)
    monkeypatch.setattr(images.paths, "default_images", lambda: first)
    monkeypatch.setattr(images.paths, "package_data", lambda name: second if name == images.paths.IMAGES else None)
    assert images.image_roots() == [first, second]
    launcher.launch(plan())
    assert [args[1] for name, args in gpu.calls if name == "cuModuleLoadData"] == [binary]


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(launcher.MODE_VAR, "ahead")
    with pytest.raises(ValueError, match=r"AOTATTN_MODE: expected one of auto, aot, jit, got 'ahead'"):
        launcher.mode()


def test_amd_gpus_run_the_jit_by_default_and_say_so_once(gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    build_image(tmp_path)  # an image there or not: AMD images are not loaded yet
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        launcher.launch(plan())
        launcher.launch(plan(MASK, (torch.empty(4, dtype=torch.int8), 1, 1, 1, 1, 1, 1, 2, 3, 4)))
    said = jit_warnings(record)
    assert len(said) == 1 and "AMD" in said[0] and len(gpu.jit.calls) == 2
    assert "cuModuleLoadData" not in gpu.names()


def test_the_jit_path_gives_triton_a_scratch_allocator_and_keeps_the_callers(gpu, monkeypatch):
    """Kernels that make tensor descriptors on the device (the forward's TMA) need global
    scratch, which Triton's JIT asks an allocator for; the launcher sets one where the
    caller set none (Triton's allocator is per context: a fresh context has none) and
    leaves a caller's own allocator in place."""
    import contextvars

    from triton.runtime import _allocation

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **options: seen.append(_allocation._allocator.get())

    monkeypatch.setattr(launcher, "jit_function", lambda kernel: Recorder())
    monkeypatch.setenv(launcher.MODE_VAR, "jit")

    def own(size, alignment, stream):
        raise AssertionError("not called here")

    def run(allocator):
        _allocation.set_allocator(allocator)  # in a copy of the context: the test's own is untouched
        launcher.launch(plan())

    contextvars.copy_context().run(run, _allocation._NULL_ALLOCATOR)  # none set
    assert seen[-1] is launcher._scratch
    contextvars.copy_context().run(run, own)
    assert seen[-1] is own
    buffer = launcher._scratch(256, 128, None) if torch.cuda.is_available() else None
    assert buffer is None or (buffer.numel() == 256 and buffer.is_cuda)


def test_a_kernel_module_first_imported_while_another_thread_interprets_stays_compiled(tmp_path, monkeypatch):
    """Triton's interpret knob is process-wide and is on while the interpreter loads a
    module's CPU copy: a kernel module another thread imported meanwhile (its first CPU or
    JIT launch) got interpreted functions for good, so its GPU launches and builds ran the
    interpreter. The copy of ``slow`` holds that window open until ``other`` is imported,
    or a second has passed (when the import rightly waits for the copy to be loaded)."""
    import importlib
    import sys
    import threading

    from triton.runtime.jit import JITFunction

    from aotattn.runtime import interpreter

    package = tmp_path / "aotattn_race_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import threading\n\nwindow = threading.Event()\n")
    kernel = "\n\n@triton.jit\ndef kern(x):\n    pass\n"
    (package / "other.py").write_text("import triton\n" + kernel)
    (package / "slow.py").write_text(
        "import sys, time, triton\n"
        "from aotattn_race_pkg import window\n"
        "if triton.knobs.runtime.interpret:  # the interpreted copy is loading\n"
        "    window.set()\n"
        "    deadline = time.monotonic() + 1\n"
        "    while time.monotonic() < deadline and not hasattr(sys.modules.get('aotattn_race_pkg.other'), 'kern'):\n"
        "        time.sleep(0.01)\n" + kernel)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(interpreter, "_modules", {})
    names = ("aotattn_race_pkg", "aotattn_race_pkg.slow", "aotattn_race_pkg.other")
    package_module = importlib.import_module("aotattn_race_pkg")
    thread = threading.Thread(target=interpreter.interpreted_module, args=("aotattn_race_pkg.slow",))
    try:
        thread.start()
        assert package_module.window.wait(30)
        interpreted = interpreter.interpreted_function("aotattn_race_pkg.other", "kern")  # its first CPU launch
        thread.join()
        assert type(sys.modules["aotattn_race_pkg.other"].kern) is JITFunction
        assert type(interpreted) is not JITFunction
        assert type(interpreter.interpreted_module("aotattn_race_pkg.slow").kern) is not JITFunction
    finally:
        thread.join()
        for name in names:
            sys.modules.pop(name, None)


@pytest.mark.parametrize("name", sorted(families.kernels()))
def test_the_jit_types_each_integer_as_declared(name):
    """Triton's JIT types an integer argument by its value (i32 below 2**31); the images
    take the declared type. A stride declared i64 but JIT-typed i32 made ``key * stride``
    wrap in 32 bits for row strides past 2**31 / BLOCK_N (tests/families/flash/
    test_hardening.py). The JIT function's binder, built as Triton builds it at a first
    launch, now gives every declared integer its declared type, whatever its value."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    spec = families.kernels()[name]
    fn = launcher.jit_function(spec)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    declared = {arg.name: arg.type for arg in spec.arguments}
    names = [p.name for p in fn.params]
    args = {}
    for param in fn.params:
        kind = declared.get(param.name)
        if kind is None:  # a constexpr: any value the binder takes
            args[param.name] = 1
        elif kind.startswith("*"):
            args[param.name] = torch.empty(16, dtype=torch.float32)
        else:
            args[param.name] = 0.5 if kind.startswith("fp") else 448
    _, specialization, _ = binder(**args)
    for param_name, (type_, _) in zip(names, specialization):
        kind = declared.get(param_name)
        if kind is not None and not kind.startswith("*"):
            assert type_ == kind, (param_name, type_, kind)
    assert any(kind == "i64" for kind in declared.values()) or name.startswith("rmsnorm")
