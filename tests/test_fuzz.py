"""Property: for any problem, aotattn is within the rounding floor of the float64 reference.

Hypothesis draws the shapes (odd lengths, empty key sets, GQA groups, head dims 1..256
that differ between Q/K and V), the mask (causal, windows with -1 or bounded sides on
either diagonal), the scale (default, zero, negative, large), the dtype, the input
magnitude and the backward backend, and checks forward and backward as
tests/test_common_mistakes.py does: no NaN, rows that see no key exactly 0 with lse
+inf, every quantity within a small multiple of the floor's error. A second draws at most
six rows and keys with head dims to 256 on every device (the CPU's own limits stop at 40
rows and head dim 80). A third adds dropout (the floor and the reference under the
keep-mask the call reports), on problems of either kind.

Budgets (profiles registered in tests/conftest.py): CI runs the "ci" profile, a fixed
set of 12 examples per device. The long run explores (CPU, then GPU)::

    python -m pytest tests/test_fuzz.py --hypothesis-profile=long -m "not gpu"   # CPU
    AOTATTN_MODE=jit AOTATTN_FUZZ_SHARDS=8 python -m pytest tests/test_fuzz.py --hypothesis-profile=long -m gpu -n 8

``AOTATTN_FUZZ_SHARDS=N`` splits each property into N items per device, each with its share
of the profile's examples and its own random seed, so pytest-xdist's workers share one
property (on the GPU the dropout property outlasted a 10-minute call on one worker).

A failure prints the smallest example found and ``@reproduce_failure`` to replay it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aotattn
from tests.helpers import DEVICES, Results, assert_within_floor, exact_attention, floor_attention, kernel_attention

# the largest lengths and head dims drawn, per device (the interpreter is slow)
LIMITS = {"cpu": {"seqlen": 40, "head_dim": 80}, "cuda": {"seqlen": 3000, "head_dim": 256}}
# few rows and keys with head dims to 256, on every device: where one number (a row's delta, a
# pair's P) carries a whole row's error, which the CPU's limits above never reach (the GPU's
# long fuzz found both of the floor's too-tight spreads there, PINNED below)
FEW_ROWS = {"seqlen": 6, "head_dim": 256}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BACKENDS = [("split", False), ("fused", False), ("fused", True)]
# each property's items: one per device, or N per device under AOTATTN_FUZZ_SHARDS=N (for the
# long profile: the "ci" profile is derandomized, so its shards would all draw the same data)
_shards = os.environ.get("AOTATTN_FUZZ_SHARDS", "1")
if not _shards.isdigit() or int(_shards) < 1:
    raise ValueError(f"AOTATTN_FUZZ_SHARDS={_shards}: expected the items per property and device, "
                     "a whole number from 1")
SHARDS = int(_shards)


def _sharded_devices() -> list:
    if SHARDS == 1:
        return DEVICES  # the ids stay [cpu] and [cuda]
    params = []
    for device in DEVICES:
        value, marks = (device.values[0], device.marks) if hasattr(device, "values") else (device, ())
        params += [pytest.param(value, marks=marks, id=f"{value}-{i}") for i in range(SHARDS)]
    return params


def fuzzed(test):
    """``test(device, data)`` as a Hypothesis property on every device, split into SHARDS items
    per device, each drawing its share of the profile's examples (read when this module is
    imported, after pytest has loaded ``--hypothesis-profile``)."""
    test = given(data=st.data())(test)
    if SHARDS > 1:
        test = settings(max_examples=-(-settings.default.max_examples // SHARDS))(test)
    return pytest.mark.parametrize("device", _sharded_devices())(test)


def _window_side(seqlen: int):
    return st.one_of(st.just(-1), st.integers(0, seqlen + 2))


@st.composite
def problems(draw, device: str, **limits: int) -> dict:
    limits = dict(LIMITS[device], **limits)
    heads_k = draw(st.integers(1, 2))
    shape = dict(
        batch=draw(st.integers(1, 2)),
        seqlen_q=draw(st.integers(1, limits["seqlen"])),
        seqlen_k=draw(st.integers(0, limits["seqlen"])),
        heads_k=heads_k,
        heads_q=heads_k * draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, limits["head_dim"])),
        head_dim_v=draw(st.integers(1, limits["head_dim"])),
    )
    mask = dict(
        causal=draw(st.booleans()),
        window_size=(draw(_window_side(shape["seqlen_k"])), draw(_window_side(shape["seqlen_k"]))),
        diagonal=draw(st.sampled_from(["bottom_right", "top_left"])),
        softmax_scale=draw(st.one_of(st.none(), st.just(0.0), st.floats(-2.0, 2.0, allow_nan=False))),
    )
    return dict(shape=shape, mask=mask, dtype=draw(st.sampled_from(DTYPES)),
                magnitude=draw(st.sampled_from([0.25, 1.0, 4.0])), backend=draw(st.sampled_from(BACKENDS)),
                seed=draw(st.integers(0, 2**31 - 1)))


def inputs(problem: dict, device: str) -> tuple[torch.Tensor, ...]:
    """q, k, v (at the drawn magnitude) and dO from the problem's seed."""
    s, dtype = problem["shape"], problem["dtype"]
    gen = torch.Generator(device).manual_seed(problem["seed"])

    def randn(*shape, scale=problem["magnitude"]):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    return (randn(s["batch"], s["seqlen_q"], s["heads_q"], s["head_dim"]),
            randn(s["batch"], s["seqlen_k"], s["heads_k"], s["head_dim"]),
            randn(s["batch"], s["seqlen_k"], s["heads_k"], s["head_dim_v"]),
            randn(s["batch"], s["seqlen_q"], s["heads_q"], s["head_dim_v"], scale=1.0))


@fuzzed
def test_any_problem_is_within_the_floor(device, data):
    check_problem(data.draw(problems(device), label="problem"), device)


@fuzzed
def test_any_few_row_wide_head_problem_is_within_the_floor(device, data):
    check_problem(data.draw(problems(device, **FEW_ROWS), label="problem"), device)


def check_problem(problem: dict, device: str) -> None:
    q, k, v, dout = inputs(problem, device)
    backend, deterministic = problem["backend"]
    kernel = kernel_attention(q, k, v, dout, backend=backend, deterministic=deterministic, **problem["mask"])
    floor = floor_attention(q, k, v, dout, **problem["mask"])
    exact = exact_attention(q, k, v, dout, **problem["mask"])
    assert_within_floor(kernel, floor, exact, problem["dtype"], device)


# One query that sees two of 91 keys (window (-1, 1) top-left), head dim 1, V's 187: its dK has
# two nonzero rows, whose norm error the floor's spread had counted over all 91 (dK 2.04x the
# floor). Found by the GPU's long fuzz (H100, JIT, 2026-12-07, seed 871 on CUDA data; the
# failing quantity was cut from the log); seed 33 fails the same way on CPU data.
TWO_OF_91_KEYS = dict(shape=dict(batch=1, seqlen_q=1, seqlen_k=91, heads_k=1, heads_q=1, head_dim=1, head_dim_v=187),
                      mask=dict(causal=False, window_size=(-1, 1), diagonal="top_left", softmax_scale=-1.0),
                      dtype=torch.bfloat16, magnitude=0.25, backend=("split", False))
# Two queries, causal: the second sees two keys, and all of its dQ (163 elements) moves with
# one number, delta's error from the stored output's rounding (dQ 2.25x a floor that spread it
# as 163 draws). The GPU's second long fuzz (H100, JIT, 2026-12-07, seed 2 on CUDA data); seed
# 21 fails the same way on CPU data (dQ 2.18x, dK 2.40x).
ONE_DELTA = dict(shape=dict(batch=1, seqlen_q=2, seqlen_k=2, heads_k=1, heads_q=1, head_dim=163, head_dim_v=78),
                 mask=dict(causal=True, window_size=(-1, -1), diagonal="bottom_right", softmax_scale=None),
                 dtype=torch.bfloat16, magnitude=1.0, backend=("split", False))
PINNED = [dict(TWO_OF_91_KEYS, seed=871), dict(TWO_OF_91_KEYS, seed=33), dict(ONE_DELTA, seed=2),
          dict(ONE_DELTA, seed=21)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(len(PINNED)))
def test_pinned_problems(device, index):
    """Examples the long fuzz found, replayed without Hypothesis (each device draws its own data from the seed)."""
    check_problem(PINNED[index], device)


@fuzzed
def test_any_dropout_problem_is_within_the_floor(device, data):
    """The same property with dropout: the floor and the float64 reference applied with the
    keep-mask the call reports (``aotattn.dropout_mask`` under the generator state the call
    saw), at rates from one in 2^16 to 0.9."""
    # on the GPU, shorter than the plain property: the floor keeps a few more float64
    # (B, Hq, Sq, Sk) tensors (the mask and the kept P), and eight workers share one GPU;
    # half the problems are the few-rows wide-heads ones
    limits = data.draw(st.sampled_from([{"seqlen": 2048} if device == "cuda" else {}, FEW_ROWS]), label="limits")
    problem = data.draw(problems(device, **limits), label="problem")
    dropout_p = data.draw(st.sampled_from([2.0**-16, 0.1, 0.5, 0.9]), label="dropout_p")
    check_dropout_problem(problem, dropout_p, device)


# Examples the fuzz found, replayed without Hypothesis (a failing example shrinks for
# minutes on the GPU). The first failed on the H200 (JIT, 2026-12-01, the "ci" profile):
# dK 0.168 against an exact 0 (one key: dS cancels to rounding) while dQ, from the same
# dS, passed; the interpreter gives dK ~1e-5 on CPU data, old and new floors alike.
# The second failed on CPU (the long profile, 2026-12-05): fp32, one key, dV 11x the floor,
# which summed in float64 the twelve dO rows that cancel to 1e-3 of their magnitudes; the
# kernel's fp32 sum of them is that far off by itself (the floor now counts it, helpers.py).
PINNED_DROPOUT = [
    (dict(shape=dict(batch=1, seqlen_q=16, seqlen_k=1, heads_k=1, heads_q=1, head_dim=1, head_dim_v=129),
          mask=dict(causal=False, window_size=(-1, -1), diagonal="bottom_right", softmax_scale=None),
          dtype=torch.float16, magnitude=0.25, backend=("fused", False), seed=0), 2.0**-16),
    (dict(shape=dict(batch=1, seqlen_q=12, seqlen_k=1, heads_k=1, heads_q=1, head_dim=1, head_dim_v=1),
          mask=dict(causal=False, window_size=(-1, -1), diagonal="bottom_right", softmax_scale=None),
          dtype=torch.float32, magnitude=0.25, backend=("split", False), seed=1), 2.0**-16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b[0]}{'-det' if b[1] else ''}")
@pytest.mark.parametrize("index", range(len(PINNED_DROPOUT)))
def test_pinned_dropout_problems(device, backend, index):
    problem, dropout_p = PINNED_DROPOUT[index]
    torch.manual_seed(problem["seed"])  # the call's Philox seed and offset (the fuzz's came from its run)
    check_dropout_problem(dict(problem, backend=backend), dropout_p, device)


def check_dropout_problem(problem: dict, dropout_p: float, device: str) -> None:
    assert_within_floor(*dropout_results(problem, dropout_p, device), problem["dtype"], device)


def dropout_results(problem: dict, dropout_p: float, device: str) -> tuple[Results, Results, Results]:
    """(kernel, floor, exact) of a dropout problem, the floor and the reference under the
    keep-mask the call reports."""
    s = problem["shape"]
    q, k, v, dout = inputs(problem, device)
    backend, deterministic = problem["backend"]
    state = torch.get_rng_state()
    kernel = kernel_attention(q, k, v, dout, backend=backend, deterministic=deterministic, dropout_p=dropout_p,
                              **problem["mask"])
    torch.set_rng_state(state)
    keep = aotattn.dropout_mask(s["batch"], s["heads_q"], s["seqlen_q"], s["seqlen_k"], dropout_p, device=device)
    dropped = dict(dropout_mask=keep, dropout_p=dropout_p)
    floor = floor_attention(q, k, v, dout, **problem["mask"], **dropped)
    exact = exact_attention(q, k, v, dout, **problem["mask"], **dropped)
    return kernel, floor, exact


def test_shards_share_out_a_propertys_examples():
    """AOTATTN_FUZZ_SHARDS=N: N items per property and device, each with the profile's
    examples divided by N (rounded up), and a refusal of N below 1."""
    def pytest_run(shards: str, *args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, AOTATTN_FUZZ_SHARDS=shards)
        return subprocess.run([sys.executable, "-m", "pytest", "tests/test_fuzz.py", "-p", "no:cacheprovider",
                               "-p", "no:xdist", "--hypothesis-profile=long", *args], env=env,
                              capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])

    shards = 160  # the long profile's 400 examples: 3 for each
    listed = pytest_run(str(shards), "--collect-only", "-q").stdout.splitlines()
    for name in ("test_any_problem_is_within_the_floor", "test_any_few_row_wide_head_problem_is_within_the_floor",
                 "test_any_dropout_problem_is_within_the_floor"):
        ids = {line.split("[")[1].rstrip("]") for line in listed if f"::{name}[" in line}
        assert ids == {f"{device}-{i}" for device in ("cpu", "cuda") for i in range(shards)}, name
    ran = pytest_run(str(shards), "-k", "few_row and cpu-7]", "--hypothesis-show-statistics", "-m", "not gpu")
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert "3 passing examples" in ran.stdout and "settings.max_examples=3" in ran.stdout, ran.stdout[-2000:]
    for bad in ("0", "two"):
        refused = pytest_run(bad, "--collect-only", "-q")
        assert refused.returncode != 0 and f"AOTATTN_FUZZ_SHARDS={bad}:" in refused.stdout
