"""Mutants: the kernels and checks with one known numerical mistake planted, test-only.

Each :class:`Mutant` is a file, an exact snippet of it and the snippet's replacement:
the mistake, written the way a kernel author would write it. ``AOTATTN_MUTANT=<name>``
makes a pytest run load the mutated source in place of the real module (see
:mod:`tests.mutants.loader`; nothing shipped reads it). ``python -m tests.mutants`` runs
each mutant's killer tests in a subprocess and prints the mutation score (caught /
injected); every mistake in docs/numerical-lessons.md has one here.

Anchors are kept short and unique (a line, with a neighbour where the line repeats), so
that a rewrite of the kernels breaks few of them; ``tests/mutants/test_mutants.py``
fails, naming the mutant, as soon as an anchor no longer matches exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = "aotattn/families/flash/kernels.py"
CHECKS = "aotattn/families/flash/checks.py"

MISTAKES = "tests/test_common_mistakes.py"
NULL_LSE = "tests/test_null_logsumexp.py"


@dataclass(frozen=True)
class Mutant:
    """One planted mistake and the tests that must catch it.

    ``tests`` are pytest node ids (files or ``file::test``), ``keyword`` an optional
    ``-k`` expression narrowing them; the runner adds the device marker.
    """

    name: str
    mistake: str  # one line: what a kernel author got wrong
    path: str  # repository-relative file
    original: str  # occurs exactly once in the file
    replacement: str
    tests: tuple[str, ...]
    keyword: str = ""

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    @property
    def host_only(self) -> bool:
        """Host code (argument checks): the same on every device, run on CPU."""
        return self.path != KERNELS


MUTANTS = (
    Mutant(
        "prescaled-q-rounded",
        "Q multiplied by the softmax scale and rounded back to its dtype before Q K^T",
        KERNELS,
        "        # [BLOCK_M, BLOCK_N]\n"
        "        s = _mma(q, tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), PRECISION) * qk_scale\n",
        "        # [BLOCK_M, BLOCK_N]\n"
        "        s = _mma((q * qk_scale).to(q.dtype), tl.trans(k), tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32),"
        " PRECISION)\n",
        (MISTAKES + "::test_within_floor",), "sharp",
    ),
    Mutant(
        "running-max-nan",
        "a row that has seen no visible key keeps m = -inf and computes exp2(-inf - -inf) = NaN",
        KERNELS,
        '            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)\n',
        "            m_use = m_new\n",
        (NULL_LSE,),
    ),
    Mutant(
        "max-before-scale",
        "the running max taken over unscaled scores and scaled afterwards (a negative scale turns it into the min)",
        KERNELS,
        "        m_new = tl.maximum(m_i, _row_max(s))\n",
        "        m_new = tl.maximum(m_i, _row_max(s / qk_scale) * qk_scale)\n",
        (MISTAKES + "::test_within_floor",), "large-negative-scale or zero-scale",
    ),
    Mutant(
        "mask-before-scale",
        "masked scores set to -inf before the scale multiplies them (-inf times a negative scale is +inf)",
        KERNELS,
        '            s = tl.where(_visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), s, float("-inf"))\n',
        '            s = tl.where(_visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), s / qk_scale,'
        ' float("-inf")) * qk_scale\n',
        (MISTAKES + "::test_within_floor",), "negative-scale",
    ),
    Mutant(
        "p-truncated",
        "P converted to the input dtype by truncation (round toward zero) instead of to nearest",
        KERNELS,
        "        acc = _mma(p.to(v.dtype), v, acc, PRECISION)\n",
        '        acc = _mma(p.to(v.dtype, fp_downcast_rounding="rtz"), v, acc, PRECISION)\n',
        (MISTAKES + "::test_rounding_is_unbiased",),
    ),
    Mutant(
        "lse-log2",
        "the log-sum-exp stored in the kernel's base-2 domain instead of natural log",
        KERNELS,
        "(m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)\n",
        "(m_i + tl.log2(tl.where(empty, 1.0, l_i))))\n",
        (MISTAKES + "::test_within_floor",), "sharp",
    ),
    Mutant(
        "delta-low-precision",
        "delta = rowsum(dO * O) reduced in the input dtype instead of fp32",
        KERNELS,
        "_row_sum(o * do), mask=m_in)\n",
        "_row_sum((o * do).to(DO.dtype.element_ty)), mask=m_in)\n",
        (MISTAKES + "::test_delta_is_fp32_accurate",),
    ),
    Mutant(
        "empty-row-nan",
        "the output divided by l with no guard for rows that saw no key (0 * inf = NaN)",
        KERNELS,
        "    inv_l = 1.0 / tl.where(empty, 1.0, l_i)\n",
        "    inv_l = 1.0 / l_i\n",
        (NULL_LSE,),
    ),
    Mutant(
        "empty-row-lse",
        "lse = m + log(l) with no guard for rows that saw no key (-inf instead of +inf)",
        KERNELS,
        '    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)\n',
        "    lse = (m_i + tl.log2(l_i)) * LN2\n",
        (NULL_LSE,),
    ),
    Mutant(
        "empty-row-unwritten",
        "rows that saw no key are skipped at the store, leaving whatever the buffer held",
        KERNELS,
        "        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None])\n",
        "        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(m_in & (l_i > 0))[:, None])\n",
        (NULL_LSE,),
    ),
    Mutant(
        "dropout-offset-bwd",
        "the backward draws its dropout mask at another Philox offset than the forward",
        KERNELS,
        "z_t = _dropout_keep(seed, offset, threshold, drop_base, rows[None, :], offs_n[:, None], max_seqlen_k)\n",
        "z_t = _dropout_keep(seed, offset + 1, threshold, drop_base, rows[None, :], offs_n[:, None], max_seqlen_k)\n",
        (MISTAKES + "::test_dropout_counter_is_64_bit", "tests/families/flash/test_dropout.py"),
    ),
    Mutant(
        "diagonal-bwd",
        "the key-major backward aligns the window top-left while the forward aligns it bottom-right",
        KERNELS,
        "    diag = _diagonal(seqlen_q, seqlen_k, MASK)\n    # the queries that see these keys",
        "    diag = 0\n    # the queries that see these keys",
        (MISTAKES + "::test_within_floor",), "masked-rows-br",
    ),
    Mutant(
        "window-start-unclamped",
        "a window's first block computed from a negative column by truncating division (no clamp to 0)",
        KERNELS,
        "        lo = tl.maximum(row_lo + diag - window_left, 0)\n",
        "        lo = row_lo + diag - window_left\n",
        (MISTAKES + "::test_within_floor",), "window or masked-rows",
    ),
    Mutant(
        "drop-base-int32",
        "the forward's Philox counter base computed in 32 bits ((b * Hq + h) * Sq * Sk overflows)",
        KERNELS,
        "    off_hk = (off_h // group_size).to(tl.int64)\n"
        "    drop_base = (off_z.to(tl.int64) * num_heads_q + off_h) * max_seqlen_q * max_seqlen_k\n",
        "    off_hk = (off_h // group_size).to(tl.int64)\n"
        "    drop_base = (off_z * num_heads_q + off_h) * max_seqlen_q * max_seqlen_k\n",
        (MISTAKES + "::test_dropout_counter_is_64_bit",),
    ),
    Mutant(
        "store-padded-dv",
        "the output store bounded by the padded head dim (the bucket) instead of the real one",
        KERNELS,
        "        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None] & dv_mask[None, :])\n",
        "        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_in[:, None])\n",
        (MISTAKES + "::test_padded_head_dim_store_stays_in_its_row",),
    ),
    Mutant(
        "oor-keys-unmasked",
        "key-major backward: keys past seqlen_k (zeros) keep p = exp2(-lse2), which overflows fp16 into dQ",
        KERNELS,
        "            ds_t = tl.where(n_in[:, None], ds_t, 0.0)\n",
        "",
        (MISTAKES + "::test_one_key_rows_with_very_negative_lse", MISTAKES + "::test_within_floor"), "one-key",
    ),
    Mutant(
        "window-right-minus-2",
        "a right window bound of -2 (or less) accepted as unbounded instead of rejected",
        CHECKS,
        "    if left < -1 or right < -1:\n",
        "    if left < -1:\n",
        (MISTAKES + "::test_window_bounds_below_minus_one_are_rejected",),
    ),
    Mutant(
        "unbounded-as-minus-one",
        "the -1 that means 'unbounded' handed to the kernel as a window size",
        CHECKS,
        "        left = wide if self.window_left < 0 else min(self.window_left, wide)\n",
        "        left = self.window_left if self.window_left < 0 else min(self.window_left, wide)\n",
        (MISTAKES + "::test_within_floor",), "window",
    ),
)

BY_NAME = {m.name: m for m in MUTANTS}
