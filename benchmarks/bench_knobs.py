"""A kernel's tuning knobs beyond the tiles side by side: each cell's tuned configuration
against the same tiles with each knob setting, in one process on the GPU. The forward
(``flash.attn_fwd``): OVERLAP=1, TMA=1 (K), TMA=2 (K and V) and OVERLAP=1 TMA=2; the split
backward's dQ and dK/dV (``flash.attn_bwd_dq``, ``flash.attn_bwd_dkdv``): TMA=1; the ws
forward (``flash.attn_fwd_ws``): the persistent grid against one program per tile, and
persistent with a second Q slot (``Q_SLOTS=2``), with the output stored by bulk copies
(``TMA_STORE=1``), and both at two stages (where the cell's ring leaves no room for them).
``--cudnn``: SDPA's cuDNN backend at each forward cell's shape too, by the same clock.

    AOTATTN_MODE=aot AOTATTN_IMAGES=... python benchmarks/bench_knobs.py [--table flash.attn_fwd]
        [--dtype bf16,fp16] [--head-dim 64,128,256] [--seqlen 512,...,16384] [--keys 77,512] [--mask 0,2]
        [--json out.json]

(``benchmarks/forward_knobs_session.sh`` builds the forward's images of all five and runs
this; a variant whose compile failed, as TMA at two stages does in the forward with Triton
3.6, or that needs more shared memory than the GPU has, shows as failed.)
Grid: hidden size 2048 (H = 2048 / D), 16k tokens per batch (B = 16384 / S), Sq = Sk
(``--keys``: these key lengths against each query length instead).
Timed by the tuner's clock (:func:`aotattn.tune.timing.measure`: CUDA events, L2 flushed
before each call), two interleaved rounds per variant, the lower median kept; each
variant's outputs are compared with the plain loop's (relative error, the largest over
what the kernel writes). The tuner decides per cell (``aotattn tune plan -c flash,attn_fwd
--limit 48``, docs/tuner.md); this is the quick look. ``--device cpu`` runs the same code
path in the interpreter on one tiny shape per dtype and mask (a check, not a speed).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from aotattn import tuning
from aotattn.families.flash import rules
from aotattn.runtime.device import arch_of
from aotattn.spec import Config, Functional
from aotattn.tune.candidates import config_name
from aotattn.tune.flash import Problem, Shape, current_config, relative_error
from aotattn.tune.timing import measure

VARIANTS = {
    "flash.attn_fwd": {"plain": {}, "overlap": {"OVERLAP": 1}, "tma-k": {"TMA": 1}, "tma-kv": {"TMA": 2},
                       "both": {"OVERLAP": 1, "TMA": 2}},
    "flash.attn_bwd_dq": {"plain": {}, "tma": {"TMA": 1}},
    "flash.attn_bwd_dkdv": {"plain": {}, "tma": {"TMA": 1}},
    "flash.attn_fwd_ws": {"plain": {}, "persist": {"PERSISTENT": 1},
                          "qslots": {"PERSISTENT": 1, "Q_SLOTS": 2},  # the next tile's Q a tile ahead
                          "store": {"PERSISTENT": 1, "TMA_STORE": 1},  # the output by bulk copies
                          "both-st2": {"PERSISTENT": 1, "Q_SLOTS": 2, "TMA_STORE": 1, "STAGES": 2}},
}
# the kernel's matmul FLOPs over the forward's two (dQ: S, dP, dQ; dK/dV: S, dP, dV, dK)
FLOPS_OVER_FORWARD = {"flash.attn_fwd": 1.0, "flash.attn_fwd_ws": 1.0, "flash.attn_bwd_dq": 1.5,
                      "flash.attn_bwd_dkdv": 2.0}


def functional(dtype: str, head_dim: int, mask: int) -> Functional:
    return Functional.of(dict(dtype=dtype, BLOCK_D=head_dim, BLOCK_DV=head_dim, PAD_HEAD=False, MASK=mask,
                              VARLEN=False, DROPOUT=False, BIAS=0))


def _cudnn_ms(f: Functional, shape: Shape, device: torch.device) -> float:
    """SDPA's cuDNN forward at the cell's shape ((B, H, S, D) tensors), the tuner's clock."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[f["dtype"]]
    q, k, v = (torch.randn(shape.batch, shape.heads, n, shape.head_dim, device=device, dtype=dtype)
               for n in (shape.seqlen_q, shape.seqlen_k, shape.seqlen_k))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        run = lambda _: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(f["MASK"]))
        return measure(run, lambda: None, device=device, warmup=3, repeats=10).median_ms


def compare(table: str, f: Functional, shape: Shape, device: torch.device, rounds: int = 2,
            cudnn: bool = False) -> dict:
    """Each variant's time and its outputs' difference from the plain loop's, for the cell's tiles."""
    spec = rules.KERNELS[table.split(".", 1)[1]]
    variants = VARIANTS[table]
    cell = (shape.seqlen_q, shape.seqlen_k)
    tiles = (current_config(tuning.database(), arch_of(device), table, f, cell) if device.type == "cuda"
             else rules.INTERPRETER_CONFIG).as_dict()
    tiles = {k: v for k, v in tiles.items() if k not in dict(spec.knob_defaults)}
    configs = {name: spec.canonical(Config.of(tiles, **knobs)) for name, knobs in variants.items()}
    problem = Problem(table, f, shape, device)
    outputs, times, failed = {}, {name: [] for name in variants}, {}
    for _ in range(rounds):
        for name, config in configs.items():
            if name in failed:
                continue
            try:
                run = problem.runner(config)
                problem.reset()
                run()
            except Exception as exc:  # no image (its compile failed), or the JIT's compile failed
                if name == "plain":
                    raise
                failed[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
                continue
            outputs[name] = {key: t.to(torch.float64) for key, t in problem.outputs().items()}
            times[name].append(measure(lambda _: run(), lambda: None, device=device, warmup=3, repeats=10).median_ms)
    flops = (4.0 * FLOPS_OVER_FORWARD[table] * shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k
             * shape.head_dim / (2 if f["MASK"] else 1))
    if cudnn and table in ("flash.attn_fwd", "flash.attn_fwd_ws") and device.type == "cuda":
        times["cudnn"] = [_cudnn_ms(f, shape, device) for _ in range(rounds)]
    best = {name: min(ms) for name, ms in times.items() if ms}
    return dict(shape=str(shape), dtype=f["dtype"], mask=f["MASK"], tiles=config_name(configs["plain"]),
                ms=best, tflops={name: flops / ms / 1e9 for name, ms in best.items()},
                speedup={name: best["plain"] / ms for name, ms in best.items()},
                rel_diff={name: max(relative_error(t, outputs["plain"][key]) for key, t in outs.items())
                          for name, outs in outputs.items()}, failed=failed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default="flash.attn_fwd", choices=sorted(VARIANTS))
    ap.add_argument("--dtype", default="bf16,fp16")
    ap.add_argument("--head-dim", default="64,128,256")
    ap.add_argument("--seqlen", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--keys", default="", help="key lengths (default: each query length)")
    ap.add_argument("--mask", default="0,2", help="0: full, 2: causal (bottom-right)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--cudnn", action="store_true", help="time SDPA's cuDNN forward at each cell too")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtypes, masks = args.dtype.split(","), [int(m) for m in args.mask.split(",")]
    if device.type == "cuda":
        grid = [(dtype, int(d), int(s), int(sk or s), m) for dtype in dtypes for d in args.head_dim.split(",")
                for s in args.seqlen.split(",") for sk in (args.keys.split(",") if args.keys else [0])
                for m in masks]
    else:  # one tiny problem per dtype and mask: the code path, in the interpreter
        grid = [(dtype, 16, 64, 64, m) for dtype in dtypes for m in masks]
    others = [name for name in VARIANTS[args.table] if name != "plain"] + (["cudnn"] if args.cudnn else [])
    print(f"{'shape':30} {'dtype':5} {'mask':4} {'tiles':16} {'plain ms':>9} {'TFLOP/s':>7} "
          + " ".join(f"{name:>8}" for name in others) + "  (speedup over plain)  largest diff")
    rows = []
    for dtype, d, s, sk, m in grid:
        shape = (Shape(max(1, 16384 // s), max(1, 2048 // d), s, sk, d) if device.type == "cuda"
                 else Shape(1, 2, s, sk, d))
        try:
            row = compare(args.table, functional(dtype, d, m), shape, device, cudnn=args.cudnn)
        except Exception as exc:  # a variant without an image, a failed compile: say so, go on
            print(f"{str(shape):30} {dtype:5} {m:4} skipped: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
            continue
        rows.append(row)
        print(f"{row['shape']:30} {dtype:5} {m:4} {row['tiles']:16} {row['ms']['plain']:9.4f} "
              f"{row['tflops']['plain']:7.1f} "
              + " ".join(f"{row['speedup'][name]:8.3f}" if name in row["speedup"] else f"{'failed':>8}"
                         for name in others)
              + f"  {max(row['rel_diff'].values()):.1e}" + "".join(f"  [{n}: {why}]" for n, why in row["failed"].items()),
              flush=True)
    if not rows:
        raise SystemExit("no cell was measured")
    for name in others:
        speedups = [row["speedup"][name] for row in rows if name in row["speedup"]]
        if not speedups:
            print(f"{name:8} ran in no cell")
            continue
        geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
        print(f"{name:8} over plain, {len(speedups)} cells: geomean {geomean:.3f}, min {min(speedups):.3f}, "
              f"max {max(speedups):.3f}")
    print(f"largest output difference from the plain loop: {max(max(r['rel_diff'].values()) for r in rows):.1e}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
