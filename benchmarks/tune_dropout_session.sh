#!/usr/bin/env bash
# Dropout cells tuned on the H200 in one device call, no PostgreSQL: plan the tasks here
# (`aotattn tune plan --out`, offline), compile and run them (benchmarks/tune_session.sh),
# export the winners into a copy of the tuning database, then the dropout GPU tests and
# perfmon's dropout entries with that copy (benchmarks/dropout_session.sh). What comes back
# under $OUT: the results, the exported patches (tuned.tgz: copy them into tuning/ to land
# them, after `aotattn tuning lint`), the logs, the perfdb run and its comparisons.
#
#   bash benchmarks/tune_dropout_session.sh
#
# Environment: DTYPES (bf16), HEAD_DIMS (64,128), SEQLENS (512,1024,4096), TUNE_S (300: the
# tuning slice's deadline). A `tune plan` file runs with the default settings (8 candidates
# per cell; bf16 d64/d128 s512-4096: 84 tasks, ~1.5 GPU-minutes by the plan's estimate).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
work=build/tune-dropout
rm -rf "$work" && mkdir -p "$work"
python -m aotattn.cli tune plan -c flash,attn_fwd -c flash,attn_bwd_dkdv -c flash,attn_bwd_dq -c flash,attn_bwd_fused \
  -c flash,backward --where "DROPOUT=True MASK=0,2 PAD_HEAD=False VARLEN=False BIAS=0" --all-functionals \
  --dtype "${DTYPES:-bf16}" --head-dim "${HEAD_DIMS:-64,128}" --seqlen "${SEQLENS:-512,1024,4096}" \
  --limit 8 --out "$work/tasks.jsonl" > "$OUT/plan.log" 2>&1
tail -n 1 "$OUT/plan.log"
# the slice writes under its own $OUT; keep ours for what comes back
OUT=$PWD/$work/slice bash benchmarks/tune_session.sh "$work/tasks.jsonl" "$work/images" "${TUNE_S:-300}" --compile \
  > "$OUT/tune.log" 2>&1
tail -n 3 "$OUT/tune.log"
rm -rf "$work/tuning" && cp -r tuning "$work/tuning"
python -m aotattn.cli tune export --arch sm_90 --tuning-db "$work/tuning" "$work/slice/results" > "$OUT/export.log" 2>&1
cat "$OUT/export.log"
python -m aotattn.cli tuning lint --tuning-db "$work/tuning" | tail -n 1
tar czf "$OUT/tuned.tgz" -C "$work" tuning
tar czf "$OUT/slice.tgz" -C "$work/slice" results env.txt compile.log $(cd "$work/slice" && ls worker-*.log)
tag=h200-$(date -u +%Y%m%d)-dropout-tuned
AOTATTN_TUNING_DB=$PWD/$work/tuning TAG=$tag bash benchmarks/dropout_session.sh
# at most 8 files come back: the perfdb run, the patches, the slice, and every log in one archive
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
ls "$OUT"
