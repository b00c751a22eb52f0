"""The ``fp8`` recipe's linear layer as traced PyTorch operations, for ``torch.compile``.

Under ``torch.compile`` every other recipe's layer is an opaque custom op (``mxtrain::linear``): the compiler
cannot fuse its quantizers into the kernels around it, and whatever the op keeps for its backward has to be
stored. For per-tensor FP8 that costs the speed race against torchao's float8, whose casts are ordinary traced
operations that the compiler fuses into the neighbouring norm, activation and residual kernels and recomputes
in the backward instead of storing. This module gives the ``fp8`` recipe (every operand per-tensor E4M3/E5M2,
round-to-nearest, no prescale, no rotation, all three GEMMs on FP8 tensor cores) the same form: an autograd
function made of traced operations (amax reduction, multiplication, saturation, cast to the FP8 dtype) around
``torch._scaled_mm``. It keeps X and W for the backward (the compiler decides what to store or recompute) and
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

from . import tensorfp8
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


class _TracedFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fmts, out_dtype, wgrad_dtype):
        ctx.save_for_backward(x, weight)
        ctx.fmts, ctx.has_bias, ctx.wgrad_dtype = fmts, bias is not None, wgrad_dtype
        K, N = x.shape[-1], weight.shape[0]
        fa = tensorfp8.fast_accum_fprop()
        with torch.autocast(x.device.type, enabled=False):
            cx, sx = cast(x.reshape(-1, K), fmts[0])
            cw, sw = cast(weight, fmts[1])
            if bias is None:
                y = _mm(cx, sx, cw, sw, out_dtype, fa)
            else:
                y = (_mm(cx, sx, cw, sw, torch.float32, fa) + bias.to(torch.float32)).to(out_dtype)
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        f = ctx.fmts
        n = ctx.needs_input_grad
        dx = dw = db = None
        K, N = x.shape[-1], weight.shape[0]
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, N)
            if n[0] or n[1]:
                cdy, sdy = cast(dy2, f[2])
            if n[0]:
                cw, sw = cast(weight, f[3])
                dx = _mm(cdy, sdy, cw.t().contiguous(), sw, x.dtype).reshape(x.shape)
            if n[1]:
                cdw, sdw = (cdy, sdy) if f[4] == f[2] else cast(dy2, f[4])
                cx, sx = cast(x.reshape(-1, K), f[5])
                dw = _mm(cdw.t().contiguous(), sdw, cx.t().contiguous(), sx, ctx.wgrad_dtype).to(weight.dtype)
            if ctx.has_bias and n[2]:
                db = dy2.to(torch.float32).sum(0).to(weight.dtype)
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
