"""The forward's OVERLAP knob side by side: each cell's tuned configuration against the same
tiles with OVERLAP=1, in one process on the GPU.

    AOTATTN_MODE=jit python benchmarks/bench_overlap.py [--dtype bf16,fp16] [--head-dim 64,128,256]
        [--seqlen 512,...,16384] [--mask 0,2] [--json out.json]

Grid: hidden size 2048 (H = 2048 / D), 16k tokens per batch (B = 16384 / S), Sq = Sk.
Timed by the tuner's clock (:func:`aotattn.tune.timing.measure`: CUDA events, L2 flushed
before each call), two interleaved rounds per variant, the lower median kept; the two
outputs are compared (relative error) before a figure is printed. The tuner decides per
cell (``aotattn tune plan -c flash,attn_fwd --limit 16``, docs/tuner.md); this is the
quick look. ``--device cpu`` runs the same code path in the interpreter on one tiny
shape (a check, not a speed).
"""

from __future__ import annotations

import argparse
import json

import torch

from aotattn import tuning
from aotattn.families.flash import rules
from aotattn.runtime.device import arch_of
from aotattn.spec import Config, Functional
from aotattn.tune.candidates import config_name
from aotattn.tune.flash import Problem, Shape, current_config, relative_error
from aotattn.tune.timing import measure

TABLE = "flash.attn_fwd"


def functional(dtype: str, head_dim: int, mask: int) -> Functional:
    return Functional.of(dict(dtype=dtype, BLOCK_D=head_dim, BLOCK_DV=head_dim, PAD_HEAD=False, MASK=mask,
                              VARLEN=False, DROPOUT=False, BIAS=0))


def compare(f: Functional, shape: Shape, device: torch.device, rounds: int = 2) -> dict:
    """Times and the outputs' difference of the cell's configuration without and with OVERLAP."""
    arch = arch_of(device) if device.type == "cuda" else "sm_90"
    cell = (shape.seqlen_q, shape.seqlen_k)
    plain = current_config(tuning.database(), arch, TABLE, f, cell) if device.type == "cuda" else \
        rules.INTERPRETER_CONFIG
    plain = rules.ATTN_FWD.canonical(Config.of(plain.as_dict(), OVERLAP=0))
    overlapped = Config.of(plain.as_dict(), OVERLAP=1)
    problem = Problem(TABLE, f, shape, device)
    outputs, times = {}, {"plain": [], "overlap": []}
    for _ in range(rounds):
        for name, config in (("plain", plain), ("overlap", overlapped)):
            run = problem.runner(config)
            problem.reset()
            run()
            outputs[name] = problem.outputs()["out"].clone()
            times[name].append(measure(lambda _: run(), lambda: None, device=device, warmup=3, repeats=10).median_ms)
    fwd_flops = 4.0 * shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k * shape.head_dim
    fwd_flops /= 2 if f["MASK"] else 1
    best = {name: min(ms) for name, ms in times.items()}
    return dict(shape=str(shape), dtype=f["dtype"], mask=f["MASK"], config=config_name(plain),
                plain_ms=best["plain"], overlap_ms=best["overlap"], speedup=best["plain"] / best["overlap"],
                tflops_plain=fwd_flops / best["plain"] / 1e9, tflops_overlap=fwd_flops / best["overlap"] / 1e9,
                rel_diff=relative_error(outputs["overlap"], outputs["plain"].to(torch.float64)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--head-dim", default="64,128,256")
    ap.add_argument("--seqlen", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--mask", default="0,2", help="0: full, 2: causal (bottom-right)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    grid = [(dtype, int(d), int(s), int(m)) for dtype in args.dtype.split(",") for d in args.head_dim.split(",")
            for s in args.seqlen.split(",") for m in args.mask.split(",")]
    if device.type == "cpu":  # one tiny problem per combination: the code path, in the interpreter
        grid = [(dtype, 16, 64, int(m)) for dtype in args.dtype.split(",") for m in args.mask.split(",")]
    rows = []
    print(f"{'shape':34} {'dtype':5} {'mask':4} {'config':18} {'plain ms':>9} {'overlap ms':>10} {'speedup':>7} "
          f"{'TFLOP/s':>15} {'rel diff':>9}")
    for dtype, d, s, m in grid:
        shape = Shape(max(1, 16384 // s), max(1, 2048 // d), s, s, d) if device.type == "cuda" else \
            Shape(1, 2, s, s, d)
        try:
            row = compare(functional(dtype, d, m), shape, device)
        except Exception as exc:  # a variant without an image, a failed compile: say so, go on
            print(f"{str(shape):34} {dtype:5} {m:4} skipped: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
            continue
        rows.append(row)
        print(f"{row['shape']:34} {dtype:5} {m:4} {row['config']:18} {row['plain_ms']:9.4f} {row['overlap_ms']:10.4f} "
              f"{row['speedup']:7.3f} {row['tflops_plain']:7.1f}->{row['tflops_overlap']:6.1f} {row['rel_diff']:9.1e}",
              flush=True)
    if not rows:
        raise SystemExit("no cell was measured")
    speedups = [r["speedup"] for r in rows]
    geomean = torch.tensor(speedups, dtype=torch.float64).log().mean().exp().item()
    print(f"{len(rows)} cells: OVERLAP=1 speedup geomean {geomean:.3f}, min {min(speedups):.3f}, "
          f"max {max(speedups):.3f}; largest output difference {max(r['rel_diff'] for r in rows):.1e}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
