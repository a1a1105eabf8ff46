#!/usr/bin/env bash
# The next GPU calls for issue 17 (written in the forty-second session, no device time left
# to run them), one step a call:
#
#   bash benchmarks/s42_session.sh verify   # < 8 min: the ws forward's PERSISTENT=2 (short masked
#                                           # sequences in sections of a few heads, new and never run)
#                                           # through the knob-covering GPU tests of every masked
#                                           # case, the three new short-section cases included
#   bash benchmarks/s42_session.sh tune     # < 10 min: the ws forward's masked cells of s512-s2048
#                                           # (d64/d128/d256, bf16/fp16) with the knobs around the
#                                           # current choice (PERSISTENT=2 among them), then the
#                                           # forward's engine choice; hand patch 0003's one cell
#                                           # (d128 s1024 causal) is among them, its choice timed
#                                           # as the current one, then taken out (--unmask): land
#                                           # tuned.tgz and `git rm` patch 0003 (deleted there)
#   bash benchmarks/s42_session.sh bench    # < 4 min: benchmarks/short_causal_sections.py (NaN-filled
#                                           # outputs against float32, then causal and full against
#                                           # cuDNN and SDPA-flash, JIT) on the tables as they are
#
# Why (RESULTS.md, forty-second session): on an H100 the d128 s1024 causal forward took as long as
# the full one (0.2658 vs 0.2634 ms, B16 H16; cuDNN 0.1595 vs 0.2281). Every ws knob the tuner
# timed was within 2% there, and the Triton kernel took the same time: the limit is not the tile.
# The persistent list under a mask runs a round's ~132 tiles on ~132 different heads (66 MB of K
# and V at d128 s1024, beyond L2), so every query block reads its K and V from HBM again
# (590 MB a call, 176 us at 3.35 TB/s). PERSISTENT=2 keeps a round on ~16 heads (8 MB).
# Prediction: d128 s1024 causal from ~1.0x to ~0.6-0.7x of the full forward's time.
source "$(dirname "$0")/session_common.sh"
case ${1:-verify} in
  verify)
    stamp "the ws forward's short-section cases with every knob value, PERSISTENT=2 included (JIT)"
    gpu_tests forward-ws-short.log "${SHORT_S:-200}" -n 3 tests/families/flash/test_forward_ws.py \
      -k "reference and short-sections"
    stamp "the other masked cases"
    gpu_tests forward-ws-masked.log "${TEST_S:-330}" -n 8 tests/families/flash/test_forward_ws.py \
      -k "reference and (causal or window or one-key or one-query) and not short-sections" ;;
  tune)
    stamp "tune the ws forward's short masked cells (PERSISTENT=2 among the knobs; patch 0003's choice timed, then unmasked)"
    UNMASK=1 TUNE_S=${TUNE_S:-260} SELECT= bash benchmarks/tune_cells_session.sh \
      -- -c flash,attn_fwd_ws --dtype bf16,fp16 --head-dim 64,128,256 --where "MASK=2" \
      --cells 512x512,1024x1024,2048x2048 --limit 24 \
      --then -c flash,forward --dtype bf16,fp16 --head-dim 64,128,256 --where "MASK=2" \
      --cells 512x512,1024x1024,2048x2048 ;;
  bench)
    stamp "short causal forwards against cuDNN and SDPA-flash (JIT)"
    AOTATTN_MODE=jit timeout "${BENCH_S:-220}" python benchmarks/short_causal_sections.py 2>&1 \
      | grep -v Warning | tee "$OUT/short-causal.log" ;;
  *) echo "usage: s42_session.sh verify|tune|bench" >&2; exit 2 ;;
esac
stamp "done"
