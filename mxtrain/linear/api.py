"""``mx_linear``: the MX linear call, eager or under ``torch.compile`` (the package docstring,
``mxtrain.linear``, says what it computes). Eagerly it calls the fast path or the reference's autograd
function as ``dispatch.route`` says; while compiling, ``compiled_linear`` takes the form
``dispatch.compiled_form`` chooses: ``F.linear``, a traced form (``compiledmx``, ``tracedfp8``) or the custom ops (``ops``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import settings
from . import ops as _ops   # noqa: F401 - registers the mxtrain custom ops that compiled_linear calls
from . import tracedfp8
from .dispatch import _check_floats, _compile_spec, _fp8_input, call_context, compiled_form, recipe_json, route
from .ops import _AMP_NAME
from ..numerics.recipe import Recipe
from ..numerics.recipes import get as get_recipe
from . import reference

__all__ = ["mx_linear", "compiled_linear"]


def compiled_linear(x, weight, bias, state, recipe_str: str, seeded: bool, quantized: bool, split: bool = False,
                    fp8: str = "", mx: str = ""):
    """The traced form of ``mx_linear`` (what a compiled ``MXLinear.forward`` calls): only strings and
    booleans that are constant per recipe, so graphs carry no step, call or layer. ``split``: the recipe
    is ``split_capable``; on a CUDA device with the fast path on, X is quantized by its own op. ``fp8``: the
    recipe's operand formats joined by commas where ``tracedfp8.spec`` accepts it (else empty): traced
    operations instead of the custom op where ``tracedfp8.applies``. ``mx``: ``compiledmx.spec`` of the recipe (else
    empty): the layer compiled into the graph where ``compiledmx.applies``."""
    form, arg = compiled_form(x, weight, quantized, split, fp8, mx)
    if form == "plain":
        return F.linear(x, weight, bias)
    _check_floats(x, weight)
    if form == "graph":
        from . import compiledmx  # startup
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
        rs, seeded, quantized, split, fp8, mx = _compile_spec(recipe if isinstance(recipe, str) else recipe_json(recipe))
        return compiled_linear(x, weight, bias, state, rs, seeded, quantized, split, fp8, mx)
    recipe = get_recipe(recipe)
    if recipe.memo("tracedfp8_spec", tracedfp8.spec) is not None:
        x = _fp8_input(x)
    rt = route(recipe, x, weight)
    if rt == "plain":
        return F.linear(x, weight, bias)
    _check_floats(x, weight)
    qctx = call_context(recipe, state)
    if rt == "fast":   # (a weight FSDP2 gathered quantized, mxtrain.linear.qgather: fast.gathered_operand reads it)
        from . import fast  # startup
        return fast.apply(x, weight, bias, qctx)
    return reference.apply(x, weight, bias, qctx)
