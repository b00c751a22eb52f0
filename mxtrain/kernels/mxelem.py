"""MX fake quantization in one pass for any element format (the reference path's MX operands on a GPU:
MXFP8, MXFP6 and MXFP4 operands of recipes that the MXFP4 fast path does not run, such as ``mxfp8``).

``quantize_mx_values(x, fmt, axis, block_size, scale_rule, prescale)`` gives the values that
``mxtrain.linear.context.fake_quantize_operand(x, None, None, axis, 0, fmt, block_size, "nearest", scale_rule,
prescale)`` gives (the definition, bit for bit: ``mxtrain.numerics.quant.quantize`` then ``MXTensor.dequantize``) for
an already rotated 2-D float32/bf16/fp16 ``x``: per block of ``block_size`` elements along ``axis`` the E8M0
exponent ``s`` of the largest finite magnitude by the scale rule (``quant.mx_scale_exponent``: floor, ceil,
rceil, even or amd; -127 for an all-zero block), each element ``x * prescale * 2**-s`` rounded half to even
onto the element grid (saturating at its largest value, negative values that round to zero kept as -0), and
written as ``element * 2**s`` in float32, in ``x``'s shape; a block holding NaN or +-Inf gives NaN everywhere.

One Triton kernel: one read of ``x`` and one write, in float32 or, where the caller's GEMM multiplies bf16
next, in bf16 (rounded half to even on the bits, as ``.to(torch.bfloat16)`` rounds; MX values are exact in
bf16 except for blocks scaled below about 2**-117). The reference did the same in about twenty
full-tensor PyTorch passes.

Why bit-exact: the block maximum is a maximum; the exponent and significand of that maximum come from its
bits (a subnormal maximum reads as exponent -127, and the clamp to -127 gives the reference's exponent for
every rule, since no rule adds more than the element format's ``emax``); ``2**-s``, ``2**s`` and the spacings
are powers of two built from bits; ``x * prescale`` and ``* 2**-s`` are the reference's float32 multiplies in
its order (the second exact); the rounding onto the element grid is exact power-of-two scaling and
round-half-even through ``(y + 1.5 * 2**23) - 1.5 * 2**23`` (as ``quant.round_to_elem`` does with
``torch.round``); ``element * 2**s`` is the reference's float32 multiply. The kernel is launched with
``enable_fp_fusion=False`` so that no multiply-add becomes an FMA. ``tests/kernels/test_mx_kernel.py`` compares it
with the reference; each variant also checks itself on its first GPU run (the ``qselfcheck`` setting) and
falls back to the reference where it differs.
"""

from __future__ import annotations

import torch

from .. import settings as _settings
from ..numerics.formats import get_format
from ..numerics.operand import compute_dtype, fake_quantize_operand, pad_axis
from ..numerics.quant import SCALE_RULES
from . import HAS_TRITON, INTERPRET, kernels_available
from .nvfp4 import _adversarial, _mismatches, checked_once
from ..numerics.hadamard import hadamard

__all__ = ["quantize_mx_values", "mx_kernel_applies", "mx_ok", "mx_selfcheck", "mx_operand", "CALLS"]

_RULE = {r: i for i, r in enumerate(SCALE_RULES)}   # floor 0, ceil 1, rceil 2, even 3, amd 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4.device import _f32

    @triton.jit
    def _pow2(e):
        """Exact float32 2**e for int32 e in [-149, 127] (as ``quant.pow2``)."""
        normal = ((tl.maximum(e + 127, 0)) << 23).to(tl.float32, bitcast=True)
        sub = (tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
        return tl.where(e >= -126, normal, sub)

    @triton.jit
    def _mx_kernel(x_ptr, out_ptr, prescale, M, K, s_m, s_k,
                   TM: tl.constexpr, NB: tl.constexpr, B: tl.constexpr, MAXV: tl.constexpr, MBITS: tl.constexpr,
                   EMIN: tl.constexpr, EMAX: tl.constexpr, RULE: tl.constexpr, PRESCALE: tl.constexpr,
                   IDX64: tl.constexpr, OUT_BF16: tl.constexpr):
        """Logical (M, K) view of ``x`` (K: the quantization axis): element (m, k) at ``x_ptr + m*s_m + k*s_k``,
        its output at ``out_ptr`` + the same offset. A program quantizes a [TM, NB, B] piece: ``TM`` rows from
        ``pid_m``, ``NB`` blocks of ``B`` from ``pid_k``."""
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        m = pid_m * TM + tl.arange(0, TM)[:, None, None]
        k = pid_k * (NB * B) + tl.arange(0, NB)[None, :, None] * B + tl.arange(0, B)[None, None, :]
        if IDX64:
            m = m.to(tl.int64)
            k = k.to(tl.int64)
        msk = (m < M) & (k < K)
        offs = m * s_m + k * s_k
        x = _f32(tl.load(x_ptr + offs, mask=msk, other=0.0))
        ax = tl.abs(x)
        fin = (x == x) & (ax != float("inf"))
        amax = tl.max(tl.where(fin, ax, 0.0), axis=2)[:, :, None]            # [TM, NB, 1]
        nbad = tl.max(tl.where(fin, 0, 1), axis=2)[:, :, None]
        # the shared exponent (quant.mx_scale_exponent) from amax's bits
        ab = amax.to(tl.int32, bitcast=True)
        E = ((ab >> 23) & 0xFF) - 127
        sig = ((ab & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)    # 1 <= sig < 2
        if RULE == 0:
            bump = tl.zeros_like(E)
        elif RULE == 1:
            bump = (sig > 1.0).to(tl.int32)
        elif RULE == 2:
            bump = (sig * (2.0 ** EMAX) > MAXV).to(tl.int32)
        elif RULE == 3:
            t = sig * (2.0 ** MBITS)
            bump = (((t + 12582912.0) - 12582912.0) >= 2.0 ** (MBITS + 1)).to(tl.int32)
        else:
            bump = (sig >= 1.75).to(tl.int32)
        s = tl.minimum(tl.maximum(E - EMAX + bump, -127), 127 - EMAX)
        s = tl.where(amax > 0.0, s, -127)
        ok = nbad == 0
        if PRESCALE:
            x = x * prescale
        v = tl.where(ok, x * _pow2(-s), 0.0)
        # onto the element grid (quant.round_to_elem, nearest)
        a = tl.minimum(tl.abs(v), MAXV)
        ex = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(ex, EMIN)                                              # subnormals share emin's spacing
        y = a * _pow2(MBITS - e)                                              # a / spacing, exact
        r = (y + 12582912.0) - 12582912.0                                     # half to even (y < 2**22)
        q = tl.minimum(r * _pow2(e - MBITS), MAXV)
        q = (q.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                              bitcast=True)
        out = tl.where(ok, q * _pow2(s), float("nan"))
        if OUT_BF16:
            # round half to even onto bf16 (float32's upper 16 bits) on the bits, subnormals included (a
            # hardware or interpreter cast may flush those); NaN -> the canonical bf16 NaN
            ob = out.to(tl.int32, bitcast=True)
            rb = (ob + 0x7FFF + ((ob >> 16) & 1)) >> 16
            rb = tl.where(out == out, rb, 0x7FC0)
            tl.store(out_ptr + offs, rb.to(tl.int16), mask=msk)
        else:
            tl.store(out_ptr + offs, out, mask=msk)


def _launch_config(axis: int, B: int) -> tuple[int, int, int]:
    """(TM, NB, num_warps): rows and blocks a program."""
    if INTERPRET:
        return 16, max(1, 128 // B), 4
    return (16, max(1, 128 // B), 4) if axis == 1 else (32, max(1, 64 // B), 4)


def _check(x: torch.Tensor, fmt: str, block_size: int, scale_rule: str, prescale: float):
    if not HAS_TRITON:
        raise RuntimeError("quantize_mx_values needs Triton")
    if x.ndim != 2:
        raise ValueError(f"quantize_mx_values: expected a 2-D tensor, got {x.ndim}-d")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_mx_values: expected float32/bf16/fp16, got {x.dtype}")
    f = get_format(fmt)
    if f.kind != "mx":
        raise ValueError(f"quantize_mx_values: {fmt!r} is not an MX format")
    if block_size & (block_size - 1) or not 2 <= block_size <= 1024:
        raise ValueError(f"quantize_mx_values: block size must be a power of two in [2, 1024], got {block_size}")
    if scale_rule not in _RULE:
        raise ValueError(f"unknown scale rule {scale_rule!r}; valid: {', '.join(SCALE_RULES)}")
    if not prescale > 0:
        raise ValueError(f"prescale must be positive, got {prescale}")
    return f.elem


def quantize_mx_values(x: torch.Tensor, fmt: str, axis: int = -1, block_size: int = 32, scale_rule: str = "floor",
                       prescale: float = 1.0, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float32 values of ``fake_quantize_operand(x, None, None, axis, 0, fmt, block_size, "nearest",
    scale_rule, prescale)`` for 2-D ``x`` (bit for bit; module docstring), in ``x``'s shape; with ``out_dtype``
    bf16/fp16, those values cast to it (round half to even, as ``.to(out_dtype)``) by the kernel's store."""
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_mx_values: out_dtype must be float32, bf16 or fp16, not {out_dtype}")
    if out_dtype == torch.float16:   # (the kernel rounds onto bf16 only; fp16 is the float32 values cast)
        return quantize_mx_values(x, fmt, axis, block_size, scale_rule, prescale).to(torch.float16)
    elem = _check(x, fmt, block_size, scale_rule, prescale)
    axis = axis % 2
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()           # (the kernel is specialized for 16-byte aligned pointers)
    R0, C0 = x.shape
    bf16 = out_dtype == torch.bfloat16
    out = torch.empty((R0, C0), dtype=torch.int16 if bf16 else torch.float32, device=x.device)
    if x.numel() == 0:
        return out.view(out_dtype)
    if axis == 1:
        M, K, s_m, s_k = R0, C0, C0, 1
    else:
        M, K, s_m, s_k = C0, R0, 1, C0
    TM, NB, nw = _launch_config(axis, block_size)
    grid = (triton.cdiv(M, TM), triton.cdiv(K, NB * block_size))
    ps = float(torch.tensor(prescale, dtype=torch.float32))
    _mx_kernel[grid](x, out, ps, M, K, s_m, s_k, TM=TM, NB=NB, B=block_size, MAXV=float(elem.max),
                     MBITS=elem.mbits, EMIN=elem.emin, EMAX=elem.emax, RULE=_RULE[scale_rule], PRESCALE=ps != 1.0,
                     IDX64=x.numel() >= 2**31 - 1, OUT_BF16=bf16, num_warps=nw, enable_fp_fusion=False)
    return out.view(out_dtype)


# ----------------------------------------------------------------------------------------------
# where the kernel serves the reference path, and its runtime self-check


def mx_kernel_applies(t: torch.Tensor, fmt: str, block_size, rounding: str, st=None, fp4: bool = False) -> bool:
    """Does ``fake_quantize_operand`` of this operand run through the kernel? The ``mx_kernel`` setting:
    ``auto`` on CUDA tensors, ``always`` also on CPU under Triton's interpreter (tests), ``off`` never. Only MX
    formats with FP6/FP8 elements (MXFP4 operands have the fast path; the reference that checks it stays plain
    PyTorch; ``fp4=True`` admits MXFP4 for callers outside the GEMM path, as ``mxtrain.train.deosc``'s weight grid)
    and 1-D blocks of a power of two, round-to-nearest, 2-D float32/bf16/fp16 operands, never inside a
    ``torch.compile`` trace."""
    st = st or _settings.current()
    mode = st.mx_kernel
    if mode == "off" or not HAS_TRITON or t.ndim != 2 or t.dtype not in (torch.float32, torch.bfloat16,
                                                                          torch.float16):
        return False
    if rounding != "nearest" or torch.compiler.is_compiling():
        return False
    f = get_format(fmt)
    if f.kind != "mx" or (f.elem.bits == 4 and not fp4):   # (MXFP4 has the fast path; its reference stays plain PyTorch)
        return False
    b = f.block_size if block_size is None else block_size
    if not isinstance(b, int) or b & (b - 1) or not 2 <= b <= 1024:
        return False
    if t.device.type == "cuda":
        return True
    return mode == "always" and kernels_available(t.device)


def _variant_key(x: torch.Tensor, fmt: str, axis: int, block: int, rule: str, prescale: float):
    R0, C0 = x.shape
    return ("mx", x.device.index, x.dtype, fmt, axis % 2, block, rule, prescale != 1.0, R0 % block == 0,
            C0 % block == 0, R0 == 1, C0 == 1, x.numel() >= 2**31 - 1)


def mx_selfcheck(device, dtype, fmt: str, axis: int, block: int, rule: str, prescale: float, r_whole: bool,
                 c_whole: bool, quantize_fn=None, r1: bool = False, c1: bool = False) -> dict:
    """Run one kernel variant on an adversarial tensor with the same divisibility of its sizes by the block
    and compare its values with the reference (``fake_quantize_operand``); ``r1``/``c1``: a single row /
    column. ``quantize_fn``: the quantizer checked (default ``quantize_mx_values``; tests pass a faulty one).
    Returns ``ok`` and the mismatch count."""
    quantize_fn = quantize_fn or quantize_mx_values
    base = 4 * block if torch.device(device).type == "cpu" else 8 * block
    R, C = (base if r_whole else base + 3), (2 * base if c_whole else 2 * base + 5)
    R, C = (1 if r1 else R), (1 if c1 else C)
    t = _adversarial(R, C).to(device=device, dtype=dtype)
    v = quantize_fn(t, fmt, axis, block, rule, prescale)
    rv = fake_quantize_operand(t, None, None, axis, 0, fmt, block, "nearest", rule, prescale)
    n = _mismatches(v, rv) if v.shape == rv.shape and v.dtype == rv.dtype else v.numel()
    return {"values": n, "ok": n == 0}


def mx_ok(x: torch.Tensor, fmt: str, axis: int, block: int, rule: str, prescale: float, st=None) -> bool:
    """``nvfp4.checked_once`` for this kernel variant: once per variant (``qselfcheck``), did it reproduce the
    reference? A variant that fails warns once and the reference serves it from then on."""
    vkey = _variant_key(x, fmt, axis, block, rule, prescale)
    return checked_once(x, vkey, lambda: mx_selfcheck(x.device, x.dtype, fmt, axis, block, rule, prescale, vkey[8],
                                                      vkey[9], r1=vkey[10], c1=vkey[11]), "MX", st)


def mx_operand(t: torch.Tensor, signs, key, axis: int, rot: int, fmt: str, block_size, rounding: str,
               scale_rule: str, prescale: float, out_dtype: torch.dtype | None = None):
    """``fake_quantize_operand(...)`` of an MX operand through the kernel where ``mx_kernel_applies`` and its
    variant passed its self-check, else None (the caller runs the reference). The rotation stays in torch
    (float32); without one a bf16/fp16 ``t`` goes to the kernel as it is (its upcast is exact). ``out_dtype``:
    bf16/fp16 to have the kernel write the values cast to it (what the caller's GEMM multiplies), else float32."""
    if not mx_kernel_applies(t, fmt, block_size, rounding):
        return None
    block = get_format(fmt).block_size if block_size is None else block_size
    r = t
    if rot:
        r = hadamard(pad_axis(t.to(compute_dtype(t)), axis, rot), rot, axis=axis, signs=signs)
    if not mx_ok(r, fmt, axis, block, scale_rule, prescale):
        return None
    CALLS["kernel"] += 1
    od = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.float32
    return quantize_mx_values(r, fmt, axis, block, scale_rule, prescale, out_dtype=od)


CALLS = {"kernel": 0}   # operands quantized by ``mx_operand`` in this process (tests read it)
