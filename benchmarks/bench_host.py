"""aotattn's host time per call with the kernels taken out (no GPU needed).

    python benchmarks/bench_host.py [--calls 2000] [--profile]

CPU tensors go through the same operators, checks, plan cache, autograd Function and
prepared launches as CUDA ones; only the launch differs (the interpreter instead of the
driver or Triton's JIT). With the interpreter's kernels replaced by no-ops, what is left
is the Python and PyTorch work of a call: the part of issue 17's host time that does not
depend on the GPU. B1 H1 S128 D64 bf16 causal, as ``bench_latency.py`` measures on the
GPU: inference (no grad), a training forward (inputs that require grad) and a training
forward + backward. ``--profile`` prints where the forward + backward's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import aotattn
from aotattn.runtime import interpreter


class _NoKernel:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    interpreter.interpreted_function = lambda module, function: _NoKernel()
    q, k, v = (torch.randn(1, 128, 1, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 128, 1, 64, dtype=torch.bfloat16)

    def inference():
        with torch.no_grad():
            return aotattn.flash_attn_func(q, k, v, causal=True)

    def forward():
        return aotattn.flash_attn_func(q, k, v, causal=True)

    def forward_backward():
        return torch.autograd.grad(aotattn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)

    for name, fn in (("inference", inference), ("training forward", forward),
                     ("training forward + backward", forward_backward)):
        for _ in range(50):
            fn()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        print(f"{name:30} {(time.perf_counter() - start) / args.calls * 1e6:8.1f} us per call")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            forward_backward()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


if __name__ == "__main__":
    main()
