"""FSDP2's quantized weight all-gather (mxtrain.linear.qgather): bit-identical to gathering in high precision and
quantizing after, and a loud fallback where it cannot be.

Single-process tests quantize a weight shard by shard (2 and 4 shards), put the pieces together as FSDP2's
all-gather does (each rank's inputs one after another along dim 0) and compare, bit for bit, with the whole
weight's quantization and with the MX linear's forward and backward on the whole weight, on the reference path
and on the fast path (its Triton kernels under the interpreter on CPU, the FP8 carrier rebuilt from the gathered
codes; a ``cuda`` test for the same on a GPU). One torchrun launch
(2 gloo ranks, tests/_qgather_worker.py) trains a tiny model 3 steps (2 micro-steps each) under both gathers
for four recipes and compares losses and final weights bit for bit, then a checkpoint written under
gather="quantized" is resumed under both gathers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mxtrain
from mxtrain.linear import qgather as Q
from mxtrain.linear.context import Ctx
from mxtrain.linear import mx_linear
from mxtrain.numerics.formats import get_format
from mxtrain.numerics.quant import quantize
from mxtrain.numerics.recipe import Rotation
from mxtrain.numerics.recipes import get as get_recipe

TESTS = Path(__file__).resolve().parents[1]   # tests/: the shared helpers and the workers it starts

_NV1D = get_recipe("nvfp4").with_(**{"fprop_w.block_2d": False, "dgrad_w.block_2d": False}, name="nvfp4-1d")
_SIGNED = get_recipe("mxfp4-all").with_(fprop_rotation=Rotation(32, "per_layer"), dgrad_rotation=Rotation(16, "fixed"),
                                        name="mxfp4-signed")
_FP6 = get_recipe("mxfp8").with_(**{"fprop_w.fmt": "mxfp6_e2m3", "dgrad_w.fmt": "mxfp6_e3m2"}, name="mxfp6-w")
RECIPES = ["mxfp4-all", "mxfp4-all-dh16", "mxfp8", "nvfp4", "fp8", "nvfp4-4over6", _NV1D, _SIGNED, _FP6]
_FP8_ROT = get_recipe("fp8").with_(dgrad_rotation=Rotation(16, "fixed"), name="fp8-dgrad-rot")   # (not shared)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (torch cannot copy FP4 tensors: one-byte types are viewed first)."""
    return (t if t.element_size() == 1 else t.contiguous().reshape(-1)).view(torch.uint8).contiguous()


def _gather(w: torch.Tensor, plan: Q.Plan) -> Q.Gathered:
    """What FSDP2 does with ``plan.world`` ranks, in one process: each shard's amax, their MAX (the all-reduce),
    each shard's inputs, concatenated along dim 0 (the all-gather), assembled by one rank's metadata."""
    shards = w.chunk(plan.world, 0)
    local = [Q.amaxes(s, plan) for s in shards]
    am = {k: torch.stack([a[k] for a in local]).amax(0) for k in local[0]}
    pieces = [Q.shard_operands(s, plan, am) for s in shards]
    outputs = [torch.cat([p[0][i] for p in pieces], 0) for i in range(len(pieces[0][0]))]
    return Q.assemble(outputs, pieces[1][1], plan)


def _weight(N=128, K=48, odd=True):
    w = torch.randn(N, K) * torch.logspace(-3, 2, N)[:, None]   # shards of very different amax
    if odd:
        w[3, 5], w[70, 1] = float("nan"), float("-inf")   # non-finite values, in two shards
        w[96:] = 0.0   # an all-zero shard (of 4)
    return w


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r if isinstance(r, str) else r.name)
def test_shards_gathered_equal_whole_weight_quantized(recipe):
    """Codes, scales and values of both weight operands, gathered from 2 or 4 shards, equal the whole weight's
    quantization bit for bit (non-finite values, an all-zero shard, shards of very different amax included),
    also for a weight FSDP2 gathers in bf16, for 2 and 4 shards (three recipes; the others 4 shards of fp32)."""
    r = get_recipe(recipe)
    both = r.name in ("mxfp4-all-dh16", "nvfp4", "fp8")   # (CI time: the others on 4 shards of an fp32 weight)
    for world in ((2, 4) if both else (4,)):
        for dt in ((torch.float32, torch.bfloat16) if both else (torch.float32,)):
            w = _weight().to(dt)
            plan = Q.plan_layer(r, tuple(w.shape), world, layer_id=5)
            assert isinstance(plan, Q.Plan), plan
            g = _gather(w, plan)
            ctx = Ctx(r, 5)
            for s in plan.gathered:   # the whole weight's codes and scales, as the reference quantizer makes them
                op = s.op
                ref = quantize(ctx.rotate(w, s.axis, s.gemm, ctx.signs(s.gemm, w.device)), op.fmt, axis=s.axis,
                               block_size=op.block_size, scale_rule=op.scale_rule, prescale=op.prescale)
                got = g.ops[s.name]
                assert got.data.shape == ref.data.shape and torch.equal(_bits(got.data), _bits(ref.data))
                assert torch.equal(_bits(got.scales), _bits(ref.scales))
                if ref.global_scale is not None:
                    assert torch.equal(_bits(got.global_scale), _bits(ref.global_scale))
            gw = Q.GatheredWeight(tuple(w.shape), dt, w.device, [g])
            for name, axis, gemm in Q.WEIGHT_OPERANDS:
                s = ctx.signs(gemm, w.device)
                ref, pr = ctx.operand(w, axis, name, gemm, s)
                got, pg = ctx.operand(gw, axis, name, gemm, s)
                assert pr == pg and torch.equal(_bits(ref), _bits(got)), (name, world, dt)
                if plan.shared:   # (a Dgrad operand read from the Fprop one: the same values along either axis)
                    assert name == "fprop_w" or plan.spec(name).op == plan.spec("fprop_w").op


@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "nvfp4", "fp8"])
def test_linear_on_gathered_weight_equals_whole_weight(recipe):
    """``mx_linear``'s output, dX and dW (reference path, with and without bf16 autocast: NVFP4's factored
    GEMMs) are bit-identical whether the weight is the whole tensor or its gathered operands."""
    r = get_recipe(recipe)
    w = _weight(odd=False)
    plan = Q.plan_layer(r, tuple(w.shape), 4, layer_id=2)
    for amp in ((None, torch.bfloat16) if recipe == "nvfp4" else (None,)):   # (NVFP4's factored GEMMs)
        outs = []
        for kind in ("whole", "gathered"):
            wt = (w.clone() if kind == "whole" else Q.GatheredWeight(tuple(w.shape), w.dtype, w.device,
                                                                   [_gather(w, plan)])).requires_grad_()
            x = torch.randn(3, 5, w.shape[1], generator=torch.Generator().manual_seed(1)).requires_grad_()
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                y = mx_linear(x, wt, None, r, torch.tensor([2, 7, 0]))
            y.float().square().sum().backward()
            outs.append((y, x.grad, wt.grad))
        for a, b in zip(*outs):
            assert type(b) is torch.Tensor and torch.equal(_bits(a), _bits(b)), (recipe, amp)


@pytest.mark.parametrize("recipe", RECIPES + [_FP8_ROT], ids=lambda r: r if isinstance(r, str) else r.name)
def test_gathered_operands_stored_as_whole_weight_quantized(recipe):
    """The operand a GEMM reads from a gathered weight (``Gathered.get``) is stored as ``quantize`` stores the
    whole weight's: the same codes and scales in the same memory layout (strides, axis), so that its values
    (``Ctx.operand``, ``operand_factored``) have the layout the whole weight's have. Equal values in another layout
    are not enough: a GEMM may sum them in another order (a CPU BLAS did for a few tokens, and NVFP4's Dgrad
    operand, read from the Fprop one's 16x16 tiles, gave another dX on 4 ranks). 4 shards of a weight whose
    in-features (48) pad to whole blocks, fp32 and bf16."""
    r = get_recipe(recipe)
    for dt in (torch.float32, torch.bfloat16):
        w = _weight(odd=False).to(dt)
        plan = Q.plan_layer(r, tuple(w.shape), 4, layer_id=5)
        assert isinstance(plan, Q.Plan), plan
        gw = Q.GatheredWeight(tuple(w.shape), dt, w.device, [_gather(w, plan)])
        ctx = Ctx(r, 5)
        for name, axis, gemm in Q.WEIGHT_OPERANDS:
            s, op = ctx.signs(gemm, w.device), r.operand(name)
            ref = quantize(ctx.rotate(w, axis, gemm, s), op.fmt, axis=axis, block_size=op.block_size,
                           scale_rule=op.scale_rule, prescale=op.prescale)
            for _ in range(2):   # (the second read: the operand kept from the first)
                got = gw.mx_gathered.get(ctx, axis, name, gemm, s)
                assert (got.axis, got.shape, got.block_size) == (ref.axis, ref.shape, ref.block_size), (name, dt)
                for a, b in ((ref.data, got.data), (ref.scales, got.scales)):
                    assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), (name, dt)
                    assert torch.equal(_bits(a), _bits(b)), (name, dt)
            vals = [ctx.operand(t, axis, name, gemm, s)[0] for t in (w, gw)]
            if get_format(op.fmt).kind == "nvfp4":
                vals += [ctx.operand_factored(t, axis, name, gemm, s)[0] for t in (w, gw)]
            for a, b in zip(vals[::2], vals[1::2]):
                assert a.stride() == b.stride() and torch.equal(_bits(a), _bits(b)), (name, dt)


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8", "fp8"])
def test_dgrad_on_gathered_weight_equals_whole_weight_few_tokens(recipe):
    """dX of 1 to 4 tokens (where a CPU BLAS sums a GEMM's equal operands in another order for another memory
    layout) is bit-identical on the whole weight and on its operands gathered from 4 shards: NVFP4 (the Dgrad
    operand read from the Fprop one's 16x16 tiles), MXFP8 (the Dgrad operand gathered out-features first), FP8."""
    r = get_recipe(recipe)
    w = _weight(N=256, K=128, odd=False) * 1e-2
    plan = Q.plan_layer(r, tuple(w.shape), 4, layer_id=2)
    for m in (1, 2, 3, 4):
        dxs = []
        for wt in (w, Q.GatheredWeight(tuple(w.shape), w.dtype, w.device, [_gather(w, plan)])):
            x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m)).requires_grad_()
            y = mx_linear(x, wt, None, r, torch.tensor([2, 7, 0]))
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + m)))
            dxs.append(x.grad)
        assert torch.equal(_bits(dxs[0]), _bits(dxs[1])), (recipe, m)


def test_fallback_reasons():
    """``plan_layer`` says why a layer cannot gather quantized exactly."""
    def why(recipe, shape=(128, 64), world=2):
        p = Q.plan_layer(recipe, shape, world)
        assert isinstance(p, str), (recipe, shape, world)
        return p
    assert "fprop_w rounds stochastically" in why(get_recipe("mxfp4-all").with_(**{"fprop_w.rounding": "stochastic"}))
    assert "dgrad_w rounds stochastically" in why(get_recipe("mxfp4-all").with_(**{"dgrad_w.rounding": "stochastic"}))
    assert "fprop_w is not quantized" in why("tseng")   # (its Fprop is bf16; SR and per-step signs on Dgrad)
    assert isinstance(Q.plan_layer("mxfp4-all-sr", (128, 64), 2), Q.Plan)   # (SR on dY only: the weights are RNE)
    assert "per_step" in why("mxfp4-all-rht16")
    assert "fprop_w is not quantized" in why("mxfp4-bwd")
    assert "dgrad_w is not quantized" in why("mxfp4-fprop")
    assert "split the Dgrad operand's 32-row blocks" in why("mxfp4-all", (64, 64), 4)   # 16-row shards
    assert "split the Dgrad operand's 16-row blocks" in why("nvfp4", (64, 64), 8)       # 8-row shards
    assert "not divisible by 5 ranks" in why("mxfp4-all", (128, 64), 5)
    h64 = get_recipe("mxfp4-all").with_(dgrad_rotation=Rotation(64, "none"))
    assert "64-row blocks" in why(h64, (128, 64), 4)   # 32-row shards: the 64-row rotation blocks split
    # and where it can: 32-row shards of MXFP4, 16-row shards of NVFP4's tiles and of FP8
    assert isinstance(Q.plan_layer("mxfp4-all", (128, 64), 4), Q.Plan)
    assert isinstance(Q.plan_layer("nvfp4", (64, 64), 4), Q.Plan)
    assert isinstance(Q.plan_layer("fp8", (64, 64), 8), Q.Plan)
    # on CUDA: the fast path takes gathered MXFP4 / MXINT4 operands; per-tensor FP8 still falls back
    cuda = torch.device("cuda")
    assert Q._device_reason(get_recipe("mxfp4-all-dh16"), cuda) is None and Q._device_reason(_SIGNED, cuda) is None
    assert "per-tensor FP8" in Q._device_reason(get_recipe("fp8"), cuda)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(64, 128)
        self.w2 = nn.Linear(128, 64)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))


def test_prepare_falls_back_loudly_and_state_dicts_stay_plain(tmp_path):
    """With 4 ranks the 64-row weights' shards split MXFP4's Dgrad blocks: those layers gather in high
    precision, said once in one warning naming them and the reason; the others carry the all-gather
    extension, and their state dicts hold plain tensors (``torch.save`` and a load work as before)."""
    model = mxtrain.convert(_Toy(), "mxfp4-all").model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning) as rec:
        rep = Q.prepare(model, model.layers, 4, torch.device("cpu"))
    msgs = [str(w.message) for w in rec if "gather='quantized'" in str(w.message)]
    assert len(msgs) == 1
    assert "2 of 4 MX layers" in msgs[0] and "layers.0.w2, layers.1.w2" in msgs[0] and "32-row blocks" in msgs[0]
    assert rep.quantized == ["layers.0.w1", "layers.1.w1"] and set(rep.high) == {"layers.0.w2", "layers.1.w2"}
    assert type(model.layers[0].w1.weight) is Q.QGatherWeight and type(model.layers[0].w2.weight.data) is torch.Tensor
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert all(torch.equal(sd[k], before[k]) for k in before)
    torch.save(sd, tmp_path / "m.pt")
    sd2 = {k: v + 1 for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items()}
    model.load_state_dict(sd2)
    assert torch.equal(model.layers[1].w1.weight._inner, sd2["layers.1.w1.weight"])
    assert model.layers[1].w1.weight._gen[0] >= 1   # (the load counted as an update: no stale reuse)
    # with 2 ranks every layer takes it, and nothing is said
    model = mxtrain.convert(_Toy(), "mxfp4-all").model
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rep = Q.prepare(model, model.layers, 2, torch.device("cpu"))
    assert len(rep.quantized) == 4 and not rep.high


def test_gathered_weight_refuses_what_it_cannot_do():
    """A gathered weight has no high-precision values: any other use raises (never a silent wrong value), and
    so does a call whose recipe or rotation signs differ from the ones it was quantized for."""
    w = _weight(odd=False)
    plan = Q.plan_layer("mxfp4-all", tuple(w.shape), 2)
    gw = Q.GatheredWeight(tuple(w.shape), w.dtype, w.device, [_gather(w, plan)])
    x = torch.randn(4, w.shape[1])
    for bad in (lambda: torch.nn.functional.linear(x, gw), lambda: gw + 1, lambda: gw.sum(), lambda: gw.clone()):
        with pytest.raises(RuntimeError, match="holds no high-precision values"):
            bad()
    with pytest.raises(RuntimeError, match="quantized for recipe mxfp4-all, the call's recipe is mxfp8"):
        mx_linear(x, gw, None, "mxfp8")
    assert torch.zeros_like(gw).shape == w.shape and type(gw.detach()) is Q.GatheredWeight
    plan = Q.plan_layer(_SIGNED, tuple(w.shape), 2, layer_id=3)
    gw = Q.GatheredWeight(tuple(w.shape), w.dtype, w.device, [_gather(w, plan)])
    with pytest.raises(RuntimeError, match="rotation signs of this call differ from layer 3's"):
        mx_linear(x, gw, None, _SIGNED, torch.tensor([4, 0, 0]))   # (layer 4's per-layer signs)
    assert mx_linear(x, gw, None, _SIGNED, torch.tensor([3, 0, 0])).shape == (4, w.shape[0])


def test_all_gather_bytes():
    """Bytes one all-gather assembles: 4 bytes a weight element in fp32 (2 in bf16) against MXFP4's two
    operands, each 0.5 byte an element and one E8M0 scale per 32."""
    model = mxtrain.convert(_Toy(), "mxfp4-all").model
    n = 4 * 128 * 64
    other = sum(p.numel() for n_, p in model.named_parameters() if not n_.endswith("weight"))
    hi = Q.all_gather_bytes(model, 2, "high")
    assert hi == {"total": 4 * (n + other), "mx_weights": 4 * n, "quantized_layers": 0, "high_layers": 4}
    assert Q.all_gather_bytes(model, 2, "high", torch.bfloat16)["mx_weights"] == 2 * n
    q = Q.all_gather_bytes(model, 2, "quantized")
    assert q["mx_weights"] == 2 * (n // 2 + n // 32) and q["quantized_layers"] == 4
    assert Q.all_gather_bytes(model, 4, "quantized")["high_layers"] == 2   # (the 64-row weights fall back)
    # MXFP8's two operands (2 x (1 + 1/32) bytes an element) move more than a bf16 gather: it stays high
    m8 = mxtrain.convert(_Toy(), "mxfp8").model
    assert Q.all_gather_bytes(m8, 2, "quantized", torch.bfloat16)["quantized_layers"] == 0
    assert Q.all_gather_bytes(m8, 2, "quantized")["mx_weights"] == 2 * (n + n // 32)
    with pytest.warns(UserWarning, match=r"2\.062 bytes an element\) would move no fewer bytes than the bfloat16"):
        assert not Q.prepare(m8, m8.layers, 2, torch.device("cpu"), param_dtype=torch.bfloat16).quantized


# ----------------------------------------------------------------------------------- several processes

@pytest.mark.xdist_group("torchrun")   # one worker: torchrun's rendezvous ports are not raced for
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_fsdp2_quantized_gather_trains_bit_identically(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(TESTS / "_qgather_worker.py"), str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((tmp_path / "results.json").read_text())
    steps, micro = 3, 2
    for key in ("mxfp4-all-dh16", "mxfp8", "nvfp4", "fp8"):
        hi, q = res[f"{key}:high"], res[f"{key}:quantized"]
        assert q["losses"] == hi["losses"] and len(q["losses"]) == steps, key   # bit for bit
        assert q["digest"] == hi["digest"], key   # the final weights, every bit
        assert len(q["quantized"]) == 4 and q["high"] == {} and q["said"] == [], key
        assert "QGatherWeight" in q["local_types"] and hi["local_types"] == ["Tensor"]
        # each forward quantizes its shard once; the backward's re-gather reuses it
        assert q["quantizations"] == steps * micro * 4, key
    assert len(set(res[f"{k}:high"]["digest"] for k in ("mxfp4-all-dh16", "mxfp8", "nvfp4", "fp8"))) == 4
    # a DCP checkpoint written at step 2 under gather="quantized", resumed under either gather: step 3 equal
    full = res["mxfp4-all-dh16:quantized"]
    for g in ("high", "quantized"):
        assert res[f"resume:{g}"]["losses"] == full["losses"][2:] and res[f"resume:{g}"]["digest"] == full["digest"]
    b = res["bytes"]
    n = 4 * 128 * 64   # 4 weights of 128 x 64: fp32, against two MXFP4 operands (0.5 byte + a scale per 32)
    assert b["high"]["mx_weights"] == 4 * n and b["quantized"]["mx_weights"] == 2 * (n // 2 + n // 32)
    assert b["quantized"]["quantized_layers"] == 4


@pytest.mark.xdist_group("torchrun")
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_fsdp2_quantized_gather_on_4_ranks_trains_bit_identically(tmp_path):
    """Four ranks (each weight's rows in four shards of whole Dgrad blocks; NVFP4's tensor scale from four shards'
    amax; 8 tokens a micro-step, few enough that a CPU BLAS may sum equal Dgrad operands of another memory layout
    in another order: ``test_dgrad_on_gathered_weight_equals_whole_weight_few_tokens``): the quantized gather
    trains as the high-precision one, every loss and every final weight bit equal."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                        str(TESTS / "_qgather_worker.py"), str(tmp_path), "four"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    res = json.loads((tmp_path / "results.json").read_text())
    for key in ("mxfp4-all-dh16", "nvfp4"):
        hi, q = res[f"{key}:high"], res[f"{key}:quantized"]
        assert q["losses"] == hi["losses"] and len(q["losses"]) == 3, key
        assert len(q["quantized"]) == 4 and q["high"] == {} and q["said"] == [], key
        assert q["quantizations"] == 3 * 2 * 4, key
    for key in ("mxfp4-all-dh16", "nvfp4"):   # the final weights, every bit
        assert res[f"{key}:quantized"]["digest"] == res[f"{key}:high"]["digest"], key
    assert res["mxfp4-all-dh16:high"]["digest"] != res["nvfp4:high"]["digest"]


# ------------------------------------------------------------------- the fast path (fused Triton kernels)

_INT4 = _SIGNED.with_(**{f"{o}.fmt": "mxint4" for o in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy",
                                                        "wgrad_x")}, name="mxint4-signed")


def _fast_kernels(dev: str):
    """``mxtrain.linear.fast``, where its Triton kernels run on ``dev`` (else the test is skipped)."""
    pytest.importorskip("triton")
    from mxtrain.kernels import kernels_available
    if not kernels_available(dev):
        pytest.skip(f"the Triton kernels cannot run on {dev}")
    from mxtrain.linear import fast
    return fast


def _same_operand(want, got, what):
    """``got`` (``fast.gathered_operand``'s) is the GEMM operand ``want`` (the fused quantizer's, of the whole
    weight) bit for bit: the FP8 carrier and its group scales where the backend's GEMM reads them, else the packed
    codes and E8M0 scales."""
    assert (got.R, got.K, got.group_rows, got.fmt) == (want.R, want.K, want.group_rows, want.fmt), what
    if want.carrier is not None:
        assert got.carrier.shape == want.carrier.shape, what
        assert torch.equal(got.carrier.view(torch.uint8), want.carrier.view(torch.uint8)), what
        assert torch.equal(got.gscale, want.gscale) and got.gscale.stride() == want.gscale.stride(), what
    else:
        assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales), what


def _fast_runs(recipe, w: torch.Tensor, worlds, M: int, monkeypatch, on_gpu: bool = False):
    """The fast path's (Y, dX, dW) on the whole weight ``w``, then on its operands gathered from each of
    ``worlds`` shardings (a ``GatheredWeight``), with each run's count of inexact carrier blocks of the weight;
    and each run's weight operands as its GEMMs took them (the whole weight's from the fused quantizer, the
    gathered ones from ``fast.gathered_operand``). On a GPU through ``mx_linear`` (its route, device seeds),
    else ``fast.apply`` (Triton's interpreter)."""
    fast = _fast_kernels(w.device.type)
    r = get_recipe(recipe)
    ops: list = []
    real_q, real_g = fast._quant, fast.gathered_operand

    def quant(*a, **k):
        out = real_q(*a, **k)
        if a[3] in ("fprop_w", "dgrad_w"):
            ops[-1][a[3]] = out[0]
        return out

    def gathered(*a, **k):
        out = real_g(*a, **k)
        ops[-1][a[3]] = out[0]
        return out

    monkeypatch.setattr(fast, "_quant", quant)
    monkeypatch.setattr(fast, "gathered_operand", gathered)
    outs = []
    for world in (None,) + tuple(worlds):
        if world is None:
            wt = w.clone()
        else:
            plan = Q.plan_layer(r, tuple(w.shape), world, layer_id=2, device=w.device)
            assert isinstance(plan, Q.Plan), plan
            wt = Q.GatheredWeight(tuple(w.shape), w.dtype, w.device, [_gather(w, plan)])
        wt.requires_grad_()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(M, w.shape[1], generator=g).to(w.device, w.dtype).requires_grad_()
        gy = torch.randn(M, w.shape[0], generator=g).to(w.device, w.dtype)
        ops.append({})
        n0 = fast.inexact_by_tensor(w.device)["w"]
        if on_gpu:
            y = mx_linear(x, wt, None, r, torch.tensor([2, 3, 0], device=w.device))
        else:
            y = fast.apply(x, wt, None, Ctx(r, 2, 3, 0))
        y.backward(gy)
        outs.append((y, x.grad, wt.grad, fast.inexact_by_tensor(w.device)["w"] - n0))
    return outs, ops


def _check_runs(outs, ops, what):
    """Each gathered run (``_fast_runs``) took both weight operands from the gathered codes, and its operands,
    outputs, gradients and inexact count equal the whole weight's run bit for bit."""
    for k in range(1, len(outs)):
        assert sorted(ops[k]) == ["dgrad_w", "fprop_w"], what   # (both taken from the gathered codes)
        for name in ops[k]:
            _same_operand(ops[0][name], ops[k][name], (what, k, name))
        for a, b in zip(outs[0], outs[k]):
            assert torch.equal(_bits(torch.as_tensor(a)), _bits(torch.as_tensor(b))), (what, k)


@pytest.mark.parametrize("recipe, dt, world, grs", [("mxfp4-all-dh16", torch.bfloat16, 4, (1, 128)),
                                                    (_INT4, torch.float32, 2, (128, 1))],
                         ids=["mxfp4-all-dh16", "mxint4-signed"])
def test_fast_path_on_gathered_weight_equals_whole_weight_cpu(recipe, dt, world, grs, monkeypatch):
    """The fast path (Triton's interpreter on CPU) takes W's two operands from the gathered codes and scales: the
    codes its GEMMs read, Y, dX and dW equal the fast path's on the whole weight bit for bit. MXFP4 with 16-wide
    rotations, 4 shards of a bf16 weight (32 rows: one Dgrad block each); MXINT4 with per-layer signs on a 32-wide
    Fprop rotation and fixed ones on Dgrad's, 2 shards of an fp32 weight; in-features 80 pad to whole rotation and
    32-element blocks.

    Then sm_90's FP8 carrier (``gemm_backend=fp8_carrier``, whose GEMM CPU lacks), rebuilt from the gathered codes:
    its bytes (K padded to 512), group scales (values, strides) and count of inexact blocks equal the definition's
    (``carrier_from_fp4``) from the fused quantizer's codes of the whole weight, which is the fused quantizer's own
    carrier (tests/kernels/test_expand.py; the fused carrier is slow in the interpreter). ``grs``: the Fprop and Dgrad
    operands' group rows (1x128: 4 or 3 row tiles of the expand kernel; 128x128: padded rows). CI time: one
    sharding and one group shape an operand."""
    fast = _fast_kernels("cpu")
    from mxtrain import settings
    from mxtrain.kernels.mxfp4.carrier import QuantOut, carrier_from_fp4
    r = get_recipe(recipe)
    w = (_weight(N=128, K=80, odd=False) * torch.logspace(-4, 4, 80)).to(dt)   # (some blocks inexact in a carrier)
    outs, ops = _fast_runs(r, w, (world,), 16, monkeypatch)
    _check_runs(outs, ops, r.name)
    plan = Q.plan_layer(r, tuple(w.shape), world, layer_id=2)
    gw = Q.GatheredWeight(tuple(w.shape), dt, w.device, [_gather(w, plan)])
    ctx, n_inexact = Ctx(r, 2, 3, 0), 0
    with settings.override(exact_carrier=True):   # (each call's own count of inexact blocks)
        for (name, axis, gemm), gr in zip(Q.WEIGHT_OPERANDS, grs):
            fused = ops[0][name]
            signs = ctx.signs(gemm, w.device)
            got, _ = fast.gathered_operand(ctx, gw, axis % 2, name, gemm, signs, "fp8_carrier", gr)
            want = QuantOut(fused.R, fused.K, None, None, gr, None, fused.packed, fused.scales, fmt=fused.fmt)
            carrier_from_fp4(want, 512, 16)
            assert got.carrier.shape[1] == 512 and got.gs_base.shape == want.gs_base.shape
            _same_operand(want, got, (r.name, name, gr))
            assert int(got.inexact.item()) == int(want.inexact.item()), (r.name, name, gr)
            n_inexact += int(want.inexact.item())
    assert n_inexact > 0   # (the count compared is not always 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["mxfp4-all", "mxfp4-all-dh16", _INT4],
                         ids=lambda r: r if isinstance(r, str) else r.name)
def test_fast_path_on_gathered_weight_equals_whole_weight_gpu(recipe, monkeypatch):
    """On a GPU (sm_90: FP8-carrier GEMMs, the carrier rebuilt from the gathered codes), ``mx_linear`` routes a
    gathered weight to the fast path: Y, dX, dW and the weight's inexact-block count equal the whole weight's,
    for 2, 4 and 8 shards of a bf16 weight (in-features 1040: rotation and 512 padding)."""
    w = _weight(N=768, K=1040, odd=False).to("cuda", torch.bfloat16)
    outs, ops = _fast_runs(recipe, w, (2, 4, 8), 256, monkeypatch, on_gpu=True)
    _check_runs(outs, ops, recipe)
