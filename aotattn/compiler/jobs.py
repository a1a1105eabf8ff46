"""Compile one kernel variant for one target with Triton's compiler, no GPU needed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aotattn import arch as arches
from aotattn.compiler import ptx_hazards
from aotattn.runtime import images
from aotattn.runtime.images import Entry, entry_key
from aotattn.spec import VARIANTS, Config, Functional


@dataclass(frozen=True)
class Job:
    """One kernel variant to compile: a table's functional and configuration for an arch."""

    arch: str
    table: str  # family.kernel
    functional: Functional
    config: Config

    def __post_init__(self) -> None:
        # what is compiled: a functional without the table's own axes (KernelSpec.table_axes),
        # so the jobs of each of their values are one job (a table no kernel has fails later,
        # where it is compiled or looked up, as before)
        from aotattn import families
        spec = families.kernels().get(self.table)
        if spec is not None:
            object.__setattr__(self, "functional", spec.compiled_functional(self.functional))

    def spec(self) -> Any:
        from aotattn import families
        return families.kernels()[self.table]

    @property
    def variant(self) -> str:
        return self.spec().variant(self.functional)

    @property
    def key(self) -> str:
        return entry_key(self.functional.as_dict(), self.config.as_dict(), self.variant)

    def file(self) -> str:
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:16]
        return f"{self.table}/{digest}.{'hsaco' if arches.arch(self.arch).target[0] == 'hip' else 'cubin'}"


def source_hash(spec: Any) -> str:
    """The hash an archive records for the kernel's source: the one the runtime recomputes,
    without Triton, to refuse images of another source (:func:`aotattn.runtime.images.source_hash`)."""
    return images.source_hash(spec.module, spec.declaration)


def _triton_inputs(job: Job) -> tuple[Any, dict, dict, dict, dict]:
    spec = job.spec()
    from aotattn.runtime.interpreter import compiled_module  # not while another thread loads interpreted copies

    fn = getattr(compiled_module(spec.module), spec.function)
    signature = spec.signature(job.functional)
    constexprs = spec.constexprs(job.functional, job.config)
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {}
    unit = VARIANTS[job.variant]
    if unit is not None:  # pointers in bytes, integers in elements
        attrs = {(i,): [["tt.divisibility", 16 if arg.type.startswith("*") else unit]]
                 for i, arg in enumerate(spec.arguments) if arg.aligned}
    options = {"num_warps": job.config.num_warps, "num_stages": job.config.num_stages}
    return fn, signature, constexprs, attrs, options


def cache_key(job: Job, line_info: bool = False) -> str:
    """What decides the binary: source, signature, constexprs, hints, options, target,
    compiler, and whether it keeps line info."""
    import triton

    fn, signature, constexprs, attrs, options = _triton_inputs(job)
    target = arches.arch(job.arch).target
    payload = json.dumps([fn.cache_key, signature, {k: str(v) for k, v in constexprs.items()},
                          sorted((str(k), v) for k, v in attrs.items()), options, target, triton.__version__,
                          {"line_info": line_info}], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


# Triton 3.6 compiles with line info by default: ptxas -lineinfo embeds the kernel's whole
# PTX text and two line tables, about three quarters of a cubin (an sm_90 bf16 d128
# forward: 168 KB, 48 KB without; 37 KB and 15 KB compressed). The build leaves it out
# unless asked (profiling with source lines, compute-sanitizer's line numbers). The
# machine code differs too (same length, other scheduling), so images built with and
# without it are different kernels: hence its place in the cache key.
_LINE_INFO_VAR = "TRITON_DISABLE_LINE_INFO"  # read by Triton at compile time; part of its own cache key


@contextlib.contextmanager
def _line_info(keep: bool) -> Iterator[None]:
    previous = os.environ.get(_LINE_INFO_VAR)
    os.environ[_LINE_INFO_VAR] = "0" if keep else "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_LINE_INFO_VAR]
        else:
            os.environ[_LINE_INFO_VAR] = previous


class ResourceError(RuntimeError):
    """A compiled kernel needs more of a per-block resource than its architecture has."""


def _source(language: str) -> Any:
    """Triton's compiler input for a kernel written in ``language`` (KernelSpec.language)."""
    if language == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource
    from triton.compiler import ASTSource

    return ASTSource


def compile_job(job: Job, line_info: bool = False) -> tuple[Entry, bytes]:
    """The job's kernel compiled for its target: its entry (launch metadata) and binary."""
    import triton
    from triton.backends.compiler import GPUTarget

    fn, signature, constexprs, attrs, options = _triton_inputs(job)
    spec = job.spec()
    if not spec.runs_on(job.arch):
        raise ValueError(f"{job.table} compiles for {', '.join(spec.archs)} only, not {job.arch}")
    backend, arch, warp_size = arches.arch(job.arch).target
    with _line_info(line_info):
        compiled = triton.compile(_source(spec.language)(fn, signature, constexprs, attrs),
                                  target=GPUTarget(backend, arch, warp_size), options=options)
    md = compiled.metadata
    limit = arches.arch(job.arch).shared_memory
    if md.shared > limit:  # Triton compiles it; the driver would refuse it at load (cuFuncSetAttribute)
        raise ResourceError(f"needs {md.shared} bytes of shared memory, {job.arch} allows {limit} per block: the "
                            "image would not load (choose a smaller configuration for this cell)")
    if backend == "cuda":
        ptx_hazards.check(compiled.asm["ptx"], f"{job.table} [{job.functional}] {job.config}")
    binary_kind = "hsaco" if backend == "hip" else "cubin"
    entry = Entry(
        key=job.key, functional=job.functional.as_dict(), config=job.config.as_dict(), variant=job.variant,
        symbol=md.name, shared=md.shared, num_warps=md.num_warps, warp_size=getattr(md, "warp_size", warp_size),
        global_scratch_size=getattr(md, "global_scratch_size", 0),
        global_scratch_align=getattr(md, "global_scratch_align", 1),
        profile_scratch_size=getattr(md, "profile_scratch_size", 0), binary=binary_kind, file=job.file(), blob="")
    return entry, compiled.asm[binary_kind]
