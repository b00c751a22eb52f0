"""The torch side of the MXFP4 quantizer: its outputs (``QuantOut``), their shapes and buffers, and the
plain-PyTorch definitions the kernels are checked against.

FP8 carrier (``docs/kernels.md``): each MX element ``v * 2**s`` is stored as ``v * 2**(s - G + 6)`` in e4m3,
with ``2**(G - 6)`` as its group's float32 scale, where ``G`` is the largest block exponent of the group
(1x128: one row x 128; 128x128: the whole tile), at least ``MIN_G``. Exact when ``s >= G - 14`` (``mxint4``:
``s >= G - 15``, ``mxe1m2``: ``s >= G - 13``, ``EXACT_KEXP``); non-zero blocks below that are counted in
``inexact``. ``carrier_from_fp4``
builds it from packed FP4 codes and E8M0 scales with torch ops (the definition, and the fallback of a kernel
variant that failed its self-check); ``reference_quantize`` is the reference quantizer (``mxtrain.numerics.quant``) with
the optional rotation first, the spec every kernel output must equal bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...numerics.formats import get_format
from ...numerics.quant import E8M0_NAN, pow2, elem_table, unpack_fp4, quantize as ref_quantize
from ...numerics.hadamard import hadamard

__all__ = ["TILE_K", "MIN_G", "KERNEL_FORMATS", "EXACT_KEXP", "QuantOut", "ceil_to", "carrier_buffers", "out_shapes",
           "carrier_from_fp4", "carrier_values", "group_values", "dequantize_fp4", "reference_quantize"]

TILE_K = 128   # reduction elements of one kernel tile: 4 MX blocks of 32, one carrier group
MIN_G = -120   # group exponent floor: keeps 2**(G-6) a normal float32
# The MX formats of the fused quantizer (``launch.GRID_ID``) and, for each, the lowest block shift
# ``kexp = s - G + 6`` at which the carrier holds every value of a block exactly: the smallest non-zero element
# (E2M1 0.5, INT4 1, E1M2 0.25) times 2**kexp must be at least e4m3's quantum 2**-9.
# (``KERNEL_FORMATS``: the formats the fast path takes; the kernels implement ``mxe1m2`` too, ``launch.KERNEL_GRIDS``)
KERNEL_FORMATS = ("mxfp4", "mxint4", "mxe1m2")
EXACT_KEXP = {"mxfp4": -8, "mxint4": -9, "mxe1m2": -7}


@dataclass
class QuantOut:
    """Outputs of one fused quantize call over a 2-D view (rows R = outer axis, K = reduction).

    * ``carrier``: float8_e4m3fn (Rc, Kc), or None; ``gscale``: float32 group scales, shape
      (Rc, Kc/128) for 1x128 groups (stored outer-dim-major, as ``_scaled_mm`` wants) or
      (Rc/128, Kc/128) for 128x128; ``inexact``: int32 count of inexact carrier blocks.
    * ``packed``: uint8 (R, Kq/2) FP4 codes (low nibble = lower index); ``scales``: uint8 E8M0 (R, Kq/32).
    * ``fmt``: the MX format of the elements, one of ``KERNEL_FORMATS`` (``mxfp4``: E2M1 codes; ``mxint4``: INT4 codes,
      sign and magnitude 0..7; ``mxe1m2``: E1M2 codes, sign and 4 x the magnitude). The carrier and its group
      scales are the same construction for all.
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
    fmt: str = "mxfp4"   # the MX format of the codes (``KERNEL_FORMATS``)


def ceil_to(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b``."""
    return -(-a // b) * b


def carrier_buffers(Rc: int, Kc: int, group_rows: int, dev):
    """FP8-carrier output buffers: (carrier bytes (Rc, Kc), group scales view, their contiguous storage,
    group-scale strides per row group and per K group)."""
    car = torch.empty((Rc, Kc), dtype=torch.uint8, device=dev)
    if group_rows == 1:
        gs_base = torch.empty((Kc // TILE_K, Rc), dtype=torch.float32, device=dev)
        return car, gs_base.t(), gs_base, 1, Rc      # outer-dim-major (Rc, Kc/128) view
    # cuBLAS wants the 128x128 scale rows' leading dimension padded to a multiple of 4
    # (the padding columns are never read)
    ld = ceil_to(Kc // TILE_K, 4)
    gs_base = torch.empty((Rc // 128, ld), dtype=torch.float32, device=dev)
    return car, gs_base[:, : Kc // TILE_K], gs_base, ld, 1


def out_shapes(R: int, K: int, rot: int, carrier: bool, fp4: bool, group_rows: int, row_multiple: int,
               k_multiple: int = TILE_K):
    """Shapes of the stored outputs (carrier bytes, group-scale storage, packed codes, E8M0 scales) of a
    quantize call over R rows x K reduction elements; (0, 0) for an output not written."""
    Kq = ceil_to(ceil_to(max(K, 1), rot or 1), 32)
    Kc = ceil_to(max(K, 1), k_multiple)
    rm = 128 if group_rows == 128 else row_multiple
    Rc = ceil_to(max(R, 1), max(rm, 1))
    car = (Rc, Kc) if carrier else (0, 0)
    gs = ((Kc // TILE_K, Rc) if group_rows == 1 else (Rc // 128, ceil_to(Kc // TILE_K, 4))) if carrier else (0, 0)
    pk = (R, Kq // 2) if fp4 else (0, 0)
    sc = (R, Kq // 32) if fp4 else (0, 0)
    return car, gs, pk, sc


def carrier_from_fp4(q: QuantOut, k_multiple: int, row_multiple: int) -> None:
    """Build the FP8 carrier and group scales of ``q`` from its packed FP4 codes and E8M0 scales with
    plain torch ops (the definition; used where the fused carrier output failed its self-check)."""
    R, dev = q.R, q.packed.device
    vals = dequantize_fp4(q)                                   # (R, Kq), NaN blocks NaN
    Kq = vals.shape[1]
    Kc = ceil_to(max(q.K, 1), k_multiple)
    rm = 128 if q.group_rows == 128 else row_multiple
    Rc = ceil_to(max(R, 1), max(rm, 1))
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
    g = g.clamp(min=MIN_G)
    gfull = gfull.clamp(min=MIN_G)
    car = (v * pow2(6 - gfull).repeat_interleave(TILE_K, 1)).to(torch.float8_e4m3fn)
    gs = pow2(g - 6)
    live = (s > -127).reshape(Rc, Kc // TILE_K, 4)
    lo = s.reshape(Rc, Kc // TILE_K, 4) - gfull[:, :, None] + 6 < EXACT_KEXP[q.fmt]
    q.inexact = (live & lo)[:R].sum().to(torch.int32).reshape(1)
    if q.group_rows == 1:
        q.gscale = gs.t().contiguous().t()
        q.gs_base = q.gscale.t()
    else:
        ld = ceil_to(Kc // TILE_K, 4)
        base = torch.zeros((Rc // 128, ld), dtype=torch.float32, device=dev)
        base[:, : Kc // TILE_K] = gs
        q.gs_base, q.gscale = base, base[:, : Kc // TILE_K]
    q.carrier = car


def carrier_values(q: QuantOut) -> torch.Tensor:
    """float32 carrier x group scale, (Rc, Kc) (for tests and the dequantize GEMM path)."""
    return group_values(q.carrier, q.gscale)


def group_values(car: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """float32 values (Rc, Kc) of an e4m3 carrier ``car`` and its group scales ``gs``: (Rc, Kc/128) for 1x128
    groups, (Rc/128, Kc/128) for 128x128 groups (told apart by their row count)."""
    Rc, Kc = car.shape
    c = car.to(torch.float32).reshape(Rc, Kc // TILE_K, TILE_K)
    if gs.shape[0] == Rc:
        return (c * gs[..., None]).reshape(Rc, Kc)
    return (c.reshape(Rc // 128, 128, Kc // TILE_K, TILE_K) * gs.reshape(Rc // 128, 1, -1, 1)).reshape(Rc, Kc)


def dequantize_fp4(q: QuantOut) -> torch.Tensor:
    """float32 MX values (R, Kq) from the packed codes (of ``q.fmt``) and E8M0 scales (NaN blocks give NaN)."""
    codes = unpack_fp4(q.packed)
    vals = elem_table(get_format(q.fmt).elem, codes.device)[codes.long()]
    s = q.scales.to(torch.int32) - 127
    sv = torch.where(q.scales == E8M0_NAN, torch.full(s.shape, float("nan"), device=s.device), pow2(s))
    return vals * sv.repeat_interleave(32, dim=1)


def reference_quantize(x, fmt, axis, block_size, rounding, scale_rule, seed, prescale, rotation, signs):
    """``mxtrain.numerics.quant.quantize`` of ``x`` after the blockwise Hadamard rotation (``rotation`` wide, with
    ``signs``; ``axis`` padded with zeros to whole rotation blocks first): what the kernels must equal."""
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
