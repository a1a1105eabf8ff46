#!/usr/bin/env bash
# Everything the GPU machine is for, in one call: the GPU test suite, then benchmarks.
# Logs go under $OUT (at most 8 files come back); a short summary is printed last.
#
#   bash benchmarks/gpu_session.sh [tests] [sweep] [bench] [features] [latency]   (default: all)
#
# The GPU tests run through Triton's JIT (TESTS_MODE=aot to use images); the AOT path is
# tested by tests/runtime/test_image_loader_gpu.py, which builds its images (carry build/cache to
# reuse what was compiled on the CPU machine).
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-tests sweep bench features latency}
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu,memory.used \
  --format=csv > "$OUT/env.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) AOTATTN_MODE=${TESTS_MODE:-jit} python -m pytest -m gpu -q -n 8 -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
           rc=$?; line=$(tail -n 1 "$OUT/tests.log") ;;
    latency) { bash benchmarks/build_gpu_subset.sh /tmp/aot-images && \
               python benchmarks/bench_latency.py --images /tmp/aot-images --json "$OUT/latency.json"; } \
               > "$OUT/latency.log" 2>&1
           rc=$?; line="see latency.log" ;;
    sweep) python benchmarks/sweep_configs.py > "$OUT/sweep.log" 2>&1
           rc=$?; line="see sweep.log" ;;
    bench) python benchmarks/bench_attention.py --passes "${BENCH_PASSES:-fwd}" ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"} \
             --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
           rc=$?; line="see bench.log" ;;
    features) python benchmarks/bench_features.py > "$OUT/features.log" 2>&1
           rc=$?; line="see features.log" ;;
    *) echo "unknown step $step"; continue ;;
  esac
  summary+=("$(printf '%-6s rc=%-3s %4ss  %s' "$step" "$rc" "$(( $(date +%s) - start ))" "$line")")
done

for step in $steps; do
  case $step in
    tests) grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20 ;;
    sweep) sed -n '/^best per shape/,$p' "$OUT/sweep.log" ;;
    bench) sed -n '/TFLOP\/s (ms)/,$p' "$OUT/bench.log" ;;
    features) tail -n 12 "$OUT/features.log" ;;
    latency) sed -n '/^first call/,$p' "$OUT/latency.log" ;;
  esac
done
printf '%s\n' "${summary[@]}"
