"""MXLinear and convert: plumbing against F.linear, every preset against an independent float64
computation on the reference fake-quantized operands, gradcheck, HF-style conversion."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mxtrain
from mxtrain import MXLinear, Recipe, Rotation
from mxtrain.numerics import recipes, rng
from mxtrain.numerics.hadamard import rotation_signs
from mxtrain.numerics.recipe import GEMMS, OPERANDS

from numerics_helpers import FP32_TOL, sqnr_db

QUANTIZED = [n for n in recipes.names() if recipes.get(n).quantized]


def make_layer(recipe, k=64, n=48, layer_id=2, seed=5, dtype=torch.float32):
    r = recipes.get(recipe).with_(seed=seed) if isinstance(recipe, str) else recipe
    torch.manual_seed(0)
    return MXLinear(k, n, bias=True, recipe=r, layer_id=layer_id, dtype=dtype)


def run(layer, x, dy):
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


# ------------------------------------------------------------------------------------------------
# expected results, built here from the documented definition (nn.py module docstring)


def expected(recipe: Recipe, layer_id: int, step: int, call: int, x, w, b, dy):
    """float64 (Y, dX, dW, db) from the reference fake-quantized operands."""
    def signs(gemm):
        rot = recipe.rotation(gemm)
        if not rot.enabled:
            return None
        return rotation_signs(rot.size, rot.signs, seed=recipe.seed, layer=layer_id,
                              gemm=GEMMS.index(gemm), step=step)

    def q(t, axis, name, gemm):
        op, rot = recipe.operand(name), recipe.rotation(gemm)
        t = t.detach().to(torch.float32)
        if rot.enabled:
            pad = (-t.shape[axis]) % rot.size
            zshape = list(t.shape)
            zshape[axis] = pad
            t = torch.cat([t, t.new_zeros(zshape)], dim=axis)
            t = mxtrain.hadamard(t, rot.size, axis=axis, signs=signs(gemm))
        p = 1.0
        if op.quantized:
            seed = None
            if op.rounding == "stochastic":
                seed = rng.stream_key(recipe.seed, layer_id, OPERANDS.index(name), step, call)
            t = mxtrain.quantize(t, op.fmt, axis=axis, block_size=(16, 16) if op.block_2d else None,
                                 rounding=op.rounding, scale_rule=op.scale_rule, seed=seed,
                                 prescale=op.prescale).dequantize()
            p = op.prescale
        return t.double(), p

    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    (a, pa), (bq, pb) = q(x2, -1, "fprop_x", "fprop"), q(w, -1, "fprop_w", "fprop")
    y = a @ bq.T / (pa * pb) + b.double()
    (a, pa), (bq, pb) = q(dy2, -1, "dgrad_dy", "dgrad"), q(w, 0, "dgrad_w", "dgrad")
    dx = a @ bq / (pa * pb)
    (a, pa), (bq, pb) = q(dy2, 0, "wgrad_dy", "wgrad"), q(x2, 0, "wgrad_x", "wgrad")
    dw = a.T @ bq / (pa * pb)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, dy2.double().sum(0)


def close(actual, exp, what):
    scale = exp.abs().max().item() or 1.0
    torch.testing.assert_close(actual.double(), exp, rtol=FP32_TOL["rtol"], atol=FP32_TOL["atol"] * scale,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", QUANTIZED)
def test_preset_equals_float64_gemms_on_reference_operands(name):
    layer = make_layer(name)
    layer.set_step(3)
    x = torch.randn(2, 20, 64)
    dy = torch.randn(2, 20, 48)
    run(layer, x, dy)  # call 0 of step 3; the checked call is 1 (different SR streams)
    y, dx, dw, db = run(layer, x, dy)
    ey, edx, edw, edb = expected(layer.recipe, 2, 3, 1, x, layer.weight, layer.bias, dy)
    close(y, ey, f"{name} Y")
    close(dx, edx, f"{name} dX")
    close(dw, edw, f"{name} dW")
    close(db, edb, f"{name} db")
    # and the quantization really happened (not the exact result) in every quantized GEMM
    x2, dy2, w = x.reshape(40, 64).double(), dy.reshape(40, 48).double(), layer.weight.double()
    r = layer.recipe
    for got, exact, ops in ((y.reshape(40, 48), x2 @ w.T + layer.bias.double(), ("fprop_x", "fprop_w")),
                            (dx.reshape(40, 64), dy2 @ w, ("dgrad_dy", "dgrad_w")),
                            (dw, dy2.T @ x2, ("wgrad_dy", "wgrad_x"))):
        quantized = any(r.operand(o).quantized for o in ops)
        assert (sqnr_db(exact, got) < 60) == quantized, ops


def test_expected_operands_catch_a_wrong_seed():
    # the check above is sharp: another call number gives other SR bits and fails it
    layer = make_layer("tseng")
    x, dy = torch.randn(40, 64), torch.randn(40, 48)
    _, dx, _, _ = run(layer, x, dy)
    _, edx, _, _ = expected(layer.recipe, 2, 0, 1, x, layer.weight, layer.bias, dy)
    with pytest.raises(AssertionError):
        close(dx, edx, "wrong call")


def test_bf16_recipe_is_f_linear():
    layer = make_layer("bf16")
    x, dy = torch.randn(3, 5, 64), torch.randn(3, 5, 48)
    y, dx, dw, db = run(layer, x, dy)
    xr = x.clone().requires_grad_(True)
    w = layer.weight.detach().clone().requires_grad_(True)
    bb = layer.bias.detach().clone().requires_grad_(True)
    yr = F.linear(xr, w, bb)
    yr.backward(dy)
    assert torch.equal(y, yr.detach()) and torch.equal(dx, xr.grad)
    assert torch.equal(dw, w.grad) and torch.equal(db, bb.grad)


ROT_ONLY = Recipe("rot-only", fprop_rotation=Rotation(16, "per_step"), dgrad_rotation=Rotation(32, "fixed"),
                  wgrad_rotation=Rotation(64, "per_layer"), seed=1)


def test_rotation_without_quantization_matches_f_linear():
    layer = make_layer(ROT_ONLY, k=40, n=24)  # odd sizes: every rotation pads its axis
    layer.set_step(7)
    x, dy = torch.randn(3, 7, 40), torch.randn(3, 7, 24)
    y, dx, dw, db = run(layer, x, dy)
    xr = x.double().requires_grad_(True)
    w = layer.weight.detach().double().requires_grad_(True)
    yr = F.linear(xr, w, layer.bias.detach().double())
    yr.backward(dy.double())
    close(y, yr.detach(), "Y")
    close(dx, xr.grad, "dX")
    close(dw, w.grad, "dW")
    # float64 inputs stay float64: equal to F.linear to float64 rounding
    layer64 = make_layer(ROT_ONLY, k=40, n=24, dtype=torch.float64)
    y64, dx64, dw64, _ = run(layer64, x.double(), dy.double())
    assert y64.dtype == dx64.dtype == dw64.dtype == torch.float64
    torch.testing.assert_close(y64, F.linear(x.double(), layer64.weight, layer64.bias).detach(), rtol=1e-12, atol=1e-12)


def test_gradcheck_unquantized_rotated_path():
    layer = make_layer(ROT_ONLY, k=10, n=6, dtype=torch.float64)  # small: gradcheck perturbs every entry
    x = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return mxtrain.linear.reference.apply(x, w, b, mxtrain.linear.context.Ctx(ROT_ONLY, 0, 4, 0))

    w = layer.weight.detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradcheck(layer, (x,))


@pytest.mark.parametrize("name", recipes.names())
def test_every_preset_runs_with_bias_and_batch_dims(name):
    layer = MXLinear(40, 24, recipe=name)
    x = torch.randn(2, 3, 5, 40, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 3, 5, 24) and y.dtype == torch.float32
    y.square().sum().backward()
    assert x.grad.shape == x.shape and layer.weight.grad.shape == (24, 40) and layer.bias.grad.shape == (24,)
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    ref = F.linear(x.detach(), layer.weight.detach(), layer.bias.detach())
    assert sqnr_db(ref, y) > 12  # MXFP4 with a plain floor scale gives ~17 dB on Gaussian data
    layer_nb = MXLinear(40, 24, bias=False, recipe=name)
    layer_nb(x).sum().backward()


def test_autocast_bf16_output():
    layer = make_layer("mxfp4-all")
    x = torch.randn(40, 64)
    y32 = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = layer(x)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.float(), y32.detach(), rtol=1e-2, atol=1e-2 * y32.abs().max().item())


def test_steps_and_calls_select_random_streams():
    x, dy = torch.randn(40, 64), torch.randn(40, 48)
    # per-step signs: the output changes with the step; deterministic Hadamard does not
    rht, dh = make_layer("mxfp4-all-rht16"), make_layer("mxfp4-all-dh16")
    y0, y0d = rht(x).detach(), dh(x).detach()
    mxtrain.set_step(rht, 1)
    mxtrain.set_step(dh, 1)
    assert not torch.equal(rht(x), y0) and torch.equal(dh(x), y0d)
    # stochastic rounding: a new call draws new bits; set_step resets the call counter
    t = make_layer("tseng")
    g0 = run(t, x, dy)[1]
    g1 = run(t, x, dy)[1]
    t.set_step(0)
    g0b = run(t, x, dy)[1]
    assert not torch.equal(g0, g1) and torch.equal(g0, g0b)


def test_nvfp4_weight_tiles_are_the_same_in_fprop_and_dgrad():
    r = recipes.get("nvfp4")
    w = torch.randn(48, 64)
    ctx = mxtrain.linear.context.Ctx(r, 0, 0, 0)
    wf, _ = ctx.operand(w, -1, "fprop_w", "fprop", None)
    wd, _ = ctx.operand(w, 0, "dgrad_w", "dgrad", None)
    assert torch.equal(wf, wd)


def test_operand_seed_helper_is_the_documented_derivation():
    for name in OPERANDS:
        assert mxtrain.linear.module.operand_seed(9, 3, name, 4, 2) == rng.stream_key(9, 3, OPERANDS.index(name), 4, 2)


# ------------------------------------------------------------------------------------------------
# convert on a small HF-Llama-like module tree


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, h):
        a = torch.softmax(self.q_proj(h) @ self.k_proj(h).transpose(-1, -2) / h.shape[-1] ** 0.5, -1)
        return self.o_proj(a @ self.v_proj(h))


class MLP(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Block(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn, self.mlp = Attn(d), MLP(d, f)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Inner(nn.Module):
    def __init__(self, v, d, f, n):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, d)
        self.layers = nn.ModuleList(Block(d, f) for _ in range(n))
        self.norm = nn.LayerNorm(d)


class TinyLlama(nn.Module):
    def __init__(self, v=50, d=32, f=64, n=4):
        super().__init__()
        self.model = Inner(v, d, f, n)
        self.lm_head = nn.Linear(d, v, bias=False)

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for blk in self.model.layers:
            h = blk(h)
        return self.lm_head(self.model.norm(h))


PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def kinds(model):
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_convert_swaps_exactly_the_block_linears_and_shares_parameters():
    model = TinyLlama()
    params_before = {n: p for n, p in model.named_parameters()}
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert mxtrain.convert(model, "mxfp4-all").model is model
    k = kinds(model)
    assert k.pop("lm_head") is nn.Linear
    assert set(k) == {f"model.layers.{i}.{p}" for i in range(4) for p in PROJ}
    assert all(t is MXLinear for t in k.values())
    assert type(model.model.embed_tokens) is nn.Embedding
    after = dict(model.named_parameters())
    assert after.keys() == params_before.keys()
    assert all(after[n] is p for n, p in params_before.items())
    assert model.state_dict().keys() == sd_before.keys()  # checkpoints load either way
    model.load_state_dict(sd_before)
    ids = [m.layer_id for _, m in mxtrain.linear.module.mx_layers(model)]
    assert ids == list(range(28))
    # an optimizer built before convert trains the converted model
    w0 = model.model.layers[1].mlp.up_proj.weight.detach().clone()
    loss = F.cross_entropy(model(torch.randint(0, 50, (2, 16))).flatten(0, 1), torch.randint(0, 50, (32,)))
    loss.backward()
    opt.step()
    assert not torch.equal(model.model.layers[1].mlp.up_proj.weight, w0)


def test_convert_keep_first_last_hp_and_skip():
    model = mxtrain.convert(TinyLlama().eval(), "nvfp4").model  # keep_first=1, keep_last=1
    k = kinds(model)
    for i in range(4):
        for p in PROJ:
            assert k[f"model.layers.{i}.{p}"] is (MXLinear if i in (1, 2) else nn.Linear), (i, p)
    assert not model.model.layers[1].mlp.up_proj.training  # eval mode is kept
    r = recipes.get("mxfp4-all").with_(keep_hp=("*.o_proj", "model.layers.2.mlp.*"), keep_last=1)
    k = kinds(mxtrain.convert(TinyLlama(), r).model)
    for i in range(4):
        for p in PROJ:
            hp = i == 3 or p.endswith("o_proj") or (i == 2 and p.startswith("mlp"))
            assert k[f"model.layers.{i}.{p}"] is (nn.Linear if hp else MXLinear), (i, p)
    k = kinds(mxtrain.convert(TinyLlama(), "mxfp4-all", skip=("*k_proj",)).model)
    assert k["lm_head"] is MXLinear  # a custom skip replaces the default list
    assert all(t is nn.Linear for n, t in k.items() if n.endswith("k_proj"))
    assert sum(t is MXLinear for t in k.values()) == 4 * 6 + 1
    with pytest.raises(ValueError, match="valid recipes"):
        mxtrain.convert(TinyLlama(), "mxfp9")
    with pytest.raises(TypeError):
        mxtrain.convert(object(), "bf16")
