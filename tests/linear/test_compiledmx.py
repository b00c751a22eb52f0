"""The MX layer compiled into the graph (mxtrain.linear.compiledmx, the quantize kernels as triton_ops).

CPU (CI): the layer's autograd function run eagerly (each triton_op runs its body: the Triton kernels under the
interpreter, the carrier GEMM emulated in float32) gives the reference's outputs and gradients for every recipe
it takes, with bias, 3-D inputs and sizes that need padding; every kernel launch passes every argument; the
dispatcher takes the form only where it applies. CUDA (cuda-marked, run on a GPU before a change lands): the
compiled layer against the eager fast path bit for bit (outputs, dX, dW, inexact-block counts), no custom op left
in the graph, CUDA graphs not skipped, a compiled model training like eager without recompiles."""

import pytest
import torch

import mxtrain
from mxtrain.linear import compiledmx, fast
from mxtrain import mx_linear, settings
from mxtrain.numerics import recipes
from mxtrain.linear import COMPILED_FORMS
from mxtrain.kernels.mxfp4 import kernels as K
from mxtrain.kernels.mxfp4.launch import kernel_kwargs

from compile_helpers import fwd_bwd, ops_of

RECIPES = ["mxfp4-all", "mxfp4-all-dh16", "mxfp4-all-dh32", "mxfp4-all-dh16+amd", "mxfp4-fprop"]


def _cpu_layer(x, w, b, recipe, rows=128):
    """The compiled layer (``compiledmx.linear``), eagerly on CPU tensors."""
    fast.state.prepare("cpu")
    return compiledmx.linear(x, w, b, compiledmx.spec(recipes.get(recipe)), (rows, 128))


@pytest.mark.parametrize("recipe,shape,bias,rows", [
    ("mxfp4-all", (2, 48, 160), True, 128),
    ("mxfp4-all-dh16", (96, 160), False, 128),
    ("mxfp4-all-dh16+amd", (3, 20, 100), True, 1),     # M=60, K=100: rows and reduction padded
    ("mxfp4-fprop", (40, 64), True, 128),               # plain Dgrad and Wgrad
])   # (mxfp4-all-dh32 differs from -dh16 in a constexpr only: its case runs on the GPU, for CI's time)
def test_layer_equals_the_reference_on_cpu(recipe, shape, bias, rows):
    g = torch.Generator().manual_seed(3)
    N = 80
    x = torch.randn(*shape, generator=g) * 4
    w = torch.randn(N, shape[-1], generator=g)
    b = torch.randn(N, generator=g) if bias else None
    gy = torch.randn(*shape[:-1], N, generator=g)
    launched = []
    real = compiledmx._traced._launch

    def spy(kfn, grid, args, consts, nw):
        launched.append((kfn, kernel_kwargs(kfn, args, consts)))
        return real(kfn, grid, args, consts, nw)
    compiledmx._traced._launch = spy
    # (the default wgrad_x=auto keeps X's Wgrad carrier at these widths; -dh16 keeps its codes and rebuilds it)
    try:
        with settings.override(wgrad_x="forward" if recipe == "mxfp4-all-dh16" else "auto"):
            got = fwd_bwd(x, w, b, gy, lambda x, w, b: _cpu_layer(x, w, b, recipe, rows))
    finally:
        compiledmx._traced._launch = real
    # torch's analysis of what a user kernel writes fails on a launch that leaves an argument out (then every
    # input counts as written and the compiler copies X before each quantize): every launch passes them all
    for kfn, kw in launched:
        assert set(kw) == set(kfn.arg_names), kfn.fn.__name__
    names = sorted(kfn.fn.__name__ for kfn, _ in launched)
    if recipe == "mxfp4-all-dh16":   # X dual, W along K, dY dual, W along N, X's carrier from its codes
        assert names == sorted(["_mxfp4_dual_kernel", "_mxfp4_kernel", "_mxfp4_dual_kernel", "_mxfp4_kernel",
                                "_expand_kernel"])
    elif recipe == "mxfp4-all":      # the same, X's Wgrad carrier kept from the forward: nothing rebuilt
        assert names == sorted(["_mxfp4_dual_kernel", "_mxfp4_kernel", "_mxfp4_dual_kernel", "_mxfp4_kernel"])
    with settings.override(fast=False):
        want = fwd_bwd(x, w, b, gy, lambda x, w, b: mx_linear(x, w, b, recipe))
    for a, r, name in zip(got, want, ("y", "dX", "dW", "db")):
        # the same MX values multiplied in float32 on both sides: equal up to summation order
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item()), (recipe, name)


@pytest.mark.parametrize("recipe,shape,bias", [
    ("tseng", (2, 24, 96), False),            # plain Fprop; SR, per-step H64 signs and prescale 0.75 behind it;
                                              # K = 96 pads to whole 64-blocks (the SR stream's index strides)
    ("mxfp4-all-sr", (32, 64), True),         # SR on dY only, nearest elsewhere: X's operands from one pass
    ("mxfp4-all-rht16", (3, 20, 64), False),  # random signs on every GEMM, rows padded
])
def test_seeded_layer_equals_the_reference_on_cpu(recipe, shape, bias):
    """Stochastic rounding, random signs and prescales in the compiled layer: with the call's keys and signs from
    ``call_seeds`` (the layer's state [layer 7, step 3, call 2]), the same MX values as the reference at that
    state, so the same outputs and gradients up to summation order (a key of the wrong operand, or the SR
    stream's index strides of an unpadded operand, fail it)."""
    from mxtrain.linear.dispatch import call_seeds, mx_spec
    rec = recipes.get(recipe)
    mx = mx_spec(rec)
    assert mx and compiledmx.seeded(mx)
    g = torch.Generator().manual_seed(5)
    N = 80
    x = torch.randn(*shape, generator=g) * 4
    w = torch.randn(N, shape[-1], generator=g)
    b = torch.randn(N, generator=g) if bias else None
    gy = torch.randn(*shape[:-1], N, generator=g)
    fast.state.prepare("cpu")
    st = torch.tensor([7, 3, 2])

    def layer(x, w, b):
        keys, signs = call_seeds(st, rec, True)
        return compiledmx.linear(x, w, b, mx, (128, 128), keys, signs)
    got = fwd_bwd(x, w, b, gy, layer)
    assert st.tolist() == [7, 3, 3 if rec.operand("dgrad_dy").rounding == "stochastic" else 2]
    ref_state = torch.tensor([7, 3, 2])
    with settings.override(fast=False):
        want = fwd_bwd(x, w, b, gy, lambda x, w, b: mx_linear(x, w, b, recipe, ref_state))
    for a, r, name in zip(got, want, ("y", "dX", "dW", "db")):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item()), (recipe, name)


def _uniform(fmt, base="mxfp4-all", **over):
    """``base`` with every operand of MX format ``fmt`` (and the operand fields ``over``)."""
    from mxtrain.numerics.recipe import OPERANDS
    return recipes.get(base).with_(**{**{f"{n}.fmt": fmt for n in OPERANDS}, **over})


# issue #51's recipes: the uniform grids (``ufp4``: mxint4, H16 per-step signs, SR on dY; E1M2 with an INT4 Wgrad X
# and an E2M1 Fprop W, so that one GEMM and one dual pass mix grids) and the adaptive rule (with H16, and on ufp4)
NEW_RECIPES = {
    "ufp4": lambda: recipes.get("ufp4"),
    "e1m2-mixed": lambda: _uniform("mxe1m2", "mxfp4-all-dh16", **{"wgrad_x.fmt": "mxint4", "fprop_w.fmt": "mxfp4"}),
    "mxfp4-all-dh16+adaptive": lambda: recipes.get("mxfp4-all-dh16+adaptive"),
    "ufp4+adaptive": lambda: recipes.get("ufp4+adaptive"),
    "mxint4-dh16": lambda: _uniform("mxint4", "mxfp4-all-dh16"),   # (round to nearest, no signs: not seeded)
}


def _gemm_as_compiled(a, b, backend, out_dtype=torch.float32, divisor=1.0):
    """The fast path's FP8-carrier GEMM (``kernels.gemm.mx_gemm_nt``, whose ``_scaled_mm`` a CPU lacks) as the
    compiled layer's CPU emulation computes it (``compiledmx._mm``): the same carriers and group scales give the
    same float32 products and sums, so outputs equal bit for bit exactly when the operands do."""
    assert backend == "fp8_carrier"
    return compiledmx._mm(a.carrier.view(torch.uint8), a.gs_base, a.R, b.carrier.view(torch.uint8), b.gs_base,
                          b.group_rows, b.R, out_dtype, 1.0 / divisor)


@pytest.mark.parametrize("name,shape,bias", [
    ("ufp4", (3, 20, 96), True),                # M=60, K=96: rows and rotation blocks padded
    ("e1m2-mixed", (48, 64), False),            # one pass makes X's E1M2 Fprop and INT4 Wgrad operands
    ("mxfp4-all-dh16+adaptive", (2, 24, 64), True),
])   # (ufp4+adaptive: as these, on the GPU only, for CI's time)
def test_new_formats_and_the_adaptive_rule_equal_the_eager_fast_path_on_cpu(name, shape, bias, monkeypatch):
    """Issue #51's uniform grids (``mxint4``, ``mxe1m2``) and the ``adaptive`` rule in the compiled layer: ``spec``
    takes them (its wider form, with the formats where one is not ``mxfp4``) and each launch gets the operand's
    format and rule as the eager fast path passes them, so Y, dX, dW, db and the inexact-block counts equal the
    eager fast path's bit for bit (at the layer's state [7, 3, 2]: the same keys and signs). CPU: the fast path
    with the FP8-carrier backend, its GEMM the compiled layer's emulation (``_gemm_as_compiled``)."""
    from mxtrain.kernels import gemm as kg
    from mxtrain.kernels.mxfp4.launch import GRID_ID, RULE_ID
    from mxtrain.linear.context import Ctx
    from mxtrain.linear.dispatch import call_seeds, mx_spec
    rec = NEW_RECIPES[name]()
    mx = mx_spec(rec)
    assert mx and mx == compiledmx.spec(rec)
    assert compiledmx.seeded(mx) == name.startswith("ufp4")    # (the grids and the rule draw nothing)
    g = torch.Generator().manual_seed(6)
    N = 48
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 6, (shape[-1],), generator=g).float())
    w = torch.randn(N, shape[-1], generator=g)
    b = torch.randn(N, generator=g) if bias else None
    gy = torch.randn(*shape[:-1], N, generator=g)
    monkeypatch.setattr(kg, "mx_gemm_nt", _gemm_as_compiled)
    monkeypatch.setattr(kg, "activation_b_group_rows", lambda dev: 128)
    launched = []
    real = compiledmx._traced._launch

    def spy(kfn, grid, args, consts, nw):
        launched.append(kernel_kwargs(kfn, args, consts))
        return real(kfn, grid, args, consts, nw)
    with settings.override(gemm_backend="fp8_carrier", qselfcheck="off"):
        fast.state.prepare("cpu")
        fast.clear_caches()
        before = fast.inexact_by_tensor("cpu")
        eager = fwd_bwd(x, w, b, gy, lambda x, w, b: fast.apply(x, w, b, Ctx(rec, 7, 3, 2)))
        mid = fast.inexact_by_tensor("cpu")
        st = torch.tensor([7, 3, 2])

        def layer(x, w, b):
            keys, signs = call_seeds(st, rec, True)
            return compiledmx.linear(x, w, b, mx, (128, 128), keys, signs)
        monkeypatch.setattr(compiledmx._traced, "_launch", spy)
        comp = fwd_bwd(x, w, b, gy, layer)
        after = fast.inexact_by_tensor("cpu")
    for a, e, what in zip(comp, eager, ("y", "dX", "dW", "db")):
        assert torch.equal(a, e), (name, what, (a - e).abs().max().item())
    assert {k: after[k] - mid[k] for k in after} == {k: mid[k] - before[k] for k in mid}
    # not vacuous: the launches carried the recipe's grids and rules (the single and dual kernels' constexprs)
    grids = {kw[k] for kw in launched for k in ("GRID", "GRID_A", "GRID_B") if k in kw}
    rules = {kw[k] for kw in launched for k in ("RULE", "RULE_A", "RULE_B") if k in kw}
    fmts = {rec.operand(n).fmt for n in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")}
    assert grids == {GRID_ID[f] for f in fmts}, (grids, fmts)
    assert rules == {RULE_ID[rec.operand("fprop_x").scale_rule]}, rules
    assert any("GRID_A" in kw for kw in launched)   # (X's and dY's operands from one pass each)


def test_wgrad_operand_kept_as_its_carrier_on_cpu():
    """``wgrad_x=carrier``: X's Wgrad operand comes out of the forward's dual pass as its FP8 carrier and the
    backward multiplies it as it is (no rebuild from FP4 codes): the same outputs and gradients as ``forward``."""
    g = torch.Generator().manual_seed(4)
    x, w, gy = torch.randn(64, 96, generator=g), torch.randn(48, 96, generator=g), torch.randn(64, 48, generator=g)
    out = {}
    for mode in ("forward", "carrier"):
        launched = []
        real = compiledmx._traced._launch

        def spy(kfn, grid, args, consts, nw):
            launched.append(kfn.fn.__name__)
            return real(kfn, grid, args, consts, nw)
        compiledmx._traced._launch = spy
        try:
            with settings.override(wgrad_x=mode):
                out[mode] = fwd_bwd(x, w, None, gy, lambda x, w, b: _cpu_layer(x, w, b, "mxfp4-all-dh16"))
        finally:
            compiledmx._traced._launch = real
        assert ("_expand_kernel" in launched) == (mode == "forward"), (mode, launched)
    for a, b in zip(out["forward"], out["carrier"]):
        assert torch.equal(a, b)


def test_carrier_k_pads_the_reduction_less_with_the_same_operands(monkeypatch):
    """The setting ``carrier_k``: a carrier's reduction length padded to a multiple of 128 or 256 instead of 512 (K
    768: 768 columns, not 1,024), its first K columns the same bytes and the rest zeros; the compiled layer's outputs
    and gradients (CPU emulation of the GEMM; K 384 with 128) the 512 ones up to the float32 sum's order."""
    from mxtrain.kernels.mxfp4 import quantize_op
    from mxtrain.kernels import gemm
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, 768, generator=g)
    q = {m: quantize_op(x, 1, rot=16, carrier=True, fp4=False, group_rows=1, k_multiple=m) for m in (128, 256, 512)}
    assert q[128].carrier.shape[1] == q[256].carrier.shape[1] == 768 and q[512].carrier.shape[1] == 1024
    for m in (128, 256):
        assert torch.equal(q[m].carrier.view(torch.uint8), q[512].carrier.view(torch.uint8)[:, :768])
    assert not q[512].carrier.view(torch.uint8)[:, 768:].any()
    x, w, gy = torch.randn(32, 384, generator=g), torch.randn(32, 384, generator=g), torch.randn(32, 32, generator=g)
    out, widths, real = {}, [], compiledmx._quant_rows

    def spy(*a, **k):   # (the widths of the carriers made along rows here: W's Fprop operand)
        c, gs = real(*a, **k)
        widths.append(c.shape[1])
        return c, gs
    monkeypatch.setattr(compiledmx, "_quant_rows", spy)
    for m in (128, 512):
        widths.clear()
        with settings.override(carrier_k=m):
            assert gemm.k_multiple_for("fp8_carrier") == m and gemm.k_multiple_for("dequant") == 128
            out[m] = fwd_bwd(x, w, None, gy, lambda x, w, b: _cpu_layer(x, w, b, "mxfp4-all-dh16"))
        assert widths and set(widths) == {384 if m == 128 else 512}, (m, widths)
    for a, b in zip(out[128], out[512]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_dispatcher_takes_the_form_only_where_it_applies():
    mx = compiledmx.spec(recipes.get("mxfp4-all-dh16"))
    x, w = torch.zeros(64, 96), torch.zeros(32, 96)
    s = settings.current()
    assert compiledmx.applies(mx, x, w, s) == (0, 0)            # a CPU tensor
    assert compiledmx.applies("", x, w, s) == (0, 0)
    assert compiledmx.seeded(compiledmx.spec(recipes.get("mxfp4-all-sr")))   # SR: the spec's wider form
    assert compiledmx.seeded(compiledmx.spec(recipes.get("tseng"))) and not compiledmx.seeded(mx)
    for name in ("nvfp4", "mxfp8", "fp8"):   # what the fast path does not run
        assert compiledmx.spec(recipes.get(name)) is None, name
    # an MX operand against a high-precision one: the fast path runs that GEMM as the reference does
    assert compiledmx.spec(recipes.get("mxfp4-all").with_(**{"fprop_w.fmt": "bf16"})) is None
    # the settings are the dispatcher's (linear.compiled_form): with mx_compiled=ops, or a seeded recipe with
    # mx_compiled_seeded off, it never asks (a spy stands in for a GPU's answer)
    from mxtrain.linear.dispatch import compiled_form
    asked = []

    def spy(mx_, x_, w_, s_):
        asked.append(mx_)
        return (128, 128)
    real = compiledmx.applies
    compiledmx.applies = spy
    try:
        assert compiled_form(x, w, True, True, "", mx)[0] == "graph"
        tseng = compiledmx.spec(recipes.get("tseng"))
        with settings.override(mx_compiled_seeded=False):
            assert compiled_form(x, w, True, False, "", tseng)[0] == "op" and asked == [mx]
        assert compiled_form(x, w, True, False, "", tseng)[0] == "graph"   # (the default)
        with settings.override(mx_compiled="ops"):
            assert compiled_form(x, w, True, True, "", mx)[0] == "op"
        with settings.override(fast=False):
            assert compiled_form(x, w, True, True, "", mx)[0] == "op"
        assert asked == [mx, tseng]
    finally:
        compiledmx.applies = real


def test_setting_is_read_from_the_environment():
    assert settings.Settings.from_env({"MXTRAIN_MX_COMPILED": "ops"}).mx_compiled == "ops"
    assert settings.Settings.from_env({"MXTRAIN_MX_COMPILED": "separate"}).mx_compiled == "separate"
    # (the sharing was its own choice, "shared", before it became the default: that name still means auto)
    assert settings.Settings.from_env({"MXTRAIN_MX_COMPILED": "shared"}).mx_compiled == "auto"
    assert settings.Settings().shares_inputs() and settings.Settings(mx_compiled="shared").shares_inputs()
    assert not settings.Settings(mx_compiled="separate").shares_inputs()
    assert not settings.Settings(mx_compiled="ops").shares_inputs()
    with pytest.raises(settings.SettingsError):
        settings.Settings.from_env({"MXTRAIN_MX_COMPILED": "sometimes"})


# ---------------------------------------------------------------------------------------------- GPU

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from mxtrain.kernels import backend
    if backend("cuda") != "fp8_carrier":
        pytest.skip("needs FP8 tensor cores (the FP8-carrier GEMM)")


def _data(M, Kd, N, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, Kd, device="cuda", generator=g)
         * torch.exp2(torch.randint(-8, 8, (M, 1), device="cuda", generator=g).float())).to(dtype)
    w = torch.randn(N, Kd, device="cuda", generator=g) * 0.05
    b = torch.randn(N, device="cuda", generator=g)
    gy = torch.randn(M, N, device="cuda", generator=g)
    return x, w, b, gy


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype,amp,bias,shape", [
    (torch.bfloat16, False, False, (2048, 768, 2304)),
    (torch.float32, True, True, (1000, 768, 256)),       # rows padded, autocast, bias
    (torch.float32, False, True, (512, 2048, 768)),
    (torch.bfloat16, True, False, (4, 256, 4096, 512)),  # 3-D input
])
def test_cuda_compiled_layer_equals_the_eager_fast_path(recipe, dtype, amp, bias, shape):
    _compiled_vs_eager(recipe, dtype, amp, bias, shape)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["tseng", "mxfp4-all-sr", "mxfp4-all-rht16"])
@pytest.mark.parametrize("dtype,amp,bias,shape", [
    (torch.bfloat16, False, False, (2048, 768, 2304)),
    (torch.float32, True, True, (1000, 768, 256)),
])
def test_cuda_seeded_compiled_layer_equals_the_eager_fast_path(recipe, dtype, amp, bias, shape):
    """Stochastic rounding, random signs and prescales (``mx_compiled_seeded``): the compiled layer draws the eager
    fast path's bits (both at layer 0, step 0, call 0: the eager call's host key against the compiled call's key
    in device memory)."""
    from mxtrain.linear import implementation
    with settings.override(mx_compiled_seeded=True):
        x = torch.zeros(64, 256, device="cuda")
        assert implementation(recipe, x, torch.zeros(128, 256, device="cuda")) == COMPILED_FORMS["graph"]
        _compiled_vs_eager(recipe, dtype, amp, bias, shape)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["ufp4", "mxfp4-all-dh16+adaptive", "e1m2-mixed", "mxint4-dh16"])
@pytest.mark.parametrize("dtype,amp,bias,shape", [
    (torch.bfloat16, False, False, (2048, 768, 2304)),
    (torch.bfloat16, False, True, (3, 333, 776, 264)),   # M 999, K 776 (not whole rotation blocks), N 264: padded
])
def test_cuda_new_formats_and_adaptive_rule_compiled_equal_the_eager_fast_path(name, dtype, amp, bias, shape):
    """Issue #51's uniform grids and adaptive rule compiled into the graph (``torch.compile(fullgraph=True)``):
    Y, dX, dW and the inexact-block counts equal the eager fast path's bit for bit, db to float32 summation order
    (``_compiled_vs_eager``). ``mx_compiled_seeded`` on for ``ufp4``'s random signs and stochastic rounding (its
    bits: layer 0, step 0, call 0 on both sides). (An adaptive kernel variant takes Triton 20-25 s to compile for
    sm_90, docs/kernels.md: the adaptive case's first run compiles its variants eagerly and under inductor.)"""
    from mxtrain.linear import implementation
    rec = NEW_RECIPES[name]()
    with settings.override(mx_compiled_seeded=True, mx_compiled_grids=True):
        _gpu()
        x = torch.zeros(64, 256, device="cuda", dtype=dtype)
        assert implementation(rec, x, torch.zeros(128, 256, device="cuda")) == COMPILED_FORMS["graph"]
        _compiled_vs_eager(rec, dtype, amp, bias, shape)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["ufp4", "mxfp4-all-dh16+adaptive", "e1m2-mixed"])
def test_cuda_new_formats_and_adaptive_rule_under_cuda_graphs(name, caplog):
    """The same layers compiled with ``mode="reduce-overhead"`` (CUDA graphs): every call, the first ones and the
    replays, gives the eager fast path's Y, dX and dW bit for bit; CUDA graphs are not skipped and nothing
    recompiles."""
    import logging
    _gpu()
    rec = NEW_RECIPES[name]()
    x, w, b, gy = _data(1000, 768, 512, torch.bfloat16)

    def layer(x, w, b):
        return mx_linear(x, w, b, rec)
    eager = fwd_bwd(x, w, b, gy, layer)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING), settings.override(mx_compiled_seeded=True, mx_compiled_grids=True):
        f = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        for i in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            got = fwd_bwd(x, w, b, gy, f)
            for a, e, what in zip(got[:3], eager[:3], ("y", "dX", "dW")):
                assert torch.equal(a, e), (name, i, what, (a - e).abs().max().item())
            del got
    torch._dynamo.reset()
    assert "skipping cudagraphs" not in caplog.text
    assert "Recompiling" not in caplog.text


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all-sr"])
def test_cuda_wgrad_x_carrier_equals_codes_compiled_and_eager(recipe):
    """``wgrad_x=carrier`` (``auto``'s choice up to 2,048 input features) against ``forward`` (codes, the carrier
    rebuilt in the backward), on a GPU, compiled and eager: Y, dX and dW bit for bit."""
    _gpu()
    x, w, _, gy = _data(2048, 768, 2304, torch.bfloat16)

    def layer(x, w, b):
        return mx_linear(x, w, b, recipe, torch.tensor([3, 5, 0], device="cuda"))
    out = {}
    for mode in ("forward", "carrier"):
        with settings.override(wgrad_x=mode):
            out[mode, "eager"] = fwd_bwd(x, w, None, gy, layer)
            torch._dynamo.reset()
            out[mode, "compiled"] = fwd_bwd(x, w, None, gy, torch.compile(layer, fullgraph=True))
    for key, got in out.items():
        for a, e, name in zip(got, out["forward", "eager"], ("y", "dX", "dW")):
            assert torch.equal(a, e), (recipe, key, name)


def _compiled_vs_eager(recipe, dtype, amp, bias, shape, inductor=None):
    _gpu()
    *lead, Kd, N = shape
    M = 1
    for d in lead:
        M *= d
    x, w, b, gy = _data(M, Kd, N, dtype)
    x, gy = x.reshape(*lead, Kd), gy.reshape(*lead, N).to(torch.bfloat16 if amp else dtype)
    b = b if bias else None

    def run(fn):
        ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp else torch.autocast("cuda", enabled=False)
        with ctx:
            return fwd_bwd(x, w, b, gy, fn)

    def layer(x, w, b):
        return mx_linear(x, w, b, recipe)
    before = fast.inexact_by_tensor("cuda")
    eager = run(layer)
    mid = fast.inexact_by_tensor("cuda")
    torch._dynamo.reset()
    import torch._inductor.config as ic
    with ic.patch(inductor or {}):
        comp = run(torch.compile(layer, fullgraph=True))
    after = fast.inexact_by_tensor("cuda")
    for a, e, name in zip(comp, eager, ("y", "dX", "dW")):
        assert torch.equal(a, e), (recipe, name, (a - e).abs().max().item())
    if bias:   # db is a float32 sum of dY's rows, no MX number: inductor's reduction adds in another order than
        # eager's, so it agrees to float32 rounding of the sum (|error| <= rows * 2^-24 * sum |dY|), not bit for bit
        bound = gy.reshape(-1, N).float().abs().sum(0) * (M * 2.0 ** -24)
        assert ((comp[3].float() - eager[3].float()).abs() <= bound).all(), (recipe, "db")
    assert {k: after[k] - mid[k] for k in after} == {k: mid[k] - before[k] for k in mid}
    assert fast.state.counted("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "tseng"])
def test_cuda_static_launcher_gives_the_eager_bits(recipe):
    """Inductor's own launcher for the layer's Triton kernels (``static_launch_user_defined_triton_kernels``, the
    bench's ``static_launch=true``; measured faster on the host, BENCHMARKS.md): the same outputs and gradients,
    bit for bit, as the eager fast path, stochastic rounding and per-step signs (``tseng``) included."""
    _compiled_vs_eager(recipe, torch.bfloat16, True, True, (1000, 768, 256),
                       inductor={"static_launch_user_defined_triton_kernels": True})


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "tseng", "mxfp4-all"])
def test_cuda_cpp_wrapper_gives_the_eager_bits(recipe):
    """Inductor's C++ wrapper (``cpp_wrapper``: the code that runs the compiled graph, launches of the layer's
    Triton kernels and ``_scaled_mm`` calls included, written in C++; docs/library.md advises it where the host
    bounds a step): the same outputs and gradients, bit for bit, as the eager fast path, stochastic rounding and
    per-step signs (``tseng``) included, with bias and padded rows."""
    _compiled_vs_eager(recipe, torch.bfloat16, True, True, (1000, 768, 256), inductor={"cpp_wrapper": True})


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all-sr"])
def test_cuda_dynamic_token_count_gives_the_eager_bits(recipe):
    """Dynamic shapes (the token count a symbol, as dynamo makes it once a model has seen a second batch size): one
    compiled graph serves token counts of either divisibility by 16 with the eager fast path's outputs and gradients
    bit for bit. (The kernels' self-check ran on the symbolic sizes and failed: "BooleanAtom not allowed".)"""
    _gpu()
    torch._dynamo.reset()
    f = torch.compile(lambda x, w, b: mx_linear(x, w, b, recipe), fullgraph=True, dynamic=True)
    for M in (1000, 512, 77):
        x, w, b, gy = _data(M, 768, 256, torch.bfloat16, seed=M)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager = fwd_bwd(x, w, None, gy.bfloat16(), lambda x, w, b: mx_linear(x, w, b, recipe))
            comp = fwd_bwd(x, w, None, gy.bfloat16(), f)
        for a, e, name in zip(comp, eager, ("y", "dX", "dW")):
            assert torch.equal(a, e), (recipe, M, name, (a - e).abs().max().item())
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all-rht16"])
def test_cuda_w_dual_gives_the_eager_bits(recipe):
    """``w_dual=on`` (the weight's two operands from one pass in the forward, the Dgrad one kept): the compiled
    layer's outputs and gradients are the eager fast path's bit for bit, random signs included, with bias and
    padded rows; the inexact-block counts by tensor too."""
    with settings.override(w_dual="on", mx_compiled_seeded=True):
        _compiled_vs_eager(recipe, torch.bfloat16, True, True, (1000, 768, 256))


@pytest.mark.cuda
def test_cuda_w_group_gives_the_eager_bits(monkeypatch):
    """``w_group=on`` (consecutive weight passes in one launch of ``_mxfp4_group_kernel``, placed by the joint-graph
    pass): five layers of the 125M-class model's shapes in a chain, float32 weights under autocast, compiled, give
    the eager fast path's output, dX and every dW bit for bit and the same inexact counts; the pass grouped passes in
    the forward and in the backward (inductor's graph cache off, so that the pass runs)."""
    _gpu()
    import torch._inductor.config as ic
    removed = []
    real = compiledmx.group_weight_launches
    monkeypatch.setattr(compiledmx, "group_weight_launches", lambda g: removed.append(real(g)) or removed[-1])
    g = torch.Generator(device="cuda").manual_seed(3)
    dims = (768, 2304, 768, 4096, 768, 768)
    x = torch.randn(2048, 768, device="cuda", generator=g)
    ws = [(torch.randn(o, i, device="cuda", generator=g) * 0.05).requires_grad_() for i, o in zip(dims, dims[1:])]
    ws[1].data[:32, :64] *= 2.0**-24   # (blocks below their group's carrier range: inexact blocks to count)
    gy = torch.randn(2048, dims[-1], device="cuda", generator=g).bfloat16()

    def chain(x, *ws):
        for w in ws:
            x = mx_linear(x, w, None, "mxfp4-all-dh16")
        return x

    def run(fn):
        xx = x.clone().requires_grad_()
        for w in ws:
            w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xx, *ws)
        y.backward(gy)
        return [y.detach(), xx.grad] + [w.grad.clone() for w in ws]
    before = fast.inexact_by_tensor("cuda")
    eager = run(chain)
    mid = fast.inexact_by_tensor("cuda")
    torch._dynamo.reset()
    with settings.override(w_group="on"), ic.patch(fx_graph_cache=False):
        comp = run(torch.compile(chain, fullgraph=True))
    after = fast.inexact_by_tensor("cuda")
    torch._dynamo.reset()
    for i, (a, e) in enumerate(zip(comp, eager)):
        assert torch.equal(a, e), (i, (a.float() - e.float()).abs().max().item())
    assert {k: mid[k] - before[k] for k in mid} == {k: after[k] - mid[k] for k in mid}
    assert mid["w"] - before["w"] > 0
    assert sum(removed) >= 6, removed   # (5 passes along K and 5 along N: 4 + 1 each way)


@pytest.mark.cuda
def test_cuda_compiled_graph_holds_no_custom_op():
    _gpu()
    x, w, b, _ = _data(256, 512, 256, torch.bfloat16)
    x.requires_grad_()

    def f(x, w, b):
        return mx_linear(x, w, b, "mxfp4-all-dh16")
    ops = ops_of(f, x, w.requires_grad_(), b)
    assert not any(o.startswith("mxtrain.linear") or "quantize_input" in o or "linear_q" in o for o in ops), ops
    assert any("q_dual" in o for o in ops), ops


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_compiled_model_trains_like_eager_without_recompiles(mode, caplog):
    """A converted Llama compiled with its MX layers in the graph trains with the losses of the same model
    compiled with the custom ops (which are the eager fast path's calls), in both compile modes; no recompile
    across steps; CUDA graphs are not skipped.

    The first step's loss is the same bit for bit (each layer's forward and backward is, in the layer test
    above). Later steps agree to a few 1e-5: on an H200 (torch 2.11) steps 1-3 were equal and step 4 differed by
    7e-5 relative, the same in both modes. The two graphs differ around the layers (opaque custom ops against
    traced kernels), so inductor fuses the non-MX ops next to them (norms, their backward reductions) in other
    ways; such last-bit gradient differences are hidden by the bf16 casts of autocast until one flips a
    rounding. Not yet isolated op by op (the open question: are the MX layers' weight gradients equal at
    step 1 when their inputs are)."""
    _gpu()
    import logging
    from mxtrain.model.llama import Llama, ModelConfig
    losses = {}
    for kind in ("auto", "ops"):
        torch.manual_seed(0)
        m = Llama(ModelConfig.named("tiny", vocab_size=512)).cuda()
        mxtrain.convert(m, "mxfp4-all-dh16")
        f = torch.compile(m, mode=None if mode == "default" else mode)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        out = []
        torch._dynamo.reset()
        with caplog.at_level(logging.WARNING), settings.override(mx_compiled=kind):
            for _ in range(6):
                idx = torch.randint(0, 512, (4, 129), device="cuda", generator=g)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = f(idx[:, :-1], idx[:, 1:])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                out.append(loss.item())
        losses[kind] = out
    assert losses["auto"][0] == losses["ops"][0], losses
    rel = [abs(a - b) / abs(b) for a, b in zip(losses["auto"], losses["ops"])]
    assert max(rel) < 5e-4, losses
    assert "skipping cudagraphs" not in caplog.text
    assert "Recompiling" not in caplog.text


def test_kernel_sources_hold_no_escape_sequences():
    """Inductor copies the source of a user kernel and of the functions it calls into a string literal of its
    generated code without escaping it: a backslash in that source (an asm string's ``\\n``) breaks the
    generated module (a SyntaxError when the compiled layer loads)."""
    import inspect
    from mxtrain.kernels import expand
    from mxtrain.kernels.mxfp4 import device
    for mod in (K, device, expand):
        src = inspect.getsource(mod)
        assert "\\" not in src, mod.__name__


def test_implementation_says_which_form_runs_a_layer():
    from mxtrain.linear import COMPILED_FORMS, implementation
    x, w = torch.zeros(64, 96), torch.zeros(32, 96)
    assert implementation("bf16", x, w) == COMPILED_FORMS["plain"]
    assert implementation("mxfp4-all-dh16", x, w) == COMPILED_FORMS["op"]          # CPU: no fused kernels
    assert "reference" in implementation("mxfp4-all-dh16", x, w, compiled=False)


@pytest.mark.cuda
def test_cuda_implementation_of_the_default_settings():
    _gpu()
    from mxtrain.linear import COMPILED_FORMS, implementation
    x, w = torch.zeros(64, 96, device="cuda"), torch.zeros(32, 96, device="cuda")
    assert implementation("mxfp4-all-dh16", x, w) == COMPILED_FORMS["graph"]
    assert implementation("mxfp4-all-sr", x, w) == COMPILED_FORMS["graph"]   # seeded: mx_compiled_seeded on
    with settings.override(mx_compiled_seeded=False):
        assert implementation("mxfp4-all-sr", x, w) == COMPILED_FORMS["split_ops"]
    with settings.override(mx_compiled="ops"):
        assert implementation("mxfp4-all-dh16", x, w) == COMPILED_FORMS["split_ops"]


def test_compiled_layer_kernels_are_the_same_code_with_contraction_on():
    """Inductor compiles user kernels with floating-point contraction on (torch 2.11 and 2.13), mxtrain's own
    launches with it off: every kernel variant the compiled layer launches must compile to the same code either
    way (no product fused into an FMA by LLVM or ptxas), so that its bytes cannot differ from the eager path's.
    Compiled for sm_90 on the CPU (``tools/compile_check.py --fusion``)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    only = ["graph dual x r16 g128 fp4_b", "graph dual dy r16", "graph blocks w r16 g128", "graph cols w r16 g128",
            "graph expand g128",
            # the seeded recipes' (mx_compiled_seeded), one variant each (CI time; tools/compile_check.py --fusion
            # checks all of FUSION_CHECKED): tseng's 64-wide pass with signs, SR and prescale, mxfp4-all-sr's dY
            # with SR on both sides, mxfp4-all-rht16's X with random signs (the blocks and cols layouts' sign code)
            "graph tile dy r64 signs sr prescale keyptr rows", "graph dual dy sr keyptr r0",
            "graph dual x signs r16 fold g128 fp4_b",
            # issue #51's grids and rule (the variants of tools/compile_check.py's table): INT4 and E1M2 dual passes
            # and carrier rebuilds, an adaptive one. (The adaptive blocks-128 and dual variants differ with and without
            # contraction in the count of FMULs alone, through the register cap their eager launch has and inductor's
            # drops: compiled both ways without the cap they are the same code.)
            "int4 dual x signs r16 fold fp4_b", "int4 expand", "e1m2 dual x signs r16 fold fp4_b",
            "adaptive cols r0 sr car",
            # the cols layout with one value a thread (setting qcols singles): the compiled layer's two dual passes
            "singles dual dy r16", "singles dual x r16 g128 fp4_b",
            # a block's four weights in one launch (setting w_group), along K
            "graph group w r16 g128 blocks"]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "fusion.json")
        p = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_check.py"), "--fusion", "--jobs", "2",
                            "--json", out, *[a for o in only for a in ("--only", o)]],
                           capture_output=True, text=True, env=env, cwd=root, timeout=900)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        res = json.loads(open(out).read())
    assert sorted(res) == sorted(only)
    for name, r in res.items():
        assert r["same"], (name, r)
        assert sum(a for a, _ in r["float_ops"].values()) > 0, name   # (it sees the kernels' float work)


def test_layers_reading_one_input_share_its_quantization(monkeypatch):
    """``mx_compiled=auto`` (the default): the pass over dynamo's graph merges the q/k-style layers' quantize calls of their
    shared input into one (with the views leading to them), and the graph computes the same outputs and
    gradients as without it. CPU: dynamo's fake run of the ops skips the interpreted launches; the captured graph
    then runs for real."""
    from torch._subclasses.fake_tensor import is_fake
    real = compiledmx._traced._launch
    monkeypatch.setattr(compiledmx._traced, "_launch", lambda kfn, grid, args, consts, nw: None if any(
        is_fake(a) for a in args if isinstance(a, torch.Tensor)) else real(kfn, grid, args, consts, nw))
    fast.state.prepare("cpu")
    mx = compiledmx.spec(recipes.get("mxfp4-all-dh16"))

    def block(x, wq, wk):
        return sum(compiledmx.linear(x, w, None, mx, (128, 128)).sum() for w in (wq, wk))

    def counts(graph):
        return sum(1 for n in graph.nodes if n.target in (torch.ops.mxtrain.q_dual, torch.ops.mxtrain.q_dual.default))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 32, generator=g)
    ws = [torch.randn(n, 32, generator=g) for n in (32, 16)]
    results = {}
    for share in (False, True):
        seen = {}

        def backend(gm, example_inputs, share=share, seen=seen):
            seen["before"] = counts(gm.graph)
            seen["removed"] = compiledmx.share_inputs(gm.graph) if share else 0
            gm.recompile()
            seen["after"] = counts(gm.graph)
            return gm
        torch._dynamo.reset()
        xs, wts = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in ws]
        torch.compile(block, backend=backend, fullgraph=True)(xs, *wts).backward()
        results[share] = (seen, [xs.grad, *[w.grad for w in wts]])
    torch._dynamo.reset()
    assert results[False][0]["before"] == results[False][0]["after"] == 2
    assert results[True][0]["before"] == 2 and results[True][0]["after"] == 1 and results[True][0]["removed"] >= 3
    for a, b in zip(results[True][1], results[False][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["mxfp4-all-rht16"])   # (H16 with signs: mxfp4-all-dh16's path and the seeds')
def test_w_dual_gives_the_same_outputs_and_gradients(recipe, monkeypatch):
    """``w_dual=on``: the weight's Fprop and Dgrad operands from one pass in the forward (``q_dual`` with 128-row
    groups on both sides), the Dgrad one kept for the backward: the layer's output, dX and dW are those of the
    default (each operand in its own pass) bit for bit, and the forward makes the weight's pass. CPU: the kernels
    under Triton's interpreter, the layer function called as the compiled graph calls it. (Random signs:
    ``mxfp4-all-rht16``, whose Fprop and Dgrad rotations draw different signs, from the same call's seeds.)"""
    fast.state.prepare("cpu")
    rec = recipes.get(recipe)
    mx = compiledmx.spec(rec)
    calls = []
    real = compiledmx._dual
    monkeypatch.setattr(compiledmx, "_dual", lambda *a, **k: (calls.append(k.get("group_rows_a", 1)),
                                                              real(*a, **k))[1])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, 256, generator=g)
    w = torch.randn(200, 256, generator=g) * 0.05   # (N padded to 256 rows in the weight's carriers)
    gy = torch.randn(1, 64, 200, generator=g)
    keys = signs = None
    if compiledmx.seeded(mx):   # (the same call's seeds for both modes)
        from mxtrain.linear.dispatch import call_seeds
        keys, signs = call_seeds(torch.tensor([7, 3, 2]), rec, True)
    out = {}
    for mode in ("off", "on"):
        calls.clear()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with settings.override(w_dual=mode, qselfcheck="off", dual="on"):
            y = compiledmx.linear(xs, ws, None, mx, (128, 128), keys, signs)
            y.backward(gy)
        out[mode] = ([y.detach(), xs.grad, ws.grad], list(calls))
    for a, b in zip(out["off"][0], out["on"][0]):
        assert torch.equal(a, b)
    assert 128 not in out["off"][1] and out["on"][1].count(128) == 1, out
    # no dX asked for: the weight's Dgrad operand is not made in the forward
    calls.clear()
    with settings.override(w_dual="on", qselfcheck="off", dual="on"):
        compiledmx.linear(x, w.clone().requires_grad_(), None, mx, (128, 128), keys, signs).backward(gy)
    assert 128 not in calls


def test_selfcheck_under_dynamic_shapes_runs_on_stand_ins_of_each_kind():
    """Under dynamic shapes the quantize ops' self-check (``traced._selfcheck``) gets real tensors and integers, one of
    each divisibility by 16 for each symbolic size (the kernel compiled for the symbol runs on both), the layout kept,
    and no guard on the symbol: before, it got the symbolic sizes and raised inside the trace on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from torch._dynamo.source import ConstantSource
    from mxtrain.kernels.mxfp4 import traced
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.randn(200, 96), symbolic_context=ctx, source=ConstantSource("x"))
    xt = mode.from_tensor(torch.randn(96, 200).t(), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC]), source=ConstantSource("xt"))
    assert isinstance(x.shape[0], torch.SymInt)
    seen = []

    def check(*args):
        seen.append(args)
        return True
    with settings.override(qselfcheck="always"):
        traced._selfcheck(check, x, 1, x.shape[0], 96)
        traced._selfcheck(check, xt, 0)
    assert len(seen) == 4 + 2
    for args in seen:
        assert not any(isinstance(a, torch.SymInt) for a in args)
        assert not any(isinstance(a, torch.Tensor) and (a.__class__ is not torch.Tensor) for a in args)
    assert sorted((a[0].shape[0] % 16 == 0, a[2] % 16 == 0) for a in seen[:4]) == [
        (False, False), (False, True), (True, False), (True, True)]
    assert all(a[0].shape[1] == 96 and a[0].stride(1) == 1 and a[3] == 96 for a in seen[:4])
    assert sorted(a[0].shape[1] % 16 == 0 for a in seen[4:]) == [False, True]
    assert all(a[0].shape[0] == 200 and a[0].stride(0) == 1 for a in seen[4:])   # column-major kept
    assert not env.guards
    # a trace without symbols: the arguments as they are, once
    seen.clear()
    with settings.override(qselfcheck="always"):
        traced._selfcheck(check, torch.zeros(4, 8), 3)
    assert len(seen) == 1 and seen[0][1] == 3


def test_w_dual_setting_is_read_from_the_environment():
    assert settings.Settings().w_dual == "off"
    assert settings.Settings.from_env({"MXTRAIN_W_DUAL": "on"}).w_dual == "on"
    with pytest.raises(settings.SettingsError):
        settings.Settings.from_env({"MXTRAIN_W_DUAL": "sometimes"})


def test_share_pass_keeps_reads_across_an_in_place_write_apart():
    import operator
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c = graph.placeholder("c")
    q1 = graph.call_function(torch.ops.mxtrain.q_single.default, (x, c, 1, 0, "floor", True, False, 1, 512))
    graph.call_method("add_", (x, 1.0))
    q2 = graph.call_function(torch.ops.mxtrain.q_single.default, (x, c, 1, 0, "floor", True, False, 1, 512))
    q3 = graph.call_function(torch.ops.mxtrain.q_single.default, (x, c, 1, 0, "floor", True, False, 1, 512))
    graph.output((graph.call_function(operator.getitem, (q1, 0)), graph.call_function(operator.getitem, (q2, 0)),
                  graph.call_function(operator.getitem, (q3, 0))))
    assert compiledmx.share_inputs(graph) == 2   # q3 and its getitem merge with q2's; q1 stays apart
    left = [n for n in graph.nodes if n.target is torch.ops.mxtrain.q_single.default]
    assert left == [q1, q2]


def test_installed_share_passes_act_only_on_shared_compiles():
    """Once ``mx_compiled=auto`` (the default) has installed the passes in inductor's config (they stay for the
    process), a later compile under ``separate`` (or ``ops``) keeps one quantize call per layer, as in a fresh
    process: ``separate``'s graphs, and an A/B of the two in one process (``bench step``'s variants), are not
    merged behind the user's back; inductor's caches key on the mode."""
    import operator

    def graph_with_two_reads():
        graph = torch.fx.Graph()
        x, c = graph.placeholder("x"), graph.placeholder("c")
        qs = [graph.call_function(torch.ops.mxtrain.q_single.default, (x, c, 1, 0, "floor", True, False, 1, 512))
              for _ in range(2)]
        graph.output(tuple(graph.call_function(operator.getitem, (q, 0)) for q in qs))
        return graph

    def left(graph):
        return sum(1 for n in graph.nodes if n.target is torch.ops.mxtrain.q_single.default)
    inputs, carriers = compiledmx.SharePass(), compiledmx.ShareCarrierPass()
    uuids = {}
    for mode, calls in (("separate", 2), ("ops", 2), ("auto", 1), ("shared", 1)):
        with settings.override(mx_compiled=mode):
            g = graph_with_two_reads()
            inputs(g)
            assert left(g) == calls, mode
            uuids[mode] = (inputs.uuid(), carriers.uuid())
    assert uuids["separate"] == uuids["ops"] != uuids["auto"] == uuids["shared"]
    assert uuids["separate"][0] != uuids["auto"][0] and uuids["separate"][1] != uuids["auto"][1]


def test_carrier_pass_merges_rebuilds_of_the_same_codes_only():
    """``share_carriers`` on a joint graph as aot_autograd writes it (functional launches of ``_expand_kernel``, each
    into fresh buffers, the inexact-block counter chained through them): of three rebuilds of one operand's codes the
    first stays and serves the others' readers, the counter chain skips the dropped launches; a rebuild of other
    codes, or of the same codes with other arguments, stays. (tests/linear/test_graph_structure.py: the real block's
    graph.)"""
    import operator
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from mxtrain.kernels.expand import _expand_kernel
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    graph = torch.fx.Graph()
    pk, sc, pk2, cnt = (graph.placeholder(n) for n in ("pk", "sc", "pk2", "cnt"))
    kidx = kernel_side_table.add_kernel(_expand_kernel)
    cidx = kernel_side_table.add_constant_args({})

    def expand(p, c, rows=256):
        car = graph.call_function(torch.ops.aten.empty.memory_format, ([rows, 512],), {"dtype": torch.uint8})
        gs = graph.call_function(torch.ops.aten.empty.memory_format, ([2, 4],), {"dtype": torch.float32})
        kw = dict(pk_ptr=p, sc_ptr=sc, car_ptr=car, gs_ptr=gs, cnt_ptr=c, R=rows, Kq=256, Rc=rows, Kc=512, gs_sr=4,
                  gs_sk=1, BR=128, GROUP_ROWS=128, GRID=0)
        n = graph.call_function(hop, (), dict(kernel_idx=kidx, constant_args_idx=cidx, grid=[(2, 4, 1)],
                                              tma_descriptor_metadata={}, kwargs=kw,
                                              tensors_to_clone=["car_ptr", "gs_ptr", "cnt_ptr"]))
        return n, [graph.call_function(operator.getitem, (n, k)) for k in ("car_ptr", "gs_ptr", "cnt_ptr")]
    e1, (car1, gs1, c1) = expand(pk, cnt)
    e2, (car2, gs2, c2) = expand(pk, c1)
    e3, (car3, _, c3) = expand(pk2, c2)           # other codes
    e4, (car4, gs4, c4) = expand(pk, c3)
    e5, (car5, _, c5) = expand(pk, c4, rows=384)  # the same codes, another launch
    graph.output((car1, car2, gs2, car3, car4, gs4, car5, c5))
    assert compiledmx.share_carriers(graph) == 2
    graph.lint()
    launches = [n for n in graph.nodes if n.target is hop]
    assert launches == [e1, e3, e5]
    out = graph.output_node().args[0]
    assert [o.args for o in out[:3]] == [(e1, "car_ptr"), (e1, "car_ptr"), (e1, "gs_ptr")]
    assert out[3] is car3 and [o.args for o in out[4:6]] == [(e1, "car_ptr"), (e1, "gs_ptr")] and out[6] is car5
    assert e3.kwargs["kwargs"]["cnt_ptr"] is c1 and e5.kwargs["kwargs"]["cnt_ptr"] is c3 and out[7] is c5
    assert sum(1 for n in graph.nodes if n.target is torch.ops.aten.empty.memory_format) == 6   # (2 dropped launches)


def test_group_pass_merges_consecutive_weight_passes_of_one_variant():
    """``group_weight_launches`` on a joint graph as aot_autograd writes it (functional launches of ``_mxfp4_kernel``
    on graph inputs, the inexact-block counter chained through them): six passes of one variant become a group of 4
    and one of 2 (``GROUP_MAX``), each group where its first pass was, with every pass's buffers and integers in a slot
    of its own and its programs after the previous slot's; their readers read the group's outputs, the counter runs
    through the groups. A pass of another variant between them, or one on another counter, splits the run; a pass of
    a tensor made in the graph (not an input) is not grouped."""
    import operator
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    graph = torch.fx.Graph()
    ws = [graph.placeholder(f"w{i}") for i in range(8)]
    cnt, cnt2 = graph.placeholder("cnt"), graph.placeholder("cnt2")
    for w in ws:
        w.meta["val"] = torch.empty(256, 256)
    kidx = kernel_side_table.add_kernel(K._mxfp4_kernel)
    cidx = kernel_side_table.add_constant_args({"pid_r": None, "pid_k": None})

    def quant(x, c, rows=256, rot=16):
        car = graph.call_function(torch.ops.aten.empty.memory_format, ([rows, 512],), {"dtype": torch.uint8})
        gs = graph.call_function(torch.ops.aten.empty.memory_format, ([rows // 128, 4],), {"dtype": torch.float32})
        kw = dict(x_ptr=x, signs_ptr=c, car_ptr=car, gs_ptr=gs, fp4_ptr=c, sc_ptr=c, cnt_ptr=c, key_ptr=c, R=rows,
                  K=256, Rc=rows, sx_r=256, sx_k=1, si_r=256, si_k=1, Kc=512, Kq=256, gs_sr=4, gs_sk=1, key=0,
                  inv_sqrt=0.25, prescale=1.0, BR=128, ROT=rot, HAS_SIGNS=False, RULE=0, SR=False, PRESCALE=False,
                  GROUP_ROWS=128, WRITE_CARRIER=True, WRITE_FP4=False, IDX64=False, KEY_PTR=False, LAYOUT="blocks",
                  GRID=0, USE_ASM=False, FOLD=False, SPLIT16=True, BFIRST=True, PACK=4)
        n = graph.call_function(hop, (), dict(kernel_idx=kidx, constant_args_idx=cidx, grid=[(rows // 128, 2, 1)],
                                              tma_descriptor_metadata={}, kwargs=kw,
                                              tensors_to_clone=["car_ptr", "gs_ptr", "cnt_ptr"]))
        n.meta["val"] = {"car_ptr": torch.empty(rows, 512, dtype=torch.uint8),
                         "gs_ptr": torch.empty(rows // 128, 4), "cnt_ptr": torch.empty(1, dtype=torch.int32)}
        # (the inputs' eager values, as dynamo records them: what torch's post-grad decomposition replays)
        eager.setdefault(x, torch.empty(256, 256) if x.op == "placeholder" else torch.empty(256, 256, dtype=torch.half))
        n.meta["eager_input_vals"] = ((), torch.utils._pytree.tree_map_only(
            torch.fx.Node, lambda v: eager.get(v, "eager " + v.name), dict(n.kwargs)))
        outs = [graph.call_function(operator.getitem, (n, k)) for k in ("car_ptr", "gs_ptr", "cnt_ptr")]
        return n, outs
    cars, c, eager = [], cnt, {}
    for i in range(6):                                   # one run of six: 4 + 2
        _, (car, gs, c) = quant(ws[i], c, rows=128 * (i % 3 + 1))
        cars += [car, gs]
    _, (car_o, _, c) = quant(ws[6], c, rot=32)           # another variant: alone
    _, (car_a, _, c) = quant(ws[7], c)                   # after it: alone (a run of one stays as it is)
    made = graph.call_function(torch.ops.aten.mul.Tensor, (ws[0], 2.0))
    _, (car_m, _, c) = quant(made, c)                    # not a graph input
    _, (car_b, _, d) = quant(ws[0], cnt2)                # another counter
    graph.output((*cars, car_o, car_a, car_m, car_b, c, d))
    assert compiledmx.group_weight_launches(graph) == 4
    graph.lint()
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in graph.nodes
               if n.target is hop]
    assert kernels == ["_mxfp4_group_kernel", "_mxfp4_group_kernel"] + ["_mxfp4_kernel"] * 4, kernels
    g1, g2 = [n for n in graph.nodes if n.target is hop][:2]
    k1, k2 = g1.kwargs["kwargs"], g2.kwargs["kwargs"]
    assert (k1["G"], k2["G"]) == (4, 2) and k1["cnt_ptr"] is cnt and k2["cnt_ptr"].args == (g1, "cnt_ptr")
    assert [k1[f"x{i}"] for i in range(4)] == ws[:4] and [k2[f"x{i}"] for i in range(2)] == ws[4:6]
    assert [k1[f"end{i}"] for i in range(4)] == [2, 6, 12, 14] and [k1[f"R{i}"] for i in range(4)] == [128, 256, 384, 128]
    assert g1.kwargs["grid"] == [(14, 1, 1)] and g2.kwargs["grid"] == [(4 + 6, 1, 1)]
    assert k2["car2"] is k2["cnt_ptr"] and k2["x2"] is ws[4]   # (unused slots: never written, never read)
    out = graph.output_node().args[0]
    assert [o.args for o in out[:4]] == [(g1, "car0"), (g1, "gs0"), (g1, "car1"), (g1, "gs1")]
    assert [o.args for o in out[8:12]] == [(g2, "car0"), (g2, "gs0"), (g2, "car1"), (g2, "gs1")]
    assert g1.meta["val"]["car2"].shape == (384, 512) and sorted(g1.kwargs["tensors_to_clone"])[-1] == "gs3"
    # the group launch's eager values are of its own arguments (the same tree), each input's from its pass
    for g in (g1, g2):
        ev = g.meta["eager_input_vals"]
        assert ev[0] == () and torch.utils._pytree.tree_structure(ev[1]) == torch.utils._pytree.tree_structure(
            torch.utils._pytree.tree_map_only(torch.fx.Node, lambda v: 0, dict(g.kwargs)))
        assert all(ev[1]["kwargs"][f"x{i}"] is eager[g.kwargs["kwargs"][f"x{i}"]] for i in range(4))
        assert ev[1]["kwargs"]["car0"] == "eager " + g.kwargs["kwargs"]["car0"].name


def test_share_pass_chains_a_users_pass_and_has_a_uuid():
    for cls in (compiledmx.SharePass, compiledmx.ShareCarrierPass):
        calls = []
        p = cls(lambda g: calls.append(g))
        graph = torch.fx.Graph()
        graph.output(graph.placeholder("x"))
        p(graph)
        assert calls == [graph] and p.uuid() == cls(p.before).uuid(), cls
    assert compiledmx.SharePass().uuid() != compiledmx.ShareCarrierPass().uuid()


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "mxfp4-all"])
def test_cuda_shared_input_gives_the_unshared_values(recipe):
    """``mx_compiled=auto`` (the default) on a GPU: three layers reading one input (q/k/v), compiled with the shared
    quantize (``share_inputs``) and the shared carrier of X's Wgrad operand (``share_carriers``, inductor's joint
    pass), give the outputs and weight gradients of the same layers compiled with ``separate`` bit for bit (the same kernels on the
    same values; each output's gradient is given, so nothing between the layers and the loss can be fused
    differently); dX, a sum of the three layers' bf16 contributions whose additions inductor may fuse differently
    in the two graphs, to a few bf16 roundings."""
    _gpu()
    from torch._inductor import config as ic
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 256, 512, device="cuda", generator=g).to(torch.bfloat16)
    ws = [(torch.randn(n, 512, device="cuda", generator=g) * 0.05) for n in (512, 256, 256)]
    gys = [torch.randn(4, 256, n, device="cuda", generator=g).to(torch.bfloat16) for n in (512, 256, 256)]

    def block(x, wq, wk, wv):
        return tuple(mx_linear(x, w, None, recipe) for w in (wq, wk, wv))
    out = {}
    for mode in ("separate", "auto"):
        torch._dynamo.reset()
        xs = x.clone().requires_grad_()
        wts = [w.clone().requires_grad_() for w in ws]
        with settings.override(mx_compiled=mode), ic.patch(pre_grad_custom_pass=None, joint_custom_pre_pass=None):
            ys = torch.compile(block, fullgraph=True)(xs, *wts)
            torch.autograd.backward(ys, gys)
            if mode == "auto":
                assert isinstance(ic.joint_custom_pre_pass, compiledmx.ShareCarrierPass)
        out[mode] = ([y.detach() for y in ys], xs.grad, [w.grad for w in wts])
    torch._dynamo.reset()
    (ya, dxa, dwa), (ysh, dxs, dws) = out["separate"], out["auto"]
    for a, b in zip(ya + dwa, ysh + dws):
        assert torch.equal(a, b)
    assert torch.allclose(dxa.float(), dxs.float(), rtol=2 ** -6, atol=1e-3 * dxa.float().abs().max().item())


_ACCESS_SCRIPT = r'''
import json, sys, torch, triton
from unittest import mock
from triton.backends.compiler import GPUTarget
import torch._higher_order_ops.triton_kernel_wrap as tkw
from mxtrain.kernels import access_cache
from mxtrain.kernels.mxfp4 import launch, traced
name = access_cache.install()
wrapped = getattr(tkw, name)
launches = []
real_launch = traced._launch
traced._launch = lambda kfn, grid, args, consts, nw: launches.append((kfn, launch.kernel_kwargs(kfn, args, consts)))
cnt = torch.zeros(4, dtype=torch.int64)
for rows, cols in ((256, 512), (384, 1024)):      # two shapes: the second launch of each variant is a cache hit
    x = torch.randn(rows, cols, dtype=torch.bfloat16)
    torch.ops.mxtrain.q_single(x, cnt, 1, 16, "floor", True, False, 128, 128)
    torch.ops.mxtrain.q_dual(x, cnt, 16, "floor", 16, "floor", 128, True, 128)
    pk, sc = torch.zeros(rows, cols // 2, dtype=torch.uint8), torch.zeros(rows, cols // 32, dtype=torch.uint8)
    torch.ops.mxtrain.q_expand(pk, sc, cnt, cols, 128, 128)
    torch.ops.mxtrain.q_dual(x, cnt, 0, "floor", 0, "floor", 1, False, 128)     # dY's: B as a carrier, 1-row groups
    torch.ops.mxtrain.q_single(x, cnt, 0, 0, "floor", False, True, 128, 128)    # along M, FP4 codes only
    torch.ops.mxtrain.q_single(x, cnt, 0, 0, "floor", True, False, 128, 128)    # along M, carrier (W along N)
class Target:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
def names(r, what="writes"):
    rw = getattr(r, "read_writes", None)
    return sorted(d.name for d in getattr(rw, what)) if rw is not None else sorted(r)
out = []
with mock.patch.object(triton.runtime.driver, "_active", Target(), create=True):
    for kfn, kw in launches:
        access_cache.DECLARE = False
        cached, fresh = wrapped(kfn, kw, {}), wrapped.__wrapped__(kfn, kw, {})
        access_cache.DECLARE = True
        table = wrapped(kfn, kw, {})
        out.append([kfn.fn.__name__, names(cached), names(fresh), names(table),
                    sorted(set(names(fresh, "reads")) - set(names(table, "reads"))),
                    access_cache.declared_writes(kfn, kw)])
    @triton.jit
    def other(p):
        triton.language.store(p, 1.0)
    other.fn.__module__ = "elsewhere"
    t = torch.zeros(4)
    wrapped(other, {"p": t}, {})
    wrapped(other, {"p": t}, {})
ACCESS = {"name": name, "launches": out, "stats": access_cache.stats(),
          "table_used": name == "identify_accessed_tensors" or access_cache.DECLARE_MUTATED}
# inductor's kernel-source text (its FX graph cache key): once per kernel, equal to torch's own
import torch._inductor.codegen.wrapper as inductor_wrapper
source = getattr(inductor_wrapper, access_cache._SOURCE)
texts, seen = [], []
for kfn, _ in launches:
    if any(kfn is k for k in seen):
        continue
    seen.append(kfn)
    first, again = source(kfn), source(kfn)
    texts.append([kfn.fn.__name__, first == source.__wrapped__(kfn), again is first, len(first)])
before = access_cache.stats()
other_texts = [source(other), source(other)]
ACCESS["source"] = {"wrapped": getattr(source, "_mxtrain_cached", False), "texts": texts,
                    "stats": [before["source_hits"], before["source_misses"]],
                    "other_counted": access_cache.stats() != before,
                    "other_equal": other_texts[0] == other_texts[1] == source.__wrapped__(other),
                    "epilogue": source(seen[0], ("fused", "def x(): pass")) != source(seen[0])}
traced._launch = real_launch   # (what the graph script below traces)
'''


@pytest.fixture(scope="module")
def sm90_child(tmp_path_factory):
    """The answers of ``_ACCESS_SCRIPT`` and then ``_GRAPH_SCRIPT`` (below), run one after the other in one child
    process (a start-up with torch, Triton and dynamo fewer than one each): real Triton IR for sm_90, so without the
    interpreter. The graph script starts from what the access script leaves (its recording ``_launch`` put back;
    the access cache's answers, which the access test checks against torch's own analysis)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path_factory.mktemp("sm90") / "sm90.py"   # (a file: Triton reads a jitted function's source)
    script.write_text(_ACCESS_SCRIPT + _GRAPH_SCRIPT + 'json.dump({"access": ACCESS, "graph": GRAPH}, sys.stdout)\n')
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=root,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def test_kernel_access_analysis_runs_once_per_variant_and_agrees_with_torch(sm90_child):
    """``kernels.access_cache``: torch's analysis of which tensors a kernel launch writes (Triton IR, compiled per
    launch) is cached per kernel variant for mxtrain's kernels: the cached answer for a second shape equals the
    analysis torch makes of that launch itself; the writes are the op's outputs and the counter, never its input;
    a kernel of another module is analysed by torch every time. The ``READ_ONLY`` table's answer (used instead of
    the analysis on torch 2.12+, and before with ``DECLARE_MUTATED``) has exactly torch's writes (with 2.12+ at
    least its reads too); its pre-2.12 form (``declared_writes``) is checked on every torch. Real Triton IR for
    sm_90, so in a process without the interpreter (``sm90_child``)."""
    res = sm90_child["access"]
    assert res["name"] in ("identify_accessed_tensors", "identify_mutated_tensors")
    assert len(res["launches"]) == 12
    for fn, cached, fresh, table, reads_missed, writes in res["launches"]:
        assert cached == fresh, fn
        assert "x_ptr" not in cached and len(cached) >= 2, (fn, cached)
        # the READ_ONLY table's answer where it is used: exactly torch's writes (and with 2.12+ at least its reads)
        if res["table_used"]:
            assert table == fresh and reads_missed == [], (fn, table, fresh, reads_missed)
        # its pre-2.12 form (identify_mutated_tensors: the names written) is the same set, used or not
        assert sorted(writes) == fresh, (fn, writes, fresh)
    declared = 12 if res["table_used"] else 0
    # where the table is not used, the script's third call of each launch (``table``) is a cache hit too, 12 more
    hits = 6 if declared else 18
    assert {k: res["stats"][k] for k in ("hits", "misses", "bypassed", "declared")} == {
        "hits": hits, "misses": 6, "bypassed": 2, "declared": declared}


def test_inductor_reads_each_kernels_source_once_and_gets_torchs_text(sm90_child):
    """``kernels.access_cache`` also memoizes inductor's kernel-source text (the transitive closure of a user
    kernel's ``triton.jit`` functions, which keys the FX graph cache and which torch recomputes for every launch,
    about 45 ms a quantize kernel): installed with the access cache; for each of mxtrain's kernels the text equals
    torch's own and a second call returns the first text without computing it; a kernel of another module, or a
    launch with an epilogue fused into it, gets torch's own computation every time."""
    res = sm90_child["access"]["source"]
    assert res["wrapped"]
    names = sorted(t[0] for t in res["texts"])
    assert names == ["_expand_kernel", "_mxfp4_dual_kernel", "_mxfp4_kernel"], names
    for name, equal, memo, size in res["texts"]:
        assert equal and memo and size > 1000, (name, equal, memo, size)
    assert res["stats"] == [3, 3], res["stats"]   # (each kernel: one computed, one from the memo)
    assert not res["other_counted"] and res["other_equal"]
    assert res["epilogue"]   # (the fused text is torch's, not the memo's)


def test_a_setting_changed_after_compiling_recompiles_the_layer(monkeypatch):
    """Every decision of the compiled layer is made at trace time, the ops' launch settings included: the
    settings the ops' bodies read are passed to ``plan`` (dynamo guards on them), so a change after compiling
    recompiles, and a setting the layer does not read does not. CPU: ``plan`` stands in for the GPU's answer."""
    from torch._dynamo.utils import counters
    from mxtrain.linear._constant import assume_constant_result
    monkeypatch.setattr(compiledmx, "plan", assume_constant_result(lambda device, share=False, *knobs: (1, 128)))
    mx = compiledmx.spec(recipes.get("mxfp4-all-dh16"))
    w = torch.zeros(8, 32)

    def f(x):
        return x * compiledmx.applies(mx, x, w, settings.current())[1]
    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.ones(4, 32)
    graphs = []
    with settings.override(dual="auto", qkernel="auto", qmaxnreg=80, qblocks="auto", qcols="auto"):
        for change in ({}, {"dual": "off"}, {"qkernel": "tile"}, {"qmaxnreg": 64}, {"qselfcheck": "off"},
                       {"qblocks": "lanes"}, {"qcols": "singles"}, {"wgrad_x_recompute": True}, {"wgrad_x": "forward"}):
            with settings.override(**change):
                assert torch.equal(cf(x), x * 128)
            graphs.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert graphs == [1, 2, 3, 4, 5, 6, 7, 8, 8]   # (wgrad_x is read by compiledmx.linear, not by applies)


def test_trace_time_settings_are_the_ones_the_ops_read():
    """``compiledmx.TRACE_TIME_SETTINGS`` names every setting the launch descriptions and the self-check read
    (``st.<name>`` in kernels/mxfp4/launch.py and verify.py) but the eager launch machinery's."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    read = set()
    for f in ("launch.py", "verify.py"):
        read |= set(re.findall(r"\bst\.([a-z_]+)", open(os.path.join(root, "mxtrain", "kernels", "mxfp4", f)).read()))
    assert read - {"fast_launch", "append"} == set(compiledmx.TRACE_TIME_SETTINGS)
    for n in compiledmx.TRACE_TIME_SETTINGS:
        assert n in settings.Settings.__dataclass_fields__


_GRAPH_SCRIPT = r'''
import collections, json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from functorch.compile import aot_function, default_partition, make_boxed_func
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from mxtrain.linear import compiledmx, fast
from mxtrain.numerics import recipes
from mxtrain import settings

class Target:   # (Triton IR for sm_90 on a machine without a GPU: torch's analysis of what each launch writes)
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
triton.runtime.driver._active = Target()
settings.configure(qselfcheck="off", wgrad_x="forward")   # (the layer that rebuilds X's carrier from codes)
amp = torch.is_autocast_enabled
torch.is_autocast_enabled = lambda *a: False if a and a[0] == "meta" else amp(*a)
fast.state.prepare("meta")
joint = []

def partition(gm, inputs, **kw):
    joint.append(gm)
    return default_partition(gm, inputs, **kw)

def run(recipe, n_layers, M=256, K=256, N=512):
    from mxtrain.linear.dispatch import mx_spec
    mx = mx_spec(recipes.get(recipe))
    def block(x, c0, c1, c2, c3, c4, keys, signs, *ws):
        fast.state.by_name["meta"] = (c0, c1, c2, c3, c4)   # (the counters as graph inputs, as dynamo lifts them)
        return sum(compiledmx.linear(x, w, None, mx, (128, 128), keys, signs).float().sum() for w in ws)
    x = torch.empty(M, K, device="meta", dtype=torch.bfloat16, requires_grad=True)
    ws = [torch.empty(N, K, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(n_layers)]
    cs = [torch.zeros(1, dtype=torch.int32, device="meta") for _ in range(len(fast.COUNTERS))]
    seeds = (torch.zeros(24, dtype=torch.int32, device="meta"), torch.ones(3, 128, device="meta"))
    joint.clear()
    compiler = lambda gm, example_inputs: make_boxed_func(gm.forward)
    aot_function(block, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition)(x, *cs, *seeds, *ws)
    g = joint[0].graph
    places = [n for n in g.nodes if n.op == "placeholder"]
    inputs, counters = set(places), set(places[1:1 + len(fast.COUNTERS)])   # (a counter is a mutated input)
    kernels, cloned, clones = collections.Counter(), [], 0
    for n in g.nodes:
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            kernels[k.fn.__name__] += 1
            for name in n.kwargs["tensors_to_clone"]:
                arg = n.kwargs["kwargs"][name]
                if arg in inputs and arg not in counters:
                    cloned.append(name)
        clones += n.target is torch.ops.aten.clone.default
    return {"kernels": dict(kernels), "cloned_inputs": cloned, "clones": clones}
GRAPH = {f"{r} x{n}": run(r, n) for r, n in (("mxfp4-all", 1), ("mxfp4-all", 2), ("mxfp4-all-dh16", 1),
                                             ("mxfp4-fprop", 1), ("mxfp4-all-sr", 1), ("tseng", 1))}
# w_group's pass on the real joint graph of five layers: what it leaves, and the partitioner's split of it
removed = []
real_partition = partition
def partition(gm, inputs, **kw):
    removed.append(compiledmx.group_weight_launches(gm.graph))
    gm.graph.lint()
    gm.recompile()
    return real_partition(gm, inputs, **kw)
grouped = run("mxfp4-all-dh16", 5)
grouped["removed"] = removed
GRAPH["grouped"] = grouped
'''


def test_graph_of_a_compiled_layer_under_fake_gpu_tensors(sm90_child):
    """What the compiler gets from a compiled layer, forward and backward (the joint graph aot_autograd traces,
    with the quantize ops decomposed into their Triton launches and torch's analysis of what each writes, for
    sm_90, on meta tensors): five quantize launches a layer (X and dY in one pass each, W along K and along N,
    X's carrier from its FP4 codes), two for ``mxfp4-fprop``; no launch makes the compiler copy an input (X, W,
    dY) and no clone at all. Without the sharing pass two layers reading one input quantize it twice (the graph
    ``mx_compiled=shared`` merges, tested above). With stochastic rounding and random signs (``mxfp4-all-sr``,
    ``tseng``) the keys and signs are read from device memory: not copied either. (On torch 2.12+ the launches' writes come from
    ``access_cache.READ_ONLY``; without it the rotated variant's analysis takes minutes here.) In the child
    process of ``sm90_child``, after the access script."""
    res = sm90_child["graph"]
    one = {"_mxfp4_dual_kernel": 2, "_mxfp4_kernel": 2, "_expand_kernel": 1}
    assert res["mxfp4-all x1"]["kernels"] == one
    assert res["mxfp4-all x2"]["kernels"] == {k: 2 * v for k, v in one.items()}
    assert res["mxfp4-all-dh16 x1"]["kernels"] == one
    assert res["mxfp4-fprop x1"]["kernels"] == {"_mxfp4_kernel": 2}
    # stochastic rounding on dY (keys and signs read from device memory, nothing copied): dY still in one pass
    assert res["mxfp4-all-sr x1"]["kernels"] == one
    # tseng: plain Fprop; dY along both axes, W along N, X along M (H64: no one-pass kernel), all stochastic
    assert res["tseng x1"]["kernels"] == {"_mxfp4_kernel": 4}, res["tseng x1"]
    for r in res.values():
        assert r["cloned_inputs"] == [] and r["clones"] == 0, r
    # w_group's pass (group_weight_launches) on five layers' joint graph: the passes along K (forward) and along N
    # (backward) each as a group of 4 and one left alone, nothing copied, and the partitioner splits the graph
    assert res["grouped"]["removed"] == [6]
    assert res["grouped"]["kernels"] == {"_mxfp4_dual_kernel": 10, "_expand_kernel": 5, "_mxfp4_group_kernel": 2,
                                         "_mxfp4_kernel": 2}, res["grouped"]["kernels"]


def test_no_kernel_store_names_an_input_pointer():
    """``access_cache.READ_ONLY`` says which tensor arguments of the quantize kernels are only read: no
    ``tl.store`` or ``tl.atomic_*`` in their sources takes a pointer expression naming one of them."""
    import os
    import re
    from mxtrain.kernels.access_cache import READ_ONLY
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    stores = 0
    for f, kernels in ((("mxfp4", "kernels.py"), ("_mxfp4_kernel", "_mxfp4_dual_kernel")),
                       (("expand.py",), ("_expand_kernel",))):
        inputs = set().union(*(READ_ONLY[k] for k in kernels))
        src = open(os.path.join(root, "mxtrain", "kernels", *f)).read()
        for m in re.finditer(r"tl\.(store|atomic_\w+)\(([^,]+),", src):
            stores += 1
            assert not set(re.findall(r"\w+", m.group(2))) & inputs, m.group(0)
    assert stores >= 20



@pytest.mark.cuda
def test_cuda_recomputed_x_gives_the_kept_x_bits():
    """``wgrad_x=backward`` with ``wgrad_x_recompute`` on a GPU: a compiled ``mxtrain.model.Block`` (its norms' outputs
    and SwiGLU product recomputed in the backward for the Wgrad quantize, ``compiledmx.recompute_wgrad_inputs``)
    gives the block's output and every gradient bit for bit as the same compile that keeps X, and as
    ``wgrad_x=forward`` (X's Wgrad operand kept as codes)."""
    import copy
    from mxtrain.model import Block, ModelConfig, rope_tables
    _gpu()
    torch.manual_seed(0)
    T, C = 512, 512
    block = Block(ModelConfig(dim=C, n_heads=4, n_kv_heads=4, ffn_dim=1408, max_seq_len=T), device="cuda")
    mxtrain.convert(block, "mxfp4-all-dh16", skip=())
    x0 = torch.randn(2, T, C, device="cuda")
    gy = torch.randn(2, T, C, device="cuda")
    cos, sin = rope_tables(C // 4, T, 10000.0, device="cuda")
    out = {}
    for key, over in (("kept", dict(wgrad_x="backward")), ("recomputed", dict(wgrad_x="backward",
                                                                             wgrad_x_recompute=True)),
                      ("codes", dict(wgrad_x="forward"))):
        m = copy.deepcopy(block)
        x = x0.clone().requires_grad_()
        torch._dynamo.reset()
        with settings.override(**over), torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.compile(m, fullgraph=True)(x, cos, sin)
        y.backward(gy)
        out[key] = [y.detach(), x.grad] + [p.grad for p in m.parameters()]
    torch._dynamo.reset()
    for key in ("recomputed", "codes"):
        for i, (a, e) in enumerate(zip(out[key], out["kept"])):
            assert torch.equal(a, e), (key, i)



def test_recompute_setting_without_wgrad_x_backward_warns(monkeypatch):
    """``wgrad_x_recompute`` acts only with ``wgrad_x=backward``; with another placement the joint pass says so
    (once), rather than leaving a user to believe the memory is saved."""
    import warnings
    monkeypatch.setattr(compiledmx, "_WARNED_RECOMPUTE", [])
    with settings.override(wgrad_x_recompute=True, wgrad_x="auto"):
        with pytest.warns(UserWarning, match="wgrad_x_recompute has no effect with wgrad_x=auto"):
            assert compiledmx._recomputing()
    with settings.override(wgrad_x_recompute=True, wgrad_x="backward"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiledmx._recomputing()
