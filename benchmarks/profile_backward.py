"""Per-kernel device time of one pass: aotattn beside SDPA's flash and cuDNN backends.

    python benchmarks/profile_backward.py [--shapes d64-q512-k512-full,d128-g8-q16384-k16384-causal,...]
                                          [--pass bwd|fwd]

A shape ``d<D>[-g<G>]-q<Sq>-k<Sk>-<full|causal>`` (as ``bench_ws_backward.py`` reads it;
the older ``d<D>-s<S>-<mask>`` still works) runs at hidden size 2048 (H = 2048 / D query
heads, H / G key heads) and 16k query tokens (B = 16384 / Sq), bf16, inputs in flash-attn's
layout (SDPA gets views of them, as perfmon passes them, so it copies no gradient).
Prints, per shape, each kernel's time in µs per pass (``torch.profiler``, 10 passes after
3 warm-up ones): where aotattn loses or wins against the peers' kernels. Set
``AOTATTN_MODE=aot`` and ``AOTATTN_IMAGES`` to profile the images. SDPA's causal mask is
top-left: the peers are skipped for causal shapes with Sq != Sk.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotattn
from bench_ws_backward import parse

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


def shape_of(text: str) -> tuple[int, int, int, int, bool]:
    """(D, G, Sq, Sk, causal) of either shape syntax."""
    parts = text.split("-")
    if len(parts) == 3 and parts[1].startswith("s"):  # d<D>-s<S>-<mask>
        text = f"{parts[0]}-q{parts[1][1:]}-k{parts[1][1:]}-{parts[2]}"
    return parse(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--pass", dest="which", choices=("bwd", "fwd"), default="bwd")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        head_dim, group, sq, sk, causal = shape_of(shape)
        batch, heads = max(1, 16384 // sq), 2048 // head_dim
        q = torch.randn(batch, sq, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(batch, sk, heads // group, head_dim, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        dout = torch.randn_like(q)
        gqa = {"enable_gqa": True} if group > 1 else {}
        runs = {}

        def ours():
            return aotattn.flash_attn_func(q, k, v, causal=causal)

        providers = [("aotattn", ours)]
        if not (causal and sq != sk):
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def peer(backend=backend):
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                            **gqa).transpose(1, 2)
                providers.append((name, peer))
        for name, fn in providers:
            try:
                if args.which == "fwd":
                    with torch.no_grad():
                        runs[name] = kernel_times(fn)
                else:
                    out = fn()
                    runs[name] = kernel_times(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                    del out
            except RuntimeError as e:  # a peer refusing the shape (memory, head dim)
                print(f"    {name}: {str(e).splitlines()[0][:100]}")
        print(f"{shape} {args.which} (B{batch} H{heads}/{heads // group}): "
              + ", ".join(f"{who} {sum(t.values()):8.1f} us" for who, t in runs.items()))
        for who, times in runs.items():
            for name, us in times.most_common():
                print(f"    {who:8} {us:8.1f}  {name}")
        runs.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
