"""RMSNorm against its float64 reference, and its argument checks."""

from __future__ import annotations

import pytest
import torch

import aotattn
from aotattn.families.rmsnorm.reference import rms_norm
from tests.helpers import DEVICES, TOLERANCE, rel_err
from tests.families.flash.helpers import seed_from


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("cols", [1, 100, 256, 1000, 5000])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(request, device, dtype, cols, weighted):
    seed_from(request.node.nodeid)
    x = torch.randn(3, 7, cols, dtype=dtype, device=device) * 3 + 0.5
    w = torch.randn(cols, dtype=dtype, device=device) if weighted else None
    y = aotattn.rms_norm(x, w, eps=1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, rms_norm(x, w, eps=1e-5)) < TOLERANCE[dtype]


def test_strided_rows():
    x = torch.randn(8, 2, 300)[:, 1]
    assert rel_err(aotattn.rms_norm(x), rms_norm(x)) < 1e-5


@pytest.mark.parametrize("args, exc, message", [
    (([1.0],), TypeError, "x: expected a torch.Tensor"),
    ((torch.randn(4, 8, dtype=torch.float64),), TypeError, "x: expected dtype"),
    ((torch.randn(4, 20000),), ValueError, "x: expected a last dimension of 1..16384"),
    ((torch.randn(4, 8), torch.randn(7)), ValueError, "weight: expected shape (8,)"),
    ((torch.randn(4, 8), torch.randn(8, dtype=torch.float16)), TypeError, "weight: expected dtype torch.float32"),
    ((torch.randn(4, 8), None, float("nan")), ValueError, "eps: expected a non-negative number"),
    ((torch.randn(4, 8), None, -1e-6), ValueError, "eps: expected a non-negative number"),
    ((torch.randn(4, 8), None, 1e39), ValueError, "up to 3.4e+38"),
    ((torch.randn(4, 8), None, "1e-6"), TypeError, "eps: expected a real number, got str"),
    ((torch.randn(4, 8), None, True), TypeError, "eps: expected a real number, got bool"),
    ((torch.randn(8, 4).t(),), ValueError, "x: expected a unit stride"),
])
def test_rejects(args, exc, message):
    with pytest.raises(exc) as info:
        aotattn.rms_norm(*args)
    assert message in str(info.value)
