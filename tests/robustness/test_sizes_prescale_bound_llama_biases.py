"""Leftovers of issues #47 and #48: a named model size with explicit shape fields, an operand prescale that
overflows its format, Markdown specials in report.md names, Llama checkpoints with attention/MLP biases."""

import json

import pytest

from mxtrain.cli.core import build_config, make_parser
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

    from mxtrain.numerics.formats import get_format
    from mxtrain.numerics.quant import mx_scale_exponent
    from mxtrain.numerics.recipe import _largest_prescale
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
    import mxtrain.numerics.recipes as R
    from mxtrain.numerics.recipe import Operand
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
    with pytest.raises(ValueError, match="no effect on a bf16 operand"):   # not quantized: it would be ignored
        Operand("bf16", prescale=1e30)
    t = R.get("tseng")
    assert t.with_(**{"dgrad_dy.prescale": 1.25}).dgrad_dy.prescale == 1.25


def test_large_prescale_in_a_config_files_recipe_table(tmp_path):
    import mxtrain.numerics.recipes as R
    d = R.get("mxfp4-all-dh16").to_dict()
    d["fprop_w"]["prescale"] = 8.0
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"recipe": d}))
    one_line_error(run_main("train", "--config", str(f), "--print-config"), "prescale 8 is too large for mxfp4")
    f.write_text(json.dumps({"recipe_overrides": {"dgrad_w.prescale": 1e6}}))
    one_line_error(run_main("train", "--config", str(f), "--print-config"), "dgrad_w.prescale=1000000.0")


# -- 4. Llama checkpoints with attention_bias / mlp_bias (#48, 1) --------------------------------------------------

def _make_llama(folder, vocab=100, **kw):
    """A transformers LlamaForCausalLM with every weight random (biases and norms too), saved to ``folder``."""
    transformers = pytest.importorskip("transformers")
    from test_hf_mistral_qwen2 import SHAPES, randomize_and_save
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, **{**SHAPES, **kw}))
    return randomize_and_save(model, folder)


@pytest.mark.parametrize("bias", [dict(attention_bias=True), dict(mlp_bias=True),
                                  dict(attention_bias=True, mlp_bias=True)], ids=["attention", "mlp", "both"])
def test_llama_with_biases_loads_with_transformers_logits_and_exports_back(bias, tmp_path):
    """These folders were refused ("mxtrain's model has biases on q/k/v only"); now their biases load, the logits
    equal transformers' in float32, and the export round trip gives the same Llama back."""
    import torch
    transformers = pytest.importorskip("transformers")
    from mxtrain.model.hf_io import config_from_hf, hf_config, hf_name, load_hf_llama, save_safetensors
    from mxtrain.model.llama import Llama
    hf = _make_llama(tmp_path / "hf", **bias)
    mc = config_from_hf(tmp_path / "hf", vocab_multiple=32)
    att, mlp = bias.get("attention_bias", False), bias.get("mlp_bias", False)
    assert (mc.attention_bias, mc.mlp_bias, mc.qkv_bias, mc.hf_model_type) == (att, mlp, False, "llama")
    model = Llama(mc)
    assert model.num_params() == mc.num_params()
    load_hf_llama(model, tmp_path / "hf")
    a, f = model.layers[1].attention, model.layers[1].feed_forward
    ha, hm = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    assert (a.wo.bias is not None, a.wq.bias is not None, f.w2.bias is not None) == (att, att, mlp)
    if att:
        assert torch.equal(a.wo.bias, ha.o_proj.bias) and torch.equal(a.wk.bias, ha.k_proj.bias)
    if mlp:
        assert torch.equal(f.w1.bias, hm.gate_proj.bias) and torch.equal(f.w2.bias, hm.down_proj.bias)
    x = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(x).logits
        torch.testing.assert_close(model(x)[..., :100], theirs, atol=1e-5, rtol=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(mc, None)))
    save_safetensors(out / "model.safetensors", {hf_name(k): v for k, v in model.state_dict().items()})
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back).__name__ == "LlamaForCausalLM"
    assert (back.config.attention_bias, back.config.mlp_bias) == (att, mlp)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits[..., :100], theirs, atol=1e-5, rtol=0)
    again = config_from_hf(out)
    assert (again.attention_bias, again.mlp_bias) == (att, mlp)


def test_llama_bias_mismatches_and_foreign_bias_fields_are_one_line(tmp_path):
    from dataclasses import replace

    from mxtrain.model.hf_io import config_from_hf, load_hf_llama
    from mxtrain.model.llama import Llama, ModelConfig
    _make_llama(tmp_path / "hf", attention_bias=True)
    plain = replace(config_from_hf(tmp_path / "hf", vocab_multiple=32), attention_bias=False)
    with pytest.raises(UserError, match="attention_bias False here, attention_bias True in the Hugging Face"):
        load_hf_llama(Llama(plain), tmp_path / "hf")
    with pytest.raises(UserError, match="mlp_bias is a Llama config's field"):
        ModelConfig(qkv_bias=True, hf_model_type="qwen2", mlp_bias=True)
    q = tmp_path / "q"
    q.mkdir()
    (q / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
                                               "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 64,
                                               "mlp_bias": True}))
    with pytest.raises(UserError, match="mlp_bias true \\(a Llama config's field"):
        config_from_hf(q)


def test_llama_with_biases_trains_from_init_and_exports_as_a_llama(tmp_path):
    """--init-from such a folder: the MX layers keep every bias (none weight-decayed), the checkpoint holds them,
    and the exported folder is a Llama with both bias fields that transformers runs with mxtrain's logits."""
    import torch
    transformers = pytest.importorskip("transformers")
    from mxtrain.interop.export import export_hf, load_run
    from mxtrain.train import checkpoint as ckpt
    from mxtrain.train import train
    from mxtrain.train.callbacks import Callback
    from train_helpers import tiny_run_cfg
    _make_llama(tmp_path / "hf", vocab=512, attention_bias=True, mlp_bias=True)

    class Look(Callback):
        def on_train_begin(self, state):
            from mxtrain.train import parallel as D
            m = D.unwrap(state.model)
            self.kinds = {type(m.layers[0].attention.wo).__name__, type(m.layers[0].feed_forward.w2).__name__}
            decay = {id(p) for g in state.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
            self.decayed = {n for n, p in m.named_parameters() if id(p) in decay}

    look = Look()
    cfg = tiny_run_cfg(tmp_path / "run", 1)
    cfg.train.init_from = str(tmp_path / "hf")
    run = train(cfg, callbacks=[look])
    assert all(k.startswith("MX") for k in look.kinds), look.kinds
    assert not any(n.endswith("bias") for n in look.decayed)
    state = ckpt.load(run)
    assert state["model_config"]["attention_bias"] is True and state["model_config"]["mlp_bias"] is True
    assert "layers.1.feed_forward.w3.bias" in state["model"] and "layers.1.attention.wo.bias" in state["model"]
    out = export_hf(run, tmp_path / "out", tokenizer=False)
    c = json.loads((out / "config.json").read_text())
    assert (c["model_type"], c["attention_bias"], c["mlp_bias"]) == ("llama", True, True)
    model, _ = load_run(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)
