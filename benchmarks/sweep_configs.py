"""Time each attention kernel under candidate configurations at a few shapes (GPU).

A quick sweep to seed the hand-picked configurations before the tuner exists. Every
candidate's result is checked against SDPA's flash backend before it is timed; a
candidate that fails to launch (shared memory) or disagrees is reported, not timed.

    python benchmarks/sweep_configs.py
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from aotattn.families.flash import planning
from aotattn.families.flash.checks import check_flash
from aotattn.runtime import launch
from aotattn.spec import Config

SHAPES = [(64, 4096, False), (128, 4096, False)]  # head_dim, seqlen, causal
CANDIDATES = {  # BLOCK_M, BLOCK_N, num_warps, num_stages
    "attn_fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    "attn_bwd_dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (16, 128, 8, 2), (32, 64, 8, 2), (32, 128, 8, 3)],
    "attn_bwd_dq": [(128, 64, 8, 2), (64, 64, 4, 2), (128, 128, 8, 2), (64, 128, 8, 2)],
    "attn_bwd_fused": [(16, 128, 8, 2), (32, 128, 8, 2), (32, 64, 8, 2), (64, 128, 8, 1)],
}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    best = []
    print(f"{'shape':<20}{'kernel':<16}{'BM':>5}{'BN':>5}{'w':>3}{'s':>3}{'TFLOP/s*':>10}{'ms':>9}")
    for head_dim, seqlen, causal in SHAPES:
        batch, heads = 16384 // seqlen, 2048 // head_dim
        tag = f"d{head_dim} s{seqlen} {'causal' if causal else 'full'}"
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        qr, kr, vr = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
            ref_grads = [g.transpose(1, 2) for g in torch.autograd.grad(ref, (qr, kr, vr), dout.transpose(1, 2))]
        ref = ref.transpose(1, 2)
        p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal, window_size=(-1, -1),
                        diagonal="bottom_right")
        call = planning.Call(p)
        out = torch.empty_like(q)
        lse = planning.run_forward(call, q, k, v, out)
        flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        for kernel, candidates in CANDIDATES.items():
            rows = []
            for bm, bn, w, s in candidates:
                config = Config.of(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                dq, dk, dv = torch.zeros(q.shape, device="cuda"), torch.empty_like(k), torch.empty_like(v)
                delta = torch.empty(batch, heads, seqlen, device="cuda")
                if kernel == "attn_fwd":
                    o2 = torch.empty_like(q)
                    plan = planning.forward_plan(call, q, k, v, o2, torch.empty_like(lse), config)
                    check = lambda: [_rel(o2, ref)]  # noqa: E731
                else:
                    backend, det = ("fused", False) if kernel == "attn_bwd_fused" else ("split", True)
                    if kernel != "attn_bwd_fused":
                        dq = torch.empty_like(q)
                    plans = planning.backward_plans(call, dout, q, k, v, out, lse, delta, dq, dk, dv, None, backend,
                                               det, {kernel: config})
                    launch(plans[0])  # delta
                    plan = next(pl for pl in plans if pl.kernel.name == kernel)
                    others = [pl for pl in plans[1:] if pl is not plan]
                    scale = planning.accumulated_dq_scale(call, backend, det)
                    check = lambda: [_rel(g, r) for g, r, name in  # noqa: E731
                                     zip((planning.finish_dq(dq, q, scale), dk, dv), ref_grads, ("dq", "dk", "dv"))
                                     if kernel != "attn_bwd_dq" or name == "dq"]
                try:
                    launch(plan)
                    if kernel != "attn_fwd":
                        for other in others:
                            launch(other)
                    torch.cuda.synchronize()
                except Exception as exc:
                    print(f"  {tag} {kernel} {config}: {type(exc).__name__}: {str(exc)[:70]}")
                    continue
                errs = check()
                if not max(errs) < 2e-2:
                    print(f"  {tag} {kernel} {config}: WRONG {errs}")
                    continue
                ms = do_bench(lambda: launch(plan), warmup=25, rep=100, return_mode="median")
                rows.append((flops / ms / 1e9, ms, (bm, bn, w, s)))
            lines = [f"{tag:<20}{kernel:<16}{bm:>5}{bn:>5}{w:>3}{s:>3}{tf:>10.0f}{ms:>9.3f}"
                     for tf, ms, (bm, bn, w, s) in sorted(rows, reverse=True)]
            print("\n".join(lines), flush=True)
            best += lines[:2]
    print("* forward FLOPs over the kernel's time, for comparing configurations of one kernel")
    print("best per shape")
    print("\n".join(best))


if __name__ == "__main__":
    main()
