"""Mutants: the kernels and checks with one known numerical mistake planted, test-only.

Each :class:`Mutant` is a file and one or more edits of it (an exact snippet and its
replacement): the mistake, written the way a kernel author would write it. ``AOTATTN_MUTANT=<name>``
makes a pytest run load the mutated source in place of the real module (see
:mod:`tests.mutants.loader`; nothing shipped reads it). ``python -m tests.mutants`` runs
each mutant's killer tests in a subprocess and prints the mutation score (caught /
injected); every mistake in docs/numerical-lessons.md has one here.

Snippets are kept short, unique in their file and free of leading indentation (a
statement, not its block), so that a rewrite of the kernels breaks few of them;
``tests/mutants/test_mutants.py`` fails, naming the mutant, as soon as a snippet no
longer occurs exactly once or the mutated file no longer compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = "aotattn/families/flash/kernels/"
FORWARD = KERNELS + "forward.py"
FORWARD_WS = KERNELS + "forward_ws.py"
BACKWARD = KERNELS + "backward.py"
BACKWARD_WS = KERNELS + "backward_ws.py"
COMMON = KERNELS + "common.py"
CHECKS = "aotattn/families/flash/checks.py"
HOST_CODE = (CHECKS,)
GLUON = (FORWARD_WS, BACKWARD_WS)  # sm_90 kernels, which Triton's interpreter cannot run
# The flash.forward engine whose kernel a file holds. On GPUs the table chooses the engine per
# cell (the ws kernel at every size the accuracy cases use on sm_90), so a mutant of the other
# kernel would go unseen: with a mutant of one of these files, every forward that kernel
# serves runs it (tests.mutants.loader.force_forward_engine).
FORWARD_ENGINES = {FORWARD: "triton", FORWARD_WS: "ws"}

MISTAKES = "tests/test_common_mistakes.py"
FLOOR = MISTAKES + "::test_within_floor[{case}-{{device}}]"
NULL_ROWS = "tests/test_null_logsumexp.py::test_null_rows_dense"


@dataclass(frozen=True)
class Mutant:
    """One planted mistake and the tests that must catch it.

    ``edits`` are ``(snippet, replacement)`` pairs applied to ``path``; each snippet
    must occur exactly once in the file. ``tests`` are pytest node ids (``file``,
    ``file::test`` or ``file::test[id]``) where ``{device}`` stands for ``cpu`` or
    ``cuda``; the runner also selects the device's parametrizations by marker. A node id
    that matches nothing makes pytest (and so the run) fail with an error, never a
    silent pass.
    """

    name: str
    mistake: str  # one line: what a kernel author got wrong
    path: str  # repository-relative file
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    cpu_killers: bool = False  # the killer tests are CPU checks (a compile for sm_90), whatever the device

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    @property
    def killed_on_cpu(self) -> bool:
        """Host code (argument checks) or a mistake a CPU check finds in the compiled code:
        the same on every device, run on CPU."""
        return self.path in HOST_CODE or self.cpu_killers

    @property
    def gpu_only(self) -> bool:
        """A Gluon kernel's mutant: Triton's interpreter cannot run it, only ``--device cuda`` does."""
        return self.path in GLUON

    @property
    def forward_engine(self) -> str | None:
        """The forward engine whose kernel this mutant changes (FORWARD_ENGINES), if any."""
        return FORWARD_ENGINES.get(self.path)

    def node_ids(self, device: str) -> list[str]:
        return [t.format(device="cpu" if self.killed_on_cpu else device) for t in self.tests]


def _mutant(name: str, mistake: str, path: str, snippet: str, replacement: str, *tests: str) -> Mutant:
    return Mutant(name, mistake, path, ((snippet, replacement),), tests)


MUTANTS = (
    Mutant(
        "prescaled-q-rounded", "Q multiplied by the softmax scale and rounded back to its dtype before Q K^T",
        FORWARD,
        (("0, 0, m_in, d_mask, True, PAD_HEAD)", "0, 0, m_in, d_mask, True, PAD_HEAD)\n    q = (q * qk_scale).to(q.dtype)"),
         ("s = s * qk_scale", "s = s")),
        (FLOOR.format(case="sharp-fp16-split"),),
    ),
    _mutant(
        "running-max-nan", "a row that has seen no visible key keeps m = -inf and computes exp2(-inf - -inf) = NaN",
        FORWARD,
        'm_use = tl.where(m_new == float("-inf"), 0.0, m_new)',
        "m_use = m_new",
        NULL_ROWS,
    ),
    _mutant(
        "max-before-scale",
        "the running max taken over unscaled scores and scaled afterwards (a negative scale turns it into the min)",
        FORWARD,
        "m_new = tl.maximum(m_i, row_max(s))",
        "m_new = tl.maximum(m_i, row_max(s / qk_scale) * qk_scale)",
        FLOOR.format(case="zero-scale-fp16-split"), FLOOR.format(case="large-negative-scale-fp16-fused"),
    ),
    _mutant(
        "mask-before-scale",
        "masked scores set to -inf before the scale multiplies them (-inf times a negative scale is +inf)",
        FORWARD,
        's = tl.where(visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), s, float("-inf"))',
        's = tl.where(visible(offs_m, cols, seqlen_k, diag, window_left, window_right, MASK), s / qk_scale,'
        ' float("-inf")) * qk_scale',
        FLOOR.format(case="negative-scale-fp16-split"), FLOOR.format(case="negative-scale-bf16-fused"),
    ),
    _mutant(
        "p-truncated", "P converted to the input dtype by truncation (round toward zero) instead of to nearest",
        FORWARD,
        "acc = mma(p.to(v.dtype), v, acc, PRECISION)",
        'acc = mma(p.to(v.dtype, fp_downcast_rounding="rtz"), v, acc, PRECISION)',
        MISTAKES + "::test_rounding_is_unbiased",
    ),
    _mutant(
        "lse-log2", "the log-sum-exp stored in the kernel's base-2 domain instead of natural log",
        FORWARD,
        "(m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)",
        "(m_i + tl.log2(tl.where(empty, 1.0, l_i))))",
        FLOOR.format(case="sharp-fp16-split"),
    ),
    _mutant(
        "delta-low-precision", "delta = rowsum(dO * O) reduced in the input dtype instead of fp32",
        BACKWARD,
        "delta = row_sum(o.to(tl.float32) * do.to(tl.float32))",
        "delta = row_sum((o.to(tl.float32) * do.to(tl.float32)).to(o.dtype))",
        MISTAKES + "::test_delta_is_fp32_accurate", MISTAKES + "::test_split_dq_kernel_writes_the_preprocess_stats",
    ),
    _mutant(
        "empty-row-nan", "the output divided by l with no guard for rows that saw no key (0 * inf = NaN)",
        FORWARD,
        "inv_l = 1.0 / tl.where(empty, 1.0, l_i)",
        "inv_l = 1.0 / l_i",
        NULL_ROWS,
    ),
    _mutant(
        "empty-row-lse", "lse = m + log(l) with no guard for rows that saw no key (-inf instead of +inf)",
        FORWARD,
        'lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)',
        "lse = (m_i + tl.log2(l_i)) * LN2",
        NULL_ROWS,
    ),
    _mutant(
        "empty-row-unwritten", "rows that saw no key are skipped at the store, leaving whatever the buffer held",
        FORWARD,
        "tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=m_in[:, None])",
        'tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=(m_in & (lse != float("inf")))[:, None])',
        NULL_ROWS,
    ),
    _mutant(
        "dropout-offset-bwd", "the backward draws its dropout mask at another Philox offset than the forward",
        BACKWARD,
        "draws_t = tl.trans(dropout_draws(philox_seed, philox_offset, ",
        "draws_t = tl.trans(dropout_draws(philox_seed, philox_offset + 1, ",
        MISTAKES + "::test_dropout_counter_is_64_bit", "tests/families/flash/test_dropout.py",
    ),
    Mutant(
        "diagonal-bwd", "the key-major backward aligns the window top-left while the forward aligns it bottom-right",
        BACKWARD,
        (("key_blocks(start_n, tl.minimum(start_n + BLOCK_N, seqlen_k), seqlen_q, -diag,",
          "key_blocks(start_n, tl.minimum(start_n + BLOCK_N, seqlen_k), seqlen_q, 0,"),
         ("keep = visible(offs_n, rows, seqlen_q, -diag, window_right, window_left, MASK)",
          "keep = visible(offs_n, rows, seqlen_q, 0, window_right, window_left, MASK)")),
        (FLOOR.format(case="masked-rows-br-fp16-split"),),
    ),
    _mutant(
        "window-start-unclamped",
        "a window's first block computed from a negative column by truncating division (no clamp to 0)",
        COMMON,
        "lo = tl.maximum(row_lo + diag - window_left, 0)",
        "lo = row_lo + diag - window_left",
        FLOOR.format(case="window-left-unbounded-fp16-split"), FLOOR.format(case="masked-rows-br-fp16-split"),
    ),
    _mutant(
        "drop-counter-int32",
        "the Philox counter computed in 32 bits (((b * Hq + h) * Sq + i) * 4 * ceil(Sk / 32) overflows)",
        COMMON,
        "idx = (row_base + rows.to(tl.int64))[:, None] * (((max_seqlen_k + 31) // 32) * 4) + calls[None, :]",
        "idx = (row_base.to(tl.int32) + rows)[:, None] * (((max_seqlen_k + 31) // 32) * 4) + calls[None, :]",
        MISTAKES + "::test_dropout_counter_is_64_bit",
    ),
    _mutant(
        "store-padded-dv", "the output store bounded by the padded head dim (the bucket) instead of the real one",
        FORWARD,
        "tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=m_in[:, None] & dv_mask[None, :])",
        "tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=m_in[:, None])",
        MISTAKES + "::test_padded_head_dim_store_stays_in_its_row",
    ),
    _mutant(
        "oor-keys-unmasked",
        "key-major backward: keys past seqlen_k (zeros) keep p = exp2(-lse2), which overflows fp16 into dQ",
        BACKWARD,
        "ds_t = tl.where(n_in[:, None], ds_t, 0.0)",
        "ds_t = tl.where(n_in[:, None], ds_t, ds_t)",
        MISTAKES + "::test_one_key_rows_with_very_negative_lse",
    ),
    Mutant(
        "tail-zeroed-after-dk",
        "the dQ path's zeroing of dS past seqlen_k placed after the dK product, whose running wgmma reads dS's registers",
        BACKWARD,
        (("if ATOMIC_DQ and tail:", "if False:"),
         ("dk = mma(ds_t.to(q.dtype), q, dk, PRECISION)",
          "dk = mma(ds_t.to(q.dtype), q, dk, PRECISION)\n"
          "            if ATOMIC_DQ and tail:\n"
          "                ds_t = tl.where(n_in[:, None], ds_t, 0.0)")),
        ("tests/compiler/test_ptx_hazards.py::test_the_kernel_the_h200_caught_compiles_without_the_hazard",),
        cpu_killers=True,
    ),
    _mutant(
        "bias-unclamped",
        "a finite bias multiplied by log2(e) as it is: beyond 2.36e38 the product overflows float32 "
        "(torch.finfo(dtype).min masks hide every key of a padded row, +3e38 gives NaN)",
        COMMON,
        "return b * LOG2E",
        "return bias.to(tl.float32) * LOG2E",
        "tests/families/flash/test_bias.py::test_biases_beyond_the_float32_product_keep_their_order[{device}]",
        "tests/families/flash/test_bias.py::test_finfo_min_masks_match_pytorch[split-fp32-{device}]",
    ),
    _mutant(
        "window-right-minus-2", "a right window bound of -2 (or less) accepted as unbounded instead of rejected",
        CHECKS,
        "if left < -1 or right < -1:",
        "if left < -1:",
        MISTAKES + "::test_window_bounds_below_minus_one_are_rejected",
    ),
    _mutant(
        "unbounded-as-minus-one", "the -1 that means 'unbounded' handed to the kernel as a window size",
        CHECKS,
        "left = wide if self.window_left < 0 else min(self.window_left, wide)",
        "left = self.window_left if self.window_left < 0 else min(self.window_left, wide)",
        FLOOR.format(case="window-left-unbounded-fp16-split"),
    ),
)

# The same mistakes in the warp-specialized kernels (kernels/forward_ws.py, backward_ws.py),
# which the sm_90 tables choose at most cells they serve: sm_90 GPUs only. (The ws forward's
# padded-head store has no mutant: at the padded-head test's cells the tables choose
# TMA_STORE, whose descriptor spans the real head dim, so no killer reaches the masked
# register store.)
WS_P = "p_op = gl.convert_layout(p.to(dtype), p_layout)"
WS_P_RTZ = 'p_op = gl.convert_layout(p.to(dtype, fp_downcast_rounding="rtz"), p_layout)'
WS_LSE = "(m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)"
MUTANTS += (
    _mutant(
        "ws-running-max-nan", "ws forward: a masked block with no visible key for a row shifts by m = -inf (NaN)",
        FORWARD_WS,
        'm_use = gl.where(m_new == float("-inf"), 0.0, m_new)',
        "m_use = m_new",
        FLOOR.format(case="one-key-fp16-split"), FLOOR.format(case="masked-rows-br-fp16-split"),
    ),
    _mutant(
        "ws-max-before-scale",
        "ws forward: the unmasked blocks' max taken over the raw scores whatever the scale's sign (the min for a "
        "negative scale)",
        FORWARD_WS,
        "top = gl.min(s, axis=1)",
        "top = gl.max(s, axis=1)",
        FLOOR.format(case="large-negative-scale-fp16-fused"),
    ),
    _mutant(
        "ws-mask-before-scale", "ws forward: masked scores set to -inf before the scale multiplies them",
        FORWARD_WS,
        's = gl.where(keep, s * qk_scale, float("-inf"))',
        's = gl.where(keep, s, float("-inf")) * qk_scale',
        FLOOR.format(case="negative-scale-fp16-split"), FLOOR.format(case="negative-scale-bf16-fused"),
    ),
    Mutant(
        "ws-p-truncated", "ws forward: P converted to the input dtype by truncation instead of to nearest",
        FORWARD_WS,
        ((WS_P + "\n        for i in range(1, n_blocks):", WS_P_RTZ + "\n        for i in range(1, n_blocks):"),
         (WS_P, WS_P_RTZ)),
        (MISTAKES + "::test_rounding_is_unbiased",),
    ),
    _mutant(
        "ws-lse-log2", "ws forward: the log-sum-exp stored in base 2 instead of natural log",
        FORWARD_WS,
        WS_LSE,
        WS_LSE.replace(" * LN2)", ")"),
        FLOOR.format(case="sharp-fp16-split"),
    ),
    _mutant(
        "ws-empty-row-nan", "ws forward: the output divided by l with no guard for rows that saw no key",
        FORWARD_WS,
        "inv_l = 1.0 / gl.where(empty, 1.0, l_i)",
        "inv_l = 1.0 / l_i",
        FLOOR.format(case="masked-rows-br-fp16-split"),
    ),
    _mutant(
        "ws-empty-row-lse", "ws forward: lse = m + log(l) with no guard for rows that saw no key (-inf, not +inf)",
        FORWARD_WS,
        'lse = gl.where(empty, float("inf"), ' + WS_LSE,
        "lse = (m_i + gl.log2(l_i)) * LN2",
        FLOOR.format(case="masked-rows-br-fp16-split"),
    ),
    _mutant(
        "ws-diagonal-bwd", "ws backward: the mask of a step's probabilities aligned top-left where the call is bottom-right",
        BACKWARD_WS,
        "rel = keys[:, None] - (rows[None, :] + diag)",
        "rel = keys[:, None] - rows[None, :]",
        "tests/families/flash/test_backward_ws.py::test_it_matches_the_reference_with_every_knob_value[causal-sq-longer]",
    ),
)

BY_NAME = {m.name: m for m in MUTANTS}
