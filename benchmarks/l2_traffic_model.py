"""How many K/V bytes the ws forward's persistent schedule reads from HBM, in a model with
an LRU L2: for choosing a masked tile order without device time. No GPU.

Every program (one per SM) runs its static list of tiles (forward_ws._decode and
round_tile: back and forth over costliest-first tiles), one key block a step; all programs
step together. A block read is a hit when that (head, key block) is in the L2, an LRU of
whole K+V blocks. Printed per order: HBM bytes of K and V, their ratio to the bytes of K
and V themselves (1.0: every block read once from HBM), and the steps (the makespan in
key blocks), and the HBM bandwidth the order would need at full speed; then the same
for the causal shape grid of bench_attention.py (hidden 2048, 16k tokens).

Why (RESULTS.md, forty-sixth session): a d128 block does 128 FLOP per byte of K and V,
under the H100's ridge (~295), so a tile order that reads each block from HBM once per
tile is memory bound. At s1024 with 128 (sequence, head) pairs the one costliest-first
list runs about one tile of each head at a time, and no tile finds its blocks in the L2.

    python benchmarks/l2_traffic_model.py
"""

from __future__ import annotations

from collections import OrderedDict

PROGRAMS = 132
L2_BYTES = 50 * 1024 * 1024


def tile_list(heads: int, n_m: int, width: int, causal: bool) -> list[tuple[int, int]]:
    """(head, key blocks) of each tile: sections of ``width`` heads, query blocks slowest
    and (causal) last first inside a section, as forward_ws._decode."""
    tiles = []
    for first in range(0, heads, width):
        w = min(width, heads - first)
        for r in range(w * n_m):
            rank, h = divmod(r, w)
            m = n_m - 1 - rank if causal else rank
            tiles.append((first + h, m + 1 if causal else n_m))
    return tiles


def deal(tiles: list, programs: int) -> list[list]:
    """round_tile: program p takes p, then 2 programs - 1 - p, ..."""
    lists = [[] for _ in range(programs)]
    for t, tile in enumerate(tiles):
        r, i = divmod(t, programs)
        lists[programs - 1 - i if r % 2 else i].append(tile)
    return lists


def simulate(tiles: list, block_bytes: int, programs: int = PROGRAMS) -> tuple[float, int]:
    """(HBM bytes of K and V, steps)."""
    lists = deal(tiles, programs)
    capacity = L2_BYTES // block_bytes
    l2: OrderedDict = OrderedDict()
    position = [(0, 0)] * programs  # (tile index, block index) per program
    misses = steps = 0
    while True:
        active = False
        for p in range(programs):
            i, j = position[p]
            if i >= len(lists[p]):
                continue
            active = True
            head, blocks = lists[p][i]
            key = (head, j)
            if key in l2:
                l2.move_to_end(key)
            else:
                misses += 1
                l2[key] = None
                if len(l2) > capacity:
                    l2.popitem(last=False)
            position[p] = (i, j + 1) if j + 1 < blocks else (i + 1, 0)
        if not active:
            return misses * block_bytes, steps
        steps += 1


# A key block does 2 * 2 * 128 * 128 * d FLOP on 2 * 128 * d * 2 bytes of K and V: 128 FLOP a byte
# at any d. At the forward's ~630 TFLOP/s (H100, d128 s16384) a block read from HBM every time
# needs ~4.9 TB/s; the HBM gives ~3.35 (H100) or 4.8 (H200) at most.
PEAK_TFLOPS = 630.0


def needed_tbps(hbm: float, steps: int, d: int) -> float:
    """The HBM bandwidth the order needs to run at PEAK_TFLOPS: its bytes over its steps' time."""
    step_s = PROGRAMS * 2 * 2 * 128 * 128 * d / (PEAK_TFLOPS * 1e12)  # every program one key block
    return hbm / (steps * step_s) / 1e12


def grid() -> None:
    """The hidden-2048 shape grid (B = 16384 / S), causal, one list against quarter sections."""
    print(f"causal, B = 16384 / S, hidden 2048: TB/s needed at {PEAK_TFLOPS:.0f} TFLOP/s (one list / quarter sections)")
    for d in (64, 128, 256):
        row = []
        for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
            heads, n_m = (16384 // seqlen) * (2048 // d), seqlen // 128
            block_bytes = 2 * 128 * d * 2
            one = simulate(tile_list(heads, n_m, heads, True), block_bytes)
            quarter = simulate(tile_list(heads, n_m, max(PROGRAMS // (4 * n_m), 1), True), block_bytes)
            row.append(f"s{seqlen} {needed_tbps(*one, d):.1f}/{needed_tbps(*quarter, d):.1f}")
        print(f"d{d:<4} " + "  ".join(row))


def main() -> None:
    print(f"{PROGRAMS} programs, L2 {L2_BYTES >> 20} MB (LRU of K+V blocks), BLOCK 128")
    for name, heads, seqlen, d in (("d128 s1024 B8 H16", 128, 1024, 128), ("d128 s1024 B16 H16", 256, 1024, 128),
                                   ("d128 s2048 B4 H16", 64, 2048, 128), ("d128 s4096 B2 H16", 32, 4096, 128),
                                   ("d64 s1024 B16 H32", 512, 1024, 64)):
        n_m = seqlen // 128
        block_bytes = 2 * 128 * d * 2  # K and V of one key block, 16-bit
        kv_bytes = heads * n_m * block_bytes
        kv_heads = max((24 << 20) // (4 * d) // seqlen, 1)  # forward_ws.KV_L2_BYTES' sections, unmasked
        quarter = max(PROGRAMS // (4 * n_m), 1)  # PERSISTENT=2 (forward_ws._decode)
        rows = [("full, L2 sections", tile_list(heads, n_m, min(kv_heads, heads), False)),
                ("causal, one list", tile_list(heads, n_m, heads, True)),
                (f"causal, sections of {min(kv_heads, heads)}", tile_list(heads, n_m, min(kv_heads, heads), True)),
                (f"causal, quarter sections ({quarter})", tile_list(heads, n_m, quarter, True))]
        for label, tiles in rows:
            hbm, steps = simulate(tiles, block_bytes)
            print(f"{name:20} {label:32} HBM {hbm / 2**20:7.0f} MB ({hbm / kv_bytes:4.2f}x K+V), {steps} steps, "
                  f"{needed_tbps(hbm, steps, d):.1f} TB/s needed")
    grid()


if __name__ == "__main__":
    main()
