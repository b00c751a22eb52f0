#!/usr/bin/env bash
# 1 GPU vs 2 GPUs (FSDP2, then DDP) on the ~1B model with mxfp4-all-dh16: tokens/s and losses.
# Usage (on a 2-GPU machine, from the repo root): benchmarks/distributed.sh DATA_DIR OUT_DIR
# DATA_DIR: a prepared folder (mxtrain data prepare builtin --out DATA_DIR). Results: OUT_DIR/*.jsonl, log.txt.
# First a 2-step probe of the fast MXLinear path on 1 GPU; if its loss is not finite, every run uses the
# reference path (MXTRAIN_FAST=0) with a smaller batch. Same global batch and micro-batch on 1 and 2 GPUs
# (1 GPU: 2 accumulation steps; 2 GPUs: 1 micro-step per rank). EXTRA="--lr 3e-4" adds train flags.
set -uo pipefail
DATA=${1:?data folder}; OUT=${2:?out folder}
# NVLink multicast stays off (shared hosts; see the device docs); mxtrain.train.parallel sets these too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}; MODEL=${MODEL:-1b}; DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
TMPD=/tmp; [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 40000000 ] 2>/dev/null && TMPD=/dev/shm
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  nvidia-smi topo -m 2>/dev/null | head -4
  echo "run folders in $TMPD"
} > "$OUT/log.txt" 2>&1
run() {  # name nproc steps batch micro seq log_every eval_tokens [extra args...]
  local name=$1 nproc=$2 steps=$3 bs=$4 mb=$5 seq=$6 le=$7 et=$8; shift 8
  local launch=("$PY" benchmarks/mx_entry.py)
  [ "$nproc" -gt 1 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" benchmarks/mx_entry.py)
  local t0=$(date +%s)
  echo "=== $name (MXTRAIN_FAST=${MXTRAIN_FAST:-1}): nproc $nproc steps $steps batch $bs micro $mb seq $seq $*" >> "$OUT/log.txt"
  "${launch[@]}" train --data "$DATA" --model "$MODEL" --recipe mxfp4-all-dh16 --steps "$steps" --batch-size "$bs" \
    --micro-batch-size "$mb" --seq-len "$seq" --eval-every 100000 --eval-tokens "$et" --no-progress --seed 0 \
    --device "$DEVICE" --set log.log_every="$le" --set log.tensorboard=false --set schedule.warmup_steps=2 \
    --set schedule.horizon_steps=20 --out "$TMPD/mxbench-$name" ${EXTRA:-} "$@" >> "$OUT/log.txt" 2>&1
  echo "=== $name rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$OUT/log.txt"
  cp "$TMPD/mxbench-$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  rm -rf "$TMPD/mxbench-$name"
}
export MXTRAIN_FAST=1
ONLY=${ONLY:-"gpu1 gpu2_fsdp2 gpu2_ddp"}  # e.g. ONLY="gpu2_fsdp2 gpu2_ddp" SKIP_PROBE=1 to redo the 2-GPU runs
if [ -n "${SKIP_PROBE:-}" ]; then
  P=(15 16 8 1024 5 16384)
else
run probe_fast 1 2 16 8 1024 1 1024
if $PY - "$OUT/probe_fast.jsonl" <<'PYEOF'
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
loss = [r["loss"] for r in rows if isinstance(r.get("loss"), float)]
sys.exit(0 if len(loss) == 2 and all(math.isfinite(x) for x in loss) else 1)
PYEOF
then
  echo "=== fast path OK: 1b, 16 x 1024 tokens/step, 15 steps" >> "$OUT/log.txt"
  P=(15 16 8 1024 5 16384)
else
  export MXTRAIN_FAST=0
  echo "=== fast path failed the probe: reference path, 8 x 1024 tokens/step, 6 steps" >> "$OUT/log.txt"
  P=(6 8 4 1024 2 4096)
fi
fi
for r in $ONLY; do
  case $r in
    gpu1) run gpu1 1 "${P[@]}" ;;
    gpu2_fsdp2) run gpu2_fsdp2 2 "${P[@]}" --parallel fsdp2 ;;
    gpu2_ddp) run gpu2_ddp 2 "${P[@]}" --parallel ddp ;;
  esac
done
