"""The interpreter the CPU tests run (tests/interp_speed.py, installed by conftest.py): a kernel calling device
functions computes what it is written to, and the signed-overflow check that interp_speed turns off is one
that Triton's interpreter only acts on in debug mode (off in these tests), so turning it off drops nothing."""

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (CPU) only")


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, _twice(_twice(v)) * k, mask=m)


def _run(x, k):
    out = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), k, BLOCK=16)
    return out


def test_device_functions_compute_as_written():
    x = torch.arange(-20, 20, dtype=torch.int32)
    assert torch.equal(_run(x, 3), x * 12)
    f = torch.linspace(-3, 3, 40)
    assert torch.equal(_run(f, 0.5), f * 2.0)


def test_the_overflow_check_acts_only_in_debug_mode():
    from triton.runtime import interpreter as I
    opts = I.interpreter_builder.options
    assert not opts.debug
    x = torch.full((20,), 2 ** 29, dtype=torch.int32)   # x * 4 leaves int32
    try:
        I.interpreter_builder.options = dataclasses.replace(opts, sanitize_overflow=True)
        assert torch.equal(_run(x, 1), x * 4)            # checked, and the result dropped: it wraps
        I.interpreter_builder.options = dataclasses.replace(opts, sanitize_overflow=True, debug=True)
        with pytest.raises(Exception, match="overflow"):
            _run(x, 1)
    finally:
        I.interpreter_builder.options = opts
