"""Attention speed on the GPU: aotattn against PyTorch SDPA's flash and cuDNN backends.

Measured side by side in one run, bf16, median of ``triton.testing.do_bench``. FLOPs:
forward 4*B*H*Sq*Sk*D (halved when causal), backward 2.5x the forward. A figure is only
reported when aotattn's output (and gradients) at that shape match SDPA's.

    python benchmarks/bench_attention.py --passes fwd,bwd --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import asdict, dataclass

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import aotattn


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    def flops(self, direction: str) -> float:
        fwd = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        fwd = fwd / 2 if self.causal else fwd
        return fwd * (2.5 if direction == "bwd" else 1.0)


def grid_shape(head_dim: int, seqlen: int, causal: bool) -> Shape:
    """Hidden size 2048 (H = 2048 / D) and 16k tokens per batch (B = 16384 / S)."""
    tag = "causal" if causal else "full"
    return Shape(f"d{head_dim} s{seqlen} {tag}", 16384 // seqlen, 2048 // head_dim, seqlen, head_dim, causal)


SHAPES = [
    grid_shape(64, 1024, False),
    grid_shape(64, 4096, False),
    grid_shape(64, 16384, True),
    grid_shape(128, 1024, False),
    grid_shape(128, 4096, False),
    grid_shape(128, 4096, True),
    grid_shape(128, 16384, False),
    grid_shape(256, 4096, False),
    Shape("gpt2", 72, 12, 1024, 64, True),
    Shape("video DiT", 1, 32, 15300, 128, False),
]

PROVIDERS = {
    "aotattn": None,  # the tuning database's backend (the ws kernels on Hopper where it chose them)
    "aotattn-fused": "fused",
    "aotattn-split": "split",
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
}


def _attention(provider: str, q, k, v, causal: bool):
    """q, k, v in (B, H, S, D)."""
    if provider.startswith("aotattn"):
        return aotattn.scaled_dot_product_attention(q, k, v, is_causal=causal, backend=PROVIDERS[provider])
    with sdpa_kernel(PROVIDERS[provider]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(shape: Shape, passes: list[str], providers: list[str]) -> list[dict]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.seqlen, shape.head_dim, device="cuda",
                           dtype=torch.bfloat16, requires_grad="bwd" in passes) for _ in range(3))
    dout = torch.randn_like(q)
    rows = []
    baseline = None
    for provider in providers:
        try:
            out = _attention(provider, q, k, v, shape.causal)
            grads = torch.autograd.grad(out, (q, k, v), dout) if "bwd" in passes else ()
        except Exception as exc:  # a peer without a kernel for this shape
            rows.append(dict(shape=shape.name, provider=provider, error=f"{type(exc).__name__}: {exc}"[:120]))
            continue
        if baseline is None:
            baseline = (provider, out.detach(), grads)
        errs = [_rel(out, baseline[1])] + [_rel(g, gb) for g, gb in zip(grads, baseline[2])]
        row = dict(shape=shape.name, provider=provider, max_rel_diff=max(errs), compared_with=baseline[0])
        if max(errs) > 2e-2:
            row["error"] = f"disagrees with {baseline[0]}: relative difference {max(errs):.2e}"
            rows.append(row)
            continue
        for direction in passes:
            if direction == "fwd":
                fn = lambda: _attention(provider, q, k, v, shape.causal)  # noqa: E731
                with torch.no_grad():
                    ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
            else:
                out = _attention(provider, q, k, v, shape.causal)
                fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
            row[f"{direction}_ms"] = ms
            row[f"{direction}_tflops"] = shape.flops(direction) / ms / 1e9
        rows.append(row)
    return rows


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, cudnn=torch.backends.cudnn.version(), command=" ".join(sys.argv))


def print_table(rows: list[dict], passes: list[str]) -> None:
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    by = {(r["shape"], r["provider"]): r for r in rows}
    for direction in passes:
        print(f"\n{direction} TFLOP/s (ms), bf16")
        header = f"{'shape':<20}" + "".join(f"{p:>22}" for p in providers) + f"{'aot/flash':>10}{'aot/cudnn':>10}"
        print("(aot: the faster aotattn backend)")
        print(header)
        for shape in shapes:
            line = f"{shape:<20}"
            for p in providers:
                r = by.get((shape, p), {})
                if f"{direction}_tflops" in r:
                    line += f"{r[direction + '_tflops']:>12.0f} ({r[direction + '_ms']:7.3f})"
                else:
                    line += f"{'n/a':>22}"
            ours = [by.get((shape, p), {}).get(f"{direction}_tflops") for p in providers if p.startswith("aotattn")]
            for peer in ("sdpa-flash", "sdpa-cudnn"):
                a = max((t for t in ours if t), default=None)
                b = by.get((shape, peer), {}).get(f"{direction}_tflops")
                line += f"{a / b:>10.2f}" if a and b else f"{'':>10}"
            print(line)
    for r in rows:
        if "error" in r:
            print(f"  {r['shape']} / {r['provider']}: {r['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", default="fwd", help="comma-separated: fwd, bwd")
    parser.add_argument("--providers", default=",".join(p for p in PROVIDERS if p != "aotattn"))
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--json", default=None, help="write environment and rows here")
    args = parser.parse_args()
    passes = args.passes.split(",")
    providers = args.providers.split(",")
    shapes = [s for s in SHAPES if args.shapes is None or s.name in args.shapes.split(",")]
    rows = []
    for shape in shapes:
        rows += measure(shape, passes, providers)
        print(json.dumps(rows[-len(providers):]), flush=True)
    env = environment()
    print_table(rows, passes)
    print(f"\n{env['gpu']}, torch {env['torch']}, triton {env['triton']}, cuDNN {env['cudnn']}, {env['date']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(environment=env, shapes=[asdict(s) for s in shapes], rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
