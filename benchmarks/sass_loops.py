"""What one kernel variant's sm_90 machine code does per loop, read on a machine without a GPU.

    python benchmarks/sass_loops.py attn_bwd_dq --where "dtype=bf16 BLOCK_D=256 MASK=2" \\
        --config "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=1" [--config ...] [--sass out.sass]

Compiles the variant with the build's own inputs (Triton cross-compiles for sm_90; its
package carries cuobjdump), then prints the registers, the stack (spilled registers),
the shared memory, and for every loop (the instructions between a backward branch and
its target, innermost loops listed on their own) how many instructions it has, its
wgmma instructions, exponentials, and local-memory loads and stores (spill traffic).
A loop's instruction count is per iteration per warp: fewer is less issue work, and
spills in a hot loop are what to look for first. Unnamed functional axes take the dense
fast path (bf16, D 128, unpadded, no mask, varlen, dropout or bias); a configuration may
name the kernel's tuning knobs (``OVERLAP=1 TMA=2`` for the forward). Several
``--config`` compare side by side. The figures in benchmarks/RESULTS.md (seventh
session) came from this.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from aotattn import families
from aotattn.compiler.jobs import Job, compile_job
from aotattn.spec import Config, Functional, parse_where
from aotattn.tuning.format import parse_config

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
DENSE = dict(dtype="bf16", BLOCK_D=128, BLOCK_DV=128, PAD_HEAD=False, MASK=0, VARLEN=False, DROPOUT=False, BIAS=0)
_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BACKWARD_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")
COUNTED = {"HGMMA": r"\bHGMMA\b", "EX2": r"\bMUFU\.EX2\b", "LDL": r"\bLDL\b", "STL": r"\bSTL\b",
           "BAR": r"\bBAR\.SYNC\b"}


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(CUOBJDUMP), flag, str(path)], check=True, capture_output=True, text=True).stdout


def loops(sass: str) -> list[dict]:
    """Every loop of a SASS listing: ``{"start", "end", "instructions", HGMMA, EX2, LDL, STL, BAR}``.

    A loop is a backward branch before the kernel's first unconditional ``EXIT`` and its
    target: the code placed after it (barrier-wait retries that jump back into the body,
    the final self-branch) is not a loop of the kernel's."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]
    exit_at = next((a for a, t in instructions if re.fullmatch(r"EXIT", t)), None)
    found = []
    for address, text in instructions:
        if exit_at is not None and address > exit_at:
            break
        branch = _BACKWARD_BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [t for a, t in instructions if start <= a <= address]
            found.append({"start": start, "end": address, "instructions": len(body),
                          **{name: sum(1 for t in body if re.search(p, t)) for name, p in COUNTED.items()}})
    return found


def report(table: str, functional: Functional, config: Config) -> tuple[str, dict[str, str], list[dict]]:
    """(SASS, resource usage, loops) of one variant compiled for sm_90."""
    entry, cubin = compile_job(Job("sm_90", table, functional, config))
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    fields["dynamic shared"] = str(entry.shared)
    sass = _cuobjdump(cubin, "--dump-sass")
    return sass, fields, loops(sass)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="a flash kernel (attn_fwd, attn_bwd_dq, attn_bwd_dkdv, attn_bwd_fused) or family.kernel")
    ap.add_argument("--where", default="", help='functional axes, e.g. "dtype=fp16 BLOCK_D=64 MASK=2"')
    ap.add_argument("--config", action="append", required=True,
                    help='tuning knobs, e.g. "BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3 OVERLAP=1" (repeatable)')
    ap.add_argument("--sass", help="write the (last) variant's SASS here")
    args = ap.parse_args(argv)
    table = args.kernel if "." in args.kernel else f"flash.{args.kernel}"
    spec = families.kernels()[table]
    choices = dict(spec.functionals)
    named = {axis: next(c for c in choices[axis] if str(c) == value) for axis, value in parse_where(args.where, [spec]).items()}
    axes = {**{k: v for k, v in DENSE.items() if k in spec.axes}, **named}
    if "ATOMIC_DQ" in spec.axes:
        axes.setdefault("ATOMIC_DQ", True)
    functional = Functional.of(axes)
    print(f"{table} [{functional}] on sm_90")
    for text in args.config:
        config = parse_config(spec, text, "--config")  # every knob named once, each a value of the space
        sass, fields, found = report(table, functional, config)
        print(f"  {config}: registers {fields.get('REG')}, stack {fields.get('STACK')} B, "
              f"shared {fields['dynamic shared']} B, {len(found)} loop(s)")
        for loop in found:
            counts = ", ".join(f"{name} {loop[name]}" for name in COUNTED)
            print(f"    loop 0x{loop['start']:x}-0x{loop['end']:x}: {loop['instructions']} instructions; {counts}")
        if args.sass:
            Path(args.sass).write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
