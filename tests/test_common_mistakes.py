"""The numerical mistakes attention kernels are known to make, tried on aotattn.

Each case (tests/adiffs/cases.py) runs forward and backward against the float64
reference and against the rounding floor (:func:`tests.helpers.floor_attention`: float64
with only the roundings a flash kernel must make). Outputs, log-sum-exp and gradients
must stay within :func:`tests.helpers.multiple` times the floor's error, fully masked rows must be
exactly 0, nothing may be NaN, and no maximum error may exceed the accuracy record
(tests/adiffs/<arch>.txt) by more than its margin. The other tests aim at one mistake
each (docs/numerical-lessons.md); tests/mutants proves that each of them catches its own.

CPU runs use small shapes (Triton's interpreter); the GPU parametrizations use GPU-sized
ones (Sq 2048, Sk 3001, D 128 for most cases).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import aotattn
from aotattn.families.flash import ops, planning, rules
from aotattn.families.flash.checks import check_flash
from aotattn.runtime import launch
from aotattn.spec import Functional, LaunchPlan
from tests import adiffs
from tests.adiffs.cases import CASES
from tests.helpers import (DEVICES, SLACK, TOLERANCE, assert_within_floor, exact_attention, floor_attention,
                           kernel_attention, multiple, dropout_keeps, philox_first_word, rel_err)
from tests.families.flash.helpers import seed_from


@functools.cache
def _record(device: str) -> dict[str, dict[str, float]]:
    file = adiffs.path(device)
    if not file.exists():
        pytest.fail(f"no accuracy record {file}: run `python -m tests.adiffs --update --device {device}`")
    return adiffs.read(file)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_within_floor(case, device):
    """Sharp softmax, zero and negative scales, one key per row, bottom-right fully masked
    rows, large magnitudes, unbounded window sides, irregular head dims and lengths, both
    backends: within the floor, exact where exactness is due, and no worse than recorded."""
    kernel, floor, exact = case.run(device)
    assert_within_floor(kernel, floor, exact, case.dtype, device)
    recorded = _record(device).get(case.id)
    if recorded is None:
        pytest.fail(f"{case.id} is not in {adiffs.path(device)}: run `python -m tests.adiffs --update --device {device}`")
    worse = adiffs.regressions(adiffs.measure(kernel, exact), recorded, device)
    assert not worse, f"accuracy regressed against {adiffs.path(device).name}: {'; '.join(worse)}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_within_floor_on_the_triton_forward(monkeypatch, case):
    """The same cases with the Triton forward forced wherever the tables choose the
    warp-specialized one (every GPU-sized case on sm_90): the forward that every other
    architecture runs, checked at GPU sizes on GPU arithmetic. Within the floor and exact
    where due; the accuracy record is the tables' kernels' and is not applied."""
    monkeypatch.setattr(planning, "choose_engine", lambda c, device, functional=None: "triton")
    ops._PLANS.entries.clear()
    try:
        kernel, floor, exact = case.run("cuda")
    finally:
        ops._PLANS.entries.clear()
    assert_within_floor(kernel, floor, exact, case.dtype, "cuda")


# -------------------------------------------------------------- one mistake at a time


def _gpu_or_cpu(device: str, cpu, cuda):
    return cpu if device == "cpu" else cuda


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", [("split", False), ("fused", False), ("fused", True)],
                         ids=["split", "fused-atomic", "fused-deterministic"])
@pytest.mark.parametrize("window", [(0, 0), (0, -1)], ids=["every-row", "last-row"])
def test_one_key_rows_with_very_negative_lse(request, device, variant, window):
    """The live NaN of issue 11: rows that see exactly one key, whose score (hence lse)
    is very negative, in fp16, with Sk not a multiple of the key block. The key-major
    backward's out-of-range keys (loaded as 0, score 0) then have p = exp(-lse) far above
    fp16's range; unmasked, that overflow times k = 0 put NaN into dQ. The (0, -1) window
    is issue 11's: its unbounded right side lets those keys through the window test; with
    (0, 0) the window itself excludes them (the case guards the masking of one-key rows)."""
    seed_from(request.node.name)
    batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim = _gpu_or_cpu(
        device, (1, 37, 53, 2, 1, 64), (2, 2048, 3001, 8, 2, 128))
    assert seqlen_k % 16 and seqlen_k % 64 and seqlen_k % 128, "the last key block must be partial"
    q, k, v, dout = (torch.randn(*shape, device=device) * 1.5 for shape in (
        (batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_k, head_dim),
        (batch, seqlen_k, heads_k, head_dim), (batch, seqlen_q, heads_q, head_dim)))
    # the one key a row sees: column i + Sk - Sq (bottom-right); its query points along
    # it, scaled so that with softmax_scale = -0.1 the row's only score is -20
    group = heads_q // heads_k
    diagonal_keys = k[:, seqlen_k - seqlen_q:].repeat_interleave(group, 2)
    rows = slice(None) if window == (0, 0) else slice(-1, None)
    q[:, rows] = diagonal_keys[:, rows] * 200.0 / diagonal_keys[:, rows].square().sum(-1, keepdim=True)
    q, k, v, dout = (t.to(torch.float16) for t in (q, k, v, dout))
    mask = dict(window_size=window, softmax_scale=-0.1)
    kernel = kernel_attention(q, k, v, dout, backend=variant[0], deterministic=variant[1], **mask)
    exact = exact_attention(q, k, v, dout, **mask)
    assert exact.lse[..., -1].max() < -19.0, "the one-key rows must have a very negative lse"
    assert_within_floor(kernel, floor_attention(q, k, v, dout, **mask), exact, torch.float16, device)


@pytest.mark.parametrize("device, dtype", [
    ("cpu", torch.float16),
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float16, marks=pytest.mark.gpu),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu),
], ids=["cpu-fp16", "cpu-bf16", "cuda-fp16", "cuda-bf16"])
def test_rounding_is_unbiased(request, device, dtype):
    """P is rounded to nearest before P @ V, never truncated: truncation shrinks every
    weight by about a quarter of an ulp, a bias the floor's norm can hide (the output's
    own rounding is as large) but the mean signed error shows. V has a positive mean so
    the bias adds up; the softmax is soft so that most weights get rounded.

    bf16 ran on the GPU only while Triton's interpreter converted fp32 to bf16 by
    truncation; aotattn now gives it the GPU's rounding (aotattn/runtime/interpreter.py).
    """
    seed_from(request.node.name)
    batch, seqlen_q, seqlen_k, heads, head_dim = _gpu_or_cpu(device, (1, 48, 160, 2, 32), (2, 2048, 3001, 8, 128))
    q = (torch.randn(batch, seqlen_q, heads, head_dim, device=device) * 0.5).to(dtype)
    k = (torch.randn(batch, seqlen_k, heads, head_dim, device=device) * 0.5).to(dtype)
    v = (1.0 + 0.25 * torch.randn(batch, seqlen_k, heads, head_dim, device=device)).to(dtype)
    out = aotattn.flash_attn_func(q, k, v)
    exact = exact_attention(q, k, v).out
    bias = ((out.double() - exact).mean() / exact.mean()).item()
    eps = torch.finfo(dtype).eps
    assert abs(bias) < eps / 16, f"mean relative error {bias:.2e}: P or the output is not rounded to nearest"


def _preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The backward's first kernel launched directly: its stats, (2, B, H, S padded) fp32
    (plane 0 delta = rowsum(dO * O), plane 1 lse in base 2)."""
    batch, seqlen, heads, head_dim_v = out.shape
    bucket = rules.head_dim_bucket(head_dim_v)
    functional = Functional.of({"dtype": rules.DTYPES[out.dtype], "BLOCK_DV": bucket,
                                "PAD_HEAD": head_dim_v != bucket, "VARLEN": False})
    kernel = rules.ATTN_BWD_PREPROCESS
    config = rules.config_for(kernel, functional, out.device, seqlen_q=seqlen)
    rows = math.ceil(seqlen / 128) * 128
    stats = torch.full((2, batch, heads, rows), math.nan, dtype=torch.float32, device=out.device)
    unused = torch.zeros(1, dtype=torch.int32, device=out.device)
    # (batch, head, row) strides of the (B, S, H, Dv) tensors, (batch, head) of lse,
    # (batch, head, plane) of the stats
    args = kernel.bind(Out=out, DO=dout, Lse=lse, Stats=stats, CuSeqlensQ=unused, max_seqlen_q=seqlen,
                       head_dim_v=head_dim_v,
                       **kernel.strides("o", (out.stride(0), out.stride(2), out.stride(1))),
                       **kernel.strides("do", (dout.stride(0), dout.stride(2), dout.stride(1))),
                       **kernel.strides("l", lse.stride()[:2]),
                       **kernel.strides("s", (stats.stride(1), stats.stride(2), stats.stride(0))))
    launch(LaunchPlan(kernel, functional, config, (rows // config["BLOCK_M"], heads, batch), args))
    return stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim_v", [64, 72, 256])
def test_delta_is_fp32_accurate(request, device, dtype, head_dim_v):
    """delta = rowsum(dO * O) straight from the preprocess kernel against float64, to
    fp32 accuracy (1e-5 of sum |dO * O|). A delta reduced in fp16/bf16 is 100x worse, yet
    hides under the gradients' fp16 tolerance: only a direct check sees it. The same
    launch's second plane is lse * log2(e), and the padding rows past the sequence hold
    delta 0 and lse +inf (the backward loops read them without a mask)."""
    seed_from(request.node.name)
    batch, seqlen, heads = _gpu_or_cpu(device, (2, 37, 3), (4, 3001, 16))
    out = torch.randn(batch, seqlen, heads, head_dim_v, device=device).to(dtype)
    dout = torch.randn(batch, seqlen, heads, head_dim_v, device=device).to(dtype)
    lse = torch.randn(batch, heads, seqlen, device=device) * 10
    lse[0, 0, 0] = math.inf  # a row that saw no key
    stats = _preprocess(out, dout, lse)
    delta = stats[0, ..., :seqlen].double()
    products = (out.double() * dout.double()).transpose(1, 2)  # (B, H, S, Dv)
    exact = products.sum(-1)
    err = ((delta - exact).abs() / products.abs().sum(-1)).max().item()
    assert err < 1e-5, f"delta: max error {err:.2e} of sum |dO * O| (fp32 accumulation gives ~1e-7)"
    torch.testing.assert_close(stats[1, ..., :seqlen], lse * math.log2(math.e), rtol=1e-6, atol=0)
    assert (stats[0, ..., seqlen:] == 0).all() and (stats[1, ..., seqlen:] == math.inf).all(), "padding rows"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim, causal", [(64, True), (72, False), (256, True)])
def test_split_dq_kernel_writes_the_preprocess_stats(request, device, dtype, head_dim, causal):
    """The split backend launches no preprocess: its dQ kernel, launched first, writes the
    stats the dK/dV kernel reads. They must be the preprocess's: delta to fp32 accuracy
    (the sums may run in another order), lse in base 2 exactly, and every padding row up
    to the stats' rounded length (delta 0, lse +inf), past the dQ kernel's last block of
    rows too, since dK/dV reads them without a mask in larger blocks."""
    seed_from(request.node.name)
    batch, seqlen, heads = _gpu_or_cpu(device, (2, 37, 3), (3, 3001, 4))
    q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device=device).to(dtype) for _ in range(4))
    p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal, window_size=(-1, -1),
                    diagonal="bottom_right")
    c = planning.new_call(p, q, k, v)
    out = torch.empty_like(q)
    lse = planning.run_forward(c, q, k, v, out)
    stats, dq, dk, dv, _ = planning.backward_buffers(c, q, k, v, "split", False)
    stats.fill_(math.nan)
    plans = planning.backward_plans(c, dout, q, k, v, out, lse, stats, dq, dk, dv, None, "split", False)
    assert [plan.kernel.name for plan in plans] == ["attn_bwd_dq", "attn_bwd_dkdv"]
    launch(plans[0])
    expected = _preprocess(out, dout, lse)
    assert stats.shape == expected.shape and not stats.isnan().any(), "every row of the stats is written"
    products = (out.double() * dout.double()).transpose(1, 2)
    err = ((stats[0, ..., :seqlen].double() - products.sum(-1)).abs() / products.abs().sum(-1)).max().item()
    assert err < 1e-5, f"delta: max error {err:.2e} of sum |dO * O|"
    assert torch.equal(stats[1], expected[1]), "lse in base 2, padding rows +inf"
    assert (stats[0, ..., seqlen:] == 0).all(), "padding rows hold delta 0"


@pytest.mark.parametrize("window", [(-2, 0), (0, -2), (-2, -2), (-1, -2), (-2, -1), (-7, 3), (3, -9)])
def test_window_bounds_below_minus_one_are_rejected(window):
    """-1 means unbounded; anything below it is an error on either side (a -2 taken as
    unbounded would silently widen the window)."""
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match=r"window_size: expected sizes >= 0, or -1 for unbounded"):
        aotattn.flash_attn_func(q, k, v, window_size=window)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"window_size: expected sizes >= 0, or -1 for unbounded"):
        aotattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, window_size=window)


@pytest.mark.parametrize("key, counter, expected", [
    # Random123's known answers for Philox4x32-10: key (k0, k1), counter (c0..c3), first word
    ((0, 0), (0, 0, 0, 0), 0x6627E8D5),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 4, 0x408F276D),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0xD16CFE09),
])
def test_numpy_philox_known_answers(key, counter, expected):
    """The test's own Philox (tests.helpers.philox_first_word) against Random123."""
    word = philox_first_word(key[0] | key[1] << 32, counter[2] | counter[3] << 32,
                             np.array([counter[0] | counter[1] << 32], dtype=np.uint64).astype(np.int64))
    assert int(word[0]) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_counter_is_64_bit(request, device):
    """The Philox counter of element (b, h, i, j) is ((b Hq + h) Sq + i) 4 ceil(Sk / 32) +
    4 (j // 32) + (j // 2) % 4: past 2**31 for heads h >= 32 here (Sq Sk / 8 = 2**26). Each row sees one key (window (0, 0)), so its
    output is that key's value, kept or dropped: the expected output follows from an
    independent numpy Philox without materialising a mask of 2**33 elements. A counter
    computed in 32 bits wraps and drops other elements than the mask says.

    The backward (each kept key's dV is dO / (1 - p)) runs on the GPU only: its 2**25
    keys are 2**21 key-major programs, minutes in the interpreter.
    """
    from aotattn.families.flash.planning import philox_state

    seed_from(request.node.name)
    heads_q, seqlen_q, seqlen_k, dropout_p = 40, 16, 2**25, 0.5
    q = torch.randn(1, seqlen_q, heads_q, 1, device=device, dtype=torch.float16)
    k = torch.randn(1, seqlen_k, 1, 1, device=device, dtype=torch.float16)
    v = torch.randn(1, seqlen_k, 1, 2, device=device, dtype=torch.float16)
    if device != "cpu":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    state = torch.get_rng_state()
    out = aotattn.flash_attn_func(q, k, v, dropout_p=dropout_p, window_size=(0, 0))
    torch.set_rng_state(state)
    seed, offset = philox_state(dropout_p)
    rows = np.arange(seqlen_q)
    heads = np.arange(heads_q)[:, None]
    keep = dropout_keeps(seed, offset, dropout_p, heads * seqlen_q + rows, rows + seqlen_k - seqlen_q,
                         seqlen_k)  # (Hq, Sq), batch 0
    keep = torch.from_numpy(keep.T.copy()).to(device)  # (Sq, Hq)
    value = v[0, seqlen_k - seqlen_q:, 0].detach().double() / (1 - dropout_p)  # (Sq, 2)
    expected = torch.where(keep[..., None], value[:, None, :], 0.0)
    assert torch.equal(out[0].double(), expected), \
        f"{int((out[0].double() != expected).any(-1).sum())} of {keep.numel()} rows kept or dropped against the mask"
    if device == "cpu":
        return
    dout = torch.randn_like(out)
    dv = torch.autograd.grad(out, v, dout)[0]
    expected_dv = torch.zeros(seqlen_k, 2, dtype=torch.float64, device=device)
    expected_dv[seqlen_k - seqlen_q:] = (keep[..., None] * dout[0].double()).sum(1) / (1 - dropout_p)
    torch.testing.assert_close(dv[0, :, 0].double(), expected_dv, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["sdpa", "flash"])
@pytest.mark.parametrize("pad_heads", ["kernel", "copy"])
def test_padded_head_dim_store_stays_in_its_row(request, monkeypatch, device, layout, pad_heads):
    """A head dim below its bucket (24 in 32, 72 in 128): the padded-head kernels
    (``AOTATTN_PAD_HEADS=kernel``, the default) compute on the padded tile and must store
    only the real columns. The padding's zeros stored past a row land on its neighbour (the
    next row in (B, H, S, D), the next head in (B, S, H, D)); causal masks reverse the block
    order, so the neighbour has already been written. ``copy`` pads by copy and slices."""
    monkeypatch.setenv("AOTATTN_PAD_HEADS", pad_heads)
    seed_from(request.node.name)
    batch, seqlen, heads, head_dim = _gpu_or_cpu(device, (2, 40, 3, 24), (2, 2048, 8, 72))
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=device, dtype=torch.float16) for _ in range(3))
    if layout == "sdpa":
        out = aotattn.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        out = out.transpose(1, 2)
        mask = dict(causal=True, diagonal="top_left")
    else:
        mask = dict(causal=True)
        out = aotattn.flash_attn_func(q, k, v, **mask)
    exact, floor = exact_attention(q, k, v, **mask), floor_attention(q, k, v, **mask)
    err, bound = rel_err(out, exact.out), rel_err(floor.out, exact.out)
    assert err <= multiple(torch.float16, device) * bound + SLACK, f"relative error {err:.3e} vs floor {bound:.3e}"
    assert err < TOLERANCE[torch.float16]
