#!/usr/bin/env bash
# Dropout on the H200, one device call (~2 min): its GPU tests (JIT, GPU sizes), then the
# perfmon dropout entries beside the dense entries of the same shapes, from images, in one
# run, so dropout's cost over the plain call and the ratios to SDPA's backends come from
# the same process. The perfdb file, logs and the comparison go under $OUT.
#
#   bash benchmarks/dropout_session.sh [BASE]
#
# BASE (default perfdb/sm_90/h200-20261201-s13-dropout.txt): the run to compare against.
# Environment: TAG (h200-<date>-dropout), DTYPE (bf16), TESTS_S (120; 0 skips the tests).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
base=${1:-perfdb/sm_90/h200-20261201-s13-dropout.txt}
dtype=${DTYPE:-bf16}
tag=${TAG:-h200-$(date -u +%Y%m%d)-dropout}
aot() { python -m aotattn.cli "$@"; }
select=(-g dropout -g dense -m "dropout-$dtype-*")
for d in 64 128; do for s in 512 1024 4096; do select+=(-m "dense-$dtype-d$d-s$s-*"); done; done

aot perfmon images --arch sm_90 --out build/img-dropout --jobs "$(nproc)" "${select[@]}" > "$OUT/images.log" 2>&1 &
if [ "${TESTS_S:-120}" != 0 ]; then
  AOTATTN_MODE=jit timeout -s INT "${TESTS_S:-120}" python -m pytest -m gpu -v -rfE -n 8 -p no:cacheprovider \
    tests/families/flash/test_dropout.py tests/test_common_mistakes.py -k "dropout or Dropout" > "$OUT/tests.log" 2>&1
  tail -n 1 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 10
fi
wait
tail -n 1 "$OUT/images.log"
AOTATTN_IMAGES=$PWD/build/img-dropout timeout 300 python -m aotattn.cli perfmon run --tag "$tag" \
  --out "$OUT/$tag.txt" --deadline 200 "${select[@]}" > "$OUT/run.log" 2>&1
grep -E "entries in" "$OUT/run.log"
{ aot perfdb compare "$base" "$OUT/$tag.txt"; aot perfdb faults "$OUT/$tag.txt"; } > "$OUT/compare.log" 2>&1
grep -E "regression|improvement\(s\)" "$OUT/compare.log" | tail -n 3
aot perfdb costs "$OUT/$tag.txt" > "$OUT/costs.log" 2>&1  # dropout's time over the plain call's
grep -E "geometric mean" "$OUT/costs.log"
