"""What the masked blocks of a causal ws forward tile cost, from the tuning tables' own
timings (no GPU needed).

    python benchmarks/tile_cost_fit.py [--gpu H200] [--head-dim 128] [--dtype bf16]

Reads the ``# cell`` comments of ``tuning/nvidia/sm_90/flash.attn_fwd_ws.*`` (time, shape
and chosen tile of every tuned cell; the last file's comment wins) and turns each into
SM-microseconds per query tile: time x 132 SMs / tiles, the grid taken as balanced.

- A key block's cost ``c``: the slope of tile cost against key blocks over the full
  (MASK=0) cells of one Sq (the same tiles, longer keys), averaged over the Sq values.
- The mask's cost per tile: for every (Sq, Sk) timed both full and causal (bottom-right,
  MASK=2) with the same tile, ``causal - full - (causal blocks - full blocks) c``: what
  a causal tile costs beyond its blocks at the full cell's price. Each tile has
  BLOCK_M / BLOCK_N masked blocks (one with 128 x 128 tiles).
"""

from __future__ import annotations

import argparse
import math
import re
from collections import defaultdict
from pathlib import Path

CELL = re.compile(r"# cell \[dtype=(\w+) BLOCK_D=(\d+) .*? MASK=(\d) .*?\] seqlen_q=(\d+) seqlen_k=(\d+): "
                  r"m(\d+)_n(\d+)\S* ([\d.]+) ms.*?; B(\d+) H(\d+) Sq\d+ Sk\d+ D\d+, NVIDIA ([^,]+),")
SMS = 132


def cells(dtype: str, head_dim: int, gpu: str) -> dict[tuple, dict]:
    found = {}
    for path in sorted(Path(__file__).resolve().parents[1].glob("tuning/nvidia/sm_90/flash.attn_fwd_ws.*")):
        for m in CELL.finditer(path.read_text()):
            dt, d, mask, sq, sk, bm, bn, ms, b, h, card = m.groups()
            if dt == dtype and int(d) == head_dim and gpu in card and int(sq) <= int(sk) and mask in "02":
                found[(int(mask), int(sq), int(sk))] = dict(bm=int(bm), bn=int(bn), ms=float(ms), b=int(b), h=int(h))
    return found


def per_tile(mask: int, sq: int, sk: int, c: dict) -> tuple[float, float]:
    """(key blocks a tile, SM-us a tile), bottom-right causal under MASK=2."""
    tiles = math.ceil(sq / c["bm"])
    if mask == 0:
        blocks = [math.ceil(sk / c["bn"])] * tiles
    else:
        blocks = [math.ceil(min(sk, sk - sq + (i + 1) * c["bm"]) / c["bn"]) for i in range(tiles)]
    return sum(blocks) / tiles, c["ms"] * 1e3 * SMS / (tiles * c["b"] * c["h"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    found = cells(args.dtype, args.head_dim, args.gpu)
    by_sq = defaultdict(list)
    for (mask, sq, sk), c in found.items():
        if mask == 0 and c["bm"] == 128 and c["bn"] == 128:
            by_sq[sq].append(per_tile(0, sq, sk, c))
    slopes = []
    for sq, points in sorted(by_sq.items()):
        if len(points) >= 2:
            (n0, t0), (n1, t1) = min(points), max(points)
            slopes.append((t1 - t0) / (n1 - n0))
    if not slopes:
        raise SystemExit(f"no two full 128x128 cells of one Sq for {args.dtype} d{args.head_dim} on {args.gpu}")
    block = sum(slopes) / len(slopes)
    print(f"{args.dtype} d{args.head_dim} on the {args.gpu}: a key block costs {block:.3f} SM-us "
          f"(slopes {min(slopes):.3f}-{max(slopes):.3f} over {len(slopes)} query lengths)")
    print(f"{'Sq':>6} {'Sk':>6} {'tile':>9} {'full':>7} {'causal':>7} {'blocks':>11} {'mask cost':>9} {'(blocks)':>8}")
    for (mask, sq, sk), c in sorted(found.items(), key=lambda kv: kv[0][1:]):
        full = found.get((0, sq, sk))
        if mask != 2 or full is None or (full["bm"], full["bn"]) != (c["bm"], c["bn"]):
            continue
        n_full, t_full = per_tile(0, sq, sk, full)
        n_causal, t_causal = per_tile(2, sq, sk, c)
        extra = t_causal - t_full - (n_causal - n_full) * block * c["bn"] / 128
        print(f"{sq:>6} {sk:>6} {'m%d_n%d' % (c['bm'], c['bn']):>9} {t_full:>7.2f} {t_causal:>7.2f} "
              f"{n_full:>5.1f}/{n_causal:<5.1f} {extra:>9.2f} {extra / block:>8.2f}")


if __name__ == "__main__":
    main()
