"""Start-up cost: importing mxtrain (every CLI call, study worker and torchrun rank does) does not import
``torch._dynamo`` (about 0.9 s), and mxtrain's own ``assume_constant_result`` marks a function exactly as
torch's decorator does, so ``torch.compile`` still treats the marked functions' results as constants."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mark_equals_torchs_decorator():
    import torch._dynamo
    from mxtrain.linear._constant import assume_constant_result

    def a():
        return 1

    def b():
        return 1
    assert torch._dynamo.assume_constant_result(a) is a and assume_constant_result(b) is b
    assert a.__dict__ == b.__dict__ == {"_dynamo_marked_constant": True}
    from mxtrain.linear import compiledmx, dispatch, tracedfp8
    assert dispatch._compile_spec._dynamo_marked_constant and tracedfp8._capable._dynamo_marked_constant
    marked = [f for m in (dispatch, tracedfp8, compiledmx) for f in vars(m).values()
              if callable(f) and getattr(f, "_dynamo_marked_constant", False)]
    assert len(marked) == 3, marked


def test_importing_mxtrain_does_not_import_dynamo():
    code = ("import sys, mxtrain, mxtrain.cli.core, mxtrain.train.trainer, mxtrain.study.workers; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_tests_run_in_the_interpreter_without_xdist():
    """On a machine without a GPU, one kernel test run by a plain ``pytest`` (``-n 0``: no controller process
    to hand TRITON_INTERPRET down) passes: the test configuration turns the interpreter on before anything imports
    ``triton.language`` (once ``torch._dynamo`` was imported first, and 98 of 100 kernel tests failed that way)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the kernels compiled, not in the interpreter")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_XDIST_WORKER")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        "tests/kernels/test_nvfp4_kernel.py::test_values_and_scale_equal_the_reference"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and " passed" in r.stdout, (r.stdout + r.stderr)[-2000:]
