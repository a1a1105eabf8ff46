"""The forward's knobs beyond the tiles (kernels/forward.py, tuning knobs of ``flash.attn_fwd``).

OVERLAP=1 issues each interior key block's scores one block ahead of its softmax; TMA=1
loads K, TMA=2 K and V, through tensor descriptors. Each is the same arithmetic in the same
order, so in the interpreter the output and log-sum-exp equal the plain loop's bit for
bit, on every path through the kernel: masks on both diagonals and windows (interiors
that are empty, one block, many), rows that see one key or none, GQA, varlen, dropout, a
bias, padded head dims (descriptors spanning the real head dim), every dtype. On the GPU they must match the
float64 reference and the plain loop. The configurations come from ``rules.config_for``
with the knobs set; the plan cache is emptied around each test so no plan of another
setting is reused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import aotattn
from aotattn import reference
from aotattn.families.flash import ops, rules
from aotattn.spec import Config, Functional
from aotattn.tune import candidates
from aotattn.tune import flash as tune_flash
from tests.helpers import TOLERANCE, rel_err
from tests.families.flash.helpers import assert_forward_matches, config_override, make_qkv, seed_from


KNOBS = [{"OVERLAP": 1}, {"TMA": 1}, {"OVERLAP": 1, "TMA": 2}]
PLAIN = {"OVERLAP": 0, "TMA": 0}
TABLE = "flash.attn_fwd"
SM_90 = candidates.target("sm_90")


def _shared_bytes(functional, values: dict) -> int:
    """The tuner's shared-memory estimate of the forward at these values (aotattn/tune/flash.py)."""
    functional = functional if isinstance(functional, Functional) else Functional.of(functional)
    return candidates.shared_bytes(tune_flash.footprint(TABLE), functional, Config.of(values), SM_90)


def _name(knobs: dict) -> str:
    return "+".join(f"{k.lower()}" for k in knobs)


@pytest.fixture
def forward_knobs(monkeypatch):
    """``set(knobs)``: the forward runs with these knob values from then on."""
    use = config_override(monkeypatch)

    def set_knobs(knobs: dict) -> None:
        def with_knobs(kernel, functional, config):
            if kernel.name != rules.ATTN_FWD.name:
                return config
            values = {**config.as_dict(), **PLAIN, **knobs}
            # OVERLAP's extra K tile can push a tuned tile past sm_90's shared memory (d128
            # m128 n128 at 3 stages: 256 KB); fewer stages, as the tuner's pruning would
            while values["num_stages"] > 1 and _shared_bytes(functional, values) > SM_90.shared_memory:
                values["num_stages"] -= 1
            if knobs.get("TMA") and values["num_stages"] == 2:  # Triton 3.6's ptxas crashes there (forward.py);
                values["num_stages"] = 1  # one stage compiles and needs no more shared memory
            return rules.ATTN_FWD.canonical(Config.of(values))

        use(with_knobs)

    yield set_knobs
    ops._PLANS.entries.clear()


@dataclasses.dataclass(frozen=True)
class Case:
    """(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, head_dim_v) on the CPU and
    the GPU, and the call's keyword arguments."""

    name: str
    cpu: tuple[int, ...]
    cuda: tuple[int, ...]
    kwargs: dict = dataclasses.field(default_factory=dict)
    dtype: torch.dtype = torch.float16

    def shape(self, device: str) -> tuple[int, ...]:
        return self.cpu if device == "cpu" else self.cuda


CASES = [
    Case("full", (2, 70, 83, 3, 3, 32, 32), (2, 2048, 3001, 8, 8, 128, 128)),
    Case("full-bf16-gqa", (2, 45, 64, 6, 2, 64, 64), (2, 1024, 4096, 16, 4, 64, 64), dtype=torch.bfloat16),
    Case("fp32", (1, 40, 50, 2, 1, 16, 16), (1, 512, 1000, 4, 2, 64, 64), dtype=torch.float32),
    Case("one-interior-block", (1, 16, 40, 2, 2, 16, 16), (1, 128, 200, 4, 4, 128, 128)),
    Case("shorter-than-a-block", (2, 9, 11, 2, 2, 16, 16), (2, 40, 50, 4, 4, 64, 64)),
    Case("causal", (2, 70, 70, 3, 3, 32, 32), (2, 4096, 4096, 8, 8, 128, 128), {"causal": True}),
    Case("causal-top-left", (1, 50, 90, 2, 2, 16, 16), (1, 1500, 3000, 8, 8, 64, 64),
         {"causal": True, "diagonal": "top_left"}),
    Case("causal-sq-longer", (1, 90, 50, 2, 2, 16, 16), (1, 3000, 1500, 8, 8, 64, 64), {"causal": True}),
    Case("window", (2, 80, 80, 2, 2, 16, 16), (2, 4096, 4096, 8, 8, 128, 128), {"window_size": (40, 7)}),
    Case("narrow-window", (1, 64, 64, 2, 2, 16, 16), (1, 2048, 2048, 8, 8, 64, 64), {"window_size": (3, 0)}),
    Case("one-key", (1, 37, 53, 2, 1, 64, 64), (2, 2048, 3001, 8, 2, 128, 128), {"window_size": (0, 0)}),
    Case("no-key-rows", (1, 60, 20, 2, 2, 16, 16), (1, 3000, 1000, 4, 4, 64, 64), {"causal": True}),
    Case("padded-head", (1, 50, 70, 2, 2, 40, 40), (1, 1000, 2000, 4, 4, 72, 72)),
    Case("unequal-head-dims", (1, 50, 70, 2, 2, 32, 16), (1, 1000, 2000, 4, 4, 128, 64)),
    Case("negative-scale", (1, 50, 70, 2, 2, 16, 16), (1, 1000, 2000, 4, 4, 64, 64), {"softmax_scale": -0.2}),
    Case("bias", (2, 40, 70, 2, 2, 16, 16), (2, 1000, 1500, 4, 4, 64, 64), {"bias": True, "causal": True}),
    Case("dropout", (2, 40, 70, 2, 2, 32, 32), (2, 1000, 1500, 4, 4, 128, 128), {"dropout_p": 0.25}),
]


def _call(case: Case, q, k, v, device: str, seed: int):
    kwargs = dict(case.kwargs)
    if kwargs.pop("bias", False):
        b, sq, hq = q.shape[0], q.shape[1], q.shape[2]
        generator = torch.Generator(device=device).manual_seed(seed)
        kwargs["bias"] = torch.randn(b, hq, sq, k.shape[1], generator=generator, device=device, dtype=q.dtype)
    torch.manual_seed(seed)  # the dropout draws
    out, lse = aotattn.flash_attn_func(q, k, v, return_lse=True, **kwargs)
    return out, lse, kwargs


def _reference(q, k, v, kwargs, device: str, seed: int):
    mask = {key: kwargs[key] for key in ("causal", "window_size", "diagonal", "softmax_scale", "bias") if key in kwargs}
    if kwargs.get("dropout_p"):
        batch, sq, hq = q.shape[0], q.shape[1], q.shape[2]
        torch.manual_seed(seed)
        keep = aotattn.dropout_mask(batch, hq, sq, k.shape[1], kwargs["dropout_p"], device=device)
        return reference.attention(q, k, v, dropout_mask=keep, dropout_p=kwargs["dropout_p"], **mask)
    return reference.attention(q, k, v, **mask)


def _both(case: Case, device: str, set_knobs, knobs: dict, name: str):
    """(plain out, plain lse, out and lse with ``knobs``, float64 reference out, the
    call's keyword arguments) on fresh inputs."""
    seed_from(name)
    q, k, v = make_qkv(*case.shape(device), case.dtype, device)
    set_knobs(PLAIN)
    plain, plain_lse, kwargs = _call(case, q, k, v, device, seed=7)
    set_knobs(knobs)
    out, lse, _ = _call(case, q, k, v, device, seed=7)
    ref, _ = _reference(q, k, v, kwargs, device, seed=7)
    return plain, plain_lse, out, lse, ref, (q, k, v, kwargs)


@pytest.mark.parametrize("knobs", KNOBS, ids=_name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_knobs_match_the_plain_loop_bit_for_bit_in_the_interpreter(case, knobs, forward_knobs, request):
    plain, plain_lse, out, lse, ref, _ = _both(case, "cpu", forward_knobs, knobs, request.node.name)
    assert torch.equal(out, plain)
    assert torch.equal(lse, plain_lse)
    assert rel_err(out, ref) < TOLERANCE[case.dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOBS, ids=_name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_knobs_match_the_reference_on_the_gpu(case, knobs, forward_knobs, request):
    plain, plain_lse, out, lse, ref, (q, k, v, kwargs) = _both(case, "cuda", forward_knobs, knobs, request.node.name)
    assert rel_err(out, ref) < TOLERANCE[case.dtype]
    if not kwargs.get("dropout_p") and "bias" not in kwargs:
        assert_forward_matches(out, lse, q, k, v, **kwargs)
    assert rel_err(out, plain.to(torch.float64)) < TOLERANCE[case.dtype] / 4
    finite = torch.isfinite(plain_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], plain_lse[finite], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("knobs", KNOBS, ids=_name)
def test_varlen_knobs_match_the_plain_loop(knobs, forward_knobs, request):
    """Packed sequences of unequal lengths (one empty, one shorter than a block), causal:
    each sequence's descriptors start at its own first row."""
    seed_from(request.node.name)
    lengths, heads, d = [70, 13, 0, 41, 1], 3, 16
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, d, dtype=torch.float16) for _ in range(3))
    runs = []
    for value in (PLAIN, knobs):
        forward_knobs(value)
        runs.append(aotattn.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                   return_lse=True))
    (plain, plain_lse), (out, lse) = runs
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    ref, _ = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    assert rel_err(out, ref) < TOLERANCE[torch.float16]


def test_the_knobs_are_in_the_forward_space_and_off_by_default():
    """A configuration without the knobs is the plain loop, and stays spelled without them."""
    spec = rules.ATTN_FWD
    space = dict(spec.tuning_space)
    assert space["OVERLAP"] == (0, 1) and space["TMA"] == (0, 1, 2) and dict(spec.knob_defaults) == PLAIN
    plain = Config.of(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    assert spec.canonical(Config.of(plain.as_dict(), **PLAIN)) == plain
    for knobs in KNOBS:
        assert spec.canonical(Config.of(plain.as_dict(), **knobs)) != plain
    functional = next(iter(spec.enumerate_functionals()))
    assert {k: spec.constexprs(functional, plain)[k] for k in PLAIN} == PLAIN
    assert spec.constexprs(functional, Config.of(plain.as_dict(), TMA=1))["TMA"] == 1
    # the backward has its own TMA (test_backward_knobs.py) and no OVERLAP
    assert "OVERLAP" not in dict(rules.ATTN_BWD_DQ.tuning_space)
    assert not set(PLAIN) & set(dict(rules.ATTN_BWD_FUSED.tuning_space))


@pytest.mark.parametrize("knobs", KNOBS, ids=_name)
@pytest.mark.parametrize("layout", ["sdpa-gqa", "packed-qkv", "sliced-heads"])
def test_knobs_follow_the_callers_strides(layout, knobs, forward_knobs):
    """The descriptors take the caller's strides: SDPA's (B, H, S, D) with GQA, q, k, v
    viewed out of one packed (B, S, 3, H, D) tensor, and every other head of a wider one
    (the tuned sm_90 forward runs TMA on such calls)."""
    torch.manual_seed(len(layout) * 7 + len(knobs))
    b, s, d = 2, 75, 32
    if layout == "sdpa-gqa":
        q = torch.randn(b, 6, s, d, dtype=torch.float16)
        k, v = (torch.randn(b, 2, s, d, dtype=torch.float16) for _ in range(2))

        def call():
            return aotattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif layout == "packed-qkv":
        q, k, v = torch.randn(b, s, 3, 4, d, dtype=torch.float16).unbind(2)

        def call():
            return aotattn.flash_attn_func(q, k, v, causal=True)
    else:
        q, k, v = (torch.randn(b, s, 8, d, dtype=torch.float16)[:, :, ::2] for _ in range(3))

        def call():
            return aotattn.flash_attn_func(q, k, v, window_size=(20, 3))
    forward_knobs(PLAIN)
    plain = call()
    forward_knobs(knobs)
    assert torch.equal(call(), plain)
