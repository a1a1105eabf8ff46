"""Kernel arguments are bound by name against the one declaration (aotattn.spec.KernelSpec)."""

from __future__ import annotations

import pytest
import torch

from aotattn.families import kernels
from aotattn.families.flash import planning, rules
from aotattn.families.flash.checks import check_flash
from aotattn.spec import Arg, KernelSpec

SPEC = KernelSpec(family="toy", name="k", module="m", function="f",
                  arguments=(Arg("X", "*fp32"), Arg("stride_xz", "i64"), Arg("stride_xm", "i64"), Arg("n", "i32")),
                  functionals=(), tuning_space=())


def test_bind_orders_by_the_declaration():
    x = torch.zeros(3)
    assert SPEC.bind(n=7, stride_xm=1, X=x, stride_xz=5) == (x, 5, 1, 7)
    assert SPEC.bind(X=x, n=7, **SPEC.strides("x", (5, 1))) == (x, 5, 1, 7)


def test_bind_refuses_missing_and_unknown_names():
    x = torch.zeros(3)
    with pytest.raises(TypeError, match=r"toy.k: missing kernel arguments \['stride_xm'\]"):
        SPEC.bind(X=x, stride_xz=5, n=7)
    with pytest.raises(TypeError, match=r"toy.k: unknown kernel arguments \['stride_xq'\]"):
        SPEC.bind(X=x, stride_xz=5, stride_xm=1, n=7, stride_xq=2)


def test_strides_must_match_the_declared_group():
    with pytest.raises(TypeError, match="3 strides for 'x'"):
        SPEC.strides("x", (1, 2, 3))
    with pytest.raises(TypeError, match="for 'y', but the kernel declares none"):
        SPEC.strides("y", (1,))


def test_every_kernel_declares_whole_stride_groups():
    """Stride arguments are named stride_<tensor><axis>; each group has one name per axis."""
    for spec in kernels().values():
        for tensor, names in spec.stride_groups.items():
            assert len(set(n[-1] for n in names)) == len(names), (spec.qualname, tensor, names)


@pytest.mark.parametrize("backend,deterministic", [("split", False), ("fused", False), ("fused", True)])
def test_plans_bind_every_argument_of_their_kernel(backend, deterministic):
    """Each plan's tuple has exactly the kernel's arguments, each stride from its own tensor."""
    q = torch.randn(2, 8, 4, 16)[:, :, :, :]
    k, v = torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16).transpose(1, 2).contiguous().transpose(1, 2)
    p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=True, window_size=(-1, -1),
                    diagonal="bottom_right")
    c = planning.new_call(p, q, k, v)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 8)
    fwd = planning.forward_plan(c, q, k, v, out, lse)
    named = dict(zip(fwd.kernel.argument_names, fwd.args))
    assert named["V"] is v and named["stride_vn"] == v.stride(1) and named["stride_vh"] == v.stride(2)
    assert named["stride_kn"] == k.stride(1) and named["stride_lh"] == lse.stride(1)
    dq = torch.empty_like(q, dtype=torch.float32 if backend == "fused" and not deterministic else q.dtype)
    plans = planning.backward_plans(c, torch.randn_like(q), q, k, v, out, lse, torch.empty(2, 4, 8), dq,
                                    torch.empty_like(k), torch.empty_like(v), None, backend, deterministic)
    # split: dQ writes the stats, then dK/dV reads them; fused: the preprocess writes them
    first = rules.ATTN_BWD_DQ if backend == "split" else rules.ATTN_BWD_PREPROCESS
    assert [pl.kernel.name for pl in plans][0] == first.name
    for plan in [fwd, *plans]:
        assert len(plan.args) == len(plan.kernel.arguments)
        named = dict(zip(plan.kernel.argument_names, plan.args))
        if "stride_vn" in named:
            assert named["stride_vn"] == v.stride(1) != k.stride(1)
        if "Out" in named and plan is not fwd:  # the stats' writer reads the forward's output and lse
            assert named["Out"] is out and named["Lse"] is lse and named["stride_lh"] == lse.stride(1)


def test_every_backward_row_block_divides_the_stats_rows():
    """The stats' rows are rounded up to STATS_ROWS, and their writers (the preprocess, the
    dQ kernel's padding loop) and readers (dK/dV without a mask) step in BLOCK_M: a
    BLOCK_M the tuner may choose that did not divide it would read or write past them."""
    for spec in (rules.ATTN_BWD_PREPROCESS, rules.ATTN_BWD_DKDV, rules.ATTN_BWD_DQ, rules.ATTN_BWD_FUSED):
        blocks = dict(spec.tuning_space)["BLOCK_M"]
        assert all(planning.STATS_ROWS % b == 0 for b in blocks), (spec.name, blocks)
