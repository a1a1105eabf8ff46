#!/usr/bin/env bash
# Some cells re-tuned on the H200 in one device call, no PostgreSQL, then perfmon with the
# result: plan the tasks (`aotattn tune plan --out`, the arguments after `--`), compile and
# run them (benchmarks/tune_session.sh), export the winners into a copy of the tuning
# database, build images with it and time the perfmon entries SELECT names (every provider
# beside aotattn). What comes back under $OUT: tuned.tgz (the copy's tables and patches:
# copy them into tuning/ to land them, after `aotattn tuning lint`), the perfdb run, logs.
#
#   SELECT="-g dense -m *d64*" bash benchmarks/tune_cells_session.sh -- -c flash,attn_bwd_dkdv \
#       --dtype fp16,bf16 --head-dim 64 --seqlen 512,1024 --limit 16
#
# Environment: SELECT (perfmon's selection; empty: no perfmon run), TUNE_S (200: the slice's
# deadline), RUN_S (120: perfmon's deadline), TAG (h200-<date>-retuned).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ "${1:-}" = "--" ] && shift
work=build/tune-cells
rm -rf "$work" && mkdir -p "$work"
aot() { python -m aotattn.cli "$@"; }
aot tune plan "$@" --out "$work/tasks.jsonl" > "$OUT/plan.log" 2>&1
tail -n 2 "$OUT/plan.log"
OUT=$PWD/$work/slice bash benchmarks/tune_session.sh "$work/tasks.jsonl" "$work/images" "${TUNE_S:-200}" --compile \
  > "$OUT/tune.log" 2>&1
tail -n 2 "$OUT/tune.log"
cp -r tuning "$work/tuning"
aot tune export --arch sm_90 --tuning-db "$work/tuning" "$work/slice/results" > "$OUT/export.log" 2>&1
cat "$OUT/export.log"
aot tuning lint --tuning-db "$work/tuning" | tail -n 1
tar czf "$OUT/tuned.tgz" -C "$work" tuning
tar czf "$OUT/slice.tgz" -C "$work/slice" results env.txt compile.log $(cd "$work/slice" && ls worker-*.log)
if [ -n "${SELECT:-}" ]; then
  read -r -a select <<< "$SELECT"
  tag=${TAG:-h200-$(date -u +%Y%m%d)-retuned}
  export AOTATTN_TUNING_DB=$PWD/$work/tuning
  aot perfmon images --arch sm_90 --out build/img-retuned --cache build/cache --jobs "$(nproc)" "${select[@]}" \
    > "$OUT/images.log" 2>&1
  tail -n 1 "$OUT/images.log"
  AOTATTN_IMAGES=$PWD/build/img-retuned timeout $(( ${RUN_S:-120} + 120 )) python -m aotattn.cli perfmon run \
    --tag "$tag" --out "$OUT/$tag.txt" --deadline "${RUN_S:-120}" "${select[@]}" > "$OUT/run.log" 2>&1
  grep -E "entries in" "$OUT/run.log"
  aot perfdb summary "$OUT/$tag.txt" > "$OUT/summary.log" 2>&1
fi
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
ls "$OUT"
