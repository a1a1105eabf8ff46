#!/usr/bin/env bash
# The sm_90 images the GPU session's AOT test and latency benchmark use (a subset of the
# full set: bf16/fp16, d64/d128, unpadded, dense, no dropout or bias), into ${1:-images}.
# Every flash kernel at those functionals: which one a call runs (Triton or warp-specialized,
# split or fused backward) is the tuning database's choice; bf16 d64 also with the kernels
# only a forced backend runs.
set -euo pipefail
out=${1:-images}
common="PAD_HEAD=False VARLEN=False DROPOUT=False BIAS=0"
build() { python -m aotattn.cli build --arch sm_90 --out "$out" "$@"; }
build --family flash --where "dtype=bf16 BLOCK_D=128 $common"
build --family flash --where "dtype=fp16 BLOCK_D=64 MASK=2 $common"
build --family flash --forced-backends --where "dtype=bf16 BLOCK_D=64 $common"
build --kernel rmsnorm_fwd --where "dtype=bf16 BLOCK=1024"
