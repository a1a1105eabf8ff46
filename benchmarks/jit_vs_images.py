"""Which binaries a call runs from images and through the JIT, side by side (issue 17, item 2):
one forward and backward per shape in the mode AOTATTN_MODE names, then each kernel that ran
(its image entry, or the JIT's specialization) and its cubin written under --out, so the two
modes' SASS can be compared on any machine (benchmarks/sass_loops.py).

    AOTATTN_MODE=aot AOTATTN_IMAGES=/tmp/aot-images python benchmarks/jit_vs_images.py --out $OUT/img
    AOTATTN_MODE=jit python benchmarks/jit_vs_images.py --out $OUT/jit

--time also times the backward as bench_attention does and lists each kernel's own GPU time
(torch.profiler), which tells a slower kernel from time spent between kernels.

Why: the forty-seventh session's three alternating rounds (H100) put the images' ws backward
4% (s4096 full) to 9-13% (s16384 full) behind the JIT's, every round, while the same kernel
compiled here on CPU both ways had equal hot loops. Its first run (H100, d128 s16384 and s4096
full) found the same configurations, warps, shared memory and scratch both ways, and the ws
backward's SASS identical instruction for instruction (the JIT's cubin adds line tables): the
gap is not in the code. What differs is the launch: Triton's loader also sets
cuFuncSetCacheConfig(PREFER_SHARED) on kernels over 48 KB (--prefer-shared does it for images)
and launches with cuLaunchKernelEx.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import aotattn
from aotattn import families
from aotattn.runtime import image_loader, launcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="1x16384x16x128,4x4096x16x128", help="BxSxHxD,...")
    parser.add_argument("--time", action="store_true", help="also time the backward as bench_attention does")
    parser.add_argument("--prefer-shared", action="store_true",
                        help="images: cuFuncSetCacheConfig(PREFER_SHARED) after each load, as Triton's loader does")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mode = os.environ.get("AOTATTN_MODE", "auto")
    records: list[dict] = []
    if mode != "jit":  # every image loaded: its entry and its cubin
        original_init = image_loader.LoadedKernel.__init__

        def recording_init(self, entry, binary, signature, device_index=0):
            original_init(self, entry, binary, signature, device_index)
            if args.prefer_shared:
                import ctypes
                assert ctypes.CDLL("libcuda.so.1").cuFuncSetCacheConfig(ctypes.c_void_p(self.function), 1) == 0
            name = f"img-{len(records)}-{entry.symbol}"
            (args.out / f"{name}.cubin").write_bytes(binary)
            records.append({"file": f"{name}.cubin", "key": entry.key, "variant": entry.variant,
                            "num_warps": entry.num_warps, "shared": entry.shared,
                            "global_scratch": entry.global_scratch_size})

        image_loader.LoadedKernel.__init__ = recording_init
    for shape in args.shapes.split(","):
        b, s, h, d = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = aotattn.flash_attn_func(q, k, v)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        if args.time:  # (B, H, S, D) views through the SDPA-style call, as bench_attention times them
            from triton.testing import do_bench
            qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            out = aotattn.scaled_dot_product_attention(qt, kt, vt)
            dout = torch.randn_like(out)
            ms = do_bench(lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True), warmup=50, rep=200,
                          return_mode="median")
            print(f"{mode} prefer_shared={args.prefer_shared} {shape} backward {ms:.4f} ms", flush=True)
            # each kernel's own GPU time (the profiler's CUDA activity): equal kernel times with
            # unequal do_bench times put the gap outside the kernels (host work, idle gaps)
            backward = lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True)  # noqa: E731
            for _ in range(5):
                backward()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    backward()
                torch.cuda.synchronize()
            for event in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:6]:
                print(f"  {event.key[:60]:60s} {event.count:4d} calls {event.device_time_total / event.count / 1e3:8.4f} ms"
                      " each", flush=True)
    if mode == "jit":  # every kernel the JIT compiled: its specialization and its cubin
        for table, spec in families.kernels().items():
            for cache in launcher.jit_function(spec).device_caches.values():
                for compiled in cache[0].values():
                    md = compiled.metadata
                    try:
                        regs, spills = compiled.n_regs, compiled.n_spills
                    except Exception:  # noqa: BLE001  (a kernel whose handles were never loaded)
                        regs = spills = None
                    name = f"jit-{len(records)}-{md.name}"
                    (args.out / f"{name}.cubin").write_bytes(compiled.asm["cubin"])
                    records.append({"file": f"{name}.cubin", "table": table, "num_warps": md.num_warps,
                                    "shared": md.shared, "n_regs": regs, "n_spills": spills,
                                    "global_scratch": getattr(md, "global_scratch_size", None),
                                    "constants": str(getattr(compiled.src, "constants", ""))[:600],
                                    "attrs": str(getattr(compiled.src, "attrs", ""))[:600]})
    (args.out / "kernels.json").write_text(json.dumps(records, indent=1))
    for record in records:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
