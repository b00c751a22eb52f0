"""The MX linear function: the reference (the spec), its routing to the fast path, and the custom ops
that ``torch.compile`` sees.

``Y = X W^T + b`` runs three GEMMs, each quantizing both operands along that GEMM's reduction axis as
the ``Recipe`` says:

* Fprop  ``Y  = Q(X R_f) Q(W R_f)^T``           blocks along in-features,
* Dgrad  ``dX = Q(dY R_d) Q(R_d^T W)``          blocks along out-features,
* Wgrad  ``dW = Q(R_w^T dY)^T Q(R_w^T X)``      blocks along tokens,

where ``R`` is the GEMM's blockwise Hadamard rotation (identity when off) and ``Q`` quantize +
dequantize. Each operand is quantized from the high-precision tensor of this call, never from another
quantized copy or from an earlier call's. Each GEMM output is divided by the product of its operands'
prescales (Tseng et al.'s 16/9 for a 3/4 prescale on both).

On a CUDA GPU with FP8 tensor cores, a GEMM of two per-tensor FP8 operands (the ``fp8`` recipe) multiplies
the reference's FP8 codes with ``torch._scaled_mm`` (``mxtrain.tensorfp8``); otherwise the reference
multiplies dequantized operands in float32, or in the autocast dtype when both operands
are exact in it (MX values have at most 4 significant bits and a power-of-two scale; the one exception
is a block whose scale is below about 2**-117, where FP6/FP8 subnormal elements fall under bf16's
smallest subnormal; MXFP4 is always exact), which changes only the accumulation order. Under autocast an
NVFP4 operand enters its GEMM without its float32 tensor scale (element x E4M3 block scale: exact in bf16),
the GEMM accumulates in float32 (bf16 tensor cores on GPUs), and the product is multiplied by the tensor
scales (``factors_nvfp4``): the NVFP4 values before any rounding, as block-scaled hardware multiplies them,
where ``MXTensor.dequantize`` rounds block scale x tensor scale to float32 first. Float64 inputs
(``gradcheck``) keep float64 for everything that is not quantized.

Routes (``route``): ``plain`` (the recipe quantizes nothing: ``F.linear``), ``fast`` (CUDA tensors and a
recipe ``mxtrain.fast`` implements: fused Triton quantizers and MX GEMMs, bit-identical operands), else
``reference``. Eagerly, ``mx_linear`` calls an autograd function directly (no dispatcher overhead);
under ``torch.compile`` it calls the custom ops ``mxtrain::call_seeds`` (the call's random inputs from
the layer's state tensor; advances its call counter), ``mxtrain::linear`` and ``mxtrain::linear_backward``
(opaque to the compiler, with fake implementations and registered autograd), so a converted model
compiles to one graph with no guards on steps, calls or layer numbers. Both run the same functions. The
``fp8`` recipe is the exception under ``torch.compile`` on GPUs with FP8 tensor cores: traced operations the
compiler fuses and recomputes (``mxtrain.tracedfp8``, setting ``fp8_traced``), the same codes and GEMMs.
"""

from __future__ import annotations

import functools
import json
from typing import Optional

import torch
import torch.nn.functional as F

from .context import Ctx, advances_calls, autocast_dtype, bf16_exact, gemm_dtype, needs_seeds, seed_spec
from .operand import compute_dtype
from ._constant import assume_constant_result
from .formats import get_format
from . import tensorfp8, tracedfp8
from .recipe import Recipe
from .recipes import get as get_recipe
from . import settings

__all__ = ["mx_linear", "route", "call_context", "new_state", "implementation", "COMPILED_FORMS"]

_AMP = {"": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_AMP_NAME = {v: k for k, v in _AMP.items()}


# ----------------------------------------------------------------------------------------------
# the reference (the spec)

def factors_nvfp4(recipe: Recipe, a: str, b: str, gemm: str, amp: torch.dtype | None,
                  cdt: torch.dtype = torch.float32) -> bool:
    """Does this GEMM multiply NVFP4 operands without their tensor scales (``Ctx.operand_factored``), in the
    autocast dtype where both operands are then exact, and scale the product by the tensor scales after? (The
    NVFP4 values before any rounding, as block-scaled hardware multiplies them; BF16 tensor cores instead of
    a float32 GEMM.) Not for float64 computations (``gradcheck``), which stay float64."""
    if amp is None or cdt != torch.float32:
        return False
    rot = recipe.rotation(gemm)
    ops = (recipe.operand(a), recipe.operand(b))
    nv = [op.quantized and get_format(op.fmt).kind == "nvfp4" for op in ops]
    return any(nv) and all(n or bf16_exact(op, rot) for n, op in zip(nv, ops))


def _mm_f32(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``a @ b`` of values exact in ``dt`` with float32 products and sums, as a float32 tensor: tensor cores
    with a float32 result on GPUs, a float32 GEMM elsewhere (the products of values exact in bf16 are exact
    in float32 either way)."""
    if a.is_cuda and _mm_out_dtype_ok(a.device):
        return torch.mm(a.to(dt), b.to(dt), out_dtype=torch.float32)
    return torch.mm(a.to(torch.float32), b.to(torch.float32))


def _mm_out_dtype_ok(device) -> bool:
    """Can this device's ``torch.mm`` return float32 from bf16 operands (``out_dtype``)? Probed once per
    device (kept in ``mxtrain.kernels.CACHES.probes``)."""
    from .kernels.caches import CACHES
    key = f"mm_out_dtype:{device}"
    ok = CACHES.probes.get(key)
    if ok is None:
        try:
            one = torch.ones((16, 16), dtype=torch.bfloat16, device=device)
            ok = bool(torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        CACHES.probes[key] = ok
    return ok


def _factored_gemm(qctx: Ctx, gemm: str, a, b, amp: torch.dtype, cdt: torch.dtype, device) -> torch.Tensor:
    """``A @ B`` of two operands ``(tensor, axis, name, transpose)`` quantized with NVFP4 tensor scales taken
    out (``factors_nvfp4``): float32 accumulation, then times the tensor scales, divided by the prescales."""
    s = qctx.signs(gemm, device)
    av, pa, ga = qctx.operand_factored(a[0], a[1], a[2], gemm, s, out_dtype=amp)
    bv, pb, gb = qctx.operand_factored(b[0], b[1], b[2], gemm, s, out_dtype=amp)
    y = _mm_f32(av.t() if a[3] else av, bv.t() if b[3] else bv, amp)
    g = ga if gb is None else (gb if ga is None else ga * gb)
    if g is not None:
        y = y * g
    y = y.to(cdt)
    if pa * pb != 1.0:
        y = y / (pa * pb)
    return y


def keeps_fp8_x(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does the reference keep X's FP8 codes for the backward instead of X (``ref_forward(keep_x=True)``)?
    Where Fprop and Wgrad both run on FP8 tensor cores and X's codes are the same for both
    (``tensorfp8.shares_codes``): one quantization of X, 1 byte an element kept instead of 2 or 4.
    Works on fake tensors."""
    M, K, N = x.numel() // max(x.shape[-1], 1), x.shape[-1], weight.shape[0]
    cdt = compute_dtype(x, weight)
    return (M > 0 and tensorfp8.shares_codes(recipe, "fprop_x", "wgrad_x")
            and _fp8_mm(recipe, "fprop_x", "fprop_w", "fprop", cdt, M, N, K, x.device)
            and _fp8_mm(recipe, "wgrad_dy", "wgrad_x", "wgrad", cdt, N, K, M, x.device))


def ref_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: Ctx,
                amp: torch.dtype | None, keep_x: bool = False):
    """The layer output; with ``keep_x`` (``keeps_fp8_x`` true), ``(output, X's FP8 codes tuple)``."""
    out_dtype = amp if amp is not None else x.dtype
    r = qctx.recipe
    cdt = compute_dtype(x, weight)  # float32, or float64 for float64 inputs
    gd = gemm_dtype(r, "fprop_x", "fprop_w", "fprop", amp, cdt)
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    xc = None
    with torch.autocast(x.device.type, enabled=False):
        fin = out_dtype if bias is None else None   # (the GEMM may write the output dtype itself)
        if keep_x:
            xc = tensorfp8.codes(qctx, x2, -1, "fprop_x")
            y = tensorfp8.scaled_mm(qctx, x2, -1, "fprop_x", weight, -1, "fprop_w", cdt, a_codes=xc, final_dtype=fin,
                                    fast_accum=tensorfp8.fast_accum_fprop())
        elif _fp8_mm(r, "fprop_x", "fprop_w", "fprop", cdt, x2.shape[0], weight.shape[0], x2.shape[1], x.device):
            y = tensorfp8.scaled_mm(qctx, x2, -1, "fprop_x", weight, -1, "fprop_w", cdt, final_dtype=fin,
                                    fast_accum=tensorfp8.fast_accum_fprop())
        elif factors_nvfp4(r, "fprop_x", "fprop_w", "fprop", amp, cdt):
            y = _factored_gemm(qctx, "fprop", (x2, -1, "fprop_x", False), (weight, -1, "fprop_w", True), amp, cdt,
                               x.device)
        else:
            s = qctx.signs("fprop", x.device)
            xq, px = qctx.operand(x2, -1, "fprop_x", "fprop", s, out_dtype=gd)
            wq, pw = qctx.operand(weight, -1, "fprop_w", "fprop", s, out_dtype=gd)
            y = torch.matmul(xq.to(gd), wq.to(gd).t())
            if not (px * pw == 1.0 and bias is None and gd == out_dtype):   # (else: cast to cdt and back, identity)
                y = y.to(cdt)
            if px * pw != 1.0:
                y = y / (px * pw)
        if bias is not None:
            y = y + bias.to(cdt)
    y = y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])
    return (y, xc) if keep_x else y


def ref_backward(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, qctx: Ctx,
                 amp: torch.dtype | None, need: tuple[bool, bool, bool], x_codes: tuple | None = None,
                 x_dtype: torch.dtype | None = None) -> tuple:
    """(dX, dW, db) of the reference; an entry is None where ``need`` says False. ``x_codes``: X's FP8 codes
    kept by the forward (``ref_forward(keep_x=True)``) in place of ``x`` (then None; ``x_dtype`` its dtype)."""
    r = qctx.recipe
    if x is None:   # (only its shape and dtype are read below: a tensor without storage stands in)
        x = torch.empty((*dy.shape[:-1], weight.shape[1]), dtype=x_dtype, device="meta")
    cdt = compute_dtype(x, weight)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
    dx = dw = db = None
    with torch.autocast(dy.device.type, enabled=False):
        M, N, K = dy2.shape[0], dy2.shape[1], x2.shape[1]
        fp8_dgrad = need[0] and _fp8_mm(r, "dgrad_dy", "dgrad_w", "dgrad", cdt, M, K, N, dy.device)
        fp8_wgrad = need[1] and _fp8_mm(r, "wgrad_dy", "wgrad_x", "wgrad", cdt, N, K, M, dy.device)
        dy_codes = None   # (dY's FP8 codes, made once for both GEMMs where they are the same: shares_codes)
        if fp8_dgrad and fp8_wgrad and tensorfp8.shares_codes(r, "dgrad_dy", "wgrad_dy"):
            dy_codes = tensorfp8.codes(qctx, dy2, -1, "dgrad_dy")
        if fp8_dgrad:
            dx = tensorfp8.scaled_mm(qctx, dy2, -1, "dgrad_dy", weight, 0, "dgrad_w", cdt, a_codes=dy_codes,
                                     final_dtype=x.dtype)
            dx = dx.to(x.dtype).reshape(x.shape)
        elif need[0] and factors_nvfp4(r, "dgrad_dy", "dgrad_w", "dgrad", amp, cdt):
            dx = _factored_gemm(qctx, "dgrad", (dy2, -1, "dgrad_dy", False), (weight, 0, "dgrad_w", False), amp,
                                cdt, dy.device)
            dx = dx.to(x.dtype).reshape(x.shape)
        elif need[0]:
            gd = gemm_dtype(r, "dgrad_dy", "dgrad_w", "dgrad", amp, cdt)
            s = qctx.signs("dgrad", dy.device)
            dyq, pa = qctx.operand(dy2, -1, "dgrad_dy", "dgrad", s, out_dtype=gd)   # (M, Np)
            wq, pb = qctx.operand(weight, 0, "dgrad_w", "dgrad", s, out_dtype=gd)   # (Np, K)
            dx = torch.matmul(dyq.to(gd), wq.to(gd))
            if not (pa * pb == 1.0 and gd == x.dtype):   # (else: cast to cdt and back, identity)
                dx = dx.to(cdt)
            if pa * pb != 1.0:
                dx = dx / (pa * pb)
            dx = dx.to(x.dtype).reshape(x.shape)
        wio = tensorfp8.autocast_io(r, amp)   # (dW rounded to the autocast dtype first: fp8_autocast)
        if fp8_wgrad:
            dw = tensorfp8.scaled_mm(qctx, dy2, 0, "wgrad_dy", x2, 0, "wgrad_x", cdt,
                                     a_codes=tensorfp8.reorient(dy_codes, 0) if dy_codes is not None else None,
                                     b_codes=tensorfp8.reorient(x_codes, 0) if x_codes is not None else None,
                                     final_dtype=wio)
            dw = dw.to(wio or weight.dtype).to(weight.dtype)
        elif need[1] and factors_nvfp4(r, "wgrad_dy", "wgrad_x", "wgrad", amp, cdt):
            dw = _factored_gemm(qctx, "wgrad", (dy2, 0, "wgrad_dy", True), (x2, 0, "wgrad_x", False), amp, cdt,
                                dy.device).to(weight.dtype)
        elif need[1]:
            gd = gemm_dtype(r, "wgrad_dy", "wgrad_x", "wgrad", amp, cdt)
            s = qctx.signs("wgrad", dy.device)
            dyq, pa = qctx.operand(dy2, 0, "wgrad_dy", "wgrad", s, out_dtype=gd)    # (Mp, N)
            xq, pb = qctx.operand(x2, 0, "wgrad_x", "wgrad", s, out_dtype=gd)       # (Mp, K)
            dw = torch.matmul(dyq.to(gd).t(), xq.to(gd)).to(cdt)
            if pa * pb != 1.0:
                dw = dw / (pa * pb)
            dw = dw.to(wio or weight.dtype).to(weight.dtype)
        if need[2]:
            db = dy2.to(cdt).sum(0).to(weight.dtype)
    return dx, dw, db


def _fp8_mm(recipe: Recipe, a: str, b: str, gemm: str, cdt: torch.dtype, *dims_and_device) -> bool:
    """Does this reference GEMM run on FP8 tensor cores (``mxtrain.tensorfp8``: per-tensor FP8 operands on
    a CUDA GPU, float32 compute)?"""
    *dims, device = dims_and_device
    return cdt == torch.float32 and tensorfp8.applies(recipe, a, b, gemm, *dims, device=device)


class _MXLinearFunction(torch.autograd.Function):
    """The reference as an autograd function (eager use). ``amp``: the autocast dtype, or "auto" to
    read it from the autocast state at the call."""

    @staticmethod
    def forward(ctx, x, weight, bias, qctx: Ctx, amp="auto"):
        if amp == "auto":
            amp = autocast_dtype(x.device.type)
        ctx.qctx, ctx.amp, ctx.has_bias, ctx.x_dtype = qctx, amp, bias is not None, x.dtype
        # (a Wgrad will need X's codes; the wgrad_x setting as in the compiled op: backward keeps X)
        if ctx.needs_input_grad[1] and settings.current().wgrad_x != "backward" and keeps_fp8_x(qctx.recipe, x, weight):
            y, (codes, scale, prescale) = ref_forward(x, weight, bias, qctx, amp, keep_x=True)
            ctx.save_for_backward(None, weight, codes, scale)
            ctx.x_prescale = prescale
            return y
        ctx.save_for_backward(x, weight, None, None)
        return ref_forward(x, weight, bias, qctx, amp)

    @staticmethod
    def backward(ctx, dy):
        x, weight, codes, scale = ctx.saved_tensors
        n = ctx.needs_input_grad
        xc = (codes, scale, ctx.x_prescale) if codes is not None else None
        dx, dw, db = ref_backward(dy, x, weight, ctx.qctx, ctx.amp, (n[0], n[1], ctx.has_bias and n[2]),
                                  x_codes=xc, x_dtype=ctx.x_dtype)
        return dx, dw, db, None, None


# ----------------------------------------------------------------------------------------------
# routing and the per-call context

# The dispatcher: ``route`` (an eager call) and ``compiled_form`` (a traced call) are the only readers of the
# routing settings (fast, mx_traced, mx_compiled, mx_compiled_seeded, fp8_traced, and exact_carrier where it
# decides a form); the forms' ``supported`` / ``spec`` / ``applies`` answer from the recipe, the tensors and the
# device alone. (Inside the reference, the choice of quantize kernel, ``mx_kernel``, ``nvfp4_kernel`` and
# ``ref_compile``, is ``context.Ctx``'s.)

def route(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor) -> str:
    """``plain``, ``fast`` or ``reference`` (module docstring). Works on fake tensors too."""
    if not recipe.quantized:
        return "plain"
    if x.device.type == "cuda" and settings.current().fast:
        from . import fast
        if fast.supported(recipe) and fast.applies(x, weight):
            return "fast"
    return "reference"


def new_state(layer: int = 0, device=None) -> torch.Tensor:
    """A layer's random-input state ``[layer, step, call]`` (int64) for ``mx_linear``'s ``state``."""
    return torch.tensor([int(layer), 0, 0], dtype=torch.int64, device=device)


def _seeds_on_device(state: torch.Tensor) -> bool:
    if state.device.type != "cuda":
        return False
    from .kernels import kernels_available
    return kernels_available(state.device)


def call_seeds(state: torch.Tensor, recipe: Recipe, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This call's (keys, signs) from a layer's state tensor; advances its call counter when the recipe
    rounds stochastically and the call records gradients (``grad``: ``torch.is_grad_enabled()`` where the
    layer is called; a call under ``no_grad`` draws the next call's bits without taking them, ``Ctx``). On a
    CUDA device one kernel, no host synchronisation."""
    from .kernels import seeds as S
    sr, modes, sizes = seed_spec(recipe)
    adv = any(sr) and grad
    if _seeds_on_device(state):
        return S.call_seeds(state, seed=recipe.seed, sr=sr, sign_modes=modes, sign_sizes=sizes, advance=adv)
    layer, step, call = (int(v) for v in state.tolist())
    out = S.call_seeds_host(recipe.seed, layer, step, call, sr=sr, sign_modes=modes, sign_sizes=sizes,
                            device=state.device)
    if adv:
        state[2] += 1
    return out


def call_context(recipe: Recipe, state: torch.Tensor | None) -> Ctx:
    """The context of one eager call of a layer with ``state`` (None: layer 0, step 0, call 0, nothing
    advanced). On a CPU state: host integers (and the call counter advanced, for a call that records
    gradients); on a CUDA state: device keys and signs from ``call_seeds``."""
    if state is None or not needs_seeds(recipe):
        return Ctx(recipe)
    grad = torch.is_grad_enabled()
    if _seeds_on_device(state):
        keys, signs = call_seeds(state, recipe, grad)
        return Ctx.from_seeds(recipe, keys, signs)
    layer, step, call = (int(v) for v in state.tolist())
    if advances_calls(recipe) and grad:
        state[2] += 1
    return Ctx(recipe, layer, step, call)


# ----------------------------------------------------------------------------------------------
# custom ops (what torch.compile sees)

@functools.lru_cache(maxsize=256)
def _recipe_from_json(s: str) -> Recipe:
    return Recipe.from_dict(json.loads(s))


def recipe_json(recipe: Recipe) -> str:
    """The recipe as the string argument of the custom ops (one constant per recipe in a graph)."""
    return recipe._json


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
        from . import fast
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
        from . import fast
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
        from . import fast
        wq = fast.unpack_operand(s0, s1, weight.shape[1], dy.numel() // max(dy.shape[-1], 1))
        dx, dw, db = fast.backward(dy, None, weight, wq, qctx, a, x_dtype, need)
    elif route(r, x, weight) == "fast":
        from . import fast
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
    from . import fast
    r = _recipe_from_json(recipe)
    pre = fast.quantize_input(x.reshape(-1, x.shape[-1]), _op_ctx(r, keys, signs), need_wgrad)
    f0, f1 = fast.pack_operand(pre["fprop_x"][0])
    if "wgrad_x" in pre:
        w0, w1 = fast.pack_operand(pre["wgrad_x"][0])
        return f0, f1, w0, w1
    return f0, f1, _empty(x), _empty(x, torch.float32)


@_quantize_input_op.register_fake
def _(x, keys, signs, recipe, need_wgrad):
    from . import fast
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
    from . import fast
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


# ----------------------------------------------------------------------------------------------
# the entry point



def split_capable(recipe: Recipe) -> bool:
    """Can the compiled fast path quantize X in its own op (MXFP4 on both Fprop operands)?"""
    from . import fast
    return fast.supported(recipe) and all(
        recipe.operand(n).fmt == "mxfp4" for n in ("fprop_x", "fprop_w"))


def _check_floats(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Refuse integer, boolean and complex operands (``nn.Linear`` refuses them too; quantizing them would
    silently truncate or drop the imaginary part)."""
    for name, t in (("input", x), ("weight", weight)):
        if not t.is_floating_point():
            raise TypeError(f"mxtrain linear layer: the {name} is {t.dtype}, a quantized linear layer takes "
                            f"floating-point tensors (float32, bfloat16, float16, float64); convert it with "
                            f".float() first")


COMPILED_FORMS = {
    "plain": "F.linear (the recipe quantizes nothing)",
    "traced_mx": "traced PyTorch operations around the FP8-carrier GEMM (mxtrain.tracedmx, setting mx_traced)",
    "graph": "compiled into the graph: Triton quantize kernels and the carrier GEMM in inductor's code "
             "(mxtrain.compiledmx, setting mx_compiled)",
    "traced_fp8": "traced per-tensor FP8 casts and torch._scaled_mm (mxtrain.tracedfp8, setting fp8_traced)",
    "split_ops": "the custom ops mxtrain::quantize_input and mxtrain::linear_q (the fast path, decided in Python "
                 "at each call)",
    "op": "the custom op mxtrain::linear (the fast path or the reference, decided in Python at each call)",
}


def compiled_form(x, weight, quantized: bool, split: bool, fp8: str, mx: str) -> tuple[str, object]:
    """Which implementation a compiled call of a layer takes (``COMPILED_FORMS``' keys), with what that form
    needs (``tracedmx``'s group rows, ``compiledmx``'s plan, ``tracedfp8``'s formats): the one place that
    reads the routing settings of compiled layers (``compiled_linear`` calls it while tracing; ``implementation``
    answers users). Works on fake tensors."""
    if not quantized:
        return "plain", None
    s = settings.current()
    # (exact_carrier: the one op, whose GEMMs see the FP4 codes beside each carrier)
    if mx and s.fast and not s.exact_carrier:
        from . import compiledmx, tracedmx
        rows = tracedmx.applies(mx, x, weight, s.mx_traced)
        if rows:
            return "traced_mx", rows
        if s.mx_compiled != "ops" and (s.mx_compiled_seeded or not compiledmx.seeded(mx)):
            plan = compiledmx.applies(mx, x, weight, s)
            if plan[0]:
                return "graph", plan
    if fp8 and s.fast and s.fp8_traced == "auto":
        fmts = tuple(fp8.split(","))
        if tracedfp8.applies(fmts, _fp8_input(x), weight):
            return "traced_fp8", fmts
    from . import fast
    if (split and s.fast and not s.exact_carrier and fast.KERNELS and x.is_cuda and x.dtype in fast.OK_DTYPES
            and weight.dtype in fast.OK_DTYPES):
        return "split_ops", None
    return "op", None


def implementation(recipe: Recipe | str, x: torch.Tensor, weight: torch.Tensor, compiled: bool = True) -> str:
    """What runs a layer of ``recipe`` called on ``x`` with ``weight`` (real or meta tensors of the shapes,
    dtypes and device you use), in words: under ``torch.compile`` (``compiled``), one of ``COMPILED_FORMS``;
    eagerly, ``route``'s answer (plain, the fast path's fused kernels, or the reference quantizer). Reads the
    settings as they are now. A routing setting changed after a model was compiled makes dynamo compile its graph
    again at the next call (it guards on the settings it read while tracing; the compiled layer also on the
    launch settings of its kernels, ``compiledmx.TRACE_TIME_SETTINGS``)."""
    r = get_recipe(recipe)
    if not compiled:
        return {"plain": "F.linear (the recipe quantizes nothing)",
                "fast": "the fast path: fused Triton quantizers and MX GEMMs (mxtrain.fast)",
                "reference": "the reference quantizer and GEMMs (mxtrain.linear.ref_forward)"}[route(r, x, weight)]
    json_, _, quantized, split, fp8, mx = _compile_spec(r._json)
    return COMPILED_FORMS[compiled_form(x, weight, quantized, split, fp8, mx)[0]]


def compiled_linear(x, weight, bias, state, recipe_str: str, seeded: bool, quantized: bool, split: bool = False,
                    fp8: str = "", mx: str = ""):
    """The traced form of ``mx_linear`` (what a compiled ``MXLinear.forward`` calls): only strings and
    booleans that are constant per recipe, so graphs carry no step, call or layer. ``split``: the recipe
    is ``split_capable``; on a CUDA device with the fast path on, X is quantized by its own op. ``fp8``: the
    recipe's operand formats joined by commas where ``tracedfp8.spec`` accepts it (else empty): traced
    operations instead of the custom op where ``tracedfp8.applies``. ``mx``: ``tracedmx.spec`` of the recipe (else
    empty): traced operations around the FP8-carrier GEMM where ``tracedmx.applies``."""
    form, arg = compiled_form(x, weight, quantized, split, fp8, mx)
    if form == "plain":
        return F.linear(x, weight, bias)
    _check_floats(x, weight)
    if form == "traced_mx":
        from . import tracedmx
        return tracedmx.linear(x, weight, bias, mx, arg)
    if form == "graph":
        from . import compiledmx
        keys = signs = None
        if seeded:   # (the call's random inputs: one small op; it advances the layer's call counter)
            if state is None:
                state = torch.zeros((3,), dtype=torch.int64, device=x.device)
            keys, signs = torch.ops.mxtrain.call_seeds(state, recipe_str, torch.is_grad_enabled())
        return compiledmx.linear(x, weight, bias, mx, arg, keys, signs)
    if fp8:
        x = _fp8_input(x)
    if form == "traced_fp8":
        return tracedfp8.linear(x, weight, bias, arg)
    keys = signs = None
    if seeded:
        if state is None:
            state = torch.zeros((3,), dtype=torch.int64, device=x.device)
        keys, signs = torch.ops.mxtrain.call_seeds(state, recipe_str, torch.is_grad_enabled())
    dt = x.device.type
    amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None
    # (wgrad_x=backward: the graph keeps X, not its Wgrad operand, and the backward quantizes it)
    # (wgrad_x=carrier keeps FP4 codes here: the custom ops' fake shapes are those of codes; same values)
    need_wgrad = torch.is_grad_enabled() and weight.requires_grad and settings.current().wgrad_x != "backward"
    if form == "split_ops":
        f0, f1, w0, w1 = torch.ops.mxtrain.quantize_input(x, keys, signs, recipe_str, need_wgrad)
        return torch.ops.mxtrain.linear_q(x, f0, f1, w0, w1, weight, bias, keys, signs, recipe_str, _AMP_NAME[amp])
    y, _, _ = torch.ops.mxtrain.linear(x, weight, bias, keys, signs, recipe_str, _AMP_NAME[amp], need_wgrad)
    return y


def _fp8_input(x: torch.Tensor) -> torch.Tensor:
    """A per-tensor FP8 layer's input: cast to ``tensorfp8.autocast_io_dtype`` of the autocast state (setting
    ``fp8_autocast``) where that is a dtype, else ``x`` itself (also float64 and non-float inputs)."""
    dt = x.device.type
    io = tensorfp8.autocast_io_dtype(torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else None)
    return x if io is None or not x.is_floating_point() or x.dtype == torch.float64 else x.to(io)


@assume_constant_result
def _compile_spec(recipe: str) -> tuple[str, bool, bool, bool, str, str]:
    """``recipe``: a preset name or a recipe's JSON string (strings only: a traced call passes its
    arguments as constants, and some torch versions cannot rebuild a frozen dataclass there)."""
    from . import tracedfp8
    r = _recipe_from_json(recipe) if recipe.startswith("{") else get_recipe(recipe)
    fp8 = tracedfp8.spec(r)
    return (recipe_json(r), needs_seeds(r), r.quantized, split_capable(r), ",".join(fp8) if fp8 else "",
            mx_spec(r))


def mx_spec(r: Recipe) -> str:
    """The recipe's GEMMs as the traced MX forms take them (``tracedmx.spec``; where that declines, the wider
    ``compiledmx.spec``: stochastic rounding, random signs, prescales), else ""."""
    from . import compiledmx, tracedmx
    return r.memo("mx_spec", lambda r: tracedmx.spec(r) or compiledmx.spec(r) or "")


def mx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              recipe: Recipe | str = "mxfp4-all", state: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with every GEMM quantized as ``recipe`` says (autograd-aware; eager or
    under ``torch.compile``).

    **Arguments:**
      * ``x``: (..., K); ``weight``: (N, K); ``bias``: (N,) or None; any float dtype, autocast honoured.
      * ``recipe``: a ``Recipe`` or preset name.
      * ``state``: the layer's ``[layer, step, call]`` int64 tensor (``new_state``; an ``MXLinear`` holds
        one as its ``mx_state`` buffer), which numbers the random streams of stochastic rounding and
        random rotation signs. None: layer 0, step 0, call 0, every call alike.

    Use it for GEMMs that are not ``nn.Linear`` calls (for example fused expert weights of a layout
    ``convert`` does not take: call it once per expert with ``weight[e]``, as ``nn.MXExperts`` does for
    Hugging Face's Mixtral and Qwen3-MoE experts).
    """
    if torch.compiler.is_compiling():
        rs, seeded, quantized, split, fp8, mx = _compile_spec(recipe if isinstance(recipe, str) else recipe._json)
        return compiled_linear(x, weight, bias, state, rs, seeded, quantized, split, fp8, mx)
    recipe = get_recipe(recipe)
    if recipe.memo("tracedfp8_spec", tracedfp8.spec) is not None:
        x = _fp8_input(x)
    rt = route(recipe, x, weight)
    if rt == "plain":
        return F.linear(x, weight, bias)
    _check_floats(x, weight)
    qctx = call_context(recipe, state)
    if rt == "fast":   # (a weight FSDP2 gathered quantized, mxtrain.qgather: fast.gathered_operand reads it)
        from . import fast
        return fast.apply(x, weight, bias, qctx)
    return _MXLinearFunction.apply(x, weight, bias, qctx)
