"""The cost of the bias clamp (``kernels/common.bias_log2``; GPU, bf16, the JIT).

    AOTATTN_MODE=jit python benchmarks/bench_bias_clamp.py

The bias path clamps finite biases to ±2.3e38 before their base-2 product (docs/semantics.md):
two compares and two selects a score beside the bias load. This times the bias path with the
clamp and without it (the ``bias-unclamped`` mutant of tests/mutants, loaded in a subprocess
as the mutation runs load it; the JIT compiles both), forward and forward+backward, the two
alternating over ``--rounds`` subprocesses so that clock drift falls on both. Prediction:
within noise (the bias tile's load, 2 bytes a score in bf16, dominates the four operations).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((4, 16, 2048, 128), (2, 16, 4096, 128), (2, 32, 4096, 64))  # B, H, S, D: hidden 2048
MUTANT = "bias-unclamped"


def measure() -> dict[str, float]:
    """Median milliseconds per shape and pass, in this process (with whatever kernels it loads)."""
    import torch
    from triton.testing import do_bench

    import aotattn

    times = {}
    for b, h, s, d in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
                   for _ in range(3))
        bias = torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16, generator=gen)
        bias[0, :, :, : s // 8] = torch.finfo(torch.bfloat16).min  # the padding mask transformers builds

        def forward():
            return aotattn.scaled_dot_product_attention(q, k, v, attn_mask=bias)

        def both():
            out = forward()
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

        name = f"B{b} H{h} S{s} D{d}"
        times[f"{name} fwd"] = do_bench(forward, warmup=25, rep=200, return_mode="median")
        times[f"{name} fwd+bwd"] = do_bench(both, warmup=10, rep=200, return_mode="median")
    return times


def run(mutant: str | None) -> dict[str, float]:
    env = {**os.environ, "AOTATTN_MODE": "jit", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("AOTATTN_MUTANT", None)
    if mutant:
        env["AOTATTN_MUTANT"] = mutant
    done = subprocess.run([sys.executable, __file__, "--child"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{'the ' + mutant if mutant else 'the real'} kernels' run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="subprocesses of each, alternating")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if os.environ.get("AOTATTN_MUTANT"):
            from tests.mutants.loader import install_from_environment

            install_from_environment()
        print(json.dumps(measure()))
        return
    clamped: dict[str, list[float]] = {}
    plain: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for mutant, into in ((None, clamped), (MUTANT, plain)):
            for key, ms in run(mutant).items():
                into.setdefault(key, []).append(ms)
    print(f"{'shape and pass':<28} {'clamped ms':>11} {'unclamped ms':>13} {'ratio':>7}")
    for key in clamped:
        a, b = statistics.median(clamped[key]), statistics.median(plain[key])
        print(f"{key:<28} {a:>11.3f} {b:>13.3f} {a / b:>7.3f}")


if __name__ == "__main__":
    main()
