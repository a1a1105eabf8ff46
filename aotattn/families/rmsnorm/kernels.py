"""Triton kernel of the RMSNorm family: y = x / sqrt(mean(x^2) + eps) * weight, per row.

Like every family's kernels it uses builtins only (see aotattn/families/flash/kernels/common.py):
the interpreter runs this source from a copy of the module.
"""

import triton
import triton.language as tl
from triton.language.standard import _sum_combine


@triton.jit
def rmsnorm_fwd(X, W, Y, Rstd, stride_x, stride_y, n_cols, eps,
                BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """One program per row; the row fits one BLOCK (n_cols <= BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, _sum_combine) / n_cols + eps)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inside)
    tl.store(Rstd + row, rstd)
