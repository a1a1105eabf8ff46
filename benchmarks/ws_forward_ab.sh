#!/usr/bin/env bash
# The ws forward's persistent grid against one program per tile, beside cuDNN, in one device
# call (JIT, no images): the ws forward's GPU tests, then benchmarks/bench_knobs.py over the
# flash.attn_fwd_ws cells (bf16; each cell's tuned tiles, PERSISTENT 0 and 1, Q_SLOTS 2).
# Logs and the rows (ab$AB_TAG.json) go under $OUT.
#
#   bash benchmarks/ws_forward_ab.sh   # AB_SEQLEN (1024,4096,16384), AB_HEAD_DIM (64,128,256), AB_MASK (0,2),
#                                      # AB_KEYS (key lengths; default Sq = Sk), AB_TAG, TEST_S (0: no tests)
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 AOTATTN_MODE=jit
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${TEST_S:-240}" != 0 ]; then
  stamp "GPU tests of flash.attn_fwd_ws (JIT)"
  timeout -s INT -k 20 "${TEST_S:-240}" python -m pytest -m gpu -q -n 8 -p no:cacheprovider \
    tests/families/flash/test_forward_ws.py > "$OUT/ws-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/ws-tests.log" | head -n 10; tail -n 1 "$OUT/ws-tests.log"
fi
stamp "persistent vs one tile per program, a second Q slot, and cuDNN"
keys=(); [ -n "${AB_KEYS:-}" ] && keys=(--keys "$AB_KEYS")
timeout "${AB_S:-300}" python benchmarks/bench_knobs.py --table flash.attn_fwd_ws --dtype bf16 --cudnn \
  --head-dim "${AB_HEAD_DIM:-64,128,256}" --seqlen "${AB_SEQLEN:-1024,4096,16384}" --mask "${AB_MASK:-0,2}" \
  "${keys[@]}" --json "$OUT/ab${AB_TAG:-}.json" > "$OUT/ab${AB_TAG:-}.log" 2>&1
cat "$OUT/ab${AB_TAG:-}.log"
stamp "done"
