#!/usr/bin/env bash
# One device call: GPU correctness tests of the fast path, then every benchmark (JSON + logs in $OUT).
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tools/gpu_check.sh [bench-what]
# CUDA_TESTS=all: every cuda-marked test of the suite instead of the fast path's two test files;
# SKIP_TESTS=1: benchmarks only; bench-what "none": tests only.
set -o pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
WHAT=${1:-all}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  if [ "${CUDA_TESTS:-}" = "all" ]; then TESTS=(-m cuda tests); else TESTS=(tests/test_kernels.py tests/test_fast_linear.py); fi
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -n 8 "${TESTS[@]}" \
    -k "${TEST_K:-}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
fi
if [ "$WHAT" != "none" ]; then
  timeout "${BENCH_TIMEOUT:-330}" python3 -m mxtrain.bench "$WHAT" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
