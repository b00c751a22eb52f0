"""The MX linear layer under ``torch.compile``, compiled into the graph (setting ``mx_compiled``).

Under ``torch.compile`` the fast path used to be opaque Python custom ops (``mxtrain::quantize_input``,
``mxtrain::linear_q``, ``mxtrain::linear_backward``) that re-made every decision at every call: about 1.2 ms of
host time a layer on a GPU server, more than the GPU work of a layer of a 125M model (BENCHMARKS.md). Here the
layer is a traced ``autograd.Function`` whose forward and backward call the quantize kernels as ``triton_op``s
(``kernels.mxfp4.traced``: ``q_dual``, ``q_single``, ``q_expand``) and multiply the FP8 carriers with a traced
``torch._scaled_mm``. Every decision (recipe, kernel variant, grid, group rows, padding) is made once, when the
graph is traced; at run time the layer is the lines inductor's generated code holds for it: kernel launches and
GEMM calls.

It computes what the fast path computes, with the same kernels and the same GEMM calls: X's Fprop operand and
its Wgrad operand (as packed FP4 codes, 0.53 bytes an element) from one read of X (the dual kernel), W's
operands with 128x128 groups, dY's two operands from one read, X's carrier rebuilt from its codes before the
Wgrad GEMM. Outputs and gradients are the eager fast path's bit for bit (cuda tests), and the inexact-block
counts are kept as eagerly (``fast.state``).

Which recipes: those ``tracedmx.spec`` describes, each GEMM either MXFP4 on both operands with round to
nearest, prescale 1 and no or a deterministic Hadamard rotation (``mxfp4-all``, ``mxfp4-all-dh16``,
``mxfp4-all-dh32``, ``+amd`` scale rules, ``mxfp4-fprop``...) or plain. Recipes with stochastic rounding, random
signs or prescales (``mxfp4-all-sr``, ``mxfp4-all-rht16``, ``tseng``) keep the custom ops for now.
Where: CUDA tensors (float32, bfloat16, float16) on a GPU whose FP8 GEMM takes 128x128 weight groups exactly
(Hopper), the fast path on, ``exact_carrier`` off. ``route_layer`` answers which form a compiled layer takes.
"""

from __future__ import annotations

import torch

from ._constant import assume_constant_result
from .kernels.mxfp4 import traced as _traced  # noqa: F401  (registers mxtrain::q_single, q_dual, q_expand)

__all__ = ["applies", "linear", "plan"]

_KMUL = 512          # carrier reduction multiple (kernels.gemm.k_multiple_for("fp8_carrier"))
_TILE = 128
_OK = (torch.float32, torch.bfloat16, torch.float16)


@assume_constant_result
def plan(device: str) -> tuple:
    """``(x_rows, w_rows)``: group rows of Wgrad's X and of the weights on ``device``, or ``(0, 0)`` where the
    compiled layer cannot run there (no FP8 tensor cores, the FP8-carrier GEMM not the device's backend,
    128x128 weight groups not exact). Makes the inexact-block counters of the device (outside any graph,
    static addresses for CUDA graphs). Called with the tracing modes off, once per graph."""
    from . import fast
    from .kernels import backend, gemm
    from .kernels.mxfp4.traced import AVAILABLE
    d = torch.device(device)
    if d.type != "cuda" or not AVAILABLE or backend(d) != "fp8_carrier":
        return (0, 0)
    if gemm.weight_group_rows(d) != 128:
        return (0, 0)
    fast.state.prepare(d)
    if not COUNT:
        fast.state.missed.add(fast.state._dev(d))
    return (gemm.activation_b_group_rows(d), 128)


def applies(mx: str, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """``plan``'s answer where the compiled layer runs this call, else ``(0, 0)``: ``mx`` from
    ``tracedmx.spec`` (non-empty), the settings ``mx_compiled`` (``auto``) and ``fast`` on, ``exact_carrier`` off,
    CUDA float tensors, a 2-D weight, a non-empty input."""
    from . import settings
    s = settings.current()
    if not mx or s.mx_compiled != "auto" or not s.fast or s.exact_carrier:
        return (0, 0)
    if x.device.type != "cuda" or x.dtype not in _OK or weight.dtype not in _OK or weight.ndim != 2:
        return (0, 0)
    if x.numel() == 0 or weight.numel() == 0:
        return (0, 0)
    return plan(str(x.device))


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def _mm(ca: torch.Tensor, ga: torch.Tensor, Ra: int, cb: torch.Tensor, gb: torch.Tensor, rows_b: int, Rb: int,
        out_dtype: torch.dtype) -> torch.Tensor:
    """``A B^T`` of two carriers (``q_*``'s outputs: A with 1x128 group-scale storage (Kc/128, Rca), B with
    ``rows_b`` 1 or 128), the first ``Ra`` x ``Rb`` entries, in ``out_dtype``: the fast path's
    ``kernels.gemm.mx_gemm_nt`` (the same ``_scaled_mm`` call and scale views)."""
    odt = out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    Kc = ca.shape[1]
    sa = ga.t()                                          # (Rca, Kc/128), outer-dim-major
    sb = gb if rows_b == 1 else gb[:, : Kc // _TILE].t()  # (Kc/128, Rcb) or (Kc/128, Rcb/128)
    if ca.device.type != "cuda":   # (the tests' emulation on a CPU: the carriers' values in float32)
        from .tracedmx import carrier_values
        va = carrier_values(ca.view(torch.float8_e4m3fn), sa)
        vb = carrier_values(cb.view(torch.float8_e4m3fn), sb.t())
        return torch.matmul(va, vb.t())[:Ra, :Rb].to(odt).to(out_dtype)
    y = torch._scaled_mm(ca.view(torch.float8_e4m3fn), cb.view(torch.float8_e4m3fn).t(), sa, sb, out_dtype=odt)
    if y.shape[0] != Ra or y.shape[1] != Rb:
        y = y[:Ra, :Rb]
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _parse(g: str) -> tuple[int, str, str]:
    rot, ra, rb = g[1:].split(":")
    return int(rot), ra, rb


def _dual_ok(t2: torch.Tensor, rot_a: int, rot_b: int) -> bool:
    """Does one pass make both operands of ``t2`` (``launch.dual_applies`` on the trace's tensor)?"""
    from .kernels.mxfp4.launch import dual_applies
    return dual_applies(t2, rot_a, rot_b)


def _quant_rows(t2: torch.Tensor, cnt, rot: int, rule: str, group_rows: int):
    """``t2`` (R, K) quantized along K: (carrier, group-scale storage)."""
    c, g, _, _ = torch.ops.mxtrain.q_single(t2, cnt, 1, rot, rule, True, False, group_rows, _KMUL)
    return c, g


def _quant_cols(t2: torch.Tensor, cnt, rot: int, rule: str, group_rows: int, fp4: bool = False):
    """``t2`` (M, K) quantized along M (the operand of K rows): (carrier, group-scale storage) or, with
    ``fp4``, (packed codes, E8M0 scales)."""
    c, g, p, s = torch.ops.mxtrain.q_single(t2, cnt, 0, rot, rule, not fp4, fp4, group_rows, _KMUL)
    return (p, s) if fp4 else (c, g)


class _CompiledMXLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gemms, out_dtype, amp, x_rows, keep_wgrad):
        from .tracedmx import _gemm as plain_gemm
        cx, cw, _ = _counters(x.device)
        K, N = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, K).contiguous()
        M = x2.shape[0]
        need_wgrad = keep_wgrad and ctx.needs_input_grad[1] and gemms[2] != "p"
        ydt = torch.float32 if bias is not None else out_dtype
        ctx.gemms, ctx.amp, ctx.x_rows, ctx.has_bias, ctx.x_dtype = gemms, amp, x_rows, bias is not None, x.dtype
        ctx.x_shape, ctx.saved_codes = x.shape, False
        xcodes = None
        # (no autocast context here: dynamo's trace of one inside an autograd.Function left autocast off for the
        # layers after it; nothing below depends on autocast: custom ops, _scaled_mm, and plain GEMMs whose
        # operands are cast to the GEMM dtype first)
        if gemms[0] == "p":
            y = plain_gemm("p", x2, 1, weight, 1, ydt, amp, 128)
        else:
            rot, ra, rb = _parse(gemms[0])
            if need_wgrad:
                rot_w, _, rule_x = _parse(gemms[2])
                if _dual_ok(x2, rot, rot_w):
                    ca, ga, pk, sc = torch.ops.mxtrain.q_dual(x2, cx, rot, ra, rot_w, rule_x, x_rows, True, _KMUL)
                else:
                    ca, ga = _quant_rows(x2, cx, rot, ra, 1)
                    pk, sc = _quant_cols(x2, cx, rot_w, rule_x, x_rows, fp4=True)
                xcodes = (pk, sc)
            else:
                ca, ga = _quant_rows(x2, cx, rot, ra, 1)
            cw_, gw_ = _quant_rows(weight, cw, rot, rb, 128)
            y = _mm(ca, ga, M, cw_, gw_, 128, N, ydt)
        if bias is not None:
            y = (y + bias.to(torch.float32)).to(out_dtype)
        if xcodes is not None:
            ctx.save_for_backward(xcodes[0], xcodes[1], weight)
            ctx.saved_codes = True
        else:
            ctx.save_for_backward(x2, weight)
        return y.reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        from .tracedmx import _gemm as plain_gemm
        g = ctx.gemms
        n = ctx.needs_input_grad
        if ctx.saved_codes:
            pk, sc, weight = ctx.saved_tensors
            x2 = None
        else:
            x2, weight = ctx.saved_tensors
        cx, cw, cdy = _counters(dy.device)
        K, N = weight.shape[1], weight.shape[0]
        dx = dw = db = None
        dy2 = dy.reshape(-1, N).contiguous()
        M = dy2.shape[0]
        pre = {}
        if n[0] and n[1] and g[1] != "p" and g[2] != "p":
            rot_d, rule_dy, _ = _parse(g[1])
            rot_w, rule_wdy, _ = _parse(g[2])
            if _dual_ok(dy2, rot_d, rot_w):
                a0, a1, b0, b1 = torch.ops.mxtrain.q_dual(dy2, cdy, rot_d, rule_dy, rot_w, rule_wdy, 1, False, _KMUL)
                pre = {"dgrad": (a0, a1), "wgrad": (b0, b1)}
        if n[0]:
            odt = ctx.x_dtype
            if g[1] == "p":
                dx = plain_gemm("p", dy2, 1, weight, 0, odt, ctx.amp, 128)
            else:
                rot_d, rule_dy, rule_w = _parse(g[1])
                ca, ga = pre["dgrad"] if "dgrad" in pre else _quant_rows(dy2, cdy, rot_d, rule_dy, 1)
                cb, gb = _quant_cols(weight, cw, rot_d, rule_w, 128)
                dx = _mm(ca, ga, M, cb, gb, 128, K, odt)
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        if n[1]:
            if g[2] == "p":
                dw = plain_gemm("p", dy2, 0, x2, 0, weight.dtype, ctx.amp, ctx.x_rows)
            else:
                rot_w, rule_wdy, rule_x = _parse(g[2])
                ca, ga = pre["wgrad"] if "wgrad" in pre else _quant_cols(dy2, cdy, rot_w, rule_wdy, 1)
                if x2 is None:
                    cb, gb = torch.ops.mxtrain.q_expand(pk, sc, cx, M, ctx.x_rows, _KMUL)
                else:
                    cb, gb = _quant_cols(x2, cx, rot_w, rule_x, ctx.x_rows)
                dw = _mm(ca, ga, N, cb, gb, ctx.x_rows, K, weight.dtype)
            dw = dw.to(weight.dtype)
        if ctx.has_bias and n[2]:
            db = dy2.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None, None, None


# Inexact-block counts: the ops add to the device's running counters (``fast.state``), made by ``plan`` before
# the graph. ``COUNT`` False: each op gets a scratch counter instead and the device's counts are marked as not
# counted (``fast.state.missed``).
COUNT = True


def _counters(device: torch.device) -> tuple:
    from . import fast
    if COUNT:
        return fast.state.by_name[str(device)]
    return tuple(torch.empty((1,), dtype=torch.int32, device=device) for _ in range(3))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mx: str, rows: tuple) -> torch.Tensor:
    """``x @ weight.T + bias`` with the GEMMs ``tracedmx.spec`` described as ``mx``, as the compiled layer
    (``applies``' answer ``rows``), in the autocast dtype where autocast is on (as the fast path)."""
    from . import settings
    dt = x.device.type
    amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
    out_dtype = amp if amp is not None else x.dtype
    keep = torch.is_grad_enabled() and weight.requires_grad and settings.current().wgrad_x == "forward"
    return _CompiledMXLinear.apply(x, weight, bias, tuple(mx.split(";")), out_dtype, amp, rows[0], keep)
