"""The ahead-of-time build: every kernel a user may run, compiled per architecture and
packed into image archives. Family-agnostic: kernels come from ``aotattn.families``."""

from aotattn.build.builder import BuildReport, build, enumerate_jobs, pack
from aotattn.build.compiler import TARGETS, Job, compile_job

__all__ = ["TARGETS", "BuildReport", "Job", "build", "compile_job", "enumerate_jobs", "pack"]
