"""mxtrain's MX quantizer against torchao's ``to_mx`` (torchao 0.18.0), bit for bit.

torchao is a second, independent implementation of OCP MX quantization; its ``ScaleCalculationMode``
``FLOOR``, ``CEIL``, ``EVEN`` and ``RCEIL`` are mxtrain's scale rules ``floor``, ``ceil``, ``even`` and
``rceil`` (mxtrain's ``amd`` has no torchao counterpart). Both quantize along the last axis in blocks
of 32 with round-half-to-even, saturating element casts.

* ``test_agrees_bit_for_bit``: on 131,072 float32 values per rule and format (random values of
  magnitudes 2**-40..2**40 with zeros, -0 and float32 subnormals mixed in, every element grid value,
  every rounding midpoint of the grid and its float32 neighbours, values at and just above the element
  max, and block maxima at and 1-2 ulps around every scale rule's threshold), the E8M0 scale codes, the
  element codes (FP4 also as packed bytes) and the float32 dequantized values are identical.
* ``test_documented_differences``: torchao differs on three kinds of finite blocks, all far outside the
  range of real tensors; for each the test asserts torchao's exact output (the rounding of the elements
  is the same, only the power of two they are divided by differs):

  1. Scale code 0 (block max below ``2**(emax-126)``, or ``max_elem * 2**-127`` for RCEIL, i.e. about
     1e-37): torchao writes scale 2**-127 but divides the elements by 2**-126 (FLOOR, CEIL, EVEN clamp
     the float scale to the smallest normal float32) or by 1 (RCEIL), so its elements are half of
     mxtrain's, or flushed to zero.
  2. Block max near float32's max: mxtrain clamps ``s <= 127 - emax`` so that a finite block never
     dequantizes to Inf; torchao allows one more binade (CEIL, EVEN, RCEIL), and its block then
     dequantizes to Inf. FLOOR never reaches the clamp and agrees.
  3. RCEIL only: torchao computes ``ceil(log2(amax / max_elem))`` in float32; when ``amax / max_elem``
     is a few ulps above a power of two ``2**j``, float32 ``log2`` can return exactly ``j`` (1 ulp above:
     always for |j| >= 16, from |j| = 4 or 5 with torch 2.13's CPU log2, never for |j| <= 1) and the
     scale comes out one binade below the exact rule, so the block max saturates (an error of a few
     float32 ulps). mxtrain decides ``amax <= max_elem * 2**s`` exactly.

* ``test_nonfinite_blocks``: a block holding NaN gets the NaN scale (255) in both, and dequantizes to
  NaN in both. A block holding +-Inf but no NaN differs by convention: mxtrain gives it the NaN scale
  (the whole block reads back NaN); torchao gives it the scale ``2**(128-emax)`` (FLOOR, CEIL, EVEN) or
  ``2**127`` (RCEIL) and saturates the Inf elements, which dequantize to +-Inf again. Element codes of
  non-finite blocks are not compared (mxtrain writes +0; torchao's are whatever its casts give NaN).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

torchao = pytest.importorskip(
    "torchao", minversion="0.18.0",
    reason="torchao (an independent MX implementation) is not installed: pip install torchao==0.18.0")

from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402

from mxtrain.numerics.formats import get_format  # noqa: E402
from mxtrain.numerics.quant import elem_table, encode_elem, pow2, quantize, round_to_elem, unpack_fp4  # noqa: E402

RULES = {"floor": ScaleCalculationMode.FLOOR, "ceil": ScaleCalculationMode.CEIL,
         "even": ScaleCalculationMode.EVEN, "rceil": ScaleCalculationMode.RCEIL}
ELEM_DTYPES = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp6_e2m3": DTYPE_FP6_E2M3, "mxfp8_e4m3": torch.float8_e4m3fn}
CASES = [(r, f) for f in ELEM_DTYPES for r in RULES]
IDS = [f"{r}-{f}" for r, f in CASES]
N_BLOCKS = 4096  # 131,072 values
SAFE_J = [-110, -96, -77, -64, -50, -40, -33, -20, -16, -9, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 9, 16,
          20, 33, 40, 50, 64, 77, 96, 110]


# ------------------------------------------------------------------------------------------------
# both quantizers, read back as uint8 codes


def _torchao(x: torch.Tensor, fmt: str, rule: str):
    """(scale codes (rows, blocks), element codes (rows, K), packed data, dequantized float32)."""
    scale, data = to_mx(x.contiguous(), ELEM_DTYPES[fmt], 32, RULES[rule])
    deq = to_dtype(data, scale, ELEM_DTYPES[fmt], 32, torch.float32)
    data = data.view(torch.uint8)
    codes = unpack_fp4(data) if fmt == "mxfp4" else data
    return scale.view(torch.uint8), codes, data, deq


def _mxtrain(x: torch.Tensor, fmt: str, rule: str):
    q = quantize(x, fmt, axis=-1, block_size=32, scale_rule=rule)
    return q.scales, q.codes(), q.data.view(torch.uint8), q.dequantize()


def _codes_divided(x: torch.Tensor, fmt: str, mult: torch.Tensor) -> torch.Tensor:
    """Element codes of ``x * mult`` (one exact power of two per block) by mxtrain's element rounding."""
    elem = get_format(fmt).elem
    v = x.reshape(x.shape[0], -1, 32) * mult[..., None]
    return encode_elem(round_to_elem(v, elem), elem).reshape(x.shape)


def _exact_exponent(amax: float, fmt: str, rule: str) -> int:
    """The rule's shared exponent by exact rational arithmetic, not clamped above (below at -127)."""
    elem = get_format(fmt).elem
    if amax == 0:
        return -127
    a = Fraction(amax)
    E = a.numerator.bit_length() - a.denominator.bit_length()
    E += 1 if Fraction(2) ** (E + 1) <= a else 0
    E -= 1 if Fraction(2) ** E > a else 0  # now 2**E <= a < 2**(E+1)
    sig = a / Fraction(2) ** E
    if rule == "floor":
        s = E - elem.emax
    elif rule == "ceil":
        s = E + (sig > 1) - elem.emax
    elif rule == "even":
        s = E + (round(sig * 2**elem.mbits) == 2 ** (elem.mbits + 1)) - elem.emax  # Fraction: half to even
    else:  # rceil: the smallest s with amax <= max_elem * 2**s
        s = E - elem.emax - 1
        while a > Fraction(elem.max) * Fraction(2) ** s:
            s += 1
    return max(s, -127)


# ------------------------------------------------------------------------------------------------
# test data


def _f32(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float64).to(torch.float32)


def _ulps(v: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``v`` moved by ``n`` ulps away from zero (positive finite ``v``)."""
    return (v.view(torch.int32) + n).view(torch.float32)


def _grid(fmt: str) -> torch.Tensor:
    """Sorted non-negative values of the element format."""
    t = elem_table(get_format(fmt).elem)
    return torch.unique(t[torch.isfinite(t) & (t >= 0)])


def _fill(amax: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One block per entry of ``amax``: element 0 is ``amax``, the rest uniform in (-amax, amax)."""
    blk = (torch.rand(len(amax), 32, generator=gen) * 2 - 1) * amax[:, None]
    blk[:, 0] = amax
    return blk


def _wide_range_values(fmt: str) -> torch.Tensor:
    """N_BLOCKS x 32 float32 values on which both quantizers must agree (see the module docstring)."""
    gen = torch.Generator().manual_seed(2202)
    elem = get_format(fmt).elem
    g = _grid(fmt)
    top = 2.0**elem.emax
    blocks = []

    # every grid value (each at least 100 times), both signs, with the block max at max_elem * 2**k
    k = torch.randint(-30, 31, (256, 1), generator=gen).to(torch.float32)
    vals = g[(torch.arange(256 * 32) % len(g))[torch.randperm(256 * 32, generator=gen)]].reshape(256, 32)
    vals[:, 0] = elem.max
    sign = torch.where(torch.rand(256, 32, generator=gen) < 0.5, -1.0, 1.0)
    blocks.append(vals * sign * torch.exp2(k))

    # rounding midpoints of the grid, exact and one float32 ulp either side. With the block max a power
    # of two, 2**emax, every rule picks the same scale, so the midpoints below it are ties for all rules;
    # with the block max at max_elem they are ties for floor, even and rceil, and the pool adds max_elem
    # itself, the saturation tie max + half the top spacing and a value just above max
    mids = (g[:-1] + g[1:]) / 2
    mids = torch.cat([mids, mids.nextafter(torch.zeros(())), mids.nextafter(torch.full((), 1e9))])
    over = _f32([elem.max, elem.max + (elem.max - g[-2].item()) / 2, elem.max * 1.0001])
    for lead, pool in ((top, mids[mids <= top]), (elem.max, torch.cat([mids, over]))):
        vals = pool[torch.randint(len(pool), (256, 32), generator=gen)]
        vals[:, 0] = lead
        sign = torch.where(torch.rand(256, 32, generator=gen) < 0.5, -1.0, 1.0)
        k = torch.randint(-60, 61, (256, 1), generator=gen).to(torch.float32)
        blocks.append(vals * sign * torch.exp2(k))

    # block maxima at the scale rules' thresholds and 1-2 ulps either side: sig = 1 (ceil), 1.75,
    # 2 - 2**-(mbits+1) (even), max_elem / 2**emax (rceil). Block maxima a few ulps *above*
    # max_elem * 2**j with |j| >= 2 can be RCEIL's difference 3: they are in test_documented_differences.
    amaxes = []
    for sig in (1.0, 1.75, 2 - 2.0 ** -(elem.mbits + 1), elem.max / top):
        for j in SAFE_J:
            base = _f32(sig * top * 2.0**j)
            for n in (-2, -1, 0, 1, 2):
                if sig == elem.max / top and n > 0 and abs(j) > 1:
                    continue
                amaxes.append(_ulps(base, n))
    blocks.append(_fill(torch.stack(amaxes), gen))

    # an all-zero and an all-minus-zero block (scale code 0 in both, no element to divide)
    blocks.append(torch.zeros(2, 32))
    blocks[-1][1] = -0.0

    # the rest: random normal values times 2**uniform(-40, 40) per block, with zeros, -0 and float32
    # subnormals (random bit patterns) mixed in
    n = N_BLOCKS - sum(b.shape[0] for b in blocks)
    x = torch.randn(n, 32, generator=gen, dtype=torch.float64)
    x = (x * torch.exp2(torch.empty(n, 1, dtype=torch.float64).uniform_(-40, 40, generator=gen))).to(torch.float32)
    u = torch.rand(n, 32, generator=gen)
    sub = torch.randint(1, 2**23, (n, 32), generator=gen, dtype=torch.int32).view(torch.float32)
    sub = torch.where(torch.rand(n, 32, generator=gen) < 0.5, -sub, sub)
    x = torch.where(u < 0.04, torch.zeros(()), x)
    x = torch.where((u >= 0.04) & (u < 0.06), torch.full((), -0.0), x)
    x = torch.where((u >= 0.06) & (u < 0.09), sub, x)
    blocks.append(x)

    out = torch.cat(blocks).to(torch.float32)
    assert out.shape == (N_BLOCKS, 32) and torch.isfinite(out).all()
    return out.reshape(-1, 256).contiguous()  # 512 rows of 8 blocks


def _extreme_values(fmt: str) -> dict[str, torch.Tensor]:
    """Blocks (one per row of 32) for the three documented differences."""
    gen = torch.Generator().manual_seed(22)
    elem = get_format(fmt).elem
    # 1. scale code 0: float32-subnormal blocks, and normal blocks below 2**(emax-126); the last block,
    #    2**(emax-126), gets scale code 1 by every rule
    sub = torch.randint(1, 2**23, (24,), generator=gen, dtype=torch.int32).view(torch.float32)
    sub = torch.cat([sub, _f32([2.0**-149, 3 * 2.0**-149, 2.0**-127 * 1.5])])
    normal = torch.exp2(torch.empty(24, dtype=torch.float64).uniform_(-126, elem.emax - 126, generator=gen))
    tiny = _fill(torch.cat([sub, _f32(normal), _f32([2.0**-126, 2.0 ** (elem.emax - 126)])]), gen)
    # 2. block maxima near float32's max (mxtrain's upper clamp binds for ceil, even, rceil)
    fmax = torch.finfo(torch.float32).max
    top = [fmax, 2.0**127, 1.5 * 2.0**127, (2 - 2.0 ** -(elem.mbits + 1)) * 2.0**127, 1.25 * 2.0**127,
           elem.max * 2.0 ** (127 - elem.emax) * 1.03125, elem.max * 2.0 ** (127 - elem.emax)]
    top = torch.stack([_f32(top), _ulps(_f32(top), -1)], 1).flatten()
    top = _fill(torch.cat([top, _ulps(_f32([2.0**127]), 1)]), gen)
    # 3. block maxima 1-2 ulps above max_elem * 2**j
    js = torch.arange(-120, 119)
    edge = torch.stack([_ulps(_f32(elem.max * 2.0 ** j.item()), n) for j in js for n in (1, 2)])
    return {"tiny": tiny, "top": top, "rceil_edge": _fill(edge, gen), "edge_j": js.repeat_interleave(2),
            "edge_n": torch.tensor([1, 2]).repeat(len(js))}


# ------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("rule,fmt", CASES, ids=IDS)
def test_agrees_bit_for_bit(rule, fmt):
    x = _wide_range_values(fmt)
    assert x.numel() == 131_072
    s_t, c_t, packed_t, deq_t = _torchao(x, fmt, rule)
    s_m, c_m, packed_m, deq_m = _mxtrain(x, fmt, rule)
    assert s_t.shape == s_m.shape == (512, 8) and c_t.shape == c_m.shape == (512, 256)
    # no block of this data is one of the documented differences: no scale code 0 except the zero blocks,
    # nothing at mxtrain's upper clamp
    emax = get_format(fmt).elem.emax
    nonzero = x.reshape(512, 8, 32).ne(0).any(-1)
    assert (s_m[nonzero] > 0).all() and (s_m < 127 + 127 - emax).all()
    assert (s_m == 0).sum() == 2
    mism = (s_t != s_m).sum().item()
    assert torch.equal(s_t, s_m), f"{rule} {fmt}: {mism} of {s_m.numel()} E8M0 scale codes differ"
    mism = (c_t != c_m).sum().item()
    assert torch.equal(c_t, c_m), f"{rule} {fmt}: {mism} of {c_m.numel()} element codes differ"
    assert torch.equal(packed_t, packed_m)  # FP4: same nibble order; FP6: one code per byte; FP8: same bytes
    assert torch.equal(deq_t.view(torch.int32), deq_m.view(torch.int32))  # float32 bit patterns, -0 included
    # the data exercises the rules: ties, saturation, subnormal inputs and scales that differ from floor's
    if rule != "floor":
        assert not torch.equal(s_m, _mxtrain(x, fmt, "floor")[0])


@pytest.mark.parametrize("rule,fmt", CASES, ids=IDS)
def test_documented_differences(rule, fmt):
    elem = get_format(fmt).elem
    data = _extreme_values(fmt)

    # 1. scale code 0: same scale code; torchao's elements are x * 2**126 (x * 1 for RCEIL), not x * 2**127
    x = data["tiny"].reshape(-1, 32)
    s_t, c_t, _, deq_t = _torchao(x, fmt, rule)
    s_m, c_m, _, deq_m = _mxtrain(x, fmt, rule)
    zero = s_m[:, 0] == 0
    assert zero[:27].all() and zero.sum() < len(zero), "subnormal blocks get scale code 0, not every tiny one"
    assert torch.equal(s_t, s_m)
    assert torch.equal(c_t[~zero], c_m[~zero]), "tiny blocks with a normal scale agree"
    mult = torch.full((int(zero.sum()), 1), 1.0 if rule == "rceil" else 2.0**126)
    assert torch.equal(c_t[zero], _codes_divided(x[zero], fmt, mult))
    assert not torch.equal(c_t[zero], c_m[zero])
    assert deq_t[zero].abs().sum() < deq_m[zero].abs().sum()  # torchao halves (or flushes) these blocks

    # 2. near float32's max: torchao uses the exact exponent up to 128 - emax, mxtrain clamps at 127 - emax
    x = data["top"]
    s_t, c_t, _, deq_t = _torchao(x, fmt, rule)
    s_m, c_m, _, deq_m = _mxtrain(x, fmt, rule)
    exact = torch.tensor([[_exact_exponent(a, fmt, rule)] for a in x.abs().amax(1).tolist()])
    assert torch.equal(s_m.to(torch.int64) - 127, exact.clamp(max=127 - elem.emax))
    clamped = (exact > 127 - elem.emax).flatten()
    assert torch.isfinite(deq_m).all()
    if rule == "floor":
        assert not clamped.any()
    else:
        assert clamped.sum() >= 2
    assert torch.equal(s_t.to(torch.int64) - 127, exact)
    assert torch.equal(c_t, _codes_divided(x, fmt, pow2(-exact)))
    assert torch.equal(c_t[~clamped], c_m[~clamped])
    if clamped.any():
        assert not torch.equal(c_t[clamped], c_m[clamped])
        assert torch.isinf(deq_t[clamped]).any()  # why mxtrain clamps

    # 3. a few ulps above max_elem * 2**j: RCEIL's float32 log2 may give the scale one binade lower
    x = data["rceil_edge"]
    s_t, c_t, _, _ = _torchao(x, fmt, rule)
    s_m, c_m, _, _ = _mxtrain(x, fmt, rule)
    if rule != "rceil":
        assert torch.equal(s_t, s_m) and torch.equal(c_t, c_m)
        return
    exact = (data["edge_j"] + 1)[:, None]
    assert torch.equal(s_m.to(torch.int64) - 127, exact)  # mxtrain: the exact rule
    lower = (s_t.to(torch.int64) - 127 == exact - 1).flatten()
    assert torch.equal(s_t[~lower], s_m[~lower]) and torch.equal(c_t[~lower], c_m[~lower])
    assert torch.equal(c_t[lower], _codes_divided(x[lower], fmt, pow2(-(exact[lower] - 1))))
    # log2(2**j * (1 + 2**-23)) = j + 1.7e-7 rounds to j in float32 for |j| >= 16 (half an ulp >= 9.5e-7)
    sure = (data["edge_j"].abs() >= 16) & (data["edge_j"] + 1 <= 127 - elem.emax) & (data["edge_n"] == 1)
    assert lower[sure].all()
    assert not lower[data["edge_j"].abs() <= 1].any()  # log2 is then more than an ulp above j
    # the block max saturates: torchao's dequantized max is max_elem * 2**j, a few ulps below amax
    assert torch.equal(c_t[lower][:, 0], torch.full_like(c_t[lower][:, 0], encode_elem(_f32([elem.max]), elem).item()))


@pytest.mark.parametrize("rule,fmt", CASES, ids=IDS)
def test_nonfinite_blocks(rule, fmt):
    emax = get_format(fmt).elem.emax
    x = torch.linspace(-3, 3, 6 * 32).reshape(6, 32)
    x[0, 3] = float("nan")
    x[1, 3], x[1, 9] = float("nan"), float("inf")
    x[2, 3] = float("inf")
    x[3, 3] = -float("inf")
    x[4, 3], x[4, 9] = float("inf"), -float("inf")
    x = x.reshape(1, -1)
    s_t, c_t, _, deq_t = _torchao(x, fmt, rule)
    s_m, _, _, deq_m = _mxtrain(x, fmt, rule)
    assert s_m.flatten().tolist() == [255] * 5 + [s_m[0, 5].item()]
    inf_scale = 254 if rule == "rceil" else 255 - emax
    assert s_t.flatten().tolist() == [255, 255, inf_scale, inf_scale, inf_scale, s_m[0, 5].item()]
    deq_t, deq_m = deq_t.reshape(6, 32), deq_m.reshape(6, 32)
    assert torch.isnan(deq_m[:5]).all() and torch.isnan(deq_t[:2]).all()
    # torchao: Inf saturates to +-max_elem, which times its scale is +-Inf again; the finite rest flushes
    inf = torch.isinf(x.reshape(6, 32)[2:5])
    assert torch.equal(deq_t[2:5][inf], x.reshape(6, 32)[2:5][inf])
    assert (deq_t[2:5][~inf] == 0).all()
    assert torch.equal(deq_t[5].view(torch.int32), deq_m[5].view(torch.int32))


# ------------------------------------------------------------------- per-tensor FP8 against torchao's float8
# mxtrain's per-tensor FP8 (the ``fp8`` recipe) is current scaling as torchao's float8 tensorwise recipe and
# TransformerEngine define it: every element multiplied in float32 by ``max_elem / amax``, saturated and cast;
# the codes dequantized with the reciprocal. torchao's ``_scale`` is that multiplier, and its GEMM
# (``float8_ops``) passes ``_scale.reciprocal()`` to ``torch._scaled_mm``: mxtrain's scale. torchao clamps amax
# at 1e-12 (mxtrain does not), so tensors here have amax of at least 2**-40.

@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_tensor_fp8_is_torchao_float8_tensorwise(fmt, dtype):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    dt = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    g = torch.Generator().manual_seed(5)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    checked = 0
    for t in range(48):
        e = int(torch.randint(-40, 40, (1,), generator=g))
        x = torch.randn(64, 96, generator=g) * 2.0 ** e
        if t % 3 == 1:   # elements on the grid's midpoints for a random multiplier, and their neighbours
            amax = float(x.abs().max())
            m = float((torch.tensor(float(grid.max()), dtype=torch.float64) / amax).float())
            pts = (mids[torch.randint(0, len(mids), (x.numel() // 2,), generator=g)] / m).float()
            pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(float("inf")))])
            x = torch.where(pts.abs().reshape(x.shape) <= amax, pts.reshape(x.shape), x)
        if t % 3 == 2:   # signed zeros after rounding, exact zeros, one huge element
            x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0 ** -60, -(2.0 ** -60), 0.0, 0.0]) * 2.0 ** e
            x[1, 1] = 3e4 * 2.0 ** e
        x = x.to(dtype)
        q = quantize(x, fmt)
        ao = hp_tensor_to_float8_dynamic(x, dt, LinearMMConfig(), scaling_granularity=ScalingGranularity.TENSORWISE)
        assert torch.equal(q.data.view(torch.uint8), ao._data.view(torch.uint8)), (t, fmt, dtype)
        assert torch.equal(q.scales.reshape(()), ao._scale.reciprocal().reshape(())), (t, q.scales, ao._scale)
        checked += x.numel()
    assert checked == 48 * 64 * 96
