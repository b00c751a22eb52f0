#!/usr/bin/env bash
# How fast several small runs share one GPU, under each way of sharing it: the study's throughput (many 30m runs
# at once, docs/study.md "Sizing a lease") before a lease commits to one. For each MODE, JOBS training runs start
# together (model, batch and recipe as the study's), and the aggregate tokens/s is the sum over the runs of each
# run's median logged rate after the first third of its steps (compilation and warm-up left out).
# Modes: plain (the study's default: blocks compiled), graphs (train.cuda_graphs: each step replayed as a CUDA
# graph, nothing compiled), mps (plain, with NVIDIA's Multi-Process Service started for the mode and stopped
# after it, so that the runs' kernels can run at the same time instead of taking turns on the GPU).
# Usage (repo root, on the GPU machine): OUT=dir DATA=prepared-folder [MODES="plain graphs mps"] [JOBS=7]
#   [STEPS=300] [MODEL=30m] [RECIPE=mxfp4-all] [DEVICE=cuda] [EXTRA="--set k=v ..."] bash benchmarks/study_probe.sh
# Writes OUT/probe.json ({mode: {"jobs", "steps", "tok_per_s" (aggregate), "per_run": [...], "rc": [...]}}) and
# OUT/probe-<mode>-<k>.log; prints one line per mode.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}; DATA=${DATA:?set DATA}; MODES=${MODES:-plain graphs mps}; JOBS=${JOBS:-7}
STEPS=${STEPS:-300}; MODEL=${MODEL:-30m}; RECIPE=${RECIPE:-mxfp4-all}; DEVICE=${DEVICE:-cuda}
TMP=$(mktemp -d); mkdir -p "$OUT"
for mode in $MODES; do
  sets=()
  case "$mode" in
    plain) ;;
    graphs) sets=(--set train.cuda_graphs=true) ;;
    mps)
      if ! command -v nvidia-cuda-mps-control > /dev/null; then echo "$mode: no nvidia-cuda-mps-control, skipped"; continue; fi
      export CUDA_MPS_PIPE_DIRECTORY="$TMP/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$TMP/mps-log"
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d || { echo "$mode: the MPS daemon did not start, skipped"; continue; } ;;
    *) echo "unknown mode $mode (plain, graphs, mps)" >&2; exit 2 ;;
  esac
  pids=()
  for k in $(seq 0 $((JOBS - 1))); do
    # shellcheck disable=SC2086
    python3 -m mxtrain train --model "$MODEL" --data "$DATA" --recipe "$RECIPE" --batch-size 32 --seq-len 512 \
      --steps "$STEPS" --seed "$k" --device "$DEVICE" --no-progress --out "$TMP/$mode-$k" \
      --set log.eval_every=$((STEPS * 10)) --set log.eval_tokens=16384 --set log.log_every=10 --set log.tensorboard=false --set train.final_checkpoint=false \
      --set train.checkpoint_every=0 "${sets[@]}" ${EXTRA:-} > "$OUT/probe-$mode-$k.log" 2>&1 &
    pids+=($!)
  done
  rcs=()
  for p in "${pids[@]}"; do wait "$p"; rcs+=($?); done
  if [ "$mode" = mps ]; then echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
  python3 - "$TMP" "$mode" "$JOBS" "$STEPS" "$OUT/probe.json" "${rcs[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path
tmp, mode, jobs, steps, out, *rcs = sys.argv[1:]
per = []
for k in range(int(jobs)):
    p = Path(tmp) / f"{mode}-{k}" / "metrics.jsonl"
    rows = [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []
    r = [x["tok_per_s"] for x in rows if "tok_per_s" in x and x.get("step", 0) > int(steps) // 3]
    per.append(statistics.median(r) if r else 0.0)
res = json.loads(Path(out).read_text()) if Path(out).is_file() else {}
res[mode] = {"jobs": int(jobs), "steps": int(steps), "tok_per_s": sum(per), "per_run": per, "rc": [int(c) for c in rcs]}
Path(out).write_text(json.dumps(res, indent=1) + "\n")
bad = sum(int(c) != 0 for c in rcs)
print(f"{mode}: {sum(per):,.0f} tokens/s over {jobs} runs (each {min(per):,.0f}-{max(per):,.0f})"
      + (f"; {bad} run(s) failed: see probe-{mode}-<k>.log" if bad else ""))
EOF
done
rm -rf "$TMP"
