#!/usr/bin/env bash
# Where a kernel change's time goes, per kernel, in one device call (~1-2 min): for the tree
# with PATCH reversed ("base"), then the working tree ("new"), images of the backward's
# kernels for SHAPES, then benchmarks/profile_backward.py from them (each kernel's device
# time per backward, beside SDPA-flash's), and with NCU=1 Nsight Compute on the dK/dV kernel
# of the first shape (one launch, clocks left alone: --clock-control none, METHOD.md).
# Written for the tenth session's open question: the per-row stats change made d256 full
# backward 3-6% slower with fewer instructions per iteration (RESULTS.md).
#
#   git diff 637ad32 359a94b -- aotattn > ab.patch
#   SHAPES=d256-s4096-full,d256-s16384-full NCU=1 bash benchmarks/ab_profile.sh ab.patch
#
# What comes back under $OUT: profile-base.txt, profile-new.txt and, with NCU=1, ncu-*.txt.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 AOTATTN_MODE=aot
patch_file=${1:?usage: ab_profile.sh PATCH}
shapes=${SHAPES:-d256-s4096-full,d256-s16384-full}
select=(-g dense)
for shape in ${shapes//,/ }; do
  d=${shape%%-*}; rest=${shape#*-}; s=${rest%%-*}; mask=${rest#*-}
  select+=(-m "dense-bf16-$d-$s-$mask")
done
patch -p1 --dry-run -R < "$patch_file" > /dev/null || { echo "ab_profile: $patch_file does not reverse on this tree"; exit 2; }
first=${shapes%%,*}
for variant in base new; do
  if [ "$variant" = base ]; then patch -s -p1 -R < "$patch_file"; else patch -s -p1 < "$patch_file"; fi
  python -m aotattn.cli perfmon images --arch sm_90 --out "build/img-$variant" --cache build/cache \
    --jobs "$(nproc)" "${select[@]}" 2>&1 | tail -n 1
  export AOTATTN_IMAGES=$PWD/build/img-$variant
  timeout 240 python benchmarks/profile_backward.py --shapes "$shapes" > "$OUT/profile-$variant.txt" 2>&1
  grep -E "aotattn .* us, sdpa-flash" "$OUT/profile-$variant.txt"
  if [ "${NCU:-0}" = 1 ]; then
    timeout 240 ncu --clock-control none -k regex:attn_bwd_dkdv -c 1 --section SpeedOfLight \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
      python benchmarks/profile_backward.py --shapes "$first" > "$OUT/ncu-$variant.txt" 2>&1
    tail -n 5 "$OUT/ncu-$variant.txt"
  fi
done
ls "$OUT"
