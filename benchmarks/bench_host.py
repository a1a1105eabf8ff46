"""aotattn's host time per call with the kernels taken out (no GPU needed).

    python benchmarks/bench_host.py [--calls 2000] [--profile] [--device cuda] [--backend split]

CPU tensors go through the same operators, checks, plan cache, autograd Function and
prepared launches as CUDA ones; only the launch differs (the interpreter instead of the
driver or Triton's JIT). With the interpreter's kernels (and its typing of their
arguments) replaced by no-ops, what is left is the Python and PyTorch work of a call: the
part of issue 17's host time that does not depend on the GPU. B1 H1 S128 D64 bf16 causal,
as ``bench_latency.py`` measures on the GPU: inference (no grad), a training forward
(inputs that require grad) and a training forward + backward. ``--profile`` prints where
the forward + backward's time goes.

``--device cuda`` runs the real kernels on the GPU instead (images or the JIT, as
``AOTATTN_MODE`` says), beside PyTorch's SDPA on the same tensors, timed the same way
(host time of a batch of calls, then synchronized), and profiles that path.
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
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--api", default="flash", choices=("flash", "sdpa"),
                    help="flash: flash_attn_func, causal (default); sdpa: scaled_dot_product_attention on "
                         "(B, H, S, D), not causal, as bench_latency.py calls it")
    ap.add_argument("--backend", default=None, choices=("split", "fused", "ws"),
                    help="the backward backend of the flash API's calls (default: the tuning database's; "
                         "the causal tiny cell chooses fused, timed at 2^19 tokens, where split launches fewer "
                         "kernels: no dQ zeroing and conversion)")
    args = ap.parse_args()
    if args.device == "cpu":
        # the interpreter's work goes with the kernels: running them, and typing their
        # integers as declared (interpreter.typed_arguments), which CUDA launches never do
        interpreter.interpreted_function = lambda module, function: _NoKernel()
        interpreter.typed_arguments = lambda arguments, args: args
    q, k, v = (torch.randn(1, 128, 1, 64, dtype=torch.bfloat16, device=args.device, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(1, 128, 1, 64, dtype=torch.bfloat16, device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    causal = args.api == "flash"
    if args.api == "flash":
        def attend():
            return aotattn.flash_attn_func(q, k, v, causal=True, backend=args.backend)
    else:
        def attend():
            return aotattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    def inference():
        with torch.no_grad():
            return attend()

    def forward():
        return attend()

    def forward_backward():
        out = attend()
        return torch.autograd.grad(out, (q, k, v), dout if args.api == "flash" else dout.transpose(1, 2))

    def sdpa(grad: bool, backward: bool):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        with torch.set_grad_enabled(grad):
            out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2)) if backward else out

    peers = {"inference": lambda: sdpa(False, False), "training forward": lambda: sdpa(True, False),
             "training forward + backward": lambda: sdpa(True, True)}

    def per_call(fn) -> float:
        """Median over 7 rounds of the host time per call (a round: 100 calls, then synchronized)."""
        samples = []
        for _ in range(7):
            sync()
            start = time.perf_counter()
            for _ in range(min(args.calls, 100) if args.device == "cuda" else args.calls // 7):
                fn()
            samples.append((time.perf_counter() - start) / (min(args.calls, 100) if args.device == "cuda"
                                                             else args.calls // 7) * 1e6)
        sync()
        return sorted(samples)[3]

    for name, fn in (("inference", inference), ("training forward", forward),
                     ("training forward + backward", forward_backward)):
        for _ in range(50):
            fn()
        ours = per_call(fn)
        line = f"{name:30} {ours:8.1f} us per call"
        if args.device == "cuda":
            for _ in range(50):
                peers[name]()
            theirs = per_call(peers[name])
            line += f"   SDPA {theirs:8.1f} us   ratio {ours / theirs:5.2f}"
        print(line)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            forward_backward()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())
        if args.device == "cuda":  # where the device time goes: kernels, copies, memsets per call
            for name, fn in (("aotattn", forward_backward), ("SDPA", lambda: sdpa(True, True))):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        fn()
                    sync()
                print(f"--- {name}: forward + backward x 20")
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))


if __name__ == "__main__":
    main()
