#!/usr/bin/env bash
# One device call: GPU correctness tests of the fast path, then every benchmark (JSON + logs in $OUT).
# Usage (repo root, on the GPU machine): OUT=/some/dir bash tools/gpu_check.sh [bench-what]
# CUDA_TESTS=all: every cuda-marked test of the suite instead of the fast path's two test files;
# SKIP_TESTS=1: benchmarks only; bench-what "none": tests only.
set -o pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export INSTAFAIL=${INSTAFAIL:-${OUT:-out}/failures.txt}
OUT=${OUT:-out}
mkdir -p "$OUT"
WHAT=${1:-all}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee "$OUT/env.txt"
# CUDA_TESTS="tests/a.py tests/b.py": the cuda-marked tests of those files. Each test is reported on its own line
# (-v) and in $OUT/junit.xml as it ends, and a test that hangs fails after PER_TEST_TIMEOUT s (pytest-timeout), so
# a run cut short by TEST_TIMEOUT still says which tests passed and which failed. -n needs pytest-xdist (carry its
# wheel and execnet's); worksteal spreads the slow compiled cases over the workers.
# tools/pytest_instafail.py writes each failure's traceback when it arrives (to $OUT/failures.txt), so a run killed
# by TEST_TIMEOUT keeps the text of the failures it had.
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  if [ "${CUDA_TESTS:-}" = "all" ]; then TESTS=(-m cuda tests)
  elif [ -n "${CUDA_TESTS:-}" ]; then read -r -a FILES <<< "$CUDA_TESTS"; TESTS=(-m cuda "${FILES[@]}")
  else TESTS=(tests/kernels/test_kernels.py tests/linear/test_fast_linear.py); fi
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rfE -p no:cacheprovider -p no:benchmark -p tools.pytest_instafail \
    -n "${WORKERS:-8}" \
    --dist worksteal --timeout "${PER_TEST_TIMEOUT:-400}" --junitxml "$OUT/junit.xml" "${TESTS[@]}" \
    -k "${TEST_K:-}" > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit: $?"
  grep -E "(PASSED|FAILED|ERROR) tests/" "$OUT/gpu_tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort | uniq -c \
    | awk '{print $2}' | sort | uniq -c
  grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | head -40
fi
if [ "$WHAT" != "none" ]; then
  timeout "${BENCH_TIMEOUT:-330}" python3 -m mxtrain.bench "$WHAT" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
