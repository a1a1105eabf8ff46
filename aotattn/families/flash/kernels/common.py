"""Building blocks shared by the flash-attention kernels: mask geometry, tiles, Philox.

Interpreter note. The operators run these same functions in Triton's interpreter on CPU
tensors, from interpreted copies of these modules (``aotattn.runtime.interpreter``
loads each kernel module a second time and rebinds the kernels it imports from its
siblings to their interpreted copies). Triton's own ``tl.max``/``tl.sum``/``tl.zeros``/
``tl.randint`` are ``@jit`` functions fixed to the mode Triton was imported in, so the
kernels use only builtins, and reduce with ``tl.reduce`` and Triton's combine functions
(which the interpreter maps to numpy). The interpreter also cannot compute on bf16 (it
stores the raw bits), so in that copy ``mma`` widens its operands to fp32, which is
exact.
"""

import triton
import triton.language as tl
from triton.language.core import builtin
from triton.language.standard import _elementwise_max, _sum_combine

_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@builtin
def _nvidia(_semantic=None):
    """Whether this compilation targets an NVIDIA GPU: the target's, not the machine's, so
    cross-compiling sm_90 images on a CPU machine says yes and gfx942 on a GPU host no
    (``triton.language.target_info.is_cuda`` asks the local driver)."""
    return tl.constexpr(_semantic.builder.options.backend_name == "cuda")

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

# The MASK axis (aotattn.families.flash.rules): which diagonal a window is aligned to.
MASK_NONE: tl.constexpr = tl.constexpr(0)
MASK_TOP_LEFT: tl.constexpr = tl.constexpr(1)
MASK_BOTTOM_RIGHT: tl.constexpr = tl.constexpr(2)
# The BIAS axis: none, an additive bias, an additive bias whose gradient is written.
BIAS_NONE: tl.constexpr = tl.constexpr(0)
BIAS_ADD: tl.constexpr = tl.constexpr(1)
BIAS_GRAD: tl.constexpr = tl.constexpr(2)
# The largest finite bias magnitude the kernels keep: times log2(e), 3.32e38, still finite in
# float32 (beyond about 2.36e38 the product overflowed, and torch.finfo(dtype).min, the
# usual additive mask, hid every key instead of leaving them equal).
BIAS_BOUND: tl.constexpr = tl.constexpr(2.3e38)


@triton.jit
def bias_log2(bias):
    """A bias tile in the kernels' base-2 units, float32: finite values clamped to
    ``BIAS_BOUND`` in magnitude first (docs/semantics.md, Bias and masks), infinities and NaN
    kept (-inf hides a key, +inf and NaN make the row NaN, as in PyTorch; tl.minimum and
    tl.maximum would drop a NaN on the GPU)."""
    b = bias.to(tl.float32)
    b = tl.where((b < -BIAS_BOUND) & (b != float("-inf")), -BIAS_BOUND, b)
    b = tl.where((b > BIAS_BOUND) & (b != float("inf")), BIAS_BOUND, b)
    return b * LOG2E


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def row_max(x):
    return tl.reduce(x, 1, _elementwise_max)


@triton.jit
def row_sum(x):
    return tl.reduce(x, 1, _sum_combine)


# ----------------------------------------------------------------------------- Philox


@triton.jit
def philox(seed, offset, idx):
    """The four 32-bit words of Philox4x32-10 at counter (idx, offset) under key seed."""
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
    w0 = tl.cast(0x9E3779B9, tl.uint32)
    w1 = tl.cast(0xBB67AE85, tl.uint32)
    for _ in tl.static_range(10):
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo(c2, 0xCD9E8D57)
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = k0 + w0
        k1 = k1 + w1
    return c0, c1, c2, c3


@triton.jit
def _mulhilo(a, M: tl.constexpr):
    """The high and the low 32-bit halves of ``a * M`` (Philox's two multipliers)."""
    if not _INTERPRETED and _nvidia():  # constexprs: the interpreter never asks _nvidia()
        # One mul.wide (sm_90: IMAD.WIDE.U32) for both halves, where umulhi and the low
        # product are two instructions. In Triton the 64-bit product (a.to(tl.uint64) * M)
        # would do it too, but its 64-bit ops stop Triton giving the whole Philox chain the
        # accumulator's layout, and the keep-mask then goes through shared memory.
        if M == 0xD2511F53:
            return tl.inline_asm_elementwise(
                "{ .reg .b64 t; mul.wide.u32 t, $2, 0xD2511F53; mov.b64 {$1, $0}, t; }",
                "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
        else:
            tl.static_assert(M == 0xCD9E8D57)
            return tl.inline_asm_elementwise(
                "{ .reg .b64 t; mul.wide.u32 t, $2, 0xCD9E8D57; mov.b64 {$1, $0}, t; }",
                "=r,=r,r", [a], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        return tl.umulhi(a, tl.cast(M, tl.uint32)), a * tl.cast(M, tl.uint32)


@triton.jit
def philox_word(seed, offset, idx):
    """First 32-bit word of Philox4x32-10 at counter (idx, offset) under key seed."""
    c0, c1, c2, c3 = philox(seed, offset, idx)
    return c0


@triton.jit
def dropout_keep(seed, offset, threshold, row_base, rows, start_n, max_seqlen_k, BLOCK_N: tl.constexpr):
    """Keep-mask ``[len(rows), BLOCK_N]`` of the columns ``start_n .. start_n + BLOCK_N``:
    the draws of :func:`dropout_draws` that are >= ``threshold``."""
    draws = dropout_draws(seed, offset, row_base, rows, start_n, max_seqlen_k, BLOCK_N)
    return draws >= tl.cast(threshold, tl.int32)  # the JIT passes a threshold of 1 as a constexpr int


@triton.jit
def dropout_draws(seed, offset, row_base, rows, start_n, max_seqlen_k, BLOCK_N: tl.constexpr):
    """The 16-bit draws ``[len(rows), BLOCK_N]`` (as int32) of the columns ``start_n .. start_n + BLOCK_N``.

    Each 32-bit Philox word holds two 16-bit draws, and a column is kept when its draw is
    >= ``threshold`` (``dropout_p * 2**16``, rounded): column ``j = 32 g + 8 h + 2 p + a``
    of row ``r`` takes half ``a`` (0: low, 1: high) of word ``h`` of Philox4x32-10 at
    counter ``(row_base + r) * 4 * ceil(max_seqlen_k / 32) + 4 g + p``. One Philox call
    thus serves eight columns, and they are the eight one thread of Hopper's wgmma
    accumulator holds (columns 2p, 2p+1 of each 8-column group), so the interleave below
    stays in registers. ``start_n`` is a multiple of ``BLOCK_N`` >= 16.
    """
    if BLOCK_N >= 32:
        return _draw_span(seed, offset, row_base, rows, start_n, max_seqlen_k, BLOCK_N)
    else:
        tl.static_assert(BLOCK_N == 16)
        # half of the 32 columns one set of calls covers
        span = _draw_span(seed, offset, row_base, rows, start_n - start_n % 32, max_seqlen_k, 32)
        first, second = tl.split(tl.permute(tl.reshape(span, (rows.shape[0], 2, 16)), (0, 2, 1)))
        return tl.where(start_n % 32 == 0, first, second)


@triton.jit
def _draw_span(seed, offset, row_base, rows, start_n, max_seqlen_k, BLOCK_N: tl.constexpr):
    """:func:`dropout_draws` for ``start_n`` and ``BLOCK_N`` multiples of 32."""
    calls = start_n // 8 + tl.arange(0, BLOCK_N // 8)  # 4 g + p
    idx = (row_base + rows.to(tl.int64))[:, None] * (((max_seqlen_k + 31) // 32) * 4) + calls[None, :]
    c0, c1, c2, c3 = philox(seed, offset, idx)
    # per word h: [rows, 4 g + p, a]; joined: [rows, 4 g + p, a, h % 2, h // 2]
    draws = tl.join(tl.join(_halves(c0), _halves(c1)), tl.join(_halves(c2), _halves(c3)))
    draws = tl.reshape(draws, (rows.shape[0], BLOCK_N // 32, 4, 2, 2, 2))
    draws = tl.permute(draws, (0, 1, 5, 4, 2, 3))  # [rows, g, h // 2, h % 2, p, a]: column 32 g + 8 h + 2 p + a
    return tl.reshape(draws, (rows.shape[0], BLOCK_N))


@triton.jit
def _halves(word):
    """[..., 2]: the low and the high 16 bits of ``word``, as int32."""
    return tl.join((word & 0xFFFF).to(tl.int32), (word >> 16).to(tl.int32))


@triton.jit
def drop(x, draws, threshold):
    """fp32 ``x`` where its draw (:func:`dropout_draws`) is >= ``threshold``, else 0."""
    t = tl.cast(threshold, tl.int32)
    if not _INTERPRETED and _nvidia():
        # One compare and one select per element on the fp32 value. LLVM moves a select
        # past the bf16 rounding that follows it, onto the packed halves, where each
        # element then costs two byte permutes more (sm_90).
        tl.static_assert(x.dtype == tl.float32, "drop: fp32 values")
        return tl.inline_asm_elementwise(
            "{ .reg .pred k; setp.ge.s32 k, $1, $2; selp.f32 $0, $3, 0f00000000, k; }",
            "=f,r,r,f", [draws, t, x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.where(draws >= t, x, 0.0)


# ------------------------------------------------------------------------ program order

# The heads program_order starts together stream at most this much between them (a third
# of the H200's 50 MB L2), at most this many heads go together, and a group holds at most
# one wave of WAVE_PROGRAMS programs (the H100's and H200's 132 SMs).
L2_SHARE: tl.constexpr = tl.constexpr(16 * 1024 * 1024)
MAX_HEADS_TOGETHER: tl.constexpr = tl.constexpr(16)
WAVE_PROGRAMS: tl.constexpr = tl.constexpr(132)


@triton.jit
def program_order(streamed_bytes, MASK: tl.constexpr):
    """(rank, head, batch) of this program in a grid (blocks, heads, batch).

    Without a mask, the program ids as launched (rank = program id 0). Under a causal mask
    or a window, the blocks of a head cost unequal time, and the hardware starts programs
    in the order of their linear id (x fastest): program ids are then renumbered so that
    rank 0 of every head of a group starts before rank 1 of any, and so on, the caller
    giving rank 0 to its costliest block. Per head alone, the last programs of the grid are
    a head's costliest ones, and SMs wait on them (up to 13% of a d256 causal dQ grid in a
    list-scheduling model, 1% grouped; benchmarks/RESULTS.md). A group is as many heads as
    keep their ``streamed_bytes`` (what all of one head's programs read, that L2 shares
    between them) within ``L2_SHARE``, at most ``MAX_HEADS_TOGETHER``, and as fill at most
    one wave: then each group's costliest blocks start as the last group's cheapest end,
    group after group. The last group takes the remainder of the heads (so it may hold up to
    twice the others) rather than be a small group on its own, whose costliest blocks would
    start last (GQA group 8, d128 s4096 causal backward: 8 heads of 32 blocks one by one,
    1.59x the ideal in that model; in groups of 4, the ideal; in groups of 5 and 3, 1.38x;
    benchmarks/program_order_model.py).
    """
    if MASK == MASK_NONE:
        return tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        blocks = tl.num_programs(0)
        heads = tl.num_programs(1)
        pairs = heads * tl.num_programs(2)  # (head, batch) pairs
        linear = tl.program_id(0) + blocks * (tl.program_id(1) + heads * tl.program_id(2))
        by_l2 = tl.cast(tl.minimum(L2_SHARE // tl.maximum(tl.cast(streamed_bytes, tl.int64), 1), MAX_HEADS_TOGETHER),
                        tl.int32)
        together = tl.maximum(tl.minimum(by_l2, WAVE_PROGRAMS // blocks), 1)
        groups = tl.maximum(pairs // together, 1)  # the last one takes the remainder
        first = tl.minimum(linear // (together * blocks), groups - 1) * together  # the group's first pair
        size = tl.where(first == (groups - 1) * together, pairs - first, together)
        within = linear - first * blocks
        rank = within // size
        pair = first + within - rank * size
        return rank, pair % heads, pair // heads


# ------------------------------------------------------------------ sequences and masks


@triton.jit
def sequence(CuSeqlensQ, CuSeqlensK, off_z, max_seqlen_q, max_seqlen_k, VARLEN: tl.constexpr):
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
def diagonal(seqlen_q, seqlen_k, MASK: tl.constexpr):
    """Offset of the window's diagonal: column = row + diag."""
    if MASK == MASK_BOTTOM_RIGHT:
        return seqlen_k - seqlen_q
    else:
        return 0


@triton.jit
def key_blocks(row_lo, row_hi, seqlen_k, diag, window_left, window_right,
               MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column ranges seen by rows [row_lo, row_hi): (lo, a, b, hi).

    Blocks start at lo, a, b and step by BLOCK_N: [lo, a) and [b, hi) need masks,
    [a, b) is seen by every row in full. All are empty when no column is visible.
    Written for query rows and key columns; the backward's key-major loops call it
    transposed (rows = keys, columns = queries, diag -> -diag, left <-> right).
    """
    if MASK != MASK_NONE:
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
def segment(seg: tl.constexpr, lo, a, b, hi):
    """Bounds of run ``seg`` of :func:`key_blocks`' three: the masked left edge, the
    unmasked interior, the masked right edge.

    Callers loop ``for seg in tl.static_range(3)`` and pass ``seg != 1`` (masked) at each
    use: a constexpr bound to a local name before a loop reaches the loop body as a
    runtime value in Triton 3.6, and the kernel fails to compile."""
    if seg == 0:
        return lo, a
    elif seg == 1:
        return a, b
    else:
        return b, hi


@triton.jit
def run_bounds(run: tl.constexpr, lo, a, b, hi, MASK: tl.constexpr):
    """Bounds of the ``run``-th loop of a backward program over :func:`key_blocks`' runs.
    Under a mask the unmasked interior comes first, then the masked left and right edges;
    without one, the runs in order (the left one is empty). So the interior is loop
    ``0 if MASK != MASK_NONE else 1``: callers pass ``run != (0 if MASK != MASK_NONE else 1)``
    (masked) at each use, written out (a jit function's constexpr result, or a constexpr
    bound to a name, reaches a loop body as a runtime value in Triton 3.6).

    The order is a register-allocation matter: compiled for sm_90, a masked kernel's
    interior loop is shorter when it comes first (dQ causal, instructions per iteration:
    d256 m128 n64 520 -> 377 with its spill loads 15 -> 1, d128 m128 n128 539 -> 470, d64
    447 -> 416; dK/dV d256 m64 n64 917 -> 833, spill traffic 93 -> 54, its one-block
    diagonal loop 1302 -> 1383; d64/d128 dK/dV unchanged); the unmasked kernels keep their
    code (benchmarks/RESULTS.md, seventh session)."""
    return segment(run if MASK == MASK_NONE else (1 - run if run < 2 else 2), lo, a, b, hi)


@triton.jit
def visible(offs_m, offs_n, seqlen_k, diag, window_left, window_right, MASK: tl.constexpr):
    """[rows, columns] mask of the pairs that attend (columns past seqlen_k never do)."""
    keep = offs_n[None, :] < seqlen_k
    if MASK != MASK_NONE:
        rel = offs_n[None, :] - (offs_m[:, None] + diag)
        keep = keep & (rel >= -window_left) & (rel <= window_right)
    return keep


@triton.jit
def head_columns(offs, head_dim, PAD_HEAD: tl.constexpr):
    """Mask of the head-dim columns ``offs`` inside a head of ``head_dim``: all of them
    unless PAD_HEAD (unpadded variants have head_dim equal to the block). A mask the
    compiler sees as constant keeps tile stores 16 bytes wide: ``offs < head_dim`` with a
    runtime head_dim made the images store element by element (Triton's JIT had seen
    head_dim divisible by 16), 1.3-1.5x slower dK/dV at seqlen 512 (RESULTS.md)."""
    if PAD_HEAD:
        return offs < head_dim
    else:
        return tl.full(offs.shape, True, tl.int1)


@triton.jit
def load_tile(desc, ptrs, row, row_off, stride, rows_in, cols_in, MASKED: tl.constexpr, PAD_HEAD: tl.constexpr,
              DESCRIPTOR: tl.constexpr):
    """The [rows, cols] tile starting at row ``row`` (``row_off``: the same, as int64):
    through its tensor descriptor when DESCRIPTOR (rows past the tensor, and columns past a
    padded head, are zeros: the descriptor spans the real head dim), else :func:`load_rows`."""
    if DESCRIPTOR:
        return desc.load([row, 0])
    else:
        return load_rows(ptrs, row_off, stride, rows_in, cols_in, MASKED, PAD_HEAD)


@triton.jit
def load_rows(ptrs, row_off, stride, rows_in, cols_in, MASKED: tl.constexpr, PAD_HEAD: tl.constexpr):
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
