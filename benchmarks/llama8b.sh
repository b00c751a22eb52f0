#!/usr/bin/env bash
# Llama 3.1-8B (or the 1B model) on one multi-GPU machine with the whole model compiled, in three stages, one a
# device call (each must fit the call's 10 minutes; docs/distributed.md, "Llama 3.1-8B on several GPUs"):
#   STAGE=recipes  every recipe of RECIPES under FSDP2 on NPROC GPUs, same init and batches: tokens/s per GPU,
#                  MFU, peak memory per GPU, and each recipe's training loss against the first recipe's
#   STAGE=scaling  one recipe at a fixed per-GPU batch on each GPU count of GPUS, FSDP2 and DDP (PARALLELS):
#                  tokens/s per GPU and its share of the fewest GPUs' rate (1 GPU: no wrapper)
#   STAGE=dcp      a distributed checkpoint saved on NPROC GPUs and resumed on NPROC/2, both timed
# Usage (repo root, on the GPU machine):
#   OUT=dir STAGE=recipes|scaling|dcp [DATA=folder | PARTS=/root/mx] [MODEL=llama3-8b] [NPROC=all GPUs]
#   [RECIPES=bf16,fp8,mxfp4-all-dh16,tseng] [RECIPE=mxfp4-all-dh16] [STEPS=60] [SEQ=8192] [MB=1]
#   [GPUS="1 2 4 8"] [PARALLELS="fsdp2 ddp"] [VOCAB=128256] [RUNS=/tmp/mx8b] [DEVICE=cuda] [RUN_BUDGET=540]
#   [EXTRA="--set k=v ..."] bash benchmarks/llama8b.sh
# DATA: a prepared folder; without it the corpus parts in PARTS are unpacked as benchmarks/study_gpu.sh does
# (docs/data.md, "Getting it to a GPU machine"). VOCAB: the model's embedding and head rows (model.vocab_size):
# Llama 3.1's 128,256 with any tokenizer; empty for the data's own. MB: sequences per GPU and micro-step; the
# global batch is MB x GPUs (one micro-step a step). Results: OUT/<run>.jsonl (metrics.jsonl of each run),
# OUT/log.txt (commands, exit codes, times), OUT/summary.json and OUT/summary.md (benchmarks/summarize_runs.py).
# Run folders go to RUNS and are deleted (an 8B checkpoint with its AdamW state is 96 GB).
set -uo pipefail
OUT=${OUT:?set OUT}; STAGE=${STAGE:?set STAGE to recipes, scaling or dcp}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (shared hosts; see the device docs); mxtrain.distributed sets these too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}; MODEL=${MODEL:-llama3-8b}; DEVICE=${DEVICE:-cuda}; RUNS=${RUNS:-/tmp/mx8b}
SEQ=${SEQ:-8192}; MB=${MB:-1}; STEPS=${STEPS:-60}
if [ -z "${VOCAB+x}" ]; then VOCAB=$([ "$MODEL" = llama3-8b ] && echo 128256); fi
if [ -z "${NPROC:-}" ]; then
  NPROC=$($PY -c 'import torch; print(max(torch.cuda.device_count(), 1))' 2>/dev/null || echo 1)
fi
mkdir -p "$OUT" "$RUNS"
PARTS=${PARTS:-/root/mx}
if [ -z "${DATA:-}" ]; then
  DATA=$PARTS/c32k
  if [ ! -f "$DATA/meta.json" ]; then
    ls "$PARTS"/corpus-32k.tar.xz.* >/dev/null 2>&1 || { echo "no DATA and no corpus parts in $PARTS" >&2; exit 2; }
    mkdir -p "$DATA"
    cat "$PARTS"/corpus-32k.tar.xz.* | $PY -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
      | tar -C "$DATA" -xf - || { echo "unpacking the corpus parts failed" >&2; exit 2; }
  fi
fi
{
  echo "=== stage $STAGE at $(date -u +%FT%TZ): model $MODEL vocab ${VOCAB:-data} seq $SEQ mb $MB nproc $NPROC data $DATA"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  $PY -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
} >> "$OUT/log.txt" 2>&1

run() {  # name nproc parallel steps recipe [extra train args...]; FOLDER: the run folder (default RUNS/name)
  local name=$1 n=$2 par=$3 steps=$4 recipe=$5; shift 5
  local folder=${FOLDER:-$RUNS/$name}
  local launch=(--nproc "$n" --parallel "$par")
  [ "$n" -le 1 ] && launch=(--parallel none)
  local vocab=()
  [ -n "$VOCAB" ] && vocab=(--set "model.vocab_size=$VOCAB")
  local t0
  t0=$(date +%s)
  local cmd=("$PY" -m mxtrain train --data "$DATA" --model "$MODEL" "${vocab[@]}" --recipe "$recipe"
             --steps "$steps" --batch-size $((MB * (n > 1 ? n : 1))) --micro-batch-size "$MB" --seq-len "$SEQ"
             --device "$DEVICE" --seed 0 --no-progress --eval-every 1000000 --eval-tokens $((SEQ * (n > 1 ? n : 1)))
             --set log.log_every=5 --set log.tensorboard=false --set train.compile=on
             --set train.checkpoint_minutes=0 --set train.final_checkpoint=false
             --set schedule.warmup_steps=$((steps / 4 + 1)) --set optim.lr=3e-4
             --out "$folder" "${launch[@]}" "$@" ${EXTRA:-})
  echo "=== $name: ${cmd[*]}" >> "$OUT/log.txt"
  timeout "${RUN_BUDGET:-540}" "${cmd[@]}" >> "$OUT/log.txt" 2>&1
  local rc=$?
  echo "=== $name rc=$rc wall=$(( $(date +%s) - t0 ))s" >> "$OUT/log.txt"
  cp "$folder/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  return $rc
}

case $STAGE in
  recipes)
    IFS=, read -ra RS <<< "${RECIPES:-bf16,fp8,mxfp4-all-dh16,tseng}"
    for r in "${RS[@]}"; do
      run "recipe-$r" "$NPROC" fsdp2 "$STEPS" "$r"
      rm -rf "${RUNS:?}/recipe-$r"
    done ;;
  scaling)
    for n in ${GPUS:-1 2 4 8}; do
      [ "$n" -gt "$NPROC" ] && continue
      if [ "$n" -eq 1 ]; then
        run "scale-n1" 1 none "$STEPS" "${RECIPE:-mxfp4-all-dh16}"; rm -rf "${RUNS:?}/scale-n1"; continue
      fi
      for p in ${PARALLELS:-fsdp2 ddp}; do
        run "scale-$p-n$n" "$n" "$p" "$STEPS" "${RECIPE:-mxfp4-all-dh16}"; rm -rf "${RUNS:?}/scale-$p-n$n"
      done
    done ;;
  dcp)   # the same global batch on both legs (an identity of the run): half the GPUs take 2 micro-steps
    half=$(( NPROC / 2 > 0 ? NPROC / 2 : 1 ))
    rm -rf "${RUNS:?}/dcp"
    sched=(--set schedule.warmup_steps=1 --set schedule.horizon_steps=$(( ${STEPS_SAVE:-3} + 2 )))
    if FOLDER=$RUNS/dcp run "dcp-save-n$NPROC" "$NPROC" fsdp2 "${STEPS_SAVE:-3}" "${RECIPE:-mxfp4-all-dh16}" \
        --set train.final_checkpoint=true "${sched[@]}"; then
      du -sh "$RUNS/dcp" >> "$OUT/log.txt" 2>&1
      FOLDER=$RUNS/dcp run "dcp-resume-n$half" "$half" fsdp2 $(( ${STEPS_SAVE:-3} + 2 )) "${RECIPE:-mxfp4-all-dh16}" \
        --batch-size $(( MB * NPROC )) --resume "$RUNS/dcp" "${sched[@]}"
    fi
    rm -rf "${RUNS:?}/dcp" ;;
  *) echo "STAGE must be recipes, scaling or dcp, not $STAGE" >&2; exit 2 ;;
esac
$PY benchmarks/summarize_runs.py "$OUT" >> "$OUT/log.txt" 2>&1
cat "$OUT/summary.md" 2>/dev/null
tail -4 "$OUT/log.txt"
