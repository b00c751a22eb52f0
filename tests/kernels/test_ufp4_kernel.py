"""The uniform 4-bit grid (``mxint4``, the ``ufp4`` recipe's format) in the fused quantizer and the FP8 carrier:
bit-identical to the reference quantizer (``mxtrain.numerics.quant``), and the fast path that takes it (issue #51).

On CPU the kernels run in Triton's interpreter on small shapes (this file's CPU tests take a few seconds); the
tests marked ``cuda`` run the compiled kernels and the sm_90 carrier GEMM (not yet run on a GPU when written).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain.linear import fast
from mxtrain.numerics import recipes, rng
from mxtrain import settings  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels.expand import carrier_from_packed  # noqa: E402
from mxtrain.kernels.mxfp4 import carrier as kc, ops, verify  # noqa: E402
from mxtrain.kernels.mxfp4.launch import GRID_ID, RULE_ID  # noqa: E402
from mxtrain.numerics.quant import SCALE_RULES, quantize as ref_quantize  # noqa: E402
from numerics_helpers import assert_quant_out_equal, mx_reference_out  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
F32 = torch.float32


def _ref_out(x, axis, fmt="mxint4", **kw):
    return mx_reference_out(x, axis, fmt, **kw)


_same = assert_quant_out_equal   # (tests/numerics_helpers.py)


def _table(dtype) -> torch.Tensor:
    """(16, 128): every INT4 grid value, every rounding midpoint and its neighbours one ulp (of ``dtype``) either
    side, values past the largest element, +-0, each sign; in blocks whose maximum puts the scale at 2**0 (the
    floor rule: block maxima in [4, 8)), the rows scaled by powers of two from 2**-133 (float32 subnormal inputs)
    to 2**125; and a row of special blocks: NaN, +Inf, all +0, all -0."""
    mids = torch.arange(7, dtype=F32) + 0.5
    lo = torch.nextafter(mids.to(dtype), torch.zeros((), dtype=dtype)).to(F32)
    hi = torch.nextafter(mids.to(dtype), torch.full((), 8.0, dtype=dtype)).to(F32)
    big = torch.tensor([7.25, 7.5, 7.75, 7.96875])
    mags = torch.cat([torch.arange(8, dtype=F32), mids, lo, hi, big])            # 40 magnitudes
    vals = torch.cat([mags, -mags, torch.tensor([-0.0])])                         # 81 values
    row = torch.zeros(128)
    row[: vals.numel()] = vals
    row[torch.arange(4) * 32 + 31] = 7.0                                         # each block's maximum in [4, 8)
    rows = [row * 2.0**e for e in (0, -1, 3, -20, 40, -126, -133, 125, 7, -60, 90, -100, 1, 2, -3)]
    special = torch.zeros(128)
    special[3], special[40] = float("nan"), float("inf")
    special[64:96], special[96:] = 0.0, -0.0
    special[:3] = 1.0
    rows.append(special)
    x = torch.stack(rows)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_grid_table_every_layout_both_axes(dtype):
    """Round to nearest over the whole grid and around every midpoint, in the three layouts of the single-pass
    kernel, along rows and along columns (the transposed tensor, read through its strides): codes, scales,
    carrier and inexact count equal the reference's. The table row of scale 2**0 checks the codes' values."""
    x = _table(dtype)
    r = _ref_out(x, 1)
    want = ref_quantize(x[:1].float(), "mxint4").dequantize()[0, :81]
    q = ops.quantize(x[:1], "mxint4")
    assert q.fmt.name == "mxint4" and q.data.dtype == torch.uint8
    assert torch.equal(q.dequantize()[0, :81], want)
    xs = x[0, :81].float()
    assert torch.equal(want, torch.where(xs.abs() > 7, torch.copysign(torch.tensor(7.0), xs),
                                         torch.round(xs)))   # (RNE onto the integers, saturating at 7)
    for kern, axis in (("blocks", 1), ("tile", 1), ("cols", 0)):
        t = x if axis == 1 else x.t().contiguous()
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, carrier=True, fp4=True, fmt="mxint4")
        _same(q, r)


@pytest.mark.parametrize("rule", [r for r in SCALE_RULES if r != "floor"])
def test_scale_rules_at_their_thresholds(rule):
    """Block maxima at and one ulp around where each rule rounds the exponent up (INT4: rceil above 1.75 x 2**E,
    even from 1.9375, amd from 1.75, ceil above 1), plus the floor rule's: the kernel's E8M0 scales and codes equal
    the reference's for every rule the kernels take."""
    sig = torch.tensor([1.0, 1.5, 1.75, 1.9375, 1.96875])
    edges = torch.cat([sig, torch.nextafter(sig, torch.zeros(5)), torch.nextafter(sig, torch.full((5,), 2.0))])
    x = torch.randn(16, 128) * 0.25
    for i, m in enumerate(edges.tolist()):
        x[i % 16, (i // 16) * 32 + (i % 32)] = m * 2.0 ** (2 + i % 5)   # one block per maximum
    x[:, 127] = 0.0
    q = ops.quantize_mxfp4_2d(x.to(DEV), 1, scale_rule=rule, carrier=True, fp4=True, fmt="mxint4")
    _same(q, _ref_out(x, 1, rule=rule))


def test_rotation_signs_stochastic_rounding_dual_and_expand():
    """The ``ufp4`` recipe's operands: 16-wide Hadamard with signs, stochastic rounding (dY), bf16 and float32
    inputs, along rows and columns; the one-pass dual kernel equals the two single passes, and the carrier rebuilt
    from INT4 codes (``carrier_from_packed``) equals the fused one byte for byte."""
    g = torch.Generator().manual_seed(3)
    signs = (1.0 - 2.0 * torch.randint(0, 2, (16,), generator=g)).float()
    x = (torch.randn(24, 136, generator=g) * torch.exp2(torch.randint(-9, 9, (24, 1), generator=g).float()))
    xc = x[:, :32]   # along columns: 32 output rows (one program), 24 tokens (ragged: H16 pads them to 32)
    key = rng.stream_key(5)
    for dtype, axis, rnd, kern in ((torch.bfloat16, 1, "stochastic", "blocks"), (F32, 0, "stochastic", "cols"),
                                   (torch.bfloat16, 0, "nearest", "cols"), (F32, 1, "stochastic", "tile")):
        t = (x[:16] if kern == "blocks" else x if axis == 1 else xc).to(dtype)   # (one program a column tile)
        si = (kc.ceil_to(t.shape[1], 16), 1) if axis == 1 else None
        with settings.override(qkernel=kern):
            q = ops.quantize_mxfp4_2d(t.to(DEV), axis, rot=16, signs=signs.to(DEV), rounding=rnd, key=key,
                                      index_strides=si, carrier=True, fp4=True, fmt="mxint4")
        _same(q, _ref_out(t, axis, rounding=rnd, rot=16, signs=signs))
    # the 64-wide tile path (not the ufp4 recipe's rotation, but the same switch)
    s64 = (1.0 - 2.0 * torch.randint(0, 2, (64,), generator=g)).float()
    x64 = x[:, :72]   # (ragged: H64 pads to 128, one program)
    q = ops.quantize_mxfp4_2d(x64.to(DEV), 1, rot=64, signs=s64.to(DEV), rounding="stochastic", key=key,
                              index_strides=(128, 1), carrier=True, fp4=True, fmt="mxint4")
    _same(q, _ref_out(x64, 1, rounding="stochastic", rot=64, signs=s64))
    # dual: X's Fprop (rows) and Wgrad (columns, as FP4 codes) operands from one read, as the forward makes them
    xb = x[:16, :128].to(torch.bfloat16).to(DEV)
    a = dict(rot=16, signs=signs.to(DEV), fmt="mxint4")
    b = dict(rot=16, signs=signs.to(DEV), rounding="stochastic", key=key, fmt="mxint4")
    with settings.override(dual="on"):
        qa, qb = ops.quantize_mxfp4_dual(xb, a, b, fp4_b=True)
    sa = ops.quantize_mxfp4_2d(xb, 1, **a, carrier=True, fp4=False)
    sb = ops.quantize_mxfp4_2d(xb, 0, **b, carrier=False, fp4=True)
    assert qa.fmt == qb.fmt == "mxint4"
    assert torch.equal(qa.carrier.view(torch.uint8), sa.carrier.view(torch.uint8)) and torch.equal(qa.gscale, sa.gscale)
    assert torch.equal(qb.packed, sb.packed) and torch.equal(qb.scales, sb.scales)
    # the backward's carrier of the kept codes: the fused carrier's bytes
    e = carrier_from_packed(qb)
    f = ops.quantize_mxfp4_2d(xb, 0, **b, carrier=True, fp4=False)
    assert torch.equal(e.carrier.view(torch.uint8), f.carrier.view(torch.uint8)) and torch.equal(e.gscale, f.gscale)
    assert int(e.inexact.item()) == int(f.inexact.item())


def test_carrier_exact_one_binade_lower_than_e2m1():
    """INT4's smallest non-zero value is 1, E2M1's 0.5: a block 15 binades under its group's largest one is held
    exactly by the carrier for INT4 (not counted) and not for E2M1 (counted); 16 binades under is inexact for both.
    The fused quantizer, the carrier rebuild and the definition agree on bytes and counts, and the carrier's values
    are the MX values wherever the count says exact."""
    x = torch.zeros(16, 128)
    x[:, :32] = 7.0                        # block 0: s = 0 (the group exponent G)
    x[:, 32:64] = 2.0**-13                 # block 1: s = -15 (kexp = s - G + 6 = -9): value 4
    x[:, 33] = 2.0**-15                    # and an INT4 value 1: 2**-9 in the carrier, e4m3's smallest
    x[:, 64:96] = 2.0**-14                 # block 2: s = -16 (kexp -10): inexact for both grids
    x[:, 96:] = 2.0**-14 * 6.0             # block 3: s = -14 (kexp -8): exact for both
    counts = {}
    for fmt in ("mxint4", "mxfp4"):
        q = ops.quantize_mxfp4_2d(x.to(DEV), 1, carrier=True, fp4=True, fmt=fmt)
        r = _ref_out(x, 1, fmt=fmt)
        _same(q, r)
        counts[fmt] = int(q.inexact.item())
        e = carrier_from_packed(q)
        assert torch.equal(e.carrier.view(torch.uint8), q.carrier.view(torch.uint8))
        assert int(e.inexact.item()) == counts[fmt]
        vals = kc.carrier_values(q)[:, :128].cpu()
        mx = kc.dequantize_fp4(q).cpu()
        blocks = [0, 1, 3] if fmt == "mxint4" else [0, 3]
        for b in blocks:
            assert torch.equal(vals[:, 32 * b: 32 * b + 32], mx[:, 32 * b: 32 * b + 32]), (fmt, b)
    assert counts == {"mxint4": 16, "mxfp4": 32}


def test_fast_path_admits_the_uniform_grid_and_round_up_scales():
    """``fast.supported``: the ``ufp4`` preset and any preset of MXFP4, MXINT4 or MXE1M2 with a scale rule the kernels
    have (``rceil`` and ``adaptive`` included: tests/kernels/test_rules_kernels.py); not NVFP4 or an MXFP6 format."""
    for name in ("ufp4", "ufp4+rceil", "ufp4+even", "mxfp4-all+rceil", "mxfp4-all-dh16+rceil", "mxfp4-all-adaptive",
                 "ufp4+adaptive"):
        assert fast.supported(recipes.get(name)), name
    for name in ("nvfp4-4over6", "nvfp4"):
        assert not fast.supported(recipes.get(name)), name
    assert fast.supported(recipes.get("mxfp4-all").with_(**{"fprop_x.fmt": "mxe1m2"}))
    assert set(GRID_ID) == set(kc.KERNEL_FORMATS) == {"mxfp4", "mxint4", "mxe1m2"}
    assert set(RULE_ID) == set(SCALE_RULES) | {"adaptive"}
    assert ops.supported("mxint4") and ops.supported("mxe1m2") and not ops.supported("mxfp6_e2m3")
    with pytest.raises(ValueError, match="no fused kernel"):
        ops.quantize_mxfp4_2d(torch.ones(4, 32), 1, fmt="mxfp6_e2m3")


# ---------------------------------------------------------------------------------------------- GPU (cuda)


@cuda
@needs_cuda
@pytest.mark.parametrize("preset", ["ufp4", "ufp4+rceil", "mxfp4-all+rceil"])
def test_fast_equals_reference_gpu(preset):
    """The eager fast path (fused quantizers, FP8-carrier GEMMs on sm_90) against the reference MXLinear, bf16,
    ragged shapes: outputs and gradients within bf16 output rounding."""
    from mxtrain.linear.context import Ctx
    from mxtrain.linear import reference as _ref_linear
    rec = recipes.get(preset)
    g = torch.Generator().manual_seed(0)
    M, K, N = 1024 + 16, 1024 + 64, 768
    x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEV, torch.bfloat16)
    b = torch.randn(N, generator=g).to(DEV, torch.bfloat16)
    gy = torch.randn(M, N, generator=g).to(DEV, torch.bfloat16)
    outs = []
    for fn in (_ref_linear.apply, fast.apply):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        y = fn(xs, ws, bs, Ctx(rec, 3, 5, 1))
        y.backward(gy)
        outs.append([t.detach().float() for t in (y, xs.grad, ws.grad, bs.grad)])
    for r, f in zip(*outs):
        assert ((f - r).norm() / r.norm()).item() < 1e-2, preset


@cuda
@needs_cuda
@pytest.mark.parametrize("exact", [False, True], ids=["counted", "exact_carrier"])
def test_inexact_counts_one_binade_lower_gpu(exact):
    """The fast path's count of inexact carrier blocks for INT4 operands: blocks 15 binades under their 1x128 group's
    largest block are exact (not counted), 16 binades under are counted; with ``exact_carrier`` such a GEMM runs
    the exact dequantized GEMM instead, and its output equals the reference's then too."""
    from mxtrain import MXLinear, Operand, Recipe
    rec = Recipe("int4-fprop", fprop_x=Operand("mxint4"), fprop_w=Operand("mxint4"))
    with settings.override(exact_carrier=exact):
        lin = MXLinear(256, 128, recipe=rec, device=DEV)
        lin.weight.requires_grad_(False)   # Fprop operands only
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 256, generator=g).to(DEV)
        x[:, :32] = 7.0
        x[:, 32:128] = (4.0 + 3.9 * torch.rand(64, 96, generator=g)).to(DEV) * 2.0**-15   # s = -15: kexp -9
        before = fast.inexact_blocks()
        y = lin(x)
        assert fast.inexact_blocks() == before
        x[:, 32:128] *= 0.5                                                               # kexp -10
        y = lin(x)
        assert fast.inexact_blocks() - before == 64 * 3
        with settings.override(fast=False):
            ref = lin(x)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < (1e-5 if exact else 1e-2)


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_selfcheck_every_int4_variant_gpu(dtype):
    """Each compiled INT4 variant the ufp4 recipe launches (and its neighbours: every layout, rotations 0/16/64,
    SR, 128x128 groups, FP4 codes) matches the reference quantizer on the GPU (``verify.selfcheck``), and the dual
    kernel matches two single passes (``verify.dual_ok``)."""
    from mxtrain.kernels.mxfp4.launch import block_config, kernel_for
    # (axis, rotation, signs, SR, group rows, FP4 codes, output rows contiguous)
    variants = ((1, 16, True, False, 1, False, False), (0, 16, True, True, 1, False, True),
                (1, 16, True, True, 1, True, False), (0, 16, False, False, 128, True, True),
                (1, 0, False, False, 128, False, False), (1, 64, True, True, 1, True, False),
                (0, 0, False, True, 1, True, True))
    for axis, rot, signs, sr, gr, fp4, rc in variants:
        kern = kernel_for(axis, rot, fp4, rows_contiguous=rc)
        BR, nw = block_config(kern, axis, gr, sr)
        res = verify.selfcheck(DEV, dtype, axis, rot, signs, "floor", sr, 1.0, gr, BR, nw, 512, fp4, rows_contiguous=rc,
                               fmt="mxint4")
        assert res["ok"], (axis, rot, signs, sr, gr, fp4, res)
    x = torch.randn(1024, 2048, device=DEV, dtype=dtype)
    s = torch.ones(16, device=DEV)
    for sr in (False, True):
        a = dict(rot=16, signs=s, fmt="mxint4")
        b = dict(rot=16, signs=s, rounding="stochastic" if sr else "nearest", key=7, fmt="mxint4")
        assert verify.dual_ok(x, a, b, 512), sr
        assert verify.dual_ok(x, a, b, 512, fp4_b=True), sr


@cuda
@needs_cuda
def test_ufp4_mxlinear_compiled_and_cuda_graph_gpu():
    """A ``ufp4`` layer routes to the fast path, runs under ``torch.compile`` (it draws random signs and stochastic
    rounding, so without ``mx_compiled_seeded`` it runs as the custom op around the eager fast path; with it, compiled
    into the graph: tests/linear/test_compiledmx.py) and under a CUDA graph, with the eager results."""
    from mxtrain import MXLinear
    from mxtrain.linear import route
    rec = recipes.get("ufp4")
    torch.manual_seed(0)
    lin = MXLinear(512, 256, recipe=rec, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4, 64, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    assert route(rec, x, lin.weight) == "fast"
    y = lin(x)
    y.float().square().mean().backward()
    torch._dynamo.reset()
    cl = torch.compile(lin)
    x2 = x.detach().clone().requires_grad_()
    y2 = cl(x2)
    y2.float().square().mean().backward()
    assert ((y2.float() - y.float()).norm() / y.float().norm()).item() < 1e-2
    # a CUDA graph of the forward replays the eager forward (keys and signs from device memory)
    with torch.no_grad():
        lin(x)   # warm-up (kernels compiled and self-checked outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = lin(x)
        graph.replay()
        assert torch.isfinite(yg).all()
