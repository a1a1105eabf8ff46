#!/usr/bin/env bash
# A warp-specialized kernel on the H200 in one device call, no PostgreSQL: its GPU tests;
# its cells tuned, then its operator table's (which kernel or backend per cell, timed with
# the kernel's tuned cells), exported into a copy of the tuning database; then perfmon of
# the dense bf16 entries from images with that copy, beside the peers. What comes back
# under $OUT: tuned.tgz (the copy's tables and patches: copy them into tuning/ after
# `aotattn tuning lint`), the perfdb run, logs.
#
#   bash benchmarks/ws_session.sh                   # the forward: attn_fwd_ws, flash.forward
#   WS=backward bash benchmarks/ws_session.sh       # the backward: attn_bwd_ws, flash.backward
#
# Environment: WS (forward | backward), WS_SEQLEN (1024,4096,16384: the kernel's cells; empty:
# no kernel cells, no GPU tests), WS_WHERE (the kernel's cells' other axes, e.g. "MASK=2":
# fewer functionals to compile), OP_SEQLEN (512..16384: the operator table's), OP_DTYPE
# (fp16,bf16), OP_HEAD_DIM (the backward's 64,128,256), OP_WHERE (the backward's other axes,
# default "DETERMINISTIC=False"), OP_PLAN_ARGS (more `aotattn tune plan` options; the padded
# backward cells: benchmarks/padded_ws_session.sh),
# TUNING_FROM (the database the copy starts from, default tuning/: another session's tuned
# copy chains two sessions in one call), TEST_S / WS_S / OP_S / RUN_S (deadlines: 150 (0: no
# GPU tests) / 300 / 150 / 100 s; WS_S counts the compile: the forward's 576 kernels took 132 s
# on 16 cores in the twenty-first session, whatever WS_SEQLEN, as every cell needs all 48
# configurations of its functional), SELECT (perfmon's selection, default "-g dense -m *bf16*";
# empty: no perfmon), TAG (h200-<date>-ws).
source "$(dirname "$0")/session_common.sh"

if [ "${WS:-forward}" = backward ]; then
  kernel=attn_bwd_ws operator=backward
  where=(--head-dim "${OP_HEAD_DIM:-64,128,256}" --where "${OP_WHERE:-DETERMINISTIC=False}")
  tests=tests/families/flash/test_backward_ws.py
else
  kernel=attn_fwd_ws operator=forward where=() tests=tests/families/flash/test_forward_ws.py
fi
work=build/ws-session
from=$(realpath "${TUNING_FROM:-tuning}")
rm -rf "$work" && mkdir -p "$work" && cp -r "$from" "$work/tuning"
if [ -n "${WS_SEQLEN-1024,4096,16384}" ]; then
if [ "${TEST_S:-150}" != 0 ]; then
  stamp "GPU tests of flash.$kernel (JIT)"
  AOTATTN_MODE=jit timeout -s INT -k 20 "${TEST_S:-150}" python -m pytest -m gpu -q -n 8 -p no:cacheprovider \
    "$tests" > "$OUT/ws-tests.log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/ws-tests.log" | head -n 10; tail -n 1 "$OUT/ws-tests.log"
fi

stamp "tune flash.$kernel"
ws_where=(); [ -n "${WS_WHERE:-}" ] && ws_where=(--where "$WS_WHERE")
aot tune plan -c "flash,$kernel" "${ws_where[@]}" --dtype fp16,bf16 --seqlen "${WS_SEQLEN:-1024,4096,16384}" \
  --tuning-db "$work/tuning" --out "$work/ws.jsonl" > "$OUT/plan.log" 2>&1
OUT=$PWD/$work/s1 AOTATTN_TUNING_DB=$PWD/$work/tuning bash benchmarks/tune_session.sh "$work/ws.jsonl" "$work/img1" \
  "${WS_S:-300}" --compile > "$OUT/tune-ws.log" 2>&1
tail -n 1 "$OUT/tune-ws.log"
aot tune export --arch sm_90 --tuning-db "$work/tuning" "$work/s1/results" > "$OUT/export-ws.log" 2>&1
tail -n 4 "$OUT/export-ws.log"
fi

stamp "tune flash.$operator (which kernel or backend per cell)"
read -r -a plan_args <<< "${OP_PLAN_ARGS:-}"
aot tune plan -c "flash,$operator" "${where[@]}" "${plan_args[@]}" --dtype "${OP_DTYPE:-fp16,bf16}" --seqlen "${OP_SEQLEN:-512,1024,2048,4096,8192,16384}" \
  --tuning-db "$work/tuning" --out "$work/op.jsonl" >> "$OUT/plan.log" 2>&1
OUT=$PWD/$work/s2 AOTATTN_TUNING_DB=$PWD/$work/tuning bash benchmarks/tune_session.sh "$work/op.jsonl" "$work/img2" \
  "${OP_S:-150}" --compile > "$OUT/tune-op.log" 2>&1
tail -n 1 "$OUT/tune-op.log"
aot tune export --arch sm_90 --tuning-db "$work/tuning" "$work/s2/results" > "$OUT/export-op.log" 2>&1
tail -n 4 "$OUT/export-op.log"
aot tuning lint --tuning-db "$work/tuning" | tail -n 1
tar czf "$OUT/tuned.tgz" -C "$work" tuning
tar czf "$OUT/slices.tgz" -C "$work" $(cd "$work" && ls -d s*/results s*/compile.log s*/worker-*.log 2>/dev/null)

SELECT=${SELECT--g dense -m *bf16*}
if [ -n "$SELECT" ] && [ $(( $(date +%s) - start )) -lt "${PERFMON_BEFORE_S:-420}" ]; then
  stamp "perfmon with the tuned copy: $SELECT"
  read -r -a select <<< "$SELECT"
  tag=${TAG:-h200-$(date -u +%Y%m%d)-ws}
  export AOTATTN_TUNING_DB=$PWD/$work/tuning
  aot perfmon images --arch sm_90 --out build/img-ws --cache build/cache --jobs "$(nproc)" "${select[@]}" \
    > "$OUT/images.log" 2>&1
  tail -n 1 "$OUT/images.log"
  AOTATTN_IMAGES=$PWD/build/img-ws timeout $(( ${RUN_S:-100} + 90 )) python -m aotattn.cli perfmon run --no-flex \
    --tag "$tag" --out "$OUT/$tag.txt" --deadline "${RUN_S:-100}" "${select[@]}" > "$OUT/run.log" 2>&1
  grep -E "entries in" "$OUT/run.log"
  aot perfdb summary "$OUT/$tag.txt" > "$OUT/summary.log" 2>&1
  head -n 30 "$OUT/summary.log"
fi
stamp "done"
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
ls "$OUT"
