#!/usr/bin/env bash
# Thirty-seventh session's GPU call: the ws backward's TMA_STORE checked (GPU tests of
# flash.attn_bwd_ws, JIT) and timed (bench_ws_backward.py), then the ws forward's cells with
# Q_SLOTS/TMA_STORE tuned (attn_fwd_ws, then the flash.forward engine choice) into a copy of
# the tuning database without the hand patch 0003-short-tiles (tuned.tgz under $OUT: delete
# that patch when landing it; no perfmon here: SELECT is empty).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
stamp "GPU tests of flash.attn_bwd_ws (JIT)"
AOTATTN_MODE=jit timeout -s INT -k 20 "${TEST_S:-170}" python -m pytest -m gpu -q -n 8 -p no:cacheprovider \
  tests/families/flash/test_backward_ws.py > "$OUT/bwd-tests.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/bwd-tests.log" | head -n 10; tail -n 1 "$OUT/bwd-tests.log"
stamp "bench_ws_backward: TMA_STORE"
AOTATTN_MODE=jit timeout "${BENCH_S:-120}" python benchmarks/bench_ws_backward.py --reps 10 \
  --shapes "${SHAPES:-d128-q128-k16384-full,d64-q128-k16384-full,d128-q512-k4096-full,d64-q1024-k1024-causal}" \
  > "$OUT/bench-bwd.log" 2>&1
cat "$OUT/bench-bwd.log"
stamp "tune the ws forward cells"
DROP=flash.attn_fwd_ws.0003-short-tiles.dbpatch TUNE_S=${TUNE_S:-110} SELECT= bash benchmarks/tune_cells_session.sh -- -c flash,attn_fwd_ws --dtype bf16 \
  --head-dim 64,128 --where "MASK=0,2" --cells 4096x128,4096x512,512x512,1024x1024 --limit 24 \
  --then -c flash,forward --dtype bf16 --head-dim 64,128 --where "MASK=0,2" --cells 4096x128,4096x512,512x512,1024x1024
stamp "done"
