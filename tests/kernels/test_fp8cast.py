"""The two-pass per-tensor FP8 quantizer (kernels/fp8cast.py) against the reference (mxtrain.numerics.quant.quantize):
bit-identical codes and scales for E4M3 and E5M2, float32 and bf16 inputs, with a prescale, across the whole
range (saturation, subnormals, rounding ties, -0), an all-zero tensor and non-finite inputs. On CPU the kernel
runs in Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels.fp8cast import quantize_tensor_fp8  # noqa: E402
from mxtrain.numerics.quant import quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")


def _wide(n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 20, (n,), generator=g).float())
    x[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 1e30, 5e-45])
    return x.to(dtype).reshape(-1, 64).to(DEV)


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prescale", [1.0, 0.75])
def test_codes_and_scale_equal_the_reference(fmt, dtype, prescale):
    x = _wide(64 * 97, seed=3, dtype=dtype)
    codes, scale = quantize_tensor_fp8(x, fmt, prescale)
    ref = quantize(x, fmt, prescale=prescale)
    assert codes.dtype == ref.data.dtype and codes.shape == x.shape
    assert torch.equal(_bits(codes), _bits(ref.data.contiguous()))
    assert torch.equal(scale, ref.scales.to(torch.float32).reshape(()))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_every_grid_value_and_midpoint(fmt):
    """Each representable magnitude (times the scale) comes back as itself, and each midpoint between
    neighbours goes to the even one, as the reference says; the largest value sets amax."""
    dt = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
    grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, -mids, torch.full((1,), grid.max().item())])
    x = torch.nn.functional.pad(x, (0, (-x.numel()) % 16)).reshape(-1, 16).to(DEV)
    codes, scale = quantize_tensor_fp8(x, fmt)
    ref = quantize(x, fmt)
    assert float(scale) == 1.0
    assert torch.equal(_bits(codes), _bits(ref.data.contiguous()))


def test_zero_and_non_finite_tensors():
    z = torch.zeros(4, 32, device=DEV)
    codes, scale = quantize_tensor_fp8(z)
    assert float(scale) == 1.0 and not _bits(codes).any()
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(4, 32).to(DEV)
        x[1, 3] = bad
        codes, scale = quantize_tensor_fp8(x)
        ref = quantize(x, "fp8_e4m3")
        assert torch.isnan(scale) and torch.isnan(ref.scales)
        assert torch.equal(_bits(codes), _bits(ref.data.contiguous()))


def test_refuses_other_formats():
    with pytest.raises(ValueError, match="not a per-tensor FP8 format"):
        quantize_tensor_fp8(torch.zeros(2, 32, device=DEV), "mxfp4")
