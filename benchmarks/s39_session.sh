#!/usr/bin/env bash
# The next GPU call for issue 17 (written in the thirty-eighth session, without a GPU): the ws
# backward's TMA_STORE and KV_SLOTS checked (GPU tests of flash.attn_bwd_ws, JIT: every fitting
# configuration, both knobs included, against the float64 reference) and timed
# (bench_ws_backward.py: ws-T*, ws-K*, ws-KT1, ws-S1 beside the tuned P0/P1/P2), then the ws
# backward cells where a tile has few steps tuned with them (attn_bwd_ws, then the backward's
# backend choice) into a copy of the tuning database (tuned.tgz under $OUT; no perfmon: SELECT
# is empty). Under 10 minutes: TEST_S + BENCH_S + TUNE_S x 2 stages + builds.
#
#   bash benchmarks/s39_session.sh            # then land tuned.tgz (tuning lint first)
#
# The forward's short-tile tuning (patch 0003) is benchmarks/s38_session.sh's last stage.
source "$(dirname "$0")/session_common.sh"
stamp "GPU tests of flash.attn_bwd_ws (JIT)"
gpu_tests bwd-tests.log "${TEST_S:-240}" -n 8 tests/families/flash/test_backward_ws.py
stamp "bench_ws_backward: TMA_STORE, KV_SLOTS"
bench_ws_backward "${BENCH_S:-150}" \
  "${SHAPES:-d128-q128-k16384-full,d64-q128-k16384-full,d128-q512-k4096-full,d128-q4096-k4096-full,d128-q1024-k1024-causal}"
stamp "tune the ws backward cells of few steps a tile"
TUNE_S=${TUNE_S:-100} SELECT= bash benchmarks/tune_cells_session.sh -- -c flash,attn_bwd_ws --dtype bf16,fp16 \
  --head-dim 64,128 --where "MASK=0,2" --cells 128x16384,512x4096,1024x8192 --limit 24 \
  --then -c flash,backward --dtype bf16,fp16 --head-dim 64,128 --where "MASK=0,2 DETERMINISTIC=False" \
  --cells 128x16384,512x4096,1024x8192
stamp "done"
