"""Declarative description of the RMSNorm kernel: arguments, functionals, tuning space."""

from __future__ import annotations

import torch

from aotattn import tuning
from aotattn.runtime.device import arch_of
from aotattn.spec import Arg, Config, Functional, KernelSpec

FAMILY = "rmsnorm"
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
BLOCKS = (256, 1024, 4096, 16384)  # the row length is padded to the next of these
MAX_COLS = BLOCKS[-1]

RMSNORM_FWD = KernelSpec(
    family=FAMILY,
    name="rmsnorm_fwd",
    module="aotattn.families.rmsnorm.kernels",
    function="rmsnorm_fwd",
    arguments=(Arg("X", "*{dtype}"), Arg("W", "*{dtype}"), Arg("Y", "*{dtype}"), Arg("Rstd", "*fp32"),
               Arg("stride_x", "i64"), Arg("stride_y", "i64"), Arg("n_cols", "i32"), Arg("eps", "fp32")),
    functionals=(("dtype", ("fp16", "bf16", "fp32")), ("BLOCK", BLOCKS), ("HAS_WEIGHT", (False, True))),
    tuning_space=(("num_warps", (1, 2, 4, 8, 16)), ("num_stages", (1,))),
    tuning_keys=(("n_rows", (1, 64, 4096, 262144)),),
)

KERNELS = {RMSNORM_FWD.name: RMSNORM_FWD}
TABLES = (RMSNORM_FWD,)
INTERPRETER_CONFIG = Config.of(num_warps=4, num_stages=1)


def config_for(kernel: KernelSpec, functional: Functional, device: torch.device, **sizes: int) -> Config:
    if device.type == "cpu":
        return INTERPRETER_CONFIG
    return tuning.database().lookup(arch_of(device), kernel, functional, sizes)
