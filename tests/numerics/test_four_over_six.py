"""NVFP4 "Four over Six" (Cook et al., arXiv 2512.02010) on the reference path: ``scale_rule="four_over_six"``.

Per block, the E4M3 block scale maps the block maximum to 6 (the standard ``amax / (g * 6)``) or to 4
(``amax / (g * 4)``), both rounded to E4M3 as the standard path rounds (nearest even, saturated at 448), whichever
gives the lower squared error of the block against the input (ties: 6); the tensor scale ``g`` stays NVFP4's.

Checked against an independent reference written here from that definition: ``ml_dtypes`` rounds to E4M3 and
E2M1, and the squared errors are summed exactly with ``fractions.Fraction``. Also: hand-made blocks with known
answers, an exhaustive grid of both candidates' grid points and midpoints, never more error than ``nvfp4``'s per
block, ``nvfp4`` without the rule unchanged, the one-line refusals, and that the rule never reaches a kernel.
"""

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import mxtrain
import mxtrain.linear
from mxtrain.linear import fast
from mxtrain import Operand, settings
from mxtrain.numerics import recipes
from mxtrain.numerics.hadamard import hadamard
from mxtrain.numerics.quant import REF_SCALE_RULES, SCALE_RULES, quantize, reference_only
from mxtrain.numerics.recipe import OPERANDS
from numerics_helpers import four_over_six_pairs

F32 = np.float32


# ----------------------------------------------------------------------------------------------
# the independent reference


def _e4m3(v: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 (nearest even), saturated at 448 first, as float32 values."""
    return np.minimum(v.astype(F32), F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def _e2m1(v: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 (nearest even), saturated at +-6 first, as float32 values (sign kept)."""
    return np.clip(v, F32(-6), F32(6)).astype(ml_dtypes.float4_e2m1fn).astype(F32)


def _tensor_scale(x: np.ndarray) -> F32:
    """``amax / (6 * 448)`` correctly rounded to float32 (a float64 quotient of float32 numbers rounds to the
    float32 quotient), 1 where that is 0."""
    g = F32(float(np.abs(x).max()) / 2688.0) if x.size else F32(0)
    return g if g > 0 else F32(1)


def _candidate(xb: np.ndarray, b: F32, g: F32) -> np.ndarray:
    """E2M1 values of block ``xb`` with block scale ``b``: ``x / float32(b * g)``, round to nearest even."""
    d = F32(b * g)
    if d == 0:
        return np.zeros_like(xb)
    return _e2m1((xb / d).astype(F32))


def _sq_err(xb: np.ndarray, q: np.ndarray, b: F32, g: F32) -> Fraction:
    """Exact ``sum((q * b * g - x)**2)``."""
    fb, fg = Fraction(float(b)), Fraction(float(g))
    return sum(((Fraction(float(qi)) * fb * fg - Fraction(float(xi))) ** 2 for qi, xi in zip(q, xb) if qi or xi),
               Fraction(0))


def ref_four_over_six(x: np.ndarray, rule: bool = True):
    """Blocks of 16 along the last axis of 2-D float32 ``x`` (a multiple of 16 wide): ``(block scales, element
    values, chose-4 mask)``, from the definition, one block at a time."""
    g = _tensor_scale(x)
    blocks = x.reshape(-1, 16)
    scales, elems, four = [], [], []
    for xb in blocks:
        amax = F32(np.abs(xb).max())
        b6 = _e4m3(np.array([amax / F32(g * F32(6))]))[0]
        b4 = _e4m3(np.array([amax / F32(g * F32(4))]))[0]
        q6, q4 = _candidate(xb, b6, g), _candidate(xb, b4, g)
        pick4 = rule and _sq_err(xb, q4, b4, g) < _sq_err(xb, q6, b6, g)
        scales.append(b4 if pick4 else b6)
        elems.append(q4 if pick4 else q6)
        four.append(pick4)
    return np.array(scales, F32), np.stack(elems).reshape(x.shape), np.array(four)


def _ours(x: torch.Tensor, rule: str = "four_over_six", **kw):
    mx = quantize(x, "nvfp4", scale_rule=rule, **kw)
    return mx, mx.scales.float().reshape(-1).numpy(), mx.elements().reshape(x.shape).numpy()


def _check_against_reference(x: torch.Tensor, rule: bool = True):
    sc, el, four = ref_four_over_six(x.numpy(), rule)
    mx, s, e = _ours(x, "four_over_six" if rule else "floor")
    assert np.array_equal(s, sc), np.nonzero(s != sc)[0][:8]
    assert np.array_equal(e.view(np.int32), el.view(np.int32))   # (bits: the sign of zero too)
    return mx, four


def _anchored(blocks: np.ndarray) -> torch.Tensor:
    """Rows of 16 after an anchor block whose maximum 2688 makes the tensor scale exactly 1."""
    anchor = np.zeros((1, 16), F32)
    anchor[0, 0] = 2688.0
    return torch.from_numpy(np.concatenate([anchor, blocks.astype(F32)]))


# ----------------------------------------------------------------------------------------------
# against the reference


def test_random_blocks_match_the_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 64, generator=gen) * torch.exp2(torch.randint(-8, 8, (24, 1), generator=gen).float())
    x[3, 5:9] = torch.tensor([4.5, -4.25, 5.0, 3.0])   # near-maximal values
    x[4, :16] = 0.0                                    # an all-zero block
    x[5, 16:32] = torch.randn(16, generator=gen) * 1e-6   # blocks whose scales are E4M3 subnormals or 0
    mx, four = _check_against_reference(x)
    assert 0.2 < four.mean() < 0.8    # both candidates are taken (Gaussian blocks: about half each)
    assert not four[4 * 4]            # the all-zero block keeps 6 (a tie)


def test_heavy_tailed_and_tiny_tensors_match_the_reference():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 128, generator=gen) * torch.exp2(torch.randint(-20, 20, (8, 128), generator=gen).float())
    _check_against_reference(x)
    _check_against_reference(x * 1e-30)                  # tensor scale near float32's bottom
    _check_against_reference(torch.full((1, 16), 3.0))   # one block: the 4 candidate saturates at 448 -> 6


def test_hand_made_blocks():
    # tensor scale 1 (anchor); per block the values, then the expected block scale and element values
    rows = np.zeros((4, 16), F32)
    rows[0, :2] = [6.0, 4.62]   # 6: b6 = 1, 4.62 -> 4 (err .3844); 4: b4 = 1.5, 6 -> 4, 4.62 -> 3 (err .0144)
    rows[1, :3] = [6.0, 3.0, 1.0]   # 6: every value on the grid (err 0); 4: 1 -> 0.5 * 1.5 (err .0625)
    rows[2, :3] = [8.0, 4.0, 2.0]   # 6: b6 = e4m3(1.33) = 1.375 (err .082); 4: b4 = 2, exact (err 0)
    rows[3, :3] = [9.0, 8.0, 4.0]   # 6: b6 = 1.5: 9, 8 -> 9 (err 1), 4 -> 4.5 (.25); 4: b4 = 2.25: 9, 8 -> 9 (1),
    #                                 4 -> 4.5 (.25): equal errors 1.25, and the tie keeps 6
    x = _anchored(rows)
    mx, four = _check_against_reference(x)
    assert four.tolist() == [False, True, False, True, False]
    s = mx.scales.float().reshape(-1).tolist()
    assert s[1:] == [1.5, 1.0, 2.0, 1.5]
    v = mx.dequantize()
    assert v[1, :2].tolist() == [6.0, 4.5] and v[2, :3].tolist() == [6.0, 3.0, 1.0]
    assert v[3, :3].tolist() == [8.0, 4.0, 2.0] and v[4, :3].tolist() == [9.0, 9.0, 4.5]


def test_exhaustive_pairs_of_grid_points_and_midpoints():
    """Blocks ``[6, p, r] * s`` for every pair of signed points of either candidate's grid (the 6 grid and the 4
    grid x 1.5) and every midpoint between neighbours, at a few scales ``s`` (exact E4M3 scales, ones that round,
    an E4M3 subnormal one): rounding ties, error ties and saturation, against the exact reference."""
    p, r = four_over_six_pairs()
    for s in (1.0, 0.3, 3 * 2.0**-9, 2.0**-11):   # (3 * 2**-9: an E4M3 subnormal scale; 2**-11: both are 0)
        rows = np.zeros((p.size, 16), F32)
        rows[:, 0], rows[:, 1], rows[:, 2] = 6 * s, p.reshape(-1) * s, r.reshape(-1) * s
        _, four = _check_against_reference(_anchored(rows))
        assert four.any() == (s > 2.0**-11), s


def test_every_e2m1_code_times_e4m3_scales_keeps_6():
    """A block holding all 16 E2M1 codes times an E4M3 scale ``b`` is exact under the standard scale (``b``
    itself): error 0, which the 4 candidate cannot beat, so every such block keeps 6, with its codes."""
    codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32)
    e4m3 = np.arange(1, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)   # every positive finite
    e4m3 = e4m3[e4m3 >= 2.0**-6]   # (normal ones: amax / 6 gives b back exactly)
    x = _anchored(codes[None, :] * e4m3[:, None])
    mx, four = _check_against_reference(x)
    assert not four.any()
    assert np.array_equal(mx.scales.float().reshape(-1).numpy()[1:], e4m3)
    want = np.tile(np.arange(16, dtype=np.uint8), (len(e4m3), 1))
    assert np.array_equal(mx.codes().reshape(-1, 16)[1:].numpy(), want)


# ----------------------------------------------------------------------------------------------
# properties


@pytest.mark.parametrize("block", [16, (16, 16)])
@pytest.mark.parametrize("axis", [-1, 0])
def test_never_more_error_than_nvfp4_per_block(block, axis):
    gen = torch.Generator().manual_seed(2)
    # (uniform values: on Gaussian 16x16 tiles the 4 candidate almost never wins, on uniform ones it does)
    x = (torch.rand(64, 96, generator=gen) * 2 - 1) * torch.logspace(-3, 3, 96) ** 0.5
    a = quantize(x, "nvfp4", axis=axis, block_size=block, scale_rule="four_over_six")
    s = quantize(x, "nvfp4", axis=axis, block_size=block)
    assert torch.equal(a.global_scale, s.global_scale)

    def block_err(mx):
        v, g = mx.dequantize_factored()
        e = ((v.double() * float(g) - x.double()) ** 2).movedim(axis, -1)
        if block == 16:
            return e.reshape(*e.shape[:-1], -1, 16).sum(-1).reshape(-1)
        R, C = e.shape
        return e.reshape(R // 16, 16, C // 16, 16).sum((1, 3)).reshape(-1)
    ea, es = block_err(a), block_err(s)
    same = (a.scales.float() == s.scales.float()).reshape(-1)
    assert torch.equal(ea[same], es[same])            # the 6 candidate is the standard block, bit for bit
    assert (ea[~same] <= es[~same]).all() and (ea[~same] < es[~same]).any()   # (float64 sums of the errors)


def test_nvfp4_without_the_rule_is_unchanged():
    """The standard path against the independent reference with the rule off; every other rule name leaves
    NVFP4 alone (bit-identical codes and scales)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=gen) * torch.exp2(torch.randint(-10, 10, (16, 64), generator=gen).float())
    _check_against_reference(x, rule=False)
    base = quantize(x, "nvfp4")
    for rule in SCALE_RULES:
        for kw in ({}, {"block_size": (16, 16)}, {"rounding": "stochastic", "seed": 5}, {"prescale": 0.75}):
            m0, m1 = quantize(x, "nvfp4", **kw), quantize(x, "nvfp4", scale_rule=rule, **kw)
            assert torch.equal(m0.scales.float(), m1.scales.float()) and torch.equal(m0.codes(), m1.codes())
    assert torch.equal(base.codes(), quantize(x, "nvfp4", scale_rule="floor").codes())


def test_stochastic_rounding_and_prescale_use_the_chosen_scale():
    """The choice is deterministic (made under round-to-nearest-even on the prescaled values); stochastic
    rounding then rounds with the chosen block scale."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 64, generator=gen)
    near = quantize(x, "nvfp4", scale_rule="four_over_six")
    sr = quantize(x, "nvfp4", scale_rule="four_over_six", rounding="stochastic", seed=9)
    assert torch.equal(near.scales.float(), sr.scales.float())
    # prescale: the candidates come from the unscaled maxima and g, the errors from the prescaled values
    ps = quantize(x, "nvfp4", scale_rule="four_over_six", prescale=0.75)
    g = _tensor_scale(x.numpy())
    amax = x.abs().reshape(-1, 16).amax(-1).numpy()
    b6 = _e4m3(amax / F32(g * F32(6)))
    b4 = _e4m3(amax / F32(g * F32(4)))
    xs = (x * F32(0.75)).numpy().reshape(-1, 16)
    want = [b4[i] if _sq_err(xs[i], _candidate(xs[i], b4[i], g), b4[i], g)
            < _sq_err(xs[i], _candidate(xs[i], b6[i], g), b6[i], g) else b6[i] for i in range(len(amax))]
    assert np.array_equal(ps.scales.float().reshape(-1).numpy(), np.array(want, F32))


# ----------------------------------------------------------------------------------------------
# validation, presets, routing


def test_refused_where_it_does_not_apply():
    assert "four_over_six" in REF_SCALE_RULES and "four_over_six" not in SCALE_RULES
    assert reference_only("nvfp4", "four_over_six") and not reference_only("nvfp4", "floor")
    for fmt in ("mxfp4", "mxfp8_e4m3", "fp8_e4m3", "mxint4"):
        with pytest.raises(ValueError, match=r"^scale rule 'four_over_six' is defined for nvfp4[^\n]*$"):
            Operand(fmt, scale_rule="four_over_six")
        with pytest.raises(ValueError, match="defined for nvfp4"):
            quantize(torch.ones(32), fmt, scale_rule="four_over_six")
    with pytest.raises(ValueError, match="MX formats"):
        Operand("nvfp4", scale_rule="adaptive")
    with pytest.raises(ValueError, match="has no NVFP4 operand"):
        recipes.get("mxfp4-all+four_over_six")
    Operand("bf16", scale_rule="four_over_six")   # (a not-quantized operand carries any rule, as for adaptive)


def test_preset():
    r, base = recipes.get("nvfp4-4over6"), recipes.get("nvfp4")
    assert {r.operand(n).scale_rule for n in OPERANDS} == {"four_over_six"}
    assert r.with_(**{f"{n}.scale_rule": "floor" for n in OPERANDS}, name="nvfp4",
                   description=base.description) == base
    assert recipes.get("nvfp4+four_over_six").with_(name="nvfp4-4over6", description=r.description) == r
    assert "2512.02010" in r.description
    # the summary names NVFP4's rule as it names MX ones (and none where NVFP4 keeps its standard block scale)
    assert "x=nvfp4 nearest four_over_six, w=nvfp4(16x16) nearest four_over_six" in r.summary()
    assert "x=nvfp4 nearest, w=nvfp4(16x16) nearest," in base.summary()
    from mxtrain.linear.dispatch import mx_spec
    assert not fast.supported(r) and mx_spec(r) == ""
    xm = torch.empty(64, 64, device="meta")
    assert mxtrain.linear.route(r, xm, xm) == "reference"


@pytest.fixture
def kernel_spy(monkeypatch):
    """Counts calls of the NVFP4 kernel's entry (``kernels.nvfp4.factored_operand``, which ``Ctx.operand_factored``
    calls where the ``nvfp4_kernel`` setting says) and makes them fall back to the reference (returns None)."""
    from mxtrain.kernels import nvfp4 as K
    calls = []

    def spy(*a, **kw):
        calls.append(a[8])   # (t, signs, key, axis, rot, fmt, block_size, rounding, scale_rule, prescale)
        return None
    monkeypatch.setattr(K, "factored_operand", spy)
    return calls


def test_the_nvfp4_kernel_is_asked_for_the_rule(kernel_spy):
    from mxtrain.linear.context import Ctx
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)
    dy = torch.randn(32, 48, generator=gen)
    t = {"fprop_x": (x, -1, "fprop"), "fprop_w": (w, -1, "fprop"), "dgrad_dy": (dy, -1, "dgrad"),
         "dgrad_w": (w, 0, "dgrad"), "wgrad_dy": (dy, 0, "wgrad"), "wgrad_x": (x, 0, "wgrad")}
    with settings.override(nvfp4_kernel="always", qselfcheck="off"):
        ctx = Ctx(recipes.get("nvfp4"), 2, 0, 0)
        for n, (v, axis, gemm) in t.items():
            ctx.operand_factored(v, axis, n, gemm, ctx.signs(gemm, "cpu"))
        assert len(kernel_spy) == 6   # (the spy sits on the route the standard rule takes)
        r = recipes.get("nvfp4-4over6")
        ctx = Ctx(r, 2, 0, 0)
        for n, (v, axis, gemm) in t.items():
            s = ctx.signs(gemm, "cpu")
            got, p, g = ctx.operand_factored(v, axis, n, gemm, s)
            if r.rotation(gemm).enabled:
                v = hadamard(v, 16, axis=axis, signs=s)
            o = r.operand(n)
            key = ctx.stream_key(n) if o.rounding == "stochastic" else None
            want, wg = quantize(v, "nvfp4", axis=axis, block_size=o.block_size, rounding=o.rounding,
                                scale_rule="four_over_six", key=key).dequantize_factored()
            assert torch.equal(got, want) and torch.equal(g, wg), n
        assert len(kernel_spy) == 12 and set(kernel_spy[6:]) == {"four_over_six"}   # (the spy declines: reference)


def test_layer_under_autocast_with_the_kernel_setting_on(kernel_spy):
    """The whole layer (factored NVFP4 GEMMs under bf16 autocast) with ``nvfp4_kernel="always"``: the kernel entry
    is asked for the rule's operands (the spy declines, so the reference serves them) and the outputs and gradients
    equal those with the kernel off (with the kernel itself: tests/kernels/test_rules_kernels.py)."""
    from mxtrain.linear.module import MXLinear
    out = {}
    for mode in ("off", "always"):
        torch.manual_seed(0)
        lin = MXLinear(64, 32, recipe="nvfp4-4over6", layer_id=1)
        x = torch.randn(2, 16, 64, requires_grad=True)
        with settings.override(nvfp4_kernel=mode, qselfcheck="off"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = lin(x)
            y.float().square().sum().backward()
        out[mode] = (y.detach(), x.grad, lin.weight.grad)
    assert len(kernel_spy) == 6 and set(kernel_spy) == {"four_over_six"}
    for a, b in zip(out["off"], out["always"]):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    std = MXLinear(64, 32, recipe="nvfp4", layer_id=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(std(torch.randn(2, 16, 64)), out["off"][0])   # (the rule changed something)
