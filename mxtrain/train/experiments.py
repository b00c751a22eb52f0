"""Named experiment configs. Each is a function returning a ``TrainConfig``; derived experiments call
their baseline and change a few fields. ``mxtrain train --exp NAME``; ``mxtrain train`` alone runs
``tiny-main``."""

from __future__ import annotations

from .config import DEFAULT_EXPERIMENT, TrainConfig, experiment, experiment_names, get_experiment

# the registry lives with the config loader (``config.load_train_config`` reads it); the names used from here
DEFAULT = DEFAULT_EXPERIMENT
names = experiment_names
get = get_experiment


@experiment("tiny-main")
def tiny_main() -> TrainConfig:
    """The README's main job: ``tiny`` + ``mxfp4-all-dh16`` on the built-in corpus, about 5 minutes on
    2 CPU cores (measured: docs/training.md); validation every 25 steps."""
    return TrainConfig(recipe="mxfp4-all-dh16")


@experiment("tiny-bf16")
def tiny_bf16() -> TrainConfig:
    """The main job's high-precision baseline (same init and data order)."""
    cfg = tiny_main()
    cfg.recipe = "bf16"
    return cfg


@experiment("debug")
def debug() -> TrainConfig:
    """The golden 20-step run of the tests (tests/assets/golden_losses.json): a 2-layer, 64-wide model."""
    cfg = TrainConfig(recipe="mxfp4-all-dh16")
    cfg.model.dim, cfg.model.n_layers, cfg.model.n_heads, cfg.model.n_kv_heads = 64, 2, 2, 1
    cfg.data.seq_len = 64
    cfg.train.steps, cfg.train.batch_size = 20, 8
    cfg.schedule.warmup_steps = 5
    cfg.log.eval_every, cfg.log.eval_tokens, cfg.log.log_every = 10, 2048, 1
    return cfg


@experiment("125m-gpu")
def gpu_125m() -> TrainConfig:
    """The ~125M model on one GPU with mxfp4-all-dh16 (BENCHMARKS.md "Training: 125M on one GPU")."""
    cfg = TrainConfig(recipe="mxfp4-all-dh16")
    cfg.model.name = "125m"
    cfg.data.vocab_size = 16384
    cfg.data.seq_len = 1024
    cfg.train.batch_size, cfg.train.steps = 16, 300
    cfg.optim.lr = 1e-3
    cfg.schedule.warmup_steps = 30
    cfg.log.eval_every, cfg.log.eval_tokens, cfg.log.log_every = 100, 65536, 10
    return cfg


@experiment("125m-gpu-bf16")
def gpu_125m_bf16() -> TrainConfig:
    cfg = gpu_125m()
    cfg.recipe = "bf16"
    return cfg
