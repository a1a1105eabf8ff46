"""A model of the ws backward's one-tile grid on a grouped causal call: is the g8 gap to
g4 (RESULTS.md, fifty-second session: 1.88-1.90 ms against 1.58-1.60 at d128 s4096, the
same FLOPs) dispatch granularity? No GPU.

A program is one key tile (BLOCK_N keys) of one (batch, key head); it walks the query
blocks that see its keys for each of the G query heads of its group, so its cost is
G x (its causal query blocks) + a fixed prologue/epilogue. The hardware deals programs in
launch order (heaviest first) to the first free SM. Printed: the makespan over the ideal
(total work / SMs) for g4 and g8 at the perfmon gqa entries' shapes (hidden 2048, 16k
tokens), and with each tile's group split over two programs (a design not built).

    python benchmarks/grouped_backward_schedule_model.py [--sms 132] [--fixed 1.0]
"""

from __future__ import annotations

import argparse
import heapq


def makespan(costs: list[float], sms: int) -> float:
    free = [0.0] * sms
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def program_costs(batch: int, heads_k: int, group: int, seqlen: int, block_n: int, block_m: int,
                  split: int, fixed: float) -> list[float]:
    """Per program, in launch order: key tile 0 (seen by every query block) first."""
    costs = []
    for tile in range(seqlen // block_n):
        query_blocks = (seqlen - tile * block_n) // block_m
        costs += [group / split * query_blocks + fixed] * (batch * heads_k * split)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--fixed", type=float, default=1.0, help="per program, in query blocks")
    args = parser.parse_args()
    print(f"{'shape':24s} {'programs':>8s} {'makespan / ideal':>16s}")
    for d, heads_q in ((64, 32), (128, 16)):
        for seqlen in (1024, 4096, 16384):
            batch = 16384 // seqlen
            for group in (4, 8):
                for split in (1, 2):
                    costs = program_costs(batch, heads_q // group, group, seqlen, 128, 64, split, args.fixed)
                    ratio = makespan(costs, args.sms) / (sum(costs) / args.sms)
                    name = f"d{d} s{seqlen} g{group}" + (f" split{split}" if split > 1 else "")
                    print(f"{name:24s} {len(costs):8d} {ratio:16.3f}")


if __name__ == "__main__":
    main()
