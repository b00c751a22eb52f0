"""The ``fp8`` recipe under torch.compile as traced operations (mxtrain.linear.tracedfp8): the casts are the reference
quantizer's codes and scales bit for bit (eagerly and compiled by Inductor), a compiled layer or model gives
the eager path's outputs and gradients, the graph holds no mxtrain custom op, and the setting ``fp8_traced=off``
brings the custom op back. CPU runs ``torch._scaled_mm``'s CPU implementation with the device check forced
on; the cuda-marked tests compare the compiled casts with the Triton cast kernel on large tensors (where an
approximate float32 division of the scales would show) and a compiled model's training with the eager one."""

import pytest
import torch

import mxtrain
from mxtrain.linear import tensorfp8, tracedfp8
from mxtrain import mx_linear, settings
from mxtrain.numerics import recipes
from mxtrain.numerics.quant import quantize
from mxtrain.numerics.recipe import Operand, Recipe, Rotation

from compile_helpers import fwd_bwd, mlp_losses, ops_of

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# inductor's C++ (CPU) code generator honours emulate_precision_casts from torch 2.13 on (torch's
# codegen/cpp.py, pytorch#185337); before, its compiled bf16 casts may skip eager's rounding, so the tests that
# ask for eager's codes through that setting need 2.13 on a CPU (the Triton backend, on a GPU, has it earlier)
NEEDS_CPU_EMULATED_CASTS = pytest.mark.skipif(
    DEV == "cpu" and torch.torch_version.TorchVersion(torch.__version__) < (2, 13),
    reason="on a CPU, inductor's emulate_precision_casts needs torch >= 2.13 (its C++ backend ignores it before)")


@pytest.fixture
def fp8_on(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setattr(tensorfp8, "_fp8_capable", lambda device: True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tensor(M, K, dtype, seed=0, spread=20):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-spread, spread, (M, 1), generator=g).float())
    return x.to(DEV, dtype)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _same_as_reference(x, fmt, fn):
    codes, scale = fn(x, fmt)
    ref = quantize(x, fmt, axis=-1)
    assert codes.dtype == tracedfp8._DT[fmt]
    assert torch.equal(_bits(codes), _bits(ref.data)), fmt
    assert torch.equal(scale, ref.scales.to(torch.float32).reshape(())) or (scale.isnan() and ref.scales.isnan().all())


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_cast_is_the_reference_quantizer(fmt, dtype, compiled):
    torch._dynamo.reset()
    fn = torch.compile(tracedfp8.cast) if compiled else tracedfp8.cast
    x = _tensor(256, 128, dtype)
    x[0, 0], x[0, 1], x[1, 1] = -1e-30, 1e-30, 0.0          # signed zeros after rounding, an exact zero
    _same_as_reference(x, fmt, fn)
    # values exactly on the midpoints between two FP8 neighbours (ties to even) once multiplied by m = 1
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(tracedfp8._DT[fmt]).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([mids, -mids, grid]).to(DEV, torch.float32).reshape(1, -1)
    x = torch.cat([x, torch.full((1, x.shape[1]), float(grid.max()), device=DEV)])   # amax = max_elem: scale 1
    _same_as_reference(x.to(dtype), fmt, fn)   # (the midpoints hold at most 5 significant bits: exact in bf16)
    # all zeros (scale 1), a non-finite element (scale NaN, every code +0)
    _same_as_reference(torch.zeros(32, 16, device=DEV, dtype=dtype), fmt, fn)
    bad = _tensor(32, 16, dtype, seed=1)
    bad[3, 4] = float("nan")
    codes, scale = fn(bad, fmt)
    assert scale.isnan() and not _bits(codes).any()
    bad[3, 4] = float("inf")
    codes, scale = fn(bad, fmt)
    assert scale.isnan() and not _bits(codes).any()


def test_spec_takes_per_tensor_fp8_with_nearest_rounding_only():
    assert tracedfp8.spec(recipes.get("fp8")) == ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3", "fp8_e5m2",
                                                  "fp8_e4m3")
    assert tracedfp8.spec(recipes.get("mxfp4-all")) is None
    assert tracedfp8.spec(recipes.get("mxfp8")) is None
    base = {n: Operand(recipes.get("fp8").operand(n).fmt) for n in tensorfp8._OPS}
    sr = Recipe("sr", **{**base, "wgrad_dy": Operand("fp8_e5m2", rounding="stochastic")})
    pre = Recipe("pre", **{**base, "fprop_x": Operand("fp8_e4m3", prescale=0.75)})
    rot = Recipe("rot", **base, wgrad_rotation=Rotation(16, "none"))
    e5 = Recipe("e5", **{**base, "fprop_x": Operand("fp8_e5m2"), "fprop_w": Operand("fp8_e5m2")})
    part = Recipe("part", fprop_x=Operand("fp8_e4m3"), fprop_w=Operand("fp8_e4m3"))   # backward not quantized
    for r in (sr, pre, rot, e5, part):
        assert tracedfp8.spec(r) is None, r.name


def test_applies_needs_the_setting_fp8_tensor_cores_and_multiples_of_16(fp8_on, monkeypatch):
    f = tracedfp8.spec(recipes.get("fp8"))
    x, w = torch.zeros(4, 8, 32, device=DEV), torch.zeros(48, 32, device=DEV)
    assert tracedfp8.applies(f, x, w)
    assert not tracedfp8.applies(None, x, w)
    assert not tracedfp8.applies(f, torch.zeros(4, 8, 33, device=DEV), torch.zeros(48, 33, device=DEV))
    assert not tracedfp8.applies(f, x, torch.zeros(40, 32, device=DEV))
    assert not tracedfp8.applies(f, x.double(), w.double())
    # the settings are the dispatcher's to read (linear.compiled_form), which asks only where they allow it
    from mxtrain.linear.dispatch import compiled_form
    assert compiled_form(x, w, True, False, ",".join(f), "")[0] == "traced_fp8"
    with settings.override(fp8_traced="off"):
        assert compiled_form(x, w, True, False, ",".join(f), "")[0] != "traced_fp8"
    with settings.override(fast=False):
        assert compiled_form(x, w, True, False, ",".join(f), "")[0] != "traced_fp8"
    monkeypatch.setattr(tensorfp8, "_fp8_capable", lambda device: False)
    assert not tracedfp8.applies(f, x, w)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amp", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_layer_is_traced_and_equals_eager(bias, amp, dtype, fp8_on):
    x = _tensor(64, 96, dtype, spread=4)
    w = (_tensor(48, 96, torch.float32, seed=2, spread=1) / 10)
    b = _tensor(1, 48, torch.float32, seed=3, spread=1).reshape(48) if bias else None
    gy = _tensor(64, 48, torch.bfloat16 if (amp or dtype == torch.bfloat16) else torch.float32, seed=4, spread=2)

    def f(a, c, d):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=amp):
            return mx_linear(a, c, d, recipe="fp8")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops = ops_of(f, xg, wg, b)
    assert not any("mxtrain" in o for o in ops) and any("autograd_function_apply" in o for o in ops), ops
    eager = fwd_bwd(x, w, b, gy, f)
    torch._dynamo.reset()
    got = fwd_bwd(x, w, b, gy, torch.compile(f, fullgraph=True))
    for i, (g, r) in enumerate(zip(got, eager)):
        if i < 3:
            assert torch.equal(g, r), (i, (g - r).abs().max())
        else:   # db: a float32 sum over tokens (another summation order when compiled)
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    with settings.override(fp8_traced="off"):
        assert any("mxtrain.linear" in o for o in ops_of(f, xg, wg, b))


@NEEDS_CPU_EMULATED_CASTS
def test_compiled_model_trains_like_eager_without_recompiles(fp8_on):
    """A converted MLP under ``torch.compile(fullgraph=True)``, 6 steps of AdamW in a plain loop under bf16
    autocast: the same losses as eagerly, one graph (no recompile after the first step). With inductor's
    ``emulate_precision_casts``: by default inductor may fuse a cast into the GELU producing its input and
    read the GELU's float32 value before its bf16 rounding (as for any compiled bf16 code), and the codes of
    those elements then differ from eager's (docs/library.md)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as ic

    eager = mlp_losses("fp8", False, DEV)
    torch._dynamo.reset()
    counters.clear()
    with ic.patch(emulate_precision_casts=True):
        got = mlp_losses("fp8", True, DEV)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert eager[-1] < eager[0] * 0.9
    # biases' gradients are float32 sums in another order when compiled: the losses agree to float32 rounding
    for a, b in zip(got, eager):
        assert abs(a - b) <= 1e-4 * abs(b), (got, eager)


@pytest.mark.cuda
def test_compiled_casts_equal_the_cast_kernel_on_large_tensors():
    """Inductor's Triton code for ``cast`` against the Triton cast kernel (the definition bit for bit) on 2**24
    elements of each kind (the 0-d quotients computed by the compiler, the products and the saturating casts
    in its kernels)."""
    from mxtrain.kernels.fp8cast import quantize_tensor_fp8
    torch._dynamo.reset()
    fn = torch.compile(tracedfp8.cast)
    for dtype in (torch.float32, torch.bfloat16):
        for fmt in ("fp8_e4m3", "fp8_e5m2"):
            x = torch.randn(4096, 4096, device="cuda", dtype=dtype) * 3.7
            c, s = fn(x, fmt)
            kc, ks = quantize_tensor_fp8(x, fmt)
            assert torch.equal(s, ks)
            assert torch.equal(_bits(c), _bits(kc)), (dtype, fmt, (_bits(c) != _bits(kc)).sum().item())


@pytest.mark.cuda
def test_compiled_layer_on_the_gpu_equals_the_eager_fast_path():
    """Llama-like shapes under bf16 autocast: the compiled traced layer and the eager layer (Triton casts,
    X's codes kept) give the same output and gradients: same codes, same GEMMs."""
    torch.manual_seed(0)
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 1024, device="cuda") / 32
    gy = torch.randn(2048, 3072, device="cuda", dtype=torch.bfloat16) * 1e-2

    def f(a, c, d):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return mx_linear(a, c, d, recipe="fp8")
    eager = fwd_bwd(x, w, None, gy, f)
    torch._dynamo.reset()
    got = fwd_bwd(x, w, None, gy, torch.compile(f, fullgraph=True))
    for i, (g, r) in enumerate(zip(got, eager)):
        assert torch.equal(g, r), (i, ((g - r).norm() / r.norm()).item())


def test_hf_llama_with_fp8_compiles_to_traced_layers(fp8_on):
    """A Hugging Face Llama built from a config, converted with ``fp8``, in a plain loop with fused AdamW:
    under ``torch.compile(fullgraph=True)`` one graph with no mxtrain custom op (the traced layers), and the
    same losses as eager training."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    def run(compiled):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg).to(DEV)
        mxtrain.convert(model, "fp8")
        ops = []

        def backend(gm, example_inputs):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm
        f = torch.compile(model, fullgraph=True, backend=backend) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses = []
        for s in range(3):
            ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(s)).to(DEV)
            loss = f(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, ops
    eager, _ = run(False)
    torch._dynamo.reset()
    counters.clear()
    got, ops = run(True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    assert any("autograd_function_apply" in o for o in ops) and not any("mxtrain" in o for o in ops), ops
    assert got == pytest.approx(eager, rel=1e-6)


TORCHAO_NUMERICS = dict(fp8_fast_accum="fprop", fp8_autocast="autocast")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=NEEDS_CPU_EMULATED_CASTS)])
def test_fp8_autocast_casts_the_input_and_writes_dw_in_bf16(compiled, fp8_on):
    """Setting ``fp8_autocast=autocast`` under bf16 autocast: the layer computes what the default computes for
    the input cast to bf16 first (output, dX through the cast's backward), and dW is that dW rounded to bf16
    (written so by its GEMM): eagerly, and compiled (the traced layer; with inductor's
    ``emulate_precision_casts``, else it may fuse the bf16 cast into the FP8 cast and read the float32 value:
    docs/library.md). Without the setting dW is not bf16."""
    from torch._inductor import config as ic
    x = _tensor(64, 96, torch.float32, spread=4)
    w = _tensor(48, 96, torch.float32, seed=2, spread=1) / 10
    gy = _tensor(64, 48, torch.bfloat16, seed=4, spread=2)

    def f(a, c, d):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            return mx_linear(a, c, d, recipe="fp8")

    def f_cast(a, c, d):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            return mx_linear(a.to(torch.bfloat16), c, d, recipe="fp8")
    want = fwd_bwd(x, w, None, gy, f_cast)
    plain = fwd_bwd(x, w, None, gy, f)
    with settings.override(fp8_autocast="autocast"), ic.patch(emulate_precision_casts=True):
        torch._dynamo.reset()
        got = fwd_bwd(x, w, None, gy, torch.compile(f, fullgraph=True) if compiled else f)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2].to(torch.bfloat16).float())
    assert not torch.equal(plain[2], plain[2].to(torch.bfloat16).float())   # (the default keeps float32 dW)
    assert not torch.equal(plain[1], got[1])   # (dX of the float32 input: float32, the cast's widens bf16)


def test_fp8_settings_leave_other_recipes_alone(fp8_on):
    """``fp8_autocast`` and ``fp8_fast_accum`` act on per-tensor FP8 layers only: an ``mxfp4-all`` layer and a
    recipe mixing FP8 with MXFP4 operands give the same outputs and gradients with them on."""
    x = _tensor(64, 96, torch.float32, spread=4)
    w = _tensor(48, 96, torch.float32, seed=2, spread=1) / 10
    gy = _tensor(64, 48, torch.bfloat16, seed=4, spread=2)
    mixed = Recipe(name="fp8-x-mxfp4-w", fprop_x=Operand("fp8_e4m3"), fprop_w=Operand("mxfp4"))
    for r in ("mxfp4-all", mixed):
        def f(a, c, d, r=r):
            with torch.autocast(DEV, dtype=torch.bfloat16):
                return mx_linear(a, c, d, recipe=r)
        want = fwd_bwd(x, w, None, gy, f)
        with settings.override(**TORCHAO_NUMERICS):
            got = fwd_bwd(x, w, None, gy, f)
        for g, e in zip(got, want):
            assert torch.equal(g, e), r


@pytest.mark.cuda
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_with_torchao_numerics_is_torchao_float8_tensorwise(bias):
    """mxtrain's ``fp8`` with ``fp8_fast_accum=fprop`` and ``fp8_autocast=autocast`` computes what torchao's
    float8 tensorwise ``Float8Linear`` (its default config) computes, bit for bit: a float32 input (as a norm
    under autocast gives) and float32 master weight under bf16 autocast, output, dX and dW, eagerly. A bias is
    the exception: torchao adds it to the bf16 output in bf16 (two roundings) and sums db in bf16; mxtrain adds
    it in float32 (one rounding) and sums db in float32, so there the output agrees to one bf16 rounding and db
    to bf16's precision. mxtrain's compiled layer gives its eager numbers (with inductor's
    ``emulate_precision_casts``). With mxtrain's defaults dW differs (float32, not rounded to bf16) and dX
    differs (the float32 input quantized as given)."""
    pytest.importorskip("torchao", minversion="0.18.0")
    import copy

    from torch._inductor import config as ic

    from torchao.float8 import convert_to_float8_training
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(1024, 768, bias=bias)).cuda()
    with torch.no_grad():
        lin[0].weight.mul_(3.0)
    tao = copy.deepcopy(lin)
    convert_to_float8_training(tao)
    ours = copy.deepcopy(lin)
    mxtrain.convert(ours, "fp8", skip=())
    x = torch.randn(4, 512, 1024, device="cuda") * 2.5
    gy = torch.randn(4, 512, 768, device="cuda", dtype=torch.bfloat16) * 1e-2

    def run(m):
        m.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(xg)
        y.backward(gy)
        return [y, xg.grad] + [p.grad for p in m.parameters()]
    want = run(tao)
    with settings.override(**TORCHAO_NUMERICS):
        got = run(ours)
        torch._dynamo.reset()
        with ic.patch(emulate_precision_casts=True):
            comp = run(torch.compile(ours))
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for i, (g, e, c) in enumerate(zip(got, want, comp)):
        if i < 3:
            assert torch.equal(c, g), i
        if bias and i == 0:   # (one bf16 rounding of the output apart: 2**-8 of it, and the bias's)
            err = (g.float() - e.float()).abs()
            assert (err <= (e.float().abs() + ours[0].bias.detach().abs()) * 2.0 ** -7).all(), err.max()
        elif bias and i == 3:
            torch.testing.assert_close(g, e, rtol=2.0 ** -7, atol=1e-6)
        else:
            assert torch.equal(g, e), (i, ((g.float() - e.float()).norm() / e.float().norm()).item())
    plain = run(ours)
    assert not torch.equal(plain[1], want[1]) and not torch.equal(plain[2], want[2])


def test_fp8_fast_accum_reaches_the_forward_gemm_only(fp8_on, monkeypatch):
    """``fp8_fast_accum=fprop``: the forward GEMM is called with ``use_fast_accum=True``, Dgrad and Wgrad with
    False, on the eager path (the reference's FP8 route) and in the traced layer; by default every call False.
    (On CPU ``torch._scaled_mm`` accumulates in float32 either way, so the calls are what is checked.)"""
    calls = []
    real = torch._scaled_mm

    def spy(*a, **kw):
        calls.append(bool(kw.get("use_fast_accum", False)))
        return real(*a, **kw)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = _tensor(64, 96, torch.float32, spread=4)
    w = _tensor(48, 96, torch.float32, seed=2, spread=1) / 10
    gy = _tensor(64, 48, torch.bfloat16, seed=4, spread=2)
    fmts = tracedfp8.spec(recipes.get("fp8"))

    def eager(a, c, d):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            return mx_linear(a, c, d, recipe="fp8")

    def traced(a, c, d):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            return tracedfp8.linear(a, c, d, fmts)
    for f in (eager, traced):
        for setting, want in (("off", [False, False, False]), ("fprop", [True, False, False])):
            calls.clear()
            with settings.override(fp8_fast_accum=setting):
                fwd_bwd(x, w, None, gy, f)
            assert calls == want, (f.__name__, setting, calls)
