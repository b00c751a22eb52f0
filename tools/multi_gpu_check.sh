#!/usr/bin/env bash
# One device call on a 2-GPU machine: the same short mxfp4-all-dh16 run on 1 GPU, under DDP and under
# FSDP2 (2 ranks, same micro-batch), with the default (compiled) elementwise layers; prints the largest
# per-step loss difference against the 1-GPU run. Usage: OUT=dir [DATA=prepared folder] [STEPS=n] bash
# tools/multi_gpu_check.sh (without DATA: the built-in corpus, which needs the [data] extra there)
set -eo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
ARGS="--model ${MODEL:-30m} --recipe ${RECIPE:-mxfp4-all-dh16} --steps ${STEPS:-30} --batch-size 16 --micro-batch-size 8 --seq-len 512 --eval-every 1000 --no-progress ${DATA:+--data $DATA}"
python3 -m mxtrain train $ARGS --out "$OUT/one" > "$OUT/one.log" 2>&1; tail -2 "$OUT/one.log"
for p in ddp fsdp2; do
  python3 -m mxtrain train $ARGS --nproc 2 --parallel $p --out "$OUT/$p" > "$OUT/$p.log" 2>&1; tail -2 "$OUT/$p.log"
done
grep -h "Warning" "$OUT"/*.log | sort | uniq -c | head -20 || true
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def losses(d):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{out}/{d}/metrics.jsonl")) if "loss" in r}
one = losses("one")
for p in ("ddp", "fsdp2"):
    o = losses(p)
    diffs = [abs(o[s] - one[s]) for s in one if s in o]
    print(f"{p}: {len(diffs)} steps, max |loss - 1-GPU loss| = {max(diffs):.3g}, final {o[max(o)]:.4f} vs {one[max(one)]:.4f}")
PY
