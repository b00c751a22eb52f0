"""The public MXFP4 quantize operations: ``quantize_mxfp4_2d`` (one fused pass over a 2-D view, along rows
or columns), ``quantize_mxfp4_dual`` (both FP8-carrier operands of an activation from one read), the
drop-in ``quantize`` (an ``MXTensor``, as ``mxtrain.quantize``) and the custom op ``mxtrain::quantize_mxfp4``
(``quantize_mxfp4_op``; ``quantize_op`` calls it under ``torch.compile``).

Bit-exactness with ``mxtrain.numerics.quant.quantize`` (the spec) comes from the kernels doing the same float32
operations (``device.py``); ``verify.py`` checks each compiled variant once on GPUs.
"""

from __future__ import annotations

import torch

from ...numerics import rng
from ... import settings as _settings
from ...numerics.formats import get_format
from ...numerics.quant import MXTensor
from ..caches import CACHES
from . import kernels as _kernels   # (its kernels exist where Triton imports; read at launch time)
from .carrier import (KERNEL_FORMATS, TILE_K, QuantOut, carrier_buffers, carrier_from_fp4, ceil_to, out_shapes,
                      reference_quantize)
from .launch import (DUAL_SEQ, GROUP_MAX, GRID_ID, KERNEL_GRIDS, KERNEL_RULES, DualPlan, Plan, dual_applies,
                     dual_config, group_args, group_key, group_spec,
                     dual_args, dual_spec, i32, launch, single_args, single_spec, use_plans)
from .verify import config_ok, dual_ok, selfcheck_applies, set_quantizers
from .. import kernels_available

try:
    import triton
except Exception:  # pragma: no cover
    triton = None

__all__ = ["supported", "quantize_mxfp4_2d", "quantize_mxfp4_dual", "quantize_mxfp4_group", "quantize",
           "quantize_mxfp4_op", "quantize_op"]

SIDE_KEYS = ("rot", "signs", "rounding", "scale_rule", "key", "prescale", "index_strides", "key_tensor", "group_rows",
             "fmt")


def supported(fmt: str, block_size=None) -> bool:
    """Formats the fused kernel implements (others fall back to the reference): ``mxfp4`` and the uniform 4-bit
    grid ``mxint4`` (``carrier.KERNEL_FORMATS``), 32-element blocks."""
    return fmt in KERNEL_FORMATS and block_size in (None, 32)


def quantize_mxfp4_2d(x: torch.Tensor, axis: int, *, rot: int = 0, signs: torch.Tensor | None = None,
                      rounding: str = "nearest", scale_rule: str = "floor", key: int = 0,
                      prescale: float = 1.0, index_strides: tuple[int, int] | None = None,
                      carrier: bool = True, fp4: bool = True, group_rows: int = 1,
                      row_multiple: int = 16, block_rows: int | None = None, num_warps: int | None = None,
                      k_multiple: int = TILE_K,
                      counter: torch.Tensor | None = None, key_tensor: torch.Tensor | None = None,
                      force_idx64: bool = False, fmt: str = "mxfp4", _check: bool = True) -> QuantOut:
    """Quantize a 2-D tensor to MXFP4 (or ``fmt``: ``mxint4``, ``carrier.KERNEL_FORMATS``) along ``axis`` (0 or 1)
    in one fused pass.

    ``index_strides``: logical (outer, reduction) strides of the element index used for stochastic
    rounding (defaults to ``x``'s contiguous layout). The carrier rows are padded to
    ``row_multiple`` (128 for 128x128 groups); padded rows hold zeros. ``counter``: an int32
    tensor of one element that the count of inexact carrier blocks is added to (and returned as
    ``inexact``), instead of a fresh zeroed one per call (saves a memset launch). ``key_tensor``: an
    int32 tensor whose first element the kernel reads as the stochastic-rounding key instead of ``key``
    (a CUDA graph then replays with whatever key is stored there; ``mxtrain.linear.fast`` refreshes it).
    ``block_rows``, ``num_warps``: the tile shape (default: the launch table's, ``launch.block_config``).
    ``force_idx64``: the 64-bit offset variant even where 32-bit offsets suffice (tests run it on small
    shapes; by default it runs only for tensors whose offsets could pass 2**31 - 1). ``_check``: the
    variant's self-check where the ``qselfcheck`` setting applies (``verify.py``).
    """
    assert x.ndim == 2 and axis in (0, 1)
    if fmt not in GRID_ID:
        raise ValueError(f"quantize_mxfp4_2d: format {fmt!r} has no fused kernel; valid: {', '.join(GRID_ID)}")
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
                None if key_tensor is None else key_tensor.data_ptr() & 15, _check, force_idx64, st.launch_key, fmt)
        plan = CACHES.plans.get(pkey)
        if plan is not None:
            return plan(x, signs, key, counter, key_tensor)
    dev = x.device
    sp = single_spec(x.shape, x.stride(), x.dtype, dev, axis, rot=rot, has_signs=signs is not None,
                     rounding=rounding, scale_rule=scale_rule, prescale=prescale, index_strides=index_strides,
                     carrier=carrier, fp4=fp4, group_rows=group_rows, row_multiple=row_multiple,
                     block_rows=block_rows, num_warps=num_warps, k_multiple=k_multiple,
                     key_ptr=key_tensor is not None, force_idx64=force_idx64, st=st, fmt=fmt)
    R, K, Kc, Kq = sp.R, sp.K, sp.Kc, sp.Kq
    sr = rounding == "stochastic"
    if group_rows == 128:
        row_multiple = 128
    if carrier:
        car, gs, gs_base, _, _ = carrier_buffers(sp.Rc, Kc, group_rows, dev)
        cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
    else:
        car = gs = gs_base = None
        cnt = counter if counter is not None else torch.empty((1,), dtype=torch.int32, device=dev)
    if fp4:
        packed = torch.empty((R, Kq // 2), dtype=torch.uint8, device=dev)
        sc = torch.empty((R, Kq // 32), dtype=torch.uint8, device=dev)
    else:
        packed = sc = None
    if signs is not None:
        assert signs.numel() == rot
    floats, grid, BR, num_warps = sp.floats, sp.grid, sp.consts["BR"], sp.num_warps
    compiled = kfn = consts = ints = None
    if R > 0 and K > 0:
        ints, kfn, consts = sp.ints, sp.kfn, sp.consts
        args = single_args(x, cnt, signs, car, gs, packed, sc, key_tensor, ints, key, floats)
        compiled = launch(sp.kern, kfn, grid, args, consts, num_warps, sp.opts, x.shape)
    out = QuantOut(R, K, car.view(torch.float8_e4m3fn) if carrier else None, gs, group_rows,
                   cnt if carrier else None, packed, sc, gs_base, fmt)
    if (carrier and _check and selfcheck_applies(dev, st) and R > 0 and K > 0
            and not torch.compiler.is_compiling()
            and not config_ok(x, axis, rot, signs is not None, scale_rule, sr, prescale, group_rows, BR, num_warps,
                              k_multiple, fp4, R, K, st, force_idx64, quantize_fn=quantize_mxfp4_2d, fmt=fmt)):
        # safety net: this variant's fused carrier failed its self-check on this GPU; rebuild the
        # carrier from FP4 codes and scales of the FP4-only kernel (bit-exact on GPU) with torch ops
        q2 = quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding=rounding, scale_rule=scale_rule,
                               key=key, prescale=prescale, index_strides=index_strides, carrier=False,
                               fp4=True, group_rows=group_rows, block_rows=block_rows, k_multiple=k_multiple,
                               key_tensor=key_tensor, force_idx64=force_idx64, fmt=fmt, _check=False)
        out.packed, out.scales = q2.packed, q2.scales
        carrier_from_fp4(out, k_multiple, row_multiple)
        if not fp4:
            out.packed = out.scales = None
        return out
    if pkey is not None and pkey not in CACHES.plans:   # (bounded: least recently used plans are dropped)
        CACHES.plans[pkey] = Plan.make(sp.kern, kfn, compiled, grid, ints, floats, consts, out, Kc, group_rows)
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
                          None if kt is None else kt.data_ptr() & 15, side.get("fmt", "mxfp4")))
        # and what decided for one pass (the dual and qkernel settings, the self-check): a plan is only made
        # after dual_applies and the variant's self-check passed, so a hit skips both (host time per call)
        pkey = (x.device, x.dtype, x.shape, x.stride(), x.data_ptr() & 15, tuple(sides), k_multiple,
                cnt.data_ptr() & 15, block_rows, num_warps, sequential,
                dual_config(a.get("group_rows", 1), b.get("group_rows", 1), st), DUAL_SEQ, st.launch_key, checked,
                fp4_b, force_idx64)
        plan = CACHES.dual_plans.get(pkey)
        if plan is not None:
            return plan(x, a, b, cnt)
    sr = a.get("rounding", "nearest") == "stochastic" or b.get("rounding", "nearest") == "stochastic"
    weight_groups_ok = a.get("group_rows", 1) == 1 or b.get("group_rows", 1) == 128   # (launch.dual_spec)
    if not weight_groups_ok or not dual_applies(x, ra, rb, a.get("group_rows", 1), sr=sr) or (
            checked and not dual_ok(x, a, b, k_multiple, fp4_b, force_idx64, dual_fn=quantize_mxfp4_dual,
                                    single_fn=quantize_mxfp4_2d)):
        return tuple(quantize_mxfp4_2d(x, ax, **side, carrier=not fp, fp4=fp, k_multiple=k_multiple,
                                       counter=cnt, force_idx64=force_idx64, _check=_check)
                     for ax, side, fp in ((1, a, False), (0, b, fp4_b)))
    dev = x.device
    sp = dual_spec(x.shape, x.stride(0), x.dtype, dev, a, b, k_multiple=k_multiple, block_rows=block_rows,
                   num_warps=num_warps, sequential=sequential, fp4_b=fp4_b, force_idx64=force_idx64, st=st)
    outs, ptrs = [], []
    for side, (R, Kr, Rc, Kc, Kq, gr, fp) in zip((a, b), sp.sides):
        signs = side.get("signs")
        if signs is not None:
            signs = signs.to(device=dev, dtype=torch.float32).contiguous()
            assert signs.numel() == side.get("rot", 0)
        fmt = side.get("fmt", "mxfp4")
        if fp:   # packed codes and scales take the carrier's and group scales' places
            car = torch.empty((R, Kq // 2), dtype=torch.uint8, device=dev)
            gs = torch.empty((R, Kq // 32), dtype=torch.uint8, device=dev)
            outs.append(QuantOut(R, Kr, None, None, gr, None, car, gs, fmt=fmt))
        else:
            car, gs, base, _, _ = carrier_buffers(Rc, Kc, gr, dev)
            outs.append(QuantOut(R, Kr, car.view(torch.float8_e4m3fn), gs, gr, cnt, None, None, base, fmt))
        ptrs.append((signs, car, gs, side.get("key_tensor")))
    grid, ints, floats, consts = sp.grid, sp.ints, (sp.floats_a, sp.floats_b), sp.consts
    args = dual_args(x, cnt, ptrs[0], ptrs[1], ints, a.get("key", 0), floats[0], b.get("key", 0), floats[1])
    compiled = launch("dual", _kernels._mxfp4_dual_kernel, grid, args, consts, sp.num_warps, sp.opts, x.shape)
    if pkey is not None:   # (bounded: least recently used plans are dropped)
        CACHES.dual_plans[pkey] = DualPlan.make(compiled, grid, ints, floats[0], floats[1], consts, outs)
    return outs[0], outs[1]


def quantize_mxfp4_group(xs: list, axis: int, *, rot: int = 0, signs: torch.Tensor | None = None,
                         rounding: str = "nearest", scale_rule: str = "floor", key: int = 0, prescale: float = 1.0,
                         group_rows: int = 1, row_multiple: int = 16, k_multiple: int = TILE_K,
                         counter: torch.Tensor | None = None, key_tensor: torch.Tensor | None = None,
                         fmt: str = "mxfp4") -> list:
    """The FP8 carriers of ``quantize_mxfp4_2d(x, axis, ..., carrier=True, fp4=False)`` for every ``x`` of ``xs``
    (2-D tensors of one dtype and device, each with the index strides of its own layout), bit-identical, in
    launches of ``_mxfp4_group_kernel`` of up to ``launch.GROUP_MAX`` tensors each where they are one kernel variant
    (``launch.group_key``; the rest, one launch each). All add their inexact blocks to one counter (``counter``, or a
    new one). Made for a model's weights, whose passes are small grids: one launch each leaves most of a GPU idle
    (the compiled layer's ``w_group`` setting groups them in the graph; this is the same launch, eagerly)."""
    st = _settings.current()
    if not xs:
        return []
    dev = xs[0].device
    cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
    if signs is not None:
        signs = signs.to(device=dev, dtype=torch.float32).contiguous()
    specs = [single_spec(x.shape, x.stride(), x.dtype, dev, axis, rot=rot, has_signs=signs is not None,
                         rounding=rounding, scale_rule=scale_rule, prescale=prescale, index_strides=None,
                         carrier=True, fp4=False, group_rows=group_rows, row_multiple=row_multiple, block_rows=None,
                         num_warps=None, k_multiple=k_multiple, key_ptr=key_tensor is not None, force_idx64=False,
                         st=st, fmt=fmt) for x in xs]
    outs: list = [None] * len(xs)
    by_key: dict = {}
    for i, sp in enumerate(specs):
        k = group_key(sp)
        if k is None or xs[i].dtype != xs[0].dtype:
            outs[i] = quantize_mxfp4_2d(xs[i], axis, rot=rot, signs=signs, rounding=rounding, scale_rule=scale_rule,
                                        key=key, prescale=prescale, carrier=True, fp4=False, group_rows=group_rows,
                                        row_multiple=row_multiple, k_multiple=k_multiple, counter=cnt,
                                        key_tensor=key_tensor, fmt=fmt, _check=False)
        else:
            by_key.setdefault(k, []).append(i)
    for idx in by_key.values():
        for c in range(0, len(idx), GROUP_MAX):
            part = idx[c:c + GROUP_MAX]
            gsp = group_spec([specs[i] for i in part])
            members = []
            for i in part:
                sp = specs[i]
                car, gs, base, _, _ = carrier_buffers(sp.Rc, sp.Kc, group_rows, dev)
                outs[i] = QuantOut(sp.R, sp.K, car.view(torch.float8_e4m3fn), gs, group_rows, cnt, None, None,
                                   base, fmt)
                members.append((xs[i], car, gs))
            args = group_args(cnt, signs, key_tensor, members, gsp, key)
            launch("group", _kernels._mxfp4_group_kernel, gsp.grid, args, gsp.consts, gsp.num_warps, gsp.opts,
                   xs[part[0]].shape)
    return outs


set_quantizers(quantize_mxfp4_2d, quantize_mxfp4_dual)   # (what verify checks where a caller passes none)


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
    fname = fmt if isinstance(fmt, str) else fmt.name
    q = quantize_mxfp4_2d(x2, a2, rot=rotation, signs=signs, rounding=rounding, scale_rule=scale_rule,
                          key=key, prescale=prescale, index_strides=si, carrier=False, fp4=True, fmt=fname)
    if rotation:
        rshape = list(shape)
        rshape[axis_n] = ceil_to(shape[axis_n], rotation)
        shape = tuple(rshape)
    if x.ndim > 2:
        data = q.packed.reshape(*shape[:-1], -1)
        scales = q.scales.reshape(*shape[:-1], -1)
    else:
        data, scales = q.packed, q.scales
    if fname == "mxfp4":   # (as mxtrain.quantize: E2M1 codes as torch's FP4 dtype, other 4-bit grids as uint8)
        data = data.view(torch.float4_e2m1fn_x2)
    return MXTensor(get_format(fname), data, scales, shape, axis_n, 32, prescale=prescale, dtype=x.dtype)


# ---------------------------------------------------------------------------------------------- custom op
# torch.library op, so that torch.compile sees one opaque call with a fake (meta) implementation

@torch.library.custom_op("mxtrain::quantize_mxfp4", mutates_args=())
def quantize_mxfp4_op(x: torch.Tensor, signs: torch.Tensor | None, axis: int, rot: int, stochastic: bool,
                      rule: int, key: int, prescale: float, si0: int, si1: int, carrier: bool, fp4: bool,
                      group_rows: int, row_multiple: int, k_multiple: int,
                      grid: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused MXFP4 quantize as one op: (carrier uint8, group scales (contiguous; 1x128 ones
    transposed: (Kc/128, Rc)), inexact count, packed FP4, E8M0 scales); unused outputs are empty. ``grid``: the
    format's ``launch.GRID_ID``."""
    rules = {v: k for k, v in KERNEL_RULES.items()}
    fmts = {v: k for k, v in KERNEL_GRIDS.items()}
    q = quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding="stochastic" if stochastic else "nearest",
                          scale_rule=rules[rule], key=key, prescale=prescale, index_strides=(si0, si1),
                          carrier=carrier, fp4=fp4, group_rows=group_rows, row_multiple=row_multiple,
                          k_multiple=k_multiple, fmt=fmts[grid])

    def e(dt=torch.uint8):
        return torch.empty((0, 0), dtype=dt, device=x.device)
    car = q.carrier.view(torch.uint8) if carrier else e()
    gs = q.gs_base if carrier else e(torch.float32)
    cnt = q.inexact if carrier else torch.zeros((1,), dtype=torch.int32, device=x.device)
    return car, gs, cnt, q.packed if fp4 else e(), q.scales if fp4 else e()


@quantize_mxfp4_op.register_fake
def _(x, signs, axis, rot, stochastic, rule, key, prescale, si0, si1, carrier, fp4, group_rows, row_multiple,
      k_multiple, grid=0):
    R, K = (x.shape[0], x.shape[1]) if axis == 1 else (x.shape[1], x.shape[0])
    car, gs, pk, sc = out_shapes(R, K, rot, carrier, fp4, group_rows, row_multiple, k_multiple)
    return (x.new_empty(car, dtype=torch.uint8), x.new_empty(gs, dtype=torch.float32),
            x.new_empty((1,), dtype=torch.int32), x.new_empty(pk, dtype=torch.uint8),
            x.new_empty(sc, dtype=torch.uint8))


def quantize_op(x: torch.Tensor, axis: int, *, rot: int = 0, signs=None, rounding: str = "nearest",
                scale_rule: str = "floor", key: int = 0, prescale: float = 1.0, index_strides=None,
                carrier: bool = True, fp4: bool = True, group_rows: int = 1, row_multiple: int = 16,
                k_multiple: int = TILE_K, counter: torch.Tensor | None = None,
                key_tensor: torch.Tensor | None = None, fmt: str = "mxfp4") -> QuantOut:
    """``quantize_mxfp4_2d`` through the registered op under ``torch.compile`` (eagerly: a direct
    call, which saves the custom-op dispatch overhead); same result either way."""
    if not torch.compiler.is_compiling():
        return quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding=rounding, scale_rule=scale_rule, key=key,
                                 prescale=prescale, index_strides=index_strides, carrier=carrier, fp4=fp4,
                                 group_rows=group_rows, row_multiple=row_multiple, k_multiple=k_multiple,
                                 counter=counter, key_tensor=key_tensor, fmt=fmt)
    if key_tensor is not None:
        raise NotImplementedError("quantize_op: a key in device memory is for eager CUDA-graph capture, "
                                  "not for torch.compile")
    if axis == 1:
        R, K = x.shape
        si = index_strides or (x.shape[1], 1)
    else:
        K, R = x.shape
        si = index_strides or (1, x.shape[1])
    car, gs, cnt, pk, sc = quantize_mxfp4_op(x, signs, axis, rot, rounding == "stochastic", KERNEL_RULES[scale_rule],
                                              i32(key), float(prescale), si[0], si[1], carrier, fp4,
                                              group_rows, row_multiple, k_multiple, KERNEL_GRIDS[fmt])
    gview = None
    if carrier:
        gview = gs.t() if group_rows == 1 else gs[:, : ceil_to(max(K, 1), k_multiple) // TILE_K]
    return QuantOut(R, K, car.view(torch.float8_e4m3fn) if carrier else None, gview, group_rows,
                    cnt if carrier else None, pk if fp4 else None, sc if fp4 else None, gs if carrier else None, fmt)
