"""Issue #47, third round, leftovers of the helper's sweep: each case answered the same way by every command that
takes it, or refused in one line (cases run in this process through ``cli.main``, no training).

Found (each case: command, what happened before the fix):
* ``study --config F --set model.name=30m`` with ``[model] dim = 576`` in F: 30m 576 wide, silently, where
  ``train --config F --set model.name=30m`` refuses (the size named by ``--set`` drops the file's shape, as
  ``--model`` does; the study refused ``--model 30m`` only).
* ``study --set train.init_from=HF --set model.dim=64`` (or ``--model 30m``, ``[study] model``, a study file's
  ``[model]`` table): accepted, and every run trained the folder's shape, ignoring them, where ``train`` refuses
  a size or shape key with ``--init-from``.
* ``train --recipe bf16 --set recipe.fprop_x.prescale=1e6`` (any prescale on an operand that is not quantized,
  ``tseng``'s bf16 Fprop included): accepted and ignored (nothing multiplies a bf16 operand, nothing divides its
  GEMM's output).
* ``--set recipe.fprop_x.prescale=3.5`` with per-tensor FP8 (``fp8``), ``=3`` with NVFP4: accepted, though the
  per-tensor scale puts the tensor's largest value at the format's largest element (any prescale above 1
  saturates it), and NVFP4's block maxima lie above 3 (above 2 saturates every block, four_over_six: above 3).
"""

import json

import pytest
import torch

from mxtrain.cli.core import build_config, make_parser
from train_helpers import study_model as _study_model, one_line_error, run_main


# -- 1. a model size named by --set model.name over a config file's shape ----------------------------------------

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
    (hf / "config.json").write_text(json.dumps(_TINY_LLAMA))
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
    from mxtrain.model.hf_io import config_from_hf
    n = config_from_hf(hf, vocab_multiple=32).num_params()
    for argv in ((), ("--preset", "smoke")):   # no shape of the user's: fine, and the plan counts the folder's model
        p = run_main("study", "--arms", "bf16", *init, *argv, "--dry-run", "--out", out)
        assert p.returncode == 0, p.stderr
        assert f"model: {n / 1e6:.1f} M parameters" in p.stdout, (n, p.stdout)


# a Llama folder's config.json (no weights: the dry run reads the shape only), 0.2 M parameters: no preset's size
_TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
               "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "hidden_act": "silu"}


# -- 2. prescales: none on an operand that is not quantized; the largest where every block saturates -------------

def test_a_prescale_on_an_operand_that_is_not_quantized_is_refused():
    import mxtrain.numerics.recipes as R
    from mxtrain.numerics.recipe import Operand
    for argv in (("--recipe", "bf16", "--set", "recipe.fprop_x.prescale=1e6"),
                 ("--recipe", "tseng", "--set", "recipe.fprop_w.prescale=0.75")):   # (tseng's Fprop is bf16)
        one_line_error(run_main("train", *argv, "--print-config"), "prescale=", "has no effect on a bf16 operand")
    with pytest.raises(ValueError, match="no effect on a bf16 operand"):
        Operand("bf16", prescale=2.0)
    t = R.get("tseng")
    # an operand made bf16 drops the prescale it inherited; one made quantized takes one, in either order
    assert t.with_(**{"dgrad_dy.fmt": "bf16"}).dgrad_dy == Operand("bf16", rounding="stochastic")
    for ch in ({"fprop_x.prescale": 0.75, "fprop_x.fmt": "mxfp4"}, {"fprop_x.fmt": "mxfp4", "fprop_x.prescale": 0.75}):
        assert t.with_(**ch).fprop_x == Operand("mxfp4", prescale=0.75)
    with pytest.raises(ValueError, match="dgrad_dy.prescale=0.5: prescale 0.5 has no effect"):
        t.with_(**{"dgrad_dy.fmt": "bf16", "dgrad_dy.prescale": 0.5})


def test_a_studys_prescale_applies_to_the_arms_that_quantize_the_operand(tmp_path):
    """Beside a bf16 baseline the prescale goes to the quantized arms (said in a line); with no such arm, refused."""
    from mxtrain.cli.study import apply_study_file  # noqa: F401  (the study's CLI module, as run_main uses it)
    from mxtrain.study.plan import StudySpec, build_config as run_config
    out = str(tmp_path / "st")
    argv = ["study", "--arms", "bf16,mxfp4-all", "--set", "recipe.fprop_x.prescale=0.75", "--dry-run", "--out", out]
    p = run_main(*argv)
    assert p.returncode == 0, p.stderr
    assert "recipe.fprop_x.prescale=0.75 applies to the arms that quantize fprop_x: not to bf16" in p.stdout
    spec = StudySpec.from_args(make_parser(argv).parse_args(argv))
    assert "fprop_x.prescale" not in run_config(spec, "bf16", 0, tmp_path / "r").recipe_overrides
    assert run_config(spec, "mxfp4-all", 0, tmp_path / "r").resolved_recipe().fprop_x.prescale == 0.75
    one_line_error(run_main("study", "--arms", "bf16,tseng", "--set", "recipe.fprop_x.prescale=0.75", "--dry-run",
                            "--out", out), "--set recipe.fprop_x.prescale=0.75: no arm quantizes fprop_x (bf16, tseng)")
    assert not (tmp_path / "st").exists()


def _landings(fmt, x, rule="floor"):
    """Each block's largest value as the quantizer's scale puts it, before the prescale (from the scales that
    ``quantize`` returns): per-tensor FP8 one number, NVFP4 one per block of 16."""
    from mxtrain.numerics.quant import quantize
    q = quantize(x, fmt, scale_rule=rule)
    if q.global_scale is None:   # per-tensor: x * m, scale = 1 / m
        return (x.abs().amax() / q.scales.double()).reshape(1)
    d = q.scales.double() * q.global_scale.double()
    amax = x.double().abs().reshape(*x.shape[:-1], -1, 16).amax(-1)
    ok = d > 0
    return (amax[ok] / d[ok]).flatten()


@pytest.mark.parametrize("fmt,rule", [("nvfp4", "floor"), ("nvfp4", "four_over_six"), ("fp8_e4m3", "floor"),
                                      ("fp8_e5m2", "floor")])
def test_largest_prescale_of_nvfp4_and_per_tensor_fp8_is_where_every_block_saturates(fmt, rule):
    """Above the bound (NVFP4: 2, with four_over_six 3; per-tensor FP8: 1) every block's largest value lands past
    the largest element; a little below it, one block still fits: a block whose E4M3 scale rounds up by almost
    2x among the subnormals (a block about 460,000x below the tensor's largest), or the tensor's largest value
    itself. Blocks at many other ratios to the tensor's largest besides."""
    from mxtrain.numerics.formats import get_format
    from mxtrain.numerics.recipe import Operand, _largest_prescale
    top = get_format(fmt).elem.max
    bound, _ = _largest_prescale(fmt, rule)
    assert bound == {"nvfp4": 3.0 if rule == "four_over_six" else 2.0}.get(fmt, 1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g) * 2.0 ** torch.randint(-30, 0, (512, 1), generator=g).float()
    x[0, 0] = 8.0                                          # the tensor's largest
    for i, k in enumerate((6.0, 4.0)):                     # E4M3 scale ratio just above 2**-10: rounds up to 2**-9
        x[1 + i] = 8.0 * (2.0 ** -10 * (1 + 2 ** -12)) * k / 6.0 / 448.0 * torch.linspace(1, 0.5, 16)
    land = _landings(fmt, x.reshape(1, -1), rule)
    assert bool((land * bound * (1 + 1e-6) > top).all()), (fmt, rule, land.min().item())
    assert bool((land * bound * (1 - 1e-3) <= top).any()), (fmt, rule, land.min().item())
    assert Operand(fmt, scale_rule=rule, prescale=bound).prescale == bound
    with pytest.raises(ValueError, match=f"at most {bound:g} "):
        Operand(fmt, scale_rule=rule, prescale=bound * (1 + 2 ** -20))
    one_line_error(run_main("train", "--recipe", "fp8", "--set", "recipe.fprop_x.prescale=3.5", "--print-config"),
                   "prescale 3.5 is too large for fp8_e4m3", "any prescale above 1 makes it overflow", "at most 1 ")
