#!/usr/bin/env bash
# Thirty-seventh session's GPU call: the ws backward's TMA_STORE checked (GPU tests of
# flash.attn_bwd_ws, JIT) and timed (bench_ws_backward.py), then the ws forward's cells with
# Q_SLOTS/TMA_STORE tuned (attn_fwd_ws, then the flash.forward engine choice) into a copy of
# the tuning database without the hand patch 0003-short-tiles (tuned.tgz under $OUT: delete
# that patch when landing it; no perfmon here: SELECT is empty).
# Its last stage is benchmarks/s40_session.sh's `tune-forward` step (each stage 110 s here).
source "$(dirname "$0")/session_common.sh"
stamp "GPU tests of flash.attn_bwd_ws (JIT)"
gpu_tests bwd-tests.log "${TEST_S:-170}" -n 8 tests/families/flash/test_backward_ws.py
stamp "bench_ws_backward: TMA_STORE"
bench_ws_backward "${BENCH_S:-120}" \
  "${SHAPES:-d128-q128-k16384-full,d64-q128-k16384-full,d128-q512-k4096-full,d64-q1024-k1024-causal}"
stamp "tune the ws forward cells"
TUNE_S=${TUNE_S:-110} bash "$(dirname "$0")/s40_session.sh" tune-forward
stamp "done"
