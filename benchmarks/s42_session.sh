#!/usr/bin/env bash
# The next GPU calls for issue 17 (written in the forty-second session, with no device time left
# to run them), one step a call:
#
#   bash benchmarks/s42_session.sh diag     # < 7 min: what the short causal forward's time is made of.
#                                           # benchmarks/bench_short_causal.py (JIT) on the tree as it
#                                           # is, then with each forward patch of benchmarks/patches/
#                                           # applied in turn (each in its own process, the tree restored
#                                           # after): fwd-ws-no-mask-timing-only (masked blocks run the
#                                           # unmasked softmax: WRONG outputs, timing only) and
#                                           # fwd-ws-mask-bounds (per-row bounds: two compares a score)
#   bash benchmarks/s42_session.sh mask     # < 8 min: fwd-ws-mask-bounds applied, the ws forward's masked
#                                           # GPU tests with every knob value; if they pass and diag
#                                           # showed a gain, land the patch (git apply, commit)
#   bash benchmarks/s42_session.sh sections # < 10 min: PERSISTENT=2 (landed in the forty-sixth session),
#                                           # its GPU tests, then the tuner on the masked s512-s2048
#                                           # cells with it among the knobs (UNMASK=1: hand patch
#                                           # 0003's and 0004's cells timed as the current choice)
#   bash benchmarks/s42_session.sh sections-ab # < 7 min: the tables against a
#                                           # copy whose short masked ws-forward cells run PERSISTENT=2
#                                           # (benchmarks/sections_ab.py), bench_short_causal alternating
#                                           # (ROUNDS=2), then the patch's GPU tests. Run it before `sections`
#                                           # (whose tuning takes two stages of TUNE_S each: give it its own call)
#   bash benchmarks/s42_session.sh mask-bwd # < 9 min: bwd-ws-mask-bounds (the same per-key bounds in the
#                                           # ws backward's P; SASS 4288 instructions against 4432 at d128
#                                           # causal: a small gain at most) applied, the ws backward's masked
#                                           # GPU tests, then bench_ws_backward's causal shapes with it;
#                                           # compare with the same shapes of a run without (BASE=1)
#
# (The order step landed in the forty-sixth session: fwd-ws-program-order is in forward_ws.py.)
# Why (RESULTS.md, forty-second session): on an H100 the d128 s1024 causal forward took as long as
# the full one (0.2658 vs 0.2634 ms, B16 H16; cuDNN 0.1595 vs 0.2281), and every ws knob was within
# 2%. The tables' times fit "a causal tile costs its blocks plus 2.8 more" from s1024 to s16384
# (causal/full 0.91, 0.71, 0.60, 0.55, 0.51 against measured 0.91, 0.71, 0.58, 0.57, 0.515): the
# masked diagonal block would cost ~3.8 unmasked blocks. Its softmax compiles to ~770 more
# instructions a thread than the unmasked one (SASS, d128). Prediction for no-mask: causal/full
# from ~1.0 to ~0.6 at s1024, near 0.52 at s4096; if it stays near 1.0, the masks are not
# the cost and the schedule is (the sections patch is the lead then).
# Revised (forty-third session, no GPU: benchmarks/tile_cost_fit.py on the tables' H200 times):
# with causal and full cells of the same (Sq, Sk) and tile compared, a causal tile costs 1-2.3
# key blocks beyond its own at Sq 256-4096 and 2.6-5.5 at Sq 8192-16384, but 0.1-0.2 at Sq 128,
# where every tile has the same length and the same masked block. The excess grows with the
# spread of tile lengths, not with the masked blocks: a schedule (tail) cost more than a mask
# cost. New prediction for diag: no-mask within ~5% of the tree at s1024, mask-bounds ~0.
source "$(dirname "$0")/session_common.sh"
short() {  # LOG ARGS...: the benchmark, JIT, into $OUT/LOG
  local log=$1; shift
  AOTATTN_MODE=jit timeout "${BENCH_S:-150}" python benchmarks/bench_short_causal.py "$@" 2>&1 | grep -v Warning \
    | grep -v "^  " | tee "$OUT/$log"
}
with_patch() {  # PATCH COMMAND...: COMMAND with benchmarks/patches/PATCH applied, the tree restored after
  local patch=benchmarks/patches/$1; shift
  git apply "$patch" || { stamp "$patch does not apply"; return 1; }
  "$@"; local rc=$?
  git apply -R "$patch"
  return $rc
}
case ${1:-diag} in
  diag)
    shapes=${SHAPES:-16x1024x16x128,16x1024x32x64,8x2048x16x128,4x4096x16x128}
    stamp "the tree as it is"; short base.log --shapes "$shapes"
    stamp "masked blocks unmasked (timing only)"
    with_patch fwd-ws-no-mask-timing-only.patch short no-mask.log --no-check --shapes "$shapes"
    stamp "per-row mask bounds"; with_patch fwd-ws-mask-bounds.patch short mask-bounds.log --shapes "$shapes" ;;
  mask)
    stamp "per-row mask bounds: the ws forward's masked cases with every knob value (JIT)"
    with_patch fwd-ws-mask-bounds.patch gpu_tests forward-ws-masked.log "${TEST_S:-450}" -n 8 \
      tests/families/flash/test_forward_ws.py -k "reference and (causal or window or one-key or one-query)" ;;
  sections-ab)
    # the tables as they are against the same tiles with PERSISTENT=2 (benchmarks/sections_ab.py:
    # a copy of the database), alternating, each in its own process; bench_short_causal's checks
    # run on the copy too. Prediction (forty-sixth session, l2_traffic_model.py): 1.45-1.8x at
    # d128 and d64 s1024 B16 causal (H100), less on the H200; s2048 d128 (one-tile grid: not
    # switched) and s4096 (no sections past programs / 8 query blocks) are controls, ~1.0
    # AB_DB=DIR (forty-seventh session): another database copy instead, e.g. a tuner export not yet landed
    db=${AB_DB:-build/sections-ab/tuning}
    [ -n "${AB_DB:-}" ] || python benchmarks/sections_ab.py "$db" | tail -n 1
    shapes=${SHAPES:-16x1024x16x128,16x1024x32x64,32x512x16x128,8x2048x16x128,4x4096x16x128}
    for r in $(seq 1 "${ROUNDS:-2}"); do
      stamp "round $r: the tables as they are"; short "ab-tree-$r.log" --no-check --shapes "$shapes"
      stamp "round $r: PERSISTENT=2 on the short masked cells"
      AOTATTN_TUNING_DB=$(realpath "$db") short "ab-sections-$r.log" $( [ "$r" = 1 ] || echo --no-check ) \
        --shapes "$shapes"
    done
    [ -n "${NO_TESTS:-}" ] && exit 0
    stamp "PERSISTENT=2: the short-section cases with every knob value (JIT)"
    gpu_tests forward-ws-short.log "${SHORT_S:-200}" -n 3 tests/families/flash/test_forward_ws.py \
      -k "reference and short-sections" ;;
  sections)
    if [ -z "${NO_TESTS:-}" ]; then  # NO_TESTS=1: the suite ran them (gpu_verify.sh suite)
      stamp "PERSISTENT=2: the short-section cases with every knob value (JIT)"
      gpu_tests forward-ws-short.log "${SHORT_S:-200}" -n 3 tests/families/flash/test_forward_ws.py \
        -k "reference and short-sections"
    fi
    stamp "tune the ws forward's short masked cells (PERSISTENT=2 among the knobs; patch 0003's choice timed)"
    UNMASK=1 TUNE_S=${TUNE_S:-260} SELECT= bash benchmarks/tune_cells_session.sh \
      -- -c flash,attn_fwd_ws --dtype bf16,fp16 --head-dim 64,128,256 --where "MASK=2" \
      --cells 512x512,1024x1024,2048x2048 --limit 24 \
      --then -c flash,forward --dtype bf16,fp16 --head-dim 64,128,256 --where "MASK=2" \
      --cells 512x512,1024x1024,2048x2048 ;;
  mask-bwd)
    shapes=${SHAPES:-d128-q1024-k1024-causal,d128-q4096-k4096-causal,d256-q4096-k4096-causal,d64-q1024-k1024-causal}
    if [ -n "${BASE:-}" ]; then
      stamp "bench_ws_backward, the tree as it is"; bench_ws_backward "${BENCH_S:-200}" "$shapes"
    else
      git apply benchmarks/patches/bwd-ws-mask-bounds.patch || exit 1
      stamp "per-key mask bounds in the ws backward: its masked tests (JIT)"
      gpu_tests backward-ws-masked.log "${TEST_S:-300}" -n 8 tests/families/flash/test_backward_ws.py \
        -k "causal or window or one-key"
      stamp "bench_ws_backward with the patch"; bench_ws_backward "${BENCH_S:-200}" "$shapes"
      git apply -R benchmarks/patches/bwd-ws-mask-bounds.patch
    fi ;;
  *) echo "usage: s42_session.sh diag|mask|mask-bwd|sections-ab|sections" >&2; exit 2 ;;
esac
stamp "done"
