"""Every config value is checked before anything is written: one clear line naming the value."""

import math

import pytest

from mxtrain.errors import UserError
from mxtrain.train import apply_overrides, experiments
from mxtrain.train.config import validate

BAD = [
    ("optim.lr=0", "optim.lr must be in (0, inf)"),
    ("optim.lr=nan", "optim.lr must be finite"),
    ("optim.lr=inf", "optim.lr must be finite"),
    ("optim.lr=1e39", "optim.lr 1e+39 is too large"),        # past float32 (a RuntimeError inside AdamW's step)
    ("optim.lr=1e38", "use a learning rate below 3.4e+37"),   # its first step: lr / (1 - beta1)
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
    ("model.vocab_size=8", "model.vocab_size must be in [32, 16777216]"),
    ("data.seq_len=0", "data.seq_len must be in [1, 1048576]"),
    ("train.checkpoint_minutes=-1", "train.checkpoint_minutes must be in [0, inf)"),
    # also checked here, not only by the trainer: a study's runs and --print-config go through validate alone
    ("train.steps=0", "train.steps must be in [1, inf)"),
    ("train.batch_size=-1", "train.batch_size must be in [1, inf)"),
    ("log.eval_every=0", "log.eval_every must be in [1, inf)"),
    ("log.eval_tokens=0", "log.eval_tokens must be in [1, inf)"),
    ("log.log_every=0", "log.log_every must be in [1, inf)"),
    ("recipe_overrides={\"fprop_x.prescale\": Infinity}", "prescale must be a positive finite number"),
    # finite as a Python float, infinite or zero in float32, the type it is used in (issue #47, 7)
    ("recipe.fprop_x.prescale=1e300", "prescale must be a normal float32 number"),
    ("recipe.wgrad_x.prescale=1e-300", "prescale must be a normal float32 number"),
    ("recipe.fprop_x.prescale=1e-30 recipe.fprop_w.prescale=1e-30",   # (each alone rounds MXFP4 to nothing)
     "fprop_x.prescale=1e-30: prescale 1e-30 is too small for mxfp4 (scale rule floor)"),
    ("recipe.fprop_x.prescale=1e30", "prescale 1e+30 is too large for mxfp4 (scale rule floor)"),
    ("optim.lr=1e-50", "optim.lr 1e-50 is zero or subnormal in float32"),
    ("optim.eps=1e-46", "optim.eps 1e-46 is zero or subnormal in float32"),
    ("optim.grad_clip=1e-40", "optim.grad_clip 1e-40 is subnormal or zero in float32"),
    ("model.rope_theta=1e300", "model.rope_theta=1e+300 must be a positive number within float32's normal range"),
]


@pytest.mark.parametrize("item,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_one_clear_line(item, msg):
    cfg = experiments.get("debug")
    if item.startswith("recipe_overrides="):
        cfg.recipe_overrides = {"fprop_x.prescale": math.inf}
        with pytest.raises(UserError) as e:
            validate(cfg)
    else:
        with pytest.raises(UserError) as e:
            apply_overrides(cfg, item.split())
            validate(cfg)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_defaults_and_experiments_are_valid():
    for name in experiments.names():
        validate(experiments.get(name))


def test_model_vocab_size_pads_the_head_and_embedding():
    """``model.vocab_size`` sets the embedding and head rows (Llama 3.1's 128,256 with any tokenizer), padded to
    a multiple of 32; smaller than the data's vocabulary is refused in one line."""
    from mxtrain.train.trainer import _model_config
    cfg = experiments.get("debug")
    assert _model_config(cfg, 4000).vocab_size == 4000          # unset: the data's vocabulary, padded to 32
    assert _model_config(cfg, 4001).vocab_size == 4032
    apply_overrides(cfg, ["model.vocab_size=128256"])
    validate(cfg)
    assert _model_config(cfg, 4001).vocab_size == 128256        # a multiple of 32 already
    apply_overrides(cfg, ["model.vocab_size=5000"])
    assert _model_config(cfg, 4001).vocab_size == 5024
    with pytest.raises(UserError) as e:
        _model_config(cfg, 6000)
    assert "model.vocab_size=5,000 is smaller than the data's vocabulary (6,000 ids)" in str(e.value)
    assert "\n" not in str(e.value)


def test_rate_fields_are_per_gpu():
    """MFU divides the tokens/s of all ranks by the number of GPUs (each GPU's own rate over its peak)."""
    from mxtrain.train.trainer import rate_fields
    one = rate_fields(1000.0, 1e6, 1.0, 1)
    assert one == {"mfu": pytest.approx(1e-3)}
    two = rate_fields(2000.0, 1e6, 1.0, 2)   # twice the tokens on twice the GPUs: the same MFU
    assert two == {"tok_per_s_per_gpu": 1000.0, "mfu": pytest.approx(1e-3)}
    assert rate_fields(2000.0, 1e6, None, 2) == {"tok_per_s_per_gpu": 1000.0}


def test_checkpoint_from_before_a_new_model_key_still_resumes():
    """A checkpoint whose config predates ``model.vocab_size`` matches a config that leaves it unset, and not
    one that sets it."""
    import copy
    from mxtrain.train import checkpoint as ckpt
    now = experiments.get("debug").to_dict()
    saved = copy.deepcopy(now)
    del saved["model"]["vocab_size"]
    ckpt.check_compatible(saved, now, "old.pt")
    changed = copy.deepcopy(now)
    changed["model"]["vocab_size"] = 5024
    with pytest.raises(UserError, match=r"does not match this config: model.vocab_size \(None in checkpoint, 5024 "
                                        r"now\)$"):   # the field that differs, not only its section
        ckpt.check_compatible(saved, changed, "old.pt")
