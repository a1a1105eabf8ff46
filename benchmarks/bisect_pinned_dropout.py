"""Where the pinned GPU dropout failure comes from: the problem of
``tests/test_fuzz.py::PINNED_DROPOUT`` and its neighbours, one size changed at a time.

    AOTATTN_MODE=jit python benchmarks/bisect_pinned_dropout.py      # on the GPU, ~1 min
    python benchmarks/bisect_pinned_dropout.py --device cpu           # the interpreter, the same rows

The eleventh session's GPU suite failed that problem (B1 Sq16 Sk1 H1 D1 Dv129 fp16, p =
2^-16, fused atomic backward): dK 0.168 against an exact 0 while dQ passed. Triton's JIT
specializes integer arguments equal to 1 as constants (head_dim, seqlen_k, the heads and
group size are all 1 there; the images never specialize), so each row below moves one of
them off 1, and the dropout off 2^-16, and prints per backend each gradient's error over
the bound the test allows (above 1 fails). A row whose ratios drop below 1 names the
argument the failure needs.
"""

from __future__ import annotations

import argparse

import torch

from tests.helpers import floor_error, multiple, rel_err
from tests.test_fuzz import BACKENDS, PINNED_DROPOUT, dropout_results

VARIANTS = {
    "pinned": {},
    "head_dim 2": {"head_dim": 2},
    "seqlen_k 2": {"seqlen_k": 2},
    "heads 2": {"heads_q": 2, "heads_k": 2},
    "head_dim_v 128": {"head_dim_v": 128},
    "seqlen_q 17": {"seqlen_q": 17},
}


def ratios(problem: dict, dropout_p: float, backend: tuple[str, bool], device: str) -> dict[str, float]:
    """Each gradient's error over the test's bound (multiple x the floor's error)."""
    torch.manual_seed(problem["seed"])
    kernel, floor, exact = dropout_results(dict(problem, backend=backend), dropout_p, device)
    times = multiple(problem["dtype"], device)
    return {name: rel_err(kernel.get(name), exact.get(name)) / (times * floor_error(floor, exact, name))
            for name in ("out", "dq", "dk", "dv")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter) to compare")
    device = ap.parse_args().device
    base, dropout_p = PINNED_DROPOUT[0]
    rows = [(name, dict(base, shape=dict(base["shape"], **change)), dropout_p) for name, change in VARIANTS.items()]
    rows.append(("dropout 0.1", base, 0.1))
    for name, problem, p in rows:
        for backend in BACKENDS:
            r = ratios(problem, p, backend, device)
            label = f"{backend[0]}{'-det' if backend[1] else ''}"
            print(f"{name:16} {label:10} " + "  ".join(f"{k} {v:7.2f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
