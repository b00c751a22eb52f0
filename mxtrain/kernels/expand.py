"""FP4 codes + E8M0 scales -> the FP8 carrier and its group scales (Triton), for operands kept between
the forward and the backward pass.

X's Wgrad operand is made in the forward pass (from one read of X, with its Fprop operand) and used
in the backward. Kept as packed FP4 codes and E8M0 block scales it takes 0.53 bytes an element; as the
FP8 carrier, 1.03. The forward therefore keeps the codes, and the backward rebuilds the carrier just
before the Wgrad GEMM with ``carrier_from_packed``: one read of 0.53 bytes and one write of 1 byte an
element. The codes are E2M1 (``mxfp4``), INT4 (``mxint4``) or E1M2 (``mxe1m2``; the uniform grids):
``QuantOut.fmt`` says which.

The carrier it writes is the one the fused quantizer writes for the same operand, byte for byte (the
same group exponent ``G``, the same ``v * 2**(s - G + 6)`` in e4m3 and the same count of inexact
blocks). Its plain-PyTorch definition is ``mxfp4.carrier.carrier_from_fp4``; ``tests/kernels/test_expand.py``
compares the two.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON
from .mxfp4.carrier import TILE_K, QuantOut, carrier_buffers, ceil_to
from .. import settings as _settings
from .mxfp4.launch import launch_direct, use_plans, KERNEL_GRIDS

__all__ = ["carrier_from_packed", "expand_spec"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4.device import _e4m3_bits

    @triton.jit
    def _expand_kernel(pk_ptr, sc_ptr, car_ptr, gs_ptr, cnt_ptr, R, Kq, Rc, Kc, gs_sr, gs_sk,
                       BR: tl.constexpr, GROUP_ROWS: tl.constexpr, GRID: tl.constexpr = 0):
        """One program: ``BR`` rows x one 128-wide group (4 MX blocks). With 128x128 groups ``BR`` is 128
        and the program's tile is one group. ``GRID``: the codes' element grid (``mxfp4.launch.GRID_ID``: 0 E2M1,
        1 INT4, 2 E1M2)."""
        pid_r = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_r * BR + tl.arange(0, BR)                         # [BR]
        rm = rows < R
        # E8M0 scales of the tile's four blocks; padding (rows >= R, blocks past Kq) is "no block"
        blk = pid_k * 4 + tl.arange(0, 4)                            # [4]
        bm = rm[:, None] & (blk[None, :] * 32 < Kq)
        code_s = tl.load(sc_ptr + rows[:, None] * (Kq // 32) + blk[None, :], mask=bm, other=0).to(tl.int32)
        s = code_s - 127                                              # [BR, 4]
        nan_blk = code_s == 255
        cols = pid_k * 64 + tl.arange(0, 64)                          # packed bytes of the tile
        pm = rm[:, None] & (cols[None, :] * 2 < Kq)
        byte = tl.load(pk_ptr + rows[:, None] * (Kq // 2) + cols[None, :], mask=pm, other=0).to(tl.int32)
        codes = tl.reshape(tl.join(byte & 0xF, byte >> 4), [BR, 128])  # element 2i: low nibble
        mag = codes & 7
        # a block counts (for the group exponent and the inexact count) where it holds a non-zero value:
        # its scale is above the smallest, or one of its codes is non-zero (a block at 2**-127)
        nz = tl.max(tl.reshape(mag, [BR, 4, 32]), axis=2) > 0
        live = ((s > -127) | nz) & (code_s != 255)
        s_live = tl.where(live, s, -127)
        if GROUP_ROWS == 1:
            G = tl.maximum(tl.max(s_live, axis=1), -120)              # [BR] (mxfp4.carrier.MIN_G)
            G2 = G[:, None]
        else:
            G = tl.maximum(tl.max(tl.max(s_live, axis=1), axis=0), -120)
            G2 = G
        if GRID == 2:   # E1M2 (mxfp4.carrier.EXACT_KEXP)
            inexact = live & (s - G2 + 6 < -7) & rm[:, None]
        else:
            inexact = live & (s - G2 + 6 < -8 - GRID) & rm[:, None]   # (mxfp4.carrier.EXACT_KEXP)
        kexp = s - G2 + 6                                             # [BR, 4]
        # carrier value of each element: its E2M1 (INT4) magnitude times 2**kexp (exact in float32); E1M2: its
        # magnitude code (4 x the value) times 2**(kexp - 2), as the quantizer writes it (device._carrier_factor)
        if GRID == 2:
            fc = ((tl.maximum(kexp - 2, -126) + 127) << 23).to(tl.float32, bitcast=True)
        else:
            fc = ((tl.maximum(kexp, -126) + 127) << 23).to(tl.float32, bitcast=True)
        fc = tl.where(nan_blk, float("nan"), fc)
        if GRID != 0:   # INT4 (E1M2: 4 x) the magnitude code is the value
            val = mag.to(tl.float32)
        else:
            e = mag >> 1
            m = (mag & 1).to(tl.float32)
            # E2M1: e == 0 -> 0.5 m; else (1 + 0.5 m) 2**(e - 1)
            # (explicit FMA: 0.5 m is exact; contraction on or off leaves the code as written)
            val = tl.where(e == 0, 0.5 * m, tl.fma(m, 0.5, 1.0) * ((e + 126) << 23).to(tl.float32, bitcast=True))
        val = (val.to(tl.int32, bitcast=True) | ((codes & 8) << 28)).to(tl.float32, bitcast=True)  # -0 kept
        c = tl.reshape(tl.reshape(val, [BR, 4, 32]) * fc[:, :, None], [BR, 128])
        # e4m3 bits by float32 arithmetic (the values are E2M1/INT4 times a power of two: exact above 2**-6,
        # rounded half to even onto the subnormal grid below), as the quantizer's interpreter path
        b = _e4m3_bits(c, False)
        kc = pid_k * 128 + tl.arange(0, 128)
        tl.store(car_ptr + rows[:, None] * Kc + kc[None, :], b, mask=(rows < Rc)[:, None])
        gval = (((tl.maximum(G - 6, -126)) + 127) << 23).to(tl.float32, bitcast=True)
        if GROUP_ROWS == 1:
            tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
        else:
            tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
        n_bad = tl.sum(tl.sum(inexact.to(tl.int32), axis=1), axis=0)
        tl.atomic_add(cnt_ptr, n_bad, mask=n_bad > 0)


def expand_spec(R: int, K: int, Kq: int, group_rows: int, k_multiple: int = TILE_K, row_multiple: int = 16) -> tuple:
    """The launch of ``_expand_kernel`` for an operand of ``R`` rows, reduction length ``K`` (codes padded to
    ``Kq``): ``(Rc, Kc, group-scale storage shape, its strides (per row group, per K group), BR, grid, warps)``, for
    the eager launch (``carrier_from_packed``) and the traced one (``mxfp4.traced.q_expand``)."""
    Kc = ceil_to(max(K, 1), k_multiple)
    Rc = ceil_to(max(R, 1), 128 if group_rows == 128 else max(row_multiple, 1))
    if group_rows == 1:   # (carrier.carrier_buffers' layouts)
        gs_shape, gsr, gsk = (Kc // TILE_K, Rc), 1, Rc
    else:
        ld = ceil_to(Kc // TILE_K, 4)
        gs_shape, gsr, gsk = (Rc // 128, ld), ld, 1
    BR = 128 if group_rows == 128 else 32
    return Rc, Kc, gs_shape, gsr, gsk, BR, (-(-Rc // BR), Kc // TILE_K), 4 if group_rows == 1 else 8


def carrier_from_packed(q: QuantOut, k_multiple: int = TILE_K, row_multiple: int = 16,
                        counter: torch.Tensor | None = None) -> QuantOut:
    """A copy of ``q`` (packed FP4 codes + E8M0 scales) with its FP8 carrier and group scales
    (``q.group_rows``: 1 for 1x128 groups, 128 for 128x128), as the fused quantizer writes them for the
    same operand. Inexact blocks (more than 14 binades below their group's largest) are added to
    ``counter`` when given. Triton (GPU, or the interpreter on CPU); ``quantize.carrier_from_fp4`` is
    the definition."""
    if q.packed is None or q.scales is None:
        raise ValueError("carrier_from_packed: the operand has no packed FP4 codes")
    R, dev = q.R, q.packed.device
    Kq = q.scales.shape[1] * 32
    gr = q.group_rows
    Rc, Kc, _, gsr, gsk, BR, grid, nw = expand_spec(R, q.K, Kq, gr, k_multiple, row_multiple)
    car, gs, base, _, _ = carrier_buffers(Rc, Kc, gr, dev)
    cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
    gid = KERNEL_GRIDS[q.fmt]
    args = (q.packed, q.scales, car, gs, cnt, R, Kq, Rc, Kc, gsr, gsk)
    key = (("expand", dev, q.packed.data_ptr() & 15, q.scales.data_ptr() & 15, car.data_ptr() & 15,
            gs.data_ptr() & 15, cnt.data_ptr() & 15, R, Kq, Rc, Kc, gsr, gsk, BR, gr, gid)
           if use_plans(q.packed, _settings.current()) else None)
    # (GRID only where it is not the default: the E2M1 launches keep their constexprs and plans as before)
    consts = {"BR": BR, "GROUP_ROWS": gr} if gid == 0 else {"BR": BR, "GROUP_ROWS": gr, "GRID": gid}
    launch_direct(_expand_kernel, grid, args, consts, nw, key)
    return QuantOut(R, q.K, car.view(torch.float8_e4m3fn), gs, gr, cnt, q.packed, q.scales, base, q.fmt)

