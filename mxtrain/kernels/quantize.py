"""Fused MXFP4 quantizer (Triton): [signs * Hadamard] -> block amax -> E8M0 scale -> prescale ->
nearest/stochastic rounding -> packed FP4 codes + E8M0 scales and/or the FP8 e4m3 carrier.

One program handles a tile of ``BR`` rows x 128 reduction elements (4 MX blocks of 32, one carrier
group). The tile is read through two strides, so quantizing along columns (Wgrad: along tokens)
reads the transposed tile directly from the row-major tensor: no transpose copy.

Two kernels implement it (``kernel_for`` picks one; the ``qkernel`` setting, ``MXTRAIN_QKERNEL``, forces one): the "tile"
kernel (``_mxfp4_kernel``: any rotation, the whole tile as one [BR, 128] tensor) and the "blocks"
kernel (``_mxfp4_blk_kernel``: rotations up to 32 wide; the tile as four pieces so that a thread
holds whole MX blocks; 1.2-2x faster on an H100, BENCHMARKS.md). They write identical bytes.

Bit-exactness with ``mxtrain.quant.quantize`` (the spec) comes from doing the same float32
operations: the butterfly with the reference's stage order (``tl.reshape``/``tl.permute``/
``tl.split``/``tl.join`` on a ``[BR, 128/(2h), 2, h]`` view), exact power-of-two scaling built from
bits, round-half-even through ``(y + 1.5*2**23) - 1.5*2**23`` (exact for 0 <= y < 2**22), floor by
truncation (y >= 0), and the same 32-bit counter hash (``mxtrain.rng``) for stochastic rounding.
Kernels are launched with ``enable_fp_fusion=False`` so no multiply-add is contracted to an FMA.

FP8 carrier (``docs/kernels.md``): each element ``v * 2**s`` is stored as ``v * 2**(s - G + 6)`` in
e4m3 (bits computed here, round-half-even), with ``2**(G - 6)`` as the group's float32 scale, where
``G`` is the largest block exponent in the group (1x128: one row x 128; 128x128: the whole tile).
Exact when ``s >= G - 14``; non-zero blocks below that are counted in ``inexact``.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import torch

from .. import rng
from .. import settings as _settings
from ..formats import get_format
from ..quant import MXTensor
from .caches import CACHES

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

__all__ = ["QuantOut", "quantize_mxfp4_2d", "quantize", "RULE_ID", "supported"]

RULE_ID = {"floor": 0, "ceil": 1, "rceil": 2, "even": 3, "amd": 4}
TILE_K = 128
_MIN_G = -120  # group exponent floor: keeps 2**(G-6) a normal float32


def supported(fmt: str, block_size=None) -> bool:
    """Formats the fused kernel implements (others fall back to the reference)."""
    return fmt == "mxfp4" and block_size in (None, 32)


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def _pow2(e):
        """Exact float32 2**e for int32 e in [-149, 127]."""
        normal = ((tl.maximum(e, -126) + 127) << 23)
        sub = (tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(e + 149, 0), 22))
        bits = tl.where(e >= -126, normal, sub)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _pow2n(e):
        """Exact float32 2**e for int32 e in [-126, 127] (normal range)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _uniform(idx, key):
        """Uniform [0, 1) float32 from the element index and the stream key (``mxtrain.rng``). An int32
        ``idx`` (callers use one only where every index is below 2**31) skips the high word's hash,
        which is 0 there."""
        if idx.dtype == tl.int64:
            lo = (idx & 0xFFFFFFFF).to(tl.uint32)
            hi = (idx >> 32).to(tl.uint32)
            h = _mix32(lo ^ key.to(tl.uint32, bitcast=True) ^ _mix32(hi))
        else:
            h = _mix32(idx.to(tl.uint32, bitcast=True) ^ key.to(tl.uint32, bitcast=True))
        return (h >> 8).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def _block_scale(abits, RULE: tl.constexpr):
        """E8M0 block exponent s from the bit pattern of the block's |x| maximum (finite, >= 0), as the
        spec: floor(log2 amax) - 2 (+1 where the scale rule rounds up), clamped to [-127, 125];
        -127 for all-zero blocks. Returns (s, nonzero)."""
        E = (abits >> 23) - 127
        mant = abits & 0x7FFFFF
        if RULE == 0:
            bump = tl.zeros_like(E)
        elif RULE == 1:
            bump = (mant != 0).to(tl.int32)
        elif RULE == 2:
            bump = (mant > 0x400000).to(tl.int32)
        else:  # even / amd: sig >= 1.75 (identical for FP4)
            bump = (mant >= 0x600000).to(tl.int32)
        s = tl.minimum(tl.maximum(E - 2 + bump, -127), 125)   # [-127, 127 - emax], as the spec
        nz = abits > 0
        return tl.where(nz, s, -127), nz

    @triton.jit
    def _carrier_exp(s, live, GROUP_ROWS: tl.constexpr):
        """Carrier group exponent G (largest live block exponent of the row, or of the whole tile for
        128x128 groups; at least -120) and each block's shift kexp = s - G + 6. Returns (G, kexp)."""
        s_live = tl.where(live, s, -127)
        if GROUP_ROWS == 1:
            G = tl.maximum(tl.max(s_live, axis=1), -120)           # [BR]
            G2 = G[:, None]
        else:
            G = tl.maximum(tl.max(tl.max(s_live, axis=1), axis=0), -120)
            G2 = G
        return G, s - G2 + 6

    @triton.jit
    def _bfly(x, BR: tl.constexpr, H: tl.constexpr):
        """One butterfly stage: pairs (x[i], x[i + H]) for i with bit H clear -> (a + b, a - b)."""
        v4 = tl.reshape(x, [BR, 128 // (2 * H), 2, H])
        v4 = tl.permute(v4, (0, 1, 3, 2))
        a, b = tl.split(v4)
        v4 = tl.join(a + b, a - b)
        v4 = tl.permute(v4, (0, 1, 3, 2))
        return tl.reshape(v4, [BR, 128])

    @triton.jit(do_not_specialize=["key"])
    def _mxfp4_kernel(
        x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr,
        R, K, Rc,
        sx_r, sx_k,            # memory strides of x along (outer row, reduction)
        si_r, si_k,            # logical index strides (stochastic rounding index)
        Kc, Kq,                # carrier row length (mult. of 128), MX padded length (mult. of 32)
        gs_sr, gs_sk,          # group-scale strides (per row-group, per k-group)
        key, inv_sqrt, prescale,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr,
        WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, IDX64: tl.constexpr, KEY_PTR: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        if KEY_PTR:  # the seed read from device memory (refreshed between CUDA-graph replays)
            key = tl.load(key_ptr)
        if IDX64:  # offsets beyond 2**31 - 1: 64-bit index math (costs integer throughput)
            rows = pid_r.to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
            kbase = pid_k.to(tl.int64) * 128
        else:
            rows = pid_r * BR + tl.arange(0, BR)
            kbase = pid_k * 128
        cols = kbase + tl.arange(0, 128)
        r2 = rows[:, None]
        c2 = cols[None, :]
        r3 = rows[:, None, None]
        c3 = kbase + (tl.arange(0, 4) * 32)[None, :, None] + tl.arange(0, 32)[None, None, :]
        inb = (r2 < R) & (c2 < K)
        x = tl.load(x_ptr + r2 * sx_r + c2 * sx_k, mask=inb, other=0.0).to(tl.float32)

        # ---- optional blockwise Hadamard (signs first, butterfly h = 1..ROT/2, one scale multiply)
        if ROT > 0:
            if HAS_SIGNS:
                sg = tl.load(signs_ptr + (tl.arange(0, 128) % ROT))
                x = x * sg[None, :]
            if ROT > 1:
                x = _bfly(x, BR, 1)
            if ROT > 2:
                x = _bfly(x, BR, 2)
            if ROT > 4:
                x = _bfly(x, BR, 4)
            if ROT > 8:
                x = _bfly(x, BR, 8)
            if ROT > 16:
                x = _bfly(x, BR, 16)
            if ROT > 32:
                x = _bfly(x, BR, 32)
            if ROT > 64:
                x = _bfly(x, BR, 64)
            x = x * inv_sqrt
            # the reference pads with +0 only to whole rotation blocks; beyond that, +0 block padding;
            # padding rows (up to Rc) hold +0
            Kr = ((K + ROT - 1) // ROT) * ROT
            x = tl.where((c2 < Kr) & (r2 < R), x, 0.0)
        xb = tl.reshape(x, [BR, 4, 32])
        # ---- block scales (from the values before the prescale, as the reference) (4 blocks of 32 per row)
        # |x| bit patterns order like the values; NaN/Inf have the largest ones (exponent 0xFF)
        mbits = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)   # [BR, 4]
        ok = mbits < 0x7F800000
        abits = tl.where(ok, mbits, 0)
        s, nz = _block_scale(abits, RULE)
        code_sc = tl.where(ok, s + 127, 255)

        # ---- elements
        if PRESCALE:
            xb = xb * prescale
        v = xb * _pow2n(-s)[:, :, None]
        v = tl.where(ok[:, :, None], v, 0.0)
        vbits = v.to(tl.int32, bitcast=True)
        a = tl.minimum(tl.abs(v), 6.0)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 0)
        y = a * _pow2n(1 - e)
        if SR:
            idx = r3.to(tl.int64) * si_r + c3.to(tl.int64) * si_k
            u3 = _uniform(idx, key)
            fl = y.to(tl.int32).to(tl.float32)
            rr = fl + tl.where(u3 < (y - fl), 1.0, 0.0)
        else:
            rr = (y + 12582912.0) - 12582912.0
        ri = rr.to(tl.int32)
        mag = tl.minimum(ri + 2 * e, 7)                              # E2M1 magnitude code

        if WRITE_FP4:
            code = mag | ((vbits >> 28) & 8)
            c2d = tl.reshape(code, [BR, 64, 2])
            lo4, hi4 = tl.split(c2d)
            byte = (lo4 | (hi4 << 4)).to(tl.uint8)
            jb = kbase // 2 + tl.arange(0, 64)
            m4 = (r2 < R) & (jb[None, :] * 2 < Kq)
            tl.store(fp4_ptr + r2 * (Kq // 2) + jb[None, :], byte, mask=m4)
            bidx = kbase // 32 + tl.arange(0, 4)
            msc = (r2 < R) & (bidx[None, :] * 32 < Kq)
            tl.store(sc_ptr + r2 * (Kq // 32) + bidx[None, :], code_sc.to(tl.uint8), mask=msc)

        if WRITE_CARRIER:
            live = ok & nz
            G, kexp = _carrier_exp(s, live, GROUP_ROWS)                # kexp [BR, 4]
            inexact = live & (kexp < -8)
            # e4m3 bits of c = (FP4 value) * 2**kexp, exact in float32 (the value has at most two
            # significant bits). In e4m3's normal range the bits are the float32 exponent and top
            # mantissa bits, rebiased; below 2**-6 they are the subnormal count k = RNE(c * 2**9),
            # rounded by the float add of 1.5 * 2**23. (Float ops: the integer pipes have half the
            # throughput, and Triton's fp32 -> e4m3 cast wrote wrong bytes on sm_90, see above.)
            cval = rr * _pow2n(tl.maximum(e - 1 + kexp[:, :, None], -126))
            nrm = (cval.to(tl.int32, bitcast=True) >> 20) - 960
            sub = (cval * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
            bits8 = tl.where(cval < 0.015625, sub, nrm)
            bits8 = bits8 | ((vbits >> 24) & 0x80)
            bits8 = tl.where(ok[:, :, None], bits8, 0x7F)
            # stored through 3-D pointers (no reshape back to [BR, 128])
            tl.store(car_ptr + r3 * Kc + c3, bits8.to(tl.uint8), mask=r3 < Rc)
            gval = _pow2(G - 6)
            if GROUP_ROWS == 1:
                tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
            else:
                tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
            nin = tl.sum(tl.sum((inexact & (rows[:, None] < R)).to(tl.int32), axis=1), axis=0)
            tl.atomic_add(cnt_ptr, nin, mask=nin > 0)  # rare: no contention on the common path

if triton is not None:

    @triton.jit
    def _bfly8(x, BR: tl.constexpr, H: tl.constexpr):
        """Butterfly stage h = H (1, 2 or 4) inside the last axis (8 values, all held by one thread)."""
        v = tl.reshape(x, [BR, 4, 8 // (2 * H), 2, H])
        v = tl.permute(v, (0, 1, 2, 4, 3))
        a, b = tl.split(v)
        v = tl.join(a + b, a - b)
        v = tl.permute(v, (0, 1, 2, 4, 3))
        return tl.reshape(v, [BR, 4, 8])

    @triton.jit
    def _e4m3_bits(c, USE_ASM: tl.constexpr, PACK: tl.constexpr = 4):
        """e4m3 byte of float32 ``c``; NaN -> 0x7F. The hardware path rounds half to even and saturates
        everywhere; the bit-arithmetic path (interpreter) is exact where ``c`` is an e4m3 normal value
        (the carrier's case: an E2M1 value times a power of two) and rounds half to even below 2**-6."""
        if USE_ASM and PACK == 2:   # for layouts with 2 values a thread
            return tl.inline_asm_elementwise(
                asm="cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;",
                constraints="=h,r,r", args=[c], dtype=tl.uint8, is_pure=True, pack=2)
        elif USE_ASM:
            # the hardware conversion, two values per instruction; the first value goes to the low byte
            return tl.inline_asm_elementwise(
                asm="{ .reg .b16 lo, hi;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
                    "mov.b32 $0, {lo, hi}; }",
                constraints="=r,r,r,r,r", args=[c], dtype=tl.uint8, is_pure=True, pack=4)
        else:
            a = tl.abs(c)
            nrm = (a.to(tl.int32, bitcast=True) >> 20) - 960
            sub = (a * 512.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
            b = tl.where(a < 0.015625, sub, nrm)
            b = tl.minimum(b, 0x7E) | ((c.to(tl.int32, bitcast=True) >> 24) & 0x80)
            b = tl.where(c != c, 0x7F, b)
            return b.to(tl.uint8)

    @triton.jit
    def _fp4_round(v, SR: tl.constexpr, idx, key):
        """|v| rounded to E2M1 magnitudes (float32 0..6), nearest-even or stochastic (hash of idx)."""
        a = tl.minimum(tl.abs(v), 6.0)
        pbits = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000   # 2**e, e = max(E(a), 0)
        if SR:
            y = a * ((0x7F800000 - pbits).to(tl.float32, bitcast=True))      # a * 2**(1-e): step 1
            u = _uniform(idx, key)
            fl = y.to(tl.int32).to(tl.float32)
            rr = fl + tl.where(u < (y - fl), 1.0, 0.0)
            q = rr * (pbits - 0x00800000).to(tl.float32, bitcast=True)        # * 2**(e-1)
        else:
            # round to the step 2**(e-1) by adding and removing 1.5 * 2**(22+e)
            m = pbits.to(tl.float32, bitcast=True) * 6291456.0
            q = (a + m) - m
        return q

    @triton.jit
    def _fp4_code(q, v):
        """E2M1 code of magnitude q (0, .5, 1, 1.5, 2, 3, 4, 6 -> 0..7) with the sign of v."""
        cf = tl.minimum(tl.minimum(q * 2.0, q + 2.0), q * 0.5 + 4.0)
        c = (cf + 12582912.0).to(tl.int32, bitcast=True) & 0xF
        return c | ((v.to(tl.int32, bitcast=True) >> 28) & 8)

    @triton.jit
    def _piece(x_j, sc, fc, ok3, SR: tl.constexpr, idx, key, PRESCALE: tl.constexpr, prescale,
               WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, USE_ASM: tl.constexpr, PACK: tl.constexpr = 4):
        if PRESCALE:
            x_j = x_j * prescale
        v = x_j * sc
        q = _fp4_round(v, SR, idx, key)
        if WRITE_CARRIER:
            qs = (q.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
            byte = _e4m3_bits(qs * fc, USE_ASM, PACK)
        else:
            byte = tl.zeros(v.shape, tl.uint8)
        if WRITE_FP4:
            code = tl.where(ok3, _fp4_code(q, v), 0)
        else:
            code = tl.zeros(v.shape, tl.int32)
        return byte, code

    @triton.jit
    def _pack4(c):
        """[BR, 4, 8] codes -> [BR, 4, 4] bytes (low nibble = lower index)."""
        BR: tl.constexpr = c.shape[0]
        lo, hi = tl.split(tl.reshape(c, [BR, 4, 4, 2]))
        return (lo | (hi << 4)).to(tl.uint8)

    @triton.jit
    def _blk_tile(
        pid_r, pid_k,
        x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr,
        R, K, Rc,
        sx_r, sx_k, si_r, si_k, Kc, Kq, gs_sr, gs_sk,
        key, inv_sqrt, prescale,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr,
        WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, IDX64: tl.constexpr, KEY_PTR: tl.constexpr,
        USE_ASM: tl.constexpr,
        JOIN_STORE: tl.constexpr,
        FOLD: tl.constexpr = False,
    ):
        """Same contract as ``_mxfp4_kernel`` for ROT in (0, 2, 4, 8, 16, 32). The 128-wide tile is
        loaded as four pieces x0..x3 of shape [BR, 4, 8] (piece j = elements 8j..8j+7 of each MX
        block), so each thread holds whole MX blocks: block maxima and rotation stages h >= 8 are
        register-local; stages h < 8 stay inside a thread's 8 contiguous values."""
        if KEY_PTR:  # the seed read from device memory (refreshed between CUDA-graph replays)
            key = tl.load(key_ptr)
        if IDX64:
            rows = pid_r.to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
            kbase = pid_k.to(tl.int64) * 128
        else:
            rows = pid_r * BR + tl.arange(0, BR)
            kbase = pid_k * 128
        r3 = rows[:, None, None]
        blk = tl.arange(0, 4)[None, :, None]
        ee = tl.arange(0, 8)[None, None, :]
        c0 = kbase + blk * 32 + ee                     # [1, 4, 8] columns of piece 0
        c1 = c0 + 8
        c2 = c0 + 16
        c3 = c0 + 24
        rm = r3 < R
        xp = x_ptr + r3 * sx_r
        x0 = tl.load(xp + c0 * sx_k, mask=rm & (c0 < K), other=0.0).to(tl.float32)
        x1 = tl.load(xp + c1 * sx_k, mask=rm & (c1 < K), other=0.0).to(tl.float32)
        x2 = tl.load(xp + c2 * sx_k, mask=rm & (c2 < K), other=0.0).to(tl.float32)
        x3 = tl.load(xp + c3 * sx_k, mask=rm & (c3 < K), other=0.0).to(tl.float32)

        if ROT > 0:
            if HAS_SIGNS:
                lb = blk * 32 + ee
                x0 = x0 * tl.load(signs_ptr + lb % ROT)
                x1 = x1 * tl.load(signs_ptr + (lb + 8) % ROT)
                x2 = x2 * tl.load(signs_ptr + (lb + 16) % ROT)
                x3 = x3 * tl.load(signs_ptr + (lb + 24) % ROT)
            if ROT > 1:
                x0 = _bfly8(x0, BR, 1)
                x1 = _bfly8(x1, BR, 1)
                x2 = _bfly8(x2, BR, 1)
                x3 = _bfly8(x3, BR, 1)
            if ROT > 2:
                x0 = _bfly8(x0, BR, 2)
                x1 = _bfly8(x1, BR, 2)
                x2 = _bfly8(x2, BR, 2)
                x3 = _bfly8(x3, BR, 2)
            if ROT > 4:
                x0 = _bfly8(x0, BR, 4)
                x1 = _bfly8(x1, BR, 4)
                x2 = _bfly8(x2, BR, 4)
                x3 = _bfly8(x3, BR, 4)
            if ROT > 8:
                t0 = x0 - x1
                x0 = x0 + x1
                x1 = t0
                t2 = x2 - x3
                x2 = x2 + x3
                x3 = t2
            if ROT > 16:
                t0 = x0 - x2
                x0 = x0 + x2
                x2 = t0
                t1 = x1 - x3
                x1 = x1 + x3
                x3 = t1
            if not FOLD:   # FOLD: the 1/sqrt(ROT) normalization goes into the block scales (below)
                x0 = x0 * inv_sqrt
                x1 = x1 * inv_sqrt
                x2 = x2 * inv_sqrt
                x3 = x3 * inv_sqrt
            if HAS_SIGNS:  # signs turn padding zeros into -0; the reference pads +0 past whole rotation
                # blocks, and padding rows (up to Rc) hold +0
                Kr = ((K + ROT - 1) // ROT) * ROT
                x0 = tl.where((c0 < Kr) & rm, x0, 0.0)
                x1 = tl.where((c1 < Kr) & rm, x1, 0.0)
                x2 = tl.where((c2 < Kr) & rm, x2, 0.0)
                x3 = tl.where((c3 < Kr) & rm, x3, 0.0)

        # ---- block scales: |x| maximum per MX block (NaN propagates), as the reference
        m = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1), propagate_nan=tl.PropagateNan.ALL),
                       tl.maximum(tl.abs(x2), tl.abs(x3), propagate_nan=tl.PropagateNan.ALL),
                       propagate_nan=tl.PropagateNan.ALL)
        # the last 8 in-thread values by their bit patterns (ordered as the values; NaN above all)
        abits = tl.max(m.to(tl.int32, bitcast=True), axis=2)             # [BR, 4]
        if FOLD:   # the normalized block maximum (exact: see _fold_applies)
            abits = (abits.to(tl.float32, bitcast=True) * inv_sqrt).to(tl.int32, bitcast=True)
        ok = abits < 0x7F800000                                           # not NaN / Inf
        abits = tl.where(ok, abits, 0)
        s, nz = _block_scale(abits, RULE)
        code_sc = tl.where(ok, s + 127, 255)
        if FOLD:
            sc = (_pow2n(-s) * inv_sqrt)[:, :, None]
        else:
            sc = _pow2n(-s)[:, :, None]
        ok3 = ok[:, :, None]

        if WRITE_CARRIER:
            live = ok & nz
            G, kexp = _carrier_exp(s, live, GROUP_ROWS)
            inexact = live & (kexp < -8)
            fc = tl.where(ok, _pow2n(tl.maximum(kexp, -126)), float("nan"))[:, :, None]
        else:
            fc = sc

        if SR:
            if IDX64:
                ri = r3.to(tl.int64) * si_r
                i0 = ri + c0.to(tl.int64) * si_k
                i1 = ri + c1.to(tl.int64) * si_k
                i2 = ri + c2.to(tl.int64) * si_k
                i3 = ri + c3.to(tl.int64) * si_k
            else:   # every index below 2**31 (IDX64 counts the index strides too)
                ri = r3 * si_r
                i0 = ri + c0 * si_k
                i1 = ri + c1 * si_k
                i2 = ri + c2 * si_k
                i3 = ri + c3 * si_k
        else:
            i0 = 0
            i1 = 0
            i2 = 0
            i3 = 0
        b0, q0 = _piece(x0, sc, fc, ok3, SR, i0, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM)
        b1, q1 = _piece(x1, sc, fc, ok3, SR, i1, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM)
        b2, q2 = _piece(x2, sc, fc, ok3, SR, i2, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM)
        b3, q3 = _piece(x3, sc, fc, ok3, SR, i3, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM)

        if WRITE_FP4:
            fb = fp4_ptr + r3 * (Kq // 2)
            if JOIN_STORE:   # the block's 16 bytes in one store
                p01 = tl.reshape(tl.permute(tl.join(_pack4(q0), _pack4(q1)), (0, 1, 3, 2)), [BR, 4, 8])
                p23 = tl.reshape(tl.permute(tl.join(_pack4(q2), _pack4(q3)), (0, 1, 3, 2)), [BR, 4, 8])
                pp = tl.reshape(tl.permute(tl.join(p01, p23), (0, 1, 3, 2)), [BR, 4, 16])
                jb = kbase // 2 + blk * 16 + tl.arange(0, 16)[None, None, :]
                tl.store(fb + jb, pp, mask=rm & (jb * 2 < Kq))
            else:
                jb = kbase // 2 + blk * 16 + tl.arange(0, 4)[None, None, :]    # byte columns of piece 0
                tl.store(fb + jb, _pack4(q0), mask=rm & (jb * 2 < Kq))
                tl.store(fb + jb + 4, _pack4(q1), mask=rm & ((jb + 4) * 2 < Kq))
                tl.store(fb + jb + 8, _pack4(q2), mask=rm & ((jb + 8) * 2 < Kq))
                tl.store(fb + jb + 12, _pack4(q3), mask=rm & ((jb + 12) * 2 < Kq))
            r2 = rows[:, None]
            bidx = kbase // 32 + tl.arange(0, 4)[None, :]
            tl.store(sc_ptr + r2 * (Kq // 32) + bidx, code_sc.to(tl.uint8), mask=(r2 < R) & (bidx * 32 < Kq))

        if WRITE_CARRIER:
            if JOIN_STORE:  # one 32-byte run per thread and block: join the pieces back in column order
                b01 = tl.reshape(tl.permute(tl.join(b0, b1), (0, 1, 3, 2)), [BR, 4, 16])
                b23 = tl.reshape(tl.permute(tl.join(b2, b3), (0, 1, 3, 2)), [BR, 4, 16])
                bb = tl.reshape(tl.permute(tl.join(b01, b23), (0, 1, 3, 2)), [BR, 4, 32])
                cb = kbase + blk * 32 + tl.arange(0, 32)[None, None, :]
                tl.store(car_ptr + r3 * Kc + cb, bb, mask=r3 < Rc)
            else:  # four 8-byte stores per thread and block, straight from the pieces' registers
                cp = car_ptr + r3 * Kc
                mc = r3 < Rc
                tl.store(cp + c0, b0, mask=mc)
                tl.store(cp + c1, b1, mask=mc)
                tl.store(cp + c2, b2, mask=mc)
                tl.store(cp + c3, b3, mask=mc)
            gval = _pow2(G - 6)
            if GROUP_ROWS == 1:
                tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
            else:
                tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
            bad = inexact & (rows[:, None] < R)
            tl.atomic_add(cnt_ptr + tl.zeros_like(s), 1, mask=bad)   # rare: usually no lane is active


    @triton.jit(do_not_specialize=["key"])
    def _mxfp4_blk_kernel(
        x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr,
        R, K, Rc,
        sx_r, sx_k, si_r, si_k, Kc, Kq, gs_sr, gs_sk,
        key, inv_sqrt, prescale,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr,
        WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, IDX64: tl.constexpr, KEY_PTR: tl.constexpr,
        USE_ASM: tl.constexpr,
        JOIN_STORE: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        """``_blk_tile`` on the tile of this program: (row block, reduction block) = program ids."""
        _blk_tile(
            tl.program_id(0), tl.program_id(1),
            x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr, R, K, Rc, sx_r, sx_k, si_r,
            si_k, Kc, Kq, gs_sr, gs_sk, key, inv_sqrt, prescale, BR, ROT, HAS_SIGNS, RULE, SR, PRESCALE,
            GROUP_ROWS, WRITE_CARRIER, WRITE_FP4, IDX64, KEY_PTR, USE_ASM, JOIN_STORE, FOLD)


if triton is not None:

    @triton.jit
    def _join_level(v, H: tl.constexpr):
        """Tuple of 2H tensors -> tuple of H: entry i joins entries i and i + H (a new last axis of 2)."""
        w = ()
        for i in tl.static_range(H):
            w = w + (tl.join(v[i], v[i + H]),)
        return w

    @triton.jit
    def _bfly_tuple(xs, H: tl.constexpr):
        """Butterfly stage H over a tuple of 32 tensors: pairs (a, b) = (xs[j], xs[j + H]) for j with bit H
        clear -> (a + b, a - b)."""
        w = ()
        for j in tl.static_range(32):
            if (j // H) % 2 == 0:
                w = w + (xs[j] + xs[j + H],)
            else:
                w = w + (xs[j - H] - xs[j],)
        return w

    @triton.jit
    def _join_tree(v, N: tl.constexpr, BR: tl.constexpr):
        """Tuple of N (16 or 32) [4, BR] tensors -> one [4, BR, N] tensor, in tuple order. Each level
        pairs entries half the remaining count apart, so the new axes come out in index order and the
        final reshape moves no data (every value stays in its thread's registers)."""
        if N == 32:
            v = _join_level(v, 16)
        v = _join_level(v, 8)
        v = _join_level(v, 4)
        v = _join_level(v, 2)
        v = _join_level(v, 1)
        return tl.reshape(v[0], [4, BR, N])

    @triton.jit
    def _cols_tile(
        pid_r, pid_k,
        x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr,
        R, K, Rc,
        sx_r, sx_k, si_r, si_k, Kc, Kq, gs_sr, gs_sk,
        key, inv_sqrt, prescale,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr,
        WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, IDX64: tl.constexpr, KEY_PTR: tl.constexpr,
        USE_ASM: tl.constexpr,
        PACK: tl.constexpr,
        FOLD: tl.constexpr = False,
    ):
        """Same contract as ``_mxfp4_kernel`` for ROT in (0, 2, 4, 8, 16, 32), made for inputs whose
        output rows are the contiguous axis (quantizing along columns: a [tokens, features] activation
        or gradient along tokens, for Wgrad). The 128-long reduction range is loaded as 32 tensors
        x[j] of shape [4, BR] (x[j][b, r] = element 32 b + j of the range, row r): every load is
        coalesced along the rows, and the block maxima and every rotation stage are element-wise
        between the 32 tensors. Only the 1-byte results change layout: joined into [4, BR, 32], each
        thread stores whole 32-byte carrier blocks (16-byte FP4 blocks) of the transposed output."""
        if KEY_PTR:  # the seed read from device memory (refreshed between CUDA-graph replays)
            key = tl.load(key_ptr)
        if IDX64:
            rows = pid_r.to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
            kbase = pid_k.to(tl.int64) * 128
        else:
            rows = pid_r * BR + tl.arange(0, BR)
            kbase = pid_k * 128
        r2 = rows[None, :]                                  # [1, BR]
        kb = kbase + tl.arange(0, 4)[:, None] * 32          # [4, 1] first column of each MX block
        rm = r2 < R
        xp = x_ptr + r2 * sx_r
        xs = ()
        for j in tl.static_range(32):
            xs = xs + (tl.load(xp + (kb + j) * sx_k, mask=rm & (kb + j < K), other=0.0).to(tl.float32),)

        if ROT > 0:
            if HAS_SIGNS:
                w = ()
                for j in tl.static_range(32):
                    w = w + (xs[j] * tl.load(signs_ptr + j % ROT),)
                xs = w
            if ROT > 1:
                xs = _bfly_tuple(xs, 1)
            if ROT > 2:
                xs = _bfly_tuple(xs, 2)
            if ROT > 4:
                xs = _bfly_tuple(xs, 4)
            if ROT > 8:
                xs = _bfly_tuple(xs, 8)
            if ROT > 16:
                xs = _bfly_tuple(xs, 16)
            w = ()
            for j in tl.static_range(32):
                if FOLD:   # the 1/sqrt(ROT) normalization goes into the block scales (below)
                    v = xs[j]
                else:
                    v = xs[j] * inv_sqrt
                if HAS_SIGNS:  # signs turn padding zeros into -0: +0 past whole rotation blocks and rows
                    v = tl.where(rm & (kb + j < ((K + ROT - 1) // ROT) * ROT), v, 0.0)
                w = w + (v,)
            xs = w

        # ---- block scales: |x| maximum per MX block by bit pattern (ordered as the values; NaN above all)
        abits = tl.abs(xs[0]).to(tl.int32, bitcast=True)
        for j in tl.static_range(1, 32):
            abits = tl.maximum(abits, tl.abs(xs[j]).to(tl.int32, bitcast=True))
        if FOLD:   # the normalized block maximum (exact: see _fold_applies)
            abits = (abits.to(tl.float32, bitcast=True) * inv_sqrt).to(tl.int32, bitcast=True)
        ok = abits < 0x7F800000                                           # not NaN / Inf
        abits = tl.where(ok, abits, 0)
        s, nz = _block_scale(abits, RULE)                                 # [4, BR]
        code_sc = tl.where(ok, s + 127, 255)
        if FOLD:
            sc = _pow2n(-s) * inv_sqrt
        else:
            sc = _pow2n(-s)

        if WRITE_CARRIER:
            live = ok & nz
            s_live = tl.where(live, s, -127)
            if GROUP_ROWS == 1:
                G = tl.maximum(tl.max(s_live, axis=0), -120)              # [BR]
                G2 = G[None, :]
            else:
                G = tl.maximum(tl.max(tl.max(s_live, axis=0), axis=0), -120)
                G2 = G
            kexp = s - G2 + 6
            inexact = live & (kexp < -8)
            fc = tl.where(ok, _pow2n(tl.maximum(kexp, -126)), float("nan"))
        else:
            fc = sc

        bs = ()
        qs = ()
        for j in tl.static_range(32):
            if SR:
                if IDX64:
                    idx = r2.to(tl.int64) * si_r + (kb + j).to(tl.int64) * si_k
                else:
                    idx = r2 * si_r + (kb + j) * si_k
            else:
                idx = 0
            b, q = _piece(xs[j], sc, fc, ok, SR, idx, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4,
                          USE_ASM, PACK)
            bs = bs + (b,)
            qs = qs + (q,)

        r3 = rows[None, :, None]
        kb3 = kb[:, :, None]
        if WRITE_FP4:
            pk = ()
            for i in tl.static_range(16):
                pk = pk + ((qs[2 * i] | (qs[2 * i + 1] << 4)).to(tl.uint8),)
            jb = kb3 // 2 + tl.arange(0, 16)[None, None, :]
            tl.store(fp4_ptr + r3 * (Kq // 2) + jb, _join_tree(pk, 16, BR), mask=(r3 < R) & (jb * 2 < Kq))
            bi = kb // 32
            tl.store(sc_ptr + r2 * (Kq // 32) + bi, code_sc.to(tl.uint8), mask=rm & (kb < Kq))

        if WRITE_CARRIER:
            cb = kb3 + tl.arange(0, 32)[None, None, :]
            tl.store(car_ptr + r3 * Kc + cb, _join_tree(bs, 32, BR), mask=r3 < Rc)
            gval = _pow2(G - 6)
            if GROUP_ROWS == 1:
                tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
            else:
                tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
            bad = inexact & rm
            tl.atomic_add(cnt_ptr + tl.zeros_like(s), 1, mask=bad)   # rare: usually no lane is active


    @triton.jit(do_not_specialize=["key"])
    def _mxfp4_cols_kernel(
        x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr,
        R, K, Rc,
        sx_r, sx_k, si_r, si_k, Kc, Kq, gs_sr, gs_sk,
        key, inv_sqrt, prescale,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr,
        WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, IDX64: tl.constexpr, KEY_PTR: tl.constexpr,
        USE_ASM: tl.constexpr,
        PACK: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        """``_cols_tile`` on the tile of this program: (row block, reduction block) = program ids."""
        _cols_tile(
            tl.program_id(0), tl.program_id(1),
            x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr, R, K, Rc, sx_r, sx_k, si_r,
            si_k, Kc, Kq, gs_sr, gs_sk, key, inv_sqrt, prescale, BR, ROT, HAS_SIGNS, RULE, SR, PRESCALE,
            GROUP_ROWS, WRITE_CARRIER, WRITE_FP4, IDX64, KEY_PTR, USE_ASM, PACK, FOLD)

    # the kernels above must spell out their arguments (Triton binds a kernel's signature by name)

    @triton.jit(do_not_specialize=["key_a", "key_b"])
    def _mxfp4_dual_kernel(
        x_ptr, cnt_ptr,
        sg_a, car_a, gs_a, kp_a,
        sg_b, car_b, gs_b, kp_b,
        M, K, sx_m, sx_k,
        Rc_a, si_ra, si_ka, Kc_a, Kq_a, gsr_a, gsk_a,
        Rc_b, si_rb, si_kb, Kc_b, Kq_b, gsr_b, gsk_b,
        nr_a, nk_a, nr_b, nk_b, F,
        key_a, inv_a, ps_a, key_b, inv_b, ps_b,
        BR_A: tl.constexpr, ROT_A: tl.constexpr, HAS_SIGNS_A: tl.constexpr, RULE_A: tl.constexpr,
        SR_A: tl.constexpr, PRESCALE_A: tl.constexpr, KEY_PTR_A: tl.constexpr,
        BR_B: tl.constexpr, ROT_B: tl.constexpr, HAS_SIGNS_B: tl.constexpr, RULE_B: tl.constexpr,
        SR_B: tl.constexpr, PRESCALE_B: tl.constexpr, KEY_PTR_B: tl.constexpr, GROUP_ROWS_B: tl.constexpr,
        PACK_B: tl.constexpr,
        IDX64: tl.constexpr, USE_ASM: tl.constexpr, JOIN_STORE: tl.constexpr, SEQ: tl.constexpr,
        FOLD_A: tl.constexpr, FOLD_B: tl.constexpr, CAR_B: tl.constexpr = True, FP4_B: tl.constexpr = False,
    ):
        """Both FP8-carrier operands of a row-major (M, K) tensor from one read of it: A quantized along
        rows (K; ``_blk_tile``, 1x128 group scales) and B along columns (M; ``_cols_tile``). Programs come
        in groups of ``128 / BR_A`` A tiles and ``128 / BR_B`` B tiles that cover the same 128 x 128 block
        of the input, so the B tiles read what the A tiles just brought into the L2 cache (one pass over
        HBM instead of two). ``SEQ``: one program runs all of a block's A tiles, then its B tiles (the B
        reads come after the A reads, from L2). ``F``: 128-wide blocks along K; ``nr_*``, ``nk_*``: each
        output's grid. ``FP4_B`` (with ``CAR_B`` False): B as packed FP4 codes (``car_b``) and E8M0 scales
        (``gs_b``) instead of the carrier."""
        NA: tl.constexpr = 128 // BR_A
        NB: tl.constexpr = 128 // BR_B
        pid = tl.program_id(0)
        if SEQ:
            tb = pid // F
            fb = pid % F
            for w in range(NA):
                pr = tb * NA + w
                if (pr < nr_a) & (fb < nk_a):
                    _blk_tile(pr, fb, x_ptr, sg_a, car_a, gs_a, cnt_ptr, cnt_ptr, cnt_ptr, kp_a,
                              M, K, Rc_a, sx_m, sx_k, si_ra, si_ka, Kc_a, Kq_a, gsr_a, gsk_a, key_a, inv_a, ps_a,
                              BR_A, ROT_A, HAS_SIGNS_A, RULE_A, SR_A, PRESCALE_A, 1, True, False, IDX64,
                              KEY_PTR_A, USE_ASM, JOIN_STORE, FOLD_A)
            for w in range(NB):
                pr = fb * NB + w
                if (pr < nr_b) & (tb < nk_b):
                    _cols_tile(pr, tb, x_ptr, sg_b, car_b, gs_b, car_b, gs_b, cnt_ptr, kp_b,
                               K, M, Rc_b, sx_k, sx_m, si_rb, si_kb, Kc_b, Kq_b, gsr_b, gsk_b, key_b, inv_b, ps_b,
                               BR_B, ROT_B, HAS_SIGNS_B, RULE_B, SR_B, PRESCALE_B, GROUP_ROWS_B, CAR_B, FP4_B,
                               IDX64, KEY_PTR_B, USE_ASM, PACK_B, FOLD_B)
        else:
            g = pid // (NA + NB)
            w = pid % (NA + NB)
            tb = g // F          # 128-row block of the input (tokens)
            fb = g % F           # 128-column block (features)
            if w < NA:
                pr = tb * NA + w
                if (pr < nr_a) & (fb < nk_a):
                    _blk_tile(pr, fb, x_ptr, sg_a, car_a, gs_a, cnt_ptr, cnt_ptr, cnt_ptr, kp_a,
                              M, K, Rc_a, sx_m, sx_k, si_ra, si_ka, Kc_a, Kq_a, gsr_a, gsk_a, key_a, inv_a, ps_a,
                              BR_A, ROT_A, HAS_SIGNS_A, RULE_A, SR_A, PRESCALE_A, 1, True, False, IDX64,
                              KEY_PTR_A, USE_ASM, JOIN_STORE, FOLD_A)
            else:
                pr = fb * NB + (w - NA)
                if (pr < nr_b) & (tb < nk_b):
                    _cols_tile(pr, tb, x_ptr, sg_b, car_b, gs_b, car_b, gs_b, cnt_ptr, kp_b,
                               K, M, Rc_b, sx_k, sx_m, si_rb, si_kb, Kc_b, Kq_b, gsr_b, gsk_b, key_b, inv_b, ps_b,
                               BR_B, ROT_B, HAS_SIGNS_B, RULE_B, SR_B, PRESCALE_B, GROUP_ROWS_B, CAR_B, FP4_B,
                               IDX64, KEY_PTR_B, USE_ASM, PACK_B, FOLD_B)


@dataclass
class QuantOut:
    """Outputs of one fused quantize call over a 2-D view (rows R = outer axis, K = reduction).

    * ``carrier``: float8_e4m3fn (Rc, Kc), or None; ``gscale``: float32 group scales, shape
      (Rc, Kc/128) for 1x128 groups (stored outer-dim-major, as ``_scaled_mm`` wants) or
      (Rc/128, Kc/128) for 128x128; ``inexact``: int32 count of inexact carrier blocks.
    * ``packed``: uint8 (R, Kq/2) FP4 codes (low nibble = lower index); ``scales``: uint8 E8M0 (R, Kq/32).
    """

    R: int
    K: int
    carrier: torch.Tensor | None
    gscale: torch.Tensor | None
    group_rows: int
    inexact: torch.Tensor | None
    packed: torch.Tensor | None
    scales: torch.Tensor | None
    gs_base: torch.Tensor | None = None  # contiguous storage behind ``gscale`` (128x128: padded)


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def _f32(v: float) -> float:
    """``v`` rounded to float32 (the kernel's scalar arguments are float32)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def _i32(key: int) -> int:
    key &= 0xFFFFFFFF
    return key - (1 << 32) if key >= (1 << 31) else key


def _carrier_buffers(Rc: int, Kc: int, group_rows: int, dev):
    """FP8-carrier output buffers: (carrier bytes (Rc, Kc), group scales view, their contiguous storage,
    group-scale strides per row group and per K group)."""
    car = torch.empty((Rc, Kc), dtype=torch.uint8, device=dev)
    if group_rows == 1:
        gs_base = torch.empty((Kc // TILE_K, Rc), dtype=torch.float32, device=dev)
        return car, gs_base.t(), gs_base, 1, Rc      # outer-dim-major (Rc, Kc/128) view
    # cuBLAS wants the 128x128 scale rows' leading dimension padded to a multiple of 4
    # (the padding columns are never read)
    ld = _ceil(Kc // TILE_K, 4)
    gs_base = torch.empty((Rc // 128, ld), dtype=torch.float32, device=dev)
    return car, gs_base[:, : Kc // TILE_K], gs_base, ld, 1


def _needs_idx64(Rp: int, Kc: int, Kq: int, sx_r: int, sx_k: int, si) -> bool:
    """32-bit offsets unless some offset (masked lanes of the last tiles included, ``Rp`` rows of
    programs) could pass 2**31 - 1."""
    return FORCE_IDX64 or max(Rp * abs(sx_r) + Kc * abs(sx_k), Rp * Kc, Rp * Kq,
                              Rp * max(si[0], 1) + Kc * max(si[1], 1)) >= 2**31 - 1


def quantize_mxfp4_2d(x: torch.Tensor, axis: int, *, rot: int = 0, signs: torch.Tensor | None = None,
                      rounding: str = "nearest", scale_rule: str = "floor", key: int = 0,
                      prescale: float = 1.0, index_strides: tuple[int, int] | None = None,
                      carrier: bool = True, fp4: bool = True, group_rows: int = 1,
                      row_multiple: int = 16, block_rows: int | None = None, num_warps: int | None = None,
                      k_multiple: int = TILE_K,
                      counter: torch.Tensor | None = None, key_tensor: torch.Tensor | None = None,
                      _check: bool = True) -> QuantOut:
    """Quantize a 2-D tensor to MXFP4 along ``axis`` (0 or 1) in one fused pass.

    ``index_strides``: logical (outer, reduction) strides of the element index used for stochastic
    rounding (defaults to ``x``'s contiguous layout). The carrier rows are padded to
    ``row_multiple`` (128 for 128x128 groups); padded rows hold zeros. ``counter``: an int32
    tensor of one element that the count of inexact carrier blocks is added to (and returned as
    ``inexact``), instead of a fresh zeroed one per call (saves a memset launch). ``key_tensor``: an
    int32 tensor whose first element the kernel reads as the stochastic-rounding key instead of ``key``
    (a CUDA graph then replays with whatever key is stored there; ``mxtrain.fast`` refreshes it).
    """
    assert x.ndim == 2 and axis in (0, 1)
    if signs is not None:
        signs = signs.to(device=x.device, dtype=torch.float32).contiguous()
    pkey = None
    st = _settings.current()
    if _use_plans(x):
        # everything the launch depends on, down to the 16-byte alignment Triton specializes on
        pkey = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() & 15, axis, rot,
                None if signs is None else signs.data_ptr() & 15, rounding, scale_rule, prescale, index_strides,
                carrier, fp4, group_rows, row_multiple, block_rows, num_warps, k_multiple,
                None if counter is None else counter.data_ptr() & 15,
                None if key_tensor is None else key_tensor.data_ptr() & 15, _check, FORCE_IDX64, st.launch_key)
        plan = CACHES.plans.get(pkey)
        if plan is not None:
            return plan(x, signs, key, counter, key_tensor)
    if axis == 1:
        R, K = x.shape
        sx_r, sx_k = x.stride(0), x.stride(1)
        si = index_strides or (x.shape[1], 1)
    else:
        K, R = x.shape
        sx_r, sx_k = x.stride(1), x.stride(0)
        si = index_strides or (1, x.shape[1])
    dev = x.device
    Kq = _ceil(_ceil(max(K, 1), rot or 1), 32)   # the reference pads to whole rotation blocks first
    Kc = _ceil(max(K, 1), k_multiple)  # fp8_carrier uses 512: cuBLAS wants K/128 % 4 == 0
    if group_rows == 128:
        row_multiple = 128
    kern = kernel_for(axis, rot, fp4, rows_contiguous=sx_r == 1 and sx_k != 1, kernel=st.qkernel)
    if kern == "cols":
        # 4 x BR values per load, 2 of them a thread (the best on an H100, BENCHMARKS.md; with stochastic
        # rounding, uncapped, 32 rows x 2 warps: 153.8 us against 163.3 for 64 x 4 without rotation)
        BR = block_rows or (128 if group_rows == 128 else (32 if rounding == "stochastic" else 64))
        num_warps = num_warps or max(1, BR // 16)
    elif kern == "blocks":
        # best on an H100 (BENCHMARKS.md): small tiles along rows, 64 rows along columns, 128 for 128x128 groups
        BR = block_rows or (128 if group_rows == 128 else (16 if axis == 1 else 64))
        # 8 rows x 4 MX blocks per warp (32 values a thread); 128x128 groups: 8 warps (64 values a thread)
        num_warps = num_warps or (8 if group_rows == 128 else max(1, min(16, BR // 8)))
    else:
        BR = block_rows or (128 if group_rows == 128 else (64 if axis == 1 else 32))  # tuned on H100 (BENCHMARKS.md)
        num_warps = num_warps or (8 if BR >= 128 else 4)
    Rc = _ceil(max(R, 1), max(row_multiple, 1)) if carrier else R
    Rgrid = Rc if carrier else R
    if carrier:
        car, gs, gs_base, gsr, gsk = _carrier_buffers(Rc, Kc, group_rows, dev)
        cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
    else:
        car = gs = None
        cnt = counter if counter is not None else torch.empty((1,), dtype=torch.int32, device=dev)
        gsr = gsk = 0
    if fp4:
        packed = torch.empty((R, Kq // 2), dtype=torch.uint8, device=dev)
        sc = torch.empty((R, Kq // 32), dtype=torch.uint8, device=dev)
    else:
        packed = sc = None
    dummy = cnt
    if signs is not None:
        assert signs.numel() == rot
    inv_sqrt = _f32(1.0 / math.sqrt(rot)) if rot else 1.0
    ps = _f32(prescale)
    grid = (triton.cdiv(max(Rgrid, 1), BR), Kc // TILE_K)
    idx64 = _needs_idx64(grid[0] * BR, Kc, Kq, sx_r, sx_k, si)
    compiled = kfn = consts = None
    if R > 0 and K > 0:
        args = (x, signs if signs is not None else dummy,
                car if carrier else dummy, gs if carrier else dummy,
                packed if fp4 else dummy, sc if fp4 else dummy, cnt, key_tensor if key_tensor is not None else dummy,
                R, K, Rgrid, sx_r, sx_k, si[0], si[1], Kc, Kq, gsr, gsk,
                _i32(key), inv_sqrt, ps)
        consts = dict(BR=BR, ROT=rot, HAS_SIGNS=signs is not None, RULE=RULE_ID[scale_rule],
                      SR=rounding == "stochastic", PRESCALE=prescale != 1.0, GROUP_ROWS=group_rows,
                      WRITE_CARRIER=carrier, WRITE_FP4=fp4, IDX64=idx64, KEY_PTR=key_tensor is not None)
        if kern == "cols":
            per_thread = 4 * BR // (32 * num_warps)   # values of each [4, BR] tensor a thread holds
            assert per_thread in (2, 4, 8, 16), "cols kernel: 4 x block_rows must be 64, 128, ... x 32 x num_warps"
            kfn = _mxfp4_cols_kernel
            consts.update(USE_ASM=dev.type == "cuda", PACK=2 if per_thread == 2 else 4,
                          FOLD=_fold_applies(x.dtype, rot, prescale, st.qfold))
        elif kern == "blocks":
            kfn = _mxfp4_blk_kernel
            consts.update(USE_ASM=dev.type == "cuda", JOIN_STORE=st.qjoin,
                          FOLD=_fold_applies(x.dtype, rot, prescale, st.qfold))
        else:
            kfn = _mxfp4_kernel
        compiled = kfn[grid](*args, **consts, num_warps=num_warps, enable_fp_fusion=False,
                             **_launch_opts(kern + ("128" if kern == "blocks" and group_rows == 128 else ""), dev,
                                            sr=rounding == "stochastic", maxnreg=st.qmaxnreg))
    base = None
    if carrier:
        base = gs_base
    out = QuantOut(R, K, car.view(torch.float8_e4m3fn) if carrier else None, gs, group_rows,
                   cnt if carrier else None, packed, sc, base)
    if (carrier and _check and dev.type in SELF_CHECK_DEVICES and R > 0 and K > 0
            and not torch.compiler.is_compiling()
            and not _config_ok(x, axis, rot, signs is not None, scale_rule, rounding == "stochastic", prescale,
                               group_rows, BR, num_warps, k_multiple, fp4, R, K)):
        # safety net: this variant's fused carrier failed its self-check on this GPU; rebuild the
        # carrier from FP4 codes and scales of the FP4-only kernel (bit-exact on GPU) with torch ops
        q2 = quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding=rounding, scale_rule=scale_rule,
                               key=key, prescale=prescale, index_strides=index_strides, carrier=False,
                               fp4=True, group_rows=group_rows, block_rows=block_rows, k_multiple=k_multiple,
                               key_tensor=key_tensor, _check=False)
        out.packed, out.scales = q2.packed, q2.scales
        carrier_from_fp4(out, k_multiple, row_multiple)
        if not fp4:
            out.packed = out.scales = None
        return out
    if pkey is not None and pkey not in CACHES.plans:   # (bounded: least recently used plans are dropped)
        CACHES.plans[pkey] = _Plan.make(kfn, compiled, grid, args, consts, out, Kc, group_rows)
    return out


# Both operands of one activation from one read (``quantize_mxfp4_dual``): the forward's X (Fprop along
# features, Wgrad along tokens) and the backward's dY (Dgrad along features, Wgrad along tokens).
# Measured on an H100 (BENCHMARKS.md, "One-pass dual quantize"): with launch plans
# 1.08-1.22x faster than the two passes without rotations, from 2048x4096 to 16384x14336; with H16 1.01x
# alone and no faster inside a whole MXLinear call (the passes are bound by their arithmetic as much as by
# memory, so sharing the read pays little). The ``dual`` setting (MXTRAIN_QDUAL): "auto" (default: one pass
# only without rotations), "on" (always where the kernels apply), "off" (never).
# (A block rows, B block rows, warps) for B with 1x128 / 128x128 groups; SEQ: one program per 128x128
# input block (A tiles, then B tiles) instead of one per tile
DUAL_CONFIG = {False: (32, 64, 4), True: (64, 128, 8)}
DUAL_SEQ = False
_SIDE_KEYS = ("rot", "signs", "rounding", "scale_rule", "key", "prescale", "index_strides", "key_tensor", "group_rows")


def dual_applies(x: torch.Tensor, rot_a: int, rot_b: int, group_rows_a: int = 1, sr: bool = False) -> bool:
    """Whether ``quantize_mxfp4_dual`` runs one fused pass for ``x`` (else it runs two): a row-major 2-D
    tensor, FP8-carrier outputs, A with 1x128 groups, and rotations the blocks and cols kernels take (with
    the ``dual`` setting ``auto``: no rotation and no stochastic rounding on either side (``sr``), where one
    pass measured faster; with SR on both sides one pass took 394 us against ~265 us for the two passes,
    H100, 16384 x 4096; ``off``: never)."""
    st = _settings.current()
    if st.dual == "off" or (st.dual == "auto" and (rot_a or rot_b or sr)):
        return False
    return (x.ndim == 2 and x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) == 1
            and group_rows_a == 1 and kernel_for(1, rot_a, False, kernel=st.qkernel) == "blocks"
            and kernel_for(0, rot_b, False, rows_contiguous=True, kernel=st.qkernel) == "cols")


def quantize_mxfp4_dual(x: torch.Tensor, a: dict, b: dict, *, k_multiple: int = TILE_K,
                        counter: torch.Tensor | None = None, block_rows: tuple[int, int] | None = None,
                        num_warps: int | None = None, sequential: bool | None = None,
                        fp4_b: bool = False, _check: bool = True) -> tuple[QuantOut, QuantOut]:
    """The FP8-carrier outputs of ``quantize_mxfp4_2d(x, 1, **a, carrier=True, fp4=False)`` and
    ``quantize_mxfp4_2d(x, 0, **b, carrier=True, fp4=False)`` (bit-identical) from one pass over ``x``
    where ``dual_applies``, else from those two calls. ``a`` and ``b`` take the keyword options of
    ``quantize_mxfp4_2d`` (rot, signs, rounding, scale_rule, key, prescale, index_strides, key_tensor,
    group_rows). Both outputs add their inexact blocks to one counter (``counter``, or a new one).
    ``fp4_b``: B as ``quantize_mxfp4_2d(x, 0, **b, carrier=False, fp4=True)`` makes it (packed codes and
    E8M0 scales, ``group_rows`` kept for ``expand.carrier_from_packed``; nothing counted for B).
    ``block_rows`` (A, B), ``num_warps``, ``sequential``: kernel configuration (benchmark sweeps)."""
    for side in (a, b):
        bad = set(side) - set(_SIDE_KEYS)
        if bad:
            raise TypeError(f"quantize_mxfp4_dual: unknown option(s) {sorted(bad)}; use {', '.join(_SIDE_KEYS)}")
    if x.ndim != 2:
        raise ValueError(f"quantize_mxfp4_dual: x must be 2-D, got shape {tuple(x.shape)}")
    ra, rb = a.get("rot", 0), b.get("rot", 0)
    cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=x.device)
    pkey = None
    if _use_plans(x):
        # everything the launch depends on (as quantize_mxfp4_2d's plans), for both sides
        sides = []
        for side in (a, b):
            sg, kt = side.get("signs"), side.get("key_tensor")
            sides.append((side.get("rot", 0), None if sg is None else (sg.dtype, sg.is_contiguous(), sg.data_ptr() & 15),
                          side.get("rounding", "nearest"), side.get("scale_rule", "floor"), side.get("prescale", 1.0),
                          side.get("index_strides"), side.get("group_rows", 1),
                          None if kt is None else kt.data_ptr() & 15))
        # and what decided for one pass (the dual and qkernel settings, the self-check): a plan is only made
        # after dual_applies and the variant's self-check passed, so a hit skips both (host time per call)
        checked = _check and x.device.type in SELF_CHECK_DEVICES
        pkey = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() & 15, tuple(sides), k_multiple,
                cnt.data_ptr() & 15, block_rows, num_warps, sequential, DUAL_CONFIG[b.get("group_rows", 1) == 128],
                DUAL_SEQ, _settings.current().launch_key, checked, fp4_b)
        plan = CACHES.dual_plans.get(pkey)
        if plan is not None:
            return plan(x, a, b, cnt)
    sr = a.get("rounding", "nearest") == "stochastic" or b.get("rounding", "nearest") == "stochastic"
    if not dual_applies(x, ra, rb, a.get("group_rows", 1), sr=sr) or (
            _check and x.device.type in SELF_CHECK_DEVICES and not _dual_ok(x, a, b, k_multiple, fp4_b)):
        return tuple(quantize_mxfp4_2d(x, ax, **side, carrier=not fp, fp4=fp, k_multiple=k_multiple,
                                       counter=cnt, _check=_check) for ax, side, fp in ((1, a, False), (0, b, fp4_b)))
    M, K = x.shape
    dev = x.device
    st = _settings.current()
    gr_b = b.get("group_rows", 1)
    cfg = DUAL_CONFIG[gr_b == 128]
    nw = num_warps or cfg[2]
    bra, brb = block_rows or cfg[:2]
    seq = DUAL_SEQ if sequential is None else sequential
    BR = {1: bra, 0: brb}
    assert 128 % bra == 0 and brb in (64, 128) and (gr_b == 1 or brb == 128), (bra, brb, gr_b)
    pack = 4 * brb // (32 * nw)
    assert 4 * brb % (32 * nw) == 0 and pack in (2, 4, 8, 16), "dual kernel: 4 x block_rows[1] must be 64, 128, ... x 32 x num_warps"
    outs, args, consts, geo = [], [], {}, []
    for axis, side, R, Kr, sfx in ((1, a, M, K, "A"), (0, b, K, M, "B")):
        rot = side.get("rot", 0)
        signs = side.get("signs")
        if signs is not None:
            signs = signs.to(device=dev, dtype=torch.float32).contiguous()
            assert signs.numel() == rot
        gr = side.get("group_rows", 1)
        Kq = _ceil(_ceil(Kr, rot or 1), 32)
        Kc = _ceil(Kr, k_multiple)
        Rc = _ceil(R, 128 if gr == 128 else 16)
        si = side.get("index_strides") or ((K, 1) if axis == 1 else (1, K))
        kt = side.get("key_tensor")
        rounding = side.get("rounding", "nearest")
        prescale = side.get("prescale", 1.0)
        if axis == 0 and fp4_b:   # packed codes and scales take the carrier's and group scales' places
            car = torch.empty((R, Kq // 2), dtype=torch.uint8, device=dev)
            gs = torch.empty((R, Kq // 32), dtype=torch.uint8, device=dev)
            gsr = gsk = 0
            outs.append(QuantOut(R, Kr, None, None, gr, None, car, gs))
        else:
            car, gs, base, gsr, gsk = _carrier_buffers(Rc, Kc, gr, dev)
            outs.append(QuantOut(R, Kr, car.view(torch.float8_e4m3fn), gs, gr, cnt, None, None, base))
        nr, nk = triton.cdiv(Rc, BR[axis]), Kc // TILE_K
        sx = (x.stride(0), 1) if axis == 1 else (1, x.stride(0))
        geo.append((nr, nk, _needs_idx64(nr * BR[axis], Kc, Kq, sx[0], sx[1], si)))
        args.append(((signs if signs is not None else cnt), car, gs, kt if kt is not None else cnt,
                     (Rc, si[0], si[1], Kc, Kq, gsr, gsk),
                     (_i32(side.get("key", 0)), _f32(1.0 / math.sqrt(rot)) if rot else 1.0, _f32(prescale))))
        consts.update({f"BR_{sfx}": BR[axis], f"ROT_{sfx}": rot, f"HAS_SIGNS_{sfx}": signs is not None,
                       f"RULE_{sfx}": RULE_ID[side.get("scale_rule", "floor")], f"SR_{sfx}": rounding == "stochastic",
                       f"PRESCALE_{sfx}": prescale != 1.0, f"KEY_PTR_{sfx}": kt is not None,
                       f"FOLD_{sfx}": _fold_applies(x.dtype, rot, prescale, st.qfold)})
    consts.update(GROUP_ROWS_B=gr_b, PACK_B=2 if pack == 2 else 4, IDX64=geo[0][2] or geo[1][2],
                  USE_ASM=dev.type == "cuda", JOIN_STORE=st.qjoin, SEQ=seq, CAR_B=not fp4_b, FP4_B=fp4_b)
    (nr_a, nk_a, _), (nr_b, nk_b, _) = geo
    NA, NB = 128 // BR[1], 128 // BR[0]
    F = max(nk_a, triton.cdiv(nr_b, NB))
    T = max(triton.cdiv(nr_a, NA), nk_b)
    (sa, ca, ga, ka, dims_a, sc_a), (sb, cb, gb, kb, dims_b, sc_b) = args
    grid = (T * F * (1 if seq else NA + NB),)
    largs = (x, cnt, sa, ca, ga, ka, sb, cb, gb, kb, M, K, x.stride(0), 1, *dims_a, *dims_b,
             nr_a, nk_a, nr_b, nk_b, F, *sc_a, *sc_b)
    compiled = _mxfp4_dual_kernel[grid](*largs, **consts, num_warps=nw, enable_fp_fusion=False,
                                        **_launch_opts("dual", dev, sr=consts["SR_A"] or consts["SR_B"],
                                                       maxnreg=st.qmaxnreg))
    if pkey is not None:   # (bounded: least recently used plans are dropped)
        CACHES.dual_plans[pkey] = _DualPlan.make(compiled, grid, largs, consts, outs)
    return outs[0], outs[1]


# Extra Triton launch options per kernel ("blocks", "blocks128" = blocks with 128x128 groups, "cols",
# "tile", "dual") on NVIDIA GPUs. Register caps (maxnreg): the cols and dual kernels hold 32 tokens of a
# feature per thread (~127 registers, so 4 blocks of 128 threads per SM: 25 % occupancy under Nsight
# Compute), the blocks kernel with 128x128 groups 64 values per thread (~103 registers); capped at 80
# registers they ran 1.03-1.09x faster on an H100 with bit-identical output (64 and below much slower;
# the plain blocks kernel, 48 registers, 0.95x; BENCHMARKS.md).
# The cap is the ``qmaxnreg`` setting (MXTRAIN_QMAXNREG; 0: no cap); launch plans key on it. Which kernels
# take it: CAPPED_KERNELS (launch plans do not key on it: clear them after rebinding it).
CAPPED_KERNELS = ("cols", "dual", "blocks128")


def _launch_opts(kern: str, dev: torch.device, sr: bool = False, maxnreg: int | None = None) -> dict:
    """Launch options of one kernel (``maxnreg``: the register cap, default the ``qmaxnreg`` setting).
    Stochastic rounding (a hash per element) needs more registers: capped at 80 the cols kernel spilled and
    ran 2.2-2.7x slower without rotation (H100: 355-488 us against 152-163 us uncapped at 16384 x 4096) and
    2-5 % slower with H16 + signs, so SR variants run uncapped."""
    if dev.type != "cuda" or torch.version.hip is not None or _INTERPRET or sr:
        return {}
    cap = _settings.current().qmaxnreg if maxnreg is None else maxnreg
    return {"maxnreg": cap} if cap > 0 and kern in CAPPED_KERNELS else {}


class _DualPlan:
    """A dual-kernel launch called through its compiled kernel (see ``_Plan``): the generic Triton launch
    of this kernel's ~60 arguments cost more host time than the fused pass saves on mid-sized tensors
    (H100: 16.7M elements, one pass 185 us per call in a loop against 54 us for two planned passes)."""
    __slots__ = ("run", "ints", "tail", "bufs")

    @staticmethod
    def make(compiled, grid, largs, consts, outs):
        got = _direct_runner(_mxfp4_dual_kernel, compiled, grid, largs, consts,
                             ["key_a", "inv_a", "ps_a", "key_b", "inv_b", "ps_b"])
        if got is None or got[1][10] != "M":
            return None
        run, names = got
        n = len(largs)
        p = _DualPlan()
        p.run = run
        p.ints = tuple(largs[10:n - 6])
        p.tail = (largs[n - 5], largs[n - 4], largs[n - 2], largs[n - 1]) + tuple(consts[c] for c in names[n:])
        p.bufs = [(o.R, o.K, tuple(o.packed.shape), tuple(o.scales.shape), o.group_rows, "fp4") if o.carrier is None
                  else (o.R, o.K, tuple(o.carrier.shape), tuple(o.gs_base.shape), o.group_rows,
                        o.gscale.shape[1] if o.group_rows == 128 else None) for o in outs]
        return p

    def __call__(self, x, a, b, cnt):
        dev = x.device
        outs, ptrs = [], []
        for (R, Kr, cshape, gshape, gr, gcols), side in zip(self.bufs, (a, b)):
            car = torch.empty(cshape, dtype=torch.uint8, device=dev)
            if gcols == "fp4":   # packed codes (car) and E8M0 scales (gs)
                gs = torch.empty(gshape, dtype=torch.uint8, device=dev)
                outs.append(QuantOut(R, Kr, None, None, gr, None, car, gs))
            else:
                base = torch.empty(gshape, dtype=torch.float32, device=dev)
                gs = base.t() if gr == 1 else base[:, :gcols]
                outs.append(QuantOut(R, Kr, car.view(torch.float8_e4m3fn), gs, gr, cnt, None, None, base))
            sg, kt = side.get("signs"), side.get("key_tensor")
            if sg is not None and (sg.dtype != torch.float32 or not sg.is_contiguous() or sg.device != dev):
                sg = sg.to(device=dev, dtype=torch.float32).contiguous()
            ptrs += [cnt if sg is None else sg, car, gs, cnt if kt is None else kt]
        inv_a, ps_a, inv_b, ps_b = self.tail[:4]
        self.run(x, cnt, *ptrs, *self.ints, _i32(a.get("key", 0)), inv_a, ps_a, _i32(b.get("key", 0)), inv_b, ps_b,
                 *self.tail[4:])
        return outs[0], outs[1]


def _dual_ok(x: torch.Tensor, a: dict, b: dict, k_multiple: int, fp4_b: bool = False) -> bool:
    """Once per dual-kernel variant on a GPU: are both outputs bit-identical to the two single passes
    (themselves self-checked against the reference quantizer)? Runs the variant on a random tensor with
    the same dtype, options and divisibility of the sizes by 16."""
    M, K = x.shape

    def opt(side):
        s = side.get("signs")
        return (side.get("rot", 0), s is not None, side.get("rounding", "nearest"), side.get("scale_rule", "floor"),
                side.get("prescale", 1.0) != 1.0, side.get("group_rows", 1))
    st = _settings.current()
    vkey = (x.device.index, x.dtype, opt(a), opt(b), k_multiple, M % 16 == 0, K % 16 == 0, st.qjoin,
            DUAL_CONFIG[b.get("group_rows", 1) == 128], DUAL_SEQ, st.qfold, st.qmaxnreg, fp4_b)
    ok = CACHES.dual_verified.get(vkey)
    if ok is None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False   # no self-check inside a CUDA-graph capture (it copies from the host): two passes
    if ok is None:
        g = torch.Generator(device="cpu").manual_seed(4321)
        if x.device.type == "cpu":   # the interpreter (tests): fewer programs, the same edge cases
            Mt, Kt = (128 if M % 16 == 0 else 131), (256 if K % 16 == 0 else 261)
        else:
            Mt, Kt = (512 if M % 16 == 0 else 515), (1024 if K % 16 == 0 else 1041)
        xt = (torch.randn(Mt, Kt, generator=g) * torch.exp2(torch.randint(-12, 12, (Mt, 1), generator=g).float()))
        xt = xt.to(device=x.device, dtype=x.dtype)
        sides = []
        for i, side in enumerate((a, b)):
            t = {k: v for k, v in side.items() if k not in ("signs", "key_tensor", "index_strides")}
            if side.get("signs") is not None:
                t["signs"] = (torch.randint(0, 2, (side["rot"],), generator=g) * 2 - 1).float()
            if side.get("rounding") == "stochastic":
                t["key"] = 12345 + i
            sides.append(t)
        got = quantize_mxfp4_dual(xt, *sides, k_multiple=k_multiple, fp4_b=fp4_b, _check=False)
        want = [quantize_mxfp4_2d(xt, ax, **s, carrier=not fp, fp4=fp, k_multiple=k_multiple)
                for ax, s, fp in ((1, sides[0], False), (0, sides[1], fp4_b))]
        ok = all(torch.equal(p.packed, q.packed) and torch.equal(p.scales, q.scales) if q.carrier is None
                 else torch.equal(p.carrier.view(torch.uint8), q.carrier.view(torch.uint8))
                 and torch.equal(p.gscale, q.gscale) for p, q in zip(got, want))
        ok = ok and int(got[0].inexact.item()) == sum(int(w.inexact.item()) for w in want if w.inexact is not None)
        CACHES.dual_verified[vkey] = ok
        if not ok:
            import warnings
            warnings.warn(f"mxtrain: dual quantize variant {vkey} differed from two single passes on this GPU; "
                          "using two passes for it", RuntimeWarning, stacklevel=3)
    return ok


# Launch plans: a configuration quantized once (and, on GPUs, self-checked) is launched again through
# its compiled kernel directly, skipping Triton's generic launch path (argument binding, specialization,
# cache-key lookup): about 14 of the 22 us of host time a launch took on an H100's host
# (tools/host_overhead.py). Keyed by everything the launch depends on (shapes, strides, pointer
# alignment, every option; ``key``, the stochastic-rounding seed, is not specialized on). Kept in
# ``CACHES.plans`` / ``CACHES.dual_plans`` (LRU-bounded). The ``fast_launch`` setting (MXTRAIN_FAST_LAUNCH=0)
# turns them off.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_plans(x: torch.Tensor) -> bool:
    return x.is_cuda and not _INTERPRET and _settings.current().fast_launch


def _direct_runner(kfn, compiled, grid, args, consts, last_args: list):
    """(the compiled kernel bound to ``grid``, the kernel's argument names), or None where it cannot be called
    directly: the launch's positional ``args`` must end with ``last_args`` and be followed by exactly the
    constexprs in ``consts`` (what a launch plan passes)."""
    if compiled is None:
        return None
    try:
        names = list(kfn.arg_names)
        n = len(args)
        if (len(names) != n + len(consts) or names[n - len(last_args):n] != last_args
                or any(a not in consts for a in names[n:])):
            return None
        return compiled[tuple(grid) + (1,) * (3 - len(grid))], names
    except Exception:  # noqa: BLE001 - a Triton without this interface: keep the generic launch
        return None


class _Plan:
    __slots__ = ("run", "head", "tail", "R", "K", "carrier", "fp4", "group_rows", "car_shape", "gs_shape",
                 "gs_cols", "pk_shape", "sc_shape")

    @staticmethod
    def make(kfn, compiled, grid, args, consts, out: QuantOut, Kc: int, group_rows: int):
        """A plan for this launch, or None where the compiled kernel cannot be called directly."""
        got = _direct_runner(kfn, compiled, grid, args, consts, ["key", "inv_sqrt", "prescale"])
        if got is None:
            return None
        run, names = got
        n = len(args)
        p = _Plan()
        p.run = run
        p.head = tuple(args[8:n - 3])   # the integer sizes and strides
        p.tail = tuple(args[n - 2:]) + tuple(consts[a] for a in names[n:])
        p.R, p.K, p.group_rows = out.R, out.K, group_rows
        p.carrier, p.fp4 = out.carrier is not None, out.packed is not None
        if p.carrier:
            p.car_shape = tuple(out.carrier.shape)
            p.gs_shape = tuple(out.gs_base.shape)
            p.gs_cols = Kc // TILE_K
        if p.fp4:
            p.pk_shape, p.sc_shape = tuple(out.packed.shape), tuple(out.scales.shape)
        return p

    def __call__(self, x: torch.Tensor, signs, key: int, counter, key_tensor=None) -> QuantOut:
        dev = x.device
        car = gs = base = packed = sc = None
        if self.carrier:
            car = torch.empty(self.car_shape, dtype=torch.uint8, device=dev)
            base = torch.empty(self.gs_shape, dtype=torch.float32, device=dev)
            gs = base.t() if self.group_rows == 1 else base[:, : self.gs_cols]
            cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
        else:
            cnt = counter if counter is not None else torch.empty((1,), dtype=torch.int32, device=dev)
        if self.fp4:
            packed = torch.empty(self.pk_shape, dtype=torch.uint8, device=dev)
            sc = torch.empty(self.sc_shape, dtype=torch.uint8, device=dev)
        self.run(x, cnt if signs is None else signs, cnt if car is None else car, cnt if gs is None else gs,
                 cnt if packed is None else packed, cnt if sc is None else sc, cnt,
                 cnt if key_tensor is None else key_tensor, *self.head, _i32(key), *self.tail)
        return QuantOut(self.R, self.K, car.view(torch.float8_e4m3fn) if car is not None else None, gs,
                        self.group_rows, cnt if car is not None else None, packed, sc, base)


# Which kernel quantizes: "blocks" (each thread holds whole MX blocks; rotations up to 32 wide) or
# "tile" (any rotation) or "cols" (along columns of a row-major input); "auto" picks by layout
# (``kernel_for``). The ``qkernel`` setting (MXTRAIN_QKERNEL) overrides.
# Blocks kernel: join the four pieces into one 32-byte carrier store (16 bytes of FP4 codes) per thread and
# block (1.2-2x faster on an H100 than 8-byte stores straight from the pieces, BENCHMARKS.md); the ``qjoin``
# setting off (MXTRAIN_QJOIN=0) for those.
# Rotations whose normalization 1/sqrt(ROT) is a power of two (H4, H16, H64) on bf16/fp16 inputs: the
# blocks and cols kernels multiply the block scale by it instead of every rotated value (one multiply an
# element fewer). Bit-identical: the butterfly sums of bf16 (fp16) values are multiples of 2**-133
# (2**-24), so x / sqrt(ROT) is exact in float32, subnormals included, and (x * 2**-k) * 2**-s rounds the
# same real number as x * 2**(-s-k) (a power of two down to 2**-128, exact). Not with a prescale (applied
# between the two) or float32 inputs (x / sqrt(ROT) can round there). The ``qfold`` setting off
# (MXTRAIN_QFOLD=0) turns it off.
_FOLD_ROTS = (4, 16, 64)


def _fold_applies(dtype: torch.dtype, rot: int, prescale: float, fold: bool | None = None) -> bool:
    """``fold``: the ``qfold`` setting (default: the current one)."""
    if fold is None:
        fold = _settings.current().qfold
    return fold and rot in _FOLD_ROTS and dtype in (torch.bfloat16, torch.float16) and prescale == 1.0
BLOCK_ROTS = (0, 2, 4, 8, 16, 32)


def kernel_for(axis: int, rot: int, fp4: bool = False, rows_contiguous: bool = False,
               kernel: str | None = None) -> str:
    """The kernel that quantizes along ``axis`` with a ``rot``-wide rotation, given the ``qkernel`` setting
    (``kernel``; default: the current one). ``auto``: "cols" where
    the output rows are the input's contiguous axis (along columns of a row-major tensor: the Wgrad
    operands), else "blocks" for carrier-only outputs (the Hopper training path) and "tile" where packed
    FP4 codes are written (the blocks kernel's FP4 stores measured slower, BENCHMARKS.md). Rotations
    wider than 32 always run "tile"; "cols" forced where it does not apply runs "blocks"."""
    k = _settings.current().qkernel if kernel is None else kernel
    if k == "tile" or rot not in BLOCK_ROTS:
        return "tile"
    if rows_contiguous and k in ("auto", "cols"):
        return "cols"
    if k == "auto" and fp4:
        return "tile"
    return "blocks"


FORCE_IDX64 = False  # tests: run the 64-bit offset variant on small shapes
# Triton's float32 -> float8e4nv cast (the hardware cvt.rn.satfinite.e4m3x2.f32, which converts pairs
# of registers) wrote wrong bytes for every other row of many tile layouts on sm_90 with Triton 3.6
# (on an H100, 17 of 82 variants failed, all with that cast; BENCHMARKS.md). The
# tile kernel builds the e4m3 bits with float32 ops; the blocks kernel issues the instruction through
# its own inline PTX on pairs of one thread's consecutive values (``_e4m3_bits``). The per-variant
# self-check stays as the safety net for both.
SELF_CHECK_DEVICES = ("cuda",)  # device types whose fused carrier is self-checked once per configuration


def carrier_from_fp4(q: QuantOut, k_multiple: int, row_multiple: int) -> None:
    """Build the FP8 carrier and group scales of ``q`` from its packed FP4 codes and E8M0 scales with
    plain torch ops (the definition; used where the fused carrier output failed its self-check)."""
    from ..quant import E8M0_NAN
    R, dev = q.R, q.packed.device
    vals = dequantize_fp4(q)                                   # (R, Kq), NaN blocks NaN
    Kq = vals.shape[1]
    Kc = _ceil(max(q.K, 1), k_multiple)
    rm = 128 if q.group_rows == 128 else row_multiple
    Rc = _ceil(max(R, 1), max(rm, 1))
    v = torch.zeros((Rc, Kc), dtype=torch.float32, device=dev)
    v[:R, :Kq] = vals
    s = torch.full((Rc, Kc // 32), -127, dtype=torch.int32, device=dev)
    sc = q.scales.to(torch.int32) - 127
    s[:R, : Kq // 32] = torch.where(q.scales == E8M0_NAN, torch.full_like(sc, -127), sc)
    g = s.reshape(Rc, Kc // TILE_K, 4).amax(-1)                # (Rc, Kc/128)
    if q.group_rows == 128:
        g = g.reshape(Rc // 128, 128, -1).amax(1)               # (Rc/128, Kc/128)
        gfull = g.repeat_interleave(128, 0)
    else:
        gfull = g
    g = g.clamp(min=_MIN_G)
    gfull = gfull.clamp(min=_MIN_G)
    from ..quant import pow2
    car = (v * pow2(6 - gfull).repeat_interleave(TILE_K, 1)).to(torch.float8_e4m3fn)
    gs = pow2(g - 6)
    live = (s > -127).reshape(Rc, Kc // TILE_K, 4)
    lo = s.reshape(Rc, Kc // TILE_K, 4) < (gfull[:, :, None] - 14)
    q.inexact = (live & lo)[:R].sum().to(torch.int32).reshape(1)
    if q.group_rows == 1:
        q.gscale = gs.t().contiguous().t()
        q.gs_base = q.gscale.t()
    else:
        ld = _ceil(Kc // TILE_K, 4)
        base = torch.zeros((Rc // 128, ld), dtype=torch.float32, device=dev)
        base[:, : Kc // TILE_K] = gs
        q.gs_base, q.gscale = base, base[:, : Kc // TILE_K]
    q.carrier = car


def _config_ok(x: torch.Tensor, axis: int, rot: int, has_signs: bool, scale_rule: str, sr: bool,
               prescale: float, group_rows: int, BR: int, nw: int, k_multiple: int, fp4: bool,
               R: int, K: int) -> bool:
    """Once per compiled kernel variant on a GPU: is the fused carrier right?

    Runs the same variant (every constexpr, the dtype, and the divisibility-by-16 of the sizes and
    strides that Triton specializes on) on a random tensor and compares carrier bytes and group
    scales with ones built by torch ops from the reference quantizer's output (``mxtrain.quant``).
    """
    r16, k16 = R % 16 == 0, K % 16 == 0
    rc = False
    if x.ndim == 2:
        sx_r, sx_k = (x.stride(0), x.stride(1)) if axis == 1 else (x.stride(1), x.stride(0))
        rc = sx_r == 1 and sx_k != 1
    st = _settings.current()
    vkey = (x.device.index, x.dtype, axis, rot, has_signs, scale_rule, sr, prescale != 1.0, group_rows, BR, nw,
            k_multiple, fp4, r16, k16, st.qmaxnreg, kernel_for(axis, rot, fp4, rc, kernel=st.qkernel), st.qjoin,
            st.qfold)
    ok = CACHES.verified.get(vkey)
    if ok is None:
        ok = selfcheck(x.device, x.dtype, axis, rot, has_signs, scale_rule, sr, prescale, group_rows, BR, nw,
                       k_multiple, fp4, r16, k16, rows_contiguous=rc)["ok"]
        CACHES.verified[vkey] = ok
        if not ok:
            import warnings
            warnings.warn(f"mxtrain: fused FP8-carrier kernel variant {vkey} failed its self-check on this GPU; "
                          "using the exact (slower) torch fallback for it", RuntimeWarning, stacklevel=3)
    return ok


def selfcheck(device, dtype, axis: int, rot: int, has_signs: bool, scale_rule: str, sr: bool, prescale: float,
              group_rows: int, BR: int, nw: int, k_multiple: int, fp4: bool, r16: bool = True, k16: bool = True,
              samples: int = 0, rows_contiguous: bool | None = None) -> dict:
    """Run one fused-kernel variant on a fixed random tensor and compare every output with the one
    built by torch ops from the reference quantizer. Returns ``ok`` and, per output, the number of
    mismatching entries (``samples`` > 0 adds the first mismatching carrier entries, for diagnosis).
    ``rows_contiguous``: lay the tensor out with the output rows contiguous (default: row-major, which
    makes them contiguous along columns only), as the variant being checked reads it."""
    g = torch.Generator(device="cpu").manual_seed(1234)
    if torch.device(device).type == "cpu":   # the interpreter (tests): fewer programs, the same edge cases
        Rt, Kt = (128 if r16 else 129), (304 if k16 else 305)
    else:
        Rt, Kt = (256 if r16 else 257), (1088 if k16 else 1089)
    if rows_contiguous is None:
        rows_contiguous = axis == 0
    # row-major unless the output rows must be the other axis' contiguous one: then a transposed view
    transposed = rows_contiguous != (axis == 0)
    shape = (Rt, Kt) if (axis == 1) != transposed else (Kt, Rt)
    t = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))).to(device, dtype)
    if transposed:
        t = t.t()
    signs = None
    if has_signs:
        signs = (1.0 - 2.0 * torch.randint(0, 2, (rot,), generator=g).float()).to(device)
    seed = 5
    from .. import rng as _rng
    q = quantize_mxfp4_2d(t, axis, rot=rot, signs=signs, rounding="stochastic" if sr else "nearest",
                          scale_rule=scale_rule, key=_rng.stream_key(seed), prescale=prescale,
                          index_strides=(_ceil(Kt, rot) if rot else Kt, 1) if axis == 1 else None,
                          carrier=True, fp4=fp4, group_rows=group_rows, block_rows=BR, num_warps=nw,
                          k_multiple=k_multiple, _check=False)
    ref = _reference(t, "mxfp4", axis, None, "stochastic" if sr else "nearest", scale_rule, seed, prescale,
                     rot, signs)
    qr = QuantOut(Rt, Kt, None, None, group_rows, None, ref.data.view(torch.uint8).reshape(Rt, -1),
                  ref.scales.reshape(Rt, -1))
    carrier_from_fp4(qr, k_multiple, 16)
    cq, cr = q.carrier.view(torch.uint8), qr.carrier.view(torch.uint8)
    out = {"carrier": int((cq != cr).sum()), "gscale": int((q.gscale != qr.gscale).sum()),
           "inexact": (int(q.inexact.item()), int(qr.inexact.item()))}
    if fp4:
        out["packed"] = int((q.packed != qr.packed).sum())
        out["scales"] = int((q.scales != qr.scales).sum())
    out["ok"] = (out["carrier"] == 0 and out["gscale"] == 0 and out["inexact"][0] == out["inexact"][1]
                 and out.get("packed", 0) == 0 and out.get("scales", 0) == 0)
    if samples and out["carrier"]:
        bad = (cq != cr).nonzero()[:samples].tolist()
        out["samples"] = [(r, c, int(cq[r, c]), int(cr[r, c])) for r, c in bad]
        rows = (cq != cr).any(1).nonzero().flatten()
        out["bad_rows"] = rows[:16].tolist()
        out["n_bad_rows"] = int(rows.numel())
        out["bad_cols_mod128"] = sorted(set(int(c) % 128 for _, c in (cq != cr).nonzero()[:2000].tolist()))[:40]
    return out


def carrier_values(q: QuantOut) -> torch.Tensor:
    """float32 carrier x group scale, (Rc, Kc) (for tests and the dequantize GEMM path)."""
    c = q.carrier.to(torch.float32)
    if q.group_rows == 1:
        g = q.gscale.repeat_interleave(TILE_K, dim=1)
    else:
        g = q.gscale.repeat_interleave(128, dim=0).repeat_interleave(TILE_K, dim=1)
    return c * g


def dequantize_fp4(q: QuantOut) -> torch.Tensor:
    """float32 MX values (R, Kq) from the packed codes and E8M0 scales (NaN blocks give NaN)."""
    from ..quant import E8M0_NAN, elem_table, pow2, unpack_fp4
    codes = unpack_fp4(q.packed)
    vals = elem_table(get_format("mxfp4").elem, codes.device)[codes.long()]
    s = q.scales.to(torch.int32) - 127
    sv = torch.where(q.scales == E8M0_NAN, torch.full(s.shape, float("nan"), device=s.device), pow2(s))
    return vals * sv.repeat_interleave(32, dim=1)


def quantize(x: torch.Tensor, fmt: str = "mxfp4", *, axis: int = -1, block_size=None,
             rounding: str = "nearest", scale_rule: str = "floor", seed: int | None = None,
             prescale: float = 1.0, rotation: int = 0, signs: torch.Tensor | None = None) -> MXTensor:
    """Kernel-backed drop-in for ``mxtrain.quantize`` (optionally with a Hadamard rotation first).

    Equals ``mxtrain.quantize(hadamard(pad(x), rotation, axis=axis, signs=signs), ...)`` bit for bit
    (the rotation pads ``axis`` with zeros to whole rotation blocks, as ``MXLinear`` does; the
    stochastic-rounding index runs over that padded tensor). Runs the Triton kernel for MXFP4 on
    2-D tensors (or N-D with ``axis`` last) where kernels are available, and the reference
    otherwise.
    """
    from . import kernels_available
    axis_n = axis % x.ndim
    nd_ok = x.ndim == 2 or (x.ndim > 2 and axis_n == x.ndim - 1)
    if not (supported(fmt if isinstance(fmt, str) else fmt.name, block_size) and nd_ok
            and kernels_available(x.device) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return _reference(x, fmt, axis_n, block_size, rounding, scale_rule, seed, prescale, rotation, signs)
    shape = tuple(x.shape)
    x2 = x.reshape(-1, shape[-1]) if x.ndim > 2 else x
    a2 = 1 if axis_n == x.ndim - 1 else 0
    if rounding == "stochastic" and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    key = rng.stream_key(seed) if rounding == "stochastic" else 0
    M, N = x2.shape
    if rotation:
        # index over the rotation-padded tensor
        if a2 == 1:
            si = (_ceil(N, rotation), 1)
        else:
            si = (1, N)
    else:
        si = None
    q = quantize_mxfp4_2d(x2, a2, rot=rotation, signs=signs, rounding=rounding, scale_rule=scale_rule,
                          key=key, prescale=prescale, index_strides=si, carrier=False, fp4=True)
    if rotation:
        rshape = list(shape)
        rshape[axis_n] = _ceil(shape[axis_n], rotation)
        shape = tuple(rshape)
    if x.ndim > 2:
        data = q.packed.reshape(*shape[:-1], -1)
        scales = q.scales.reshape(*shape[:-1], -1)
    else:
        data, scales = q.packed, q.scales
    return MXTensor(get_format("mxfp4"), data.view(torch.float4_e2m1fn_x2), scales, shape, axis_n, 32,
                    prescale=prescale, dtype=x.dtype)


def _reference(x, fmt, axis, block_size, rounding, scale_rule, seed, prescale, rotation, signs):
    from ..hadamard import hadamard
    from ..quant import quantize as ref_quantize
    if rotation:
        import torch.nn.functional as F
        n = x.shape[axis]
        pad = (-n) % rotation
        t = x.to(torch.float32)
        if pad:
            pads = [0, 0] * (x.ndim - 1 - axis) + [0, pad]
            t = F.pad(t, pads)
        x = hadamard(t, rotation, axis=axis, signs=signs)
    return ref_quantize(x, fmt, axis=axis, block_size=block_size, rounding=rounding, scale_rule=scale_rule,
                        seed=seed, prescale=prescale)


# ----------------------------------------------------------------------------------------------
# torch.library op, so that torch.compile sees one opaque call with a fake (meta) implementation

def _out_shapes(R: int, K: int, rot: int, carrier: bool, fp4: bool, group_rows: int, row_multiple: int,
                k_multiple: int = TILE_K):
    Kq = _ceil(_ceil(max(K, 1), rot or 1), 32)
    Kc = _ceil(max(K, 1), k_multiple)
    rm = 128 if group_rows == 128 else row_multiple
    Rc = _ceil(max(R, 1), max(rm, 1))
    car = (Rc, Kc) if carrier else (0, 0)
    gs = ((Kc // TILE_K, Rc) if group_rows == 1 else (Rc // 128, _ceil(Kc // TILE_K, 4))) if carrier else (0, 0)
    pk = (R, Kq // 2) if fp4 else (0, 0)
    sc = (R, Kq // 32) if fp4 else (0, 0)
    return car, gs, pk, sc


@torch.library.custom_op("mxtrain::quantize_mxfp4", mutates_args=())
def quantize_mxfp4_op(x: torch.Tensor, signs: torch.Tensor | None, axis: int, rot: int, stochastic: bool,
                      rule: int, key: int, prescale: float, si0: int, si1: int, carrier: bool, fp4: bool,
                      group_rows: int, row_multiple: int, k_multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor, torch.Tensor]:
    """Fused MXFP4 quantize as one op: (carrier uint8, group scales (contiguous; 1x128 ones
    transposed: (Kc/128, Rc)), inexact count, packed FP4, E8M0 scales); unused outputs are empty."""
    rules = {v: k for k, v in RULE_ID.items()}
    q = quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding="stochastic" if stochastic else "nearest",
                          scale_rule=rules[rule], key=key, prescale=prescale, index_strides=(si0, si1),
                          carrier=carrier, fp4=fp4, group_rows=group_rows, row_multiple=row_multiple,
                          k_multiple=k_multiple)

    def e(dt=torch.uint8):
        return torch.empty((0, 0), dtype=dt, device=x.device)
    car = q.carrier.view(torch.uint8) if carrier else e()
    gs = q.gs_base if carrier else e(torch.float32)
    cnt = q.inexact if carrier else torch.zeros((1,), dtype=torch.int32, device=x.device)
    return car, gs, cnt, q.packed if fp4 else e(), q.scales if fp4 else e()


@quantize_mxfp4_op.register_fake
def _(x, signs, axis, rot, stochastic, rule, key, prescale, si0, si1, carrier, fp4, group_rows, row_multiple,
      k_multiple):
    R, K = (x.shape[0], x.shape[1]) if axis == 1 else (x.shape[1], x.shape[0])
    car, gs, pk, sc = _out_shapes(R, K, rot, carrier, fp4, group_rows, row_multiple, k_multiple)
    return (x.new_empty(car, dtype=torch.uint8), x.new_empty(gs, dtype=torch.float32),
            x.new_empty((1,), dtype=torch.int32), x.new_empty(pk, dtype=torch.uint8),
            x.new_empty(sc, dtype=torch.uint8))


def quantize_op(x: torch.Tensor, axis: int, *, rot: int = 0, signs=None, rounding: str = "nearest",
                scale_rule: str = "floor", key: int = 0, prescale: float = 1.0, index_strides=None,
                carrier: bool = True, fp4: bool = True, group_rows: int = 1, row_multiple: int = 16,
                k_multiple: int = TILE_K, counter: torch.Tensor | None = None,
                key_tensor: torch.Tensor | None = None) -> QuantOut:
    """``quantize_mxfp4_2d`` through the registered op under ``torch.compile`` (eagerly: a direct
    call, which saves the custom-op dispatch overhead); same result either way."""
    if not torch.compiler.is_compiling():
        return quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding=rounding, scale_rule=scale_rule, key=key,
                                 prescale=prescale, index_strides=index_strides, carrier=carrier, fp4=fp4,
                                 group_rows=group_rows, row_multiple=row_multiple, k_multiple=k_multiple,
                                 counter=counter, key_tensor=key_tensor)
    if key_tensor is not None:
        raise NotImplementedError("quantize_op: a key in device memory is for eager CUDA-graph capture, "
                                  "not for torch.compile")
    if axis == 1:
        R, K = x.shape
        si = index_strides or (x.shape[1], 1)
    else:
        K, R = x.shape
        si = index_strides or (1, x.shape[1])
    car, gs, cnt, pk, sc = quantize_mxfp4_op(x, signs, axis, rot, rounding == "stochastic", RULE_ID[scale_rule],
                                              _i32(key), float(prescale), si[0], si[1], carrier, fp4,
                                              group_rows, row_multiple, k_multiple)
    gview = None
    if carrier:
        gview = gs.t() if group_rows == 1 else gs[:, : _ceil(max(K, 1), k_multiple) // TILE_K]
    return QuantOut(R, K, car.view(torch.float8_e4m3fn) if carrier else None, gview, group_rows,
                    cnt if carrier else None, pk if fp4 else None, sc if fp4 else None, gs if carrier else None)
