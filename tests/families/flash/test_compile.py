"""torch.compile: the public functions trace into one custom op without graph breaks
(fullgraph), forward and backward match the float64 reference, and the ops pass
torch.library's own checks."""

from __future__ import annotations

import math

import pytest
import torch

import aotattn
from aotattn import reference
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import make_qkv, seed_from
from tests.families.flash.test_varlen import make_varlen

SIZES = {"cpu": (2, 37, 53, 32), "cuda": (2, 300, 777, 128)}  # batch, Sq, Sk, D


def compiled(fn, fullgraph: bool = True):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, backend="aot_eager")


def check(out, grads, inputs, dout, ref_fn):
    ref_inputs = [t.detach().to(torch.float64).requires_grad_(t.requires_grad) for t in inputs]
    ref_out = ref_fn(*ref_inputs)
    wanted = [t for t in ref_inputs if t.requires_grad]
    ref_grads = torch.autograd.grad(ref_out, wanted, dout.to(torch.float64))
    bound = TOLERANCE[out.dtype]
    assert rel_err(out, ref_out) < bound
    for g, r, t in zip(grads, ref_grads, [t for t in inputs if t.requires_grad]):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert rel_err(g, r) < bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["split", "fused"])
def test_flash_attn_func_compiles_whole_and_matches(request, device, dtype, backend):
    seed_from(request.node.name)
    batch, sq, sk, d = SIZES[device]
    q, k, v = make_qkv(batch, sq, sk, 4, 2, d, d, dtype, device, requires_grad=True)
    mask = dict(window_size=(17, 3), diagonal="top_left")

    def attention(q, k, v):
        out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, backend=backend, **mask)
        return out * 2.0, lse

    out, lse = compiled(attention)(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check(out, grads, (q, k, v), dout, lambda q, k, v: reference.attention(q, k, v, **mask)[0] * 2.0)
    _, ref_lse = reference.attention(q.detach(), k.detach(), v.detach(), **mask)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_a_compiled_lse_is_not_differentiable_as_an_eager_one(request, varlen):
    """Eager calls mark lse non-differentiable; compiled ones returned it requiring grad and
    dropped its gradient in the backward, so d(lse)/dq came back silently 0. Now neither
    requires grad, and a loss over out and lse backpropagates through out alone, alike."""
    seed_from(request.node.name)
    q, k, v = make_qkv(1, 24, 24, 2, 2, 16, 16, torch.float32, "cpu", requires_grad=True)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)

    def attention(q, k, v):
        if varlen:
            return aotattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 14, 14, causal=True, return_lse=True)
        return aotattn.flash_attn_func(q, k, v, causal=True, return_lse=True)

    grads = []
    for fn in (attention, compiled(attention)):
        out, lse = fn(q, k, v)
        assert out.requires_grad and not lse.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.autograd.grad(lse.sum(), q)
        grads.append(torch.autograd.grad(out.sum() + lse.sum(), (q, k, v)))
    for eager, traced in zip(*grads):
        torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_with_a_float_mask_compiles_and_its_gradient_flows(request, device):
    seed_from(request.node.name)
    batch, sq, sk, d = SIZES[device]
    query = torch.randn(batch, 4, sq, d, device=device, requires_grad=True)
    key = torch.randn(batch, 4, sk, d, device=device, requires_grad=True)
    value = torch.randn(batch, 4, sk, d, device=device, requires_grad=True)
    mask = torch.randn(1, 4, sq, sk, device=device, requires_grad=True)  # broadcast over the batch

    def attention(query, key, value, mask):
        return aotattn.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False)

    out = compiled(attention)(query, key, value, mask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value, mask), dout)
    check(out, grads, (query, key, value, mask), dout,
          lambda q, k, v, m: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m))


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_under_compile_uses_torchs_generator(request, device):
    seed_from(request.node.name)
    batch, sq, sk, d = SIZES[device]
    q, k, v = make_qkv(batch, sq, sk, 2, 2, d, d, torch.float32, device, requires_grad=True)
    fn = compiled(lambda q, k, v: aotattn.flash_attn_func(q, k, v, dropout_p=0.3, causal=True))
    torch.manual_seed(11)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.manual_seed(11)
    keep = aotattn.dropout_mask(batch, 2, sq, sk, 0.3, device=device)
    check(out, grads, (q, k, v), dout,
          lambda q, k, v: reference.attention(q, k, v, causal=True, dropout_mask=keep, dropout_p=0.3)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_with_per_sequence_windows_compiles_whole_and_matches(request, device):
    """Lengths 0, 1, primes and a long one; offsets are op inputs, read only when it runs."""
    seed_from(request.node.name)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(device, torch.float32, requires_grad=True)
    mask = dict(window_size=(7, 2))  # bottom-right: each sequence on its own diagonal

    def attention(q, k, v, cu_q, cu_k):
        return aotattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **mask)

    out = compiled(attention)(q, k, v, cu_q, cu_k)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check(out, grads, (q, k, v), dout, lambda q, k, v: reference.attention_varlen(q, k, v, cu_q, cu_k, **mask)[0])
    bad = cu_q.clone()
    bad[1] = bad[2] + 1  # decreasing: seen when the op reads the offsets
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing offsets"):
        attention(q, k, v, bad, cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing offsets"):
        compiled(attention)(q, k, v, bad, cu_k)


def test_bad_input_is_the_same_error_under_compile():
    """A check that raises is a graph break: Dynamo runs that call eagerly and the
    caller sees the eager path's error."""
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"window_size: expected sizes >= 0"):
        compiled(lambda q, k, v: aotattn.flash_attn_func(q, k, v, window_size=(-2, 0)), fullgraph=False)(q, k, v)
    k3, v3 = torch.randn(1, 16, 3, 16), torch.randn(1, 16, 3, 16)
    with pytest.raises(ValueError, match=r"multiple"):
        compiled(lambda q, k, v: aotattn.flash_attn_func(q, k, v), fullgraph=False)(q, k3, v3)


def test_the_custom_ops_pass_torch_library_checks():
    torch.manual_seed(5)
    q, k, v = make_qkv(1, 24, 40, 2, 1, 16, 16, torch.float32, "cpu", requires_grad=True)
    scalars = (0.25, 2, -1, 0, 0.0)  # softmax_scale, bottom-right causal (mask, left, right), dropout_p
    args = (q, k, v, None, None, None, 0, 0, *scalars, False, "split", False)
    torch.library.opcheck(torch.ops.aotattn.flash_fwd.default, args)
    out, lse, rng = torch.ops.aotattn.flash_fwd(*args)
    detached = [t.detach() for t in (q, k, v, out, lse)]
    torch.library.opcheck(torch.ops.aotattn.flash_bwd.default,
                          (torch.randn_like(out), *detached, None, None, None, 0, 0, rng, *scalars, False, "split",
                           False))
    vq, vk, vv, cu_q, cu_k, max_q, max_k = make_varlen("cpu", torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.aotattn.flash_fwd.default,
                          (vq, vk, vv, None, cu_q, cu_k, max_q, max_k, *scalars, False, None, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [72, 57], ids=["padded-kernels", "padded-by-copy"])
def test_off_bucket_heads_and_a_view_at_an_odd_offset_compile_and_match(request, device, head_dim):
    """Under torch.compile the custom op sees the real tensors: a q at a 2-byte offset is
    copied inside it (planning.servable) in the forward and again in the backward; 72 runs
    the padded-head kernels, 57 (not a multiple of 8) is padded by copy in the trace."""
    seed_from(request.node.name)
    batch, sq, sk, _ = SIZES[device]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    base = torch.randn(batch * sq * 4 * head_dim + 1, dtype=dtype, device=device)
    q = base[1:].view(batch, sq, 4, head_dim).requires_grad_()
    k, v = (torch.randn(batch, sk, 2, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    assert q.data_ptr() % 16

    def attention(q, k, v):
        return aotattn.flash_attn_func(q, k, v, causal=True)

    out = compiled(attention)(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check(out, grads, (q, k, v), dout, lambda q, k, v: reference.attention(q, k, v, causal=True)[0])


@pytest.mark.parametrize("api", ["flash", "sdpa"])
def test_a_scale_argument_compiles_whole_with_dynamic_shapes(request, api):
    """``torch.compile(dynamic=True, fullgraph=True)`` with the scale passed in (a symbolic
    float: the trace cannot read it) or written in: one graph, the reference's numbers for
    each scale, gradients too; a bad scale is refused when the op runs, with the eager
    message. The scale check built its message with a float format on every call, and
    read the value with math.isfinite: both stopped the trace."""
    seed_from(request.node.name)
    if api == "flash":
        attend = lambda q, k, v, s: aotattn.flash_attn_func(q, k, v, softmax_scale=s, causal=True)  # noqa: E731
        ref_fn = lambda q, k, v, s: reference.attention(q, k, v, softmax_scale=s, causal=True)[0]  # noqa: E731
    else:
        attend = lambda q, k, v, s: aotattn.scaled_dot_product_attention(q, k, v, scale=s)  # noqa: E731
        ref_fn = lambda q, k, v, s: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=s)  # noqa: E731
    torch._dynamo.reset()
    passed_in = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=True)
    written_in = torch.compile(lambda q, k, v: attend(q, k, v, 0.3), backend="aot_eager", fullgraph=True,
                               dynamic=True)
    for scale, fn in ((0.25, passed_in), (-1.5, passed_in), (0.3, written_in)):
        q, k, v = make_qkv(2, 21, 30, 2, 2, 16, 16, torch.float32, "cpu", requires_grad=True)
        if api == "sdpa":
            q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        args = (q, k, v) if fn is written_in else (q, k, v, scale)
        out = fn(*args)
        dout = torch.randn_like(out)
        check(out, torch.autograd.grad(out, (q, k, v), dout), (q, k, v), dout, lambda a, b, c: ref_fn(a, b, c, scale))
    for bad, match in ((math.inf, "finite"), (math.nan, "finite"), (1e39, "magnitude")):
        with pytest.raises(ValueError, match=match):
            passed_in(q, k, v, bad)


@pytest.mark.parametrize("api", ["flash", "sdpa"])
def test_a_bad_symbolic_dropout_is_refused_when_the_op_runs(api):
    """A dropout probability passed into a function compiled with ``dynamic=True`` is
    symbolic: its range is checked when the op runs, with the eager message (a message
    formatted from it while tracing stopped the trace with an unrelated error)."""
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, 16, torch.float32, "cpu")
    if api == "sdpa":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attend = lambda q, k, v, p: aotattn.scaled_dot_product_attention(q, k, v, dropout_p=p)  # noqa: E731
    else:
        attend = lambda q, k, v, p: aotattn.flash_attn_func(q, k, v, dropout_p=p)  # noqa: E731
    fn = torch.compile(attend, backend="aot_eager", fullgraph=True, dynamic=True)
    assert fn(q, k, v, 0.0).shape == q.shape
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match=r"dropout_p: expected a float in \[0, 1\)"):
            fn(q, k, v, bad)
