#!/usr/bin/env bash
# One device call: GPU correctness tests of the fast path, then every benchmark (JSON + logs in $OUT).
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tools/gpu_check.sh [bench-what]
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
WHAT=${1:-all}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels.py tests/test_fast_linear.py \
    -k "${TEST_K:-}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
timeout "${BENCH_TIMEOUT:-330}" python3 -m mxtrain.bench "$WHAT" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
