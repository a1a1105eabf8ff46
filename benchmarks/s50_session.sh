#!/usr/bin/env bash
# The fiftieth session's last device call, written for whichever card comes:
#
#   CALL_S=450 bash benchmarks/s50_session.sh   # run's timeout_s at least CALL_S
#
# CALL_S is the call's length: the before/after runs take what is left after the host time
# (~170 s on an H100: the image subset 80 s, the latency benchmark 90 s), and are left out
# below 140 s. On an H100 the fiftieth session ran it with CALL_S=270 (158 s, no host time).
# On an H200: issue 17's item 3 first (the image subset, then benchmarks/bench_latency.py: the
# first call and the host time per tiny call, which no H200 has measured since the eighteenth
# session). On any card, while the call has time: the d128/d256 forward tiles re-tuned on an H100
# in this session, checked where that session's perfmon run did not look (s2048, s16384 and the
# model shapes), the tables before (commit 5b76810's tuning/) and after, side by side.
source "$(dirname "$0")/session_common.sh"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
stamp "$gpu"
if [[ $gpu == *H200* ]]; then
  stamp "building the image subset"
  bash benchmarks/build_gpu_subset.sh /tmp/aot-images > "$OUT/build.log" 2>&1 || tail -n 5 "$OUT/build.log"
  stamp "latency"
  timeout 150 python benchmarks/bench_latency.py --images /tmp/aot-images --json "$OUT/latency.json" \
    > "$OUT/latency.log" 2>&1
  sed -n '/^first call/,$p' "$OUT/latency.log"
fi
left=$(( ${CALL_S:-280} - ($(date +%s) - start) ))
if [ "$left" -lt 140 ]; then
  stamp "perfmon before/after left out: $left s left"; exit 0
fi
select=(-m 'dense-*-d128-s2048-*' -m 'dense-*-d128-s16384-*' -m 'dense-*-d256-s2048-*' -m 'dense-*-d256-s16384-*' -m 'model-*')
mkdir -p build/old && git archive 5b76810 tuning | tar -x -C build/old || { stamp "no git history here"; exit 1; }
tag=$(echo "$gpu" | grep -q H200 && echo h200 || echo h100)-$(date -u +%Y%m%d)-s50
deadline=$(( (left - 40) / 2 - 15 ))
for side in old new; do
  db=$PWD/tuning; [ $side = old ] && db=$PWD/build/old/tuning
  stamp "perfmon, the $side tables ($deadline s)"
  AOTATTN_TUNING_DB=$db aot perfmon images --arch sm_90 --out "build/img-$side" --cache build/cache --jobs "$(nproc)" \
    "${select[@]}" > "$OUT/images-$side.log" 2>&1
  AOTATTN_TUNING_DB=$db AOTATTN_IMAGES=$PWD/build/img-$side timeout $(( deadline + 30 )) python -m aotattn.cli perfmon run \
    --tag "$tag-$side" --out "$OUT/$tag-$side.txt" --deadline "$deadline" --no-flex --hide-host-ms 1 "${select[@]}" \
    > "$OUT/run-$side.log" 2>&1
  grep -E "entries in" "$OUT/run-$side.log"
done
aot perfdb compare "$OUT/$tag-old.txt" "$OUT/$tag-new.txt" 2>&1 | tail -n 25
