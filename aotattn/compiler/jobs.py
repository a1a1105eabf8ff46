"""Compile one kernel variant for one target with Triton's compiler, no GPU needed."""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from typing import Any

from aotattn import arch as arches
from aotattn.runtime import images
from aotattn.runtime.images import Entry, entry_key
from aotattn.spec import Config, Functional


@dataclass(frozen=True)
class Job:
    """One kernel variant to compile: a table's functional and configuration for an arch."""

    arch: str
    table: str  # family.kernel
    functional: Functional
    config: Config

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
    return images.source_hash(spec.module)


def _triton_inputs(job: Job) -> tuple[Any, dict, dict, dict, dict]:
    spec = job.spec()
    fn = getattr(importlib.import_module(spec.module), spec.function)
    signature = spec.signature(job.functional)
    constexprs = spec.constexprs(job.functional, job.config)
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {}
    if job.variant == "aligned":
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(spec.arguments) if arg.aligned}
    options = {"num_warps": job.config.num_warps, "num_stages": job.config.num_stages}
    return fn, signature, constexprs, attrs, options


def cache_key(job: Job) -> str:
    """What decides the binary: source, signature, constexprs, hints, options, target, compiler."""
    import triton

    fn, signature, constexprs, attrs, options = _triton_inputs(job)
    target = arches.arch(job.arch).target
    payload = json.dumps([fn.cache_key, signature, {k: str(v) for k, v in constexprs.items()},
                          sorted((str(k), v) for k, v in attrs.items()), options, target, triton.__version__],
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def compile_job(job: Job) -> tuple[Entry, bytes]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, signature, constexprs, attrs, options = _triton_inputs(job)
    backend, arch, warp_size = arches.arch(job.arch).target
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(backend, arch, warp_size),
                              options=options)
    md = compiled.metadata
    binary_kind = "hsaco" if backend == "hip" else "cubin"
    entry = Entry(
        key=job.key, functional=job.functional.as_dict(), config=job.config.as_dict(), variant=job.variant,
        symbol=md.name, shared=md.shared, num_warps=md.num_warps, warp_size=getattr(md, "warp_size", warp_size),
        global_scratch_size=getattr(md, "global_scratch_size", 0),
        global_scratch_align=getattr(md, "global_scratch_align", 1),
        profile_scratch_size=getattr(md, "profile_scratch_size", 0), binary=binary_kind, file=job.file(), blob="")
    return entry, compiled.asm[binary_kind]
