"""A model of the ws backward's persistent schedule (kernels/backward_ws.py, PERSISTENT=1)
against its one-tile grid, under a causal mask. No GPU.

A tile is a key block of one (sequence, key head) pair; its cost is its steps (the query
blocks that see it, times the group size: key block n of a square causal call with
BLOCK_N = 128, BLOCK_M = 64 is seen by 2 (n_n - n) query blocks) plus a fixed cost per
tile, in steps: on the one-tile grid a program's descriptors, barriers, first loads and
last stores (~11 us against ~1.2 us a step at d64 q128-k16384, RESULTS.md, thirty-second
session: ONE_TILE_FIXED), on the persistent grid the exposed K/V load (PERSISTENT_FIXED).
Orders:
- one-tile: the hardware's greedy dispatch of the grid, renumbered by program_order
  (groups of pairs that fill about a wave, rank-major: key block 0 of every pair of the
  group first);
- sections (the kernel's order): sections of ``width`` pairs (at least two rounds of tiles,
  at most 24 MB of q and dO), key block slowest within a section, dealt back and forth;
- all heads: one section (costliest first over every pair), dealt back and forth;
- counter: the sections' list taken from an atomic counter (not built);
- 8 rounds: sections of eight rounds of tiles without the L2 cap (PERSISTENT=2, built
  after this model, not yet timed on the GPU when written): the programs
  running together still read a pair's q and dO in step (``_step``: every tile of a pair
  starts at its last query block), so the cap may be needless; a pair's q and dO are read
  about eight times from memory instead of once.
Printed: makespans in steps (lower is faster) and the ideal (total work / programs). The
model reproduces the H200's ratios of the persistent grid to the one-tile grid: d128 s1024
causal 1.41x (measured 1.41x), GQA group 4 0.77x (0.79x), d128 s4096 0.94x (0.97x), d256
s8192 0.86x (0.88x). No L2
in it: the all-heads order lost 1.37x on the GPU at q128-k16384 (every tile streaming its
own head's q and dO), which this model does not see.

Sixty-second session: d128 g8 s16384 B1 Hk2 (0.87-0.89x cuDNN on an H100, the one GQA shape
below 0.9x) and ``halves``, each tile taking half of the group's query heads (the split the
fifty-fifth session named). PERSISTENT=2 there is within 2.3% of the ideal (2049 steps against
2003: the heaviest tile, key block 0 with 8 heads x 256 query blocks, is itself above the ideal),
and halves would bring it to 2039 (0.5%), less than its partials' extra traffic costs: the
balance of the schedule is not what holds that shape back, and splitting the group's heads for
balance is not worth building. What is left is the q/dO traffic (grouped_l2_model.py).

    python benchmarks/persistent_backward_model.py
"""

from __future__ import annotations

import heapq

ONE_TILE_FIXED = 5.0  # steps
PERSISTENT_FIXED = 1.0
SPLIT_FIXED = 4.0  # a half-group tile's dK/dV partial added into an fp32 buffer (not built; a guess)
PROGRAMS = 132
QDO_L2_BYTES = 24 * 1024 * 1024


def steps(n: int, n_n: int, group: int) -> int:
    return 2 * (n_n - n) * group


def sections(pairs: int, n_n: int, width: int) -> list[int]:
    """Key block of each tile: sections of ``width`` pairs, key block slowest inside."""
    blocks = []
    for first in range(0, pairs, width):
        w = min(width, pairs - first)
        blocks += [r // w for r in range(w * n_n)]
    return blocks


def back_and_forth(costs: list[float], programs: int) -> float:
    load = [0.0] * programs
    for t, c in enumerate(costs):
        r, i = divmod(t, programs)
        load[programs - 1 - i if r % 2 else i] += c
    return max(load)


def greedy(costs: list[float], programs: int) -> float:
    free = [0.0] * programs
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def main() -> None:
    # name, pairs (B x Hk), key blocks, group, q and dO bytes per pair
    shapes = [("d128 s1024 B16 H16", 256, 8, 1, 4 * 1024 * 128), ("d128 g4 s1024 B16 Hk4", 64, 8, 4, 4 * 4 * 1024 * 128),
              ("d128 g8 s1024 B16 Hk2", 32, 8, 8, 4 * 8 * 1024 * 128), ("d128 s4096 B4 H16", 64, 32, 1, 4 * 4096 * 128),
              ("d128 g8 s4096 B4 Hk2", 8, 32, 8, 4 * 8 * 4096 * 128), ("d256 s8192 B2 H8", 16, 128, 1, 4 * 8192 * 256),
              ("d64 s1024 B16 H32", 512, 8, 1, 4 * 1024 * 64),
              ("d128 g8 s16384 B1 Hk2", 2, 128, 8, 4 * 8 * 16384 * 128)]
    print("causal backward, makespan in steps (lower is faster)")
    for name, pairs, n_n, group, qdo in shapes:
        work = [steps(n, n_n, group) for n in sections(pairs, n_n, 1)]
        ideal = sum(w + PERSISTENT_FIXED for w in work) / PROGRAMS
        together = max(1, PROGRAMS // n_n)  # program_order: about a wave of programs a group
        one_tile = greedy([steps(n, n_n, group) + ONE_TILE_FIXED for n in sections(pairs, n_n, together)], PROGRAMS)
        width = max(1, min(-(-2 * PROGRAMS // n_n), QDO_L2_BYTES // qdo, pairs))
        ordered = [steps(n, n_n, group) + PERSISTENT_FIXED for n in sections(pairs, n_n, width)]
        every = [steps(n, n_n, group) + PERSISTENT_FIXED for n in sections(pairs, n_n, pairs)]
        wide = max(1, min(-(-8 * PROGRAMS // n_n), pairs))  # eight rounds a section, no L2 cap
        widened = [steps(n, n_n, group) + PERSISTENT_FIXED for n in sections(pairs, n_n, wide)]
        print(f"{name:24} ideal {ideal:6.0f}  one-tile {one_tile:6.0f}  sections(w={width}) "
              f"{back_and_forth(ordered, PROGRAMS):6.0f}  all heads {back_and_forth(every, PROGRAMS):6.0f}  "
              f"counter {greedy(ordered, PROGRAMS):6.0f}  8 rounds(w={wide}) {back_and_forth(widened, PROGRAMS):6.0f}"
              f"/counter {greedy(widened, PROGRAMS):6.0f}"
              + (f"  halves {halves(pairs, n_n, group):6.0f}" if group > 1 else ""))


def halves(pairs: int, n_n: int, group: int) -> float:
    """PERSISTENT=2's makespan with each tile taking half of the group's query heads (twice
    the tiles, half the steps each, SPLIT_FIXED more a tile for adding its dK/dV partial)."""
    wide = max(1, min(-(-8 * PROGRAMS // n_n), 2 * pairs))
    return back_and_forth([steps(n, n_n, group // 2) + PERSISTENT_FIXED + SPLIT_FIXED
                           for n in sections(2 * pairs, n_n, wide)], PROGRAMS)


if __name__ == "__main__":
    main()
