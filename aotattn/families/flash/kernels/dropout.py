"""Dropout's keep-mask on its own, and the raw Philox stream the tests check.

The keep decision of element (batch b, query head h, row i, column
``j = 32 g + 8 e + 2 p + a``) is half ``a`` (low or high 16 bits) of word ``e`` of
Philox4x32-10 (Salmon et al., SC'11) keyed by the call's seed, at counter (idx_lo, idx_hi,
offset_lo, offset_hi) with the 64-bit
``idx = ((b * Hq + h) * max_seqlen_q + i) * 4 * ceil(max_seqlen_k / 32) + 4 g + p``; an
element is kept when that 16-bit draw is >= ``round(dropout_p * 2**16)``. One call serves
the eight columns one thread of the wgmma accumulator holds (:func:`.common.dropout_draws`). The forward, the backward and
``dropout_mask_kernel`` evaluate the same draws (:func:`.common.dropout_draws`) against the
same threshold, so the mask is bit-identical between them.
"""

import triton
import triton.language as tl

from aotattn.families.flash.kernels.common import dropout_keep, philox_word


@triton.jit
def philox_words(Out, seed, offset, base, n, BLOCK: tl.constexpr):
    """Out[i] = philox_word(seed, offset, base + i) for i < n (checked against Random123)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Out + i, philox_word(seed, offset, base + i.to(tl.int64)).to(tl.int64), mask=i < n)


@triton.jit
def dropout_mask_kernel(
    Mask, stride_mz, stride_mh, stride_mm,
    max_seqlen_q, max_seqlen_k, num_heads_q, dropout_threshold, philox_seed, philox_offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The keep-mask the attention kernels use, as int8 (B, Hq, max_seqlen_q, max_seqlen_k)."""
    off_h = tl.program_id(1)
    off_z = tl.program_id(2)
    drop_rows = (off_z.to(tl.int64) * num_heads_q + off_h) * max_seqlen_q
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_in = offs_m < max_seqlen_q
    ptrs = (Mask + off_z.to(tl.int64) * stride_mz + off_h.to(tl.int64) * stride_mh
            + offs_m[:, None].to(tl.int64) * stride_mm)
    for start_n in range(0, max_seqlen_k, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(philox_seed, philox_offset, dropout_threshold, drop_rows, offs_m, start_n,
                            max_seqlen_k, BLOCK_N)
        tl.store(ptrs + cols[None, :], keep.to(tl.int8), mask=m_in[:, None] & (cols < max_seqlen_k)[None, :])
