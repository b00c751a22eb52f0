"""NVFP4 GEMMs of the reference path under autocast (``linear.factors_nvfp4``): each operand is quantized, its
float32 tensor scale taken out (``MXTensor.dequantize_factored``: element x E4M3 block scale, exact in bf16),
the two are multiplied in bf16 with float32 accumulation (float32 on CPU: the same exact products), and the
product is scaled by both tensor scales. Checked against float64 math on the same quantized values."""

import pytest
import torch

from mxtrain.linear import reference as L
from mxtrain.linear.context import Ctx
from mxtrain.linear.module import MXLinear
from mxtrain.numerics.quant import quantize
from mxtrain.numerics.recipes import get as get_recipe


def _x(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1]) ** 0.5   # spread of magnitudes
    x[0, :16] = 0.0            # an all-zero block
    x[1, 3] = 1e-42            # a subnormal
    return x


@pytest.mark.parametrize("block", [16, (16, 16)])
@pytest.mark.parametrize("axis", [-1, 0])
def test_factored_values_are_exact_in_bf16_and_give_dequantize(block, axis):
    x = _x((64, 96), 0)
    mx = quantize(x, "nvfp4", axis=axis, block_size=block)
    v, g = mx.dequantize_factored()
    assert v.shape == x.shape and g.dim() == 0 and g.dtype == torch.float32
    assert torch.equal(v.to(torch.bfloat16).float(), v) and torch.equal(v.half().float(), v)
    # dequantize() rounds (block scale x g) to float32 first: the two agree to float32 rounding (2 roundings)
    d = mx.dequantize()
    exact = v.double() * g.double()
    assert torch.allclose(d.double(), exact, rtol=2.5 * 2.0**-24, atol=0)
    with pytest.raises(ValueError, match="NVFP4"):
        quantize(x, "mxfp4", axis=axis).dequantize_factored()


def test_factored_gemms_match_float64_math():
    """fprop, dgrad and wgrad of the nvfp4 recipe (16x16 weight tiles, SR gradients, H16 on Wgrad) under bf16
    autocast: the factored GEMM equals float64 math on the factored operands to float32 accumulation."""
    r = get_recipe("nvfp4")
    q = Ctx(r, layer=2, step=5)
    amp = torch.bfloat16
    x, w, dy = _x((48, 64), 1), _x((32, 64), 2) * 0.1, _x((48, 32), 3) * 1e-3
    cases = [("fprop", (x, -1, "fprop_x", False), (w, -1, "fprop_w", True)),
             ("dgrad", (dy, -1, "dgrad_dy", False), (w, 0, "dgrad_w", False)),
             ("wgrad", (dy, 0, "wgrad_dy", True), (x, 0, "wgrad_x", False))]
    for gemm, a, b in cases:
        assert L.factors_nvfp4(r, a[2], b[2], gemm, amp) and not L.factors_nvfp4(r, a[2], b[2], gemm, None)
        assert not L.factors_nvfp4(r, a[2], b[2], gemm, amp, torch.float64)
        got = L._factored_gemm(q, gemm, a, b, amp, torch.float32, x.device)
        s = q.signs(gemm, x.device)
        av, pa, ga = q.operand_factored(a[0], a[1], a[2], gemm, s)
        bv, pb, gb = q.operand_factored(b[0], b[1], b[2], gemm, s)
        A = av.double().t() if a[3] else av.double()
        B = bv.double().t() if b[3] else bv.double()
        want = (A @ B) * float(ga) * float(gb) / (pa * pb)
        K = A.shape[1]
        tol = 4 * K * 2.0**-24 * ((A.abs() @ B.abs()) * float(ga) * float(gb)) + 1e-30
        assert ((got.double() - want).abs() <= tol).all(), gemm
        # the tensor scales were taken out of the values (not 1), so the scaling step is exercised
        assert float(ga) != 1.0 and float(gb) != 1.0


def test_nvfp4_layer_uses_factored_gemms_under_autocast_and_stays_close_to_rounded_values():
    """An MXLinear with the nvfp4 recipe under bf16 autocast (reference path on CPU): forward and backward run
    the factored GEMMs, and agree with the float32 GEMMs of the rounded values (``fast off``) to bf16 output
    rounding."""
    torch.manual_seed(0)
    lin = MXLinear(64, 32, recipe="nvfp4", layer_id=1)
    x = torch.randn(4, 12, 64, requires_grad=True)
    calls = []
    real = L._factored_gemm

    def spy(qctx, gemm, *a, **k):
        calls.append(gemm)
        return real(qctx, gemm, *a, **k)
    L._factored_gemm = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        y.float().sum().backward()
    finally:
        L._factored_gemm = real
    assert sorted(calls) == ["dgrad", "fprop", "wgrad"]
    # the same layer without autocast: float32 GEMMs of float32-rounded values (the other path)
    x2 = x.detach().clone().requires_grad_(True)
    lin.weight.grad = None
    y2 = lin(x2)
    assert torch.allclose(y.float(), y2.to(torch.bfloat16).float(), rtol=2**-6, atol=1e-3)


def test_mm_out_dtype_probe_is_kept_in_the_kernel_caches():
    from mxtrain.kernels.caches import CACHES
    CACHES.probes.pop("mm_out_dtype:cpu", None)
    assert L._mm_out_dtype_ok(torch.device("cpu")) is False          # (CPU: no bf16 -> float32 mm)
    assert CACHES.probes["mm_out_dtype:cpu"] is False
    a, b = torch.randn(8, 16).to(torch.bfloat16).float(), torch.randn(16, 4).to(torch.bfloat16).float()
    assert torch.equal(L._mm_f32(a, b, torch.bfloat16), a @ b)      # exact products, float32 sums
