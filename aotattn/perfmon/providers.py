"""The implementations perfmon times on each entry, and the float64 reference they must match.

``aotattn`` is the public operator as users call it (the backward backend chosen by the
tuning database); ``aotattn:split``, ``aotattn:fused`` and ``aotattn:ws`` force the
backward backend (``backend=``; forward passes are the same code under each, so only
backward passes time them; ws only where it serves). The peers are PyTorch's SDPA backends
(``torch.nn.attention.sdpa_kernel``) and FlexAttention through ``torch.compile``; a peer runs an entry only where it computes
the same function (same mask and diagonal, no packed sequences), and says why not
otherwise.

Every provider takes and returns tensors in the entry's API layout, so outputs and
gradients compare element by element.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

import aotattn
from aotattn import reference
from aotattn.perfmon.entries import Entry

AOTATTN = "aotattn"
FORCED = {"aotattn:split": "split", "aotattn:fused": "fused", "aotattn:ws": "ws"}
SDPA = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
PEERS = (*SDPA, "flex")
ALL = (AOTATTN, *FORCED, *PEERS)
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# ||out - ref|| / ||ref|| on the checked slice: aotattn's test tolerances; peers get twice
# (they are not ours to hold to the same bar, only to show they computed the same thing)
TOLERANCE = {"bf16": 1e-2, "fp16": 5e-3, "fp32": 1e-5}
PEER_TOLERANCE = {"bf16": 2e-2, "fp16": 1e-2, "fp32": 2e-3}


@dataclass
class Inputs:
    """An entry's tensors on one device, in its API layout; leaves that require grad for
    backward passes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor  # the upstream gradient of backward passes, shaped like the output
    bias: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None

    def leaves(self) -> tuple[torch.Tensor, ...]:
        extra = (self.bias,) if self.bias is not None and self.bias.requires_grad else ()
        return (self.q, self.k, self.v, *extra)


def _shape(entry: Entry, seqlen: int, heads: int, dim: int) -> tuple[int, ...]:
    if entry.api == "varlen":
        return (sum(entry.lengths), heads, dim)
    if entry.api == "sdpa":
        return (entry.batch, heads, seqlen, dim)
    return (entry.batch, seqlen, heads, dim)


def make_inputs(entry: Entry, device: torch.device, seed: int, fill: bool = True) -> Inputs:
    """Fresh standard-normal inputs (a seeded generator on the device); ``fill=False``
    leaves them uninitialised (planning only, nothing is computed)."""
    dtype = TORCH_DTYPES[entry.dtype]
    grad = any(p != "fwd" for p in entry.passes) or entry.training
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape, requires_grad):
        t = (torch.randn(shape, generator=gen, dtype=dtype, device=device) if fill
             else torch.empty(shape, dtype=dtype, device=device))
        return t.requires_grad_(requires_grad)

    q = randn(_shape(entry, entry.seqlen_q, entry.heads_q, entry.head_dim), grad)
    k = randn(_shape(entry, entry.seqlen_k, entry.heads_k, entry.head_dim), grad)
    v = randn(_shape(entry, entry.seqlen_k, entry.heads_k, entry.head_dim_v), grad)
    dout = randn(_shape(entry, entry.seqlen_q, entry.heads_q, entry.head_dim_v), False)
    bias = cu = None
    if entry.bias != "none":
        bias = randn((entry.batch, entry.heads_q, entry.seqlen_q, entry.seqlen_k), entry.bias == "bias-grad")
    if entry.api == "varlen":
        cu = torch.tensor([0, *entry.lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return Inputs(q, k, v, dout, bias, cu)


# ---------------------------------------------------------------------------- calls

def call_aotattn(entry: Entry, x: Inputs, backend: str | None = None, dropout_p: float | None = None) -> torch.Tensor:
    p = entry.dropout_p if dropout_p is None else dropout_p
    if entry.api == "sdpa":
        return aotattn.scaled_dot_product_attention(x.q, x.k, x.v, attn_mask=x.bias, dropout_p=p,
                                                    is_causal=entry.causal, enable_gqa=entry.group_size > 1,
                                                    deterministic=entry.deterministic, backend=backend)
    mask = dict(causal=entry.causal, window_size=entry.window, diagonal=entry.diagonal)
    if entry.api == "varlen":
        return aotattn.flash_attn_varlen_func(x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, entry.seqlen_q,
                                              entry.seqlen_k, dropout_p=p, deterministic=entry.deterministic,
                                              backend=backend, **mask)
    return aotattn.flash_attn_func(x.q, x.k, x.v, dropout_p=p, deterministic=entry.deterministic, bias=x.bias,
                                   backend=backend, **mask)


def _heads_major(entry: Entry, t: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) <-> (B, H, S, D) for the flash API; SDPA-API tensors already are."""
    return t if entry.api == "sdpa" else t.transpose(1, 2)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def call_sdpa(entry: Entry, x: Inputs, provider: str, dropout_p: float | None = None) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    p = entry.dropout_p if dropout_p is None else dropout_p
    q, k, v = (_heads_major(entry, t) for t in (x.q, x.k, x.v))
    gqa = {"enable_gqa": True} if entry.group_size > 1 else {}
    with sdpa_kernel(_sdpa_backend(provider)):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=x.bias, dropout_p=p,
                                                               is_causal=entry.causal, **gqa)
    return _heads_major(entry, out)


# The compiler settings FlexAttention's calls run under.
# - One static graph a shape, however many entries a run times. With automatic dynamic
#   shapes, the second shape a run gave flex_attention compiled one dynamic graph that
#   served every later shape (not the per-shape kernel FlexAttention's own benchmarks
#   time). Past the recompile limit (8 graphs), Dynamo would fall back to eager
#   FlexAttention silently, which is many times slower and would flatter aotattn; with the
#   limit raised, hitting it raises instead, and the entry records the error.
# - No donated buffers: a backward pass is timed by running the backward of one forward
#   again and again (retain_graph=True), which AOTAutograd refuses for a backward compiled
#   to reuse the forward's saved buffers. It checks its setting when the backward runs,
#   outside the call, so it is turned off for the whole process (perfmon's: aotattn does
#   not compile through torch.compile). Until the thirtieth session every FlexAttention
#   backward record was that refusal.
_FLEX_DYNAMO = {"recompile_limit": 100_000, "accumulated_recompile_limit": 100_000,
                "fail_on_recompile_limit_hit": True}


@functools.cache
def _compiled_flex():
    """(FlexAttention compiled one static graph a shape, the Dynamo settings its calls run
    under); turns AOTAutograd's donated buffers off in this process."""
    import torch._dynamo
    import torch._functorch.config
    from torch.nn.attention.flex_attention import flex_attention

    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False
    settings = {name: value for name, value in _FLEX_DYNAMO.items() if hasattr(torch._dynamo.config, name)}
    return torch.compile(flex_attention, dynamic=False), settings


@functools.lru_cache(maxsize=8)
def _block_mask(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int], diagonal: str, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    left, right = window
    if causal:
        right = 0
    shift = seqlen_k - seqlen_q if diagonal == "bottom_right" else 0

    def visible(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if left >= 0:
            keep = keep & (kv_idx >= q_idx + (shift - left))
        if right >= 0:
            keep = keep & (kv_idx <= q_idx + (shift + right))
        return keep

    return create_block_mask(visible, None, None, seqlen_q, seqlen_k, device=device)


def call_flex(entry: Entry, x: Inputs) -> torch.Tensor:
    q, k, v = (_heads_major(entry, t) for t in (x.q, x.k, x.v))
    block_mask = None
    if entry.masked:
        block_mask = _block_mask(entry.seqlen_q, entry.seqlen_k, entry.causal, entry.window, entry.diagonal,
                                 str(q.device))
    compiled, settings = _compiled_flex()
    with torch._dynamo.config.patch(**settings):
        out = compiled(q, k, v, block_mask=block_mask, enable_gqa=entry.group_size > 1)
    return _heads_major(entry, out)


def call(entry: Entry, x: Inputs, provider: str, dropout_p: float | None = None) -> torch.Tensor:
    """One call of ``provider`` on ``x``; output in the entry's API layout."""
    if provider == AOTATTN:
        return call_aotattn(entry, x, None, dropout_p)
    if provider in FORCED:
        return call_aotattn(entry, x, FORCED[provider], dropout_p)
    if provider in SDPA:
        return call_sdpa(entry, x, provider, dropout_p)
    if provider == "flex":
        return call_flex(entry, x)
    raise ValueError(f"provider: expected one of {ALL}, got {provider!r}")


FLEX_ALL = "all"  # the ``flex`` setting that times FlexAttention on every entry it supports


def ws_backward_serves(entry: Entry) -> bool:
    """The entry's calls are ones the ws backward computes (rules.ws_backward_serves: a head
    dim is served as its bucket is, padded or not; the masks are all served)."""
    from aotattn.families.flash import rules

    bucket = rules.head_dim_bucket(max(entry.head_dim, entry.head_dim_v))  # both dims' (planning.Call)
    functional = {"dtype": entry.dtype, "BLOCK_D": bucket, "BLOCK_DV": bucket, "PAD_HEAD": False,
                  "MASK": rules.MASK_NONE, "VARLEN": entry.api == "varlen", "DROPOUT": bool(entry.dropout_p),
                  "BIAS": rules.BIAS_NONE if entry.bias == "none" else rules.BIAS_ADD}
    return rules.ws_backward_serves(functional, None, entry.deterministic)


def ws_backward_runs_on(arch: str | None) -> bool:
    """Whether the ws backend's kernel exists for ``arch`` (None: CPU tensors, the interpreter)."""
    from aotattn.families.flash import rules

    return arch is not None and rules.ATTN_BWD_WS.runs_on(arch)


def unsupported(entry: Entry, provider: str, pass_: str, flex: bool | str = True) -> str | None:
    """Why ``provider`` does not run this entry's pass (None: it runs). Limits of a kernel
    that only show at run time (a head dim, a dtype) are found by running it instead.

    ``flex``: False never times FlexAttention, True on the entries that ask for it
    (``Entry.flex``), ``"all"`` wherever it supports the entry (about 20 s of compiling each)."""
    if provider == AOTATTN:
        return None
    if provider in FORCED:
        if pass_ == "fwd":
            return "a forward pass runs the same code under every backend"
        if FORCED[provider] == "ws" and not ws_backward_serves(entry):
            return "the ws backend serves fp16/bf16 head dims 33-256 (buckets 64, 128, 256), dense, not deterministic"
        return None
    if entry.api == "varlen":
        return "no packed-sequence API"
    if entry.deterministic:
        return "no deterministic mode asked of peers"
    if provider in SDPA:
        if entry.window != (-1, -1):
            return "no sliding window"
        if entry.causal and entry.diagonal == "bottom_right" and entry.seqlen_q != entry.seqlen_k:
            return "is_causal is top-left only"
        return None
    if not flex or (not entry.flex and flex != FLEX_ALL):
        return "not asked (compiles per shape: see Entry.flex, or --flex-all)"
    if entry.dropout_p:
        return "no dropout"
    if entry.bias != "none":
        return "bias not wired through score_mod"
    return None


# ---------------------------------------------------------------------------- checking

def sequence_slice(entry: Entry, t: torch.Tensor, heads: slice) -> torch.Tensor:
    """The first sequence's ``heads`` of a q/k/v/out-like tensor, as ``(1, S, h, D)``."""
    if entry.api == "varlen":
        return t[: entry.lengths[0], heads].unsqueeze(0)
    if entry.api == "sdpa":
        return t[:1, heads].transpose(1, 2)
    return t[:1, :, heads]


def checked_heads(entry: Entry) -> tuple[slice, slice]:
    """Query heads and key heads of the checked slice: key head 0 and its query group."""
    return slice(0, entry.group_size), slice(0, 1)


def reference_slice(entry: Entry, x: Inputs, dout: torch.Tensor | None, dropout_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0) -> dict[str, torch.Tensor]:
    """Float64 output (and gradients when ``dout`` is given) of the checked slice.

    Computed one query head at a time (a head's scores are Sq x Sk float64), summing the
    key/value gradients over the group. ``dropout_mask``: ``(1, group, Sq, Sk)`` keep-mask.
    """
    qh, kh = checked_heads(entry)
    q, k, v = (sequence_slice(entry, t.detach(), h) for t, h in ((x.q, qh), (x.k, kh), (x.v, kh)))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    bias = None if x.bias is None else x.bias.detach()[:1, qh]
    k64, v64 = (t.to(torch.float64).requires_grad_(dout is not None) for t in (k, v))
    outs, dqs, dbiases = [], [], []
    dk = dv = None
    for h in range(q.shape[2]):
        q64 = q[:, :, h:h + 1].to(torch.float64).requires_grad_(dout is not None)
        b64 = None if bias is None else bias[:, h:h + 1].to(torch.float64).requires_grad_(
            dout is not None and x.bias.requires_grad)
        mask = None if dropout_mask is None else dropout_mask[:, h:h + 1, :seqlen_q, :seqlen_k]
        out, _ = reference.attention(q64, k64, v64, softmax_scale=1.0 / math.sqrt(entry.head_dim),
                                     causal=entry.causal, window_size=entry.window, diagonal=entry.diagonal,
                                     bias=b64, dropout_mask=mask, dropout_p=dropout_p)
        outs.append(out.detach())
        if dout is not None:
            g = sequence_slice(entry, dout, qh)[:, :, h:h + 1].to(torch.float64)
            wanted = [q64, k64, v64] + ([b64] if b64 is not None and b64.requires_grad else [])
            grads = torch.autograd.grad(out, wanted, g)
            dqs.append(grads[0])
            dk = grads[1] if dk is None else dk + grads[1]
            dv = grads[2] if dv is None else dv + grads[2]
            if len(grads) > 3:
                dbiases.append(grads[3])
        del out
    result = {"out": torch.cat(outs, dim=2)}
    if dout is not None:
        result.update(dq=torch.cat(dqs, dim=2), dk=dk, dv=dv)
        if dbiases:
            result["dbias"] = torch.cat(dbiases, dim=1)
    return result


def result_slice(entry: Entry, x: Inputs, name: str, t: torch.Tensor) -> torch.Tensor:
    """The checked slice of one result (``out``, ``dq``, ``dk``, ``dv``, ``dbias``)."""
    qh, kh = checked_heads(entry)
    if name == "dbias":
        return t[:1, qh]
    return sequence_slice(entry, t, kh if name in ("dk", "dv") else qh)


def rel_diff(a: torch.Tensor, b: torch.Tensor, *, chunk: int = 1 << 24) -> float:
    """||a - b|| / ||b|| in float64 (inf when a has a NaN), a piece of at most ``chunk``
    elements at a time: a whole gradient of a large entry in float64 would not fit beside
    the tensors being compared (dK of B128 H32 Sk16384 D64 is 32 GiB in float64)."""
    if a.shape != b.shape:
        raise ValueError(f"rel_diff of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    diff, norm = torch.zeros(2, dtype=torch.float64, device=a.device)
    for pa, pb in zip(_pieces(a.detach(), chunk), _pieces(b.detach(), chunk)):
        a64, b64 = pa.to(torch.float64), pb.to(torch.float64)
        if torch.isnan(a64).any():
            return math.inf
        diff += (a64 - b64).square().sum()
        norm += b64.square().sum()
    diff, denom = math.sqrt(diff.item()), math.sqrt(norm.item())
    return diff / denom if denom > 0 else diff


def _pieces(t: torch.Tensor, chunk: int) -> Iterable[torch.Tensor]:
    """Views of ``t`` of at most ``chunk`` elements that cover it, split along the leading
    dimensions (the same shape gives the same pieces, whatever the strides)."""
    if t.numel() <= chunk or t.dim() == 0:
        yield t
    elif t.dim() == 1:
        yield from t.split(chunk)
    elif t.shape[0] == 1:
        yield from _pieces(t[0], chunk)
    else:
        for part in t.split(max(1, chunk // (t.numel() // t.shape[0]))):
            yield from _pieces(part, chunk)


@contextlib.contextmanager
def quiet():
    """Peers warn when a backend cannot take a shape; the record says so instead."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
