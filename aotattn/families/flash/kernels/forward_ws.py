"""The warp-specialized forward for Hopper (sm_90), written in Gluon.

Same math, masks, outputs and log-sum-exp as :mod:`.forward` (read its docstring first);
a narrower functional space: fp16/bf16, unpadded head dims 64-256, no varlen, dropout
or bias (``rules.ATTN_FWD_WS``); the ``flash.forward`` table chooses it per cell.

Triton 3.6 does not warp-specialize on sm_90 (RESULTS.md, fourth session), so this
kernel spells out what FlashAttention-3 describes, in Gluon (Triton's tile language
with explicit layouts, shared memory, barriers and warp partitions):

- One program owns ``BLOCK_M`` query rows of one head: ``BLOCK_M // 64`` *consumer*
  warpgroups of 64 rows each, plus one *loader* warp.
- The loader streams K and V tiles through the bulk tensor copy engine (TMA) into a
  ``STAGES``-deep ring of shared-memory slots. Each slot has a ready barrier (the copy
  engine completes it) and an empty barrier (every consumer arrives once it is done
  with the tile); K and V have separate rings, so K of the next block can land while
  V of the current one is still being read.
- Each consumer keeps its rows' output accumulator in registers and runs the online
  softmax with the two products issued asynchronously (``wgmma``), one block apart:
  the scores of block j+1 and the ``P V`` product of block j are in flight on the
  tensor cores while the warps compute block j+1's exponentials (intra-warpgroup
  overlap). P goes to the second product from registers, never through shared memory.
- ``PINGPONG``: the consumers take turns issuing their products (a ring of barriers),
  so one warpgroup's softmax runs while the other's products occupy the tensor cores.
- The softmax scale is folded into the exponent: ``p = exp2(s * qk_scale - m)`` is one
  FMA per score; the running max ``m`` is kept in the scaled log2 domain.

Blocks outside a causal or windowed program's key range are never loaded; blocks on its
edges are masked, the interior is not (the ranges of :func:`.common.key_blocks`,
computed over the whole program's rows). Under a mask programs start costliest first
(:func:`.common.program_order` on the one-tile grid).

``PERSISTENT`` (1 or 2): a grid of at most one program per SM (planning.forward_plan), each taking
one *tile* (one ``BLOCK_M`` block of one head of one sequence) per round of ``programs``
tiles, the rounds dealt back and forth over the programs, of a list
in sections of heads whose K and V fit in L2 together, each section's tiles query
blocks slowest (under a mask one section, costliest first, so the short causal tiles
fill the end of the run instead of a tail wave of idle SMs; with ``PERSISTENT=2`` and
short sequences, sections of a few heads, costliest first inside each, whose K and V stay
in L2 while every query block of the section reads them). The
rings' and barriers' phases run on across tiles, and the loader brings a tile's Q
as soon as the consumers have computed the last scores of the tile before (a
``q_empty`` barrier), overlapping its last ``P V`` product and epilogue. Without it
the grid is (m blocks, Hq, B) and each program runs the one tile it names.

``Q_SLOTS`` (2: with PERSISTENT): each consumer has two Q slots, alternate tiles take
alternate slots, so the loader brings tile r+1's Q as soon as it has issued tile r's K/V
loads, a whole tile ahead, instead of after tile r's last scores. Tiles of few key blocks
(small-key or short forwards) otherwise start by waiting for their Q. It costs a second
``BLOCK_M x D`` tile of shared memory.

``TMA_STORE`` (1): a consumer writes its output rows into a shared staging tile and one
bulk tensor copy stores them, asynchronously (the next tile's wait for the copy comes a
whole tile later), instead of 4-byte stores from the accumulator's registers (32 a thread
at d128). The staging costs a ``BLOCK_M x D`` tile of shared memory.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from aotattn.families.flash.kernels.common import key_blocks, program_order

# The MASK axis (aotattn.families.flash.rules), as in .common.
MASK_NONE: gl.constexpr = gl.constexpr(0)
MASK_BOTTOM_RIGHT: gl.constexpr = gl.constexpr(2)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)
WARPGROUP_ROWS: gl.constexpr = gl.constexpr(64)  # rows of one consumer: wgmma's M per warpgroup
# Register budgets (setmaxnreg) of the partitions: the loader needs few, the consumers
# share the rest of the 64K-register file (2 consumers: 240 each; 3: 160 each).
LOADER_REGS: gl.constexpr = gl.constexpr(24)
# PERSISTENT: the K and V bytes of the heads whose tiles run at once, to be read from L2
# (about half of the H100's and H200's 50 MB). The first persistent order (every head's
# first query blocks before any head's second) had ~64 heads' K and V (128 MB) in flight
# at d128 s4096 and ran 5% slower than the one-tile grid, whose program order keeps ~4
# heads in flight (RESULTS.md, seventeenth and twentieth sessions).
KV_L2_BYTES: gl.constexpr = gl.constexpr(24 * 1024 * 1024)


@gluon.constexpr_function
def consumer_regs(consumers):
    return 240 if consumers == 2 else 160


@gluon.jit
def program_tiles(n_tiles, PERSISTENT: gl.constexpr):
    """How many tiles the program runs: one per round of ``programs`` tiles of the list
    while it lasts (PERSISTENT), else the one its program ids name."""
    if PERSISTENT:
        rounds = n_tiles // gl.num_programs(0)
        return rounds + (round_tile(rounds, PERSISTENT) < n_tiles).to(gl.int32)
    else:
        return 1


@gluon.jit
def round_tile(r, PERSISTENT: gl.constexpr):
    """The program's tile of round r, in the list of :func:`_decode`: rounds go over the
    programs back and forth (program p takes p, then 2 programs - 1 - p, ...), so under a
    mask, whose list runs costliest first, every program's tiles add up alike (a plain
    round robin gives the first programs the heaviest tile of every round; back and
    forth ran d128/d256 s4096 causal 1.10x faster than one tile per program on the H200,
    benchmarks/persistent_schedule_model.py models both)."""
    if PERSISTENT:
        p = gl.program_id(0)
        programs = gl.num_programs(0)
        return r * programs + p + (r % 2) * (programs - 1 - 2 * p)
    else:
        return 0


@gluon.jit
def _decode(t, n_m, batch, heads_q, group_size, seqlen_q, seqlen_k, window_left, window_right, MASK: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, PERSISTENT: gl.constexpr):
    """The tile: (z, h, hk, m0, lo, a, b, n_blocks, diag). Without PERSISTENT the program
    ids name it (grid (m blocks, Hq, B)), under a mask through :func:`.common.program_order`
    (heads in groups, rank by rank: the costliest blocks of a group's heads start together,
    instead of each head's costliest after the previous head's cheapest; 1.06-1.13x at d128
    s8192 causal on an H100, forty-sixth session); with it, tile t of the list: query block slowest,
    then (sequence, head); without a mask the pairs in sections whose K and V fit in L2
    together (KV_L2_BYTES; whole groups of query heads sharing a key head), a section
    after another. Under a mask the last query block, the costliest, first, over all the
    heads: sections would deal each program about one tile of a section, a heavy one to
    some and a light one to others (0.55x the one-tile grid at d256 s16384 causal); with
    PERSISTENT=2, where a round holds 8 query blocks or more (short sequences), sections of
    a few heads, costliest first inside each."""
    if PERSISTENT:
        heads = batch * heads_q
        if MASK == MASK_NONE:
            kv_heads = gl.maximum((KV_L2_BYTES // (4 * BLOCK_D)) // gl.maximum(seqlen_k, 1), 1)
            width = gl.minimum(kv_heads, heads // group_size) * group_size
        elif PERSISTENT == 2 and n_m * 8 <= gl.num_programs(0):
            # short tiles: sections of a few whole groups, each a quarter of a round or less, to
            # keep the K and V in flight in L2; one list puts a round's tiles on ~programs heads
            # (d128 s1024 causal: 66 MB of K and V, read again by every query block; the causal
            # forward took as long as the full one, H100 2026-12-05). Sections this small still
            # balance (benchmarks/persistent_schedule_model.py); the one list read K and V up to 4x
            # from HBM (benchmarks/l2_traffic_model.py). d128 s1024 B16 H16 causal on an H200: 1.22x
            # (forty-sixth session; d64 0.93x: the tuner chooses per cell).
            width = gl.maximum(gl.num_programs(0) // (4 * n_m) // group_size, 1) * group_size
        else:  # one section: a static round robin over costliest-first tiles stays balanced
            width = heads
        first = (t // (width * n_m)) * width
        width = gl.minimum(width, heads - first)  # the last section may be narrower
        r = t - first * n_m
        pid_m = r // width
        zh = first + r - pid_m * width
    else:  # under a mask, heads in groups, every head's costliest block before any's next
        kv_bytes = gl.maximum(seqlen_k, 1).to(gl.int64) * (4 * BLOCK_D) // group_size
        pid_m, h, z = program_order(kv_bytes, MASK)
        zh = z * heads_q + h
    if MASK != MASK_NONE:
        pid_m = n_m - 1 - pid_m
    z = zh // heads_q
    h = zh - z * heads_q
    hk = h // group_size
    m0 = pid_m * BLOCK_M
    if MASK == MASK_BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = 0
    lo, a, b, hi = key_blocks(m0, gl.minimum(m0 + BLOCK_M, seqlen_q), seqlen_k, diag, window_left, window_right,
                              MASK, BLOCK_N)
    n_blocks = gl.maximum((hi - lo + BLOCK_N - 1) // BLOCK_N, 1)
    return z, h, hk, m0, lo, a, b, n_blocks, diag


@gluon.jit
def head_columns(head_dim, head_dim_v, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, PAD_HEAD: gl.constexpr):
    """The columns of the Q/K and V descriptors. Padded heads (rows of 16 bytes, the aligned8
    variant): the real head dims, so the bulk copies fill the bucket's columns past them with
    zeros, adding nothing to any product; unpadded: the buckets."""
    if PAD_HEAD:
        return head_dim, head_dim_v
    else:
        return BLOCK_D, BLOCK_DV


@gluon.jit
def heads_descriptor(base, batch, heads, rows, cols, stride_z, stride_h, stride_row, BLOCK_ROWS: gl.constexpr,
                     BLOCK_COLS: gl.constexpr, layout: gl.constexpr):
    """A [sequence, head, row, column] tensor descriptor of a (B, S, H, D)-strided tensor whose
    tiles are BLOCK_ROWS x BLOCK_COLS of one head: rows past ``rows`` and columns past
    ``cols`` read as zeros (and are dropped by a store or reduce)."""
    return tma.make_tensor_descriptor(base, shape=[batch, heads, rows, cols],
                                      strides=[stride_z, stride_h, stride_row, 1],
                                      block_shape=[1, 1, BLOCK_ROWS, BLOCK_COLS], layout=layout)


@gluon.jit
def _loader(loads, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
            STAGES: gl.constexpr, MASK: gl.constexpr, PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr):
    """The loader warp: per tile, each consumer's Q (into the tile's Q slot, once the
    consumer is done with the tile that last used it), then K and V of every key block into
    the rings (counters run across tiles)."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, n_m,
     batch, heads_q, group_size, seqlen_q, seqlen_k, window_left, window_right) = loads
    it = 0
    k = 0
    for r in range(0, program_tiles(n_m * batch * heads_q, PERSISTENT)):
        t = round_tile(r, PERSISTENT)
        z, h, hk, m0, lo, a, b, n_blocks, diag = _decode(t, n_m, batch, heads_q, group_size, seqlen_q, seqlen_k,
                                                         window_left, window_right, MASK, BLOCK_M, BLOCK_N, BLOCK_D,
                                                         PERSISTENT)
        for c in gl.static_range(CONSUMERS):
            qi = (k % Q_SLOTS) * CONSUMERS + c
            mbarrier.wait(q_empty.index(qi), ((k // Q_SLOTS) & 1) ^ 1)
            mbarrier.expect(q_bar.index(qi), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [z, h, m0 + c * WARPGROUP_ROWS, 0], q_bar.index(qi),
                                            q_smem.index(qi))
        for i in range(n_blocks):
            slot = it % STAGES
            free = ((it // STAGES) & 1) ^ 1  # a fresh barrier passes the wait on parity 1
            start_n = lo + i * BLOCK_N
            mbarrier.wait(k_empty.index(slot), free)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [z, hk, start_n, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), free)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [z, hk, start_n, 0], v_ready.index(slot), v_smem.index(slot))
            it += 1
        k += 1


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, start_n, rows, seqlen_k, diag, window_left, window_right, MASKED: gl.constexpr,
             MASK: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """One key block's online-softmax step on the raw scores ``s``: (p, m, l, alpha), with
    m in the scaled log2 domain.

    Unmasked blocks fold the scale into the exponent, one FMA per score: the row max of
    ``s * qk_scale`` is the scale times the raw max, or the raw min when the scale is
    negative (a uniform branch). MASKED blocks (the window's edges, the sequence's end)
    scale first and then set invisible scores to -inf (-inf times a negative scale would
    be +inf); a row with no visible key so far keeps m = -inf and shifts by 0."""
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = cols[None, :] < seqlen_k
        if MASK != MASK_NONE:
            rel = cols[None, :] - (rows[:, None] + diag)
            keep = keep & (rel >= -window_left) & (rel <= window_right)
        s = gl.where(keep, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_use[:, None])
    else:
        if qk_scale >= 0:
            top = gl.max(s, axis=1)
        else:
            top = gl.min(s, axis=1)
        m_new = gl.maximum(m_i, top * qk_scale)
        m_use = m_new
        p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _turn(turn, c: gl.constexpr, t, PINGPONG: gl.constexpr):
    """Ping-pong: consumer c issues its products at step t once the consumer before it
    in the ring has issued its own (consumer 0's first turn is free)."""
    if PINGPONG:
        if c == 0:
            mbarrier.wait(turn.index(c), (t & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(c), t & 1)


@gluon.jit
def _pass_turn(turn, c: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((c + 1) % CONSUMERS), count=1)


@gluon.jit
def _consumer(c: gl.constexpr, work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr,
              PERSISTENT: gl.constexpr, PAD_HEAD: gl.constexpr, Q_SLOTS: gl.constexpr, TMA_STORE: gl.constexpr):
    """Consumer warpgroup c: rows m0 + 64 c .. m0 + 64 c + 63 of every tile of the program."""
    (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn, Out, Lse, stride_oz,
     stride_oh, stride_om, stride_lz, stride_lh, n_m, batch, heads_q, group_size, seqlen_q, seqlen_k, window_left,
     window_right, qk_scale, head_dim_v, o_desc, o_smem) = work
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    no_scores = gl.zeros([WARPGROUP_ROWS, BLOCK_N], gl.float32, s_layout)
    count = program_tiles(n_m * batch * heads_q, PERSISTENT)
    it = 0  # key blocks consumed so far (the rings' position)
    tt = 0  # ping-pong turns taken so far
    k = 0  # tiles done (q_bar's phase)
    for r in range(0, count):
        t = round_tile(r, PERSISTENT)
        z, h, hk, m0, lo, a, b, n_blocks, diag = _decode(t, n_m, batch, heads_q, group_size, seqlen_q, seqlen_k,
                                                         window_left, window_right, MASK, BLOCK_M, BLOCK_N, HEAD_D,
                                                         PERSISTENT)
        first_row = m0 + c * WARPGROUP_ROWS
        rows = first_row + gl.arange(0, WARPGROUP_ROWS, layout=row_s)
        m_i = gl.full([WARPGROUP_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.full([WARPGROUP_ROWS], 0.0, gl.float32, row_s)
        acc = gl.zeros([WARPGROUP_ROWS, HEAD_D], gl.float32, o_layout)
        qi = (k % Q_SLOTS) * CONSUMERS + c
        q = q_smem.index(qi).reshape([WARPGROUP_ROWS, HEAD_D])
        mbarrier.wait(q_bar.index(qi), (k // Q_SLOTS) & 1)

        # block 0: its scores and softmax; its P V product is issued beside block 1's scores
        slot0 = it % STAGES
        mbarrier.wait(k_ready.index(slot0), (it // STAGES) & 1)
        _turn(turn, c, tt, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(slot0).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), no_scores,
                          use_acc=False, is_async=True)
        _pass_turn(turn, c, PINGPONG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot0), count=1)
        if lo < a or lo >= b:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, lo, rows, seqlen_k, diag, window_left,
                                          window_right, True, MASK, BLOCK_N, s_layout)
        else:
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, lo, rows, seqlen_k, diag, window_left,
                                          window_right, False, MASK, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, n_blocks):
            g = it + i
            start_n = lo + i * BLOCK_N
            slot = g % STAGES
            prev = (g - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
            _turn(turn, c, tt + i, PINGPONG)
            s = warpgroup_mma(q, k_smem.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), no_scores,
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
            _pass_turn(turn, c, PINGPONG, CONSUMERS)
            s = warpgroup_mma_wait(1, deps=(s, ))  # the scores were issued first: done with one product in flight
            mbarrier.arrive(k_empty.index(slot), count=1)
            if start_n < a or start_n >= b:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, start_n, rows, seqlen_k, diag, window_left,
                                              window_right, True, MASK, BLOCK_N, s_layout)
            else:
                p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, start_n, rows, seqlen_k, diag, window_left,
                                              window_right, False, MASK, BLOCK_N, s_layout)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(v_empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        # every score of the tile is computed: the loader may bring the next tile's Q
        mbarrier.arrive(q_empty.index(qi), count=1)
        g = it + n_blocks - 1
        last = g % STAGES
        mbarrier.wait(v_ready.index(last), (g // STAGES) & 1)
        _turn(turn, c, tt + n_blocks, PINGPONG)
        acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        _pass_turn(turn, c, PINGPONG, CONSUMERS)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(last), count=1)

        # rows that saw no key: l = 0, acc = 0 -> output 0, lse +inf
        empty = l_i == 0.0
        inv_l = 1.0 / gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
        out = acc * gl.convert_layout(inv_l, row_o)[:, None]
        if TMA_STORE:  # staged, then one bulk copy: rows past the sequence, columns past the head dim dropped
            o_tile = o_smem.index(c)
            tma.store_wait(0)  # the last tile's copy has read the staging tile (a whole tile ago)
            o_tile.store(gl.reshape(out.to(dtype), [1, 1, WARPGROUP_ROWS, HEAD_D]))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [z, h, first_row, 0], o_tile)
        else:
            out_rows = first_row + gl.arange(0, WARPGROUP_ROWS, layout=row_o)
            cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
            out_ptr = Out + z.to(gl.int64) * stride_oz + h.to(gl.int64) * stride_oh
            keep = out_rows[:, None] < seqlen_q
            if PAD_HEAD:  # the bucket's columns past the head dim are not the output's
                keep = keep & (cols[None, :] < head_dim_v)
            gl.store(out_ptr + out_rows[:, None].to(gl.int64) * stride_om + cols[None, :], out.to(dtype), mask=keep)
        lse_ptr = Lse + z.to(gl.int64) * stride_lz + h.to(gl.int64) * stride_lh
        gl.store(lse_ptr + rows, lse, mask=rows < seqlen_q)
        it += n_blocks
        tt += n_blocks + 1
        k += 1
    if TMA_STORE:  # the shared memory outlives the last copy's read of it
        tma.store_wait(0)


# warp_specialize takes one function per partition: the consumers differ only in c
@gluon.jit
def _consumer0(work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
               PAD_HEAD: gl.constexpr, Q_SLOTS: gl.constexpr, TMA_STORE: gl.constexpr):
    _consumer(0, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
              TMA_STORE)


@gluon.jit
def _consumer1(work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
               PAD_HEAD: gl.constexpr, Q_SLOTS: gl.constexpr, TMA_STORE: gl.constexpr):
    _consumer(1, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
              TMA_STORE)


@gluon.jit
def _consumer2(work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
               PAD_HEAD: gl.constexpr, Q_SLOTS: gl.constexpr, TMA_STORE: gl.constexpr):
    _consumer(2, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
              TMA_STORE)


@gluon.jit
def attn_fwd_ws(
    Q, K, V, Out, Lse,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    max_seqlen_q, max_seqlen_k, batch, num_heads_q, group_size, qk_scale, window_left, window_right, head_dim,
    head_dim_v, MASK: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, PAD_HEAD: gl.constexpr,
    VARLEN: gl.constexpr, DROPOUT: gl.constexpr, BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    PERSISTENT: gl.constexpr, Q_SLOTS: gl.constexpr, TMA_STORE: gl.constexpr,
):
    """Tiles of BLOCK_M query rows (BLOCK_M // 64 consumer warpgroups) of one query head:
    one per program on a grid (m blocks, Hq, B), or with PERSISTENT every programs-th
    tile on a grid (programs,). Compiled with num_warps=4 (the first consumer, the default
    partition) and grows to 4 per consumer plus the loader's. The functional axes it does
    not serve (rules._ws_unserved) are fixed."""
    gl.static_assert(BLOCK_DV == BLOCK_D and not VARLEN and not DROPOUT and BIAS == 0,
                     "attn_fwd_ws: one head-dim bucket, no varlen, dropout or bias")
    CONSUMERS: gl.constexpr = BLOCK_M // WARPGROUP_ROWS
    seqlen_q = max_seqlen_q
    seqlen_k = max_seqlen_k
    n_m = (seqlen_q + BLOCK_M - 1) // BLOCK_M

    dtype: gl.constexpr = Q.dtype.element_ty
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, WARPGROUP_ROWS, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, BLOCK_D], dtype)
    # [batch, head, row, column]: rows past a sequence arrive as zeros (their scores are
    # masked or their rows not stored), and so do the columns past a padded head dim (the
    # output's are zeros, which the store drops)
    cols_qk, cols_v = head_columns(head_dim, head_dim_v, BLOCK_D, BLOCK_DV, PAD_HEAD)
    q_desc = heads_descriptor(Q, batch, num_heads_q, gl.maximum(seqlen_q, 1), cols_qk, stride_qz, stride_qh,
                              stride_qm, WARPGROUP_ROWS, BLOCK_D, q_layout)
    keys = gl.maximum(seqlen_k, 1)  # a descriptor's dims are positive (no key: one zero row, masked)
    num_heads_k = num_heads_q // group_size
    k_desc = heads_descriptor(K, batch, num_heads_k, keys, cols_qk, stride_kz, stride_kh, stride_kn, BLOCK_N, BLOCK_D,
                              kv_layout)
    v_desc = heads_descriptor(V, batch, num_heads_k, keys, cols_v, stride_vz, stride_vh, stride_vn, BLOCK_N, BLOCK_D,
                              kv_layout)

    q_smem = gl.allocate_shared_memory(dtype, [Q_SLOTS * CONSUMERS, 1, 1, WARPGROUP_ROWS, BLOCK_D], q_layout)
    if TMA_STORE:  # the output's descriptor (made on the device: only where used) and staging tiles
        o_desc = heads_descriptor(Out, batch, num_heads_q, gl.maximum(seqlen_q, 1), cols_v, stride_oz, stride_oh,
                                  stride_om, WARPGROUP_ROWS, BLOCK_DV, q_layout)
        o_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 1, 1, WARPGROUP_ROWS, BLOCK_DV], q_layout)
    else:
        o_desc = Out
        o_smem = q_smem
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_SLOTS * CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS * CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(c), count=1)
    for qi in gl.static_range(Q_SLOTS * CONSUMERS):
        mbarrier.init(q_bar.index(qi), count=1)
        mbarrier.init(q_empty.index(qi), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(k_empty.index(slot), count=CONSUMERS)
        mbarrier.init(v_empty.index(slot), count=CONSUMERS)
    fence_async_shared()

    work = (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn, Out, Lse, stride_oz,
            stride_oh, stride_om, stride_lz, stride_lh, n_m, batch, num_heads_q, group_size, seqlen_q, seqlen_k,
            window_left, window_right, qk_scale, head_dim_v, o_desc, o_smem)
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, n_m,
             batch, num_heads_q, group_size, seqlen_q, seqlen_k, window_left, window_right)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer0, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
                          TMA_STORE)),
            (_consumer1, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
                          TMA_STORE)),
            (_loader, (loads, CONSUMERS, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, MASK, PERSISTENT, Q_SLOTS)),
        ], [4, 1], [consumer_regs(CONSUMERS), LOADER_REGS])
    else:
        gl.static_assert(CONSUMERS == 3, "BLOCK_M is 128 or 192: two or three consumer warpgroups")
        gl.warp_specialize([
            (_consumer0, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
                          TMA_STORE)),
            (_consumer1, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
                          TMA_STORE)),
            (_consumer2, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, PINGPONG, CONSUMERS, PERSISTENT, PAD_HEAD, Q_SLOTS,
                          TMA_STORE)),
            (_loader, (loads, CONSUMERS, BLOCK_M, BLOCK_N, BLOCK_D, STAGES, MASK, PERSISTENT, Q_SLOTS)),
        ], [4, 4, 1], [consumer_regs(CONSUMERS), consumer_regs(CONSUMERS), LOADER_REGS])
