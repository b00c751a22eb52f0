"""The quantize kernels' runtime self-check: the safety net of compiled variants.

The first time a kernel variant runs (same constexprs, input dtype and the divisibility-by-16 of sizes and
strides that Triton specializes on), it quantizes a random tensor and compares every output with one built
by torch ops from the reference quantizer (``selfcheck``; the dual pass: with the two single passes). The
result is kept in ``CACHES.verified`` / ``CACHES.dual_verified``. A single-pass variant that fails is served
from then on by the FP4-only kernel plus ``carrier.carrier_from_fp4`` (exact, slower), a dual variant by the
two single passes, each with a ``RuntimeWarning``. Where it runs: the ``qselfcheck`` setting (``auto``: GPUs,
where a miscompiled variant is possible; ``always``: every device, Triton's interpreter too; ``off``).

The quantizers checked are given to this module, not imported by it: ``ops`` (which imports this module) passes
``quantize_mxfp4_2d`` / ``quantize_mxfp4_dual`` in its calls and hands them in once as the defaults
(``set_quantizers``) for the other callers (``traced``, ``mxtrain.kernels.mxfp4.selfcheck``).
"""

from __future__ import annotations

import warnings

import torch

from ...numerics import rng as _rng
from ... import settings as _settings
from ..caches import CACHES
from .carrier import QuantOut, carrier_from_fp4, ceil_to, reference_quantize
from .launch import DUAL_SEQ, dual_config, kernel_for

__all__ = ["selfcheck_applies", "config_ok", "dual_ok", "selfcheck", "set_quantizers"]

_QUANTIZERS: dict = {}   # "single", "dual": the fused quantizers checked where a caller passes none


def set_quantizers(single, dual) -> None:
    """The quantizers checked by default: ``single`` as ``ops.quantize_mxfp4_2d``, ``dual`` as
    ``ops.quantize_mxfp4_dual`` (``ops`` hands them in when it is imported)."""
    _QUANTIZERS.update(single=single, dual=dual)


def selfcheck_applies(device: torch.device, st) -> bool:
    """Whether kernel variants are self-checked for tensors on ``device`` (the ``qselfcheck`` setting of ``st``)."""
    mode = st.qselfcheck
    return mode == "always" or (mode == "auto" and device.type == "cuda")


def config_ok(x: torch.Tensor, axis: int, rot: int, has_signs: bool, scale_rule: str, sr: bool,
              prescale: float, group_rows: int, BR: int, nw: int, k_multiple: int, fp4: bool,
              R: int, K: int, st=None, force_idx64: bool = False, quantize_fn=None, fmt: str = "mxfp4") -> bool:
    """Once per compiled kernel variant: is the fused carrier right?

    Runs the same variant (every constexpr, the dtype, and the divisibility-by-16 of the sizes and
    strides that Triton specializes on) on a random tensor and compares carrier bytes and group
    scales with ones built by torch ops from the reference quantizer's output (``mxtrain.numerics.quant``).
    ``st``: the settings the variant runs under (default: the current ones). ``quantize_fn``: the fused
    quantizer checked (default: ``set_quantizers``' ``single``, ``ops.quantize_mxfp4_2d``). ``fmt``: the MX format
    (``carrier.KERNEL_FORMATS``).
    """
    st = st or _settings.current()
    r16, k16 = R % 16 == 0, K % 16 == 0
    rc = False
    if x.ndim == 2:
        sx_r, sx_k = (x.stride(0), x.stride(1)) if axis == 1 else (x.stride(1), x.stride(0))
        rc = sx_r == 1 and sx_k != 1
    vkey = (x.device.index, x.dtype, axis, rot, has_signs, scale_rule, fmt, sr, prescale != 1.0, group_rows, BR, nw,
            k_multiple, fp4, r16, k16, force_idx64, st.qmaxnreg, st.qblocks,
            kernel_for(axis, rot, fp4, rc, kernel=st.qkernel))
    ok = CACHES.verified.get(vkey)
    if ok is None:
        ok = selfcheck(x.device, x.dtype, axis, rot, has_signs, scale_rule, sr, prescale, group_rows, BR, nw,
                       k_multiple, fp4, r16, k16, rows_contiguous=rc, force_idx64=force_idx64,
                       quantize_fn=quantize_fn, fmt=fmt)["ok"]
        CACHES.verified[vkey] = ok
        if not ok:
            warnings.warn(f"mxtrain: fused FP8-carrier kernel variant {vkey} failed its self-check on this GPU; "
                          "using the exact (slower) torch fallback for it", RuntimeWarning, stacklevel=3)
    return ok


def dual_ok(x: torch.Tensor, a: dict, b: dict, k_multiple: int, fp4_b: bool = False, force_idx64: bool = False,
            dual_fn=None, single_fn=None) -> bool:
    """Once per dual-kernel variant: are both outputs bit-identical to the two single passes
    (themselves self-checked against the reference quantizer)? Runs the variant on a random tensor with
    the same dtype, options and divisibility of the sizes by 16. ``dual_fn``: the one-pass quantizer
    checked (default ``quantize_mxfp4_dual``; tests pass a faulty one); ``single_fn``: the single pass it is
    compared with (default ``quantize_mxfp4_2d``); defaults from ``set_quantizers``."""
    dual_fn = dual_fn or _QUANTIZERS["dual"]
    single_fn = single_fn or _QUANTIZERS["single"]
    M, K = x.shape

    def opt(side):
        s = side.get("signs")
        return (side.get("rot", 0), s is not None, side.get("rounding", "nearest"), side.get("scale_rule", "floor"),
                side.get("prescale", 1.0) != 1.0, side.get("group_rows", 1), side.get("fmt", "mxfp4"))
    st = _settings.current()
    vkey = (x.device.index, x.dtype, opt(a), opt(b), k_multiple, M % 16 == 0, K % 16 == 0,
            dual_config(a.get("group_rows", 1), b.get("group_rows", 1), st), DUAL_SEQ, st.qmaxnreg, st.qblocks,
            force_idx64, fp4_b)
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
        got = dual_fn(xt, *sides, k_multiple=k_multiple, fp4_b=fp4_b, force_idx64=force_idx64, _check=False)
        want = [single_fn(xt, ax, **s, carrier=not fp, fp4=fp, k_multiple=k_multiple, force_idx64=force_idx64)
                for ax, s, fp in ((1, sides[0], False), (0, sides[1], fp4_b))]
        ok = all(torch.equal(p.packed, q.packed) and torch.equal(p.scales, q.scales) if q.carrier is None
                 else torch.equal(p.carrier.view(torch.uint8), q.carrier.view(torch.uint8))
                 and torch.equal(p.gscale, q.gscale) for p, q in zip(got, want))
        ok = ok and int(got[0].inexact.item()) == sum(int(w.inexact.item()) for w in want if w.inexact is not None)
        CACHES.dual_verified[vkey] = ok
        if not ok:
            warnings.warn(f"mxtrain: dual quantize variant {vkey} differed from two single passes on this GPU; "
                          "using two passes for it", RuntimeWarning, stacklevel=3)
    return ok


def selfcheck(device, dtype, axis: int, rot: int, has_signs: bool, scale_rule: str, sr: bool, prescale: float,
              group_rows: int, BR: int, nw: int, k_multiple: int, fp4: bool, r16: bool = True, k16: bool = True,
              samples: int = 0, rows_contiguous: bool | None = None, force_idx64: bool = False,
              quantize_fn=None, fmt: str = "mxfp4") -> dict:
    """Run one fused-kernel variant on a fixed random tensor and compare every output with the one
    built by torch ops from the reference quantizer. Returns ``ok`` and, per output, the number of
    mismatching entries (``samples`` > 0 adds the first mismatching carrier entries, for diagnosis).
    ``rows_contiguous``: lay the tensor out with the output rows contiguous (default: row-major, which
    makes them contiguous along columns only), as the variant being checked reads it. ``force_idx64``: the
    variant with 64-bit offsets. ``quantize_fn``: the fused quantizer checked (default
    ``quantize_mxfp4_2d``, from ``set_quantizers``; tests pass a faulty one). ``fmt``: the MX format
    (``carrier.KERNEL_FORMATS``), checked against the reference quantizer of that format."""
    if quantize_fn is None:
        quantize_fn = _QUANTIZERS["single"]
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
    q = quantize_fn(t, axis, rot=rot, signs=signs, rounding="stochastic" if sr else "nearest",
                    scale_rule=scale_rule, key=_rng.stream_key(seed), prescale=prescale,
                    index_strides=(ceil_to(Kt, rot) if rot else Kt, 1) if axis == 1 else None,
                    carrier=True, fp4=fp4, group_rows=group_rows, block_rows=BR, num_warps=nw,
                    k_multiple=k_multiple, force_idx64=force_idx64, _check=False,
                    **({} if fmt == "mxfp4" else {"fmt": fmt}))
    ref = reference_quantize(t, fmt, axis, None, "stochastic" if sr else "nearest", scale_rule, seed, prescale,
                             rot, signs)
    qr = QuantOut(Rt, Kt, None, None, group_rows, None, ref.data.view(torch.uint8).reshape(Rt, -1),
                  ref.scales.reshape(Rt, -1), fmt=fmt)
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
