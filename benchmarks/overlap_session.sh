#!/usr/bin/env bash
# The forward's OVERLAP knob on the H200, one device call (< 10 min): the GPU tests of the
# knob, then every cell's tuned forward tiles against the same tiles with OVERLAP=1, both
# from images, side by side in one process (benchmarks/bench_overlap.py).
#
#   bash benchmarks/overlap_session.sh            (logs and the JSON rows under $OUT)
#
# The OVERLAP=1 images come from a copy of the tuning database whose forward
# configurations all say OVERLAP=1 (build/tuning-overlap); both builds go into one image
# folder (an archive keeps what it held: aotattn/compiler/builder.pack). Environment:
# DTYPES (default bf16,fp16), HEAD_DIMS (64,128,256), SEQLENS (512,...,16384).
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
aot() { python -m aotattn.cli "$@"; }
DB=build/tuning-overlap IMAGES=build/img-overlap
rm -rf "$DB" && cp -r tuning "$DB"
python - "$DB" <<'EOF'
import pathlib, sys
for path in pathlib.Path(sys.argv[1]).glob("nvidia/sm_90/flash.attn_fwd*"):
    lines, in_configs = [], False
    for line in path.read_text().splitlines():
        if line.startswith("["):
            in_configs = line.strip() == "[configs]"
        elif in_configs and "=" in line and "OVERLAP" not in line:
            line += " OVERLAP=1"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
EOF
aot tuning lint --tuning-db "$DB" > "$OUT/lint.log" 2>&1 || { echo "the OVERLAP=1 database does not lint:"; tail -n 5 "$OUT/lint.log"; }
where="PAD_HEAD=False VARLEN=False DROPOUT=False BIAS=0"
for db in tuning "$DB"; do
  aot build --arch sm_90 --kernel attn_fwd --where "$where" --tuning-db "$db" --out "$IMAGES" --jobs "$(nproc)" \
    > "$OUT/build-$(basename "$db").log" 2>&1
  stamp "images from $db: $(tail -n 1 "$OUT/build-$(basename "$db").log")"
done
AOTATTN_MODE=jit timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/families/flash/test_overlap.py \
  > "$OUT/tests.log" 2>&1
stamp "GPU tests: $(tail -n 1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 10
left=$(( 560 - ($(date +%s) - t0) ))
AOTATTN_MODE=aot AOTATTN_IMAGES=$IMAGES timeout "$left" python benchmarks/bench_overlap.py \
  --dtype "${DTYPES:-bf16,fp16}" --head-dim "${HEAD_DIMS:-64,128,256}" \
  --seqlen "${SEQLENS:-512,1024,2048,4096,8192,16384}" --json "$OUT/overlap.json" 2>&1 | tee "$OUT/bench.log" | tail -n 80
stamp done
