"""The reference MX linear layer (the spec): Fprop, Dgrad and Wgrad over operands quantized by
``context.Ctx``, as a backend of the layer's one skeleton (``RefBackend``, ``mxtrain.linear.skeleton``), run by an
autograd function for eager calls (``apply``) and by the functions the custom ops call (``ref_forward``,
``ref_backward``). The package docstring (``mxtrain.linear``) states the
GEMMs; per-tensor FP8 GEMMs on FP8 tensor cores go through ``tensorfp8``; NVFP4 operands under autocast
are multiplied without their tensor scales (``factors_nvfp4``)."""

from __future__ import annotations

import torch

from . import skeleton, tensorfp8
from .context import Ctx, autocast_dtype, bf16_exact, gemm_dtype
from .skeleton import DGRAD, FPROP, WGRAD, Backend, Gemm
from ..numerics.formats import get_format
from ..numerics.operand import compute_dtype
from ..numerics.recipe import Recipe

__all__ = ["RefBackend", "ref_forward", "ref_backward", "apply", "keeps_fp8_x", "factors_nvfp4"]


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


_AX = {1: -1, 0: 0}   # (the skeleton's reduction axis as the reference names it: the last axis is -1)


class RefBackend(Backend):
    """The reference's GEMMs (``skeleton.Backend``): each GEMM on FP8 tensor cores where both operands are
    per-tensor FP8 (``tensorfp8``), with NVFP4's tensor scales factored out under autocast (``factors_nvfp4``), else
    over operands fake-quantized by ``Ctx.operand``, multiplied in ``context.gemm_dtype`` and divided by the
    prescales in ``acc`` (float32, float64 for float64 inputs). Where Fprop and Wgrad both run on FP8 tensor cores
    with the same codes of X (``keeps_fp8_x``), X's codes are made once and kept for the backward instead of X
    (``kept``: (codes, scale, prescale)); likewise dY's codes for Dgrad and Wgrad."""

    def __init__(self, qctx: Ctx, amp: torch.dtype | None, x_dtype: torch.dtype, weight: torch.Tensor,
                 kept: tuple | None = None):
        self.qctx, self.amp, self.r = qctx, amp, qctx.recipe
        self.acc = torch.float64 if torch.float64 in (x_dtype, weight.dtype) else torch.float32
        self.kept = kept
        self.codes = {}      # operand name -> FP8 codes made before its GEMM (tensorfp8.codes' tuple)

    def _fp8(self, g: Gemm, dims, device) -> bool:
        return _fp8_mm(self.r, g.a, g.b, g.name, self.acc, *dims, device)

    def start_forward(self, x2, weight, need_wgrad):
        if need_wgrad and keeps_fp8_x(self.r, x2, weight):
            self.kept = self.codes["fprop_x"] = tensorfp8.codes(self.qctx, x2, -1, "fprop_x")

    def start_backward(self, dy2, weight, need):
        M, N, K = dy2.shape[0], dy2.shape[1], weight.shape[1]
        self.fp8 = {"dgrad": need[0] and self._fp8(DGRAD, (M, K, N), dy2.device),
                    "wgrad": need[1] and self._fp8(WGRAD, (N, K, M), dy2.device)}
        if self.fp8["dgrad"] and self.fp8["wgrad"] and tensorfp8.shares_codes(self.r, "dgrad_dy", "wgrad_dy"):
            c = tensorfp8.codes(self.qctx, dy2, -1, "dgrad_dy")   # (dY's codes once for both GEMMs)
            self.codes["dgrad_dy"], self.codes["wgrad_dy"] = c, tensorfp8.reorient(c, 0)
        if self.kept is not None:
            self.codes["wgrad_x"] = tensorfp8.reorient(self.kept, 0)
        return dy2

    def gemm(self, g, a, b, final, dims):
        r, amp, cdt, dev = self.r, self.amp, self.acc, a.device
        fp8 = self.fp8[g.name] if g.name != "fprop" else (g.a in self.codes or self._fp8(g, dims, dev))
        wio = None
        if g is WGRAD:   # (dW rounded to the autocast dtype first: setting fp8_autocast)
            wio = tensorfp8.autocast_io(r, amp)
            final = wio or final
        if fp8:
            y = tensorfp8.scaled_mm(self.qctx, a, _AX[g.a_axis], g.a, b, _AX[g.b_axis], g.b, cdt,
                                    a_codes=self.codes.get(g.a), b_codes=self.codes.get(g.b),
                                    final_dtype=wio if g is WGRAD else final,
                                    fast_accum=tensorfp8.fast_accum_fprop() if g is FPROP else False)
            return y.to(final) if g is WGRAD else y
        if factors_nvfp4(r, g.a, g.b, g.name, amp, cdt):
            return _factored_gemm(self.qctx, g.name, (a, _AX[g.a_axis], g.a, g.a_axis == 0),
                                  (b, _AX[g.b_axis], g.b, g.b_axis == 1), amp, cdt, dev)
        gd = gemm_dtype(r, g.a, g.b, g.name, amp, cdt)
        s = self.qctx.signs(g.name, dev)
        aq, pa = self.qctx.operand(a, _AX[g.a_axis], g.a, g.name, s, out_dtype=gd)
        bq, pb = self.qctx.operand(b, _AX[g.b_axis], g.b, g.name, s, out_dtype=gd)
        aq, bq = aq.to(gd), bq.to(gd)
        y = torch.matmul(aq if g.a_axis == 1 else aq.t(), bq.t() if g.b_axis == 1 else bq)
        if not (pa * pb == 1.0 and gd == final):   # (else: cast to acc and back, identity)
            y = y.to(cdt)
        if pa * pb != 1.0:
            y = y / (pa * pb)
        return y.to(final) if g is WGRAD else y

    def save(self, ctx, x, weight):
        if self.kept is not None:   # (X's FP8 codes and scale, with the tensors the autograd engine keeps)
            codes, scale, prescale = self.kept
            ctx.save_for_backward(None, weight, codes, scale)
            ctx.x_prescale = prescale
        else:
            ctx.save_for_backward(x, weight, None, None)

    @staticmethod
    def restore(ctx):
        x, weight, codes, scale = ctx.saved_tensors
        return x, weight, ((codes, scale, ctx.x_prescale) if codes is not None else None)


def ref_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: Ctx,
                amp: torch.dtype | None, keep_x: bool = False):
    """The layer output (``skeleton.forward`` over ``RefBackend``); with ``keep_x`` (``keeps_fp8_x`` true),
    ``(output, X's FP8 codes tuple)``."""
    be = RefBackend(qctx, amp, x.dtype, weight)
    y = skeleton.forward(be, x, weight, bias, amp if amp is not None else x.dtype, keep_x)
    return (y, be.kept) if keep_x else y


def ref_backward(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, qctx: Ctx,
                 amp: torch.dtype | None, need: tuple[bool, bool, bool], x_codes: tuple | None = None,
                 x_dtype: torch.dtype | None = None) -> tuple:
    """(dX, dW, db) of the reference (``skeleton.backward`` over ``RefBackend``); an entry is None where ``need``
    says False. ``x_codes``: X's FP8 codes kept by the forward (``ref_forward(keep_x=True)``) in place of ``x``
    (then None; ``x_dtype`` its dtype)."""
    xdt = x.dtype if x is not None else x_dtype
    be = RefBackend(qctx, amp, xdt, weight, kept=x_codes)
    return skeleton.backward(be, dy, x, weight, xdt, need)


def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: Ctx, amp="auto") -> torch.Tensor:
    """The reference as an autograd function for eager calls (``skeleton.EagerLinear`` over ``RefBackend``).
    ``amp``: the autocast dtype, or "auto" to read it from the autocast state at the call."""
    if amp == "auto":
        amp = autocast_dtype(x.device.type)

    def make(x_dtype, w, kept, where=None):
        return RefBackend(qctx, amp, x_dtype, w, kept)

    return skeleton.EagerLinear.apply(x, weight, bias, make, amp if amp is not None else x.dtype,
                                      torch.is_grad_enabled())


def _fp8_mm(recipe: Recipe, a: str, b: str, gemm: str, cdt: torch.dtype, *dims_and_device) -> bool:
    """Does this reference GEMM run on FP8 tensor cores (``mxtrain.linear.tensorfp8``: per-tensor FP8 operands on
    a CUDA GPU, float32 compute)?"""
    *dims, device = dims_and_device
    return cdt == torch.float32 and tensorfp8.applies(recipe, a, b, gemm, *dims, device=device)


