"""Per-GEMM diagnostics on tiny layers on CPU: they reproduce what the layer computed."""

import json

import pytest

# the first layer's input needs no gradient; its full backward hook still delivers dY
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")
import torch
import torch.nn as nn

from mxtrain import convert, set_step
from mxtrain.numerics import recipes
from mxtrain.linear.context import Ctx
from mxtrain.linear.module import mx_layers
from mxtrain.study import diagnostics as D


@pytest.mark.parametrize("name", ["mxfp4-all", "mxfp4-all-sr", "mxfp4-all-rht16", "tseng", "nvfp4", "mxfp4-all-dh32"])
def test_operand_quantize_matches_layer(name):
    rec = recipes.get(name)
    ctx = Ctx(rec, layer=3, step=7, call=1)
    g = torch.Generator().manual_seed(0)
    t = torch.randn(40, 64, generator=g)
    for opname, gemm, axis in (("fprop_x", "fprop", -1), ("dgrad_w", "dgrad", 0), ("wgrad_dy", "wgrad", 0)):
        s = ctx.signs(gemm, t.device)
        ref, p_ref = ctx.operand(t, axis, opname, gemm, s)
        q, p, r, mx = D.operand_quantize(ctx, t, axis, opname, gemm, s)
        assert p == p_ref and torch.equal(q, ref)


def _model(recipe, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    return convert(m, recipe).model


def test_recomputed_gemms_equal_the_layer(tmp_path):
    model = _model("mxfp4-all-sr")
    diag = D.Diagnostics(model, tmp_path, every=2)
    x = torch.randn(4, 8, 64)
    tgt = torch.randn(4, 8, 64)
    outs = {}
    for step in (0, 1, 2):
        set_step(model, step)
        diag.begin(step)
        model.zero_grad()
        y = model(x)
        (y * tgt).sum().backward()
        rows = diag.end(step)
        outs[step] = rows
    assert outs[1] == []
    rows0 = outs[0]
    assert {(r["layer"], r["gemm"]) for r in rows0} == {(n, g) for n in ("0", "2") for g in ("fprop", "dgrad", "wgrad")}
    # the Wgrad GEMM recomputed by the diagnostics is the layer's actual weight gradient
    (_, lin), = [(n, m) for n, m in mx_layers(model) if n == "2"]
    cap_ctx = Ctx(lin.recipe, lin.layer_id, 2, 0)
    # re-run step 2's capture through the public function and compare with .grad
    h = {}
    def fwd(m, i, o):
        h["x"] = i[0].detach()
        o.register_hook(lambda g: h.update(dy=g))

    hk = lin.register_forward_hook(fwd)
    model.zero_grad()
    y = model(x)
    (y * tgt).sum().backward()
    hk.remove()
    d = D.gemm_diagnostics(Ctx(lin.recipe, lin.layer_id, 2, 1), h["x"], lin.weight.detach(), h["dy"])
    dw_q = d["wgrad"]["_err"] + h["dy"].reshape(-1, 64).t() @ h["x"].reshape(-1, 96)
    assert torch.allclose(dw_q, lin.weight.grad, rtol=1e-5, atol=1e-6)
    del cap_ctx
    # rows are well-formed and the second diagnosed step has an error correlation
    lines = [json.loads(s) for s in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    assert len(lines) == 12
    w2 = [r for r in outs[2] if r["gemm"] == "wgrad"]
    assert all(r["err_corr_prev"] is not None and -1 <= r["err_corr_prev"] <= 1 for r in w2)
    for r in rows0:
        assert 0.9 < r["cos"] <= 1.0 + 1e-9 and r["rel_err"] > 0
        for st in r["operands"].values():
            assert st["sqnr_db"] > 5 and 0 <= st["clip_rate"] < 0.3 and 0 <= st["underflow_rate"] < 1
            assert sum(st["scale_hist"].values()) > 0
    agg = D.aggregate(D.load(tmp_path))
    assert agg["steps"] == [0, 2] and set(agg["gemm"]) == {"fprop", "dgrad", "wgrad"}
    assert agg["overall"]["gemm"]["wgrad"]["err_corr_prev"] is not None


def test_off_registers_nothing_and_bf16_is_skipped(tmp_path):
    model = _model("mxfp4-all")
    diag = D.Diagnostics(model, tmp_path, every=0)
    diag.begin(0)
    assert all(not m._forward_hooks for _, m in mx_layers(model))
    assert diag.end(0) == []
    base = _model("bf16")
    diag = D.Diagnostics(base, tmp_path / "b", every=1)
    diag.begin(0)
    base(torch.randn(2, 64)).sum().backward()
    assert diag.end(0) == []


def test_clip_and_underflow_rates_known():
    rec = recipes.get("mxfp4-all")
    ctx = Ctx(rec, 0, 0, 0)
    # one block of 32: max 7.0 * 2^k (floor rule -> scale 2^(2-2)=1 for amax in [4,8)), so 7 clips
    t = torch.full((1, 32), 1e-6)
    t[0, 0] = 7.0
    t[0, 1] = 6.5
    q, p, r, mx = D.operand_quantize(ctx, t, -1, "fprop_x", "fprop", None)
    st = D._operand_stats(q, p, r, mx, -1)
    assert st["clip_rate"] == pytest.approx(2 / 32)
    assert st["underflow_rate"] == pytest.approx(30 / 32)
    assert st["scale_hist"] == {"0": 1}
    # the ceil rule never saturates
    ctx = Ctx(recipes.get("mxfp4-all").with_(**{"wgrad_dy.scale_rule": "ceil"}), 0, 0, 0)
    q, p, r, mx = D.operand_quantize(ctx, torch.randn(64, 64), 0, "wgrad_dy", "wgrad", None)
    assert D._operand_stats(q, p, r, mx, 0)["clip_rate"] == 0.0


def test_impl_rel_diff_checks_the_path_that_trained(tmp_path):
    """The layer's actual Y, dX and dW agree with the reference recomputation on the reference path."""
    model = _model("mxfp4-all-rht16")
    diag = D.Diagnostics(model, None, every=1)
    set_step(model, 3)
    diag.begin(3)
    (model(torch.randn(2, 16, 64)) * torch.randn(2, 16, 64)).sum().backward()
    rows = diag.end(3)
    assert len(rows) == 6
    for r in rows:
        if r["layer"] == "0" and r["gemm"] == "dgrad":  # the model input needs no gradient: no dX
            assert r["impl_rel_diff"] is None
            continue
        assert r["impl_rel_diff"] is not None and r["impl_rel_diff"] < 1e-5, r
