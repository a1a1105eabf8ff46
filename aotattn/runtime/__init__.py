"""Running launch plans: Triton's JIT on GPUs, Triton's interpreter on CPU tensors.

Family-agnostic: it knows kernels only through their :class:`aotattn.spec.KernelSpec`.
"""

from aotattn.runtime.launcher import launch, prepare

__all__ = ["launch", "prepare"]
