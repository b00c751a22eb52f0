"""Fast MXLinear path: fused Triton quantizers + capability-dispatched MX GEMMs.

Same function as the reference ``mxtrain.nn._MXLinearFunction`` (the spec): every MXFP4 operand
is quantized from the high-precision tensor by the fused kernel, bit-identical to
``_Ctx.operand`` (same rotation, signs, seeds and stochastic-rounding index), and the GEMMs
multiply exactly those MX values (on sm_90 through the FP8 e4m3 carrier and blockwise
``torch._scaled_mm``). Only fp32 accumulation order and the bf16 rounding of GEMM outputs differ.

Used automatically by ``MXLinear`` for CUDA inputs when ``supported(recipe)``: every operand is
``mxfp4`` (32-element blocks) or ``bf16``, with any rotation, rounding, scale rule or prescale.
A GEMM whose two operands are not both MXFP4 runs exactly as the reference does.

Weight reuse: a weight operand with round-to-nearest is quantized once per (weight version, step,
sign vector) and reused by later micro-batches (stochastic rounding of W draws a fresh stream for
every call in the reference, so it is never reused). Fprop quantizes W along in-features and
Dgrad along out-features, so those two are different operands and are not shared.

Activation reuse: layers that read the same input (a Llama block's q/k/v and gate/up projections)
quantize its Fprop and Wgrad operands once (nearest rounding, same rotation and sign vector; see
``REUSE_ACTIVATIONS``). ``inexact_blocks()`` then counts such an operand once.

CUDA graphs (``train.cuda_graphs``): while a graph is captured, both caches only return operands
quantized within that capture, so every replay recomputes them from the current weights and inputs.
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import rng
from .kernels import backend as _backend, kernels_available
from .kernels import gemm as _gemm
from .kernels.quantize import QuantOut, quantize_op
from .nn import _OPERAND_ID, _Ctx, _gemm_dtype

__all__ = ["supported", "apply", "ENABLED", "inexact_blocks", "clear_caches"]

# False forces the reference path everywhere; the environment variable MXTRAIN_FAST=0 does the same
# from the command line (e.g. `MXTRAIN_FAST=0 mxtrain train ...`).
ENABLED = os.environ.get("MXTRAIN_FAST", "1").strip().lower() not in ("0", "false", "no", "off")


def supported(recipe) -> bool:
    """Recipes the fast path implements: every operand ``mxfp4`` (default blocks) or ``bf16``."""
    if not ENABLED:
        return False
    from .recipe import OPERANDS
    for n in OPERANDS:
        op = recipe.operand(n)
        if op.fmt not in ("mxfp4", "bf16") or op.block_2d:
            return False
    return True


_COUNTERS: dict = {}


def _counter(device) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros((1,), dtype=torch.int32, device=device)
    return c


def inexact_blocks(device="cuda") -> int:
    """Running count of MXFP4 blocks that the FP8 carrier could not hold exactly (more than 14
    binades below their group's largest block) over every fast-path quantize on ``device`` so far
    (0 means every GEMM multiplied the exact MX values). Reading it synchronizes the device."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    c = _COUNTERS.get(d)
    return int(c.item()) if c is not None else 0


# Activation reuse: the last quantized X operand of Fprop and of Wgrad (nearest rounding) is kept and
# reused when the next layer quantizes the same tensor the same way, as the q/k/v projections and the
# gate/up projections of a Llama block do (three and two layers on one input). The reference
# quantizes each time; the operands are identical, so results are too. One entry per operand holds
# the input tensor and its quantized form until the next quantize of that operand or clear_caches().
REUSE_ACTIVATIONS = os.environ.get("MXTRAIN_REUSE_ACT", "1").strip().lower() not in ("0", "false", "no", "off")
_ACT_OPERANDS = ("fprop_x", "wgrad_x")
_ACT_CACHE: dict = {}


def clear_caches() -> None:
    """Drop the reused activation operands (frees their memory; results are unaffected)."""
    _ACT_CACHE.clear()


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


# Host-side per-call work is what limits small layers (scripts/host_overhead.py): the recipe's
# operand and rotation specs are looked up once per recipe object, and sign vectors are made once per
# (size, mode, seed, layer, GEMM, step, device) instead of by ~20 small kernels every call.
_SPECS: dict = {}
_SIGNS: dict = {}


def _spec(recipe):
    e = _SPECS.get(id(recipe))
    if e is None or e[0] is not recipe:
        from .recipe import GEMMS, OPERANDS
        e = (recipe, {n: recipe.operand(n) for n in OPERANDS}, {g: recipe.rotation(g) for g in GEMMS})
        _SPECS[id(recipe)] = e
    return e


def _signs(qctx: _Ctx, gemm: str, device) -> torch.Tensor | None:
    """``qctx.signs(gemm, device)``, made once and shared (callers never write to it)."""
    rot = _spec(qctx.recipe)[2][gemm]
    if not rot.enabled or rot.signs == "none":
        return None
    mode = rot.signs
    k = (rot.size, mode, qctx.recipe.seed, device,
         qctx.layer if mode in ("per_layer", "per_step") else 0,
         gemm if mode == "per_step" else "", qctx.step if mode == "per_step" else 0)
    s = _SIGNS.get(k)
    if s is None:
        if len(_SIGNS) >= 4096:  # per-step signs: old steps are never asked for again
            _SIGNS.clear()
        s = _SIGNS[k] = qctx.signs(gemm, device)
    return s


class _WeightCache:
    """Per-module cache of quantized weight operands (see module docstring)."""

    def __init__(self):
        self.entries: dict = {}


def _quant(qctx: _Ctx, t: torch.Tensor, axis: int, name: str, gemm: str, signs, backend: str,
           group_rows: int, cache: dict | None = None) -> tuple[QuantOut, float]:
    """Quantize one MXFP4 operand of a 2-D tensor along ``axis`` exactly as ``_Ctx.operand`` does."""
    _, ops, rots = _spec(qctx.recipe)
    op = ops[name]
    rot = rots[gemm]
    rsize = rot.size if rot.enabled else 0
    key = 0
    if op.rounding == "stochastic":
        seed = rng.stream_key(qctx.recipe.seed, qctx.layer, _OPERAND_ID[name], qctx.step, qctx.call)
        key = rng.stream_key(seed)
    # logical index strides of the (rotation-padded) tensor the reference quantizes
    if axis == 1:
        si = (_ceil(t.shape[1], rsize) if rsize else t.shape[1], 1)
    else:
        si = (1, t.shape[1])
    carrier, fp4 = _gemm.outputs_for(backend)
    ck = None
    act = None
    if op.rounding == "nearest" and not torch.compiler.is_compiling():
        # a CUDA graph being captured may only reuse operands quantized inside the same capture (an
        # eagerly made one would be a constant of the graph, never recomputed on replay), and eager
        # code only eager ones; the capture state is part of every key
        capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
        if cache is not None:
            ck = (name, t.data_ptr(), t._version, qctx.step, backend, group_rows, capturing)
            hit = cache.get(name)
            if hit is not None and hit[0] == ck:
                return hit[1], op.prescale
        elif name in _ACT_OPERANDS and REUSE_ACTIVATIONS:
            # the same input quantized the same way by the layer before (q/k/v, gate/up projections)
            act = (name, t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                   t._version, axis, rsize, id(signs), op.scale_rule, op.prescale, backend, group_rows, capturing)
            hit = _ACT_CACHE.get(name)
            if hit is not None and hit[0] == act:
                return hit[2], op.prescale
    q = quantize_op(t, axis, rot=rsize, signs=signs, rounding=op.rounding, scale_rule=op.scale_rule, key=key,
                    prescale=op.prescale, index_strides=si, carrier=carrier, fp4=fp4, group_rows=group_rows,
                    k_multiple=_gemm.k_multiple_for(backend), counter=_counter(t.device))
    if ck is not None:
        cache[name] = (ck, q)
    if act is not None:
        # holding t (and signs) keeps their memory from being reused, so the address, version and
        # layout in the key name these very values for as long as the entry lives
        _ACT_CACHE[name] = (act, (t, signs), q)
    return q, op.prescale


def _both_mx(recipe, a: str, b: str) -> bool:
    ops = _spec(recipe)[1]
    return ops[a].fmt == "mxfp4" and ops[b].fmt == "mxfp4"


def _gemm_fn(qctx: _Ctx, A: torch.Tensor, axA: int, nA: str, B: torch.Tensor, axB: int, nB: str, gemm: str,
             b_is_weight: bool, backend: str, out_dtype, cache) -> torch.Tensor:
    """One GEMM ``op(A) op(B)^T`` reduced along the quantization axes, in float32 (or out_dtype)."""
    dev = A.device
    signs = _signs(qctx, gemm, dev)
    recipe = qctx.recipe
    if _both_mx(recipe, nA, nB):
        qa, pa = _quant(qctx, A, axA, nA, gemm, signs, backend, 1)
        gr = _gemm.weight_group_rows(dev) if b_is_weight else (
            _gemm.activation_b_group_rows(dev) if backend == "fp8_carrier" else 1)
        qb, pb = _quant(qctx, B, axB, nB, gemm, signs, backend, gr, cache if b_is_weight else None)
        return _gemm.mx_gemm_nt(qa, qb, backend, out_dtype, pa * pb)
    else:  # as the reference: fake-quantized / rotated dense operands
        gd = _gemm_dtype(recipe, nA, nB, gemm, dev.type)
        plain = not (recipe.rotation(gemm).enabled or recipe.operand(nA).quantized or recipe.operand(nB).quantized)
        if plain and A.dtype == torch.bfloat16 and B.dtype == torch.bfloat16:
            # plain bf16 operands (e.g. tseng's Fprop): exact in bf16, fp32 accumulation in cuBLAS
            ta, tb, pa, pb, gd = A, B, 1.0, 1.0, torch.bfloat16
        else:
            ta, pa = qctx.operand(A, axA, nA, gemm, signs)
            tb, pb = qctx.operand(B, axB, nB, gemm, signs)
        ta = ta if axA == 1 else ta.t()
        tb = tb if axB == 1 else tb.t()
        y = torch.matmul(ta.to(gd), tb.to(gd).t()).to(torch.float32)
    if pa * pb != 1.0:
        y = y / (pa * pb)
    return y.to(out_dtype)


def _no_autocast(device_type: str, enabled: bool):
    """Autocast off inside (entering ``torch.autocast`` costs host time, so only when it is on)."""
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


class _FastMXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qctx: _Ctx, cache):
        dev = x.device
        amp = torch.is_autocast_enabled(dev.type)
        out_dtype = torch.get_autocast_dtype(dev.type) if amp else x.dtype
        backend = _backend(dev)
        x2 = x.reshape(-1, x.shape[-1])
        with _no_autocast(dev.type, amp):
            ydt = torch.float32 if (bias is not None or backend != "fp8_carrier") else out_dtype
            y = _gemm_fn(qctx, x2, 1, "fprop_x", weight, 1, "fprop_w", "fprop", True, backend, ydt, cache)
            if bias is not None:
                y = y + bias.to(torch.float32)
        ctx.save_for_backward(x2, weight)
        ctx.qctx, ctx.cache, ctx.has_bias, ctx.x_shape, ctx.x_dtype = qctx, cache, bias is not None, x.shape, x.dtype
        ctx.backend = backend
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        qctx: _Ctx = ctx.qctx
        backend = ctx.backend
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        with _no_autocast(dy.device.type, torch.is_autocast_enabled(dy.device.type)):
            if ctx.needs_input_grad[0]:
                # dX (M, K) = Q(dY) [rows, along N] x Q(W) [columns, along N]
                dx = _gemm_fn(qctx, dy2, 1, "dgrad_dy", weight, 0, "dgrad_w", "dgrad", True, backend,
                              ctx.x_dtype if backend == "fp8_carrier" else torch.float32, ctx.cache)
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                # dW (N, K) = Q(dY^T) [along tokens] x Q(X^T) [along tokens]
                dw = _gemm_fn(qctx, dy2, 0, "wgrad_dy", x2, 0, "wgrad_x", "wgrad", False, backend,
                              weight.dtype if backend == "fp8_carrier" else torch.float32, None)
                dw = dw.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy2.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None, None


def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: _Ctx,
          module=None) -> torch.Tensor:
    """The fast MXLinear forward (autograd-aware). ``module`` (optional) holds the weight cache."""
    ok_dt = (torch.float32, torch.bfloat16, torch.float16)
    if not kernels_available(x.device) or x.dtype not in ok_dt or weight.dtype not in ok_dt:
        from .nn import _MXLinearFunction
        return _MXLinearFunction.apply(x, weight, bias, qctx)
    cache = None
    if module is not None:
        cache = module.__dict__.setdefault("_mx_weight_cache", {})
    return _FastMXLinearFunction.apply(x, weight, bias, qctx, cache)
