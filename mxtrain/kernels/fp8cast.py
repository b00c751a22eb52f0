"""Per-tensor FP8 quantization in two passes (the ``fp8`` recipe's quantizer on a GPU).

``quantize_tensor_fp8(x, fmt)`` gives the codes and the float32 scale that ``mxtrain.numerics.quant.quantize(x, fmt)``
gives for per-tensor FP8 with nearest rounding (the definition, bit for bit; TransformerEngine's and torchao's
float8 tensorwise scaling): the multiplier ``m = max_elem / amax`` and the scale ``1 / m``, both float32
(``quant.tensor_fp8_scales``: ``m = 1`` for an all-zero tensor, both NaN when an element is not finite, then
every code +0), each element ``x * prescale * m`` (float32 products) saturated to +-max_elem and rounded half to
even onto the E4M3 or E5M2 grid, negative values that round to zero kept as -0.

Pass 1 is the amax (``torch.linalg.vector_norm`` with ``ord=inf``: one read; NaN or Inf when an element is
not finite) and the two 0-d quotients. Pass 2 is one Triton kernel: one read of ``x`` and a 1-byte write, the
multiplier read from device memory (no host synchronisation; a CUDA graph replays with the new scale). The
reference path did the same in about fifteen full-tensor PyTorch passes.
"""

from __future__ import annotations

import torch

from ..numerics.formats import get_format
from ..numerics.quant import tensor_fp8_scales
from . import HAS_TRITON

__all__ = ["quantize_tensor_fp8", "tensor_scale"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4.device import _f32

    @triton.jit
    def _fp8_cast_kernel(x_ptr, out_ptr, mult_ptr, n, prescale, MAXV: tl.constexpr, MBITS: tl.constexpr,
                         EMIN: tl.constexpr, BIAS: tl.constexpr, SUB: tl.constexpr, PRESCALE: tl.constexpr,
                         BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        s = tl.load(mult_ptr)
        x = _f32(tl.load(x_ptr + offs, mask=m, other=0.0))
        if PRESCALE:
            x = x * prescale
        v = x * s
        ok = s == s                                    # NaN when an element of the tensor is not finite
        v = tl.where(ok, v, 0.0)
        a = tl.minimum(tl.abs(v), MAXV)
        # spacing of a's binade (the subnormal binade shares the first normal one's): 2**(e - MBITS)
        E = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(E, EMIN)
        y = a * ((127 + MBITS - e) << 23).to(tl.float32, bitcast=True)       # a / spacing, exact
        r = (y + 12582912.0) - 12582912.0                                      # half to even (y < 2**22)
        q = r * ((127 - MBITS + e) << 23).to(tl.float32, bitcast=True)       # back on the grid, exact
        q = tl.minimum(q, MAXV)
        qb = q.to(tl.int32, bitcast=True)
        Eq = ((qb >> 23) & 0xFF) - 127
        normal = ((Eq + BIAS) << MBITS) | ((qb >> (23 - MBITS)) & ((1 << MBITS) - 1))
        sub = (q * SUB).to(tl.int32)                                          # q / 2**(EMIN - MBITS), exact
        code = tl.where(Eq >= EMIN, normal, sub)
        code = tl.where(q == 0.0, 0, code)
        code = code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)          # the sign of v (-0 too)
        tl.store(out_ptr + offs, code.to(tl.uint8), mask=m)


def tensor_scale(x: torch.Tensor, max_elem: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition's float32 multiplier ``m = max_elem / amax`` and scale ``1 / m`` of ``x``
    (``quant.tensor_fp8_scales``; 0-d, on ``x``'s device)."""
    if x.numel() == 0:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        return one, one
    return tensor_fp8_scales(torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32), max_elem)


def quantize_tensor_fp8(x: torch.Tensor, fmt: str = "fp8_e4m3", prescale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in ``x``'s shape, contiguous, dtype float8_e4m3fn / float8_e5m2; float32 0-d scale), as
    ``mxtrain.numerics.quant.quantize(x, fmt, prescale=prescale)`` makes them with nearest rounding."""
    f = get_format(fmt)
    if f.kind != "tensor" or f.elem.name not in ("e4m3", "e5m2"):
        raise ValueError(f"quantize_tensor_fp8: {fmt!r} is not a per-tensor FP8 format")
    el = f.elem
    x = x.contiguous()
    mult, scale = tensor_scale(x, el.max)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    if n:
        BLOCK = 4096
        ps = float(torch.tensor(prescale, dtype=torch.float32))
        _fp8_cast_kernel[(triton.cdiv(n, BLOCK),)](x, out, mult, n, ps, MAXV=el.max, MBITS=el.mbits, EMIN=el.emin,
                                                    BIAS=el.bias, SUB=2.0 ** (el.mbits - el.emin),
                                                    PRESCALE=prescale != 1.0, BLOCK=BLOCK,
                                                    num_warps=8)
    return out.view(getattr(torch, el.torch_dtype)), scale
