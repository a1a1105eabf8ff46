"""Write a copy of the tuning database whose short masked ws-forward cells run PERSISTENT=2
(sections of a few heads, forward_ws._decode), each cell's tuned configuration otherwise unchanged, so that one process can time the tables
as they are (AOTATTN_TUNING_DB unset) against the same tiles in sections of a few heads
(AOTATTN_TUNING_DB=OUT). No GPU needed to write it.

    python benchmarks/sections_ab.py build/sections-ab/tuning [--seqlens 512,1024,2048]

Why (RESULTS.md, forty-sixth session, benchmarks/l2_traffic_model.py): the one
costliest-first list reads K and V up to 4x from HBM at s512-s2048, where a d128 block's
128 FLOP per byte is under the ridge; sections of a few heads read them once.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from aotattn import families, tuning
from aotattn.tuning.database import default_root
from aotattn.tune.candidates import config_name
from aotattn.tuning.format import format_config, format_functional

PATCH = "flash.attn_fwd_ws.0099-sections-ab.dbpatch"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the copy's root (replaced)")
    parser.add_argument("--seqlens", default="512,1024,2048", help="square cells to switch to PERSISTENT=2")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--dtypes", default="bf16,fp16")
    args = parser.parse_args()

    spec = families.kernels()["flash.attn_fwd_ws"]
    knobs = dict(spec.tuning_space)
    if 2 not in knobs["PERSISTENT"]:
        parser.error("PERSISTENT=2 is not a value of flash.attn_fwd_ws in this checkout")
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(default_root(), args.out)
    db = tuning.database()
    configs, blocks = {}, {}
    for functional in spec.enumerate_functionals():
        f = functional.as_dict()
        if (f["MASK"] == 0 or f["VARLEN"] or f["DROPOUT"] or f["BIAS"] or f["PAD_HEAD"] or f.get("GROUPED")
                or f["dtype"] not in args.dtypes.split(",") or str(f["BLOCK_D"]) not in args.head_dims.split(",")
                or f["BLOCK_D"] != f["BLOCK_DV"]):
            continue
        functional = spec.canonical_functional(functional)
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            config = db.lookup("sm_90", spec, functional, {"seqlen_q": seqlen, "seqlen_k": seqlen})
            values = config.as_dict()
            if not values.get("PERSISTENT"):
                continue  # the one-tile grid: its order is program_order's, not the list's
            values["PERSISTENT"] = 2
            switched = type(config).of(values)
            name = config_name(switched)
            configs[name] = format_config(switched, spec)
            blocks.setdefault(format_functional(spec, functional), []).append(f"seqlen_q={seqlen} seqlen_k={seqlen}: {name}")
    lines = ["# benchmarks/sections_ab.py: the short masked cells' tuned tiles with PERSISTENT=2 (an A/B copy,",
             "# never landed)", "#! aotattn-patch 1", "#! table flash.attn_fwd_ws", "", "[configs]"]
    lines += [f"{name} = {values}" for name, values in sorted(configs.items())]
    for header, cells in blocks.items():
        lines += ["", header, *cells]
    path = args.out / "nvidia" / "sm_90" / PATCH
    path.write_text("\n".join(lines) + "\n")
    print(f"{path}: {sum(len(c) for c in blocks.values())} cells switched to PERSISTENT=2")


if __name__ == "__main__":
    main()
