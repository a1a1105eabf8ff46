#!/usr/bin/env bash
# One tuning slice on the GPU host (no network, no PostgreSQL): run an offline batch of
# tune tasks with one worker per GPU until the batch is done or the deadline passes.
# Results and logs go under $OUT; see docs/tuner.md, "A GPU slice", for the CPU side.
#
#   bash benchmarks/tune_session.sh BATCH IMAGES [DEADLINE_S]
#
# BATCH: a pgdef batch (`aotattn tune checkout`) or a JSON-lines task file (`aotattn tune
# plan --out`); IMAGES: the image folder `aotattn tune compile` filled (or `--compile` as
# the 4th argument to compile it here first, with every core). DEADLINE_S (default 480)
# bounds the whole call: workers start no task after it and are stopped at it; a stopped
# task leaves its journal, and the next slice resumes it.
set -uo pipefail
batch=${1:?usage: tune_session.sh BATCH IMAGES [DEADLINE_S] [--compile]}
images=${2:?usage: tune_session.sh BATCH IMAGES [DEADLINE_S] [--compile]}
deadline=${3:-480}
compile=${4:-}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/results" "$OUT/journal"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export AOTATTN_IMAGES=$(realpath -m "$images") AOTATTN_TUNE_JOURNAL=$OUT/journal AOTATTN_MODE=aot
start=$(date +%s)

nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,memory.used \
  --format=csv > "$OUT/env.txt" 2>&1
python -c "import torch, aotattn; print('torch', torch.__version__, 'aotattn', aotattn.__version__)" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$compile" = "--compile" ]; then
  python -m aotattn.cli tune compile "$batch" --images "$images" --jobs "$(nproc)" > "$OUT/compile.log" 2>&1
  tail -n 2 "$OUT/compile.log"
fi

gpus=$(nvidia-smi -L | wc -l)
first=${FIRST_GPU:-0}  # workers on GPUs first .. first+gpus-1 (GPUS=1 FIRST_GPU=1: the second GPU alone)
gpus=${GPUS:-$gpus}
worker() {  # one GPU: rerun after a lost device (exit 3) while time is left
  local gpu=$1 rc=0
  while :; do
    local left=$(( deadline - ($(date +%s) - start) ))
    [ "$left" -le 5 ] && break
    CUDA_VISIBLE_DEVICES=$(( first + gpu )) timeout --signal=TERM --kill-after=10 "$left" \
      python -m aotattn.tune.offline "$batch" --results "$OUT/results" --shard "$gpu/$gpus" --gpu "$gpu" \
      --deadline-s "$(( left - 20 ))" >> "$OUT/worker-$gpu.log" 2>&1
    rc=$?
    [ "$rc" -eq 3 ] || break
    echo "worker $gpu: device lost, restarting (the task resumes from its journal)" >> "$OUT/worker-$gpu.log"
  done
  echo "worker $gpu: exit $rc after $(( $(date +%s) - start )) s" >> "$OUT/worker-$gpu.log"
}
for ((gpu = 0; gpu < gpus; gpu++)); do worker "$gpu" & done
wait

for ((gpu = 0; gpu < gpus; gpu++)); do tail -n 3 "$OUT/worker-$gpu.log"; done
done_tasks=$(cat "$OUT"/results/results-*.jsonl 2>/dev/null | grep -c '"task_id"')
[ "$done_tasks" -gt 0 ] || done_tasks=$(ls "$OUT"/results/*.json 2>/dev/null | wc -l)
echo "tune slice: $done_tasks task results under $OUT/results, $gpus GPU(s), $(( $(date +%s) - start )) s"
