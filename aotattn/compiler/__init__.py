"""The ahead-of-time compiler: every kernel a user may run, compiled per architecture and
packed into image archives (``aotattn build``, ``aotattn images``). Family-agnostic:
kernels come from ``aotattn.families``, targets from :mod:`aotattn.arch`.

Named ``compiler`` as Triton names its own (description, compilation and launching are
separate packages); ``build/`` is the build output folder, which tools skip.
"""

from aotattn.compiler.builder import BuildReport, build, enumerate_jobs, pack
from aotattn.compiler.jobs import Job, compile_job

__all__ = ["BuildReport", "Job", "build", "compile_job", "enumerate_jobs", "pack"]
