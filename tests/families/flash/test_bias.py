"""Additive bias (broadcast dimensions, gradient) and SDPA's attn_mask."""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn import reference
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import make_qkv, seed_from

SHAPES = [  # bias shape as a function of (B, H, Sq, Sk)
    pytest.param(lambda b, h, sq, sk: (b, h, sq, sk), id="full"),
    pytest.param(lambda b, h, sq, sk: (1, h, sq, sk), id="batch-broadcast"),
    pytest.param(lambda b, h, sq, sk: (b, 1, sq, sk), id="head-broadcast"),
    pytest.param(lambda b, h, sq, sk: (sq, sk), id="2d"),
    pytest.param(lambda b, h, sq, sk: (b, h, 1, sk), id="row-broadcast"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("variant", [("split", False), ("fused", False), ("fused", True)],
                         ids=["split", "fused-atomic", "fused-deterministic"])
def test_bias_forward_and_gradients(request, device, shape, variant):
    seed_from(request.node.nodeid)
    b, h, sq, sk = (2, 4, 37, 45) if device == "cpu" else (2, 8, 600, 1000)
    q, k, v = make_qkv(b, sq, sk, h, 2, 32, 32, torch.float32, device, requires_grad=True)
    bias = torch.randn(shape(b, h, sq, sk), device=device, requires_grad=True)
    out = aotattn.flash_attn_func(q, k, v, bias=bias, causal=True, backend=variant[0], deterministic=variant[1])
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    ref_out, _ = reference.attention(*ref_in[:3], bias=ref_in[3], causal=True)
    assert rel_err(out, ref_out) < TOLERANCE[torch.float32]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), dout)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert g.shape == r.shape, name
        assert rel_err(g, r) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_bias_without_grad_and_in_bf16(request, device):
    seed_from(request.node.nodeid)
    q, k, v = make_qkv(2, 33, 40, 4, 4, 64, 64, torch.bfloat16, device, requires_grad=True)
    bias = torch.randn(1, 4, 33, 40, device=device, dtype=torch.float32)
    out = aotattn.flash_attn_func(q, k, v, bias=bias, window_size=(5, 5))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention(*ref_in, bias=bias.to(torch.bfloat16).double(), window_size=(5, 5))
    assert rel_err(out, ref_out) < TOLERANCE[torch.bfloat16]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, r in zip(grads, torch.autograd.grad(ref_out, ref_in, dout.double())):
        assert rel_err(g, r) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_sdpa_attn_mask_matches_torch(request, device, kind):
    seed_from(request.node.nodeid)
    q, k, v = (t.transpose(1, 2) for t in make_qkv(2, 29, 31, 4, 4, 32, 32, torch.float32, device))
    if kind == "float":
        mask = torch.randn(2, 1, 29, 31, device=device)
    else:
        mask = torch.rand(29, 31, device=device) > 0.3
        mask[:, 0] = True  # PyTorch gives NaN on fully masked rows; keep one key per row
    out = aotattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask if kind == "bool" else mask.double())
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


def test_boolean_mask_hiding_a_whole_row_gives_zero():
    q, k, v = (t.transpose(1, 2) for t in make_qkv(1, 8, 8, 1, 1, 16, 16, torch.float32, "cpu"))
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    out = aotattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out[0, 0, 3] == 0).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("bias, exc, message", [
    (torch.randn(3, 8, 8), ValueError, "bias: expected a shape broadcastable to (B, Hq, Sq, Sk) = (1, 2, 8, 8)"),
    (torch.randn(1, 1, 1, 2, 8, 8), ValueError, "bias: expected a shape broadcastable"),
    (torch.zeros(8, 8, dtype=torch.int32), TypeError, "bias: expected dtype float16, bfloat16, float32"),
    (torch.zeros(8, 8, dtype=torch.bool), TypeError, "bias: expected dtype float16, bfloat16, float32, got"),
    (torch.zeros(8, 8, dtype=torch.float64), TypeError, "bias: expected dtype"),
    ("x", TypeError, "bias: expected a torch.Tensor"),
])
def test_bias_rejects(bias, exc, message):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(exc) as info:
        aotattn.flash_attn_func(q, k, v, bias=bias)
    assert message in str(info.value)


@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("enable_gqa", [False, True], ids=["mha", "gqa"])
def test_sdpa_is_causal_with_attn_mask_applies_both(request, kind, enable_gqa):
    """docs/semantics.md: a key is seen where the top-left causal mask and attn_mask both
    keep it (Sq != Sk, gradients included), against the float64 reference."""
    seed_from(request.node.nodeid)
    q, k, v = make_qkv(2, 13, 19, 4, 2 if enable_gqa else 4, 32, 32, torch.float32, "cpu", requires_grad=True)
    if kind == "float":
        mask = torch.randn(4, 13, 19)
    else:
        mask = torch.rand(13, 19) > 0.4
        mask[5] = False  # a row hidden by the mask alone: output 0
    out = aotattn.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask,
                                               is_causal=True, enable_gqa=enable_gqa).transpose(1, 2)
    bias = mask.double() if kind == "float" else torch.zeros(13, 19, dtype=torch.float64).masked_fill(
        ~mask, float("-inf"))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention(*ref_in, bias=bias, causal=True, diagonal="top_left")
    assert rel_err(out, ref_out) < TOLERANCE[torch.float32]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref_out, ref_in, dout.double())):
        assert rel_err(g, r) < TOLERANCE[torch.float32], name
    if kind == "bool":
        assert (out[:, 5] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["split", "fused"])
def test_finfo_min_masks_match_pytorch(request, device, dtype, backend):
    """The additive mask of transformers' models (0 where a key is kept, torch.finfo(dtype).min
    elsewhere; left padding hides the first keys of a sequence, and its padded query rows see no
    key kept) gives PyTorch's answer: float32 and bfloat16's min times log2(e) overflowed float32,
    so those keys were hidden as by -inf and a padded row gave 0 instead of the mean of the
    values. Gradients flow from the real rows only (dO is 0 on the padded ones), as in training."""
    seed_from(request.node.nodeid)
    b, h, s, pad = (2, 2, 24, 5) if device == "cpu" else (2, 8, 700, 133)
    q, k, v = (t.transpose(1, 2) for t in make_qkv(b, s, s, h, h, 32, 32, dtype, device, requires_grad=True))
    keep = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, 1, s, s).clone()
    keep[1, :, :, :pad] = False  # sequence 1 is left-padded: its first `pad` rows see no kept key
    mask = torch.zeros(b, 1, s, s, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)
    out = aotattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=mask.double())
    assert rel_err(out, expected) < TOLERANCE[dtype]
    padded = out[1, :, :pad].double()  # every key equally far below: the mean of all the values
    mean = v[1].detach().double().mean(dim=1, keepdim=True).expand_as(padded)
    assert rel_err(padded, mean) < TOLERANCE[dtype]
    dout = torch.randn_like(out)
    dout[1, :, :pad] = 0
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(expected, ref_in, dout.double())):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, r) < TOLERANCE[dtype], name


@pytest.mark.parametrize("device", DEVICES)
def test_biases_beyond_the_float32_product_keep_their_order(request, device):
    """Finite biases whose product with log2(e) overflows float32 (beyond about 2.36e38) act
    as 2.3e38 in magnitude (docs/semantics.md): a key at -1.5e38 still outweighs keys at -3e38,
    and one at +3e38 takes the whole row, as in float64; before, -3e38 hid its key and +3e38
    gave NaN."""
    seed_from(request.node.nodeid)
    b, h, s = (1, 2, 16) if device == "cpu" else (2, 4, 300)
    q, k, v = make_qkv(b, s, s, h, h, 16, 16, torch.float32, device)
    bias = torch.randn(b, h, s, s, device=device)
    bias[:, :, 0] = -3e38
    bias[:, :, 0, 3] = -1.5e38  # row 0: the key at -1.5e38 alone
    bias[:, :, 1, 5] = 3e38  # row 1: key 5 alone
    bias[:, :, 2] = torch.finfo(torch.float32).min  # row 2: every key equal: the mean
    out = aotattn.flash_attn_func(q, k, v, bias=bias)
    expected, _ = reference.attention(*(t.double() for t in (q, k, v)), bias=bias.double())
    assert rel_err(out, expected) < TOLERANCE[torch.float32]
    torch.testing.assert_close(out[:, 0], v[:, 3], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 1], v[:, 5], rtol=0, atol=0)
