"""Holes found by an adversarial pass (issue 10): each one a clear error or a correct result.

- offsets that are strided views (the kernels read offsets at unit stride: heap corruption);
- calls from many threads (Triton's interpreter keeps process-wide state during a launch);
- the plan cache answering before the checks run (``causal=1`` after a valid call);
- zero heads and the other empty shapes;
- the fused backward's dQ on rows whose log-sum-exp is very negative (the key-major
  programs' out-of-range keys overflowed fp16 into NaN).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import aotattn
from aotattn import reference
from aotattn.families.flash import ops, planning
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import assert_forward_matches, make_qkv, seed_from


# ------------------------------------------------------------------ strided offsets


@pytest.mark.parametrize("device", DEVICES)
def test_strided_cu_seqlens_are_read_by_value(device, request):
    """``cu[::2]`` of a padded buffer: the values, not the storage, decide the sequences."""
    seed_from(request.node.name)
    lengths = [3, 5, 0, 4]
    total = sum(lengths)
    q, k, v = (torch.randn(total, 2, 16, device=device) for _ in range(3))
    offsets = torch.tensor([0, 3, 8, 8, 12], dtype=torch.int32, device=device)
    padded = torch.full((2 * len(offsets) - 1,), 99, dtype=torch.int32, device=device)
    padded[::2] = offsets
    cu = padded[::2]
    assert not cu.is_contiguous() and torch.equal(cu, offsets)
    for t in (q, k, v):
        t.requires_grad_()
    out = aotattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    out.backward(torch.randn_like(out))
    for b in range(len(lengths)):
        lo, hi = offsets[b].item(), offsets[b + 1].item()
        if hi == lo:
            continue
        ref, _ = reference.attention(*(t.detach()[lo:hi][None] for t in (q, k, v)), causal=True)
        assert rel_err(out.detach()[lo:hi][None], ref) < TOLERANCE[torch.float32]
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("device", DEVICES)
def test_strided_cu_seqlens_match_contiguous(device):
    total, offsets = 12, [0, 3, 8, 8, 12]
    q, k, v = (torch.randn(total, 2, 16, device=device) for _ in range(3))
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    strided = torch.stack([cu, torch.full_like(cu, 10**6)], dim=1)[:, 0]  # stride 2, garbage between
    assert strided.stride() == (2,)
    a = aotattn.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, window_size=(2, 1))
    b = aotattn.flash_attn_varlen_func(q, k, v, strided, strided, 5, 5, window_size=(2, 1))
    assert torch.equal(a, b)


# ------------------------------------------------------------------------- threads


@pytest.mark.parametrize("device", DEVICES)
def test_calls_from_many_threads_are_correct(device):
    """Eight threads, different inputs, forward and backward: every result matches the reference."""
    size = dict(cpu=(1, 33, 40, 16), cuda=(2, 1000, 1537, 64))[device if isinstance(device, str) else "cuda"]
    batch, sq, sk, d = size
    failures: list[str] = []

    def work(i: int) -> None:
        g = torch.Generator().manual_seed(1000 + i)
        dtype = torch.float32 if device == "cpu" else (torch.float16, torch.bfloat16)[i % 2]
        q = torch.randn(batch, sq, 4, d, generator=g).to(device, dtype).requires_grad_()
        k = torch.randn(batch, sk, 2, d, generator=g).to(device, dtype).requires_grad_()
        v = torch.randn(batch, sk, 2, d, generator=g).to(device, dtype).requires_grad_()
        dout = torch.randn(batch, sq, 4, d, generator=g).to(device, dtype)
        try:
            for causal in (False, True):
                with torch.no_grad():  # the plan-cache path
                    inference = aotattn.flash_attn_func(q, k, v, causal=causal)
                out = aotattn.flash_attn_func(q, k, v, causal=causal, backend=("split", "fused")[i % 2])
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
                ref = reference.attention(q.detach(), k.detach(), v.detach(), causal=causal)[0]
                qd, kd, vd = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
                rdq, rdk, rdv = torch.autograd.grad(reference.attention(qd, kd, vd, causal=causal)[0], (qd, kd, vd),
                                                    dout.to(torch.float64))
                for name, got, want in (("inference", inference, ref), ("out", out, ref), ("dq", dq, rdq),
                                        ("dk", dk, rdk), ("dv", dv, rdv)):
                    err = rel_err(got, want)
                    if not err < TOLERANCE[dtype]:
                        failures.append(f"thread {i} causal={causal} {name}: {err:.3e}")
        except Exception as exc:  # reported below, with the thread that raised it
            failures.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------- plan cache


BAD_AFTER_GOOD = [
    (dict(softmax_scale=True), TypeError, "softmax_scale"),
    (dict(causal=1), TypeError, "causal"),
    (dict(causal=1.0), TypeError, "causal"),
    (dict(window_size=(2.0, 0.0)), TypeError, "window_size"),
    (dict(window_size=[2.0, 0]), TypeError, "window_size"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(dropout_p=False), TypeError, "dropout_p"),
    (dict(dropout_p=torch.tensor([0.0])), TypeError, "dropout_p"),  # 0-d tensors are taken, as PyTorch's
    (dict(softmax_scale=torch.tensor([1.0])), TypeError, "softmax_scale"),
]


@pytest.mark.parametrize("api", ["flash", "sdpa"])
def test_a_0_d_scale_changed_in_place_is_read_again(api):
    """A 0-d tensor scale (a learned temperature, say) changed in place between two calls:
    the plan cache must not serve the first value again."""
    q, k, v = (torch.randn(1, 9, 2, 16) for _ in range(3))
    scale = torch.tensor(0.25)
    if api == "flash":
        call = lambda: aotattn.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)  # noqa: E731
    else:
        call = lambda: aotattn.scaled_dot_product_attention(  # noqa: E731
            *(t.transpose(1, 2) for t in (q, k, v)), scale=scale, is_causal=True).transpose(1, 2)
    for value in (0.25, 0.25, 2.0, 2.0, -1.0):
        scale.fill_(value)
        out = call()
        ref, _ = reference.attention(q.double(), k.double(), v.double(), softmax_scale=value,
                                     causal=True, diagonal="bottom_right" if api == "flash" else "top_left")
        assert rel_err(out, ref) < 1e-5, value


@pytest.mark.parametrize("bad,error,match", BAD_AFTER_GOOD, ids=[str(b) for b, _, _ in BAD_AFTER_GOOD])
def test_plan_cache_never_skips_a_check(bad, error, match):
    """The same call gets the same answer whether the cache is warm or not."""
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    good = {"softmax_scale": 1.0, "causal": True, "window_size": (2, 0), "return_lse": True, "dropout_p": 0.0}
    good = {name: good[name] for name in bad}
    with pytest.raises(error, match=match):  # cold
        aotattn.flash_attn_func(q, k, v, **bad)
    aotattn.flash_attn_func(q, k, v, **good)  # warms the cache for this shape
    aotattn.flash_attn_func(q, k, v, **good)
    with pytest.raises(error, match=match):  # warm
        aotattn.flash_attn_func(q, k, v, **bad)


def test_plan_cache_sdpa_checks_flags():
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    aotattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    aotattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match="is_causal"):
        aotattn.scaled_dot_product_attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="enable_gqa"):
        aotattn.scaled_dot_product_attention(q, k, v, enable_gqa=0)
    with pytest.raises(TypeError, match="dropout_p"):
        aotattn.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=False)


@pytest.mark.parametrize("api", ["flash", "sdpa"])
def test_double_backward_raises_instead_of_dropping_the_second_order_term(api):
    """Gradients taken with create_graph=True cannot be differentiated again (the kernels
    have no backward): the second backward raises, cold or warm plan cache, rather than
    treating the first-order gradients as constants (a silently wrong gradient penalty).
    A create_graph=True call whose first-order gradients are not differentiated again
    still gets them right."""
    q, k, v = (torch.randn(1, 16, 2, 32, dtype=torch.float64).float().requires_grad_() for _ in range(3))

    def attend():
        if api == "flash":
            return aotattn.flash_attn_func(q, k, v, causal=True)
        return aotattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=True).transpose(1, 2)

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(qd.transpose(1, 2), kd.transpose(1, 2),
                                                           vd.transpose(1, 2), is_causal=True).transpose(1, 2)
    ref_dq, = torch.autograd.grad(ref.square().sum(), qd)
    for _ in range(3):  # cold, then served by the plan cache
        out = attend()
        dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        assert torch.allclose(dq.double(), ref_dq, atol=1e-4, rtol=1e-4)
        with pytest.raises(RuntimeError, match="no double backward"):
            (out.sum() + dq.square().sum()).backward()


@pytest.mark.parametrize("call", ["flash", "sdpa", "sdpa-mask", "bias", "varlen", "odd-dim", "compiled"])
def test_a_gradient_penalty_through_autograd_grad_raises(call):
    """The gradient-penalty pattern ``grad(loss + |dq|^2, q)`` (autograd.grad with inputs,
    not .backward()) must reach the raising node: it was pruned (a node on detached
    leaves), and the penalty's second-order term was dropped without a word. PyTorch's
    flash backend raises here too."""
    torch.manual_seed(len(call))
    q, k, v = (torch.randn(1, 16, 2, 24 if call == "odd-dim" else 32, requires_grad=True) for _ in range(3))
    sdpa = lambda **kw: aotattn.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    offsets = torch.tensor([0, 5, 16], dtype=torch.int32)
    attend = {
        "flash": lambda: aotattn.flash_attn_func(q, k, v, causal=True),
        "sdpa": lambda: sdpa(is_causal=True),
        "sdpa-mask": lambda: sdpa(attn_mask=torch.randn(1, 1, 16, 16)),
        "bias": lambda: aotattn.flash_attn_func(q, k, v, bias=torch.randn(16, 16, requires_grad=True)),
        "varlen": lambda: aotattn.flash_attn_varlen_func(q[0], k[0], v[0], offsets, offsets, 11, 11),
        "odd-dim": lambda: aotattn.flash_attn_func(q, k, v),
        "compiled": torch.compile(lambda: aotattn.flash_attn_func(q, k, v), backend="aot_eager"),
    }[call]
    for _ in range(2):  # cold, then warm
        out = attend()
        dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(out.sum() + dq.square().sum(), q)


def test_plan_cache_list_window_is_served():
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    ops._PLANS.entries.clear()
    a = aotattn.flash_attn_func(q, k, v, window_size=[2, 1])
    b = aotattn.flash_attn_func(q, k, v, window_size=[2, 1])
    assert torch.equal(a, b) and len(ops._PLANS.entries) == 1
    assert_forward_matches(b, None, q, k, v, window_size=(2, 1))


def test_plan_cache_with_an_unhashable_argument_reports_it_warm():
    """A key that cannot be hashed misses (it is hashed only at lookup and store): the
    checks report the argument, warm cache or not, and the cache stores nothing for it."""
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    aotattn.flash_attn_func(q, k, v, softmax_scale=0.5)
    aotattn.scaled_dot_product_attention(q, k, v, scale=0.5)
    stored = len(ops._PLANS.entries)
    with pytest.raises(TypeError, match="softmax_scale"):
        aotattn.flash_attn_func(q, k, v, softmax_scale={})
    with pytest.raises(TypeError, match="scale"):
        aotattn.scaled_dot_product_attention(q, k, v, scale={})
    assert len(ops._PLANS.entries) == stored


@pytest.mark.parametrize("device", DEVICES)
def test_plan_cache_follows_the_launch_mode_and_tuning_database(device, monkeypatch, tmp_path):
    """The environment a plan was made under is part of its key: after warm calls, a new
    ``AOTATTN_MODE``, ``AOTATTN_TUNING_DB`` or ``AOTATTN_IMAGES`` misses the cache (a plan of its own), under
    autograd or not; on a GPU a bad value is then reported (CPU tensors always run in the
    interpreter with its own configs)."""
    q, k, v = (torch.randn(1, 8, 2, 16, device=device, requires_grad=True) for _ in range(3))
    ops._PLANS.entries.clear()
    for _ in range(2):
        aotattn.flash_attn_func(q, k, v, causal=True)
        with torch.no_grad():
            aotattn.flash_attn_func(q, k, v, causal=True)
    assert len(ops._PLANS.entries) == 1
    for name, value in (("AOTATTN_TUNING_DB", str(tmp_path / "no-such-db")), ("AOTATTN_MODE", "bogus"),
                        ("AOTATTN_IMAGES", str(tmp_path / "other-images"))):  # a plan holds the kernel it loaded
        monkeypatch.setenv(name, value)
        for grad in (True, False):
            with torch.set_grad_enabled(grad), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # on a GPU, no images there: the JIT's fallback warning
                if device == "cuda" and name != "AOTATTN_IMAGES":
                    with pytest.raises(Exception, match="no-such-db|AOTATTN_MODE"):
                        aotattn.flash_attn_func(q, k, v, causal=True)
                else:
                    stored = len(ops._PLANS.entries)
                    out = aotattn.flash_attn_func(q, k, v, causal=True)
                    assert len(ops._PLANS.entries) == stored + (grad is True)  # missed once, then served
                    assert_forward_matches(out, None, q, k, v, causal=True)
        monkeypatch.delenv(name)
    out = aotattn.flash_attn_func(q, k, v, causal=True)
    assert_forward_matches(out, None, q, k, v, causal=True)


# --------------------------------------------------------------------- empty shapes

EMPTY = {  # q (B, Sq, Hq, D), k (B, Sk, Hk, D)
    "no heads": ((1, 4, 0, 8), (1, 5, 0, 8)),
    "no batch": ((0, 4, 2, 8), (0, 5, 2, 8)),
    "no queries": ((1, 0, 2, 8), (1, 5, 2, 8)),
    "no keys": ((1, 4, 2, 8), (1, 0, 2, 8)),
    "no keys gqa": ((2, 3, 4, 8), (2, 0, 1, 8)),
}


@pytest.mark.parametrize("backend", ["split", "fused"])
@pytest.mark.parametrize("name", EMPTY)
def test_empty_shapes(name, backend):
    """Degenerate shapes give an empty result, or rows that see no key: 0 and +inf."""
    qs, ks = EMPTY[name]
    q = torch.randn(qs, requires_grad=True)
    k, v = (torch.randn(ks, requires_grad=True) for _ in range(2))
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, backend=backend)
    assert out.shape == qs and lse.shape == (qs[0], qs[2], qs[1])
    assert (out == 0).all() and (lse == float("inf")).all()
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()
    sdpa = aotattn.scaled_dot_product_attention(q.detach().transpose(1, 2), k.detach().transpose(1, 2),
                                                v.detach().transpose(1, 2), enable_gqa=True)
    assert sdpa.shape == (qs[0], qs[2], qs[1], qs[3]) and (sdpa == 0).all()


def test_empty_heads_varlen():
    q, k, v = (torch.randn(7, 0, 8) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse = aotattn.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, return_lse=True)
    assert out.shape == (7, 0, 8) and lse.shape == (0, 7)


# --------------------------------------------------------- the fused backward's NaN


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_fused_dq_finite_when_a_row_sees_one_key_with_a_very_negative_score(device, deterministic, request):
    """Found on the H200 (fp16, window (0, -1) bottom-right, scale -0.1): the last row sees
    exactly one key; when that score is very negative, p = exp(-lse) of the key block's
    zero-filled tail overflowed fp16 in the key-major dQ product, and inf * 0 gave a NaN row."""
    seed_from(request.node.name)
    if device == "cpu":
        batch, sq, sk, hq, hk, d, scale = 1, 16, 37, 2, 1, 16, -2.0
    else:
        batch, sq, sk, hq, hk, d, scale = 2, 2048, 3001, 8, 2, 128, -0.1
    q, k, v = make_qkv(batch, sq, sk, hq, hk, d, d, torch.float16, device)
    q, k, v = q * 1.5, k * 1.5, v * 1.5
    # the last row's only key: aligned with its query so that scale * q.k is very negative
    last_q = q[:, sq - 1, 0].float()
    k[:, sk - 1, 0] = (last_q * (-40.0 / (scale * last_q.pow(2).sum(-1, keepdim=True)))).to(torch.float16)
    for t in (q, k, v):
        t.requires_grad_()
    mask = dict(window_size=(0, -1), diagonal="bottom_right", softmax_scale=scale)
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, backend="fused", deterministic=deterministic, **mask)
    assert lse[:, 0, sq - 1].max() < -30, "the planted row must have a very negative log-sum-exp"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(reference.attention(qd, kd, vd, **mask)[0], (qd, kd, vd), dout.double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        assert rel_err(got, want) < TOLERANCE[torch.float16], name


# ------------------------------------------------------------------------ warnings


def test_cpu_calls_pass_under_warnings_as_errors():
    """A user's ``python -W error`` (or pytest's error filters) sees no interpreter warnings."""
    code = ("import torch, aotattn\n"
            "q = torch.randn(1, 40, 2, 16, requires_grad=True)\n"
            "k = torch.randn(1, 37, 1, 16, requires_grad=True)\n"
            "out = aotattn.flash_attn_func(q, k, k, causal=True, softmax_scale=-30.0)\n"
            "out.sum().backward()\n"
            "assert torch.isfinite(q.grad).all()\n"
            "aotattn.rms_norm(torch.randn(3, 5))\n")
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3])))
    assert run.returncode == 0, run.stderr[-2000:]


# ------------------------------------------------ the plan cache binds by role, trains too


def test_plan_cache_does_not_alias_self_attention_into_later_calls():
    """``f(x, x, x)`` first, then ``f(q, k, v)`` of the same layout: the cached launch must
    take q, k and v each from its own argument (it once bound them by object identity)."""
    x = torch.randn(1, 16, 2, 16)
    aotattn.flash_attn_func(x, x, x)
    q, k, v = (torch.randn(1, 16, 2, 16) for _ in range(3))
    assert_forward_matches(aotattn.flash_attn_func(q, k, v), None, q, k, v)
    query = torch.randn(1, 2, 16, 16)
    aotattn.scaled_dot_product_attention(query, query, query)
    query, key, value = (torch.randn(1, 2, 16, 16) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(query.double(), key.double(), value.double())
    assert rel_err(aotattn.scaled_dot_product_attention(query, key, value), want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend,deterministic", [(None, False), ("split", False), ("fused", False),
                                                   ("fused", True)])
def test_training_calls_served_by_the_plan_cache_match_the_reference(backend, deterministic):
    """Repeated training calls (inputs that require grad) replay cached forward and
    backward launches; every repeat, on fresh inputs, matches the reference."""
    ops._PLANS.entries.clear()
    for trial in range(3):
        q, k, v = make_qkv(2, 21, 27, 4, 2, 32, 32, torch.float32, "cpu", requires_grad=True)
        dout = torch.randn(2, 21, 4, 32)
        out = aotattn.flash_attn_func(q, k, v, causal=True, backend=backend, deterministic=deterministic)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = reference.attention(qd, kd, vd, causal=True)
        ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) < TOLERANCE[torch.float32], trial
    assert len(ops._PLANS.entries) == 1
    (entry,) = ops._PLANS.entries.values()
    assert len(entry.backwards) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("enable_gqa,backend,deterministic", [(False, None, False), (True, None, False),
                                                              (True, "fused", False), (False, "split", False),
                                                              (True, "fused", True)])
def test_cached_sdpa_training_calls_take_the_callers_layout(device, enable_gqa, backend, deterministic):
    """SDPA-layout training hits run on the caller's ``(B, H, S, D)`` tensors without
    views (the lean autograd Function; gradients allocated in the caller's layout, the
    fused backend's fp32 dQ accumulator too): output, gradients and their shapes match the
    reference on every repeat; only the inputs that require grad get one; a transposed
    dout, and one with a last stride of 2 (copied first)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    heads_k = 2 if enable_gqa else 6
    sq, sk, d = (37, 53, 32) if device == "cpu" else (1000, 1333, 128)
    ops._PLANS.entries.clear()
    for trial in range(4):
        query = torch.randn(2, 6, sq, d, dtype=dtype, device=device, requires_grad=True)
        key = torch.randn(2, heads_k, sk, d, dtype=dtype, device=device, requires_grad=trial != 1)
        value = torch.randn(2, heads_k, sk, d, dtype=dtype, device=device, requires_grad=True)
        out = aotattn.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=enable_gqa,
                                                   backend=backend, deterministic=deterministic)
        dout = {2: lambda: torch.randn(2, sq, 6, d, dtype=dtype, device=device).transpose(1, 2),
                3: lambda: torch.randn(2, 6, sq, 2 * d, dtype=dtype, device=device)[..., ::2]}.get(
                    trial, lambda: torch.randn_like(out))()
        wanted = [t for t in (query, key, value) if t.requires_grad]
        grads = torch.autograd.grad(out, wanted, dout)
        ref_in = [t.detach().double().requires_grad_() for t in (query, key, value)]
        ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=enable_gqa)
        ref_grads = torch.autograd.grad(ref, [r for r, t in zip(ref_in, (query, key, value)) if t.requires_grad],
                                        dout.double())
        assert out.shape == (2, 6, sq, d) and rel_err(out, ref) < TOLERANCE[dtype], trial
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape and rel_err(got, want) < TOLERANCE[dtype], trial
    assert len(ops._PLANS.entries) == 1


def test_cached_training_call_returning_the_lse():
    """``return_lse=True`` under autograd, warm: out and lse as the reference, lse not differentiable."""
    ops._PLANS.entries.clear()
    for trial in range(2):
        q, k, v = make_qkv(1, 19, 23, 2, 2, 16, 16, torch.float32, "cpu", requires_grad=True)
        out, lse = aotattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
        ref, ref_lse = reference.attention(*(t.detach().double() for t in (q, k, v)), causal=True)
        assert rel_err(out, ref) < TOLERANCE[torch.float32] and not lse.requires_grad
        assert torch.allclose(lse.double(), ref_lse, atol=1e-4)
        (dq,) = torch.autograd.grad(out.sum(), (q,))
        assert dq.shape == q.shape and torch.isfinite(dq).all()


def test_cached_training_call_with_a_strided_dout():
    ops._PLANS.entries.clear()
    for trial in range(2):
        q, k, v = make_qkv(1, 16, 16, 2, 2, 16, 16, torch.float32, "cpu", requires_grad=True)
        out = aotattn.flash_attn_func(q, k, v)
        dout = torch.randn(1, 2, 16, 32)[..., ::2].transpose(1, 2)  # last stride 2: copied first
        grads = torch.autograd.grad(out, (q, k, v), dout)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref_grads = torch.autograd.grad(reference.attention(qd, kd, vd)[0], (qd, kd, vd), dout.double())
        for got, want in zip(grads, ref_grads):
            assert rel_err(got, want) < TOLERANCE[torch.float32]


def _douts(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> dict:
    """Output gradients of one shape in every layout a caller may hand the backward."""
    b, h, s, d = shape
    n = b * h * s * d
    return {
        "contiguous": lambda: torch.randn(shape, dtype=dtype, device=device),
        "transposed": lambda: torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2),
        "last stride 2": lambda: torch.randn(b, h, s, 2 * d, dtype=dtype, device=device)[..., ::2],
        "odd offset": lambda: torch.randn(n + 1, dtype=dtype, device=device)[1:].view(shape),
        "expanded (a sum's)": lambda: torch.randn((), dtype=dtype, device=device).expand(shape),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", [None, "split", "fused"])
def test_cached_sdpa_backward_in_every_dout_layout_twice(device, backend, monkeypatch):
    """A warm backward picks its launches, and whether dout is copied first, by dout's
    layout as it comes: each layout twice (the second a hit), interleaved, on fresh
    inputs, against the float64 reference; one prepared backward per layout, and one copy
    of dout per call that needs one (the first call launches on the copy planning made)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shape = (2, 4, 29, 32) if device == "cpu" else (2, 8, 1031, 128)
    ops._PLANS.entries.clear()
    copies = []

    def counted_copy(dout, copy=planning.dout_copy):
        copies.append(dout.shape)
        return copy(dout)

    monkeypatch.setattr(planning, "dout_copy", counted_copy)
    monkeypatch.setattr(ops, "dout_copy", counted_copy)
    layouts = _douts(shape, dtype, device)
    made = {}
    for name in [*layouts, *layouts]:
        q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        out = aotattn.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
        dout = layouts[name]()
        before = len(copies)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        made.setdefault(name, []).append(len(copies) - before)
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True)
        ref_grads = torch.autograd.grad(ref, ref_in, dout.double())
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape and rel_err(got, want) < TOLERANCE[dtype], name
    (entry,) = ops._PLANS.entries.values()
    assert len(entry.backwards) == len(layouts)
    keys = {name: (t.stride(), t.data_ptr() % 16 == 0) for name, t in ((n, make()) for n, make in layouts.items())}
    copied = sorted(name for name, key in keys.items()
                    for choice, (*_, copy) in entry.backwards.items() if choice[:2] == key and copy)
    assert copied == ["expanded (a sum's)", "last stride 2", "odd offset"]
    assert made == {name: [1, 1] if name in copied else [0, 0] for name in layouts}


@pytest.mark.parametrize("bad,error", [(dict(backend="bogus"), ValueError), (dict(deterministic=1), TypeError)])
def test_plan_cache_checks_backward_options_when_warm(bad, error):
    q, k, v = (torch.randn(1, 8, 2, 16, requires_grad=True) for _ in range(3))
    good = {"backend": "split", "deterministic": True}
    good = {name: good[name] for name in bad}
    for _ in range(2):
        aotattn.flash_attn_func(q, k, v, **good).sum().backward()
    with pytest.raises(error, match=next(iter(bad))):
        aotattn.flash_attn_func(q, k, v, **bad)
    with torch.no_grad(), pytest.raises(error, match=next(iter(bad))):
        aotattn.flash_attn_func(q, k, v, **bad)


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_large_scores_keep_the_documented_gradient_accuracy(backend, request):
    """The backward recomputes p = exp(s - lse) from the stored float32 lse, whose rounding
    (|lse| 2^-23 in the exponent) bounds its accuracy (docs/semantics.md, softmax_scale):
    at |lse| near 2e3 the gradients stay within 2e-4 of the float64 reference."""
    seed_from(request.node.name)
    q, k, v = make_qkv(1, 64, 64, 2, 2, 16, 16, torch.float32, "cpu", requires_grad=True)
    out, lse = aotattn.flash_attn_func(q, k, v, softmax_scale=100.0, return_lse=True, backend=backend)
    assert 5e2 < lse.abs().max() < 1e4
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(reference.attention(qd, kd, vd, softmax_scale=100.0)[0], (qd, kd, vd),
                                    dout.double())
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < 2e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["split", "fused"])
def test_values_near_the_fp16_limit(device, backend, request):
    """v entries up to 65000 (fp16's largest is 65504): the forward is within the dtype's
    tolerance and never overflows (a weighted mean of v; P is rounded to the dtype for the
    P V product while its row sum is not, so a column of 65504s could round past 65504).
    The backward rounds dS = P * (dP - delta) to the input dtype for the tensor cores, as
    flash-attn and PyTorch's flash backend do (docs/semantics.md, "Gradients in float16"):
    in fp16 a gradient may be inf where some |dS| of its row or column passes 65504 (or the
    gradient itself does), and only there; bf16 keeps every gradient finite and within its
    tolerance."""
    seed_from(request.node.name)
    b, s, h, d = 1, 37, 2, 16
    q, k = (torch.randn(b, s, h, d, device=device) for _ in range(2))
    v = (torch.rand(b, s, h, d, device=device) * 2 - 1) * 65000
    v[..., 0] = 60000  # every key: column 0 of the output is 60000
    dout = torch.randn(b, s, h, d, device=device) * 4  # |dS| passes 65504 somewhere (~3e5 at most)
    for dtype in (torch.float16, torch.bfloat16):
        qd, kd, vd = (t.to(dtype).double().requires_grad_() for t in (q, k, v))
        ref_out, _ = reference.attention(qd, kd, vd)
        ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), dout.to(dtype).double())
        # dS of the reference, (B, H, Sq, Sk): rows are queries (dQ), columns keys (dK)
        scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) / d**0.5
        p = scores.softmax(-1)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout.to(dtype).double(), vd)
        ds = (p * (dp - (p * dp).sum(-1, keepdim=True))).detach()
        past = ds.abs() > 65504

        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = aotattn.flash_attn_func(*x, backend=backend)
        assert out.isfinite().all()
        assert torch.allclose(out[..., 0].double(), ref_out[..., 0], rtol=2e-3 if dtype == torch.float16 else 8e-3)
        assert rel_err(out, ref_out) < TOLERANCE[dtype]
        grads = torch.autograd.grad(out, x, dout.to(dtype))
        if dtype == torch.bfloat16:
            for got, want in zip(grads, ref_grads):
                assert got.isfinite().all() and rel_err(got, want) < TOLERANCE[dtype]
            continue
        assert past.any()  # the case exercises the limit
        may_overflow = {0: past.any(-1).transpose(1, 2), 1: past.any(-2).transpose(1, 2)}  # (B, S, H) rows of dQ, dK
        for i, (got, want) in enumerate(zip(grads, ref_grads)):
            bad = ~got.isfinite()
            allowed = want.abs() >= 65504  # the exact gradient itself is past fp16's range
            if i < 2:  # dV = P^T dO takes no dS
                allowed = allowed | may_overflow[i][..., None]
            assert not (bad & ~allowed).any(), i
            ok = ~bad & (want.abs() < 65504)
            assert rel_err(got[ok], want[ok]) < TOLERANCE[dtype], i


# ------------------------------------------------------------------ checkpointing and in-place changes


@pytest.mark.parametrize("api", ["sdpa", "flash"])
@pytest.mark.parametrize("state", ["cold", "warm", "evicted"])
@pytest.mark.parametrize("shape", [(1, 4, 4, 32), (2, 3, 19, 16)], ids=["square", "odd"])
def test_non_reentrant_checkpoint_recomputes_what_the_forward_saved(api, state, shape):
    """``torch.utils.checkpoint(use_reentrant=False)`` hands the backward the tensors its
    recomputation saves in place of the forward's, by position. The first call of a shape
    misses the plan cache and its recomputation hits (cold); an entry evicted between the
    two does the reverse. Both paths must save the same tensors in the same layout: SDPA's
    uncached path saved flash-attn-layout views, so heads == rows (square) gave wrong
    gradients silently and other shapes a CheckpointError (or a double free without the
    determinism check)."""
    torch.manual_seed(sum(shape) + len(state))
    ops._PLANS.entries.clear()
    if api == "sdpa":
        attend = lambda a, b, c: aotattn.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
        ref_fn = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
    else:
        attend = lambda a, b, c: aotattn.flash_attn_func(a, b, c, causal=True)  # noqa: E731
        ref_fn = lambda a, b, c: reference.attention(a, b, c, causal=True)[0]  # noqa: E731
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    if state != "cold":
        attend(q, k, v)  # the entry is stored
    out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)
    if state == "evicted":
        ops._PLANS.entries.clear()  # the forward hit, its recomputation will miss
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(ref_fn(qd, kd, vd), (qd, kd, vd), dout.double())
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOLERANCE[torch.float32]


def _changed_in_place(name):
    """(call, change) for a training call whose backward reads a tensor that ``change``
    modifies in place afterwards."""
    q, k, v = (torch.randn(1, 20, 2, 16, requires_grad=True) for _ in range(3))
    if name == "bias":
        bias = torch.randn(1, 2, 20, 20)
        return lambda: aotattn.flash_attn_func(q, k, v, bias=bias), lambda: bias.mul_(5)
    if name == "broadcast-bias-base":
        base = torch.randn(20, 20)
        return lambda: aotattn.flash_attn_func(q, k, v, bias=base[None, None]), lambda: base.add_(1)
    if name == "attn_mask":
        mask = torch.randn(1, 2, 20, 20)
        return (lambda: aotattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             attn_mask=mask), lambda: mask.zero_())
    packed = [t[0] for t in (q, k, v)]
    offsets = {"cu_seqlens_q": torch.tensor([0, 5, 20], dtype=torch.int32),
               "cu_seqlens_k": torch.tensor([0, 7, 20], dtype=torch.int32)}
    change = {"cu_seqlens_q": lambda: offsets["cu_seqlens_q"].__setitem__(1, 12),
              "cu_seqlens_k": lambda: offsets["cu_seqlens_k"].__setitem__(2, 2000)}[name]
    return (lambda: aotattn.flash_attn_varlen_func(*packed, offsets["cu_seqlens_q"], offsets["cu_seqlens_k"], 15, 15,
                                                   causal=True), change)


@pytest.mark.parametrize("name", ["bias", "broadcast-bias-base", "attn_mask", "cu_seqlens_q", "cu_seqlens_k"])
def test_a_saved_tensor_changed_in_place_before_the_backward_is_refused(name):
    """As PyTorch's SDPA (attn_mask) and flash-attn (offsets) do: autograd's version check
    raises. The backward read them from the call instead: changed biases gave other
    gradients, changed offsets read past the tensors (a double free)."""
    call, change = _changed_in_place(name)
    out = call()
    with torch.no_grad():
        change()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ------------------------------------------------------------------ autocast


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", [None, "float", "bool"])
def test_sdpa_follows_autocast_as_pytorchs_does(device, mask, request):
    """PyTorch's SDPA is on autocast's lower-precision list: in an autocast region float32
    (and float16 under bfloat16) inputs, a float mask too, run in the region's dtype, and
    gradients come back in the inputs' dtype. The drop-in does the same; float64 and
    regions of another device are left alone."""
    seed_from(request.node.name)
    sq, sk, d = (24, 29, 16) if device == "cpu" else (1000, 1333, 128)
    query = torch.randn(2, 4, sq, d, device=device, requires_grad=True)
    key, value = (torch.randn(2, 4, sk, d, device=device, requires_grad=True) for _ in range(2))
    attn_mask = {None: None, "float": torch.randn(2, 1, sq, sk, device=device),
                 "bool": torch.rand(2, 1, sq, sk, device=device) > 0.3}[mask]
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast(device, dtype=dtype):
            out = aotattn.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)
        assert out.dtype == dtype
        grads = torch.autograd.grad(out.float().sum(), (query, key, value))
        ref_in = [t.detach().double().requires_grad_() for t in (query, key, value)]
        rounded = [t.to(dtype).double() for t in ref_in]  # what autocast hands the kernels
        ref_mask = attn_mask.to(dtype).double() if mask == "float" else attn_mask
        ref = torch.nn.functional.scaled_dot_product_attention(*rounded, attn_mask=ref_mask)
        ref_grads = torch.autograd.grad(ref.sum(), ref_in)
        assert rel_err(out, ref) < TOLERANCE[dtype]
        for got, want in zip(grads, ref_grads):
            assert got.dtype == torch.float32 and rel_err(got, want) < 2 * TOLERANCE[dtype]
    other = "cuda" if device == "cpu" else "cpu"
    with torch.autocast(other, dtype=torch.bfloat16):
        assert aotattn.scaled_dot_product_attention(query, key, value).dtype == torch.float32


# ------------------------------------------------------------------ SDPA of any rank


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["2-D", "2-D causal", "3-D mask", "3-D gqa", "5-D bool mask", "5-D gqa", "6-D causal",
                                  "5-D no rows", "5-D no keys", "5-D no heads"])
def test_sdpa_takes_the_ranks_pytorchs_does(device, case, request):
    """``(..., L, E)`` of rank 2, 3 or past 4, as PyTorch's SDPA: output shape, values and
    gradients against PyTorch's in float64, masks broadcast as it broadcasts them."""
    seed_from(request.node.name)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sq, sk, d = (6, 9, 16) if device == "cpu" else (700, 901, 128)
    sq = 0 if case == "5-D no rows" else sq
    sk = 0 if case == "5-D no keys" else sk
    lead_q, lead_k, mask_shape, options = {
        "2-D": ((), (), None, {}),
        "2-D causal": ((), (), None, {"is_causal": True}),
        "3-D mask": ((2,), (2,), ("float", (sq, sk)), {}),
        "3-D gqa": ((4,), (2,), None, {"enable_gqa": True}),
        "5-D bool mask": ((3, 2, 2), (3, 2, 2), ("bool", (2, 1, sq, sk)), {}),
        "5-D gqa": ((3, 2, 4), (3, 2, 2), ("float", (3, 1, 1, sq, sk)), {"enable_gqa": True}),
        "6-D causal": ((2, 1, 2, 2), (2, 1, 2, 2), None, {"is_causal": True}),
        "5-D no rows": ((2, 1, 2), (2, 1, 2), ("float", (2, 1, 1, sq, sk)), {}),
        "5-D no keys": ((2, 1, 2), (2, 1, 2), None, {}),
        "5-D no heads": ((2, 1, 0), (2, 1, 0), None, {}),
    }[case]

    query = torch.randn(*lead_q, sq, d, dtype=dtype, device=device, requires_grad=True)
    key, value = (torch.randn(*lead_k, sk, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    mask = None
    if mask_shape is not None:
        kind, shape = mask_shape
        mask = torch.randn(shape, device=device) if kind == "float" else torch.rand(shape, device=device) > 0.2
    out = aotattn.scaled_dot_product_attention(query, key, value, attn_mask=mask, **options)
    ref_in = [t.detach().double().requires_grad_() for t in (query, key, value)]
    ref_mask = mask.to(dtype).double() if mask is not None and mask.is_floating_point() else mask
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=ref_mask, **options)
    assert out.shape == ref.shape == (*lead_q, sq, d) and out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (query, key, value), dout)
    for got, want, t in zip(grads, torch.autograd.grad(ref, ref_in, dout.double()), (query, key, value)):
        assert got.shape == t.shape and rel_err(got, want) < TOLERANCE[dtype]


# ------------------------------------------------------------------ flash-attn's signature


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_calls_run_unchanged(device, request):
    """flash-attn's positional order (dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes, deterministic, return_attn_probs): its calls run unchanged, cold and warm,
    and ``return_attn_probs`` returns ``(out, lse, None)`` as flash-attn's does without
    dropout. The eighth position was ``diagonal`` (a ValueError on softcap's 0.0)."""
    seed_from(request.node.name)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sq, d = (19, 16) if device == "cpu" else (1000, 128)
    q, k, v = make_qkv(2, sq, sq + 5, 4, 2, d, d, dtype, device)
    ref, ref_lse = reference.attention(q.double(), k.double(), v.double(), causal=True, window_size=(7, -1))
    for _ in range(2):
        out = aotattn.flash_attn_func(q, k, v, 0.0, None, True, (7, -1), 0.0, None, True)
        assert rel_err(out, ref) < TOLERANCE[dtype]
        out, lse, probs = aotattn.flash_attn_func(q, k, v, 0.0, None, True, (7, -1), 0.0, None, False, True)
        assert probs is None and rel_err(out, ref) < TOLERANCE[dtype]
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=1e-5, atol=2e-4)
    offsets = torch.tensor([0, 5, 2 * sq], dtype=torch.int32, device=device)
    packed = [t.flatten(0, 1)[:2 * sq] for t in (q, k, v)]
    out, lse, probs = aotattn.flash_attn_varlen_func(*packed, offsets, offsets, 2 * sq, 2 * sq, 0.0, None, True,
                                                     (-1, -1), 0.0, None, False, True, None)
    ref = reference.attention_varlen(*(t.double() for t in packed), offsets, offsets, causal=True)[0]
    assert probs is None and rel_err(out, ref) < TOLERANCE[dtype]
    with pytest.raises(ValueError, match="block_table: expected None"):
        aotattn.flash_attn_varlen_func(*packed, offsets, offsets, 2 * sq, 2 * sq, block_table=offsets)


# ------------------------------------------------------------------ offsets past 2**31 elements


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["split", "fused"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_past_2_31_elements_from_their_tensors_start(device, backend, causal, request):
    """q, k and v are views of one 4 GiB buffer whose rows lie 2**28 elements apart (an
    (S, B, H, D) layout with B H D = 2**28 has that row stride): row 8 starts 2**31 elements
    in. The images take strides as the declared i64; Triton's JIT and interpreter typed them
    by value (an i32), and ``key * stride`` wrapped in 32 bits: the interpreter read outside
    the buffer (a segmentation fault) at key 8. The buffer is never written past the rows
    used: a bare storage, whose pages the OS commits only where written (not torch.empty,
    which the suite's poison_allocations fills with NaN)."""
    seed_from(request.node.name)
    seqlen, head_dim, stride = 9, 64, 2**28
    storage = torch.UntypedStorage(((seqlen - 1) * stride + 4 * head_dim) * 2, device=device)
    q, k, v = (torch.tensor([], dtype=torch.bfloat16, device=device).set_(
        storage, i * head_dim, (1, seqlen, 1, head_dim), (seqlen * stride, stride, head_dim, 1)) for i in range(3))
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, dtype=t.dtype))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = aotattn.flash_attn_func(q, k, v, causal=causal, backend=backend)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(qd, kd, vd, causal=causal)[0]
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", [None, "split", "fused"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_one_key_head_expanded_over_the_query_heads(device, backend, head_dim, request):
    """MQA written as an expand: k and v of one head viewed as Hq heads (a head stride of
    0, which the ws kernels' 4-D tensor descriptors step over), causal with fewer queries
    than keys; dK and dV summed over the heads by autograd."""
    seed_from(request.node.name)
    batch, seqlen_q, seqlen_k, heads = 2, 200 if device == "cuda" else 40, 333 if device == "cuda" else 53, 4
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k1, v1 = (torch.randn(batch, seqlen_k, 1, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
              for _ in range(2))
    k, v = k1.expand(-1, -1, heads, -1), v1.expand(-1, -1, heads, -1)
    assert k.stride(2) == 0
    out = aotattn.flash_attn_func(q, k, v, causal=True, backend=backend)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k1, v1), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k1, v1))
    ref = reference.attention(qd, kd.expand(-1, -1, heads, -1), vd.expand(-1, -1, heads, -1), causal=True)[0]
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), dout.double())
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    for name, got, want in zip("qkv", grads, ref_grads):
        assert rel_err(got, want) < TOLERANCE[torch.bfloat16], f"d{name}"


# ------------------------------------------------------------------ meta tensors

_META_CALLS = {
    "flash causal": lambda q, k, v, cu: aotattn.flash_attn_func(q, k, v, causal=True),
    "flash lse": lambda q, k, v, cu: aotattn.flash_attn_func(q, k, v, return_lse=True)[1],
    "flash gqa window": lambda q, k, v, cu: aotattn.flash_attn_func(q, k[:, :, :1], v[:, :, :1], window_size=(3, 1)),
    "flash d57": lambda q, k, v, cu: aotattn.flash_attn_func(q[..., :57], k[..., :57], v[..., :40]),
    "flash dropout": lambda q, k, v, cu: aotattn.flash_attn_func(q, k, v, dropout_p=0.3),
    "sdpa bool mask": lambda q, k, v, cu: aotattn.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=torch.ones(19, 19, dtype=torch.bool,
                                                                                      device=q.device).tril()),
    "sdpa 3-D": lambda q, k, v, cu: aotattn.scaled_dot_product_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                                          v[0].transpose(0, 1), is_causal=True),
    "varlen": lambda q, k, v, cu: aotattn.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                                 cu, cu, 19, 19, causal=True),
    "rms_norm": lambda q, k, v, cu: aotattn.rms_norm(q, torch.ones(q.shape[-1], dtype=q.dtype, device=q.device)),
}


@pytest.mark.parametrize("name", list(_META_CALLS))
def test_meta_tensors_give_the_shapes_dtypes_and_strides_of_a_real_call(name):
    """Shape inference on ``device="meta"`` (docs/semantics.md, Devices): the result of the
    same call on CPU tensors, less the values; gradients too where the call has them."""
    call = _META_CALLS[name]
    results = {}
    for device in ("cpu", "meta"):
        q, k, v = (torch.randn(2, 19, 3, 64, device=device, dtype=torch.bfloat16,
                               requires_grad=name != "rms_norm") for _ in range(3))
        cu = torch.tensor([0, 19, 38], dtype=torch.int32, device=device)
        out = call(q, k, v, cu)
        grads = ()
        if out.requires_grad:
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), allow_unused=True)
        results[device] = [(t.shape, t.dtype, t.stride()) for t in (out, *grads) if t is not None]
        assert all(t.device.type == device for t in (out, *grads) if t is not None)
    assert results["meta"] == results["cpu"]


def test_meta_tensors_are_checked_as_any_other():
    q = torch.randn(1, 8, 2, 16, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="k: expected device meta"):
        aotattn.flash_attn_func(q, torch.randn(1, 8, 2, 16, dtype=torch.float16), q)
    with pytest.raises(ValueError, match="q: expected a head dim in 1..256"):
        bad = torch.randn(1, 8, 2, 300, device="meta", dtype=torch.float16)
        aotattn.flash_attn_func(bad, bad, bad)
    with pytest.raises(ValueError, match="window_size"):
        aotattn.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="device"):
        aotattn.dropout_mask(1, 2, 8, 8, 0.5, device="meta")
