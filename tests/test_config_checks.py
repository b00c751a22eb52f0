"""Every config value is checked before anything is written: one clear line naming the value."""

import math

import pytest

from mxtrain.errors import UserError
from mxtrain.train import apply_overrides, experiments
from mxtrain.train.trainer import validate

BAD = [
    ("optim.lr=0", "optim.lr must be in (0, inf)"),
    ("optim.lr=nan", "optim.lr must be finite"),
    ("optim.lr=inf", "optim.lr must be finite"),
    ("optim.beta1=1.0", "optim.beta1 must be in [0, 1)"),
    ("optim.beta2=-0.1", "optim.beta2 must be in [0, 1)"),
    ("optim.eps=0", "optim.eps must be in (0, 1]"),
    ("optim.weight_decay=-1", "optim.weight_decay must be in [0, inf)"),
    ("optim.grad_clip=-1", "optim.grad_clip must be in [0, inf)"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio must be in [0, 1]"),
    ("schedule.warmup_steps=-5", "schedule.warmup_steps must be in [0, inf)"),
    ("schedule.decay_fraction=1.5", "schedule.decay_fraction must be in [0, 1]"),
    ("model.dim=0", "model.dim must be in [1, inf)"),
    ("model.dim=99", "must be a multiple of model.n_heads"),
    ("model.n_kv_heads=3", "must be a multiple of model.n_kv_heads"),
    ("model.rope_theta=-1", "model.rope_theta must be in (0, inf)"),
    ("data.vocab_size=0", "data.vocab_size must be in [32, 1048576]"),
    ("data.seq_len=0", "data.seq_len must be in [1, 1048576]"),
    ("train.checkpoint_minutes=-1", "train.checkpoint_minutes must be in [0, inf)"),
    ("recipe_overrides={\"fprop_x.prescale\": Infinity}", "prescale must be a positive finite number"),
]


@pytest.mark.parametrize("item,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_one_clear_line(item, msg):
    cfg = experiments.get("debug")
    if item.startswith("recipe_overrides="):
        cfg.recipe_overrides = {"fprop_x.prescale": math.inf}
    else:
        apply_overrides(cfg, [item])
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_defaults_and_experiments_are_valid():
    for name in experiments.names():
        validate(experiments.get(name))
