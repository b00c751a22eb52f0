"""The custom ops ``torch.compile`` sees for an MX linear call that is not traced into the graph:
``mxtrain::call_seeds`` (the call's random inputs from the layer's state tensor; advances its call counter),
``mxtrain::linear`` and ``mxtrain::linear_backward`` (the fast path or the reference, decided in Python at each
call, opaque to the compiler, with fake implementations and registered autograd), and the split pair
``mxtrain::quantize_input`` / ``mxtrain::linear_q`` (layers that read one input share its quantization)."""

from __future__ import annotations

from typing import Optional

import torch

from . import tensorfp8
from .context import Ctx
from .dispatch import _recipe_from_json, call_seeds, route
from .reference import keeps_fp8_x, ref_backward, ref_forward

_AMP = {"": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_AMP_NAME = {v: k for k, v in _AMP.items()}


@torch.library.custom_op("mxtrain::call_seeds", mutates_args=("state",))
def _call_seeds_op(state: torch.Tensor, recipe: str, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # ``grad``: the grad mode where the layer was called, fixed when the graph was traced (a compiled forward
    # itself runs without grad mode)
    return call_seeds(state, _recipe_from_json(recipe), grad)


@_call_seeds_op.register_fake
def _(state, recipe, grad):
    return state.new_empty((24,), dtype=torch.int32), state.new_empty((3, 128), dtype=torch.float32)


def _op_ctx(recipe: Recipe, keys, signs) -> Ctx:
    """The context inside the custom ops. It counts inexact carrier blocks only into counters made before
    (``fast.state.prepare``: an MX layer made on or moved to a GPU makes them): a counter first made here
    would be a tensor that outlives the call, which a CUDA graph tree (``mode="reduce-overhead"``) refuses
    when it was first made during its warm-up."""
    c = Ctx(recipe) if keys is None and signs is None else Ctx.from_seeds(recipe, keys, signs)
    c.count = "existing"
    return c


def _empty(like: torch.Tensor, dtype=torch.uint8) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


@torch.library.custom_op("mxtrain::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], keys: Optional[torch.Tensor],
               signs: Optional[torch.Tensor], recipe: str, amp: str,
               need_wgrad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Y, S0, S1)``: the layer output and, on the fast path, the two tensors of X's Wgrad operand
    quantized in the forward (FP8 carrier + group scales, or FP4 codes + E8M0 scales) that the backward
    keeps instead of X; empty otherwise."""
    r = _recipe_from_json(recipe)
    qctx = _op_ctx(r, keys, signs)
    a = _AMP[amp]
    if route(r, x, weight) == "fast":
        from . import fast  # startup
        y, wq = fast.forward(x, weight, bias, qctx, a, need_wgrad, reuse=False)
        # (contiguous: the padded GEMM output's slice is a strided view; the fake says contiguous)
        y = y.contiguous()
        if wq is not None:
            s0, s1 = fast.pack_operand(wq)
            return y, s0, s1
        return y, _empty(x), _empty(x)
    if need_wgrad and keeps_fp8_x(r, x, weight):   # (X's FP8 codes and scale, kept instead of X)
        y, (codes, scale, _) = ref_forward(x, weight, bias, qctx, a, keep_x=True)
        return y.contiguous(), codes, scale.reshape(())
    return ref_forward(x, weight, bias, qctx, a).contiguous(), _empty(x), _empty(x)


@_linear_op.register_fake
def _(x, weight, bias, keys, signs, recipe, amp, need_wgrad):
    r = _recipe_from_json(recipe)
    a = _AMP[amp]
    y = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=a if a is not None else x.dtype)
    if route(r, x, weight) == "fast":
        from . import fast  # startup
        shapes = fast.saved_operand_shapes(r, x, weight, need_wgrad)
        if shapes is not None:
            (sh0, dt0), (sh1, dt1) = shapes
            return y, x.new_empty(sh0, dtype=dt0), x.new_empty(sh1, dtype=dt1)
    elif need_wgrad and keeps_fp8_x(r, x, weight):
        M = x.numel() // max(x.shape[-1], 1)
        return (y, x.new_empty((M, x.shape[-1]), dtype=tensorfp8.FP8_DTYPES[r.operand("fprop_x").fmt]),
                x.new_empty((), dtype=torch.float32))
    return y, _empty(x), _empty(x)


@torch.library.custom_op("mxtrain::linear_backward", mutates_args=())
def _linear_backward_op(dy: torch.Tensor, x: Optional[torch.Tensor], weight: torch.Tensor, s0: torch.Tensor,
                        s1: torch.Tensor, keys: Optional[torch.Tensor], signs: Optional[torch.Tensor], recipe: str,
                        amp: str, x_dtype: torch.dtype, need_dx: bool, need_dw: bool,
                        need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dX, dW, db) of ``mxtrain::linear`` (empty where not needed)."""
    r = _recipe_from_json(recipe)
    qctx = _op_ctx(r, keys, signs)
    a = _AMP[amp]
    need = (need_dx, need_dw, need_db)
    if s0.numel() and s0.dtype in tensorfp8.FP8_DTYPES.values():   # X's FP8 codes (keeps_fp8_x)
        dx, dw, db = ref_backward(dy, None, weight, qctx, a, need, x_codes=(s0, s1, r.operand("wgrad_x").prescale),
                                  x_dtype=x_dtype)
    elif s0.numel():
        from . import fast  # startup
        wq = fast.unpack_operand(s0, s1, weight.shape[1], dy.numel() // max(dy.shape[-1], 1))
        dx, dw, db = fast.backward(dy, None, weight, wq, qctx, a, x_dtype, need)
    elif route(r, x, weight) == "fast":
        from . import fast  # startup
        dx, dw, db = fast.backward(dy, x, weight, None, qctx, a, x_dtype, need)
    else:
        dx, dw, db = ref_backward(dy, x, weight, qctx, a, need)
    e = _empty(dy, weight.dtype)
    return (dx.contiguous() if dx is not None else _empty(dy, x_dtype)), (dw.contiguous() if dw is not None else e), \
        (db.contiguous() if db is not None else e)


@_linear_backward_op.register_fake
def _(dy, x, weight, s0, s1, keys, signs, recipe, amp, x_dtype, need_dx, need_dw, need_db):
    dx = dy.new_empty((*dy.shape[:-1], weight.shape[1]), dtype=x_dtype) if need_dx else dy.new_empty((0,), dtype=x_dtype)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty((0,))
    db = weight.new_empty((weight.shape[0],)) if need_db else weight.new_empty((0,))
    return dx, dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, keys, signs, recipe, amp, need_wgrad = inputs
    _, s0, s1 = output
    ctx.saved_x = s0.numel() == 0
    ctx.save_for_backward(x if ctx.saved_x else None, weight, s0, s1, keys, signs)
    ctx.recipe, ctx.amp, ctx.x_dtype, ctx.has_bias = recipe, amp, x.dtype, bias is not None
    ctx.mark_non_differentiable(s0, s1)


def _backward(ctx, dy, _g0, _g1):
    x, weight, s0, s1, keys, signs = ctx.saved_tensors
    n = ctx.needs_input_grad
    need = (n[0], n[1], ctx.has_bias and n[2])
    dx, dw, db = torch.ops.mxtrain.linear_backward(dy, x, weight, s0, s1, keys, signs, ctx.recipe, ctx.amp,
                                                   ctx.x_dtype, *need)
    return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None, None, None, None, None, None)


_linear_op.register_autograd(_backward, setup_context=_setup_context)


# The fast path in two ops, so that layers reading one input (q/k/v, gate/up) share its quantization in a
# compiled graph: ``quantize_input`` is a pure function of (x, seeds, recipe), so the compiler's common
# subexpression elimination runs it once for all of them (and the backward of each keeps the same
# quantized tensors); ``linear_q`` multiplies.

@torch.library.custom_op("mxtrain::quantize_input", mutates_args=())
def _quantize_input_op(x: torch.Tensor, keys: Optional[torch.Tensor], signs: Optional[torch.Tensor], recipe: str,
                       need_wgrad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """X's Fprop operand (two tensors) and, with ``need_wgrad``, its Wgrad operand (two tensors, else empty)."""
    from . import fast  # startup
    r = _recipe_from_json(recipe)
    pre = fast.quantize_input(x.reshape(-1, x.shape[-1]), _op_ctx(r, keys, signs), need_wgrad)
    f0, f1 = fast.pack_operand(pre["fprop_x"][0])
    if "wgrad_x" in pre:
        w0, w1 = fast.pack_operand(pre["wgrad_x"][0])
        return f0, f1, w0, w1
    return f0, f1, _empty(x), _empty(x, torch.float32)


@_quantize_input_op.register_fake
def _(x, keys, signs, recipe, need_wgrad):
    from . import fast  # startup
    r = _recipe_from_json(recipe)
    (a0, d0), (a1, d1) = fast.operand_shapes(r, x, "fprop_x")
    out = [x.new_empty(a0, dtype=d0), x.new_empty(a1, dtype=d1)]
    if need_wgrad and fast._both_mx(r, "wgrad_dy", "wgrad_x"):
        (b0, e0), (b1, e1) = fast.operand_shapes(r, x, "wgrad_x")
        return (*out, x.new_empty(b0, dtype=e0), x.new_empty(b1, dtype=e1))
    return (*out, _empty(x), _empty(x, torch.float32))


def _setup_context_input(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)   # quantized values: the gradient reaches x through linear_q


def _backward_input(ctx, *grads):
    return None, None, None, None, None


_quantize_input_op.register_autograd(_backward_input, setup_context=_setup_context_input)


@torch.library.custom_op("mxtrain::linear_q", mutates_args=())
def _linear_q_op(x: torch.Tensor, f0: torch.Tensor, f1: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor,
                 weight: torch.Tensor, bias: Optional[torch.Tensor], keys: Optional[torch.Tensor],
                 signs: Optional[torch.Tensor], recipe: str, amp: str) -> torch.Tensor:
    """``Y`` from X's Fprop operand ``(f0, f1)`` made by ``quantize_input`` (``x`` only routes dX; its
    values are not read)."""
    from . import fast  # startup
    r = _recipe_from_json(recipe)
    M, K = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    pre = {"fprop_x": (fast.unpack_operand(f0, f1, M, K, group_rows=1), r.operand("fprop_x").prescale)}
    y, _ = fast.forward(x, weight, bias, _op_ctx(r, keys, signs), _AMP[amp], False, pre=pre)
    return y.contiguous()


@_linear_q_op.register_fake
def _(x, f0, f1, w0, w1, weight, bias, keys, signs, recipe, amp):
    a = _AMP[amp]
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=a if a is not None else x.dtype)


def _setup_context_q(ctx, inputs, output):
    x, f0, f1, w0, w1, weight, bias, keys, signs, recipe, amp = inputs
    ctx.saved_x = w0.numel() == 0
    ctx.save_for_backward(x if ctx.saved_x else None, weight, w0, w1, keys, signs)
    ctx.recipe, ctx.amp, ctx.x_dtype, ctx.has_bias = recipe, amp, x.dtype, bias is not None


def _backward_q(ctx, dy):
    x, weight, w0, w1, keys, signs = ctx.saved_tensors
    n = ctx.needs_input_grad
    need = (n[0], n[5], ctx.has_bias and n[6])
    dx, dw, db = torch.ops.mxtrain.linear_backward(dy, x, weight, w0, w1, keys, signs, ctx.recipe, ctx.amp,
                                                   ctx.x_dtype, *need)
    return (dx if need[0] else None, None, None, None, None, dw if need[1] else None, db if need[2] else None,
            None, None, None, None)


_linear_q_op.register_autograd(_backward_q, setup_context=_setup_context_q)
