"""mxtrain's own mixture of experts (``model.n_experts``, ``--model tiny-moe``): its routing and load-balancing loss
against a per-token reference, its counts, ``convert`` (experts to ``MXExperts``, the router kept), the trainer's
command line (a run that trains, resumes, is diagnosed, and is refused where not built), in a few seconds."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import mxtrain
from mxtrain.cli import core as cli
from mxtrain.errors import UserError
from mxtrain.model.llama import Llama, ModelConfig, MoEFeedForward
from mxtrain.linear.module import MXExperts, MXLinear
from mxtrain.study.diagnostics import Diagnostics
from train_helpers import small_data

CFG = ModelConfig.named("tiny-moe", n_layers=2, vocab_size=256, dim=64, n_heads=2, n_kv_heads=1)


def _reference(ffn: MoEFeedForward, x: torch.Tensor):
    """Token by token in float64: softmax of the router's logits, the top_k renormalized, each expert's SwiGLU;
    Switch's loss from counts."""
    h = x.detach().reshape(-1, x.shape[-1]).double()
    E = ffn.experts.num_experts
    gu, down = ffn.experts.gate_up_proj.detach().double(), ffn.experts.down_proj.detach().double()
    probs = torch.softmax(h @ ffn.router.weight.detach().double().T, dim=-1)
    out = torch.zeros_like(h)
    counts = [0] * E
    for t in range(h.shape[0]):
        top = sorted(range(E), key=lambda e: -float(probs[t, e]))[:ffn.top_k]
        z = sum(float(probs[t, e]) for e in top)
        for e in top:
            counts[e] += 1
            gate, up = (gu[e] @ h[t]).chunk(2)
            out[t] += float(probs[t, e]) / z * (down[e] @ (F.silu(gate) * up))
    share = torch.tensor(counts, dtype=torch.float64) / (h.shape[0] * ffn.top_k)
    aux = E * float((share * probs.mean(0)).sum())
    return out.reshape(x.shape), aux


def test_routing_and_balancing_loss_equal_a_per_token_reference():
    torch.manual_seed(1)
    m = Llama(CFG)
    ffn = m.layers[0].feed_forward
    x = torch.randn(2, 9, CFG.dim)
    y = ffn(x)
    want, aux = _reference(ffn, x)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6)
    assert ffn.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    with torch.no_grad():                       # uniform router probabilities: the loss is 1 whatever the routing
        ffn.router.weight.zero_()
        ffn(x)
    assert ffn.aux_loss is None                 # (no gradients recorded: no loss)
    ffn(x)
    assert ffn.aux_loss.item() == pytest.approx(1.0)


def test_training_loss_adds_the_balancing_loss_and_validation_does_not():
    torch.manual_seed(2)
    m = Llama(CFG)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    loss = m(idx, idx)
    ce = F.cross_entropy(m(idx).float().view(-1, CFG.vocab_size), idx.reshape(-1))
    aux = torch.stack([b.feed_forward.aux_loss for b in m.layers]).mean()
    assert torch.allclose(loss, ce + CFG.router_aux_coef * aux)
    loss.backward()
    assert m.layers[0].feed_forward.router.weight.grad.abs().sum() > 0
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(idx, idx), ce.detach())


def test_counts_and_bad_shapes():
    for name in ("tiny-moe", "30m-moe"):
        c = ModelConfig.named(name)
        assert c.num_params() == Llama(c, device="meta").num_params()
        dense = ModelConfig.named(name, n_experts=0)
        per_layer = 3 * c.dim * c.hidden_dim
        # active FLOPs: top_k experts and the router instead of one dense feed-forward
        assert c.flops_per_token(64) - dense.flops_per_token(64) == pytest.approx(
            6 * c.n_layers * ((c.top_k - 1) * per_layer + c.dim * c.n_experts))
    for bad in (dict(n_experts=1), dict(top_k=5), dict(top_k=0), dict(router_aux_coef=-1.0),
                dict(router_aux_coef=math.inf), dict(mlp_bias=True)):
        with pytest.raises(UserError, match="model\\."):
            ModelConfig.named("tiny-moe", **bad)


def test_convert_makes_the_experts_mx_and_keeps_the_router():
    torch.manual_seed(3)
    m = Llama(CFG)
    mxtrain.convert(m, "mxfp4-all", strict=True)
    ffn = m.layers[1].feed_forward
    assert isinstance(ffn.experts, MXExperts) and not isinstance(ffn.router, MXLinear)
    assert isinstance(m.layers[1].attention.wq, MXLinear)
    idx = torch.randint(0, CFG.vocab_size, (2, 16))
    diag = Diagnostics(m, None, every=1)      # the study's per-GEMM diagnostics: the linear layers, not the experts
    diag.begin(1)
    m(idx, idx).backward()
    rows = diag.end(1)
    assert ffn.experts.gate_up_proj.grad.abs().sum() > 0
    names = {r["layer"] for r in rows}
    assert "layers.1.attention.wq" in names and not [n for n in names if "experts" in n], names


def test_cli_trains_resumes_and_refuses_what_is_not_built(tmp_path, capsys):
    out = tmp_path / "moe"
    common = ["train", "--model", "tiny-moe", "--recipe", "mxfp4-all", "--data", str(small_data()), "--seq-len", "32",
              "--batch-size", "4", "--eval-tokens", "128", "--no-progress", "--set", "model.n_layers=1",
              "--set", "model.dim=64", "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1",
              "--set", "schedule.horizon_steps=4"]
    assert cli.main(common + ["--steps", "2", "--out", str(out)]) == 0
    assert cli.main(common + ["--steps", "4", "--out", str(out), "--resume", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"mxtrain export {out}" in text and f"mxtrain eval {out}" in text   # (experts export as Mixtral)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows
                                                                           if "loss" in r)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["name"] == "tiny-moe"
    assert cli.main(["eval", str(out), "--data", str(small_data()), "--max-tokens", "256"]) == 0   # (reads the run)
    assert "step 4 | mx (mxfp4-all)" in capsys.readouterr().out
    assert cli.main(["export", str(out), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0   # (a Mixtral)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mixtral"
    capsys.readouterr()
    assert cli.main(common + ["--steps", "1", "--out", str(tmp_path / "g"), "--set", "train.cuda_graphs=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda_graphs with a mixture of experts" in err[0], err
