"""The reference operand: what one GEMM operand of a linear layer is, as values (the numerics, layer 1).

``fake_quantize_operand`` is the definition every quantize kernel is checked against (``kernels.mxelem``,
``kernels.nvfp4``, the MXFP4 kernels' tests): rotate, quantize and dequantize one operand with the reference
quantizer (``mxtrain.numerics.quant``). ``compute_dtype`` and ``pad_axis`` are the two helpers it and the kernels share.
Imports only the numerics below it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .hadamard import hadamard
from .quant import quantize

__all__ = ["compute_dtype", "pad_axis", "fake_quantize_operand"]


def compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (gradcheck), else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def pad_axis(t: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    """``t`` with zeros appended along ``axis`` up to a multiple of ``multiple``."""
    n = t.shape[axis]
    pad = (-n) % multiple
    if not pad:
        return t
    axis = axis % t.ndim
    return F.pad(t, [0, 0] * (t.ndim - 1 - axis) + [0, pad])


def fake_quantize_operand(t: torch.Tensor, signs: torch.Tensor | None, key, axis: int, rot: int, fmt: str,
                          block_size, rounding: str, scale_rule: str, prescale: float, factored: bool = False):
    """``Ctx.operand``'s values: ``t`` in float32 (float64 stays float64), rotated along ``axis`` by
    ``rot``-element Hadamard blocks (0: none) after zero-padding the axis, quantized and dequantized
    (prescale not undone). A pure function of tensors (``t``, ``signs``, ``key``: None, an int or an int64
    0-d tensor) and constants, so that ``torch.compile`` makes one graph per operand spec and shape, never
    one per step, call or layer (those enter through ``key`` and ``signs`` only)."""
    r = t.to(compute_dtype(t))
    if rot:
        r = hadamard(pad_axis(r, axis, rot), rot, axis=axis, signs=signs)
    mx = quantize(r, fmt, axis=axis, block_size=block_size, rounding=rounding, scale_rule=scale_rule, key=key,
                  prescale=prescale)
    if factored:   # NVFP4 without its tensor scale, and that scale (``MXTensor.dequantize_factored``)
        v, g = mx.dequantize_factored()
        return v.to(r.dtype), g
    return mx.dequantize(torch.float32).to(r.dtype)
