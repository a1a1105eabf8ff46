"""A model of the ws forward's persistent schedule (kernels/forward_ws.py, PERSISTENT=1)
against the one-tile grid, for choosing a tile order without device time. No GPU.

Tile cost: its key blocks (query block i of a causal call: i + 1; full: all), plus a
fixed cost per tile: small on the persistent grid (the next tile's Q load and the last
product overlap the epilogue), larger on the one-tile grid (a new program's prologue and
epilogue). The persistent grid deals a static list to ``programs`` programs (or, a
design not built, programs take the next tile from an atomic counter); the one-tile grid
is the hardware's greedy dispatch in launch order (query block fastest, costliest first).
Printed: the makespan of each order (lower is faster). It has no L2 in it: orders that
put many heads' K and V in flight at once lose more on the GPU than here (RESULTS.md,
twentieth session).

    python benchmarks/persistent_schedule_model.py [--sweep]
"""

from __future__ import annotations

import heapq

PERSISTENT_FIXED = 0.3  # per tile, in key blocks
ONE_TILE_FIXED = 1.0
PROGRAMS = 132  # the H200's SMs


def costliest_first(heads: int, n_m: int, width: int) -> list[int]:
    """Query block of each tile of the list: sections of ``width`` heads, query blocks
    slowest and last first inside a section (width = heads: one list)."""
    blocks = []
    for first in range(0, heads, width):
        w = min(width, heads - first)
        blocks += [n_m - 1 - r // w for r in range(w * n_m)]
    return blocks


def static(blocks: list[int], programs: int, back_and_forth: bool) -> float:
    load = [0.0] * programs
    for t, m in enumerate(blocks):
        r, i = divmod(t, programs)
        p = programs - 1 - i if back_and_forth and r % 2 else i
        load[p] += m + 1 + PERSISTENT_FIXED
    return max(load)


def greedy(blocks: list[int], programs: int, fixed: float = ONE_TILE_FIXED) -> float:
    """The next tile to the first program free: the hardware's dispatch of a one-tile grid,
    or (fixed = PERSISTENT_FIXED) a persistent grid taking tiles from an atomic counter."""
    free = [0.0] * programs
    for m in blocks:
        heapq.heappush(free, heapq.heappop(free) + m + 1 + fixed)
    return max(free)


def aligned(heads: int, n_m: int, group: int, programs: int) -> float | None:
    """Whole sections of one group of heads (``group * n_m`` tiles) a round, each dealt forth
    on even rounds and back on odd ones (a tile and its mirror add up to n_m + 1); the
    programs past the last whole section idle. None where a section exceeds the programs or
    more than 1/16 of them would idle (the forty-second session's variant, not built)."""
    width = group * n_m
    if width > programs or (programs % width) * 16 > programs:
        return None
    per_round = programs // width
    slots = per_round * width
    load = [0.0] * programs
    for r in range((heads * n_m + slots - 1) // slots):
        for p in range(slots):
            pos = p % width if r % 2 == 0 else width - 1 - p % width
            if (r * per_round + p // width) * width + pos < heads * n_m:
                load[p] += n_m - pos // group + PERSISTENT_FIXED
    return max(load)


def sweep(min_rounds: float) -> None:
    """The worst makespan over the one list's, for sections of programs // (4 n_m) heads dealt
    back and forth (PERSISTENT=2, forward_ws._decode, landed in the forty-sixth session)
    and for :func:`aligned`, over n_m 1-32 and 1-1200 heads where the call has min_rounds rounds
    or more."""
    worst = {"quarter sections": (0.0,), "aligned": (0.0,)}
    for n_m in range(1, 33):
        for heads in range(1, 1201):
            programs = min(PROGRAMS, heads * n_m)
            if heads * n_m < min_rounds * programs:
                continue
            one = static(costliest_first(heads, n_m, heads), programs, True)
            quarter = programs // (4 * n_m)
            found = {"quarter sections": static(costliest_first(heads, n_m, quarter), programs, True) if quarter else None,
                     "aligned": aligned(heads, n_m, 1, programs)}
            for name, makespan in found.items():
                if makespan is not None and makespan / one > worst[name][0]:
                    worst[name] = (makespan / one, n_m, heads)
    for name, (ratio, *where) in worst.items():
        print(f"at >= {min_rounds} rounds, {name}: worst {ratio:.2f}x the one list"
              + (f" (n_m {where[0]}, {where[1]} heads)" if where else ""))


def main() -> None:
    shapes = [("d64 s4096 B4 H32 (BLOCK_M 128)", 128, 32), ("d128 s4096 B4 H16", 64, 32), ("d256 s4096 B4 H8", 32, 32),
              ("d128 s16384 B1 H16", 16, 128), ("d256 s16384 B1 H8", 8, 128), ("d128 s1024 B16 H16", 256, 8)]
    print("causal, makespan in key blocks (lower is faster); sN a/b: sections of N heads dealt by a round robin /"
          " taken from an atomic counter")
    for name, heads, n_m in shapes:
        one_list = costliest_first(heads, n_m, heads)
        ideal = sum(m + 1 + PERSISTENT_FIXED for m in one_list) / PROGRAMS
        one_tile = greedy([n_m - 1 - i % n_m for i in range(heads * n_m)], PROGRAMS)
        row = [f"ideal {ideal:.0f}", f"one-tile {one_tile:.0f}", f"round robin {static(one_list, PROGRAMS, False):.0f}",
               f"back and forth {static(one_list, PROGRAMS, True):.0f}"]
        row += [f"s{w} {static(costliest_first(heads, n_m, w), PROGRAMS, False):.0f}"
                f"/{greedy(costliest_first(heads, n_m, w), PROGRAMS, PERSISTENT_FIXED):.0f}"
                for w in (1, 2, 4, 8, 16) if w < heads]
        print(f"{name:32} " + "  ".join(row))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--sweep"]:  # slow: 5-9 minutes on one core
        for rounds in (8, 15):
            sweep(rounds)
    else:
        main()
