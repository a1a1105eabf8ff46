#!/usr/bin/env bash
# The fifty-sixth session's device call, for whichever card comes (starts were scarce: one
# call may be all there is). CALL_S is the call's length (run's timeout_s at least CALL_S).
#
#   CALL_S=560 bash benchmarks/s56_session.sh
#
# On an H200: perfmon on the 24 GQA group-8 entries (the wide-group ws tiles tuned on an H100
# in the fifty-fifth session, never measured on an H200) beside SDPA-flash and cuDNN
# (benchmarks/perfmon_session.sh, ~250 s with the images), then the first half of the GPU
# suite (the backward and dropout files, which no H200 has run since the forty-eighth session)
# with what is left.
# On an H100 (the fifty-seventh session tuned the 48 untimed wide-group cells there, the
# fifty-ninth ran the whole suite there, the sixty-first the GPU mutants, 27/27 on the current
# floor): the long fuzz, its properties sharded over the eight workers (gpu_verify.sh fuzz,
# FUZZ_SHARDS=8), which no GPU has yet run to its end: the dropout property, on one worker,
# outlasted 470 s in the sixtieth and sixty-first sessions. The mutants, when wanted, need a call
# of their own on a fresh machine (a cold baseline took 350 s in the sixty-first session, the
# whole run ~480 s): `ADIFFS_S=0 MUTANTS_S=545 bash benchmarks/gpu_verify.sh mutants`.
# Carry build/cache from a CPU-machine `aotattn perfmon images ... --match 'gqa-*-g8-*'` and the
# H200's perfmon compiles nothing (85 kernels cached: 4 s).
source "$(dirname "$0")/session_common.sh"
pack() {  # a call returns at most 8 files: the logs travel in one archive
  (cd "$OUT" && find . -type f ! -name '*.tgz' ! -name '*.png' ! -path './perfdb/*' | tar czf logs56.tgz --remove-files -T -)
}
trap pack EXIT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
stamp "$gpu"
if [[ $gpu == *H200* ]]; then
  MATCH='gqa-*-g8-*' BUDGET=110 DEADLINE=200 RUN_ARGS="--hide-host-ms 1 --no-flex" \
    TAG=h200-$(date -u +%Y%m%d)-s56-gqa8 bash benchmarks/perfmon_session.sh 2>&1 | tail -n 45
else
  stamp "long fuzz, sharded (FUZZ_S=$(( ${CALL_S:-560} - 20 )))"
  FUZZ_S=$(( ${CALL_S:-560} - 20 )) bash benchmarks/gpu_verify.sh fuzz 2>&1 | grep -E "passed|failed|rc=" | tail -n 3
  exit 0
fi
left=$(( ${CALL_S:-560} - ($(date +%s) - start) - 25 ))
if [ "$left" -lt 200 ]; then
  stamp "the suite left out: $left s left"; exit 0
fi
stamp "GPU suite part 1 (SUITE_S=$left)"
SUITE_PART=1 SUITE_S=$left bash benchmarks/gpu_verify.sh suite 2>&1 | grep -E "passed|failed|error|FAILED|ERROR|rc=" | tail -n 15
