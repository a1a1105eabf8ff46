"""The forward kernel: online softmax over the key blocks each query block sees.

Math (per query row i, key column j, on one head):
    s_ij = scale * q_i . k_j + bias_ij        (masked entries: -inf)
    p_ij = exp(s_ij - lse_i),  lse_i = log sum_j exp(s_ij)
    o_i  = sum_j z_ij p_ij v_j / (1 - dropout_p)      z: the dropout keep-mask
computed blockwise in fp32 with base-2 exponents: the kernel receives
``qk_scale = scale * log2(e)`` and keeps the running max ``m`` and ``lse`` in the log2
domain; ``lse`` is stored in natural log.

Masks. Row i sees column j iff ``i + diag - left <= j <= i + diag + right`` where
``diag = seqlen_k - seqlen_q`` for the bottom-right diagonal and 0 for top-left; causal
is ``right = 0``. Under varlen, seqlen_q and seqlen_k are each sequence's own, so the
diagonal moves per sequence. The host passes unbounded sides as
``max_seqlen_q + max_seqlen_k`` (wider than any row can reach), so the kernels only see
non-negative window sizes. Each program splits its key range into three runs of blocks
(:func:`.common.key_blocks`): a masked run on the left edge of the window, an unmasked
interior (no mask arithmetic at all) and a masked run on the right edge (diagonal,
window, sequence end). Blocks outside the window are never visited, which is what makes
causal and windowed attention cheaper than full attention.
"""

import triton
import triton.language as tl

from aotattn.families.flash.kernels.common import (BIAS_NONE, LN2, MASK_NONE, bias_log2, diagonal, drop,
                                                   dropout_draws, head_columns, key_blocks, load_rows, load_tile, mma,
                                                   program_order, row_max, row_sum, segment, sequence, visible)


@triton.jit
def attn_fwd(
    Q, K, V, Out, Lse, CuSeqlensQ, CuSeqlensK, Bias,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    stride_bz, stride_bh, stride_bm, stride_bn,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v,
    qk_scale, window_left, window_right,
    dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OVERLAP: tl.constexpr, TMA: tl.constexpr,
):
    """One program: BLOCK_M query rows of one query head; grid (m blocks, Hq, B).

    Tuning knobs beside the tiles: OVERLAP (0 or 1), the unmasked interior issues each key
    block's scores one block ahead of its softmax; TMA (0, 1: K, 2: K and V), those tiles
    come through tensor descriptors (the bulk tensor copy engine on Hopper; in padded heads
    the descriptors span the real head dim, the columns past it arrive as zeros)."""
    # what a head's programs stream: K and V, shared by the group's query heads
    kv_bytes = tl.cast(max_seqlen_k, tl.int64) * (head_dim + head_dim_v) * 2 // group_size
    pid_m, off_h, off_z = program_order(kv_bytes, MASK)
    q_start, seqlen_q, k_start, seqlen_k = sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q, max_seqlen_k,
                                                    VARLEN)
    num_m_blocks = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    if pid_m >= num_m_blocks:  # varlen: this sequence is shorter than the longest
        return
    if MASK != MASK_NONE:
        # windowed rows further down cost more: rank 0 is the last block
        pid_m = num_m_blocks - 1 - pid_m
    off_hk = (off_h // group_size).to(tl.int64)
    drop_rows = (off_z.to(tl.int64) * num_heads_q + off_h) * max_seqlen_q  # dropout counters: this head's rows
    off_h = off_h.to(tl.int64)
    off_z = off_z.to(tl.int64)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = head_columns(offs_d, head_dim, PAD_HEAD)
    dv_mask = head_columns(offs_dv, head_dim_v, PAD_HEAD)
    m_in = offs_m < seqlen_q
    rows = q_start + offs_m[:, None].to(tl.int64)

    if MASK != MASK_NONE:
        # a block no row of which sees a key (bottom-right causal with Sq > Sk, a window past
        # the keys) stores its zeros and leaves before loading Q. Not in MASK_NONE kernels:
        # there only an empty key set does it, and the pointers computed this early cost
        # registers (d64 attn_fwd m128_n64_w8: 124 -> 132, one program per SM instead of two)
        o_ptrs = Out + off_z * stride_oz + off_h * stride_oh + rows * stride_om + offs_dv[None, :]
        lse_ptrs = Lse + off_z * stride_lz + off_h * stride_lh + q_start + offs_m
        diag = diagonal(seqlen_q, seqlen_k, MASK)
        lo, a, b, hi = key_blocks(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), seqlen_k, diag,
                                  window_left, window_right, MASK, BLOCK_N)
        if hi == lo:
            _store(o_ptrs, lse_ptrs, tl.full((BLOCK_M, BLOCK_DV), 0.0, tl.float32),
                   tl.full((BLOCK_M,), float("inf"), tl.float32), m_in, dv_mask, PAD_HEAD)
            return

    q = load_rows(Q + off_z * stride_qz + off_h * stride_qh + rows * stride_qm + offs_d[None, :],
                  0, 0, m_in, d_mask, True, PAD_HEAD)
    # [BLOCK_N, BLOCK_D] and [BLOCK_N, BLOCK_DV] tiles at key 0; the loop adds start_n * stride
    keys = k_start + offs_n[:, None]
    k_ptrs = K + off_z * stride_kz + off_hk * stride_kh + keys * stride_kn + offs_d[None, :]
    v_ptrs = V + off_z * stride_vz + off_hk * stride_vh + keys * stride_vn + offs_dv[None, :]
    # K (TMA=1), or K and V (TMA=2), through the bulk tensor copy engine: rows past the
    # sequence, and in padded heads the columns past the head, arrive as zeros (every
    # variant has the 16-byte bases and row strides a descriptor needs, rules._variant_of).
    # Triton 3.6's ptxas crashes on TMA with num_stages=2 unless it is TMA=1 without
    # OVERLAP: the build reports such a configuration as failed.
    if TMA:
        k_desc = tl.make_tensor_descriptor(K + off_z * stride_kz + off_hk * stride_kh + k_start * stride_kn,
                                           shape=[tl.maximum(seqlen_k, 1), head_dim if PAD_HEAD else BLOCK_D],
                                           strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        k_desc = None
    if TMA == 2:
        v_desc = tl.make_tensor_descriptor(V + off_z * stride_vz + off_hk * stride_vh + k_start * stride_vn,
                                           shape=[tl.maximum(seqlen_k, 1), head_dim_v if PAD_HEAD else BLOCK_DV],
                                           strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_DV])
    else:
        v_desc = None
    bias_ptrs = (Bias + off_z * stride_bz + off_h * stride_bh + offs_m[:, None].to(tl.int64) * stride_bm
                 + offs_n[None, :] * stride_bn)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_DV), 0.0, tl.float32)

    if MASK == MASK_NONE:  # masked kernels computed these before loading Q (the early exit above)
        diag = diagonal(seqlen_q, seqlen_k, MASK)
        lo, a, b, hi = key_blocks(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), seqlen_k, diag,
                                  window_left, window_right, MASK, BLOCK_N)
    for seg in tl.static_range(3):
        # runs 0 and 2 (the window's edges) are masked: `seg != 1`, see common.segment
        start, end = segment(seg, lo, a, b, hi)
        if seg == 1 and OVERLAP:
            # The interior, software-pipelined by hand: block j + 1's scores are issued
            # before block j's softmax, so the tensor cores compute them while the warps do
            # block j's exponentials (in order of issue, the MMAs of Q K^T j+1 and P V j
            # then overlap the softmax). A non-empty interior starts and ends on block
            # boundaries (common.key_blocks), and every key in it is inside the sequence.
            if start < end:
                k = load_tile(k_desc, k_ptrs, start, tl.cast(start, tl.int64), stride_kn, offs_n < BLOCK_N, d_mask,
                             False, PAD_HEAD, TMA >= 1)
                s = mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION)
                for start_n in range(start, end - BLOCK_N, BLOCK_N):
                    k = load_tile(k_desc, k_ptrs, start_n + BLOCK_N, tl.cast(start_n + BLOCK_N, tl.int64), stride_kn,
                                 offs_n < BLOCK_N, d_mask, False, PAD_HEAD, TMA >= 1)
                    s_next = mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION)
                    acc, m_i, l_i = _online_softmax(
                        acc, m_i, l_i, s, start_n, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                        qk_scale, v_desc, v_ptrs, stride_vn, dv_mask, bias_ptrs, stride_bn, philox_seed, philox_offset,
                        dropout_threshold, drop_rows, max_seqlen_k,
                        MASK, False, PAD_HEAD, DROPOUT, BIAS, PRECISION, TMA, BLOCK_N)
                    s = s_next
                acc, m_i, l_i = _online_softmax(
                    acc, m_i, l_i, s, end - BLOCK_N, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                    qk_scale, v_desc, v_ptrs, stride_vn, dv_mask, bias_ptrs, stride_bn, philox_seed, philox_offset,
                    dropout_threshold, drop_rows, max_seqlen_k,
                    MASK, False, PAD_HEAD, DROPOUT, BIAS, PRECISION, TMA, BLOCK_N)
        else:
            for start_n in range(start, end, BLOCK_N):
                k = load_tile(k_desc, k_ptrs, start_n, tl.cast(start_n, tl.int64), stride_kn,  # [BLOCK_N, BLOCK_D]
                             start_n + offs_n < seqlen_k, d_mask, seg != 1, PAD_HEAD, TMA >= 1)
                s = mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION)  # [BLOCK_M, BLOCK_N]
                acc, m_i, l_i = _online_softmax(
                    acc, m_i, l_i, s, start_n, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                    qk_scale, v_desc, v_ptrs, stride_vn, dv_mask, bias_ptrs, stride_bn, philox_seed, philox_offset,
                    dropout_threshold, drop_rows, max_seqlen_k,
                    MASK, seg != 1, PAD_HEAD, DROPOUT, BIAS, PRECISION, TMA, BLOCK_N)

    # rows that saw no key: l = 0, acc = 0 -> output 0, lse +inf
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if DROPOUT:
        inv_l = inv_l * dropout_scale
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)

    if MASK == MASK_NONE:  # late, as the early exit's registers note says
        o_ptrs = Out + off_z * stride_oz + off_h * stride_oh + rows * stride_om + offs_dv[None, :]
        lse_ptrs = Lse + off_z * stride_lz + off_h * stride_lh + q_start + offs_m
    _store(o_ptrs, lse_ptrs, out, lse, m_in, dv_mask, PAD_HEAD)


@triton.jit
def _store(o_ptrs, lse_ptrs, out, lse, m_in, dv_mask, PAD_HEAD: tl.constexpr):
    """The block's output rows (in the output's dtype) and their log-sum-exp."""
    if PAD_HEAD:
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=m_in[:, None] & dv_mask[None, :])
    else:
        tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=m_in[:, None])
    tl.store(lse_ptrs, lse, mask=m_in)


@triton.jit
def _online_softmax(acc, m_i, l_i, s, start_n, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                    qk_scale, v_desc, v_ptrs, stride_vn, dv_mask, bias_ptrs, stride_bn, philox_seed, philox_offset,
                    dropout_threshold, drop_rows, max_seqlen_k,
                    MASK: tl.constexpr, MASKED: tl.constexpr, PAD_HEAD: tl.constexpr, DROPOUT: tl.constexpr,
                    BIAS: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key block's step of the online softmax: ``s``, the block's raw scores ``q k^T``
    (keys ``start_n ..``), folded into the running output ``acc``, max ``m_i`` and sum
    ``l_i`` (log2 domain). ``MASKED``: the block is on the window's edge (or the sequence's
    end) and its scores and values are masked."""
    n_off = tl.cast(start_n, tl.int64)
    cols = start_n + offs_n
    n_in = cols < seqlen_k
    s = s * qk_scale
    if BIAS != BIAS_NONE:
        bias = tl.load(bias_ptrs + n_off * stride_bn, mask=m_in[:, None] & n_in[None, :], other=0.0)
        s += bias_log2(bias)
    if MASKED:
        s = tl.where(visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), s, float("-inf"))
    m_new = tl.maximum(m_i, row_max(s))
    if MASKED or BIAS != BIAS_NONE:
        # a row that has seen no visible key yet keeps m = -inf; shift by 0 instead
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + row_sum(p)
    acc = acc * alpha[:, None]
    v = load_tile(v_desc, v_ptrs, start_n, n_off, stride_vn, n_in, dv_mask, MASKED, PAD_HEAD,  # [BLOCK_N, BLOCK_DV]
                 TMA == 2)
    if DROPOUT:
        draws = dropout_draws(philox_seed, philox_offset, drop_rows, offs_m, start_n, max_seqlen_k, BLOCK_N)
        p = drop(p, draws, dropout_threshold)
    acc = mma(p.to(v.dtype), v, acc, PRECISION)
    return acc, m_new, l_i
