#!/usr/bin/env bash
# The sixty-second session's device call, for whichever card comes (CALL_S: the call's length,
# run's timeout_s at least CALL_S):
#
#   CALL_S=560 bash benchmarks/s62_session.sh
#
# First, on either card, the GPU tests of the files this session changed: the bias kernels now
# clamp finite biases beyond 2.3e38 before their base-2 product (test_bias.py, its new
# finfo-min tests at GPU sizes among them) and the checks refuse sparse and nested tensors
# (test_errors.py, test_varlen.py), through the JIT, 8 workers. Then benchmarks/s56_session.sh
# with what is left: on an H200 the g8 perfmon beside SDPA-flash and cuDNN and the suite's
# first part, on an H100 the sharded long fuzz. Carry build/cache from a CPU-machine
# `aotattn perfmon images ... --match 'gqa-*-g8-*'` (the session's kernels: the cache is keyed
# by their source).
source "$(dirname "$0")/session_common.sh"
stamp "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)"
stamp "the changed files' GPU tests"
FORCE=1 gpu_tests changed.log 150 -n 8 -rfE tests/families/flash/test_bias.py tests/families/flash/test_errors.py \
  tests/families/flash/test_varlen.py
left=$(( ${CALL_S:-560} - ($(date +%s) - start) ))
stamp "s56_session.sh in the $left s left"
CALL_S=$left bash benchmarks/s56_session.sh
