"""The two-pass NVFP4 quantizer (kernels/nvfp4.py) against the reference (``fake_quantize_operand(...,
factored=True)``: ``mxtrain.numerics.quant.quantize`` + ``MXTensor.dequantize_factored``): bit-identical values and tensor
scale for rows and columns, 1-D blocks and 16x16 tiles, nearest and stochastic rounding (a key as an int or in
device memory), prescale, sizes that are not multiples of 16, magnitudes over many binades, NaN/Inf blocks,
all-zero and tiny tensors, and every E2M1 code times every E4M3 block scale. Then the integration
(``Ctx.operand_factored``, the ``nvfp4_kernel`` setting) and the per-variant self-check. On CPU the kernel runs
in Triton's interpreter; the ``cuda`` tests repeat the main comparisons at larger shapes on a GPU."""

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain import settings  # noqa: E402
from numerics_helpers import wide_values  # noqa: E402
from mxtrain.linear.context import Ctx  # noqa: E402
from mxtrain.numerics.operand import fake_quantize_operand  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import nvfp4 as K  # noqa: E402
from mxtrain.kernels.caches import CACHES  # noqa: E402
from mxtrain.numerics.recipe import OPERANDS  # noqa: E402
from mxtrain.numerics.recipes import get as get_recipe  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")

KEY = 0xC0FFEE11   # above 2**31: the key's sign bit is exercised


def _wide(shape, seed, nonfinite=True):
    """Values over ~40 binades, E2M1 ties, zeros, -0, subnormals, NaN/+-Inf (``numerics.wide_values``)."""
    return wide_values(shape, seed, DEV, nonfinite, zero_block=16)


def _ref(x, axis, block_2d, rounding, key, prescale):
    return fake_quantize_operand(x, None, key, axis, 0, "nvfp4", (16, 16) if block_2d else 16, rounding, "floor",
                                 prescale, True)


def _check(x, axis, block_2d, rounding="nearest", key=None, prescale=1.0):
    v, g = K.quantize_nvfp4_factored(x, axis, block_2d, rounding, key, prescale)
    rkey = int(key.item()) if isinstance(key, torch.Tensor) else key
    rv, rg = _ref(x, axis, block_2d, rounding, rkey, prescale)
    assert v.shape == x.shape and v.dtype == torch.float32 and g.dim() == 0 and g.dtype == torch.float32
    assert K._bits_equal(g, rg), (float(g), float(rg))
    bad = ~((v.view(torch.int32) == rv.view(torch.int32)) | (torch.isnan(v) & torch.isnan(rv)))
    assert not bad.any(), (int(bad.sum()), bad.nonzero()[:5].tolist(), v[bad][:5].tolist(), rv[bad][:5].tolist())
    return v, g


@pytest.mark.parametrize("shape", [(33, 72), (17, 40), (1, 16), (64, 48), (40, 1)])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("prescale", [1.0, 0.75])
def test_values_and_scale_equal_the_reference(shape, axis, block_2d, rounding, prescale):
    x = _wide(shape, seed=sum(shape) + axis)
    _check(x, axis, block_2d, rounding, KEY if rounding == "stochastic" else None, prescale)


@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("block_2d", [False, True])
def test_bf16_input_and_key_in_device_memory(axis, block_2d):
    x = _wide((40, 56), seed=7).to(torch.bfloat16)
    _check(x, axis, block_2d)
    kt = torch.tensor(KEY, dtype=torch.int64, device=DEV)
    v1, _ = _check(x, axis, block_2d, "stochastic", kt)
    v2, _ = K.quantize_nvfp4_factored(x, axis, block_2d, "stochastic", KEY)
    assert torch.equal(v1.nan_to_num(), v2.nan_to_num())
    v3, _ = K.quantize_nvfp4_factored(x, axis, block_2d, "stochastic", KEY + 1)
    assert not torch.equal(v1.nan_to_num(), v3.nan_to_num())   # another key, other bits


def test_non_contiguous_input_and_bf16_output():
    x = _wide((48, 40), seed=3).t()          # (40, 48), columns contiguous
    for axis in (0, 1):
        v, g = _check(x, axis, False)
        vb, gb = K.quantize_nvfp4_factored(x, axis, False, out_dtype=torch.bfloat16)
        assert vb.dtype == torch.bfloat16 and torch.equal(vb.float().nan_to_num(), v.nan_to_num()) and gb == g


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_zero_tiny_huge_and_non_finite_tensors(block_2d, rounding):
    key = KEY if rounding == "stochastic" else None
    for axis in (1, 0):
        z = torch.zeros(20, 33, device=DEV)
        v, g = _check(z, axis, block_2d, rounding, key)
        assert float(g) == 1.0 and not v.any() and not torch.signbit(v).any()
        for scale in (1e-44, 1e-41, 1e-39, 1e-30, 3e38):   # g underflows to 0 (then 1), g subnormal, huge values
            x = _wide((24, 40), seed=11, nonfinite=False)
            x = x / x.abs().max() * scale
            _check(x, axis, block_2d, rounding, key, 0.75)
        nan = torch.full((17, 32), float("nan"), device=DEV)
        v, g = _check(nan, axis, block_2d, rounding, key)    # no finite value: g = 1, every block NaN
        assert float(g) == 1.0 and torch.isnan(v).all()
        inf = _wide((32, 32), seed=5, nonfinite=False)
        inf[::5, ::7] = float("inf")
        _check(inf, axis, block_2d, rounding, key)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("axis", [1, 0])
def test_every_e2m1_code_times_every_e4m3_block_scale_round_trips(block_2d, axis):
    """A block (tile: each row) holding all 16 E2M1 codes times an E4M3 block scale b comes back as itself, for
    every finite positive b (the tensor's largest value 6 * 448 makes g = 1)."""
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = torch.cat([codes, -codes])                                   # -0 included
    b = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 2**-9 .. 448
    rows = 16 if block_2d else 1
    x = (codes[None, None, :] * b[:, None, None]).expand(-1, rows, -1).reshape(-1, 16)
    x = torch.cat([x, torch.tile(x, (1, 2))[:, :16]], 1).to(DEV)          # two blocks a row
    xs = x.t().contiguous() if axis == 0 else x
    v, g = _check(xs, axis, block_2d)
    assert float(g) == 1.0 and torch.equal(v.view(torch.int32), xs.view(torch.int32))
    _check(xs, axis, block_2d, "stochastic", KEY)                        # on the grid: SR keeps them too


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="2-D"):
        K.quantize_nvfp4_factored(torch.zeros(4, device=DEV), -1)
    with pytest.raises(ValueError, match="key"):
        K.quantize_nvfp4_factored(torch.zeros(4, 16, device=DEV), -1, rounding="stochastic")
    with pytest.raises(TypeError):
        K.quantize_nvfp4_factored(torch.zeros(4, 16, dtype=torch.float64, device=DEV), -1)


# ---------------------------------------------------------------------------------------------- integration


def _device_ctx(recipe, layer, step, call, device):
    """``Ctx.from_seeds`` with the keys and signs ``call_seeds`` would write (host computation)."""
    from mxtrain.linear.context import seed_spec
    from mxtrain.kernels.seeds import call_seeds_host
    sr, modes, sizes = seed_spec(recipe)
    keys, signs = call_seeds_host(recipe.seed, layer, step, call, sr=sr, sign_modes=modes, sign_sizes=sizes,
                                  device=device)
    return Ctx.from_seeds(recipe, keys, signs)


OPS = [("fprop", "fprop_x", -1), ("fprop", "fprop_w", -1), ("dgrad", "dgrad_dy", -1), ("dgrad", "dgrad_w", 0),
       ("wgrad", "wgrad_dy", 0), ("wgrad", "wgrad_x", 0)]


def test_operand_factored_runs_the_kernel_and_off_runs_the_reference():
    r = get_recipe("nvfp4")
    assert {n for _, n, _ in OPS} == set(OPERANDS)
    mode = "auto" if DEV == "cuda" else "always"
    x, w, dy = _wide((40, 64), 1, False), _wide((48, 64), 2, False) * 0.1, _wide((40, 48), 3, False) * 1e-3
    t = {"fprop_x": x, "wgrad_x": x, "fprop_w": w, "dgrad_w": w, "dgrad_dy": dy, "wgrad_dy": dy}
    for ctx in (Ctx(r, layer=2, step=5, call=1), _device_ctx(r, 2, 5, 1, DEV)):
        for gemm, name, axis in OPS:
            s = ctx.signs(gemm, DEV)
            with settings.override(nvfp4_kernel="off"):
                n0 = K.CALLS["kernel"]
                rv, rp, rg = ctx.operand_factored(t[name], axis, name, gemm, s)
                assert K.CALLS["kernel"] == n0
            with settings.override(nvfp4_kernel=mode, qselfcheck="off"):
                v, p, g = ctx.operand_factored(t[name], axis, name, gemm, s)
                assert K.CALLS["kernel"] == n0 + 1, name
            assert p == rp and K._bits_equal(g, rg) and K._bits_equal(v, rv), (name, ctx.on_device)
            # the GEMM's operand dtype written directly (no float32 values and cast pass): the same values
            with settings.override(nvfp4_kernel=mode, qselfcheck="off"):
                vb, _, gb = ctx.operand_factored(t[name], axis, name, gemm, s, out_dtype=torch.bfloat16)
            assert vb.dtype == torch.bfloat16 and K._bits_equal(gb, rg)
            assert K._bits_equal(vb.float(), rv), name


def test_layer_under_autocast_is_the_same_with_the_kernel():
    from mxtrain.linear.module import MXLinear
    dev_type = "cuda" if DEV == "cuda" else "cpu"
    mode = "auto" if DEV == "cuda" else "always"
    out = {}
    for m in ("off", mode):
        torch.manual_seed(0)
        lin = MXLinear(64, 32, recipe="nvfp4", layer_id=1).to(DEV)
        x = torch.randn(3, 16, 64, device=DEV, requires_grad=True)
        n0 = K.CALLS["kernel"]
        with settings.override(nvfp4_kernel=m, qselfcheck="off"):
            with torch.autocast(dev_type, dtype=torch.bfloat16):
                y = lin(x)
            y.float().square().sum().backward()
        out[m] = (y.detach(), x.grad, lin.weight.grad, K.CALLS["kernel"] - n0)
    assert out["off"][3] == 0 and out[mode][3] == 6       # six operands, all through the kernel
    for a, b in zip(out["off"][:3], out[mode][:3]):
        assert torch.equal(a, b)


def test_whole_model_compiled_fullgraph_runs_the_kernel():
    """Under ``torch.compile(fullgraph=True)`` of a whole converted model (as ``mxtrain bench step`` and the
    trainer compile it), the MX linear is one op, so its NVFP4 operands still go through the kernel at run
    time; outputs and gradients equal the compiled model with the kernel off."""
    import dataclasses

    import torch.nn as nn

    import mxtrain
    dev_type = "cuda" if DEV == "cuda" else "cpu"
    mode = "auto" if DEV == "cuda" else "always"
    out = {}
    for m in ("off", mode):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48)).to(DEV)
        mxtrain.convert(net, dataclasses.replace(get_recipe("nvfp4"), keep_first=0, keep_last=0))
        f = torch.compile(net, backend="aot_eager", fullgraph=True)
        x = torch.randn(32, 64, device=DEV)
        n0 = K.CALLS["kernel"]
        with settings.override(nvfp4_kernel=m, qselfcheck="off"):
            with torch.autocast(dev_type, dtype=torch.bfloat16):
                y = f(x)
            y.float().square().sum().backward()
        out[m] = (y.detach(), [p.grad for p in net.parameters()], K.CALLS["kernel"] - n0)
        torch._dynamo.reset()
    assert out["off"][2] == 0 and out[mode][2] == 16   # 3 layers x (2 forward + 4 backward), no dX for the first
    assert torch.equal(out["off"][0], out[mode][0])
    for a, b in zip(out["off"][1], out[mode][1]):
        assert torch.equal(a, b)


def test_selfcheck_passes_catches_a_faulty_kernel_and_falls_back():
    assert K.nvfp4_selfcheck(DEV, torch.float32, 1, False, True, True, 0.75, False, True)["ok"]
    assert K.nvfp4_selfcheck(DEV, torch.bfloat16, 0, True, False, False, 1.0, True, False)["ok"]

    def faulty(x, *a):
        v, g = K.quantize_nvfp4_factored(x, *a)
        v = v.clone()
        v.view(-1)[7] = -v.view(-1)[7] if v.view(-1)[7] != 0 else 1.0
        return v, g
    res = K.nvfp4_selfcheck(DEV, torch.float32, 1, False, False, False, 1.0, True, True, quantize_fn=faulty)
    assert not res["ok"] and res["values"] == 1
    # a variant recorded as failed: the reference serves it (no kernel call), once it is found, with a warning
    r = get_recipe("nvfp4")
    ctx = Ctx(r, layer=0, step=0)
    x = _wide((32, 48), 9, False)
    mode = "auto" if DEV == "cuda" else "always"
    vkey = K._variant_key(x, 1, False, False, False, 1.0)
    CACHES.verified.pop(vkey, None)
    try:
        with settings.override(nvfp4_kernel=mode, qselfcheck="always"):
            n0 = K.CALLS["kernel"]
            ctx.operand_factored(x, -1, "fprop_x", "fprop", None)
            assert CACHES.verified[vkey] is True and K.CALLS["kernel"] == n0 + 1
            CACHES.verified[vkey] = False
            v, _, g = ctx.operand_factored(x, -1, "fprop_x", "fprop", None)
            assert K.CALLS["kernel"] == n0 + 1
        with settings.override(nvfp4_kernel="off"):
            rv, _, rg = ctx.operand_factored(x, -1, "fprop_x", "fprop", None)
        assert K._bits_equal(v, rv) and K._bits_equal(g, rg)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            CACHES.verified.pop(vkey)
            import unittest.mock as um
            with um.patch.object(K, "nvfp4_selfcheck", lambda *a, **k: {"ok": False}), \
                    settings.override(qselfcheck="always"):
                assert not K.nvfp4_ok(x, 1, False, False, False, 1.0)
            assert any("differed from the reference" in str(m.message) for m in w)
    finally:
        CACHES.verified.pop(vkey, None)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 1024), (1000, 2056), (333, 4100)])
@pytest.mark.parametrize("axis", [1, 0])
@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_cuda_large_shapes_equal_the_reference(shape, axis, block_2d, rounding):
    x = _wide(shape, seed=shape[0]).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        for prescale in (1.0, 0.75):
            _check(x.to(dtype), axis, block_2d, rounding, KEY if rounding == "stochastic" else None, prescale)
    if rounding == "stochastic":
        _check(x, axis, block_2d, rounding, torch.tensor(KEY, dtype=torch.int64, device="cuda"))


@pytest.mark.cuda
def test_cuda_selfcheck_every_variant():
    for dtype in (torch.float32, torch.bfloat16):
        for axis in (1, 0):
            for block_2d in (False, True):
                for sr, kp in ((False, False), (True, False), (True, True)):
                    for r16, c16 in ((True, True), (False, False)):
                        res = K.nvfp4_selfcheck("cuda", dtype, axis, block_2d, sr, kp, 0.75, r16, c16)
                        assert res["ok"], (dtype, axis, block_2d, sr, kp, r16, c16, res)


@pytest.mark.cuda
def test_cuda_graph_replay_reads_the_key_and_scale_from_device_memory():
    x = _wide((256, 512), 4, False).cuda()
    kt = torch.tensor(KEY, dtype=torch.int64, device="cuda")
    K.quantize_nvfp4_factored(x, 1, False, "stochastic", kt)           # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        v, g = K.quantize_nvfp4_factored(x, 1, False, "stochastic", kt)
    for key, scale in ((KEY + 5, 1.0), (17, 1e-3)):
        kt.fill_(key)
        x.mul_(scale)
        graph.replay()
        rv, rg = _ref(x, 1, False, "stochastic", key, 1.0)
        assert K._bits_equal(v, rv) and K._bits_equal(g, rg)


@pytest.mark.skipif(DEV != "cpu", reason="the GPU tests run the compiled kernels instead")
def test_kernels_compile_for_sm90():
    """The interpreter compiles nothing: the NVFP4 variants of ``tools/compile_check.py`` compiled for sm_90."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_check.py"), "--jobs", "2", "--only",
                        "nvfp4"], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert len([ln for ln in p.stdout.splitlines() if ln.startswith("nvfp4") and "regs" in ln]) == 9, p.stdout


def test_selfcheck_of_single_row_and_column_variants():
    for r1, c1 in ((True, False), (False, True)):
        for axis in (1, 0):
            res = K.nvfp4_selfcheck(DEV, torch.float32, axis, False, True, False, 1.0, False, False, r1=r1, c1=c1)
            assert res["ok"], res
