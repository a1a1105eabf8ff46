"""Forward pass against the float64 reference, on CPU (interpreter) and on the GPU."""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn import reference
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import assert_forward_matches, make_qkv, seed_from

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# (seqlen_q, seqlen_k) per device: Sq < Sk, Sq = Sk, Sq > Sk, odd lengths.
LENGTHS = {
    "cpu": [(37, 53), (48, 48), (70, 21)],
    "cuda": [(300, 777), (1024, 1024), (1000, 333)],
}
HEADS = {"cpu": (4, 2), "cuda": (8, 2)}

MASKS = [
    ("full", {}),
    ("causal", {"causal": True}),
    ("window", {"window_size": (9, 4)}),
    ("left-only", {"window_size": (5, -1)}),
    ("right-only", {"window_size": (-1, 6)}),
    ("causal+left", {"causal": True, "window_size": (17, -1)}),
]
DIAGONALS = ["bottom_right", "top_left"]


def _mask_cases():
    for name, mask in MASKS:
        for diagonal in DIAGONALS if mask else DIAGONALS[:1]:
            yield pytest.param(dict(mask, diagonal=diagonal), id=f"{name}-{diagonal}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", list(_mask_cases()))
@pytest.mark.parametrize("length", [0, 1, 2], ids=["sq<sk", "sq=sk", "sq>sk"])
def test_masks_and_diagonals(request, device, dtype, mask, length):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k = LENGTHS[device][length]
    heads_q, heads_k = HEADS[device]
    head_dim = 40 if device == "cpu" else 128
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, head_dim, dtype, device)
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, **mask)
    assert_forward_matches(out, lse, q, k, v, **mask)


HEAD_DIMS = [(1, 1), (7, 13), (16, 16), (40, 24), (64, 128), (96, 96), (128, 128), (200, 72), (256, 256)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}-dv{d[1]}")
def test_head_dims(request, device, dtype, head_dims):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k = (33, 45) if device == "cpu" else (513, 1029)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, *head_dims, dtype, device)
    out, lse = aotattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_forward_matches(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(6, 1), (6, 2), (6, 3), (6, 6)], ids=lambda h: f"hq{h[0]}-hk{h[1]}")
def test_gqa_mqa(request, device, heads):
    seed_from(request.node.nodeid)
    seqlen = 40 if device == "cpu" else 1100
    q, k, v = make_qkv(2, seqlen, seqlen, *heads, 64, 64, torch.bfloat16, device)
    out, lse = aotattn.flash_attn_func(q, k, v, window_size=(12, 3), return_lse=True)
    assert_forward_matches(out, lse, q, k, v, window_size=(12, 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.0, -0.3, -2.0, 1.7, 1e-3])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scale(request, device, scale, causal):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k = (29, 41) if device == "cpu" else (700, 900)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 2, 32, 32, torch.float16, device)
    out, lse = aotattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    assert_forward_matches(out, lse, q, k, v, softmax_scale=scale, causal=causal)


FULLY_MASKED = [
    # rows 0..Sq-Sk-1 see nothing: causal bottom-right with Sq > Sk
    pytest.param((50, 20, {"causal": True}), id="causal-br-sq>sk"),
    # rows i >= Sk see nothing: top-left band of width 0
    pytest.param((40, 17, {"window_size": (0, 0), "diagonal": "top_left"}), id="band-tl"),
    # a band two keys wide that leaves the key range for rows i >= Sk + 2
    pytest.param((30, 10, {"window_size": (2, 0), "diagonal": "top_left"}), id="window-tl"),
    pytest.param((20, 0, {}), id="no-keys"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FULLY_MASKED)
def test_fully_masked_rows(request, device, dtype, case):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k, mask = case
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 2, 1, 24, 24, dtype, device)
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, **mask)
    ref_out, ref_lse = reference.attention(q, k, v, **mask)
    empty = torch.isinf(ref_lse)
    assert empty.any(), "the case must contain fully masked rows"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[empty.transpose(1, 2)] == 0).all()
    assert torch.isposinf(lse[empty]).all()
    if not empty.all():
        assert_forward_matches(out, lse, q, k, v, **mask)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_without_copy(request, device):
    """q, k, v as slices of a packed (B, S, 3, H, D) tensor and of a (B, H, S, D) one."""
    seed_from(request.node.nodeid)
    seqlen = 45 if device == "cpu" else 999
    packed = torch.randn(2, seqlen, 3, 4, 64, dtype=torch.bfloat16, device=device)
    q, k, v = packed.unbind(2)
    assert not q.is_contiguous()
    out, lse = aotattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert_forward_matches(out, lse, q, k, v, causal=True)
    heads_major = torch.randn(2, 4, seqlen, 64, dtype=torch.bfloat16, device=device)
    kt = heads_major.transpose(1, 2)
    out = aotattn.flash_attn_func(q, kt, kt, window_size=(7, 7))
    assert_forward_matches(out, None, q, kt, kt, window_size=(7, 7))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lengths", [(31, 47), (47, 31)], ids=["sq<sk", "sq>sk"])
def test_sdpa_matches_torch(request, device, is_causal, lengths):
    """PyTorch layout and top-left causal; checked against the reference and against torch."""
    seed_from(request.node.nodeid)
    scale = 10 if device == "cuda" else 1
    seqlen_q, seqlen_k = (n * scale for n in lengths)
    q, k, v = (t.transpose(1, 2) for t in make_qkv(2, seqlen_q, seqlen_k, 6, 2, 32, 48, torch.float32, device))
    out = aotattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert out.shape == (2, 6, seqlen_q, 48)
    ref_out, _ = reference.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=is_causal,
                                     diagonal="top_left")
    assert rel_err(out, ref_out.transpose(1, 2)) < TOLERANCE[torch.float32]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1), is_causal=is_causal)
    assert rel_err(out, expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_empty_problems(device):
    q, k, v = make_qkv(0, 8, 8, 2, 2, 16, 16, torch.float16, device)
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True)
    assert out.shape == (0, 8, 2, 16) and lse.shape == (0, 2, 8)
    q, k, v = make_qkv(1, 0, 8, 2, 2, 16, 16, torch.float16, device)
    out = aotattn.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 0, 2, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_calls_reuse_plans_without_confusing_them(request, device):
    """Identical metadata repeats the plan; any change of scale, mask, strides or shape does not."""
    from aotattn.families.flash import ops

    seed_from(request.node.nodeid)
    q, k, v = make_qkv(2, 45, 60, 4, 2, 32, 32, torch.float16, device)
    ops._PLANS.entries.clear()
    calls = [dict(), dict(), dict(softmax_scale=-0.5), dict(causal=True), dict(causal=True),
             dict(window_size=(3, 3), diagonal="top_left")]
    for mask in calls:
        for _ in range(2):
            out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, **mask)
            assert_forward_matches(out, lse, q, k, v, **mask)
    assert len(ops._PLANS.entries) == 4
    # same shapes, other strides: a transposed copy of k
    k2 = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert k2.stride() != k.stride()
    out = aotattn.flash_attn_func(q, k2, v)
    assert_forward_matches(out, None, q, k2, v)
    # SDPA layout, returned as PyTorch would (B, H, S, Dv)
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    for _ in range(2):
        out = aotattn.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True, is_causal=True)
        assert out.shape == (2, 4, 45, 32) and out.is_contiguous()
        assert_forward_matches(out.transpose(1, 2), None, q, k, v, causal=True, diagonal="top_left")
    with pytest.raises(TypeError, match="softmax_scale"):
        aotattn.flash_attn_func(q, k, v, softmax_scale=[1.0])  # unhashable: the full path reports it


@pytest.mark.parametrize("window", [(-1, -1), (5, 3)], ids=["causal", "window"])
def test_top_left_over_equal_lengths_runs_the_bottom_right_variant(window):
    """Over equal lengths both diagonals are column = row: a top-left call runs the
    bottom-right variant (its images and tuned cells), unequal lengths and varlen keep
    their own; the two calls then give the same bits, forward and backward."""
    from aotattn.families.flash import planning, rules
    from aotattn.families.flash.checks import check_flash

    def kernel_mask(sq, sk, diagonal):
        q, k, v = make_qkv(2, sq, sk, 2, 2, 16, 16, torch.float16, "cpu")
        p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=window == (-1, -1), window_size=window,
                        diagonal=diagonal)
        return planning.Call(p).functional()["MASK"]

    assert kernel_mask(37, 37, "top_left") == rules.MASK_BOTTOM_RIGHT
    assert kernel_mask(37, 53, "top_left") == kernel_mask(53, 37, "top_left") == rules.MASK_TOP_LEFT
    assert kernel_mask(37, 37, "bottom_right") == rules.MASK_BOTTOM_RIGHT
    torch.manual_seed(0)
    q, k, v = make_qkv(2, 40, 40, 3, 1, 32, 32, torch.float32, "cpu", requires_grad=True)
    causal = window == (-1, -1)
    runs = [aotattn.flash_attn_func(q, k, v, causal=causal, window_size=window, diagonal=d)
            for d in ("top_left", "bottom_right")]
    dout = torch.randn_like(runs[0])
    grads = [torch.autograd.grad(out, (q, k, v), dout) for out in runs]
    assert torch.equal(runs[0], runs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    ref, _ = reference.attention(q.double(), k.double(), v.double(), causal=causal, window_size=window,
                                 diagonal="top_left")
    assert rel_err(runs[0], ref) < TOLERANCE[torch.float32]


def test_the_tuner_leaves_top_left_cells_on_the_diagonal_out():
    """No problem selects MASK_TOP_LEFT at equal lengths, so the tuner has nothing to time there."""
    from aotattn.families.flash import rules
    from aotattn.spec import Functional
    from aotattn.tune import flash as harness

    f = Functional.of(dict(dtype="bf16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=False, MASK=rules.MASK_TOP_LEFT,
                           VARLEN=False, DROPOUT=False, BIAS=0))
    assert not harness.supports("flash.attn_fwd", f, (1024, 1024))
    assert harness.supports("flash.attn_fwd", f, (1024, 4096))
    assert harness.supports("flash.attn_fwd", f)
