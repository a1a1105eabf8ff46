#!/usr/bin/env bash
# Some cells re-tuned on the H200 in one device call, no PostgreSQL, then perfmon with the
# result: plan the tasks (`aotattn tune plan --out`, the arguments after `--`), compile and
# run them (benchmarks/tune_session.sh), export the winners into a copy of the tuning
# database, build images with it and time the perfmon entries SELECT names (every provider
# beside aotattn). What comes back under $OUT: tuned.tgz (the copy's tables and patches:
# copy them into tuning/ to land them, after `aotattn tuning lint`), slice.tgz (every
# stage's results), the perfdb run, logs.tgz: four files (a device call returns at most 8).
#
#   SELECT="-g dense -m *d64*" bash benchmarks/tune_cells_session.sh -- -c flash,attn_bwd_dkdv \
#       --dtype fp16,bf16 --head-dim 64 --seqlen 512,1024 --limit 16
#
# A stage may also be one task file (`tune plan --out`, filtered to chosen cells; carry it):
#
#   bash benchmarks/tune_cells_session.sh -- build/tasks/ws.jsonl --then build/tasks/backward.jsonl
#
# Stages: `--then` starts another selection, planned, timed and exported on the copy the
# previous stage exported into (kernel tiles first, then the operator's choice between
# kernels on those tiles):
#
#   bash benchmarks/tune_cells_session.sh -- --all-functionals -c flash,attn_bwd_ws \
#       --where PAD_HEAD=True --head-dim 256 --then --all-functionals -c flash,backward \
#       --where "PAD_HEAD=True DETERMINISTIC=False" --head-dim 256
#
# The cells timed on other problems than today's settings time (`tune plan --stale`, e.g. the
# grouped backward tiles timed at 40 MiB before the 128 MiB floor; a stage with none is skipped):
#
#   bash benchmarks/tune_cells_session.sh -- --all-functionals -c flash,attn_bwd_ws --where GROUPED=True --stale
#
# Environment: UNMASK (1: export with --unmask, taking the tuned cells out of later hand
# patches, so a hand patch's choice is timed as the current one and then replaced, and the
# copy in tuned.tgz has the patches as they should land; deleted ones: `git rm` them),
# DROP (patch file names under tuning/nvidia/sm_90/ left out of the copy: hand
# patches over the cells tuned, which would mask the export; their choices go untimed), SELECT (perfmon's selection;
# empty: no perfmon run), TUNE_S (200: each stage's
# deadline, compile included), RUN_S (120: perfmon's deadline), TAG (h200-<date>-retuned),
# RUN_ARGS (more `perfmon run` options, e.g. "--hide-host-ms 1"), RUN_EXTRA_S (120: perfmon is stopped
# this long after its deadline; add the FlexAttention compile with "--flex-all --flex-jobs N"),
# BASE (a git revision: perfmon also times SELECT on that revision's tuning/ first, in the same
# call, and `perfdb compare` prints base against tuned; the base run is $TAG-base.txt).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
[ "${1:-}" = "--" ] && shift
work=build/tune-cells
rm -rf "$work" && mkdir -p "$work"
cp -r tuning "$work/tuning"
for patch in ${DROP:-}; do  # hand patches over the cells being tuned: a later layer would mask the export
  rm -v "$work/tuning/nvidia/sm_90/$patch"
done
export AOTATTN_TUNING_DB=$PWD/$work/tuning  # every stage plans, compiles and times on the copy
aot() { python -m aotattn.cli "$@"; }

stage() {  # n, then the plan's arguments
  local n=$1; shift
  local dir=$work/stage-$n
  mkdir -p "$dir"
  if [ $# -eq 1 ] && [ -f "$1" ]; then  # a task file planned beforehand (carried), e.g. chosen cells only
    cp "$1" "$dir/tasks.jsonl" && echo "stage $n: $(wc -l < "$1") tasks from $1" | tee "$OUT/plan-$n.log"
  else
    aot tune plan "$@" --out "$dir/tasks.jsonl" > "$OUT/plan-$n.log" 2>&1
    tail -n 2 "$OUT/plan-$n.log"
  fi
  if [ ! -s "$dir/tasks.jsonl" ]; then  # e.g. `--stale` with every selected cell up to date
    echo "stage $n: no task planned, nothing tuned" && return 0
  fi
  OUT=$PWD/$dir/slice bash benchmarks/tune_session.sh "$dir/tasks.jsonl" "$dir/images" "${TUNE_S:-200}" --compile \
    > "$OUT/tune-$n.log" 2>&1
  tail -n 2 "$OUT/tune-$n.log"
  aot tune export --arch sm_90 --tuning-db "$work/tuning" ${UNMASK:+--unmask} "$dir/slice/results" > "$OUT/export-$n.log" 2>&1
  cat "$OUT/export-$n.log"
  aot tuning lint --tuning-db "$work/tuning" | tail -n 1
}

n=1 args=()
for arg in "$@"; do
  if [ "$arg" = "--then" ]; then
    stage "$n" "${args[@]}"; n=$((n + 1)) args=()
  else
    args+=("$arg")
  fi
done
stage "$n" "${args[@]}"
tar czf "$OUT/tuned.tgz" -C "$work" tuning
slices=$(cd "$work" && ls -d stage-*/slice/results stage-*/slice/*.log stage-*/slice/env.txt 2>/dev/null)
[ -n "$slices" ] && tar czf "$OUT/slice.tgz" -C "$work" $slices

perfmon() {  # tables, tag, images folder, log suffix
  AOTATTN_TUNING_DB=$1 aot perfmon images --arch sm_90 --out "$3" --cache build/cache --jobs "$(nproc)" \
    "${select[@]}" > "$OUT/images$4.log" 2>&1
  tail -n 1 "$OUT/images$4.log"
  AOTATTN_TUNING_DB=$1 AOTATTN_IMAGES=$PWD/$3 timeout $(( ${RUN_S:-120} + ${RUN_EXTRA_S:-120} )) \
    python -m aotattn.cli perfmon run --tag "$2" --out "$OUT/$2.txt" --deadline "${RUN_S:-120}" "${run_args[@]}" \
    "${select[@]}" > "$OUT/run$4.log" 2>&1
  grep -E "entries in" "$OUT/run$4.log"
}

if [ -n "${SELECT:-}" ]; then
  read -r -a select <<< "$SELECT"
  read -r -a run_args <<< "${RUN_ARGS:-}"
  tag=${TAG:-h200-$(date -u +%Y%m%d)-retuned}
  if [ -n "${BASE:-}" ]; then  # the same entries on BASE's tables first, in this process' machine
    rm -rf build/base && mkdir -p build/base && git archive "$BASE" tuning | tar -x -C build/base
    perfmon "$PWD/build/base/tuning" "$tag-base" build/img-base -base
  fi
  perfmon "$PWD/$work/tuning" "$tag" build/img-retuned ""
  aot perfdb summary "$OUT/$tag.txt" > "$OUT/summary.log" 2>&1
  if [ -n "${BASE:-}" ]; then
    aot perfdb compare "$OUT/$tag-base.txt" "$OUT/$tag.txt" > "$OUT/compare.log" 2>&1
    tail -n 30 "$OUT/compare.log"
  fi
fi
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
ls "$OUT"
