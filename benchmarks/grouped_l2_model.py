"""The ws backward's q/dO and dQ traffic through an LRU L2, per program order and GQA
group: does the d128 g8 s4096 causal backward (1.88 ms one-tile, 1.69 PERSISTENT=2) lose
to g4 (1.58 ms one-tile, 1.80 PERSISTENT=2) at the same FLOPs (RESULTS.md, fifty-second
session) because its programs drift apart and stream q and dO from HBM? No GPU.

benchmarks/persistent_backward_model.py has the orders without an L2 (its makespans put
g4 and g8 within 1-2% of the ideal on the one-tile grid) and
benchmarks/grouped_backward_schedule_model.py the dispatch alone. Here every running
program does one step a time unit (the kernel's _step: query blocks from the last down,
every head of the group at each), a step touches its (pair, head, query block) q+dO tile
and the dQ tile it reduces into, each an entry of an LRU cache of L2_MB; a program starts
after FIXED idle units (the one-tile grid's prologue) or, persistent, takes its next tile
of a static list. Printed per shape and order: the time units (the makespan, no memory
stalls in it), q/dO bytes from HBM over the bytes of q and dO (1.0: each read once) and dQ
misses over dQ tiles (1.0: each brought in once), and HBM bytes per step (what the
bandwidth must sustain for the steps to run at compute speed).

What it says (fifty-second session): at d128 s4096 (L2 30-50 MB) g8's one-tile grid moves
45-49 KB a step against g4's 26-43 and g8's PERSISTENT=2 27-29; at s1024 g4 one-tile 51
against persistent2 67, g8 58 against 47. All four directions are the H100's (g4 and g8
each preferring the order the model moves fewer bytes with, g8 one-tile slower than g4).
It is not the whole story: for the dense d128 s1024 causal call it has PERSISTENT=2 move
90 KB a step against one-tile's 21, yet on the GPU PERSISTENT=2 ran 1.41x faster there
(the makespan, persistent_backward_model.py); a strict LRU of whole tiles overstates what
a cyclic pass over more than the cache loses.

Checked on an H100 (fifty-third session, benchmarks/gqa_l2_session.sh, ncu on bf16 d128 s4096
causal): DRAM reads g4 one-tile 1.26 GB, g8 one-tile 2.03, g4 PERSISTENT=2 1.72, g8
PERSISTENT=2 1.26. The model's directions all hold; its g8/g4 one-tile ratio (~1.3x) is low
against the measured 1.61x. The ws backward's tiles are keyed by group width since
(flash.attn_bwd_ws's WIDE_GROUPS axis, rules.wide_groups).

Fifty-fifth session: s16384 (B1, two pairs) and the rotated walk (``rotated2``: a later
round's tile starting at the query block the first round reads when it starts). At d128 g8
s16384 PERSISTENT=2 moves 22 KB a step (40 MB) against s4096's 28, where the tuned tiles stand at
0.93x cuDNN on an H100 against s16384's 0.87-0.89x: more traffic a step does not explain why
s16384 stands lower. Against the dense call of the same FLOPs (1.5-7.5 KB a step; 4.94 ms against
g8's 5.35 on the H100) the extra traffic may explain g8's 8%. The rotated walk changes
nothing (within 1%): under a causal mask a first-round tile ends when the stream has passed every
query block a later tile sees (key block n is seen by blocks >= 2n), so there is no stream to join.

    python benchmarks/grouped_l2_model.py [--l2-mb 40] [--fixed 5]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

PROGRAMS = 132
BLOCK_M, BLOCK_N = 64, 128
QDO_L2_BYTES = 24 * 1024 * 1024  # kernels/backward_ws.py's PERSISTENT=1 cap


class LRU:
    def __init__(self, entries: int):
        self.entries, self.cache, self.misses = entries, OrderedDict(), 0

    def touch(self, key) -> None:
        if key in self.cache:
            self.cache.move_to_end(key)
            return
        self.misses += 1
        self.cache[key] = None
        if len(self.cache) > self.entries:
            self.cache.popitem(last=False)


def tile_steps(pair: int, n: int, n_m: int, group: int, top: int | None = None) -> list[tuple[int, int, int]]:
    """(pair, head, query block) of each step of key block n's program (causal, square):
    the query blocks from the last down, or, given ``top``, from ``top`` down and then from
    the last down to ``top + 1`` (the rotated walk)."""
    first = n * BLOCK_N // BLOCK_M
    blocks = list(range(n_m - 1, first - 1, -1))
    if top is not None:
        top = min(max(top, first), n_m - 1)
        blocks = blocks[n_m - 1 - top:] + blocks[:n_m - 1 - top]
    return [(pair, i % group, blocks[i // group]) for i in range(len(blocks) * group)]


def rotated(lists, n_m: int, group: int):
    """Each program's tiles with the rotated walk: a tile starts at the query block the first
    round's tiles read when it starts (every program knows the static list, so the start
    time of its k-th tile is the steps of its tiles before), so a later round's tile reads in
    step with the first round's instead of streaming the last blocks again behind them."""
    out = []
    for own in lists:
        start, mine = 0, []
        for pair, n in own:
            mine.append((pair, n, n_m - 1 - start // group))
            start += len(tile_steps(pair, n, n_m, group))
        out.append(mine)
    return out


def sections(pairs: int, n_n: int, width: int) -> list[tuple[int, int]]:
    """(pair, key block) of each tile: sections of ``width`` pairs, key block slowest."""
    tiles = []
    for first in range(0, pairs, width):
        w = min(width, pairs - first)
        tiles += [(first + r % w, r // w) for r in range(w * n_n)]
    return tiles


def back_and_forth(tiles, programs):
    lists = [[] for _ in range(programs)]
    for t, tile in enumerate(tiles):
        r, i = divmod(t, programs)
        lists[programs - 1 - i if r % 2 else i].append(tile)
    return lists


def simulate(tiles, lists, n_m: int, group: int, fixed: int, entries: int):
    """Run every program a step a time unit; returns (time units, q/dO misses, dQ misses)."""
    qdo, dq = LRU(entries // 2), LRU(entries // 2)
    queue = list(tiles)
    slots = []  # per SM: [remaining steps iterator, idle units left, own list or None]
    for sm in range(PROGRAMS):
        own = lists[sm] if lists is not None else None
        slots.append([iter(()), fixed if own is None else 0, own])
    time = 0

    def next_tile(slot):
        own = slot[2]
        source = own if own is not None else queue
        if not source:
            return False
        tile = source.pop(0)
        slot[0] = iter(tile_steps(tile[0], tile[1], n_m, group, *tile[2:]))
        return True

    active = [next_tile(s) for s in slots]
    while any(active):
        time += 1
        for sm, slot in enumerate(slots):
            if not active[sm]:
                continue
            if slot[1] > 0:
                slot[1] -= 1
                continue
            step = next(slot[0], None)
            if step is None:
                active[sm] = next_tile(slot)
                if active[sm] and slot[2] is None:
                    slot[1] = fixed - 1  # a new program's prologue (this unit included)
                continue
            qdo.touch(step)
            dq.touch(step)
    return time, qdo.misses, dq.misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--l2-mb", type=float, default=40.0, help="L2 left to q/dO and dQ (H100/H200: 50 MB)")
    parser.add_argument("--fixed", type=int, default=5, help="a one-tile program's prologue, in steps")
    parser.add_argument("--d", type=int, default=128)
    args = parser.parse_args()
    tile_bytes = BLOCK_M * args.d * 2 * 2  # q and dO, 16-bit; dQ fp32: the same
    entries = int(args.l2_mb * 2**20 // tile_bytes)
    print(f"d{args.d}, L2 {args.l2_mb} MB for q/dO and dQ tiles of {tile_bytes // 1024} KB, causal")
    print(f"{'shape':22} {'order':12} {'units':>6} {'q/dO reads':>10} {'dQ misses':>9} {'KB/step':>8}")
    for seqlen, batch in ((1024, 16), (4096, 4), (16384, 1)):
        heads_q = 2048 // args.d
        n_n, n_m = seqlen // BLOCK_N, seqlen // BLOCK_M
        for group in (1, 4, 8):
            pairs = batch * heads_q // group
            together = max(1, PROGRAMS // n_n)  # program_order: about a wave of pairs a section
            wide = max(1, min(-(-8 * PROGRAMS // n_n), pairs))  # PERSISTENT=2: eight rounds a section
            # PERSISTENT=1: two rounds a section, capped to the pairs whose q and dO fit in 24 MB
            capped = max(1, min(-(-2 * PROGRAMS // n_n), QDO_L2_BYTES // (4 * group * seqlen * args.d), pairs))
            orders = (("one-tile", sections(pairs, n_n, together), None, args.fixed),
                      ("persistent1", sections(pairs, n_n, capped), "lists", 0),
                      ("persistent2", sections(pairs, n_n, wide), "lists", 0),
                      ("rotated2", sections(pairs, n_n, wide), "rotated", 0))
            tiles_qdo = pairs * group * n_m
            for name, tiles, lists, fixed in orders:
                dealt = back_and_forth(tiles, PROGRAMS) if lists else None
                if lists == "rotated":
                    dealt = rotated(dealt, n_m, group)
                units, q_miss, dq_miss = simulate(tiles, dealt, n_m, group, fixed, entries)
                steps = sum(len(tile_steps(p, n, n_m, group)) for p, n in tiles)
                per_step = (q_miss + 2 * dq_miss) * tile_bytes / steps / 1024
                shape = f"s{seqlen} B{batch} g{group}"
                print(f"{shape:22} {name:12} {units:6d} {q_miss / tiles_qdo:10.2f} {dq_miss / tiles_qdo:9.2f} "
                      f"{per_step:8.1f}")


if __name__ == "__main__":
    main()
