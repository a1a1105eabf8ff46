"""Short causal forwards (forty-second session): checks that every output row is written and
right (NaN-filled outputs, float32 reference), then times causal against full for aotattn
and SDPA's cuDNN and flash backends, in one process (JIT; medians of 30 calls after 3 warm-up
calls, timed as perfmon times them: :func:`timed`). Run once per kernel variant
(benchmarks/s42_session.sh diag).

perfmon on an H100 (L2 flushed), d128 s1024 B16 H16: aotattn causal 0.2658 ms, full 0.2634 ms;
cuDNN causal 0.1595, full 0.2281.

    python benchmarks/bench_short_causal.py [--no-check] [--shapes 16x1024x16x128,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotattn

sys.path.insert(0, str(Path(__file__).parent))
from bench_ws_backward import timed as perfmon_timed  # noqa: E402  (the L2 flushed, the host's launch work hidden)


def timed(fn, reps=30):
    """Median ms, timed as perfmon times calls (bench_ws_backward.timed). Until the
    forty-seventh session this bench synchronized after every call and recorded its start
    event on an idle GPU, so each figure also counted the host work before the launch,
    larger through the JIT than SDPA's. It put d64 s512 causal B16 H32 at 0.1595 ms (0.83x
    SDPA-flash), where the tuner's timing of the same tile at the same size gave 0.0942 ms
    (H100, forty-seventh session)."""
    return perfmon_timed(fn, reps)


def check(b, s, hq, hk, d, **kw):
    torch.manual_seed(0)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(True)  # torch.empty fills NaN: an unwritten row fails
    out = aotattn.flash_attn_func(q, k, v, **kw)
    torch.use_deterministic_algorithms(False)
    left, right = kw.get("window_size", (-1, -1))
    right = 0 if kw.get("causal") else right
    i, j = torch.arange(s, device="cuda")[:, None], torch.arange(s, device="cuda")  # Sq = Sk: no diagonal shift
    seen = ((left < 0) | (j >= i - left)) & ((right < 0) | (j <= i + right))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                         v.transpose(1, 2).float(), attn_mask=seen,
                                         enable_gqa=hq != hk).transpose(1, 2)
    err = (out.float() - ref).abs().max().item()
    print(f"check B{b} S{s} Hq{hq} Hk{hk} D{d} {kw}: max |err| {err:.2e}, NaN {out.isnan().any().item()}", flush=True)
    assert err < 2e-2 and not out.isnan().any()


def bench(b, s, h, d):
    """Causal and full, aotattn and the peers; the line ends with aotattn's causal/full ratio."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    row, ours_ms = [f"B{b} H{h} S{s} D{d}"], []
    for causal in (False, True):
        ours = timed(lambda: aotattn.flash_attn_func(q, k, v, causal=causal))
        ours_ms.append(ours)
        peers = []
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend):
                peers.append((name, timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))))
        row.append(f"{'causal' if causal else 'full'}: aotattn {ours:.4f} ms, "
                   + ", ".join(f"{n} {t:.4f} ({t / ours:.2f}x)" for n, t in peers))
    row.append(f"aotattn causal/full {ours_ms[1] / ours_ms[0]:.2f}")
    print(" | ".join(row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-check", action="store_true", help="timing only (a diagnostic patch gives wrong outputs)")
    parser.add_argument("--shapes", default="16x1024x16x128,16x1024x32x64,8x2048x16x128,4x4096x16x128",
                        help="BxSxHxD,... timed causal and full")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    if not args.no_check:
        check(16, 1024, 16, 16, 128, causal=True)
        check(3, 1000, 12, 4, 128, causal=True)
        check(3, 512, 11, 11, 64, causal=True)
        check(4, 1024, 12, 12, 64, window_size=(100, 20))
        check(2, 700, 8, 8, 128, window_size=(30, 5))
    for shape in args.shapes.split(","):
        bench(*(int(x) for x in shape.split("x")))


if __name__ == "__main__":
    main()
