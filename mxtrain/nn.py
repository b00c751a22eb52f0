"""The MX linear layer (reference path) and ``convert``, which swaps it into any model.

``MXLinear`` computes ``Y = X W^T + b`` with a custom autograd function whose three GEMMs quantize
both operands along that GEMM's reduction axis, as the layer's ``Recipe`` says:

* Fprop  ``Y  = Q(X R_f) Q(W R_f)^T``           blocks along in-features,
* Dgrad  ``dX = Q(dY R_d) Q(R_d^T W)``          blocks along out-features,
* Wgrad  ``dW = Q(R_w^T dY)^T Q(R_w^T X)``      blocks along tokens,

where ``R`` is the GEMM's blockwise Hadamard rotation (identity when off) and ``Q`` quantize +
dequantize. Each operand is quantized from the high-precision tensor (X and W saved in the forward
pass), never from another quantized copy. Each GEMM output is divided by the product of its
operands' prescales (Tseng et al.'s 16/9 for a 3/4 prescale on both).

This is the oracle for the fast GPU path: dequantized operands are multiplied in float32, or in
bf16 under autocast when both operands are exactly representable in bf16 (MX values have at most
4 significant bits and a power-of-two scale, and bf16 shares float32's exponent range; the one
exception is a block whose scale is so small, below about 2**-117, that FP6/FP8 subnormal elements
fall under bf16's smallest subnormal 2**-133; MXFP4 is always exact), which changes only the
accumulation order. Float64 inputs (``gradcheck``) keep
float64 for everything that is not quantized: rotations, unquantized operands and the GEMMs
(quantized operands are float32 values by definition, converted exactly).

Random streams: GEMM ``g`` (fprop 0, dgrad 1, wgrad 2) of layer ``layer_id`` rotates with
``rotation_signs(size, mode, seed=recipe.seed, layer=layer_id, gemm=g, step=step)``; a
stochastically rounded operand uses the seed ``operand_seed(recipe.seed, layer_id, operand, step,
call)``, where ``call`` counts the layer's forward calls since the last ``set_step`` (so micro-
batches of one step draw different bits, and the backward pass of a call reuses its call number).
"""

from __future__ import annotations

import fnmatch
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import rng
from .formats import get_format
from .hadamard import rotation_signs
from .quant import quantize
from .recipe import Operand, Recipe, Rotation
from .recipes import get as get_recipe

__all__ = ["MXLinear", "convert", "set_step", "mx_layers", "operand_seed"]

_OPERAND_ID = {"fprop_x": 0, "fprop_w": 1, "dgrad_dy": 2, "dgrad_w": 3, "wgrad_dy": 4, "wgrad_x": 5}
_GEMM_ID = {"fprop": 0, "dgrad": 1, "wgrad": 2}


def operand_seed(seed: int, layer: int, operand: str, step: int, call: int) -> int:
    """Stochastic-rounding seed of one operand of one layer call.

    ``rng.stream_key(seed, layer, k, step, call)`` with ``k`` the operand's index in
    ``mxtrain.recipe.OPERANDS`` (fprop_x 0, fprop_w 1, dgrad_dy 2, dgrad_w 3, wgrad_dy 4, wgrad_x 5).
    """
    return rng.stream_key(seed, layer, _OPERAND_ID[operand], step, call)


def _compute_dtype(*ts: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (gradcheck), else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _pad_axis(t: torch.Tensor, axis: int, multiple: int) -> torch.Tensor:
    n = t.shape[axis]
    pad = (-n) % multiple
    if not pad:
        return t
    axis = axis % t.ndim
    pads = [0, 0] * (t.ndim - 1 - axis) + [0, pad]
    return F.pad(t, pads)


def _bf16_exact(op: Operand, rot: Rotation) -> bool:
    """Can the dequantized operand be cast to bf16 without rounding?"""
    if op.quantized:
        return get_format(op.fmt).kind == "mx"
    return not rot.enabled


class _Ctx:
    """What one call needs to quantize its operands: recipe, layer id, step and call counter."""

    __slots__ = ("recipe", "layer", "step", "call")

    def __init__(self, recipe: Recipe, layer: int, step: int, call: int):
        self.recipe, self.layer, self.step, self.call = recipe, layer, step, call

    def signs(self, gemm: str, device):
        rot = self.recipe.rotation(gemm)
        if not rot.enabled:
            return None
        return rotation_signs(rot.size, rot.signs, seed=self.recipe.seed, layer=self.layer,
                              gemm=_GEMM_ID[gemm], step=self.step, device=device)

    def operand(self, t: torch.Tensor, axis: int, name: str, gemm: str, signs) -> tuple[torch.Tensor, float]:
        """Rotate (padding the axis to whole rotation blocks) and fake-quantize one operand.

        Returns float32 values (float64 for a float64 ``t``; prescale not undone) and the
        operand's prescale.
        """
        op: Operand = self.recipe.operand(name)
        rot = self.recipe.rotation(gemm)
        dt = _compute_dtype(t)
        t = t.to(dt)
        if rot.enabled:
            from .hadamard import hadamard
            t = hadamard(_pad_axis(t, axis, rot.size), rot.size, axis=axis, signs=signs)
        if not op.quantized:
            return t, 1.0
        seed = None
        if op.rounding == "stochastic":
            seed = operand_seed(self.recipe.seed, self.layer, name, self.step, self.call)
        mx = quantize(t, op.fmt, axis=axis, block_size=op.block_size, rounding=op.rounding,
                      scale_rule=op.scale_rule, seed=seed, prescale=op.prescale)
        return mx.dequantize(torch.float32).to(dt), op.prescale


def _gemm_dtype(recipe: Recipe, a: str, b: str, gemm: str, device_type: str,
                default: torch.dtype = torch.float32) -> torch.dtype:
    """bf16 under autocast when both operands are bf16-exact, else ``default`` (float32/float64)."""
    if torch.is_autocast_enabled(device_type):
        rot = recipe.rotation(gemm)
        if _bf16_exact(recipe.operand(a), rot) and _bf16_exact(recipe.operand(b), rot):
            return torch.get_autocast_dtype(device_type)
    return default


class _MXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qctx: _Ctx):
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        cdt = _compute_dtype(x, weight)  # float32, or float64 for float64 inputs
        gd_f = _gemm_dtype(qctx.recipe, "fprop_x", "fprop_w", "fprop", dev, cdt)
        gd_d = _gemm_dtype(qctx.recipe, "dgrad_dy", "dgrad_w", "dgrad", dev, cdt)
        gd_w = _gemm_dtype(qctx.recipe, "wgrad_dy", "wgrad_x", "wgrad", dev, cdt)
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        with torch.autocast(dev, enabled=False):
            s = qctx.signs("fprop", x.device)
            xq, px = qctx.operand(x2, -1, "fprop_x", "fprop", s)
            wq, pw = qctx.operand(weight, -1, "fprop_w", "fprop", s)
            y = torch.matmul(xq.to(gd_f), wq.to(gd_f).t()).to(cdt)
            if px * pw != 1.0:
                y = y / (px * pw)
            if bias is not None:
                y = y + bias.to(cdt)
        ctx.save_for_backward(x2, weight)
        ctx.qctx, ctx.has_bias, ctx.x_shape, ctx.x_dtype = qctx, bias is not None, x.shape, x.dtype
        ctx.gemm_dtypes, ctx.cdt = (gd_d, gd_w), cdt
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        qctx: _Ctx = ctx.qctx
        gd_d, gd_w = ctx.gemm_dtypes
        dy2 = dy.reshape(-1, dy.shape[-1])  # (M, N)
        M, K = x2.shape
        N = weight.shape[0]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                s = qctx.signs("dgrad", dy.device)
                dyq, pa = qctx.operand(dy2, -1, "dgrad_dy", "dgrad", s)   # (M, Np)
                wq, pb = qctx.operand(weight, 0, "dgrad_w", "dgrad", s)   # (Np, K)
                dx = torch.matmul(dyq.to(gd_d), wq.to(gd_d)).to(ctx.cdt)
                if pa * pb != 1.0:
                    dx = dx / (pa * pb)
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                s = qctx.signs("wgrad", dy.device)
                dyq, pa = qctx.operand(dy2, 0, "wgrad_dy", "wgrad", s)    # (Mp, N)
                xq, pb = qctx.operand(x2, 0, "wgrad_x", "wgrad", s)       # (Mp, K)
                dw = torch.matmul(dyq.to(gd_w).t(), xq.to(gd_w)).to(ctx.cdt)
                if pa * pb != 1.0:
                    dw = dw / (pa * pb)
                dw = dw.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy2.to(ctx.cdt).sum(0).to(weight.dtype)
        del M, K, N
        return dx, dw, db, None


class MXLinear(nn.Linear):
    """Drop-in ``nn.Linear`` whose GEMMs follow a ``Recipe``.

    **Arguments:** ``in_features``, ``out_features``, ``bias``, ``device``, ``dtype`` as for
    ``nn.Linear``; ``recipe``: a ``Recipe`` or preset name; ``layer_id``: index used for
    per-layer random signs and stochastic-rounding streams (``convert`` numbers layers in order).

    ``step`` (set for all layers by ``mxtrain.set_step``) selects per-step random signs and
    stochastic-rounding streams. With a recipe that quantizes nothing, the layer is ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 *, recipe: Recipe | str = "bf16", layer_id: int = 0):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = get_recipe(recipe)
        self.layer_id = layer_id
        self.step = 0
        self._calls = 0

    @classmethod
    def from_linear(cls, lin: nn.Linear, recipe: Recipe | str, layer_id: int = 0) -> "MXLinear":
        """A new ``MXLinear`` sharing ``lin``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.register_parameter("bias", lin.bias)  # a Parameter or None, as in nn.Linear
        new.recipe = get_recipe(recipe)
        new.layer_id, new.step, new._calls = layer_id, 0, 0
        new.train(lin.training)
        return new

    def set_step(self, step: int) -> None:
        self.step = int(step)
        self._calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recipe.quantized:
            return F.linear(x, self.weight, self.bias)
        qctx = _Ctx(self.recipe, self.layer_id, self.step, self._calls)
        self._calls += 1
        # --- fast-path dispatch hook (owned by mxtrain.fast / mxtrain.kernels; the reference below
        # stays the spec). CUDA inputs with an MXFP4/bf16-only recipe use the fused kernels.
        if x.is_cuda:
            from . import fast
            if fast.supported(self.recipe):
                return fast.apply(x, self.weight, self.bias, qctx, module=self)
        # --- end fast-path hook
        return _MXLinearFunction.apply(x, self.weight, self.bias, qctx)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, layer_id={self.layer_id}"


def mx_layers(model: nn.Module) -> list[tuple[str, MXLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MXLinear)]


def set_step(model: nn.Module, step: int) -> None:
    """Tell every ``MXLinear`` in ``model`` the optimizer step (per-step signs and SR streams)."""
    for _, m in mx_layers(model):
        m.set_step(step)


DEFAULT_SKIP = ("lm_head", "output", "head", "classifier", "score", "embed*", "*embedding*")
_BLOCK_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _block_index(name: str) -> int | None:
    m = _BLOCK_RE.search(name)
    return int(m.group(1)) if m else None


def convert(model: nn.Module, recipe: Recipe | str, *, skip=DEFAULT_SKIP) -> nn.Module:
    """Replace the ``nn.Linear`` modules of ``model`` by ``MXLinear`` in place; returns ``model``.

    **Arguments:**
      * ``recipe``: a ``Recipe`` or preset name (``mxtrain.recipes.names()``).
      * ``skip``: fnmatch patterns matched against each module's last name component and its full
        name; matching layers stay high precision. The default keeps output heads (``lm_head``,
        ``output``, ...) and anything named like an embedding: the head's error goes straight into
        the loss and vocabularies are rarely multiples of the block size.

    The recipe's ``keep_hp`` patterns and ``keep_first``/``keep_last`` blocks (the first integer
    in a module's name, e.g. ``layers.3.mlp.w1`` is block 3) also stay ``nn.Linear``. Parameters
    are shared, not copied, so an optimizer built before or after ``convert`` works.
    """
    recipe = get_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects an nn.Module, got {type(model).__name__}")
    patterns = tuple(skip) + tuple(recipe.keep_hp)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    blocks = [b for b in (_block_index(n) for n, _ in linears) if b is not None]
    nblocks = max(blocks) + 1 if blocks else 0
    layer_id = 0
    for name, lin in linears:
        leaf = name.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatch(leaf, p) or fnmatch.fnmatch(name, p) for p in patterns):
            continue
        b = _block_index(name)
        if b is not None and (b < recipe.keep_first or b >= nblocks - recipe.keep_last):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, MXLinear.from_linear(lin, recipe, layer_id))
        layer_id += 1
    return model
