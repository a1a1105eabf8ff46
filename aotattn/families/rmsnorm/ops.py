"""Public operator of the RMSNorm family: checks -> launch plan -> runtime."""

from __future__ import annotations

import math
import numbers
import reprlib

import torch
from torch.autograd import forward_ad

from aotattn.errors import type_name
from aotattn.families.rmsnorm import rules
from aotattn.runtime import launch
from aotattn.spec import Functional, LaunchPlan

MAX_EPS = float(torch.finfo(torch.float32).max)  # the kernel adds eps in fp32: more would round to inf
MIN_EPS = 2.0 ** -149  # float32's smallest subnormal: a smaller positive eps rounds to 0 (1e-50 gave NaN on zeros)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dimension, in fp32.

    Args:
        x: ``(..., N)``, float16, bfloat16 or float32, unit stride in the last dimension,
            N up to 16384.
        weight: ``(N,)`` in x's dtype, or None.
        eps: 0, or a positive real number representable in float32 (2**-149 up to
            float32's largest).

    Returns:
        A tensor of x's shape and dtype. Forward only: where x or weight requires grad
        (under grad mode), backpropagating through the result raises (it has no backward),
        rather than leaving out this term of the gradient. The mean of squares is taken
        in fp32, as ``torch.nn.functional.rms_norm`` does: a row whose sum of squares
        leaves float32's range (|x| beyond about 1.8e19 / sqrt(N)) gives zeros, and one
        that underflows with eps 0 gives inf.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type_name(x)}")
    _check_dense("x", x)
    x = x.resolve_neg()  # the kernel reads memory: a view with the negative bit set (conj().imag) came out negated
    if x.dtype not in rules.DTYPES:
        raise TypeError(f"x: expected dtype float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1 or not 1 <= x.shape[-1] <= rules.MAX_COLS:
        raise ValueError(f"x: expected a last dimension of 1..{rules.MAX_COLS}, got shape {tuple(x.shape)}")
    if x.device.type not in ("cpu", "cuda", "meta"):  # meta: shapes only, through the op's fake
        raise ValueError(f"x: expected a CUDA, CPU or meta tensor, got device {x.device}")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight: expected a torch.Tensor or None, got {type_name(weight)}")
        _check_dense("weight", weight)
        if weight.dtype != x.dtype:
            raise TypeError(f"weight: expected dtype {x.dtype} (the dtype of x), got {weight.dtype}")
        if weight.shape != (x.shape[-1],) or weight.device != x.device:
            raise ValueError(f"weight: expected shape ({x.shape[-1]},) on device {x.device}; got "
                             f"{tuple(weight.shape)} on {weight.device}")
        weight = weight.resolve_neg().contiguous()
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps: expected a real number, got {type_name(eps)}")
    if not torch.compiler.is_compiling():  # traced (dynamic=True), eps may be symbolic: the op checks it
        _check_eps(eps)
    if x.numel() and x.stride(-1) != 1:
        raise ValueError(f"x: expected a unit stride in the last dimension, got strides {x.stride()} "
                         "(pass x.contiguous())")
    if torch.compiler.is_compiling() or x.is_meta:
        # one opaque node with a shape-only fake: Dynamo traced into the launch (on CPU into
        # Triton's interpreter) and failed on fake tensors. No autograd formula is registered,
        # so differentiating through it raises, as the eager result below does.
        return torch.ops.aotattn.rms_norm(x, weight, float(eps))
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        # a result detached from its inputs would silently drop this term of their gradient
        # (``rms_norm(x) + x`` would backpropagate through ``x`` alone); one marked on a new
        # leaf (DelayedError) was skipped by autograd.grad(..., x), which then gave x's other
        # terms alone: the node sits on x and weight and raises when reached
        return _ForwardOnly.apply(x, weight, float(eps))
    return _forward(x, weight, float(eps))


class _ForwardOnly(torch.autograd.Function):
    """rms_norm under autograd: the forward, and a backward that raises."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        return _forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(_NO_BACKWARD)


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The checked call: plan and launch; y contiguous, x's shape."""
    if torch.compiler.is_compiling():  # Dynamo tracing this frame on its own (after a refused compiled call, it
        return torch.ops.aotattn.rms_norm(x, weight, eps)  # ran rms_norm eagerly and traced this into the launch)
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)  # a view whenever the rows are evenly strided
    y = torch.empty_like(rows, memory_format=torch.contiguous_format)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    block = next(b for b in rules.BLOCKS if n_cols <= b)
    functional = Functional.of({"dtype": rules.DTYPES[x.dtype], "BLOCK": block, "HAS_WEIGHT": weight is not None})
    kernel = rules.RMSNORM_FWD
    config = rules.config_for(kernel, functional, x.device, n_rows=rows.shape[0])
    args = kernel.bind(X=rows, W=rows if weight is None else weight, Y=y, Rstd=rstd, stride_x=rows.stride(0),
                       stride_y=y.stride(0), n_cols=n_cols, eps=float(eps))
    launch(LaunchPlan(kernel, functional, config, (rows.shape[0], 1, 1), args))
    return y.reshape(x.shape)


def _check_eps(eps: numbers.Real) -> None:
    if not (eps == 0 or MIN_EPS <= eps <= MAX_EPS) or not math.isfinite(eps):  # a huge int fails the bound first
        raise ValueError(f"eps: expected 0 or a number from {MIN_EPS:.3g} to {MAX_EPS:.3g} (float32's smallest and "
                         f"largest: less rounds to 0 in the kernel), got {reprlib.repr(eps)}")


@torch.library.custom_op("aotattn::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm` under ``torch.compile``, its tensors checked while Dynamo traced it;
    eps here (a float argument of a function traced with ``dynamic=True`` is symbolic: the
    trace cannot read it)."""
    _check_eps(eps)
    return _forward(x, weight, eps)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_NO_BACKWARD = ("aotattn.rms_norm has no backward: it is forward only; for gradients use "
                "torch.nn.functional.rms_norm (or call aotattn.rms_norm under torch.no_grad())")


def _check_dense(name: str, t: torch.Tensor) -> None:
    """A strided tensor with storage: the kernel reads data pointers. (Sparse tensors and
    those of a ``torch.func`` transform made torch raise from deep inside, in reshape or
    data_ptr.)"""
    if t.layout != torch.strided or t.is_nested:  # a nested tensor reports strided, then fails inside torch
        layout = "nested" if t.is_nested else t.layout
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {layout}")
    if not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(t):  # Dynamo cannot trace it
        raise ValueError(f"{name}: expected a plain tensor, got one wrapped by a torch.func transform (vmap, grad, "
                         "...), which aotattn.rms_norm does not support")
    if forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None:  # its tangent was dropped
        raise ValueError(f"{name}: expected a plain tensor, got a dual tensor of forward-mode AD (make_dual), which "
                         "aotattn.rms_norm does not support (no JVP rule)")
