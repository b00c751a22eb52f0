"""Mixture of experts to and from Hugging Face Mixtral (issue #48, 3): an mxtrain MoE run exports as a
``MixtralForCausalLM`` that plain transformers loads with mxtrain's float32 logits and whose loss over the run's
validation windows is the run's validation loss; a Mixtral built by transformers from a small MixtralConfig loads
into mxtrain (``--init-from``) with transformers' logits, trains, and exports back; what mxtrain's model does not
compute is refused in one line.

Tolerance of the logit comparisons: ``atol=1e-5, rtol=0`` on logits of size about 1. Both sides run the same
float32 operations in the same order (RMSNorm, RoPE, SDPA, the router's float32 softmax, top-k, renormalization,
transformers' expert loop), and on this CPU the logits are equal bit for bit; the slack (about 100 float32 ulps)
is for kernels that sum in another order (transformers' default ``grouped_mm`` experts, other SDPA backends).
A routing difference is far above it: one expert chosen differently, or top-k weights not renormalized, moves
logits by 1e-2 or more (checked below on the router)."""

import json

import pytest
import torch

from mxtrain.errors import UserError
from mxtrain.model.hf_io import (config_from_hf, hf_config, hf_state_dict, llama_from_hf, load_hf_llama, load_safetensors, save_safetensors)
from mxtrain.interop.export import export_hf, load_run
from mxtrain.model.llama import Llama, ModelConfig

from train_helpers import small_data, tiny_run_cfg

transformers = pytest.importorskip("transformers")

TOL = dict(atol=1e-5, rtol=0)   # (the module docstring says why)
SHAPES = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """2 steps of the debug model (2 layers, 2 query heads sharing 1 key/value head) with 4 experts a block, 2 a
    token; recipe bf16 (unquantized: float32 on the CPU), so that its validation loss is a float32 model's."""
    from mxtrain.train import train
    cfg = tiny_run_cfg(tmp_path_factory.mktemp("moe") / "run", 2)
    cfg.model.n_experts, cfg.recipe = 4, "bf16"
    return train(cfg)


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    return export_hf(run, tmp_path_factory.mktemp("moe-hf") / "hf")


def _mixtral(folder, vocab=100, save=True, **kw):
    """A transformers Mixtral with every weight random (norms near 1), saved to ``folder`` as transformers saves it."""
    c = transformers.MixtralConfig(vocab_size=vocab, **{**SHAPES, "rope_parameters": {"rope_type": "default",
                                                                                      "rope_theta": 10000.0}, **kw})
    hf = transformers.MixtralForCausalLM(c).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g) if n.endswith("norm.weight")
                    else 0.1 * torch.randn(p.shape, generator=g))
    if save:
        hf.save_pretrained(str(folder))
    return hf


def test_moe_run_exports_as_a_mixtral_with_mxtrains_logits(run, exported, monkeypatch):
    model, _ = load_run(run)
    c = model.cfg
    assert c.n_experts == 4 and c.n_kv_heads < c.n_heads             # experts, and grouped-query attention
    cfg = json.loads((exported / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], cfg["sliding_window"],
            cfg["router_jitter_noise"]) == (4, 2, c.hidden_dim, None, 0.0)
    assert cfg["router_aux_loss_coef"] == pytest.approx(c.router_aux_coef / c.top_k)   # (transformers' is top_k x)
    t, _ = load_safetensors(exported / "model.safetensors")   # transformers' own on-disk names, one tensor per expert
    gu = model.layers[1].feed_forward.experts.gate_up_proj
    assert torch.equal(t["model.layers.1.block_sparse_moe.experts.3.w3.weight"], gu[3, c.hidden_dim:])
    assert torch.equal(t["model.layers.1.block_sparse_moe.gate.weight"], model.layers[1].feed_forward.router.weight)

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()
    assert type(hf).__name__ == "MixtralForCausalLM" and hf.dtype == torch.float32
    x = torch.randint(0, c.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x)
        torch.testing.assert_close(hf(x).logits, ours, **TOL)
        # the comparison sees routing: top-k weights left unnormalized (a router that differs so) are far off
        router = type(hf.model.layers[0].mlp.gate)
        real = router.forward

        def unnormalized(self, h):
            logits, w, idx = real(self, h)
            return logits, w * torch.softmax(logits.float(), -1).gather(-1, idx).sum(-1, keepdim=True), idx
        monkeypatch.setattr(router, "forward", unnormalized)
        assert (hf(x).logits - ours).abs().max() > 1e-2


def test_transformers_loss_of_the_export_is_the_runs_validation_loss(run, exported):
    """Over the windows the run's evaluation used (``mxtrain eval``'s, with its ``log.eval_tokens``), transformers'
    own causal-LM loss of the exported model is the validation loss the run logged; so is ``mxtrain eval``'s."""
    from mxtrain.interop.generate import evaluate, load
    final = json.loads((run / "summary.json").read_text())["final_val_loss"]
    assert evaluate(run, small_data(), max_tokens=256, device="cpu", progress=False)["loss"] == pytest.approx(final,
                                                                                                            abs=1e-6)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported)).eval()

    ld = load(run, precision="fp32", device="cpu")

    class Transformers(torch.nn.Module):   # mxtrain's loss call (inputs, targets), answered by transformers
        cfg = ld.model.cfg

        def forward(self, x, y):
            return hf(input_ids=x, labels=y, shift_labels=y.contiguous()).loss

    ld.model = Transformers()
    res = evaluate(run, small_data(), max_tokens=256, progress=False, loaded=ld)
    assert res["windows"] == 8
    assert res["loss"] == pytest.approx(final, abs=1e-5)


def test_transformers_balancing_loss_with_the_exported_coefficient_is_mxtrains_in_one_layer(tmp_path):
    """The exported ``router_aux_loss_coef`` (``router_aux_coef / top_k``) weighs transformers' load-balancing loss
    (``output_router_logits=True``) as mxtrain weighs its own: equal for one layer (transformers pools the layers)."""
    mc = ModelConfig.named("tiny-moe", n_layers=1, dim=64, n_heads=2, n_kv_heads=1, vocab_size=128)
    torch.manual_seed(4)
    model = Llama(mc).train()
    (tmp_path / "config.json").write_text(json.dumps(hf_config(mc, None)))
    save_safetensors(tmp_path / "model.safetensors", hf_state_dict(model.state_dict(), mc))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).train()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model(x, x)
    ours = mc.router_aux_coef * model.layers[0].feed_forward.aux_loss
    theirs = hf.config.router_aux_loss_coef * hf(x, output_router_logits=True).aux_loss
    assert abs(ours.item() - 0.01) > 1e-5    # (not the value of an even load, which any weighting would give)
    assert theirs.item() == pytest.approx(ours.item(), rel=1e-6)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_transformers_mixtral_loads_with_its_logits_and_exports_back(tmp_path, layout):
    """A folder as transformers saves a Mixtral (experts one by one, ``block_sparse_moe``), or with transformers 5's
    fused names (``mlp.experts.gate_up_proj``); the fused case with a tied head and Llama 3.1's RoPE scaling. Its
    vocab 100 padded to 128 with zero rows; mxtrain's export of it is the same Mixtral."""
    kw = {} if layout == "per-expert" else dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    hf = _mixtral(tmp_path / "hf", save=layout == "per-expert", **kw)
    if layout == "fused":
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "config.json").write_text(hf.config.to_json_string())
        save_safetensors(tmp_path / "hf" / "model.safetensors",
                         {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"})
        assert "model.layers.0.mlp.experts.gate_up_proj" in load_safetensors(tmp_path / "hf" / "model.safetensors")[0]
    mc = config_from_hf(tmp_path / "hf", vocab_multiple=32)
    assert (mc.n_experts, mc.top_k, mc.ffn_dim, mc.hf_model_type, mc.vocab_size) == (4, 2, 48, "mixtral", 128)
    assert mc.router_aux_coef == pytest.approx(2 * 0.001) and mc.tie_embeddings == (layout == "fused")
    model = Llama(mc)
    assert model.num_params() == mc.num_params()
    assert load_hf_llama(model, tmp_path / "hf")["padded_rows"] == 28
    x = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(x).logits
        torch.testing.assert_close(model(x)[..., :100], theirs, **TOL)

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(mc, None)))
    save_safetensors(out / "model.safetensors", hf_state_dict(model.state_dict(), mc))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back).__name__ == "MixtralForCausalLM" and back.config.tie_word_embeddings == (layout == "fused")
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits[..., :100], theirs, **TOL)
    again = config_from_hf(out)
    assert (again.n_experts, again.top_k, again.router_aux_coef, again.rope_scaling) == (4, 2, mc.router_aux_coef,
                                                                                          mc.rope_scaling)


def test_init_from_a_mixtral_trains_mx_experts_and_exports_a_mixtral(tmp_path):
    """``train.init_from`` a Mixtral folder: its experts become MX layers (the router stays high precision), the
    checkpoint records the mixture, and the export is a Mixtral with the trained model's logits."""
    from mxtrain.train import parallel as D
    from mxtrain.train import checkpoint as ckpt
    from mxtrain.train import train
    from mxtrain.train.callbacks import Callback
    _mixtral(tmp_path / "hf", vocab=512)

    class Look(Callback):
        def on_train_begin(self, state):
            ffn = D.unwrap(state.model).layers[0].feed_forward
            self.kinds = type(ffn.experts).__name__, type(ffn.router).__name__

    look = Look()
    cfg = tiny_run_cfg(tmp_path / "run", 1)
    cfg.train.init_from = str(tmp_path / "hf")
    run = train(cfg, callbacks=[look])
    assert look.kinds == ("MXExperts", "Router")
    mc = ckpt.load(run)["model_config"]
    assert (mc["n_experts"], mc["top_k"], mc["hf_model_type"]) == (4, 2, "mixtral")
    out = export_hf(run, tmp_path / "out", tokenizer=False)
    model, _ = load_run(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), **TOL)


def test_what_a_mixtral_of_mxtrain_cannot_be_is_refused_in_one_line(run, tmp_path):
    def write(**kw):
        d = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        base = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2,
                "num_attention_heads": 4, "vocab_size": 128}
        (d / "config.json").write_text(json.dumps({**base, **kw}))
        return d

    # absent fields: transformers' MixtralConfig defaults (not Llama's)
    mc = config_from_hf(write(router_jitter_noise=0.1))   # (training-time noise in transformers: no logit changes)
    assert (mc.n_experts, mc.top_k, mc.rope_theta, mc.norm_eps, mc.max_seq_len) == (8, 2, 1e6, 1e-5, 131072)
    for kw, frag in (({"sliding_window": 16, "max_position_embeddings": 64}, "sliding_window 16 below the longest"),
                     ({"num_local_experts": 1, "num_experts_per_tok": 1}, "num_local_experts 1 (mxtrain's mixture"),
                     ({"num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok 3 above"),
                     ({"router_aux_loss_coef": -1}, "router_aux_loss_coef -1 below 0"),
                     ({"num_local_experts": "8"}, 'num_local_experts is "8", expected a positive integer'),
                     ({"hidden_act": "gelu"}, "hidden_act 'gelu'")):
        with pytest.raises(UserError) as e:
            config_from_hf(write(**kw))
        assert frag in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    with pytest.raises(UserError, match="hf_model_type='mixtral' with model.n_experts=0"):
        ModelConfig(hf_model_type="mixtral")
    # a model of other expert counts, a folder missing an expert or holding both layouts
    _mixtral(tmp_path / "hf")
    mc = config_from_hf(tmp_path / "hf", vocab_multiple=32)
    from dataclasses import replace
    with pytest.raises(UserError, match="n_experts 8 here, num_local_experts 4 .*top_k 1 here, num_experts_per_tok 2"):
        load_hf_llama(Llama(replace(mc, n_experts=8, top_k=1)), tmp_path / "hf")
    with pytest.raises(UserError, match="n_experts 0 here, num_local_experts 4"):
        load_hf_llama(Llama(replace(mc, n_experts=0, hf_model_type="mistral")), tmp_path / "hf")
    t = {k: v.clone() for k, v in load_safetensors(tmp_path / "hf" / "model.safetensors")[0].items()}
    del t["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_safetensors(tmp_path / "hf" / "model.safetensors", t)
    with pytest.raises(UserError, match="missing weights model.layers.1.block_sparse_moe.experts.2.w3.weight$"):
        llama_from_hf(tmp_path / "hf")
    t["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(4, 96, 64)
    save_safetensors(tmp_path / "hf" / "model.safetensors", t)
    with pytest.raises(UserError, match="gate_up_proj is given in two layouts"):
        llama_from_hf(tmp_path / "hf")
    # an MoE with attention biases is no Mixtral: export refuses it before writing anything
    with pytest.raises(UserError, match="with q/k/v biases .* cannot be exported: .* a Mixtral"):
        hf_config(replace(mc, hf_model_type="qwen2", qkv_bias=True), None)
    from mxtrain.train import checkpoint as ckpt
    st = {k: v for k, v in ckpt.load(run).items() if k != "format"}
    st["model_config"] = {**st["model_config"], "attention_bias": True}
    for i in range(2):
        for w in "qkvo":
            rows = st["model"][f"layers.{i}.attention.w{w}.weight"].shape[0]
            st["model"][f"layers.{i}.attention.w{w}.bias"] = torch.zeros(rows)
    biased = tmp_path / "biased"
    biased.mkdir()
    ckpt.save(biased / ckpt.NAME, st)
    with pytest.raises(UserError, match="with attention_bias cannot be exported"):
        export_hf(biased, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_init_from_a_mixtral_takes_the_balancing_weight_and_refuses_cuda_graphs(tmp_path):
    """``model.router_aux_coef`` weighs a loss (no shape): with ``--init-from`` it replaces the folder's, for a new
    run and a resumed one; on a dense folder it is refused, and so is ``train.cuda_graphs`` with a Mixtral folder
    (refused for the named MoE sizes already; a folder's shape is known only when the model is built)."""
    from mxtrain.train.trainer import build_model
    from train_helpers import run_main
    _mixtral(tmp_path / "hf", vocab=128)
    cfg = tiny_run_cfg(tmp_path / "run", 1)
    cfg.train.init_from, cfg.model.router_aux_coef = str(tmp_path / "hf"), 0.5
    for load in (True, False):
        assert build_model(cfg, 128, torch.device("cpu"), load_init=load).cfg.router_aux_coef == 0.5
    cfg.train.cuda_graphs = True
    with pytest.raises(UserError, match="cuda_graphs with a mixture of experts"):
        build_model(cfg, 128, torch.device("cpu"))
    dense = tmp_path / "dense"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: SHAPES[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")},
        vocab_size=128)).save_pretrained(str(dense))
    cfg.train.init_from, cfg.train.cuda_graphs = str(dense), False
    with pytest.raises(UserError, match="router_aux_coef=0.5 weighs .* dense model"):
        build_model(cfg, 128, torch.device("cpu"))
    r = run_main("train", "--init-from", str(tmp_path / "hf"), "--data", str(small_data()), "--set",
                 "model.router_aux_coef=0.25", "--print-config")
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if "router_aux_coef" in ln and "0.25" in ln], r.stdout
