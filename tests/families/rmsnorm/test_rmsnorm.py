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
    ((torch.randn(4, 8), None, float("nan")), ValueError, "eps: expected 0 or a number from 1.4e-45"),
    ((torch.randn(4, 8), None, -1e-6), ValueError, "eps: expected 0 or a number from 1.4e-45"),
    ((torch.randn(4, 8), None, 10**400), ValueError, "eps: expected 0 or a number from 1.4e-45 to 3.4e+38"),
    ((torch.randn(4, 8), None, -10**400), ValueError, "eps: expected 0 or a number"),
    ((torch.randn(4, 8), None, 1e39), ValueError, "to 3.4e+38"),
    ((torch.randn(4, 8), None, 1e-50), ValueError, "less rounds to 0"),  # was 0 in the kernel: NaN on a zero row
    ((torch.randn(4, 8), None, "1e-6"), TypeError, "eps: expected a real number, got str"),
    ((torch.randn(4, 8), None, True), TypeError, "eps: expected a real number, got bool"),
    ((torch.randn(8, 4).t(),), ValueError, "x: expected a unit stride"),
    # sparse tensors made torch raise from inside (reshape, contiguous)
    ((torch.randn(4, 8).to_sparse(),), ValueError, "x: expected a dense (strided) tensor, got layout torch.sparse_coo"),
    ((torch.randn(4, 8), torch.randn(8).to_sparse()), ValueError, "weight: expected a dense (strided) tensor"),
    ((torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)]),), ValueError, "got layout nested"),
])
def test_rejects(args, exc, message):
    with pytest.raises(exc) as info:
        aotattn.rms_norm(*args)
    assert message in str(info.value)


def test_vmap_is_refused_clearly():
    """vmap's batched tensors have no storage (torch raised "Cannot access storage of
    BatchedTensorImpl" from inside): refused at the boundary, naming the argument."""
    x, w = torch.randn(3, 4, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="^x: expected a plain tensor, got one wrapped by a torch.func"):
        torch.vmap(aotattn.rms_norm)(x)
    with pytest.raises(ValueError, match="^weight: expected a plain tensor"):
        torch.vmap(lambda w: aotattn.rms_norm(x[0], w))(w)


def test_dual_tensors_of_forward_mode_ad_are_refused_clearly():
    """No JVP rule: a dual x or weight (forward_ad.make_dual) had its tangent dropped."""
    from torch.autograd import forward_ad

    x, w = torch.randn(4, 8), torch.randn(8)
    with forward_ad.dual_level():
        with pytest.raises(ValueError, match="^x: expected a plain tensor, got a dual tensor of forward-mode AD"):
            aotattn.rms_norm(forward_ad.make_dual(x, torch.randn_like(x)), w)
        with pytest.raises(ValueError, match="^weight: expected a plain tensor, got a dual tensor"):
            aotattn.rms_norm(x, forward_ad.make_dual(w, torch.randn_like(w)))
        y = aotattn.rms_norm(x, w)
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * w.double()
    assert (y.double() - ref).abs().max() < 1e-5


@pytest.mark.parametrize("needs_grad", ["x", "weight"])
def test_no_gradient_is_silently_dropped(request, needs_grad):
    """rms_norm has no backward. Its result used to be detached from its inputs, so
    ``rms_norm(x) + x`` backpropagated through ``x`` alone: a silently wrong gradient.
    Now backpropagating through it raises; the forward is unchanged, and under no_grad
    (or without inputs that require grad) the result is a plain tensor."""
    seed_from(request.node.nodeid)
    x, w = torch.randn(5, 24), torch.randn(24)
    (x if needs_grad == "x" else w).requires_grad_()
    y = aotattn.rms_norm(x, w)
    assert rel_err(y.detach(), rms_norm(x.detach(), w.detach())) < TOLERANCE[torch.float32]
    with pytest.raises(RuntimeError, match="aotattn.rms_norm has no backward"):
        (y + x + w).sum().backward()
    with torch.no_grad():
        assert not aotattn.rms_norm(x, w).requires_grad
    assert not aotattn.rms_norm(x.detach(), w.detach()).requires_grad


def test_under_torch_compile(request):
    """A compiled caller gets the reference's answer through a custom op (checked while
    Dynamo traces); Dynamo used to trace into the launch and fail inside Triton's
    interpreter. (`torch.compiler.disable` at import imported Dynamo and Triton with aotattn.)"""
    seed_from(request.node.nodeid)
    x, w = torch.randn(6, 40), torch.randn(40)
    compiled = torch.compile(lambda x, w: aotattn.rms_norm(x * 2.0, w) + 1.0, backend="eager")
    assert rel_err(compiled(x, w), rms_norm(x * 2.0, w) + 1.0) < TOLERANCE[torch.float32]
    # one opaque node (no trace into the launch), and, as in eager mode, no silent gradient
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.compile(lambda x: aotattn.rms_norm(x) + x, backend="eager")(x.requires_grad_()).sum().backward()



@pytest.mark.parametrize("needs_grad", ["x", "weight"])
def test_autograd_grad_does_not_skip_the_missing_backward(request, needs_grad):
    """The mark that raises sat on a new leaf, not on x or weight: autograd.grad(.., x) and
    backward(inputs=[x]) skipped it and returned x's other terms alone (all ones for
    rms_norm(x) + x; half of w's gradient for rms_norm(x, w) * w). Now they raise."""
    seed_from(request.node.nodeid)
    x, w = torch.randn(3, 8), torch.randn(8)
    leaf = (x if needs_grad == "x" else w).requires_grad_()
    for run in (lambda: torch.autograd.grad((aotattn.rms_norm(x, w) + leaf).sum(), leaf),
                lambda: (aotattn.rms_norm(x, w) * leaf).sum().backward(inputs=[leaf]),
                lambda: torch.autograd.grad(aotattn.rms_norm(x, w).sum(), leaf, allow_unused=True)):
        with pytest.raises(RuntimeError, match="aotattn.rms_norm has no backward"):
            run()


def test_a_view_with_the_negative_bit_is_read_as_its_values(request):
    """conj().imag of a complex tensor is a view with the negative bit set; the kernel read
    the memory under it and returned the normalised values negated."""
    seed_from(request.node.nodeid)
    x = torch.randn(4, 16, dtype=torch.complex64).conj().imag
    w = torch.randn(16, dtype=torch.complex64).conj().imag
    assert x.is_neg() and w.is_neg()
    assert rel_err(aotattn.rms_norm(x, w), rms_norm(x.resolve_neg(), w.resolve_neg())) < TOLERANCE[torch.float32]


def test_a_refused_compiled_call_leaves_later_compiled_calls_working(request):
    """After a refused call, Dynamo ran rms_norm eagerly but traced its launch as a frame
    of its own, into Triton's interpreter on fake tensors: every later call failed."""
    seed_from(request.node.nodeid)
    compiled = torch.compile(aotattn.rms_norm, backend="eager")
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="eps"):
        compiled(x, None, -1.0)
    assert rel_err(compiled(x), rms_norm(x)) < TOLERANCE[torch.float32]


def test_an_eps_argument_compiles_whole_with_dynamic_shapes(request):
    """An eps passed into a function compiled with ``dynamic=True`` is symbolic: the trace
    cannot read it (``math.isfinite`` of it stopped the trace, valid or not), so its value is
    checked when the op runs, with the eager message."""
    seed_from(request.node.nodeid)
    compiled = torch.compile(lambda x, w, eps: aotattn.rms_norm(x, w, eps=eps), backend="aot_eager", fullgraph=True,
                             dynamic=True)
    x, w = torch.randn(5, 24), torch.randn(24)
    for eps in (1e-5, 0.25):
        assert rel_err(compiled(x, w, eps), rms_norm(x, w, eps=eps)) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="eps: expected 0 or a number from"):
        compiled(x, w, -1.0)
