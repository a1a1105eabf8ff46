#!/usr/bin/env bash
# The split backward's TMA knob on the H200, one device call: its GPU tests, then each
# cell's tuned dK/dV and dQ tiles plain and with TMA=1 from images, side by side
# (benchmarks/bench_knobs.py). Variants that need more shared memory than the GPU has
# (dQ d256 m128 n64 with descriptors: 256 KB) fail their build and show as failed.
#
#   bash benchmarks/backward_tma_session.sh          (logs and the JSON rows under $OUT)
#
# Environment: DTYPES (bf16), HEAD_DIMS (64,128,256), SEQLENS (1024,4096,16384), TESTS_S
# (90; 0 skips the tests), LIMIT_S (the whole call, 560).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }
if [ "${TESTS_S:-90}" != 0 ]; then
  AOTATTN_MODE=jit timeout "${TESTS_S:-90}" python -m pytest -m gpu -q -n 4 -p no:cacheprovider \
    tests/families/flash/test_backward_knobs.py > "$OUT/tests.log" 2>&1
  stamp "GPU tests: $(tail -n 1 "$OUT/tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 10
fi
IMAGES=build/img-bwd-tma
where="dtype=${DTYPES:-bf16} BLOCK_D=${HEAD_DIMS:-64,128,256} PAD_HEAD=False VARLEN=False DROPOUT=False BIAS=0"
db=build/tuning-bwd-tma
mkdir -p build && rm -rf "$db" && cp -r tuning "$db"
# the timed problem runs a forward and the preprocess to make the backward's inputs
aot build --arch sm_90 --kernel attn_fwd --kernel attn_bwd_preprocess --where "$where" --out "$IMAGES" \
  --jobs "$(nproc)" >> "$OUT/build.log" 2>&1
for kernel in attn_bwd_dkdv attn_bwd_dq; do
  aot tuning set-knobs TMA=1 --table "flash.$kernel" --tuning-db "$db" > /dev/null
  for source in tuning "$db"; do
    aot build --arch sm_90 --kernel "$kernel" --where "$where" --tuning-db "$source" --out "$IMAGES" \
      --jobs "$(nproc)" >> "$OUT/build.log" 2>&1
  done
  stamp "images $kernel: $(grep -E 'kernel\(s\)' "$OUT/build.log" | tail -n 1)"
done
for kernel in attn_bwd_dkdv attn_bwd_dq; do
  left=$(( ${LIMIT_S:-560} - ($(date +%s) - t0) - 10 ))
  [ "$left" -le 20 ] && break
  [ "$kernel" = attn_bwd_dkdv ] && left=$(( left * 6 / 10 ))
  AOTATTN_MODE=aot AOTATTN_IMAGES=$IMAGES timeout "$left" python benchmarks/bench_knobs.py --table "flash.$kernel" \
    --dtype "${DTYPES:-bf16}" --head-dim "${HEAD_DIMS:-64,128,256}" --seqlen "${SEQLENS:-1024,4096,16384}" \
    --json "$OUT/$kernel.json" 2>&1 | tee "$OUT/bench-$kernel.log" | grep -v Warning | tail -n 30
  stamp "bench $kernel"
done
