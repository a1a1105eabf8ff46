"""Varlen against padding with PyTorch SDPA, and the cost of dropout (GPU, bf16).

    python benchmarks/bench_features.py

Varlen: 16 sequences of lengths drawn uniformly from [256, 4096] (seeded), H=16, D=128.
aotattn packs them (flash_attn_varlen_func); PyTorch SDPA runs the batch padded to the
longest, with a key-padding mask (the correct computation: SDPA then picks its
memory-efficient backend) and without one on the flash backend (padding's cost alone;
its padded rows are garbage). Dropout: the same call with dropout_p 0 and 0.1, aotattn
and SDPA flash. Times are medians of triton.testing.do_bench, forward and forward+backward.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import aotattn


def _time(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _fwd_bwd(fn, inputs):
    def run():
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    return run


def varlen_rows(causal: bool) -> list[tuple]:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(256, 4097, (16,), generator=gen).tolist()
    heads, dim, longest = 16, 128, max(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32).cuda()
    total = sum(lens)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    padded = [torch.zeros(len(lens), heads, longest, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for t_pad, t in zip(padded, (q, k, v)):
        for b, (a, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
            t_pad[b, :, :e - a] = t.detach()[a:e].transpose(0, 1)
    qp, kp, vp = (t.requires_grad_() for t in padded)
    keep = torch.arange(longest, device="cuda")[None, :] < torch.tensor(lens, device="cuda")[:, None]
    mask = keep[:, None, None, :]
    if causal:  # SDPA's is_causal cannot combine with a mask: fold it in
        mask = mask & torch.ones(longest, longest, dtype=torch.bool, device="cuda").tril()
    flops = sum(4 * heads * n * n * dim / (2 if causal else 1) for n in lens)

    def ours():
        return aotattn.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal, diagonal="top_left")

    def sdpa_masked():
        return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)

    def sdpa_flash_padded():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=causal)

    # correctness of what is timed: aotattn's packed output against SDPA's masked padded one
    ref = sdpa_masked().detach()
    out = ours().detach()
    worst = max(((out[a:e].transpose(0, 1).float() - ref[b, :, :e - a].float()).norm()
                 / ref[b, :, :e - a].float().norm()).item()
                for b, (a, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])))
    assert worst < 2e-2, f"varlen disagrees with SDPA: {worst:.2e}"
    rows = []
    for name, fn, inputs in (("aotattn varlen", ours, (q, k, v)), ("SDPA padded + mask", sdpa_masked, (qp, kp, vp)),
                             ("SDPA flash padded, no mask", sdpa_flash_padded, (qp, kp, vp))):
        with torch.no_grad():
            fwd = _time(fn)
        both = _time(_fwd_bwd(fn, inputs))
        rows.append((f"varlen {'causal' if causal else 'full'}", name, fwd, both, flops / fwd / 1e9))
    return rows


def dropout_rows() -> list[tuple]:
    batch, heads, seqlen, dim = 4, 16, 4096, 128
    q, k, v = (torch.randn(batch, heads, seqlen, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flops = 4 * batch * heads * seqlen * seqlen * dim
    rows = []
    for p in (0.0, 0.1):
        def ours(p=p):
            return aotattn.scaled_dot_product_attention(q, k, v, dropout_p=p)

        def sdpa(p=p):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p)

        for name, fn in (("aotattn", ours), ("SDPA flash", sdpa)):
            with torch.no_grad():
                fwd = _time(fn)
            both = _time(_fwd_bwd(fn, (q, k, v)))
            rows.append((f"d128 s4096 dropout {p}", name, fwd, both, flops / fwd / 1e9))
    return rows


def main() -> None:
    rows = varlen_rows(False) + varlen_rows(True) + dropout_rows()
    print(f"{'case':<24}{'implementation':<30}{'fwd ms':>9}{'fwd+bwd ms':>12}{'fwd TFLOP/s':>13}")
    for case, name, fwd, both, tflops in rows:
        print(f"{case:<24}{name:<30}{fwd:>9.3f}{both:>12.3f}{tflops:>13.0f}")


if __name__ == "__main__":
    main()
