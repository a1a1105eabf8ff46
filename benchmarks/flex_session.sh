#!/usr/bin/env bash
# perfmon with FlexAttention on every entry it supports (`--flex-all`), beside every other
# peer, from images, in one device call; resumable over several calls. FlexAttention's
# graphs are compiled first in FLEX_JOBS processes (`perfmon run --flex-jobs`), then the
# entries are timed one at a time until RUN_S. The run's file is perfdb/sm_90/$TAG.txt: copy
# the returned one there (uncommitted files travel) and call again to go on with --resume.
#
#   TAG=h200-<date>-flex SELECT="-g dense -g model" bash benchmarks/flex_session.sh
#
# Environment: SELECT (perfmon's selection), RUN_S (perfmon's deadline, 300), FLEX_JOBS
# (12), CALL_S (560: the run is interrupted this long after the call began, so the file
# still comes back within a device call's 600 s), IMAGES (an image folder; built here with `perfmon images` when missing: carry
# build/img to skip that), RUN_ARGS (more `perfmon run` options; default --hide-host-ms 1).
source "$(dirname "$0")/session_common.sh"
read -r -a select <<< "${SELECT:--g dense -g model}"
read -r -a run_args <<< "${RUN_ARGS:---hide-host-ms 1}"
tag=${TAG:-h200-$(date -u +%Y%m%d)-flex}
images=${IMAGES:-build/img}
file=perfdb/sm_90/$tag.txt
if [ ! -d "$images" ]; then
  stamp "images of the entries"
  aot perfmon images --arch sm_90 --out "$images" --jobs "$(nproc)" "${select[@]}" > "$OUT/images.log" 2>&1
  tail -n 1 "$OUT/images.log"
fi
resume=()
[ -f "$file" ] && resume=(--resume)
stamp "perfmon run $tag ${resume[*]}"
AOTATTN_IMAGES=$PWD/$images timeout -s INT -k 10 $(( ${CALL_S:-560} - $(date +%s) + start )) python -m aotattn.cli perfmon run --flex-all \
  --flex-jobs "${FLEX_JOBS:-12}" --tag "$tag" --out "$file" --deadline "${RUN_S:-300}" "${resume[@]}" \
  "${run_args[@]}" "${select[@]}" 2>&1 | tee "$OUT/run.log" | grep -v "^ *$" | tail -n 60
cp "$file" "$OUT/"
aot perfdb summary "$file" > "$OUT/summary.log" 2>&1
stamp "done"
