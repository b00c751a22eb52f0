#!/usr/bin/env bash
# The trainer's per-step wait for the GPU, measured: `mxtrain train` with the step's checks on the host
# (train.check_every_step=on: two waits a step) against on the device (auto on CUDA: none), for each recipe, one
# run after the other on one GPU; prints the median tokens/s of each run's log rows after step SKIP.
# Usage (repo root): DATA=folder [EXP=125m-gpu] [RECIPES="bf16 mxfp4-all-dh16"] [STEPS=80] [SKIP=20]
#   [EXTRA="--set ..."] OUT=dir bash benchmarks/step_checks.sh
set -u -o pipefail
OUT=${OUT:?set OUT}; DATA=${DATA:?set DATA}; EXP=${EXP:-125m-gpu}; STEPS=${STEPS:-80}; SKIP=${SKIP:-20}
mkdir -p "$OUT"
for recipe in ${RECIPES:-bf16 mxfp4-all-dh16}; do
  for check in on auto; do
    run="$OUT/$recipe-$check"
    # shellcheck disable=SC2086
    python3 -m mxtrain train --exp "$EXP" --data "$DATA" --recipe "$recipe" --steps "$STEPS" --no-progress \
      --out "$run" --set train.check_every_step=$check --set log.log_every=10 --set log.eval_every=100000 \
      --set train.final_checkpoint=false --set log.tensorboard=false ${EXTRA:-} > "$run.log" 2>&1 \
      || { echo "$recipe $check: failed"; tail -n 5 "$run.log"; continue; }
    python3 - "$run" "$recipe" "$check" "$SKIP" <<'PY'
import json, statistics, sys
run, recipe, check, skip = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "tok_per_s" in r and r["step"] > skip]
tps = [r["tok_per_s"] for r in rows]
print(f"{recipe:>16} check_every_step={check:<4} median {statistics.median(tps):>10,.0f} tokens/s "
      f"(min {min(tps):,.0f}, max {max(tps):,.0f}, {len(tps)} rows of 10 steps after step {skip}); "
      f"last loss {rows[-1]['loss']:.4f}")
PY
  done
done
