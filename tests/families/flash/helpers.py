"""Inputs and comparisons shared by the flash-attention tests."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from aotattn import reference
from aotattn.families.flash import ops, rules
from aotattn.families.flash.checks import check_flash
from aotattn.spec import Config
from tests.helpers import TOLERANCE, rel_err


def config_override(monkeypatch) -> Callable[[Callable], None]:
    """``use(change)``: from then on every tuned configuration the operators look up is
    ``change(kernel, functional, config)`` of the database's (plans cached before are
    dropped; the plan cache is emptied again by the caller's teardown)."""
    original = rules.config_for

    def use(change: Callable) -> None:
        def config_for(kernel, functional, device, **sizes):
            return change(kernel, functional, original(kernel, functional, device, **sizes))

        monkeypatch.setattr(rules, "config_for", config_for)
        ops._PLANS.entries.clear()

    return use


def forced_kernel(monkeypatch, operator, choice: Config, kernel) -> Callable[[Config], None]:
    """``use(config)``: from then on the ``operator`` table says ``choice`` in every cell and
    ``kernel`` runs with ``config`` wherever it serves (a warp-specialized kernel under
    test: ``flash.forward`` engine=ws, ``flash.backward`` backend=ws)."""
    override = config_override(monkeypatch)

    def use(config: Config) -> None:
        override(lambda k, functional, chosen: choice if k is operator else config if k is kernel else chosen)

    return use


def problem(q, k, v, **kwargs):
    """The validated problem of ``flash_attn_func(q, k, v, **kwargs)``."""
    call = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
            "diagonal": "bottom_right", **kwargs}
    return check_flash(q, k, v, **call)


def dense_functional(dtype="bf16", d=128, mask=rules.MASK_NONE, **changes) -> dict:
    """A kernel functional of equal unpadded heads, no varlen, dropout or bias."""
    return {"dtype": dtype, "BLOCK_D": d, "BLOCK_DV": d, "PAD_HEAD": False, "MASK": mask, "VARLEN": False,
            "DROPOUT": False, "BIAS": rules.BIAS_NONE, **changes}


def seed_from(name: str) -> None:
    """Fresh inputs per test, reproducible from the test's id."""
    torch.manual_seed(zlib.crc32(name.encode()))


def make_qkv(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_k: int, head_dim: int,
             head_dim_v: int, dtype: torch.dtype, device: str, requires_grad: bool = False):
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim_v, dtype=dtype, device=device)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def assert_lse_close(lse: torch.Tensor, ref_lse: torch.Tensor) -> None:
    """Same +inf rows; finite rows within fp32 rounding of the score computation."""
    lse = lse.detach().to(torch.float64)
    assert not torch.isnan(lse).any(), "NaN in log-sum-exp"
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf), "rows with +inf log-sum-exp differ from the reference"
    assert (lse[inf] > 0).all()
    torch.testing.assert_close(lse[~inf], ref_lse[~inf], rtol=1e-5, atol=2e-4)


def assert_forward_matches(out: torch.Tensor, lse: torch.Tensor | None, q, k, v, **mask) -> None:
    # the reference runs in float64 on the inputs' device
    ref_out, ref_lse = reference.attention(q.detach(), k.detach(), v.detach(), **mask)
    assert out.shape == ref_out.shape and out.dtype == q.dtype
    err = rel_err(out.detach(), ref_out)
    assert err < TOLERANCE[q.dtype], f"relative error {err:.3e} >= {TOLERANCE[q.dtype]:.0e}"
    empty_rows = torch.isinf(ref_lse).transpose(1, 2)  # (B, Sq, Hq)
    assert (out.detach()[empty_rows] == 0).all(), "a fully masked row is not exactly 0"
    if lse is not None:
        assert_lse_close(lse, ref_lse)
