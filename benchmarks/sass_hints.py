"""A kernel compiled as the images compile it, and again with the divisibility hints Triton's
JIT would add for a call (integers divisible by 16), compared in SASS: no GPU needed.

    python benchmarks/sass_hints.py --kernel flash.attn_bwd_ws \
        --where "dtype=bf16 BLOCK_D=128 BLOCK_DV=128 PAD_HEAD=False MASK=0 VARLEN=False DROPOUT=False BIAS=0 GROUPED=False" \
        --seqlen 16384 --hint max_seqlen_q,max_seqlen_k,num_heads_q,head_dim,head_dim_v

Prints the tuned configuration, each build's instruction count and the loops that hold wgmma
instructions (instructions, HGMMA), shortest first (benchmarks/sass_loops.py's loops). Issue 17's item 2: if the
hot loops are the same length both ways, the hints do not explain an images-vs-JIT gap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from aotattn import families, tuning
from aotattn.compiler import jobs
from aotattn.spec import parse_where

sys.path.insert(0, str(Path(__file__).parent))
from sass_loops import _cuobjdump, loops  # noqa: E402  (the SASS reader of benchmarks/sass_loops.py)


def mma_loops(sass: str) -> list[tuple[int, int]]:
    """(instructions, HGMMA) of each loop that holds a wgmma, shortest first."""
    return sorted((loop["instructions"], loop["HGMMA"]) for loop in loops(sass) if loop["HGMMA"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="flash.attn_bwd_ws")
    parser.add_argument("--where", required=True, help="the functional, every axis but its defaults")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--seqlen", type=int, default=16384, help="the cell's seqlen_q and seqlen_k")
    parser.add_argument("--hint", default="max_seqlen_q,max_seqlen_k,num_heads_q,head_dim,head_dim_v",
                        help="integer arguments the JIT would hint divisible by 16 for the call")
    args = parser.parse_args()

    spec = families.kernels()[args.kernel]
    where = parse_where(args.where, [spec])
    found = [f for f in spec.enumerate_functionals() if f.matches(where)]
    if len(found) != 1:
        parser.error(f"--where matches {len(found)} functionals of {args.kernel}: name every axis")
    functional = spec.canonical_functional(found[0])
    config = tuning.database().lookup(args.arch, spec, functional, {"seqlen_q": args.seqlen, "seqlen_k": args.seqlen})
    job = jobs.Job(args.arch, args.kernel, functional, config)
    print(f"{args.kernel} [{functional}] {config} ({job.variant})")
    fn, signature, constexprs, attrs, options = jobs._triton_inputs(job)
    names = [a.name for a in spec.arguments]
    hinted = [n.strip() for n in args.hint.split(",") if n.strip()]
    unknown = [n for n in hinted if n not in names]
    if unknown:
        parser.error(f"--hint: {', '.join(unknown)} is not an argument of {args.kernel}")
    target = GPUTarget(*_target(args.arch))
    for label, extra in (("images", []), ("JIT hints", hinted)):
        build_attrs = dict(attrs)
        build_attrs.update({(names.index(n),): [["tt.divisibility", 16]] for n in extra})
        compiled = triton.compile(jobs._source(spec.language)(fn, signature, constexprs, build_attrs),
                                  target=target, options=options)
        text = _cuobjdump(compiled.asm["cubin"], "--dump-sass")
        count = sum(1 for line in text.splitlines() if line.lstrip().startswith("/*") and ";" in line)
        print(f"{label:10s} {count} instructions; loops with wgmma (instructions, HGMMA): {mma_loops(text)[:6]}")


def _target(arch: str) -> tuple[str, int, int]:
    from aotattn import arch as arches
    return arches.arch(arch).target


if __name__ == "__main__":
    main()
