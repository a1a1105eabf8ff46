"""Masked grids run their programs in another order than launched, and every block of
every head is still computed exactly once.

Under a causal mask or a window the forward and dQ programs take their query blocks
last-first (rank 0 is the costliest block), and ``kernels/common.py`` ``program_order``
renumbers the forward, dK/dV and dQ grids across groups of heads as well; these tests are
its correctness check. The outputs are
allocated while torch fills uninitialized memory with NaN (its deterministic mode), so a
block that no program wrote fails the comparison with the float64 reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import aotattn
from aotattn import reference
from aotattn.runtime.interpreter import interpreted_module
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import make_qkv, seed_from

# (batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, window): the comment gives the
# groups of (head, batch) pairs program_order cuts the forward/dQ and the dK/dV grids into
CASES = {
    "cpu": [
        (3, 70, 70, 7, 7, 16, None),      # 21 pairs: one group of 21 (16 and the remainder)
        (5, 40, 90, 6, 2, 32, None),      # GQA, Sq < Sk: 30 pairs, one group (16 and the remainder); dK/dV 10
        (1, 33, 33, 1, 1, 16, None),      # one pair
        (4, 50, 50, 5, 5, 16, (7, 3)),    # a window: 20 pairs, one group
    ],
    "cuda": [
        (5, 4096, 4096, 7, 7, 128, None),     # 35 pairs of 32-64 blocks: groups of 2-4, the last larger
        (3, 2048, 2048, 8, 2, 256, None),     # GQA d256: dK/dV 8 MB of q and dO a pair (split), none (ws)
        (2, 3000, 5000, 12, 12, 64, (300, 0)),  # a window, Sq < Sk: 24 pairs
    ],
}


def _cases(device: str):
    return [(device, *case) for case in CASES[device]]


@pytest.mark.parametrize("device, batch, sq, sk, hq, hk, d, window",
                         _cases("cpu") + [pytest.param(*c, marks=pytest.mark.gpu) for c in _cases("cuda")])
def test_every_block_of_every_head_is_computed_once(device, batch, sq, sk, hq, hk, d, window, request):
    seed_from(request.node.name)
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = make_qkv(batch, sq, sk, hq, hk, d, d, dtype, device, requires_grad=True)
    dout = torch.randn(batch, sq, hq, d, dtype=dtype, device=device)
    mask = dict(causal=True) if window is None else dict(window_size=window)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty now fills floating tensors with NaN
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        out = aotattn.flash_attn_func(q, k, v, backend="split", **mask)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(previous)

    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    ref_out, _ = reference.attention(q64, k64, v64, **mask)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.to(torch.float64))
    tolerance = TOLERANCE[dtype]
    assert rel_err(out.detach(), ref_out) < tolerance
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_err(grad, ref) < tolerance, name


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_sequences_shorter_than_the_grid(device, request):
    """A grid sized for the longest sequence: the ranks past a shorter sequence's blocks end
    their program, whichever head and batch entry the renumbering gave them."""
    seed_from(request.node.name)
    dtype = torch.float32 if device == "cpu" else torch.float16
    lengths = [70, 13, 0, 41, 1] if device == "cpu" else [4000, 130, 0, 2500, 1, 3333]
    heads, d = (7, 16) if device == "cpu" else (9, 128)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    total, longest = sum(lengths), max(lengths)
    q, k, v = (torch.randn(total, heads, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, heads, d, dtype=dtype, device=device)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # torch.empty now fills floating tensors with NaN
    try:
        out = aotattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True, backend="split")
        grads = torch.autograd.grad(out, (q, k, v), dout)
    finally:
        torch.use_deterministic_algorithms(previous)
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    ref_out, _ = reference.attention_varlen(q64, k64, v64, cu, cu, causal=True)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.to(torch.float64))
    assert rel_err(out.detach(), ref_out) < TOLERANCE[dtype]
    for name, grad, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert rel_err(grad, ref) < TOLERANCE[dtype], name


# ------------------------------------------------------------------ the renumbering itself

_program_order = interpreted_module("aotattn.families.flash.kernels.common").program_order

# benchmarks/program_order_model.py: the list-scheduling model that chose the grouping rule
_MODEL_SPEC = importlib.util.spec_from_file_location(
    "program_order_model", Path(__file__).resolve().parents[3] / "benchmarks" / "program_order_model.py")
_model = importlib.util.module_from_spec(_MODEL_SPEC)
_MODEL_SPEC.loader.exec_module(_model)


def _interpreted(fn):
    """``@triton.jit``, run by Triton's interpreter (the knob decides at decoration)."""
    previous = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = True
    try:
        return triton.jit(fn)
    finally:
        triton.knobs.runtime.interpret = previous


@_interpreted
def _record_order(Out, streamed_bytes, MASK: tl.constexpr):
    rank, head, batch = _program_order(streamed_bytes, MASK)
    linear = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    tl.store(Out + 3 * linear, rank)
    tl.store(Out + 3 * linear + 1, head)
    tl.store(Out + 3 * linear + 2, batch)


def _launch_order(blocks: int, heads: int, batch: int, streamed_bytes: int, mask: int) -> list[tuple[int, int, int]]:
    """(rank, head, batch) of each program, in the order the hardware starts them."""
    out = torch.full((blocks * heads * batch, 3), -1, dtype=torch.int32)
    _record_order[(blocks, heads, batch)](out, streamed_bytes, mask)
    return [tuple(row) for row in out.tolist()]


@pytest.mark.parametrize("blocks, heads, batch, streamed_mb, sizes", [
    # GQA group 8, d128 s4096 (the ws backward, no L2 limit): a wave holds 4 pairs of 32 blocks
    (32, 2, 4, 0, [4, 4]),
    (32, 16, 1, 2, [4, 4, 4, 4]),   # dense d128 s4096, one batch entry: L2 allows 8, a wave 4
    (128, 8, 1, 16, [1] * 8),       # d256 s16384: 16 MB a head, 128 blocks, one at a time
    (7, 5, 3, 1, [15]),             # short: a wave would hold 18 pairs, 15 there are
    (3, 1, 1, 64, [1]),             # one pair
    (1, 40, 2, 0, [16] * 5),        # one block a head: at most 16 together
    (32, 7, 3, 0, [4, 4, 4, 4, 5]),  # 21 pairs in fours: the last group takes the remainder
    (24, 11, 1, 0, [5, 6]),         # a wave holds 5 pairs of 24 blocks
    (40, 3, 1, 4, [3]),             # L2 allows 4, a wave 3
])
def test_masked_grids_start_the_costliest_blocks_of_a_group_of_heads_first(blocks, heads, batch, streamed_mb, sizes):
    order = _launch_order(blocks, heads, batch, streamed_mb << 20, mask=1)
    pairs = heads * batch
    assert sum(sizes) == pairs
    assert _model.group_sizes(pairs, blocks, streamed_mb, "landed") == sizes  # the model models this rule
    assert sorted(order) == sorted((r, h, z) for r in range(blocks) for h in range(heads) for z in range(batch))
    first = 0
    for size in sizes:  # each group: rank by rank, its pairs in launch order
        group = order[first * blocks:(first + size) * blocks]
        assert [r for r, _, _ in group] == [r for r in range(blocks) for _ in range(size)]
        assert [h + heads * z for _, h, z in group[:size]] == list(range(first, first + size))
        first += size


def test_unmasked_grids_run_as_launched():
    order = _launch_order(5, 3, 2, 1 << 20, mask=0)
    assert order == [(r, h, z) for z in range(2) for h in range(3) for r in range(5)]
