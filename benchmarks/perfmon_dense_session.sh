#!/usr/bin/env bash
# perfmon of the dense bf16 entries from images with the committed tables, beside the peers
# (no FlexAttention), compared with an earlier run; then the first-call and host-time
# benchmark from images. One device call (~8 min); the perfdb run and logs go under $OUT.
#
#   TAG=h200-<date>-<what> BEFORE=perfdb/sm_90/<earlier run>.txt bash benchmarks/perfmon_dense_session.sh
#
# Environment: SELECT (default "-g dense -m *bf16*"), RUN_S (perfmon's deadline, 150),
# LATENCY (1: also benchmarks/bench_latency.py from the image subset; 0: not).
source "$(dirname "$0")/session_common.sh"
read -r -a select <<< "${SELECT:--g dense -m *bf16*}"
tag=${TAG:-h200-$(date -u +%Y%m%d)-dense}
stamp "images of the entries"
aot perfmon images --arch sm_90 --out build/img-dense --jobs "$(nproc)" "${select[@]}" > "$OUT/images.log" 2>&1
tail -n 1 "$OUT/images.log"
stamp "perfmon run $tag"
AOTATTN_IMAGES=$PWD/build/img-dense timeout $(( ${RUN_S:-150} + 90 )) python -m aotattn.cli perfmon run --no-flex \
  --tag "$tag" --out "$OUT/$tag.txt" --deadline "${RUN_S:-150}" "${select[@]}" > "$OUT/run.log" 2>&1
grep -E "entries in" "$OUT/run.log"
aot perfdb summary "$OUT/$tag.txt" > "$OUT/summary.log" 2>&1; head -n 40 "$OUT/summary.log"
if [ -n "${BEFORE:-}" ]; then
  aot perfdb compare "$BEFORE" "$OUT/$tag.txt" > "$OUT/compare.log" 2>&1; head -n 40 "$OUT/compare.log"
fi
if [ "${LATENCY:-1}" = 1 ]; then
  stamp "first call and host time (images)"
  bash benchmarks/build_gpu_subset.sh /tmp/aot-images > "$OUT/build.log" 2>&1 || tail -n 5 "$OUT/build.log"
  timeout 150 python benchmarks/bench_latency.py --images /tmp/aot-images --json "$OUT/latency.json" \
    > "$OUT/latency.log" 2>&1
  grep -E "first call|images\)|JIT|SDPA  |host time|part by part|back to back" "$OUT/latency.log" | head -n 12
fi
stamp "done"
