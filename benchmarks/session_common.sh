# Sourced by the GPU session scripts: strict pipes, the output folder $OUT, the import path,
# a clock for `stamp MESSAGE` lines and `aot` for the CLI.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }

# `gpu_tests LOG SECONDS PYTEST_ARGS...`: GPU tests through the JIT into $OUT/LOG, stopped
# by SIGINT at the deadline (the summary still prints); the failures and the summary line
# are shown, and the script stops on a failure unless FORCE is set.
gpu_tests() {
  local log=$1 seconds=$2; shift 2
  AOTATTN_MODE=jit timeout -s INT -k 20 "$seconds" python -m pytest -m gpu -q -p no:cacheprovider "$@" \
    > "$OUT/$log" 2>&1
  grep -E "^(FAILED|ERROR)" "$OUT/$log" | head -n 10; tail -n 1 "$OUT/$log"
  if grep -qE "^(FAILED|ERROR)" "$OUT/$log" && [ -z "${FORCE:-}" ]; then
    stamp "a test fails: nothing more runs (FORCE=1 goes on)"; exit 1
  fi
}

# `bench_ws_backward SECONDS SHAPES`: benchmarks/bench_ws_backward.py into $OUT/bench-bwd.log, shown.
bench_ws_backward() {
  AOTATTN_MODE=jit timeout "$1" python benchmarks/bench_ws_backward.py --reps 10 --shapes "$2" \
    > "$OUT/bench-bwd.log" 2>&1
  cat "$OUT/bench-bwd.log"
}
