"""A list-scheduling model of ``program_order`` (kernels/common.py): how a masked grid's
groups of (head, batch) pairs start on 132 SMs, for choosing the grouping rule without
device time. No GPU.

Each pair has ``blocks`` programs; under a causal mask rank r (0: the costliest, the one
the kernels give the most query or key blocks) costs ``blocks - r`` steps. Inside a group
the programs go rank by rank; the hardware starts each next program on the first SM free.
Printed: the makespan over its lower bound (the total work over 132, or the costliest
program), for three rules:

- ``l2``: as many pairs as keep their streamed bytes within L2_SHARE (16 MB), at most 16;
  the last group the remainder (before the twenty-third session);
- ``wave+``: at least ceil(132 / blocks) pairs (the twenty-second session's patch);
- ``landed``: at most a wave (floor(132 / blocks)) and the L2 share, the last group taking
  the remainder instead of standing alone; the ws backward passes no streamed bytes (its
  programs read the same tiles at the same step), so its rows use no L2 limit;
- ``alone`` (the sweep only): the landed rule with a small last group on its own.

It has no L2, no per-program fixed cost and no memory limits in it. Measured (twenty-third
session, GQA d128 s4096 causal ws backward, 32 blocks a pair): group 8 (8 pairs) 1.93 / 1.74
/ 1.49 ms and group 4 (16 pairs) 1.51 / 1.66 / 1.33 ms under the three rules (the last with
the ws backward's last-first step order): the rules rank as the model ranks them, and the
model overstates the differences (group 8, l2 against landed: 1.59x modelled, 1.29x measured).

    python benchmarks/program_order_model.py
"""

from __future__ import annotations

import heapq
import math

SMS = 132
L2_SHARE_MB = 16
MAX_TOGETHER = 16


def group_sizes(pairs: int, blocks: int, streamed_mb: float, rule: str) -> list[int]:
    by_l2 = MAX_TOGETHER if streamed_mb <= 0 else min(MAX_TOGETHER, max(1, int(L2_SHARE_MB // streamed_mb)))
    if rule in ("landed", "alone"):
        together = max(1, min(by_l2, SMS // blocks))
        if rule == "alone":
            return [min(together, pairs - first) for first in range(0, pairs, together)]
        groups = max(pairs // together, 1)
        return [together] * (groups - 1) + [pairs - together * (groups - 1)]
    together = by_l2 if rule == "l2" else min(MAX_TOGETHER, max(by_l2, -(-SMS // blocks)))
    return [min(together, pairs - first) for first in range(0, pairs, together)]


def makespan(blocks: int, sizes: list[int]) -> float:
    """Over the lower bound: the programs in launch order, each to the first SM free."""
    free = [0.0] * SMS
    for size in sizes:
        for rank in range(blocks):
            for _ in range(size):
                heapq.heappush(free, heapq.heappop(free) + blocks - rank)
    bound = max(sum(sizes) * blocks * (blocks + 1) / 2 / SMS, blocks)
    return max(free) / bound


def main() -> None:
    rules = ("l2", "wave+", "landed")
    # (name, blocks a pair, pairs, streamed MB a pair under the l2 rule: the ws backward's q and dO)
    shapes = [("GQA g8 d128 s4096 (B4 Hk2)", 32, 8, 16), ("GQA g4 d128 s4096 (B4 Hk4)", 32, 16, 8),
              ("GQA g4 d64 s4096 (B4 Hk8)", 32, 32, 4), ("GQA g8 d64 s4096 (B4 Hk4)", 32, 16, 8),
              ("GQA g8 d128 s1024 (B16 Hk2)", 8, 32, 4), ("dense d128 s4096 (B4 H16)", 32, 64, 2),
              ("GQA g8 d128 s16384 (B1 Hk2)", 128, 2, 64)]
    print(f"{'causal grid':30s}" + "".join(f"{rule:>10s}" for rule in rules) + "   (makespan / lower bound)")
    for name, blocks, pairs, streamed in shapes:
        print(f"{name:30s}" + "".join(
            f"{makespan(blocks, group_sizes(pairs, blocks, 0 if r == 'landed' else streamed, r)):10.3f}"
            for r in rules))
    # a sweep without an L2 limit (the landed ws backward passes none): geomean and worst
    for rule in ("alone", "landed"):
        ratios = [(makespan(b, group_sizes(p, b, 0, rule)), b, p) for b in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
                  for p in list(range(1, 40)) + [48, 64, 96, 128]]
        geomean = math.exp(sum(math.log(r) for r, _, _ in ratios) / len(ratios))
        worst = max(ratios)
        print(f"sweep, rule {rule:7s}: geomean {geomean:.3f}, worst {worst[0]:.3f} ({worst[1]} blocks, {worst[2]} pairs)")


if __name__ == "__main__":
    main()
