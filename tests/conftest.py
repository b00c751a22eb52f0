"""Test configuration: a fixed torch seed per test, CUDA-marked tests skipped on CPU machines, a temporary
MXTRAIN_CACHE, and on machines without a GPU Triton's interpreter for every test module (Triton reads
TRITON_INTERPRET when a kernel is defined, so it must be set before any module imports mxtrain.kernels).

The test files sit in folders that mirror the package (tests/numerics/, tests/kernels/, ...; whole-repository
checks in tests/ itself); the helpers they share stay here in tests/ (train_helpers, compile_helpers,
numerics_helpers, the _dist_* and _qgather_worker scripts, assets/) and are imported by name
(``from train_helpers import ...``): this folder is put first on sys.path, and each folder of test files after it. (pytest's default import mode does so
too for a conftest.py outside a package; stated here so that it does not rest on the import mode.) No
``__init__.py`` anywhere under tests/: every test file's name is unique."""

import os
import sys

# inductor compiles in this process, not in a pool of worker processes that each import torch first: on the
# 2-core CI machine (two pytest workers) the pool costs more than it saves (tests/linear/test_ref_compile.py,
# warm cache: 135 s against 146 s); subprocesses of the tests inherit it
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

_TESTS = os.path.dirname(os.path.abspath(__file__))
# tests/ first, then each folder of test files: a test that reuses another file's fixtures by name
# (``from test_study import curve``) finds it however few files a run collects
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
for _d in sorted(os.listdir(_TESTS)):
    _p = os.path.join(_TESTS, _d)
    if os.path.isdir(_p) and not _d.startswith(("_", ".")) and _d != "assets" and _p not in sys.path:
        sys.path.append(_p)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# after TRITON_INTERPRET: importing torch._dynamo imports triton.language, whose own jitted functions (tl.max, ...)
# must be made in interpreter mode too (under pytest-xdist the workers inherit the variable from the controller,
# so only a run without -n showed it)
import torch._dynamo  # noqa: E402, F401  (tests call torch._dynamo.reset(); mxtrain itself no longer imports it)

# the interpreter without work whose result it drops (tests/interp_speed.py; MXTRAIN_TEST_PLAIN_INTERPRETER=1 runs
# Triton's interpreter as it ships)
if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("MXTRAIN_TEST_PLAIN_INTERPRETER"):
    import interp_speed  # noqa: E402

    interp_speed.install()

# Under pytest-xdist (CI: `-n 2` on 2 cores) each worker computes with one thread, and so do the processes it
# starts (OMP_NUM_THREADS is inherited): two workers with a thread per core each oversubscribe the machine, and
# OpenMP's waiting threads then slow small CPU ops down (measured: 12 % of two test files' wall time). A run
# with OMP_NUM_THREADS set keeps its setting.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# With PYTHONDONTWRITEBYTECODE set (as on CI's machines), Python compiles mxtrain's modules from source in every
# process it starts, and the suite starts hundreds (CLI runs, torchrun ranks, study workers): about 0.7 s each
# for the trainer's imports. Compiled once here, before the workers start (the variable stops writes, not reads
# of a __pycache__ that exists; a source edited later makes its .pyc stale, and Python then ignores it).
if sys.dont_write_bytecode and not os.environ.get("PYTEST_XDIST_WORKER"):
    import compileall
    for _d in ("mxtrain", "tests"):
        compileall.compile_dir(os.path.join(os.path.dirname(_TESTS), _d), quiet=2)

# records of checked data shards go to a temporary folder, not the user's cache
if "MXTRAIN_CACHE" not in os.environ:
    import tempfile
    os.environ["MXTRAIN_CACHE"] = tempfile.mkdtemp(prefix="mxtrain-test-cache-")


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
