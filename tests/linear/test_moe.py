"""Hugging Face MoE models under ``convert``: Mixtral's and Qwen3-MoE's fused experts become ``MXExperts`` (one
``mx_linear`` call per expert GEMM, ``mxtrain.linear.moe``), with the parameters, names and routing of the original.

Tiny models built from configs (2 layers, 4 experts, dims 64): with a recipe that quantizes nothing the converted
model is transformers' eager model bit for bit; with MX recipes each expert GEMM is ``mx_linear`` on ``weight[e]``
with the expert's own layer id; a few optimizer steps train. The grouped MX experts path (mxtrain.linear.experts)
equals the per-expert loop bit for bit: on CPU with the kernels in Triton's interpreter and the carrier GEMM
emulated, and in cuda tests at E=8, H=1024, I=512, 4096 tokens.
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
    by-hand loop bit for bit (``mxfp4-all-dh16`` through the grouped MX experts path, which the dispatcher takes
    for it: the same numbers), and the reference path (``fast="off"``) to within MX-vs-MX kernel noise. ``source``:
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
    assert ex.mx_experts_path == ("grouped" if recipe == "mxfp4-all-dh16" else "loop")
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


# ---------------------------------------------------------------------------------------------- the grouped path

@pytest.fixture
def carrier_cpu(monkeypatch):
    """The FP8-carrier fast path on CPU (as tests/linear/test_exact_carrier.py): Triton's interpreter quantizes,
    and the carrier GEMM multiplies the carriers' values in float32 (codes dropped). Yields the GEMMs' operand
    layouts as ``_scaled_mm`` would receive them: shapes and scale shapes and strides."""
    import dataclasses
    from mxtrain import settings
    from mxtrain.kernels import gemm as kg
    from mxtrain.linear import fast
    real, seen = kg.mx_gemm_nt, []

    def layout(s):   # (a scale's shape and strides; the stride of a dimension of size 1 is not checked)
        return tuple(s.shape), tuple(st if n > 1 else None for n, st in zip(s.shape, s.stride()))

    def gemm(a, b, backend, *r):
        assert backend == "fp8_carrier"
        seen.append((a.carrier.shape, layout(a.gscale), b.carrier.shape, layout(b.gscale), b.group_rows))
        a, b = (dataclasses.replace(q, packed=None, scales=None) for q in (a, b))
        return real(a, b, "dequant", *r)
    monkeypatch.setattr(kg, "mx_gemm_nt", gemm)
    monkeypatch.setattr(kg, "activation_b_group_rows", lambda dev: 128)
    # (carrier_k=128: each expert's tokens padded to 128 rows, the least the carrier allows: interpreter time)
    with settings.override(gemm_backend="fp8_carrier", qselfcheck="off", fast_launch="always", carrier_k=128):
        fast.clear_caches()
        yield seen


def _own_experts(recipe, dtype, E=4, H=64, I=64):
    """A converted experts module in transformers' fused layout (mxtrain's own ``Experts``: importing transformers'
    Mixtral costs 5 s of CI time), E experts, hidden H, intermediate I, random weights."""
    from types import SimpleNamespace
    from mxtrain.model.llama import Experts
    ex = Experts(SimpleNamespace(n_experts=E, dim=H, hidden_dim=I))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) / H ** 0.5)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) / I ** 0.5)
    ex.to(dtype)
    mxtrain.convert(nn.ModuleDict({"experts": ex}), recipe, strict=True)
    assert isinstance(ex, MXExperts)
    return ex


@pytest.mark.parametrize("recipe,dtype,wgrad_x,qkernel", [("mxfp4-all", torch.float32, "auto", "auto"),
                                                          ("mxfp4-all-dh16", torch.bfloat16, "forward", "tile"),
                                                          ("mxfp4-all-dh32", torch.float32, "backward", "tile")])
def test_grouped_experts_equal_the_loop_bit_for_bit(carrier_cpu, recipe, dtype, wgrad_x, qkernel):
    """The grouped MX experts path (mxtrain.linear.experts; setting experts_grouped=on runs it on CPU) gives the
    per-expert loop's output and gradients bit for bit (hidden states, routing weights, both expert weights), with
    the kernels in Triton's interpreter and the carrier GEMM emulated: E=4, H=64, I=64, 40 tokens, top-2, experts 1
    and 3 chosen by nobody, a fifth of the second choices "no expert" (index E, which the loop skips), token
    counts that are not multiples of 32. Every GEMM gets the loop's operand layouts (shapes, scale shapes and
    strides, as ``_scaled_mm`` checks them), with fewer quantize launches. The down projection's weight operands
    (64 rows, not a multiple of 128) come from one launch per expert, the gate/up ones (128 rows) from one launch
    for all experts. X's and dY's two operands come from the one-pass kernel (``qkernel=auto``) or, with the tile
    kernel, from two passes. (Interpreter time: two experts run, not three, and the bf16 case runs the tile
    kernel, which the interpreter runs about twice as fast: 3.6, 1.0 and 0.9 s with ``-n 2``, the first one paying
    the kernels' first runs.) X's Wgrad operand is made in
    the forward as the carrier (``wgrad_x=auto`` at 64 inputs), as FP4 codes (``forward``), or in the backward from
    the kept input (``backward``)."""
    from mxtrain import settings
    from mxtrain._experts import experts_forward
    from mxtrain.kernels import mxfp4 as kq
    from mxtrain.linear import fast, implementation
    from mxtrain.linear.context import Ctx
    rec = mxtrain.numerics.recipes.get(recipe)
    ex = _own_experts(recipe, dtype)
    g = torch.Generator().manual_seed(1)
    n = 40
    x = torch.randn(n, 64, generator=g).to(dtype).requires_grad_()
    idx = torch.stack([torch.randperm(2, generator=g) * 2 for _ in range(n)])   # experts 0 and 2
    idx[::5, 1] = 4   # no expert
    counts = torch.bincount(idx.flatten(), minlength=5).tolist()
    assert counts[1] == counts[3] == 0 and all(c % 32 for c in (counts[0], counts[2])), counts
    w = torch.rand(n, 2, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(n, 64, generator=g).to(dtype)
    got = {}
    with settings.override(wgrad_x=wgrad_x, qkernel=qkernel):
        for path in ("loop", "grouped"):
            carrier_cpu.clear()
            with kq.record_launches() as log:
                if path == "loop":   # (what MXExperts runs on CUDA: mx_linear's fast path per expert GEMM)
                    y = experts_forward(ex, x, idx, w, lambda a, b, k: fast.apply(a, b, None, Ctx(rec)))
                else:
                    with settings.override(experts_grouped="on"):
                        assert "grouped" in implementation(rec, x, ex.gate_up_proj, compiled=False)
                        y = ex(x, idx, w)
                    assert ex.mx_experts_path == "grouped"
                grads = _grads(y, dy, x, w, ex.gate_up_proj, ex.down_proj)
            got[path] = ((y, *grads), sorted(carrier_cpu), len(log))
    for a, b, name in zip(got["loop"][0], got["grouped"][0], ("y", "dx", "d weights", "d gate_up", "d down")):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got["grouped"][1] == got["loop"][1]   # 2 experts x 6 GEMMs, each with the loop's operand layouts
    assert len(got["grouped"][1]) == 12
    # X's two operands and dY's two: one pass each with the one-pass kernel, else two (X's Wgrad operand in the
    # backward: a pass of its own); loop: those, W and W^T for each of 4 expert GEMMs; grouped: those once a
    # projection, W and W^T of gate/up for all experts (2), down's W and W^T per expert (4)
    xs, dys = (1 if qkernel == "auto" and wgrad_x != "backward" else 2), (1 if qkernel == "auto" else 2)
    assert got["loop"][2] == 4 * (xs + dys + 2) and got["grouped"][2] == 2 * (xs + dys) + 6


def test_experts_dispatcher_chooses_and_says_which_path():
    """``dispatch.experts_choice`` (setting experts_grouped) takes the grouped path only for recipes that draw
    nothing at random, on the FP8-carrier fast path; ``implementation`` and ``convert``'s report say which runs."""
    from mxtrain import settings
    from mxtrain.linear import implementation
    from mxtrain.linear.dispatch import experts_choice
    get = mxtrain.numerics.recipes.get
    ex = _own_experts("mxfp4-all", torch.float32)
    x, gu = torch.zeros(3, 64), ex.gate_up_proj.detach()
    # CPU, auto: the layers run the reference path, so the loop
    assert experts_choice(get("mxfp4-all"), x, gu) == ("loop", "the layers do not take the fast path here (CUDA "
                                                              "tensors, setting fast)")
    assert "per-expert loop" in implementation("mxfp4-all", x, gu, compiled=False)
    with settings.override(experts_grouped="on", gemm_backend="fp8_carrier"):
        for r in ("mxfp4-all", "mxfp4-all-dh16", "mxfp4-all-adaptive", "mxfp4-all+rceil"):
            assert experts_choice(get(r), x, gu) == ("grouped", ""), r
        for r in ("mxfp4-all-sr", "mxfp4-all-rht16", "tseng", "ufp4", "mxfp4-bwd", "nvfp4"):   # drawn, or not all MX
            assert experts_choice(get(r), x, gu)[0] == "loop", r
        assert "stochastic rounding or random signs" in experts_choice(get("mxfp4-all-sr"), x, gu)[1]
        assert experts_choice(get("bf16"), x, gu)[0] == "loop"
        with settings.override(exact_carrier=True):
            assert experts_choice(get("mxfp4-all"), x, gu)[0] == "loop"
        with settings.override(experts_grouped="off"):
            assert experts_choice(get("mxfp4-all"), x, gu) == ("loop", "setting experts_grouped=off")
        assert "grouped MX experts path" in implementation("mxfp4-all", x, gu, compiled=False)
        assert "per-expert loop" in implementation("mxfp4-all", x, gu, compiled=True)   # (not in scope compiled)
        rep = mxtrain.convert(nn.ModuleDict({"experts": ex, "proj": nn.Linear(64, 64)}), "mxfp4-all")
        assert "grouped MX experts path" in rep.runs_as["experts"] and "experts modules on cpu" in str(rep)
    with settings.override(experts_grouped="on"):   # (CPU's own GEMM backend, dequant: the loop)
        assert "fp8_carrier" in experts_choice(get("mxfp4-all"), x, gu)[1]


def _routing(n, E, k, device, seed, nobody=None):
    """Top-k routing of ``n`` tokens over ``E`` experts (softmax of random logits, renormalized), uneven loads;
    expert ``nobody`` gets no token."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n, E, device=device, generator=g) + torch.linspace(0, 1, E, device=device)
    if nobody is not None:
        logits[:, nobody] = -float("inf")
    w, idx = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return idx, w / w.sum(dim=-1, keepdim=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "autocast"])
@pytest.mark.parametrize("recipe", ["mxfp4-all", "mxfp4-all-dh16"])
def test_cuda_grouped_experts_equal_the_loop(recipe, dtype):
    """On a GPU (the FP8-carrier backend of an H100/H200) the grouped MX experts path runs by default (the dispatcher
    says so, ``implementation`` too) and gives the per-expert loop's (``experts_grouped=off``: one ``mx_linear``
    fast-path call per expert GEMM) output and gradients bit for bit, at E=8, H=1024, I=512, 4096 tokens, top-2
    (bf16; float32; float32 weights and inputs under bf16 autocast), with a second routing in which expert 5 gets
    no token; and the carriers' inexact-block counts by tensor grow by the same amounts."""
    from mxtrain import settings
    from mxtrain.linear import fast, implementation
    dev = "cuda"
    E, H, I, n = 8, 1024, 512, 4096
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    ex = _own_experts(recipe, dt, E=E, H=H, I=I).to(dev)
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(n, H, device=dev, generator=g).to(dt).requires_grad_()
    dy = torch.randn(n, H, device=dev, generator=g).to(dt)
    rec = mxtrain.numerics.recipes.get(recipe)
    for seed, nobody in ((1, None), (2, 5)):
        idx, w = _routing(n, E, 2, dev, seed, nobody)
        counts = torch.bincount(idx.flatten(), minlength=E).tolist()
        assert (counts[nobody] == 0 if nobody is not None else min(counts) > 0), counts
        w = w.to(dt).requires_grad_()
        got = {}
        for path in ("loop", "grouped"):
            before = fast.inexact_by_tensor(dev)
            with settings.override(experts_grouped="off" if path == "loop" else "auto"), \
                    torch.autocast(dev, dtype=torch.bfloat16, enabled=dtype == "autocast"):
                said = implementation(rec, x, ex.gate_up_proj, compiled=False)
                assert ("grouped MX experts path" in said) == (path == "grouped"), said
                y = ex(x, idx, w)
            assert ex.mx_experts_path == path
            grads = _grads(y, dy.to(y.dtype), x, w, ex.gate_up_proj, ex.down_proj)
            after = fast.inexact_by_tensor(dev)
            got[path] = ((y, *grads), {r: after[r] - before[r] for r in after})
        for a, b, name in zip(got["loop"][0], got["grouped"][0], ("y", "dx", "d weights", "d gate_up", "d down")):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, seed, ((a.float() - b.float()).abs().max()))
        assert got["loop"][1] == got["grouped"][1], got


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wgrad_x", ["forward", "backward"])
def test_cuda_grouped_experts_keep_x_as_the_loop_does(wgrad_x):
    """``wgrad_x=forward`` (X's Wgrad operand kept as FP4 codes, its carrier rebuilt in the backward: one launch
    for all experts) and ``backward`` (X kept, quantized in the backward): the loop's values bit for bit."""
    from mxtrain import settings
    dev = "cuda"
    ex = _own_experts("mxfp4-all-dh16", torch.bfloat16, E=8, H=1024, I=512).to(dev)
    g = torch.Generator(device=dev).manual_seed(4)
    x = torch.randn(4096, 1024, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(4096, 1024, device=dev, generator=g).to(torch.bfloat16)
    idx, w = _routing(4096, 8, 2, dev, 5)
    w = w.to(torch.bfloat16).requires_grad_()
    got = {}
    with settings.override(wgrad_x=wgrad_x):
        for path in ("off", "auto"):
            with settings.override(experts_grouped=path):
                y = ex(x, idx, w)
            got[path] = (y, *_grads(y, dy, x, w, ex.gate_up_proj, ex.down_proj))
    assert ex.mx_experts_path == "grouped"
    for a, b in zip(got["off"], got["auto"]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["mxfp4-all", "mxfp4-all-dh16"])
def test_cuda_grouped_experts_in_a_model_equal_the_loop(recipe):
    """A whole mixture-of-experts model (mxtrain's ``30m-moe`` blocks: 8 experts, top-2, dim 384, experts 1024 wide;
    2 blocks, bf16): its loss and every parameter's gradient (the router's, which reach it through the hidden
    states' gradient the experts sum, included) equal the per-expert loop's bit for bit; the down projection's
    Dgrad weight operand (384 rows, not a multiple of 512) is quantized per expert, the rest grouped."""
    from mxtrain import settings
    from mxtrain.model.llama import Llama, ModelConfig
    dev = "cuda"
    torch.manual_seed(0)
    model = Llama(ModelConfig.named("30m-moe", n_layers=2, vocab_size=512), glue="eager").to(dev, torch.bfloat16)
    mxtrain.convert(model, recipe, strict=True)
    ids = torch.randint(0, 512, (4, 512), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    got = {}
    for path in ("off", "auto"):
        model.zero_grad(set_to_none=True)
        with settings.override(experts_grouped=path):
            loss = model(ids, ids)
            loss.backward()
        got[path] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    assert model.layers[1].feed_forward.experts.mx_experts_path == "grouped"
    for a, b in zip(got["off"], got["auto"]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_grouped_experts_train_an_hf_mixtral_in_a_users_loop_like_the_loop():
    """A user's own loop: a Hugging Face Mixtral built from a config (eager attention, so that the two runs'
    attention backward sums in one order), converted to ``mxfp4-all-dh16``, float32 weights under bf16 autocast,
    fused AdamW, 3 steps: the grouped MX experts path (``experts_grouped=auto``) trains the losses and weights of
    the per-expert loop (``off``) bit for bit, and the grouped path is the one that ran."""
    from mxtrain import settings
    res = {}
    for path in ("off", "auto"):
        model = _hf("mixtral").cuda()
        model.set_attn_implementation("eager")
        mxtrain.convert(model, "mxfp4-all-dh16", strict=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses = []
        with settings.override(experts_grouped=path):
            for step in range(3):
                ids = _ids(4, 64, seed=step).cuda()
                with torch.autocast("cuda", torch.bfloat16):
                    loss = model(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
        res[path] = (torch.stack(losses), [p.detach().clone() for p in model.parameters()],
                     model.model.layers[1].mlp.experts.mx_experts_path)
    assert res["off"][2] == "loop" and res["auto"][2] == "grouped"
    assert torch.isfinite(res["auto"][0]).all()
    assert torch.equal(res["off"][0], res["auto"][0])
    for a, b in zip(res["off"][1], res["auto"][1]):
        assert torch.equal(a, b)


def test_the_loop_sums_the_hidden_states_gradient_from_the_last_expert_to_the_first():
    """What the grouped path's backward reproduces (``experts._Grouped.backward``): autograd adds the gradients of
    the loop's per-expert gathers of the hidden states from the last expert to the first, which with top-4 routing
    gives other bits than the first-to-last order (plain ``F.linear`` experts, no quantization)."""
    from types import SimpleNamespace
    from mxtrain import _experts
    from mxtrain.model.llama import Experts
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    ex = Experts(SimpleNamespace(n_experts=6, dim=64, hidden_dim=64))
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) / 8)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) / 8)
    x = torch.randn(50, 64, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(50)])
    w, dy = torch.rand(50, 4, generator=g), torch.randn(50, 64, generator=g)
    want = torch.autograd.grad(ex(x, idx, w), x, dy)[0]
    experts, groups = _experts._groups(idx, 6)
    parts = []
    for e in experts:   # each expert's contribution alone, as the loop computes it
        pos, tok = groups[e]
        xe = x.detach()[tok].requires_grad_()
        gate, up = F.linear(xe, ex.gate_up_proj[e]).chunk(2, dim=-1)
        ye = F.linear(ex.act_fn(gate) * up, ex.down_proj[e]) * w[tok, pos, None]
        parts.append((tok, torch.autograd.grad(ye, xe, dy[tok])[0]))
    sums = {}
    for order in ("last first", "first first"):
        s = torch.zeros_like(want)
        for tok, d in (reversed(parts) if order == "last first" else parts):
            s.index_add_(0, tok, d)
        sums[order] = s
    assert torch.equal(sums["last first"], want) and not torch.equal(sums["first first"], want)
