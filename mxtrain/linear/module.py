"""The MX linear layer and ``convert``, which turns the linear layers of any model into MX layers.

``MXLinear`` is an ``nn.Linear`` whose forward is ``mxtrain.linear.mx_linear`` (the three GEMMs
quantized as its ``Recipe`` says; see ``mxtrain.linear``). ``convert`` changes the class of each
convertible layer in place (as FSDP2's ``fully_shard`` does): the module keeps its parameters, hooks,
attributes and ``state_dict`` keys, and an optimizer built before or after ``convert`` works.

Random inputs (stochastic rounding, random rotation signs) are numbered by each layer's ``mx_state``
buffer ``[layer, step, call]`` (int64, not saved in ``state_dict``). ``step`` advances by itself after
every ``optimizer.step()`` of an optimizer that holds the layer's weight (PyTorch's global optimizer
step hooks) and ``call`` counts forward calls within a step; ``set_step(model, step)`` sets the step
explicitly (mxtrain's trainer does, every step). Nothing about a layer's numerics depends on these
hooks: every call quantizes the current weights.
"""

from __future__ import annotations

import copyreg
import fnmatch
import re
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .context import Ctx, advances_calls, needs_seeds, operand_seed
from .api import compiled_linear, mx_linear
from .dispatch import experts_route, mx_spec, recipe_json, split_capable, implementation
from . import ops as _ops, tracedfp8  # noqa: F401 - ops: registers the mxtrain ops
from ..numerics.recipe import Recipe
from ..numerics.recipes import get as get_recipe

__all__ = ["MXLinear", "MXLayer", "convert", "ConvertReport", "set_step", "mx_layers", "operand_seed", "mx_linear"]

# every MX layer alive, for the optimizer step hook (a registry, not a cache: it holds no tensor)
_LAYERS: "weakref.WeakSet[MXLayer]" = weakref.WeakSet()
_HOOK = None


# optimizers whose layers' ids were checked for repeats (once each)
_CHECKED: "weakref.WeakSet" = weakref.WeakSet()


def _held(m: nn.Module, ids: set) -> bool:
    """Whether an optimizer holding the parameters ``ids`` trains layer ``m``: its weight, or any parameter of
    its own (a parametrized weight's ``original``, or the bias of a layer whose weight is frozen)."""
    return any(id(p) in ids for p in m.parameters())


def _after_optimizer_step(opt, args, kwargs) -> None:
    """Global optimizer step post-hook: advance the step of every MX layer that ``opt`` trains."""
    if not _LAYERS:
        return
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    layers = [m for m in list(_LAYERS) if m._mx_seeded and _held(m, ids)]
    if layers and opt not in _CHECKED:
        _CHECKED.add(opt)
        _warn_repeated_ids(layers)
    _advance([m.mx_state for m in layers])


def _warn_repeated_ids(layers) -> None:
    """Warn when layers trained by one optimizer share a ``layer_id``: they would draw the same stochastic
    rounding and random signs for the same inputs (e.g. blocks converted one ``convert`` call each, or
    ``MXLinear`` layers built with the default ``layer_id=0``)."""
    by_id: dict = {}
    for m in layers:
        by_id.setdefault(m.layer_id, []).append(m)
    rep = {i: ms for i, ms in by_id.items() if len(ms) > 1}
    if rep:
        i, ms = next(iter(rep.items()))
        warnings.warn(f"mxtrain: {sum(len(v) for v in rep.values())} MX layers trained by one optimizer share "
                      f"layer ids ({len(ms)} have layer_id {i}, {len(rep)} id{'s' if len(rep) > 1 else ''} repeated): "
                      f"their recipe draws random numbers (stochastic rounding or random signs) by layer id, so "
                      f"those layers draw the same ones. Number them apart: convert the whole model in one call, "
                      f"or pass convert(..., first_layer_id=N) to each later call, or give MXLinear(..., layer_id=N)",
                      stacklevel=3)


def _ensure_hook() -> None:
    global _HOOK
    if _HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _HOOK = register_optimizer_step_post_hook(_after_optimizer_step)


def _by_device(states):
    groups: dict = {}
    for s in states:
        if s.device.type != "meta":
            groups.setdefault(s.device, []).append(s)
    return groups


RANK_CALL_SHIFT = 40   # a data-parallel rank's own range of call numbers: [rank << 40, (rank + 1) << 40)


def call_base() -> int:
    """Where this process's call counters start when nobody numbers them (``set_step(..., call=)``): 0 on one
    process, ``rank << 40`` once ``torch.distributed`` is initialized, so that every rank of a data-parallel
    run draws stochastic rounding of its own for its own data, not rank 0's bits."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() << RANK_CALL_SHIFT
    return 0


def _advance(states) -> None:
    """step += 1, call = call_base() for every state tensor (two foreach kernels per device, no host read)."""
    base = call_base()
    for dev, ss in _by_device(states).items():
        keep = torch.tensor([1, 1, 0], dtype=torch.int64).to(dev, non_blocking=True)
        inc = torch.tensor([0, 1, base], dtype=torch.int64).to(dev, non_blocking=True)
        torch._foreach_mul_(ss, [keep] * len(ss))
        torch._foreach_add_(ss, [inc] * len(ss))


def _write_states(layers, step: int, call: int | None = None) -> None:
    """state = [layer_id, step, call] for every layer (one host-to-device copy per device); ``call`` None:
    ``call_base()``."""
    call = call_base() if call is None else call
    if int(step) < 0 or int(call) < 0:
        raise ValueError(f"set_step: step and call must be non-negative, got step={step}, call={call}")
    groups: dict = {}
    for m in layers:
        if m.mx_state.device.type != "meta":
            groups.setdefault(m.mx_state.device, []).append(m)
    for dev, ms in groups.items():
        # from pinned memory on a GPU: the copy waits for nothing, so the host can issue a step ahead of the GPU
        host = torch.tensor([[m.layer_id, int(step), int(call)] for m in ms], dtype=torch.int64,
                            pin_memory=dev.type == "cuda")
        rows = host.to(dev, non_blocking=True).unbind(0)
        torch._foreach_copy_([m.mx_state for m in ms], list(rows))


def _prepare_counters(device) -> None:
    """The fast path's inexact-block counters of a GPU, made now, outside any compiled graph or CUDA graph
    (``mxtrain.linear.fast.FastState.prepare``), so that compiled calls count too."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        from . import fast  # startup
        fast.state.prepare(device)


class MXLayer:
    """What every MX layer has (mixed into ``nn.Linear`` and linear-like classes by ``convert``)."""

    _mx_transposed = False   # HF Conv1D keeps its weight as (in, out)
    _mx_ids = 1   # layer ids a layer takes (its GEMMs' random streams): MXExperts takes one per expert GEMM

    def _mx_setup(self, recipe: Recipe | str, layer_id: int) -> None:
        dev = self._mx_weight().device
        if "mx_state" not in self._buffers:
            self.register_buffer("mx_state", torch.tensor([0, 0, call_base()], dtype=torch.int64, device=dev),
                                 persistent=False)
        self.recipe = recipe
        self.layer_id = layer_id
        _LAYERS.add(self)
        _ensure_hook()
        _prepare_counters(dev)

    def __setstate__(self, state):
        # a deep copy or an unpickled layer (torch.save / torch.load of a whole model) is a new live layer:
        # registered, so that optimizer steps advance its step as they do the original's
        super().__setstate__(state)
        if "mx_state" in self._buffers:
            _LAYERS.add(self)
            _ensure_hook()

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        _prepare_counters(self._mx_weight().device)
        return out

    @property
    def recipe(self) -> Recipe:
        return self._mx_recipe

    @recipe.setter
    def recipe(self, recipe: Recipe | str) -> None:
        r = get_recipe(recipe)
        self._mx_recipe = r
        # what a compiled forward reads: constants per recipe (no per-layer or per-step guards)
        self._mx_json, self._mx_seeded, self._mx_quantized = recipe_json(r), needs_seeds(r), r.quantized
        self._mx_split = split_capable(r)
        fp8 = tracedfp8.spec(r)
        self._mx_fp8 = ",".join(fp8) if fp8 else ""
        self._mx_spec = mx_spec(r)

    @property
    def layer_id(self) -> int:
        return self._mx_layer_id

    @layer_id.setter
    def layer_id(self, value: int) -> None:
        self._mx_layer_id = int(value)
        if self.mx_state.device.type != "meta":
            self.mx_state[0] = int(value)

    @property
    def step(self) -> int:
        """The optimizer step that numbers this layer's random inputs (reads the device state)."""
        return int(self.mx_state[1])

    def set_step(self, step: int, call: int | None = None) -> None:
        _write_states([self], step, call)

    def call_context(self, last: bool = True) -> Ctx:
        """The host ``Ctx`` of this layer's last forward call that recorded gradients (``last``) or of its next
        one (calls under ``no_grad`` do not advance the call counter: ``mxtrain.linear.context``)."""
        layer, step, call = (int(v) for v in self.mx_state.tolist())
        if last and advances_calls(self.recipe):
            call -= 1
        return Ctx(self.recipe, layer, step, call)

    def _mx_weight(self) -> torch.Tensor:
        return self.weight.t() if self._mx_transposed else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return compiled_linear(x, self._mx_weight(), self.bias, self.mx_state, self._mx_json, self._mx_seeded,
                                   self._mx_quantized, self._mx_split, self._mx_fp8, self._mx_spec)
        return mx_linear(x, self._mx_weight(), self.bias, self._mx_recipe, self.mx_state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, layer_id={self.layer_id}"


class MXLinear(MXLayer, nn.Linear):
    """Drop-in ``nn.Linear`` whose GEMMs follow a ``Recipe``.

    **Arguments:** ``in_features``, ``out_features``, ``bias``, ``device``, ``dtype`` as for
    ``nn.Linear``; ``recipe``: a ``Recipe`` or preset name; ``layer_id``: numbers the layer's random
    streams (``convert`` numbers layers in order). With a recipe that quantizes nothing, the layer is
    ``F.linear``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 *, recipe: Recipe | str = "bf16", layer_id: int = 0):
        nn.Linear.__init__(self, in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._mx_setup(recipe, layer_id)

    @classmethod
    def from_linear(cls, lin: nn.Linear, recipe: Recipe | str, layer_id: int = 0) -> "MXLinear":
        """``lin`` itself, turned into an MX layer in place (see ``convert``)."""
        _make_mx(lin, recipe, layer_id)
        return lin


class MXExperts(MXLayer):
    """Hugging Face fused MoE experts (Mixtral's ``MixtralExperts``, Qwen3-MoE's ``Qwen3MoeExperts``: ``gate_up_proj``
    ``(E, 2 I, H)``, ``down_proj`` ``(E, H, I)``; ``mxtrain.linear.moe.fused_experts`` says which) whose expert GEMMs follow
    a ``Recipe``: ``convert`` mixes this class in, keeping the parameters, their names and the module's attributes.

    The forward is ``transformers``' eager experts forward (``mxtrain._experts.experts_forward``: the routing the block
    computed, tokens gathered per expert) with each expert's two GEMMs one ``mx_linear`` call on ``weight[e]``: MX
    numerics exact per expert GEMM (the reference path on CPU; on CUDA whatever ``mx_linear`` routes to). The module
    takes ``2 E`` layer ids: expert ``e``'s ``gate_up_proj`` GEMM draws its random inputs (stochastic rounding,
    random signs) as layer ``layer_id + 2 e``, its ``down_proj`` GEMM as ``layer_id + 2 e + 1``, at the module's
    step and call (``mx_state``); a forward that records gradients advances the call once.

    Eagerly, where the dispatcher says so (``mxtrain.linear.dispatch.experts_route``, setting ``experts_grouped``:
    recipes that draw nothing at random, on the FP8-carrier fast path), the grouped MX experts path runs instead of
    the loop (``mxtrain.linear.experts``: each operand of all experts from one quantize launch; the loop's values bit
    for bit). ``mx_experts_path`` says which ran last: ``"grouped"`` or ``"loop"`` (None before the first eager
    call)."""

    mx_experts_path = None

    @property
    def _mx_ids(self) -> int:
        from .._experts import GEMMS_PER_EXPERT  # startup
        return GEMMS_PER_EXPERT * self.num_experts

    def _mx_weight(self) -> torch.Tensor:
        return self.gate_up_proj

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from .._experts import experts_forward  # startup
        from .moe import advances_calls_json  # startup
        recipe, seeded = self._mx_recipe, self._mx_seeded
        compiling = torch.compiler.is_compiling()
        if not compiling:
            path = experts_route(recipe, hidden_states, self.gate_up_proj)
            self.mx_experts_path = path
            if path == "grouped":   # (nothing drawn at random: no call counter to advance)
                from . import experts  # startup
                return experts.forward(self, hidden_states, top_k_index, top_k_weights, recipe)

        def gemm(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
            state = None
            if seeded:   # this GEMM's own layer id, the module's step and call (mx_linear advances the copy)
                state = self.mx_state.clone()
                state[0] += k
            if compiling:   # (as MXLayer.forward: constants per recipe, no recipe object for dynamo to guard on)
                return compiled_linear(x, w, None, state, self._mx_json, seeded, self._mx_quantized, self._mx_split,
                                       self._mx_fp8, self._mx_spec)
            return mx_linear(x, w, None, recipe, state)

        out = experts_forward(self, hidden_states, top_k_index, top_k_weights, gemm)
        advances = advances_calls_json(self._mx_json) if compiling else advances_calls(recipe)
        if seeded and advances and torch.is_grad_enabled():
            with torch.no_grad():
                self.mx_state[2] += 1
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, gate_up_proj={tuple(self.gate_up_proj.shape)}, down_proj="
                f"{tuple(self.down_proj.shape)}, recipe={self.recipe.name}, layer_ids={self.layer_id}.."
                f"{self.layer_id + self._mx_ids - 1}")


class _MXClass(type):
    """The metaclass of the classes ``convert`` makes for ``nn.Linear`` subclasses and HF's Conv1D: they pickle
    as "the MX class of <original class>", so a pickled model loads wherever the original class imports."""


# one class per original class, so that every converted instance of it shares one type
_CLASSES: dict = {}


def _mx_class(cls: type) -> type:
    if cls is nn.Linear:
        return MXLinear
    new = _CLASSES.get(cls)
    if new is None:
        name = f"MX{cls.__name__}"
        ns = {"__module__": __name__, "__qualname__": name, "_mx_base": cls}
        if issubclass(cls, nn.Linear):
            new = _MXClass(name, (MXLinear, cls), ns)
        elif any(c.__name__ == "Conv1D" for c in cls.__mro__):   # HF Conv1D: y = x @ W + b with W (in, out)
            new = _MXClass(name, (MXLayer, cls), {**ns, "_mx_transposed": True})
        else:   # HF fused MoE experts (mxtrain.linear.moe.fused_experts)
            new = _MXClass(name, (MXExperts, cls), ns)
        _CLASSES[cls] = new
    return new


copyreg.pickle(_MXClass, lambda c: (_mx_class, (c._mx_base,)))


def _make_mx(m: nn.Module, recipe, layer_id: int) -> nn.Module:
    if not isinstance(m, MXLayer):
        m.__class__ = _mx_class(type(m))
    m._mx_setup(recipe, layer_id)
    return m


def mx_layers(model: nn.Module) -> list[tuple[str, MXLayer]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MXLayer)]


def set_step(model: nn.Module, step: int, call: int | None = None) -> None:
    """Set the optimizer step that numbers the random inputs of every MX layer in ``model``, and where its
    call counter starts (default ``call_base()``: 0 on one process). Optional: steps advance by themselves
    after each ``optimizer.step()`` and calls after each forward.

    Data parallelism (DDP, FSDP2): left alone, each rank's calls start at ``rank << 40``, so the ranks draw
    independent stochastic rounding for their different data. To draw exactly what one process with gradient
    accumulation draws, rank ``r`` of ``N`` calls ``set_step(model, step, call=k * N + r)`` before its
    micro-step ``k`` when its micro-batches are the global batch's ``k * N + r``-th (as
    ``torch.utils.data.DistributedSampler`` and mxtrain's loader deal them; each layer called once per
    micro-step, as in a transformer block). mxtrain's trainer does this."""
    _write_states([m for _, m in mx_layers(model)], step, call)


# ----------------------------------------------------------------------------------------------
# convert

DEFAULT_SKIP = ("lm_head", "output", "head", "classifier", "score", "embed*", "*embedding*")
_BLOCK_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _block_index(name: str) -> int | None:
    """The block a layer named ``name`` is in: the first integer component of its name that is not the last
    (``layers.3.mlp.w1`` -> 3; ``5``, an ``nn.Sequential``'s item that is the layer itself -> None)."""
    m = _BLOCK_RE.search(name.rpartition(".")[0])
    return int(m.group(1)) if m else None


def _encoder_fast_paths_off(model: nn.Module, rep) -> None:
    """Turn off the inference fast path of ``nn.TransformerEncoderLayer``s whose feed-forward layers are MX
    layers (it reads ``linear1.weight`` and ``linear2.weight`` directly in ``eval()`` under ``no_grad``) and
    the nested-tensor path of ``nn.TransformerEncoder``s holding them."""
    for n, m in model.named_modules():
        if isinstance(m, nn.TransformerEncoderLayer) and (isinstance(m.linear1, MXLayer)
                                                          or isinstance(m.linear2, MXLayer)):
            m.activation_relu_or_gelu = 0   # (torch's fast-path condition; the slow path uses m.activation)
            rep.notes.append(f"{n or '<root>'}: nn.TransformerEncoderLayer's inference fast path turned off (it "
                             "would bypass the MX layers in eval)")
        elif isinstance(m, nn.TransformerEncoder) and any(isinstance(x, MXLayer) for x in m.layers.modules()):
            m.use_nested_tensor = False


def _conv1d_base(m: nn.Module) -> type | None:
    """Hugging Face's ``Conv1D`` among the module's classes (no import of transformers needed)."""
    return next((c for c in type(m).__mro__ if c.__name__ == "Conv1D" and c.__module__.startswith("transformers")),
                None)


def _classify(m: nn.Module) -> str | None:
    """'mx' (converted before), 'linear', 'conv1d' (HF Conv1D), 'own_forward' (a subclass of either that
    overrides forward), or None."""
    if isinstance(m, MXLayer):
        return "mx"
    if isinstance(m, nn.Linear):
        return "linear" if type(m).forward is nn.Linear.forward else "own_forward"
    base = _conv1d_base(m)
    if base is not None and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.ndim == 2:
        return "conv1d" if type(m).forward is base.forward else "own_forward"
    return None


@dataclass
class ConvertReport:
    """What ``convert`` did. ``converted``: names of MX layers; ``kept``: name -> why it stays in high
    precision by choice (skip pattern, keep_hp, keep_first/keep_last); ``refused``: name -> why mxtrain
    cannot run its GEMMs (they stay in high precision); ``mx_params`` / ``total_params``: parameters in
    MX layers and in the model. ``model`` is the converted model (the same object, converted in place)."""

    model: nn.Module
    recipe: Recipe
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    mx_params: int = 0
    total_params: int = 0
    outside_blocks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # what runs the converted layers where their weights are now (``linear.implementation`` of the first one):
    # {"device", "eager", "compiled"}, and for the first experts module (``MXExperts``) "experts": what runs it
    # eagerly (the grouped MX experts path or the per-expert loop); empty where nothing was converted or the
    # weights are on the meta device
    runs_as: dict[str, str] = field(default_factory=dict)

    @property
    def share(self) -> float:
        """Fraction of the model's parameters in MX layers."""
        return self.mx_params / self.total_params if self.total_params else 0.0

    def __str__(self) -> str:
        lines = [f"mxtrain.convert: recipe {self.recipe.name}: {len(self.converted)} layer{'' if len(self.converted) == 1 else 's'} converted, "
                 f"{100 * self.share:.1f} % of {self.total_params:,} parameters in MX layers"]
        for what, d in (("kept in high precision", self.kept), ("NOT converted (mxtrain cannot run them)", self.refused)):
            if d:
                lines.append(f"  {what}:")
                lines += [f"    {n or '<root>'}: {why}" for n, why in d.items()]
        if self.outside_blocks:   # an output head with a name the skip patterns miss shows here
            more = len(self.outside_blocks) - 8
            lines.append("  converted outside numbered blocks (an output head among them? skip it by name): "
                         + ", ".join(self.outside_blocks[:8]) + (f", and {more} more" if more > 0 else ""))
        if "eager" in self.runs_as:
            lines.append(f"  on {self.runs_as['device']}: eagerly {self.runs_as['eager']}; under torch.compile "
                         f"{self.runs_as['compiled']} (mxtrain.linear.implementation answers for a layer and input)")
        if "experts" in self.runs_as:
            lines.append(f"  experts modules on {self.runs_as['device']}, eagerly: {self.runs_as['experts']}")
        lines += [f"  note: {t}" for t in self.notes]
        return "\n".join(lines)


def convert(model: nn.Module, recipe: Recipe | str, *, skip=DEFAULT_SKIP, strict: bool = False,
            first_layer_id: int = 0, keep_tied: bool = True) -> ConvertReport:
    """Turn the linear layers of ``model`` into MX layers in place; returns a ``ConvertReport``.

    **Converted:** ``nn.Linear`` and its subclasses that keep ``nn.Linear.forward``, Hugging Face's GPT-2
    ``Conv1D`` (a linear layer with a transposed weight), Hugging Face's fused MoE experts (Mixtral's,
    Qwen3-MoE's: ``MXExperts``, one ``mx_linear`` call per expert GEMM, taking ``2 E`` layer ids; the router stays
    in high precision), and layers converted before (their recipe changes). The module object stays the same (its class changes), so parameters, hooks, attributes
    and ``state_dict`` keys are kept; ``convert(nn.Linear(...))`` makes that layer an ``MXLinear``.

    **Kept in high precision:** layers matching ``skip`` (fnmatch patterns on a module's last name
    component and its full name; the default keeps output heads such as ``lm_head`` and anything named
    like an embedding: the head's error goes straight into the loss, vocabularies are rarely multiples
    of the block size; a string is one pattern) or the recipe's ``keep_hp``; with ``keep_tied`` (default), a
    layer whose weight is an embedding's weight (a tied output head, whatever its name); and the recipe's
    ``keep_first``/``keep_last`` blocks: the blocks are the numbered modules that hold linear layers (the first
    integer in a layer's name that is not the layer's own name: ``layers.3.mlp.w1`` is in block 3; in
    ``nn.Sequential(embedding, block, ..., block, head)`` the first and last blocks, not the embedding and head).

    **Layer ids** number each layer's random streams (stochastic rounding, random signs): ``first_layer_id``,
    ``first_layer_id + 1``, ... in module order. Converting parts of one model in several calls, give each
    later call a ``first_layer_id`` past the ids used before (an optimizer that trains layers sharing an id
    warns at its first step).

    **Refused** (reported, warned about, left in high precision; ``strict=True`` raises instead):
    ``nn.Linear`` subclasses with a forward of their own (LoRA-style layers: mxtrain cannot know what
    they compute; call ``mxtrain.mx_linear`` inside them), the projections of ``nn.MultiheadAttention``
    (it reads their weights directly), and other modules with 3-D or larger weights (fused experts in
    another layout, e.g. transposed or with biases: their GEMMs are not linear-layer calls; call
    ``mxtrain.mx_linear`` per expert).

    ``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder``) whose feed-forward layers are converted get
    their inference fast path turned off: in ``eval()`` under ``no_grad`` it would multiply by the layers'
    weights directly, in high precision, instead of calling them.

    Warns when nothing was converted.
    """
    recipe = get_recipe(recipe)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert expects an nn.Module, got {type(model).__name__}")
    if isinstance(skip, str):
        skip = (skip,)
    if isinstance(first_layer_id, bool) or not isinstance(first_layer_id, int) or first_layer_id < 0:
        raise ValueError(f"first_layer_id must be a non-negative int, got {first_layer_id!r}")
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:   # (checked before anything changes)
        raise ValueError(f"convert: {lazy[0]} is an uninitialized parameter of a lazy module (nn.LazyLinear): run one "
                         "forward pass first, which makes the weights, then convert")
    rep = ConvertReport(model, recipe)
    patterns = tuple(skip) + tuple(recipe.keep_hp)
    tied = {}
    if keep_tied:
        for n, m in model.named_modules():
            if isinstance(m, nn.Embedding):
                tied.setdefault(id(m.weight), n)
    mods = list(model.named_modules())
    mha_children = set()
    for n, m in mods:
        if isinstance(m, nn.MultiheadAttention):
            mha_children.update(f"{n}.{c}" if n else c for c, _ in m.named_modules() if c)
    candidates = []
    for n, m in mods:
        if n in mha_children:
            continue
        if isinstance(m, nn.MultiheadAttention):
            rep.refused[n] = ("nn.MultiheadAttention multiplies by its in_proj_weight and out_proj.weight directly, "
                              "not through nn.Linear calls; use separate nn.Linear projections")
            continue
        kind = _classify(m)
        if kind is None:
            big = [pn for pn, p in m.named_parameters(recurse=False) if p.ndim >= 3]
            if big and not isinstance(m, nn.modules.conv._ConvNd):
                from .moe import fused_experts  # startup
                why = fused_experts(m)
                if why is None:   # HF Mixtral / Qwen3-MoE experts: MXExperts
                    candidates.append((n, m))
                    continue
                rep.refused[n] = (f"holds {'/'.join(big)} with 3 or more dimensions ({why}): its GEMMs are not "
                                  "linear-layer calls; call mxtrain.mx_linear on each expert's weight in the "
                                  "module's forward")
            continue
        if kind == "own_forward":
            own = next(c for c in type(m).__mro__ if "forward" in c.__dict__)
            rep.refused[n] = (f"{type(m).__name__} subclasses {'Conv1D' if _conv1d_base(m) else 'nn.Linear'} with "
                              f"its own forward ({own.__module__}.{own.__qualname__}.forward); mxtrain cannot know "
                              "what it computes: call mxtrain.mx_linear inside it")
            continue
        candidates.append((n, m))
    for n, m in list(candidates):   # layers nested in a refused module (e.g. LoRA's A/B) are its business
        if any(n.startswith(r + ".") for r in rep.refused if r):
            candidates.remove((n, m))
            rep.kept[n] = "inside a module that mxtrain does not convert"
    blocks = sorted({b for b in (_block_index(n) for n, _ in candidates) if b is not None})
    first = set(blocks[:recipe.keep_first])
    last = set(blocks[len(blocks) - recipe.keep_last:]) if recipe.keep_last else set()
    layer_id = first_layer_id
    for name, m in candidates:
        leaf = name.rsplit(".", 1)[-1]
        pat = next((p for p in patterns if fnmatch.fnmatch(leaf, p) or fnmatch.fnmatch(name, p)), None)
        if pat is not None:
            why = f"matches skip pattern {pat!r}" if pat in skip else f"matches the recipe's keep_hp pattern {pat!r}"
            _keep(m, rep, name, why)
            continue
        if id(getattr(m, "weight", None)) in tied:
            _keep(m, rep, name, f"its weight is the weight of embedding {tied[id(m.weight)]!r} (a tied output head; "
                                "keep_tied=False converts it)")
            continue
        b = _block_index(name)
        if b in first:
            _keep(m, rep, name, f"block {b} is among the recipe's keep_first={recipe.keep_first} blocks")
            continue
        if b in last:
            _keep(m, rep, name, f"block {b} is among the recipe's keep_last={recipe.keep_last} of {len(blocks)} blocks")
            continue
        _make_mx(m, recipe, layer_id)
        layer_id += m._mx_ids
        rep.converted.append(name)
        if b is None:
            w = m._mx_weight()
            rep.outside_blocks.append(f"{name or '<root>'} ({w.shape[-1]} -> {w.shape[-2]}"
                                      + (f", {w.shape[0]} experts)" if w.ndim == 3 else ")"))
    _encoder_fast_paths_off(model, rep)
    seen: set = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            rep.total_params += p.numel()
    mx_seen: set = set()
    for n in rep.converted:
        for p in model.get_submodule(n).parameters():   # (a parametrized weight's original is a child's)
            if id(p) not in mx_seen:
                mx_seen.add(id(p))
                rep.mx_params += p.numel()
    ddp_ignore_states(model)
    rep.runs_as = _runs_as(model, rep, recipe)
    if rep.refused:
        msg = ("mxtrain.convert: these modules stay in high precision because mxtrain cannot run their GEMMs:\n"
               + "\n".join(f"  {n or '<root>'}: {why}" for n, why in rep.refused.items()))
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    if not rep.converted:
        reasons = "; ".join(f"{n}: {w}" for n, w in list(rep.kept.items())[:4]) or "the model has no linear layers"
        warnings.warn(f"mxtrain.convert: no layer was converted to recipe {recipe.name} ({reasons}); the model "
                      "trains entirely in high precision", stacklevel=2)
    return rep


def _runs_as(model: nn.Module, rep: ConvertReport, recipe: Recipe) -> dict:
    """``ConvertReport.runs_as``: what runs the first converted layer on its weights' device and dtype, eagerly
    and compiled (the routing of ``linear.route`` and ``linear.compiled_form``, which every converted layer of one
    recipe on one device shares up to input shapes)."""
    out: dict = {}
    for n in rep.converted:
        w = model.get_submodule(n)._mx_weight()
        if w.device.type == "meta":
            continue
        key = "experts" if w.ndim == 3 else "eager"
        if key in out:
            continue
        x = torch.zeros(1, w.shape[-1], device=w.device, dtype=w.dtype)
        out.setdefault("device", str(w.device))
        if w.ndim == 3:   # (MXExperts: its gate_up_proj)
            out["experts"] = implementation(recipe, x, w.detach(), compiled=False)
        else:
            out["eager"] = implementation(recipe, x, w.detach(), compiled=False)
            out["compiled"] = implementation(recipe, x, w.detach(), compiled=True)
        if "eager" in out and "experts" in out:
            break
    return out


def ddp_ignore_states(model: nn.Module) -> None:
    """Keep DistributedDataParallel from broadcasting rank 0's MX layer states to the other ranks before each
    forward (``broadcast_buffers``): each rank numbers its own calls (``set_step(..., call=)``), so that the
    ranks draw their own stochastic rounding. Names the ``mx_state`` buffers in the attribute DDP reads from
    the module it wraps (``convert`` does this for the model it converted; call it on the module you give
    DDP when that is a parent of it)."""
    names = {n for n, _ in model.named_buffers() if n == "mx_state" or n.endswith(".mx_state")}
    if names:
        model._ddp_params_and_buffers_to_ignore = sorted(set(getattr(model, "_ddp_params_and_buffers_to_ignore",
                                                                      ())) | names)


def _keep(m: nn.Module, rep: ConvertReport, name: str, why: str) -> None:
    """A layer that stays in high precision; one converted before gets a recipe that quantizes nothing."""
    if isinstance(m, MXLayer):
        m.recipe = "bf16"
        why += " (was an MX layer: now bf16)"
    rep.kept[name] = why


# ----------------------------------------------------------------------------------------------
# activation checkpointing that draws the same random inputs when it recomputes

def _checkpoint_policy(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy of ``checkpoint`` under ``torch.compile``: every operation is made again in the
    backward except ``mxtrain.call_seeds`` (a layer's random inputs; it advances the layer's call counter in a call
    that records gradients): kept,
    so the recomputed forward draws what the first one drew."""
    from torch.utils.checkpoint import CheckpointPolicy
    if op is torch.ops.mxtrain.call_seeds.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(_checkpoint_policy)


def checkpoint(fn, *args, layers: nn.Module, **kwargs):
    """``fn(*args, **kwargs)`` under activation checkpointing (``torch.utils.checkpoint``, non-reentrant): only
    the inputs are kept, and ``fn`` runs again in the backward. Plain checkpointing would make that second run a
    new call of every MX layer, with the next call's stochastic-rounding bits; here the recomputation draws the
    bits of the first run, so the gradients are those without checkpointing, bit for bit (on CPU; tested eagerly
    for ``bf16``, ``mxfp4-all-dh16``, ``mxfp4-all-sr`` and ``tseng``, compiled for ``mxfp4-all-dh16`` and ``tseng``;
    on an H200's fast path for ``mxfp4-all-sr``, ``tseng`` and ``mxfp4-all-dh16``, eager and compiled:
    tests/train/test_gpu_features.py). ``layers``: the module holding the MX layers ``fn`` calls (their
    ``mx_state``). Under ``torch.compile`` a selective-checkpoint policy keeps ``mxtrain.call_seeds`` and
    recomputes everything else; eagerly the layers' call counters are put back before the second run."""
    from torch.utils.checkpoint import checkpoint as _ckpt
    if torch.compiler.is_compiling():
        return _ckpt(fn, *args, use_reentrant=False, context_fn=_checkpoint_context, **kwargs)
    states = [b for n, b in layers.named_buffers() if n == "mx_state" or n.endswith(".mx_state")]
    before = [s.clone() for s in states]

    def again(*a, **k):   # the same call numbers the first time and when recomputed
        with torch.no_grad():
            for s, v in zip(states, before):
                s.copy_(v)
        return fn(*a, **k)
    return _ckpt(again, *args, use_reentrant=False, **kwargs)
