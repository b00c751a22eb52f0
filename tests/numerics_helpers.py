"""Shared numerics helpers for the tests: the three tolerance tiers of docs/shared style.md.

1. Bit-exact (formats, quantizers, kernels vs the reference): ``assert_bitwise_equal``.
2. Quantized results: ``sqnr_db`` with floors stated next to each use.
3. Float tolerances for plumbing: ``FP32_TOL`` (reason: float32 accumulation of short sums).

And ``wide_values``: the adversarial input of the kernel tests (many binades, ties, zeros, NaN/Inf).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

# float32 matmul of operands that are exactly equal, compared with a float64 product:
# only accumulation rounding differs (K <= a few hundred terms of magnitude <= ~10).
FP32_TOL = dict(rtol=2e-5, atol=2e-5)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10 log10(|ref|^2 / |ref - approx|^2) in dB (inf if equal)."""
    ref = ref.detach().to(torch.float64)
    err = (ref - approx.detach().to(torch.float64)).pow(2).sum().item()
    sig = ref.pow(2).sum().item()
    if err == 0:
        return math.inf
    return 10.0 * math.log10(sig / err)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def assert_bitwise_equal(actual, expected, what: str = "") -> None:
    """Equal bit patterns (uint8 codes / float arrays compared by value with NaN == NaN)."""
    a = as_numpy(actual) if isinstance(actual, torch.Tensor) else np.asarray(actual)
    e = as_numpy(expected) if isinstance(expected, torch.Tensor) else np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    if a.dtype.kind == "f" or e.dtype.kind == "f":
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        same = (a64 == e64) & (np.signbit(a64) == np.signbit(e64)) | (np.isnan(a64) & np.isnan(e64))
    else:
        same = a == e
    if not same.all():
        idx = np.argwhere(~same)
        first = tuple(idx[0])
        raise AssertionError(
            f"{what}: {len(idx)} of {a.size} entries differ; first at {first}: got {a[first]!r}, "
            f"expected {e[first]!r}")


# our element format name -> the ml_dtypes type with the same encoding (the independent reference)
ML = {
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
}


def wide_values(shape, seed, device, nonfinite=True, zero_block=16) -> torch.Tensor:
    """float32 values over ~40 binades (a different range per row), small-grid ties, zeros, -0, an all-zero
    run of ``zero_block`` in row 2, a subnormal, and (``nonfinite``) NaN and +-Inf, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    R, C = shape
    x = torch.randn(R, C, generator=g) * torch.exp2(torch.randint(-20, 20, (R, C), generator=g).float())
    x = x * torch.exp2(torch.randint(-6, 6, (R, 1), generator=g).float())
    n = min(C, 8)
    x[0, :n] = torch.tensor([0.25, 0.75, -1.25, 2.5, 3.5, -5.0, 0.0, -0.0])[:n]
    if R > 2:
        x[2, : min(C, zero_block)] = 0.0         # an all-zero block
        x[1, -1] = 1e-41                         # a subnormal
    if nonfinite and R > 3 and C > 20:
        x[3, 17] = float("nan")
        x[R - 1, C - 1] = float("inf")
        x[R // 2, 1] = -float("inf")
    return x.to(device)


def mx_reference_out(x, axis, fmt, rounding="nearest", rule="floor", seed=5, rot=0, signs=None, gr=1, km=128,
                     prescale=1.0):
    """The reference quantizer's codes and scales of ``x`` as the fused MXFP4 quantizer's ``QuantOut`` (rows along
    the output's rows), with the carrier and inexact count built from them by ``carrier_from_fp4`` (the carrier's
    definition): what a kernel's output is compared with, bit for bit (``assert_quant_out_equal``)."""
    from mxtrain.kernels.mxfp4 import carrier as kc
    ref = kc.reference_quantize(x.cpu(), fmt, axis, None, rounding, rule, seed, prescale, rot,
                                None if signs is None else signs.cpu())
    R = x.shape[0] if axis == 1 else x.shape[1]
    q = kc.QuantOut(R, x.shape[axis], None, None, gr, None, ref.data.view(torch.uint8).reshape(R, -1),
                    ref.scales.reshape(R, -1), fmt=fmt)
    kc.carrier_from_fp4(q, km, 16)
    return q


def assert_quant_out_equal(q, r, fp4=True, carrier=True) -> None:
    """Every output of the fused quantizer ``q`` equals the reference's ``r`` (``mx_reference_out``): FP4 codes and
    E8M0 scales (``fp4``), carrier bytes, group scales and the inexact count (``carrier``)."""
    if fp4:
        assert torch.equal(q.packed.cpu(), r.packed) and torch.equal(q.scales.cpu(), r.scales)
    if carrier:
        assert torch.equal(q.carrier.view(torch.uint8).cpu(), r.carrier.view(torch.uint8))
        assert torch.equal(q.gscale.cpu(), r.gscale)
        assert int(q.inexact.item()) == int(r.inexact.item())


def four_over_six_pairs() -> tuple[np.ndarray, np.ndarray]:
    """Every ordered pair (p, r) of the signed points of either "Four over Six" candidate grid (E2M1's, scaled to
    6, and E2M1's times 1.5, scaled to 4) and of the midpoints between neighbours, up to 6: rounding ties, error ties
    and saturation (two float64 arrays from ``np.meshgrid``)."""
    g6 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    pts = np.unique(np.concatenate([g6, g6 * 1.5]))
    pts = np.unique(np.concatenate([pts, (pts[1:] + pts[:-1]) / 2]))
    pts = pts[pts <= 6]
    signed = np.concatenate([pts, -pts[1:]])
    return np.meshgrid(signed, signed, indexing="ij")
