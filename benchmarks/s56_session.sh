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
# On an H100: the 48 wide-group ws cells at s <= 512 that no tuner has timed
# (benchmarks/tune_cells_session.sh, ~200 s), then the same half of the GPU suite on the
# tables that tuning exported (the tuned choices through the suite, not only the tuner's check).
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
  mkdir -p "$OUT/tune"
  OUT=$OUT/tune UNMASK=1 TUNE_S=240 bash benchmarks/tune_cells_session.sh -- --all-functionals \
    -c flash,attn_bwd_ws --where "WIDE_GROUPS=True PAD_HEAD=False" --head-dim 64,128 --untimed 2>&1 | tail -n 25
  if [ -d build/tune-cells/tuning ]; then  # the checkout's tuning/ stays as it is
    export AOTATTN_TUNING_DB=$PWD/build/tune-cells/tuning && stamp "the suite runs on the exported tables"
  fi
fi
left=$(( ${CALL_S:-560} - ($(date +%s) - start) - 25 ))
if [ "$left" -lt 200 ]; then
  stamp "the suite left out: $left s left"; exit 0
fi
stamp "GPU suite part 1 (SUITE_S=$left)"
SUITE_PART=1 SUITE_S=$left bash benchmarks/gpu_verify.sh suite 2>&1 | grep -E "passed|failed|error|FAILED|ERROR|rc=" | tail -n 15
