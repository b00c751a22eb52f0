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
