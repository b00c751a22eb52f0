"""The reference MX linear layer (the spec): Fprop, Dgrad and Wgrad over operands quantized by
``context.Ctx``, as an autograd function for eager calls (``_MXLinearFunction``) and as the functions the
custom ops call (``ref_forward``, ``ref_backward``). The package docstring (``mxtrain.linear``) states the
GEMMs; per-tensor FP8 GEMMs on FP8 tensor cores go through ``tensorfp8``; NVFP4 operands under autocast
are multiplied without their tensor scales (``factors_nvfp4``)."""

from __future__ import annotations

import torch

from .. import settings
from . import tensorfp8
from .context import Ctx, autocast_dtype, bf16_exact, gemm_dtype
from ..numerics.formats import get_format
from ..numerics.operand import compute_dtype
from ..numerics.recipe import Recipe

__all__ = ["ref_forward", "ref_backward", "keeps_fp8_x", "factors_nvfp4"]


def factors_nvfp4(recipe: Recipe, a: str, b: str, gemm: str, amp: torch.dtype | None,
                  cdt: torch.dtype = torch.float32) -> bool:
    """Does this GEMM multiply NVFP4 operands without their tensor scales (``Ctx.operand_factored``), in the
    autocast dtype where both operands are then exact, and scale the product by the tensor scales after? (The
    NVFP4 values before any rounding, as block-scaled hardware multiplies them; BF16 tensor cores instead of
    a float32 GEMM.) Not for float64 computations (``gradcheck``), which stay float64."""
    if amp is None or cdt != torch.float32:
        return False
    rot = recipe.rotation(gemm)
    ops = (recipe.operand(a), recipe.operand(b))
    nv = [op.quantized and get_format(op.fmt).kind == "nvfp4" for op in ops]
    return any(nv) and all(n or bf16_exact(op, rot) for n, op in zip(nv, ops))


def _mm_f32(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``a @ b`` of values exact in ``dt`` with float32 products and sums, as a float32 tensor: tensor cores
    with a float32 result on GPUs, a float32 GEMM elsewhere (the products of values exact in bf16 are exact
    in float32 either way)."""
    if a.is_cuda and _mm_out_dtype_ok(a.device):
        return torch.mm(a.to(dt), b.to(dt), out_dtype=torch.float32)
    return torch.mm(a.to(torch.float32), b.to(torch.float32))


def _mm_out_dtype_ok(device) -> bool:
    """Can this device's ``torch.mm`` return float32 from bf16 operands (``out_dtype``)? Probed once per
    device (kept in ``mxtrain.kernels.CACHES.probes``)."""
    from ..kernels.caches import CACHES  # startup
    key = f"mm_out_dtype:{device}"
    ok = CACHES.probes.get(key)
    if ok is None:
        try:
            one = torch.ones((16, 16), dtype=torch.bfloat16, device=device)
            ok = bool(torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        CACHES.probes[key] = ok
    return ok


def _factored_gemm(qctx: Ctx, gemm: str, a, b, amp: torch.dtype, cdt: torch.dtype, device) -> torch.Tensor:
    """``A @ B`` of two operands ``(tensor, axis, name, transpose)`` quantized with NVFP4 tensor scales taken
    out (``factors_nvfp4``): float32 accumulation, then times the tensor scales, divided by the prescales."""
    s = qctx.signs(gemm, device)
    av, pa, ga = qctx.operand_factored(a[0], a[1], a[2], gemm, s, out_dtype=amp)
    bv, pb, gb = qctx.operand_factored(b[0], b[1], b[2], gemm, s, out_dtype=amp)
    y = _mm_f32(av.t() if a[3] else av, bv.t() if b[3] else bv, amp)
    g = ga if gb is None else (gb if ga is None else ga * gb)
    if g is not None:
        y = y * g
    y = y.to(cdt)
    if pa * pb != 1.0:
        y = y / (pa * pb)
    return y


def keeps_fp8_x(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does the reference keep X's FP8 codes for the backward instead of X (``ref_forward(keep_x=True)``)?
    Where Fprop and Wgrad both run on FP8 tensor cores and X's codes are the same for both
    (``tensorfp8.shares_codes``): one quantization of X, 1 byte an element kept instead of 2 or 4.
    Works on fake tensors."""
    M, K, N = x.numel() // max(x.shape[-1], 1), x.shape[-1], weight.shape[0]
    cdt = compute_dtype(x, weight)
    return (M > 0 and tensorfp8.shares_codes(recipe, "fprop_x", "wgrad_x")
            and _fp8_mm(recipe, "fprop_x", "fprop_w", "fprop", cdt, M, N, K, x.device)
            and _fp8_mm(recipe, "wgrad_dy", "wgrad_x", "wgrad", cdt, N, K, M, x.device))


def ref_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: Ctx,
                amp: torch.dtype | None, keep_x: bool = False):
    """The layer output; with ``keep_x`` (``keeps_fp8_x`` true), ``(output, X's FP8 codes tuple)``."""
    out_dtype = amp if amp is not None else x.dtype
    r = qctx.recipe
    cdt = compute_dtype(x, weight)  # float32, or float64 for float64 inputs
    gd = gemm_dtype(r, "fprop_x", "fprop_w", "fprop", amp, cdt)
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    xc = None
    with torch.autocast(x.device.type, enabled=False):
        fin = out_dtype if bias is None else None   # (the GEMM may write the output dtype itself)
        if keep_x:
            xc = tensorfp8.codes(qctx, x2, -1, "fprop_x")
            y = tensorfp8.scaled_mm(qctx, x2, -1, "fprop_x", weight, -1, "fprop_w", cdt, a_codes=xc, final_dtype=fin,
                                    fast_accum=tensorfp8.fast_accum_fprop())
        elif _fp8_mm(r, "fprop_x", "fprop_w", "fprop", cdt, x2.shape[0], weight.shape[0], x2.shape[1], x.device):
            y = tensorfp8.scaled_mm(qctx, x2, -1, "fprop_x", weight, -1, "fprop_w", cdt, final_dtype=fin,
                                    fast_accum=tensorfp8.fast_accum_fprop())
        elif factors_nvfp4(r, "fprop_x", "fprop_w", "fprop", amp, cdt):
            y = _factored_gemm(qctx, "fprop", (x2, -1, "fprop_x", False), (weight, -1, "fprop_w", True), amp, cdt,
                               x.device)
        else:
            s = qctx.signs("fprop", x.device)
            xq, px = qctx.operand(x2, -1, "fprop_x", "fprop", s, out_dtype=gd)
            wq, pw = qctx.operand(weight, -1, "fprop_w", "fprop", s, out_dtype=gd)
            y = torch.matmul(xq.to(gd), wq.to(gd).t())
            if not (px * pw == 1.0 and bias is None and gd == out_dtype):   # (else: cast to cdt and back, identity)
                y = y.to(cdt)
            if px * pw != 1.0:
                y = y / (px * pw)
        if bias is not None:
            y = y + bias.to(cdt)
    y = y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])
    return (y, xc) if keep_x else y


def ref_backward(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, qctx: Ctx,
                 amp: torch.dtype | None, need: tuple[bool, bool, bool], x_codes: tuple | None = None,
                 x_dtype: torch.dtype | None = None) -> tuple:
    """(dX, dW, db) of the reference; an entry is None where ``need`` says False. ``x_codes``: X's FP8 codes
    kept by the forward (``ref_forward(keep_x=True)``) in place of ``x`` (then None; ``x_dtype`` its dtype)."""
    r = qctx.recipe
    if x is None:   # (only its shape and dtype are read below: a tensor without storage stands in)
        x = torch.empty((*dy.shape[:-1], weight.shape[1]), dtype=x_dtype, device="meta")
    cdt = compute_dtype(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
    dx = dw = db = None
    with torch.autocast(dy.device.type, enabled=False):
        M, N, K = dy2.shape[0], dy2.shape[1], x2.shape[1]
        fp8_dgrad = need[0] and _fp8_mm(r, "dgrad_dy", "dgrad_w", "dgrad", cdt, M, K, N, dy.device)
        fp8_wgrad = need[1] and _fp8_mm(r, "wgrad_dy", "wgrad_x", "wgrad", cdt, N, K, M, dy.device)
        dy_codes = None   # (dY's FP8 codes, made once for both GEMMs where they are the same: shares_codes)
        if fp8_dgrad and fp8_wgrad and tensorfp8.shares_codes(r, "dgrad_dy", "wgrad_dy"):
            dy_codes = tensorfp8.codes(qctx, dy2, -1, "dgrad_dy")
        if fp8_dgrad:
            dx = tensorfp8.scaled_mm(qctx, dy2, -1, "dgrad_dy", weight, 0, "dgrad_w", cdt, a_codes=dy_codes,
                                     final_dtype=x.dtype)
            dx = dx.to(x.dtype).reshape(x.shape)
        elif need[0] and factors_nvfp4(r, "dgrad_dy", "dgrad_w", "dgrad", amp, cdt):
            dx = _factored_gemm(qctx, "dgrad", (dy2, -1, "dgrad_dy", False), (weight, 0, "dgrad_w", False), amp,
                                cdt, dy.device)
            dx = dx.to(x.dtype).reshape(x.shape)
        elif need[0]:
            gd = gemm_dtype(r, "dgrad_dy", "dgrad_w", "dgrad", amp, cdt)
            s = qctx.signs("dgrad", dy.device)
            dyq, pa = qctx.operand(dy2, -1, "dgrad_dy", "dgrad", s, out_dtype=gd)   # (M, Np)
            wq, pb = qctx.operand(weight, 0, "dgrad_w", "dgrad", s, out_dtype=gd)   # (Np, K)
            dx = torch.matmul(dyq.to(gd), wq.to(gd))
            if not (pa * pb == 1.0 and gd == x.dtype):   # (else: cast to cdt and back, identity)
                dx = dx.to(cdt)
            if pa * pb != 1.0:
                dx = dx / (pa * pb)
            dx = dx.to(x.dtype).reshape(x.shape)
        wio = tensorfp8.autocast_io(r, amp)   # (dW rounded to the autocast dtype first: fp8_autocast)
        if fp8_wgrad:
            dw = tensorfp8.scaled_mm(qctx, dy2, 0, "wgrad_dy", x2, 0, "wgrad_x", cdt,
                                     a_codes=tensorfp8.reorient(dy_codes, 0) if dy_codes is not None else None,
                                     b_codes=tensorfp8.reorient(x_codes, 0) if x_codes is not None else None,
                                     final_dtype=wio)
            dw = dw.to(wio or weight.dtype).to(weight.dtype)
        elif need[1] and factors_nvfp4(r, "wgrad_dy", "wgrad_x", "wgrad", amp, cdt):
            dw = _factored_gemm(qctx, "wgrad", (dy2, 0, "wgrad_dy", True), (x2, 0, "wgrad_x", False), amp, cdt,
                                dy.device).to(weight.dtype)
        elif need[1]:
            gd = gemm_dtype(r, "wgrad_dy", "wgrad_x", "wgrad", amp, cdt)
            s = qctx.signs("wgrad", dy.device)
            dyq, pa = qctx.operand(dy2, 0, "wgrad_dy", "wgrad", s, out_dtype=gd)    # (Mp, N)
            xq, pb = qctx.operand(x2, 0, "wgrad_x", "wgrad", s, out_dtype=gd)       # (Mp, K)
            dw = torch.matmul(dyq.to(gd).t(), xq.to(gd)).to(cdt)
            if pa * pb != 1.0:
                dw = dw / (pa * pb)
            dw = dw.to(wio or weight.dtype).to(weight.dtype)
        if need[2]:
            db = dy2.to(cdt).sum(0).to(weight.dtype)
    return dx, dw, db


def _fp8_mm(recipe: Recipe, a: str, b: str, gemm: str, cdt: torch.dtype, *dims_and_device) -> bool:
    """Does this reference GEMM run on FP8 tensor cores (``mxtrain.linear.tensorfp8``: per-tensor FP8 operands on
    a CUDA GPU, float32 compute)?"""
    *dims, device = dims_and_device
    return cdt == torch.float32 and tensorfp8.applies(recipe, a, b, gemm, *dims, device=device)


class _MXLinearFunction(torch.autograd.Function):
    """The reference as an autograd function (eager use). ``amp``: the autocast dtype, or "auto" to
    read it from the autocast state at the call."""

    @staticmethod
    def forward(ctx, x, weight, bias, qctx: Ctx, amp="auto"):
        if amp == "auto":
            amp = autocast_dtype(x.device.type)
        ctx.qctx, ctx.amp, ctx.has_bias, ctx.x_dtype = qctx, amp, bias is not None, x.dtype
        # (a Wgrad will need X's codes; the wgrad_x setting as in the compiled op: backward keeps X)
        if ctx.needs_input_grad[1] and settings.current().wgrad_x != "backward" and keeps_fp8_x(qctx.recipe, x, weight):
            y, (codes, scale, prescale) = ref_forward(x, weight, bias, qctx, amp, keep_x=True)
            ctx.save_for_backward(None, weight, codes, scale)
            ctx.x_prescale = prescale
            return y
        ctx.save_for_backward(x, weight, None, None)
        return ref_forward(x, weight, bias, qctx, amp)

    @staticmethod
    def backward(ctx, dy):
        x, weight, codes, scale = ctx.saved_tensors
        n = ctx.needs_input_grad
        xc = (codes, scale, ctx.x_prescale) if codes is not None else None
        dx, dw, db = ref_backward(dy, x, weight, ctx.qctx, ctx.amp, (n[0], n[1], ctx.has_bias and n[2]),
                                  x_codes=xc, x_dtype=ctx.x_dtype)
        return dx, dw, db, None, None
