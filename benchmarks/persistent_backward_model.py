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

    python benchmarks/persistent_backward_model.py
"""

from __future__ import annotations

import heapq

ONE_TILE_FIXED = 5.0  # steps
PERSISTENT_FIXED = 1.0
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
              ("d64 s1024 B16 H32", 512, 8, 1, 4 * 1024 * 64)]
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
              f"/counter {greedy(widened, PROGRAMS):6.0f}")


if __name__ == "__main__":
    main()
