"""Leftovers of issues #47 and #48: a named model size with explicit shape fields, an operand prescale that
overflows its format, Markdown specials in report.md names, Llama checkpoints with attention/MLP biases."""

import json

import pytest

from mxtrain.cli import build_config, make_parser
from mxtrain.errors import UserError
from mxtrain.train import experiments
from train_helpers import one_line_error, run_main


def _cfg(*argv):
    argv = ["train", *argv]
    return build_config(make_parser(argv).parse_args(argv))


def _model(cfg) -> dict:
    return {k: v for k, v in cfg.to_dict()["model"].items() if v is not None}


# -- 1. --model NAME with model shape fields (#47, 5) ---------------------------------------------------------

def test_named_size_replaces_the_experiments_shape():
    """`--exp debug --model 30m` gave the 30m name with debug's 64-wide, 2-layer shape (silently)."""
    assert experiments.get("debug").model.dim == 64
    assert _model(_cfg("--exp", "debug", "--model", "30m")) == {"name": "30m"}
    assert _model(_cfg("--exp", "debug", "--set", "model.name=tiny")) == {"name": "tiny"}
    assert _model(_cfg("--exp", "debug")) == {"name": "tiny", "dim": 64, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1}


def test_explicit_shape_fields_override_the_named_size_in_any_order():
    for argv in (("--model", "30m", "--set", "model.n_layers=3"), ("--set", "model.n_layers=3", "--model", "30m"),
                 ("--exp", "debug", "--set", "model.n_layers=3", "--set", "model.name=30m")):
        assert _model(_cfg(*argv)) == {"name": "30m", "n_layers": 3}, argv
    from mxtrain.train.trainer import _model_config
    mc = _model_config(_cfg("--exp", "debug", "--model", "30m", "--set", "model.n_layers=3"), 4096)
    assert (mc.dim, mc.n_layers, mc.n_heads) == (384, 3, 6)   # 30m's width and heads, the layers given


def test_config_file_model_table_naming_a_size(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('exp = "debug"\n[model]\nname = "30m"\nn_layers = 3\n')
    assert _model(_cfg("--config", str(f))) == {"name": "30m", "n_layers": 3}   # not debug's dim 64
    f.write_text('exp = "debug"\n[model]\nn_layers = 3\n')   # no name: the experiment's other fields stay
    assert _model(_cfg("--config", str(f)))["dim"] == 64


def test_flag_size_over_a_config_files_shape_is_refused_or_kept_when_asked(tmp_path):
    f = tmp_path / "m.yaml"
    f.write_text("model:\n  dim: 256\n  n_heads: 4\n")
    one_line_error(run_main("train", "--config", str(f), "--model", "30m", "--print-config"),
                   "--model 30m names a model size", "sets model.dim, model.n_heads", "--set model.dim=256")
    c = _cfg("--config", str(f), "--model", "30m", "--set", "model.dim=256", "--set", "model.n_heads=4")
    assert _model(c) == {"name": "30m", "dim": 256, "n_heads": 4}
    run = tmp_path / "run"   # a run folder's config.json: its null shape fields are not "set"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(experiments.get("tiny-main").to_dict()))
    assert _model(_cfg("--config", str(run), "--model", "30m")) == {"name": "30m"}


def test_contradictory_shape_is_one_line_naming_the_sizes_values():
    p = run_main("train", "--model", "30m", "--set", "model.dim=128", "--print-config")
    one_line_error(p, "model.dim=128 must be a multiple of model.n_heads=6", "named size '30m'",
                   "--set model.dim=128", "30m's model.n_heads=6")


def test_print_config_saves_what_the_run_trains():
    p = run_main("train", "--exp", "debug", "--model", "30m", "--set", "model.ffn_dim=512", "--print-config")
    assert p.returncode == 0, p.stderr
    assert _model_from_json(p.stdout) == {"name": "30m", "ffn_dim": 512}


def _model_from_json(text: str) -> dict:
    return {k: v for k, v in json.loads(text)["model"].items() if v is not None}


def test_shape_with_init_from_is_refused(tmp_path):
    """--init-from takes the shape from the folder: a size or shape field given with it was ignored."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert _cfg("--exp", "debug", "--init-from", str(hf)).train.init_from == str(hf)   # an experiment's: fine
    one_line_error(run_main("train", "--init-from", str(hf), "--model", "30m", "--print-config"),
                   "--model 30m cannot be combined with --init-from", "remove model.name")
    one_line_error(run_main("train", "--init-from", str(hf), "--set", "model.dim=64", "--print-config"),
                   "--set model.dim=64 cannot be combined with --init-from")
    f = tmp_path / "f.toml"
    f.write_text("[model]\nn_layers = 3\n")
    with pytest.raises(UserError, match="the config file's model.n_layers = 3 cannot be combined"):
        _cfg("--config", str(f), "--init-from", str(hf))


# -- 2. an operand prescale the format cannot hold (#47, 7) ------------------------------------------------------

RULES = ("floor", "ceil", "rceil", "even", "amd")


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "mxfp6_e3m2"])
def test_prescale_bound_is_where_every_block_saturates(fmt):
    """Above the bound every block's largest value lands past the format's largest element (the prescale is
    applied after the scale is chosen); just below it some block still fits, so nothing sensible is refused."""
    import torch

    from mxtrain.formats import get_format
    from mxtrain.quant import mx_scale_exponent
    from mxtrain.recipe import _largest_prescale
    elem = get_format(fmt).elem
    g = torch.Generator().manual_seed(0)
    # block maxima over many binades and every significand (the edges of each rule's bump exactly)
    sig = torch.cat([torch.rand(20000, generator=g) + 1, torch.tensor([1.0, 1.5, 1.75, 1.875, 2 - 2 ** -20])])
    amax = sig * 2.0 ** torch.randint(-20, 20, sig.shape, generator=g).float()
    for rule in RULES:
        bound, _ = _largest_prescale(fmt, rule)
        m = amax * torch.pow(2.0, -mx_scale_exponent(amax, elem, rule).float())   # a block's scaled maximum
        assert bool((m * bound * (1 + 1e-6) > elem.max).all()), (fmt, rule)
        assert not bool((m * bound * (1 - 1e-3) > elem.max).all()), (fmt, rule)


def test_large_prescale_is_refused_in_one_line_and_valid_ones_keep_their_recipe():
    import mxtrain.recipes as R
    from mxtrain.recipe import Operand
    one_line_error(run_main("train", "--set", "recipe.fprop_x.prescale=1e30", "--print-config"),
                   "fprop_x.prescale=1e+30", "too large for mxfp4 (scale rule floor)", "largest element 6",
                   "at most 1.5")
    one_line_error(run_main("train", "--set", "recipe.wgrad_dy.prescale=2", "--print-config"), "at most 1.5")
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1.51):
        with pytest.raises(ValueError, match="prescale"):
            Operand("mxfp4", prescale=bad)
    for ok in (0.75, 1.0, 1.5):
        assert Operand("mxfp4", prescale=ok).prescale == ok
    assert Operand("mxfp4", scale_rule="ceil", prescale=2.9).prescale == 2.9   # ceil leaves a binade free
    assert Operand("bf16", prescale=1e30).prescale == 1e30    # not quantized: no format to overflow
    t = R.get("tseng")
    assert t.with_(**{"fprop_x.prescale": 1.25}).fprop_x.prescale == 1.25


def test_large_prescale_in_a_config_files_recipe_table(tmp_path):
    import mxtrain.recipes as R
    d = R.get("mxfp4-all-dh16").to_dict()
    d["fprop_w"]["prescale"] = 8.0
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"recipe": d}))
    one_line_error(run_main("train", "--config", str(f), "--print-config"), "prescale 8 is too large for mxfp4")
    f.write_text(json.dumps({"recipe_overrides": {"dgrad_w.prescale": 1e6}}))
    one_line_error(run_main("train", "--config", str(f), "--print-config"), "dgrad_w.prescale=1000000.0")
