#!/usr/bin/env bash
# 1 GPU vs 2 GPUs (FSDP2, then DDP) on the ~1B model with mxfp4-all-dh16: tokens/s and losses.
# Usage (on a 2-GPU machine, from the repo root): benchmarks/distributed.sh DATA_DIR OUT_DIR [STEPS]
# DATA_DIR: a prepared folder (mxtrain data prepare builtin --out DATA_DIR). Results: OUT_DIR/*.jsonl,
# OUT_DIR/log.txt. Same global batch everywhere: 16 x 1024 tokens, micro-batch 8 (1 GPU: 2 accumulation
# steps; 2 GPUs: 1 micro-step per rank).
set -uo pipefail
DATA=${1:?data folder}; OUT=${2:?out folder}; STEPS=${3:-20}
# NVLink multicast stays off (shared hosts; see the device docs); mxtrain.distributed sets these too.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
mkdir -p "$OUT"
# run folders (the final checkpoint is ~12 GB) in RAM when /dev/shm has room: faster than disk
TMPD=/tmp; [ "$(df --output=avail -k /dev/shm 2>/dev/null | tail -1)" -gt 40000000 ] 2>/dev/null && TMPD=/dev/shm
COMMON=(train --data "$DATA" --model "${MODEL:-1b}" --recipe mxfp4-all-dh16 --steps "$STEPS" --batch-size 16
        --micro-batch-size 8 --seq-len "${SEQ:-1024}" --eval-every 100000 --eval-tokens 16384 --no-progress --seed 0
        --device "${DEVICE:-cuda}" --set log.log_every=5 --set log.tensorboard=false --set schedule.warmup_steps=5)
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  nvidia-smi topo -m 2>/dev/null | head -5
  echo "run folders in $TMPD"
} > "$OUT/log.txt" 2>&1
run() {  # name, extra args...
  local name=$1; shift
  local t0=$(date +%s)
  echo "=== $name: $*" >> "$OUT/log.txt"
  "$PY" -m mxtrain "${COMMON[@]}" --out "$TMPD/mxbench-$name" "$@" >> "$OUT/log.txt" 2>&1
  echo "=== $name rc=$? wall=$(( $(date +%s) - t0 ))s" >> "$OUT/log.txt"
  cp "$TMPD/mxbench-$name/metrics.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  rm -rf "$TMPD/mxbench-$name"
}
run gpu1
run gpu2_fsdp2 --nproc 2 --parallel fsdp2
run gpu2_ddp --nproc 2 --parallel ddp
