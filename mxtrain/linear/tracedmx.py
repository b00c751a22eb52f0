"""MXFP4 recipes' linear layer as traced PyTorch operations under ``torch.compile`` (setting ``mx_traced``).

Under ``torch.compile`` the MXFP4 fast path is a chain of opaque custom ops (``mxtrain::quantize_input``,
``mxtrain::linear_q``, ``mxtrain::linear_backward``): the compiler cannot fuse their quantizers into the
norm, activation and residual kernels around them, must store what they keep for the backward (X's Wgrad
operand as FP4 codes), and each call costs host time in Python. ``mxtrain.linear.tracedfp8`` gave the ``fp8`` recipe
torchao's speed and memory by writing its layer as traced operations; this module does the same for recipes
whose GEMMs are each either

* **MX**: both operands ``mxfp4`` (blocks of 32), round-to-nearest, prescale 1, a scale rule the kernels
  implement (``quant.SCALE_RULES``), with no rotation or a deterministic blockwise Hadamard rotation (sign mode ``none``: the AMD recipe's H16/H32),
* **plain**: both operands unquantized and not rotated (``mxfp4-fprop``'s backward GEMMs, say).

Stochastic rounding, random signs, prescales and other formats keep the custom ops (they need the call's
random streams or kernels of their own).

An MX GEMM here is the fast path's FP8-carrier GEMM written as traced operations: each operand is rotated
(``mxtrain.numerics.hadamard``: the reference's fixed butterfly order), split into blocks of 32 along the GEMM's
reduction axis, given the block exponent of the recipe's scale rule (``quant.mx_scale_exponent``), rounded
onto the E2M1 grid (``quant.round_to_elem``), and written as the FP8 carrier with float32 group scales
(``kernels.mxfp4.carrier``: ``v * 2**(s - G + 6)`` in e4m3 and ``2**(G - 6)`` per group of 1x128, or 128x128
for weights and Wgrad's X, ``G`` the group's largest block exponent); ``torch._scaled_mm`` multiplies the two
carriers (blockwise scales, inside the one small custom op ``mxtrain::carrier_mm``, which fixes the scale
layouts cuBLAS needs). Every step is exact (power-of-two multiplies, comparisons, the cast of a value the
e4m3 grid holds), so the compiled kernels give the fast path's carrier bytes bit for bit, and the GEMM is the
same call: outputs and gradients equal the fast path's. Blocks more than 14 binades below their group's
largest are rounded by the e4m3 cast as on the fast path, but **not counted** here: a training run that uses
this path logs its inexact-block counts as not counted (``mx_traced=off`` counts them; docs/kernels.md, "What
exact means on Hopper").

The layer keeps X and W for the backward and quantizes them again there (the compiler decides what to store
and what to recompute, as for torchao's float8 and ``tracedfp8``). On a CPU the carrier GEMM is emulated
(the carriers' values multiplied in float32), which the tests use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._constant import assume_constant_result
from ..numerics.formats import get_format
from ..numerics.hadamard import _INV_SQRT
from ..numerics.quant import SCALE_RULES, mx_scale_exponent, pow2
from ..numerics.recipe import Recipe
from .. import settings
from . import tensorfp8

__all__ = ["spec", "applies", "carrier", "linear"]

_E2M1 = get_format("mxfp4").elem
_TILE = 128          # reduction elements of one carrier group (4 MX blocks)
_KMUL = 512          # carrier reduction length multiple (cuBLAS's blockwise FP8 GEMM: K/128 % 4 == 0)
_MIN_G = -120        # group exponent floor (kernels.mxfp4.carrier.MIN_G)
_GEMMS = (("fprop", "fprop_x", "fprop_w"), ("dgrad", "dgrad_dy", "dgrad_w"), ("wgrad", "wgrad_dy", "wgrad_x"))


def spec(recipe: Recipe) -> str | None:
    """The recipe's three GEMMs as this module runs them (``"p"`` plain, ``"m<rot>:<rule A>:<rule B>"``
    MX), joined by ``;``; None where a GEMM is neither or none is MX. Depends on the recipe only. Scale rules
    the fused kernels do not implement (``adaptive``, the reference path's) get None: such a recipe never reaches
    a traced or compiled kernel form."""
    parts, mx = [], False
    for g, a, b in _GEMMS:
        oa, ob, rot = recipe.operand(a), recipe.operand(b), recipe.rotation(g)
        if not oa.quantized and not ob.quantized and not rot.enabled and oa.prescale == ob.prescale == 1.0:
            parts.append("p")
        elif (oa.fmt == ob.fmt == "mxfp4" and not oa.block_2d and not ob.block_2d
              and oa.rounding == ob.rounding == "nearest" and oa.prescale == ob.prescale == 1.0
              and (not rot.enabled or rot.signs == "none")
              and oa.scale_rule in SCALE_RULES and ob.scale_rule in SCALE_RULES):
            parts.append(f"m{rot.size if rot.enabled else 0}:{oa.scale_rule}:{ob.scale_rule}")
            mx = True
        else:
            return None
    return ";".join(parts) if mx else None


@assume_constant_result
def _plan(device: str) -> int:
    """Group rows of Wgrad's X (128 or 1, as the fast path chooses: ``gemm.activation_b_group_rows``) where
    the traced form can run on ``device`` (FP8 tensor cores, the blockwise GEMM with 128x128 weight groups
    exact, the fast path on), else 0. Called once per compiled graph: the inexact-block counts of
    ``device`` are then marked as not counted (``fast.state.missed``)."""
    from . import fast  # startup
    from ..kernels import gemm  # startup
    d = torch.device(device)
    if d.type == "cuda":
        if not tensorfp8._fp8_capable(d) or gemm.weight_group_rows(d) != 128:
            return 0
        rows = gemm.activation_b_group_rows(d)
    else:
        rows = 128 if settings.current().wgrad_b_group == 128 else 1
    fast.state.missed.add(fast.state._dev(d))
    return rows


def applies(mx: str, x: torch.Tensor, weight: torch.Tensor, mode: str = "auto") -> int:
    """Group rows of Wgrad's X where the traced form can run this call, else 0: ``mx`` from ``spec``;
    float16/bfloat16/float32 tensors on a GPU with FP8 tensor cores (CPU: only with ``mode`` ``always``, the
    tests' emulation); every GEMM dimension a multiple of 32. ``mode``: the ``mx_traced`` setting as the
    dispatcher read it (``linear.compiled_form``, which asks only with it on, the fast path on and
    ``exact_carrier`` off)."""
    if not mx or mode == "off":
        return 0
    if any(g.count(":") > 2 for g in mx.split(";")):
        return 0   # (compiledmx.spec's wider form: stochastic rounding, random signs or prescales)
    if x.device.type != "cuda" and mode != "always":
        return 0
    ok = (torch.float32, torch.bfloat16, torch.float16)
    if x.dtype not in ok or weight.dtype not in ok or weight.ndim != 2:
        return 0
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // max(K, 1)
    if M == 0 or any(d % 32 for d in (M, N, K)):
        return 0
    return _plan(str(x.device))


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def _rotate(r: torch.Tensor, n: int) -> torch.Tensor:
    """``hadamard(r, n, axis=-1)`` (no signs) for float32 ``r`` whose last axis is a multiple of ``n``, in the
    reference's arithmetic (butterfly stages h = 1, 2, ..., n/2: ``(a, b) -> (a + b, a - b)``, then one multiply by
    float32(1/sqrt(n))), written so that the compiler fuses every stage into the kernel that reads ``r``: each
    element takes its partner from the same pair through a flip (an index map), not from a concatenation."""
    lead, L = r.shape[:-1], r.shape[-1]
    first = torch.arange(2, device=r.device) == 0          # (a, b): which half of each pair
    h = 1
    while h < n:
        v = r.reshape(*lead, L // (2 * h), 2, h)
        partner = v.flip(-2)
        r = torch.where(first[:, None], v + partner, partner - v).reshape(*lead, L)
        h *= 2
    return r * _INV_SQRT[(n, torch.float32)]


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``quant.round_to_elem(v, E2M1, "nearest")`` in fewer operations: ``|v|`` saturated at 6, divided by its
    binade's spacing (0.5 below 2, 1 below 4, else 2; a multiply by a power of two, exact), rounded half to
    even, multiplied back, with ``v``'s sign (negative values that round to zero give -0)."""
    a = v.abs().clamp(max=6.0)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    inv = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))    # (a multiply: exact, never a division)
    return torch.copysign(torch.round(a * inv) * step, v)


def carrier(t: torch.Tensor, rot: int, rule: str, group_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 carrier of ``t`` (R, K) quantized to MXFP4 along K (its last axis) by ``rule`` after a
    deterministic ``rot``-element Hadamard rotation (0: none): (e4m3 (Rc, Kc), float32 group scales
    (Rc, Kc/128) for ``group_rows`` 1, (Rc/128, Kc/128) for 128), with Kc = K padded to a multiple of 512 and
    Rc = R padded to a multiple of 128 for 128-row groups (zeros). The bytes ``kernels.mxfp4`` writes.

    Written for the compiler: the group exponent ``G`` comes from the block exponents (small tensors), and each
    element is written as ``q * 2**(s - G + 6)`` straight from the input (one rounding, as the definition's
    ``(q * 2**s) * 2**(6 - G)``, both exact where the carrier holds the block), so no full-size float32 tensor
    needs to be kept between the two reductions."""
    R, K = t.shape
    r = t.to(torch.float32)
    if rot:
        if K % rot:
            r = F.pad(r, (0, (-K) % rot))
        r = _rotate(r, rot)
    Kc = _ceil(K, _KMUL)
    Rc = _ceil(R, 128) if group_rows == 128 else R
    if Kc != r.shape[1] or Rc != R:
        r = F.pad(r, (0, Kc - r.shape[1], 0, Rc - R))
    xb = r.reshape(Rc, Kc // 32, 32)
    finite = torch.isfinite(xb)
    ok = finite.all(-1)
    amax = torch.where(finite, xb.abs(), torch.zeros_like(xb)).amax(-1)
    s = mx_scale_exponent(amax, _E2M1, rule)                              # (Rc, Kc/32)
    se = torch.where(ok, s, torch.full_like(s, -127))
    g = se.reshape(Rc, Kc // _TILE, 4).amax(-1)                            # (Rc, Kc/128)
    if group_rows == 128:
        g = g.reshape(Rc // 128, 128, Kc // _TILE).amax(1).clamp(min=_MIN_G)   # (Rc/128, Kc/128)
        gb = g.reshape(Rc // 128, 1, Kc // _TILE, 1).expand(Rc // 128, 128, Kc // _TILE, 4).reshape(Rc, Kc // 32)
    else:
        g = g.clamp(min=_MIN_G)
        gb = g.reshape(Rc, Kc // _TILE, 1).expand(Rc, Kc // _TILE, 4).reshape(Rc, Kc // 32)
    v = torch.where(ok[..., None], xb * pow2(-s)[..., None], torch.zeros_like(xb))
    q = _round_e2m1(v)
    car = q * pow2((s - gb + 6).clamp(min=-149))[..., None]
    car = torch.where(ok[..., None], car, torch.full_like(car, float("nan")))
    return car.reshape(Rc, Kc).to(torch.float8_e4m3fn), pow2(g - 6)


def carrier_values(car: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """The float32 values a carrier holds (its e4m3 values times their group scales)."""
    Rc, Kc = car.shape
    if gs.shape[0] == Rc:
        return (car.to(torch.float32).reshape(Rc, Kc // _TILE, _TILE) * gs[..., None]).reshape(Rc, Kc)
    v = car.to(torch.float32).reshape(Rc // 128, 128, Kc // _TILE, _TILE) * gs.reshape(Rc // 128, 1, -1, 1)
    return v.reshape(Rc, Kc)


@torch.library.custom_op("mxtrain::carrier_mm", mutates_args=())
def _carrier_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype
                ) -> torch.Tensor:
    """``A B^T`` of two FP8 carriers (``carrier``'s outputs; A with 1x128 groups, B with 1x128 or 128x128), in
    ``out_dtype`` (bfloat16 or float32): ``torch._scaled_mm`` with the scale layouts cuBLAS takes (A's scales
    outer-dim-major, B's as the transpose of their row-major storage), as ``kernels.gemm`` calls it. On a CPU,
    the carriers' values multiplied in float32."""
    if a.device.type != "cuda":
        return torch.matmul(carrier_values(a, sa), carrier_values(b, sb).t()).to(out_dtype)
    sa = sa.t().contiguous().t()
    sb = sb.contiguous().t()
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), sa, sb, out_dtype=out_dtype)


@_carrier_mm.register_fake
def _(a, sa, b, sb, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _gemm(g: str, A: torch.Tensor, axA: int, B: torch.Tensor, axB: int, out_dtype: torch.dtype,
          amp: torch.dtype | None, b_rows: int) -> torch.Tensor:
    """One GEMM ``op(A) op(B)^T`` reduced along the given axes of the 2-D ``A`` and ``B``, as the fast path
    computes it (``fast._gemm_fn``), in ``out_dtype``."""
    ta = A if axA == 1 else A.t()
    tb = B if axB == 1 else B.t()
    if g == "p":
        if A.dtype == torch.bfloat16 and B.dtype == torch.bfloat16:
            y = torch.matmul(ta, tb.t())
        else:
            gd = amp if amp is not None else torch.float32
            y = torch.matmul(ta.to(torch.float32).to(gd), tb.to(torch.float32).to(gd).t())
        return y.to(torch.float32).to(out_dtype)
    rot, ra, rb = g[1:].split(":")
    ca, sa = carrier(ta, int(rot), ra, 1)
    cb, sb = carrier(tb, int(rot), rb, b_rows)
    odt = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    y = torch.ops.mxtrain.carrier_mm(ca, sa, cb, sb, odt)
    return y[: ta.shape[0], : tb.shape[0]].to(out_dtype)


class _TracedMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gemms, out_dtype, amp, x_rows):
        ctx.save_for_backward(x, weight)
        ctx.gemms, ctx.amp, ctx.x_rows, ctx.has_bias = gemms, amp, x_rows, bias is not None
        K, N = x.shape[-1], weight.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, K)
            if bias is None:
                y = _gemm(gemms[0], x2, 1, weight, 1, out_dtype, amp, 128)
            else:
                y = (_gemm(gemms[0], x2, 1, weight, 1, torch.float32, amp, 128)
                     + bias.to(torch.float32)).to(out_dtype)
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        g = ctx.gemms
        n = ctx.needs_input_grad
        dx = dw = db = None
        K, N = x.shape[-1], weight.shape[0]
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, N)
            if n[0]:
                # dX (M, K) = Q(dY) along N x Q(W) along N
                dx = _gemm(g[1], dy2, 1, weight, 0, x.dtype, ctx.amp, 128).reshape(x.shape)
            if n[1]:
                # dW (N, K) = Q(dY^T) along tokens x Q(X^T) along tokens
                dw = _gemm(g[2], dy2, 0, x.reshape(-1, K), 0, weight.dtype, ctx.amp, ctx.x_rows)
            if ctx.has_bias and n[2]:
                db = dy2.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mx: str, x_rows: int) -> torch.Tensor:
    """``x @ weight.T + bias`` with the GEMMs ``spec`` described as ``mx``, in the autocast dtype where
    autocast is on (as the fast path); ``x_rows``: ``applies``'s answer."""
    dt = x.device.type
    amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
    out_dtype = amp if amp is not None else x.dtype
    return _TracedMXLinear.apply(x, weight, bias, tuple(mx.split(";")), out_dtype, amp, x_rows)
