"""Which compile-time assumption makes the JIT's dK/dV kernel faster than the images'?

    python benchmarks/bench_variant_hints.py

On the H200 the backward from images ran 9-10% slower than through Triton's JIT
(benchmarks/RESULTS.md). The JIT specializes on every argument it sees: pointers and
integers divisible by 16, integers equal to 1 as constants; the images' *aligned* variant
assumes only the tile pointers and tile strides divisible by 16. This compiles
``attn_bwd_dkdv`` for one shape (bf16, d128, s4096, split backward) under four sets of
assumptions, loads each through aotattn's driver-level runtime, checks its dK/dV against
the JIT's and times it on the same arguments.
"""

from __future__ import annotations

import argparse
import importlib
import os

os.environ.setdefault("AOTATTN_MODE", "jit")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from aotattn.families.flash import ops, planning  # noqa: E402
from aotattn.families.flash.checks import check_flash  # noqa: E402
from aotattn.runtime.image_loader import LoadedKernel, _raw_stream  # noqa: E402
from aotattn.runtime.images import Entry  # noqa: E402
from aotattn.runtime.launcher import launch  # noqa: E402

LSE_AND_SEQLEN = {"Lse", "Delta", "stride_lz", "stride_lh", "max_seqlen_q", "max_seqlen_k"}
JIT = "jit"  # the divisibility and constants Triton's JIT itself derives from the arguments
VARIANTS = {  # name: (arguments assumed divisible by 16 beyond the aligned ones, arguments made constant)
    "images (aligned variant)": (set(), set()),
    "+ LSE/delta pointers and strides, seqlens % 16": (LSE_AND_SEQLEN, set()),
    "+ group_size == 1 constant": (set(), {"group_size"}),
    "both": (LSE_AND_SEQLEN, {"group_size"}),
    "the JIT's own specialization of these arguments": (JIT, JIT),
}


def jit_specialization(names: list[str], values: list) -> tuple[set[str], set[str]]:
    """What Triton's JIT would specialize on for these values: (divisible by 16, constant)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    divisible, constant = set(), set()
    for name, value in zip(names, values):
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
        if kind == "constexpr":
            constant.add(name)
        elif key == "D":
            divisible.add(name)
    return divisible, constant


def compile_variant(plan, extra, constants, values: list):
    spec = plan.kernel
    fn = getattr(importlib.import_module(spec.module), spec.function)
    signature = spec.signature(plan.functional)
    constexprs = spec.constexprs(plan.functional, plan.config)
    names = [a.name for a in spec.arguments]
    if extra == JIT:
        extra, constants = jit_specialization(names, values)
    kept = list(range(len(names)))
    for name in constants:
        constexprs[name] = values[names.index(name)]
        kept.remove(names.index(name))
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(spec.arguments)
             if (a.aligned or a.name in extra) and a.name not in constants}
    for i in attrs:  # the assumption must hold for these arguments
        value = values[i[0]]
        assert (value.data_ptr() if isinstance(value, torch.Tensor) else value) % 16 == 0, names[i[0]]
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": plan.config.num_warps, "num_stages": plan.config.num_stages})
    md = compiled.metadata
    entry = Entry(key="experiment", functional=plan.functional.as_dict(), config=plan.config.as_dict(),
                  variant="experiment", symbol=md.name, shared=md.shared, num_warps=md.num_warps, warp_size=32,
                  global_scratch_size=getattr(md, "global_scratch_size", 0),
                  global_scratch_align=getattr(md, "global_scratch_align", 1),
                  profile_scratch_size=getattr(md, "profile_scratch_size", 0), binary="cubin", file="x.cubin", blob="")
    types = list(signature.values())
    kernel = LoadedKernel(entry, compiled.asm["cubin"], [t for t in types if t != "constexpr"], 0)
    return kernel, [values[i] for i in kept], compiled.asm["ptx"].count("cp.async.ca.shared.global")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = ops.flash_attn_func(q, k, v, causal=args.causal, return_lse=True)
    dout = torch.randn_like(out)
    p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=args.causal, window_size=(-1, -1),
                    diagonal="bottom_right")
    c = planning.new_call(p, q, k, v)
    delta, dq = torch.empty_like(lse), torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    plans = planning.backward_plans(c, dout, q, k, v, out, lse, delta, dq, dk, dv, None, "split", False)
    preprocess, dkdv = plans[0], plans[1]
    launch(preprocess)
    launch(dkdv)
    torch.cuda.synchronize()
    ref_dk, ref_dv = dk.clone(), dv.clone()
    flops = 2.0 * 4 * args.batch * args.heads * args.seqlen * args.seqlen * 128 * (0.5 if args.causal else 1.0)
    print(f"attn_bwd_dkdv, B{args.batch} S{args.seqlen} H{args.heads} D128 bf16 {'causal' if args.causal else 'full'}, "
          f"[{dkdv.functional}] {dkdv.config}")
    jit_ms = do_bench(lambda: launch(dkdv), warmup=50, rep=300)
    print(f"  {'Triton JIT':<50} {jit_ms:.3f} ms  {flops / jit_ms / 1e9:.0f} TFLOP/s")
    values = list(dkdv.args)
    rows = []
    for name, (extra, constants) in VARIANTS.items():
        kernel, kept, scalar_copies = compile_variant(dkdv, extra, constants, values)
        raw = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in kept]
        dk.zero_()
        dv.zero_()
        kernel.launch(dkdv.grid, raw, _raw_stream(0), q.device)
        torch.cuda.synchronize()
        same = torch.equal(dk, ref_dk) and torch.equal(dv, ref_dv)
        ms = do_bench(lambda: kernel.launch(dkdv.grid, raw, _raw_stream(0), q.device), warmup=50, rep=300)
        rows.append((name, ms))
        print(f"  {name:<50} {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s  vs JIT {ms / jit_ms:.3f}  "
              f"4-byte cp.async in PTX: {scalar_copies}  dK/dV bitwise equal to the JIT's: {same}")


if __name__ == "__main__":
    main()
