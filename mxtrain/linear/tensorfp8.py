"""Per-tensor FP8 GEMMs on FP8 tensor cores (the ``fp8`` recipe's GEMMs on a CUDA GPU).

The reference path quantizes each operand with ``mxtrain.numerics.quant.quantize`` (per-tensor current scaling:
elements times ``max_elem / amax``, codes dequantized with the reciprocal ``scale``), dequantizes it to
float32 and multiplies in float32. Where both operands of a GEMM are per-tensor FP8 (E4M3 or E5M2, not both
E5M2), not rotated, on a CUDA device with FP8 tensor cores (sm_89 and later), ``scaled_mm`` multiplies the same FP8 codes with ``torch._scaled_mm``
instead: the products of the codes accumulated in float32, then multiplied by the two scales. The
operands are the reference's, bit for bit; the result differs from the reference's only by float32
rounding (the reference rounds each dequantized operand ``code * scale`` to float32 before multiplying,
``_scaled_mm`` applies the scales to the accumulated sum) and by the accumulation order. That makes the
``fp8`` recipe train at FP8 tensor-core speed on Hopper instead of through float32 GEMMs. Per-tensor
codes do not depend on the axis, so where two operands of one tensor share format, prescale and
round-to-nearest (``shares_codes``) it is quantized once: the ``fp8`` recipe's X for Fprop and Wgrad (the
forward keeps X's FP8 codes for the backward instead of X: ``linear.keeps_fp8_x``) and dY for Dgrad and Wgrad.
"""

from __future__ import annotations

import torch

from .context import Ctx
from ..numerics.recipe import Recipe
from .. import settings

__all__ = ["FP8_DTYPES", "applies", "codes", "scaled_mm", "shares_codes", "reorient", "fast_accum_fprop",
           "autocast_io", "autocast_io_dtype", "spec"]

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}   # format -> its codes' dtype
_OPS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")


def spec(recipe: Recipe) -> tuple[str, ...] | None:
    """The six operand formats (``fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_dy, wgrad_x``) where ``recipe``
    is one the traced form (``tracedfp8``, which re-exports this as ``tracedfp8.spec``) runs: every operand
    per-tensor FP8 with round-to-nearest and prescale 1, no rotation, no GEMM of two E5M2 operands; else None.
    Depends on the recipe only."""
    ops = [recipe.operand(n) for n in _OPS]
    if any(op.fmt not in FP8_DTYPES or op.rounding != "nearest" or op.prescale != 1.0 for op in ops):
        return None
    if any(recipe.rotation(g).enabled for g in ("fprop", "dgrad", "wgrad")):
        return None
    fmts = tuple(op.fmt for op in ops)
    if any(fmts[i] == fmts[i + 1] == "fp8_e5m2" for i in (0, 2, 4)):
        return None
    return fmts


def _fp8_capable(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(idx) >= (8, 9)


def applies(recipe: Recipe, a_name: str, b_name: str, gemm: str, *dims: int, device) -> bool:
    """Can this GEMM of ``recipe`` (operands ``a_name``, ``b_name``; ``dims``: M, N and the reduction
    length) run as ``scaled_mm``?"""
    fa, fb = recipe.operand(a_name).fmt, recipe.operand(b_name).fmt
    if fa not in FP8_DTYPES or fb not in FP8_DTYPES or (fa == "fp8_e5m2" and fb == "fp8_e5m2"):
        return False
    if recipe.rotation(gemm).enabled or any(d % 16 for d in dims):
        return False
    return _fp8_capable(torch.device(device))


def fast_accum_fprop() -> bool:
    """Does the forward GEMM accumulate in the FP8 tensor cores' fast mode (setting ``fp8_fast_accum``:
    ``fprop``, TransformerEngine's and torchao's default)? Dgrad and Wgrad always accumulate in float32."""
    return settings.current().fp8_fast_accum == "fprop"


def autocast_io_dtype(amp: torch.dtype | None) -> torch.dtype | None:
    """The dtype a per-tensor FP8 layer's input is cast to, and its dW written in, under autocast ``amp`` (None:
    autocast off): ``amp`` where the setting ``fp8_autocast`` says ``autocast`` (as ``nn.Linear`` and torchao's
    float8 do) and ``amp`` is a 16-bit dtype; None: neither (the input quantized as given, float32 gradients to
    float32 tensors). The one place this rule is decided (``autocast_io``, ``linear._fp8_input``,
    ``tracedfp8.linear``)."""
    if amp is None or amp == torch.float32 or settings.current().fp8_autocast != "autocast":
        return None
    return amp


def autocast_io(recipe: Recipe, amp: torch.dtype | None) -> torch.dtype | None:
    """``autocast_io_dtype(amp)`` for a recipe that ``spec`` takes (every operand per-tensor FP8,
    nearest, no prescale or rotation), None for every other recipe."""
    io = autocast_io_dtype(amp)
    return io if io is not None and recipe.memo("tracedfp8_spec", spec) is not None else None


def codes(qctx: Ctx, t: torch.Tensor, axis: int, name: str):
    """(FP8 codes with the reduction axis last, contiguous; float32 scale; prescale): the reference's
    quantization of the 2-D ``t`` along ``axis`` (nearest rounding: the two-pass kernel,
    ``kernels.fp8cast``, bit for bit)."""
    op = qctx.recipe.operand(name)
    if op.rounding == "nearest" and _cast_kernel_runs(t.device):
        from ..kernels.fp8cast import quantize_tensor_fp8  # startup
        codes, scale = quantize_tensor_fp8(t, op.fmt, op.prescale)
        return (codes if axis in (-1, 1) else codes.t().contiguous()), scale, op.prescale
    mx = qctx.quantize(t, axis, name)
    return mx.data.contiguous(), mx.scales.to(torch.float32).reshape(()), mx.prescale


def shares_codes(recipe: Recipe, a_name: str, b_name: str) -> bool:
    """Do operands ``a_name`` and ``b_name`` of one tensor get the same FP8 codes and scale? Per-tensor
    scaling does not depend on the axis, so with the same format and prescale and round-to-nearest (a
    stochastic stream is drawn per operand) the two quantizations are one."""
    a, b = recipe.operand(a_name), recipe.operand(b_name)
    return (a.fmt == b.fmt and a.fmt in FP8_DTYPES and a.rounding == b.rounding == "nearest"
            and a.prescale == b.prescale)


def reorient(q: tuple, axis: int) -> tuple:
    """``codes``'s result for reduction ``axis`` from the same tensor's codes made along -1 (or 1)."""
    codes, scale, prescale = q
    return (codes if axis in (-1, 1) else codes.t().contiguous()), scale, prescale


def _cast_kernel_runs(device: torch.device) -> bool:
    from ..kernels import kernels_available  # startup
    return kernels_available(device)


def scaled_mm(qctx: Ctx, a: torch.Tensor, a_axis: int, a_name: str, b: torch.Tensor, b_axis: int, b_name: str,
              out_dtype: torch.dtype, a_codes: tuple | None = None, b_codes: tuple | None = None,
              final_dtype: torch.dtype | None = None, fast_accum: bool = False) -> torch.Tensor:
    """``op(a) @ op(b)^T`` for 2-D ``a`` and ``b`` quantized along ``a_axis`` / ``b_axis`` (-1 or 1: the
    GEMM reduces along the tensor's columns, the stored layout; 0: along its rows, the tensor is used
    transposed), divided by the two prescales, in ``out_dtype``. ``a_codes``: ``a``'s quantization along
    ``a_axis`` made already (``shares_codes``); ``b_codes`` likewise for ``b``. ``final_dtype``: the dtype
    the caller casts the result to next (bf16/fp16 under autocast); where no prescale divides the product,
    the GEMM writes it directly (its float32 accumulator scaled and rounded once, as the cast would) instead
    of a float32 output and a cast pass over it. ``fast_accum``: the tensor cores' fast accumulation
    (``fast_accum_fprop``), else float32."""
    A, sa, pa = a_codes if a_codes is not None else codes(qctx, a, a_axis, a_name)   # (M, R) row-major
    Bt, sb, pb = b_codes if b_codes is not None else codes(qctx, b, b_axis, b_name)  # (N, R): Bt.t() col-major
    if final_dtype in (torch.bfloat16, torch.float16) and pa * pb == 1.0:
        return torch._scaled_mm(A, Bt.t(), scale_a=sa, scale_b=sb, out_dtype=final_dtype, use_fast_accum=fast_accum)
    y = torch._scaled_mm(A, Bt.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=fast_accum)
    if pa * pb != 1.0:
        y = y / (pa * pb)
    return y.to(out_dtype)
