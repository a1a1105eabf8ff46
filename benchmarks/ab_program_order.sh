#!/usr/bin/env bash
# A/B of the program order across heads (kernels/common.py program_order, landed after the
# 2026-12-01 A/B against heads in launch order: RESULTS.md) on the H200, one device call
# (< 10 min): perfmon from images over the masked bf16 entries (dense, GQA, models) with
#   po    the kernels as committed: rank 0 of every head of a group before rank 1 of any,
#         groups capped by L2_SHARE (16 MB of what the heads stream),
#   nocap the same with the cap lifted (always up to MAX_HEADS_TOGETHER heads).
# Each run times SDPA's backends beside aotattn, so each run's ratios are side by side;
# `aotattn perfdb compare` between runs says what moved beyond the noise.
#   bash benchmarks/ab_program_order.sh            (logs and perfdb files under $OUT)
#   VARIANTS=po bash benchmarks/ab_program_order.sh   (a subset, in this order)
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }
common=aotattn/families/flash/kernels/common.py
sel=(-g dense -g gqa -g model -m '*bf16*causal*' -m 'model-*')
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv,noheader
for variant in ${VARIANTS:-po nocap}; do
  case $variant in
    nocap) sed -i 's/^L2_SHARE: tl.constexpr = tl.constexpr(16 \* 1024 \* 1024)/L2_SHARE: tl.constexpr = tl.constexpr(1 << 60)/' \
             "$common"; grep -n "^L2_SHARE" "$common" ;;
  esac
  aot perfmon images --arch sm_90 --out "build/img-$variant" --cache build/cache --jobs 16 "${sel[@]}" \
    > "$OUT/images-$variant.log" 2>&1
  stamp "images $variant: $(tail -n 1 "$OUT/images-$variant.log")"
  AOTATTN_IMAGES=build/img-$variant aot perfmon run --tag "h200-20261201-$variant" --out "$OUT/$variant.txt" \
    --deadline 110 "${sel[@]}" > "$OUT/run-$variant.log" 2>&1
  stamp "perfmon $variant: $(grep -E 'entries in' "$OUT/run-$variant.log" | tail -n 1)"
  aot perfdb summary "$OUT/$variant.txt" 2>&1 | grep -E "sdpa-flash"
done
[ -f "$OUT/nocap.txt" ] && aot perfdb compare "$OUT/po.txt" "$OUT/nocap.txt" 2>&1 | tail -n 12
stamp done
