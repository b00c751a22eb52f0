"""The 2026 scale rules and formats in the Triton kernels (issue #51), bit for bit against the reference quantizer
(``mxtrain.numerics.quant``): NVFP4's ``four_over_six`` in ``kernels/nvfp4.py``'s quantizer, and the uniform E1M2 grid
(``mxe1m2``) in the MXFP4 kernels (``kernels/mxfp4``, ``GRID`` 2). Adversarial inputs: NaN/Inf blocks, zero
blocks, subnormals, rounding and error ties, magnitudes from float32's bottom to its top, bf16 and float32, both
axes, 16x16 tiles, stochastic rounding, prescale, rotations. On CPU the kernels run in Triton's interpreter (tiny
shapes: interpreted kernels are slow); the ``cuda`` tests repeat the comparisons at larger shapes on a GPU."""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from numerics_helpers import assert_quant_out_equal, four_over_six_pairs, mx_reference_out, wide_values  # noqa: E402

from mxtrain import settings  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import nvfp4 as K  # noqa: E402
from mxtrain.kernels.caches import CACHES  # noqa: E402
from mxtrain.numerics.operand import fake_quantize_operand  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")

KEY = 0xC0FFEE11   # above 2**31: the key's sign bit is exercised
R46 = "four_over_six"


# ---------------------------------------------------------------------------------------------- NVFP4 four_over_six


def _ref46(x, axis, block_2d, rounding="nearest", key=None, prescale=1.0, rot=0, signs=None, rule=R46):
    return fake_quantize_operand(x, signs, key, axis, rot, "nvfp4", (16, 16) if block_2d else 16, rounding, rule,
                                 prescale, True)


def _check46(x, axis, block_2d, rounding="nearest", key=None, prescale=1.0, rot=0, signs=None):
    """The kernel with ``four_over_six`` equals the reference bit for bit; returns how many values differ from the
    standard rule's (the rule changed something where the input asks it to)."""
    kw = dict(rot=rot, signs=signs) if rot else {}
    v, g = K.quantize_nvfp4_factored(x, axis, block_2d, rounding, key, prescale, scale_rule=R46, **kw)
    rkey = int(key.item()) if isinstance(key, torch.Tensor) else key
    rv, rg = _ref46(x, axis, block_2d, rounding, rkey, prescale, rot, signs)
    assert v.shape == rv.shape and K._bits_equal(g, rg), (float(g), float(rg))
    n = K._mismatches(v, rv)
    assert n == 0, (n, x.dtype, axis, block_2d, rounding, prescale, rot)
    sv, _ = _ref46(x, axis, block_2d, rounding, rkey, prescale, rot, signs, rule="floor")
    return K._mismatches(sv, rv)


@pytest.mark.parametrize("axis,block_2d,rounding,prescale,dtype", [
    (1, False, "nearest", 1.0, torch.float32),
    (0, False, "stochastic", 0.75, torch.float32),
    (1, True, "stochastic", 1.0, torch.bfloat16),
    (0, True, "nearest", 0.75, torch.bfloat16),
])
def test_four_over_six_equals_the_reference(axis, block_2d, rounding, prescale, dtype):
    """Values over ~40 binades, E2M1 ties, a zero block, -0, a subnormal, NaN/+-Inf; sizes not multiples of 16."""
    x = wide_values((33, 72), 5 + axis, DEV, True, zero_block=16).to(dtype)
    changed = _check46(x, axis, block_2d, rounding, KEY if rounding == "stochastic" else None, prescale)
    assert changed > 0


def test_four_over_six_ties_and_midpoints_exhaustively():
    """Blocks ``[6, p, r] * s`` (after an anchor block making the tensor scale 1) for every pair of signed points of
    either candidate's grid and every midpoint between neighbours: rounding ties, exact error ties (which keep 6)
    and saturation, at an exact E4M3 scale, one that rounds and an E4M3 subnormal one."""
    p, r = four_over_six_pairs()
    blocks = []
    for s in (1.0, 0.3, 3 * 2.0**-9):
        rows = np.zeros((p.size, 16), np.float32)
        rows[:, 0], rows[:, 1], rows[:, 2] = 6 * s, p.reshape(-1) * s, r.reshape(-1) * s
        blocks.append(rows)
    anchor = np.zeros((1, 16), np.float32)
    anchor[0, 0] = 2688.0
    x = np.concatenate([anchor] + blocks)
    x = np.concatenate([x, np.zeros((-len(x) % 4, 16), np.float32)])
    x = torch.from_numpy(x).to(DEV).reshape(-1, 64)               # 4 blocks a row
    assert _check46(x, 1, False) > 0


def test_four_over_six_zero_tiny_huge_and_non_finite_tensors():
    for axis in (1, 0):
        for block_2d in (False, True):
            z = torch.zeros(20, 33, device=DEV)
            assert _check46(z, axis, block_2d) == 0
            nan = torch.full((17, 32), float("nan"), device=DEV)
            _check46(nan, axis, block_2d)
        for scale in (1e-44, 1e-39, 1e-30, 3e38):   # g underflows (then 1), g subnormal, tiny, huge values
            x = wide_values((24, 40), 11, DEV, False)
            x = x / x.abs().max() * scale
            _check46(x, axis, False, "stochastic", KEY, 0.75)
            _check46(x, axis, True)


@pytest.mark.parametrize("axis", [1, 0])
def test_four_over_six_with_the_fused_rotation(axis):
    """The 16-wide Hadamard inside the kernel (the nvfp4 recipe's Wgrad operands), with signs, SR and a key in device
    memory, on a size that pads the rotated axis."""
    x = wide_values((40, 44), 3, DEV, True)
    signs = torch.tensor(K.SELFCHECK_SIGNS, dtype=torch.float32, device=DEV)
    kt = torch.tensor(KEY, dtype=torch.int64, device=DEV)
    assert _check46(x, axis, False, "stochastic", kt, 1.0, rot=16, signs=signs) > 0


def test_four_over_six_admission_selfcheck_and_routing():
    """The kernel takes ``four_over_six`` and NVFP4's ignored MX rules, and no other rule; the rule is part of the
    variant's self-check key; the self-check passes, and catches a kernel that leaves the rule out;
    ``factored_operand`` runs the kernel with the rule (the values of the reference)."""
    x = wide_values((32, 48), 9, DEV, False)
    mode = "auto" if DEV == "cuda" else "always"
    with settings.override(nvfp4_kernel=mode):
        assert K.nvfp4_kernel_applies(x, "nvfp4", 16, "nearest", R46)
        assert K.nvfp4_kernel_applies(x, "nvfp4", (16, 16), "stochastic", "rceil")
        assert not K.nvfp4_kernel_applies(x, "nvfp4", 16, "nearest", "adaptive")
    assert K.kernel_rule(R46) and not K.kernel_rule("adaptive") and not K.kernel_rule("floor")
    with pytest.raises(ValueError, match="scale rule"):
        K.quantize_nvfp4_factored(x, 1, scale_rule="adaptive")
    k0, k1 = K._variant_key(x, 1, False, False, False, 1.0), K._variant_key(x, 1, False, False, False, 1.0, 0, False,
                                                                              R46)
    assert k1[:-1] == k0 and k1[-1] == ("rule", R46)
    assert K._variant_key(x, 1, False, False, False, 1.0, 0, False, "ceil") == k0
    for args in ((torch.float32, 1, False, True, True, 0.75, False, True), (torch.bfloat16, 0, True, False, False,
                                                                             1.0, True, False)):
        assert K.nvfp4_selfcheck(DEV, *args, scale_rule=R46)["ok"]

    def rule_left_out(t, *a, scale_rule="floor", **kw):
        return K.quantize_nvfp4_factored(t, *a, **kw)
    res = K.nvfp4_selfcheck(DEV, torch.float32, 1, False, False, False, 1.0, True, True, quantize_fn=rule_left_out,
                            scale_rule=R46)
    assert not res["ok"] and res["values"] > 0
    CACHES.verified.pop(k1, None)
    try:
        with settings.override(nvfp4_kernel=mode, qselfcheck="always"):
            n0 = K.CALLS["kernel"]
            got = K.factored_operand(x, None, None, -1, 0, "nvfp4", 16, "nearest", R46, 1.0)
            assert K.CALLS["kernel"] == n0 + 1 and CACHES.verified[k1] is True
        rv, rg = _ref46(x, -1, False)
        assert K._bits_equal(got[0], rv) and K._bits_equal(got[1], rg)
    finally:
        CACHES.verified.pop(k1, None)


def test_four_over_six_layer_runs_the_kernel():
    """An ``nvfp4-4over6`` layer under bf16 autocast with the kernel setting on: its six operands go through the NVFP4
    kernel (``Ctx.operand_factored``), and outputs and gradients equal those with the kernel off."""
    from mxtrain import MXLinear
    dev_type = "cuda" if DEV == "cuda" else "cpu"
    mode = "auto" if DEV == "cuda" else "always"
    out = {}
    for m in ("off", mode):
        torch.manual_seed(0)
        lin = MXLinear(64, 32, recipe="nvfp4-4over6", layer_id=1).to(DEV)
        x = torch.randn(2, 16, 64, device=DEV, requires_grad=True)
        n0 = K.CALLS["kernel"]
        with settings.override(nvfp4_kernel=m, qselfcheck="off"):
            with torch.autocast(dev_type, dtype=torch.bfloat16):
                y = lin(x)
            y.float().square().sum().backward()
        out[m] = (y.detach(), x.grad, lin.weight.grad, K.CALLS["kernel"] - n0)
    assert out["off"][3] == 0 and out[mode][3] == 6
    for a, b in zip(out["off"][:3], out[mode][:3]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 2056)])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("block_2d", [False, True])
def test_cuda_four_over_six_large_shapes(shape, axis, block_2d):
    x = wide_values(shape, shape[0], "cuda", True)
    for dtype in (torch.float32, torch.bfloat16):
        for prescale in (1.0, 0.75):
            _check46(x.to(dtype), axis, block_2d, "nearest", None, prescale)
            _check46(x.to(dtype), axis, block_2d, "stochastic", KEY, prescale)
    _check46(x, axis, block_2d, "stochastic", torch.tensor(KEY, dtype=torch.int64, device="cuda"))
    signs = torch.tensor(K.SELFCHECK_SIGNS, dtype=torch.float32, device="cuda")
    _check46(x, axis, False, "stochastic", KEY, 1.0, rot=16, signs=signs)


@pytest.mark.cuda
def test_cuda_four_over_six_selfcheck_every_variant():
    for dtype in (torch.float32, torch.bfloat16):
        for axis in (1, 0):
            for block_2d in (False, True):
                for sr, kp in ((False, False), (True, True)):
                    for r16, c16 in ((True, True), (False, False)):
                        res = K.nvfp4_selfcheck("cuda", dtype, axis, block_2d, sr, kp, 0.75, r16, c16, scale_rule=R46)
                        assert res["ok"], (dtype, axis, block_2d, sr, kp, r16, c16, res)
                    res = K.nvfp4_selfcheck("cuda", dtype, axis, False, sr, kp, 1.0, True, False, rot=16,
                                            has_signs=True, scale_rule=R46)
                    assert res["ok"], (dtype, axis, sr, kp, "rot16", res)


# ---------------------------------------------------------------------------------------------- MX E1M2 (GRID 2)

from mxtrain.numerics import rng  # noqa: E402
from mxtrain.kernels.expand import carrier_from_packed  # noqa: E402
from mxtrain.kernels.mxfp4 import carrier as kc, ops, verify  # noqa: E402
from mxtrain.kernels.mxfp4.launch import GRID_ID, record_launches  # noqa: E402
from mxtrain.linear import fast  # noqa: E402
from mxtrain.numerics.quant import SCALE_RULES, quantize as ref_quantize  # noqa: E402

F32 = torch.float32


def _mx_ref(x, axis, fmt="mxe1m2", **kw):
    return mx_reference_out(x, axis, fmt, **kw)


_mx_same = assert_quant_out_equal


def _e1m2_table(dtype) -> torch.Tensor:
    """(16, 128): with block maxima 7 x 2**e (E1M2's scale 2**(e + 2)): every grid value (k / 4 of the scale),
    every rounding midpoint and its neighbours one ulp (of ``dtype``) either side, values past the largest
    element, +-0; rows scaled from 2**-133 (float32 subnormal inputs, scale clamped at 2**-127) to 2**125 (block
    maxima 1.75 x 2**127: the largest exponent, 127); and a row of special blocks: NaN, +Inf, all +0, all -0."""
    mids = torch.arange(7, dtype=F32) + 0.5
    lo = torch.nextafter(mids.to(dtype), torch.zeros((), dtype=dtype)).to(F32)
    hi = torch.nextafter(mids.to(dtype), torch.full((), 8.0, dtype=dtype)).to(F32)
    mags = torch.cat([torch.arange(8, dtype=F32), mids, lo, hi, torch.tensor([7.25, 7.5, 7.75, 7.96875])])
    vals = torch.cat([mags, -mags, torch.tensor([-0.0])])
    row = torch.zeros(128)
    row[: vals.numel()] = vals
    row[torch.arange(4) * 32 + 31] = 7.0
    rows = [row * 2.0**e for e in (0, -1, 3, -20, 40, -126, -133, 125, 124, -60, 90, -128, 1, 2, -3)]
    special = torch.zeros(128)
    special[3], special[40] = float("nan"), float("inf")
    special[64:96], special[96:] = 0.0, -0.0
    special[:3] = 1.0
    rows.append(special)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_e1m2_grid_table_every_layout_both_axes(dtype):
    """Round to nearest over the whole E1M2 grid and around every midpoint, exponents from -127 to 127, in the three
    layouts of the single-pass kernel along rows and columns: codes, scales, carrier and inexact count equal the
    reference's; the drop-in ``quantize`` gives the reference's values."""
    x = _e1m2_table(dtype)
    r = _mx_ref(x, 1)
    fin = r.scales[r.scales != 255]
    assert int(fin.max()) == 127 + 127 and int(fin.min()) == 0   # (both ends of E8M0's exponents)
    q = ops.quantize(x[:1], "mxe1m2")
    want = ref_quantize(x[:1].float(), "mxe1m2")
    assert q.fmt.name == "mxe1m2" and q.data.dtype == torch.uint8 and torch.equal(q.data.cpu(), want.data)
    assert torch.equal(q.dequantize().cpu(), want.dequantize())
    for kern, axis in (("blocks", 1), ("tile", 1), ("cols", 0)):
        t = x if axis == 1 else x.t().contiguous()
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, carrier=True, fp4=True, fmt="mxe1m2")
        _mx_same(q, r)


@pytest.mark.parametrize("rule", [r for r in SCALE_RULES if r != "floor"])
def test_e1m2_scale_rules_at_their_thresholds_and_subnormal_maxima(rule):
    """Block maxima at and one ulp around where each rule rounds E1M2's exponent up (rceil above 1.75 x 2**E, even
    from 1.875, amd from 1.75, ceil above 1), at 2**127 (the clamp) and float32-subnormal block maxima (whose
    exponent clamps at -127 whatever the rule): scales and codes equal the reference's, in each layout."""
    sig = torch.tensor([1.0, 1.5, 1.75, 1.875, 1.9375])
    edges = torch.cat([sig, torch.nextafter(sig, torch.zeros(5)), torch.nextafter(sig, torch.full((5,), 2.0))])
    x = torch.randn(16, 128) * 0.25
    for i, m in enumerate(edges.tolist()):
        x[i % 16, (i // 16) * 32 + (i % 32)] = m * 2.0 ** (i % 5 - 2)   # one block per maximum
    x[:, 127] = 0.0
    x[15, :32] = 1.5 * 2.0**127
    x[14] = torch.randn(128) * 1e-39   # subnormal maxima (a whole row: the fused kernel counts a block of
    # subnormal maximum under a larger group one inexact, carrier_from_fp4 does not (its scale code is 0))
    x[13, 64:96] = 1.2e-38                                                 # just above the normal range's bottom
    for kern, axis in (("blocks", 1), ("cols", 0)):
        t = x if axis == 1 else x.t().contiguous()
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, scale_rule=rule, carrier=True, fp4=True, fmt="mxe1m2")
        _mx_same(q, _mx_ref(t, axis, rule=rule))


def test_e1m2_rotation_signs_sr_prescale_dual_and_expand():
    """16-wide Hadamard with signs, stochastic rounding, prescale, bf16 (the scales folding 1/4) and float32, rows
    and columns; the 64-wide tile path; the dual kernel's two outputs; the carrier rebuilt from E1M2 codes: each equal
    to the reference's codes, scales and carrier."""
    g = torch.Generator().manual_seed(3)
    signs = (1.0 - 2.0 * torch.randint(0, 2, (16,), generator=g)).float()
    x = torch.randn(24, 136, generator=g) * torch.exp2(torch.randint(-9, 9, (24, 1), generator=g).float())
    key = rng.stream_key(5)
    for dtype, axis, kern, ps in ((torch.bfloat16, 1, "blocks", 1.0), (F32, 0, "cols", 0.75), (F32, 1, "tile", 0.75)):
        t = (x[:16] if kern == "blocks" else x if axis == 1 else x[:, :32]).to(dtype)
        si = (kc.ceil_to(t.shape[1], 16), 1) if axis == 1 else None
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, rot=16, signs=signs.to(DEV), rounding="stochastic", key=key,
                                      prescale=ps, index_strides=si, carrier=True, fp4=True, fmt="mxe1m2")
        _mx_same(q, _mx_ref(t, axis, rounding="stochastic", rot=16, signs=signs, prescale=ps))
    s64 = (1.0 - 2.0 * torch.randint(0, 2, (64,), generator=g)).float()
    x64 = x[:, :72]
    q = ops.quantize_mxfp4_2d(x64.to(DEV), 1, rot=64, signs=s64.to(DEV), rounding="stochastic", key=key,
                              index_strides=(128, 1), carrier=True, fp4=True, fmt="mxe1m2")
    _mx_same(q, _mx_ref(x64, 1, rounding="stochastic", rot=64, signs=s64))
    # dual: X's Fprop (rows, carrier) and Wgrad (columns, FP4 codes) operands from one read
    xb = x[:16, :128].to(torch.bfloat16)
    a = dict(rot=16, signs=signs.to(DEV), fmt="mxe1m2")
    b = dict(rot=16, signs=signs.to(DEV), rounding="stochastic", key=key, fmt="mxe1m2")
    with settings.override(dual="on"), record_launches() as log:
        qa, qb = ops.quantize_mxfp4_dual(xb.to(DEV), a, b, fp4_b=True)
    assert [e.kernel for e in log] == ["dual"] and qa.fmt == qb.fmt == "mxe1m2"
    ra, rb = _mx_ref(xb, 1, rot=16, signs=signs), _mx_ref(xb, 0, rounding="stochastic", rot=16, signs=signs)
    _mx_same(qa, ra, fp4=False)
    _mx_same(qb, rb, carrier=False)
    _mx_same(carrier_from_packed(qb), rb)   # the backward's carrier of the kept codes


def test_e1m2_carrier_exact_two_binades_above_int4():
    """E1M2's smallest non-zero value is 0.25 (of its scale): a block 13 binades under its group's largest one is
    exact in the carrier (kexp -7: 2**-9, e4m3's smallest), 14 binades under is counted inexact; the fused quantizer,
    the carrier rebuild and the definition agree on bytes and counts, and the carrier's values are the MX values
    wherever the count says exact."""
    x = torch.zeros(16, 128)
    x[:, :32] = 1.75                       # block 0: s = 0 (the group exponent G)
    x[:, 32:64] = 2.0**-13                 # block 1: s = -13 (kexp -7): value 1
    x[:, 33] = 2.0**-15                    # and 0.25 of it: 2**-9 in the carrier, e4m3's smallest
    x[:, 64:96] = 2.0**-14                 # block 2: s = -14 (kexp -8): counted inexact,
    x[:, 65] = 2.0**-16                    # and its 0.25 (2**-10 in the carrier) is
    x[:, 96:] = 2.0**-12 * 1.5             # block 3: exact
    q = ops.quantize_mxfp4_2d(x.to(DEV), 1, carrier=True, fp4=True, fmt="mxe1m2")
    _mx_same(q, _mx_ref(x, 1))
    assert int(q.inexact.item()) == 16
    e = carrier_from_packed(q)
    assert torch.equal(e.carrier.view(torch.uint8), q.carrier.view(torch.uint8)) and int(e.inexact.item()) == 16
    vals, mx = kc.carrier_values(q)[:, :128].cpu(), kc.dequantize_fp4(q).cpu()
    for blk in (0, 1, 3):
        assert torch.equal(vals[:, 32 * blk: 32 * blk + 32], mx[:, 32 * blk: 32 * blk + 32]), blk
    assert not torch.equal(vals[:, 64:96], mx[:, 64:96])


def test_e1m2_the_fast_path():
    """Admitted (the fixture), a layer whose operands are all ``mxe1m2`` (stochastic rounding on dY) runs through the
    fast path (``fast.apply``: the fused quantizers under Triton's interpreter, the exact dequantized GEMM on CPU)
    with the reference path's outputs and gradients (the self-check of its variants: the cuda test below)."""
    from mxtrain import Operand, Recipe, mx_linear
    from mxtrain.linear.context import Ctx
    assert GRID_ID["mxe1m2"] == 2 and ops.supported("mxe1m2")
    u, u_sr = Operand("mxe1m2"), Operand("mxe1m2", rounding="stochastic")
    rec = Recipe("e1m2-all", fprop_x=u, fprop_w=u, dgrad_dy=u_sr, dgrad_w=u, wgrad_dy=u_sr, wgrad_x=u)
    assert fast.supported(rec)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=g), torch.randn(32, 64, generator=g) / 8
    gy = torch.randn(16, 32, generator=g)
    out = []
    for fn in (fast.apply, None):
        xs, ws = x.clone().to(DEV).requires_grad_(), w.clone().to(DEV).requires_grad_()
        with record_launches() as log:
            if fn is None:   # the reference path (mx_linear routes CPU tensors there)
                with settings.override(fast=False):
                    y = mx_linear(xs, ws, None, rec, torch.tensor([1, 2, 0], device=DEV))   # (layer, step, call)
            else:
                y = fn(xs, ws, None, Ctx(rec, 1, 2, 0))
            y.backward(gy.to(DEV))
        assert bool(log) == (fn is not None)
        out.append([t.detach().float().cpu() for t in (y, xs.grad, ws.grad)])
    for f, r in zip(*out):
        assert ((f - r).norm() / r.norm()).item() < 1e-6


# ---------------------------------------------------------------------------------------------- MX adaptive (RULE 5)

GRIDS = {"mxfp4": np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]), "mxint4": np.arange(8.0),
         "mxe1m2": np.arange(8.0) / 4}


def _adaptive_blocks(fmt: str) -> torch.Tensor:
    """Rows of 32-element blocks that decide the ``adaptive`` choice both ways and tie: per block a maximum ``m``
    (floor's exponent 0: the grid's top, or past it, saturating under floor's exponent, where the next one can win)
    and two values ``p``, ``r`` over every signed point of either candidate's grid (the floor grid and twice it) up
    to ``m`` and every midpoint between neighbours, the rest 0; 4 blocks a row."""
    g = GRIDS[fmt]
    top = g[-1]
    ms = [top, 7.5 if fmt == "mxfp4" else top * 1.125]
    pts = np.unique(np.concatenate([g, 2 * g]))
    pts = np.unique(np.concatenate([pts, (pts[1:] + pts[:-1]) / 2]))
    pts = pts[pts <= ms[-1]]
    signed = np.concatenate([pts, -pts[1:]])
    p, r = np.meshgrid(signed, signed, indexing="ij")
    rows = []
    for m in ms:
        b = np.zeros((p.size, 32), np.float32)
        b[:, 0], b[:, 1], b[:, 2] = m, p.reshape(-1), r.reshape(-1)
        rows.append(b)
    x = np.concatenate(rows)
    x = np.concatenate([x, np.zeros((-len(x) % 4, 32), np.float32)])
    return torch.from_numpy(x).reshape(-1, 128)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxint4"])
def test_adaptive_grid_pairs_ties_and_saturation(fmt):
    """Every pair of either candidate's grid points and midpoints beside a maximum that fits or saturates: codes,
    E8M0 scales, carrier and inexact count equal the reference's (exact error ties keep floor's exponent), and both
    candidates are taken. (E1M2 is INT4's grid over 4 in the kernels: its own exponents and clamp in the next
    test.)"""
    x = _adaptive_blocks(fmt)
    r = _mx_ref(x, 1, fmt=fmt, rule="adaptive")
    up = (r.scales != _mx_ref(x, 1, fmt=fmt).scales).float().mean().item()
    assert 0.05 < up < 0.95, up
    _mx_same(ops.quantize_mxfp4_2d(x.to(DEV), 1, scale_rule="adaptive", carrier=True, fp4=True, fmt=fmt), r)


def _adaptive_wide(dtype) -> torch.Tensor:
    """(32, 128): blocks over many binades (float32 subnormal inputs to maxima 2**127), maxima near the top of their
    binade, exponents where the next one is clamped (E2M1/INT4 125, E1M2 127) and just below, NaN, Inf and zero
    blocks."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(32, 128, generator=g) * 2 - 1
    x = x * torch.exp2(torch.randint(-30, 30, (32, 4), generator=g).float()).repeat_interleave(32, 1)
    x[:, ::32] = (1.5 + 0.5 * torch.rand(32, 4, generator=g)) * x[:, 1::32].abs().max() * 2   # near-top maxima
    x[0, :32] *= 2.0**-140                                     # subnormal block
    x[1, :32] = x[1, :32] / x[1, :32].abs().max() * 1.9 * 2.0**127      # E1M2 s 127: no next exponent
    x[1, 32:64] = x[1, 32:64] / x[1, 32:64].abs().max() * 1.9 * 2.0**126    # E1M2 s 126 -> 127 possible
    x[1, 64:96] = x[1, 64:96] / x[1, 64:96].abs().max() * 7.5 * 2.0**124   # E2M1/INT4 s 124 (-> 125) and 125
    x[1, 96:] = x[1, 96:] / x[1, 96:].abs().max() * 7.5 * 2.0**125
    x[2, 5], x[3, 40], x[4, 96:] = float("nan"), float("inf"), 0.0
    return x.to(dtype)


@pytest.mark.parametrize("fmt,dtype", [("mxfp4", F32), ("mxint4", F32), ("mxe1m2", F32), ("mxfp4", torch.bfloat16)],
                         ids=["mxfp4-f32", "mxint4-f32", "mxe1m2-f32", "mxfp4-bf16"])
def test_adaptive_every_layout_wide_values(fmt, dtype):
    """The three layouts of the single-pass kernel, along rows and columns, on values over many binades with the
    exponent clamps, NaN/Inf/zero blocks: the reference's codes, scales, carrier and count."""
    x = _adaptive_wide(dtype)
    r = _mx_ref(x, 1, fmt=fmt, rule="adaptive")
    assert (r.scales[1] != 255).all() and (r.scales != _mx_ref(x, 1, fmt=fmt).scales).sum() >= 16   # (it decides)
    kerns = (("blocks", 1), ("tile", 1), ("cols", 0)) if dtype == F32 else (("blocks", 1), ("cols", 0))
    for kern, axis in kerns:
        t = x if axis == 1 else x.t().contiguous()
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, scale_rule="adaptive", carrier=True, fp4=True, fmt=fmt)
        _mx_same(q, _mx_ref(t, axis, fmt=fmt, rule="adaptive"))


def test_adaptive_rotation_sr_prescale_fold_dual_and_the_fast_path():
    """16-wide Hadamard with signs and the normalization folded into the scales (bf16), stochastic rounding with the
    chosen exponent, prescale 3/4 (the errors compared on the prescaled values), the 64-wide tile path, the dual
    kernel (the tile layout without rotation: the wide-values test); a layer of ``mxfp4-all-adaptive``'s operands
    through the fast path equals the reference layer."""
    from mxtrain import Operand, Recipe, mx_linear
    from mxtrain.linear.context import Ctx
    g = torch.Generator().manual_seed(4)
    signs = (1.0 - 2.0 * torch.randint(0, 2, (16,), generator=g)).float()
    x = torch.randn(16, 136, generator=g) * torch.exp2(torch.randint(-9, 9, (16, 1), generator=g).float())
    key = rng.stream_key(5)
    for dtype, axis, kern, ps, fmt in ((torch.bfloat16, 1, "blocks", 1.0, "mxfp4"), (F32, 0, "cols", 0.75, "mxint4")):
        t = (x if axis == 1 else x[:, :32]).to(dtype)
        si = (kc.ceil_to(t.shape[1], 16), 1) if axis == 1 else None
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, rot=16, signs=signs.to(DEV), rounding="stochastic", key=key,
                                      scale_rule="adaptive", prescale=ps, index_strides=si, carrier=True, fp4=True,
                                      fmt=fmt)
        _mx_same(q, _mx_ref(t, axis, fmt=fmt, rounding="stochastic", rule="adaptive", rot=16, signs=signs,
                            prescale=ps))
    s64 = (1.0 - 2.0 * torch.randint(0, 2, (64,), generator=g)).float()
    q = ops.quantize_mxfp4_2d(x[:, :72].to(DEV), 1, rot=64, signs=s64.to(DEV), rounding="stochastic", key=key,
                              scale_rule="adaptive", index_strides=(128, 1), carrier=True, fp4=True)
    _mx_same(q, _mx_ref(x[:, :72], 1, fmt="mxfp4", rounding="stochastic", rule="adaptive", rot=64, signs=s64))
    xb = x[:, :128].to(torch.bfloat16)
    a = dict(rot=16, signs=signs.to(DEV), scale_rule="adaptive")
    b = dict(rot=16, signs=signs.to(DEV), rounding="stochastic", key=key, scale_rule="adaptive")
    with settings.override(dual="on"), record_launches() as log:
        qa, qb = ops.quantize_mxfp4_dual(xb.to(DEV), a, b, fp4_b=True)
    assert [e.kernel for e in log] == ["dual"]
    _mx_same(qa, _mx_ref(xb, 1, fmt="mxfp4", rule="adaptive", rot=16, signs=signs), fp4=False)
    _mx_same(qb, _mx_ref(xb, 0, fmt="mxfp4", rounding="stochastic", rule="adaptive", rot=16, signs=signs),
             carrier=False)
    # the fast path (fused quantizers, exact dequantized GEMM on CPU) against the reference path: the Fprop and Dgrad
    # operands adaptive (dY with SR), Wgrad's in bf16
    a_, a_sr = Operand("mxfp4", scale_rule="adaptive"), Operand("mxfp4", scale_rule="adaptive", rounding="stochastic")
    rec = Recipe("adaptive-fd", fprop_x=a_, fprop_w=a_, dgrad_dy=a_sr, dgrad_w=a_)
    assert fast.supported(rec)
    xl, wl, gy = x[:, :64], torch.randn(32, 64, generator=g) / 8, torch.randn(16, 32, generator=g)
    out = []
    for use_fast in (True, False):
        xs, ws = xl.clone().to(DEV).requires_grad_(), wl.clone().to(DEV).requires_grad_()
        if use_fast:
            y = fast.apply(xs, ws, None, Ctx(rec, 1, 2, 0))
        else:
            with settings.override(fast=False):
                y = mx_linear(xs, ws, None, rec, torch.tensor([1, 2, 0], device=DEV))
        y.backward(gy.to(DEV))
        out.append([t.detach().float().cpu() for t in (y, xs.grad, ws.grad)])
    for f, r in zip(*out):
        assert ((f - r).norm() / r.norm()).item() < 1e-6


# Each adaptive kernel variant takes Triton ~20-25 s to compile for sm_90 (H200, 2026-11-28: the two candidate
# quantizations and their error sums make a large kernel), so the GPU checks are split by format and dtype and each
# launch variant runs at one prescale (the prescaled path on three of the seven): the pytest-xdist workers of
# tools/gpu_check.sh spread them instead of one test compiling ~90 variants in a row.
_ADAPTIVE_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
_ADAPTIVE_FMTS = pytest.mark.parametrize("fmt", ["mxfp4", "mxint4", "mxe1m2"])


@pytest.mark.cuda
@_ADAPTIVE_DTYPES
@_ADAPTIVE_FMTS
def test_cuda_adaptive_every_layout(fmt, dtype):
    for x in (_adaptive_wide(dtype), _adaptive_blocks(fmt).to(dtype)):
        for kern, axis in (("blocks", 1), ("tile", 1), ("cols", 0)):
            t = x if axis == 1 else x.t().contiguous()
            with settings.override(qkernel=kern):
                q = ops.quantize_mxfp4_2d(t.to("cuda"), axis, scale_rule="adaptive", carrier=True, fp4=True,
                                          fmt=fmt)
            _mx_same(q, _mx_ref(t, axis, fmt=fmt, rule="adaptive"))


# (apart from the layouts above: with them in one test, mxfp4 in bf16 ran past a 300 s limit on 8 busy workers)
@pytest.mark.cuda
@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "sr"])
@_ADAPTIVE_DTYPES
@_ADAPTIVE_FMTS
def test_cuda_adaptive_dual(fmt, dtype, sr):
    xx = torch.randn(1024, 2048, device="cuda", dtype=dtype)
    s = torch.ones(16, device="cuda")
    a = dict(rot=16, signs=s, fmt=fmt, scale_rule="adaptive")
    b = dict(rot=16, signs=s, rounding="stochastic" if sr else "nearest", key=7, fmt=fmt, scale_rule="adaptive")
    assert verify.dual_ok(xx, a, b, 512) and verify.dual_ok(xx, a, b, 512, fp4_b=True), (fmt, sr)


@pytest.mark.cuda
@_ADAPTIVE_DTYPES
@_ADAPTIVE_FMTS
def test_cuda_adaptive_selfcheck(fmt, dtype):
    from mxtrain.kernels.mxfp4.launch import block_config, kernel_for
    variants = ((1, 16, True, False, 1, False, False, 1.0), (0, 16, True, True, 1, False, True, 0.75),
                (1, 16, True, True, 1, True, False, 1.0), (0, 16, False, False, 128, True, True, 0.75),
                (1, 0, False, False, 128, False, False, 1.0), (1, 64, True, True, 1, True, False, 0.75),
                (0, 0, False, True, 1, True, True, 1.0))
    for axis, rot, signs, sr, gr, fp4, rc, ps in variants:
        kern = kernel_for(axis, rot, fp4, rows_contiguous=rc)
        BR, nw = block_config(kern, axis, gr, sr)
        res = verify.selfcheck("cuda", dtype, axis, rot, signs, "adaptive", sr, ps, gr, BR, nw, 512, fp4,
                               rows_contiguous=rc, fmt=fmt)
        assert res["ok"], (fmt, axis, rot, signs, sr, gr, fp4, ps, res)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_cuda_e1m2_every_layout_and_selfcheck(dtype):
    from mxtrain.kernels.mxfp4.launch import block_config, kernel_for
    x = _e1m2_table(dtype)
    r = _mx_ref(x, 1)
    for kern, axis in (("blocks", 1), ("tile", 1), ("cols", 0)):
        t = x if axis == 1 else x.t().contiguous()
        with settings.override(qkernel=kern):
            _mx_same(ops.quantize_mxfp4_2d(t.to("cuda"), axis, carrier=True, fp4=True, fmt="mxe1m2"), r)
    variants = ((1, 16, True, False, 1, False, False), (0, 16, True, True, 1, False, True),
                (1, 16, True, True, 1, True, False), (0, 16, False, False, 128, True, True),
                (1, 0, False, False, 128, False, False), (1, 64, True, True, 1, True, False),
                (0, 0, False, True, 1, True, True))
    for axis, rot, signs, sr, gr, fp4, rc in variants:
        for rule in ("floor", "rceil", "even"):
            kern = kernel_for(axis, rot, fp4, rows_contiguous=rc)
            BR, nw = block_config(kern, axis, gr, sr)
            res = verify.selfcheck("cuda", dtype, axis, rot, signs, rule, sr, 1.0, gr, BR, nw, 512, fp4,
                                   rows_contiguous=rc, fmt="mxe1m2")
            assert res["ok"], (axis, rot, signs, sr, gr, fp4, rule, res)
    xx = torch.randn(1024, 2048, device="cuda", dtype=dtype)
    s = torch.ones(16, device="cuda")
    for sr in (False, True):
        a = dict(rot=16, signs=s, fmt="mxe1m2")
        b = dict(rot=16, signs=s, rounding="stochastic" if sr else "nearest", key=7, fmt="mxe1m2")
        assert verify.dual_ok(xx, a, b, 512) and verify.dual_ok(xx, a, b, 512, fp4_b=True), sr
