"""MXFP4 GEMM on packed operands: ``C = A B^T`` from E2M1 codes and E8M0 scales, in one Triton kernel.

Operands are laid out as ``QuantOut.packed`` / ``QuantOut.scales`` (``mxtrain.kernels.mxfp4``):
codes (R, Kq/2) uint8, two per byte, the lower k in the low nibble; scales (R, Kq/32) uint8, the
block of 32 k's value ``2^(s-127)``, ``s = 255`` NaN. Kq is a multiple of 32. The product is
accumulated in float32, divided by ``divisor`` and rounded once to ``out_dtype``.

Two variants of one kernel (constexpr ``NATIVE``):

* ``NATIVE=True``: ``tl.dot_scaled(..., "e2m1", ..., "e2m1")``, the MX matrix instruction on FP4-native
  GPUs (sm_100, gfx950); Triton emulates it on Hopper (measured in BENCHMARKS.md), which is how the
  path is tested here.
* ``NATIVE=False``: the portable twin. Codes are decoded to bf16 in registers (every MX value
  ``v * 2^(s-127)`` is exact in bf16: 2 significant bits, ``2^-128 .. 1.5 * 2^127``) and multiplied with
  ``tl.dot`` on bf16 tensor cores. The even and odd k of each byte go to two dots, so no interleave
  is needed. It runs in Triton's interpreter, which the CPU tests use (the interpreter has no
  ``dot_scaled`` and no bf16 ``dot``, so there the decoded values, exact in float32 too, meet in a
  float32 dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mx_dot_nt", "supports_native"]


@triton.jit
def _decode(c, s):
    """float32 values of E2M1 codes ``c`` (int32, 0..15) times block scales ``2^(s-127)`` (s int32, 0..255)."""
    m = c & 7
    # magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: exponent e = m >> 1 (subnormal for m < 2), mantissa bit m & 1
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5,
                   (2.0 + (m & 1).to(tl.float32)) * tl.exp2(((m >> 1) - 1).to(tl.float32)) * 0.5)
    v = tl.where(c >= 8, -mag, mag)
    # 2^(s-127) as float32 bits for s >= 1; s == 0 is 2^-127 (subnormal), built as 2^-126 * 0.5
    p = ((tl.maximum(s, 1)) << 23).to(tl.float32, bitcast=True)
    p = tl.where(s == 0, p * 0.5, p)
    out = v * p
    return tl.where(s == 255, float("nan"), out)


@triton.jit
def _mx_dot_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, Ra, Rb, KB: tl.constexpr, sa_r, ssa_r, sb_r, ssb_r, sc_r, inv_div,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NATIVE: tl.constexpr,
                   FMT: tl.constexpr, OUT_BF16: tl.constexpr, DOT_DT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < Ra
    mn = rn < Rb
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, (KB + BK // 2 - 1) // (BK // 2)):   # KB constexpr: the interpreter needs a static bound
        k0 = kt * (BK // 2)        # in bytes of codes (2 codes each)
        kb = k0 + tl.arange(0, BK // 2)
        mk = kb < KB
        a = tl.load(a_ptr + rm[:, None] * sa_r + kb[None, :], mask=mm[:, None] & mk[None, :], other=0)
        b = tl.load(b_ptr + rn[:, None] * sb_r + kb[None, :], mask=mn[:, None] & mk[None, :], other=0)
        if NATIVE:
            ks = k0 // 16 + tl.arange(0, BK // 32)
            ms = ks < KB // 16
            sa = tl.load(as_ptr + rm[:, None] * ssa_r + ks[None, :], mask=mm[:, None] & ms[None, :], other=127)
            sb = tl.load(bs_ptr + rn[:, None] * ssb_r + ks[None, :], mask=mn[:, None] & ms[None, :], other=127)
            acc = tl.dot_scaled(a, sa, FMT, tl.trans(b), sb, FMT, acc)
        else:
            # the scale of byte column j is scale column j // 16 (one 32-code block = 16 bytes)
            ksa = kb // 16
            sa = tl.load(as_ptr + rm[:, None] * ssa_r + ksa[None, :], mask=mm[:, None] & mk[None, :],
                         other=127).to(tl.int32)
            sb = tl.load(bs_ptr + rn[:, None] * ssb_r + ksa[None, :], mask=mn[:, None] & mk[None, :],
                         other=127).to(tl.int32)
            a = a.to(tl.int32)
            b = b.to(tl.int32)
            a_lo = _decode(a & 15, sa).to(DOT_DT)
            a_hi = _decode(a >> 4, sa).to(DOT_DT)
            b_lo = _decode(b & 15, sb).to(DOT_DT)
            b_hi = _decode(b >> 4, sb).to(DOT_DT)
            acc = tl.dot(a_lo, tl.trans(b_lo), acc)
            acc = tl.dot(a_hi, tl.trans(b_hi), acc)
    acc = acc * inv_div
    cp = c_ptr + rm[:, None] * sc_r + rn[None, :]
    if OUT_BF16:
        tl.store(cp, acc.to(tl.bfloat16), mask=mm[:, None] & mn[None, :])
    else:
        tl.store(cp, acc, mask=mm[:, None] & mn[None, :])


def supports_native(device) -> bool:
    """Does ``device`` have MX (FP4) matrix instructions (NVIDIA sm_100+, AMD gfx950)?"""
    d = torch.device(device)
    if d.type != "cuda" or not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(d)
    arch = getattr(props, "gcnArchName", "") or ""
    if arch:
        return arch.startswith("gfx950")
    return (props.major, props.minor) >= (10, 0)


def _check(name: str, p: torch.Tensor, s: torch.Tensor) -> None:
    if p.dtype != torch.uint8 or s.dtype != torch.uint8:
        raise ValueError(f"mx_dot_nt: {name} codes and scales must be uint8 (got {p.dtype}, {s.dtype})")
    if p.ndim != 2 or s.ndim != 2:
        raise ValueError(f"mx_dot_nt: {name} codes and scales must be 2-D (got {tuple(p.shape)}, {tuple(s.shape)})")
    if p.shape[1] % 16 or s.shape != (p.shape[0], p.shape[1] // 16):
        raise ValueError(f"mx_dot_nt: {name} codes {tuple(p.shape)} need a multiple of 16 bytes a row (32 codes) "
                         f"and scales of shape {(p.shape[0], p.shape[1] // 16)} (got {tuple(s.shape)})")
    if p.stride(1) != 1 or s.stride(1) != 1:
        raise ValueError(f"mx_dot_nt: {name} codes and scales must be contiguous along the last axis")


def mx_dot_nt(a_packed: torch.Tensor, a_scales: torch.Tensor, b_packed: torch.Tensor, b_scales: torch.Tensor,
              out_dtype=torch.bfloat16, divisor: float = 1.0, native: bool = False, block_m: int | None = None,
              block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> torch.Tensor:
    """``(A B^T) / divisor`` of two packed MXFP4 operands (see the module docstring), shape (Ra, Rb).

    ``native=True`` uses ``tl.dot_scaled`` (GPUs only); ``native=False`` decodes to bf16 in registers.
    """
    _check("A", a_packed, a_scales)
    _check("B", b_packed, b_scales)
    if a_packed.shape[1] != b_packed.shape[1]:
        raise ValueError(f"mx_dot_nt: A and B reduce over different lengths ({a_packed.shape[1] * 2} and "
                         f"{b_packed.shape[1] * 2} codes)")
    dev = a_packed.device
    if any(t.device != dev for t in (a_scales, b_packed, b_scales)):
        raise ValueError("mx_dot_nt: all operands must be on one device")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"mx_dot_nt: out_dtype must be torch.bfloat16 or torch.float32, not {out_dtype}")
    if native and dev.type != "cuda":
        raise ValueError("mx_dot_nt: native=True (tl.dot_scaled) needs a GPU; use native=False on CPU")
    Ra, Rb, KB = a_packed.shape[0], b_packed.shape[0], a_packed.shape[1]
    c = torch.empty((Ra, Rb), dtype=out_dtype, device=dev)
    if Ra == 0 or Rb == 0:
        return c
    if KB == 0:
        return c.zero_()
    gpu = dev.type == "cuda"
    BM = block_m or (128 if gpu else 32)
    BN = block_n or (128 if gpu else 32)
    BK = block_k or (128 if gpu else 64)
    if BK % 64:
        raise ValueError(f"mx_dot_nt: block_k must be a multiple of 64 (got {BK})")
    kw = {}
    if gpu:
        kw = dict(num_warps=num_warps or 8, num_stages=num_stages or 3)
    grid = (triton.cdiv(Ra, BM), triton.cdiv(Rb, BN))
    _mx_dot_kernel[grid](a_packed, a_scales, b_packed, b_scales, c, Ra, Rb, KB,
                         a_packed.stride(0), a_scales.stride(0), b_packed.stride(0), b_scales.stride(0), c.stride(0),
                         float(1.0 / divisor), BM=BM, BN=BN, BK=BK, NATIVE=native, FMT="e2m1",
                         OUT_BF16=out_dtype == torch.bfloat16, DOT_DT=tl.bfloat16 if gpu else tl.float32, **kw)
    return c
