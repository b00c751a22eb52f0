#!/usr/bin/env bash
# A cooled-down study on one GPU machine (docs/study.md, docs/results.md): join and unpack the prepared corpus
# from its xz parts if needed (benchmarks/unpack_corpus.sh: parts carried under data/ship over several calls
# gather in PARTS; exit status 3 until all are there; docs/data.md, "Getting it to a GPU machine"), train (resuming what an earlier
# call of the same lease finished), write the report, and copy everything but checkpoints to $OUT.
# Usage (repo root, on the GPU machine):
#   OUT=dir [PARTS=/root/mx] [DATA=/root/mx/c32k] [STUDY=/root/mx/study] [ARMS=a,b,c | PRESET=split]
#   [MODEL=30m] [STEPS=240] [SEEDS=3] [BUDGETS=0.25,0.5,0.75,1] [COOLDOWN=0.2] [JOBS=6] [EVAL_EVERY=10]
#   [EVAL_TOKENS=131072] [FINAL_EVAL_TOKENS=1048576] [WARMUP=20] [DEVICE=cuda] [BUDGET=seconds] [EXTRA="--set k=v ..."]
#   [SEED_STUDY=path/study.tgz] [START_BY=seconds] [ONLY_SEEDS=3,4] [MPS=1] bash benchmarks/study_gpu.sh
# SEED_STUDY: the study.tgz an earlier lease returned (its run folders without checkpoints), unpacked into the
# study folder when that holds no study yet, so that a study spans several leases: finished runs and branches
# are skipped, unfinished ones train again (docs/study.md, "A study over several GPU leases").
# MPS=1: NVIDIA's Multi-Process Service for the study (one daemon in PARTS, shared by studies running at once on
# the lease's GPUs: started by the first, stopped by the last to end); MPS=auto: benchmarks/study_probe.sh first (JOBS runs of
# MODEL for PROBE_STEPS steps, plain and under MPS; PROBE_EXTRA: their extra train flags), MPS where it is 15 %
# faster or more; its output in OUT/mps.txt and OUT/probe.json (logs in OUT/probe/). BUDGET and START_BY include the probe's time.
# (MPS=auto starts a daemon of its own for the probe: not while another study of the lease runs under MPS.)
# START_BY: no run starts later than this many seconds after the study does (mxtrain study --start-by); set it
# to BUDGET less one run's time so that the lease's end goes to runs and branches that can finish.
# ONLY_SEEDS: comma-separated seeds this call trains (mxtrain study --only-seeds): e.g. the last seed of a plan,
# the others' runs left for a later lease, every arm still listed in the plan and the report.
# WARMUP: warm-up steps (schedule.warmup_steps); the flags here replace a preset's values of the same settings, so a
# preset with another warm-up (recipes-2026, ladder-30m: 84) needs WARMUP=84, as it needs its STEPS and BUDGETS.
# JOBS: runs sharing the GPU; a 30m run with 32 x 512-token batches and the 32k vocabulary peaks near 11 GiB,
# so 6 fit an 80 GiB H100 (8 did not). Call it again in the same lease to go on: finished runs are skipped, and
# runs that BUDGET's SIGTERM stopped continue from the checkpoint they wrote (checkpoints stay on the machine's disk).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}; PARTS=${PARTS:-/root/mx}; DATA=${DATA:-$PARTS/c32k}; S=${STUDY:-$PARTS/study}
T0=$(date +%s)   # BUDGET and START_BY count from here (an MPS=auto probe comes out of them)
mkdir -p "$OUT"
bash benchmarks/unpack_corpus.sh "$PARTS" "$DATA" || exit $?   # 3: parts still to carry
if [ -n "${SEED_STUDY:-}" ] && [ ! -f "$S/study.json" ]; then
  [ -f "$SEED_STUDY" ] || { echo "SEED_STUDY=$SEED_STUDY: no such file" >&2; exit 2; }
  mkdir -p "$S" && tar -C "$S" -xzf "$SEED_STUDY" || { echo "unpacking $SEED_STUDY failed" >&2; exit 2; }
fi
if [ "${MPS:-0}" = auto ]; then   # measure first (benchmarks/study_probe.sh): MPS only where it pays 15 % or more
  MPS=0
  if command -v nvidia-cuda-mps-control > /dev/null || [ -n "${PROBE_FORCE:-}" ]; then
    OUT="$OUT/probe" DATA="$DATA" MODES="plain mps" JOBS="${JOBS:-6}" STEPS="${PROBE_STEPS:-200}" \
      MODEL="${MODEL:-30m}" DEVICE="${DEVICE:-cuda}" EXTRA="${PROBE_EXTRA:-}" bash benchmarks/study_probe.sh \
      >> "$OUT/mps.txt" 2>&1
    cp "$OUT/probe/probe.json" "$OUT/probe.json" 2>/dev/null
    MPS=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); p=r.get('plain',{}).get('tok_per_s',0); \
m=r.get('mps',{}).get('tok_per_s',0); print(1 if p > 0 and m >= 1.15 * p else 0)" "$OUT/probe/probe.json" 2>/dev/null || echo 0)
  fi
  echo "MPS=auto: MPS=$MPS" >> "$OUT/mps.txt"
fi
if [ "${MPS:-0}" = 1 ]; then   # NVIDIA's Multi-Process Service for this study: the runs' kernels share the GPU at once
  # One daemon per machine, in PARTS: a study started while another's daemon runs joins it (two studies on the
  # GPUs of one lease, each with its own GPUS), and the last study to end stops it. The daemon sees every GPU.
  export CUDA_MPS_PIPE_DIRECTORY="$PARTS/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$PARTS/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" "$PARTS/mps-users"
  mps_leave() {   # this study's end: stop the daemon unless another study still uses it
    rm -f "$PARTS/mps-users/$$"
    local f
    for f in "$PARTS"/mps-users/*; do
      [ -e "$f" ] || continue
      if kill -0 "$(basename "$f")" 2>/dev/null; then return 0; fi
      rm -f "$f"
    done
    echo quit | nvidia-cuda-mps-control
    rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"   # no later study of the lease takes a stopped daemon for a running one
  }
  if [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
    echo "MPS on (joined the daemon another study started)" >> "$OUT/mps.txt"
  elif env -u CUDA_VISIBLE_DEVICES nvidia-cuda-mps-control -d; then
    echo "MPS on" >> "$OUT/mps.txt"
  elif [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then   # another study started it at the same moment
    echo "MPS on (joined the daemon another study started)" >> "$OUT/mps.txt"
  else
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS requested but its daemon did not start: the runs take turns on the GPU" >> "$OUT/mps.txt"
  fi
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo $$ > "$PARTS/mps-users/$$"
    trap mps_leave EXIT
  fi
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%FT%TZ; } > "$OUT/device.txt" 2>&1
if [ -n "${ARMS:-}" ]; then WHAT=(--arms "$ARMS"); else WHAT=(--preset "${PRESET:-split}"); fi
CMD=(python3 -m mxtrain study "${WHAT[@]}" --seeds "${SEEDS:-3}" --model "${MODEL:-30m}" --data "$DATA"
     --batch-size 32 --seq-len 512 --steps "${STEPS:-240}" --budgets "${BUDGETS:-0.25,0.5,0.75,1}"
     --cooldown "${COOLDOWN:-0.2}" --eval-every "${EVAL_EVERY:-10}" --diagnose-every 0
     --set "log.eval_tokens=${EVAL_TOKENS:-131072}" --set "log.final_eval_tokens=${FINAL_EVAL_TOKENS:-1048576}"
     --set "schedule.warmup_steps=${WARMUP:-20}" --device "${DEVICE:-cuda}"
     --jobs "${JOBS:-6}" --out "$S")
SPENT=$(( $(date +%s) - T0 ))
[ -n "${START_BY:-}" ] && CMD+=(--start-by "$(( START_BY > SPENT ? START_BY - SPENT : 0 ))")
[ -n "${ONLY_SEEDS:-}" ] && CMD+=(--only-seeds "$ONLY_SEEDS")
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && CMD+=(${EXTRA})
echo "${CMD[*]}" >> "$OUT/device.txt"
LEFT=$(( ${BUDGET:-480} - SPENT )); [ "$LEFT" -lt 1 ] && LEFT=1
timeout "$LEFT" "${CMD[@]}" > "$OUT/study_log.txt" 2>&1
echo "study exit: $?" >> "$OUT/study_log.txt"
timeout 60 python3 -m mxtrain report "$S" >> "$OUT/study_log.txt" 2>&1
(cd "$S" && find . -type f ! -name '*.pt' ! -path '*/tb/*' -size -8M | tar czf "$OUT/study.tgz" -T -)
cp "$S/summary.json" "$S/report.md" "$OUT/" 2>/dev/null
tail -15 "$OUT/study_log.txt"
