"""Typed run configuration: one dataclass per section, ``TrainConfig`` holds them all.

Overrides come as ``section.field=value`` strings (``--set optim.lr=1e-3``) and are parsed by the
field's declared type; an unknown key or an unparsable value is a ``UserError``. Keys under
``recipe.`` (e.g. ``recipe.wgrad_dy.rounding=stochastic``) change the recipe through ``Recipe.with_``.

Config files (``mxtrain train --config FILE``; docs/config.md) are TOML, JSON or YAML holding the same
nested form as ``TrainConfig.to_dict()`` (and a run folder's ``config.json``): ``read_config_file`` parses
one, ``apply_dict`` applies it on top of a config with the same type checks, and ``load_train_config`` does
both on top of the right experiment. Unknown keys are refused with the nearest valid ones.
"""

from __future__ import annotations

from collections.abc import Hashable

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch

from .parallel import MODES
from .._io import read_regular
from ..errors import UserError, check_number
from ..model.llama import ModelConfig, SIZES
from . import profiling
from .callbacks import wandb_project
from ..numerics import recipes
from ..numerics.recipe import Recipe
from ..data.tokenizer import check_vocab_size
from ..linear.qgather import GATHER_MODES
from .deosc import DeoscSettings, check_recipe


@dataclass
class ModelSection:
    name: str = "tiny"                      # a size from mxtrain.model.SIZES
    dim: Optional[int] = None               # the fields below override the named size when set
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    ffn_dim: Optional[int] = None
    rope_theta: Optional[float] = None
    tie_embeddings: Optional[bool] = None
    vocab_size: Optional[int] = None        # embedding and head rows; None: the data's vocabulary; larger pads
                                            # it (128256: Llama 3.1's head); always padded to a multiple of 32
    init_seed: Optional[int] = None         # model init seed; None: train.seed (same init for every recipe)
    n_experts: Optional[int] = None         # a mixture of experts in every block (0: the dense feed-forward)
    top_k: Optional[int] = None             # experts a token runs through
    router_aux_coef: Optional[float] = None  # weight of the load-balancing loss in the training loss


@dataclass
class DataSection:
    path: str = "builtin"                   # a prepared folder, or "builtin" (prepared on first use)
    vocab_size: int = 4096                  # BPE vocab for the built-in corpus (multiple of 32)
    seq_len: int = 128
    seed: Optional[int] = None              # data order seed; None: train.seed


@dataclass
class OptimSection:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1               # final LR of cosine / WSD as a fraction of lr
    weight_decay: float = 0.1               # on matrices only (not norms, not embeddings)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0                  # max global grad norm; 0 disables


@dataclass
class ScheduleSection:
    kind: str = "cosine"                    # cosine | wsd | constant
    warmup_steps: int = 10
    horizon_steps: Optional[int] = None     # length of the LR schedule; None: train.steps (may exceed it)
    decay_fraction: float = 0.2             # WSD: final share of the horizon spent decaying (the cooldown)
    decay_steps: Optional[int] = None       # WSD: the cooldown as a number of steps (overrides decay_fraction)
    decay_shape: str = "linear"             # WSD cooldown shape: linear | 1-sqrt (Hägele et al. 2024), to min_lr


@dataclass
class TrainSection:
    steps: int = 100                        # optimizer steps
    tokens: Optional[int] = None            # if set, steps = ceil(tokens / (batch_size * seq_len))
    batch_size: int = 16                    # sequences per optimizer step, all ranks together
    micro_batch_size: Optional[int] = None  # per rank and forward pass; None: batch_size / world_size
    seed: int = 0
    device: str = "auto"                    # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                     # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    checkpoint_every: int = 0               # steps between checkpoints; 0: only at the end (and by time, below)
    checkpoint_minutes: float = 30.0        # also checkpoint when this much time passed since the last one; 0: off
    final_checkpoint: bool = True           # checkpoint at the last step; false: benchmark runs of large models
                                            # that nothing resumes (a signal still checkpoints)
    async_checkpoint: bool = False          # several processes: write DCP checkpoints in the background (the
                                            # state is copied to host memory, training goes on while a thread
                                            # writes the files); one counts (resumable, "last good") once
                                            # complete, checked at log steps. The last and a signal's: at once
    keep_checkpoints_at: Optional[str] = None  # also keep checkpoints at these points: comma-separated steps
                                            # ("200,400") or fractions of train.steps ("0.25,0.5"), each kept
                                            # as checkpoint-<step>.pt (checkpoint-<step>.dcp) for cooldown branches
    deterministic: bool = False             # torch.use_deterministic_algorithms (GPU runs)
    cuda_graphs: bool = False               # replay each micro-step's forward + backward as a CUDA graph
                                            # (one GPU)
    compile: str = "auto"                   # torch.compile every transformer block (MX layers included):
                                            # auto (on CUDA without cuda_graphs) | on | off
    cpp_wrapper: bool = False               # compiled blocks: inductor's C++ wrapper (the code that runs each
                                            # compiled graph, kernel launches included, in C++, not Python): less
                                            # host time a step where the host bounds it; needs a C++ compiler
    recompute_ffn: bool = False             # compiled blocks: make the feed-forward's linear outputs again in
                                            # the backward instead of keeping them (less memory, two more GEMMs
                                            # a block; same results; train.parallel.apply_ac)
    checkpoint_blocks: bool = False         # full activation checkpointing: each block keeps only its input and
                                            # runs its forward again in the backward (least memory, about a
                                            # third more compute; the same losses; train.parallel.apply_ac)
    memory_budget: Optional[float] = None   # compiled blocks: torch's activation_memory_budget in (0, 1]: the
                                            # compiler recomputes activations in the backward to keep only that
                                            # share of what it would save (less memory, more recompute); None:
                                            # torch's default (1.0)
    recompute_gemm_inputs: bool = False     # compiled code: the compiler may recompute activations that feed a
                                            # GEMM in the backward instead of keeping them (torch's
                                            # ban_recompute_materialized_backward off): less memory, some
                                            # recompute; with the fast path's wgrad_x=backward, MX layers then
                                            # keep neither X nor its codes where X is cheap to make again
    switch_recipe: Optional[str] = None     # "STEP:RECIPE": from optimizer step STEP + 1 on, every linear layer
                                            # trains with preset RECIPE instead (e.g. "800:bf16", a high-
                                            # precision end of training; STEP may be a fraction of
                                            # train.steps, "0.8:bf16"); which layers stay in high precision
                                            # is the new recipe's rule, as in convert (head, embedding stay).
                                            # A run resumed past STEP, or a branch from it, trains with RECIPE
    init_from: Optional[str] = None         # a local Hugging Face Llama, Mistral, Qwen2 or Mixtral folder whose
                                            # weights initialise the model; None: the random init
    check_every_step: str = "auto"          # wait for the GPU after every step to check its loss and gradient
                                            # norm before the update (on), or check them on the GPU (off): a
                                            # non-finite step and every later one make no update (fused AdamW's
                                            # found_inf), the run stops one step later with the same error, and
                                            # the host issues the next step while the GPU runs this one. auto: off
                                            # on CUDA unless a callback reads each step's loss (on_step_end
                                            # without reads_step_metrics = False); on elsewhere
    gc_every: int = 0                       # > 0: Python's automatic garbage collection off while training,
                                            # collected on every rank every this many steps (torchtitan's
                                            # gc_freq; under DDP/FSDP2 one rank's collection stalls all);
                                            # 0: Python's automatic collection


@dataclass
class LogSection:
    out: Optional[str] = None               # run folder; None: runs/<exp>-<recipe>-<time>
    eval_every: int = 25
    eval_tokens: int = 8192                 # validation tokens per evaluation (fixed windows)
    final_eval_tokens: int = 0              # > eval_tokens: one more evaluation when the run ends, over this many
                                            # validation tokens (RUN/eval_final.json; a study's cooled-down
                                            # losses read it); 0: none
    log_every: int = 10
    profile_steps: Optional[str] = None     # "A-B": torch.profiler over steps A..B (1-based, inclusive) on every
                                            # rank -> RUN/profile/rank<r>.json.gz (Perfetto trace) and
                                            # rank<r>.txt (top operators, step wall times); None: off
    tensorboard: bool = True                # if tensorboard is installed
    progress: bool = True                   # console progress bar
    peak_tflops: Optional[float] = None     # for MFU; None: looked up from the GPU name (CPU: no MFU)
    wandb: Any = None                       # Weights & Biases logging (needs wandb): None / false / "off": off;
                                            # true / "on": project "mxtrain"; any other text: that project


@dataclass
class ParallelSection:
    """Multi-process training (docs/distributed.md); rank and world size come from torchrun's environment."""
    mode: str = "auto"                      # auto (none on 1 process, ddp on several) | none | ddp | fsdp2
    param_dtype: str = "auto"               # FSDP2 gathered-weight dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    reshard_after_forward: bool = True      # FSDP2: free gathered weights after each block's forward (ZeRO-3)
    prefetch: int = 0                       # FSDP2: all-gather this many blocks ahead explicitly, forward and
                                            # backward (0: FSDP2's own implicit overlap)
    gather: str = "high"                    # FSDP2 weight all-gather: high | quantized (each MX layer's weight as
                                            # its quantized operands, bit-identical; docs/distributed.md)


@dataclass
class DeoscSection:
    """Weight de-oscillation (``mxtrain.train.deosc``; TetraJet-v2's OsciReset, AMD ALTO): weights whose quantized Fprop
    value flips back and forth over a window of steps are snapped onto the grid."""
    enable: bool = False                    # on: the trainer adds mxtrain.train.deosc.DeoscCallback
    period: int = 200                       # a window opens every this many steps (ALTO: 200)
    window: Optional[int] = None            # steps tracked before each reset (<= period); None: the whole period
    threshold: float = 4.0                  # reset when sum|dQ(w)| >= threshold * sum|dw| over the window (ALTO: 4)
    min_flips: int = 1                      # ... and Q(w) changed at least this many times in the window
    start: int = 0                          # the first window opens when this many steps are done


@dataclass
class TrainConfig:
    exp: str = "custom"
    recipe: Any = "mxfp4-all-dh16"          # a recipe name, or (in-process) a mxtrain.Recipe
    recipe_overrides: dict = field(default_factory=dict)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    train: TrainSection = field(default_factory=TrainSection)
    log: LogSection = field(default_factory=LogSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    deosc: DeoscSection = field(default_factory=DeoscSection)

    def to_dict(self) -> dict:
        d = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                v = v.to_dict() if hasattr(v, "to_dict") else dataclasses.asdict(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "") -> "TrainConfig":
        """A config from a nested dict (``to_dict``'s form, a run's ``config.json``, a config file's content):
        the defaults, then every key of ``d`` (see ``apply_dict``). ``source`` names the dict in errors."""
        return apply_dict(cls(), d, source)

    def resolved_recipe(self):
        try:
            r = recipes.get(self.recipe)
            return r.with_(**self.recipe_overrides) if self.recipe_overrides else r
        except (ValueError, TypeError) as e:
            raise UserError(str(e)) from None

    def recipe_name(self) -> str:
        return self.recipe if isinstance(self.recipe, str) else self.recipe.name


# -- keys and suggestions --------------------------------------------------------------------------

_TOP_KEYS = ("exp", "recipe", "recipe_overrides")

# names other trainers use for a field (nanoGPT, torchtitan, Hugging Face): suggested when given as keys
_ALIASES = {
    "learning_rate": "optim.lr", "lr": "optim.lr", "max_lr": "optim.lr", "min_lr": "optim.min_lr_ratio",
    "max_iters": "train.steps", "max_steps": "train.steps", "training_steps": "train.steps", "iters": "train.steps",
    "warmup_iters": "schedule.warmup_steps", "warmup": "schedule.warmup_steps",
    "lr_decay_iters": "schedule.horizon_steps", "lr_scheduler_type": "schedule.kind", "lr_min": "optim.min_lr_ratio",
    "block_size": "data.seq_len", "max_seq_len": "data.seq_len", "seq_length": "data.seq_len",
    "n_layer": "model.n_layers", "num_hidden_layers": "model.n_layers", "n_head": "model.n_heads",
    "num_attention_heads": "model.n_heads", "num_key_value_heads": "model.n_kv_heads", "n_embd": "model.dim",
    "hidden_size": "model.dim", "intermediate_size": "model.ffn_dim", "out_dir": "log.out", "output_dir": "log.out",
    "dump_folder": "log.out", "eval_interval": "log.eval_every", "eval_freq": "log.eval_every",
    "log_interval": "log.log_every", "log_freq": "log.log_every", "max_norm": "optim.grad_clip",
    "max_grad_norm": "optim.grad_clip", "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    "adam_epsilon": "optim.eps", "dataset": "data.path", "seed": "train.seed", "batch_size": "train.batch_size",
    "local_batch_size": "train.micro_batch_size", "per_device_train_batch_size": "train.micro_batch_size",
    "init_from": "train.init_from", "tokens": "train.tokens", "steps": "train.steps",
}


# torchtitan's config sections -> mxtrain's sections that hold what they set, and a few of their keys
_TITAN_SECTIONS = {
    "job": ("log", "dump_folder -> log.out"),
    "training": ("train or data", "steps -> train.steps, local_batch_size -> train.micro_batch_size, "
                 "seq_len -> data.seq_len, dataset_path -> data.path"),
    "optimizer": ("optim", ""), "lr_scheduler": ("schedule", "warmup_steps -> schedule.warmup_steps"),
    "parallelism": ("parallel", ""), "checkpoint": ("train", ""), "activation_checkpoint": ("train", ""),
    "metrics": ("log", ""), "compile": ("train", "enable -> train.compile"), "float8": ("recipe", ""),
    "mx": ("recipe", ""), "quantize": ("recipe", ""),
}


def section_names() -> list[str]:
    """The config's sections (model, data, optim, ...), in order."""
    cfg = TrainConfig()
    return [f.name for f in fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]


def valid_keys() -> list[str]:
    """Every settable key: ``exp``, ``recipe``, ``recipe_overrides`` and ``SECTION.FIELD`` for each field."""
    cfg = TrainConfig()
    return list(_TOP_KEYS) + [f"{s}.{f.name}" for s in section_names() for f in fields(getattr(cfg, s))]


def suggest(key: str) -> list[str]:
    """The valid keys nearest to an unknown ``key`` (at most 3): the same field name in another section or a
    name other trainers use for a field (``max_steps`` -> ``train.steps``); else the closest spellings."""
    keys, sections = valid_keys(), section_names()
    sec, _, leaf = key.rpartition(".")
    first = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    if leaf.lower() in _ALIASES:
        first.append(_ALIASES[leaf.lower()])
    if first:
        return list(dict.fromkeys(first))[:3]
    out: list[str] = []
    if sec:
        for s in [sec] if sec in sections else difflib.get_close_matches(sec, sections, n=1, cutoff=0.6):
            leaves = [k.split(".", 1)[1] for k in keys if k.startswith(s + ".")]
            out += [f"{s}.{m}" for m in difflib.get_close_matches(leaf, leaves, n=2, cutoff=0.6)]
    else:
        out += difflib.get_close_matches(key, list(_TOP_KEYS) + sections, n=2, cutoff=0.6)
    out += difflib.get_close_matches(key, keys, n=2, cutoff=0.8)
    return list(dict.fromkeys(o for o in out if o != key))[:3]


def unknown_key_message(key: str, where: str = "") -> str:
    """``unknown key 'train.lr'; did you mean optim.lr? (keys of train: ...)`` on one line."""
    if key in _TITAN_SECTIONS:   # a torchtitan config file
        ours, keys = _TITAN_SECTIONS[key]
        return (f"{where}unknown key {key!r}; did you mean {ours}? ([{key}] is a torchtitan section; mxtrain's "
                f"sections are {', '.join(section_names())}{'; ' + keys if keys else ''}; docs/config.md)")
    near = suggest(key)
    msg = f"{where}unknown key {key!r}"
    if near:
        msg += f"; did you mean {' or '.join(near)}?"
    sec = key.split(".", 1)[0] if "." in key else None
    if sec in section_names():
        msg += f" (keys of {sec}: {', '.join(f.name for f in fields(getattr(TrainConfig(), sec)))})"
    else:
        msg += f" (top-level keys: {', '.join(_TOP_KEYS)}; sections: {', '.join(section_names())})"
    return msg


# -- overrides -------------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null"}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _optional_inner(tp):
    """``X`` for ``Optional[X]`` / ``X | None``, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return None


def parse_value(text: str, tp, key: str, source: str | None = None):
    """Parse ``text`` as type ``tp`` (int, float, bool, str, Optional[...]). Errors name ``--set KEY=TEXT``,
    or ``SOURCE: KEY = 'TEXT'`` when ``source`` (a config file) is given."""
    what = f"--set {key}={text}" if source is None else f"{source}: {key} = {text!r}"
    inner = _optional_inner(tp)
    if inner is not None:
        if text.lower() in _NONE:
            return None
        return parse_value(text, inner, key, source)
    if tp is bool:
        t = text.lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise UserError(f"{what}: expected true or false")
    if tp is int:
        try:
            return int(float(text)) if ("e" in text.lower() and float(text).is_integer()) else int(text.replace("_", ""))
        except ValueError:
            raise UserError(f"{what}: expected an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise UserError(f"{what}: expected a number") from None
    if tp is str or tp is Any:
        return text
    raise UserError(f"{'--set ' + key if source is None else what}: cannot set a field of type {_type_name(tp)} "
                    f"from {'the command line' if source is None else 'a config file'}")


def _guess(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    return text


def apply_override(cfg: TrainConfig, item: str) -> None:
    """Apply one ``key=value`` override in place."""
    if "=" not in item:
        raise UserError(f"--set expects key=value (e.g. optim.lr=1e-3), got {item!r}")
    key, value = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if parts[0] == "recipe" and len(parts) >= 2:
        cfg.recipe_overrides[".".join(parts[1:])] = _guess(value)
        cfg.resolved_recipe()  # validate now
        return
    if key in ("recipe", "exp"):
        setattr(cfg, key, value)
        return
    valid_sections = section_names()
    if len(parts) != 2 or parts[0] not in valid_sections:
        near = suggest(key)
        raise UserError(f"--set {key}: unknown key; {'did you mean ' + ' or '.join(near) + '? ' if near else ''}"
                        f"use SECTION.FIELD with SECTION one of {', '.join(valid_sections)} "
                        f"(or recipe.OPERAND.FIELD)")
    sec = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(sec))
    if parts[1] not in hints:
        near = suggest(key)
        raise UserError(f"--set {key}: unknown field {parts[1]!r} in section {parts[0]!r}; "
                        f"{'did you mean ' + ' or '.join(near) + '? ' if near else ''}fields: {', '.join(hints)}")
    setattr(sec, parts[1], parse_value(value.strip(), hints[parts[1]], key))


# the fields of the model section a named size (model.name) defines: a layer of settings that names a size
# starts from that size's shape, so these fields set by an earlier layer (an experiment, a config file) are dropped
MODEL_SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "tie_embeddings",
                      "n_experts", "top_k", "router_aux_coef")


def shape_overrides(m) -> dict:
    """The shape fields a model section sets (``MODEL_SHAPE_FIELDS`` that are not None): what replaces the named
    size's own in ``ModelConfig.named(m.name, **shape_overrides(m))``."""
    return {k: getattr(m, k) for k in MODEL_SHAPE_FIELDS if getattr(m, k, None) is not None}


def _reset_model_shape(cfg: TrainConfig, keep=()) -> None:
    """A named size replaces the shape of the layers below: clear the shape fields except ``keep`` (those the
    same layer sets, which then override the named size's)."""
    for k in MODEL_SHAPE_FIELDS:
        if k not in keep:
            setattr(cfg.model, k, None)


def _override_key(item: str) -> str:
    return item.split("=", 1)[0].strip() if "=" in item else ""


def apply_overrides(cfg: TrainConfig, items: list[str]) -> TrainConfig:
    """Apply ``key=value`` items in order, as one layer of settings: when they name a model size
    (``model.name``, ``--model``), the model shape fields set before them (by the experiment or a config file)
    are dropped first, and those among ``items`` override the named size's (``--model 30m --set model.dim=512``:
    the 30m model, 512 wide)."""
    items = list(items or [])
    keys = [_override_key(it) for it in items]
    if "model.name" in keys:
        _reset_model_shape(cfg, keep={k.split(".", 1)[1] for k in keys if k.startswith("model.")})
    for it in items:
        apply_override(cfg, it)
    return cfg


def check_model_shape(cfg: TrainConfig, given: dict | None = None) -> None:
    """The model shape that ``cfg.model`` asks for (the named size, with the fields set replacing its own) is a
    valid one; a contradiction (``--model 30m --set model.dim=100``: 30m's 6 heads do not divide 100) is one line
    naming which values came from the named size and how to set them. ``given``: key -> how the user gave it."""
    m = cfg.model
    if m.name not in SIZES:
        raise UserError(f"model.name={m.name!r}: unknown model size; valid sizes: {', '.join(SIZES)}")
    over = shape_overrides(m)
    if not over:
        return
    _check_model_numbers(m)
    try:
        ModelConfig.named(m.name, **over)
    except (UserError, TypeError, ValueError) as e:
        base = SIZES[m.name]
        named = [f"model.{k}={getattr(base, k)}" for k in ("dim", "n_heads", "n_kv_heads") if k not in over]
        how = ", ".join((given or {}).get(f"model.{k}", f"model.{k}={v}") for k, v in over.items())
        raise UserError(f"{str(e).splitlines()[0]}: the model is the named size {m.name!r} with {how}"
                        f"{' (and ' + m.name + chr(39) + 's ' + ', '.join(named) + ')' if named else ''}; set the "
                        f"other shape fields to match (--set model.n_heads=N, ...) or choose another size") from None


# -- config files ----------------------------------------------------------------------------------

CONFIG_SUFFIXES = {".toml": "TOML", ".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _coerce(value, tp, key: str, source: str):
    """A config-file value as the field's type: numbers and booleans as such, or as text the way ``--set``
    reads it (YAML reads ``3e-3`` as text; TOML has no null: ``"none"`` is None for optional fields)."""
    where = f"{source}: " if source else ""
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        return _coerce(value, inner, key, source)
    if tp is Any:
        return value
    if isinstance(value, str) and tp in (int, float, bool):
        return parse_value(value.strip(), tp, key, source or "config")
    ok = None
    if tp is bool and isinstance(value, bool):
        ok = value
    elif tp is int and _is_number(value) and float(value).is_integer():
        ok = int(value)
    elif tp is float and _is_number(value):
        ok = float(value)
    elif tp is str and isinstance(value, str):
        ok = value
    if ok is not None:
        return ok
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, _type_name(tp))
    hint = (" (YAML reads on/off/yes/no as booleans: quote the value)" if tp is str and isinstance(value, bool)
            else "")
    raise UserError(f"{where}{key}: expected {kind}, got {json.dumps(value) if value is None else repr(value)}{hint}")


def _nest(d: dict, where: str, prefix: str = "") -> dict:
    """Dotted keys (``"optim.lr": 1e-3``, as ``--set`` writes them) as nested tables; the keys inside
    ``recipe_overrides`` are recipe paths (``"wgrad_dy.rounding"``) and stay as they are."""
    out: dict = {}
    for k, v in d.items():
        if not isinstance(k, str):
            raise UserError(f"{where}key {k!r} under {prefix or 'the top level'} is not a string")
        in_overrides = prefix.split(".", 1)[0] == "recipe_overrides"
        head, _, rest = (k, "", "") if in_overrides else k.partition(".")
        path = f"{prefix}.{head}" if prefix else head
        if rest:
            v = {rest: v}
        if isinstance(v, dict):
            v = _nest(v, where, path)
        out[head] = _merge(out[head], v, where, path) if head in out else v
    return out


def _merge(a, b, where: str, path: str):
    if not (isinstance(a, dict) and isinstance(b, dict)):
        raise UserError(f"{where}{path} is given twice")
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v, where, f"{path}.{k}") if k in out else v
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def apply_dict(cfg: TrainConfig, d: dict, source: str = "") -> TrainConfig:
    """Apply a nested dict on top of ``cfg`` in place (and return it): only the keys given change, except that
    a ``model`` table with a ``name`` (a named size) drops the model shape fields set before (an experiment's),
    keeping those of the same table, which override the named size's (``MODEL_SHAPE_FIELDS``).

    ``d`` has ``TrainConfig.to_dict()``'s form: ``exp``, ``recipe`` (a preset name, or a full recipe table as
    in a run's ``recipe.json``), ``recipe_overrides`` (``{"wgrad_dy.rounding": "stochastic"}``, or nested) and
    one table per section (``{"optim": {"lr": 1e-3}}``; dotted keys ``{"optim.lr": 1e-3}`` work too). Keys
    starting with ``_`` are ignored (comments, run metadata). Values are checked against the field types;
    an unknown key is a ``UserError`` naming the nearest valid keys. ``source`` prefixes error messages."""
    where = f"{source}: " if source else ""
    if not isinstance(d, dict):
        raise UserError(f"{where}expected a table of keys, got {type(d).__name__}")
    d = _nest({k: v for k, v in d.items() if not (isinstance(k, str) and k.startswith("_"))}, where)
    sections = section_names()
    for k, v in d.items():
        if k == "exp":
            cfg.exp = _coerce(v, str, "exp", source)
        elif k == "recipe":
            if isinstance(v, str):
                cfg.recipe = v
            elif isinstance(v, dict):
                if "name" not in v:
                    raise UserError(f"{where}recipe: a recipe table is a whole recipe (as in a run's recipe.json, "
                                    f"with a name); to change fields of a preset, set recipe = \"NAME\" and "
                                    f"[recipe_overrides] \"OPERAND.FIELD\" = VALUE")
                try:
                    cfg.recipe = Recipe.from_dict(v)
                except (TypeError, ValueError) as e:
                    raise UserError(f"{where}recipe: {str(e).splitlines()[0]}") from None
            else:
                raise UserError(f"{where}recipe: expected a recipe name or a recipe table, got {v!r}")
        elif k == "recipe_overrides":
            if not isinstance(v, dict):
                raise UserError(f"{where}recipe_overrides: expected a table like {{\"wgrad_dy.rounding\": "
                                f"\"stochastic\"}}, got {v!r}")
            for rk, rv in _flat(v).items():
                if not (isinstance(rv, (str, int, float, bool)) or rv is None or isinstance(rv, list)):
                    raise UserError(f"{where}recipe_overrides.{rk}: expected a value, got {rv!r}")
                cfg.recipe_overrides[rk] = tuple(rv) if isinstance(rv, list) else rv
        elif k in sections:
            if not isinstance(v, dict):
                raise UserError(f"{where}{k} is a section: give its fields ([{k}] in TOML, {{\"{k}\": {{...}}}} in "
                                f"JSON, e.g. {k}.{fields(getattr(cfg, k))[0].name}), got {v!r}")
            sec = getattr(cfg, k)
            hints = typing.get_type_hints(type(sec))
            if k == "model" and "name" in v:   # a named size: its shape, with this table's fields over it
                _reset_model_shape(cfg, keep=set(v))
            for fk, fv in v.items():
                if fk not in hints:
                    raise UserError(unknown_key_message(f"{k}.{fk}", where))
                if isinstance(fv, (dict, list)):
                    raise UserError(f"{where}{k}.{fk}: expected a single value, got {fv!r}")
                setattr(sec, fk, _coerce(fv, hints[fk], f"{k}.{fk}", source))
        else:
            raise UserError(unknown_key_message(k, where))
    if "recipe" in d or "recipe_overrides" in d:
        try:
            cfg.resolved_recipe()
        except UserError as e:
            raise UserError(f"{where}{e}") from None
    return cfg


def _toml_loads(text: str):
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]  # Python 3.10
        except ModuleNotFoundError:
            raise UserError("reading TOML on Python 3.10 needs tomli: pip install tomli "
                            "(or use a .json config file)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"not valid TOML ({e})") from None


def _no_duplicate_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (JSON would keep the last one silently; TOML
    refuses it too)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} is given twice in one table")
        out[k] = v
    return out


def _yaml_loads(text: str, path: Path):
    try:
        import yaml  # optional
    except ModuleNotFoundError:
        raise UserError(f"{path}: reading YAML needs PyYAML: pip install pyyaml (or use a .toml or .json "
                        f"config file)") from None

    class Loader(yaml.SafeLoader):
        """safe_load, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):   # (the base class refuses it in its own words)
                    continue
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)
    try:
        return yaml.load(text, Loader=Loader)
    except yaml.YAMLError as e:
        raise ValueError("not valid YAML (" + " ".join(str(e).split()) + ")") from None


def config_file_path(path) -> Path:
    """``path`` itself, or ``path/config.json`` when ``path`` is a run folder."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return p / "config.json"
        raise UserError(f"{p} is a folder without config.json; give a config file (.toml, .json, .yaml)")
    return p


MAX_DEPTH = 16        # a config file's tables and lists in each other (a run's config.json: 3)
MAX_VALUES = 100_000  # its values in all


def check_shape(data, path) -> None:
    """A parsed config file is a tree of at most ``MAX_DEPTH`` levels and ``MAX_VALUES`` values, each table or
    list in it once: YAML aliases (``&a`` / ``*a``) that refer to themselves, or nest into a billion values,
    are refused in one line naming the file, not a RecursionError or a hang."""
    seen: set[int] = set()
    stack, n = [(data, 1)], 0
    while stack:
        v, depth = stack.pop()
        n += 1
        if n > MAX_VALUES:
            raise UserError(f"{path}: more than {MAX_VALUES:,} values; not a config file (YAML aliases that "
                            f"multiply?)")
        if isinstance(v, (dict, list)):
            if id(v) in seen:
                raise UserError(f"{path}: a table or list used twice (a YAML alias *NAME); write the values out")
            seen.add(id(v))
            if depth > MAX_DEPTH:
                raise UserError(f"{path}: nested too deeply to be a config file (at most {MAX_DEPTH} levels)")
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


CONFIG_MAX_BYTES = 16 << 20   # a config file larger than this is not one (and would be read whole)


def read_config_file(path) -> dict:
    """The content of a TOML / JSON / YAML config file (chosen by the suffix) as a dict; a run folder reads
    its ``config.json``. Any problem (missing file, other suffix, a syntax error, YAML without PyYAML) is a
    one-line ``UserError`` naming the file."""
    p = config_file_path(path)
    kind = CONFIG_SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise UserError(f"{p}: unknown config file type {p.suffix or '(no suffix)'!r}; use .toml, .json, .yaml or .yml")
    try:
        # (a byte-order mark, as some editors write, is not content; /dev/zero or a pipe is no config file)
        text = read_regular(p, "config file ", limit=CONFIG_MAX_BYTES, encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"config file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {p} ({getattr(e, 'strerror', None) or e})") from None
    try:
        if kind == "TOML":
            data = _toml_loads(text)
        elif kind == "JSON":
            try:
                data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON at line {e.lineno}, column {e.colno} ({e.msg})") from None
        else:
            data = _yaml_loads(text, p)
    except ValueError as e:
        raise UserError(f"{p}: {e}") from None
    except RecursionError:   # (the parsers recurse per level of nesting)
        raise UserError(f"{p}: nested too deeply to be a config file (at most {MAX_DEPTH} levels)") from None
    check_shape(data, p)
    if data is None and kind == "YAML" and not [ln for ln in text.splitlines() if ln.strip() and not
                                                ln.lstrip().startswith("#") and ln.strip() not in ("---", "...")]:
        data = {}   # an empty YAML file (or comments only): no settings, as an empty TOML file
    if data is None:   # (JSON null, YAML "~" or "null": a value where the settings should be)
        raise UserError(f"{p}: the file must hold a table of keys (sections like model, train), not null")
    if not isinstance(data, dict):
        raise UserError(f"{p}: the file must hold a table of keys (sections like model, train), "
                        f"not a {type(data).__name__}")
    return data


# -- named experiments: the registry (the experiments themselves: ``experiments``, which fills it) ----------

_EXPERIMENTS: dict[str, typing.Callable[[], TrainConfig]] = {}
DEFAULT_EXPERIMENT = "tiny-main"   # ``mxtrain train`` alone (``experiments.DEFAULT``)


def experiment(name: str):
    """Decorator: register a function returning a ``TrainConfig`` as the experiment ``name``."""
    def deco(fn):
        _EXPERIMENTS[name] = fn
        return fn
    return deco


def experiment_names() -> list[str]:
    """The registered experiments' names (``experiments.names``)."""
    return list(_EXPERIMENTS)


def get_experiment(name: str) -> TrainConfig:
    """A fresh config of the experiment ``name`` (``experiments.get``); an unknown name is a ``UserError``."""
    if name not in _EXPERIMENTS:
        near = difflib.get_close_matches(name, list(_EXPERIMENTS), n=1, cutoff=0.6)
        raise UserError(f"unknown experiment {name!r}; {f'did you mean {near[0]}? ' if near else ''}valid experiments: "
                        f"{', '.join(_EXPERIMENTS)} (a config file is given with --config FILE)")
    cfg = _EXPERIMENTS[name]()
    cfg.exp = name
    return cfg


def load_train_config(path, exp: str | None = None, data: dict | None = None) -> TrainConfig:
    """The config of ``mxtrain train --config FILE [--exp NAME]``: the defaults, then the experiment, then
    the file. The experiment is ``exp`` if given, else the file's ``exp`` when it names one
    (``mxtrain train --list``), else the default one (``tiny-main``); a file's ``exp`` that names no
    experiment is only the run's label (the run folder's name starts with it). A file without ``exp`` is
    labelled by its file name.
    ``data``: the file's content when already read. (The experiments are registered by ``experiments``, which
    the package ``mxtrain.train`` imports.)"""
    p = config_file_path(path)
    d = read_config_file(p) if data is None else data
    if "study" in d:
        raise UserError(f"{p} has a [study] section: it is a study config, run it with mxtrain study --config {p}")
    file_exp = d.get("exp")
    if exp is not None:
        cfg = get_experiment(exp)
    elif isinstance(file_exp, str) and file_exp in experiment_names():
        cfg = get_experiment(file_exp)
    else:
        cfg = get_experiment(DEFAULT_EXPERIMENT)
    if file_exp is None and exp is None:
        cfg.exp = p.stem if p.name != "config.json" else p.parent.name
    return apply_dict(cfg, d, str(p))


def check_init_from(path) -> None:
    """``train.init_from`` must be a local Hugging Face model folder: an existing folder with config.json."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise UserError(f"train.init_from (--init-from): {p} not found; give a local Hugging Face Llama, Mistral, "
                        f"Qwen2 or Mixtral folder (config.json and *.safetensors)")
    if not p.is_dir():
        raise UserError(f"train.init_from (--init-from): {p} is not a folder; give a local Hugging Face Llama, "
                        f"Mistral, Qwen2 or Mixtral folder (config.json and *.safetensors)")
    if not (p / "config.json").is_file():
        raise UserError(f"train.init_from (--init-from): {p} has no config.json, so it is not a Hugging Face "
                        f"model folder")

# ------------------------------------------------------------------------------- checking a config
# ``validate(cfg)``: every value training reads; ``_check(cfg)``: that, and what ``train`` needs besides
# (``train.tokens`` turned into steps, the device's name, the combinations not supported).

DECAY_SHAPES = ("linear", "1-sqrt")
# the most steps or tokens a run may have: the schedule and the logs compute with them as float64 numbers
MAX_COUNT = 2**53


def keep_steps(cfg: TrainConfig) -> list[int]:
    """The steps of ``train.keep_checkpoints_at`` (sorted, unique): integers are steps, numbers with a point are
    fractions of ``train.steps`` (rounded to a step, at least 1). UserError on anything else."""
    text = getattr(cfg.train, "keep_checkpoints_at", None)
    if text is None or str(text).strip() == "":
        return []
    out = set()
    for item in str(text).replace(" ", "").split(","):
        if not item:
            continue
        try:
            if "." in item or "e" in item.lower():
                f = float(item)
                if not 0 < f <= 1:
                    raise ValueError
                out.add(max(1, int(round(f * cfg.train.steps))))
            else:
                k = int(item)
                if k < 1:
                    raise ValueError
                out.add(k)
        except ValueError:
            raise UserError(f"train.keep_checkpoints_at: {item!r} is neither a step (an integer >= 1) nor a fraction "
                            f"of train.steps in (0, 1] (written with a point, e.g. 0.5)") from None
    bad = [k for k in out if k > cfg.train.steps]
    if bad:
        raise UserError(f"train.keep_checkpoints_at: step {min(bad)} is past train.steps ({cfg.train.steps})")
    return sorted(out)


def _check(cfg: TrainConfig) -> None:
    t, d = cfg.train, cfg.data
    if t.tokens is not None:
        if t.tokens <= 0:
            raise UserError("--tokens must be positive")
        _num("train.tokens", t.tokens, lo=1, hi=MAX_COUNT, integer=True)
        _num("train.batch_size", t.batch_size, lo=1, integer=True)
        _num("data.seq_len", d.seq_len, lo=1, hi=2**20, integer=True)
        t.steps = math.ceil(t.tokens / (t.batch_size * d.seq_len))
    for name, v in (("train.steps", t.steps), ("train.batch_size", t.batch_size), ("data.seq_len", d.seq_len),
                    ("log.eval_every", cfg.log.eval_every), ("log.eval_tokens", cfg.log.eval_tokens),
                    ("log.log_every", cfg.log.log_every)):
        if v <= 0:
            raise UserError(f"{name} must be positive, got {v}")
    _num("train.steps", t.steps, lo=1, hi=MAX_COUNT, integer=True)
    if cfg.log.final_eval_tokens < 0:
        raise UserError(f"log.final_eval_tokens must be 0 (none) or positive, got {cfg.log.final_eval_tokens}")
    profiling.parse_steps(cfg.log.profile_steps, t.steps)
    if t.micro_batch_size is not None and t.micro_batch_size > 0 and t.batch_size % t.micro_batch_size:
        raise UserError(f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
                        f"({t.micro_batch_size}) (times the number of processes)")
    if t.device != "auto":   # the name only: whether this machine has the device is checked when training starts
        try:
            ok = torch.device(t.device).type in ("cpu", "cuda")
        except (RuntimeError, TypeError):
            ok = False
        if not ok:
            raise UserError(f"unknown device {t.device!r}; use auto, cpu, cuda or cuda:N")
    if d.path == "builtin":   # the built-in corpus's tokenizer is trained at this vocab
        check_vocab_size(d.vocab_size)
    if t.gc_every < 0:
        raise UserError(f"train.gc_every must be 0 (Python's automatic collection) or positive, got {t.gc_every}")
    switch_step(cfg)   # train.switch_recipe: well formed, a known recipe, inside the run
    if t.switch_recipe and t.cuda_graphs:
        raise UserError("train.switch_recipe and train.cuda_graphs together are not supported (the captured graphs "
                        "hold the first recipe's kernels); set one of them off")
    if t.checkpoint_blocks and t.cuda_graphs:
        raise UserError("train.checkpoint_blocks and train.cuda_graphs together are not supported (a recomputation "
                        "inside a replayed graph is not tested); set one of them to false")
    validate(cfg)
    if t.cuda_graphs and ModelConfig.named(cfg.model.name, **shape_overrides(cfg.model)).n_experts:
        raise UserError("train.cuda_graphs with a mixture of experts is not supported (the experts' token counts "
                        "change every step, which a captured graph cannot); set one of them off")
    if cfg.schedule.horizon_steps is not None and cfg.schedule.horizon_steps < cfg.train.steps:
        raise UserError(f"schedule.horizon_steps ({cfg.schedule.horizon_steps}) must be >= train.steps ({t.steps})")
    if cfg.schedule.kind not in ("cosine", "wsd", "constant"):
        raise UserError(f"schedule.kind must be cosine, wsd or constant, got {cfg.schedule.kind!r}")
    if cfg.train.compile not in ("auto", "on", "off"):
        raise UserError(f"train.compile must be auto, on or off, got {cfg.train.compile!r}")
    if t.cpp_wrapper and (t.compile == "off" or (t.compile == "auto" and t.cuda_graphs)):
        raise UserError("train.cpp_wrapper is for compiled blocks, but "
                        + ("train.compile is off" if t.compile == "off" else "train.cuda_graphs turns compiling off")
                        + "; set train.compile=on or leave train.cpp_wrapper off")
    if cfg.train.check_every_step not in ("auto", "on", "off"):
        raise UserError(f"train.check_every_step must be auto, on or off, got {cfg.train.check_every_step!r}")
    if cfg.parallel.mode not in ("auto",) + MODES:
        raise UserError(f"parallel.mode must be auto, {', '.join(MODES)}; got {cfg.parallel.mode!r}")
    if cfg.parallel.param_dtype not in ("auto", "bf16", "fp32"):
        raise UserError(f"parallel.param_dtype must be auto, bf16 or fp32, got {cfg.parallel.param_dtype!r}")
    if cfg.parallel.gather not in GATHER_MODES:
        raise UserError(f"parallel.gather must be {' or '.join(GATHER_MODES)}, got {cfg.parallel.gather!r}")
    if cfg.parallel.gather == "quantized" and cfg.parallel.mode != "fsdp2":
        raise UserError(f"parallel.gather=quantized is FSDP2's weight all-gather: it needs parallel.mode=fsdp2 "
                        f"(got {cfg.parallel.mode})")
    if cfg.parallel.gather == "quantized" and not cfg.parallel.reshard_after_forward:
        raise UserError("parallel.gather=quantized needs parallel.reshard_after_forward=true (a gathered weight holds "
                        "only its quantized operands: no block may stay unsharded after a forward)")
    if cfg.parallel.gather == "quantized" and t.switch_recipe:
        raise UserError("parallel.gather=quantized with train.switch_recipe is not supported (each layer's gather "
                        "is planned for one recipe's weight operands); use parallel.gather=high")
    if cfg.train.dtype not in ("auto", "bf16", "fp32"):
        raise UserError(f"train.dtype must be auto, bf16 or fp32, got {cfg.train.dtype!r}")


def switch_step(cfg: TrainConfig) -> tuple[int, str] | None:
    """``train.switch_recipe`` as ``(step, recipe name)``: the optimizer steps after ``step`` train with the
    recipe; None when unset. UserError for a malformed value, an unknown recipe or a step outside the run."""
    v = cfg.train.switch_recipe
    if not v:
        return None
    at, sep, name = str(v).partition(":")
    try:
        x = float(at)
    except ValueError:
        x = float("nan")
    if not sep or not name or not math.isfinite(x) or x < 0:
        raise UserError(f"train.switch_recipe must be STEP:RECIPE (a step, or a fraction of train.steps, then a "
                        f"preset), e.g. 800:bf16 or 0.8:bf16; got {v!r}")
    step = int(round(x * cfg.train.steps)) if 0 < x < 1 and "." in at else int(x)
    if step != x and not (0 < x < 1 and "." in at):
        raise UserError(f"train.switch_recipe: step {at} must be a whole number or a fraction in (0, 1)")
    if not 0 < step < cfg.train.steps:
        raise UserError(f"train.switch_recipe: step {step} must be inside the run (1 to {cfg.train.steps - 1}; "
                        f"train.steps = {cfg.train.steps})")
    try:
        recipes.get(name)
    except (KeyError, ValueError, UserError):
        raise UserError(f"train.switch_recipe: unknown recipe {name!r}{recipes.did_you_mean(name)}; presets: "
                        f"{', '.join(recipes.names())}") from None
    return step, name


def _num(name: str, v, lo=None, hi=None, lo_open=False, hi_open=False, integer=False, optional=False) -> None:
    """One config value: ``errors.check_number`` (finite, in range, an int at most 2**63 - 1 if ``integer``)."""
    check_number(name, v, lo, hi, lo_open, hi_open, integer, optional)


def _check_model_numbers(m) -> None:
    """The model section's numbers, each in its range (before a ModelConfig is built of them: ``n_heads=0``
    would be a division by zero there)."""
    for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "top_k"):
        _num(f"model.{k}", getattr(m, k), lo=1, integer=True, optional=True)
    _num("model.n_experts", m.n_experts, lo=0, integer=True, optional=True)
    _num("model.router_aux_coef", m.router_aux_coef, lo=0, optional=True)
    _num("model.rope_theta", m.rope_theta, lo=0, lo_open=True, optional=True)
    _num("model.init_seed", m.init_seed, lo=0, integer=True, optional=True)   # (numpy refuses a negative seed)
    _num("model.vocab_size", m.vocab_size, lo=32, hi=2**24, integer=True, optional=True)


def validate(cfg: TrainConfig) -> None:
    """Every value of ``cfg`` that training reads, checked before anything is written (UserError on the first
    bad one): the model's shape, the optimizer's values (finite, in range), the schedule, the recipe."""
    m, o, sc, t, d, lg = cfg.model, cfg.optim, cfg.schedule, cfg.train, cfg.data, cfg.log
    _check_model_numbers(m)
    try:
        mc = ModelConfig.named(m.name, **shape_overrides(m))
    except TypeError as e:
        raise UserError(f"model: {e}") from None
    if (mc.dim // mc.n_heads) % 2:
        raise UserError(f"the head size model.dim / model.n_heads ({mc.dim // mc.n_heads}) must be even (RoPE)")
    _num("data.vocab_size", d.vocab_size, lo=32, hi=2**20, integer=True)
    _num("data.seq_len", d.seq_len, lo=1, hi=2**20, integer=True)
    _num("data.seed", d.seed, lo=0, integer=True, optional=True)
    _num("optim.lr", o.lr, lo=0, lo_open=True)
    _num("optim.min_lr_ratio", o.min_lr_ratio, lo=0, hi=1)
    _num("optim.weight_decay", o.weight_decay, lo=0)
    _num("optim.beta1", o.beta1, lo=0, hi=1, hi_open=True)
    _num("optim.beta2", o.beta2, lo=0, hi=1, hi_open=True)
    _num("optim.eps", o.eps, lo=0, lo_open=True, hi=1)
    _num("optim.grad_clip", o.grad_clip, lo=0)
    # AdamW's first step is lr / (1 - beta1) and its weight decay lr x weight_decay: Python numbers torch converts
    # to the weights' type, a RuntimeError beyond float32's largest number (bfloat16's is about the same)
    big = torch.finfo(torch.float32).max
    top = min(big * (1 - o.beta1), big / o.weight_decay if o.weight_decay > 0 else math.inf)
    if o.lr >= top:
        raise UserError(f"optim.lr {o.lr:g} is too large: AdamW's first step (lr / (1 - beta1)) or its weight decay "
                        f"(lr x weight_decay) overflows float32; use a learning rate below {top:.3g}")
    tiny = torch.finfo(torch.float32).tiny   # the optimizer uses lr and eps in float32: a smaller one is 0 there
    for k in ("lr", "eps"):
        if getattr(o, k) < tiny:
            raise UserError(f"optim.{k} {getattr(o, k):g} is zero or subnormal in float32, the type AdamW uses it "
                            f"in; use a value of at least {tiny:.4g}")
    if 0 < o.grad_clip < tiny:   # (0: no clipping) the clip factor is computed in float32: it would zero every step
        raise UserError(f"optim.grad_clip {o.grad_clip:g} is subnormal or zero in float32 and would zero every "
                        f"gradient; use 0 (no clipping) or at least {tiny:.4g}")
    # (model.rope_theta's float32 range: ModelConfig checks it, through ModelConfig.named above)
    _num("schedule.warmup_steps", sc.warmup_steps, lo=0, integer=True)
    _num("schedule.horizon_steps", sc.horizon_steps, lo=1, integer=True, optional=True)
    _num("schedule.decay_fraction", sc.decay_fraction, lo=0, hi=1)
    _num("schedule.decay_steps", getattr(sc, "decay_steps", None), lo=0, integer=True, optional=True)
    if getattr(sc, "decay_shape", "linear") not in DECAY_SHAPES:
        raise UserError(f"schedule.decay_shape must be {' or '.join(DECAY_SHAPES)}, got {sc.decay_shape!r}")
    if getattr(sc, "decay_steps", None) is not None and sc.decay_steps > (sc.horizon_steps or t.steps):
        raise UserError(f"schedule.decay_steps ({sc.decay_steps}) must be <= the schedule's horizon "
                        f"({sc.horizon_steps or t.steps} steps)")
    _num("train.steps", t.steps, lo=1, hi=MAX_COUNT, integer=True)   # also where _check does not run first (a study, --print-config)
    _num("train.batch_size", t.batch_size, lo=1, integer=True)
    _num("train.micro_batch_size", t.micro_batch_size, lo=1, integer=True, optional=True)
    _num("train.seed", t.seed, lo=0, integer=True)
    _num("train.checkpoint_every", t.checkpoint_every, lo=0, integer=True)
    _num("train.checkpoint_minutes", t.checkpoint_minutes, lo=0)
    _num("parallel.prefetch", cfg.parallel.prefetch, lo=0, integer=True)
    _num("train.memory_budget", getattr(t, "memory_budget", None), lo=0, lo_open=True, hi=1, optional=True)
    keep_steps(cfg)
    for k in ("eval_every", "eval_tokens", "log_every"):
        _num(f"log.{k}", getattr(lg, k), lo=1, integer=True)
    _num("log.peak_tflops", lg.peak_tflops, lo=0, lo_open=True, optional=True)
    wandb_project(getattr(lg, "wandb", None))   # true, false or a project name (read only if the field exists)
    recipe = cfg.resolved_recipe()   # unknown presets and bad recipe fields: one line
    if not isinstance(cfg.deosc.enable, bool):
        raise UserError(f"deosc.enable must be true or false, got {cfg.deosc.enable!r}")
    DeoscSettings.from_config(cfg)   # the deosc.* values, checked whether or not it is on
    if cfg.deosc.enable:
        check_recipe(recipe)
        if cfg.parallel.mode == "fsdp2":
            raise UserError("deosc.enable needs whole weights on every process (one process, or parallel.mode=ddp); "
                            "FSDP2 shards them")
