#!/usr/bin/env bash
# A/B of a kernel change on the H200 in one device call: perfmon from images for the tree
# with PATCH reversed ("base"), then for the working tree ("new"), then `perfdb compare base
# new`. Both runs time the same providers: aotattn alone, or every peer with PEERS=1 (twice
# the time). The tenth session's run of new with peers against base without read the long
# d256 forward entries 4-7% apart with unchanged code (RESULTS.md): compare like with like.
# PATCH is the change as `git diff` writes it (`git diff HEAD~1 > ab.patch`; an untracked
# file travels to the device); the tree ends as it started.
#
#   bash benchmarks/ab_patch.sh ab.patch -g dense -g gqa -m '*bf16*'
#
# Environment: PEERS (0), BASE_S and NEW_S (150 each): each run's --deadline; BASE_TAG, NEW_TAG;
# RUN_ARGS: more `perfmon run` options for both runs (e.g. "--hide-host-ms 1 --reps 10").
# What comes back under $OUT: both perfdb files, the comparison, the logs (one archive).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
patch_file=$1; shift
select=("$@")
day=$(date -u +%Y%m%d)
new_tag=${NEW_TAG:-h200-$day-new}; base_tag=${BASE_TAG:-h200-$day-base}
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
patch -p1 --dry-run -R < "$patch_file" > /dev/null || { echo "ab_patch: $patch_file does not reverse on this tree"; exit 2; }

run_variant() {  # name tag deadline peers...
  local name=$1 tag=$2 deadline=$3; shift 3
  aot perfmon images --arch sm_90 --out "build/img-$name" --cache build/cache --jobs "$(nproc)" "${select[@]}" \
    > "$OUT/images-$name.log" 2>&1
  stamp "images $name: $(tail -n 1 "$OUT/images-$name.log")"
  AOTATTN_IMAGES=$PWD/build/img-$name timeout $(( deadline + 120 )) python -m aotattn.cli perfmon run --tag "$tag" \
    --out "$OUT/$tag.txt" --deadline "$deadline" "$@" "${select[@]}" > "$OUT/run-$name.log" 2>&1
  stamp "perfmon $name: $(grep -E 'entries in' "$OUT/run-$name.log" | tail -n 1)"
}

patch -p1 -R < "$patch_file" > "$OUT/patch.log" 2>&1 || { stamp "patch -R failed"; cat "$OUT/patch.log"; exit 2; }
peers=(--no-peers); [ "${PEERS:-0}" = 1 ] && peers=()
read -r -a run_args <<< "${RUN_ARGS:-}"
peers+=("${run_args[@]}")
run_variant base "$base_tag" "${BASE_S:-150}" "${peers[@]}"
patch -p1 < "$patch_file" >> "$OUT/patch.log" 2>&1 || { stamp "patch failed"; cat "$OUT/patch.log"; exit 2; }
run_variant new "$new_tag" "${NEW_S:-150}" "${peers[@]}"
{ aot perfdb compare "$OUT/$base_tag.txt" "$OUT/$new_tag.txt"; aot perfdb summary "$OUT/$new_tag.txt"
  aot perfdb faults "$OUT/$new_tag.txt"; } > "$OUT/compare.log" 2>&1
grep -E "regression|improvement\(s\)" "$OUT/compare.log" | tail -n 3
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log)
ls "$OUT"
