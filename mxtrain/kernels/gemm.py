"""GEMM dispatch for quantized operands: ``C = A B^T`` with A (Ra, K) and B (Rb, K) both quantized
along K (their last axis) by ``mxtrain.kernels.mxfp4``.

* ``fp8_carrier`` (sm_90): blockwise ``torch._scaled_mm`` on the e4m3 carrier with 1x128 (A) and
  128x128 or 1x128 (B) float32 group scales: the exact MXFP4 values, fp32 accumulation in the tensor
  cores, bf16 output.
* ``native_mx`` (sm_100+): packed FP4 codes with E8M0 scales through the first of these that a probe
  on the device finds exact (``native_plan``): MX-scaled ``torch._scaled_mm`` (cuBLAS, scales in its
  blocked layout), the Triton ``tl.dot_scaled`` kernel (``mxtrain.kernels.mxdot``), dequantize.
  Never run on such a GPU here: the probe is the guard.
* ``dot_scaled``: the Triton ``tl.dot_scaled`` kernel on packed codes and E8M0 scales, on any GPU
  (Hopper emulates it: the test of the native path available here); on CPU its portable twin, which
  decodes the codes to bf16 in registers (Triton interpreter). Selected with the ``gemm_backend`` setting
  (``MXTRAIN_GEMM_BACKEND``).
* ``dequant``: decode codes and scales and multiply: in bf16 with fp32 accumulation on GPUs (MX values
  are exact in bf16), in float32 on CPU. Operands of the uniform INT4 grid (``mxint4``, ``QuantOut.fmt``) take
  this path where the backend is ``native_mx`` or ``dot_scaled`` (no FP4 tensor core multiplies INT4 codes);
  on ``fp8_carrier`` they run as MXFP4 does (every INT4 value times a power of two is exact in e4m3).

All paths multiply the same MX values; only accumulation order and output rounding differ.
"""

from __future__ import annotations

import torch

from .. import settings as _settings
from ..errors import UserError
from .caches import CACHES
from .mxfp4.carrier import QuantOut, carrier_values, dequantize_fp4
from .mxfp4 import quantize_mxfp4_2d

__all__ = ["mx_gemm_nt", "probe", "native_plan", "weight_group_rows", "activation_b_group_rows", "outputs_for"]

# probe results per device live in CACHES.probes (mxtrain.kernels.caches)


def k_multiple_for(backend: str) -> int:
    """Carrier reduction-length padding: the setting ``carrier_k`` (512 by default: cuBLAS's blockwise FP8 path
    wants K/128 % 4 == 0: with K/128 = 9 an earlier torch returned wrong results in both scale configurations,
    and torch 2.11 refuses 128x128 B groups at any K/128 not a multiple of 4 (``_refused_padding``); 256 or 128
    where ``tools/carrier_k_probe.py`` finds them exact); 128 for the other backends."""
    return _settings.current().carrier_k if backend == "fp8_carrier" else 128


def native_plan(device) -> str:
    """For ``native_mx``: "scaled_mm", "dot_scaled" or "dequant", the first that runs and is exact on
    ``device`` (probed once on small random operands against float64)."""
    device = torch.device(device)
    key = "native:" + str(device)
    probes = CACHES.probes
    if key not in probes:
        probes[key] = _probe_native(device)
    return probes[key]["plan"]


@torch.compiler.disable
def _probe_native(device) -> dict:
    res: dict = {"plan": "dequant", "errors": {}}
    if device.type != "cuda":
        return res
    g = torch.Generator(device=device).manual_seed(0)
    qa = quantize_mxfp4_2d(torch.randn(256, 1088, device=device, generator=g), 1, carrier=False, fp4=True)
    qb = quantize_mxfp4_2d(torch.randn(384, 1088, device=device, generator=g), 1, carrier=False, fp4=True)
    va, vb = dequantize_fp4(qa).double(), dequantize_fp4(qb).double()
    ref, mag = va @ vb.t(), va.abs() @ vb.abs().t()
    for plan in ("scaled_mm", "dot_scaled"):
        try:
            out = _native_mx(qa, qb, torch.bfloat16) if plan == "scaled_mm" else _dot_scaled(qa, qb, torch.bfloat16)
            ok, worst = exact_up_to_rounding(out[:256, :384], ref, mag)
            res["errors"][plan] = worst
            if ok:
                res["plan"] = plan
                return res
        except Exception as e:  # noqa: BLE001 - try the next
            res["errors"][plan] = repr(e)[:300]
    return res


def exact_up_to_rounding(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor) -> tuple[bool, float]:
    """Is the low-precision GEMM output ``out`` the exact product ``ref`` (float64) but for its own rounding, in
    every element? Allowed: one unit in the last place of ``out``'s dtype (2**-7 of the value for bf16, twice its
    rounding's largest error) and an accumulation error of 2**-10 of ``mag`` (the float64 product of the operands'
    magnitudes, the sum of the products' sizes). A block scale misread anywhere moves the elements it touches by a
    sizable share of ``mag`` (a block of 32 of 1,088 products: about 3 %), which a norm over the whole output can
    dilute below a norm tolerance; this looks at each element. Returns (ok, the worst element's error in units of
    its bound)."""
    ulp = torch.finfo(out.dtype).eps
    err = (out.double() - ref).abs()
    bound = ulp * ref.abs() + 2.0 ** -10 * mag + torch.finfo(torch.float64).tiny
    worst = (err / bound).max().item()
    return worst <= 1.0, worst


def _dot_scaled(a: QuantOut, b: QuantOut, out_dtype, divisor: float = 1.0) -> torch.Tensor:
    from .mxdot import mx_dot_nt  # optional (Triton: mxdot imports it)
    return mx_dot_nt(a.packed, a.scales, b.packed, b.scales, out_dtype=out_dtype, divisor=divisor,
                     native=a.packed.device.type == "cuda")


def _dequant_mm(va: torch.Tensor, vb: torch.Tensor, divisor: float) -> torch.Tensor:
    """``va @ vb^T / divisor`` of exact MX values, float32 out: bf16 tensor cores with fp32 accumulation
    on GPUs (every MX value is exact in bf16), float32 matmul elsewhere."""
    if va.is_cuda:
        a16, b16 = va.to(torch.bfloat16), vb.to(torch.bfloat16)
        try:
            y = torch.mm(a16, b16.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            y = torch.mm(a16, b16.t()).float()
    else:
        y = torch.matmul(va, vb.t())
    return y / divisor if divisor != 1.0 else y


def outputs_for(backend: str) -> tuple[bool, bool]:
    """(carrier, fp4) outputs the quantize kernel must write for a GEMM backend."""
    if backend == "fp8_carrier":
        return True, False
    return False, True


def _probe_of(device) -> dict:
    """``probe(device)``'s result; for a ``torch.device`` with an index (a tensor's, at every layer call) also
    kept under that object, so the lookup makes no device name."""
    if type(device) is torch.device and device.index is not None:
        p = CACHES.probes.get(device)
        if p is None:
            p = CACHES.probes[device] = CACHES.probes.get(str(device)) or probe(device)
        return p
    return CACHES.probes.get(str(torch.device(device))) or probe(device)


def weight_group_rows(device=None) -> int:
    """128x128 weight groups when cuBLAS takes (1x128, 128x128) correctly, else 1x128."""
    if device is None or torch.device(device).type != "cuda":
        return 128
    p = _probe_of(device)
    return 128 if p.get("a1x128_b128x128", False) or not p.get("b_1x128", False) else 1


def activation_b_group_rows(device) -> int:
    """Group rows for an activation that is operand B (Wgrad's X^T along tokens): 128x128 by default
    (cuBLAS's (1x128, 128x128) GEMM measured 1.26x faster than (1x128, 1x128) at 16384x4096x4096 on
    an H100; still exact unless a block is more than 14 binades under its 128x128 tile's largest, which
    the inexact counter reports). The ``wgrad_b_group`` setting 1 (``MXTRAIN_WGRAD_B_GROUP=1``) selects 1x128
    (exact in more cases)."""
    want = _settings.current().wgrad_b_group
    p = _probe_of(device)
    if want == 128 and p.get("a1x128_b128x128", False):
        return 128
    return 1 if p.get("b_1x128", False) else 128


def _scaled_mm(a: QuantOut, b: QuantOut, out_dtype, alpha: float = 1.0) -> torch.Tensor:
    sa = a.gscale  # (Rca, Kc/128), outer-dim-major
    if alpha != 1.0:  # fold an output multiplier (1 / prescales) into A's fp32 group scales
        sa = (sa.t() * alpha).t()
    if b.group_rows == 128:
        sb = b.gscale.t()  # (Kc/128, Rcb/128)
    else:
        sb = b.gscale.t()  # (Kc/128, Rcb), contiguous
    return torch._scaled_mm(a.carrier, b.carrier.t(), sa, sb, out_dtype=out_dtype)


@torch.compiler.disable
def probe(device) -> dict:
    """Check once per device which blockwise ``_scaled_mm`` configurations run and are exact: every element of a
    256x384x1088 product within ``exact_up_to_rounding``'s bound of the float64 product of the carrier values
    (``errors``: the worst element's error in units of its bound, or the exception)."""
    device = torch.device(device)
    key = str(device)
    probes = CACHES.probes
    if key in probes:
        return probes[key]
    res = {"a1x128_b128x128": False, "b_1x128": False, "errors": {}}
    if device.type == "cuda":
        g = torch.Generator(device=device).manual_seed(0)
        A = torch.randn(256, 1088, device=device, generator=g)
        B = torch.randn(384, 1088, device=device, generator=g)
        qa = quantize_mxfp4_2d(A, 1, carrier=True, fp4=False, group_rows=1, k_multiple=512)
        for name, gr in (("a1x128_b128x128", 128), ("b_1x128", 1)):
            try:
                qb = quantize_mxfp4_2d(B, 1, carrier=True, fp4=False, group_rows=gr, k_multiple=512)
                out = _scaled_mm(qa, qb, torch.bfloat16)
                va, vb = carrier_values(qa)[:256].double(), carrier_values(qb)[:384].double()
                # every element within its rounding (the native probe's check; on an H200 the worst element was
                # 0.26 of its bound, 2026-11-30), not a norm that one misread block scale can pass
                res[name], res["errors"][name] = exact_up_to_rounding(out, va @ vb.t(), va.abs() @ vb.abs().t())
            except Exception as e:  # noqa: BLE001
                res["errors"][name] = repr(e)[:300]
    probes[key] = res
    return res


def _to_blocked(s: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (rows, K/32) to cuBLAS's 128x4 blocked layout (torchao's ``to_blocked``)."""
    rows, cols = s.shape
    nr, nc = -(-rows // 128), -(-cols // 4)
    p = torch.zeros((nr * 128, nc * 4), dtype=s.dtype, device=s.device)
    p[:rows, :cols] = s
    blocks = p.view(nr, 128, nc, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _native_mx(a: QuantOut, b: QuantOut, out_dtype) -> torch.Tensor:  # pragma: no cover - no sm_100 here
    # UNTESTED: MX-scaled _scaled_mm (torch >= 2.8 on sm_100). K must be a multiple of 32 (it is).
    fa = a.packed.view(torch.float4_e2m1fn_x2)
    fb = b.packed.view(torch.float4_e2m1fn_x2)
    sa = _to_blocked(a.scales).view(torch.float8_e8m0fnu)
    sb = _to_blocked(b.scales).view(torch.float8_e8m0fnu)
    return torch._scaled_mm(fa, fb.t(), sa, sb, out_dtype=out_dtype)


def _refused_padding(err: RuntimeError, a: QuantOut, b: QuantOut) -> None:
    """A readable error where ``_scaled_mm`` refused a carrier GEMM for the setting ``carrier_k``: torch 2.11's
    blockwise FP8 GEMM takes 128x128 B scale groups only when K/128 is a multiple of 4 (measured on an H200,
    2026-11-29, ``tools/carrier_k_probe.py``; 1x128 B groups took every multiple of 128, exactly)."""
    kg = a.carrier.shape[1] // 128
    if b.group_rows == 128 and kg % 4 and "scal" in str(err).lower():
        raise UserError(
            f"carrier_k={_settings.current().carrier_k}: torch {torch.__version__}'s blockwise FP8 GEMM refused "
            f"128x128 weight scale groups at K = {128 * kg} (it needs K/128 to be a multiple of 4 there); set "
            f"carrier_k=512 (MXTRAIN_CARRIER_K=512), the default") from err


def mx_gemm_nt(a: QuantOut, b: QuantOut, backend: str, out_dtype=torch.float32,
               divisor: float = 1.0) -> torch.Tensor:
    """``(A B^T) / divisor`` of two MX operands, shape (a.R, b.R), in ``out_dtype``.

    ``fp8_carrier`` accumulates in fp32 and writes bf16 (the divisor is folded into A's group
    scales, applied to the fp32 accumulator); the other paths accumulate in fp32 and divide the
    float32 result before the one rounding to ``out_dtype``.
    """
    Ra, Rb = a.R, b.R
    if backend == "fp8_carrier":
        odt = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
        try:
            out = _scaled_mm(a, b, odt, 1.0 / divisor)
        except RuntimeError as e:
            _refused_padding(e, a, b)
            if odt == torch.bfloat16:
                raise
            out = _scaled_mm(a, b, torch.bfloat16, 1.0 / divisor)
        if out.shape[0] != Ra or out.shape[1] != Rb:
            out = out[:Ra, :Rb]
        return out if out.dtype == out_dtype else out.to(out_dtype)
    if (backend == "native_mx" or backend == "dot_scaled") and a.fmt == b.fmt == "mxfp4":
        # (FP4 tensor cores and tl.dot_scaled multiply E2M1 codes: other grids, ``mxint4``, are dequantized)
        plan = native_plan(a.packed.device) if backend == "native_mx" else "dot_scaled"
        if plan == "scaled_mm":
            out = _native_mx(a, b, torch.bfloat16)[:Ra, :Rb].float()
            return (out / divisor if divisor != 1.0 else out).to(out_dtype)
        if plan == "dot_scaled":
            odt = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.float32
            return _dot_scaled(a, b, odt, divisor).to(out_dtype)
    if a.packed is not None:
        va, vb = dequantize_fp4(a), dequantize_fp4(b)
    else:
        va, vb = carrier_values(a), carrier_values(b)
        Kmin = min(va.shape[1], vb.shape[1])
        va, vb = va[:, :Kmin], vb[:, :Kmin]
    return _dequant_mm(va[:Ra], vb[:Rb], divisor).to(out_dtype)
