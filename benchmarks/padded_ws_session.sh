#!/usr/bin/env bash
# The warp-specialized backward on padded heads (d72-d248, rows of 16 bytes), on the H200 in
# one device call (< 10 min): its GPU tests (test_backward_ws.py: the padded cases beside the
# others), then which backend the padded cells of flash.backward run (split, fused or ws,
# timed by the tuner into a copy of the tuning database), then perfmon of the odd-dim bf16
# entries from images with that copy, beside the peers. What comes back under $OUT: as
# ws_session.sh (tuned.tgz: copy its flash.backward patch into tuning/ after
# `aotattn tuning lint`; the perfdb run; logs).
#
#   bash benchmarks/padded_ws_session.sh
#
# Environment: TEST_S (150 s, the tests' deadline), OP_SEQLEN, OP_S, RUN_S, TAG: as ws_session.sh.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
echo "[0 s] GPU tests of flash.attn_bwd_ws (JIT)"
AOTATTN_MODE=jit timeout -s INT -k 10 "${TEST_S:-150}" python -m pytest -m gpu -q -n 12 -p no:cacheprovider \
  tests/families/flash/test_backward_ws.py > "$OUT/padded-tests.log" 2>&1
grep -E "^(FAILED|ERROR)" "$OUT/padded-tests.log" | head -n 10; tail -n 1 "$OUT/padded-tests.log"
echo "[$(( $(date +%s) - start )) s] the padded cells of flash.backward, then perfmon"
WS=backward WS_SEQLEN='' OP_WHERE="PAD_HEAD=True DETERMINISTIC=False MASK=0,2 DROPOUT=False" OP_PLAN_ARGS=--all-functionals \
  SELECT="-g odd-dim -m *bf16*" RUN_S=${RUN_S:-80} PERFMON_BEFORE_S=330 TAG=${TAG:-h200-$(date -u +%Y%m%d)-padded-ws} \
  bash benchmarks/ws_session.sh
