#!/usr/bin/env bash
# The next GPU calls for issue 17 (written in the thirty-ninth session), one step a call:
#
#   bash benchmarks/s40_session.sh verify   # < 8 min: the subnormal-dQ tests (fused, every ws
#                                           # code path) and the d256 ws tests (the column
#                                           # split's TMA_STORE, new and never run), then
#                                           # bench_ws_backward on this card (d256 shapes too)
#   bash benchmarks/s40_session.sh tune     # < 10 min: every diagonal attn_bwd_ws cell of d64, d128,
#                                           # d256 (bf16, fp16, full and causal) with every knob
#                                           # (TMA_STORE, KV_SLOTS; 132 tasks, ~4 GPU-minutes and 273
#                                           # kernels); tuned.tgz under $OUT (`tuning lint`, then land)
#   bash benchmarks/s40_session.sh tune-backend   # < 10 min: then the backward's backend choice
#                                           # (ws, split or fused) on the same cells
#   bash benchmarks/s40_session.sh tune-forward   # < 9 min: the ws forward's short-tile cells with
#                                           # Q_SLOTS/TMA_STORE, then the forward's engine choice,
#                                           # on a copy without hand patch 0003-short-tiles:
#                                           # `git rm` that patch when landing tuned.tgz
#
# (No top-left step: a top-left causal call of Sq < Sk is solved as the causal Sq x Sq call,
# planning.trim_keys, whose cell is a diagonal one; what it adds is the dK/dV zeros of the
# keys no query sees.)
#
# Land each tuned.tgz before the next tune step runs (the step starts from tuning/ as it is).
#
# Run on an H100 on 2026-12-05 (forty-first session): tune and tune-backend landed; tune-forward
# did NOT land: at --limit 24 of 36 tiles it timed no Q_SLOTS/TMA_STORE candidate at all, so patch
# 0003 stays. The planner now adds the current choice's knob variants (candidates.knob_variants):
# rerun tune-forward as is (152 kernels), land it and `git rm` patch 0003 only where the export
# keeps those cells' knobs or beats them.
# Forty-second session (H100): tune-forward landed (14 of 16 cells changed, 1.05-1.43x, the tuner's own
# Q_SLOTS=2 + TMA_STORE=1), then d128 s1024 again once knobs that do not fit a tile were also tried one
# stage shallower (1.07x full): patch 0003 keeps only the d128 s1024 causal cell. tune ran again (27 of 132
# ws backward cells changed, 1.02-1.39x) and landed.
#
# The thirty-ninth session timed TMA_STORE on an H100 only (1.09-1.56x where a tile has few
# steps; +3-7% on square cells): the tune step puts it where it wins on the card at hand.
source "$(dirname "$0")/session_common.sh"
case ${1:-verify} in
  verify)
    stamp "the subnormal-dQ tests and the d256 ws backward's (TMA_STORE of the column split) (JIT)"
    gpu_tests subnormal-tests.log "${TEST_S:-240}" -n 6 tests/runtime/test_interpreter_bfloat16.py tests/families/flash/test_backward.py \
      tests/families/flash/test_backward_ws.py -k "subnormal or tiny_softmax or finishing or d2 or d192 or d160 or stride_0 or rows_of_16"
    stamp "bench_ws_backward"
    bench_ws_backward "${BENCH_S:-200}" "${SHAPES:-d128-q128-k16384-full,d64-q128-k16384-full,d128-q512-k4096-full,\
d128-q4096-k4096-full,d128-q1024-k1024-causal,d256-q4096-k4096-causal,d256-q8192-k8192-causal,d256-q2048-k2048-full}" ;;
  tune)
    stamp "tune every diagonal ws backward cell of d64, d128 and d256"
    TUNE_S=${TUNE_S:-500} SELECT= bash benchmarks/tune_cells_session.sh -- -c flash,attn_bwd_ws --dtype bf16,fp16 \
      --head-dim 64,128,256 --where "MASK=0,2" --limit 16 ;;
  tune-backend)
    stamp "the backward's backend choice on the diagonal cells of d64, d128 and d256"
    TUNE_S=${TUNE_S:-500} SELECT= bash benchmarks/tune_cells_session.sh -- -c flash,backward --dtype bf16,fp16 \
      --head-dim 64,128,256 --where "MASK=0,2 DETERMINISTIC=False" ;;
  tune-forward)
    stamp "tune the ws forward cells of short tiles (Q_SLOTS, TMA_STORE), without hand patch 0003"
    DROP=flash.attn_fwd_ws.0003-short-tiles.dbpatch TUNE_S=${TUNE_S:-220} SELECT= bash benchmarks/tune_cells_session.sh \
      -- -c flash,attn_fwd_ws --dtype bf16 --head-dim 64,128 --where "MASK=0,2" \
      --cells 4096x128,4096x512,512x512,1024x1024 --limit 24 \
      --then -c flash,forward --dtype bf16 --head-dim 64,128 --where "MASK=0,2" \
      --cells 4096x128,4096x512,512x512,1024x1024 ;;
  *) echo "usage: s40_session.sh verify|tune|tune-backend|tune-forward" >&2; exit 2 ;;
esac
stamp "done"
