"""Shared test machinery: NaN-poisoned allocations, the GPU marker, error norms."""

from __future__ import annotations

import pytest
import torch

# Relative error norms ||out - ref|| / ||ref|| against the float64 reference.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Every buffer an operator allocates starts as NaN, so an unwritten element fails."""
    from aotattn.families.flash import ops

    def nan_empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(ops, "_empty", nan_empty)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; NaN anywhere gives inf so it never passes."""
    out = out.to(torch.float64)
    ref = ref.to(torch.float64)
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
