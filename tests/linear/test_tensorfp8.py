"""The ``fp8`` recipe's GEMMs on FP8 tensor cores (mxtrain.linear.tensorfp8): the reference's own FP8 codes and
per-tensor scales multiplied by ``torch._scaled_mm``. Against the float32 reference (dequantize, then
multiply): outputs and gradients equal up to float32 rounding, in every GEMM (E4M3 x E4M3 Fprop, E5M2 x E4M3
Dgrad and Wgrad), eagerly and under torch.compile. CPU runs the same code (``_scaled_mm`` has a CPU
implementation) with the device check forced on; the cuda-marked test runs it where it is used."""

import pytest
import torch

from mxtrain.linear import tensorfp8
from mxtrain import mx_linear
from mxtrain.numerics import recipes
from mxtrain.linear import reference as _ref_linear
from mxtrain.linear import call_context
from mxtrain.numerics.recipe import Operand, Recipe, Rotation

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(M, K, N, dtype, seed=0, nan=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-6, 6, (M, 1), generator=g).float()))
    w = torch.randn(N, K, generator=g) / K**0.5
    gy = torch.randn(M, N, generator=g) * 1e-3
    if nan:
        x[3, 5] = float("nan")
    return x.to(DEV, dtype), w.to(DEV, dtype), gy.to(DEV, dtype)


def _fwd_bwd(x, w, gy, fn):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(gy)
    return [t.detach().float() for t in (y, x.grad, w.grad)]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.fixture
def fp8_on(monkeypatch):
    if DEV == "cpu":
        monkeypatch.setattr(tensorfp8, "_fp8_capable", lambda device: True)


def _reference(monkeypatch):
    monkeypatch.setattr(tensorfp8, "_fp8_capable", lambda device: False)


@pytest.mark.parametrize("shape", [(64, 96, 48), (128, 256, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_equals_the_float32_reference(shape, dtype, fp8_on, monkeypatch):
    rec = recipes.get("fp8")
    x, w, gy = _case(*shape, dtype)
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (calls.append(a[0].dtype), real(*a, **k))[1])
    got = _fwd_bwd(x, w, gy, lambda a, b: _ref_linear.apply(a, b, None, call_context(rec, None)))
    # Fprop E4M3 x E4M3, Dgrad E5M2 x E4M3, Wgrad E5M2 x E4M3: all three GEMMs on FP8 codes
    assert calls == [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e5m2]
    monkeypatch.setattr(torch, "_scaled_mm", real)
    _reference(monkeypatch)
    want = _fwd_bwd(x, w, gy, lambda a, b: _ref_linear.apply(a, b, None, call_context(rec, None)))
    # CPU: float32 rounding apart. Hopper's FP8 tensor cores accumulate with less than float32's precision
    # (relative differences about 1e-4 seen on an H100), the same for every FP8 GEMM, torchao's included.
    tol = 2e-6 if DEV == "cpu" else 5e-4
    for g, r in zip(got, want):
        assert _rel(g, r) < (tol if dtype == torch.float32 else 1e-2)


def test_codes_are_the_reference_quantizer(fp8_on):
    from mxtrain.numerics.quant import quantize
    rec = recipes.get("fp8")
    x, w, _ = _case(64, 96, 48, torch.float32)
    q = call_context(rec, None)
    for axis in (-1, 0):
        codes, scale, _ = tensorfp8.codes(q, x, axis, "fprop_x")
        ref = quantize(x, "fp8_e4m3", axis=axis)
        assert torch.equal(codes.float(), ref.data.float().contiguous()) and codes.is_contiguous()
        assert torch.equal(scale, ref.scales.float().reshape(()))
        # the reduction axis is last: (M, K) along -1, (K, M) along 0
        assert codes.shape == (x.shape if axis == -1 else x.t().shape)


def test_non_finite_input_gives_nan_like_the_reference(fp8_on, monkeypatch):
    rec = recipes.get("fp8")
    x, w, _ = _case(32, 64, 16, torch.float32, nan=True)
    y = mx_linear(x, w, recipe=rec)
    _reference(monkeypatch)
    y_ref = mx_linear(x, w, recipe=rec)
    assert torch.isnan(y).all() and torch.isnan(y_ref).all()


def test_where_it_does_not_apply():
    rec = recipes.get("fp8")
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    # shapes not multiples of 16, a rotation, two E5M2 operands, a CPU device: the float32 reference
    assert not tensorfp8.applies(rec, "fprop_x", "fprop_w", "fprop", 33, 48, 64, device=dev)
    rot = Recipe("fp8rot", **{n: Operand(rec.operand(n).fmt) for n in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w",
                                                                     "wgrad_dy", "wgrad_x")},
                 fprop_rotation=Rotation(16, "none"))
    assert not tensorfp8.applies(rot, "fprop_x", "fprop_w", "fprop", 64, 48, 64, device=dev)
    e5 = Recipe("e5", fprop_x=Operand("fp8_e5m2"), fprop_w=Operand("fp8_e5m2"))
    assert not tensorfp8.applies(e5, "fprop_x", "fprop_w", "fprop", 64, 48, 64, device=dev)
    assert not tensorfp8.applies(rec, "fprop_x", "fprop_w", "fprop", 64, 48, 64, device=torch.device("cpu"))
    assert not tensorfp8.applies(recipes.get("mxfp4-all"), "fprop_x", "fprop_w", "fprop", 64, 48, 64, device=dev)


def test_compiled_equals_eager(fp8_on):
    x, w, gy = _case(64, 96, 48, torch.float32)
    eager = _fwd_bwd(x, w, gy, lambda a, b: mx_linear(a, b, recipe="fp8"))
    torch._dynamo.reset()
    comp = torch.compile(lambda a, b: mx_linear(a, b, recipe="fp8"), fullgraph=True)
    got = _fwd_bwd(x, w, gy, comp)
    for g, r in zip(got, eager):
        assert torch.equal(g, r)


@pytest.mark.cuda
def test_fp8_recipe_trains_on_the_gpu_like_the_reference(monkeypatch):
    """A small MLP, 20 steps of fused AdamW under bf16 autocast: the FP8 tensor-core path and the float32
    reference end at the same loss (float32 rounding apart)."""
    import mxtrain

    def train(ref):
        if ref:
            _reference(monkeypatch)
        else:
            monkeypatch.undo()
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
        mxtrain.convert(m, "fp8", skip=())
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        target = torch.randn(256, 256, device="cuda", generator=g) / 16
        for _ in range(20):
            x = torch.randn(512, 256, device="cuda", generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = (m(x).float() - x @ target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()
    fast, ref = train(False), train(True)
    assert abs(fast - ref) <= 1e-3 * abs(ref) + 1e-6, (fast, ref)


def test_x_and_dy_are_quantized_once(fp8_on, monkeypatch):
    """Per-tensor scaling does not depend on the axis: the ``fp8`` recipe's X (E4M3, for Fprop and Wgrad) is
    quantized once, in the forward, which keeps its FP8 codes for the backward instead of X; dY (E5M2, for
    Dgrad and Wgrad) once in the backward. Outputs and gradients equal those of quantizing each twice."""
    rec = recipes.get("fp8")
    assert tensorfp8.shares_codes(rec, "dgrad_dy", "wgrad_dy")
    assert not tensorfp8.shares_codes(rec, "fprop_x", "dgrad_dy")            # E4M3 vs E5M2
    sr = Recipe("sr", dgrad_dy=Operand("fp8_e5m2", rounding="stochastic"),
                wgrad_dy=Operand("fp8_e5m2", rounding="stochastic"))
    assert not tensorfp8.shares_codes(sr, "dgrad_dy", "wgrad_dy")            # one stream per operand
    x, w, gy = _case(64, 96, 48, torch.float32)
    real = tensorfp8.codes
    names = []
    monkeypatch.setattr(tensorfp8, "codes", lambda q, t, axis, name: (names.append(name), real(q, t, axis, name))[1])
    kept = []

    def pack(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        once = _fwd_bwd(x, w, gy, lambda a, b: _ref_linear.apply(a, b, None, call_context(rec, None)))
    assert sorted(names) == sorted(["fprop_x", "fprop_w", "dgrad_dy", "dgrad_w"])
    assert (torch.float8_e4m3fn, (64, 96)) in kept and (x.dtype, (64, 96)) not in kept   # X's codes, not X
    monkeypatch.setattr(tensorfp8, "shares_codes", lambda *a: False)
    names.clear()
    twice = _fwd_bwd(x, w, gy, lambda a, b: _ref_linear.apply(a, b, None, call_context(rec, None)))
    assert "wgrad_dy" in names and "wgrad_x" in names
    for a, b in zip(once, twice):
        assert torch.equal(a, b)


def test_compiled_layer_keeps_x_codes_not_x(fp8_on):
    """Under torch.compile (the ``mxtrain::linear`` op, ``fp8_traced=off``) the ``fp8`` layer also keeps X's
    FP8 codes and scale for the backward instead of X, with the same gradients as eagerly."""
    from mxtrain import settings
    with settings.override(fp8_traced="off"):
        _compiled_layer_keeps_x_codes_not_x()


def _compiled_layer_keeps_x_codes_not_x():
    x, w, gy = _case(64, 96, 48, torch.float32)
    eager = _fwd_bwd(x, w, gy, lambda a, b: mx_linear(a, b, recipe="fp8"))
    torch._dynamo.reset()
    comp = torch.compile(lambda a, b: mx_linear(a, b, recipe="fp8"), backend="aot_eager", fullgraph=True)
    kept = []

    def pack(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = _fwd_bwd(x, w, gy, comp)
    assert (torch.float8_e4m3fn, (64, 96)) in kept and (torch.float32, (64, 96)) not in kept, kept
    for g, r in zip(got, eager):
        assert torch.equal(g, r)


def test_wgrad_x_backward_keeps_x_instead_of_codes(fp8_on):
    """``wgrad_x=backward`` keeps X itself for the backward (as on the fast path), eagerly and compiled, with
    the same gradients."""
    from mxtrain import settings
    x, w, gy = _case(64, 96, 48, torch.float32)
    base = _fwd_bwd(x, w, gy, lambda a, b: mx_linear(a, b, recipe="fp8"))
    for compiled in (False, True):
        torch._dynamo.reset()
        f = (torch.compile(lambda a, b: mx_linear(a, b, recipe="fp8"), backend="aot_eager", fullgraph=True)
             if compiled else (lambda a, b: mx_linear(a, b, recipe="fp8")))
        kept = []

        def pack(t):
            kept.append((t.dtype, tuple(t.shape)))
            return t
        with settings.override(wgrad_x="backward", fp8_traced="off"), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = _fwd_bwd(x, w, gy, f)
        assert (torch.float32, (64, 96)) in kept and (torch.float8_e4m3fn, (64, 96)) not in kept, (compiled, kept)
        for g, r in zip(got, base):
            assert torch.equal(g, r)


def test_gemm_writes_the_final_dtype_directly(fp8_on):
    """Where the caller casts the product to bf16 next and no prescale divides it, the FP8 GEMM writes bf16
    itself (no float32 output and cast pass): on CPU the very bits of the float32 product cast to bf16; on a
    GPU the same up to the accumulation order (the GEMM may pick another algorithm for a bf16 output)."""
    from mxtrain.linear.context import Ctx
    rec = recipes.get("fp8")
    x, w, _ = _case(64, 96, 48, torch.bfloat16)
    q = Ctx(rec, layer=0, step=0, call=0)
    ref = tensorfp8.scaled_mm(q, x, -1, "fprop_x", w, -1, "fprop_w", torch.float32).to(torch.bfloat16)
    got = tensorfp8.scaled_mm(q, x, -1, "fprop_x", w, -1, "fprop_w", torch.float32, final_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    if DEV == "cpu":
        assert torch.equal(got, ref)
    else:
        assert _rel(got.float(), ref.float()) < 5e-3
    # a float32 (or absent) final dtype keeps the float32 product
    f32 = tensorfp8.scaled_mm(q, x, -1, "fprop_x", w, -1, "fprop_w", torch.float32, final_dtype=torch.float32)
    assert f32.dtype == torch.float32
