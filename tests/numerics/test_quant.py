"""Bit-exact tests of the reference quantizers against an independent numpy/ml_dtypes reference.

The reference below shares no code with ``mxtrain.numerics.quant``: shared exponents come from exact rational
arithmetic (``fractions.Fraction``) or, for the ``amd`` rule, from the float32 bit trick of ROCm's
cast kernel; element codes come from ml_dtypes casts (round half to even; the value is clipped to
+-max first, because ml_dtypes' FP8 casts overflow to NaN instead of saturating).
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import mxtrain
from mxtrain.numerics import rng
from mxtrain.numerics.formats import get_format

from numerics_helpers import ML, assert_bitwise_equal

MX_FORMATS = ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2"]
RULES = ["floor", "ceil", "rceil", "even", "amd"]
MX_ELEM = {"mxfp4": "e2m1", "mxfp6_e2m3": "e2m3", "mxfp6_e3m2": "e3m2", "mxfp8_e4m3": "e4m3",
           "mxfp8_e5m2": "e5m2"}


# ------------------------------------------------------------------------------------------------
# independent reference


def elem_info(ename):
    fi = ml_dtypes.finfo(ML[ename])
    mx = float(fi.max)
    emax = math.frexp(mx)[1] - 1          # exponent of the largest binade
    mbits = int(-math.log2(float(fi.eps)))  # eps = 2**-mbits
    return mx, emax, mbits


def grid(ename) -> np.ndarray:
    """Sorted finite values of the element format (from ml_dtypes)."""
    fi_bits = {"e2m1": 4, "e2m3": 6, "e3m2": 6, "e4m3": 8, "e5m2": 8}[ename]
    v = np.arange(2**fi_bits, dtype=np.uint8).view(ML[ename]).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def ref_shared_exp(amax: float, ename: str, rule: str) -> int:
    """Unbiased shared exponent of a finite block maximum, by exact arithmetic."""
    if amax == 0:
        return -127
    mx, emax, mbits = elem_info(ename)
    a = Fraction(amax)
    E = 0
    while Fraction(2) ** E > a:
        E -= 1
    while Fraction(2) ** (E + 1) <= a:
        E += 1
    # now 2**E <= a < 2**(E+1)
    if rule == "floor":
        s = E - emax
    elif rule == "ceil":
        s = (E if a == Fraction(2) ** E else E + 1) - emax
    elif rule == "rceil":
        s = E - emax - 2
        while a > Fraction(mx) * Fraction(2) ** s:
            s += 1
    elif rule == "even":
        sig = a / Fraction(2) ** E
        r = round(sig * 2**mbits)  # Python rounds Fractions half to even
        s = (E + 1 if r == 2 ** (mbits + 1) else E) - emax
    elif rule == "amd":
        # ROCm TE: add 2**21 to the float32 bit pattern, clear the mantissa, take the exponent
        bits = int(np.array([amax], dtype=np.float32).view(np.uint32)[0])
        bits = (bits + (1 << 21)) & ~((1 << 23) - 1)
        s = ((bits >> 23) - 127) - emax
    else:
        raise AssertionError(rule)
    return max(-127, min(127 - emax, s))  # quant.py: the upper clamp keeps dequantized values finite


def ref_cast(v64: np.ndarray, ename: str) -> np.ndarray:
    """uint8 codes of float64 values: clip to +-max, then ml_dtypes' RNE cast.

    ml_dtypes casts float64 through float32, so the values must be float32-exact (they are: x is
    float32 and the scale a power of two) unless they are below float32's normal range, where every
    element grid rounds them to zero anyway.
    """
    mx = elem_info(ename)[0]
    v = np.clip(v64, -mx, mx)
    v32 = v.astype(np.float32)
    ok = np.abs(v) < 2.0**-126
    assert np.all((v32.astype(np.float64) == v) | ok)
    return v32.astype(ML[ename]).view(np.uint8)


def ref_mx(x: torch.Tensor, fmt: str, axis: int, rule: str, block: int = 32, prescale: float = 1.0):
    """(codes, scale codes, dequantized) in the MXTensor layout (axis last, padded)."""
    ename = MX_ELEM[fmt]
    xm = np.moveaxis(x.to(torch.float32).numpy(), axis, -1)
    K = xm.shape[-1]
    pad = (-K) % block
    xm = np.concatenate([xm, np.zeros(xm.shape[:-1] + (pad,), np.float32)], -1)
    # the scale comes from the block before the prescale; the prescale is one float32 multiply after
    xp = (xm * np.float32(prescale)).astype(np.float64).reshape(-1, block)
    xm = xm.astype(np.float64)
    xb = xm.reshape(-1, block)
    scales = np.zeros(xb.shape[0], np.int64)
    codes = np.zeros(xb.shape, np.uint8)
    deq = np.zeros(xb.shape, np.float64)
    table = np.arange(256, dtype=np.uint8)[: 2 ** {"e2m1": 4, "e2m3": 6, "e3m2": 6}.get(ename, 8)]
    values = table.view(ML[ename]).astype(np.float64)
    for i, blk in enumerate(xb):
        if not np.all(np.isfinite(blk)):
            scales[i] = 255
            deq[i] = np.nan
            continue  # codes of a NaN block: all +0
        s = ref_shared_exp(float(np.max(np.abs(blk))), ename, rule)
        scales[i] = s + 127
        codes[i] = ref_cast(xp[i] * 2.0 ** (-s), ename)
        deq[i] = values[codes[i]] * 2.0**s
    shp = xm.shape
    return codes.reshape(shp), scales.reshape(shp[:-1] + (shp[-1] // block,)), deq.reshape(shp)


def check_mx(x, fmt, axis=-1, rule="floor", block=None, prescale=1.0, what=""):
    q = mxtrain.quantize(x, fmt, axis=axis, scale_rule=rule, block_size=block, prescale=prescale)
    codes, scales, deq = ref_mx(x, fmt, axis, rule, block or 32, prescale)
    w = f"{what} {fmt} {rule} axis={axis}"
    assert_bitwise_equal(q.scales.to(torch.int64), scales, w + " scales")
    assert_bitwise_equal(q.codes(), codes, w + " codes")
    # dequantize: original shape, axis order, NaN for NaN blocks
    K = x.shape[axis]
    ref = np.moveaxis(deq[..., :K], -1, axis)
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == torch.float32
    assert_bitwise_equal(out, ref, w + " dequantize")
    return q


# ------------------------------------------------------------------------------------------------
# test data


def binade_blocks(rows: int, K: int, lo=-30, hi=30, gen=None) -> torch.Tensor:
    """Normal values with a different random binade offset per 32-element block."""
    x = torch.randn(rows, K, generator=gen)
    nb = -(-K // 32)
    e = torch.randint(lo, hi + 1, (rows, nb), generator=gen).repeat_interleave(32, 1)[:, :K]
    return x * torch.pow(2.0, e.to(torch.float32))


def special_rows(fmt: str) -> torch.Tensor:
    """Rows of 32 (one block each) with every code, exact ties, near-ties, saturation, zeros,
    NaN/Inf and subnormal float32 values."""
    ename = MX_ELEM.get(fmt, "e2m1")
    g = grid(ename)
    mx = g[-1]
    rows = []
    pos = g[g > 0]
    mids = (g[:-1] + g[1:]) / 2  # exact ties (all representable in float32)
    for k in (0, -3, 5, -20):
        # every grid value (both signs) with the block max at the format's max: floor scale 2**k
        vals = np.concatenate([g, mids])
        for start in range(0, len(vals), 31):
            chunk = vals[start:start + 31]
            row = np.zeros(32)
            row[0] = mx
            row[1:1 + len(chunk)] = chunk
            rows.append(row * 2.0**k)
    for m in mids[-8:]:  # near-ties: one float32 ulp either side
        row = np.full(32, np.float32(m))
        row[::2] = np.nextafter(np.float32(m), np.float32(np.inf))
        row[1::4] = np.nextafter(np.float32(m), np.float32(0))
        row[0] = mx
        rows.append(row)
    # saturation: block maxima in (max, 2**(emax+1)), and values far above max after scaling
    rows.append(np.linspace(mx, 2.0 * 2 ** math.floor(math.log2(mx)) * 0.999, 32))
    rows.append(-np.linspace(mx * 1.01, mx * 1.9, 32))
    # significands around the bump thresholds of ceil/rceil/even/amd
    for sig in (1.0, 1.5, 1.74, 1.75, 1.76, 1.875, 1.9375, 1.96875, 1.999):
        row = np.linspace(-1, 1, 32) * sig
        row[7] = sig * 2.0 ** math.floor(math.log2(mx))
        rows.append(row)
    rows.append(np.zeros(32))
    rows.append(-np.zeros(32))
    # subnormal float32 inputs: a subnormal block, and a normal block holding subnormals
    sub = np.linspace(-1, 1, 32) * 2.0**-130
    rows.append(sub)
    rows.append(np.where(np.arange(32) % 2 == 0, sub, 1e-3))
    rows.append(np.full(32, 2.0**-149))
    # extremes of float32
    rows.append(np.linspace(-3.0e38, 3.4e38, 32))
    rows.append(np.linspace(-1, 1, 32) * 2.0**-110)
    # non-finite blocks
    for bad in (np.nan, np.inf, -np.inf):
        row = np.linspace(-1, 1, 32)
        row[11] = bad
        rows.append(row)
    return torch.tensor(np.stack(rows), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------
# MX: bit-exact against the reference


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_random_binades_and_special_blocks(fmt, rule):
    gen = torch.Generator().manual_seed(hash((fmt, rule)) % 2**31)
    x = binade_blocks(24, 96, gen=gen)
    check_mx(x, fmt, -1, rule, what="random")
    check_mx(special_rows(fmt), fmt, -1, rule, what="special")


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_mx_axes_and_odd_lengths(fmt):
    gen = torch.Generator().manual_seed(1)
    x2 = binade_blocks(37, 45, gen=gen)               # odd lengths on both axes
    check_mx(x2, fmt, 0, "floor", what="axis 0")      # the Wgrad direction: blocks along rows
    check_mx(x2, fmt, -1, "rceil", what="axis -1")
    x3 = torch.randn(3, 50, 7, generator=gen) * 2.0 ** torch.randint(-10, 10, (3, 1, 7), generator=gen)
    check_mx(x3, fmt, 1, "even", what="middle axis")
    check_mx(x3, fmt, 2, "amd", what="last axis of 3-d")
    check_mx(torch.randn(33, generator=gen), fmt, 0, "floor", what="1-d")
    check_mx(x2.t(), fmt, -1, "ceil", what="non-contiguous view")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3"])
def test_mx_input_dtypes(fmt, dtype):
    x = (torch.randn(8, 64) * 3).to(dtype)
    x[0, :5] = torch.tensor([float("nan"), 1, 2, 3, 4])
    check_mx(x, fmt, -1, "floor", what=str(dtype))
    y = mxtrain.fake_quantize(x, fmt)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.isnan(y[0, :32]).all() and torch.isfinite(y[1:]).all()


def test_float64_input_is_rounded_to_float32_first():
    x = torch.randn(4, 64, dtype=torch.float64)
    a, b = mxtrain.quantize(x, "mxfp4"), mxtrain.quantize(x.float(), "mxfp4")
    assert torch.equal(a.codes(), b.codes()) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e5m2"])
def test_mx_custom_block_size_and_prescale(fmt):
    x = binade_blocks(6, 64, lo=-4, hi=4)
    check_mx(x, fmt, -1, "floor", block=16, what="block 16")
    check_mx(x, fmt, -1, "floor", prescale=0.75, what="prescale")
    fq = mxtrain.fake_quantize(x, fmt, prescale=0.75)
    ref = mxtrain.quantize(x, fmt, prescale=0.75).dequantize() / 0.75
    assert torch.equal(fq, ref)


def test_three_quarter_prescale_with_floor_never_saturates():
    """Tseng et al.'s Algorithm 2: the exponent from the unscaled block, then x 3/4, puts every block
    maximum in [3, 6), so no element saturates (the plain floor rule puts it in [4, 8))."""
    torch.manual_seed(3)
    x = torch.randn(64, 256) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    for prescale, expect_clip in ((0.75, False), (1.0, True)):
        q = mxtrain.quantize(x, "mxfp4", scale_rule="floor", prescale=prescale)
        s = q.scales.to(torch.float64) - 127
        amax = x.double().abs().reshape(64, 8, 32).amax(-1)
        top = amax * prescale / torch.exp2(s)
        assert bool((top >= 3).all())
        assert bool((top > 6).any()) == expect_clip
        if not expect_clip:
            assert bool((top < 6).all())


def test_nonfinite_blocks_never_come_back_finite():
    x = torch.randn(6, 64)
    x[0, 3], x[1, 40], x[2, 0], x[2, 63] = float("nan"), float("inf"), -float("inf"), float("nan")
    for fmt in MX_FORMATS + ["nvfp4"]:
        b = 16 if fmt == "nvfp4" else 32
        for rounding in ("nearest", "stochastic"):
            q = mxtrain.quantize(x, fmt, rounding=rounding, seed=3)
            y = q.dequantize()
            bad = torch.zeros_like(y, dtype=torch.bool)
            bad[0, :b] = bad[1, 32:32 + b] = bad[2, :b] = bad[2, -b:] = True
            assert torch.isnan(y[bad]).all() and torch.isfinite(y[~bad]).all(), (fmt, rounding)
            if fmt != "nvfp4":
                assert q.scales[0, 0] == 255 and q.scales[1, 1] == 255 and q.scales[0, 1] != 255
                assert (q.codes()[0, :32] == 0).all()  # elements of a NaN block are +0
            else:
                assert torch.isnan(q.scales[0, 0].float()) and torch.isfinite(q.scales[0, 1].float())
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        assert torch.isnan(mxtrain.fake_quantize(x, fmt)).all()
        assert torch.isfinite(mxtrain.fake_quantize(x[3:], fmt)).all()


def test_empty_tensors():
    # regression: per-tensor FP8 called amax() on an empty tensor and raised
    for fmt in MX_FORMATS + ["nvfp4", "fp8_e4m3", "fp8_e5m2"]:
        for shape in ((0, 32), (4, 0)):
            assert mxtrain.fake_quantize(torch.randn(*shape), fmt).shape == shape


def test_tiny_tensors_do_not_turn_into_nan():
    # regression: a tensor scale that underflowed to 0 gave 0/0 = NaN for the zeros of a finite
    # tensor (NVFP4 and per-tensor FP8). Such a scale is now 1, and the tiny values round to 0.
    x = torch.randn(2, 32) * 1e-43
    x[1] = 0
    for fmt in MX_FORMATS + ["nvfp4", "fp8_e4m3", "fp8_e5m2"]:
        assert torch.isfinite(mxtrain.fake_quantize(x, fmt)).all(), fmt
    check_mx(x, "mxfp8_e5m2", what="tiny")


def test_zero_blocks_are_zero():
    x = torch.zeros(3, 64)
    for fmt in MX_FORMATS + ["nvfp4", "fp8_e4m3", "fp8_e5m2"]:
        y = mxtrain.fake_quantize(x, fmt)
        assert torch.equal(y, x), fmt
    assert (mxtrain.quantize(x, "mxfp4").scales == 0).all()


def test_ties_round_half_to_even_by_hand():
    # E2M1 with scale 1 (block max 6): ties go to the even code; above max saturates
    x = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.25, -5.0, 0.1] + [0] * 20)
    got = mxtrain.fake_quantize(x, "mxfp4")[:12]
    assert got.tolist() == [6, 0, 1, 1, 2, 2, 4, 4, 6, -0.0, -4, 0]
    assert torch.signbit(got[9])


# ------------------------------------------------------------------------------------------------
# NVFP4 and per-tensor FP8 against a numpy implementation of quant.py's definition


def ref_nvfp4(x: torch.Tensor, axis: int, two_d: bool):
    f32 = np.float32
    xm = np.moveaxis(x.to(torch.float32).numpy(), axis, -1).astype(np.float32)
    K = xm.shape[-1]
    xm = np.concatenate([xm, np.zeros(xm.shape[:-1] + ((-K) % 16,), f32)], -1)
    if two_d:
        R = xm.shape[-2]
        xm = np.concatenate([xm, np.zeros(xm.shape[:-2] + ((-R) % 16, xm.shape[-1]), f32)], -2)
    fin = np.isfinite(xm)
    absx = np.where(fin, np.abs(xm), f32(0))
    tmax = absx.max() if absx.size else f32(0)
    g = f32(tmax) / f32(6 * 448)
    g = g if g > 0 else f32(1)
    # blocks -> (nblocks, 16) or tiles (ntiles, 256)
    if two_d:
        *lead, R, Kp = xm.shape
        def tiles(a):
            return a.reshape(*lead, R // 16, 16, Kp // 16, 16).swapaxes(-3, -2).reshape(-1, 256)
        xb, fb = tiles(xm), tiles(fin)
    else:
        xb, fb = xm.reshape(-1, 16), fin.reshape(-1, 16)
    ok = fb.all(-1)
    amax = np.where(fb, np.abs(xb), f32(0)).max(-1).astype(f32)
    b = np.minimum(amax / (g * f32(6)), f32(448)).astype(f32).astype(ml_dtypes.float8_e4m3fn)
    b = np.where(ok, b.astype(f32), f32(np.nan)).astype(ml_dtypes.float8_e4m3fn)
    d = (b.astype(f32) * g).astype(f32)
    use = ok & (d > 0)
    v = np.where(use[:, None], xb / np.where(use, d, f32(1))[:, None], f32(0)).astype(f32)
    codes = np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    if two_d:
        codes = codes.reshape(*lead, R // 16, Kp // 16, 16, 16).swapaxes(-3, -2).reshape(xm.shape)
        b = b.reshape(*lead, R // 16, Kp // 16)
    else:
        codes = codes.reshape(xm.shape)
        b = b.reshape(xm.shape[:-1] + (xm.shape[-1] // 16,))
    return codes, b.astype(np.float64), np.float64(g)


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_against_numpy_reference(two_d):
    gen = torch.Generator().manual_seed(5)
    cases = [
        (torch.randn(40, 70, generator=gen) * 2.0 ** torch.randint(-12, 12, (40, 1), generator=gen), -1),
        (torch.randn(35, 48, generator=gen), 0),
        (torch.randn(2, 20, 33, generator=gen) * 1e-3, 1),
    ]
    x = torch.randn(32, 64, generator=gen)
    x[3, 5], x[20, 40] = float("nan"), float("inf")
    x[6:9] = 0.0
    x[10, :16] = torch.tensor(2.0**-140)  # a block far below the tensor max (its scale underflows)
    cases.append((x, -1))
    big = special_rows("nvfp4")
    cases.append((big[torch.isfinite(big).all(1)], -1))
    cases.append((torch.randn(16, 32, generator=gen) * 1e-43, -1))  # g underflows: 1 instead
    cases.append((torch.randn(20, 48, generator=gen).to(torch.bfloat16), -1))
    cases.append((torch.randn(20, 48, generator=gen).to(torch.float16), 0))
    for x, axis in cases:
        q = mxtrain.quantize(x, "nvfp4", axis=axis, block_size=(16, 16) if two_d else None)
        codes, b, g = ref_nvfp4(x, axis, two_d)
        assert_bitwise_equal(q.codes(), codes, "nvfp4 codes")
        assert_bitwise_equal(q.scales.to(torch.float32), b, "nvfp4 block scales")
        assert q.global_scale.item() == g
        out = q.dequantize()
        assert out.shape == x.shape


def test_nvfp4_2d_tiles_identical_for_w_and_wt():
    w = torch.randn(48, 80)
    a = mxtrain.fake_quantize(w, "nvfp4", axis=-1, block_size=(16, 16))
    b = mxtrain.fake_quantize(w, "nvfp4", axis=0, block_size=(16, 16))
    assert torch.equal(a, b)
    c = mxtrain.fake_quantize(w, "nvfp4", axis=0)
    assert not torch.equal(a, c)


def np_tensor_fp8_scales(amax, mx):
    """Per-tensor FP8 current scaling (TransformerEngine's and torchao's float8): the float32 multiplier
    ``mx / amax`` and scale ``1 / multiplier``, IEEE float32 divisions in numpy (multiplier 1 for amax 0, at
    most float32's max)."""
    amax, mx = np.float32(amax), np.float32(mx)
    if amax == 0:
        return np.float32(1), np.float32(1)
    with np.errstate(over="ignore"):
        m = np.minimum(mx / amax, np.finfo(np.float32).max).astype(np.float32)
    return m, (np.float32(1) / m).astype(np.float32)


def test_per_tensor_fp8_scales_are_ieee_float32_quotients():
    """``tensor_fp8_scales`` computes its two quotients through float64: each must be the IEEE float32
    quotient (numpy's float32 division), here for amax across float32's range, near powers of two and at
    the clamp (subnormal amax: the multiplier overflows float32 and is clamped)."""
    from mxtrain.numerics.quant import tensor_fp8_scales
    g = np.random.default_rng(0)
    amax = (g.random(20000) + 0.5) * np.exp2(g.integers(-149, 127, 20000).astype(np.float64))
    amax = np.concatenate([amax, np.exp2(np.arange(-149, 127, dtype=np.float64))]).astype(np.float32)
    amax = np.concatenate([amax, np.nextafter(amax, np.float32(np.inf)), np.nextafter(amax, np.float32(0))])
    amax = amax[(amax > 0) & np.isfinite(amax)]
    for mx in (448.0, 57344.0):
        m, s = tensor_fp8_scales(torch.from_numpy(amax), mx)
        want = [np_tensor_fp8_scales(a, mx) for a in amax]
        assert_bitwise_equal(m.double(), np.array([w[0] for w in want], np.float64), f"multiplier {mx}")
        assert_bitwise_equal(s.double(), np.array([w[1] for w in want], np.float64), f"scale {mx}")
    m, s = tensor_fp8_scales(torch.tensor([0.0, float("inf"), float("nan")]), 448.0)
    assert m[0] == s[0] == 1 and m[1:].isnan().all() and s[1:].isnan().all()


@pytest.mark.parametrize("fmt,ename", [("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")])
def test_per_tensor_fp8_against_numpy_reference(fmt, ename):
    gen = torch.Generator().manual_seed(7)
    for x in (torch.randn(13, 29, generator=gen) * 2.0 ** torch.randint(-20, 20, (13, 1), generator=gen),
              torch.randn(6, 9, generator=gen).to(torch.bfloat16),
              torch.randn(6, 9, generator=gen).to(torch.float16),
              torch.randn(3, 4, 5, generator=gen) * 1e-30,
              torch.randn(7, generator=gen) * 1e30,
              torch.randn(5, 5, generator=gen) * 1e-44):  # the scale underflows: 1 instead
        q = mxtrain.quantize(x, fmt, axis=0)
        xm = np.moveaxis(x.float().numpy(), 0, -1).astype(np.float32)
        mx = np.float32(elem_info(ename)[0])
        m, scale = np_tensor_fp8_scales(np.abs(xm).max(), mx)
        v = (xm * m).astype(np.float32)
        codes = np.clip(v, -mx, mx).astype(ML[ename]).view(np.uint8)
        assert q.scales.item() == float(scale)
        assert_bitwise_equal(q.codes(), codes, fmt)
        ref = np.moveaxis(codes.view(ML[ename]).astype(np.float64) * np.float64(scale), -1, 0)
        assert_bitwise_equal(q.dequantize().double(), ref.astype(np.float32).astype(np.float64), fmt + " dequant")


# ------------------------------------------------------------------------------------------------
# stochastic rounding


def neighbours(v: np.ndarray, ename: str):
    g = grid(ename)
    v = np.clip(v, g[0], g[-1])
    hi = g[np.searchsorted(g, v, side="left")]
    lo = g[np.searchsorted(g, v, side="right") - 1]
    return lo, hi


def values_before_rounding(xm: np.ndarray, d: np.ndarray, fmt: str) -> np.ndarray:
    """float64 copies of the float32 values a format rounds onto its grid: ``x / d`` for the block formats
    (``d``: ``scale_values()``; exact for MX), ``x * m`` for per-tensor FP8 (``np_tensor_fp8_scales``)."""
    if fmt.startswith("fp8_"):
        m, _ = np_tensor_fp8_scales(np.abs(xm).max(), elem_info(fmt[4:])[0])
        return (xm.astype(np.float32) * m).astype(np.float32).astype(np.float64)
    return (xm / d).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_sr_gives_only_the_two_neighbours(fmt):
    ename = MX_ELEM[fmt]
    x = binade_blocks(16, 64, lo=-5, hi=5)
    near = mxtrain.quantize(x, fmt)
    for seed in range(4):
        q = mxtrain.quantize(x, fmt, rounding="stochastic", seed=seed)
        assert torch.equal(q.scales, near.scales)  # the scale does not depend on the rounding
        s = q.scales.to(torch.float64) - 127
        v = (x.double() / torch.pow(2.0, s).repeat_interleave(32, -1)).numpy()
        lo, hi = neighbours(v, ename)
        e = q.elements().double().numpy()
        assert np.all((e == lo) | (e == hi)), fmt


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2", "mxfp8_e4m3", "nvfp4", "fp8_e5m2"])
def test_sr_bit_exact_against_hash_reference(fmt):
    # Independent SR: per-element uniforms from the numpy lowbias32 below, indexed by the element's
    # linear index in x's own layout; |v| goes up iff u < (|v| - lo) / (hi - lo).
    ename = (MX_ELEM | {"nvfp4": "e2m1", "fp8_e5m2": "e5m2"})[fmt]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(45, 7, generator=gen) * 2.0 ** torch.randint(-3, 3, (1, 7), generator=gen)
    seed, axis = 77, 0
    q = mxtrain.quantize(x, fmt, axis=axis, rounding="stochastic", seed=seed)
    d = mxtrain.quantize(x, fmt, axis=axis).scale_values().numpy()   # (7, padded 45)
    n = d.shape[-1]
    xm = np.zeros((7, n), np.float32)
    xm[:, :45] = x.numpy().T
    v = values_before_rounding(xm, d, fmt)
    idx = np.zeros((7, n), np.uint64)
    idx[:, :45] = np.arange(x.numel(), dtype=np.uint64).reshape(45, 7).T
    u = (np_mix32(idx ^ np.uint64(rng.stream_key(seed))) >> np.uint32(8)).astype(np.float64) * 2.0**-24
    g = grid(ename)
    mag = np.minimum(np.abs(v), g[-1])
    lo = g[np.searchsorted(g, mag, side="right") - 1]
    hi = g[np.searchsorted(g, mag, side="left")]
    frac = np.where(hi > lo, (mag - lo) / np.where(hi > lo, hi - lo, 1), 0)
    expect = np.copysign(np.where(u < frac, hi, lo), v)
    assert_bitwise_equal(q.elements().double(), expect, f"SR {fmt}")


def test_sr_is_seeded_and_reproducible():
    x = torch.randn(8, 64)
    for fmt in ("mxfp4", "nvfp4", "fp8_e5m2"):
        a = mxtrain.fake_quantize(x, fmt, rounding="stochastic", seed=11)
        b = mxtrain.fake_quantize(x, fmt, rounding="stochastic", seed=11)
        c = mxtrain.fake_quantize(x, fmt, rounding="stochastic", seed=12)
        assert torch.equal(a, b) and not torch.equal(a, c), fmt


def sr_z_scores(fmt: str, rounding: str, n_seeds: int = 400) -> np.ndarray:
    """Per-element z statistic of mean(quantized element over seeds) - v under the SR model.

    ``v = x / scale`` (per-tensor FP8: ``x * m``) is the value before rounding (the scale does not depend on
    the rounding).
    For v strictly between grid neighbours lo < v < hi, unbiased SR gives hi with probability
    p = (v - lo) / (hi - lo); one draw has variance (hi - lo)**2 p (1 - p).
    """
    ename = (MX_ELEM | {"nvfp4": "e2m1", "fp8_e4m3": "e4m3"})[fmt]
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(4, 32, generator=gen) * 5.5 - 2.75
    x[:, ::16] = 4.0  # block maxima; with the MX floor rule: scale 1, v = x, no saturation
    d = mxtrain.quantize(x, fmt).scale_values().numpy()
    v = values_before_rounding(x.numpy(), d, fmt)
    keep = np.arange(32) % 16 != 0  # leave the block maxima out: for nvfp4/fp8 x / d can be 1 ulp above max
    v = v[:, keep]
    lo, hi = neighbours(v, ename)
    assert np.all(np.abs(v) <= grid(ename)[-1])  # in range: SR is unbiased there
    inner = hi > lo
    p = np.where(inner, (v - lo) / np.where(inner, hi - lo, 1), 0)
    var = (hi - lo) ** 2 * p * (1 - p)
    acc = np.zeros_like(v)
    for seed in range(n_seeds):
        acc += mxtrain.quantize(x, fmt, rounding=rounding, seed=1000 + seed).elements().double().numpy()[:, keep]
    mean = acc / n_seeds
    assert np.all(mean[~inner] == v[~inner])  # values on the grid are never moved
    return (mean[inner] - v[inner]) / np.sqrt(var[inner] / n_seeds)


Z_MAX = 5.0  # per-element threshold; with ~120 elements a false alarm has probability < 1e-4


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e3m2", "nvfp4", "fp8_e4m3"])
def test_sr_is_unbiased(fmt):
    z = sr_z_scores(fmt, "stochastic")
    assert np.abs(z).max() < Z_MAX, f"max |z| = {np.abs(z).max():.2f}"
    assert abs(z.mean()) * math.sqrt(z.size) < Z_MAX


def test_unbiasedness_test_has_power():
    # nearest rounding is biased for almost every x; the same test must reject it
    z = sr_z_scores("mxfp4", "nearest", n_seeds=50)
    assert np.abs(z).max() > Z_MAX
    # and so is a stochastic rounder whose threshold is 3 % off
    orig = mxtrain.numerics.quant.round_to_elem

    def biased(v, elem, rounding="nearest", u=None):
        return orig(v, elem, rounding, None if u is None else u * 1.03)

    mxtrain.numerics.quant.round_to_elem = biased
    try:
        z = sr_z_scores("mxfp4", "stochastic")
    finally:
        mxtrain.numerics.quant.round_to_elem = orig
    assert np.abs(z).max() > Z_MAX


# ------------------------------------------------------------------------------------------------
# counter-based random numbers (independent numpy uint32 implementation of lowbias32)


def np_mix32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def test_mix32_matches_numpy_uint32_arithmetic():
    vals = np.random.default_rng(0).integers(0, 2**32, 5000, dtype=np.uint64)
    vals[:3] = [0, 1, 2**32 - 1]
    ours = rng.mix32(torch.tensor(vals.astype(np.int64))).numpy()
    assert_bitwise_equal(ours.astype(np.uint64), np_mix32(vals).astype(np.uint64), "mix32")
    assert [rng.mix32_int(int(v)) for v in vals[:50]] == [int(v) for v in np_mix32(vals[:50])]
    assert rng.mix32_int(0) == 0


def test_uniform_bits_and_range():
    key = rng.stream_key(1234)
    idx = torch.arange(4096, dtype=torch.int64)
    u = rng.uniform(idx, key)
    expect = (np_mix32(np.arange(4096, dtype=np.uint64) ^ np.uint64(key)) >> np.uint32(8)).astype(np.float64) * 2.0**-24
    assert_bitwise_equal(u.double(), expect, "uniform")
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    big = rng.uniform(idx + 2**32, key)  # upper index words change the stream
    assert not torch.equal(big, u)
    s = rng.random_signs(64, key)
    assert set(s.tolist()) <= {-1.0, 1.0} and s.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# argument checking


def test_bad_arguments_list_the_choices():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="valid: floor, ceil, rceil, even, amd"):
        mxtrain.quantize(x, "mxfp4", scale_rule="up")
    with pytest.raises(ValueError, match="valid: nearest, stochastic"):
        mxtrain.quantize(x, "mxfp4", rounding="down")
    with pytest.raises(ValueError, match="block_size"):
        mxtrain.quantize(x, "fp8_e4m3", block_size=32)
    with pytest.raises(ValueError, match="block_size"):
        mxtrain.quantize(x, "nvfp4", block_size=32)
    with pytest.raises(ValueError, match="axis"):
        mxtrain.quantize(x, "mxfp4", axis=2)
    with pytest.raises(TypeError):
        mxtrain.quantize(torch.ones(4, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="prescale"):
        mxtrain.quantize(x, "mxfp4", prescale=0.0)


def test_bf16_format_is_identity():
    x = torch.randn(3, 5)
    assert mxtrain.fake_quantize(x, "bf16") is x
    assert torch.equal(mxtrain.quantize(x, "bf16").dequantize(), x)


@pytest.mark.parametrize("rule", RULES)
def test_finite_blocks_never_dequantize_to_inf(rule):
    # Regression: the round-up rules used to pick s = 126 for block maxima near float32's max, so
    # elements that round up to 4 dequantized to 4 * 2**126 = Inf. The exponent is now clamped to
    # 127 - emax, where max_elem * 2**s stays finite.
    top = torch.tensor([3.4028235e38, 1.9 * 2.0**127, 1.75 * 2.0**127, 1.5 * 2.0**127])
    x = top[:, None] * torch.linspace(-1, 1, 32)
    for fmt in MX_FORMATS:
        y = mxtrain.fake_quantize(x, fmt, scale_rule=rule)
        assert torch.isfinite(y).all(), (fmt, rule)
        y = mxtrain.fake_quantize(x, fmt, scale_rule=rule, rounding="stochastic", seed=0)
        assert torch.isfinite(y).all(), (fmt, rule)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", MX_FORMATS + ["nvfp4", "fp8_e4m3", "fp8_e5m2"])
def test_cuda_matches_cpu_bit_for_bit(fmt):
    x = torch.cat([binade_blocks(16, 96), special_rows("mxfp4")[:, :32].repeat(1, 3)])
    for rule in RULES:
        for rounding in ("nearest", "stochastic"):
            kw = dict(rounding=rounding, seed=5, scale_rule=rule)
            a, b = mxtrain.quantize(x, fmt, **kw), mxtrain.quantize(x.cuda(), fmt, **kw)
            assert torch.equal(a.codes(), b.codes().cpu()), (fmt, rule, rounding)
            assert_bitwise_equal(b.dequantize().cpu(), a.dequantize(), f"{fmt} {rule} {rounding} cuda")


def test_stream_key_t_equals_stream_key_elementwise():
    """The tensor fold used to refresh CUDA-graph seeds gives ``rng.stream_key`` for every element,
    including parts above 2**32 (their high word is folded in) and broadcast scalar parts."""
    g = np.random.default_rng(5)
    parts = [g.integers(0, 2**40, size=64, dtype=np.int64) for _ in range(4)]
    parts[1][:8] = [0, 1, 2**31, 2**32 - 1, 2**32, 2**33 + 7, 2**39, 5]
    got = rng.stream_key_t(*[torch.from_numpy(p) for p in parts], 123)
    want = [rng.stream_key(*(int(p[i]) for p in parts), 123) for i in range(64)]
    assert got.tolist() == want
    assert int(rng.stream_key_t(torch.tensor(9))) == rng.stream_key(9)
