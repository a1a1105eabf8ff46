"""Rows that see no key: output exactly 0, log-sum-exp +inf, gradients exactly 0.

Every mask mode (none: only an empty key set leaves a row without keys; windows on the
top-left and on the bottom-right diagonal, causal included), dense and varlen, both
backward backends (the fused one with atomics and deterministic). Keys that no query
sees get dK = dV = 0 exactly. Everything else matches the float64 reference within the
rounding floor (dense) or the tolerance (varlen), and nothing is NaN: a kernel that
computes exp(-inf - -inf), divides by l = 0 or skips the store of such a row fails here.
"""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn import reference
from tests.families.flash.helpers import seed_from
from tests.helpers import (DEVICES, TOLERANCE, assert_within_floor, exact_attention, floor_attention,
                           kernel_attention, rel_err)

VARIANTS = [
    pytest.param(("split", False), id="split"),
    pytest.param(("fused", False), id="fused-atomic"),
    pytest.param(("fused", True), id="fused-deterministic"),
]

# (Sq, Sk) per device and the mask; each leaves some rows, and some keys, unseen.
SIZES = {"cpu": {"short-keys": (40, 17), "no-keys": (20, 0)},
         "cuda": {"short-keys": (3001, 1000), "no-keys": (1500, 0)}}
MASKS = [
    pytest.param(("no-keys", {}), id="none-no-keys"),
    pytest.param(("no-keys", {"causal": True, "diagonal": "top_left"}), id="causal-tl-no-keys"),
    pytest.param(("short-keys", {"causal": True}), id="causal-br"),  # rows i < Sq - Sk
    pytest.param(("short-keys", {"window_size": (3, 0)}), id="window-br"),
    pytest.param(("short-keys", {"window_size": (-1, 2)}), id="right-only-br"),  # rows i < Sq - Sk - 2
    pytest.param(("short-keys", {"window_size": (0, 0)}), id="band-br"),
    pytest.param(("short-keys", {"window_size": (2, 0), "diagonal": "top_left"}), id="window-tl"),  # i > Sk + 1
    pytest.param(("short-keys", {"window_size": (3, -1), "diagonal": "top_left"}), id="left-only-tl"),
    pytest.param(("short-keys", {"window_size": (0, 0), "diagonal": "top_left"}), id="band-tl"),
]
# backend, deterministic, dtype, head dim: fp16 with D = 32 runs the unpadded (aligned)
# kernels, bf16 with D = 40 the padded ones
DENSE_VARIANTS = [
    pytest.param(("split", False, torch.float16, 32), id="split-fp16-d32"),
    pytest.param(("fused", False, torch.float16, 32), id="fused-atomic-fp16-d32"),
    pytest.param(("fused", True, torch.float16, 32), id="fused-deterministic-fp16-d32"),
    pytest.param(("split", False, torch.bfloat16, 40), id="split-bf16-d40"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", DENSE_VARIANTS)
@pytest.mark.parametrize("case", MASKS)
def test_null_rows_dense(request, device, variant, case):
    seed_from(request.node.name)
    (size, mask), (backend, deterministic, dtype, head_dim) = case, variant
    seqlen_q, seqlen_k = SIZES[device][size]
    batch, heads_q, heads_k = (1, 2, 1) if device == "cpu" else (2, 8, 2)
    q, k, v, dout = (torch.randn(batch, s, h, head_dim, device=device).to(dtype)
                     for s, h in ((seqlen_q, heads_q), (seqlen_k, heads_k), (seqlen_k, heads_k), (seqlen_q, heads_q)))
    kernel = kernel_attention(q, k, v, dout, backend=backend, deterministic=deterministic, **mask)
    exact = exact_attention(q, k, v, dout, **mask)
    assert torch.isinf(exact.lse).any(), "the case must have rows that see no key"
    assert_within_floor(kernel, floor_attention(q, k, v, dout, **mask), exact, dtype, device)
    unseen = ~reference.visible(seqlen_q, seqlen_k, device=device, **mask).any(0)  # (Sk,)
    assert (kernel.dk[:, unseen] == 0).all() and (kernel.dv[:, unseen] == 0).all(), "a key no query sees has dK/dV != 0"


# (seqlen_q, seqlen_k) per sequence: empty key sets, empty query sets, Sq > Sk and Sq = Sk
VARLEN = {"cpu": [(5, 0), (7, 3), (0, 4), (12, 5), (3, 3), (9, 0)],
          "cuda": [(500, 0), (777, 300), (0, 400), (1500, 600), (300, 300), (900, 0)]}
VARLEN_MASKS = [
    pytest.param({}, id="none"),
    pytest.param({"causal": True}, id="causal-br"),
    pytest.param({"window_size": (0, 0)}, id="band-br"),
    pytest.param({"window_size": (2, 0), "diagonal": "top_left"}, id="window-tl"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mask", VARLEN_MASKS)
def test_null_rows_varlen(request, device, variant, mask):
    """Per sequence: a sequence without keys, and per-sequence diagonals that leave rows out."""
    seed_from(request.node.name)
    lengths = VARLEN[device]
    cu_q, cu_k = (torch.tensor([0] + [n[i] for n in lengths], device=device).cumsum(0).to(torch.int32)
                  for i in (0, 1))
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    heads_q, heads_k = (2, 1) if device == "cpu" else (8, 2)
    q, k, v, dout = (torch.randn(n, h, 32, device=device, dtype=torch.float16)
                     for n, h in ((total_q, heads_q), (total_k, heads_k), (total_k, heads_k), (total_q, heads_q)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    out, lse = aotattn.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, return_lse=True,
                                              backend=variant[0], deterministic=variant[1], **mask)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference.attention_varlen(*ref_in, cu_q, cu_k, **mask)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    empty = torch.isinf(ref_lse)  # (Hq, total_q)
    assert empty.any(), "the case must have rows that see no key"
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"{name}: NaN"
    assert torch.equal(torch.isinf(lse), empty) and torch.isposinf(lse[empty]).all(), "lse of empty rows != +inf"
    assert (out[empty.T] == 0).all() and (dq[empty.T] == 0).all(), "an empty row has a nonzero output or dQ"
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        assert rel_err(got, want) < TOLERANCE[torch.float16], name
    finite = ~empty
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=2e-4)
    unseen = torch.cat([~reference.visible(sq, sk, device=device, **mask).any(0) for sq, sk in lengths])
    assert (dk[unseen] == 0).all() and (dv[unseen] == 0).all(), "a key no query sees has dK/dV != 0"
