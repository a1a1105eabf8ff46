"""The ws backward with one tile per program against PERSISTENT (one program per SM walking
the tiles; 2, causal shapes only: the wider masked sections), beside split, fused and SDPA's
cuDNN and flash backends, in one process (JIT).

    python benchmarks/bench_ws_backward.py [--shapes d64-q128-k16384-full,...] [--reps 20]

Every bucket also runs ``TMA_STORE=1`` (ws-T0, ...: dK and dV by bulk stores); padded head
dims of the d256 bucket (d160-d192) also ``NARROW=1`` (ws-N0, ...); the key split (d64, d128
buckets) also the persistent kernel with a second K/V slot, ``KV_SLOTS=2`` (ws-K1, ws-K2;
ws-KT1 with TMA_STORE too; at d128 with ``STAGES=1``, and ws-S1, one q/dO slot and one K/V
slot, for what the ring alone costs).
A shape ``d<D>[-g<G>]-q<Sq>-k<Sk>-<full|causal>`` runs at hidden size 2048 (H = 2048 / D
query heads, H / G key heads) and 16k query tokens (B = 16384 / Sq; ``--batch``
overrides), bf16, flash-attn's layout. Each variant's backward (the stats, the kernel and,
for ws and fused, the zeroing of dQ's fp32 buffer) is timed as perfmon times
(:func:`timed`), median of ``--reps`` after warm-up; every variant's dQ, dK and dV are
compared with split's (relative Frobenius error, a check at GPU sizes beside the tests).
Prints ms per backward and the ratio to PERSISTENT=0.
"""

from __future__ import annotations

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from aotattn.families.flash import planning, rules
from aotattn.families.flash.checks import check_flash
from aotattn.perfmon.providers import rel_diff
from aotattn.runtime import launch
from aotattn.spec import Config
from aotattn.tune import timing
from aotattn.tuning.format import parse_config

DEFAULT = ("d64-q128-k16384-full,d64-q128-k16384-causal,d128-q128-k16384-full,d128-q128-k16384-causal,"
           "d64-q512-k4096-full,d128-q512-k4096-full,d128-q1024-k8192-full,d128-q4096-k4096-full,"
           "d128-q4096-k4096-causal,d256-q4096-k4096-full,d256-q512-k4096-full,d64-q1024-k1024-causal")
WS = {64: "BLOCK_M=64 BLOCK_N=128 STAGES=3", 128: "BLOCK_M=64 BLOCK_N=128 STAGES=2",
      256: "BLOCK_M=64 BLOCK_N=64 STAGES=2"}


def parse(shape: str):
    """``d<D>[-g<G>]-q<Sq>-k<Sk>-<full|causal>``: (D, G, Sq, Sk, causal); G query heads a key head."""
    parts = shape.split("-")
    group = int(parts.pop(1)[1:]) if parts[1].startswith("g") else 1
    d, q, k, mask = parts
    return int(d[1:]), group, int(q[1:]), int(k[1:]), mask == "causal"


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` calls after warm-up, timed as perfmon times them
    (:func:`aotattn.tune.timing.measure`: the L2 flushed before each call, the host's
    launch work hidden behind a GPU wait). The synchronize after every call this benchmark
    had left the GPU idle while the host launched the next, and counted that in."""
    return timing.measure(lambda _: fn(), lambda: None, device="cuda", warmup=3, repeats=reps,
                          hide_host_ms=1.0).median_ms


def config(text: str) -> Config:
    return parse_config(rules.ATTN_BWD_WS, f"{text} num_warps=4 num_stages=1", "bench_ws_backward")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{'shape':32} {'variant':10} {'ms':>8} {'vs P0':>7} {'err':>9}")
    for shape in args.shapes.split(","):
        bench(shape, args)
        torch.cuda.empty_cache()

def bench(shape: str, args) -> None:
    """One shape: every variant timed and compared (its tensors freed on return)."""
    d, group, sq, sk, causal = parse(shape)
    h = 2048 // d
    b = args.batch or max(1, 16384 // sq)  # 16k query tokens, as perfmon's non-square entries
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, h // group, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    p = check_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=causal, window_size=(-1, -1),
                    diagonal="bottom_right")
    c = planning.new_call(p, q, k, v)
    out = torch.empty_like(q)
    lse = planning.run_forward(c, q, k, v, out)
    results = {}

    def ours(backend, cfg=None):
        stats, dq, dk, dv, _ = planning.backward_buffers(c, q, k, v, backend, False)
        configs = {rules.ATTN_BWD_WS.name: cfg} if cfg is not None else None
        plans = planning.backward_plans(c, dout, q, k, v, out, lse, stats, dq, dk, dv, None, backend, False,
                                        configs)

        def run():
            if dq.dtype == torch.float32:
                dq.zero_()
            for plan in plans:
                launch(plan)

        def grads():  # as the operators return them (an accumulated dQ scaled and converted)
            return planning.finish_dq(dq, q, planning.accumulated_dq_scale(c, backend, False)), dk, dv
        return run, grads

    variants = [("split", "split", None), ("fused", "fused", None)]
    bucket = rules.head_dim_bucket(d)
    if bucket in WS:
        variants += [("ws-P0", "ws", config(WS[bucket])), ("ws-P1", "ws", config(WS[bucket] + " PERSISTENT=1"))]
        if causal:  # the wider masked sections
            variants.append(("ws-P2", "ws", config(WS[bucket] + " PERSISTENT=2")))
        walks = (0, 1, 2) if causal else (0, 1)
        # dK and dV by bulk stores (ws-T0, ...; the column split's halves at d256)
        variants += [(f"ws-T{w}", "ws", config(f"{WS[bucket]} PERSISTENT={w} TMA_STORE=1")) for w in walks]
        if bucket < 256:  # the key split
            # a second K/V slot (persistent only); at d128 it fits beside one q/dO slot alone
            tiles = WS[bucket] if bucket == 64 else WS[bucket].replace("STAGES=2", "STAGES=1")
            variants += [(f"ws-K{w}", "ws", config(f"{tiles} PERSISTENT={w} KV_SLOTS=2")) for w in walks if w]
            variants.append(("ws-KT1", "ws", config(f"{tiles} PERSISTENT=1 KV_SLOTS=2 TMA_STORE=1")))
            if bucket == 128:
                variants.append(("ws-S1", "ws", config(f"{tiles} PERSISTENT=1")))
        if bucket == 256 and d < bucket:  # padded heads: the 128 + 64 split (d160-d192)
            variants += [(f"ws-N{w}", "ws", config(f"{WS[bucket]} PERSISTENT={w} NARROW=1")) for w in walks]
    ref = None
    for name, backend, cfg in variants:  # one variant's buffers at a time (and split's, the reference)
        fn, finished = ours(backend, cfg)
        ms = timed(fn, args.reps)
        grads = finished()
        if ref is None:
            ref = grads
        results[name] = (ms, max(rel_diff(g, r) for g, r in zip(grads, ref)))
        del fn, finished, grads
    del ref
    qs, ks, vs = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
    gqa = {"enable_gqa": True} if group > 1 else {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        if causal and sq != sk:
            continue  # SDPA's is_causal is top-left
        try:
            with sdpa_kernel(be):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, **gqa)
                do = dout.transpose(1, 2)
                results[name] = (timed(lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True),
                                       args.reps), float("nan"))
        except RuntimeError as e:
            print(f"{shape:32} {name:10} failed: {str(e).splitlines()[0][:80]}")
    base = results.get("ws-P0", results["split"])[0]
    for name, (ms, err) in results.items():
        shown = "-" if err != err else f"{err:.2e}"  # the peers' gradients are not compared
        print(f"{shape + f' B{b}':32} {name:10} {ms:8.3f} {base / ms:7.3f} {shown:>9}", flush=True)


if __name__ == "__main__":
    main()
