#!/usr/bin/env bash
# Off-bucket head dims (72, 80, 96, ..., D != Dv), their two paths on the H200 in one device
# call: `AOTATTN_PAD_HEADS=copy` (zero-padding copies to the bucket, then the bucket's
# aligned kernels) and the default `AOTATTN_PAD_HEADS=kernel` (the padded-head kernels,
# built aligned8, reading the unpadded tensors). Each path gets its own image folder (perfmon images follows the
# variable) and a perfmon run with every provider, so each run has its own ratios against
# SDPA-flash; then `perfdb compare` of the two (benchmarks/RESULTS.md, twelfth session: the
# copies cost ~0.37 ms per call at s1024).
#
#   bash benchmarks/odd_dims_session.sh            # every odd-dim entry (~40), ~4 min
#   MATCH='*d96*' bash benchmarks/odd_dims_session.sh
#
# Environment: MATCH (an entry glob), RUN_S (each run's deadline, default 100), TAG
# (default h200-<date>-odd). What comes back under $OUT: both perfdb files, logs.tgz.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
aot() { python -m aotattn.cli "$@"; }
select=(-g odd-dim)
[ -n "${MATCH:-}" ] && select+=(-m "$MATCH")
tag=${TAG:-h200-$(date -u +%Y%m%d)-odd}
for mode in copy kernel; do
  AOTATTN_PAD_HEADS=$mode aot perfmon images "${select[@]}" --arch sm_90 --out "build/img-odd-$mode" \
    --cache build/cache --jobs "$(nproc)" > "$OUT/images-$mode.log" 2>&1
  tail -n 1 "$OUT/images-$mode.log"
done
for mode in copy kernel; do
  AOTATTN_PAD_HEADS=$mode AOTATTN_IMAGES=$PWD/build/img-odd-$mode timeout $(( ${RUN_S:-100} + 120 )) \
    python -m aotattn.cli perfmon run --tag "$tag-$mode" --out "$OUT/$tag-$mode.txt" --deadline "${RUN_S:-100}" \
    "${select[@]}" > "$OUT/run-$mode.log" 2>&1
  grep -E "entries in" "$OUT/run-$mode.log"
  aot perfdb summary "$OUT/$tag-$mode.txt" > "$OUT/summary-$mode.log" 2>&1
  grep -E "odd-dim .*sdpa-flash" "$OUT/summary-$mode.log"
done
aot perfdb compare "$OUT/$tag-copy.txt" "$OUT/$tag-kernel.txt" > "$OUT/compare.log" 2>&1
sed -n '1,16p' "$OUT/compare.log"
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
ls "$OUT"
