"""First-call latency and per-call host overhead on the GPU (issue 6).

    python benchmarks/bench_latency.py --images images/

1. First call in a fresh process, B2 H16 S1024 D128 bf16 causal (SDPA layout): the time
   from after ``import`` to the first output (synchronized), tensors already on the GPU.
   aotattn from prebuilt images (AOTATTN_MODE=aot), aotattn through Triton's JIT with an
   empty cache, and PyTorch SDPA. Each measured in its own process, five times; then
   one more aotattn process under cProfile shows where the first call's time goes.
2. Host overhead per forward call at B1 H1 S128 D64 bf16: the host's time to issue a
   call (200 calls timed before synchronizing, so a slower kernel cannot hold the host
   back), and the time per call of 2000 back-to-back synchronized calls; aotattn
   (images) against PyTorch SDPA, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time, json
import torch
q = torch.randn(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t0 = time.perf_counter()
if "{impl}" == "sdpa":
    fn = torch.nn.functional.scaled_dot_product_attention
else:
    import aotattn
    fn = aotattn.scaled_dot_product_attention
t1 = time.perf_counter()
if {profile}:
    import cProfile, io, pstats
    profiler = cProfile.Profile()
    profiler.enable()
out = fn(q, q, q, is_causal=True)
torch.cuda.synchronize()
t2 = time.perf_counter()
if {profile}:
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
    print(text.getvalue(), file=sys.stderr)
ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
print(json.dumps(dict(import_ms=(t1 - t0) * 1e3, first_call_ms=(t2 - t1) * 1e3, rel_diff=err,
                      triton_imported="triton" in sys.modules)))
"""


def first_call(impl: str, env: dict, profile: bool = False) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD.format(impl=impl, profile=profile)], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode:
        return dict(error=run.stderr[-500:])
    if profile:
        print(run.stderr)
    return json.loads(run.stdout.strip().splitlines()[-1])


def _median_us(fn, rounds: int = 7, calls: int = 200, sync_each_round: bool = True) -> float:
    """Median over rounds of the host time per call, timed before synchronizing."""
    import torch

    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        if sync_each_round:
            torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def _paired_median_us(ours, theirs, rounds: int = 9, calls: int = 200) -> tuple[float, float]:
    """:func:`_median_us` of two callables, their rounds interleaved (ours, theirs, ours,
    ...) so that a drift of the host's speed during the run reaches both alike."""
    import torch

    samples: tuple[list, list] = ([], [])
    for _ in range(rounds):
        for fn, out in ((ours, samples[0]), (theirs, samples[1])):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return tuple(sorted(s)[len(s) // 2] for s in samples)


def host_overhead() -> dict:
    """Per tiny call (B1 H1 S128 D64 bf16): the host's time to issue it (200 calls, timed
    before synchronizing: fewer than the launch queue holds, so the GPU never holds the
    host back; rounds of aotattn and SDPA interleaved), and the time per call back to back
    (2000 calls, synchronized: the larger of host and GPU). Inference calls, training
    forwards (inputs that require grad) and training forward + backward, aotattn beside
    PyTorch's SDPA."""
    import torch

    import aotattn

    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    qg, kg, vg = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3))
    grad = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    results = {}
    impls = {"aotattn": aotattn.scaled_dot_product_attention, "sdpa": torch.nn.functional.scaled_dot_product_attention}
    calls = {name: {
        "": lambda fn=fn: fn(q, q, q),
        " train fwd": lambda fn=fn: fn(qg, kg, vg),
        " train fwd+bwd": lambda fn=fn: torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), grad),
    } for name, fn in impls.items()}
    for label in calls["aotattn"]:
        for name in impls:
            for _ in range(50):
                calls[name][label]()
        results["aotattn" + label], results["sdpa" + label] = _paired_median_us(calls["aotattn"][label],
                                                                                calls["sdpa"][label])
    for name, fn in impls.items():
        back_to_back = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(2000):
                fn(q, q, q)
            torch.cuda.synchronize()
            back_to_back.append((time.perf_counter() - start) / 2000 * 1e6)
        results[name + " back to back"] = sorted(back_to_back)[len(back_to_back) // 2]
    results["breakdown"] = breakdown(q)
    return results


def breakdown(q) -> dict:
    """Where aotattn's per-call host time goes: the parts of a plan-cache hit, each timed
    alone like the issue time above (median of 7 rounds of 200)."""
    import torch

    from aotattn.families.flash import ops

    flags = ("sdpa", False, None, False, False, None)
    key = ops._PLANS.key(q, q, q, *flags)
    entry = ops._PLANS.entries[key]
    out = torch.empty(entry.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(entry.lse_shape, device=q.device)
    return {
        "checks + cache key": _median_us(lambda: ops._cacheable(q, q, q, 0.0, None) and ops._PLANS.key(q, q, q, *flags)),
        "two output allocations": _median_us(lambda: (torch.empty(entry.out_shape, dtype=q.dtype, device=q.device),
                                                      torch.empty(entry.lse_shape, device=q.device))),
        "launch (pack + cuLaunchKernel)": _median_us(lambda: entry.launch_forward((q, q, q, out, lse))),
        "whole call": _median_us(lambda: ops.scaled_dot_product_attention(q, q, q)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", default=None, help="image root for the aot rows (default: AOTATTN_IMAGES)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    project = str(Path(__file__).resolve().parents[1])
    base = dict(os.environ, PYTHONPATH=project)
    if args.images:
        base["AOTATTN_IMAGES"] = str(Path(args.images).resolve())
    # Bytecode compiled once, as an installed package has it (the GPU machine's copy of
    # the tree does not keep __pycache__, which added ~6 ms of compiling to every process).
    base["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="aotattn-pyc-")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(project) / "aotattn")], env=base, check=True)
    rows = {}
    for attempt in range(5):
        rows.setdefault("aotattn (images)", []).append(first_call("aotattn", dict(base, AOTATTN_MODE="aot")))
        with tempfile.TemporaryDirectory() as cache:
            rows.setdefault("aotattn (Triton JIT, cold cache)", []).append(
                first_call("aotattn", dict(base, AOTATTN_MODE="jit", TRITON_CACHE_DIR=cache)))
        rows.setdefault("PyTorch SDPA", []).append(first_call("sdpa", base))
    print("where the first call's time goes (aotattn from images, one more process, under cProfile):")
    first_call("aotattn", dict(base, AOTATTN_MODE="aot"), profile=True)
    os.environ["AOTATTN_MODE"] = "aot"
    if args.images:
        os.environ["AOTATTN_IMAGES"] = base["AOTATTN_IMAGES"]
    overhead = host_overhead()
    print("first call after import, B2 H16 S1024 D128 bf16 causal (ms; five fresh processes)")
    for name, samples in rows.items():
        if any("error" in s for s in samples):
            print(f"  {name:<36} ERROR {next(s['error'] for s in samples if 'error' in s)}")
            continue
        calls = ", ".join(f"{s['first_call_ms']:.1f}" for s in samples)
        imports = ", ".join(f"{s['import_ms']:.0f}" for s in samples)
        print(f"  {name:<36} first call {calls}   import {imports}   rel diff {samples[0]['rel_diff']:.1e}"
              f"   triton imported: {samples[0]['triton_imported']}")
    for label, what in (("", "inference forward"), (" train fwd", "training forward (inputs require grad)"),
                        (" train fwd+bwd", "training forward + backward")):
        ours, theirs = overhead["aotattn" + label], overhead["sdpa" + label]
        print(f"host time per tiny call, {what} (B1 H1 S128 D64 bf16): aotattn {ours:.1f} us, "
              f"SDPA {theirs:.1f} us, ratio {ours / theirs:.2f}")
    print("  aotattn's call, part by part (us): " + ", ".join(f"{k} {v:.1f}" for k, v in overhead["breakdown"].items()))
    print(f"  back to back, synchronized (the larger of host and GPU time): aotattn "
          f"{overhead['aotattn back to back']:.1f} us, SDPA {overhead['sdpa back to back']:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(first_call=rows, host_us=overhead), indent=1))


if __name__ == "__main__":
    main()
