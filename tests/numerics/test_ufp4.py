"""Issue #51 on the reference path: the uniform 4-bit grids (``mxint4``, ``mxe1m2``; arXiv 2606.20381), the
``adaptive`` E8M0 scale rule (the MX analogue of "Four over Six", arXiv 2512.02010), their presets, and that
neither reaches a kernel: every check against an independent float64 reference written from the definitions
(enumerated grids, nearest-even ties, brute-force choice of the scale)."""

import math

import numpy as np
import pytest
import torch

import mxtrain
from mxtrain.linear import fast
from mxtrain import Operand
from mxtrain.numerics import recipes
from mxtrain.numerics.formats import ELEMENTS, FORMATS, get_format
from mxtrain.numerics.quant import ALL_SCALE_RULES, SCALE_RULES, quantize, reference_only

UNIFORM = ("mxint4", "mxe1m2")


# ----------------------------------------------------------------------------------------------
# the independent reference: float64, grids enumerated from their definitions


def grid(fmt: str) -> np.ndarray:
    """Nonnegative grid of the element, from the definition (not from mxtrain's decode)."""
    return {"mxint4": np.arange(8.0), "mxe1m2": np.arange(8.0) / 4, "mxfp4": np.array(
        [0, 0.5, 1, 1.5, 2, 3, 4, 6.0])}[fmt]


EMAX = {"mxint4": 2, "mxe1m2": 0, "mxfp4": 2}


def rne(v: float, g: np.ndarray) -> float:
    """Round |v| to the nearest grid value, ties to the one with an even index (even code), saturating."""
    a = min(abs(v), g[-1])
    i = int(np.searchsorted(g, a))
    if i == 0:
        q = g[0]
    elif i == len(g):
        q = g[-1]
    else:
        lo, hi = g[i - 1], g[i]
        q = lo if a - lo < hi - a else hi if a - lo > hi - a else (lo if (i - 1) % 2 == 0 else hi)
    return math.copysign(q, v)


def ref_floor_exp(amax: float, fmt: str) -> int:
    if amax == 0:
        return -127
    return max(-127, min(math.floor(math.log2(amax)) - EMAX[fmt], 127 - EMAX[fmt]))


def ref_block(xs: np.ndarray, fmt: str, rule: str) -> tuple[int, np.ndarray]:
    """(exponent, dequantized values) of one finite block by brute force in float64."""
    g = grid(fmt)
    amax = float(np.abs(xs).max())
    s0 = ref_floor_exp(amax, fmt)

    def deq(s):
        return np.array([rne(v / 2.0**s, g) * 2.0**s for v in xs])
    if rule == "floor":
        return s0, deq(s0)
    assert rule == "adaptive"
    cands = [s0] + ([s0 + 1] if amax > 0 and s0 + 1 <= 127 - EMAX[fmt] else [])
    errs = [sum((float(q) - float(v)) ** 2 for q, v in zip(deq(s), xs)) for s in cands]
    s = cands[int(np.argmin(errs))]   # argmin: the first (floor) on ties
    return s, deq(s)


def blocks(n=24, seed=0):
    """Blocks of 32: Gaussian ones at many scales, and hand-made ones (ties, saturation, zeros)."""
    rng = np.random.default_rng(seed)
    out = [rng.standard_normal(32) * 2.0 ** rng.integers(-20, 20) for _ in range(n)]
    out.append(np.r_[7.5, 3.5, -0.5, 1.5, 2.5, np.zeros(27)])      # INT4 ties at .5 and saturation (7.5 > 7)
    out.append(np.r_[np.arange(8.0), -np.arange(8.0), np.arange(16) + 0.5])
    out.append(np.r_[5.0, 2.5, 0.25, 0.75, np.full(28, 6.0)])      # E2M1 ties
    out.append(np.zeros(32))
    return np.stack(out).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# formats


def test_uniform_grids_are_what_the_definitions_say():
    for fmt in UNIFORM:
        elem = get_format(fmt).elem
        vals = np.array([elem.decode(c) for c in range(16)])
        g = grid(fmt)
        assert np.array_equal(vals[:8], g) and np.array_equal(vals[8:], -g)
        assert np.signbit(vals[8])   # code 8 is -0
        assert elem.max == g[-1] and elem.emax == EMAX[fmt] and elem.bits == 4
        assert get_format(fmt).block_size == 32 and get_format(fmt).kind == "mx"
        assert get_format(fmt).reference_only and reference_only(fmt)
    assert not any(get_format(f).reference_only for f in ("mxfp4", "mxfp8_e4m3", "nvfp4", "bf16"))


def test_every_grid_value_times_every_power_of_two_is_exact_in_e4m3():
    """Exhaustive: every grid value times 2**j is exact in E4M3 (the FP8 cast returns it) wherever it lies in
    E4M3's normal range [2**-6, 448]; and a whole block (the grid times one 2**s) is exact in E4M3 for exactly
    16 consecutive exponents s, one more than E2M1's 15 (an FP8 carrier holds such a block at any of them)."""
    def exact(v: float) -> bool:
        t = torch.tensor([v, -v], dtype=torch.float64)
        return torch.equal(t.to(torch.float8_e4m3fn).to(torch.float64), t)
    n = 0
    for fmt in UNIFORM + ("mxfp4",):
        g = grid(fmt)[1:]
        for m in g:
            for j in range(-40, 40):
                v = m * 2.0**j
                if 2.0**-6 <= v <= 448.0:
                    assert exact(v), (fmt, m, j)
                    n += 1
        ok = [s for s in range(-40, 40) if all(exact(m * 2.0**s) for m in g)]
        assert ok == list(range(ok[0], ok[-1] + 1))
        assert len(ok) == (15 if fmt == "mxfp4" else 16), (fmt, ok)
        assert max(g) * 2.0 ** ok[-1] <= 448 < max(g) * 2.0 ** (ok[-1] + 1)
    assert n > 300


@pytest.mark.parametrize("fmt", UNIFORM + ("mxfp4",))
@pytest.mark.parametrize("rule", ["floor", "adaptive"])
def test_nearest_matches_the_float64_reference(fmt, rule):
    x = blocks()
    mx = quantize(torch.from_numpy(x), fmt, scale_rule=rule)
    got = mx.dequantize().numpy().astype(np.float64)
    exps = mx.scales.to(torch.int32).numpy() - 127
    for b in range(x.shape[0]):
        s, want = ref_block(x[b].astype(np.float64), fmt, rule)
        assert exps[b, 0] == s, (fmt, rule, b)
        assert np.array_equal(got[b], want), (fmt, rule, b)
        assert np.array_equal(np.signbit(got[b]), np.signbit(want)), (fmt, rule, b)   # -0 kept


def test_int4_and_e1m2_are_one_quantizer_except_in_the_smallest_binades():
    x = torch.from_numpy(blocks(40, seed=1))
    for rule in ("floor", "ceil", "rceil", "amd", "adaptive"):
        a, b = quantize(x, "mxint4", scale_rule=rule), quantize(x, "mxe1m2", scale_rule=rule)
        assert torch.equal(a.codes(), b.codes()) and torch.equal(a.dequantize(), b.dequantize()), rule
        nz = a.scales != 0
        assert torch.equal(a.scales.int()[nz] + 2, b.scales.int()[nz]), rule
    # a block with maximum 2**-128 (float32 subnormal): E8M0's smallest scale 2**-127 leaves INT4 a step of
    # 2**-127 (everything rounds to 0 or 2**-127) and E1M2 a step of 2**-129
    t = torch.tensor([2.0**-128, 2.0**-129, 3 * 2.0**-131] + [0.0] * 29)
    qi, qe = quantize(t, "mxint4").dequantize(), quantize(t, "mxe1m2").dequantize()
    assert qi[:3].tolist() == [0.0, 0.0, 0.0]                         # 0.5 step ties to even 0
    assert qe[:3].tolist() == [2.0**-128, 2.0**-129, 2.0**-129]       # 0.75 * 2**-129 -> 1 step
    assert quantize(t, "mxint4").scales[0].item() == 0 and quantize(t, "mxe1m2").scales[0].item() == 0


@pytest.mark.parametrize("fmt", UNIFORM)
def test_special_values_follow_the_mx_conventions(fmt):
    """As every MX format: NaN or +-Inf make the block's scale NaN (code 255) and it reads back NaN; an
    all-zero block gets scale code 0; huge finite blocks saturate to 7 * 2**125 (never Inf)."""
    x = torch.zeros(4, 32)
    x[0, 3] = float("nan")
    x[1, 0] = -float("inf")
    x[2, :] = 3e38
    for rule in ("floor", "adaptive", "rceil"):
        mx = quantize(x, fmt, scale_rule=rule)
        d = mx.dequantize()
        assert mx.scales[:2].flatten().tolist() == [255, 255] and torch.isnan(d[:2]).all()
        assert torch.isfinite(d[2]).all() and (d[2] == 7 * 2.0**125).all()
        assert mx.scales[3].item() == 0 and torch.equal(d[3], torch.zeros(32))


@pytest.mark.parametrize("fmt", UNIFORM)
def test_stochastic_rounding_uses_the_grid_neighbours_and_is_unbiased(fmt):
    """Each value goes to one of its two grid neighbours, up with probability (v - lo) / (hi - lo): over 1024
    draws the mean is within 5 standard errors of the value."""
    t = torch.tensor([6.3, 0.3, -2.71, 4.5, 6.99] + [0.0] * 26 + [7.0])   # block max 7: scale 1 (INT4 units)
    if fmt == "mxe1m2":
        t = t / 4
    step = 1.0 if fmt == "mxint4" else 0.25
    seeds = 1024   # (1024 copies of the block in one tensor: each element draws its own uniform)
    qs = quantize(t.repeat(seeds, 1), fmt, rounding="stochastic", seed=11).dequantize()
    lo, hi = torch.floor(t / step) * step, torch.ceil(t / step) * step
    assert ((qs == lo) | (qs == hi)).all()
    p = (t - lo) / step
    se = step * torch.sqrt(p * (1 - p) / seeds) + 1e-12
    assert ((qs.mean(0) - t).abs() <= 5 * se).all()


def test_packed_codes_carry_no_fp4_dtype():
    x = torch.randn(3, 64)
    assert quantize(x, "mxint4").data.dtype == torch.uint8
    assert quantize(x, "mxfp4").data.dtype == torch.float4_e2m1fn_x2


# ----------------------------------------------------------------------------------------------
# the adaptive rule


def test_adaptive_tie_keeps_floor_and_a_worked_block():
    # every value on both candidates' grids: equal (zero) errors -> floor
    t = torch.tensor([4.0, 2.0, 1.0, 0.0] + [0.0] * 28)
    assert quantize(t, "mxfp4", scale_rule="adaptive").scales[0].item() == 127 + 0
    # max 7.5: floor (scale 1) saturates 7.5 -> 6 (err 2.25) and rounds 5.0 -> 4 (tie to even, err 1);
    # floor + 1 (scale 2): 7.5 -> 8 (0.25), 5.0 -> 4 (1), 0.7 -> 1 (0.09) vs 0.5 (0.04): 1.34 < 3.29
    t = torch.tensor([7.5, 5.0, 0.7] + [0.0] * 29)
    mx = quantize(t, "mxfp4", scale_rule="adaptive")
    assert mx.scales[0].item() == 128 and mx.dequantize()[:3].tolist() == [8.0, 4.0, 1.0]


def test_adaptive_never_errs_more_than_floor_and_refuses_kernels():
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]
    for fmt in ("mxfp4", "mxfp6_e2m3", "mxint4"):
        a = quantize(x, fmt, scale_rule="adaptive").dequantize().double()
        f = quantize(x, fmt, scale_rule="floor").dequantize().double()
        ea = ((a - x.double()) ** 2).reshape(-1, 32).sum(-1)
        ef = ((f - x.double()) ** 2).reshape(-1, 32).sum(-1)
        assert (ea <= ef).all()
    with pytest.raises(ValueError, match="only mxtrain.numerics.quant.quantize"):
        mxtrain.numerics.quant.mx_scale_exponent(torch.ones(2), ELEMENTS["e2m1"], "adaptive")
    with pytest.raises(ValueError, match="MX formats"):
        quantize(torch.ones(16), "nvfp4", scale_rule="adaptive")
    with pytest.raises(ValueError, match="MX formats"):
        Operand("nvfp4", scale_rule="adaptive")
    assert "adaptive" in ALL_SCALE_RULES and "adaptive" not in SCALE_RULES   # SCALE_RULES: the kernels' rules


# ----------------------------------------------------------------------------------------------
# presets and routing (a new rule never reaches a kernel; the INT4 grid reaches the fast path's only)


def test_presets_and_their_routes():
    u = recipes.get("ufp4")
    assert {u.operand(n).fmt for n in mxtrain.numerics.recipe.OPERANDS} == {"mxint4"}
    assert [u.operand(n).rounding for n in mxtrain.numerics.recipe.OPERANDS] == ["nearest", "nearest", "stochastic",
                                                                       "nearest", "stochastic", "nearest"]
    assert all(u.rotation(g).size == 16 and u.rotation(g).signs == "per_step" for g in mxtrain.numerics.recipe.GEMMS)
    a = recipes.get("mxfp4-all-adaptive")
    assert {a.operand(n).scale_rule for n in mxtrain.numerics.recipe.OPERANDS} == {"adaptive"}
    assert recipes.get("mxfp4-all+adaptive").with_(name="mxfp4-all-adaptive") == a
    assert recipes.get("ufp4+rceil").fprop_x == Operand("mxint4", scale_rule="rceil")
    for r in (a, recipes.get("mxfp4-all-dh16+adaptive"), recipes.get("ufp4+adaptive"),
              recipes.get("mxfp4-all").with_(**{"wgrad_x.scale_rule": "adaptive"}),
              mxtrain.Recipe(fprop_x=Operand("mxe1m2"))):
        assert fast.supported(r), r.name   # (the kernels have them: tests/kernels/test_rules_kernels.py)
        assert mxtrain.linear.tracedfp8.spec(r) is None
    # round-up scales: the kernels have them; the INT4 grid: the fast path's fused quantizer has it
    # (tests/kernels/test_ufp4_kernel.py), and the compiled layer (below)
    for r in (recipes.get("mxfp4-all+rceil"), u, recipes.get("ufp4+floor"), recipes.get("ufp4+rceil")):
        assert fast.supported(r), r.name
        assert mxtrain.linear.tracedfp8.spec(r) is None
    # the route on a CUDA tensor (meta tensors stand in: route reads device and dtype only)
    xm = torch.empty(64, 64, device="meta")
    assert mxtrain.linear.route(a, xm, xm) == "reference"


def test_the_compiled_layer_takes_the_new_formats_and_rule():
    """``linear.mx_spec`` (what the compiled MX layer starts from: ``compiledmx.spec``): a recipe with the
    ``adaptive`` rule or a uniform grid gets the spec's wider form (formats named where not ``mxfp4``;
    tests/linear/test_compiledmx.py runs it against the eager fast path); a plain MXFP4 recipe with a scale rule of
    ``quant.SCALE_RULES`` the short form ``m<rot>:<rule A>:<rule B>``."""
    from mxtrain.linear import compiledmx
    from mxtrain.linear.dispatch import mx_spec
    for name in ("ufp4", "mxfp4-all-adaptive", "mxfp4-all-dh16+adaptive"):
        r = recipes.get(name)
        mx = compiledmx.spec(r)
        assert mx and mx_spec(r) == mx and all(g.count(":") > 2 for g in mx.split(";")), name
        assert ("mxint4" in mx) == name.startswith("ufp4") and ("adaptive" in mx) == name.endswith("adaptive")
    assert compiledmx.spec(recipes.get("mxfp4-all-dh16+rceil")) == ";".join(["m16:rceil:rceil"] * 3)
    from mxtrain.kernels.mxfp4.launch import RULE_ID
    assert set(RULE_ID) - set(SCALE_RULES) == {"adaptive"}   # (the kernels' one rule the reference has apart)


@pytest.mark.parametrize("name", ["ufp4", "mxfp4-all-adaptive"])
def test_mx_linear_on_cpu_is_the_reference_quantizer(name):
    """``mxtrain.mx_linear`` with a new-format / new-rule recipe: forward and both gradients equal the GEMMs of
    the reference quantizer's values, computed here from ``quant.quantize`` and the Hadamard blocks."""
    from mxtrain.linear.context import Ctx
    from mxtrain.numerics.hadamard import hadamard
    r = recipes.get(name)
    torch.manual_seed(3)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    st = mxtrain.linear.new_state(2)
    y = mxtrain.mx_linear(x, w, None, r, state=st)
    dy = torch.randn_like(y)
    y.backward(dy)
    ctx = Ctx(r, 2, 0, 0)

    def op(t, axis, name_, gemm):
        o = r.operand(name_)
        rot = r.rotation(gemm)
        s = ctx.signs(gemm, t.device)
        t = hadamard(t, rot.size, axis=axis, signs=s) if rot.enabled else t
        key = ctx.stream_key(name_) if o.rounding == "stochastic" else None
        return quantize(t, o.fmt, axis=axis, rounding=o.rounding, scale_rule=o.scale_rule, key=key).dequantize()
    xd, wd = x.detach(), w.detach()
    assert torch.equal(y, op(xd, -1, "fprop_x", "fprop") @ op(wd, -1, "fprop_w", "fprop").t())
    assert torch.equal(x.grad, op(dy, -1, "dgrad_dy", "dgrad") @ op(wd, 0, "dgrad_w", "dgrad"))
    assert torch.equal(w.grad, op(dy, 0, "wgrad_dy", "wgrad").t() @ op(xd, 0, "wgrad_x", "wgrad"))
    assert FORMATS["mxint4"].reference_only
