"""Export to Hugging Face and back (mxtrain.interop.export): a tiny CPU run with grouped-query attention is exported,
loaded by transformers offline and gives the same logits; a Llama built by transformers from a small
LlamaConfig loads into mxtrain with the same logits; bad run folders, models and configs are refused in
one line."""

import argparse
import json
import shutil
import subprocess
import sys

import pytest
import torch

from mxtrain.cli import hf as hfcli
from mxtrain.errors import UserError
from mxtrain.model.hf_io import (config_from_hf, hf_config, hf_name, llama_from_hf, load_hf_llama, load_safetensors, save_safetensors)
from mxtrain.interop.export import export_hf, load_run, run_tokenizer
from mxtrain.model.llama import Llama
from mxtrain.train import checkpoint as ckpt

from train_helpers import ROOT, one_line_error, run_cli, small_data, tiny_run_cfg

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step mxfp4-all run of the debug model (2 layers, 2 query heads sharing 1 key/value head)."""
    from mxtrain.train import train
    return train(tiny_run_cfg(tmp_path_factory.mktemp("hf") / "run", 2))


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="mxtrain")
    sub = parser.add_subparsers(dest="cmd")
    hfcli.add_parsers(sub)
    return parser.parse_args(list(argv))


def _hf_logits(folder, x):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert hf.dtype == torch.float32
    with torch.no_grad():
        return hf(x).logits, hf


def test_export_loads_in_transformers_with_the_same_logits(run, tmp_path):
    out = export_hf(run, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "mxtrain_export.json"} <= names
    model, info = load_run(run)
    c = model.cfg
    assert c.n_kv_heads < c.n_heads                       # the run uses GQA
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["num_hidden_layers"], cfg["vocab_size"], cfg["rms_norm_eps"], cfg["tie_word_embeddings"],
            cfg["max_position_embeddings"]) == (c.dim, c.hidden_dim, c.n_heads, c.n_kv_heads, c.n_layers,
                                                 c.vocab_size, c.norm_eps, c.tie_embeddings, c.max_seq_len)
    assert cfg["rope_parameters"]["rope_theta"] == c.rope_theta
    eot = json.loads((small_data() / "meta.json").read_text())["eot_id"]
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == eot

    x = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x)
    theirs, hf = _hf_logits(out, x)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert hf.config.rope_parameters["rope_theta"] == c.rope_theta

    # the file is a real safetensors file: the reference reader gives the same tensors
    from safetensors.torch import load_file
    ref = load_file(str(out / "model.safetensors"))
    mine, _ = load_safetensors(out / "model.safetensors")
    assert set(ref) == set(mine) and all(torch.equal(ref[k], mine[k]) for k in ref)
    assert torch.equal(ref[hf_name("layers.1.attention.wk.weight")], model.layers[1].attention.wk.weight)

    # the tokenizer: transformers' AutoTokenizer encodes as the run's tokenizer does
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    run_tok, _ = run_tokenizer(info)
    text = "The quick brown fox jumps over the lazy dog."
    assert tok(text).input_ids == run_tok.encode_batch([text])[0]
    assert tok.eos_token_id == eot
    meta = json.loads((out / "mxtrain_export.json").read_text())
    assert meta["step"] == 2 and meta["recipe"] == "mxfp4-all"


def test_export_then_load_back_gives_identical_logits(run, tmp_path):
    out = export_hf(run, tmp_path / "hf")
    model, _ = load_run(run)
    back_cfg = config_from_hf(out)
    for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size", "rope_theta", "norm_eps",
              "tie_embeddings"):
        assert getattr(back_cfg, f) == getattr(model.cfg, f), f
    fresh = Llama(back_cfg)
    assert load_hf_llama(fresh, out)["padded_rows"] == 0
    x = torch.randint(0, back_cfg.vocab_size, (2, 20))
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
    # the one-call form the trainer uses for train.init_from
    built = llama_from_hf(out, vocab_size=model.cfg.vocab_size, max_seq_len=64)
    with torch.no_grad():
        assert torch.equal(built(x), model(x))
    # bfloat16 export: the weights rounded once, the config says so
    out16 = export_hf(run, tmp_path / "hf16", dtype="bfloat16")
    t, _ = load_safetensors(out16 / "model.safetensors")
    assert t["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"


def _randomize(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim == 1 else 0.1) + (1.0 if p.ndim == 1 else 0))


@pytest.mark.parametrize("tie", [False, True])
def test_transformers_llama_loads_into_mxtrain(tmp_path, tie):
    """A Llama made by transformers from a small LlamaConfig (no download; every weight random, norms too):
    same logits in mxtrain, its vocab 100 padded to 128 with zero rows."""
    c = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = transformers.LlamaForCausalLM(c).eval()
    _randomize(hf)
    hf.save_pretrained(str(tmp_path / "hf"))
    mc = config_from_hf(tmp_path / "hf", vocab_multiple=32)
    assert (mc.vocab_size, mc.norm_eps, mc.rope_theta, mc.n_kv_heads, mc.tie_embeddings) == (128, 1e-6, 10000.0, 2, tie)
    model = Llama(mc)
    rep = load_hf_llama(model, tmp_path / "hf")
    assert rep["hf_vocab"] == 100 and rep["padded_rows"] == 28
    assert model.lm_head.weight[100:].abs().sum() == 0
    x = torch.randint(0, 100, (3, 19))
    with torch.no_grad():
        ours, theirs = model(x)[..., :100], hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def test_config_from_hf_reads_older_configs_and_refuses_what_mxtrain_cannot_compute(tmp_path):
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 250000.0, "rope_scaling": None, "max_position_embeddings": 128}

    def write(**kw):
        d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **kw}))
        return d

    mc = config_from_hf(write())   # transformers 4 style: rope_theta at the top
    assert (mc.rope_theta, mc.n_kv_heads, mc.ffn_dim, mc.max_seq_len) == (250000.0, 1, 96, 128)
    for kw, frag in (({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3' without"),
                     ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "RoPE scaling 'yarn'"),
                     ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1,
                                        "high_freq_factor": 4, "original_max_position_embeddings": 64}},
                      'rope_scaling.factor is "8", expected a positive finite number'),
                     ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "is not a Llama"),
                     ({"model_type": "qwen2", "attention_bias": True}, "attention_bias true"),   # (a Llama's: loads)
                     ({"hidden_act": "gelu"}, "hidden_act"),
                     ({"head_dim": 32}, "head_dim 32")):
        with pytest.raises(UserError, match=frag):
            config_from_hf(write(**kw))
    with pytest.raises(UserError, match="no readable config.json"):
        config_from_hf(tmp_path)
    with pytest.raises(UserError, match="not found"):
        config_from_hf(tmp_path / "nope")


def test_config_from_hf_checks_each_field_by_type(tmp_path):
    """Issue #47, 6: a string "false" tied the embeddings (and skipped the folder's lm_head.weight) with exit 0;
    strings and nulls in number fields were tracebacks. Each is one line naming the field, value and type."""
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": None, "head_dim": None, "vocab_size": 256}

    def write(**kw):
        d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **kw}))
        return d

    mc = config_from_hf(write(tie_word_embeddings=True, rope_parameters=None))   # nulls where HF allows them
    assert (mc.tie_embeddings, mc.n_kv_heads) == (True, 4)
    for kw, msg in (({"tie_word_embeddings": "false"}, 'tie_word_embeddings is "false", expected true or false'),
                    ({"tie_word_embeddings": 0}, "tie_word_embeddings is 0, expected true or false"),
                    ({"attention_bias": "false"}, 'attention_bias is "false", expected true or false'),
                    ({"rms_norm_eps": None}, "rms_norm_eps is null, expected a positive finite number"),
                    ({"rope_theta": "1e4"}, 'rope_theta is "1e4", expected a positive finite number'),
                    ({"initializer_range": [0.02]}, "initializer_range is [0.02], expected a finite number"),
                    ({"hidden_size": "64"}, 'hidden_size is "64", expected a positive integer'),
                    ({"vocab_size": None}, "vocab_size is null, expected a positive integer"),
                    ({"num_attention_heads": 0}, "num_attention_heads is 0, expected a positive integer"),
                    ({"num_key_value_heads": 1.5}, "num_key_value_heads is 1.5, expected a positive integer or null"),
                    ({"max_position_embeddings": "2k"}, 'max_position_embeddings is "2k", expected a positive'),
                    ({"hidden_act": None}, "hidden_act is null, expected a string"),
                    ({"model_type": ["llama"]}, 'model_type is ["llama"], expected a string or null'),
                    ({"architectures": "LlamaForCausalLM"}, "architectures is \"LlamaForCausalLM\", expected a list"),
                    ({"rope_scaling": "llama3"}, 'rope_scaling is "llama3", expected an object or null'),
                    ({"rope_parameters": {"rope_theta": None}}, "rope_parameters.rope_theta is null, expected a "),
                    ({"rope_parameters": {"rope_type": 3}}, "rope_parameters.rope_type is 3, expected a string"),
                    # a number of the right type that float32, where it is used, makes inf or 0 (issue #47, 7)
                    ({"rope_theta": 1e300}, "model.rope_theta=1e+300 must be a positive number within float32's"),
                    ({"rms_norm_eps": 1e-50}, "model.norm_eps=1e-50 must be a positive number within float32's")):
        with pytest.raises(UserError) as e:
            config_from_hf(write(**kw))
        assert msg in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    with pytest.raises(UserError, match=r"config.json: tie_word_embeddings is \"no\", .*; rms_norm_eps is \"x\""):
        config_from_hf(write(tie_word_embeddings="no", rms_norm_eps="x"))   # every bad field in the one line


def test_load_hf_llama_refuses_mismatches(run, tmp_path):
    out = export_hf(run, tmp_path / "hf")
    c = config_from_hf(out)
    from dataclasses import replace
    other = Llama(replace(c, dim=2 * c.dim, n_heads=2 * c.n_heads, n_kv_heads=2 * c.n_kv_heads, rope_theta=1e4))
    with pytest.raises(UserError) as e:
        load_hf_llama(other, out)
    assert "dim 128 here, hidden_size 64" in str(e.value) and "rope_theta" in str(e.value)
    # a tensor missing from the file, a tensor of the wrong shape, a tensor the model does not have
    t, _ = load_safetensors(out / "model.safetensors")
    t = {k: v.clone() for k, v in t.items()}
    for change, frag in ((lambda d: d.pop("model.norm.weight"), "missing weights model.norm.weight"),
                         (lambda d: d.__setitem__("model.norm.weight", torch.ones(3)), "has shape [3]"),
                         (lambda d: d.__setitem__("model.extra.bias", torch.ones(3)), "model.extra.bias")):
        bad = {k: v.clone() for k, v in t.items()}
        change(bad)
        save_safetensors(out / "model.safetensors", bad)
        with pytest.raises(UserError, match=frag.replace("[", r"\[").replace("]", r"\]")):
            load_hf_llama(Llama(c), out)
    (out / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(UserError, match="not a safetensors file"):
        load_hf_llama(Llama(c), out)
    with pytest.raises(UserError, match="training data's vocab"):
        llama_from_hf(out, vocab_size=c.vocab_size + 64)


def test_export_refuses_run_folders_without_a_llama_checkpoint(run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(UserError, match="holds no checkpoint"):
        export_hf(empty, tmp_path / "o1")
    with pytest.raises(UserError, match="run folder not found"):
        export_hf(tmp_path / "missing", tmp_path / "o1")
    with pytest.raises(UserError, match="holds the checkpoint of step 2, not of step 5"):
        export_hf(run, tmp_path / "o1", step=5)
    # a checkpoint whose model is not mxtrain's Llama
    st = ckpt.load(run)
    st.pop("model_config", None)   # (an older checkpoint: the config's model section decides the shapes)
    st["model"] = {"transformer.h.0.attn.c_attn.weight": torch.zeros(4, 4), "embed_tokens.weight": torch.zeros(32, 4)}
    alien = tmp_path / "alien"
    alien.mkdir()
    ckpt.save(alien / ckpt.NAME, {k: v for k, v in st.items() if k != "format"})
    with pytest.raises(UserError, match="does not hold an mxtrain Llama"):
        export_hf(alien, tmp_path / "o2")
    st["config"]["model"]["name"] = "gpt2"
    ckpt.save(alien / ckpt.NAME, {k: v for k, v in st.items() if k != "format"})
    with pytest.raises(UserError, match="not one of mxtrain's Llama sizes"):
        export_hf(alien, tmp_path / "o2")
    # a non-empty output folder, unless it is an earlier export and --force is given
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_hf(run, busy)
    with pytest.raises(UserError, match="notes.txt"):
        export_hf(run, busy, force=True)
    assert (busy / "notes.txt").read_text() == "mine"
    again = export_hf(run, tmp_path / "again")
    export_hf(run, again, force=True)
    assert not list(tmp_path.glob(".again.*"))          # no temporary folder left behind


def test_export_takes_the_model_shapes_a_checkpoint_records(run, tmp_path):
    """Shapes no tensor shows (norm epsilon, RoPE base): a checkpoint's own ``model_config`` wins; a run started
    from a Hugging Face folder (train.init_from) without one takes that folder's."""
    from dataclasses import replace
    model, _ = load_run(run)
    st = {k: v for k, v in ckpt.load(run).items() if k not in ("format", "model_config")}
    rec = tmp_path / "rec"
    rec.mkdir()
    ckpt.save(rec / ckpt.NAME, {**st, "model_config": replace(model.cfg, norm_eps=1e-6).to_dict()})
    assert json.loads((export_hf(rec, tmp_path / "o1") / "config.json").read_text())["rms_norm_eps"] == 1e-6
    hf_dir = export_hf(run, tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6, "rope_theta": 1e4,
                                                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}))
    st["config"]["train"]["init_from"] = str(hf_dir)
    ckpt.save(rec / ckpt.NAME, st)
    c = load_run(rec)[1].model_config
    assert (c.norm_eps, c.rope_theta, c.vocab_size, c.dim) == (1e-6, 1e4, model.cfg.vocab_size, model.cfg.dim)
    shutil.rmtree(hf_dir)
    with pytest.raises(UserError, match="which is gone"):
        load_run(rec)


def test_export_without_the_tokenizer_warns_and_exports_the_model(run, tmp_path, monkeypatch, capsys):
    import mxtrain.interop.export as H
    monkeypatch.setattr(H, "_data_dir", lambda run_dir, cfg: None)
    out = export_hf(run, tmp_path / "hf")
    err = capsys.readouterr().err
    assert "mxtrain: warning: exported the model without a tokenizer" in err
    assert "end-of-text id is unknown" in err
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] is None
    x = torch.randint(0, 64, (1, 8))
    model, _ = load_run(run)
    with torch.no_grad():
        assert (_hf_logits(out, x)[0] - model(x)).abs().max() < 1e-5


def test_export_from_a_distributed_checkpoint(run, tmp_path):
    """A multi-process run's checkpoint.dcp folder exports the same weights as checkpoint.pt."""
    from mxtrain.train import parallel as D
    dcp_run = tmp_path / "dcp"
    shutil.copytree(run, dcp_run, ignore=shutil.ignore_patterns(".lock"))
    model, _ = load_run(run)
    st = ckpt.load(dcp_run)
    rest = {k: v for k, v in st.items() if k not in ("model", "optimizer", "format")}
    D.save_checkpoint(dcp_run / D.DCP_NAME, model, None, extra=rest)
    (dcp_run / ckpt.NAME).unlink()
    a = load_safetensors(export_hf(run, tmp_path / "a") / "model.safetensors")[0]
    b = load_safetensors(export_hf(dcp_run, tmp_path / "b") / "model.safetensors")[0]
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_export(run, tmp_path, capsys):
    args = _parse("export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"), "--step", "2")
    assert args.func(args) == 0
    assert "exported step 2" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # bad input: one line, non-zero exit, no traceback (hfcli's own entry point, as mxtrain's main handles it)
    env_cmd = [sys.executable, "-m", "mxtrain.cli.hf"]
    p = subprocess.run(env_cmd + ["export", str(tmp_path), "--out", str(tmp_path / "x")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    one_line_error(p, "holds no checkpoint")
    p = subprocess.run(env_cmd + ["export", str(run), "--format", "gguf", "--out", str(tmp_path / "x")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    one_line_error(p, "--format 'gguf' is not supported")


def test_two_exports_to_one_new_folder_never_replace_each_other(run, tmp_path, monkeypatch):
    """Issue #47, 8: two exports started at once to one new --out both passed the check for an existing folder,
    and the second to finish replaced the first without --force. The output's lock is taken first: a second
    export while this one reads the checkpoint is refused at once, naming this one's pid, before it reads
    anything. A folder another command puts at --out meanwhile is not replaced either. No lock file, no
    temporary folder and no parent folder made for a failed export is left."""
    import os

    import mxtrain.interop.export as H
    out, real, loads, first = tmp_path / "hf", H.load_run, [], []

    def load_run_while_another_export_starts(*a, **k):
        loads.append(a[0])
        with pytest.raises(UserError, match=rf"^output folder {out} is being written by another mxtrain export "
                                            rf"\(pid {os.getpid()}\); wait for it"):
            export_hf(run, out)
        return real(*a, **k)

    monkeypatch.setattr(H, "load_run", load_run_while_another_export_starts)
    assert export_hf(run, out) == out and len(loads) == 1   # (the second never read the checkpoint)
    first.append(os.stat(out).st_ino)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]   # no lock file left

    other = tmp_path / "other"
    other.mkdir()

    def load_run_while_another_command_writes(*a, **k):   # (a folder moved in by hand, say)
        os.rename(out, other / "hf")
        return real(*a, **k)

    monkeypatch.setattr(H, "load_run", load_run_while_another_command_writes)
    with pytest.raises(UserError, match=f"output folder {other / 'hf'} was written by another command while this "
                                        f"export ran; nothing replaced"):
        export_hf(run, other / "hf")
    assert os.stat(other / "hf").st_ino == first[0] and (other / "hf" / "model.safetensors").is_file()
    assert sorted(p.name for p in other.iterdir()) == ["hf"]   # no temporary folder, no lock file
    monkeypatch.setattr(H, "load_run", real)
    assert export_hf(run, other / "hf", force=True) == other / "hf" and os.stat(other / "hf").st_ino != first[0]
    with pytest.raises(UserError, match="run folder not found"):
        export_hf(tmp_path / "nope", tmp_path / "new" / "deeper" / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]   # the folders it made, removed again


def test_mxtrain_command_has_export_when_wired(run, tmp_path):
    p = run_cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert p.returncode == 0, p.stderr
    p = run_cli("export", str(tmp_path), "--out", str(tmp_path / "x"))
    one_line_error(p, "holds no checkpoint")


def test_llama_3_1_rope_scaling_loads_with_transformers_logits_and_exports_back(tmp_path):
    """Llama 3.1/3.2's ``rope_type: "llama3"`` (the checkpoints people continue, as the AMD paper does): mxtrain's
    model gives transformers' logits in float32 on positions where all three bands of the scaling differ from
    plain RoPE, and its export writes the scaling back (a transformers model built from the export agrees)."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    c = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 rms_norm_eps=1e-6, rope_parameters=dict(rope))
    hf = transformers.LlamaForCausalLM(c).eval()
    _randomize(hf)
    hf.save_pretrained(str(tmp_path / "hf"))
    mc = config_from_hf(tmp_path / "hf")
    assert mc.rope_scaling == (8.0, 1.0, 4.0, 64.0)
    from mxtrain.model.llama import rope_tables
    plain, scaled = rope_tables(32, 8, 10000.0)[0], rope_tables(32, 8, 10000.0, scaling=mc.rope_scaling)[0]
    d = (plain != scaled).any(0)
    assert d.any() and not d.all()   # (the lowest frequencies scaled, the highest kept)
    model = Llama(mc)
    load_hf_llama(model, tmp_path / "hf")
    x = torch.randint(0, 96, (2, 100))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    # the plain RoPE gives other logits: the scaling is what makes them agree
    from dataclasses import replace
    other = Llama(replace(mc, rope_scaling=()))
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (other(x) - theirs).abs().max().item() > 1e-3
    cfg = hf_config(mc, None)
    assert cfg["rope_parameters"] == rope
    back = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                                                     if k not in ("architectures", "model_type")}))
    back.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert (back.eval()(x).logits - theirs).abs().max().item() < 1e-5
