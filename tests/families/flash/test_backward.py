"""Gradients of both backward backends against the float64 reference, CPU and GPU."""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn import reference
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import make_qkv, seed_from

# backend, deterministic: fused without determinism accumulates dQ with atomics
VARIANTS = [
    pytest.param(("split", False), id="split"),
    pytest.param(("fused", False), id="fused-atomic"),
    pytest.param(("fused", True), id="fused-deterministic"),
]
LENGTHS = {"cpu": [(37, 53), (48, 48), (70, 21)], "cuda": [(300, 777), (1024, 1024), (1000, 333)]}
MASKS = [
    pytest.param({}, id="full"),
    pytest.param({"causal": True}, id="causal-br"),
    pytest.param({"causal": True, "diagonal": "top_left"}, id="causal-tl"),
    pytest.param({"window_size": (9, 4)}, id="window-br"),
    pytest.param({"window_size": (5, -1), "diagonal": "top_left"}, id="left-tl"),
]


def check_gradients(q, k, v, variant, **mask):
    """Run forward + backward with a random upstream gradient; compare dq, dk, dv."""
    backend, deterministic = variant
    out = aotattn.flash_attn_func(q, k, v, backend=backend, deterministic=deterministic, **mask)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_inputs = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference.attention(*ref_inputs, **mask)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dout.to(torch.float64))
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        err = rel_err(g, r)
        assert err < TOLERANCE[q.dtype], f"{name}: relative error {err:.3e} >= {TOLERANCE[q.dtype]:.0e}"
    return grads, ref_grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("length", [0, 1, 2], ids=["sq<sk", "sq=sk", "sq>sk"])
def test_gradients_masks(request, device, variant, dtype, mask, length):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k = LENGTHS[device][length]
    head_dim = 40 if device == "cpu" else 128
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, head_dim, dtype, device, requires_grad=True)
    check_gradients(q, k, v, variant, **mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dims", [(7, 13), (40, 24), (64, 64), (96, 96), (200, 72), (256, 256)],
                         ids=lambda d: f"d{d[0]}-dv{d[1]}")
def test_gradients_head_dims(request, device, variant, head_dims):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k = (30, 41) if device == "cpu" else (513, 1029)
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, *head_dims, torch.float16, device, requires_grad=True)
    check_gradients(q, k, v, variant, causal=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("heads", [(6, 1), (6, 3)], ids=lambda h: f"hq{h[0]}-hk{h[1]}")
@pytest.mark.parametrize("scale", [None, 0.0, -0.7])
def test_gradients_gqa_and_scale(request, device, variant, heads, scale):
    seed_from(request.node.nodeid)
    seqlen = 33 if device == "cpu" else 900
    q, k, v = make_qkv(2, seqlen, seqlen + 7, *heads, 32, 32, torch.bfloat16, device, requires_grad=True)
    check_gradients(q, k, v, variant, softmax_scale=scale, window_size=(11, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", [
    pytest.param((50, 20, {"causal": True}), id="causal-br-sq>sk"),
    pytest.param((30, 10, {"window_size": (2, 0), "diagonal": "top_left"}), id="window-tl"),
    pytest.param((20, 0, {}), id="no-keys"),
])
def test_fully_masked_rows_have_zero_gradient(request, device, variant, case):
    seed_from(request.node.nodeid)
    seqlen_q, seqlen_k, mask = case
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 2, 1, 24, 24, torch.float32, device, requires_grad=True)
    (dq, dk, dv), _ = check_gradients(q, k, v, variant, **mask)
    _, ref_lse = reference.attention(q.detach(), k.detach(), v.detach(), **mask)
    empty = torch.isinf(ref_lse).transpose(1, 2)  # (B, Sq, Hq)
    assert empty.any()
    for g in (dq, dk, dv):
        assert not torch.isnan(g).any()
    assert (dq[empty] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["split", "fused"])
def test_deterministic_gradients_are_bitwise_identical(request, device, backend):
    seed_from(request.node.nodeid)
    seqlen = 40 if device == "cpu" else 2048
    q, k, v = make_qkv(2, seqlen, seqlen, 8, 2, 64, 64, torch.bfloat16, device, requires_grad=True)
    out = aotattn.flash_attn_func(q, k, v, causal=True, deterministic=True, backend=backend)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for _ in range(3):
        again = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_sdpa_gradients_match_torch(request, device):
    seed_from(request.node.nodeid)
    seqlen = 29 if device == "cpu" else 700
    q, k, v = (t.transpose(1, 2).detach().requires_grad_()
               for t in make_qkv(2, seqlen, seqlen + 5, 4, 4, 32, 32, torch.float32, device))
    out = aotattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out.sum() * 0.5 + (out * out).sum(), (q, k, v))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_inputs, is_causal=True)
    ref_grads = torch.autograd.grad(ref.sum() * 0.5 + (ref * ref).sum(), ref_inputs)
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < TOLERANCE[torch.float32]


def test_gradcheck_fp32():
    """Finite differences agree with the analytic backward (fp32, small, both backends)."""
    torch.manual_seed(7)
    q, k, v = make_qkv(1, 6, 9, 2, 1, 5, 3, torch.float32, "cpu", requires_grad=True)
    for backend in ("split", "fused"):
        def fn(q, k, v, backend=backend):
            return aotattn.flash_attn_func(q, k, v, window_size=(3, 1), backend=backend)

        assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=2e-2, fast_mode=True)


def test_backend_argument_is_checked():
    q, k, v = make_qkv(1, 8, 8, 1, 1, 16, 16, torch.float16, "cpu")
    with pytest.raises(ValueError, match="backend: expected one of"):
        aotattn.flash_attn_func(q, k, v, backend="triton")
    with pytest.raises(TypeError, match="deterministic: expected a bool"):
        aotattn.flash_attn_func(q, k, v, deterministic=None)


def test_unaligned_inputs_are_copied_and_rows_of_16_bytes_take_the_padded_kernels():
    """Every kernel is built with alignment hints (rules._variant_of). A q view at a 2-byte
    offset meets none: planning refuses it, the operators copy it (planning.servable) and
    the gradients are still right. A q whose head stride is 72 (a slice of wider heads)
    has rows of 16 bytes but not 16-aligned strides: it runs the padded functionals, built
    ``aligned8``, without a copy."""
    from aotattn.families.flash import planning
    from aotattn.families.flash.checks import check_flash

    kwargs = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), diagonal="bottom_right")
    base = torch.randn(1 * 40 * 2 * 64 + 1, dtype=torch.float16)
    q = base[1:].view(1, 40, 2, 64).requires_grad_()  # 2-byte offset
    k, v = (torch.randn(1, 40, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(2))
    p = check_flash(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="servable"):
        planning.new_call(p, q, k, v)
    (q2, k2, v2), copied = planning.servable(p, q, k, v)
    assert copied and q2 is not q and k2 is k and v2 is v and q2.data_ptr() % 16 == 0 and torch.equal(q2, q)
    check_gradients(q, k, v, ("split", False))

    wide = torch.randn(1, 40, 2, 72, dtype=torch.float16)
    q = wide[..., :64].requires_grad_()  # head stride 72: divisible by 8, not by 16
    p = check_flash(q, k, v, **kwargs)
    assert planning.servable(p, q, k, v) == ((q, k, v), False)
    call = planning.new_call(p, q, k, v)
    assert not call.aligned and call.functional()["PAD_HEAD"] is True
    dout = torch.randn(1, 40, 2, 64, dtype=torch.float16)
    out = torch.empty_like(dout)
    lse = planning.run_forward(call, q, k, v, out)
    plans = planning.backward_plans(call, dout, q, k, v, out, lse, torch.empty(1, 2, 40), torch.empty_like(q),
                               torch.empty_like(k), torch.empty_like(v), None, "split", True)
    assert all(plan.kernel.variant(plan.functional) == "aligned8" for plan in plans)
    check_gradients(q, k, v, ("split", False))
    check_gradients(q, k, v, ("fused", False))


@pytest.mark.parametrize("pad_head", [False, True], ids=["bucket", "padded"])
def test_a_contiguous_dout_at_an_odd_offset_is_copied(pad_head):
    """``dout.contiguous()`` returns a contiguous view at an odd offset as it is: the
    backward must copy it, or its hinted kernels read misaligned vectors."""
    from aotattn.families.flash import planning
    from aotattn.families.flash.checks import check_flash

    d = 40 if pad_head else 32
    q, k, v = (torch.randn(1, 24, 2, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = aotattn.flash_attn_func(q, k, v)
    base = torch.randn(out.numel() + 1, dtype=torch.float16)
    dout = base[1:].view(out.shape)  # contiguous, 2-byte offset
    assert dout.is_contiguous() and dout.data_ptr() % 16
    p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    diagonal="bottom_right")
    fixed = planning.backward_dout(planning.new_call(p, q, k, v), dout)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, dout)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference.attention(*ref_in)
    for got, want in zip(grads, torch.autograd.grad(ref, ref_in, dout.double())):
        assert rel_err(got, want) < TOLERANCE[torch.float16]


def _poisoned(monkeypatch) -> None:
    """Fresh float tensors from ``torch.empty``/``empty_strided`` are NaN: an output element a
    backward leaves unwritten fails the comparison instead of passing on an allocator's zeros."""
    empty, empty_strided = torch.empty, torch.empty_strided

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() and t.numel() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **kw: poison(empty_strided(*a, **kw)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape, perm, dim", [
    ((3, 50, 4, 8), (0, 1, 2, 3), 1),  # flash-attn's layout, rows along dim 1
    ((3, 50, 4, 8), (0, 2, 1, 3), 1),  # SDPA's memory seen as flash-attn's (the plan cache's flipped buffers)
    ((1, 50, 4, 8), (0, 1, 2, 3), 1),  # one batch: the tail is one block of memory
    ((3, 4, 50, 8), (0, 1, 2, 3), 2),
    ((2, 50, 3), (0, 1, 2), 1),
])
def test_zero_rows_zeroes_the_tail_and_leaves_the_rest_where_that_is_cheapest(device, shape, perm, dim):
    """planning.zero_rows: every row from ``first`` on is zero; the rows before it keep their
    values when the tail is one block of memory or under half the rows (a strided fill of
    the tail is then the cheaper), and are zeroed with the whole buffer otherwise."""
    from aotattn.families.flash import planning

    rows = shape[dim]
    for first in (0, 1, rows // 3, rows // 2, rows - 1, rows, rows + 5):
        memory = [shape[i] for i in perm]
        t = torch.randn(memory, device=device).permute([perm.index(i) for i in range(len(shape))])
        assert tuple(t.shape) == shape
        before = t.clone()
        planning.zero_rows(t, dim, first)
        tail = t.narrow(dim, min(first, rows), rows - min(first, rows))
        assert (tail == 0).all(), first
        head = t.narrow(dim, 0, min(first, rows))
        one_block = all(size == 1 for size, stride in zip(t.shape, t.stride()) if stride > t.stride(dim))
        if 0 < first and (one_block or 2 * (rows - first) < rows):
            assert torch.equal(head, before.narrow(dim, 0, min(first, rows))), first
        else:
            assert (head == 0).all(), first


# (Sq, Sk, mask, keys some query sees) on CPU, then at GPU sizes
TRIM_CASES = [
    pytest.param([(20, 77, {"causal": True, "diagonal": "top_left"}, 20),
                  (800, 3080, {"causal": True, "diagonal": "top_left"}, 800)], id="causal"),
    pytest.param([(20, 77, {"window_size": (4, 9), "diagonal": "top_left"}, 29),
                  (800, 3080, {"window_size": (160, 360), "diagonal": "top_left"}, 1160)], id="window"),
    pytest.param([(60, 77, {"causal": True, "diagonal": "top_left"}, 60),  # a tail under half the keys
                  (2600, 3080, {"causal": True, "diagonal": "top_left"}, 2600)], id="causal-short-tail"),
    pytest.param([(1, 77, {"causal": True, "diagonal": "top_left"}, 1),
                  (1, 3080, {"causal": True, "diagonal": "top_left"}, 1)], id="one-query-one-key"),
    pytest.param([(20, 77, {"window_size": (4, -1), "diagonal": "top_left"}, 77),
                  (800, 3080, {"window_size": (160, -1), "diagonal": "top_left"}, 3080)], id="right-unbounded"),
    pytest.param([(20, 77, {"causal": True}, 77), (800, 3080, {"causal": True}, 3080)], id="bottom-right"),
]


def _trim_params() -> list:
    """(variant, case, layout) with ids layout-case-variant; the SDPA layout only where SDPA
    can say it: top-left causal (is_causal with Sq < Sk), no window, no backend argument."""
    out = []
    for layout in ("flash", "sdpa", "flash-bias"):  # a bias: no plan cache (run_backward)
        for case in TRIM_CASES:
            for variant in VARIANTS:
                mask = case.values[0][0][2]
                if layout == "sdpa" and (mask.get("diagonal") != "top_left" or "window_size" in mask
                                         or variant.values[0] != ("split", False)):
                    continue
                out.append(pytest.param(variant.values[0], case.values[0], layout,
                                        id=f"{layout}-{case.id}-{variant.id}"))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("variant", "case", "layout"), _trim_params())
def test_keys_no_query_sees_launch_no_program_and_get_zero_gradient(request, monkeypatch, device, variant, case,
                                                                     layout):
    """A top-left window ending before the keys (SDPA's is_causal with Sq < Sk): the backward
    plans only the keys some query sees (planning.trim_keys), and the others' dK/dV are
    exactly zero, on the first call and on plan-cache hits, in either layout, and with a bias
    (whose gradient there is zero too)."""
    from aotattn.families.flash import ops, planning

    seqlen_q, seqlen_k, mask, visible = case[device == "cuda"]
    backend, deterministic = variant
    seed_from(request.node.nodeid)
    ops._PLANS.entries.clear()
    seen: list = []
    launch, prepare = planning.launch, ops._prepare
    monkeypatch.setattr(planning, "launch", lambda plan: (seen.append(plan), launch(plan))[1])
    monkeypatch.setattr(ops, "_prepare", lambda plan, roles: (seen.append(plan), prepare(plan, roles))[1])
    _poisoned(monkeypatch)
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, 32, torch.float32, device)
    tensors = [q, k, v]
    if layout == "flash-bias":
        tensors.append(torch.randn(2, 4, seqlen_q, seqlen_k, device=device))
    ref_inputs = [t.to(torch.float64).requires_grad_() for t in tensors]
    ref_out, _ = reference.attention(*ref_inputs[:3], bias=ref_inputs[3] if len(tensors) > 3 else None, **mask)
    dout = torch.randn_like(ref_out, dtype=torch.float32)
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dout.to(torch.float64))
    for call in range(3):  # the first plans, then cache hits
        inputs = [t.clone().requires_grad_() for t in tensors]
        if layout == "sdpa":
            q_, k_, v_ = (t.transpose(1, 2) for t in inputs)
            out = aotattn.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            bias = inputs[3] if len(inputs) > 3 else None
            out = aotattn.flash_attn_func(*inputs[:3], bias=bias, backend=backend, deterministic=deterministic,
                                          **mask)
        grads = torch.autograd.grad(out, inputs, dout)
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
            assert rel_err(g, r) < TOLERANCE[torch.float32], f"call {call}: {name}"
        for g in grads[1:3]:
            assert (g[:, visible:] == 0).all() and not g.isnan().any(), f"call {call}"
        if len(grads) > 3:
            assert (grads[3][..., visible:] == 0).all() and not grads[3].isnan().any(), f"call {call}"
    planned = {dict(zip(p.kernel.argument_names, p.args)).get("max_seqlen_k") for p in seen
               if p.kernel.name.startswith("attn_bwd") and p.kernel.name != "attn_bwd_preprocess"}
    assert planned == {visible}, planned


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_accumulated_dq_is_scaled_after_its_sums(dtype):
    """The backends that accumulate dQ (fused without deterministic, ws) leave the softmax
    scale and dropout's 1 / (1 - p) out of the sums; finish_dq applies them in the
    conversion, into a new tensor of q's dtype and the buffer's layout (the buffer is not
    changed: the tuner reads it again)."""
    from aotattn.families.flash import planning
    from tests.families.flash.helpers import problem

    q, k, v = make_qkv(2, 40, 50, 4, 2, 32, 32, dtype, "cpu")
    c = planning.new_call(problem(q, k, v, dropout_p=0.25, softmax_scale=0.3), q, k, v)
    assert planning.accumulated_dq_scale(c, "split", False) is None
    assert planning.accumulated_dq_scale(c, "fused", True) is None
    for backend in ("fused", "ws"):
        assert planning.accumulated_dq_scale(c, backend, False) == pytest.approx(0.3 / 0.75, rel=1e-15)
    sums = torch.randn(2, 4, 40, 32).transpose(1, 2)  # a buffer in SDPA's layout
    kept = sums.clone()
    dq = planning.finish_dq(sums, q, 0.4)
    assert dq.dtype == dtype and dq.stride() == sums.stride() and dq.data_ptr() != sums.data_ptr()
    assert torch.equal(sums, kept)
    assert torch.equal(dq, (kept * 0.4).to(dtype))
    written = torch.randn(2, 40, 4, 32).to(dtype)
    assert planning.finish_dq(written, q, None) is written


@pytest.mark.gpu
def test_finishing_an_accumulated_dq_is_one_kernel(monkeypatch):
    """The scale and the conversion of an accumulated dQ are one elementwise pass on the GPU
    (torch.mul into a bf16 output casts in the kernel; on CPU PyTorch stages a temporary), as
    the plain conversion was: the scale after the sums costs no extra pass over dQ."""
    from aotattn.families.flash import planning

    # conftest's poison_allocations NaN-fills every torch.empty_like: that fill is the suite's,
    # not the library's (it was the bf16 FillFunctor the H100 suites of 2026-12-05 saw).
    monkeypatch.undo()
    sums = torch.randn(2, 1000, 4, 128, device="cuda")
    q = torch.empty(1, dtype=torch.bfloat16, device="cuda")
    planning.finish_dq(sums, q, 0.125)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dq = planning.finish_dq(sums, q, 0.125)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "MulFunctor" in kernels[0], kernels
    assert torch.equal(dq, (sums * 0.125).to(torch.bfloat16))
