# Sourced by the GPU session scripts: strict pipes, the output folder $OUT, the import path,
# a clock for `stamp MESSAGE` lines and `aot` for the CLI.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }
