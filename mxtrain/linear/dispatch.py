"""The dispatcher: which implementation runs an MX linear call, and the per-call context.

``route`` (an eager call) and ``compiled_form`` (a traced call) are the only readers of the routing settings
(fast, mx_compiled, mx_compiled_seeded, fp8_traced, and exact_carrier where it decides a form); the
forms' ``supported`` / ``spec`` / ``applies`` answer from the recipe, the tensors and the device alone. (Inside
the reference, the choice of quantize kernel, ``mx_kernel``, ``nvfp4_kernel`` and ``ref_compile``, is
``context.Ctx``'s.) ``experts_route`` decides the same for an experts module's eager call (the grouped MX experts
path or the per-expert loop; setting experts_grouped). ``implementation`` answers users: what runs a layer of a
recipe on given tensors (an experts module: given its 3-D weight)."""

from __future__ import annotations

import functools
import json

import torch

from .. import settings
from . import tensorfp8, tracedfp8
from ._constant import assume_constant_result
from .context import Ctx, advances_calls, needs_seeds, seed_spec
from ..numerics.recipe import Recipe
from ..numerics.recipes import get as get_recipe

__all__ = ["route", "new_state", "call_seeds", "call_context", "recipe_json", "split_capable", "COMPILED_FORMS",
           "compiled_form", "implementation", "mx_spec", "EXPERTS_FORMS", "experts_route", "experts_choice"]


def route(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor) -> str:
    """``plain``, ``fast`` or ``reference`` (module docstring). Works on fake tensors too."""
    if not recipe.quantized:
        return "plain"
    if x.device.type == "cuda" and settings.current().fast:
        from . import fast  # startup
        if fast.supported(recipe) and fast.applies(x, weight):
            return "fast"
    return "reference"


EXPERTS_FORMS = {
    "grouped": "the grouped MX experts path: each operand of all experts from one quantize launch, one FP8-carrier "
               "GEMM per expert (mxtrain.linear.experts, setting experts_grouped)",
    "loop": "the per-expert loop: one mx_linear call per expert GEMM (mxtrain._experts)",
}


def experts_choice(recipe: Recipe, x: torch.Tensor, gate_up_proj: torch.Tensor) -> tuple[str, str]:
    """``("grouped", "")`` or ``("loop", why)`` for an eager call of an experts module (``MXExperts``) of ``recipe``
    on hidden states ``x`` with weights ``gate_up_proj`` ``(E, 2 I, H)``: the one reader of the setting
    ``experts_grouped`` (``auto``: where the layers take the fast path, ``route``; ``on``: wherever the fused
    kernels can run the tensors, Triton's interpreter on CPU included; ``off``: never). Grouped also needs a recipe
    ``experts.supported`` takes (MX GEMMs drawing nothing at random), the ``fp8_carrier`` backend, ``exact_carrier``
    off, and no ``torch.compile`` (the compiled experts run their own loop). Works on fake tensors."""
    s = settings.current()
    if s.experts_grouped == "off":
        return "loop", "setting experts_grouped=off"
    if torch.compiler.is_compiling():
        return "loop", "under torch.compile the experts run the compiled loop"
    if not recipe.quantized:
        return "loop", "the recipe quantizes nothing (F.linear per expert)"
    from . import experts  # startup
    if not experts.supported(recipe):
        return "loop", ("the recipe draws random numbers by GEMM and element position (stochastic rounding or random "
                        "signs) or has a GEMM that is not MX on both operands")
    if s.exact_carrier:
        return "loop", "setting exact_carrier decides each GEMM on the host"
    from . import fast  # startup
    if s.experts_grouped == "auto":
        if route(recipe, x, gate_up_proj) != "fast":
            return "loop", "the layers do not take the fast path here (CUDA tensors, setting fast)"
    elif not (s.fast and fast.supported(recipe) and fast.applies(x, gate_up_proj)):
        return "loop", "the fused kernels cannot run these tensors"
    from ..kernels import backend  # startup
    why = experts.why_not(recipe, x, gate_up_proj, backend(x.device))
    return ("loop", why) if why else ("grouped", "")


def experts_route(recipe: Recipe, x: torch.Tensor, gate_up_proj: torch.Tensor) -> str:
    """``grouped`` or ``loop`` (``experts_choice``)."""
    return experts_choice(recipe, x, gate_up_proj)[0]


def new_state(layer: int = 0, device=None) -> torch.Tensor:
    """A layer's random-input state ``[layer, step, call]`` (int64) for ``mx_linear``'s ``state``."""
    return torch.tensor([int(layer), 0, 0], dtype=torch.int64, device=device)


def _seeds_on_device(state: torch.Tensor) -> bool:
    if state.device.type != "cuda":
        return False
    from ..kernels import kernels_available  # startup
    return kernels_available(state.device)


def call_seeds(state: torch.Tensor, recipe: Recipe, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This call's (keys, signs) from a layer's state tensor; advances its call counter when the recipe
    rounds stochastically and the call records gradients (``grad``: ``torch.is_grad_enabled()`` where the
    layer is called; a call under ``no_grad`` draws the next call's bits without taking them, ``Ctx``). On a
    CUDA device one kernel, no host synchronisation."""
    from ..kernels import seeds as S  # startup
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


# A recipe's string argument is its JSON (printable ASCII: json.dumps escapes the rest) with these characters
# %-escaped and then '"' written as "'": a string that needs no escape in any language. Inductor's C++ wrapper writes
# a string argument of an op it runs through Python into a C++ string literal as it is (torch 2.11), and the JSON's
# '"' ended that literal. (str.replace, not urllib's quote: dynamo traces this where a user passes a Recipe.)
_ESCAPES = (("%", "%25"), ("\\", "%5C"), ("'", "%27"), ("?", "%3F"))


@functools.lru_cache(maxsize=256)
def _recipe_from_json(s: str) -> Recipe:
    """The recipe of ``recipe_json``'s string."""
    s = s.replace("'", '"')
    for plain, escaped in reversed(_ESCAPES):
        s = s.replace(escaped, plain)
    return Recipe.from_dict(json.loads(s))


def recipe_json(recipe: Recipe) -> str:
    """The recipe as the string argument of the custom ops (one constant per recipe in a graph): its JSON with
    ``"`` written as ``'`` and no backslash, quote, question mark or percent sign left unescaped (``_ESCAPES``)."""
    s = recipe._json
    for plain, escaped in _ESCAPES:
        s = s.replace(plain, escaped)
    return s.replace('"', "'")


def split_capable(recipe: Recipe) -> bool:
    """Can the compiled fast path quantize X in its own op (MXFP4 on both Fprop operands)?"""
    from . import fast  # startup
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
    "graph": "compiled into the graph: Triton quantize kernels and the carrier GEMM in inductor's code "
             "(mxtrain.linear.compiledmx, setting mx_compiled)",
    "traced_fp8": "traced per-tensor FP8 casts and torch._scaled_mm (mxtrain.linear.tracedfp8, setting fp8_traced)",
    "split_ops": "the custom ops mxtrain::quantize_input and mxtrain::linear_q (the fast path, decided in Python "
                 "at each call)",
    "op": "the custom op mxtrain::linear (the fast path or the reference, decided in Python at each call)",
}


def compiled_form(x, weight, quantized: bool, split: bool, fp8: str, mx: str) -> tuple[str, object]:
    """Which implementation a compiled call of a layer takes (``COMPILED_FORMS``' keys), with what that form
    needs (``compiledmx``'s plan, ``tracedfp8``'s formats): the one place that
    reads the routing settings of compiled layers (``compiled_linear`` calls it while tracing; ``implementation``
    answers users). Works on fake tensors."""
    if not quantized:
        return "plain", None
    s = settings.current()
    # (exact_carrier: the one op, whose GEMMs see the FP4 codes beside each carrier)
    if mx and s.fast and not s.exact_carrier:
        from . import compiledmx  # startup
        if (s.mx_compiled != "ops" and (s.mx_compiled_seeded or not compiledmx.seeded(mx))
                and (s.mx_compiled_grids or not compiledmx.grids(mx))):
            plan = compiledmx.applies(mx, x, weight, s)
            if plan[0]:
                return "graph", plan
    if fp8 and s.fast and s.fp8_traced == "auto":
        fmts = tuple(fp8.split(","))
        if tracedfp8.applies(fmts, _fp8_input(x), weight):
            return "traced_fp8", fmts
    from . import fast  # startup
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
    launch settings of its kernels, ``compiledmx.TRACE_TIME_SETTINGS``).

    A 3-D ``weight`` is an experts module's ``gate_up_proj`` ``(E, 2 I, H)`` (``MXExperts``): eagerly the answer
    says whether the grouped MX experts path runs (``experts_choice``, with the reason where it does not) and
    otherwise what runs each expert GEMM; compiled, what runs each expert GEMM of the compiled loop."""
    r = get_recipe(recipe)
    if weight.ndim == 3:
        per = implementation(r, x, weight[0], compiled)
        if compiled:
            return f"{EXPERTS_FORMS['loop']}; each GEMM: {per}"
        path, why = experts_choice(r, x, weight)
        return EXPERTS_FORMS["grouped"] if path == "grouped" else f"{EXPERTS_FORMS['loop']} ({why}); each GEMM: {per}"
    if not compiled:
        return {"plain": "F.linear (the recipe quantizes nothing)",
                "fast": "the fast path: fused Triton quantizers and MX GEMMs (mxtrain.linear.fast)",
                "reference": "the reference quantizer and GEMMs (mxtrain.linear.reference.ref_forward)"}[route(r, x, weight)]
    json_, _, quantized, split, fp8, mx = _compile_spec(recipe_json(r))
    return COMPILED_FORMS[compiled_form(x, weight, quantized, split, fp8, mx)[0]]


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
    r = _recipe_from_json(recipe) if recipe.startswith("{") else get_recipe(recipe)
    fp8 = tracedfp8.spec(r)
    return (recipe_json(r), needs_seeds(r), r.quantized, split_capable(r), ",".join(fp8) if fp8 else "",
            mx_spec(r))


def mx_spec(r: Recipe) -> str:
    """The recipe's GEMMs as the compiled MX layer takes them (``compiledmx.spec``), else ""."""
    from . import compiledmx  # startup
    return r.memo("mx_spec", lambda r: compiledmx.spec(r) or "")
