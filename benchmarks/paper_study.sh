#!/usr/bin/env bash
# GPU evidence for docs/results.md: the `paper` study preset at small scale (30m model, 3 seeds,
# built-in corpus with a 16,384-token BPE), several runs at once on one GPU.
# Usage (repo root, on the GPU machine): OUT=dir DATA=prepared-folder [JOBS=4] [BUDGET=s] bash benchmarks/paper_study.sh
# DATA: `mxtrain data prepare builtin --vocab-size 16384 --out DATA` (made on any machine and copied).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:?set OUT}; DATA=${DATA:?set DATA}; S=${STUDY:-/tmp/paper}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u +%FT%TZ; git rev-parse --short HEAD 2>/dev/null; } > "$OUT/device.txt" 2>&1
CMD="python3 -m mxtrain study --preset ${PRESET:-paper} --model 30m --steps ${STEPS:-150} --batch-size 32 --seq-len 256 \
 --lr 2e-3 --device cuda --eval-every 5 --diagnose-every 50 --set log.eval_tokens=16384 --set schedule.warmup_steps=15 \
 --data $DATA --set data.vocab_size=16384 --jobs ${JOBS:-4} --out $S"
echo "$CMD" >> "$OUT/device.txt"
timeout "${BUDGET:-500}" $CMD > "$OUT/study_log.txt" 2>&1
echo "study exit: $?" >> "$OUT/study_log.txt"
python3 -m mxtrain report "$S" >> "$OUT/study_log.txt" 2>&1
cp "$S/summary.json" "$S/report.html" "$S/report.md" "$OUT/" 2>/dev/null
tar czf "$OUT/study_runs.tar.gz" --exclude=checkpoint.pt --exclude='*.pt' --exclude=tb -C "$(dirname "$S")" "$(basename "$S")"
tail -15 "$OUT/study_log.txt"
