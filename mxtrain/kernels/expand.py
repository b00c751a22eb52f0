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
blocks). Its plain-PyTorch definition is ``mxfp4.carrier.carrier_from_fp4``; ``tests/test_expand.py``
compares the two.
"""

from __future__ import annotations

import torch

from . import HAS_TRITON
from .mxfp4.carrier import TILE_K, QuantOut, carrier_buffers, ceil_to

__all__ = ["carrier_from_packed", "expand_spec"]

# The rebuild's launch: rows a program for 1x128 groups (128x128 groups take 128), 128-wide groups of the
# carrier one program makes one after the other (``_expand_kernel``'s KG), warps for 1x128 and 128x128 groups
EXPAND_BR = 32
EXPAND_KG = 1
EXPAND_CHUNK = 32   # rows a program expands at a time (a divisor of EXPAND_BR and of 128)
EXPAND_WARPS = (4, 8)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4.device import _e4m3_bits

    @triton.jit
    def _expand_kernel(pk_ptr, sc_ptr, car_ptr, gs_ptr, cnt_ptr, R, Kq, Rc, Kc, gs_sr, gs_sk,
                       BR: tl.constexpr, GROUP_ROWS: tl.constexpr, GRID: tl.constexpr = 0,
                       KG: tl.constexpr = EXPAND_KG, CH: tl.constexpr = EXPAND_CHUNK):
        """One program: ``BR`` rows x ``KG`` consecutive 128-wide groups (4 MX blocks each), ``CH`` rows at a
        time. With 128x128 groups ``BR`` is 128 and each of the program's tiles is one group. ``GRID``: the
        codes' element grid (``mxfp4.launch.GRID_ID``: 0 E2M1, 1 INT4, 2 E1M2).

        The group exponent comes from the scales alone: ``G = max(s over the group's blocks that are not NaN,
        -120)``, the quantizer's rule (the largest exponent of the blocks holding a non-zero value, at least
        ``MIN_G``), because a block without a non-zero value has the smallest scale, ``s = -127``, which the
        bound -120 already covers. So a 128x128 group reads its 512 scale bytes first and then expands its
        codes in chunks of ``CH`` rows (few registers a thread: the whole 128 x 128 tile in registers held one
        block a multiprocessor). Each packed byte's two codes (element 2i in the low nibble) are expanded side by
        side and their two carrier bytes stored as one 16-bit word (the low byte first: the carrier's order)."""
        pid_r = tl.program_id(0)
        car16 = car_ptr.to(tl.pointer_type(tl.uint16))               # Kc is a multiple of 128: aligned rows
        n_bad = 0
        for kg in tl.static_range(KG):
            pid_k = tl.program_id(1) * KG + kg
            gm = pid_k * 128 < Kc                                     # a whole group of the carrier
            blk = pid_k * 4 + tl.arange(0, 4)                         # the tile's four blocks
            if GROUP_ROWS != 1:   # one group exponent for the whole tile, from its scales
                ra = pid_r * BR + tl.arange(0, BR)
                ca = tl.load(sc_ptr + ra[:, None] * (Kq // 32) + blk[None, :],
                             mask=(ra < R)[:, None] & (blk[None, :] * 32 < Kq), other=0).to(tl.int32)
                Gt = tl.maximum(tl.max(tl.max(tl.where(ca != 255, ca - 127, -127), axis=1), axis=0), -120)
                gval_t = (((tl.maximum(Gt - 6, -126)) + 127) << 23).to(tl.float32, bitcast=True)
                tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval_t, mask=gm)
            for c in tl.static_range(BR // CH):
                rows = pid_r * BR + c * CH + tl.arange(0, CH)        # [CH]
                rm = rows < R
                # E8M0 scales of the chunk's four blocks; padding (rows >= R, blocks past Kq) is "no block"
                bm = rm[:, None] & (blk[None, :] * 32 < Kq)
                code_s = tl.load(sc_ptr + rows[:, None] * (Kq // 32) + blk[None, :], mask=bm, other=0).to(tl.int32)
                s = code_s - 127                                      # [CH, 4]
                nan_blk = code_s == 255
                if GROUP_ROWS == 1:
                    G = tl.maximum(tl.max(tl.where(nan_blk, -127, s), axis=1), -120)   # [CH] (carrier.MIN_G)
                    G2 = G[:, None]
                else:
                    G2 = Gt
                cols = pid_k * 64 + tl.arange(0, 64)                  # packed bytes of the tile
                pm = rm[:, None] & (cols[None, :] * 2 < Kq)
                byte = tl.load(pk_ptr + rows[:, None] * (Kq // 2) + cols[None, :], mask=pm, other=0).to(tl.int32)
                lo = byte & 0xF                                       # element 2i
                hi = byte >> 4                                        # element 2i + 1
                # a block counts as inexact where it holds a non-zero value (its scale is above the smallest,
                # or one of its codes is non-zero: a block at 2**-127) more than the carrier's range below G
                nz = tl.max(tl.reshape(tl.maximum(lo & 7, hi & 7), [CH, 4, 16]), axis=2) > 0
                live = ((s > -127) | nz) & (code_s != 255)
                kexp = s - G2 + 6                                     # [CH, 4]
                if GRID == 2:   # E1M2 (mxfp4.carrier.EXACT_KEXP)
                    inexact = live & (kexp < -7) & rm[:, None]
                else:
                    inexact = live & (kexp < -8 - GRID) & rm[:, None]   # (mxfp4.carrier.EXACT_KEXP)
                # carrier value of each element: its E2M1 (INT4) magnitude times 2**kexp (exact in float32);
                # E1M2: its magnitude code (4 x the value) times 2**(kexp - 2), as the quantizer writes it
                # (device._carrier_factor)
                if GRID == 2:
                    fc = ((tl.maximum(kexp - 2, -126) + 127) << 23).to(tl.float32, bitcast=True)
                else:
                    fc = ((tl.maximum(kexp, -126) + 127) << 23).to(tl.float32, bitcast=True)
                fc = tl.where(nan_blk, float("nan"), fc)
                fcb = tl.reshape(tl.broadcast_to(fc[:, :, None], [CH, 4, 16]), [CH, 64])
                w = _expand_byte(lo, fcb, GRID).to(tl.uint16) | (_expand_byte(hi, fcb, GRID).to(tl.uint16) << 8)
                kc = pid_k * 64 + tl.arange(0, 64)                    # 16-bit words of the carrier row
                tl.store(car16 + rows[:, None] * (Kc // 2) + kc[None, :], w, mask=(rows < Rc)[:, None] & gm)
                if GROUP_ROWS == 1:
                    gval = (((tl.maximum(G - 6, -126)) + 127) << 23).to(tl.float32, bitcast=True)
                    tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=(rows < Rc) & gm)
                n_bad += tl.sum(tl.sum((inexact & gm).to(tl.int32), axis=1), axis=0)
        tl.atomic_add(cnt_ptr, n_bad, mask=n_bad > 0)

    @triton.jit
    def _expand_byte(code, fc, GRID: tl.constexpr):
        """The carrier byte (e4m3) of 4-bit element codes ``code`` (sign in bit 3) under the carrier factor
        ``fc`` of their block."""
        mag = code & 7
        if GRID != 0:   # INT4 (E1M2: 4 x) the magnitude code is the value
            val = mag.to(tl.float32)
        else:
            e = mag >> 1
            m = (mag & 1).to(tl.float32)
            # E2M1: e == 0 -> 0.5 m; else (1 + 0.5 m) 2**(e - 1)
            # (explicit FMA: 0.5 m is exact; contraction on or off leaves the code as written)
            val = tl.where(e == 0, 0.5 * m, tl.fma(m, 0.5, 1.0) * ((e + 126) << 23).to(tl.float32, bitcast=True))
        val = (val.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # -0 kept
        # e4m3 bits by float32 arithmetic (the values are E2M1/INT4 times a power of two: exact above 2**-6,
        # rounded half to even onto the subnormal grid below), as the quantizer's interpreter path
        return _e4m3_bits(val * fc, False)


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
    BR = 128 if group_rows == 128 else EXPAND_BR
    assert BR % EXPAND_CHUNK == 0, (BR, EXPAND_CHUNK)
    grid = (-(-Rc // BR), -(-(Kc // TILE_K) // EXPAND_KG))
    return Rc, Kc, gs_shape, gsr, gsk, BR, grid, EXPAND_WARPS[group_rows == 128]


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
    from .. import settings as _settings
    from .mxfp4.launch import launch_direct, use_plans
    from .mxfp4.launch import KERNEL_GRIDS
    gid = KERNEL_GRIDS[q.fmt]
    args = (q.packed, q.scales, car, gs, cnt, R, Kq, Rc, Kc, gsr, gsk)
    key = (("expand", dev, q.packed.data_ptr() & 15, q.scales.data_ptr() & 15, car.data_ptr() & 15,
            gs.data_ptr() & 15, cnt.data_ptr() & 15, R, Kq, Rc, Kc, gsr, gsk, BR, gr, gid, grid, nw)
           if use_plans(q.packed, _settings.current()) else None)
    # (GRID only where it is not the default: the E2M1 launches keep their constexprs and plans as before)
    consts = {"BR": BR, "GROUP_ROWS": gr} if gid == 0 else {"BR": BR, "GROUP_ROWS": gr, "GRID": gid}
    # (the kernel's defaults are the module's values when it was defined, as the traced launch takes them;
    # benchmark sweeps set the module's)
    consts.update(KG=EXPAND_KG, CH=EXPAND_CHUNK)
    launch_direct(_expand_kernel, grid, args, consts, nw, key)
    return QuantOut(R, q.K, car.view(torch.float8_e4m3fn), gs, gr, cnt, q.packed, q.scales, base, q.fmt)

