#!/usr/bin/env bash
# The trainer's own tokens/s, variant against variant, one run after the other on one GPU: `mxtrain train` for
# each variant and each value of train.check_every_step in CHECKS (`on`: the step's checks on the host, two waits
# for the GPU a step; `auto`: on the device on CUDA, none); prints the median tokens/s of each run's log rows after
# step SKIP. A variant is a recipe, optionally with mxtrain settings for that run only:
# `mxfp4-all-dh16:MXTRAIN_MX_COMPILED=separate` (environment assignments after the colon, comma-separated).
# Usage (repo root): DATA=folder [EXP=125m-gpu] [VARIANTS="bf16 mxfp4-all-dh16"] [CHECKS="on auto"] [STEPS=80]
#   [SKIP=20] [EXTRA="--set ..."] OUT=dir bash benchmarks/trainer_rate.sh
set -u -o pipefail
OUT=${OUT:?set OUT}; DATA=${DATA:?set DATA}; EXP=${EXP:-125m-gpu}; STEPS=${STEPS:-80}; SKIP=${SKIP:-20}
mkdir -p "$OUT"
for variant in ${VARIANTS:-${RECIPES:-bf16 mxfp4-all-dh16}}; do
  recipe=${variant%%:*}; envs=""
  [ "$recipe" != "$variant" ] && envs=${variant#*:}
  for check in ${CHECKS:-on auto}; do
    run="$OUT/$(echo "$variant" | tr ':,=' '_._')-$check"
    # shellcheck disable=SC2086
    env ${envs//,/ } python3 -m mxtrain train --exp "$EXP" --data "$DATA" --recipe "$recipe" --steps "$STEPS" \
      --no-progress --out "$run" --set train.check_every_step=$check --set log.log_every=10 \
      --set log.eval_every=100000 --set train.final_checkpoint=false --set log.tensorboard=false ${EXTRA:-} \
      > "$run.log" 2>&1 || { echo "$variant $check: failed"; tail -n 5 "$run.log"; continue; }
    python3 - "$run" "$variant" "$check" "$SKIP" <<'PY'
import json, statistics, sys
run, variant, check, skip = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "tok_per_s" in r and r["step"] > skip]
tps = [r["tok_per_s"] for r in rows]
print(f"{variant:>16} check_every_step={check:<4} median {statistics.median(tps):>10,.0f} tokens/s "
      f"(min {min(tps):,.0f}, max {max(tps):,.0f}, {len(tps)} rows of 10 steps after step {skip}); "
      f"last loss {rows[-1]['loss']:.4f}")
PY
  done
done
