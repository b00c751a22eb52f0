"""Hugging Face MoE models under ``convert``: Mixtral's and Qwen3-MoE's fused experts become ``MXExperts`` (one
``mx_linear`` call per expert GEMM, ``mxtrain.linear.moe``), with the parameters, names and routing of the original.

Tiny models built from configs (2 layers, 4 experts, dims 64): with a recipe that quantizes nothing the converted
model is transformers' eager model bit for bit; with MX recipes each expert GEMM is ``mx_linear`` on ``weight[e]``
with the expert's own layer id; a few optimizer steps train.
"""

import copy
import io

import pytest
import torch
import torch.nn as nn

import mxtrain
from mxtrain.linear import mx_linear
from mxtrain.linear.module import MXExperts, MXLayer

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _hf(kind: str, layers: int = 2):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=64, num_local_experts=4,
                                                                           **common))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=128, moe_intermediate_size=64, num_experts=4, head_dim=16, decoder_sparse_step=1,
            mlp_only_layers=[], **common))
    return model


def _ids(n=2, t=16, seed=0):
    return torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


def _eager(model):
    """The unconverted model with transformers' eager experts loop (its default may be grouped_mm)."""
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    return ref


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_experts_convert_same_parameters_and_bf16_is_the_hf_model(kind):
    model = _hf(kind)
    ref = _eager(model)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    rep = mxtrain.convert(model, "bf16", strict=True)
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert rep.refused == {} and all(n in rep.converted for n in experts)
    assert rep.share > 0.85, str(rep)   # Mixtral 90.4 %, Qwen3-MoE 89.6 % (was 9.6 % and 15.7 %: experts refused)
    ex = model.get_submodule(experts[1])
    assert isinstance(ex, MXExperts) and isinstance(ex, type(ref.get_submodule(experts[1])))
    assert ex.layer_id == 4 + 8 + 4 and ex._mx_ids == 8   # 4 attention projections, then 2 ids per expert
    assert not isinstance(model.get_submodule("model.layers.0.mlp.gate"), MXLayer)   # the router: high prec.
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    model.load_state_dict(ref.state_dict())
    ids = _ids()
    want = ref(ids).logits
    assert torch.equal(model(ids).logits, want)
    # a whole-model save and load keeps the MX class (pickled as "the MX class of the HF class")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back.get_submodule(experts[0]), MXExperts) and torch.equal(back(ids).logits, want)
    mxtrain.convert(model, "mxfp4-all")
    from mxtrain.train.deosc import tracked_layers   # weight de-oscillation tracks the linear layers, not the experts
    assert len(tracked_layers(model)) == 8
    out = model(ids).logits
    assert torch.isfinite(out).all() and 0 < (out - want).norm() / want.norm() < 0.5


def _by_hand(ex, x, idx, w, recipe, layer_of):
    """The experts' output, computed with one mx_linear per expert GEMM (state ``[layer_of(e, k), 3, 5]``)."""
    out = torch.zeros_like(x)
    for e in range(4):
        pos, tok = torch.where(idx.T == e)
        if not len(tok):
            continue
        gate, up = mx_linear(x[tok], ex.gate_up_proj[e], None, recipe,
                             torch.tensor([layer_of(e, 0), 3, 5], device=x.device)).chunk(2, dim=-1)
        h = mx_linear(ex.act_fn(gate) * up, ex.down_proj[e], None, recipe, torch.tensor([layer_of(e, 1), 3, 5], device=x.device))
        out.index_add_(0, tok, h * w[tok, pos, None])
    return out


def _grads(y, dy, *ts):
    return torch.autograd.grad(y, ts, dy)


def test_eager_groups_are_torch_where_per_expert_with_one_host_read(monkeypatch):
    """The eager loop's experts and their (position, token) pairs from one sort (``_experts._groups``) are those of
    ``transformers``' loop (``nonzero`` over a one-hot mask, then ``torch.where`` per expert), in the same order,
    for routings with unchosen experts and the "no expert" index E; and the host reads the device once a call."""
    from mxtrain import _experts
    g = torch.Generator().manual_seed(3)
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, real=torch.Tensor.tolist: reads.append(1) or real(t))
    for n_tok, k, n_exp in ((1, 1, 4), (7, 2, 4), (33, 3, 8), (64, 8, 16)):
        top = torch.randint(0, n_exp + 1, (n_tok, k), generator=g)   # E: no expert
        top[:, 0] = torch.randint(0, max(1, n_exp // 2), (n_tok,), generator=g)   # leave some experts unchosen
        mask = torch.nn.functional.one_hot(top, num_classes=n_exp + 1).permute(2, 1, 0)
        want = [int(h[0]) for h in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero() if int(h[0]) != n_exp]
        reads.clear()
        experts, groups = _experts._groups(top, n_exp)
        assert len(reads) == 1
        assert experts == want
        for e in want:
            pos, tok = torch.where(mask[e])
            assert torch.equal(groups[e][0], pos) and torch.equal(groups[e][1], tok), (n_tok, k, n_exp, e)


def test_expert_gemms_are_mx_linear_per_expert():
    """Forward and backward of the experts are mx_linear per expert GEMM, each with its own layer id (mxfp4-all-sr:
    MXFP4 forward as mxfp4-all, stochastic rounding of the gradients, drawn by layer id, step and call)."""
    recipe = "mxfp4-all-sr"
    model = _hf("qwen3_moe")
    mxtrain.convert(model, recipe, strict=True)
    ex = model.model.layers[1].mlp.experts
    mxtrain.set_step(model, 3, call=5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 64, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(24)])
    idx[idx == 3] = 2   # expert 3 chosen by nobody
    w = torch.rand(24, 2, generator=g)
    dy = torch.randn(24, 64, generator=g)
    y = ex(x, idx, w)
    assert ex.mx_state.tolist() == [ex.layer_id, 3, 6]   # a call that records gradients takes one call number
    own = _by_hand(ex, x, idx, w, recipe, lambda e, k: ex.layer_id + 2 * e + k)
    assert torch.equal(y, own)
    got = _grads(y, dy, x, ex.gate_up_proj, ex.down_proj)
    for a, b in zip(got, _grads(own, dy, x, ex.gate_up_proj, ex.down_proj)):
        assert torch.equal(a, b)
    # the experts draw bits of their own: with one layer id for all of them the gradients differ
    one = _by_hand(ex, x, idx, w, recipe, lambda e, k: ex.layer_id + k)
    assert torch.equal(one, y)   # (the forward rounds to nearest)
    assert not torch.equal(_grads(one, dy, ex.gate_up_proj)[0], got[1])
    with torch.no_grad():   # no call number taken
        assert torch.equal(ex(x, idx, w), y) and ex.mx_state.tolist() == [ex.layer_id, 3, 6]


def test_moe_trains_a_few_steps_in_a_plain_loop():
    model = _hf("mixtral", layers=1)
    mxtrain.convert(model, "mxfp4-all-sr", strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _ids(n=2, t=16, seed=2)
    ex = model.model.layers[0].mlp.experts
    before = ex.gate_up_proj.detach().clone()
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses
    assert not torch.equal(ex.gate_up_proj, before)
    assert ex.step == 4   # the optimizer step hook advances the experts' step as any MX layer's



def _train(f, model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for s in range(steps):   # other tokens each step: other routings, other token counts per expert
        ids = _ids(n=2, t=16, seed=s)
        loss = f(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_compiled_moe_one_graph_losses_equal_eager():
    """torch.compile(fullgraph=True) of a converted Mixtral (mxfp4-all-sr: stochastic rounding drawn by layer id,
    step and call) with capture_dynamic_output_shape_ops: one graph over 4 steps of changing routings, no recompile,
    losses and the experts' state equal eager's bit for bit (aot_eager runs eager's kernels)."""
    from torch._dynamo.utils import counters
    model = _hf("mixtral", layers=1)
    mxtrain.convert(model, "mxfp4-all-sr", strict=True)
    eager = _train(model, model)
    torch._dynamo.reset()
    counters.clear()
    model = _hf("mixtral", layers=1)
    mxtrain.convert(model, "mxfp4-all-sr", strict=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = _train(torch.compile(model, fullgraph=True, backend="aot_eager"), model)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])
    assert compiled == eager
    assert model.model.layers[0].mlp.experts.mx_state.tolist() == [4, 3, 0]


def test_compiled_experts_with_an_expert_nobody_chose_equal_eager():
    """The compiled experts (padded rows, every expert run) equal the eager loop, forward and gradients, also when
    an expert gets no token, and take one call number as eagerly; a second routing reuses the graph."""
    from torch._dynamo.utils import counters
    recipe = "mxfp4-all-sr"
    model = _hf("qwen3_moe", layers=1)
    mxtrain.convert(model, recipe, strict=True)
    ex = model.model.layers[0].mlp.experts
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(ex, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    n = 24
    for other in (2, 3):   # expert 3 chosen by nobody, then expert 0 (the same input shape: one graph)
        x = torch.randn(n, 64, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(n)])
        idx[idx == 3] = other
        idx[idx == 0] = other if other == 3 else 0
        w = torch.rand(n, 2, generator=g)
        dy = torch.randn(n, 64, generator=g)
        got = {}
        for mode in ("eager", "compiled"):
            mxtrain.set_step(model, 3, call=5)
            with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
                y = (f if mode == "compiled" else ex)(x, idx, w)
            got[mode] = (y, *_grads(y, dy, x, ex.gate_up_proj, ex.down_proj), ex.mx_state.tolist())
        for a, b in zip(got["compiled"], got["eager"]):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], dict(counters["stats"])

def test_compiling_experts_without_dynamic_shapes_warns_once(monkeypatch):
    """Without capture_dynamic_output_shape_ops the experts' loop breaks dynamo's graph at every expert: said once,
    with the setting that fixes it; the numbers are the eager loop's."""
    from mxtrain import _experts
    monkeypatch.setattr(_experts, "_warned", False)
    model = _hf("qwen3_moe", layers=1)
    mxtrain.convert(model, "mxfp4-all", strict=True)
    ex = model.model.layers[0].mlp.experts
    torch._dynamo.reset()
    f = torch.compile(ex, backend="eager")
    g = torch.Generator().manual_seed(2)
    x, idx, w = torch.randn(8, 64, generator=g), torch.randint(0, 4, (8, 2), generator=g), torch.rand(8, 2, generator=g)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False):
        with pytest.warns(UserWarning, match="capture_dynamic_output_shape_ops = True") as rec:
            y = f(x, idx, w)
            f(x, idx, w)
    assert sum("capture_dynamic_output_shape_ops" in str(r.message) for r in rec) == 1
    assert torch.equal(y, ex(x, idx, w))
    torch._dynamo.reset()


def test_other_3d_layouts_stay_refused():
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2)
    ex = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    ex.is_transposed = True
    wrap = nn.ModuleDict({"experts": ex, "proj": nn.Linear(64, 64)})
    with pytest.warns(UserWarning, match=r"(?s)experts: holds gate_up_proj/down_proj.*is_transposed=True.*mx_linear"):
        rep = mxtrain.convert(wrap, "mxfp4-all")
    assert list(rep.refused) == ["experts"] and rep.converted == ["proj"]

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 8, 8))
    with pytest.raises(ValueError, match="not a fused experts module"):
        mxtrain.convert(nn.Sequential(Odd(), nn.Linear(8, 8)), "mxfp4-all", strict=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("source", ["hf", "own"])
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all-sr"])
def test_cuda_experts_run_the_fast_path_as_mx_linear_per_expert(recipe, source):
    """On a GPU each expert GEMM takes mx_linear's fast path (bf16, 256 tokens, dims 64): the experts equal the
    by-hand loop bit for bit, and the reference path (``fast="off"``) to within MX-vs-MX kernel noise. ``source``:
    a Hugging Face Qwen3-MoE, or mxtrain's own mixture of experts (``tiny-moe``; whatever transformers has)."""
    from mxtrain import settings
    from mxtrain.linear import route
    from mxtrain.linear.moe import fused_experts
    if source == "own":
        from mxtrain.model.llama import Llama, ModelConfig
        model = Llama(ModelConfig.named("tiny-moe", dim=64, n_heads=2, n_kv_heads=1, n_layers=2, vocab_size=256))
        model = model.cuda().to(torch.bfloat16)
        experts = lambda: model.layers[1].feed_forward.experts
    else:
        model = _hf("qwen3_moe").cuda().to(torch.bfloat16)
        experts = lambda: model.model.layers[1].mlp.experts
    why = fused_experts(experts())
    if why is not None:   # convert refuses these loudly (test above); here only the GPU path is under test
        pytest.skip(f"transformers {transformers.__version__}: {why}")
    mxtrain.convert(model, recipe, strict=True)
    ex = experts()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(256, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.stack([torch.randperm(4, device="cuda", generator=g)[:2] for _ in range(256)])
    w = torch.rand(256, 2, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(256, 64, device="cuda", generator=g).to(torch.bfloat16)
    assert route(mxtrain.numerics.recipes.get(recipe), x, ex.gate_up_proj[0]) == "fast"
    mxtrain.set_step(model, 3, call=5)
    y = ex(x, idx, w)
    got = _grads(y, dy, x, ex.gate_up_proj, ex.down_proj)
    own = _by_hand(ex, x, idx, w, recipe, lambda e, k: ex.layer_id + 2 * e + k)
    assert torch.equal(y, own)
    for a, b in zip(got, _grads(own, dy, x, ex.gate_up_proj, ex.down_proj)):
        assert torch.equal(a, b)
    mxtrain.set_step(model, 3, call=5)
    with settings.override(fast="off"):
        assert route(mxtrain.numerics.recipes.get(recipe), x, ex.gate_up_proj[0]) == "reference"
        ref = ex(x, idx, w)
        rgot = _grads(ref, dy, x, ex.gate_up_proj, ex.down_proj)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    assert rel(y, ref) < 1e-2
    if recipe == "mxfp4-all-dh16":   # round to nearest: the same MX numbers; SR draws differ between paths
        for a, b in zip(got, rgot):
            assert rel(a, b) < 2e-2
