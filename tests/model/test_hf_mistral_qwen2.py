"""Mistral and Qwen2 folders (``train.init_from`` / ``--init-from``, ``mxtrain export``): tiny random models
built by transformers from MistralConfig / Qwen2Config give the same float32 logits in mxtrain's Llama (Qwen2's
q/k/v biases are ``ModelConfig.qkv_bias``), go back out as the same model type, and a sliding window shorter
than the sequences is refused in one line. A Qwen2 run converts, checkpoints, resumes and exports its biases."""

import json

import pytest
import torch

from mxtrain.errors import UserError
from mxtrain.model.hf_io import config_from_hf, hf_config, llama_from_hf, load_hf_llama, save_safetensors
from mxtrain.interop.export import export_hf, load_run
from mxtrain.model.llama import Llama, ModelConfig
from mxtrain.train import checkpoint as ckpt

from train_helpers import tiny_run_cfg

transformers = pytest.importorskip("transformers")

SHAPES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _make(kind: str, folder, vocab: int = 100, **kw):
    """A transformers model of ``kind`` ('mistral' / 'qwen2') with every weight random (norms and biases too),
    saved to ``folder``."""
    if kind == "mistral":
        c = transformers.MistralConfig(vocab_size=vocab, **{**SHAPES, "sliding_window": None, **kw})
        model = transformers.MistralForCausalLM(c)
    else:
        c = transformers.Qwen2Config(vocab_size=vocab, **{**SHAPES, "use_sliding_window": False, **kw})
        model = transformers.Qwen2ForCausalLM(c)
    return randomize_and_save(model, folder)


def randomize_and_save(model, folder):
    """Every weight of ``model`` random (norms near 1, biases larger than weights, so that a bias left out shows),
    then saved to ``folder``; returns the model."""
    import torch
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if n.endswith("bias") else 0.1) * torch.randn(p.shape, generator=g))
    model.eval().save_pretrained(str(folder))
    return model


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_loads_with_transformers_logits_and_exports_as_the_same_type(kind, tmp_path):
    """(The Mistral's window, 64, covers the 64-token inputs exactly: one token less and transformers' logits
    differ by about 0.17.)"""
    hf = _make(kind, tmp_path / "hf", **({"sliding_window": 64} if kind == "mistral" else {}))
    mc = config_from_hf(tmp_path / "hf", vocab_multiple=32)
    assert (mc.hf_model_type, mc.qkv_bias, mc.vocab_size, mc.n_kv_heads) == (kind, kind == "qwen2", 128, 2)
    model = Llama(mc)
    assert model.num_params() == mc.num_params()
    rep = load_hf_llama(model, tmp_path / "hf")
    assert rep["padded_rows"] == 28
    if kind == "qwen2":   # biases on q, k, v only, loaded (not the init's zeros)
        a = model.layers[1].attention
        assert a.wq.bias.abs().sum() > 0 and a.wk.bias is not None and a.wo.bias is None
        assert torch.equal(a.wv.bias, hf.model.layers[1].self_attn.v_proj.bias)
    x = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(x)[..., :100], hf(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)

    # the export's config.json and weights: transformers loads the same model type, with the same logits
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(mc, None)))
    from mxtrain.model.hf_io import hf_name
    save_safetensors(out / "model.safetensors", {hf_name(k): v for k, v in model.state_dict().items()})
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert back.config.model_type == kind and type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits[..., :100], theirs, atol=1e-5, rtol=0)
    again = config_from_hf(out)
    assert (again.hf_model_type, again.qkv_bias, again.dim) == (kind, kind == "qwen2", 64)


def test_sliding_windows_shorter_than_the_sequences_are_refused(tmp_path):
    def write(name, **kw):
        d = tmp_path / name
        d.mkdir()
        base = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "vocab_size": 128, "max_position_embeddings": 64}
        (d / "config.json").write_text(json.dumps({**base, **kw}))
        return d

    # Mistral 7B v0.1's kind: a window below max_position_embeddings
    with pytest.raises(UserError, match=r"this Mistral uses .*sliding_window 16 below the longest sequence, 64"):
        config_from_hf(write("m16", model_type="mistral", sliding_window=16))
    assert config_from_hf(write("m64", model_type="mistral", sliding_window=64)).hf_model_type == "mistral"
    assert config_from_hf(write("mnull", model_type="mistral", sliding_window=None)).qkv_bias is False
    # ... but not one the training sequences outgrow
    with pytest.raises(UserError, match="sliding_window 64 below the longest sequence, 128"):
        config_from_hf(tmp_path / "m64", max_seq_len=128)
    # Qwen2: the window counts only with use_sliding_window
    q = config_from_hf(write("q", model_type="qwen2", use_sliding_window=False, sliding_window=16))
    assert (q.qkv_bias, q.hf_model_type) == (True, "qwen2")
    with pytest.raises(UserError, match="this Qwen2 uses .*sliding_window 16"):
        config_from_hf(write("qs", model_type="qwen2", use_sliding_window=True, sliding_window=16))
    for kw, frag in (({"use_sliding_window": "false"}, "use_sliding_window is \"false\""),
                     ({"sliding_window": "4096", "use_sliding_window": True}, "sliding_window is \"4096\""),
                     ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
                      "is not a Llama, Mistral, Qwen2 or Mixtral")):
        with pytest.raises(UserError, match=frag):
            config_from_hf(write(f"bad{len(list(tmp_path.iterdir()))}", **{"model_type": "qwen2", **kw}))
    # q/k/v biases are Qwen2's; a model without them does not take a Qwen2 folder's weights
    with pytest.raises(UserError, match="qkv_bias"):
        ModelConfig(qkv_bias=True)
    _make("qwen2", tmp_path / "hf")
    from dataclasses import replace
    plain = replace(config_from_hf(tmp_path / "hf", vocab_multiple=32), qkv_bias=False, hf_model_type="llama")
    with pytest.raises(UserError, match="qkv_bias False here, q/k/v biases True"):
        load_hf_llama(Llama(plain), tmp_path / "hf")
    _make("mistral", tmp_path / "win", sliding_window=16, max_position_embeddings=16)
    assert config_from_hf(tmp_path / "win").hf_model_type == "mistral"
    with pytest.raises(UserError, match="sliding_window 16 below the longest sequence, 32"):
        llama_from_hf(tmp_path / "win", max_seq_len=32)


def test_qwen2_run_converts_checkpoints_resumes_and_exports_its_biases(tmp_path):
    """--init-from a Qwen2 folder: the MX layers keep the biases (no weight decay on them, as on the norms),
    the checkpoint holds them, a resumed run continues from them, and the export is a Qwen2 that transformers
    loads with mxtrain's logits."""
    from mxtrain.train import train
    from mxtrain.train.callbacks import Callback
    _make("qwen2", tmp_path / "hf", vocab=512)

    class Look(Callback):
        def on_train_begin(self, state):
            from mxtrain.train import parallel as D
            m = D.unwrap(state.model)
            self.kind = type(m.layers[0].attention.wq).__name__
            self.bias0 = m.layers[0].attention.wk.bias.detach().clone()
            decay = {id(p) for g in state.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
            self.decayed = {n for n, p in m.named_parameters() if id(p) in decay}

    look = Look()
    cfg = tiny_run_cfg(tmp_path / "run", 1)
    cfg.train.init_from = str(tmp_path / "hf")
    run = train(cfg, callbacks=[look])
    assert look.kind.startswith("MX")
    assert "layers.0.attention.wq.weight" in look.decayed and not any(n.endswith("bias") for n in look.decayed)
    state = ckpt.load(run)
    assert state["model_config"]["qkv_bias"] is True and state["model_config"]["hf_model_type"] == "qwen2"
    b1 = state["model"]["layers.0.attention.wk.bias"]
    assert not torch.equal(b1, look.bias0)                    # trained
    cfg2 = tiny_run_cfg(tmp_path / "run", 2)
    cfg2.train.init_from = str(tmp_path / "hf")
    run2 = train(cfg2, resume=run)
    assert ckpt.load(run2)["step"] == 2

    out = export_hf(run2, tmp_path / "out", tokenizer=False)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    model, _ = load_run(run2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)
