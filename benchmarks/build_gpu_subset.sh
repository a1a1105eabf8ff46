#!/usr/bin/env bash
# The sm_90 images the GPU session's AOT test and latency benchmark use (a subset of the
# full set: bf16/fp16, d64/d128, unpadded, dense, no dropout or bias; the fused backward
# where the tuning database chooses it, and everywhere for bf16 d64 full and causal), into ${1:-images}.
set -euo pipefail
out=${1:-images}
common="PAD_HEAD=False VARLEN=False DROPOUT=False BIAS=0"
python -m aotattn.cli build --arch sm_90 --out "$out" --kernel attn_fwd --kernel attn_bwd_dkdv --kernel attn_bwd_dq \
  --kernel attn_bwd_fused --where "dtype=bf16 BLOCK_D=128 $common"
python -m aotattn.cli build --arch sm_90 --out "$out" --kernel attn_fwd --kernel attn_bwd_dkdv --kernel attn_bwd_dq \
  --kernel attn_bwd_fused --where "dtype=fp16 BLOCK_D=64 MASK=2 $common"
for mask in 0 2; do
  python -m aotattn.cli build --arch sm_90 --out "$out" --kernel attn_fwd --kernel attn_bwd_dkdv --kernel attn_bwd_dq \
    --kernel attn_bwd_fused --forced-backends --where "dtype=bf16 BLOCK_D=64 MASK=$mask $common"
done
python -m aotattn.cli build --arch sm_90 --out "$out" --kernel attn_bwd_preprocess --where "PAD_HEAD=False VARLEN=False"
python -m aotattn.cli build --arch sm_90 --out "$out" --kernel rmsnorm_fwd --where "dtype=bf16 BLOCK=1024"
