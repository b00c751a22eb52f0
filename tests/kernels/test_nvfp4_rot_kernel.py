"""The 16-wide Hadamard rotation inside the two-pass NVFP4 quantizer (kernels/nvfp4.py, ``rot=16``: the ``nvfp4``
recipe's Wgrad operands). Its values and tensor scale equal, bit for bit, both the path it replaces (the torch
rotation ``hadamard(pad_axis(t))`` in float32, then the kernel) and the reference
``fake_quantize_operand(..., factored=True)``: rows and columns, signs or none, nearest and stochastic rounding
(a key in device memory), float32 and bf16 inputs, axis lengths that are not multiples of 16 (the reference's
padding), NaN/Inf and all-zero blocks, values over many binades. Then ``factored_operand`` takes the fused route
(no torch rotation), and the rotated variant's self-check. On CPU the kernels run in Triton's interpreter; the
``cuda`` test repeats the comparison at a training shape on a GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain.numerics import rng
from mxtrain import settings  # noqa: E402
from numerics_helpers import wide_values  # noqa: E402
from mxtrain.linear.context import Ctx  # noqa: E402
from mxtrain.numerics.operand import fake_quantize_operand, pad_axis  # noqa: E402
from mxtrain.numerics.hadamard import hadamard  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import nvfp4 as K  # noqa: E402
from mxtrain.kernels.caches import CACHES  # noqa: E402
from mxtrain.numerics.recipes import get as get_recipe  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable"),
              # the interpreter's numpy says so where the butterfly meets Inf - Inf (NaN, as in the reference)
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

KEY = 0xC0FFEE11   # above 2**31: the key's sign bit is exercised
SIGNS = rng.random_signs(16, 0x5157)


def _signs(device=DEV):
    return SIGNS.to(device)


def _same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    bad = ~((a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b)))
    assert not bad.any(), (what, int(bad.sum()), bad.nonzero()[:5].tolist(), a[bad][:5].tolist(),
                           b[bad][:5].tolist())


def _check(x, axis, rounding="nearest", key=None, signs=None, block_2d=False, prescale=1.0):
    """The fused rotation against the torch rotation + kernel and against the reference, bit for bit."""
    v, g = K.quantize_nvfp4_factored(x, axis, block_2d, rounding, key, prescale, rot=16, signs=signs)
    r = hadamard(pad_axis(x.float(), axis, 16), 16, axis=axis, signs=signs)      # the path it replaces
    ov, og = K.quantize_nvfp4_factored(r, axis, block_2d, rounding, key, prescale)
    rkey = int(key.item()) if isinstance(key, torch.Tensor) else key
    rv, rg = fake_quantize_operand(x, signs, rkey, axis, 16, "nvfp4", (16, 16) if block_2d else 16, rounding,
                                   "floor", prescale, True)
    assert g.dim() == 0 and g.dtype == torch.float32
    _same_bits(g, og, "g vs torch rotation")
    _same_bits(g, rg, "g vs reference")
    _same_bits(v, ov, "values vs torch rotation")
    _same_bits(v, rv, "values vs reference")
    return v, g


@pytest.mark.parametrize("shape", [(40, 56), (48, 64)])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotation_equals_torch_rotation_and_reference(shape, axis, rounding, dtype):
    """(40, 56): both axes padded (8 of 16 real values in the last block), (48, 64): none. Wide values with
    NaN, +-Inf, an all-zero block, ties, a subnormal; stochastic rounding with the key in device memory (the
    SR index is the element's row-major index in the padded, rotated tensor)."""
    x = wide_values(shape, sum(shape) + axis, DEV, nonfinite=True, zero_block=16).to(dtype)
    key = torch.tensor(KEY, dtype=torch.int64, device=DEV) if rounding == "stochastic" else None
    v, _ = _check(x, axis, rounding, key, _signs())
    padded = list(shape)
    padded[axis] = -(-shape[axis] // 16) * 16
    assert list(v.shape) == padded


@pytest.mark.parametrize("axis", [1, 0])
def test_fused_rotation_without_signs_2d_tiles_prescale_and_odd_sizes(axis):
    x = wide_values((33, 47), 3, DEV, nonfinite=True)
    _check(x, axis)                                               # no signs (Rotation(16, "none"))
    _check(x, axis, "stochastic", KEY, _signs(), block_2d=True, prescale=0.75)   # 16x16 tiles, int key
    _check(x.to(torch.float16), axis, "nearest", None, _signs(), prescale=0.75)
    for shape in ((1, 17), (17, 1), (5, 3)):                      # one block of one real value, single rows
        _check(wide_values(shape, 8, DEV, nonfinite=False), axis, "stochastic", KEY, _signs())


@pytest.mark.parametrize("length", [5, 9])
@pytest.mark.parametrize("axis", [1, 0])
def test_padding_signed_zeros_match_the_reference(length, axis):
    """The reference pads the axis with +0 and then applies the signs, so a -1 sign makes the padding -0 before
    the butterfly, and -0 can survive to an output element (-0 - +0): blocks of small integers with many zeros
    where that shows (a +0 padding after the signs gives other sign bits; checked below) come out as the
    reference's."""
    g = torch.Generator().manual_seed(length)
    x = torch.randint(-2, 3, (128, length), generator=g).float()
    x = torch.where(torch.rand(x.shape, generator=g) < 0.6, torch.zeros_like(x), x)
    known = {5: [[0, 0, 2, 2, 0], [0, 0, -1, -1, 0]], 9: [[0, 0, 0, 0, -1, -2, 0, 1, 0], [0, 0, 0, 0, 0, 2, 2, 0, 0]]}
    x[:2] = torch.tensor(known[length], dtype=torch.float32)   # rows found to tell them apart (with SIGNS)
    plus0 = hadamard(torch.cat([x * SIGNS[:length], torch.zeros(128, 16 - length)], 1), 16, axis=1)
    ref = hadamard(pad_axis(x, 1, 16), 16, axis=1, signs=SIGNS)
    vp = fake_quantize_operand(plus0, None, None, 1, 0, "nvfp4", 16, "nearest", "floor", 1.0, True)[0]
    vr = fake_quantize_operand(ref, None, None, 1, 0, "nvfp4", 16, "nearest", "floor", 1.0, True)[0]
    assert not torch.equal(vp.view(torch.int32), vr.view(torch.int32))     # the data tells the two apart
    xd = x.to(DEV)
    xd = xd.t().contiguous() if axis == 0 else xd
    _check(xd, axis, "nearest", None, _signs())
    _check(xd.to(torch.bfloat16), axis, "stochastic", KEY, _signs())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_fused_rotation_non_finite_zero_and_extreme_tensors(rounding):
    key = KEY if rounding == "stochastic" else None
    s = _signs()
    for axis in (1, 0):
        z = torch.zeros(20, 33, device=DEV)
        v, g = _check(z, axis, rounding, key, s)           # signs turn the zeros into -0 before the butterfly
        assert float(g) == 1.0 and not v.any() and not torch.signbit(v).any()
        for scale in (1e-44, 1e-39, 1e-30, 3e38):          # g underflows (then 1), g subnormal, rotated overflow
            x = wide_values((24, 40), 11, DEV, nonfinite=False)
            _check(x / x.abs().max() * scale, axis, rounding, key, s, prescale=0.75)
        nan = torch.full((17, 32), float("nan"), device=DEV)
        v, g = _check(nan, axis, rounding, key, s)         # no finite value: g = 1, every block NaN
        assert float(g) == 1.0 and torch.isnan(v).all()
        inf = wide_values((32, 40), 5, DEV, nonfinite=False)
        inf[::5, ::7] = float("inf")                       # Inf - Inf in the butterfly: NaN blocks
        inf[1, 3] = -float("inf")
        _check(inf, axis, rounding, key, s)


def test_refuses_other_rotations_and_sign_lengths():
    x = torch.zeros(4, 32, device=DEV)
    with pytest.raises(ValueError, match="rot"):
        K.quantize_nvfp4_factored(x, -1, rot=32)
    with pytest.raises(ValueError, match="16 rotation signs"):
        K.quantize_nvfp4_factored(x, -1, rot=16, signs=torch.ones(32, device=DEV))
    assert not K.fused_rotation_applies(x, 32, None)
    assert not K.fused_rotation_applies(x, 16, torch.ones(32, device=DEV))   # one sign per axis element
    assert not K.fused_rotation_applies(x.double(), 16, None)
    assert K.fused_rotation_applies(x.bfloat16(), 16, _signs())


# ---------------------------------------------------------------------------------------------- integration


def test_factored_operand_takes_the_fused_route(monkeypatch):
    """The recipe's Wgrad operands (rotated, fixed signs, along tokens) through ``Ctx.operand_factored``: no torch
    rotation runs (``hadamard`` raises), ``CALLS`` counts them as fused, and the values equal the reference's."""
    import sys
    H = sys.modules["mxtrain.numerics.hadamard"]    # (the package's ``hadamard`` attribute is the function)
    r = get_recipe("nvfp4")
    assert r.rotation("wgrad").size == 16
    mode = "auto" if DEV == "cuda" else "always"
    x = wide_values((40, 64), 1, DEV, nonfinite=False).to(torch.bfloat16)
    dy = wide_values((40, 48), 3, DEV, nonfinite=False) * 1e-3
    ctx = Ctx(r, layer=2, step=5, call=1)
    s = ctx.signs("wgrad", DEV)
    ref = {}
    with settings.override(nvfp4_kernel="off"):
        for name, t in (("wgrad_x", x), ("wgrad_dy", dy)):
            ref[name] = ctx.operand_factored(t, 0, name, "wgrad", s)

    def no_torch_rotation(*a, **k):
        raise AssertionError("the torch rotation ran")
    monkeypatch.setattr(H, "hadamard", no_torch_rotation)
    monkeypatch.setattr(K, "hadamard", no_torch_rotation)   # (the kernel module's own name for it)
    for name, t in (("wgrad_x", x), ("wgrad_dy", dy)):
        n0, f0 = K.CALLS["kernel"], K.CALLS["fused_rotation"]
        with settings.override(nvfp4_kernel=mode, qselfcheck="off"):
            v, p, g = ctx.operand_factored(t, 0, name, "wgrad", s, out_dtype=torch.bfloat16)
        assert K.CALLS["kernel"] == n0 + 1 and K.CALLS["fused_rotation"] == f0 + 1, name
        rv, rp, rg = ref[name]
        assert p == rp and v.dtype == torch.bfloat16
        _same_bits(g, rg, name)
        _same_bits(v.float(), rv, name)


def test_rotated_variant_selfcheck_and_fallback_to_the_torch_rotation():
    """The rotated variant's key names the rotation; its self-check passes; where it failed, the torch rotation
    and the unrotated kernel serve the operand (the same values), not the fused kernel."""
    for axis in (1, 0):
        for has_signs in (True, False):
            res = K.nvfp4_selfcheck(DEV, torch.bfloat16, axis, False, True, True, 1.0, False, False, rot=16,
                                    has_signs=has_signs)
            assert res["ok"], (axis, has_signs, res)

    def faulty(x, *a, **kw):
        v, g = K.quantize_nvfp4_factored(x, *a, **kw)
        v = v.clone()
        v.view(-1)[5] = -v.view(-1)[5] if v.view(-1)[5] != 0 else 1.0
        return v, g
    res = K.nvfp4_selfcheck(DEV, torch.float32, 0, False, False, False, 1.0, True, True, quantize_fn=faulty, rot=16,
                            has_signs=True)
    assert not res["ok"] and res["values"] == 1

    r = get_recipe("nvfp4")
    ctx = Ctx(r, layer=0, step=0)
    s = ctx.signs("wgrad", DEV)
    x = wide_values((32, 48), 9, DEV, nonfinite=False)
    mode = "auto" if DEV == "cuda" else "always"
    vkey = K._variant_key(x, 0, False, False, False, 1.0, 16, True)
    assert vkey != K._variant_key(x, 0, False, False, False, 1.0) and ("rot", 16, True) in vkey
    CACHES.verified.pop(vkey, None)
    try:
        with settings.override(nvfp4_kernel="off"):
            rv, _, rg = ctx.operand_factored(x, 0, "wgrad_x", "wgrad", s)
        with settings.override(nvfp4_kernel=mode, qselfcheck="always"):
            f0 = K.CALLS["fused_rotation"]
            v, _, g = ctx.operand_factored(x, 0, "wgrad_x", "wgrad", s)
            assert CACHES.verified[vkey] is True and K.CALLS["fused_rotation"] == f0 + 1
            _same_bits(v, rv, "checked")
            CACHES.verified[vkey] = False                   # as if it had differed on this device
            n0 = K.CALLS["kernel"]
            v, _, g = ctx.operand_factored(x, 0, "wgrad_x", "wgrad", s)
            assert K.CALLS["fused_rotation"] == f0 + 1 and K.CALLS["kernel"] == n0 + 1   # torch rotation + kernel
        _same_bits(v, rv, "fallback")
        _same_bits(g, rg, "fallback g")
    finally:
        CACHES.verified.pop(vkey, None)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 2056)])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cuda_fused_rotation_at_training_shapes(shape, axis, rounding):
    """A bf16 activation / gradient at a training shape (and one whose axes need padding) on the GPU, against the
    torch rotation + kernel and the reference; then every rotated variant's self-check."""
    x = wide_values(shape, 4, "cuda", nonfinite=True).to(torch.bfloat16)
    key = torch.tensor(KEY, dtype=torch.int64, device="cuda") if rounding == "stochastic" else None
    _check(x, axis, rounding, key, _signs("cuda"))
    _check(x.float(), axis, rounding, key, None, prescale=0.75)
    for dtype in (torch.float32, torch.bfloat16):
        for r16 in (True, False):
            res = K.nvfp4_selfcheck("cuda", dtype, axis, False, rounding == "stochastic", key is not None, 1.0,
                                    r16, r16, rot=16, has_signs=True)
            assert res["ok"], (dtype, r16, res)
