"""The backward kernels: dQ with the per-row stats, then dK/dV (split backend), or the
stats' preprocess, then all three gradients in one launch (fused).

With p = exp(s - lse) recomputed from the saved lse, z the keep-mask, r = 1 / (1 - p_drop)
and delta_i = sum_d dO[i, d] * O[i, d]:
    dv_j = sum_i z_ij r p_ij dO_i         dp_ij = z_ij r (dO_i . v_j)
    ds_ij = p_ij (dp_ij - delta_i)        (= d loss / d bias_ij)
    dq_i = scale sum_j ds_ij k_j          dk_j = scale sum_i ds_ij q_i
Key-major programs (dK, dV) hold a key block and loop over the query blocks that see
it, for every query head of the GQA group; query-major programs (dQ) hold a query
block and loop over its keys. Both split the loop into the three runs of
:func:`.common.key_blocks` (masked edges, unmasked interior). Fully masked rows have
lse = +inf, so p = 0 and every gradient they touch is exactly 0.

Before the key-major loops run, what they read per query row is written into one fp32 scratch
(by the preprocess; in the split backend by the dQ kernel, launched first),
``Stats`` ``(2, B, Hq, Sq rounded up to 128)`` (``(2, Hq, total_q rounded up to 16)``
under varlen): plane 0 delta, plane 1 the log-sum-exp in base 2 (``lse * log2(e)``, one
multiply fewer per row and step), rows past a sequence holding delta 0 and lse +inf.
Its planes, rows and heads are 16-aligned by construction, so the loops' per-row loads
are vectorized in the aligned variant and, without varlen, need no mask at all.

Stride arguments travel between the functions here as tuples, one per tensor:
``(batch, head, row)`` for q/k/v-like tensors, ``(batch, head)`` for lse and the stats,
``(batch, head, row, column)`` for the bias and ``(batch, head, row)`` for its gradient.
"""

import triton
import triton.language as tl

from aotattn.families.flash.kernels.common import (BIAS_GRAD, BIAS_NONE, LOG2E, MASK_NONE, bias_log2, diagonal,
                                                   drop, dropout_draws, head_columns, key_blocks, load_rows,
                                                   load_tile, mma, program_order, row_sum, run_bounds, sequence,
                                                   visible)


@triton.jit
def _store_row_stats(o, do, lse_ptrs, m_in, delta_ptrs, lse2_ptrs, VARLEN: tl.constexpr):
    """Delta = rowsum(dO * O), reduced in fp32, and lse * log2(e) of a block of rows, stored
    into the stats' two planes; returns them. Rows past the sequence (o = dO = 0, lse
    +inf) give the padding's 0 and +inf, and without varlen are stored too."""
    lse2 = tl.load(lse_ptrs, mask=m_in, other=float("inf")) * LOG2E
    delta = row_sum(o.to(tl.float32) * do.to(tl.float32))
    store_mask = m_in if VARLEN else None
    tl.store(delta_ptrs, delta, mask=store_mask)
    tl.store(lse2_ptrs, lse2, mask=store_mask)
    return delta, lse2


@triton.jit
def attn_bwd_preprocess(
    Out, DO, Lse, Stats, CuSeqlensQ,
    stride_oz, stride_oh, stride_om,
    stride_doz, stride_doh, stride_dom,
    stride_lz, stride_lh, stride_sz, stride_sh, stride_sp,
    max_seqlen_q, head_dim_v,
    BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The stats of each query row: delta = rowsum(dO * O) in fp32 (plane 0) and
    lse * log2(e) (plane 1); grid (m blocks of the stats' rows, Hq, B). Without varlen
    the grid covers every row of the stats, the padding too (delta 0, lse +inf)."""
    off_h = tl.program_id(1).to(tl.int64)
    off_z = tl.program_id(2)
    q_start, seqlen_q, _, _ = sequence(CuSeqlensQ, CuSeqlensQ, off_z, max_seqlen_q, max_seqlen_q, VARLEN)
    off_z = off_z.to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_in = offs_m < seqlen_q
    rows = q_start + offs_m[:, None].to(tl.int64)
    o = load_rows(Out + off_z * stride_oz + off_h * stride_oh + rows * stride_om + offs_dv[None, :],
                  0, 0, m_in, offs_dv < head_dim_v, True, PAD_HEAD)
    do = load_rows(DO + off_z * stride_doz + off_h * stride_doh + rows * stride_dom + offs_dv[None, :],
                   0, 0, m_in, offs_dv < head_dim_v, True, PAD_HEAD)
    stats = Stats + off_z * stride_sz + off_h * stride_sh + q_start + offs_m
    # without varlen the stats' rows are padded to a multiple of every BLOCK_M, the grid covers them
    _store_row_stats(o, do, Lse + off_z * stride_lz + off_h * stride_lh + q_start + offs_m, m_in, stats,
                     stats + stride_sp, VARLEN)


@triton.jit
def _dkdv_program(
    pid_n, off_hk, off_z,
    Q, K, V, DO, DK, DV, Lse2, Delta, DQ, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv, stride_l, stride_dq, stride_b, stride_db,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    """dK, dV of BLOCK_N keys of one key/value head, summed over its query heads.

    With ATOMIC_DQ it also adds each query block's share of dQ, unscaled (dS K: the
    softmax and dropout scales are applied by :func:`..planning.finish_dq`, as GPU float
    atomics flush subnormal sums to zero), into a zeroed fp32 DQ (and writes dBias).
    TMA=1: the q and dO tiles come through tensor descriptors over the group's query heads
    (in padded heads spanning the real head dims)."""
    q_start, seqlen_q, k_start, seqlen_k = sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q, max_seqlen_k,
                                                    VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:  # varlen: this sequence is shorter than the longest
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = head_columns(offs_d, head_dim, PAD_HEAD)
    dv_mask = head_columns(offs_dv, head_dim_v, PAD_HEAD)
    n_in = offs_n < seqlen_k
    tail = start_n + BLOCK_N > seqlen_k  # the last key block runs past the keys
    keys = k_start + offs_n[:, None].to(tl.int64)
    k = load_rows(K + off_z * stride_k[0] + off_hk * stride_k[1] + keys * stride_k[2] + offs_d[None, :],
                  0, 0, n_in, d_mask, True, PAD_HEAD)
    v = load_rows(V + off_z * stride_v[0] + off_hk * stride_v[1] + keys * stride_v[2] + offs_dv[None, :],
                  0, 0, n_in, dv_mask, True, PAD_HEAD)
    dk = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, BLOCK_DV), 0.0, tl.float32)
    if DROPOUT:
        # Dropout's 1 / (1 - p) leaves the loop: dV sums the kept p's, ds = p (z dp - delta)
        # / (1 - p) is summed as p (z dp - delta (1 - p)), and dK and dV are scaled once at
        # the end (two multiplies per element fewer in the loop; an atomic dQ after its
        # sums, by planning.finish_dq).
        keep_fraction = 1.0 / dropout_scale

    diag = diagonal(seqlen_q, seqlen_k, MASK)
    # the queries that see these keys: the window transposed
    lo, a, b, hi = key_blocks(start_n, tl.minimum(start_n + BLOCK_N, seqlen_k), seqlen_q, -diag,
                              window_right, window_left, MASK, BLOCK_M)
    # One loop per run over (query head of the group, query block) pairs: a runtime group
    # loop around the runs nested three pipelined loops in a fourth (the images pass
    # group_size at run time), 66 more registers per thread at d64 and a pipeline refill at
    # every head; no time by itself on MHA (RESULTS.md, fifth session).
    rows0 = q_start + offs_m[:, None].to(tl.int64)
    if TMA:
        # [query head of the group, row, column]: rows past the sequence (and columns past
        # a padded head) arrive as zeros
        q_desc = tl.make_tensor_descriptor(
            Q + off_z * stride_q[0] + off_hk * group_size * stride_q[1] + q_start * stride_q[2],
            shape=[group_size, tl.maximum(seqlen_q, 1), head_dim if PAD_HEAD else BLOCK_D],
            strides=[stride_q[1], stride_q[2], 1], block_shape=[1, BLOCK_M, BLOCK_D])
        do_desc = tl.make_tensor_descriptor(
            DO + off_z * stride_do[0] + off_hk * group_size * stride_do[1] + q_start * stride_do[2],
            shape=[group_size, tl.maximum(seqlen_q, 1), head_dim_v if PAD_HEAD else BLOCK_DV],
            strides=[stride_do[1], stride_do[2], 1], block_shape=[1, BLOCK_M, BLOCK_DV])
    else:
        q_desc = None
        do_desc = None
    for run in tl.static_range(3):
        # masked kernels loop over the unmasked interior first, then the window's edges
        # (common.run_bounds); `run != (0 if MASK != MASK_NONE else 1)`: an edge
        start, end = run_bounds(run, lo, a, b, hi, MASK)
        blocks = (end - start + BLOCK_M - 1) // BLOCK_M
        # the pipeliner computes the first steps' addresses before it tests the trip count:
        # an empty run must not divide by zero there (undefined in LLVM, a fault on the GPU)
        divisor = tl.maximum(blocks, 1)
        for step in range(0, group_size * blocks):
            g = step // divisor
            start_m = start + (step - g * divisor) * BLOCK_M
            off_h = off_hk * group_size + g
            drop_rows = (off_z * num_heads_q + off_h) * max_seqlen_q  # dropout counters: this head's rows
            m_off = tl.cast(start_m, tl.int64)
            # a multiple of BLOCK_M (every non-empty run starts at one): with the stats'
            # alignment, the per-row loads below are vectorized
            rows = tl.max_contiguous(tl.multiple_of(start_m + offs_m, BLOCK_M), BLOCK_M)
            m_in = rows < seqlen_q
            q_ptrs = Q + off_z * stride_q[0] + off_h * stride_q[1] + rows0 * stride_q[2] + offs_d[None, :]
            do_ptrs = DO + off_z * stride_do[0] + off_h * stride_do[1] + rows0 * stride_do[2] + offs_dv[None, :]
            if TMA:
                q = q_desc.load([g, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
                do = do_desc.load([g, start_m, 0]).reshape(BLOCK_M, BLOCK_DV)
            else:
                q = load_rows(q_ptrs, m_off, stride_q[2], m_in, d_mask, run != (0 if MASK != MASK_NONE else 1),
                              PAD_HEAD)  # [BLOCK_M, BLOCK_D]
                do = load_rows(do_ptrs, m_off, stride_do[2], m_in, dv_mask, run != (0 if MASK != MASK_NONE else 1),
                               PAD_HEAD)  # [BLOCK_M, BLOCK_DV]
            lse_ptr = Lse2 + off_z * stride_l[0] + off_h * stride_l[1] + q_start
            delta_ptr = Delta + off_z * stride_l[0] + off_h * stride_l[1] + q_start
            if VARLEN and run != (0 if MASK != MASK_NONE else 1):
                lse2 = tl.load(lse_ptr + rows, mask=m_in, other=float("inf"))
                delta = tl.load(delta_ptr + rows, mask=m_in, other=0.0)
            else:  # the stats' padding rows hold lse +inf (p = 0) and delta 0
                lse2 = tl.load(lse_ptr + rows)
                delta = tl.load(delta_ptr + rows)
            # [BLOCK_N, BLOCK_M]: keys down, queries across
            s_t = mma(k, tl.trans(q), tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32), PRECISION) * qk_scale
            if BIAS != BIAS_NONE:
                # bias tiles read transposed: [BLOCK_N keys, BLOCK_M queries]
                bias_ptrs = (Bias + off_z * stride_b[0] + off_h * stride_b[1] + rows[None, :].to(tl.int64) * stride_b[2]
                             + offs_n[:, None].to(tl.int64) * stride_b[3])
                bias_t = tl.load(bias_ptrs, mask=n_in[:, None] & m_in[None, :], other=0.0)
                s_t += bias_log2(bias_t)
            p_t = tl.exp2(s_t - lse2[None, :])
            if run != (0 if MASK != MASK_NONE else 1):
                keep = visible(offs_n, rows, seqlen_q, -diag, window_right, window_left, MASK)
                p_t = tl.where(keep, p_t, 0.0)
            dp_t = mma(v, tl.trans(do), tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32), PRECISION)
            if DROPOUT:
                draws_t = tl.trans(dropout_draws(philox_seed, philox_offset, drop_rows, rows, start_n, max_seqlen_k,
                                                 BLOCK_N))
                dv = mma(drop(p_t, draws_t, dropout_threshold).to(do.dtype), do, dv, PRECISION)
                ds_t = p_t * (drop(dp_t, draws_t, dropout_threshold) - (delta * keep_fraction)[None, :])
            else:
                dv = mma(p_t.to(do.dtype), do, dv, PRECISION)
                ds_t = p_t * (dp_t - delta[None, :])
            if ATOMIC_DQ and tail:
                # Keys past seqlen_k (the last key block's tail) load as zero, so their scores are 0
                # and p = exp2(-lse2), unmasked: a row whose lse is very negative (it sees one key
                # with a large negative score) overflows fp16 there, and inf * (k = 0) is NaN in dQ.
                # dK/dV drop those rows at the store; dQ sums over them, so they are zeroed, and
                # before the dK product: zeroed after it, Triton 3.6 wrote the zeros into the
                # registers the still-running dK wgmma reads its A operand from (undefined in PTX;
                # wrong dK on the H200, tests/compiler/test_ptx_hazards.py)
                ds_t = tl.where(n_in[:, None], ds_t, 0.0)
            dk = mma(ds_t.to(q.dtype), q, dk, PRECISION)
            if ATOMIC_DQ:
                dq = mma(tl.trans(ds_t.to(k.dtype)), k, tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32), PRECISION)
                dq_ptrs = DQ + off_z * stride_dq[0] + off_h * stride_dq[1] + rows0 * stride_dq[2] + offs_d[None, :]
                tl.atomic_add(dq_ptrs + m_off * stride_dq[2], dq,
                              mask=m_in[:, None] & d_mask[None, :], sem="relaxed")
                if BIAS == BIAS_GRAD:
                    dbias_ptrs = (DBias + off_z * stride_db[0] + off_h * stride_db[1]
                                  + rows[None, :].to(tl.int64) * stride_db[2] + offs_n[:, None].to(tl.int64))
                    if DROPOUT:
                        ds_t = ds_t * dropout_scale
                    tl.store(dbias_ptrs, ds_t, mask=n_in[:, None] & m_in[None, :])
    if DROPOUT:
        dk = dk * (sm_scale * dropout_scale)
        dv = dv * dropout_scale
    else:
        dk = dk * sm_scale
    tl.store(DK + off_z * stride_dk[0] + off_hk * stride_dk[1] + keys * stride_dk[2] + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=n_in[:, None] & d_mask[None, :])
    tl.store(DV + off_z * stride_dv[0] + off_hk * stride_dv[1] + keys * stride_dv[2] + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=n_in[:, None] & dv_mask[None, :])


@triton.jit
def _dq_program(
    pid_m, off_h, off_z,
    Q, K, V, DO, DQ, Lse2, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_q, stride_k, stride_v, stride_do, stride_l, stride_dq, stride_b, stride_db,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    Out, Lse, stride_o, stride_lse, stats_rows,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    STATS: tl.constexpr,
):
    """dQ (and dBias) of BLOCK_M query rows of one query head: under a mask, ``pid_m`` is
    a rank, 0 for the last (costliest) block. TMA=1: the K and V tiles come through
    tensor descriptors (in padded heads spanning the real head dims).

    STATS: the program computes its rows' stats from ``Out`` and ``Lse`` itself, as the
    preprocess would, and writes them for the dK/dV kernel that runs after it (``Delta``
    is the stats' plane 0, ``Lse2`` plane 1; ``stats_rows``: their padded row count).
    Otherwise it reads them."""
    q_start, seqlen_q, k_start, seqlen_k = sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q, max_seqlen_k,
                                                    VARLEN)
    num_m_blocks = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    if pid_m >= num_m_blocks:  # varlen: this sequence is shorter than the longest
        return
    if MASK != MASK_NONE:
        # rows further down see more keys under a causal mask: start those first, as the
        # forward does, so the last wave holds the lightest programs
        pid_m = num_m_blocks - 1 - pid_m
    start_m = pid_m * BLOCK_M
    off_hk = (off_h // group_size).to(tl.int64)
    off_h = off_h.to(tl.int64)
    drop_rows = (off_z * num_heads_q + off_h) * max_seqlen_q  # dropout counters: this head's rows
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = head_columns(offs_d, head_dim, PAD_HEAD)
    dv_mask = head_columns(offs_dv, head_dim_v, PAD_HEAD)
    m_in = offs_m < seqlen_q
    rows = q_start + offs_m[:, None].to(tl.int64)
    q = load_rows(Q + off_z * stride_q[0] + off_h * stride_q[1] + rows * stride_q[2] + offs_d[None, :],
                  0, 0, m_in, d_mask, True, PAD_HEAD)
    do = load_rows(DO + off_z * stride_do[0] + off_h * stride_do[1] + rows * stride_do[2] + offs_dv[None, :],
                   0, 0, m_in, dv_mask, True, PAD_HEAD)
    stats = off_z * stride_l[0] + off_h * stride_l[1] + q_start + offs_m
    if STATS:
        # rows past the sequence: o = dO = 0 and lse +inf, so they store the padding's values
        o = load_rows(Out + off_z * stride_o[0] + off_h * stride_o[1] + rows * stride_o[2] + offs_dv[None, :],
                      0, 0, m_in, dv_mask, True, PAD_HEAD)
        # without varlen the stats' padded rows take the block's tail
        delta, lse2 = _store_row_stats(o, do, Lse + off_z * stride_lse[0] + off_h * stride_lse[1] + q_start + offs_m,
                                       m_in, Delta + stats, Lse2 + stats, VARLEN)
        if not VARLEN:
            if start_m + BLOCK_M >= seqlen_q:  # the last block also fills the padding rows past it
                for pad in range(start_m + BLOCK_M, stats_rows, BLOCK_M):
                    tl.store(Delta + stats + (pad - start_m), tl.full((BLOCK_M,), 0.0, tl.float32))
                    tl.store(Lse2 + stats + (pad - start_m), tl.full((BLOCK_M,), float("inf"), tl.float32))
    else:
        lse2 = tl.load(Lse2 + stats, mask=m_in, other=float("inf"))
        delta = tl.load(Delta + stats, mask=m_in, other=0.0)
    if DROPOUT:  # ds = p (z dp - delta) / (1 - p), summed as p (z dp - delta (1 - p)): dQ is scaled at the end
        delta = delta / dropout_scale
    keys = k_start + offs_n[:, None]
    k_ptrs = K + off_z * stride_k[0] + off_hk * stride_k[1] + keys * stride_k[2] + offs_d[None, :]
    v_ptrs = V + off_z * stride_v[0] + off_hk * stride_v[1] + keys * stride_v[2] + offs_dv[None, :]
    if TMA:  # rows past the sequence (and columns past a padded head) arrive as zeros
        k_desc = tl.make_tensor_descriptor(K + off_z * stride_k[0] + off_hk * stride_k[1] + k_start * stride_k[2],
                                           shape=[tl.maximum(seqlen_k, 1), head_dim if PAD_HEAD else BLOCK_D],
                                           strides=[stride_k[2], 1], block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V + off_z * stride_v[0] + off_hk * stride_v[1] + k_start * stride_v[2],
                                           shape=[tl.maximum(seqlen_k, 1), head_dim_v if PAD_HEAD else BLOCK_DV],
                                           strides=[stride_v[2], 1], block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_desc = None
        v_desc = None
    local_rows = offs_m[:, None].to(tl.int64)
    bias_ptrs = (Bias + off_z * stride_b[0] + off_h * stride_b[1] + local_rows * stride_b[2]
                 + offs_n[None, :] * stride_b[3])
    dbias_ptrs = DBias + off_z * stride_db[0] + off_h * stride_db[1] + local_rows * stride_db[2] + offs_n[None, :]
    dq = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)

    diag = diagonal(seqlen_q, seqlen_k, MASK)
    lo, a, b, hi = key_blocks(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), seqlen_k, diag,
                              window_left, window_right, MASK, BLOCK_N)
    for run in tl.static_range(3):
        # masked kernels loop over the unmasked interior first, then the window's edges
        # (common.run_bounds); `run != (0 if MASK != MASK_NONE else 1)`: an edge
        start, end = run_bounds(run, lo, a, b, hi, MASK)
        for start_n in range(start, end, BLOCK_N):
            n_off = tl.cast(start_n, tl.int64)
            cols = start_n + offs_n
            n_in = cols < seqlen_k
            k = load_tile(k_desc, k_ptrs, start_n, n_off, stride_k[2], n_in, d_mask,
                          run != (0 if MASK != MASK_NONE else 1), PAD_HEAD, TMA)  # [BLOCK_N, BLOCK_D]
            v = load_tile(v_desc, v_ptrs, start_n, n_off, stride_v[2], n_in, dv_mask,
                          run != (0 if MASK != MASK_NONE else 1), PAD_HEAD, TMA)  # [BLOCK_N, BLOCK_DV]
            s = mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION) * qk_scale
            if BIAS != BIAS_NONE:
                bias = tl.load(bias_ptrs + n_off * stride_b[3], mask=m_in[:, None] & n_in[None, :], other=0.0)
                s += bias_log2(bias)
            p = tl.exp2(s - lse2[:, None])
            if run != (0 if MASK != MASK_NONE else 1):
                p = tl.where(visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), p, 0.0)
            dp = mma(do, tl.trans(v), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION)
            if DROPOUT:
                draws = dropout_draws(philox_seed, philox_offset, drop_rows, offs_m, start_n, max_seqlen_k, BLOCK_N)
                dp = drop(dp, draws, dropout_threshold)
            ds = p * (dp - delta[:, None])
            if BIAS == BIAS_GRAD:
                if DROPOUT:
                    tl.store(dbias_ptrs + n_off, ds * dropout_scale, mask=m_in[:, None] & n_in[None, :])
                else:
                    tl.store(dbias_ptrs + n_off, ds, mask=m_in[:, None] & n_in[None, :])
            dq = mma(ds.to(k.dtype), k, dq, PRECISION)
    if DROPOUT:
        dq = dq * (sm_scale * dropout_scale)
    else:
        dq = dq * sm_scale
    tl.store(DQ + off_z * stride_dq[0] + off_h * stride_dq[1] + rows * stride_dq[2] + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_in[:, None] & d_mask[None, :])


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, Stats, CuSeqlensQ, CuSeqlensK, Bias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    stride_sz, stride_sh, stride_sp, stride_bz, stride_bh, stride_bm, stride_bn,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """Split backend, second kernel: dK and dV; grid (n blocks, Hk, B), reading the stats
    the dQ kernel wrote. TMA: a tuning knob (q and dO through tensor descriptors)."""
    no_stride = (0, 0, 0)
    # what a key/value head's programs stream: q and dO of its query heads. Rank 0 is key
    # block 0, which the most queries see under a causal mask.
    qdo_bytes = tl.cast(max_seqlen_q, tl.int64) * (head_dim + head_dim_v) * 2 * group_size
    pid_n, off_hk, off_z = program_order(qdo_bytes, MASK)
    _dkdv_program(pid_n, off_hk.to(tl.int64), off_z.to(tl.int64),
                  Q, K, V, DO, DK, DV, Stats + stride_sp, Stats, DK, CuSeqlensQ, CuSeqlensK, Bias, DK,
                  (stride_qz, stride_qh, stride_qm), (stride_kz, stride_kh, stride_kn),
                  (stride_vz, stride_vh, stride_vn), (stride_doz, stride_doh, stride_dom),
                  (stride_dkz, stride_dkh, stride_dkn), (stride_dvz, stride_dvh, stride_dvn), (stride_sz, stride_sh),
                  no_stride, (stride_bz, stride_bh, stride_bm, stride_bn), no_stride,
                  max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
                  window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
                  MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, False, BLOCK_M, BLOCK_N, TMA)


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, DQ, Out, Lse, Stats, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm, stride_oz, stride_oh, stride_om, stride_lz, stride_lh,
    stride_sz, stride_sh, stride_sp, stats_rows,
    stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
):
    """Split backend, first kernel: dQ (and dBias); grid (m blocks, Hq, B). It also computes
    the per-row stats from ``Out`` and ``Lse`` and writes them (the preprocess's work, one
    launch and one pass over O and dO fewer) for the dK/dV kernel launched after it.
    TMA: a tuning knob (K and V through tensor descriptors)."""
    kv_bytes = tl.cast(max_seqlen_k, tl.int64) * (head_dim + head_dim_v) * 2 // group_size  # as the forward
    rank, off_h, off_z = program_order(kv_bytes, MASK)
    _dq_program(rank, off_h, off_z.to(tl.int64),
                Q, K, V, DO, DQ, Stats + stride_sp, Stats, CuSeqlensQ, CuSeqlensK, Bias, DBias,
                (stride_qz, stride_qh, stride_qm), (stride_kz, stride_kh, stride_kn),
                (stride_vz, stride_vh, stride_vn), (stride_doz, stride_doh, stride_dom), (stride_sz, stride_sh),
                (stride_dqz, stride_dqh, stride_dqm), (stride_bz, stride_bh, stride_bm, stride_bn),
                (stride_dbz, stride_dbh, stride_dbm),
                max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
                window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
                Out, Lse, (stride_oz, stride_oh, stride_om), (stride_lz, stride_lh), stats_rows,
                MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, BLOCK_M, BLOCK_N, TMA, True)


@triton.jit
def attn_bwd_fused(
    Q, K, V, DO, DQ, DK, DV, Stats, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm,
    stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    stride_sz, stride_sh, stride_sp, stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Fused backend: dK, dV and dQ in one launch; grid (programs, Hk, B).

    ATOMIC_DQ: key-major programs only, each adding its dQ share into a zeroed fp32 DQ
    with atomics (not bitwise reproducible). Otherwise the first n-block programs are
    key-major and the rest query-major (group_size of them per key/value head), so
    nothing is accumulated across programs and the result is deterministic.
    """
    pid = tl.program_id(0)
    off_hk = tl.program_id(1).to(tl.int64)
    off_z = tl.program_id(2).to(tl.int64)
    stride_q, stride_k = (stride_qz, stride_qh, stride_qm), (stride_kz, stride_kh, stride_kn)
    stride_v, stride_do = (stride_vz, stride_vh, stride_vn), (stride_doz, stride_doh, stride_dom)
    stride_dq, stride_l = (stride_dqz, stride_dqh, stride_dqm), (stride_sz, stride_sh)
    Lse2, Delta = Stats + stride_sp, Stats
    stride_b, stride_db = (stride_bz, stride_bh, stride_bm, stride_bn), (stride_dbz, stride_dbh, stride_dbm)
    num_n_blocks = (max_seqlen_k + BLOCK_N - 1) // BLOCK_N
    if ATOMIC_DQ or pid < num_n_blocks:
        _dkdv_program(pid, off_hk, off_z,
                      Q, K, V, DO, DK, DV, Lse2, Delta, DQ, CuSeqlensQ, CuSeqlensK, Bias, DBias,
                      stride_q, stride_k, stride_v, stride_do, (stride_dkz, stride_dkh, stride_dkn),
                      (stride_dvz, stride_dvh, stride_dvn), stride_l, stride_dq, stride_b, stride_db,
                      max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale,
                      qk_scale, window_left, window_right, dropout_threshold, dropout_scale, philox_seed,
                      philox_offset,
                      MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, ATOMIC_DQ,
                      BLOCK_M, BLOCK_N, 0)
    else:
        num_m_blocks = (max_seqlen_q + BLOCK_M - 1) // BLOCK_M
        rest = pid - num_n_blocks
        _dq_program(rest % num_m_blocks, off_hk * group_size + rest // num_m_blocks, off_z,
                    Q, K, V, DO, DQ, Lse2, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
                    stride_q, stride_k, stride_v, stride_do, stride_l, stride_dq, stride_b, stride_db,
                    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale,
                    qk_scale, window_left, window_right, dropout_threshold, dropout_scale, philox_seed,
                    philox_offset, DQ, Lse2, stride_q, stride_l, 0,
                    MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, BLOCK_M, BLOCK_N, 0, False)
