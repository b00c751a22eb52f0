"""The fast MXLinear path (mxtrain.linear.fast) equals the reference MXLinear autograd function.

On CPU the kernels run in Triton's interpreter and the GEMM path is dequantize + matmul, so the
fast path multiplies the same float32 values as the reference: results agree to fp32 rounding.
On a GPU (``cuda`` tests) the sm_90 FP8-carrier GEMMs give bf16 outputs: agreement within bf16
output rounding.
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain import MXLinear
from mxtrain.numerics import recipes  # noqa: E402
from mxtrain.linear import fast
from mxtrain import settings  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.linear.context import Ctx  # noqa: E402
from mxtrain.linear import reference as _ref_linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")

FAST_PRESETS = [n for n in recipes.names() if fast.supported(recipes.get(n))]


@pytest.fixture
def use():
    """``use(**fields)``: ``settings.override(**fields)`` until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(settings.override(**fields))


def test_supported_presets():
    assert {"mxfp4-all", "mxfp4-all-dh16", "tseng", "mxfp4-all-sr", "mxfp4-all-rht16"} <= set(FAST_PRESETS)
    assert not fast.supported(recipes.get("nvfp4")) and not fast.supported(recipes.get("mxfp8"))


def _run(fn, rec, M, K, N, dtype=torch.float32, seed=0, layer=3, step=5, call=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype).requires_grad_()
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(N, generator=g).to(DEV, dtype).requires_grad_()
    gy = torch.randn(M, N, generator=g).to(DEV, dtype)
    q = Ctx(rec, layer, step, call)
    y = fn(x, w, b, q)
    y.backward(gy)
    return [t.detach().float() for t in (y, x.grad, w.grad, b.grad)]


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("preset", FAST_PRESETS)
def test_fast_equals_reference_cpu(preset):
    if DEV != "cpu":
        pytest.skip("CPU comparison (exact GEMM path)")
    rec = recipes.get(preset)
    ref = _run(lambda *a: _ref_linear.apply(*a), rec, 33, 72, 40)
    got = _run(lambda *a: fast.apply(*a), rec, 33, 72, 40)
    for r, g in zip(ref, got):
        assert _rel(g, r) < 1e-6


@pytest.mark.parametrize("backend", ["dot_scaled", "native_mx", "dequant"])
@pytest.mark.parametrize("preset", ["mxfp4-all-dh16", "tseng"])
def test_packed_fp4_backends_equal_reference(backend, preset, use):
    """The GEMM paths of FP4-native GPUs (packed codes + E8M0 scales: the Triton dot_scaled kernel,
    whose CPU twin decodes in registers; native_mx, which takes the first exact one of cuBLAS MX
    ``_scaled_mm``, dot_scaled and dequantize on the device; dequantize + bf16/fp32 GEMM) multiply the reference's
    operands: outputs and gradients equal the reference MXLinear's (fp32 rounding on CPU; on a GPU,
    where Hopper emulates dot_scaled, within bf16 output rounding)."""
    use(gemm_backend=backend)
    rec = recipes.get(preset)
    M, K, N = (33, 72, 40) if DEV == "cpu" else (1024, 1024 + 64, 768)
    dt = torch.float32 if DEV == "cpu" else torch.bfloat16
    ref = _run(lambda *a: _ref_linear.apply(*a), rec, M, K, N, dtype=dt)
    got = _run(lambda *a: fast.apply(*a), rec, M, K, N, dtype=dt)
    for r, g in zip(ref, got):
        assert _rel(g, r) < (1e-5 if DEV == "cpu" else 1e-2)
    if backend == "native_mx":
        from mxtrain.kernels.gemm import native_plan
        # CPU: dequantize; a Hopper GPU has no FP4 _scaled_mm, and emulates tl.dot_scaled exactly
        want = {"cpu": "dequant"}.get(DEV, None)
        plan = native_plan(DEV)
        assert plan == want if want else plan in ("scaled_mm", "dot_scaled"), plan


@pytest.mark.parametrize("update", ["inplace_no_grad", "data_copy", "foreach"])
def test_weights_quantized_from_current_values(update):
    """Every call quantizes the weight as it is now, whatever changed it: an in-place update under
    no_grad (bumps the version), a ``.data`` copy and a foreach update (neither bumps it, as fused
    optimizers do not): the next call equals the reference with the new weight, not the old one."""
    rec = recipes.get("mxfp4-all-dh16")
    torch.manual_seed(0)
    lin = MXLinear(64, 48, recipe=rec).to(DEV)
    x = torch.randn(5, 64, device=DEV)
    y0 = fast.apply(x, lin.weight, lin.bias, Ctx(rec, 0, 0, 0))
    new = torch.randn_like(lin.weight)
    v = lin.weight._version
    if update == "inplace_no_grad":
        with torch.no_grad():
            lin.weight.copy_(new)
    elif update == "data_copy":
        lin.weight.data.copy_(new)
        assert lin.weight._version == v
    else:
        torch._foreach_copy_([lin.weight.data], [new])
        assert lin.weight._version == v
    y1 = fast.apply(x, lin.weight, lin.bias, Ctx(rec, 0, 0, 1))
    ref1 = _ref_linear.apply(x, lin.weight, lin.bias, Ctx(rec, 0, 0, 1))
    assert _rel(y1, ref1) < (1e-6 if DEV == "cpu" else 1e-2)
    assert _rel(y1, y0) > 0.1


@pytest.mark.parametrize("preset", ["mxfp4-all-dh16", "mxfp4-all-rht16"])
def test_shared_input_quantized_once(preset, monkeypatch):
    """Layers that read one input (q/k/v projections) reuse its Fprop and Wgrad operands, and every
    output and gradient stays equal to the reference's; a changed input (new version) is quantized anew."""
    rec = recipes.get(preset)
    calls = []
    real = fast.quantize_op
    monkeypatch.setattr(fast, "quantize_op", lambda *a, **k: calls.append(k.get("group_rows")) or real(*a, **k))
    fast.clear_caches()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 64, generator=g).to(DEV).requires_grad_()
    ws = [(torch.randn(n, 64, generator=g) / 8).to(DEV).requires_grad_() for n in (48, 16, 16)]
    gys = [torch.randn(2, 9, w.shape[0], generator=g).to(DEV) for w in ws]

    def run(fn):
        for w in ws:
            w.grad = None
        x.grad = None
        ys = [fn(x, w, None, Ctx(rec, i, 3, 0)) for i, w in enumerate(ws)]
        torch.autograd.backward(ys, gys)
        return [y.detach() for y in ys] + [x.grad.clone()] + [w.grad.clone() for w in ws]

    ref = run(lambda *a: _ref_linear.apply(*a))
    calls.clear()
    got = run(lambda *a: fast.apply(*a))
    per_layer = 6  # X, W (Fprop); dY, W (Dgrad); dY, X (Wgrad)
    # X is reused by layers 2 and 3 for a GEMM whose rotation has no sign vector (random signs differ
    # per layer, so those operands differ and are quantized anew)
    reusable = [Ctx(rec, 0, 3, 0).signs(gm, DEV) is None for gm in ("fprop", "wgrad")]
    want = 3 * per_layer - 2 * sum(reusable)
    assert len(calls) == want, (len(calls), want)
    for r, o in zip(ref, got):
        assert _rel(o, r) < (1e-6 if DEV == "cpu" else 1e-2)
    with torch.no_grad():
        x.mul_(1.5)     # in place: new version, so no stale reuse
    ref2 = run(lambda *a: _ref_linear.apply(*a))
    got2 = run(lambda *a: fast.apply(*a))
    for r, o in zip(ref2, got2):
        assert _rel(o, r) < (1e-6 if DEV == "cpu" else 1e-2)
    fast.clear_caches()

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", FAST_PRESETS)
def test_fast_equals_reference_gpu(preset):
    rec = recipes.get(preset)
    M, K, N = 1024, 1024 + 64, 768
    ref = _run(lambda *a: _ref_linear.apply(*a), rec, M, K, N, dtype=torch.bfloat16)
    got = _run(lambda *a: fast.apply(*a), rec, M, K, N, dtype=torch.bfloat16)
    for r, g in zip(ref, got):
        assert _rel(g, r) < 1e-2, preset


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mxlinear_uses_fast_path_and_compiles():
    rec = recipes.get("mxfp4-all-dh16")
    torch.manual_seed(0)
    lin = MXLinear(512, 256, recipe=rec, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(4, 64, 512, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    from mxtrain.linear import route
    assert route(rec, x, lin.weight) == "fast"
    y = lin(x)
    y.float().square().mean().backward()
    g0 = x.grad.clone()
    x.grad = None
    cl = torch.compile(lin, fullgraph=True)
    y2 = cl(x)
    y2.float().square().mean().backward()
    assert _rel(y2.float(), y.float()) < 1e-2 and _rel(x.grad.float(), g0.float()) < 1e-2


def test_env_switch_disables_the_fast_path():
    import subprocess
    import sys
    code = ("import mxtrain, mxtrain.linear.fast as f; "
            "print(mxtrain.settings.current().fast, f.supported(mxtrain.numerics.recipes.get('mxfp4-all-dh16')))")
    # (supported is the recipe's answer; whether the fast path runs is linear.route's, from the setting)
    env = dict(__import__("os").environ, MXTRAIN_FAST="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"
    # "off" (and the other spellings) through the parse a process start runs on its environment (settings.current:
    # Settings.from_env(os.environ)), without a third process start
    for value in ("off", "OFF", "false", "no"):
        assert settings.Settings.from_env({"MXTRAIN_FAST": value}).fast is False, value
    assert settings.Settings.from_env({"MXTRAIN_FAST": "on"}).fast is True
    # a value it cannot take stops the import, naming the variable, the value and the allowed values
    env = dict(__import__("os").environ, MXTRAIN_FAST="maybe")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "SettingsError: MXTRAIN_FAST='maybe' is not a valid value: use one of 1, true" in out.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inexact_blocks_counter_gpu():
    """fast.inexact_blocks() stays put for ordinary data and grows when a block sits more than 14
    binades under its 1x128 group's largest block (the carrier cannot hold it exactly)."""
    lin = MXLinear(256, 128, recipe=recipes.get("mxfp4-all"), device=DEV, dtype=torch.float32)
    lin.weight.requires_grad_(False)   # Fprop operands only (else the forward also makes X's Wgrad operand)
    x = torch.randn(64, 256, device=DEV)
    before = fast.inexact_blocks()
    lin(x)
    assert fast.inexact_blocks() == before
    x[:, 32:128] *= 2.0**-20  # blocks 1-3 of every row's first group: 20 binades under block 0
    lin(x)
    assert fast.inexact_blocks() - before == 64 * 3


def test_inexact_counters_by_tensor_and_missed_devices():
    """The counts are kept per tensor role and summed by ``inexact_blocks``; a compiled call (``count ==
    "existing"``) never makes a counter, and a device where one was missing is reported as not counted."""
    from mxtrain.linear.context import Ctx
    st = fast.FastState()
    assert st.counter("cpu", "dy", create=False) is None and not st.counted("cpu")
    st.clear()
    assert st.counted("cpu")
    st.prepare("cpu")
    st.counter("cpu", "dy").add_(7)
    st.counter("cpu", "w").add_(2)
    assert st.inexact_blocks("cpu") == 9 and st.inexact_blocks("cpu", "dy") == 7 and st.inexact_blocks("cpu", "x") == 0
    c = Ctx(recipes.get("mxfp4-all"))
    c.count = "existing"
    saved = fast.state
    try:
        fast.state = fast.FastState()
        assert fast._counter(c, "cpu", "wgrad_dy") is None and not fast.state.counted("cpu")
        c.count = True
        assert fast._counter(c, "cpu", "wgrad_dy") is fast.state.counters[(torch.device("cpu"), "dy")]
        c.count = False
        assert fast._counter(c, "cpu", "fprop_x") is None
    finally:
        fast.state = saved


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_inexact_blocks_counted_in_compiled_calls_gpu(mode):
    """A converted model under torch.compile counts inexact carrier blocks too (counters made when the layer
    was moved to the GPU), by tensor: blocks 20 binades under their group's largest in X show up under x."""
    import torch.nn as nn
    import mxtrain
    torch._dynamo.reset()
    m = nn.Sequential(nn.Linear(256, 128, bias=False))
    mxtrain.convert(m, "mxfp4-all")
    m.cuda()
    assert fast.state.counted(DEV)
    f = torch.compile(m, mode=None if mode == "default" else mode)
    x = torch.randn(64, 256, device=DEV)
    x[:, 32:128] *= 2.0**-20
    before = fast.inexact_by_tensor()
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()   # (reduce-overhead: each call a new step)
        f(x).sum().backward()
        m.zero_grad(set_to_none=True)   # (as a training loop does: a CUDA graph tree's replay reuses the memory
        #                                  of the gradient it returned, which accumulating into .grad would read)
    after = fast.inexact_by_tensor()
    assert fast.state.counted(DEV)
    assert after["x"] - before["x"] >= 3 * 64 * 3, (before, after)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_requantizes_changed_weights():
    """A CUDA graph captured around MXLinear recomputes every quantized operand on replay: after the
    weight changes in place, replayed outputs and gradients equal a fresh eager call's."""
    torch.manual_seed(0)
    lin = MXLinear(1024, 512, recipe=recipes.get("mxfp4-all-dh16"), device=DEV, dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    lin(x).sum().backward()                      # eager first
    graphed = torch.cuda.make_graphed_callables(lin, (x,))
    with torch.no_grad():
        lin.weight.mul_(-0.5).add_(0.01)
    x2 = torch.randn(256, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    lin.weight.grad = None
    yg = graphed(x2)
    yg.backward(dy)
    got = [yg.detach().clone(), x2.grad.clone(), lin.weight.grad.clone()]
    x2.grad, lin.weight.grad = None, None
    fast.clear_caches()
    # make_graphed_callables replaced lin.forward by the replay: the eager call goes through another
    # MXLinear sharing lin's weight
    ref = MXLinear(1024, 512, recipe=recipes.get("mxfp4-all-dh16"), device=DEV, dtype=torch.bfloat16)
    ref.weight, ref.bias = lin.weight, lin.bias
    ye = ref(x2)
    ye.backward(dy)
    for g, e in zip(got, [ye.detach(), x2.grad, lin.weight.grad]):
        assert torch.equal(g, e) or _rel(g.float(), e.float()) < 1e-6


def _captured_and_eager(recipe: str):
    """A layer (layer id 3) captured by make_graphed_callables at step 0, an uncaptured twin with the same
    weight and bias (make_graphed_callables replaces the captured module's forward), the graph's static
    input x, a copy of it for the twin, and an output gradient."""
    torch.manual_seed(0)
    r = recipes.get(recipe)
    lin = MXLinear(1024, 512, recipe=r, device=DEV, dtype=torch.bfloat16, layer_id=3)
    ref = MXLinear(1024, 512, recipe=r, device=DEV, dtype=torch.bfloat16, layer_id=3)
    ref.load_state_dict(lin.state_dict())   # weight and bias
    x = torch.randn(256, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    dy = torch.randn(256, 512, device=DEV, dtype=torch.bfloat16)
    lin.set_step(0)
    return lin, ref, torch.cuda.make_graphed_callables(lin, (x,)), x, xr, dy


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replays_per_step_signs_like_eager():
    """A layer with per-step random signs, captured once: after set_step(step), each replay gives what an
    eager layer (same weight, same layer id, not captured) gives at that step (the captured kernels
    compute the signs from the layer's state tensor)."""
    lin, ref, graphed, x, xr, dy = _captured_and_eager("mxfp4-all-rht16")
    outs = []
    for step in (0, 1, 7):
        x.grad, lin.weight.grad = None, None
        lin.set_step(step)
        yg = graphed(x)
        yg.backward(dy)
        xr.grad, ref.weight.grad = None, None
        fast.clear_caches()
        ref.set_step(step)
        ye = ref(xr)
        ye.backward(dy)
        for g, e in zip([yg, x.grad, lin.weight.grad], [ye, xr.grad, ref.weight.grad]):
            assert torch.equal(g.detach(), e.detach()) or _rel(g.float(), e.float()) < 1e-6, step
        outs.append(yg.detach().clone())
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])   # new signs each step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("one_pass", [False, True])
def test_cuda_graph_replays_stochastic_rounding_like_eager(one_pass, use):
    """A layer with stochastic rounding on dY, captured once: with its state at (step, call), each replay
    draws what an eager layer (same weight and layer id, not captured) draws at that step and call, and
    different steps draw different bits; each replay advances the call counter as an eager call does.
    ``one_pass``: dY's two operands from the dual kernel where the ``dual`` policy (default ``auto``) takes
    them, else always two passes."""
    use(dual="auto" if one_pass else "off")
    lin, ref, graphed, x, xr, dy = _captured_and_eager("mxfp4-all-sr")
    grads = []
    for step, micro in ((0, 0), (0, 1), (5, 0), (0, 0)):
        x.grad, lin.weight.grad = None, None
        lin.mx_state.copy_(torch.tensor([3, step, micro]))
        graphed(x).backward(dy)
        assert lin.mx_state.tolist() == [3, step, micro + 1]
        xr.grad, ref.weight.grad = None, None
        ref.set_step(step)
        for _ in range(micro):   # the earlier micro-steps' calls (recording gradients: a no_grad call
            ref(xr)              # does not advance the counter), their graphs dropped
        ref(xr).backward(dy)
        for g, e in zip([x.grad, lin.weight.grad], [xr.grad, ref.weight.grad]):
            assert torch.equal(g, e) or _rel(g.float(), e.float()) < 1e-6, (step, micro)
        grads.append(x.grad.clone())
    assert not torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    assert torch.equal(grads[0], grads[3])


@pytest.mark.parametrize("preset", FAST_PRESETS)
def test_dual_operand_passes_equal_reference(preset, monkeypatch, use):
    """With the FP8-carrier backend, X's Fprop and Wgrad operands are made in the forward, from one pass
    (the backward keeps the Wgrad carrier, not X), and dY's Dgrad and Wgrad operands from one pass in the
    backward: outputs and gradients still equal the reference MXLinear's. The carrier GEMM runs as
    float math on the carrier values here (any device), so this checks the operands and their routing."""
    from mxtrain.kernels import gemm as kg
    from mxtrain.kernels import mxfp4 as kq
    use(dual="on", gemm_backend="fp8_carrier", qselfcheck="off")   # one pass with rotations too
    real_gemm = kg.mx_gemm_nt
    monkeypatch.setattr(kg, "mx_gemm_nt", lambda a, b, backend, *r: real_gemm(a, b, "dequant", *r))
    monkeypatch.setattr(kg, "activation_b_group_rows", lambda dev: 128)
    fast.clear_caches()
    rec = recipes.get(preset)
    dt = torch.float32 if DEV == "cpu" else torch.bfloat16
    # CPU: 17 tokens, two row tiles of 16 (the second ragged), as 33 made three
    M, K, N = (17, 72, 40) if DEV == "cpu" else (1024, 1024 + 64, 768)
    ref = _run(lambda *a: _ref_linear.apply(*a), rec, M, K, N, dtype=dt)
    with kq.record_launches() as log:
        got = _run(lambda *a: fast.apply(*a), rec, M, K, N, dtype=dt)
    calls = [e.shape for e in log if e.kernel == "dual"]   # one-pass quantizes, by input shape
    for r, g in zip(ref, got):
        assert _rel(g, r) < (1e-5 if DEV == "cpu" else 1e-2)
    def pair(gemm, n1, shape):   # one pass where both GEMMs are MXFP4 and the kernels take the rotations
        r1, r2 = rec.rotation(gemm), rec.rotation("wgrad")
        sr = any(rec.operand(n).rounding != "nearest" for n in (n1[0], "wgrad_x" if gemm == "fprop" else "wgrad_dy"))
        return [shape] * (fast._both_mx(rec, *n1) and fast._both_mx(rec, "wgrad_dy", "wgrad_x") and kq.dual_applies(
            torch.empty(shape), r1.size if r1.enabled else 0, r2.size if r2.enabled else 0, sr=sr))
    assert calls == pair("fprop", ("fprop_x", "fprop_w"), (M, K)) + pair("dgrad", ("dgrad_dy", "dgrad_w"), (M, N))
    # not vacuous: one pass ran wherever Wgrad and another GEMM of the same tensor are both MXFP4
    # (tseng: its H64 rotation is not one the one-pass kernel takes)
    paired = fast._both_mx(rec, "wgrad_dy", "wgrad_x") and (
        fast._both_mx(rec, "fprop_x", "fprop_w") or fast._both_mx(rec, "dgrad_dy", "dgrad_w"))
    assert calls or not paired or preset == "tseng"


def test_no_wgrad_operand_under_no_grad(monkeypatch, use):
    """Under torch.no_grad (evaluation) no backward follows: the forward makes only the Fprop operands,
    not X's Wgrad operand (autograd still reports the weight as needing a gradient there)."""
    from mxtrain.kernels import gemm as kg
    use(gemm_backend="fp8_carrier", qselfcheck="off")
    real_gemm = kg.mx_gemm_nt
    monkeypatch.setattr(kg, "mx_gemm_nt", lambda a, b, backend, *r: real_gemm(a, b, "dequant", *r))
    monkeypatch.setattr(kg, "activation_b_group_rows", lambda dev: 128)
    pairs = []
    real_pair = fast._quant_pair
    monkeypatch.setattr(fast, "_quant_pair", lambda *a, **k: pairs.append(a[2]) or real_pair(*a, **k))
    fast.clear_caches()
    x = torch.randn(33, 72, device=DEV)
    w = torch.randn(40, 72, device=DEV, requires_grad=True)
    with torch.no_grad():
        y0 = fast.apply(x, w, None, Ctx(recipes.get("mxfp4-all-dh16"), 3, 5, 1))
    assert pairs == []
    y1 = fast.apply(x, w, None, Ctx(recipes.get("mxfp4-all-dh16"), 3, 5, 1))
    assert pairs == ["fprop_x"] and torch.equal(y0, y1.detach())


@pytest.mark.parametrize("preset", ["mxfp4-all-dh16", "mxfp4-all-sr"])
def test_wgrad_operand_made_in_forward_without_dual_pass(preset, monkeypatch, use):
    """With one-pass quantization off, the forward still makes X's Wgrad operand (two passes) and the
    backward keeps it instead of X: outputs and gradients equal the reference MXLinear's, and the
    autograd node saved no copy of X, only X's Wgrad operand as FP4 codes (``wgrad_x=forward``; the default
    ``auto`` keeps the carrier at this width)."""
    from mxtrain.kernels import gemm as kg
    use(dual="off", gemm_backend="fp8_carrier", qselfcheck="off", wgrad_x="forward")
    real_gemm = kg.mx_gemm_nt
    monkeypatch.setattr(kg, "mx_gemm_nt", lambda a, b, backend, *r: real_gemm(a, b, "dequant", *r))
    monkeypatch.setattr(kg, "activation_b_group_rows", lambda dev: 128)
    fast.clear_caches()
    rec = recipes.get(preset)
    kept = {}

    def fast_fn(*a):
        y = fast.apply(*a)
        # what the autograd node keeps for its backward (read here: the backward releases it)
        kept["saved"], kept["wq"] = [t for t in y.grad_fn.saved_tensors if t is not None], y.grad_fn.kept
        return y
    ref = _run(lambda *a: _ref_linear.apply(*a), rec, 33, 72, 40)
    got = _run(fast_fn, rec, 33, 72, 40)
    for r, g in zip(ref, got):
        assert _rel(g, r) < 1e-5
    saved = kept["saved"]
    assert len(saved) == 1 and saved[0].shape == (40, 72) and kept["wq"] is not None
    # kept as packed FP4 codes and E8M0 scales (half the carrier's bytes), the carrier rebuilt in the backward
    wq = kept["wq"]
    assert wq.carrier is None and wq.packed.dtype == torch.uint8 and wq.packed.shape == (72, 64 // 2)
    assert wq.scales.shape == (72, 64 // 32) and wq.group_rows == 128



def _two_layers_grads(recipe: str, wgrad_x: str, compiled: bool):
    import torch.nn as nn
    import mxtrain
    torch.manual_seed(0)
    torch._dynamo.reset()
    m = nn.Sequential(nn.Linear(512, 384, bias=False), nn.Linear(384, 256)).to(DEV)
    mxtrain.convert(m, recipe)
    x = torch.randn(2, 128, 512, device=DEV, requires_grad=True)
    with settings.override(wgrad_x=wgrad_x), torch.autocast("cuda", dtype=torch.bfloat16):
        f = torch.compile(m) if compiled else m
        for step in range(2):
            mxtrain.set_step(m, step)
            y = f(x)
            y.float().backward(torch.linspace(-1, 1, y.numel(), device=DEV).reshape(y.shape))
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all-sr", "tseng"])
@pytest.mark.parametrize("compiled", [False, True])
def test_wgrad_x_in_forward_or_backward_gives_the_same_gradients(recipe, compiled):
    """The ``wgrad_x`` setting moves the quantization of X's Wgrad operand between the forward (packed codes
    kept, or the FP8 carrier with ``carrier``) and the backward (X kept): outputs and gradients equal bit for bit,
    eagerly and compiled."""
    a = _two_layers_grads(recipe, "forward", compiled)
    b = _two_layers_grads(recipe, "backward", compiled)
    c = _two_layers_grads(recipe, "carrier", compiled)
    for u, v, w in zip(a, b, c):
        assert torch.equal(u, v) and torch.equal(u, w)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_wgrad_x_in_backward_keeps_no_codes_in_a_compiled_block():
    """What a compiled transformer block keeps for its backward: packed FP4 codes (uint8) with
    ``wgrad_x=forward``, none with ``backward`` (X itself instead: more bytes, 2 a value against 0.53)."""
    import mxtrain
    from mxtrain.model.llama import Block, ModelConfig, rope_tables
    cfg = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=64)
    out = {}
    for mode in ("forward", "backward"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        blk = Block(cfg).to(DEV)
        mxtrain.convert(torch.nn.ModuleList([blk]), "mxfp4-all-dh16")
        f = torch.compile(blk)
        x = torch.randn(2, 128, cfg.dim, device=DEV, requires_grad=True)
        cos, sin = rope_tables(cfg.head_dim, 128, cfg.rope_theta, DEV)
        kept = []

        def pack(t):
            kept.append((t.dtype, t.numel() * t.element_size()))
            return t
        with settings.override(wgrad_x=mode), torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = f(x, cos, sin)
            y.float().sum().backward()
        out[mode] = kept
    assert any(d == torch.uint8 and n for d, n in out["forward"])
    assert not any(d == torch.uint8 and n for d, n in out["backward"]), out["backward"]
    assert sum(n for _, n in out["backward"]) > sum(n for _, n in out["forward"])


@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all-sr"])
def test_wgrad_x_placement_same_gradients_eager(recipe):
    """Eager fast path (CPU under Triton's interpreter, or a GPU): ``wgrad_x=forward``, ``carrier`` and
    ``backward`` give the same output and gradients bit for bit; ``backward`` keeps X instead of the packed
    operand."""
    out = {}
    for mode in ("forward", "carrier", "backward"):
        torch.manual_seed(0)
        rec = recipes.get(recipe)
        lin = MXLinear(64, 32, recipe=rec, device=DEV, dtype=torch.bfloat16, layer_id=2)
        x = torch.randn(64, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        assert fast.applies(x, lin.weight)
        kept = []

        def pack(t):
            kept.append(tuple(t.shape))
            return t
        with settings.override(wgrad_x=mode):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = fast.apply(x, lin.weight, lin.bias, Ctx(rec, 2, 3, 0))
            y.float().backward(torch.linspace(-1, 1, y.numel(), device=DEV).reshape(y.shape))
        out[mode] = ([y.detach(), x.grad, lin.weight.grad, lin.bias.grad], kept)
    for a, b, c in zip(out["forward"][0], out["backward"][0], out["carrier"][0]):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert (64, 64) in out["backward"][1] and (64, 64) not in out["forward"][1]   # X itself, only with backward
