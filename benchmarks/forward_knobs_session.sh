#!/usr/bin/env bash
# The forward's knobs beyond the tiles (OVERLAP, TMA) on the H200, one device call (< 10
# min): their GPU tests, then every cell's tuned forward tiles plain, with OVERLAP=1, TMA=1
# (K), TMA=2 (K and V) and OVERLAP=1 TMA=2, all from images, side by side in one process
# (benchmarks/bench_knobs.py). Builds that fail (TMA at two stages: a ptxas crash
# in Triton 3.6) are reported in build.log and show as failed variants.
#
#   bash benchmarks/forward_knobs_session.sh          (logs and the JSON rows under $OUT)
#
# The knobbed images come from copies of the tuning database whose forward configurations
# all carry the knobs (`aotattn tuning set-knobs`); every build goes into one image folder
# (an archive keeps what it held: aotattn/compiler/builder.pack). Environment: DTYPES
# (default bf16,fp16), HEAD_DIMS (64,128,256), SEQLENS (512,...,16384), TESTS_S (150; 0 skips them).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }
IMAGES=build/img-knobs
where="PAD_HEAD=False VARLEN=False DROPOUT=False BIAS=0"
for variant in plain "OVERLAP=1" "TMA=1" "TMA=2" "OVERLAP=1 TMA=2"; do
  db=tuning
  if [ "$variant" != plain ]; then
    db=build/tuning-$(echo "$variant" | tr ' =' '_-')
    rm -rf "$db" && cp -r tuning "$db" && aot tuning set-knobs $variant --tuning-db "$db" > /dev/null
  fi
  aot build --arch sm_90 --kernel attn_fwd --where "$where" --tuning-db "$db" --out "$IMAGES" --jobs "$(nproc)" \
    >> "$OUT/build.log" 2>&1
  stamp "images, $variant: $(grep -E 'kernel\(s\)' "$OUT/build.log" | tail -n 1)"
done
if [ "${TESTS_S:-150}" != 0 ]; then  # TESTS_S=0: the knob tests ran in the GPU suite already
  AOTATTN_MODE=jit timeout "${TESTS_S:-150}" python -m pytest -m gpu -q -n 4 -p no:cacheprovider \
    tests/families/flash/test_forward_knobs.py > "$OUT/tests.log" 2>&1
  stamp "GPU tests: $(tail -n 1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 10
fi
left=$(( 570 - ($(date +%s) - t0) ))
AOTATTN_MODE=aot AOTATTN_IMAGES=$IMAGES timeout "$left" python benchmarks/bench_knobs.py \
  --dtype "${DTYPES:-bf16,fp16}" --head-dim "${HEAD_DIMS:-64,128,256}" \
  --seqlen "${SEQLENS:-512,1024,2048,4096,8192,16384}" --json "$OUT/forward_knobs.json" 2>&1 \
  | tee "$OUT/bench.log" | grep -v Warning | tail -n 85
stamp done
