"""Fused Triton quantize kernels vs the reference quantizer (the spec): bit-identical codes and scales.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before Triton is
imported); on a CUDA machine the same tests run the compiled kernels on the GPU, and the tests
marked ``cuda`` add large shapes and the FP8-carrier GEMM.
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = triton.language

import torch.nn.functional as F  # noqa: E402

from mxtrain.numerics import rng
from mxtrain import settings  # noqa: E402
from mxtrain.numerics.hadamard import hadamard, rotation_signs  # noqa: E402
from mxtrain.kernels import CACHES, kernels_available  # noqa: E402
from mxtrain.kernels import mxfp4 as kq  # noqa: E402
from mxtrain.kernels.mxfp4 import device, launch, verify  # noqa: E402
from mxtrain.numerics.quant import SCALE_RULES, quantize as ref_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable (set TRITON_INTERPRET=1 on CPU)")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["blocks", "tile", "cols"])
def kern(request):
    """Run a test with each quantize kernel forced (the blocks and cols kernels cover rotations up to
    32; wider ones always run the tile kernel; "cols" runs where the output rows are the input's
    contiguous axis, along columns of a row-major tensor, and "blocks" elsewhere)."""
    with settings.override(qkernel=request.param):
        yield request.param


def _distinct(kern: str, axis: int, rot: int = 0) -> bool:
    """Whether forcing kernel ``kern`` (the ``kern`` fixture) on a row-major input quantized along ``axis`` with
    a ``rot``-wide rotation launches something that forcing another kernel does not (``launch.kernel_for``):
    forced "cols" quantizes along rows (axis 1) of a row-major input with the "blocks" kernel (cols runs only
    where the output rows are the input's contiguous axis), and rotations wider than 32 run the "tile" kernel
    whatever is forced. Such a launch is the other case's exactly (same kernel, constexprs, tile shape and
    self-check key: the setting reaches nothing else), so tests leave those pairs out."""
    return not (kern == "cols" and axis == 1) and (rot in kq.BLOCK_ROTS or kern == "tile")


def test_left_out_kernel_cases_launch_a_kept_case():
    """What ``_distinct`` relies on: each left-out forced kernel on a row-major input launches the kernel of a
    case the tests keep (should ``launch.kernel_for`` change, this fails and the cases must come back)."""
    for k in ("blocks", "tile", "cols"):
        for axis in (1, 0):
            for rot in (0, 2, 4, 8, 16, 32, 64, 128):
                if _distinct(k, axis, rot):
                    continue
                want = "blocks" if rot in kq.BLOCK_ROTS else "tile"
                assert _distinct(want, axis, rot), (k, axis, rot)
                for fp4 in (False, True):
                    # a row-major input's output rows are its contiguous axis only along columns (axis 0)
                    got = kq.kernel_for(axis, rot, fp4, rows_contiguous=axis == 0, kernel=k)
                    assert got == want, (k, axis, rot, fp4, got)


def _kern_axis():
    """``(kern, axis)`` parameters (``kern`` indirect) of the distinct pairs (``_distinct``)."""
    return [pytest.param(k, a, id=f"{k}-{a}") for k in ("blocks", "tile", "cols") for a in (1, 0) if _distinct(k, a)]


def _kern_axis_rot(rots):
    """``(kern, axis, rot)`` parameters (``kern`` indirect) of the distinct triples (``_distinct``)."""
    return [pytest.param(k, a, r, id=f"{k}-{a}-r{r}") for r in rots for k in ("blocks", "tile", "cols")
            for a in (1, 0) if _distinct(k, a, r)]


@pytest.fixture
def use():
    """``use(**fields)``: ``settings.override(**fields)`` until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(settings.override(**fields))


@pytest.fixture
def fresh_caches():
    """The kernels' caches (``mxtrain.kernels.CACHES``) empty for the test, and emptied after it (plans made
    from interpreted kernels, self-check results marked bad, do not outlive it)."""
    CACHES.clear()
    yield CACHES
    CACHES.clear()


def _data(M, K, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(2.0 * torch.randn(M, K, generator=g))
    return x.to(dtype).to(DEV)


def _ref(x, axis, rounding="nearest", rule="floor", seed=7, prescale=1.0, rot=0, signs=None):
    axis = axis % x.ndim
    t = x
    if rot:
        t = x.to(torch.float32)
        n = t.shape[axis]
        pad = (-n) % rot
        if pad:
            t = F.pad(t, [0, 0] * (t.ndim - 1 - axis) + [0, pad])
        t = hadamard(t, rot, axis=axis, signs=signs)
    return ref_quantize(t, "mxfp4", axis=axis, rounding=rounding, scale_rule=rule, seed=seed, prescale=prescale)


def _check(x, axis, **kw):
    rot = kw.get("rot", 0)
    got = kq.quantize(x, "mxfp4", axis=axis, rounding=kw.get("rounding", "nearest"),
                      scale_rule=kw.get("rule", "floor"), seed=kw.get("seed", 7),
                      prescale=kw.get("prescale", 1.0), rotation=rot, signs=kw.get("signs"))
    ref = _ref(x, axis, **kw)
    assert got.data.shape == ref.data.shape and got.scales.shape == ref.scales.shape
    assert torch.equal(got.scales, ref.scales)
    assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert got.shape == ref.shape
    return got, ref


@pytest.mark.parametrize("rule", SCALE_RULES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("kern,axis", _kern_axis(), indirect=["kern"])
def test_scale_rules_roundings_axes(rule, rounding, axis, kern):
    # 33 x 72: ragged blocks both ways, several row tiles of every kernel (1 of the tile kernel along rows)
    x = _data(33, 72, seed=hash((rule, rounding, axis)) % 1000)
    _check(x, axis, rule=rule, rounding=rounding)


@pytest.mark.parametrize("signs_mode", ["none", "fixed", "per_step"])
@pytest.mark.parametrize("kern,axis,rot", _kern_axis_rot((16, 32, 64, 128)), indirect=["kern"])
def test_rotation(rot, signs_mode, axis, kern):
    signs = rotation_signs(rot, signs_mode, seed=5, layer=2, gemm=1, step=3, device=DEV)
    # odd reduction lengths: 1..3 blocks and partial rotation blocks
    x = _data(37, 70, seed=rot + axis)
    rounding = "stochastic" if signs_mode == "per_step" else "nearest"
    _check(x, axis, rot=rot, signs=signs, rounding=rounding, rule="even" if axis else "rceil")


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (2, 96), (5, 1), (1, 129), (33, 31)])
def test_odd_shapes(shape, kern):
    x = _data(*shape, seed=sum(shape))
    for axis in (0, 1):
        _check(x, axis, rounding="stochastic", rule="ceil")


def test_bf16_and_prescale_and_nd(kern):
    x = _data(17, 96, seed=3, dtype=torch.bfloat16)
    _check(x, 1, prescale=0.75, rounding="stochastic", rule="floor")
    _check(x, 0, prescale=0.75, rot=64, rounding="nearest", rule="amd")
    x3 = _data(6, 40, seed=4).reshape(2, 3, 40)
    _check(x3, 2, rounding="stochastic")
    _check(x3, -1, rot=16)


def test_seed_keys_above_2_31():
    # find a seed whose 32-bit key has the top bit set (Triton passes it as a signed int)
    seed = next(s for s in range(100) if rng.stream_key(s) >= 2**31)
    x = _data(9, 64, seed=1)
    _check(x, 1, rounding="stochastic", seed=seed)
    _check(x, 0, rounding="stochastic", seed=seed, rot=32)


def test_nan_inf_zero_blocks(kern):
    x = _data(8, 128, seed=9)
    x[0, :32] = 0.0
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    x[3, 100] = -float("inf")
    x[4, 5] = -0.0
    x[5, 32:64] = -0.0
    x[6, :] = 1e-40  # subnormal float32
    x[7, :32] = 3e38
    for axis in (1, 0):
        for rule in SCALE_RULES:
            _check(x, axis, rule=rule)
        _check(x, axis, rounding="stochastic")
        _check(x, axis, rot=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rot64_special_values_carrier(dtype, use, fresh_caches, monkeypatch):
    """The tile kernel's 64-wide path (its own code: one row's group a thread, sign bits of padding groups
    masked, fused first stage): FP4 codes equal the reference's, and the carrier, group scales and inexact count
    equal those rebuilt from the codes, with NaN, Inf, -0, subnormals (rows of them alone, whose codes are not
    all zero, and subnormals mixed with tiny normal values in one group), the largest values, padding groups and
    padding rows (20 x 136: K pads to 192, a group partly past K; with ``k_multiple`` groups wholly past it), along
    rows and columns, SR and prescale. (Each variant's self-check verdict is given here, not measured: the check's
    own run on a 129 x 305 tensor was over a quarter of this test's time; ``test_self_check_accepts_correct_variants``
    runs the self-check of the 64-wide variant with signs, SR, prescale 0.75 and rule ``even``, both layouts.)"""
    from mxtrain.kernels.mxfp4 import ops as kops
    x = _data(20, 136, seed=11)
    x[0, :64] = 0.0
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    x[3, 100] = -float("inf")
    x[4, 64:128] = -0.0
    x[5, :] = 1e-40
    x[6, :64] = 3e38
    x[7, 130] = 3e38
    g = torch.Generator().manual_seed(5)   # subnormals (in bf16 too) that keep non-zero codes: rows of tiny values
    x[8:12] = (torch.randn(4, 136, generator=g) * 2.0 ** -130).to(DEV)
    x[12, :128] = torch.where(torch.rand(128, generator=g) < 0.8, 2.0 ** -133, 2.0 ** -118).to(DEV)
    x = x.to(dtype)
    signs = rotation_signs(64, "per_step", seed=3, layer=1, gemm=2, step=5, device=DEV)
    use(qselfcheck="always")
    verdict = {}
    checked = []   # (the variants asked about: the safety net's check ran for each call)
    monkeypatch.setattr(kops, "config_ok", lambda *a, **k: checked.append(a[2]) or verdict["ok"])
    # bf16: rows with both roundings, columns with nearest; float32: columns with stochastic rounding (every
    # layout meets every rounding once; the dtypes differ only in the load; the interpreter takes about 5-9 s a
    # case here, and CI's time is short)
    combos = ([(1, "nearest"), (1, "stochastic"), (0, "nearest")] if dtype == torch.bfloat16 else [(0, "stochastic")])
    for axis, rounding in combos:
        _check(x, axis, rot=64, signs=signs, rounding=rounding, prescale=0.75, rule="even")
        kw = dict(rot=64, signs=signs, rounding=rounding, key=rng.stream_key(7), prescale=0.75,
                  scale_rule="even", carrier=True, fp4=False, k_multiple=512)
        checked.clear()
        verdict["ok"] = True
        good = kq.quantize_mxfp4_2d(x, axis, **kw)   # the fused carrier (its variant passed)
        verdict["ok"] = False
        fb = kq.quantize_mxfp4_2d(x, axis, **kw)     # (failed) the carrier rebuilt from FP4 codes by torch ops
        assert checked == [64, 64] and fb.packed is None, (axis, rounding, checked)
        assert torch.equal(fb.carrier.view(torch.uint8), good.carrier.view(torch.uint8)), (axis, rounding)
        assert torch.equal(fb.gscale, good.gscale)
        assert int(fb.inexact.item()) == int(good.inexact.item())
        fresh_caches.clear()


def _tiny_bf16(M, K, seed):
    """bf16 values where subnormals decide codes: rows of subnormals alone (|x| about 2**-130), rows mixing
    subnormals and tiny normal values (2**-120), rows mixing 90 % subnormals (2**-133) with a few 2**-110."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    u = torch.rand(M, K, generator=g)
    kind = torch.arange(M)[:, None] % 3
    x = torch.where(kind == 0, x * 2.0 ** -130,
                    torch.where(kind == 1, torch.where(u < 0.5, x * 2.0 ** -130, x * 2.0 ** -120),
                                torch.where(u < 0.9, x * 2.0 ** -133, x * 2.0 ** -110)))
    x = x.to(torch.bfloat16)
    assert (x.float().abs() < 2.0 ** -126).float().mean() > 0.5   # mostly subnormal
    return x.to(DEV)


def test_f32_widens_every_bf16_exactly():
    """``device._f32`` (every kernel's input conversion) gives each of the 65536 bf16 bit patterns' float32 value
    exactly, subnormals included (Triton 3.6's interpreter converts bf16 subnormals wrongly with a plain cast)."""
    @triton.jit
    def widen(x_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, device._f32(tl.load(x_ptr + i)))

    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(DEV)
    o = torch.empty(65536, dtype=torch.float32, device=DEV)
    widen[(1,)](x, o, 65536)
    assert torch.equal(o.view(torch.int32), x.float().view(torch.int32))


@pytest.mark.parametrize("kern,axis,rot", _kern_axis_rot([0, 16, 32, 64]), indirect=["kern"])
def test_bf16_subnormal_inputs(kern, axis, rot):
    """bf16 inputs whose subnormals decide FP4 codes (``_tiny_bf16``), with and without the rotation's signs
    (H64: the tile kernel's 64-wide path, ``tseng``'s operands), nearest and stochastic rounding, prescale 3/4:
    codes and scales equal the reference's (the interpreted kernels read bf16 subnormals wrongly before
    ``device._f32``; the compiled ones were right)."""
    x = _tiny_bf16(40, 192, seed=rot + axis)
    sg = rotation_signs(rot, "per_step", seed=3, layer=1, gemm=2, step=5, device=DEV) if rot else None
    # every pair of signs and rounding, and of rounding and prescale (not all eight triples: the subnormal
    # loads are the same code in each, and the interpreter takes seconds a case)
    cases = ([(None, "nearest", 1.0), (None, "stochastic", 0.75), (sg, "nearest", 0.75), (sg, "stochastic", 1.0)]
             if rot else [(None, r, p) for r in ("nearest", "stochastic") for p in (1.0, 0.75)])
    for signs, rounding, prescale in cases:
        _check(x, axis, rot=rot, signs=signs, rounding=rounding, prescale=prescale, rule="even")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", ["blocks", "cols"])
def test_folded_rotation_scale_is_bit_exact(dtype, k, use):
    """H16 on bf16/fp16 inputs: the blocks and cols kernels fold 1/sqrt(rot) into the block scales
    (``launch.fold_applies``). Still the reference's bytes where it could differ: subnormal inputs and sums,
    the largest finite values, and small integers whose rotated values fall on E2M1 rounding ties."""
    use(qkernel=k)
    rot = 16
    assert launch.fold_applies(dtype, rot, 1.0) and not launch.fold_applies(torch.float32, rot, 1.0)
    g = torch.Generator().manual_seed(rot)
    fin = torch.finfo(dtype)
    # per-row binades from the smallest subnormal to the largest normal of the dtype. Triton 3.6's
    # interpreter converts bf16 subnormals to float32 wrongly (2**-133 loads as 0, 3 * 2**-133 as 2**-127),
    # so on CPU the bf16 rows start at the smallest normal; compiled on a GPU they include subnormals.
    sub = 0 if (dtype == torch.bfloat16 and DEV == "cpu") else 1
    lo, hi = int(torch.log2(torch.tensor(fin.smallest_normal)).item()) - sub * (7 if dtype == torch.bfloat16 else 10), \
        int(torch.log2(torch.tensor(fin.max)).item()) - 5
    e = torch.linspace(lo, hi, 20).round()
    x = torch.randn(20, 70, generator=g) * torch.exp2(e)[:, None]
    x[3] = torch.randint(-6, 7, (70,), generator=g).float()            # integers: ties after the rotation
    x[4] = torch.randint(-3, 4, (70,), generator=g).float() * fin.smallest_normal / (4 if sub else 1 / 4)
    x[5, :35] = fin.max * torch.sign(torch.randn(35, generator=g))
    x = x.to(dtype)
    if not sub:
        x = torch.where((x.abs() < fin.smallest_normal) & (x != 0), torch.sign(x) * fin.smallest_normal, x)
    x = x.to(DEV)
    signs = rotation_signs(rot, "fixed", seed=2, device=DEV)
    for axis in (1, 0):
        t = x if axis == 1 else x.t().contiguous()   # cols reads the input's contiguous axis
        for rounding in ("nearest", "stochastic"):
            _check(t, axis, rot=rot, signs=signs, rounding=rounding)
        _check(t, axis, rot=rot, rule="ceil")


def _independent_inexact(ref_scales, R, group_rows):
    """Count carrier blocks with nonzero, finite scale more than 14 binades below their group max."""
    s = ref_scales.to(torch.int32) - 127  # (R, Kq/32)
    live = (ref_scales != 255) & (ref_scales != 0)
    # a block whose amax is > 0 may still have code 0 only when s = -127: treat code 0 as not live
    nb = s.shape[1]
    pad = (-nb) % 4
    sl = torch.where(live, s, torch.full_like(s, -127))
    sl = F.pad(sl, (0, pad), value=-127)
    lv = F.pad(live, (0, pad), value=False)
    g = sl.reshape(R, -1, 4)
    if group_rows == 1:
        G = g.amax(-1, keepdim=True)
    else:
        Rp = -(-R // 128) * 128
        gg = F.pad(g, (0, 0, 0, 0, 0, Rp - R), value=-127).reshape(Rp // 128, 128, -1, 4)
        G = gg.amax(dim=(1, 3), keepdim=True).expand(-1, 128, -1, 4).reshape(Rp, -1, 4)[:R]
        G = G[..., :1]
    G = G.clamp(min=-120)
    inexact = lv.reshape(R, -1, 4) & (g < G - 14)
    return int(inexact.sum())


@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("kern,axis", _kern_axis(), indirect=["kern"])
def test_carrier_exact_and_inexact_count(group_rows, axis, kern):
    # 170 wide: along rows two 128-wide groups (the second ragged); along columns 2-6 row tiles of each kernel
    x = _data(40, 170, seed=11)
    # wide dynamic range inside groups: some blocks far below their group max (inexact in e4m3)
    if axis == 1:
        x[:5, 32:64] *= 2.0**-20
        x[7, 128:160] *= 2.0**-13
    else:
        x[32:64, :5] *= 2.0**-20
    for rounding in ("nearest", "stochastic"):
        ref = _ref(x, axis, rounding=rounding, seed=3)
        q = kq.quantize_mxfp4_2d(x, axis, rounding=rounding, key=rng.stream_key(3), carrier=True, fp4=True,
                                 group_rows=group_rows)
        assert torch.equal(q.scales, ref.scales)
        assert torch.equal(q.packed, ref.data.view(torch.uint8))
        R = q.R
        deq = ref.dequantize(torch.float32)
        deq = deq if axis == 1 else deq.t()
        vals = kq.carrier_values(q)
        Kq = ref.scales.shape[1] * 32
        exp_cnt = _independent_inexact(ref.scales, R, group_rows)
        assert int(q.inexact.item()) == exp_cnt
        # exact blocks: carrier x scale == MX value bit for bit; every block when the count is 0
        s = ref.scales.to(torch.int32) - 127
        blk_ok = torch.ones_like(s, dtype=torch.bool)
        if exp_cnt:
            assert exp_cnt > 0 and x.abs().max() > 0
            # independent expectation for inexact blocks: e4m3 RNE of value * 2**(6 - G)
            g = q.gscale if group_rows == 1 else q.gscale.repeat_interleave(128, 0)
            g = g[:R].repeat_interleave(128, 1)[:, :Kq]
            vref = ref.elements() * ref.scale_values()
            expect = (vref / g).to(torch.float8_e4m3fn).to(torch.float32) * g
            assert torch.equal(vals[:R, :Kq], expect)
        else:
            assert blk_ok.all()
        full = torch.zeros_like(vals)
        full[:R, : deq.shape[1]] = deq
        if not exp_cnt:
            assert torch.equal(vals, full)
        # padding rows / columns of the carrier are zero
        assert (vals[R:] == 0).all() and (vals[:, Kq:] == 0).all()


@pytest.mark.parametrize("kern", [k for k in ("blocks", "tile", "cols") if _distinct(k, 1)], indirect=True)
def test_carrier_nan_blocks_are_nan(kern):
    x = _data(4, 64, seed=2)
    x[1, 3] = float("nan")
    q = kq.quantize_mxfp4_2d(x, 1, carrier=True, fp4=False)
    v = kq.carrier_values(q)
    assert torch.isnan(v[1, :32]).all() and not torch.isnan(v[1, 32:]).any() and not torch.isnan(v[0]).any()


@pytest.mark.parametrize("kern", [k for k in ("blocks", "tile", "cols") if _distinct(k, 1)], indirect=True)
def test_k_multiple_pads_carrier_with_zeros(kern):
    x = torch.randn(20, 200, generator=torch.Generator().manual_seed(6)).to(DEV)
    q = kq.quantize_mxfp4_2d(x, 1, carrier=True, fp4=True, k_multiple=512, group_rows=128)
    assert q.carrier.shape == (128, 512) and q.gscale.shape == (1, 4) and int(q.inexact.item()) == 0
    v = kq.carrier_values(q)
    assert (v[:, 200:] == 0).all() and (v[20:] == 0).all()
    assert torch.equal(v[:20, :200], _ref(x, 1).dequantize(torch.float32))


@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("kern,axis", _kern_axis(), indirect=["kern"])
def test_carrier_from_fp4_matches_kernel(group_rows, axis, kern):
    """The torch fallback that rebuilds the carrier from FP4 codes (GPU safety net) equals the kernel."""
    # 140 wide: along rows two groups (the second ragged) and two of padding; along columns 2-5 row tiles
    x = _data(40, 140, seed=13)
    x[3, 7] = float("nan")
    x[:5, 32:64] *= 2.0**-20
    q = kq.quantize_mxfp4_2d(x, axis, carrier=True, fp4=True, group_rows=group_rows, k_multiple=512)
    car, gs, cnt = q.carrier.view(torch.uint8).clone(), q.gscale.clone(), int(q.inexact.item())
    kq.carrier_from_fp4(q, 512, 16)
    assert torch.equal(q.carrier.view(torch.uint8), car)
    assert torch.equal(q.gscale, gs) and q.gscale.stride() == gs.stride()
    assert int(q.inexact.item()) == cnt


def _same_quant(a, b):
    for f in ("carrier", "gscale", "packed", "scales", "inexact"):
        u, v = getattr(a, f), getattr(b, f)
        assert (u is None) == (v is None), f
        if u is not None:
            if u.dtype == torch.float8_e4m3fn:
                u, v = u.view(torch.uint8), v.view(torch.uint8)
            assert u.shape == v.shape and u.stride() == v.stride() and torch.equal(u, v), f
    assert a.group_rows == b.group_rows and (a.R, a.K) == (b.R, b.K)


_PLAN_CFGS = {
    "rows": dict(axis=1, carrier=True, fp4=True),
    "cols-h16-128x128": dict(axis=0, carrier=True, fp4=False, rot=16, signs=True, group_rows=128),
    "fp4-sr": dict(axis=1, carrier=False, fp4=True, rounding="stochastic", prescale=0.75),
    # 32 columns: one row tile of 32 (the stochastic-rounding cols kernel's) x 2 K tiles (the second all
    # padding), where 130 columns made 5 x 2 of that kernel, the slowest in the interpreter (the other
    # configurations replay grids of several row tiles)
    "cols-sr-h32": dict(axis=0, carrier=True, fp4=True, rounding="stochastic", rot=32, k_multiple=256,
                        shape=(37, 32)),
}


@pytest.mark.parametrize("cfg,kern", [pytest.param(c, k, id=f"{k}-{name}") for name, c in _PLAN_CFGS.items()
                                      for k in ("blocks", "tile", "cols")
                                      if _distinct(k, c["axis"], c.get("rot", 0))],
                         indirect=["kern"])
def test_launch_plans_replay_every_argument(cfg, kern, use, fresh_caches):
    """A configuration seen before is launched through its compiled kernel directly (``launch.Plan``; in the
    interpreter, the interpreted kernel with the same argument tuple); the arguments it assembles give the
    same bytes as the generic launch, for new data and new seeds, and a misaligned view gets a plan of its
    own (Triton specializes on 16-byte alignment)."""
    use(fast_launch="always")   # on the interpreter too
    cfg = dict(cfg)
    axis = cfg.pop("axis")
    shape = cfg.pop("shape", (37, 130))
    rot = cfg.get("rot", 0)
    if cfg.pop("signs", False):
        cfg["signs"] = rotation_signs(rot, "fixed", seed=4, device=DEV)
    big = _data(1, shape[0] * shape[1] + 1, seed=21).flatten()
    log = []
    for i, x in enumerate([_data(*shape, seed=20), _data(*shape, seed=22), big[1:].view(shape)]):
        kw = dict(cfg, key=rng.stream_key(i + 5))
        with kq.record_launches() as got_log:
            got = kq.quantize_mxfp4_2d(x, axis, **kw)
        log += got_log
        with settings.override(fast_launch=False):
            want = kq.quantize_mxfp4_2d(x, axis, **kw)
        _same_quant(got, want)
        ref = _ref(x, axis, rounding=cfg.get("rounding", "nearest"), seed=i + 5, rot=rot, signs=cfg.get("signs"),
                   prescale=cfg.get("prescale", 1.0))
        if got.packed is not None:
            assert torch.equal(got.packed, ref.data.view(torch.uint8)) and torch.equal(got.scales, ref.scales)
    # the first array made the plan, the second ran it, the misaligned third made a second one (on a
    # GPU the once-per-variant self-check quantizes arrays of its own, with plans of their own)
    mine = [p for k, p in fresh_caches.plans.items() if k[2] == shape]
    planned = [e for e in log if e.shape == shape and e.plan]
    assert len(planned) == 1 and len(mine) == 2 and all(p is not None for p in mine)


@pytest.mark.parametrize("kern,axis", _kern_axis(), indirect=["kern"])
def test_key_from_device_memory_equals_scalar_key(axis, kern):
    """``key_tensor``: the kernel reads the stochastic-rounding key from device memory (what a CUDA
    graph replays with) and quantizes exactly as with the same key passed as a scalar."""
    x = _data(40, 40, seed=31)   # several row tiles: blocks along rows, tile and cols along columns
    k1, k2 = rng.stream_key(9), rng.stream_key(10)
    kw = dict(rounding="stochastic", carrier=True, fp4=True, rot=16)
    a = kq.quantize_mxfp4_2d(x, axis, key=k1, **kw)
    kt = torch.tensor([launch.i32(k1), 0, 0, 0], dtype=torch.int32, device=DEV)
    _same_quant(a, kq.quantize_mxfp4_2d(x, axis, key=12345, key_tensor=kt, **kw))
    kt[0] = launch.i32(k2)
    b = kq.quantize_mxfp4_2d(x, axis, key=k1, key_tensor=kt, **kw)
    _same_quant(b, kq.quantize_mxfp4_2d(x, axis, key=k2, **kw))
    assert not torch.equal(a.packed, b.packed)


def test_self_check_and_fallback(use, fresh_caches):
    """The once-per-configuration self-check passes, and a configuration marked bad is served by the
    torch fallback with identical results (the GPU safety net, exercised here on any device)."""
    use(qselfcheck="always")
    # along columns: 72 rows of output (2 tiles of the cols kernel, the second ragged), 8 past a multiple of
    # 16 as 200 was (the same self-checked variant)
    x = _data(33, 72, seed=17, dtype=torch.bfloat16)
    good = kq.quantize_mxfp4_2d(x, 0, rot=16, carrier=True, fp4=False, k_multiple=512)
    verified = fresh_caches.verified
    assert verified and all(verified.values())
    for k in list(verified):
        verified[k] = False
    fb = kq.quantize_mxfp4_2d(x, 0, rot=16, carrier=True, fp4=False, k_multiple=512)
    assert fb.packed is None
    assert torch.equal(fb.carrier.view(torch.uint8), good.carrier.view(torch.uint8))
    assert torch.equal(fb.gscale, good.gscale) and int(fb.inexact.item()) == int(good.inexact.item())


@pytest.mark.parametrize("variant", [
    dict(axis=1, rot=16, has_signs=False, scale_rule="floor", sr=False, prescale=1.0, group_rows=1, fp4=False),
    dict(axis=0, rot=64, has_signs=True, scale_rule="even", sr=True, prescale=0.75, group_rows=1, fp4=False),
    dict(axis=0, rot=0, has_signs=False, scale_rule="rceil", sr=False, prescale=1.0, group_rows=128, fp4=True),
    dict(axis=1, rot=32, has_signs=True, scale_rule="ceil", sr=True, prescale=1.0, group_rows=128, fp4=False),
])
@pytest.mark.parametrize("rows_contiguous", [False, True])
def test_self_check_accepts_correct_variants(variant, rows_contiguous, fresh_caches):
    """The self-check passes for correct variants of each kernel; the variant is read from ``x``'s
    layout (a row-major tensor along columns, or its transpose along rows, runs the cols kernel)."""
    x = torch.zeros(2, 3, device=DEV)
    if rows_contiguous != (variant["axis"] == 0):
        x = x.t()
    kern = kq.kernel_for(variant["axis"], variant["rot"], variant["fp4"], rows_contiguous)
    g128 = variant["group_rows"] == 128
    br, nw = {"cols": (128, 4) if g128 else (64, 2)}.get(kern, (128 if g128 else 32, 4))
    assert verify.config_ok(x, variant["axis"], variant["rot"], variant["has_signs"], variant["scale_rule"],
                            variant["sr"], variant["prescale"], variant["group_rows"], br, nw, 512, variant["fp4"],
                            4096, 1000)
    assert len(fresh_caches.verified) == 1 and next(iter(fresh_caches.verified))[-1] == kern   # (..., kernel)


@pytest.mark.parametrize("variant", [
    dict(axis=1, rot=0, has_signs=False, scale_rule="floor", sr=False, prescale=1.0, group_rows=1, fp4=True),
    dict(axis=0, rot=32, has_signs=True, scale_rule="floor", sr=True, prescale=1.0, group_rows=128, fp4=False),
])
def test_64bit_offsets_variant(variant):
    """The 64-bit offset kernel (tensors past 2**31 elements) gives the same bits as the reference
    on small shapes, as the default 32-bit one does (selfcheck compares every output)."""
    br = 128 if variant["group_rows"] == 128 else 32
    r = kq.selfcheck(DEV, torch.float32, variant["axis"], variant["rot"], variant["has_signs"], variant["scale_rule"],
                     variant["sr"], variant["prescale"], variant["group_rows"], br, 4, 512, variant["fp4"],
                     r16=False, k16=False, samples=3, force_idx64=True)
    assert r["ok"], r


def test_self_check_reports_a_wrong_carrier():
    """selfcheck() finds a corrupted carrier byte (so a miscompiled variant cannot pass)."""
    def corrupt(*a, **k):
        q = kq.quantize_mxfp4_2d(*a, **k)
        if q.carrier is not None:
            c = q.carrier.view(torch.uint8)
            c[1, 5] ^= 0x08
        return q
    r = kq.selfcheck(DEV, torch.float32, 1, 0, False, "floor", False, 1.0, 1, 32, 4, 512, True, samples=2,
                     quantize_fn=corrupt)
    assert not r["ok"] and r["carrier"] == 1 and r["samples"][0][:2] == (1, 5)


@pytest.mark.skipif(DEV != "cpu", reason="the GPU tests run the compiled kernels instead")
def test_kernels_compile_for_sm90(tmp_path):
    """The interpreter compiles nothing: one variant of each layout of ``_mxfp4_kernel`` (the blocks layout's
    ``lanes`` arrangement too, setting ``qblocks``) and the dual kernel (which calls it as a device function,
    ``pid_r`` / ``pid_k`` given) compiled for sm_90
    (``tools/compile_check.py``)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    only = ["tile r16 signs car+fp4", "blocks r16 signs fold car", "cols r32 sr car+fp4", "dual r0 fp4_b seq idx64",
            "lanes blocks x r16 fold"]
    p = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_check.py"), "--jobs", "2", "--exact",
                        "--json", str(tmp_path / "cc.json"), *[a for o in only for a in ("--only", o)]],
                       capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert sorted(ln.split("  regs")[0].strip() for ln in p.stdout.splitlines()) == sorted(only), p.stdout
    res = json.loads((tmp_path / "cc.json").read_text())
    for name in only:   # the opcode histogram counts every SASS instruction, and sees the kernels' float work
        ops = res[name]["ops"]
        assert sum(ops.values()) == res[name]["sass"] and ops.get("FADD", 0) + ops.get("FMUL", 0) > 0, (name, ops)


def test_record_launches_nests():
    with kq.record_launches() as outer:
        launch.LAUNCHES.note("tile", (2, 3), False)
        with kq.record_launches() as inner:
            launch.LAUNCHES.note("dual", torch.Size([4, 5]), True)
    launch.LAUNCHES.note("cols", (1, 1), False)
    assert outer == [kq.Launch("tile", (2, 3), False), kq.Launch("dual", (4, 5), True)]
    assert inner == [kq.Launch("dual", (4, 5), True)] and launch.LAUNCHES.logs == ()


def test_custom_op_matches_direct():
    x = _data(20, 70, seed=5)
    signs = rotation_signs(32, "fixed", seed=1, device=DEV)
    a = kq.quantize_op(x, 0, rot=32, signs=signs, rounding="stochastic", key=12345, carrier=True, fp4=True)
    b = kq.quantize_mxfp4_2d(x, 0, rot=32, signs=signs, rounding="stochastic", key=12345, carrier=True, fp4=True)
    for f in ("packed", "scales", "gscale", "inexact"):
        assert torch.equal(getattr(a, f), getattr(b, f))
    assert torch.equal(a.carrier.view(torch.uint8), b.carrier.view(torch.uint8))
    assert a.gscale.stride() == b.gscale.stride()


def test_dequant_gemm_matches_reference_values():
    from mxtrain.kernels.gemm import mx_gemm_nt
    A, B = _data(33, 100, seed=1), _data(20, 100, seed=2)
    qa = kq.quantize_mxfp4_2d(A, 1, carrier=False, fp4=True)
    qb = kq.quantize_mxfp4_2d(B, 1, carrier=False, fp4=True)
    y = mx_gemm_nt(qa, qb, "dequant")
    ra = _ref(A, 1).dequantize(torch.float32)
    rb = _ref(B, 1).dequantize(torch.float32)
    ref = ra @ rb.t()
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


# ------------------------------------------------------------------------------------ GPU (large)

@cuda
@needs_cuda
@pytest.mark.parametrize("axis", [1, 0])
def test_large_bit_exact_gpu(axis, kern):
    x = _data(4096, 2048 + 96, seed=21, dtype=torch.bfloat16)
    for kw in (dict(rule="floor"), dict(rule="even", rounding="stochastic"), dict(rot=16),
               dict(rot=64, signs=rotation_signs(64, "fixed", seed=2, device=DEV), rounding="stochastic",
                    prescale=0.75)):
        _check(x, axis, **kw)


@cuda
@needs_cuda
def test_carrier_gemm_gpu():
    from mxtrain.kernels.gemm import mx_gemm_nt, probe
    p = probe(DEV)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 carrier GEMM is the sm_90 path")
    assert p["a1x128_b128x128"], p
    A, B = _data(2048, 4096 + 64, seed=1, dtype=torch.bfloat16), _data(1536, 4096 + 64, seed=2, dtype=torch.bfloat16)
    for gr in (128, 1):
        qa = kq.quantize_mxfp4_2d(A, 1, carrier=True, fp4=True, k_multiple=512)
        qb = kq.quantize_mxfp4_2d(B, 1, carrier=True, fp4=True, group_rows=gr, k_multiple=512)
        y = mx_gemm_nt(qa, qb, "fp8_carrier").double()
        ref = (kq.dequantize_fp4(qa).double() @ kq.dequantize_fp4(qb).double().t())
        err = ((y - ref).norm() / ref.norm()).item()
        assert err < 4e-3, (gr, err)  # bf16 output rounding only


@pytest.mark.parametrize("case", [
    dict(axis=1, rot=0, group_rows=1),
    dict(axis=1, rot=16, group_rows=128, signs=True),
    dict(axis=0, rot=32, group_rows=1, signs=True, sr=True, prescale=0.75),
    dict(axis=0, rot=16, group_rows=128),
    dict(axis=1, rot=8, group_rows=1, sr=True),
])
def test_block_and_tile_kernels_agree(case):
    """The three quantize kernels ("blocks": whole MX blocks per thread, rotations up to 32; "tile":
    any rotation; "cols": inputs whose output rows are the contiguous axis) write the same bytes for
    every output, padding included, whichever way the input is laid out."""
    rot = case["rot"]
    x = _data(45, 166, seed=rot + case["axis"], dtype=torch.bfloat16)
    xt = x.t().contiguous().t()          # the same values, the other memory layout
    signs = rotation_signs(rot, "fixed", seed=3, device=DEV) if case.get("signs") else None
    # K padded to 256: along rows (166) a ragged second tile, along columns (45) a ragged tile and one all
    # padding (512 added two more padding tiles, each the same masked code again)
    kw = dict(rot=rot, signs=signs, rounding="stochastic" if case.get("sr") else "nearest", key=99,
              prescale=case.get("prescale", 1.0), carrier=True, fp4=True, group_rows=case["group_rows"],
              k_multiple=256, _check=False)
    outs = {}
    for kern in ("blocks", "tile", "cols"):
        with settings.override(qkernel=kern):
            for name, t in (("", x), ("T", xt)):
                rows_contig = (t.stride(1) if case["axis"] == 0 else t.stride(0)) == 1
                got = kq.kernel_for(case["axis"], rot, True, rows_contig)
                assert got == (kern if kern != "cols" or rows_contig else "blocks")
                if got + name not in outs:
                    outs[got + name] = kq.quantize_mxfp4_2d(t, case["axis"], **kw)
    assert "cols" in outs or "colsT" in outs
    ref = outs["tile"]
    for k, a in outs.items():
        assert torch.equal(a.carrier.view(torch.uint8), ref.carrier.view(torch.uint8)), k
        for f in ("gscale", "inexact", "packed", "scales"):
            assert torch.equal(getattr(a, f), getattr(ref, f)), (k, f)


@triton.jit
def _enc_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(o_ptr + i, device._e4m3_bits(v, False), mask=i < n)


def test_blocks_kernel_hardware_e4m3_path_matches_float_path():
    """On a GPU the blocks kernel converts to e4m3 with the hardware instruction; the interpreter uses
    float32 bit arithmetic. Both must give the bytes of the reference carrier (checked by the other
    tests); here the bit-arithmetic encoder is checked alone against ml_dtypes on every e4m3 value
    times powers of two, negative zero, subnormals and NaN."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np
    if DEV != "cpu":
        pytest.skip("the bit-arithmetic encoder runs in the interpreter only")

    codes = np.arange(256, dtype=np.uint8)
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = vals[np.isfinite(vals)]
    # its domain: every e4m3 value, and E2M1 values times any power of two (the carrier's values), which
    # land between e4m3 subnormals for inexact blocks: round half to even there
    e2m1 = np.array([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
    scaled = (e2m1[:, None] * np.exp2(np.arange(-140, 7, dtype=np.float32))[None, :]).astype(np.float32).ravel()
    srt = np.unique(np.abs(vals))
    mids = ((srt[1:] + srt[:-1]) / 2).astype(np.float32)
    mids = mids[mids < 2.0**-6]   # halfway between subnormals
    tiny = np.array([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-126, 0.0], dtype=np.float32)
    allv = np.concatenate([vals, scaled, -scaled, mids, -mids, tiny, -tiny, np.array([np.nan], dtype=np.float32)])
    x = torch.from_numpy(allv.copy())
    out = torch.empty(x.shape, dtype=torch.uint8)
    _enc_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    want = allv.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = out.numpy()
    fin = np.isfinite(allv)
    assert np.array_equal(got[fin], want[fin])
    assert np.all(got[~fin] == 0x7F)


# ---- both operands of one activation from one read (quantize_mxfp4_dual)

def _signs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float()


DUAL_CASES = [
    # (M, K, dtype, options along rows (A), options along columns (B), carrier K padding). Each spans several
    # tiles of both sides (K and M past 128 where the case is ragged: more than one 128 x 128 block of the
    # dual grid both ways), with whole tiles of carrier padding.
    (128, 256, torch.bfloat16, dict(), dict(), 512),
    (130, 140, torch.float32, dict(rot=16, signs=_signs(16, 1)), dict(rot=16, signs=_signs(16, 2), group_rows=128),
     128),
    (131, 129, torch.float32, dict(rounding="stochastic", key=rng.stream_key(5), prescale=0.75, scale_rule="even"),
     dict(rot=32, rounding="stochastic", key=rng.stream_key(6), scale_rule="rceil"), 256),
    (96, 256, torch.bfloat16, dict(rot=8, scale_rule="ceil", index_strides=(1000, 1)),
     dict(rot=4, signs=_signs(4, 3), group_rows=128, scale_rule="amd"), 128),
    # a weight's Fprop (A) and Dgrad (B) operands, both in 128x128 groups (setting w_dual): float32 master
    # weights with ragged sizes and H16 as mxfp4-all-dh16 runs them; bf16 with signs, stochastic rounding, rceil
    (200, 300, torch.float32, dict(rot=16, group_rows=128), dict(rot=16, group_rows=128), 512),
    (256, 130, torch.bfloat16, dict(group_rows=128, scale_rule="rceil"),
     dict(rot=32, signs=_signs(32, 4), group_rows=128, rounding="stochastic", key=rng.stream_key(8)), 128),
]


def _dual_expect(x, a, b, k_multiple):
    return [kq.quantize_mxfp4_2d(x, ax, **s, carrier=True, fp4=False, k_multiple=k_multiple)
            for ax, s in ((1, a), (0, b))]


def _same_carrier(p, q):
    assert p.carrier.shape == q.carrier.shape and p.gs_base.shape == q.gs_base.shape
    assert torch.equal(p.carrier.view(torch.uint8), q.carrier.view(torch.uint8))
    assert torch.equal(p.gscale, q.gscale)


@pytest.mark.parametrize("case", range(len(DUAL_CASES)))
def test_dual_equals_two_passes(case, use):
    """One pass writing both FP8-carrier operands (rows along K with the blocks tile, columns along M
    with the cols tile) gives exactly the two single passes' outputs: bytes, group scales, padding and
    the inexact count, for odd sizes, rotations with and without signs, stochastic rounding, prescale,
    every scale rule and both group shapes of B."""
    use(qselfcheck="off")   # the kernel itself, not its GPU safety net
    use(dual="on")          # with rotations too
    M, K, dt, a, b, k_multiple = DUAL_CASES[case]
    x = _data(M, K, seed=40 + case, dtype=dt)
    x[:3, 32:64] *= 2.0**-20            # inexact carrier blocks along rows
    x[64:96, :2] *= 2.0**-20            # and along columns
    assert kq.dual_applies(x, a.get("rot", 0), b.get("rot", 0))
    with kq.record_launches() as log:
        got = kq.quantize_mxfp4_dual(x, a, b, k_multiple=k_multiple)
    assert [e.kernel for e in log] == ["dual"]
    want = _dual_expect(x, a, b, k_multiple)
    for p, q in zip(got, want):
        _same_carrier(p, q)
    assert got[0].inexact is got[1].inexact     # one counter for both
    n = int(want[0].inexact.item()) + int(want[1].inexact.item())
    assert int(got[0].inexact.item()) == n and n > 0


def test_dual_launch_plans_replay_every_argument(use, fresh_caches):
    """A dual-kernel configuration seen before is launched through its compiled kernel (``launch.DualPlan``;
    in the interpreter, the interpreted kernel with the same argument tuple): the same bytes as the generic
    launch for new data, new keys and new sign vectors, and a misaligned view gets a plan of its own."""
    use(qselfcheck="off", dual="on", fast_launch="always")   # plans on the interpreter too
    big = _data(1, 48 * 160 + 1, seed=61).flatten()
    log = []
    for i, x in enumerate([_data(48, 160, seed=60), _data(48, 160, seed=62), big[1:].view(48, 160)]):
        a = dict(rot=16, signs=rotation_signs(16, "fixed", seed=i, device=DEV), rounding="stochastic",
                 key=rng.stream_key(i + 7))
        b = dict(group_rows=128, scale_rule="rceil", prescale=0.75)
        with kq.record_launches() as got_log:
            got = kq.quantize_mxfp4_dual(x, a, b)
        log += got_log
        with settings.override(fast_launch=False):
            want = kq.quantize_mxfp4_dual(x, a, b)
        for p, q in zip(got, want):
            _same_carrier(p, q)
            assert int(p.inexact.item()) == int(q.inexact.item())
    assert log == [kq.Launch("dual", (48, 160), False), kq.Launch("dual", (48, 160), True),
                   kq.Launch("dual", (48, 160), False)]
    assert len(fresh_caches.dual_plans) == 2 and all(fresh_caches.dual_plans.values())


def test_dual_matches_the_reference_quantizer():
    """Independently of the single-pass kernels: the dual pass's carrier values are the reference
    quantizer's MXFP4 values along each axis (no inexact blocks in this data)."""
    x = _data(128, 256, seed=50)
    a, b = kq.quantize_mxfp4_dual(x, dict(), dict(group_rows=1))
    assert int(a.inexact.item()) == 0
    for q, axis in ((a, 1), (b, 0)):
        deq = _ref(x, axis).dequantize(torch.float32)
        deq = deq if axis == 1 else deq.t()
        assert torch.equal(kq.carrier_values(q)[: deq.shape[0], : deq.shape[1]], deq)


def test_dual_key_from_device_memory_and_64bit_offsets(use):
    """Keys read from device memory (CUDA-graph replays) and the 64-bit offset variant give the same
    outputs as scalar keys and 32-bit offsets."""
    use(qselfcheck="off", dual="on")
    x = _data(64, 160, seed=51)
    k1, k2 = rng.stream_key(1), rng.stream_key(2)
    a = dict(rounding="stochastic", key=k1, rot=16)
    b = dict(rounding="stochastic", key=k2)
    want = kq.quantize_mxfp4_dual(x, a, b)
    kta = torch.tensor([launch.i32(k1), 0, 0, 0], dtype=torch.int32, device=DEV)
    ktb = torch.tensor([launch.i32(k2), 0, 0, 0], dtype=torch.int32, device=DEV)
    got = kq.quantize_mxfp4_dual(x, dict(a, key=0, key_tensor=kta), dict(b, key=0, key_tensor=ktb))
    for p, q in zip(got, want):
        _same_carrier(p, q)
    for p, q in zip(kq.quantize_mxfp4_dual(x, a, b, force_idx64=True), want):
        _same_carrier(p, q)


def test_dual_falls_back_to_two_passes(use):
    """Where one pass does not apply (a column-major input, a rotation wider than 32, the ``dual`` setting
    off) the two single passes run, with the same results."""
    use(qselfcheck="off", dual="on")
    x = _data(40, 72, seed=52)    # (the policy, not the tiling, is under test: a small ragged tensor)
    xt = x.t().contiguous().t()   # same values, column-major
    for xx, a, b in ((xt, dict(), dict()), (x, dict(rot=64), dict()), (x, dict(), dict(rot=128))):
        assert not kq.dual_applies(xx, a.get("rot", 0), b.get("rot", 0))
        with kq.record_launches() as log:
            got = kq.quantize_mxfp4_dual(xx, a, b)
        assert len(log) == 2 and "dual" not in [e.kernel for e in log], log   # two single passes
        for p, q in zip(got, _dual_expect(xx, a, b, 128)):
            _same_carrier(p, q)
    with settings.override(dual="auto"):   # the default: one pass, but not with SR on a large tensor
        assert kq.dual_applies(x, 0, 0) and kq.dual_applies(x, 16, 0) and kq.dual_applies(x, 0, 16)
        assert kq.dual_applies(x, 0, 0, sr=True) and kq.dual_applies(x, 16, 16, sr=True)
        big = torch.empty((2048, 2080), device=x.device)   # (more than 2**22 elements)
        assert kq.dual_applies(big, 16, 16) and not kq.dual_applies(big, 16, 16, sr=True)
        assert not kq.dual_applies(x, 64, 0)   # (a rotation the blocks kernel does not take)
    with settings.override(dual="off"):
        assert not kq.dual_applies(x, 0, 0)
    # A in a weight's 128x128 groups needs B's too (one tile covers a 128-row group on both sides)
    with kq.record_launches() as log:
        got = kq.quantize_mxfp4_dual(x, dict(group_rows=128), dict())
    assert len(log) == 2 and "dual" not in [e.kernel for e in log], log
    for p, q in zip(got, _dual_expect(x, dict(group_rows=128), dict(), 128)):
        _same_carrier(p, q)
    with pytest.raises(TypeError, match="unknown option"):
        kq.quantize_mxfp4_dual(x, dict(rotation=16), dict())


def test_dual_self_check(use, fresh_caches):
    """The once-per-variant self-check (GPU safety net, run here on any device) accepts the dual pass,
    and a variant whose output differs from the two single passes is reported and replaced by them."""
    use(qselfcheck="always", dual="on")
    x = _data(64, 160, seed=53, dtype=torch.bfloat16)
    a, b = dict(rot=16), dict(rot=16, group_rows=128)
    good = kq.quantize_mxfp4_dual(x, a, b)
    assert list(fresh_caches.dual_verified.values()) == [True]

    def broken(*args, **kw):   # the dual pass, then one byte of output A changed
        qa, qb = kq.quantize_mxfp4_dual(*args, **kw)
        qa.carrier.view(torch.uint8).view(-1)[5] ^= 1
        return qa, qb
    fresh_caches.dual_verified.clear()
    fresh_caches.clear_plans()   # (GPU) no launch of the real kernel through a plan
    with pytest.warns(RuntimeWarning, match="dual quantize variant"):
        assert not verify.dual_ok(x, a, b, kq.TILE_K, dual_fn=broken)
    assert list(fresh_caches.dual_verified.values()) == [False]
    with kq.record_launches() as log:
        fb = kq.quantize_mxfp4_dual(x, a, b)
    assert "dual" not in [e.kernel for e in log]   # the variant marked bad: two passes
    for p, q in zip(fb, good):
        _same_carrier(p, q)


@pytest.fixture(scope="module")
def dual_config_case():
    """The input, options and two-pass outputs of ``test_dual_kernel_configurations``, made once for all its
    configurations (none of which the two passes depend on). 130 x 140: two 128-row and two 128-column
    blocks of the dual grid, both ragged."""
    with settings.override(qselfcheck="off"):
        x = _data(130, 140, seed=54)
        a, b = dict(rot=16, signs=_signs(16, 4)), dict(rot=8, rounding="stochastic", key=rng.stream_key(8))
        return x, a, b, _dual_expect(x, a, b, 128)


@pytest.mark.parametrize("cfg", [dict(sequential=True), dict(sequential=True, block_rows=(16, 128), num_warps=4),
                                 dict(sequential=False, block_rows=(64, 64), num_warps=2)])
def test_dual_kernel_configurations(cfg, use, dual_config_case):
    """Every program layout of the dual kernel (one program per tile, or per 128x128 block running its
    A then its B tiles) and block sizes give the two passes' outputs."""
    use(qselfcheck="off", dual="on")
    x, a, b, want = dual_config_case
    for p, q in zip(kq.quantize_mxfp4_dual(x, a, b, **cfg), want):
        _same_carrier(p, q)


def test_a_refused_carrier_padding_is_a_readable_error(monkeypatch):
    """torch 2.11's blockwise FP8 GEMM refuses 128x128 B scale groups unless K/128 is a multiple of 4 (an H200,
    2026-11-29): with ``carrier_k`` 256 at K = 768 the layer stops with an error that names the setting and its
    fix; a refusal at a K the setting does not explain, or of 1x128 groups, stays torch's own error."""
    from mxtrain import settings
    from mxtrain.errors import UserError
    from mxtrain.kernels import gemm
    from mxtrain.kernels.mxfp4.carrier import QuantOut

    def q(k_multiple, group_rows):   # (the fields the GEMM's refusal path reads: a stand-in, nothing quantized)
        kc = -(-768 // k_multiple) * k_multiple
        return QuantOut(256, 768, torch.zeros(256, kc, dtype=torch.float8_e4m3fn), None, group_rows, None, None, None)

    def refuse(*a, **k):
        raise RuntimeError("Invalid scaling configuration.\n- For TensorWise scaling, ...")
    monkeypatch.setattr(gemm, "_scaled_mm", refuse)
    with settings.override(carrier_k=256):
        qa, qb = q(256, 1), q(256, 128)
        with pytest.raises(UserError, match=r"carrier_k=256: .* at K = 768 .* set carrier_k=512"):
            gemm.mx_gemm_nt(qa, qb, "fp8_carrier", torch.bfloat16)
        q1 = q(256, 1)
        with pytest.raises(RuntimeError, match="Invalid scaling") as e:   # (1x128 B groups: not this cause)
            gemm.mx_gemm_nt(qa, q1, "fp8_carrier", torch.bfloat16)
        assert not isinstance(e.value, UserError)
    qa, qb = q(512, 1), q(512, 128)
    with pytest.raises(RuntimeError, match="Invalid scaling") as e:       # K/128 = 8: not the padding
        gemm.mx_gemm_nt(qa, qb, "fp8_carrier", torch.bfloat16)
    assert not isinstance(e.value, UserError)
