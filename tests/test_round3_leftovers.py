"""Issue #47, third round, leftovers of the helper's sweep: each case answered the same way by every command that
takes it, or refused in one line (cases run in this process through ``cli.main``, no training).

Found (each case: command, what happened before the fix):
* ``study --config F --set model.name=30m`` with ``[model] dim = 576`` in F: 30m 576 wide, silently, where
  ``train --config F --set model.name=30m`` refuses (the size named by ``--set`` drops the file's shape, as
  ``--model`` does; the study refused ``--model 30m`` only).
* ``study --set train.init_from=HF --set model.dim=64`` (or ``--model 30m``, ``[study] model``, a study file's
  ``[model]`` table): accepted, and every run trained the folder's shape, ignoring them, where ``train`` refuses
  a size or shape key with ``--init-from``.
"""

import pytest

from mxtrain.cli.core import build_config, make_parser
from train_helpers import one_line_error, run_main


# -- 1. a model size named by --set model.name over a config file's shape ----------------------------------------

def _study_model(tmp_path, *argv) -> dict:
    from mxtrain.cli.study import apply_study_file
    from mxtrain.study.plan import StudySpec, build_config as run_config
    argv = ["study", "--arms", "bf16", *argv]
    args = make_parser(argv).parse_args(argv)
    if args.config:
        apply_study_file(args, args.config)
    cfg = run_config(StudySpec.from_args(args), "bf16", 0, tmp_path / "r")
    return {k: v for k, v in cfg.to_dict()["model"].items() if v is not None and k != "init_seed"}


@pytest.mark.parametrize("table", ["[model]\ndim = 576\n", "[model]\nname = '125m'\ndim = 576\n",
                                   "[study]\noverrides = ['model.dim=576']\n"])
def test_set_model_name_over_a_files_shape_is_refused_by_study_as_by_train(tmp_path, table):
    s, t = tmp_path / "s.toml", tmp_path / "t.toml"
    s.write_text(("[study]\narms = ['bf16']\n" + table).replace("\n[study]\n", "\n"))
    t.write_text(table.replace("[study]\noverrides = ['model.dim=576']", "[model]\ndim = 576"))
    out = str(tmp_path / "st")
    one_line_error(run_main("train", "--config", str(t), "--set", "model.name=30m", "--print-config"),
                   "--set model.name=30m names a model size, and the config file", "add --set model.dim=576")
    one_line_error(run_main("study", "--config", str(s), "--set", "model.name=30m", "--dry-run", "--out", out),
                   "--set model.name=30m names a model size, and the study file", "add --set model.dim=576")
    assert not (tmp_path / "st").exists()
    # kept when the --set repeats it: the same model in both
    argv = ("--set", "model.name=30m", "--set", "model.dim=576")
    train = build_config(make_parser(["train", "--config", str(t), *argv]).parse_args(["train", "--config", str(t),
                                                                                          *argv]))
    assert _study_model(tmp_path, "--config", str(s), *argv) == {"name": "30m", "dim": 576} == \
        {k: v for k, v in train.to_dict()["model"].items() if v is not None}


def test_study_refuses_a_shape_given_with_init_from_as_train_does(tmp_path):
    """--init-from (train.init_from) takes the model's shape from the folder: a size or shape key the user gave
    would be ignored by every run of the study, so it is refused before anything is written; a preset's shape
    gives way to the folder's, as an experiment's does in train."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    out = str(tmp_path / "st")
    init = ("--set", f"train.init_from={hf}")
    one_line_error(run_main("train", "--init-from", str(hf), "--set", "model.dim=64", "--print-config"),
                   "--set model.dim=64 cannot be combined with --init-from")
    one_line_error(run_main("study", "--arms", "bf16", *init, "--set", "model.dim=64", "--dry-run", "--out", out),
                   "--set model.dim=64 cannot be combined with --init-from", "remove model.dim")
    one_line_error(run_main("study", "--arms", "bf16", *init, "--model", "30m", "--dry-run", "--out", out),
                   "--model 30m cannot be combined with --init-from", "remove model.name")
    f = tmp_path / "s.toml"
    f.write_text(f"[study]\narms = ['bf16']\nmodel = '30m'\n[train]\ninit_from = '{hf}'\n")
    one_line_error(run_main("study", "--config", str(f), "--dry-run", "--out", out),
                   f"[study] model = '30m' (study file {f}) cannot be combined with --init-from")
    f.write_text(f"[study]\narms = ['bf16']\n[train]\ninit_from = '{hf}'\n[model]\nn_layers = 3\n")
    one_line_error(run_main("study", "--config", str(f), "--dry-run", "--out", out),
                   f"model.n_layers=3 (study file {f}) cannot be combined with --init-from")
    assert not (tmp_path / "st").exists()
    for argv in ((), ("--preset", "smoke")):   # no shape of the user's: fine
        p = run_main("study", "--arms", "bf16", *init, *argv, "--dry-run", "--out", out)
        assert p.returncode == 0, p.stderr
