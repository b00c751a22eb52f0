"""bf16 inputs whose subnormals decide the result, through the kernels other than the MXFP4 quantizer
(``tests/kernels/test_kernels.py`` has those): NVFP4 (with and without its 16-wide rotation, 1-D blocks and 16x16 tiles,
nearest and stochastic rounding), the MX quantizer for FP8/FP6 elements and the per-tensor FP8 cast, each equal
to its reference bit for bit. Under Triton 3.6's interpreter a plain bf16 -> float32 cast reads subnormals wrongly;
the kernels widen their input through ``mxfp4.device._f32``, which these tests would catch going missing."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain.numerics import rng  # noqa: E402
from mxtrain.numerics.operand import fake_quantize_operand  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import mxelem as M  # noqa: E402
from mxtrain.kernels import nvfp4 as K  # noqa: E402
from mxtrain.kernels.fp8cast import quantize_tensor_fp8  # noqa: E402
from mxtrain.numerics.quant import quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")


def _tiny(M_, K_, seed, mixed):
    """bf16 (M_, K_): subnormals (|x| about 2**-130), or (``mixed``) half of them tiny normal values (2**-120)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M_, K_, generator=g) * 2.0 ** -130
    if mixed:
        x = torch.where(torch.rand(M_, K_, generator=g) < 0.5, x, x * 2.0 ** 10)
    return x.to(torch.bfloat16).to(DEV)


def _same_bits(a, b, what):
    bad = ~((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b)))
    assert not bad.any(), (what, int(bad.sum()), a[bad][:4].tolist(), b[bad][:4].tolist())


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("rot", [0, 16])
def test_nvfp4(mixed, axis, rot):
    x = _tiny(48, 64, seed=3 + axis, mixed=mixed)
    signs = rng.random_signs(16, 0x5157).to(DEV) if rot else None
    for block_2d in (False, True):
        for rounding, key in (("nearest", None), ("stochastic", 0x1234567)):
            v, g = K.quantize_nvfp4_factored(x, axis, block_2d, rounding, key, 0.75, rot=rot, signs=signs)
            rv, rg = fake_quantize_operand(x, signs, key, axis, rot, "nvfp4", (16, 16) if block_2d else 16,
                                           rounding, "floor", 0.75, True)
            _same_bits(g, rg, ("g", block_2d, rounding))
            _same_bits(v, rv, ("values", block_2d, rounding))


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp6_e2m3"])
def test_mx_elements(fmt):
    x = _tiny(32, 64, seed=4, mixed=False)
    for axis in (0, 1):
        v = M.quantize_mx_values(x, fmt, axis, 32, "floor", 1.0)
        r = fake_quantize_operand(x, None, None, axis, 0, fmt, 32, "nearest", "floor", 1.0)
        _same_bits(v, r, (fmt, axis))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_tensor_fp8(fmt):
    x = _tiny(32, 64, seed=5, mixed=False)
    codes, scale = quantize_tensor_fp8(x, fmt, 1.0)
    ref = quantize(x, fmt)
    assert torch.equal(codes.view(torch.uint8), ref.data.contiguous().view(torch.uint8))
    assert torch.equal(scale, ref.scales.to(torch.float32).reshape(()))
