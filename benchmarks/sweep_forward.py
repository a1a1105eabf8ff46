"""Time the forward kernel under several configurations at a few shapes (GPU).

A quick sweep to seed the hand-picked configurations before the tuner exists. Each
configuration's output is checked against SDPA's before it is timed.

    python benchmarks/sweep_forward.py
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from aotattn.families.flash.checks import check_flash
from aotattn.families.flash.ops import attention_forward
from aotattn.spec import Config

SHAPES = [  # (head_dim, seqlen, causal, dtype)
    (64, 4096, False, torch.bfloat16),
    (128, 4096, False, torch.bfloat16),
    (128, 4096, True, torch.bfloat16),
    (256, 4096, False, torch.bfloat16),
]
CANDIDATES = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4),
    (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
    (128, 32, 4, 3), (64, 32, 4, 3),
]


def main() -> None:
    print(f"{'shape':<28}{'BM':>5}{'BN':>5}{'w':>3}{'s':>3}{'TFLOP/s':>10}{'ms':>9}")
    best = []
    for head_dim, seqlen, causal, dtype in SHAPES:
        batch, heads = 16384 // seqlen, 2048 // head_dim
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
        p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal, window_size=(-1, -1),
                        diagonal="bottom_right")
        flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        results = []
        for bm, bn, w, s in CANDIDATES:
            config = Config.of(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
            out = torch.empty_like(q)
            try:
                attention_forward(q, k, v, out, p, config)
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"  {config}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < 1e-2:
                print(f"  {config}: WRONG (relative difference {err:.2e})")
                continue
            ms = do_bench(lambda: attention_forward(q, k, v, out, p, config), warmup=25, rep=100,
                          return_mode="median")
            results.append((flops / ms / 1e9, ms, (bm, bn, w, s)))
        tag = f"d{head_dim} s{seqlen} {'causal' if causal else 'full'}"
        lines = [f"{tag:<28}{bm:>5}{bn:>5}{w:>3}{s:>3}{tflops:>10.0f}{ms:>9.3f}"
                 for tflops, ms, (bm, bn, w, s) in sorted(results, reverse=True)]
        print("\n".join(lines), flush=True)
        best += lines[:3]
    print("best per shape")
    print("\n".join(best))


if __name__ == "__main__":
    main()
