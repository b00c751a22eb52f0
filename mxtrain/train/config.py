"""Typed run configuration: one dataclass per section, ``TrainConfig`` holds them all.

Overrides come as ``section.field=value`` strings (``--set optim.lr=1e-3``) and are parsed by the
field's declared type; an unknown key or an unparsable value is a ``UserError``. Keys under
``recipe.`` (e.g. ``recipe.wgrad_dy.rounding=stochastic``) change the recipe through ``Recipe.with_``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from ..errors import UserError


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
    init_seed: Optional[int] = None         # model init seed; None: train.seed (same init for every recipe)


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
    decay_fraction: float = 0.2             # WSD: final share of the horizon spent decaying


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
    deterministic: bool = False             # torch.use_deterministic_algorithms (GPU runs)
    cuda_graphs: bool = False               # replay each micro-step's forward + backward as a CUDA graph
                                            # (one GPU)
    compile: str = "auto"                   # torch.compile every transformer block (MX layers included):
                                            # auto (on CUDA without cuda_graphs) | on | off


@dataclass
class LogSection:
    out: Optional[str] = None               # run folder; None: runs/<exp>-<recipe>-<time>
    eval_every: int = 25
    eval_tokens: int = 8192                 # validation tokens per evaluation (fixed windows)
    log_every: int = 10
    tensorboard: bool = True                # if tensorboard is installed
    progress: bool = True                   # console progress bar
    peak_tflops: Optional[float] = None     # for MFU; None: looked up from the GPU name (CPU: no MFU)


@dataclass
class ParallelSection:
    """Multi-process training (docs/distributed.md); rank and world size come from torchrun's environment."""
    mode: str = "auto"                      # auto (none on 1 process, ddp on several) | none | ddp | fsdp2
    param_dtype: str = "auto"               # FSDP2 gathered-weight dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    reshard_after_forward: bool = True      # FSDP2: free gathered weights after each block's forward (ZeRO-3)


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

    def to_dict(self) -> dict:
        d = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                v = v.to_dict() if hasattr(v, "to_dict") else dataclasses.asdict(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        cfg = cls()
        for k, v in d.items():
            if k not in {f.name for f in fields(cls)}:
                raise UserError(f"unknown config section {k!r}")
            cur = getattr(cfg, k)
            if dataclasses.is_dataclass(cur) and isinstance(v, dict):
                valid = {f.name for f in fields(cur)}
                bad = set(v) - valid
                if bad:
                    raise UserError(f"unknown keys in config section {k!r}: {', '.join(sorted(bad))}")
                setattr(cfg, k, type(cur)(**v))
            elif k == "recipe" and isinstance(v, dict):
                from ..recipe import Recipe
                setattr(cfg, k, Recipe.from_dict(v))
            else:
                setattr(cfg, k, v)
        return cfg

    def resolved_recipe(self):
        from .. import recipes
        try:
            r = recipes.get(self.recipe)
            return r.with_(**self.recipe_overrides) if self.recipe_overrides else r
        except (ValueError, TypeError) as e:
            raise UserError(str(e)) from None

    def recipe_name(self) -> str:
        return self.recipe if isinstance(self.recipe, str) else self.recipe.name


# -- overrides -------------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def parse_value(text: str, tp, key: str):
    """Parse ``text`` as type ``tp`` (int, float, bool, str, Optional[...])."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if text.lower() in ("none", "null"):
            return None
        return parse_value(text, args[0], key)
    if tp is bool:
        t = text.lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise UserError(f"--set {key}={text}: expected true or false")
    if tp is int:
        try:
            return int(float(text)) if ("e" in text.lower() and float(text).is_integer()) else int(text.replace("_", ""))
        except ValueError:
            raise UserError(f"--set {key}={text}: expected an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise UserError(f"--set {key}={text}: expected a number") from None
    if tp is str or tp is Any:
        return text
    raise UserError(f"--set {key}: cannot set a field of type {_type_name(tp)} from the command line")


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
    valid_sections = [f.name for f in fields(cfg) if f.name not in ("exp", "recipe", "recipe_overrides")]
    if len(parts) != 2 or parts[0] not in valid_sections:
        raise UserError(f"--set {key}: unknown key; use SECTION.FIELD with SECTION one of {', '.join(valid_sections)} "
                        f"(or recipe.OPERAND.FIELD)")
    sec = getattr(cfg, parts[0])
    hints = typing.get_type_hints(type(sec))
    if parts[1] not in hints:
        raise UserError(f"--set {key}: unknown field {parts[1]!r} in section {parts[0]!r}; fields: "
                        f"{', '.join(hints)}")
    setattr(sec, parts[1], parse_value(value.strip(), hints[parts[1]], key))


def apply_overrides(cfg: TrainConfig, items: list[str]) -> TrainConfig:
    for it in items or []:
        apply_override(cfg, it)
    return cfg
