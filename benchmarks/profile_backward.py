"""Per-kernel device time of one backward pass: aotattn beside SDPA's flash backend.

    python benchmarks/profile_backward.py [--shapes d64-s512-full,d128-s1024-causal,...]

Each shape ``d<D>-s<S>-<full|causal>`` runs at hidden size 2048 and 16k tokens per batch
(H = 2048 / D, B = 16384 / S), bf16, inputs in flash-attn's layout (SDPA gets views of
them, as perfmon passes them, so it copies no gradient). Prints, per shape, each
kernel's time in µs per backward (``torch.profiler``, 10 backward passes after 3 warm-up
ones): where aotattn's backward loses or wins against FlashAttention-2's kernels. Set
``AOTATTN_MODE=aot`` and ``AOTATTN_IMAGES`` to profile the images.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotattn

DEFAULT = "d64-s512-full,d64-s512-causal,d128-s512-full,d128-s1024-causal,d256-s512-full,d256-s1024-causal," \
          "d128-s4096-full"


def kernel_times(fn, reps: int = 10) -> collections.Counter:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
            times[event.key[:70]] += event.self_device_time_total / reps
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        d, s, mask = shape.split("-")
        head_dim, seqlen, causal = int(d[1:]), int(s[1:]), mask == "causal"
        batch, heads = 16384 // seqlen, 2048 // head_dim
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        out = aotattn.flash_attn_func(q, k, v, causal=causal)
        ours = kernel_times(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                   v.transpose(1, 2), is_causal=causal)
        theirs = kernel_times(lambda: torch.autograd.grad(ref, (q, k, v), dout.transpose(1, 2), retain_graph=True))
        print(f"{shape} (B{batch} H{heads}): aotattn {sum(ours.values()):8.1f} us, "
              f"sdpa-flash {sum(theirs.values()):8.1f} us")
        for who, times in (("aotattn", ours), ("flash", theirs)):
            for name, us in times.most_common():
                print(f"    {who:8} {us:8.1f}  {name}")


if __name__ == "__main__":
    main()
