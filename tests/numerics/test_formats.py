"""Element and scale encodings against ml_dtypes (independent reference), code by code."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import mxtrain
from mxtrain.numerics.formats import ELEMENTS, FORMATS, get_format
from mxtrain.numerics.quant import MXTensor, elem_table, encode_elem, pack_fp4, unpack_fp4

from numerics_helpers import ML, assert_bitwise_equal



def ml_values(name: str) -> np.ndarray:
    """float64 value of every code 0 .. 2**bits-1 according to ml_dtypes."""
    bits = ELEMENTS[name].bits
    codes = np.arange(2**bits, dtype=np.uint8)
    return codes.view(ML[name]).astype(np.float64)


@pytest.mark.parametrize("name", list(ML))
def test_every_code_decodes_like_ml_dtypes(name):
    # All codes, including FP8's NaN (E4M3 S.1111.111; E5M2 exponent 11111 with mantissa != 0)
    # and Inf (E5M2 S.11111.00) codes: decode() returns NaN / +-Inf for them, compared NaN == NaN.
    elem = ELEMENTS[name]
    ours = np.array([elem.decode(c) for c in range(2**elem.bits)])
    assert_bitwise_equal(ours, ml_values(name), f"{name}.decode")


@pytest.mark.parametrize("name", list(ML))
def test_elem_table_equals_ml_dtypes(name):
    elem = ELEMENTS[name]
    table = elem_table(elem)
    assert table.dtype == torch.float32 and table.numel() == 2**elem.bits
    assert_bitwise_equal(table, ml_values(name), f"elem_table({name})")


@pytest.mark.parametrize("name", list(ML))
def test_format_constants_match_ml_dtypes(name):
    elem, fi = ELEMENTS[name], ml_dtypes.finfo(ML[name])
    assert elem.max == float(fi.max)
    assert 2.0**elem.emin == float(fi.smallest_normal)
    assert elem.min_subnormal == float(fi.smallest_subnormal)
    # emax: exponent of the largest binade (OCP emax_elem)
    assert elem.emax == math.frexp(float(fi.max))[1] - 1
    assert elem.bits == {"e2m1": 4, "e2m3": 6, "e3m2": 6, "e4m3": 8, "e5m2": 8}[name]


@pytest.mark.parametrize("name", list(ML))
def test_encode_every_finite_code(name):
    # encode_elem is the inverse of decode on every finite code (both zeros included).
    vals = ml_values(name)
    finite = np.isfinite(vals)
    codes = np.arange(2 ** ELEMENTS[name].bits)[finite]
    got = encode_elem(torch.tensor(vals[finite], dtype=torch.float32), ELEMENTS[name])
    assert_bitwise_equal(got.numpy().astype(np.int64), codes, f"encode_elem({name})")


def test_e8m0_scale_decoding_all_256_codes():
    # MXTensor's scale decoding (code c -> 2**(c-127), 255 -> NaN) vs ml_dtypes float8_e8m0fnu.
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    one = 2  # E2M1 code of 1.0
    data = pack_fp4(torch.full((256, 32), one, dtype=torch.uint8)).view(torch.float4_e2m1fn_x2)
    mx = MXTensor(get_format("mxfp4"), data, codes[:, None].clone(), (256, 32), 1, 32)
    got = mx.scale_values()[:, 0].numpy().astype(np.float64)
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert_bitwise_equal(got, ref, "E8M0 scales")
    deq = mx.dequantize()[:, 0].numpy().astype(np.float64)
    assert_bitwise_equal(deq, ref, "E8M0 scales through dequantize")


def test_fp4_packing_low_nibble_first_and_round_trip():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # (3, 32)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 16)
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert int(packed[0, 0]) == 0x10 and int(packed[0, 7]) == 0xFE
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(unpack_fp4(packed.view(torch.float4_e2m1fn_x2)), codes)


def test_quantized_data_dtypes_and_layout():
    x = torch.randn(5, 70)
    assert mxtrain.quantize(x, "mxfp4").data.dtype == torch.float4_e2m1fn_x2
    assert mxtrain.quantize(x, "mxfp4").data.shape == (5, 48)  # 70 -> 96 padded, 2 per byte
    assert mxtrain.quantize(x, "mxfp4").scales.shape == (5, 3)
    assert mxtrain.quantize(x, "mxfp4").scales.dtype == torch.uint8
    assert mxtrain.quantize(x, "mxfp6_e2m3").data.dtype == torch.uint8
    assert mxtrain.quantize(x, "mxfp8_e4m3").data.dtype == torch.float8_e4m3fn
    assert mxtrain.quantize(x, "mxfp8_e5m2").data.dtype == torch.float8_e5m2
    assert mxtrain.quantize(x, "nvfp4").scales.dtype == torch.float8_e4m3fn
    assert mxtrain.quantize(x, "nvfp4", block_size=(16, 16)).scales.shape == (1, 5)
    q = mxtrain.quantize(x, "mxfp4", axis=0)  # axis moved last, padded to 32
    assert q.data.shape == (70, 16) and q.scales.shape == (70, 1)
    assert mxtrain.quantize(x, "fp8_e4m3").scales.shape == ()


def test_format_registry():
    assert mxtrain.format_names() == list(FORMATS)
    assert set(mxtrain.format_names()) == {"mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2",
                                           "mxint4", "mxe1m2", "nvfp4", "fp8_e4m3", "fp8_e5m2", "bf16"}
    with pytest.raises(ValueError, match="valid formats: mxfp4"):
        get_format("mxfp5")
    with pytest.raises(ValueError, match="valid formats"):
        mxtrain.quantize(torch.ones(4), "int4")
