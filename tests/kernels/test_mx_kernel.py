"""The one-pass MX fake quantizer for FP6/FP8 elements (kernels/mxelem.py) against the reference
(``fake_quantize_operand``: ``mxtrain.numerics.quant.quantize`` + ``MXTensor.dequantize``): bit-identical values for every
MX element format, every scale rule, rows and columns, float32 and bf16 inputs, block sizes 16/32/64, prescale,
sizes that are not multiples of the block, magnitudes over many binades, NaN/Inf blocks, all-zero blocks,
subnormals, and every element code times scales from the smallest to the largest. Then the integration
(``Ctx.operand``, the ``mx_kernel`` setting, an ``mxfp8`` layer) and the per-variant self-check. On CPU the kernel
runs in Triton's interpreter; the ``cuda`` tests repeat the main comparisons at larger shapes on a GPU."""

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain import mx_linear, settings  # noqa: E402
from mxtrain.linear.context import Ctx  # noqa: E402
from mxtrain.numerics.operand import fake_quantize_operand  # noqa: E402
from mxtrain.numerics.formats import get_format  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import mxelem as K  # noqa: E402
from mxtrain.kernels.caches import CACHES  # noqa: E402
from mxtrain.kernels.nvfp4 import _mismatches  # noqa: E402
from mxtrain.numerics.quant import SCALE_RULES, elem_table  # noqa: E402
from mxtrain.numerics.recipe import Operand, Recipe  # noqa: E402
from mxtrain.numerics.recipes import get as get_recipe  # noqa: E402
from numerics_helpers import wide_values  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4")


def _wide(shape, seed, nonfinite=True):
    """Values over ~40 binades, zeros, -0, an all-zero block, a subnormal, NaN/+-Inf (``numerics.wide_values``)."""
    return wide_values(shape, seed, DEV, nonfinite, zero_block=32)


def _same(x, fmt, axis, block=32, rule="floor", prescale=1.0):
    v = K.quantize_mx_values(x, fmt, axis, block, rule, prescale)
    r = fake_quantize_operand(x, None, None, axis, 0, fmt, block, "nearest", rule, prescale)
    assert v.shape == r.shape and v.dtype == r.dtype == torch.float32
    n = _mismatches(v, r)
    assert n == 0, (fmt, axis, block, rule, prescale, x.dtype, n)
    assert torch.equal(torch.isnan(v), torch.isnan(r))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("axis", [0, 1])
def test_every_format_rule_and_axis(fmt, rule, axis):
    for dtype in (torch.float32, torch.bfloat16):
        _same(_wide((37, 70), seed=1).to(dtype), fmt, axis, rule=rule)


@pytest.mark.parametrize("block", [16, 32, 64])
def test_block_sizes_prescale_and_odd_shapes(block):
    for shape in ((1, 130), (130, 1), (65, 97), (64, 128)):
        for axis in (0, 1):
            _same(_wide(shape, seed=2), "mxfp8_e4m3", axis, block=block)
            _same(_wide(shape, seed=3), "mxfp6_e2m3", axis, block=block, prescale=0.75)


def test_non_finite_blocks_are_nan_and_zero_blocks_zero():
    x = _wide((8, 64), seed=4)
    x[5, 40] = float("nan")
    v = K.quantize_mx_values(x, "mxfp8_e4m3", 1, 32, "floor", 1.0)
    assert torch.isnan(v[5, 32:]).all() and not torch.isnan(v[5, :32]).any()
    assert (v[2, :32] == 0).all() and not torch.signbit(v[2, :32]).any()
    _same(x, "mxfp8_e4m3", 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_times_scales_from_smallest_to_largest(fmt):
    """Each row: every element value of the format (and the midpoints between neighbours: ties to even) times
    one power of two, from 2**-140 (subnormal float32 results) to the largest a block scale allows."""
    elem = get_format(fmt).elem
    vals = elem_table(elem, "cpu")
    vals = vals[torch.isfinite(vals)].unique()
    pos = vals[vals > 0]
    mids = (pos[1:] + pos[:-1]) / 2
    row = torch.cat([vals, mids, -mids, pos * 1.000001])
    pad = (-row.numel()) % 32
    row = torch.cat([row, torch.zeros(pad)])
    exps = list(range(-140, 128 - elem.emax, 7))
    x = torch.stack([row * 2.0 ** e for e in exps]).to(DEV)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    _same(x, fmt, 1)
    _same(x.t().contiguous(), fmt, 0)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp6_e3m2"])
def test_bf16_output_is_the_cast_of_the_float32_values(fmt):
    """``out_dtype=torch.bfloat16`` (what a GEMM under autocast multiplies): the reference's float32 values cast
    to bf16, bit for bit, also where they are not exact in bf16 (blocks scaled below about 2**-117)."""
    elem = get_format(fmt).elem
    vals = elem_table(elem, "cpu")
    vals = vals[torch.isfinite(vals)].unique()
    row = torch.cat([vals, torch.zeros((-vals.numel()) % 32)])
    x = torch.stack([row * 2.0 ** e for e in range(-140, 100, 9)]).to(DEV)
    x = torch.cat([x, _wide((6, row.numel()), seed=9)])
    for axis in (0, 1):
        v = K.quantize_mx_values(x, fmt, axis, 32, "floor", 1.0, out_dtype=torch.bfloat16)
        r = fake_quantize_operand(x, None, None, axis, 0, fmt, 32, "nearest", "floor", 1.0).to(torch.bfloat16)
        assert v.dtype == torch.bfloat16
        assert _mismatches(v, r) == 0
    with pytest.raises(TypeError, match="out_dtype"):
        K.quantize_mx_values(x, fmt, out_dtype=torch.float64)


def test_ctx_operand_uses_the_kernel_for_fp8_and_fp6_only():
    """With ``mx_kernel=always`` an ``mxfp8`` layer runs its operands through the kernel and gives the bits of
    ``mx_kernel=off``, forward and backward; MXFP4 and stochastic-rounding operands stay on the reference."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 96, generator=g) * 3).to(DEV)
    w = (torch.randn(48, 96, generator=g) / 10).to(DEV)
    gy = torch.randn(64, 48, generator=g).to(DEV)

    def run(mode, recipe="mxfp8", amp=False):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        with settings.override(mx_kernel=mode, fast=False):
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=amp):
                y = mx_linear(a, b, recipe=recipe)
            y.backward(gy.to(y.dtype))
        return y.detach(), a.grad, b.grad
    before = K.CALLS["kernel"]
    got = run("always")
    assert K.CALLS["kernel"] - before == 6                  # six operands of the three GEMMs
    want = run("off")
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(run("always", amp=True), run("off", amp=True)):   # bf16 GEMMs: the kernel writes bf16
        assert a.dtype == b.dtype and torch.equal(a, b)
    before = K.CALLS["kernel"]
    run("always", "mxfp4-all")
    sr = Recipe("sr8", **{n: Operand("mxfp8_e4m3", rounding="stochastic") for n in
                          ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")})
    run("always", sr)
    assert K.CALLS["kernel"] == before
    q = Ctx(get_recipe("mxfp8"))
    with settings.override(mx_kernel="always"):
        v, p = q.operand(x, -1, "fprop_x", "fprop", None)
    assert p == 1.0 and torch.equal(v, fake_quantize_operand(x, None, None, -1, 0, "mxfp8_e4m3", 32, "nearest",
                                                              "floor", 1.0))


def test_selfcheck_catches_a_faulty_kernel_and_the_reference_serves(monkeypatch):
    x = _wide((64, 64), seed=6)
    real = K.quantize_mx_values

    def faulty(t, fmt, axis, block, rule, prescale):
        v = real(t, fmt, axis, block, rule, prescale)
        v.view(-1)[7] = v.view(-1)[7] * 2 + 1
        return v
    res = K.mx_selfcheck(DEV, torch.float32, "mxfp8_e4m3", 1, 32, "floor", 1.0, True, True, quantize_fn=faulty)
    assert not res["ok"] and res["values"] >= 1
    assert K.mx_selfcheck(DEV, torch.float32, "mxfp8_e4m3", 1, 32, "floor", 1.0, True, True)["ok"]
    CACHES.verified.clear()
    monkeypatch.setattr(K, "quantize_mx_values", faulty)
    with settings.override(mx_kernel="always", qselfcheck="always"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        v = K.mx_operand(x, None, None, 1, 0, "mxfp8_e4m3", 32, "nearest", "floor", 1.0)
        v2 = Ctx(get_recipe("mxfp8")).operand(x, 1, "fprop_x", "fprop", None)[0]
    CACHES.verified.clear()
    assert v is None and any("differed from the reference" in str(m.message) for m in w)
    assert _mismatches(v2, fake_quantize_operand(x, None, None, 1, 0, "mxfp8_e4m3", 32, "nearest", "floor", 1.0)) == 0


def test_bad_arguments_are_refused():
    x = torch.zeros(4, 32, device=DEV)
    with pytest.raises(ValueError, match="not an MX format"):
        K.quantize_mx_values(x, "nvfp4")
    with pytest.raises(ValueError, match="power of two"):
        K.quantize_mx_values(x, "mxfp8_e4m3", block_size=24)
    with pytest.raises(ValueError, match="2-D"):
        K.quantize_mx_values(torch.zeros(2, 2, 32, device=DEV), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="scale rule"):
        K.quantize_mx_values(x, "mxfp8_e4m3", scale_rule="up")


@pytest.mark.cuda
def test_cuda_large_shapes_and_an_mxfp8_layer():
    for fmt in ("mxfp8_e4m3", "mxfp6_e3m2"):
        for axis in (0, 1):
            for dtype in (torch.float32, torch.bfloat16):
                _same(_wide((2048, 4096 + 32), seed=7).to(dtype), fmt, axis)
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(4096, 1024, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", generator=g) / 32
    gy = torch.randn(4096, 2048, device="cuda", generator=g, dtype=torch.bfloat16)

    def run(mode):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        with settings.override(mx_kernel=mode), torch.autocast("cuda", dtype=torch.bfloat16):
            y = mx_linear(a, b, recipe="mxfp8")
        y.backward(gy)
        return y.detach(), a.grad, b.grad
    for a, b in zip(run("auto"), run("off")):
        assert torch.equal(a, b)


def test_deosc_weight_grid_runs_through_the_kernel_bit_for_bit(monkeypatch):
    """``mxtrain.train.deosc`` quantizes every tracked weight every step; with the kernel (``mx_kernel=always``, MXFP4
    admitted there) its window state and its resets equal the reference's bit for bit: plain, rotated (fixed
    signs, H32) with AMD's scale rule and a prescale, and an MXFP6 weight."""
    from mxtrain.train.deosc import DeoscSettings, Deoscillator
    from mxtrain.linear.module import MXLinear
    from mxtrain.numerics.recipe import Rotation

    calls = []
    real = K.quantize_mx_values

    def counted(*a, **k):
        calls.append(a[1])
        return real(*a, **k)
    monkeypatch.setattr(K, "quantize_mx_values", counted)
    odd = Recipe("odd", fprop_x=Operand("mxfp4"), fprop_w=Operand("mxfp4", scale_rule="amd", prescale=0.75),
                 fprop_rotation=Rotation(32, "fixed"), seed=3)
    six = Recipe("six", fprop_x=Operand("mxfp6_e2m3"), fprop_w=Operand("mxfp6_e2m3"))

    def run(mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(MXLinear(64, 32, bias=False, recipe="mxfp4-all"),
                                    MXLinear(64, 64, bias=False, recipe=odd),
                                    MXLinear(64, 16, bias=False, recipe=six)).to(DEV)
        g = torch.Generator().manual_seed(1)
        d = Deoscillator(model, DeoscSettings(period=5, threshold=2.0))
        stats = []
        with settings.override(mx_kernel=mode):
            for step in range(10):
                d.begin(step)
                with torch.no_grad():   # small random steps: many entries cross a grid boundary and back
                    for m in model:
                        m.weight.add_((torch.randn(m.weight.shape, generator=g) * 3e-3).to(DEV))
                s = d.end(step + 1)
                if s is not None:
                    stats.append(s)
        return stats, [m.weight.detach().clone() for m in model]
    got = run("always")
    assert len(calls) >= 3 * 10 and {"mxfp4", "mxfp6_e2m3"} <= set(calls)
    n = len(calls)
    want = run("off")
    assert len(calls) == n                                   # the reference ran the second time
    assert got[0] == want[0] and len(got[0]) == 2 and all(s["reset"] > 0 for s in got[0])
    for a, b in zip(got[1], want[1]):
        assert torch.equal(a, b)
