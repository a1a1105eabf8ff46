#!/usr/bin/env bash
# The full image set's build time and size (issue 16), on the GPU host's CPUs:
#
#   CORES=16 bash benchmarks/build_timing.sh [IMAGES] [CACHE] [DEADLINE_S]
#
# Builds every kernel the tuning database names for sm_90 with CORES compiler processes
# pinned to CORES cores (nothing else should run meanwhile), stopping at DEADLINE_S
# (default 560, under the device tool's 10-minute limit). The build is incremental: on a
# warm machine, run it again with the same IMAGES and CACHE until its summary counts only cached kernels;
# the build time is the sum of the runs' wall times. Prints the kernel counts, the
# wall time and the archives' size; logs go to $OUT/build-timing.log.
set -uo pipefail
cores=${CORES:-16}
images=${1:-build/timing/images}
cache=${2:-build/timing/cache}
deadline=${3:-560}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" "$images" "$cache"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -m aotattn.cli build --arch sm_90 --dry-run | tail -n 1
start=$(date +%s)
timeout --signal=INT --kill-after=20 "$deadline" taskset -c "0-$((cores - 1))" \
  python -m aotattn.cli build --arch sm_90 --jobs "$cores" --out "$images" --cache "$cache" > "$OUT/build-timing.log" 2>&1
rc=$?
echo "build rc=$rc after $(( $(date +%s) - start )) s on $cores cores"
tail -n 8 "$OUT/build-timing.log" | grep -v "^\s*$"
echo "compiled kernels in the cache: $(find "$cache" -name '*.json' | wc -l)"
du -sh "$images" 2>/dev/null
