"""Triton kernels of the flash-attention family.

Math (per query row i, key column j, on one head):
    s_ij = scale * q_i . k_j                  (masked entries: -inf)
    p_ij = exp(s_ij - lse_i),  lse_i = log sum_j exp(s_ij)
    o_i  = sum_j p_ij v_j
computed blockwise with the online softmax, in fp32, with base-2 exponents: the kernels
receive ``qk_scale = scale * log2(e)`` and keep the running max ``m`` and ``lse`` in the
log2 domain; ``lse`` is stored in natural log.

Masks. Row i sees column j iff ``i + diag - left <= j <= i + diag + right`` where
``diag = seqlen_k - seqlen_q`` for the bottom-right diagonal and 0 for top-left; causal
is ``right = 0``. The host passes unbounded sides as ``seqlen_q + seqlen_k`` (wider than
any row can reach), so the kernels only see non-negative window sizes.

Each program splits its key range into three runs of blocks: a masked run on the left
edge of the window, an unmasked interior (no mask arithmetic at all) and a masked run on
the right edge (diagonal, window, sequence end). Blocks outside the window are never
visited, which is what makes causal and windowed attention cheaper than full attention.

Interpreter note. The operators run these same functions in Triton's interpreter on CPU
tensors, from a second copy of this module loaded in interpreter mode (see
``aotattn.runtime.interpreter``). Triton's own ``tl.max``/``tl.sum``/``tl.zeros`` are
``@jit`` functions fixed to the mode Triton was imported in, so the kernels use only
builtins, and reduce with ``tl.reduce`` and Triton's combine functions (which the
interpreter maps to numpy). The interpreter also cannot compute on bf16 (it stores the
raw bits), so in that copy ``_mma`` widens its operands to fp32, which is exact.
"""

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _sum_combine

_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


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
    """Key ranges for query rows [row_lo, row_hi): (lo, a, b, hi).

    Blocks start at lo, a, b and step by BLOCK_N: [lo, a) and [b, hi) need masks,
    [a, b) is seen by every row in full. All are empty when no key is visible.
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
    """[BLOCK_M, BLOCK_N] mask of the (row, column) pairs that attend."""
    keep = offs_n[None, :] < seqlen_k
    if MASK != 0:
        rel = offs_n[None, :] - (offs_m[:, None] + diag)
        keep = keep & (rel >= -window_left) & (rel <= window_right)
    return keep


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, start, end,
                offs_m, offs_n, seqlen_k, diag, window_left, window_right, qk_scale,
                d_mask, dv_mask,
                MASKED: tl.constexpr, MASK: tl.constexpr, PAD_HEAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        n_off = tl.cast(start_n, tl.int64)
        if MASKED:
            n_in = (start_n + offs_n) < seqlen_k
            if PAD_HEAD:
                k = tl.load(k_ptrs + n_off * stride_kn, mask=n_in[:, None] & d_mask[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs + n_off * stride_kn, mask=n_in[:, None], other=0.0)
        else:
            if PAD_HEAD:
                k = tl.load(k_ptrs + n_off * stride_kn, mask=d_mask[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs + n_off * stride_kn)
        # [BLOCK_M, BLOCK_N]
        s = _mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION) * qk_scale
        if MASKED:
            keep = _visible(offs_m, start_n + offs_n, seqlen_k, diag, window_left, window_right, MASK)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(s))
        if MASKED:
            # a row that has seen no visible key yet keeps m = -inf; shift by 0 instead
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + _row_sum(p)
        acc = acc * alpha[:, None]
        if MASKED:
            if PAD_HEAD:
                v = tl.load(v_ptrs + n_off * stride_vn, mask=n_in[:, None] & dv_mask[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs + n_off * stride_vn, mask=n_in[:, None], other=0.0)
        else:
            if PAD_HEAD:
                v = tl.load(v_ptrs + n_off * stride_vn, mask=dv_mask[None, :], other=0.0)
            else:
                v = tl.load(v_ptrs + n_off * stride_vn)
        acc = _mma(p.to(v.dtype), v, acc, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd(
    Q, K, V, Out, Lse,
    stride_qz, stride_qh, stride_qm,
    stride_kz, stride_kh, stride_kn,
    stride_vz, stride_vh, stride_vn,
    stride_oz, stride_oh, stride_om,
    stride_lz, stride_lh,
    seqlen_q, seqlen_k, group_size, head_dim, head_dim_v,
    qk_scale, window_left, window_right,
    MASK: tl.constexpr,  # 0: none, 1: window on the top-left diagonal, 2: on the bottom-right
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAD_HEAD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one query head; grid (m blocks, Hq, B)."""
    num_m_blocks = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    pid_m = tl.program_id(0)
    if MASK != 0:
        # windowed rows further down cost more; start those first
        pid_m = num_m_blocks - 1 - pid_m
    off_h = tl.program_id(1)
    off_z = tl.program_id(2).to(tl.int64)
    off_hk = (off_h // group_size).to(tl.int64)
    off_h = off_h.to(tl.int64)

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < head_dim
    dv_mask = offs_dv < head_dim_v
    m_in = offs_m < seqlen_q

    q_ptrs = Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    if PAD_HEAD:
        q = tl.load(q_ptrs, mask=m_in[:, None] & d_mask[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=m_in[:, None], other=0.0)
    # [BLOCK_N, BLOCK_D] and [BLOCK_N, BLOCK_DV] tiles at key 0; loops add start_n * stride
    k_ptrs = K + off_z * stride_kz + off_hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    v_ptrs = V + off_z * stride_vz + off_hk * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :]

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_DV), 0.0, tl.float32)

    diag = _diagonal(seqlen_q, seqlen_k, MASK)
    lo, a, b, hi = _key_blocks(start_m, tl.minimum(start_m + BLOCK_M, seqlen_q), seqlen_k, diag,
                               window_left, window_right, MASK, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, lo, a,
                                offs_m, offs_n, seqlen_k, diag, window_left, window_right, qk_scale,
                                d_mask, dv_mask, True, MASK, PAD_HEAD, BLOCK_M, BLOCK_N, PRECISION)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, a, b,
                                offs_m, offs_n, seqlen_k, diag, window_left, window_right, qk_scale,
                                d_mask, dv_mask, False, MASK, PAD_HEAD, BLOCK_M, BLOCK_N, PRECISION)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, b, hi,
                                offs_m, offs_n, seqlen_k, diag, window_left, window_right, qk_scale,
                                d_mask, dv_mask, True, MASK, PAD_HEAD, BLOCK_M, BLOCK_N, PRECISION)

    # rows that saw no key: l = 0, acc = 0 -> output 0, lse +inf
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)

    o_ptrs = Out + off_z * stride_oz + off_h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :]
    if PAD_HEAD:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None] & dv_mask[None, :])
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None])
    tl.store(Lse + off_z * stride_lz + off_h * stride_lh + offs_m, lse, mask=m_in)
