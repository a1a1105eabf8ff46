"""Bad input gets a clear error naming the argument, never a wrong answer or a crash."""

from __future__ import annotations

import fractions
import math

import numpy as np
import pytest
import torch

import aotattn
from aotattn import reference
from tests.helpers import rel_err


def _qkv(dtype=torch.float16, b=1, sq=8, sk=8, hq=2, hk=2, d=16, dv=16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype),
            torch.randn(b, sk, hk, dv, dtype=dtype))


def _nested(layout=torch.strided):
    return torch.nested.nested_tensor([torch.randn(8, 2, 16), torch.randn(8, 2, 16)], dtype=torch.float16,
                                      layout=layout)


def _call(**changes):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(changes)
    return aotattn.flash_attn_func(**args)


FLASH_CASES = [
    ("q not a tensor", lambda: _call(q=[1.0]), TypeError, "q: expected a torch.Tensor"),
    ("q 3-D", lambda: _call(q=torch.randn(8, 2, 16, dtype=torch.float16)), ValueError, "q: expected a 4-D"),
    ("float64", lambda: aotattn.flash_attn_func(*_qkv(torch.float64)), TypeError, "q: expected dtype"),
    ("int", lambda: aotattn.flash_attn_func(*(t.to(torch.int32) for t in _qkv())), TypeError, "q: expected dtype"),
    ("k dtype", lambda: _call(k=_qkv()[1].float()), TypeError, "k: expected dtype torch.float16"),
    ("v dtype", lambda: _call(v=_qkv()[2].bfloat16()), TypeError, "v: expected dtype torch.float16"),
    ("k device", lambda: _call(k=torch.empty(1, 8, 2, 16, dtype=torch.float16, device="meta")), ValueError,
     "k: expected device cpu"),
    ("batch", lambda: _call(k=_qkv(b=2)[1]), ValueError, "k: expected batch size 1"),
    ("kv lengths", lambda: _call(v=_qkv(sk=9)[2]), ValueError, "v: expected sequence length 8"),
    ("kv heads", lambda: _call(v=_qkv(hk=1)[2]), ValueError, "v: expected 2 heads"),
    ("gqa ratio", lambda: aotattn.flash_attn_func(*_qkv(hq=3, hk=2)), ValueError,
     "q: expected a number of heads that is a multiple of k's 2"),
    ("k head dim", lambda: _call(k=_qkv(d=32)[1]), ValueError, "k: expected head dim 16"),
    ("head dim > 256", lambda: aotattn.flash_attn_func(*_qkv(d=257)), ValueError, "q: expected a head dim in 1..256"),
    ("dv > 256", lambda: aotattn.flash_attn_func(*_qkv(dv=300)), ValueError, "v: expected a head dim in 1..256"),
    ("last stride", lambda: _call(q=torch.randn(1, 8, 16, 2, dtype=torch.float16).transpose(2, 3)), ValueError,
     "q: expected a unit stride in the last dimension"),
    ("v last stride", lambda: _call(v=torch.randn(1, 8, 16, 2, dtype=torch.float16).transpose(2, 3)), ValueError,
     "got strides (256, 32, 1, 2) (pass v.contiguous())"),
    ("window type", lambda: _call(window_size=3), TypeError, "window_size: expected a pair of ints"),
    ("softcap", lambda: _call(softcap=30.0), ValueError, "softcap: expected 0.0, got 30.0 (aotattn has no logit"),
    ("softcap type", lambda: _call(softcap=False), TypeError, "softcap: expected a float, got bool"),
    ("alibi", lambda: _call(alibi_slopes=torch.ones(2)), ValueError, "alibi_slopes: expected None"),
    ("attn probs type", lambda: _call(return_attn_probs=1), TypeError, "return_attn_probs: expected a bool"),
    ("attn probs dropout", lambda: _call(return_attn_probs=True, dropout_p=0.1), ValueError,
     "aotattn.dropout_mask(...) returns the keep-mask"),
    ("attn probs, lse type", lambda: _call(return_attn_probs=True, return_lse="yes"), TypeError,
     "return_lse: expected a bool"),
    ("window floats", lambda: _call(window_size=(1.0, 2)), TypeError, "window_size: expected a pair of ints"),
    ("window < -1", lambda: _call(window_size=(-2, 0)), ValueError, "window_size: expected sizes >= 0"),
    ("diagonal", lambda: _call(diagonal="middle"), ValueError, "diagonal: expected one of"),
    ("scale nan", lambda: _call(softmax_scale=float("nan")), ValueError, "softmax_scale: expected a finite"),
    ("scale inf", lambda: _call(softmax_scale=float("inf")), ValueError, "softmax_scale: expected a finite"),
    ("scale str", lambda: _call(softmax_scale="1"), TypeError, "softmax_scale: expected a real number"),
    ("causal str", lambda: _call(causal="yes"), TypeError, "causal: expected a bool"),
    ("dropout range", lambda: _call(dropout_p=1.0), ValueError, "dropout_p: expected a float in [0, 1)"),
    ("dropout negative", lambda: _call(dropout_p=-0.1), ValueError, "dropout_p: expected a float in [0, 1)"),
    ("return_lse", lambda: _call(return_lse=1), TypeError, "return_lse: expected a bool"),
    ("scale overflows fp32", lambda: _call(softmax_scale=1e300), ValueError, "softmax_scale: expected a magnitude"),
    ("negative scale overflows fp32", lambda: _call(softmax_scale=-3e38), ValueError,
     "softmax_scale: expected a magnitude"),
    ("int scale beyond floats", lambda: _call(softmax_scale=10**400), ValueError,
     "softmax_scale: expected a magnitude up to 2.35e+38, got a number beyond the float range"),
    ("negative fraction scale beyond floats", lambda: _call(softmax_scale=fractions.Fraction(-10**400, 3)), ValueError,
     "softmax_scale: expected a magnitude"),
    ("int dropout beyond floats", lambda: _call(dropout_p=10**400), ValueError, "dropout_p: expected a float in [0, 1)"),
    ("dropout bool", lambda: _call(dropout_p=False), TypeError, "dropout_p: expected a float"),
    ("dropout tensor", lambda: _call(dropout_p=torch.tensor([0.1, 0.2])), TypeError, "dropout_p: expected a float"),
    ("sparse q", lambda: _call(q=_qkv()[0].to_sparse()), ValueError, "q: expected a dense"),
    # a sparse bias passed the checks and died in expand ("expand is unsupported for Sparse tensors")
    ("sparse bias", lambda: _call(bias=torch.randn(8, 8, dtype=torch.float16).to_sparse()), ValueError,
     "bias: expected a dense (strided) tensor, got layout torch.sparse_coo"),
    ("sparse csr bias", lambda: _call(bias=torch.randn(8, 8).to_sparse_csr()), ValueError,
     "bias: expected a dense (strided) tensor, got layout torch.sparse_csr"),
    # a strided nested tensor reports the strided layout: PyTorch raised an internal error at q.shape
    ("nested q", lambda: _call(q=_nested()), ValueError, "q: expected a dense tensor, got a nested tensor"),
    ("nested k", lambda: _call(k=_nested()), ValueError, "k: expected a dense tensor, got a nested tensor"),
    ("nested v with dropout", lambda: _call(v=_nested(), dropout_p=0.1), ValueError, "v: expected a dense tensor"),
]


@pytest.mark.parametrize("case", FLASH_CASES, ids=[c[0] for c in FLASH_CASES])
def test_flash_attn_func_rejects(case):
    _, call, exc, message = case
    with pytest.raises(exc) as info:
        call()
    assert message in str(info.value)


def _sdpa(**changes):
    q, k, v = (t.transpose(1, 2) for t in _qkv(hq=4, hk=2))
    args = dict(query=q, key=k, value=v, enable_gqa=True)
    args.update(changes)
    return aotattn.scaled_dot_product_attention(**args)


SDPA_CASES = [
    ("gqa off", lambda: _sdpa(enable_gqa=False), ValueError, "key: expected 4 heads (those of query) unless enable_gqa"),
    ("query 5-D", lambda: _sdpa(query=torch.randn(1, 1, 4, 8, 16)), ValueError, "expected one rank, got 5, 4, 4"),
    ("query 1-D", lambda: _sdpa(query=torch.randn(16), key=torch.randn(16), value=torch.randn(16)), ValueError,
     "query: expected (..., L, E), at least 2 dimensions"),
    ("5-D broadcast", lambda: _sdpa(query=torch.randn(3, 1, 4, 8, 16, dtype=torch.float16),
                                    key=torch.randn(1, 1, 2, 8, 16, dtype=torch.float16),
                                    value=torch.randn(1, 1, 2, 8, 16, dtype=torch.float16)),
     ValueError, "expected the same leading dims"),
    ("5-D mask", lambda: _sdpa(query=torch.randn(3, 1, 4, 8, 16, dtype=torch.float16),
                               key=torch.randn(3, 1, 2, 8, 16, dtype=torch.float16),
                               value=torch.randn(3, 1, 2, 8, 16, dtype=torch.float16), attn_mask=torch.randn(2, 8, 8)),
     ValueError, "attn_mask: expected a shape broadcastable to (3, 1, 4, 8, 8)"),
    ("3-D key not a tensor", lambda: _sdpa(query=torch.randn(4, 8, 16), key=[1.0]), TypeError,
     "key: expected a torch.Tensor, got list"),
    ("scale nan", lambda: _sdpa(scale=float("nan")), ValueError, "scale: expected a finite"),
    ("int scale beyond floats", lambda: _sdpa(scale=-10**400), ValueError, "scale: expected a magnitude"),
    ("is_causal", lambda: _sdpa(is_causal=None), TypeError, "is_causal: expected a bool"),
    # a bare "got bool" read as a contradiction: types outside builtins are named with their module
    ("is_causal numpy", lambda: _sdpa(is_causal=np.bool_(True)), TypeError,
     "is_causal: expected a bool, got numpy.bool"),
    ("scale 1-D tensor", lambda: _sdpa(scale=torch.tensor([0.3])), TypeError,
     "scale: expected a real number or None, got torch.Tensor"),
    ("scale bool tensor", lambda: _sdpa(scale=torch.tensor(True)), TypeError, "scale: expected a real number"),
    ("value dtype", lambda: _sdpa(value=torch.randn(1, 2, 8, 16)), TypeError, "value: expected dtype torch.float16"),
    ("sparse mask", lambda: _sdpa(attn_mask=torch.randn(8, 8, dtype=torch.float16).to_sparse()), ValueError,
     "attn_mask: expected a dense (strided) tensor"),
    ("sparse bool mask", lambda: _sdpa(attn_mask=torch.ones(8, 8, dtype=torch.bool).to_sparse()), ValueError,
     "attn_mask: expected a dense (strided) tensor"),
    ("nested query", lambda: _sdpa(query=_nested().transpose(1, 2)), ValueError,
     "query: expected a dense tensor, got a nested tensor"),
    ("jagged query", lambda: _sdpa(query=_nested(torch.jagged).transpose(1, 2)), ValueError,
     "query: expected a dense tensor, got a nested tensor"),
    ("nested value, dropout", lambda: _sdpa(value=_nested().transpose(1, 2), dropout_p=0.5), ValueError,
     "value: expected a dense tensor"),
    ("nested mask", lambda: _sdpa(attn_mask=torch.nested.nested_tensor([torch.randn(8, 8), torch.randn(8, 8)])),
     ValueError, "attn_mask: expected a dense tensor, got a nested tensor"),
]


@pytest.mark.parametrize("case", SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_sdpa_rejects(case):
    _, call, exc, message = case
    with pytest.raises(exc) as info:
        call()
    assert message in str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_scale_and_dropout_p_take_0_d_tensors_as_pytorch_does(dtype):
    """PyTorch's float arguments take a 0-d real tensor (SDPA's scale and dropout_p), so
    model code may hold its scale as one; the value is what a float would give."""
    q, k, v = (torch.randn(2, 3, 9, 16) for _ in range(3))
    value = 3 if dtype == torch.int64 else 0.3
    out = aotattn.scaled_dot_product_attention(q, k, v, scale=torch.tensor(value, dtype=dtype),
                                               dropout_p=torch.tensor(0, dtype=dtype))
    ref, _ = reference.attention(*(t.transpose(1, 2).double() for t in (q, k, v)), softmax_scale=value)
    assert rel_err(out.transpose(1, 2), ref) < 1e-5
    out = aotattn.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)),
                                  softmax_scale=torch.tensor(value, dtype=dtype))
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="scale: expected a finite number, got nan"):
        aotattn.scaled_dot_product_attention(q, k, v, scale=torch.tensor(float("nan")))


def test_the_largest_scale_accepted_gives_the_float64_answer():
    """At the bound, scale * log2(e) is still finite in float32: on scores whose scaled
    values stay in range the answer is the float64 one."""
    from aotattn.families.flash.checks import MAX_SCALE

    q, k = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
    q[..., 0] = 1.0
    k[0, :, 0, 0] = torch.tensor([0.0, 1e-37, 5e-38, -1e-37])  # scaled scores 0, 23.5, 11.75, -23.5
    v = torch.randn(1, 4, 1, 16)
    out = aotattn.flash_attn_func(q, k, v, softmax_scale=MAX_SCALE)
    weights = torch.softmax(MAX_SCALE * k[0, :, 0, 0].double(), 0)
    expected = (weights[:, None] * v[0, :, 0].double()).sum(0)
    assert torch.allclose(out[0, :, 0].double(), expected.expand(4, -1), atol=1e-5)


DROPOUT_MASK_CASES = [
    ("batch float", dict(batch=1.0), TypeError, "batch: expected an int"),
    ("negative length", dict(seqlen_q=-4), ValueError, "seqlen_q: expected an int >= 0"),
    ("heads bool", dict(heads_q=True), TypeError, "heads_q: expected an int"),
    ("meta device", dict(device="meta"), ValueError, "device: expected a CPU or CUDA device"),
    ("unknown device", dict(device="nowhere"), ValueError, "device: expected a CPU or CUDA device"),
    ("p zero", dict(dropout_p=0.0), ValueError, "dropout_p: expected a float in (0, 1)"),
    ("p one", dict(dropout_p=1.0), ValueError, "dropout_p"),
    ("p str", dict(dropout_p="0.5"), TypeError, "dropout_p: expected a float"),
    ("p int beyond floats", dict(dropout_p=-10**400), ValueError, "dropout_p: expected a float in [0, 1)"),
]


@pytest.mark.parametrize("case", DROPOUT_MASK_CASES, ids=[c[0] for c in DROPOUT_MASK_CASES])
def test_dropout_mask_rejects(case):
    _, changes, exc, message = case
    args = dict(batch=1, heads_q=1, seqlen_q=4, seqlen_k=4, dropout_p=0.5, device="cpu")
    args.update(changes)
    with pytest.raises(exc) as info:
        aotattn.dropout_mask(**args)
    assert message in str(info.value)


def _transformed(api: str, warm: bool):
    """``api`` called under ``torch.vmap`` (or ``torch.func.grad``) on fresh inputs; with
    ``warm``, after a plain call of the per-sample shapes (the plan cache holds its entry)."""
    q, k, v = (torch.randn(3, 1, 8, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = {
        "flash": lambda q, k, v: aotattn.flash_attn_func(q, k, v, causal=True),
        "sdpa": lambda q, k, v: aotattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                     v.transpose(1, 2)).transpose(1, 2),
        "varlen": lambda q, k, v: aotattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8),
    }
    call = calls[api]
    if warm:
        plain = call(q[0], k[0], v[0])
        ref, _ = reference.attention(q[0], k[0], v[0], causal=api == "flash")
        assert rel_err(plain, ref.reshape(plain.shape)) < 1e-5
    return lambda: torch.vmap(call)(q, k, v)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("api, name", [("flash", "q"), ("sdpa", "query"), ("varlen", "q")])
def test_torch_func_transforms_are_refused_clearly(api, name, warm):
    """Tensors of a torch.func transform have no storage: the kernels (and the plan cache's
    key) read data pointers, which made torch raise "Cannot access data pointer of Tensor
    that doesn't have storage" from deep inside. Refused at the boundary, naming the argument."""
    with pytest.raises(ValueError, match=f"^{name}: expected a plain tensor, got one wrapped by a torch.func"):
        _transformed(api, warm)()
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="^q: expected a plain tensor"):
        torch.func.grad(lambda q: aotattn.flash_attn_func(q, q, q).sum())(q)
    query = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="^attn_mask: expected a plain tensor"):
        torch.vmap(lambda m: aotattn.scaled_dot_product_attention(query, query, query, attn_mask=m))(
            torch.randn(3, 8, 8))


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("api, name", [("flash", "q"), ("sdpa", "query"), ("varlen", "q")])
def test_dual_tensors_of_forward_mode_ad_are_refused_clearly(api, name, warm):
    """The operators have no JVP rule: a dual tensor (forward_ad.make_dual) was accepted and
    its tangent silently dropped, the output carrying none. Refused, naming the argument,
    with or without requires_grad, after a plain call of the same shapes (a plan-cache
    hit must not skip the check); plain tensors inside a dual level still run."""
    from torch.autograd import forward_ad

    q, k, v = _qkv(torch.float32, b=1, sq=8, sk=8, hq=2, hk=2)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    calls = {
        "flash": lambda q: aotattn.flash_attn_func(q, k, v, causal=True),
        "sdpa": lambda q: aotattn.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                              v.transpose(1, 2)).transpose(1, 2),
        "varlen": lambda q: aotattn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8).unsqueeze(0),
    }
    if warm:
        calls[api](q)
    for requires_grad in (False, True):
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(q.clone().requires_grad_(requires_grad), torch.randn_like(q))
            with pytest.raises(ValueError, match=f"^{name}: expected a plain tensor, got a dual tensor of forward-mode"):
                calls[api](dual)
            plain = calls[api](q)
            assert forward_ad.unpack_dual(plain).tangent is None
    ref, _ = reference.attention(q.double(), k.double(), v.double(), causal=api == "flash")
    assert rel_err(plain, ref) < 1e-5


def test_sequences_or_heads_past_cudas_grid_limit_are_refused_on_cuda_only():
    """The kernels' grids are (blocks, heads, sequences): past 65535 in y or z the launch
    failed with the driver's CUDA_ERROR_INVALID_VALUE; the interpreter has no such limit."""
    from aotattn.families.flash import checks

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for batch, heads, what in ((65536, 1, "sequences"), (1, 65536, "heads")):
        with pytest.raises(ValueError, match=f"q: expected at most 65535 {what}.*got 65536: split the call"):
            checks.check_grid("q", batch, heads, cuda)
        checks.check_grid("q", batch, heads, cpu)
    checks.check_grid("q", 65535, 32768, cuda)
    with pytest.raises(ValueError, match=r"q: expected at most 2\*\*31 - 1 \(sequence, head\) pairs.*65535 x 32769"):
        checks.check_grid("q", 65535, 32769, cuda)  # the kernels' pair index, batch * Hq, is an int32
    checks.check_grid("q", 65535, 65535, cpu)
    with pytest.raises(ValueError, match="batch: expected at most 65535 sequences"):  # before any CUDA call
        aotattn.dropout_mask(65536, 1, 1, 1, 0.5, device="cuda")


def test_sequences_past_the_kernels_int32_block_arithmetic_are_refused():
    """Rows of stride 0 (``expand``) make any length cheap; the kernels round lengths up to
    blocks in int32, so a length within a block of 2**31 wrapped (the GPU launch of 2**31
    failed packing it; the interpreter ran without end)."""
    from aotattn.families.flash.checks import MAX_SEQLEN

    q = torch.randn(1, 4, 2, 8)
    for length in (MAX_SEQLEN + 1, 2**31 - 1, 2**31, 2**40):
        long = torch.randn(1, 1, 2, 8).expand(1, length, 2, 8)
        message = f"expected a sequence length of at most {MAX_SEQLEN} .*got {length}"
        with pytest.raises(ValueError, match="k: " + message):
            aotattn.flash_attn_func(q, long, long)
        with pytest.raises(ValueError, match="q: " + message):
            aotattn.flash_attn_func(long, q, q)
        with pytest.raises(ValueError, match="key: " + message):
            aotattn.scaled_dot_product_attention(q.transpose(1, 2), long.transpose(1, 2), long.transpose(1, 2))
        with pytest.raises(ValueError, match="seqlen_k: " + message):
            aotattn.dropout_mask(1, 1, 1, length, 0.5)


@pytest.mark.gpu
def test_keys_up_to_the_longest_length_accepted_are_attended():
    """Rows of stride 0: every key has the same score and the same v row, whose entries are
    signed powers of two. A block count that wrapped in int32 would run no key block (output
    0, log-sum-exp -inf) or a few (log-sum-exp far below score + log(n)).

    Up to 2**24 keys the float32 sums are exact: the output is v's row and the log-sum-exp
    score + log(n). Past ~2**26 keys of equal weight the tensor cores' float32 accumulator of
    P @ V stops growing (measured on an H100: the output is v * 2**26 / n at D 128), and at
    BLOCK_N 64 the row sum stops at 2**30 (docs/semantics.md); at the longest length the
    output is v times one factor in (0, 1] and every key block still counts in the row sum."""
    from aotattn.families.flash.checks import MAX_SEQLEN

    for n in (2**24, MAX_SEQLEN):
        for d in (8, 128):
            q = torch.randn(1, 3, 1, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 1, 1, d, device="cuda", dtype=torch.bfloat16)
            row = torch.randint(-2, 3, (d,)).float().exp2() * (torch.randint(0, 2, (d,)) * 2 - 1)
            v = row.to("cuda", torch.bfloat16).view(1, 1, 1, d)
            out, lse = aotattn.flash_attn_func(q, k.expand(1, n, 1, d), v.expand(1, n, 1, d), return_lse=True)
            score = (q[0, :, 0].double() @ k[0, 0, 0].double()) / d**0.5
            excess = lse[0, 0].double() - score - math.log(n)  # log(row sum / n)
            factor = out[0, :, 0].float() / v[0, 0, 0].float()  # (3, d)
            if n <= 2**24:
                assert torch.equal(out, v.expand(1, 3, 1, d)), (n, d)
                assert excess.abs().max() < 1e-5, (n, d, excess)
            else:
                assert torch.equal(factor, factor[0, 0].expand_as(factor)), (d, factor)
                assert 0 < factor[0, 0] <= 1, (d, factor)
                assert (excess >= math.log(2**26 / n) - 1e-5).all() and (excess < 1e-5).all(), (d, excess)


@pytest.mark.gpu
def test_a_batch_past_the_grid_limit_is_refused_on_the_gpu():
    q = torch.randn(65536, 1, 1, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="65535 sequences"):
        aotattn.flash_attn_func(q, q, q)
    cu = torch.arange(0, 65537, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="65535 sequences"):
        aotattn.flash_attn_varlen_func(q[:, 0], q[:, 0], q[:, 0], cu, cu, 1, 1)
    with pytest.raises(ValueError, match="batch: expected at most 65535 sequences"):
        aotattn.dropout_mask(65536, 1, 1, 1, 0.5, device="cuda")
