#!/usr/bin/env bash
# The L2 model's test on the GPU (benchmarks/grouped_l2_model.py, RESULTS.md fifty-second
# session), one device call of ~3-4 minutes, written for whichever card comes:
#
#   bash benchmarks/gqa_l2_session.sh        # run's timeout_s 300
#
# The d128 s4096 causal ws backward (bf16, hidden 2048, 16k tokens) at GQA groups 4 and 8,
# on the tables' tile (one program a tile) and on the same cell forced to PERSISTENT=2 (a
# patch in a copy of the tables): each kernel's device time (benchmarks/profile_backward.py,
# SDPA's flash and cuDNN beside it) and Nsight Compute's DRAM bytes and L2 hit rate on one
# warm launch of attn_bwd_ws (clocks left alone, METHOD.md; L2 flushed before it, as perfmon
# flushes). The model predicts DRAM reads of g8 one-tile ~1.3x g4 one-tile and ~1.7x g8 on
# PERSISTENT=2, and g4 on PERSISTENT=2 reading more than g4 one-tile. What comes back under
# $OUT: profile-*.txt, ncu-*.txt.
source "$(dirname "$0")/session_common.sh"
export AOTATTN_MODE=jit
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
stamp "$gpu"
rm -rf build/p2 && mkdir -p build/p2 && cp -r tuning build/p2/tuning
cat > build/p2/tuning/nvidia/sm_90/flash.attn_bwd_ws.0900-persistent2.dbpatch <<'EOF'
#! aotattn-patch 1
#! table flash.attn_bwd_ws
# gqa_l2_session.sh: the grouped d128 s4096 causal cell forced to PERSISTENT=2

[configs]
m64_n128_w4_s1_persistent2_st2 = BLOCK_M=64 BLOCK_N=128 STAGES=2 PERSISTENT=2 num_warps=4 num_stages=1

[dtype=bf16 BLOCK_D=128 BLOCK_DV=128 PAD_HEAD=False MASK=2 VARLEN=False DROPOUT=False BIAS=0 GROUPED=True]
seqlen_q=4096 seqlen_k=4096: m64_n128_w4_s1_persistent2_st2
EOF
aot tuning lint --tuning-db build/p2/tuning | tail -n 1
for variant in one-tile persistent2; do
  db=$PWD/tuning; [ "$variant" = persistent2 ] && db=$PWD/build/p2/tuning
  for g in 4 8; do
    shape=d128-g$g-q4096-k4096-causal
    stamp "$variant g$g"
    AOTATTN_TUNING_DB=$db timeout 150 python benchmarks/profile_backward.py --shapes "$shape" \
      > "$OUT/profile-$variant-g$g.txt" 2>&1
    grep -E " us, |attn_bwd_ws" "$OUT/profile-$variant-g$g.txt" | head -n 3
    AOTATTN_TUNING_DB=$db timeout 150 ncu --clock-control none -k regex:attn_bwd_ws --launch-skip 3 -c 1 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct \
      python benchmarks/profile_backward.py --shapes "$shape" > "$OUT/ncu-$variant-g$g.txt" 2>&1
    grep -E "gpu__time_duration|dram__bytes|lts__t_sector_hit" "$OUT/ncu-$variant-g$g.txt" || tail -n 3 "$OUT/ncu-$variant-g$g.txt"
  done
done
stamp done
