"""Does a kernel refactor change the generated code? Compile the same variants for sm_90
from the working tree and from a git revision, and compare their PTX.

    python benchmarks/compare_ptx.py --rev HEAD~1 [--arch sm_90]

Runs on a machine without a GPU (Triton cross-compiles). Comments, debug locations and
the kernel's name are dropped before comparing, so two sources that Triton lowers to the
same instructions compare equal: such a change cannot change speed or numbers, and
needs no new GPU measurement. Prints one line per variant and exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]

# (kernel, functional, configuration): the dense fast paths and the feature-heavy variants
VARIANTS = [
    ("attn_fwd", dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=False, MASK=2, VARLEN=False, DROPOUT=False,
                      BIAS=0), dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)),
    ("attn_fwd", dict(dtype="fp16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=True, MASK=0, VARLEN=True, DROPOUT=True,
                      BIAS=0), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)),
    ("attn_bwd_dkdv", dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=False, MASK=2, VARLEN=False,
                           DROPOUT=False, BIAS=0), dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)),
    ("attn_bwd_dq", dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=False, MASK=0, VARLEN=False,
                         DROPOUT=False, BIAS=2), dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)),
    ("attn_bwd_fused", dict(dtype="fp16", BLOCK_D=64, BLOCK_DV=64, PAD_HEAD=False, MASK=1, VARLEN=False,
                            DROPOUT=True, BIAS=0, ATOMIC_DQ=True), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4,
                                                                        num_stages=2)),
    ("attn_bwd_fused", dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=False, MASK=2, VARLEN=False,
                            DROPOUT=False, BIAS=0, ATOMIC_DQ=False), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4,
                                                                          num_stages=2)),
    ("attn_bwd_preprocess", dict(dtype="bf16", BLOCK_DV=128, PAD_HEAD=False, VARLEN=False),
     dict(BLOCK_M=64, num_warps=4, num_stages=1)),
    ("dropout_mask", dict(), dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)),
]

# Run inside the tree being compiled (its own aotattn on sys.path): prints {name: normalized ptx}.
CHILD = r"""
import json, re, sys
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from aotattn.families.flash import rules
from aotattn.spec import Config, Functional

arch, variants = sys.argv[1], json.loads(sys.argv[2])
out = {}
for i, (name, functional, config) in enumerate(variants):
    spec = rules.KERNELS[name]
    f, c = Functional.of(functional), Config.of(config)
    fn = getattr(__import__(spec.module, fromlist=[spec.function]), spec.function)
    signature = spec.signature(f)
    constexprs = spec.constexprs(f, c)
    signature.update({k: "constexpr" for k in constexprs})
    attrs = {(j,): [["tt.divisibility", 16]] for j, a in enumerate(spec.arguments)
             if a.aligned and spec.variant(f) == "aligned"}
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                            target=GPUTarget("cuda", int(arch[3:]), 32),
                            options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    ptx = kernel.asm["ptx"]
    ptx = re.sub(r"^\s*(//.*|\.loc\s.*|\.file\s.*|\.section.*)$", "", ptx, flags=re.M)
    ptx = ptx.replace(kernel.metadata.name, "KERNEL")
    out[f"{i} {name}"] = "\n".join(line for line in ptx.splitlines() if line.strip())
import aotattn
print(json.dumps({"ptx": out, "package": aotattn.__file__}))
"""


def compile_tree(tree: Path, arch: str) -> dict[str, str]:
    # without line info: no debug sections, whose file paths and line numbers differ
    # between any two trees; what is left is the code
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="ptx-cache-"),
               TRITON_DISABLE_LINE_INFO="1")
    run = subprocess.run([sys.executable, "-c", CHILD, arch, json.dumps(VARIANTS)], cwd=tree, env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"compiling in {tree} failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # an installed (editable) aotattn must not shadow the tree being compiled
    if not Path(result["package"]).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"compiled {result['package']}, not the tree {tree}")
    return result["ptx"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="git revision to compare the working tree with")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--dump", default=None, help="write both trees' PTX into this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ptx-rev-") as old_tree:
        subprocess.run(["git", "worktree", "add", "--detach", "-f", old_tree, args.rev], cwd=PROJECT, check=True,
                       capture_output=True)
        try:
            old = compile_tree(Path(old_tree), args.arch)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=PROJECT, capture_output=True)
    new = compile_tree(PROJECT, args.arch)
    if args.dump:
        folder = Path(args.dump)
        folder.mkdir(parents=True, exist_ok=True)
        for tag, ptx in (("old", old), ("new", new)):
            for name, text in ptx.items():
                (folder / f"{name.replace(' ', '_')}.{tag}.ptx").write_text(text)
    differ = 0
    for name in new:
        same = old.get(name) == new[name]
        differ += not same
        lines = len(new[name].splitlines())
        print(f"{name:24s} {'identical' if same else 'DIFFERENT'} ({lines} PTX lines)")
    print(f"{len(new) - differ} of {len(new)} variants compile to identical PTX ({args.arch}, rev {args.rev})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
