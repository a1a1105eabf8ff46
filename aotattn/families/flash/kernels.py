"""Triton kernels of the flash-attention family.

Math (per query row i, key column j, on one head):
    s_ij = scale * q_i . k_j + bias_ij        (masked entries: -inf)
    p_ij = exp(s_ij - lse_i),  lse_i = log sum_j exp(s_ij)
    o_i  = sum_j z_ij p_ij v_j / (1 - dropout_p)      z: the dropout keep-mask
computed blockwise with the online softmax, in fp32, with base-2 exponents: the kernels
receive ``qk_scale = scale * log2(e)`` and keep the running max ``m`` and ``lse`` in the
log2 domain; ``lse`` is stored in natural log.

Masks. Row i sees column j iff ``i + diag - left <= j <= i + diag + right`` where
``diag = seqlen_k - seqlen_q`` for the bottom-right diagonal and 0 for top-left; causal
is ``right = 0``. Under varlen, seqlen_q and seqlen_k are each sequence's own, so the
diagonal moves per sequence. The host passes unbounded sides as
``max_seqlen_q + max_seqlen_k`` (wider than any row can reach), so the kernels only see
non-negative window sizes.

Each program splits its key range into three runs of blocks: a masked run on the left
edge of the window, an unmasked interior (no mask arithmetic at all) and a masked run on
the right edge (diagonal, window, sequence end). Blocks outside the window are never
visited, which is what makes causal and windowed attention cheaper than full attention.

Dropout. The keep decision of element (batch b, query head h, row i, column j) is the
first word of Philox4x32-10 (Salmon et al., SC'11) keyed by the call's seed, at counter
(idx_lo, idx_hi, offset_lo, offset_hi) with the 64-bit
``idx = ((b * Hq + h) * max_seqlen_q + i) * max_seqlen_k + j``; an element is kept when
that word is >= ``dropout_p * 2**32``. Forward, backward and ``dropout_mask_kernel``
evaluate the same function, so the mask is bit-identical between them.

Interpreter note. The operators run these same functions in Triton's interpreter on CPU
tensors, from a second copy of this module loaded in interpreter mode (see
``aotattn.runtime.interpreter``). Triton's own ``tl.max``/``tl.sum``/``tl.zeros``/
``tl.randint`` are ``@jit`` functions fixed to the mode Triton was imported in, so the
kernels use only builtins, and reduce with ``tl.reduce`` and Triton's combine functions
(which the interpreter maps to numpy). The interpreter also cannot compute on bf16 (it
stores the raw bits), so in that copy ``_mma`` widens its operands to fp32, which is
exact.
"""

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _row_max(x):
    return tl.reduce(x, 1, _elementwise_max)


@triton.jit
def _row_sum(x):
    return tl.reduce(x, 1, _sum_combine)


# ----------------------------------------------------------------------------- Philox


@triton.jit
def _philox_word(seed, offset, idx):
    """First 32-bit word of Philox4x32-10 at counter (idx, offset) under key seed."""
    # the JIT types small integer arguments as i32, and a 32-bit shift of an i32 is poison
    idx = tl.cast(idx, tl.int64)
    offset = tl.cast(offset, tl.int64)
    seed = tl.cast(seed, tl.int64)
    c0 = idx.to(tl.uint32)
    c1 = (idx >> 32).to(tl.uint32)
    c2 = c0 * 0 + tl.cast(offset, tl.uint32)
    c3 = c0 * 0 + tl.cast(offset >> 32, tl.uint32)
    k0 = tl.cast(seed, tl.uint32)
    k1 = tl.cast(seed >> 32, tl.uint32)
    m0 = tl.cast(0xD2511F53, tl.uint32)
    m1 = tl.cast(0xCD9E8D57, tl.uint32)
    w0 = tl.cast(0x9E3779B9, tl.uint32)
    w1 = tl.cast(0xBB67AE85, tl.uint32)
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, m0)
        lo0 = c0 * m0
        hi1 = tl.umulhi(c2, m1)
        lo1 = c2 * m1
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = k0 + w0
        k1 = k1 + w1
    return c0


@triton.jit
def _dropout_keep(seed, offset, threshold, base, rows, cols, max_seqlen_k):
    """Keep-mask of the elements (rows, cols), broadcast tensors of positions."""
    idx = base + rows.to(tl.int64) * max_seqlen_k + cols
    return _philox_word(seed, offset, idx).to(tl.int64) >= threshold


@triton.jit
def philox_words(Out, seed, offset, base, n, BLOCK: tl.constexpr):
    """Out[i] = _philox_word(seed, offset, base + i) for i < n (checked against Random123)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + i, _philox_word(seed, offset, base + i.to(tl.int64)).to(tl.int64), mask=i < n)


# ------------------------------------------------------------------ sequences and masks


@triton.jit
def _sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q, max_seqlen_k, VARLEN: tl.constexpr):
    """(first row of q, seqlen_q, first row of k, seqlen_k) of batch entry off_z."""
    if VARLEN:
        q_start = tl.load(CuSeqlensQ + off_z)
        k_start = tl.load(CuSeqlensK + off_z)
        seqlen_q = tl.load(CuSeqlensQ + off_z + 1) - q_start
        seqlen_k = tl.load(CuSeqlensK + off_z + 1) - k_start
        return q_start.to(tl.int64), seqlen_q, k_start.to(tl.int64), seqlen_k
    else:
        return 0, max_seqlen_q, 0, max_seqlen_k


@triton.jit
def _diagonal(seqlen_q, seqlen_k, MASK: tl.constexpr):
    """Offset of the window's diagonal: column = row + diag."""
    if MASK == 2:
        return seqlen_k - seqlen_q
    else:
        return 0


@triton.jit
def _key_blocks(row_lo, row_hi, seqlen_k, diag, window_left, window_right,
                MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column ranges seen by rows [row_lo, row_hi): (lo, a, b, hi).

    Blocks start at lo, a, b and step by BLOCK_N: [lo, a) and [b, hi) need masks,
    [a, b) is seen by every row in full. All are empty when no column is visible.
    Written for query rows and key columns; the backward's key-major loops call it
    transposed (rows = keys, columns = queries, diag -> -diag, left <-> right).
    """
    if MASK != 0:
        lo = tl.maximum(row_lo + diag - window_left, 0)
        hi = tl.minimum(row_hi - 1 + diag + window_right + 1, seqlen_k)
        full_lo = tl.maximum(row_hi - 1 + diag - window_left, 0)
        full_hi = tl.maximum(tl.minimum(row_lo + diag + window_right + 1, seqlen_k), 0)
    else:
        lo = 0
        hi = seqlen_k
        full_lo = 0
        full_hi = seqlen_k
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    a = tl.minimum(tl.maximum((full_lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
    b = tl.minimum(tl.maximum(full_hi // BLOCK_N * BLOCK_N, a), hi)
    return lo, a, b, hi


@triton.jit
def _visible(offs_m, offs_n, seqlen_k, diag, window_left, window_right, MASK: tl.constexpr):
    """[rows, columns] mask of the pairs that attend (columns past seqlen_k never do)."""
    keep = offs_n[None, :] < seqlen_k
    if MASK != 0:
        rel = offs_n[None, :] - (offs_m[:, None] + diag)
        keep = keep & (rel >= -window_left) & (rel <= window_right)
    return keep


@triton.jit
def _load_rows(ptrs, row_off, stride, rows_in, cols_in, MASKED: tl.constexpr, PAD_HEAD: tl.constexpr):
    """A [rows, cols] tile at ptrs + row_off * stride, zero outside the tensor."""
    if MASKED:
        if PAD_HEAD:
            return tl.load(ptrs + row_off * stride, mask=rows_in[:, None] & cols_in[None, :], other=0.0)
        else:
            return tl.load(ptrs + row_off * stride, mask=rows_in[:, None], other=0.0)
    else:
        if PAD_HEAD:
            return tl.load(ptrs + row_off * stride, mask=cols_in[None, :], other=0.0)
        else:
            return tl.load(ptrs + row_off * stride)


# ---------------------------------------------------------------------------- forward


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, bias_ptrs, stride_kn, stride_vn, stride_bn, start, end,
                offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right, qk_scale,
                d_mask, dv_mask, seed, offset, threshold, drop_base, max_seqlen_k,
                MASKED: tl.constexpr, MASK: tl.constexpr, PAD_HEAD: tl.constexpr,
                DROPOUT: tl.constexpr, BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        n_off = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        n_in = cols < seqlen_k
        k = _load_rows(k_ptrs, n_off, stride_kn, n_in, d_mask, MASKED, PAD_HEAD)  # [BLOCK_N, BLOCK_D]
        # [BLOCK_M, BLOCK_N]
        s = _mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION) * qk_scale
        if BIAS:
            bias = tl.load(bias_ptrs + n_off * stride_bn, mask=m_in[:, None] & n_in[None, :], other=0.0)
            s += bias.to(tl.float32) * LOG2E
        if MASKED:
            s = tl.where(_visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), s, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(s))
        if MASKED or BIAS:
            # a row that has seen no visible key yet keeps m = -inf; shift by 0 instead
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + _row_sum(p)
        acc = acc * alpha[:, None]
        v = _load_rows(v_ptrs, n_off, stride_vn, n_in, dv_mask, MASKED, PAD_HEAD)  # [BLOCK_N, BLOCK_DV]
        if DROPOUT:
            keep = _dropout_keep(seed, offset, threshold, drop_base, offs_m[:, None], cols[None, :], max_seqlen_k)
            p = tl.where(keep, p, 0.0)
        acc = _mma(p.to(v.dtype), v, acc, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


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
    MASK: tl.constexpr,  # 0: none, 1: window on the top-left diagonal, 2: on the bottom-right
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one query head; grid (m blocks, Hq, B)."""
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    q_start, seqlen_q, k_start, seqlen_k = _sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q,
                                                     max_seqlen_k, VARLEN)
    num_m_blocks = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    pid_m = tl.program_id(0)
    if pid_m >= num_m_blocks:  # varlen: this sequence is shorter than the longest
        return
    if MASK != 0:
        # windowed rows further down cost more; start those first
        pid_m = num_m_blocks - 1 - pid_m
    off_hk = (off_h // group_size).to(tl.int64)
    drop_base = (off_z.to(tl.int64) * num_heads_q + off_h) * max_seqlen_q * max_seqlen_k
    off_h = off_h.to(tl.int64)
    off_z = off_z.to(tl.int64)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    m_in = offs_m < seqlen_q
    rows = q_start + offs_m[:, None].to(tl.int64)

    q = _load_rows(Q + off_z * stride_qz + off_h * stride_qh + rows * stride_qm + offs_d[None, :],
                   0, 0, m_in, d_mask, True, PAD_HEAD)
    # [BLOCK_N, BLOCK_D] and [BLOCK_N, BLOCK_DV] tiles at key 0; loops add start_n * stride
    keys = k_start + offs_n[:, None]
    k_ptrs = K + off_z * stride_kz + off_hk * stride_kh + keys * stride_kn + offs_d[None, :]
    v_ptrs = V + off_z * stride_vz + off_hk * stride_vh + keys * stride_vn + offs_dv[None, :]
    bias_ptrs = (Bias + off_z * stride_bz + off_h * stride_bh + offs_m[:, None].to(tl.int64) * stride_bm
                 + offs_n[None, :] * stride_bn)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_DV), 0.0, tl.float32)

    diag = _diagonal(seqlen_q, seqlen_k, MASK)
    lo, a, b, hi = _key_blocks(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), seqlen_k, diag,
                               window_left, window_right, MASK, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, bias_ptrs, stride_kn, stride_vn, stride_bn,
                                lo, a, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                                qk_scale, d_mask, dv_mask, philox_seed, philox_offset, dropout_threshold,
                                drop_base, max_seqlen_k,
                                True, MASK, PAD_HEAD, DROPOUT, BIAS, BLOCK_M, BLOCK_N, PRECISION)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, bias_ptrs, stride_kn, stride_vn, stride_bn,
                                a, b, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                                qk_scale, d_mask, dv_mask, philox_seed, philox_offset, dropout_threshold,
                                drop_base, max_seqlen_k,
                                False, MASK, PAD_HEAD, DROPOUT, BIAS, BLOCK_M, BLOCK_N, PRECISION)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, bias_ptrs, stride_kn, stride_vn, stride_bn,
                                b, hi, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right,
                                qk_scale, d_mask, dv_mask, philox_seed, philox_offset, dropout_threshold,
                                drop_base, max_seqlen_k,
                                True, MASK, PAD_HEAD, DROPOUT, BIAS, BLOCK_M, BLOCK_N, PRECISION)

    # rows that saw no key: l = 0, acc = 0 -> output 0, lse +inf
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if DROPOUT:
        inv_l = inv_l * dropout_scale
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)

    o_ptrs = Out + off_z * stride_oz + off_h * stride_oh + rows * stride_om + offs_dv[None, :]
    if PAD_HEAD:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None] & dv_mask[None, :])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None])
    tl.store(Lse + off_z * stride_lz + off_h * stride_lh + q_start + offs_m, lse, mask=m_in)


@triton.jit
def dropout_mask_kernel(
    Mask, stride_mz, stride_mh, stride_mm,
    max_seqlen_q, max_seqlen_k, num_heads_q, dropout_threshold, philox_seed, philox_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The keep-mask the attention kernels use, as int8 (B, Hq, max_seqlen_q, max_seqlen_k)."""
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    drop_base = (off_z.to(tl.int64) * num_heads_q + off_h) * max_seqlen_q * max_seqlen_k
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_in = offs_m < max_seqlen_q
    ptrs = (Mask + off_z.to(tl.int64) * stride_mz + off_h.to(tl.int64) * stride_mh
            + offs_m[:, None].to(tl.int64) * stride_mm)
    for start_n in range(0, max_seqlen_k, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = _dropout_keep(philox_seed, philox_offset, dropout_threshold, drop_base, offs_m[:, None],
                             cols[None, :], max_seqlen_k)
        tl.store(ptrs + cols[None, :], keep.to(tl.int8), mask=m_in[:, None] & (cols < max_seqlen_k)[None, :])


# --------------------------------------------------------------------------- backward
# With p = exp(s - lse) recomputed from the saved lse, z the keep-mask, r = 1 / (1 - p_drop)
# and delta_i = sum_d dO[i, d] * O[i, d]:
#     dv_j = sum_i z_ij r p_ij dO_i         dp_ij = z_ij r (dO_i . v_j)
#     ds_ij = p_ij (dp_ij - delta_i)        (= d loss / d bias_ij)
#     dq_i = scale sum_j ds_ij k_j          dk_j = scale sum_i ds_ij q_i
# Key-major programs (dK, dV) hold a key block and loop over the query blocks that see
# it, for every query head of the GQA group; query-major programs (dQ) hold a query
# block and loop over its keys. Fully masked rows have lse = +inf, so p = 0 and every
# gradient they touch is exactly 0.


@triton.jit
def attn_bwd_preprocess(
    Out, DO, Delta, CuSeqlensQ,
    stride_oz, stride_oh, stride_om,
    stride_doz, stride_doh, stride_dom,
    stride_lz, stride_lh,
    max_seqlen_q, head_dim_v,
    BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32; grid (m blocks, Hq, B)."""
    off_h = tl.program_id(1).to(tl.int64)
    off_z = tl.program_id(2)
    q_start, seqlen_q, _, _ = _sequence(CuSeqlensQ, CuSeqlensQ, off_z, max_seqlen_q, max_seqlen_q, VARLEN)
    off_z = off_z.to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_in = offs_m < seqlen_q
    rows = q_start + offs_m[:, None].to(tl.int64)
    o = _load_rows(Out + off_z * stride_oz + off_h * stride_oh + rows * stride_om + offs_dv[None, :],
                   0, 0, m_in, offs_dv < head_dim_v, True, PAD_HEAD).to(tl.float32)
    do = _load_rows(DO + off_z * stride_doz + off_h * stride_doh + rows * stride_dom + offs_dv[None, :],
                    0, 0, m_in, offs_dv < head_dim_v, True, PAD_HEAD).to(tl.float32)
    tl.store(Delta + off_z * stride_lz + off_h * stride_lh + q_start + offs_m, _row_sum(o * do), mask=m_in)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_ptrs, bias_ptrs, dbias_ptrs,
                 stride_qm, stride_dom, stride_dqm, stride_bm, stride_dbm, start, end,
                 offs_n, offs_m, n_in, seqlen_q, diag, window_left, window_right, qk_scale, sm_scale,
                 d_mask, dv_mask, seed, offset, threshold, dropout_scale, drop_base, max_seqlen_k,
                 MASKED: tl.constexpr, MASK: tl.constexpr, PAD_HEAD: tl.constexpr,
                 DROPOUT: tl.constexpr, BIAS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    for start_m in range(start, end, BLOCK_M):
        m_off = tl.cast(start_m, tl.int64)
        rows = start_m + offs_m
        m_in = rows < seqlen_q
        q = _load_rows(q_ptrs, m_off, stride_qm, m_in, d_mask, MASKED, PAD_HEAD)  # [BLOCK_M, BLOCK_D]
        do = _load_rows(do_ptrs, m_off, stride_dom, m_in, dv_mask, MASKED, PAD_HEAD)  # [BLOCK_M, BLOCK_DV]
        if MASKED:
            lse = tl.load(lse_ptr + rows, mask=m_in, other=float("inf"))
            delta = tl.load(delta_ptr + rows, mask=m_in, other=0.0)
        else:
            lse = tl.load(lse_ptr + rows)
            delta = tl.load(delta_ptr + rows)
        # [BLOCK_N, BLOCK_M]: keys down, queries across
        s_t = _mma(k, tl.trans(q), tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32), PRECISION) * qk_scale
        if BIAS != 0:
            bias_t = tl.load(bias_ptrs + m_off * stride_bm, mask=n_in[:, None] & m_in[None, :], other=0.0)
            s_t += bias_t.to(tl.float32) * LOG2E
        p_t = tl.exp2(s_t - (lse * LOG2E)[None, :])
        if MASKED:
            keep = _visible(offs_n, rows, seqlen_q, -diag, window_right, window_left, MASK)
            p_t = tl.where(keep, p_t, 0.0)
        dp_t = _mma(v, tl.trans(do), tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32), PRECISION)
        if DROPOUT:
            z_t = _dropout_keep(seed, offset, threshold, drop_base, rows[None, :], offs_n[:, None], max_seqlen_k)
            dv = _mma((tl.where(z_t, p_t, 0.0) * dropout_scale).to(do.dtype), do, dv, PRECISION)
            dp_t = tl.where(z_t, dp_t * dropout_scale, 0.0)
        else:
            dv = _mma(p_t.to(do.dtype), do, dv, PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _mma(ds_t.to(q.dtype), q, dk, PRECISION)
        if ATOMIC_DQ:
            # Keys past seqlen_k (the last key block's tail) load as zero, so their scores are 0
            # and p = exp2(-lse2), unmasked: a row whose lse is very negative (it sees one key
            # with a large negative score) overflows fp16 there, and inf * (k = 0) is NaN in dQ.
            # dK/dV drop those rows at the store; dQ sums over them, so they are zeroed here.
            ds_t = tl.where(n_in[:, None], ds_t, 0.0)
            dq = _mma(tl.trans(ds_t.to(k.dtype)), k, tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32), PRECISION)
            tl.atomic_add(dq_ptrs + m_off * stride_dqm, dq * sm_scale,
                          mask=m_in[:, None] & d_mask[None, :], sem="relaxed")
            if BIAS == 2:
                tl.store(dbias_ptrs + m_off * stride_dbm, ds_t, mask=n_in[:, None] & m_in[None, :])
    return dk, dv


@triton.jit
def _dkdv_program(
    pid_n, off_hk, off_z,
    Q, K, V, DO, DK, DV, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    stride_lz, stride_lh, stride_dqz, stride_dqh, stride_dqm,
    stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV of BLOCK_N keys of one key/value head, summed over its query heads."""
    q_start, seqlen_q, k_start, seqlen_k = _sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q,
                                                     max_seqlen_k, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= seqlen_k:  # varlen: this sequence is shorter than the longest
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    n_in = offs_n < seqlen_k
    keys = k_start + offs_n[:, None].to(tl.int64)
    k = _load_rows(K + off_z * stride_kz + off_hk * stride_kh + keys * stride_kn + offs_d[None, :],
                   0, 0, n_in, d_mask, True, PAD_HEAD)
    v = _load_rows(V + off_z * stride_vz + off_hk * stride_vh + keys * stride_vn + offs_dv[None, :],
                   0, 0, n_in, dv_mask, True, PAD_HEAD)
    dk = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    dv = tl.full((BLOCK_N, BLOCK_DV), 0.0, tl.float32)

    diag = _diagonal(seqlen_q, seqlen_k, MASK)
    # the queries that see these keys: the window transposed
    lo, a, b, hi = _key_blocks(start_n, tl.minimum(start_n + BLOCK_N, seqlen_k), seqlen_q, -diag,
                               window_right, window_left, MASK, BLOCK_M)
    for g in range(0, group_size):
        off_h = off_hk * group_size + g
        drop_base = (off_z * num_heads_q + off_h) * max_seqlen_q * max_seqlen_k
        rows = q_start + offs_m[:, None].to(tl.int64)
        q_ptrs = Q + off_z * stride_qz + off_h * stride_qh + rows * stride_qm + offs_d[None, :]
        do_ptrs = DO + off_z * stride_doz + off_h * stride_doh + rows * stride_dom + offs_dv[None, :]
        dq_ptrs = DQ + off_z * stride_dqz + off_h * stride_dqh + rows * stride_dqm + offs_d[None, :]
        # bias tiles read transposed: [BLOCK_N keys, BLOCK_M queries]
        bias_ptrs = (Bias + off_z * stride_bz + off_h * stride_bh + offs_m[None, :] * stride_bm
                     + offs_n[:, None].to(tl.int64) * stride_bn)
        dbias_ptrs = (DBias + off_z * stride_dbz + off_h * stride_dbh + offs_m[None, :] * stride_dbm
                      + offs_n[:, None].to(tl.int64))
        lse_ptr = Lse + off_z * stride_lz + off_h * stride_lh + q_start
        delta_ptr = Delta + off_z * stride_lz + off_h * stride_lh + q_start
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_ptrs, bias_ptrs, dbias_ptrs,
                              stride_qm, stride_dom, stride_dqm, stride_bm, stride_dbm, lo, a,
                              offs_n, offs_m, n_in, seqlen_q, diag, window_left, window_right, qk_scale,
                              sm_scale, d_mask, dv_mask, philox_seed, philox_offset, dropout_threshold,
                              dropout_scale, drop_base, max_seqlen_k,
                              True, MASK, PAD_HEAD, DROPOUT, BIAS, ATOMIC_DQ, BLOCK_M, BLOCK_N, BLOCK_D,
                              PRECISION)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_ptrs, bias_ptrs, dbias_ptrs,
                              stride_qm, stride_dom, stride_dqm, stride_bm, stride_dbm, a, b,
                              offs_n, offs_m, n_in, seqlen_q, diag, window_left, window_right, qk_scale,
                              sm_scale, d_mask, dv_mask, philox_seed, philox_offset, dropout_threshold,
                              dropout_scale, drop_base, max_seqlen_k,
                              False, MASK, PAD_HEAD, DROPOUT, BIAS, ATOMIC_DQ, BLOCK_M, BLOCK_N, BLOCK_D,
                              PRECISION)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, dq_ptrs, bias_ptrs, dbias_ptrs,
                              stride_qm, stride_dom, stride_dqm, stride_bm, stride_dbm, b, hi,
                              offs_n, offs_m, n_in, seqlen_q, diag, window_left, window_right, qk_scale,
                              sm_scale, d_mask, dv_mask, philox_seed, philox_offset, dropout_threshold,
                              dropout_scale, drop_base, max_seqlen_k,
                              True, MASK, PAD_HEAD, DROPOUT, BIAS, ATOMIC_DQ, BLOCK_M, BLOCK_N, BLOCK_D,
                              PRECISION)
    dk = dk * sm_scale
    tl.store(DK + off_z * stride_dkz + off_hk * stride_dkh + keys * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=n_in[:, None] & d_mask[None, :])
    tl.store(DV + off_z * stride_dvz + off_hk * stride_dvh + keys * stride_dvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=n_in[:, None] & dv_mask[None, :])


@triton.jit
def _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, bias_ptrs, dbias_ptrs,
               stride_kn, stride_vn, stride_bn, start, end,
               offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right, qk_scale,
               d_mask, dv_mask, seed, offset, threshold, dropout_scale, drop_base, max_seqlen_k,
               MASKED: tl.constexpr, MASK: tl.constexpr, PAD_HEAD: tl.constexpr,
               DROPOUT: tl.constexpr, BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        n_off = tl.cast(start_n, tl.int64)
        cols = start_n + offs_n
        n_in = cols < seqlen_k
        k = _load_rows(k_ptrs, n_off, stride_kn, n_in, d_mask, MASKED, PAD_HEAD)  # [BLOCK_N, BLOCK_D]
        v = _load_rows(v_ptrs, n_off, stride_vn, n_in, dv_mask, MASKED, PAD_HEAD)  # [BLOCK_N, BLOCK_DV]
        s = _mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION) * qk_scale
        if BIAS != 0:
            bias = tl.load(bias_ptrs + n_off * stride_bn, mask=m_in[:, None] & n_in[None, :], other=0.0)
            s += bias.to(tl.float32) * LOG2E
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), p, 0.0)
        dp = _mma(do, tl.trans(v), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION)
        if DROPOUT:
            z = _dropout_keep(seed, offset, threshold, drop_base, offs_m[:, None], cols[None, :], max_seqlen_k)
            dp = tl.where(z, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if BIAS == 2:
            tl.store(dbias_ptrs + n_off, ds, mask=m_in[:, None] & n_in[None, :])
        dq = _mma(ds.to(k.dtype), k, dq, PRECISION)
    return dq


@triton.jit
def _dq_program(
    pid_m, off_h, off_z,
    Q, K, V, DO, DQ, Lse, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_lz, stride_lh, stride_dqz, stride_dqh, stride_dqm,
    stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ (and dBias) of BLOCK_M query rows of one query head."""
    q_start, seqlen_q, k_start, seqlen_k = _sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q,
                                                     max_seqlen_k, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= seqlen_q:  # varlen: this sequence is shorter than the longest
        return
    off_hk = (off_h // group_size).to(tl.int64)
    off_h = off_h.to(tl.int64)
    drop_base = (off_z * num_heads_q + off_h) * max_seqlen_q * max_seqlen_k
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    m_in = offs_m < seqlen_q
    rows = q_start + offs_m[:, None].to(tl.int64)
    q = _load_rows(Q + off_z * stride_qz + off_h * stride_qh + rows * stride_qm + offs_d[None, :],
                   0, 0, m_in, d_mask, True, PAD_HEAD)
    do = _load_rows(DO + off_z * stride_doz + off_h * stride_doh + rows * stride_dom + offs_dv[None, :],
                    0, 0, m_in, dv_mask, True, PAD_HEAD)
    lse_ptr = Lse + off_z * stride_lz + off_h * stride_lh + q_start + offs_m
    lse2 = tl.load(lse_ptr, mask=m_in, other=float("inf")) * LOG2E
    delta = tl.load(Delta + off_z * stride_lz + off_h * stride_lh + q_start + offs_m, mask=m_in, other=0.0)
    keys = k_start + offs_n[:, None]
    k_ptrs = K + off_z * stride_kz + off_hk * stride_kh + keys * stride_kn + offs_d[None, :]
    v_ptrs = V + off_z * stride_vz + off_hk * stride_vh + keys * stride_vn + offs_dv[None, :]
    local_rows = offs_m[:, None].to(tl.int64)
    bias_ptrs = Bias + off_z * stride_bz + off_h * stride_bh + local_rows * stride_bm + offs_n[None, :] * stride_bn
    dbias_ptrs = DBias + off_z * stride_dbz + off_h * stride_dbh + local_rows * stride_dbm + offs_n[None, :]
    dq = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)

    diag = _diagonal(seqlen_q, seqlen_k, MASK)
    lo, a, b, hi = _key_blocks(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), seqlen_k, diag,
                               window_left, window_right, MASK, BLOCK_N)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, bias_ptrs, dbias_ptrs, stride_kn, stride_vn, stride_bn,
                    lo, a, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right, qk_scale, d_mask,
                    dv_mask, philox_seed, philox_offset, dropout_threshold, dropout_scale, drop_base,
                    max_seqlen_k, True, MASK, PAD_HEAD, DROPOUT, BIAS, BLOCK_M, BLOCK_N, PRECISION)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, bias_ptrs, dbias_ptrs, stride_kn, stride_vn, stride_bn,
                    a, b, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right, qk_scale, d_mask,
                    dv_mask, philox_seed, philox_offset, dropout_threshold, dropout_scale, drop_base,
                    max_seqlen_k, False, MASK, PAD_HEAD, DROPOUT, BIAS, BLOCK_M, BLOCK_N, PRECISION)
    dq = _dq_blocks(dq, q, do, lse2, delta, k_ptrs, v_ptrs, bias_ptrs, dbias_ptrs, stride_kn, stride_vn, stride_bn,
                    b, hi, offs_m, offs_n, m_in, seqlen_k, diag, window_left, window_right, qk_scale, d_mask,
                    dv_mask, philox_seed, philox_offset, dropout_threshold, dropout_scale, drop_base,
                    max_seqlen_k, True, MASK, PAD_HEAD, DROPOUT, BIAS, BLOCK_M, BLOCK_N, PRECISION)
    dq = dq * sm_scale
    tl.store(DQ + off_z * stride_dqz + off_h * stride_dqh + rows * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_in[:, None] & d_mask[None, :])


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, Lse, Delta, CuSeqlensQ, CuSeqlensK, Bias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    stride_lz, stride_lh, stride_bz, stride_bh, stride_bm, stride_bn,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Split backend, first kernel: dK and dV; grid (n blocks, Hk, B)."""
    _dkdv_program(tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64),
                  Q, K, V, DO, DK, DV, Lse, Delta, DK, CuSeqlensQ, CuSeqlensK, Bias, DK,
                  stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                  stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                  stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                  stride_lz, stride_lh, 0, 0, 0, stride_bz, stride_bh, stride_bm, stride_bn, 0, 0, 0,
                  max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
                  window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
                  MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, False, BLOCK_M, BLOCK_N)


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, DQ, Lse, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm, stride_lz, stride_lh,
    stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
    window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
    MASK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Split backend, second kernel: dQ (and dBias); grid (m blocks, Hq, B)."""
    _dq_program(tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64),
                Q, K, V, DO, DQ, Lse, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
                stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                stride_lz, stride_lh, stride_dqz, stride_dqh, stride_dqm,
                stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
                max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale, qk_scale,
                window_left, window_right, dropout_threshold, dropout_scale, philox_seed, philox_offset,
                MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, BLOCK_M, BLOCK_N)


@triton.jit
def attn_bwd_fused(
    Q, K, V, DO, DQ, DK, DV, Lse, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
    stride_dqz, stride_dqh, stride_dqm,
    stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
    stride_lz, stride_lh, stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
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
    num_n_blocks = (max_seqlen_k + BLOCK_N - 1) // BLOCK_N
    if ATOMIC_DQ or pid < num_n_blocks:
        _dkdv_program(pid, off_hk, off_z,
                      Q, K, V, DO, DK, DV, Lse, Delta, DQ, CuSeqlensQ, CuSeqlensK, Bias, DBias,
                      stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                      stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                      stride_dkz, stride_dkh, stride_dkn, stride_dvz, stride_dvh, stride_dvn,
                      stride_lz, stride_lh, stride_dqz, stride_dqh, stride_dqm,
                      stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
                      max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale,
                      qk_scale, window_left, window_right, dropout_threshold, dropout_scale, philox_seed,
                      philox_offset,
                      MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, ATOMIC_DQ,
                      BLOCK_M, BLOCK_N)
    else:
        num_m_blocks = (max_seqlen_q + BLOCK_M - 1) // BLOCK_M
        rest = pid - num_n_blocks
        _dq_program(rest % num_m_blocks, off_hk * group_size + rest // num_m_blocks, off_z,
                    Q, K, V, DO, DQ, Lse, Delta, CuSeqlensQ, CuSeqlensK, Bias, DBias,
                    stride_qz, stride_qh, stride_qm, stride_kz, stride_kh, stride_kn,
                    stride_vz, stride_vh, stride_vn, stride_doz, stride_doh, stride_dom,
                    stride_lz, stride_lh, stride_dqz, stride_dqh, stride_dqm,
                    stride_bz, stride_bh, stride_bm, stride_bn, stride_dbz, stride_dbh, stride_dbm,
                    max_seqlen_q, max_seqlen_k, num_heads_q, group_size, head_dim, head_dim_v, sm_scale,
                    qk_scale, window_left, window_right, dropout_threshold, dropout_scale, philox_seed,
                    philox_offset,
                    MASK, BLOCK_D, BLOCK_DV, PAD_HEAD, VARLEN, DROPOUT, BIAS, PRECISION, BLOCK_M, BLOCK_N)
