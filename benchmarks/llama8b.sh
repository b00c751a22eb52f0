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
#   [RECIPES=bf16,mxfp4-all-dh16] [RECIPE=mxfp4-all-dh16] [STEPS=60] [SEQ=8192] [MB=1] [GPUS="1 2 4 8"]
#   [PARALLELS="fsdp2 ddp"] [RESUME_NPROC=NPROC/2] [VOCAB=128256] [RUNS=/tmp/mx8b] [DEVICE=cuda]
#   [STAGE_BUDGET=560] [EXTRA="--set k=v ..."] bash benchmarks/llama8b.sh
# EXTRA="--set log.profile_steps=21-23": OUT/<run>-profile.tgz holds every rank's profile report (top operators,
# step wall times) and rank 0's trace; EXTRA="--set train.gc_every=N" collects garbage in step on every rank.
# STAGE_BUDGET: seconds for the whole stage; each run gets what is left (SIGKILL at the deadline: no checkpoint
# is written), a run with under a minute left is skipped. Two 8B recipes fit a call: name the others in the next.
# llama3-8b skips what cannot hold it: one GPU and DDP (128 GB of fp32 weights, gradients and AdamW moments);
# RESUME_NPROC must hold it too (on H100s at least 4).
# DATA: a prepared folder; without it the corpus parts carried under data/ship gather in PARTS and are unpacked
# once all are there (benchmarks/unpack_corpus.sh; exit status 3 until then)
# (docs/data.md, "Getting it to a GPU machine"). VOCAB: the model's embedding and head rows (model.vocab_size):
# Llama 3.1's 128,256 with any tokenizer; empty for the data's own. MB: sequences per GPU and micro-step; the
# global batch is MB x GPUs (one micro-step a step). Results: OUT/<run>.jsonl (metrics.jsonl of each run),
# OUT/log.txt (commands, exit codes, times), OUT/summary.json and OUT/summary.md (benchmarks/summarize_runs.py,
# written after every run).
# Run folders go to RUNS and are deleted (an 8B checkpoint with its AdamW state is 96 GB).
set -uo pipefail
OUT=${OUT:?set OUT}; STAGE=${STAGE:?set STAGE to recipes, scaling or dcp}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off (shared hosts; see the device docs); mxtrain.train.parallel sets these too.
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
  PY=$PY bash benchmarks/unpack_corpus.sh "$PARTS" "$DATA" || exit $?   # 3: parts still to carry
fi
{
  echo "=== stage $STAGE at $(date -u +%FT%TZ): model $MODEL vocab ${VOCAB:-data} seq $SEQ mb $MB nproc $NPROC data $DATA"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  $PY -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
} >> "$OUT/log.txt" 2>&1

T_END=$(( $(date +%s) + ${STAGE_BUDGET:-560} ))   # the whole stage ends in time for the call's 10 minutes

stop_run() {  # kill every process of a run (torchrun's workers live in sessions of their own) and wait
  pkill -KILL -f -- "--out $1( |$)" 2>/dev/null
  local i
  for i in $(seq 60); do pgrep -f -- "--out $1( |$)" >/dev/null || return 0; sleep 1; done
}

run() {  # name nproc parallel steps recipe [extra train args...]; FOLDER: the run folder (default RUNS/name),
         # RESUME=1: continue the run in FOLDER (else FOLDER is emptied first)
  local name=$1 n=$2 par=$3 steps=$4 recipe=$5; shift 5
  local folder=${FOLDER:-$RUNS/$name}
  local left=$(( T_END - $(date +%s) ))
  if [ "$left" -lt 60 ]; then echo "=== $name skipped: ${left}s left of the stage" >> "$OUT/log.txt"; return 3; fi
  [ -n "${RESUME:-}" ] || rm -rf "$folder"
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
             "${launch[@]}" "$@" ${EXTRA:-} --out "$folder")
  echo "=== $name: ${cmd[*]}" >> "$OUT/log.txt"
  # SIGKILL at the deadline: a SIGTERM would make every rank write a checkpoint first (96 GB at 8B)
  timeout -s KILL "$left" "${cmd[@]}" >> "$OUT/log.txt" 2>&1
  local rc=$?
  stop_run "$folder"
  echo "=== $name rc=$rc wall=$(( $(date +%s) - t0 ))s" >> "$OUT/log.txt"
  # a resumed leg's file holds its first leg's rows too: kept only when the resume ran
  if [ -z "${RESUME:-}" ] || [ "$rc" -eq 0 ]; then cp "$folder/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null; fi
  # EXTRA="--set log.profile_steps=A-B": every rank's report and rank 0's trace (the others' traces stay behind)
  if [ -d "$folder/profile" ]; then
    (cd "$folder/profile" && tar czf "$OUT/$name-profile.tgz" ./*.txt ./summary-*.json $(ls rank0.json.gz 2>/dev/null))
  fi
  $PY benchmarks/summarize_runs.py "$OUT" >> "$OUT/log.txt" 2>&1   # a summary after every run
  return $rc
}

BIG=$([ "$MODEL" = llama3-8b ] && echo 1)   # 8B: 128 GB of fp32 state, only FSDP2 over several GPUs holds it
case $STAGE in
  recipes)
    IFS=, read -ra RS <<< "${RECIPES:-bf16,mxfp4-all-dh16}"
    for r in "${RS[@]}"; do
      run "recipe-$r" "$NPROC" fsdp2 "$STEPS" "$r"
      rm -rf "${RUNS:?}/recipe-$r"
    done ;;
  scaling)
    for n in ${GPUS:-1 2 4 8}; do
      [ "$n" -gt "$NPROC" ] && continue
      if [ "$n" -eq 1 ]; then
        [ -n "$BIG" ] && { echo "=== scale-n1 skipped: $MODEL does not fit one GPU" >> "$OUT/log.txt"; continue; }
        run "scale-n1" 1 none "$STEPS" "${RECIPE:-mxfp4-all-dh16}"; rm -rf "${RUNS:?}/scale-n1"; continue
      fi
      for p in ${PARALLELS:-fsdp2 ddp}; do
        [ -n "$BIG" ] && [ "$p" = ddp ] && { echo "=== scale-ddp-n$n skipped: DDP keeps all of $MODEL on every GPU" >> "$OUT/log.txt"; continue; }
        run "scale-$p-n$n" "$n" "$p" "$STEPS" "${RECIPE:-mxfp4-all-dh16}"; rm -rf "${RUNS:?}/scale-$p-n$n"
      done
    done ;;
  dcp)   # the same global batch on both legs (an identity of the run): fewer GPUs take more micro-steps
    other=${RESUME_NPROC:-$(( NPROC / 2 > 0 ? NPROC / 2 : 1 ))}   # 8B on H100s: at least 4
    sched=(--set schedule.warmup_steps=1 --set schedule.horizon_steps=$(( ${STEPS_SAVE:-3} + 2 )))
    if FOLDER=$RUNS/dcp run "dcp-save-n$NPROC" "$NPROC" fsdp2 "${STEPS_SAVE:-3}" "${RECIPE:-mxfp4-all-dh16}" \
        --set train.final_checkpoint=true "${sched[@]}"; then
      du -sh "$RUNS/dcp" >> "$OUT/log.txt" 2>&1
      RESUME=1 FOLDER=$RUNS/dcp run "dcp-resume-n$other" "$other" fsdp2 $(( ${STEPS_SAVE:-3} + 2 )) \
        "${RECIPE:-mxfp4-all-dh16}" --batch-size $(( MB * NPROC )) --resume "$RUNS/dcp" "${sched[@]}"
    fi
    rm -rf "${RUNS:?}/dcp" ;;
  *) echo "STAGE must be recipes, scaling or dcp, not $STAGE" >&2; exit 2 ;;
esac
cat "$OUT/summary.md" 2>/dev/null
tail -4 "$OUT/log.txt"
