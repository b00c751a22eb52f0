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
# COMPILE_CACHE=dir: inductor's and Triton's compile caches in dir instead of /tmp (compiling the kernel variants
# is most of a cuda test run's time). CACHE_IN=file(s): unpack those tarball parts into dir first (a cache an
# earlier run packed, carried back to the machine); CACHE_PACK=1: pack dir into $OUT/compile_cache.tgz.NN at the
# end, in parts of 15 MiB (what a run can bring back). The caches key every entry by source, options, torch and
# device, so a stale entry is a miss, never a wrong kernel.
if [ -n "${COMPILE_CACHE:-}" ]; then
  mkdir -p "$COMPILE_CACHE"
  if [ -n "${CACHE_IN:-}" ]; then
    # shellcheck disable=SC2086
    cat $CACHE_IN | tar -xzf - -C "$COMPILE_CACHE" && echo "compile cache: unpacked $(du -sh "$COMPILE_CACHE" | cut -f1)"
  fi
  export TORCHINDUCTOR_CACHE_DIR=$COMPILE_CACHE/inductor TRITON_CACHE_DIR=$COMPILE_CACHE/triton
fi
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
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rfEs -p no:cacheprovider -p no:benchmark -p tools.pytest_instafail \
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
if [ -n "${COMPILE_CACHE:-}" ] && [ "${CACHE_PACK:-0}" = "1" ]; then
  tar -czf - -C "$COMPILE_CACHE" . | split -b 15M -d - "$OUT/compile_cache.tgz."
  ls -la "$OUT"/compile_cache.tgz.* | awk '{print "compile cache part:", $5, $9}'
fi
