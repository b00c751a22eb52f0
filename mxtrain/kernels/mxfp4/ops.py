"""The public MXFP4 quantize operations: ``quantize_mxfp4_2d`` (one fused pass over a 2-D view, along rows
or columns), ``quantize_mxfp4_dual`` (both FP8-carrier operands of an activation from one read), the
drop-in ``quantize`` (an ``MXTensor``, as ``mxtrain.quantize``) and the custom op ``mxtrain::quantize_mxfp4``
(``quantize_mxfp4_op``; ``quantize_op`` calls it under ``torch.compile``).

Bit-exactness with ``mxtrain.quant.quantize`` (the spec) comes from the kernels doing the same float32
operations (``device.py``); ``verify.py`` checks each compiled variant once on GPUs.
"""

from __future__ import annotations

import torch

from ... import rng
from ... import settings as _settings
from ...formats import get_format
from ...quant import MXTensor
from ..caches import CACHES
from . import kernels as _kernels   # (its kernels exist where Triton imports; read at launch time)
from .carrier import TILE_K, QuantOut, carrier_buffers, carrier_from_fp4, ceil_to, out_shapes, reference_quantize
from .launch import (DUAL_CONFIG, DUAL_SEQ, RULE_ID, DualPlan, Plan, block_config, dual_applies, dual_args,
                     fold_applies, i32, kernel_for, launch, launch_opts, needs_idx64, rot_floats, single_args,
                     single_kernel, use_plans)
from .verify import config_ok, dual_ok, selfcheck_applies

try:
    import triton
except Exception:  # pragma: no cover
    triton = None

__all__ = ["supported", "quantize_mxfp4_2d", "quantize_mxfp4_dual", "quantize", "quantize_mxfp4_op", "quantize_op"]

SIDE_KEYS = ("rot", "signs", "rounding", "scale_rule", "key", "prescale", "index_strides", "key_tensor", "group_rows")


def supported(fmt: str, block_size=None) -> bool:
    """Formats the fused kernel implements (others fall back to the reference)."""
    return fmt == "mxfp4" and block_size in (None, 32)


def quantize_mxfp4_2d(x: torch.Tensor, axis: int, *, rot: int = 0, signs: torch.Tensor | None = None,
                      rounding: str = "nearest", scale_rule: str = "floor", key: int = 0,
                      prescale: float = 1.0, index_strides: tuple[int, int] | None = None,
                      carrier: bool = True, fp4: bool = True, group_rows: int = 1,
                      row_multiple: int = 16, block_rows: int | None = None, num_warps: int | None = None,
                      k_multiple: int = TILE_K,
                      counter: torch.Tensor | None = None, key_tensor: torch.Tensor | None = None,
                      force_idx64: bool = False, _check: bool = True) -> QuantOut:
    """Quantize a 2-D tensor to MXFP4 along ``axis`` (0 or 1) in one fused pass.

    ``index_strides``: logical (outer, reduction) strides of the element index used for stochastic
    rounding (defaults to ``x``'s contiguous layout). The carrier rows are padded to
    ``row_multiple`` (128 for 128x128 groups); padded rows hold zeros. ``counter``: an int32
    tensor of one element that the count of inexact carrier blocks is added to (and returned as
    ``inexact``), instead of a fresh zeroed one per call (saves a memset launch). ``key_tensor``: an
    int32 tensor whose first element the kernel reads as the stochastic-rounding key instead of ``key``
    (a CUDA graph then replays with whatever key is stored there; ``mxtrain.fast`` refreshes it).
    ``block_rows``, ``num_warps``: the tile shape (default: the launch table's, ``launch.block_config``).
    ``force_idx64``: the 64-bit offset variant even where 32-bit offsets suffice (tests run it on small
    shapes; by default it runs only for tensors whose offsets could pass 2**31 - 1). ``_check``: the
    variant's self-check where the ``qselfcheck`` setting applies (``verify.py``).
    """
    assert x.ndim == 2 and axis in (0, 1)
    if signs is not None:
        signs = signs.to(device=x.device, dtype=torch.float32).contiguous()
    pkey = None
    st = _settings.current()
    if use_plans(x, st):
        # everything the launch depends on, down to the 16-byte alignment Triton specializes on
        pkey = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() & 15, axis, rot,
                None if signs is None else signs.data_ptr() & 15, rounding, scale_rule, prescale, index_strides,
                carrier, fp4, group_rows, row_multiple, block_rows, num_warps, k_multiple,
                None if counter is None else counter.data_ptr() & 15,
                None if key_tensor is None else key_tensor.data_ptr() & 15, _check, force_idx64, st.launch_key)
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
    sr = rounding == "stochastic"
    Kq = ceil_to(ceil_to(max(K, 1), rot or 1), 32)   # the reference pads to whole rotation blocks first
    Kc = ceil_to(max(K, 1), k_multiple)  # fp8_carrier uses 512: cuBLAS wants K/128 % 4 == 0
    if group_rows == 128:
        row_multiple = 128
    kern = kernel_for(axis, rot, fp4, rows_contiguous=sx_r == 1 and sx_k != 1, kernel=st.qkernel)
    BR, num_warps = block_config(kern, axis, group_rows, sr, block_rows, num_warps)
    Rc = ceil_to(max(R, 1), max(row_multiple, 1)) if carrier else R
    Rgrid = Rc if carrier else R
    if carrier:
        car, gs, gs_base, gsr, gsk = carrier_buffers(Rc, Kc, group_rows, dev)
        cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
    else:
        car = gs = gs_base = None
        cnt = counter if counter is not None else torch.empty((1,), dtype=torch.int32, device=dev)
        gsr = gsk = 0
    if fp4:
        packed = torch.empty((R, Kq // 2), dtype=torch.uint8, device=dev)
        sc = torch.empty((R, Kq // 32), dtype=torch.uint8, device=dev)
    else:
        packed = sc = None
    if signs is not None:
        assert signs.numel() == rot
    floats = rot_floats(rot, prescale)
    grid = (triton.cdiv(max(Rgrid, 1), BR), Kc // TILE_K)
    idx64 = force_idx64 or needs_idx64(grid[0] * BR, Kc, Kq, sx_r, sx_k, si)
    compiled = kfn = consts = ints = None
    if R > 0 and K > 0:
        ints = (R, K, Rgrid, sx_r, sx_k, si[0], si[1], Kc, Kq, gsr, gsk)
        kfn, consts = single_kernel(kern, dev, x.dtype, BR, num_warps, rot, signs is not None, scale_rule, sr,
                                    prescale, group_rows, carrier, fp4, idx64, key_tensor is not None, st)
        opts = launch_opts(kern + ("128" if kern == "blocks" and group_rows == 128 else ""), dev, sr=sr,
                           maxnreg=st.qmaxnreg)
        args = single_args(x, cnt, signs, car, gs, packed, sc, key_tensor, ints, key, floats)
        compiled = launch(kern, kfn, grid, args, consts, num_warps, opts, x.shape)
    out = QuantOut(R, K, car.view(torch.float8_e4m3fn) if carrier else None, gs, group_rows,
                   cnt if carrier else None, packed, sc, gs_base)
    if (carrier and _check and selfcheck_applies(dev, st) and R > 0 and K > 0
            and not torch.compiler.is_compiling()
            and not config_ok(x, axis, rot, signs is not None, scale_rule, sr, prescale, group_rows, BR, num_warps,
                              k_multiple, fp4, R, K, st, force_idx64)):
        # safety net: this variant's fused carrier failed its self-check on this GPU; rebuild the
        # carrier from FP4 codes and scales of the FP4-only kernel (bit-exact on GPU) with torch ops
        q2 = quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding=rounding, scale_rule=scale_rule,
                               key=key, prescale=prescale, index_strides=index_strides, carrier=False,
                               fp4=True, group_rows=group_rows, block_rows=block_rows, k_multiple=k_multiple,
                               key_tensor=key_tensor, force_idx64=force_idx64, _check=False)
        out.packed, out.scales = q2.packed, q2.scales
        carrier_from_fp4(out, k_multiple, row_multiple)
        if not fp4:
            out.packed = out.scales = None
        return out
    if pkey is not None and pkey not in CACHES.plans:   # (bounded: least recently used plans are dropped)
        CACHES.plans[pkey] = Plan.make(kern, kfn, compiled, grid, ints, floats, consts, out, Kc, group_rows)
    return out


def quantize_mxfp4_dual(x: torch.Tensor, a: dict, b: dict, *, k_multiple: int = TILE_K,
                        counter: torch.Tensor | None = None, block_rows: tuple[int, int] | None = None,
                        num_warps: int | None = None, sequential: bool | None = None,
                        fp4_b: bool = False, force_idx64: bool = False,
                        _check: bool = True) -> tuple[QuantOut, QuantOut]:
    """The FP8-carrier outputs of ``quantize_mxfp4_2d(x, 1, **a, carrier=True, fp4=False)`` and
    ``quantize_mxfp4_2d(x, 0, **b, carrier=True, fp4=False)`` (bit-identical) from one pass over ``x``
    where ``dual_applies``, else from those two calls. ``a`` and ``b`` take the keyword options of
    ``quantize_mxfp4_2d`` (rot, signs, rounding, scale_rule, key, prescale, index_strides, key_tensor,
    group_rows). Both outputs add their inexact blocks to one counter (``counter``, or a new one).
    ``fp4_b``: B as ``quantize_mxfp4_2d(x, 0, **b, carrier=False, fp4=True)`` makes it (packed codes and
    E8M0 scales, ``group_rows`` kept for ``expand.carrier_from_packed``; nothing counted for B).
    ``block_rows`` (A, B), ``num_warps``, ``sequential``: kernel configuration (benchmark sweeps).
    ``force_idx64``: as in ``quantize_mxfp4_2d``, for both outputs."""
    for side in (a, b):
        bad = set(side) - set(SIDE_KEYS)
        if bad:
            raise TypeError(f"quantize_mxfp4_dual: unknown option(s) {sorted(bad)}; use {', '.join(SIDE_KEYS)}")
    if x.ndim != 2:
        raise ValueError(f"quantize_mxfp4_dual: x must be 2-D, got shape {tuple(x.shape)}")
    ra, rb = a.get("rot", 0), b.get("rot", 0)
    cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=x.device)
    st = _settings.current()
    checked = _check and selfcheck_applies(x.device, st)
    pkey = None
    if use_plans(x, st):
        # everything the launch depends on (as quantize_mxfp4_2d's plans), for both sides
        sides = []
        for side in (a, b):
            sg, kt = side.get("signs"), side.get("key_tensor")
            sides.append((side.get("rot", 0),
                          None if sg is None else (sg.dtype, sg.is_contiguous(), sg.data_ptr() & 15),
                          side.get("rounding", "nearest"), side.get("scale_rule", "floor"), side.get("prescale", 1.0),
                          side.get("index_strides"), side.get("group_rows", 1),
                          None if kt is None else kt.data_ptr() & 15))
        # and what decided for one pass (the dual and qkernel settings, the self-check): a plan is only made
        # after dual_applies and the variant's self-check passed, so a hit skips both (host time per call)
        pkey = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() & 15, tuple(sides), k_multiple,
                cnt.data_ptr() & 15, block_rows, num_warps, sequential, DUAL_CONFIG[b.get("group_rows", 1) == 128],
                DUAL_SEQ, st.launch_key, checked, fp4_b, force_idx64)
        plan = CACHES.dual_plans.get(pkey)
        if plan is not None:
            return plan(x, a, b, cnt)
    sr = a.get("rounding", "nearest") == "stochastic" or b.get("rounding", "nearest") == "stochastic"
    if not dual_applies(x, ra, rb, a.get("group_rows", 1), sr=sr) or (
            checked and not dual_ok(x, a, b, k_multiple, fp4_b, force_idx64)):
        return tuple(quantize_mxfp4_2d(x, ax, **side, carrier=not fp, fp4=fp, k_multiple=k_multiple,
                                       counter=cnt, force_idx64=force_idx64, _check=_check)
                     for ax, side, fp in ((1, a, False), (0, b, fp4_b)))
    M, K = x.shape
    dev = x.device
    gr_b = b.get("group_rows", 1)
    cfg = DUAL_CONFIG[gr_b == 128]
    nw = num_warps or cfg[2]
    bra, brb = block_rows or cfg[:2]
    seq = DUAL_SEQ if sequential is None else sequential
    BR = {1: bra, 0: brb}
    assert 128 % bra == 0 and brb in (64, 128) and (gr_b == 1 or brb == 128), (bra, brb, gr_b)
    pack = 4 * brb // (32 * nw)
    assert 4 * brb % (32 * nw) == 0 and pack in (2, 4, 8, 16), \
        "dual kernel: 4 x block_rows[1] must be 64, 128, ... x 32 x num_warps"
    outs, ptrs, dims, floats, consts, geo = [], [], [], [], {}, []
    for axis, side, R, Kr, sfx in ((1, a, M, K, "A"), (0, b, K, M, "B")):
        rot = side.get("rot", 0)
        signs = side.get("signs")
        if signs is not None:
            signs = signs.to(device=dev, dtype=torch.float32).contiguous()
            assert signs.numel() == rot
        gr = side.get("group_rows", 1)
        Kq = ceil_to(ceil_to(Kr, rot or 1), 32)
        Kc = ceil_to(Kr, k_multiple)
        Rc = ceil_to(R, 128 if gr == 128 else 16)
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
            car, gs, base, gsr, gsk = carrier_buffers(Rc, Kc, gr, dev)
            outs.append(QuantOut(R, Kr, car.view(torch.float8_e4m3fn), gs, gr, cnt, None, None, base))
        nr, nk = triton.cdiv(Rc, BR[axis]), Kc // TILE_K
        sx = (x.stride(0), 1) if axis == 1 else (1, x.stride(0))
        geo.append((nr, nk, force_idx64 or needs_idx64(nr * BR[axis], Kc, Kq, sx[0], sx[1], si)))
        ptrs.append((signs, car, gs, kt))
        dims.append((Rc, si[0], si[1], Kc, Kq, gsr, gsk))
        floats.append(rot_floats(rot, prescale))
        consts.update({f"BR_{sfx}": BR[axis], f"ROT_{sfx}": rot, f"HAS_SIGNS_{sfx}": signs is not None,
                       f"RULE_{sfx}": RULE_ID[side.get("scale_rule", "floor")], f"SR_{sfx}": rounding == "stochastic",
                       f"PRESCALE_{sfx}": prescale != 1.0, f"KEY_PTR_{sfx}": kt is not None,
                       f"FOLD_{sfx}": fold_applies(x.dtype, rot, prescale, st.qfold)})
    consts.update(GROUP_ROWS_B=gr_b, PACK_B=2 if pack == 2 else 4, IDX64=geo[0][2] or geo[1][2],
                  USE_ASM=dev.type == "cuda", JOIN_STORE=st.qjoin, SEQ=seq, CAR_B=not fp4_b, FP4_B=fp4_b)
    (nr_a, nk_a, _), (nr_b, nk_b, _) = geo
    NA, NB = 128 // BR[1], 128 // BR[0]
    F = max(nk_a, triton.cdiv(nr_b, NB))
    T = max(triton.cdiv(nr_a, NA), nk_b)
    grid = (T * F * (1 if seq else NA + NB),)
    ints = (M, K, x.stride(0), 1, *dims[0], *dims[1], nr_a, nk_a, nr_b, nk_b, F)
    args = dual_args(x, cnt, ptrs[0], ptrs[1], ints, a.get("key", 0), floats[0], b.get("key", 0), floats[1])
    compiled = launch("dual", _kernels._mxfp4_dual_kernel, grid, args, consts, nw,
                      launch_opts("dual", dev, sr=consts["SR_A"] or consts["SR_B"], maxnreg=st.qmaxnreg), x.shape)
    if pkey is not None:   # (bounded: least recently used plans are dropped)
        CACHES.dual_plans[pkey] = DualPlan.make(compiled, grid, ints, floats[0], floats[1], consts, outs)
    return outs[0], outs[1]


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
    from .. import kernels_available
    axis_n = axis % x.ndim
    nd_ok = x.ndim == 2 or (x.ndim > 2 and axis_n == x.ndim - 1)
    if not (supported(fmt if isinstance(fmt, str) else fmt.name, block_size) and nd_ok
            and kernels_available(x.device) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return reference_quantize(x, fmt, axis_n, block_size, rounding, scale_rule, seed, prescale, rotation, signs)
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
            si = (ceil_to(N, rotation), 1)
        else:
            si = (1, N)
    else:
        si = None
    q = quantize_mxfp4_2d(x2, a2, rot=rotation, signs=signs, rounding=rounding, scale_rule=scale_rule,
                          key=key, prescale=prescale, index_strides=si, carrier=False, fp4=True)
    if rotation:
        rshape = list(shape)
        rshape[axis_n] = ceil_to(shape[axis_n], rotation)
        shape = tuple(rshape)
    if x.ndim > 2:
        data = q.packed.reshape(*shape[:-1], -1)
        scales = q.scales.reshape(*shape[:-1], -1)
    else:
        data, scales = q.packed, q.scales
    return MXTensor(get_format("mxfp4"), data.view(torch.float4_e2m1fn_x2), scales, shape, axis_n, 32,
                    prescale=prescale, dtype=x.dtype)


# ---------------------------------------------------------------------------------------------- custom op
# torch.library op, so that torch.compile sees one opaque call with a fake (meta) implementation

@torch.library.custom_op("mxtrain::quantize_mxfp4", mutates_args=())
def quantize_mxfp4_op(x: torch.Tensor, signs: torch.Tensor | None, axis: int, rot: int, stochastic: bool,
                      rule: int, key: int, prescale: float, si0: int, si1: int, carrier: bool, fp4: bool,
                      group_rows: int, row_multiple: int,
                      k_multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
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
    car, gs, pk, sc = out_shapes(R, K, rot, carrier, fp4, group_rows, row_multiple, k_multiple)
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
                                              i32(key), float(prescale), si[0], si[1], carrier, fp4,
                                              group_rows, row_multiple, k_multiple)
    gview = None
    if carrier:
        gview = gs.t() if group_rows == 1 else gs[:, : ceil_to(max(K, 1), k_multiple) // TILE_K]
    return QuantOut(R, K, car.view(torch.float8_e4m3fn) if carrier else None, gview, group_rows,
                    cnt if carrier else None, pk if fp4 else None, sc if fp4 else None, gs if carrier else None)
