"""scaled_dot_product_attention takes PyTorch's ``(N, ..., H, L, E)`` at any rank >= 2:
the dimensions before the heads are batch dimensions, broadcast between query, key, value
and attn_mask; a 2-D input has one head. Forward and gradients against the float64 SDPA."""

from __future__ import annotations

import pytest
import torch

import aotattn
from tests.families.flash.helpers import seed_from
from tests.helpers import DEVICES, TOLERANCE, rel_err

# (query, key, value, attn_mask or None, enable_gqa); key/value lengths 1..., odd head dims
SHAPES = {
    "2d": ((17, 16), (9, 16), (9, 8), None, False),
    "3d-gqa": ((4, 17, 16), (2, 9, 16), (2, 9, 24), None, True),
    "3d-bool-mask": ((3, 13, 32), (3, 1, 32), (3, 1, 32), "bool (13, 1)", False),
    "5d": ((2, 3, 2, 11, 16), (2, 3, 2, 21, 16), (2, 3, 2, 21, 16), "float (3, 1, 11, 21)", False),
    "5d-broadcast-kv": ((2, 3, 4, 11, 16), (1, 3, 2, 7, 16), (3, 2, 7, 40), None, True),
    "6d-mask-lead": ((2, 3, 1, 2, 9, 8), (2, 3, 1, 2, 9, 8), (1, 3, 1, 2, 9, 8), "float (3, 1, 1, 9, 9)", False),
    "3d-against-4d": ((2, 13, 16), (1, 2, 13, 16), (1, 2, 13, 16), None, False),
}


def _mask(spec: str | None, device: str):
    if spec is None:
        return None
    kind, shape = spec.split(" ", 1)
    shape = tuple(int(s) for s in shape.strip("()").split(",") if s.strip())
    if kind == "bool":
        mask = torch.rand(shape, device=device) > 0.3
        mask[..., 0] = True  # PyTorch gives NaN where a row sees no key
        return mask
    return torch.randn(shape, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_any_rank_matches_float64_sdpa(request, device, dtype, case, causal):
    seed_from(request.node.nodeid)
    q_shape, k_shape, v_shape, mask_spec, gqa = SHAPES[case]
    q, k, v = (torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in (q_shape, k_shape, v_shape))
    mask = _mask(mask_spec, device)
    out = aotattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_mask = mask.double() if mask is not None and mask.dtype.is_floating_point else mask
    if causal and mask is not None:  # aotattn applies both (docs/semantics.md); PyTorch takes one
        keep = torch.ones(q_shape[-2], k_shape[-2], dtype=torch.bool, device=device).tril()
        ref_mask = ref_mask & keep if mask.dtype == torch.bool else ref_mask.masked_fill(~keep, float("-inf"))
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=ref_mask,
                                                           is_causal=causal and mask is None, enable_gqa=gqa)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]
    grad = torch.randn_like(ref)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for name, t, r in zip("qkv", (q, k, v), ref_in):
        assert t.grad.shape == t.shape, name
        assert rel_err(t.grad, r.grad) < 2 * TOLERANCE[dtype], name


def test_a_float_mask_of_batch_dimensions_gets_its_gradient():
    """A mask broadcast over the flattened batch dimensions (a copy where the layout asks
    for one) still returns its gradient summed over what it was broadcast to."""
    q, k, v = (torch.randn(2, 3, 2, 7, 8, dtype=torch.float64).float() for _ in range(3))
    mask = torch.randn(3, 1, 7, 7, requires_grad=True)
    out = aotattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref_mask = mask.detach().double().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=ref_mask)
    grad = torch.randn_like(ref)
    out.backward(grad.float())
    ref.backward(grad)
    assert mask.grad.shape == mask.shape and rel_err(mask.grad, ref_mask.grad) < 1e-5


def test_a_3d_call_is_the_4d_call_with_one_batch():
    """(H, L, E) is (1, H, L, E): the same kernels, the same bits."""
    q, k, v = (torch.randn(4, 19, 16) for _ in range(3))
    three = aotattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    four = aotattn.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)
    assert torch.equal(three, four[0])


@pytest.mark.parametrize("q_shape, k_shape, mask, message", [
    ((16,), (4, 16), None, "query: expected a tensor (..., seqlen, head_dim) of 2 dimensions or more, got shape (16,)"),
    ((2, 3, 1, 4, 8), (3, 3, 1, 4, 8), None, "query, key, value: expected batch dimensions"),
    ((2, 3, 1, 4, 8), (2, 3, 1, 4, 8), (2, 2, 1, 4, 4), "attn_mask: expected a shape broadcastable to (2, 3, 1, 4, 4)"),
    ((3, 4, 8), (3, 4, 8), (1, 3, 4, 4), "attn_mask: expected a shape broadcastable to (3, 4, 4)"),
])
def test_shapes_that_do_not_broadcast_are_refused_in_one_line(q_shape, k_shape, mask, message):
    q, k = torch.randn(q_shape), torch.randn(k_shape)
    with pytest.raises(ValueError) as info:
        aotattn.scaled_dot_product_attention(q, k, k, attn_mask=None if mask is None else torch.randn(mask))
    assert message in str(info.value) and "\n" not in str(info.value)
