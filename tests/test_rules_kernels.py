"""The 2026 scale rules and formats in the Triton kernels (issue #51), bit for bit against the reference quantizer
(``mxtrain.quant``): NVFP4's ``four_over_six`` in ``kernels/nvfp4.py``'s quantizer, and the uniform E1M2 grid
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

from numerics import wide_values  # noqa: E402

from mxtrain import settings  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import nvfp4 as K  # noqa: E402
from mxtrain.kernels.caches import CACHES  # noqa: E402
from mxtrain.operand import fake_quantize_operand  # noqa: E402

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
    and saturation, at an exact E4M3 scale, one that rounds, an E4M3 subnormal one and one where both are 0; along
    rows and columns."""
    g6 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    pts = np.unique(np.concatenate([g6, g6 * 1.5]))
    pts = np.unique(np.concatenate([pts, (pts[1:] + pts[:-1]) / 2]))
    pts = pts[pts <= 6]
    signed = np.concatenate([pts, -pts[1:]])
    p, r = np.meshgrid(signed, signed, indexing="ij")
    blocks = []
    for s in (1.0, 0.3, 3 * 2.0**-9, 2.0**-11):
        rows = np.zeros((p.size, 16), np.float32)
        rows[:, 0], rows[:, 1], rows[:, 2] = 6 * s, p.reshape(-1) * s, r.reshape(-1) * s
        blocks.append(rows)
    anchor = np.zeros((1, 16), np.float32)
    anchor[0, 0] = 2688.0
    x = np.concatenate([anchor] + blocks)
    x = np.concatenate([x, np.zeros((-len(x) % 4, 16), np.float32)])
    x = torch.from_numpy(x).to(DEV).reshape(-1, 64)               # 4 blocks a row
    assert _check46(x, 1, False) > 0
    assert _check46(x.t().contiguous(), 0, False) > 0


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
