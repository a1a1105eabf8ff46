#!/usr/bin/env bash
# perfmon on the H200 in direct mode (one GPU, no database): every declared entry,
# timed through the unforced operator, each forced backend and the peers, into a perfdb
# file, within one device call (< 10 min; `aotattn perfmon list --budget 330` shows the
# estimate). Logs, the perfdb file and the plots go under $OUT.
#
#   bash benchmarks/perfmon_session.sh [images] [run] [report] [badpatch]   (default: images run report)
#
#   images    compile exactly the kernels the entries load (both backward backends), on the
#             host's cores; carry build/cache from a CPU-machine `aotattn perfmon images` to skip it
#   run       `aotattn perfmon run --resume`: a run cut short by the deadline is completed by
#             calling the script again on the same (warm) machine
#   report    faults, the summary against the peers, plots (if matplotlib is installed there)
#   badpatch  the demonstration of issue 15: small dK/dV and dQ tiles for bf16 d128 in a copy
#             of the tuning database, the d128 bf16 entries measured with it, then compare and faults
#
# Environment: TAG (default h200-<date>), BUDGET (estimated GPU seconds to size the
# repetitions to, default 330), DEADLINE (start no entry after this many seconds, default
# 420), JOBS (compiler processes, default all cores), MATCH (an entry glob, default all),
# RUN_ARGS (more `perfmon run` options, e.g. "--hide-host-ms 1 --no-flex").
# State kept between calls lives in build/perfmon/ (ignored by git, kept on a warm machine).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/perfdb/sm_90"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
TAG=${TAG:-h200-$(date -u +%Y%m%d)}
BUDGET=${BUDGET:-330}
DEADLINE=${DEADLINE:-420}
JOBS=${JOBS:-$(nproc)}
STATE=build/perfmon
IMAGES=$STATE/images
RUN_FILE=$STATE/$TAG.txt
select_args=()
[ -n "${MATCH:-}" ] && select_args=(--match "$MATCH")
read -r -a run_args <<< "${RUN_ARGS:-}"  # as tune_cells_session.sh: words, never globbed
steps=${*:-images run report}
summary=()
aot() { python -m aotattn.cli "$@"; }
mkdir -p "$STATE"

# the clocks and load before the run (the perfdb header records versions, GPU and tuning revision)
{ nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu,memory.used --format=csv
  aot info; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for step in $steps; do
  start=$(date +%s)
  case $step in
    images)
      aot perfmon images --arch sm_90 --out "$IMAGES" --cache build/cache --jobs "$JOBS" "${select_args[@]}" \
        > "$OUT/images.log" 2>&1
      rc=$?; line=$(tail -n 1 "$OUT/images.log") ;;
    run)
      AOTATTN_IMAGES=$IMAGES aot perfmon run --tag "$TAG" --out "$RUN_FILE" --resume --budget "$BUDGET" \
        --deadline "$DEADLINE" "${run_args[@]}" "${select_args[@]}" > "$OUT/run.log" 2>&1
      rc=$?; line=$(grep -E "entries in [0-9]+ s" "$OUT/run.log" | tail -n 1)
      cp "$RUN_FILE" "$OUT/perfdb/sm_90/$TAG.txt" 2>/dev/null ;;
    report)
      { aot perfdb faults "$RUN_FILE"; aot perfdb summary "$RUN_FILE"
        for dtype in bf16 fp16; do
          aot perfdb plot "$RUN_FILE" --dtype "$dtype" --out "$OUT/$TAG.dense-$dtype.png" \
            || echo "no $dtype plot here (see above; without matplotlib: aotattn perfdb plot on the CPU machine)"
        done; } > "$OUT/report.log" 2>&1
      rc=$?; line="see report.log" ;;
    badpatch)
      BAD=$STATE/tuning-bad
      rm -rf "$BAD" && cp -r tuning "$BAD"
      bad_select=(--match 'dense-bf16-d128-*')
      { aot perfmon bad-patch --tuning-db "$BAD" \
        && AOTATTN_TUNING_DB=$BAD aot perfmon images --arch sm_90 --out "$STATE/images-bad" --cache build/cache \
             --jobs "$JOBS" "${bad_select[@]}" \
        && AOTATTN_TUNING_DB=$BAD AOTATTN_IMAGES=$STATE/images-bad aot perfmon run --tag "$TAG-badpatch" \
             --out "$STATE/$TAG-badpatch.txt" --force --no-peers --reps 3 "${bad_select[@]}"
        cp "$STATE/$TAG-badpatch.txt" "$OUT/perfdb/sm_90/$TAG-badpatch.txt"
        aot perfdb compare "$RUN_FILE" "$STATE/$TAG-badpatch.txt" --provider all
        aot perfdb faults "$STATE/$TAG-badpatch.txt"; } > "$OUT/badpatch.log" 2>&1
      rc=$?; line=$(grep -E "regression\(s\)" "$OUT/badpatch.log" | tail -n 1) ;;
    *) echo "unknown step $step"; continue ;;
  esac
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$step" "$rc" "$(( $(date +%s) - start ))" "$line")")
done

for step in $steps; do
  case $step in
    run) grep -E "^\s+\S+ (fwd|bwd|fwdbwd) aotattn" "$OUT/run.log" | head -n 20 ;;
    report) grep -vE "^\s*$" "$OUT/report.log" | head -n 60 ;;
    badpatch) grep -E "regression|fault|speed" "$OUT/badpatch.log" | head -n 30 ;;
  esac
done
printf '%s\n' "${summary[@]}"
