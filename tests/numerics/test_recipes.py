"""Recipes: presets, validation, immutability, serialization."""

import dataclasses
import json

import pytest
import torch

import mxtrain
from mxtrain import Operand, Recipe, Rotation
from mxtrain.numerics import recipes
from mxtrain.numerics.recipe import OPERANDS

EXPECTED = ["bf16", "fp8", "mxfp8", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4-all", "mxfp4-all-sr",
            "mxfp4-all-rht16", "mxfp4-all-dh16", "mxfp4-all-dh32", "tseng", "nvfp4"]


def test_all_presets_from_the_issue_exist():
    assert set(EXPECTED) <= set(recipes.names())


@pytest.mark.parametrize("name", recipes.names())
def test_every_preset_constructs_and_round_trips(name):
    r = recipes.get(name)
    assert isinstance(r, Recipe) and r.name == name
    assert r.description.strip(), f"{name} needs a docstring citing its source"
    assert recipes.get(r) is r
    d = r.to_dict()
    json.dumps(d)
    assert Recipe.from_dict(json.loads(json.dumps(d))) == r
    assert r.summary().startswith(f"recipe {name}")
    assert r.quantized == (name != "bf16")


def test_preset_contents_follow_the_papers():
    g = recipes.get
    assert not g("bf16").quantized
    fp8 = g("fp8")
    assert (fp8.fprop_x.fmt, fp8.fprop_w.fmt, fp8.dgrad_dy.fmt, fp8.wgrad_dy.fmt) == ("fp8_e4m3", "fp8_e4m3", "fp8_e5m2", "fp8_e5m2")
    assert all(g("mxfp8").operand(n).fmt == "mxfp8_e4m3" for n in OPERANDS)
    assert [g("mxfp4-fprop").operand(n).quantized for n in OPERANDS] == [True, True, False, False, False, False]
    assert [g("mxfp4-fprop-dgrad").operand(n).quantized for n in OPERANDS] == [True, True, True, True, False, False]
    sr = g("mxfp4-all-sr")
    assert [sr.operand(n).rounding for n in OPERANDS] == ["nearest", "nearest", "stochastic", "nearest", "stochastic", "nearest"]
    for name, size, signs in (("mxfp4-all-rht16", 16, "per_step"), ("mxfp4-all-dh16", 16, "none"), ("mxfp4-all-dh32", 32, "none")):
        r = g(name)
        assert all(r.operand(n).fmt == "mxfp4" for n in OPERANDS)
        assert all(r.rotation(k) == Rotation(size, signs) for k in ("fprop", "dgrad", "wgrad"))
    t = g("tseng")
    assert not t.fprop_x.quantized and not t.fprop_w.quantized and not t.fprop_rotation.enabled
    for n in ("dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"):
        assert t.operand(n) == Operand("mxfp4", rounding="stochastic", prescale=0.75)
    assert t.dgrad_rotation == t.wgrad_rotation == Rotation(64, "per_step")
    nv = g("nvfp4")
    assert all(nv.operand(n).fmt == "nvfp4" for n in OPERANDS)
    assert nv.fprop_w.block_2d and nv.dgrad_w.block_2d and not nv.fprop_x.block_2d
    assert nv.dgrad_dy.rounding == nv.wgrad_dy.rounding == "stochastic" and nv.wgrad_x.rounding == "nearest"
    assert nv.wgrad_rotation == Rotation(16, "fixed") and not nv.fprop_rotation.enabled and not nv.dgrad_rotation.enabled
    assert nv.keep_first >= 1 and nv.keep_last >= 1


def test_convert_report_counts_its_layers_in_words():
    rep = mxtrain.convert(torch.nn.Linear(32, 32), "mxfp4-all")
    assert str(rep).startswith("mxtrain.convert: recipe mxfp4-all: 1 layer converted, 100.0 % of 1,056 parameters")
    rep = mxtrain.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), "mxfp4-all")
    assert "2 layers converted," in str(rep)


def test_unknown_names_list_the_valid_choices():
    with pytest.raises(ValueError, match="valid recipes: bf16, fp8"):
        recipes.get("mxfp3")
    with pytest.raises(TypeError, match=r"a recipe is a preset name \(mxtrain.numerics.recipes.names\(\)\) or an "
                                        r"mxtrain.Recipe, got int 42"):   # not AttributeError: 'partition'
        mxtrain.convert(torch.nn.Linear(32, 32), 42)
    with pytest.raises(ValueError, match="choose one of: mxfp4"):
        Operand("mxfp5")
    with pytest.raises(ValueError, match="choose one of: nearest, stochastic"):
        Operand("mxfp4", rounding="up")
    with pytest.raises(ValueError, match="choose one of: floor, ceil, rceil, even, amd"):
        Operand("mxfp4", scale_rule="round")
    with pytest.raises(ValueError, match="choose one of: 0, 16, 32, 64, 128"):
        Rotation(24)
    with pytest.raises(ValueError, match="choose one of: none, fixed, per_layer, per_step"):
        Rotation(16, "random")
    with pytest.raises(ValueError, match="prescale"):
        Operand("mxfp4", prescale=-1.0)
    with pytest.raises(ValueError, match="only defined for nvfp4"):
        Operand("mxfp4", block_2d=True)
    with pytest.raises(ValueError, match="keep_first"):
        Recipe(keep_first=-1)
    with pytest.raises(ValueError, match="keep_last"):
        Recipe(keep_last=True)
    with pytest.raises(ValueError, match="seed"):
        Recipe(seed="0")
    with pytest.raises(ValueError, match="rotation size must be an integer"):
        Rotation(16.0)
    import numpy as np
    r = Recipe(seed=np.int64(3), keep_first=np.int32(1), fprop_rotation=Rotation(np.int64(16)))
    assert type(r.seed) is int and type(r.keep_first) is int and type(r.fprop_rotation.size) is int
    with pytest.raises(ValueError, match="prescale"):
        Operand("mxfp4", prescale=True)
    with pytest.raises(TypeError):
        Recipe(fprop_x="mxfp4")
    with pytest.raises(TypeError):
        Recipe(keep_hp="*.lm_head")
    with pytest.raises(ValueError, match="unknown recipe field 'fprop'; fields: name, fprop_x"):
        recipes.get("mxfp4-all").with_(fprop=1)
    with pytest.raises(ValueError, match="unknown recipe field 'fprop_x.colour'; fields of fprop_x: fmt, rounding"):
        recipes.get("mxfp4-all").with_(**{"fprop_x.colour": 1})
    with pytest.raises(ValueError, match="unknown recipe field 'name.x': name has no fields of its own"):
        recipes.get("mxfp4-all").with_(**{"name.x": 1})
    with pytest.raises(ValueError, match="unknown recipe fields: bogus"):
        Recipe.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="choose one of"):
        Recipe.from_dict({"fprop_x": {"fmt": "int8"}})
    with pytest.raises(ValueError, match="choose one of"):
        recipes.get("mxfp4-all").with_(**{"wgrad_dy.rounding": "sometimes"})


def test_recipes_are_frozen():
    r = recipes.get("mxfp4-all")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fprop_x = Operand()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fprop_x.fmt = "bf16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.fprop_rotation.size = 32
    assert recipes.get("mxfp4-all") == r  # a fresh copy every time, unchanged


def test_with_builds_variants():
    base = recipes.get("mxfp4-all")
    v = base.with_(**{"wgrad_dy.rounding": "stochastic", "wgrad_dy.scale_rule": "rceil"},
                   wgrad_rotation=Rotation(16, "per_layer"), keep_hp=["*.o_proj"], name="mine")
    assert v.wgrad_dy == Operand("mxfp4", rounding="stochastic", scale_rule="rceil")
    assert v.wgrad_rotation.signs == "per_layer" and v.keep_hp == ("*.o_proj",) and v.name == "mine"
    assert base.wgrad_dy.rounding == "nearest"
    assert Recipe.from_dict(v.to_dict()) == v
    custom = Recipe("custom", fprop_x=Operand("mxfp6_e2m3", scale_rule="even"), fprop_w=Operand("mxfp6_e2m3"))
    assert custom.quantized and recipes.get(custom) is custom
    assert "fprop: x=mxfp6_e2m3 nearest even" in custom.summary()


def test_numerics_doc_lists_every_preset_and_its_examples_run():
    import pathlib
    import re

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "numerics.md").read_text()
    for name in recipes.names():
        assert f"| `{name}` |" in doc, f"docs/numerics.md has no table row for preset {name}"
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) >= 2
    for code in blocks:
        exec(compile(code, "docs/numerics.md", "exec"), {})


def test_preset_plus_scale_rule():
    """``PRESET+RULE``: every MX operand takes the rule, nothing else changes; bad rules and presets
    without MX operands are refused with the valid choices."""
    import pytest

    from mxtrain.numerics import recipes
    base = recipes.get("tseng")
    r = recipes.get("tseng+amd")
    assert r.name == "tseng+amd"
    for n in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"):
        want = "amd" if base.operand(n).fmt.startswith("mx") else base.operand(n).scale_rule
        assert r.operand(n).scale_rule == want
        assert r.operand(n).fmt == base.operand(n).fmt and r.operand(n).rounding == base.operand(n).rounding
    assert r.rotation("wgrad") == base.rotation("wgrad") and r.keep_first == base.keep_first
    assert recipes.is_name("mxfp4-all-dh16+rceil") and not recipes.is_name("mxfp4-all+round")
    with pytest.raises(ValueError, match="valid: floor, ceil, rceil, even, amd"):
        recipes.get("mxfp4-all+round")
    with pytest.raises(ValueError, match="has no MX operand"):
        recipes.get("fp8+amd")
    for name in ("mxfp4-dgrad", "mxfp4-wgrad", "mxfp4-bwd", "mxfp4-bwd-sr"):
        q = recipes.get(name)
        assert q.operand("fprop_x").fmt == "bf16"
        assert q.description


def test_cheapest_forward_levers_presets():
    """Issue #51's "cheapest levers on the forward": ``mxfp4-all-dh16-fprop`` is ``mxfp4-all`` with
    ``mxfp4-all-dh16``'s rotation on Fprop only; ``mxfp4-all-bf16last`` is ``mxfp4-all`` with the last block
    of the trainer's model kept as ``nn.Linear`` (every other block's linear layers become MX layers). Both
    stay on the fast path."""
    from mxtrain.linear import fast
    from mxtrain.model.llama import Llama, ModelConfig
    from mxtrain.linear.module import MXLinear

    g = recipes.get
    f = g("mxfp4-all-dh16-fprop")
    assert all(f.operand(n) == g("mxfp4-all").operand(n) for n in OPERANDS)
    assert f.fprop_rotation == g("mxfp4-all-dh16").fprop_rotation == Rotation(16, "none")
    assert not f.dgrad_rotation.enabled and not f.wgrad_rotation.enabled
    last = g("mxfp4-all-bf16last")
    assert last == g("mxfp4-all").with_(keep_last=1, name="mxfp4-all-bf16last", description=last.description)
    assert g("mxfp4-all").with_(**{"keep_last": 2}).keep_last == 2   # --set recipe.keep_last=2: more blocks
    for r in (f, last, g("mxfp4-all-dh16-fprop+rceil")):
        assert fast.supported(r), r.name
    model = Llama(ModelConfig(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16))
    rep = mxtrain.convert(model, last)
    for i, block in enumerate(model.layers):
        lin = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
        assert len(lin) == 7
        if i == 2:
            assert all(type(m) is torch.nn.Linear for m in lin)
        else:
            assert all(isinstance(m, MXLinear) for m in lin)
    assert type(model.lm_head) is torch.nn.Linear and "keep_last=1 of 3 blocks" in rep.kept["layers.2.attention.wq"]


def test_a_misspelt_recipe_name_gets_the_closest_presets():
    """The error for an unknown preset names the closest ones (a scale rule too after ``+``), and nothing where
    none is close; the study's arm check and ``train.switch_recipe`` say the same."""
    from mxtrain.errors import UserError
    from mxtrain.study import arms
    assert recipes.did_you_mean("mxfp4-al") == " (did you mean mxfp4-all or mxfp4-all-sr?)"
    assert recipes.did_you_mean("mxfp4-all-dh61") == " (did you mean mxfp4-all-dh16 or mxfp4-all-dh32?)"
    assert recipes.did_you_mean("mxfp4-all+rceal") == " (did you mean mxfp4-all+rceil?)"
    assert recipes.did_you_mean("zzz") == ""
    with pytest.raises(ValueError, match=r"unknown recipe 'tsneg' \(did you mean tseng\?\); valid recipes: bf16"):
        recipes.get("tsneg")
    with pytest.raises(UserError, match=r"unknown recipe 'mxfp4-alll' in arm 'mxfp4-alll@lr1e-3' \(did you mean "
                                        r"mxfp4-all or mxfp4-all-sr\?\)"):
        arms.check("mxfp4-alll@lr1e-3")
