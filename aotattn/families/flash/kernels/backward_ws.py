"""The warp-specialized backward for Hopper (sm_90), written in Gluon: dK, dV and dQ in one
launch, five products per block instead of the split backend's seven.

Same math, masks and gradients as :mod:`.backward` (read its docstring first); a narrower
functional space (rules.ws_backward_serves: fp16/bf16, head-dim buckets 64, 128 and 256,
padded heads included, no varlen, dropout or bias; dQ accumulated with atomics, so not
deterministic). The stats (delta and lse in base 2, :func:`.backward.attn_bwd_preprocess`)
are computed before it, and dQ is added, unscaled (dS K), into a zeroed fp32 buffer shaped
like q (:func:`..planning.finish_dq` scales and converts it: GPU float atomics flush the
subnormal sums a tiny softmax scale makes to zero, docs/numerical-lessons.md lesson 19).

A *tile* is ``BLOCK_N`` keys of one key/value head of one sequence; its program loops over
the query blocks of ``BLOCK_M`` rows that see them, for every query head of the group
(key-major, as the split backend's dK/dV kernel; ``GROUPED=False``, a call with as many
key heads as query heads, is compiled for a group of one). A program runs one tile, or with
``PERSISTENT`` one program per SM walks many (:func:`_key_tile`: the order, and why). A
*loader* warp brings a tile's K and V once (after the consumers are done with the last
tile's: ``kv_empty``), and streams Q (with its rows' delta and lse) and dO through the
bulk tensor copy engine into rings (ready/empty mbarriers) whose positions run on across
tiles. Two *consumer* warpgroups share the work in one of two ways:

- **The key split** (``BLOCK_N=128``, head dims 64 and 128): each consumer owns 64 of the
  keys and keeps their dK and dV in registers. Per query block it issues ``S^T = K Q^T``
  and ``dP^T = V dO^T`` as async wgmma (dP^T's accumulator starts at -delta), computes
  ``P^T`` (the scale folded into one FMA, lse in base 2) and ``dS^T = P^T (dP^T - delta)``,
  and feeds both from registers into ``dV += P^T dO`` and ``dK += dS^T Q`` (keys down, as
  the accumulators are). dQ needs dS with queries down: each consumer writes its dS^T rows
  into a shared tile (double-buffered), the consumers meet on an mbarrier, and each
  computes the dQ columns ``D / 2`` of its share, ``dS K[:, cols]`` over all the keys.
- **The column split** (``BLOCK_N=64``, head dim 256, where 64 keys' dK and dV at every
  column would need all of a warpgroup's registers): each consumer owns half of the
  columns of the keys' dK, dV and of every dQ, and computes S^T and dP^T for half of the
  step's queries. P^T and dS^T meet in shared tiles (double-buffered), from which both
  products of every query are read; dO has one slot (a second does not fit beside the q
  ring at d256) and is released as soon as dV has read it.

Either way dQ leaves through a staging tile per consumer and one bulk tensor reduce
(``cp.reduce.async.bulk .add``: the L2 does the adds, no per-element atomics), issued
asynchronously: its read of the tile is waited for only before the next write to it.
``TMA_STORE``: a tile's dK and dV leave the same way, through that staging tile's bytes
reinterpreted as 64 keys x D 16-bit (the key split) or 64 keys x D / 2 (the column split's
halves; not NARROW's 128 + 64) and bulk tensor stores, instead of 4-byte stores from the
accumulators' registers (64 a thread at d128; on the H100 1.46x at d128 q128-k16384, where a
tile has two steps).

``KV_SLOTS=2`` (persistent programs): K and V in two slots, brought by a second loader warp
(:func:`_kv_loader`) as soon as the tile two before is done, so the next tile's K and V
load during this tile's steps instead of after its last dQ product. Where a tile has few
steps (q128-k16384: two) that load was exposed once a tile. It costs a K and a V tile of
shared memory: at d64 beside every ring, at d128 beside one q/dO slot (``STAGES=1``, whose
slot is addressed anew each step as K and V are), at d256 nowhere.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton._C.libtriton import ir
from triton.language.core import builtin

from aotattn.families.flash.kernels.common import key_blocks, program_order
# the MASK axis, a consumer's 64 rows (here keys), the partitions' register budgets and the
# descriptors' columns: the forward's
from aotattn.families.flash.kernels.forward_ws import (LOADER_REGS, MASK_BOTTOM_RIGHT, MASK_NONE, WARPGROUP_ROWS,
                                                       consumer_regs, head_columns, heads_descriptor, program_tiles,
                                                       round_tile)


# PERSISTENT under a mask: the q and dO bytes of the heads of one section of tiles
# (:func:`_key_tile`), to be read from L2 (about half of the H200's 50 MB)
QDO_L2_BYTES: gl.constexpr = gl.constexpr(24 * 1024 * 1024)


@builtin
def _reduce_add(desc, coord, src, _semantic=None):
    """The shared tile ``src`` added into the tile of ``desc`` at ``coord`` by the bulk tensor
    copy engine (``cp.reduce.async.bulk.tensor ... .add``), asynchronously: ``tma.store_wait``
    waits for its read of ``src``, as for a bulk store. (Gluon 3.6 has the op, not the builtin.)"""
    offsets = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, offsets, src.handle)


@gluon.jit
def _step(i, last_m, group, head0, BLOCK_M: gl.constexpr):
    """Step i of a program's loop: (query head, first row of the query block); ``last_m``:
    the first row of the program's last query block, ``head0``: the group's first query
    head (int32: a bulk copy's coordinates are).

    The query blocks go from the last down, every head of the group at each: the programs
    of a key/value head started together then read the same tile at the same step (a causal
    mask's programs differ in their first block, never in their last), so the L2 holds a
    few tiles of a head's q and dO instead of all of them; from the diagonal up, program j
    would read block j + t at step t, and a group's programs would spread over all of its
    q and dO (16 MB a head at GQA group 8, d128 s4096)."""
    k = i // group
    return head0 + (i - k * group), last_m - k * BLOCK_M


@gluon.jit
def _key_tile(r, sizes, MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PERSISTENT: gl.constexpr):
    """The program's tile of round r: ``BLOCK_N`` keys of one key/value head of one sequence
    and the query blocks that see them, as (z, hk, head0, start_n, a, b, last_m, n_steps,
    tail). Without PERSISTENT the program ids name it (grid (n blocks, Hk, B), renumbered by
    :func:`.common.program_order`); with it, tile t of the list: without a mask the key
    blocks of a head one after another (the programs running together read the same q and
    dO, from L2); under one, in sections of a few heads, the first key block of every head
    of the section first, then the second, ... (the first is the costliest: every query
    block that sees any key sees it); dealt back and forth (:func:`.forward_ws.round_tile`).
    Costliest first over all the heads at once made every tile stream its own head's q and
    dO: d128 q128-k16384 causal 1.37x slower than the unmasked order, dense s4096 causal
    1.14x slower than one tile per program (H200, RESULTS.md, thirty-second session).
    PERSISTENT=2 widens the masked sections to eight rounds without the L2 cap (the model
    benchmarks/persistent_backward_model.py puts it within 0-9% of the ideal where the
    capped sections lose up to 1.3x to the one-tile grid: GQA, long causal); unmasked it
    is PERSISTENT=1. Not yet timed on the GPU when written."""
    n_n, batch, heads_k, group_size, seqlen_q, seqlen_k, diag, window_left, window_right, by_l2 = sizes
    if PERSISTENT:
        t = round_tile(r, PERSISTENT)
        if MASK == MASK_NONE:
            pair = t // n_n
            pid_n = t - pair * n_n
        else:
            pairs = batch * heads_k
            # sections of `width` (sequence, key head) pairs, key block slowest within each.
            # PERSISTENT=1: two rounds of tiles or more (the back-and-forth deal pairs heavy
            # with light), and whose q and dO stay in L2 together (every tile of a pair
            # streams them). PERSISTENT=2: eight rounds, no L2 cap (the tiles of a pair that
            # run together read its q and dO in step, from its last query block down: _step)
            if PERSISTENT == 2:
                width = gl.maximum(gl.minimum((8 * gl.num_programs(0) + n_n - 1) // n_n, pairs), 1)
            else:
                rounds2 = (2 * gl.num_programs(0) + n_n - 1) // n_n
                width = gl.maximum(gl.minimum(gl.minimum(rounds2, by_l2), pairs), 1)
            first = (t // (width * n_n)) * width
            width = gl.minimum(width, pairs - first)  # the last section may be narrower
            rest = t - first * n_n
            pid_n = rest // width
            pair = first + rest - pid_n * width
        z = pair // heads_k
        hk = pair - z * heads_k
    else:
        pid_n, hk, z = program_order(0, MASK)
    start_n = pid_n * BLOCK_N
    # the query blocks that see these keys (the window transposed); [a, b) sees all of them
    lo, a, b, hi = key_blocks(start_n, gl.minimum(start_n + BLOCK_N, seqlen_k), seqlen_q, -diag, window_right,
                              window_left, MASK, BLOCK_M)
    blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
    n_steps = group_size * blocks
    last_m = lo + (blocks - 1) * BLOCK_M
    tail = start_n + BLOCK_N > seqlen_k  # keys past the sequence: masked at every step
    return z, hk, hk * group_size, start_n, a, b, last_m, n_steps, tail


@gluon.jit
def _loader(loads, MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            DO_STAGES: gl.constexpr, PERSISTENT: gl.constexpr, KV_SLOTS: gl.constexpr):
    """The loader warp: per tile, Q (with its rows' delta and lse) and dO of every step into
    the rings (their positions run on across tiles), and with one K/V slot the tile's K and
    V once the consumers are done with the last tile's (after the first step's Q: it does
    not wait on them; with two, :func:`_kv_loader` brings them)."""
    (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, k_smem, v_smem, do_smem, stats_smem, kv_bar, kv_empty,
     q_ready, do_ready, q_empty, do_empty, sizes) = loads
    n_n, batch, heads_k, group, seqlen_q, seqlen_k, diag, window_left, window_right, by_l2 = sizes
    g = 0  # steps of the tiles before (the rings' position)
    kv = 0  # tiles before with a step (the K and V buffer's uses)
    for r in range(0, program_tiles(n_n * heads_k * batch, PERSISTENT)):
        z, hk, head0, start_n, a, b, last_m, n_steps, tail = _key_tile(r, sizes, MASK, BLOCK_M, BLOCK_N, PERSISTENT)
        for i in range(n_steps):
            s = g + i
            slot = s % STAGES
            free = ((s // STAGES) & 1) ^ 1  # a fresh barrier passes the wait on parity 1
            do_slot = s % DO_STAGES
            do_free = ((s // DO_STAGES) & 1) ^ 1
            off_h, start_m = _step(i, last_m, group, head0, BLOCK_M)
            mbarrier.wait(q_empty.index(slot), free)
            mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes + stats_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [z, off_h, start_m, 0], q_ready.index(slot), q_smem.index(slot))
            tma.async_copy_global_to_shared(stats_desc, [z, 0, off_h, start_m], q_ready.index(slot),
                                            stats_smem.index(slot))
            if KV_SLOTS == 1:
                if i == 0:
                    _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_empty, z, hk, start_n, kv, 1)
            mbarrier.wait(do_empty.index(do_slot), do_free)
            mbarrier.expect(do_ready.index(do_slot), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [z, off_h, start_m, 0], do_ready.index(do_slot),
                                            do_smem.index(do_slot))
        g += n_steps
        kv += (n_steps > 0).to(gl.int32)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_empty, z, hk, start_n, kv, KV_SLOTS: gl.constexpr):
    """K and V of the program's kv-th tile with a step into slot ``kv % KV_SLOTS``, once the
    consumers are done with the tile that slot held (``kv_empty``)."""
    slot = kv % KV_SLOTS
    mbarrier.wait(kv_empty.index(slot), ((kv // KV_SLOTS) & 1) ^ 1)  # a fresh barrier passes on parity 1
    ready = kv_bar.index(slot)
    mbarrier.expect(ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [z, hk, start_n, 0], ready, k_smem.index(slot))
    tma.async_copy_global_to_shared(v_desc, [z, hk, start_n, 0], ready, v_smem.index(slot))


@gluon.jit
def _kv_loader(kv_loads, MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               PERSISTENT: gl.constexpr, KV_SLOTS: gl.constexpr):
    """KV_SLOTS=2: a second loader warp bringing each tile's K and V into alternate slots, as
    soon as the consumers are done with the tile two before: the next tile's K and V load
    during this one's steps, where one slot waited for this tile's last dQ product."""
    k_desc, v_desc, k_smem, v_smem, kv_bar, kv_empty, sizes = kv_loads
    n_n, batch, heads_k, group, seqlen_q, seqlen_k, diag, window_left, window_right, by_l2 = sizes
    kv = 0  # tiles before with a step (the slots' uses)
    for r in range(0, program_tiles(n_n * heads_k * batch, PERSISTENT)):
        z, hk, head0, start_n, a, b, last_m, n_steps, tail = _key_tile(r, sizes, MASK, BLOCK_M, BLOCK_N, PERSISTENT)
        if n_steps > 0:
            _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bar, kv_empty, z, hk, start_n, kv, KV_SLOTS)
            kv += 1


@gluon.jit
def _step_zero(i):
    """0, as a value of step i the compiler cannot see through (an opaque ``mov``).

    Indexing the tiles that stay put for the whole loop (K, V, the one dO slot) with it
    makes their wgmma descriptors be computed in each step, in uniform registers, instead
    of hoisted out of the loop: hoisted, the column split's 48 descriptors of them lived
    in vector registers across the step, and one consumer spilled 15-23 of them per step
    (d256 sm_90 SASS, ``benchmarks/sass_loops.py``: step loops 552 and 664 instructions,
    800 under a mask; with this 547 and 552, 635 and 667, no local memory; the key split's
    d128 loops spilled 1-3 a step, now none; tests/compiler/test_machine_code.py)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], gl.int32, is_pure=False, pack=1)


@gluon.jit
def _ring(s, i, STAGES: gl.constexpr):
    """(slot, phase, dS^T buffer) of the rings' step s, which is the tile's step i: the q/dO
    slot (with one slot, addressed anew each step, as K and V: see _step_zero), its
    mbarriers' phase, and the double-buffered dS^T (and P^T) tile."""
    slot = s % STAGES
    if STAGES == 1:
        slot = _step_zero(i)
    return slot, (s // STAGES) & 1, s % 2


@gluon.jit
def _tile_kv(kv_bar, kv, n_steps, KV_SLOTS: gl.constexpr):
    """The K/V slot of a tile that follows ``kv`` tiles with a step, waited for when the
    tile has a step (the loader brings K and V for those alone)."""
    kv_slot = kv % KV_SLOTS
    if n_steps > 0:
        mbarrier.wait(kv_bar.index(kv_slot), (kv // KV_SLOTS) & 1)
    return kv_slot


@gluon.jit
def _tile_done(kv_empty, kv_slot, g, kv, n_steps):
    """After a tile's last step (its last dQ product read K): its K/V slot is released to the
    loader, and the rings' step count and the count of tiles with a step move on."""
    if n_steps > 0:
        mbarrier.arrive(kv_empty.index(kv_slot), count=1)
    return g + n_steps, kv + (n_steps > 0).to(gl.int32)


@gluon.jit
def _step_probabilities(s_t, lse2, keys, rows, qk_scale, seqlen_k, diag, window_left, window_right, masked,
                        MASK: gl.constexpr):
    """:func:`_probabilities` with the mask applied where the step needs it (``masked``: the
    tile's key tail, or queries outside the rows every key of the tile sees)."""
    if masked:
        p_t = _probabilities(s_t, lse2, keys, rows, qk_scale, seqlen_k, diag, window_left, window_right, True, MASK)
    else:
        p_t = _probabilities(s_t, lse2, keys, rows, qk_scale, seqlen_k, diag, window_left, window_right, False, MASK)
    return p_t


@gluon.jit
def _probabilities(s_t, lse2, keys, rows, qk_scale, seqlen_k, diag, window_left, window_right,
                   MASKED: gl.constexpr, MASK: gl.constexpr):
    """P^T of one step from the raw scores (keys down, queries across); MASKED: keys past
    the sequence and outside the window are 0."""
    p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:
        keep = keys[:, None] < seqlen_k
        if MASK != MASK_NONE:
            rel = keys[:, None] - (rows[None, :] + diag)
            keep = keep & (rel >= -window_left) & (rel <= window_right)
        p_t = gl.where(keep, p_t, 0.0)
    return p_t


@gluon.jit
def _store_key_grads(dk, dv, out_rows, cols, key_grads, z, hk, sm_scale, seqlen_k, head_dim, head_dim_v,
                     dtype: gl.constexpr, PAD_HEAD: gl.constexpr):
    """A consumer's dK (scaled) and dV of key head hk of sequence z at rows ``out_rows``
    (keys) and columns ``cols``: keys past the sequence and, for padded heads, the columns
    past the head dims (zeros read through the descriptors) are not stored."""
    DK, DV, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, _, _, _ = key_grads
    dk_ptr = DK + z.to(gl.int64) * stride_dkz + hk.to(gl.int64) * stride_dkh
    dv_ptr = DV + z.to(gl.int64) * stride_dvz + hk.to(gl.int64) * stride_dvh
    keep_k = out_rows[:, None] < seqlen_k
    keep_v = keep_k
    if PAD_HEAD:
        keep_k = keep_k & (cols[None, :] < head_dim)
        keep_v = keep_v & (cols[None, :] < head_dim_v)
    gl.store(dk_ptr + out_rows[:, None].to(gl.int64) * stride_dkn + cols[None, :], (dk * sm_scale).to(dtype),
             mask=keep_k)
    gl.store(dv_ptr + out_rows[:, None].to(gl.int64) * stride_dvn + cols[None, :], dv.to(dtype), mask=keep_v)


@gluon.jit
def _copy_key_grads(dk, dv, c: gl.constexpr, key_grads, z, hk, first_key, col0, sm_scale, dtype: gl.constexpr,
                    COLS: gl.constexpr, SLOTS: gl.constexpr):
    """TMA_STORE: a consumer's dK (scaled) and dV, 64 keys x COLS columns from col0 (every
    column in the key split, its half in the column split), through shared staging tiles and
    bulk tensor stores (keys past the sequence and columns past padded head dims dropped by
    the descriptors). The staging tiles are the consumer's dQ staging tile, reinterpreted:
    ``SLOTS`` tiles of 64 keys x COLS (1 at BLOCK_M=64: dV waits for dK's copy to read it; 2
    at 128). The next write of dQ's staging tile waits for these copies as for a reduce."""
    _, _, _, _, _, _, _, _, dk_desc, dv_desc, kg_smem = key_grads
    tma.store_wait(0)  # the tile's last dQ reduce has read the staging tile
    dk_tile = kg_smem.index(c * SLOTS)
    dk_tile.store(gl.reshape((dk * sm_scale).to(dtype), [1, 1, WARPGROUP_ROWS, COLS]))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [z, hk, first_key, col0], dk_tile)
    if SLOTS == 1:
        tma.store_wait(0)
    dv_tile = kg_smem.index(c * SLOTS + SLOTS - 1)
    dv_tile.store(gl.reshape(dv.to(dtype), [1, 1, WARPGROUP_ROWS, COLS]))
    fence_async_shared()
    tma.async_copy_shared_to_global(dv_desc, [z, hk, first_key, col0], dv_tile)


@gluon.jit
def _keys_consumer(c: gl.constexpr, work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PAD_HEAD: gl.constexpr,
                   PERSISTENT: gl.constexpr, TMA_STORE: gl.constexpr, KV_SLOTS: gl.constexpr):
    """Consumer warpgroup c of 128-key tiles: keys start_n + 64 c .. start_n + 64 c + 63 of
    every tile of the program."""
    (q_smem, k_smem, v_smem, do_smem, stats_smem, pt_smem, ds_smem, dq_smem, kv_bar, kv_empty, q_ready, do_ready,
     q_empty, do_empty, ds_ready, dq_desc, key_grads, sizes, qk_scale, sm_scale, head_dim, head_dim_v) = work
    n_n, batch, heads_k, group, seqlen_q, seqlen_k, diag, window_left, window_right, by_l2 = sizes
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    DQ_COLS: gl.constexpr = HEAD_D // CONSUMERS
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    # the stats ring as rows of BLOCK_M floats: (slot, plane) -> 2 slot + plane
    stats_rows = stats_smem._reinterpret(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    dq_tile = dq_smem.index(c)
    no_scores = gl.zeros([WARPGROUP_ROWS, BLOCK_M], gl.float32, s_layout)
    no_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    offs_m = gl.arange(0, BLOCK_M, layout=row_layout)
    g = 0  # steps of the tiles before (the rings' position)
    kv = 0  # tiles before with a step (the K/V slot and its kv_bar's phase)
    for r in range(0, program_tiles(n_n * heads_k * batch, PERSISTENT)):
        z, hk, head0, start_n, a, b, last_m, n_steps, tail = _key_tile(r, sizes, MASK, BLOCK_M, BLOCK_N, PERSISTENT)
        first_key = start_n + c * WARPGROUP_ROWS
        keys = first_key + gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([WARPGROUP_ROWS, HEAD_D], gl.float32, acc_layout)
        dv = gl.zeros([WARPGROUP_ROWS, HEAD_D], gl.float32, acc_layout)
        kv_slot = _tile_kv(kv_bar, kv, n_steps, KV_SLOTS)
        for i in range(n_steps):
            s = g + i
            slot, phase, buf = _ring(s, i, STAGES)
            off_h, start_m = _step(i, last_m, group, head0, BLOCK_M)
            rows = start_m + offs_m
            q_tile = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
            do_tile = do_smem.index(slot).reshape([BLOCK_M, HEAD_D])
            kv_step = kv_slot + _step_zero(i)  # K and V addressed anew each step
            k_step = k_smem.index(kv_step).reshape([BLOCK_N, HEAD_D])
            k_mine = k_step.slice(c * WARPGROUP_ROWS, WARPGROUP_ROWS, dim=0)
            v_mine = v_smem.index(kv_step).reshape([BLOCK_N, HEAD_D]).slice(c * WARPGROUP_ROWS, WARPGROUP_ROWS, dim=0)
            mbarrier.wait(q_ready.index(slot), phase)
            s_t = warpgroup_mma(k_mine, q_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)
            delta = stats_rows.index(2 * slot).load(row_layout)
            mbarrier.wait(do_ready.index(slot), phase)
            # dP^T - delta: the product accumulates onto -delta (delta's registers die before it runs)
            dp_t = warpgroup_mma(v_mine, do_tile.permute((1, 0)), no_scores - delta[None, :], is_async=True)
            lse2 = stats_rows.index(2 * slot + 1).load(row_layout)
            s_t = warpgroup_mma_wait(1, deps=(s_t, ))
            p_t = _step_probabilities(s_t, lse2, keys, rows, qk_scale, seqlen_k, diag, window_left, window_right,
                                      tail or start_m < a or start_m >= b, MASK)
            p_op = gl.convert_layout(p_t.to(dtype), op_layout)
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            dp_t = warpgroup_mma_wait(1, deps=(dp_t, ))
            ds_t = (p_t * dp_t).to(dtype)
            ds_op = gl.convert_layout(ds_t, op_layout)
            dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
            # dS^T rows of this consumer into the shared tile; the other consumers' rows and
            # this one's meet on ds_ready (the tile two steps back was read before any consumer
            # arrived on the last one: double-buffered without an empty barrier)
            ds_tile = ds_smem.index(buf)
            ds_tile.slice(c * WARPGROUP_ROWS, WARPGROUP_ROWS, dim=0).store(ds_t)
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op))
            mbarrier.arrive(q_empty.index(slot), count=1)
            mbarrier.arrive(do_empty.index(slot), count=1)
            mbarrier.wait(ds_ready.index(buf), (s // 2) & 1)
            k_cols = k_step.slice(c * DQ_COLS, DQ_COLS, dim=1)  # dQ's columns of this consumer, every key
            dq = warpgroup_mma(ds_tile.permute((1, 0)), k_cols, no_dq, use_acc=False)
            # the last step's reduce has read the staging tile by now (a whole step ago): rarely a wait
            tma.store_wait(0)
            dq_tile.store(gl.reshape(dq, [1, 1, BLOCK_M, DQ_COLS]))
            fence_async_shared()
            _reduce_add(dq_desc, [z, off_h, start_m, c * DQ_COLS], dq_tile)
        g, kv = _tile_done(kv_empty, kv_slot, g, kv, n_steps)
        if TMA_STORE:
            _copy_key_grads(dk, dv, c, key_grads, z, hk, first_key, 0, sm_scale, dtype, HEAD_D,
                            BLOCK_M // WARPGROUP_ROWS)
        else:
            out_rows = first_key + gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(1, acc_layout))
            cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout))
            _store_key_grads(dk, dv, out_rows, cols, key_grads, z, hk, sm_scale, seqlen_k, head_dim, head_dim_v,
                             dtype, PAD_HEAD)
    tma.store_wait(0)


# NARROW: padded heads of at most NARROW_D columns (d160, d192 in the d256 bucket) are split
# 128 + 64: the products over the head dim (S^T, dP^T) stop at NARROW_D, consumer 0 keeps
# dK and dV of columns 0-127 and computes dQ's 0-63, consumer 1 dK and dV of 128-191 and
# dQ's 64-191. A consumer's products per step, in units of 64 keys x BLOCK_M queries x 64
# columns: the halves of 256, 4 (S^T, dP^T) + 4 (dK, dV) + 2 (dQ) = 10 each; the 128 + 64
# split, 3 + 4 + 1 = 8 and 3 + 2 + 2 = 7. Column slices start on 64-column boundaries
# (a 128-byte swizzle atom of 16-bit elements): an even 96 + 96 would not.
NARROW_D: gl.constexpr = gl.constexpr(192)


@gluon.jit
def _over_head(a, b, acc, use_acc: gl.constexpr, USED_D: gl.constexpr):
    """``a[:, :USED_D] @ b[:, :USED_D]^T`` onto ``acc`` as async products (shared tiles, rows
    down): one, or 128 + 64 columns for NARROW_D (a shared tile's sizes are powers of two)."""
    if USED_D == NARROW_D:
        acc = warpgroup_mma(a.slice(0, 128, dim=1), b.slice(0, 128, dim=1).permute((1, 0)), acc, use_acc=use_acc,
                            is_async=True)
        return warpgroup_mma(a.slice(128, 64, dim=1), b.slice(128, 64, dim=1).permute((1, 0)), acc, is_async=True)
    else:
        return warpgroup_mma(a, b.permute((1, 0)), acc, use_acc=use_acc, is_async=True)


@gluon.jit
def _columns_consumer(c: gl.constexpr, work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DQ_COLS: gl.constexpr, PAD_HEAD: gl.constexpr,
                      PERSISTENT: gl.constexpr, USED_D: gl.constexpr, col0: gl.constexpr, COLS: gl.constexpr,
                      dq_col0: gl.constexpr, DQ_N: gl.constexpr, TMA_STORE: gl.constexpr, KV_SLOTS: gl.constexpr):
    """Consumer warpgroup c of 64-key tiles: columns col0 .. col0 + COLS - 1 of the keys' dK
    and dV, dq_col0 .. dq_col0 + DQ_N - 1 of every step's dQ, and half of the step's
    queries for S^T and dP^T, whose products run over the first USED_D columns of the
    tiles (:func:`_columns`: the halves of HEAD_D, or 128 + 64 of 192)."""
    (q_smem, k_smem, v_smem, do_smem, stats_smem, pt_smem, ds_smem, dq_smem, kv_bar, kv_empty, q_ready, do_ready,
     q_empty, do_empty, ds_ready, dq_desc, key_grads, sizes, qk_scale, sm_scale, head_dim, head_dim_v) = work
    n_n, batch, heads_k, group, seqlen_q, seqlen_k, diag, window_left, window_right, by_l2 = sizes
    HALF_M: gl.constexpr = BLOCK_M // 2
    HEAD_PRODUCTS: gl.constexpr = 2 if USED_D == NARROW_D else 1  # async products of one _over_head
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLS, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    dtype: gl.constexpr = q_smem.dtype
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    stats_rows = stats_smem._reinterpret(gl.float32, [2 * STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    dq_tile = dq_smem.index(c)
    no_scores = gl.zeros([WARPGROUP_ROWS, HALF_M], gl.float32, s_layout)
    no_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    offs_m = c * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
    g = 0  # steps of the tiles before (the rings' position)
    kv = 0  # tiles before with a step (the K/V slot and its kv_bar's phase)
    for r in range(0, program_tiles(n_n * heads_k * batch, PERSISTENT)):
        z, hk, head0, start_n, a, b, last_m, n_steps, tail = _key_tile(r, sizes, MASK, BLOCK_M, BLOCK_N, PERSISTENT)
        keys = start_n + gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([WARPGROUP_ROWS, COLS], gl.float32, acc_layout)
        dv = gl.zeros([WARPGROUP_ROWS, COLS], gl.float32, acc_layout)
        kv_slot = _tile_kv(kv_bar, kv, n_steps, KV_SLOTS)
        for i in range(n_steps):
            s = g + i
            slot, phase, buf = _ring(s, i, STAGES)
            off_h, start_m = _step(i, last_m, group, head0, BLOCK_M)
            rows = start_m + offs_m
            q_tile = q_smem.index(slot).reshape([BLOCK_M, HEAD_D])
            # the tiles every step reads, addressed anew each step (see _step_zero)
            zero = _step_zero(i)
            do_tile = do_smem.index(zero).reshape([BLOCK_M, HEAD_D])  # dO: one slot (shared memory)
            k_step = k_smem.index(kv_slot + zero).reshape([BLOCK_N, HEAD_D])
            v_step = v_smem.index(kv_slot + zero).reshape([BLOCK_N, HEAD_D])
            mbarrier.wait(q_ready.index(slot), phase)
            s_t = _over_head(k_step, q_tile.slice(c * HALF_M, HALF_M, dim=0), no_scores, False, USED_D)
            delta = stats_rows.index(2 * slot).slice(c * HALF_M, HALF_M).load(row_layout)
            mbarrier.wait(do_ready.index(0), s & 1)
            dp_t = _over_head(v_step, do_tile.slice(c * HALF_M, HALF_M, dim=0), no_scores - delta[None, :], True,
                              USED_D)
            lse2 = stats_rows.index(2 * slot + 1).slice(c * HALF_M, HALF_M).load(row_layout)
            s_t = warpgroup_mma_wait(HEAD_PRODUCTS, deps=(s_t, ))  # dP^T's may stay in flight
            p_t = _step_probabilities(s_t, lse2, keys, rows, qk_scale, seqlen_k, diag, window_left, window_right,
                                      tail or start_m < a or start_m >= b, MASK)
            # P^T and dS^T of this consumer's queries into the shared tiles (double-buffered, as
            # in the key split: the tiles two steps back were read before either consumer arrived
            # on the last ones); dV and dK need every query of the step
            pt_tile = pt_smem.index(buf)
            ds_tile = ds_smem.index(buf)
            pt_tile.slice(c * HALF_M, HALF_M, dim=1).store(p_t.to(dtype))
            dp_t = warpgroup_mma_wait(0, deps=(dp_t, ))
            ds_tile.slice(c * HALF_M, HALF_M, dim=1).store((p_t * dp_t).to(dtype))
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            mbarrier.wait(ds_ready.index(buf), (s // 2) & 1)
            dv = warpgroup_mma(pt_tile, do_tile.slice(col0, COLS, dim=1), dv, is_async=True)
            dk = warpgroup_mma(ds_tile, q_tile.slice(col0, COLS, dim=1), dk, is_async=True)
            dv = warpgroup_mma_wait(1, deps=(dv, ))
            mbarrier.arrive(do_empty.index(0), count=1)  # the loader brings the next dO during dK and dQ
            dk = warpgroup_mma_wait(0, deps=(dk, ))
            mbarrier.arrive(q_empty.index(slot), count=1)
            for j in gl.static_range(DQ_N // DQ_COLS):
                dq = warpgroup_mma(ds_tile.permute((1, 0)), k_step.slice(dq_col0 + j * DQ_COLS, DQ_COLS, dim=1),
                                   no_dq, use_acc=False)
                tma.store_wait(0)
                dq_tile.store(gl.reshape(dq, [1, 1, BLOCK_M, DQ_COLS]))
                fence_async_shared()
                _reduce_add(dq_desc, [z, off_h, start_m, dq_col0 + j * DQ_COLS], dq_tile)
        g, kv = _tile_done(kv_empty, kv_slot, g, kv, n_steps)
        if TMA_STORE:  # the halves (not NARROW's 128 + 64): one staging tile of 64 keys x COLS a BLOCK_M of 64
            _copy_key_grads(dk, dv, c, key_grads, z, hk, start_n, col0, sm_scale, dtype, COLS,
                            BLOCK_M // WARPGROUP_ROWS)
        else:
            out_rows = start_n + gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(1, acc_layout))
            cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, acc_layout))
            _store_key_grads(dk, dv, out_rows, cols, key_grads, z, hk, sm_scale, seqlen_k, head_dim, head_dim_v,
                             dtype, PAD_HEAD)
    tma.store_wait(0)


@gluon.jit
def _columns(c: gl.constexpr, work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DQ_COLS: gl.constexpr, PAD_HEAD: gl.constexpr,
             PERSISTENT: gl.constexpr, NARROW: gl.constexpr, TMA_STORE: gl.constexpr, KV_SLOTS: gl.constexpr):
    """Consumer c of the column split: the halves of HEAD_D, or with NARROW, for a call whose
    padded heads have at most NARROW_D columns (one branch for the whole grid), 128 + 64."""
    half: gl.constexpr = HEAD_D // 2
    if NARROW:  # (a branch on a constant condition crashes Triton 3.6's lowering: decided here)
        if (work[20] <= NARROW_D) & (work[21] <= NARROW_D):  # head_dim, head_dim_v
            _columns_consumer(c, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, DQ_COLS, PAD_HEAD, PERSISTENT,
                              NARROW_D, c * 128, 128 - c * 64, c * 64, 64 + c * 64, False, KV_SLOTS)
        else:
            _columns_consumer(c, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, DQ_COLS, PAD_HEAD, PERSISTENT,
                              HEAD_D, c * half, half, c * half, half, False, KV_SLOTS)
    else:
        _columns_consumer(c, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, DQ_COLS, PAD_HEAD, PERSISTENT,
                          HEAD_D, c * half, half, c * half, half, TMA_STORE, KV_SLOTS)


@gluon.jit
def _consumer0(work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CONSUMERS: gl.constexpr, COLUMNS: gl.constexpr, DQ_COLS: gl.constexpr,
               PAD_HEAD: gl.constexpr, PERSISTENT: gl.constexpr, NARROW: gl.constexpr, TMA_STORE: gl.constexpr,
               KV_SLOTS: gl.constexpr):
    if COLUMNS:
        _columns(0, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, DQ_COLS, PAD_HEAD, PERSISTENT, NARROW, TMA_STORE,
                 KV_SLOTS)
    else:
        _keys_consumer(0, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, PAD_HEAD, PERSISTENT, TMA_STORE,
                       KV_SLOTS)


@gluon.jit
def _consumer1(work, MASK: gl.constexpr, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, CONSUMERS: gl.constexpr, COLUMNS: gl.constexpr, DQ_COLS: gl.constexpr,
               PAD_HEAD: gl.constexpr, PERSISTENT: gl.constexpr, NARROW: gl.constexpr, TMA_STORE: gl.constexpr,
               KV_SLOTS: gl.constexpr):
    if COLUMNS:
        _columns(1, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, DQ_COLS, PAD_HEAD, PERSISTENT, NARROW, TMA_STORE,
                 KV_SLOTS)
    else:
        _keys_consumer(1, work, MASK, HEAD_D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, PAD_HEAD, PERSISTENT, TMA_STORE,
                       KV_SLOTS)


@gluon.jit
def attn_bwd_ws(
    Q, K, V, DO, DQ, DK, DV, Stats,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm,
    stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    stride_sz, stride_sh, stride_sp,
    max_seqlen_q, max_seqlen_k, batch, num_heads_q, group_size, sm_scale, qk_scale, window_left, window_right,
    head_dim, head_dim_v, MASK: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, PAD_HEAD: gl.constexpr,
    VARLEN: gl.constexpr, DROPOUT: gl.constexpr, BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
    GROUPED: gl.constexpr, NARROW: gl.constexpr, TMA_STORE: gl.constexpr, KV_SLOTS: gl.constexpr,
):
    """Tiles of BLOCK_N keys of one key/value head: their dK, dV and their share of dQ. One
    tile per program on a grid (n blocks, Hk, B), or with PERSISTENT every programs-th tile
    on a grid (programs,): the descriptors and barriers are made once, and the next tile's
    K and V load while this one's dK and dV are stored (with KV_SLOTS=2, into a second
    slot during this one's steps, by a warp of their own). Compiled with num_warps=4 (the
    first consumer) and grows to 4 per consumer plus the loaders'. DQ: fp32, zeroed, q's
    shape (strides in elements)."""
    gl.static_assert(BLOCK_DV == BLOCK_D and not VARLEN and not DROPOUT and BIAS == 0,
                     "attn_bwd_ws: one head-dim bucket, no varlen, dropout or bias")
    CONSUMERS: gl.constexpr = 2
    gl.static_assert(BLOCK_N == WARPGROUP_ROWS or BLOCK_N == CONSUMERS * WARPGROUP_ROWS, "BLOCK_N is 64 or 128")
    # 64 keys: the consumers split the columns (dK, dV, dQ) and the step's queries (S, dP);
    # one dO slot (at d256 a second does not fit beside the q ring)
    COLUMNS: gl.constexpr = BLOCK_N == WARPGROUP_ROWS
    DO_STAGES: gl.constexpr = 1 if COLUMNS else STAGES
    DQ_COLS: gl.constexpr = 64 if BLOCK_D > 128 else BLOCK_D // CONSUMERS  # one bulk reduce's columns
    gl.static_assert(not NARROW or (COLUMNS and PAD_HEAD and BLOCK_D == 256),
                     "NARROW: the column split of padded heads in the d256 bucket")
    gl.static_assert(not TMA_STORE or not NARROW, "TMA_STORE: the key split, or the column split's halves")
    gl.static_assert(KV_SLOTS == 1 or (KV_SLOTS == 2 and PERSISTENT > 0), "KV_SLOTS: 1, or 2 with PERSISTENT")
    seqlen_q = max_seqlen_q
    seqlen_k = max_seqlen_k
    if MASK == MASK_BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = 0
    # GROUPED=False: one query head a key head, a constant the steps' arithmetic folds away
    if GROUPED:
        group = group_size
    else:
        group: gl.constexpr = 1
    num_heads_k = num_heads_q // group
    n_n = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    # PERSISTENT under a mask: how many (sequence, key head) pairs' q and dO fit in L2 together
    by_l2 = (QDO_L2_BYTES // gl.maximum(4 * group * seqlen_q.to(gl.int64) * BLOCK_D, 1)).to(gl.int32)
    sizes = (n_n, batch, num_heads_k, group, seqlen_q, seqlen_k, diag, window_left, window_right, by_l2)

    dtype: gl.constexpr = Q.dtype.element_ty
    qdo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_N, BLOCK_D], dtype)
    if COLUMNS:  # each consumer writes half of the columns: swizzled in halves
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_M, element_bitwidth=16,
                                                       rank=2)
    else:
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_M, DQ_COLS], gl.float32)
    stats_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=4)
    # [sequence, query head, row, column]: rows past the sequence arrive as zeros, and dQ's are dropped
    queries = gl.maximum(seqlen_q, 1)
    # padded heads: the dQ reduce drops the columns past the head dim
    cols_qk, cols_v = head_columns(head_dim, head_dim_v, BLOCK_D, BLOCK_DV, PAD_HEAD)
    q_desc = heads_descriptor(Q, batch, num_heads_q, queries, cols_qk, stride_qz, stride_qh, stride_qm, BLOCK_M,
                              BLOCK_D, qdo_layout)
    do_desc = heads_descriptor(DO, batch, num_heads_q, queries, cols_v, stride_doz, stride_doh, stride_dom, BLOCK_M,
                               BLOCK_D, qdo_layout)
    dq_desc = heads_descriptor(DQ, batch, num_heads_q, queries, cols_qk, stride_dqz, stride_dqh, stride_dqm, BLOCK_M,
                               DQ_COLS, dq_layout)
    # [sequence, plane, query head, row] (delta, lse in base 2): rows padded to a multiple of
    # every BLOCK_M (delta 0, lse +inf), and contiguous: a head's stride is its row count
    stats_desc = tma.make_tensor_descriptor(Stats, shape=[batch, 2, num_heads_q, stride_sh],
                                            strides=[stride_sz, stride_sp, stride_sh, 1],
                                            block_shape=[1, 2, 1, BLOCK_M], layout=stats_layout)
    keys = gl.maximum(seqlen_k, 1)
    k_desc = heads_descriptor(K, batch, num_heads_k, keys, cols_qk, stride_kz, stride_kh, stride_kn, BLOCK_N, BLOCK_D,
                              kv_layout)
    v_desc = heads_descriptor(V, batch, num_heads_k, keys, cols_v, stride_vz, stride_vh, stride_vn, BLOCK_N, BLOCK_D,
                              kv_layout)

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, BLOCK_D], qdo_layout)
    do_smem = gl.allocate_shared_memory(dtype, [DO_STAGES, 1, 1, BLOCK_M, BLOCK_D], qdo_layout)
    stats_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, 2, 1, BLOCK_M], stats_layout)
    # K and V: KV_SLOTS slots each, indexed with _step_zero
    k_smem = gl.allocate_shared_memory(dtype, [KV_SLOTS, 1, 1, BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_SLOTS, 1, 1, BLOCK_N, BLOCK_D], kv_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    if COLUMNS:
        pt_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    else:
        pt_smem = ds_smem  # P^T stays in registers
    dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 1, 1, BLOCK_M, DQ_COLS], dq_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [KV_SLOTS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KV_SLOTS, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(KV_SLOTS):
        mbarrier.init(kv_bar.index(slot), count=1)
        mbarrier.init(kv_empty.index(slot), count=CONSUMERS)
    for slot in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(q_empty.index(slot), count=CONSUMERS)
    for slot in gl.static_range(DO_STAGES):
        mbarrier.init(do_ready.index(slot), count=1)
        mbarrier.init(do_empty.index(slot), count=CONSUMERS)
    for buf in gl.static_range(2):
        mbarrier.init(ds_ready.index(buf), count=CONSUMERS)
    fence_async_shared()

    if TMA_STORE:
        # dK and dV staged in the dQ staging tiles' bytes: 64 keys x D 16-bit (the key split,
        # whose tiles hold BLOCK_M x D / 2 fp32) or x D / 2 (the column split: BLOCK_M x 64)
        KG_COLS: gl.constexpr = BLOCK_D // 2 if COLUMNS else BLOCK_D
        kg_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, 1, WARPGROUP_ROWS, KG_COLS], dtype)
        kg_smem = dq_smem._reinterpret(dtype, [CONSUMERS * (BLOCK_M // WARPGROUP_ROWS), 1, 1, WARPGROUP_ROWS, KG_COLS],
                                       kg_layout)
        dk_desc = heads_descriptor(DK, batch, num_heads_k, keys, cols_qk, stride_dkz, stride_dkh, stride_dkn,
                                   WARPGROUP_ROWS, KG_COLS, kg_layout)
        dv_desc = heads_descriptor(DV, batch, num_heads_k, keys, cols_v, stride_dvz, stride_dvh, stride_dvn,
                                   WARPGROUP_ROWS, KG_COLS, kg_layout)
    else:
        kg_smem = dq_smem
        dk_desc = DK
        dv_desc = DV
    key_grads = (DK, DV, stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn, dk_desc, dv_desc,
                 kg_smem)
    work = (q_smem, k_smem, v_smem, do_smem, stats_smem, pt_smem, ds_smem, dq_smem, kv_bar, kv_empty, q_ready,
            do_ready, q_empty, do_empty, ds_ready, dq_desc, key_grads, sizes, qk_scale, sm_scale, head_dim,
            head_dim_v)
    loads = (q_desc, k_desc, v_desc, do_desc, stats_desc, q_smem, k_smem, v_smem, do_smem,
             stats_smem, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty, sizes)
    if KV_SLOTS == 1:
        gl.warp_specialize([
            (_consumer0, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, COLUMNS, DQ_COLS, PAD_HEAD,
                          PERSISTENT, NARROW, TMA_STORE, KV_SLOTS)),
            (_consumer1, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, COLUMNS, DQ_COLS, PAD_HEAD,
                          PERSISTENT, NARROW, TMA_STORE, KV_SLOTS)),
            (_loader, (loads, MASK, BLOCK_M, BLOCK_N, STAGES, DO_STAGES, PERSISTENT, KV_SLOTS)),
        ], [4, 1], [consumer_regs(CONSUMERS), LOADER_REGS])
    else:  # the same partitions and a loader warp of K and V's own (constexprs cannot travel in a tuple)
        kv_loads = (k_desc, v_desc, k_smem, v_smem, kv_bar, kv_empty, sizes)
        gl.warp_specialize([
            (_consumer0, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, COLUMNS, DQ_COLS, PAD_HEAD,
                          PERSISTENT, NARROW, TMA_STORE, KV_SLOTS)),
            (_consumer1, (work, MASK, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, COLUMNS, DQ_COLS, PAD_HEAD,
                          PERSISTENT, NARROW, TMA_STORE, KV_SLOTS)),
            (_loader, (loads, MASK, BLOCK_M, BLOCK_N, STAGES, DO_STAGES, PERSISTENT, KV_SLOTS)),
            (_kv_loader, (kv_loads, MASK, BLOCK_M, BLOCK_N, PERSISTENT, KV_SLOTS)),
        ], [4, 1, 1], [consumer_regs(CONSUMERS), LOADER_REGS, LOADER_REGS])
