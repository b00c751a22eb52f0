"""The ``fp8`` recipe's linear layer as traced PyTorch operations, for ``torch.compile``.

Under ``torch.compile`` every other recipe's layer is an opaque custom op (``mxtrain::linear``): the compiler
cannot fuse its quantizers into the kernels around it, and whatever the op keeps for its backward has to be
stored. For per-tensor FP8 that costs the speed race against torchao's float8, whose casts are ordinary traced
operations that the compiler fuses into the neighbouring norm, activation and residual kernels and recomputes
in the backward instead of storing. This module gives the ``fp8`` recipe (every operand per-tensor E4M3/E5M2,
round-to-nearest, no prescale, no rotation, all three GEMMs on FP8 tensor cores) the same form: an autograd
function made of traced operations (amax reduction, multiplication, saturation, cast to the FP8 dtype) around
``torch._scaled_mm`` (the layer's skeleton, ``mxtrain.linear.skeleton``, over ``_FP8Backend``). It keeps X and W for
the backward (the compiler decides what to store or recompute) and
quantizes them again there.

The numbers are the reference's, bit for bit: ``cast`` computes ``mxtrain.numerics.quant.quantize``'s per-tensor FP8
codes and scale (``quant.tensor_fp8_scales``: TransformerEngine's and torchao's definition, each element
multiplied in float32 by ``max_elem / amax``, the codes dequantized with its reciprocal; the two 0-d quotients
through float64, so that the compiler's approximate float32 division on GPUs never enters). The GEMM calls are
those of the reference's FP8 route (``tensorfp8.scaled_mm``): same codes, same scales, same output dtypes.

Used by ``linear.compiled_linear`` when ``applies`` (setting ``fp8_traced``: ``auto``, the default, or ``off``
for the custom op). Eagerly the custom-op path runs (its Triton cast kernel is faster than unfused operations).
"""

from __future__ import annotations

import torch

from . import skeleton, tensorfp8
from .skeleton import DGRAD, FPROP, Backend
from ._constant import assume_constant_result
from ..numerics.formats import get_format
from ..numerics.quant import tensor_fp8_scales
from .tensorfp8 import FP8_DTYPES as _DT
from .tensorfp8 import spec

__all__ = ["spec", "applies", "cast", "linear"]


def applies(fmts: tuple | None, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the traced form run this call? ``fmts`` from ``spec``; float16/bfloat16/float32 tensors on a device
    with FP8 tensor cores (``tensorfp8``); every GEMM dimension a multiple of 16 (``torch._scaled_mm``). Whether
    to ask (the settings ``fp8_traced`` and ``fast``) is the dispatcher's (``linear.compiled_form``)."""
    if fmts is None:
        return False
    ok = (torch.float32, torch.bfloat16, torch.float16)
    if x.dtype not in ok or weight.dtype not in ok:
        return False
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // max(K, 1)
    if M == 0 or any(d % 16 for d in (M, N, K)):
        return False
    return _capable(str(x.device))


@assume_constant_result
def _capable(device: str) -> bool:
    return tensorfp8._fp8_capable(torch.device(device))


def cast(t: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes in ``t``'s shape, float32 0-d scale): ``mxtrain.numerics.quant.quantize(t, fmt)``'s per-tensor FP8
    with nearest rounding, in traced operations: the multiplier ``m = max_elem / amax`` and the scale ``1 / m``
    of ``quant.tensor_fp8_scales`` (``m = 1`` for an all-zero tensor; both NaN when an element is not finite,
    and then every code +0); each element ``t * m`` in float32, saturated to +-max_elem, rounded half to even
    by the cast to the FP8 dtype (negative values that round to zero keep their sign)."""
    mx = get_format(fmt).elem.max
    m, scale = tensor_fp8_scales(torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32), mx)
    v = t.to(torch.float32) * m
    v = torch.where(torch.isfinite(m), v, torch.zeros_like(v))
    return v.clamp(-mx, mx).to(_DT[fmt]), scale


def _mm(a, sa, b_t, sb, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``a @ b_t.t()`` of FP8 codes (``a`` (M, R) and ``b_t`` (N, R), both row-major) times the scales in
    ``out_dtype``: the reference's own call, ``tensorfp8.scaled_mm`` with the codes given (the GEMM writes
    bf16/fp16 itself, else float32; ``fast_accum`` as there)."""
    return tensorfp8.scaled_mm(None, None, -1, "", None, -1, "", out_dtype, a_codes=(a, sa, 1.0),
                               b_codes=(b_t, sb, 1.0), final_dtype=out_dtype, fast_accum=fast_accum)


class _FP8Backend(Backend):
    """The traced per-tensor FP8 GEMMs (``skeleton.Backend``): each operand ``cast`` in traced operations, the
    product by ``_mm``; dY cast once where its two operands share the format. dW comes in ``wgrad_dtype``."""

    def __init__(self, fmts: tuple, wgrad_dtype: torch.dtype):
        self.fmts, self.wgrad_dtype = fmts, wgrad_dtype

    def start_backward(self, dy2, weight, need):
        if need[0] or need[1]:
            self.cdy = cast(dy2, self.fmts[2])
        return dy2

    def gemm(self, g, a, b, final, dims):
        f = self.fmts
        if g is FPROP:
            cx, sx = cast(a, f[0])
            cw, sw = cast(b, f[1])
            return _mm(cx, sx, cw, sw, final if final is not None else torch.float32, tensorfp8.fast_accum_fprop())
        cdy, sdy = self.cdy
        if g is DGRAD:
            cw, sw = cast(b, f[3])
            return _mm(cdy, sdy, cw.t().contiguous(), sw, final)
        cdw, sdw = (cdy, sdy) if f[4] == f[2] else cast(a, f[4])
        cx, sx = cast(b, f[5])
        return _mm(cdw.t().contiguous(), sdw, cx.t().contiguous(), sx, self.wgrad_dtype)


class _TracedFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fmts, out_dtype, wgrad_dtype):
        ctx.save_for_backward(x, weight)
        ctx.fmts, ctx.has_bias, ctx.wgrad_dtype = fmts, bias is not None, wgrad_dtype
        return skeleton.forward(_FP8Backend(fmts, wgrad_dtype), x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        n = ctx.needs_input_grad
        dx, dw, db = skeleton.backward(_FP8Backend(ctx.fmts, ctx.wgrad_dtype), dy, x, weight, x.dtype,
                                       (n[0], n[1], ctx.has_bias and n[2]))
        return dx, dw, db, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmts: tuple) -> torch.Tensor:
    """``x @ weight.T + bias`` with the ``fp8`` recipe's GEMMs (``spec`` gave ``fmts``), in the autocast
    dtype where autocast is on (as the reference); dW in float32, or in the autocast dtype with the setting
    ``fp8_autocast=autocast`` (whose input cast the caller made: ``linear.compiled_linear``)."""
    dt = x.device.type
    amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
    out_dtype = amp if amp is not None else x.dtype
    wgrad_dtype = tensorfp8.autocast_io_dtype(amp) or torch.float32
    return _TracedFP8Linear.apply(x, weight, bias, fmts, out_dtype, wgrad_dtype)
