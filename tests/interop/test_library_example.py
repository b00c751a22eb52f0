"""examples/library_example.py's arms (docs/library.md): a recipe with the mxtrain settings of its run after colons,
checked before any GPU work (the example itself needs a CUDA GPU; its timing is a benchmark, not a test)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "library_example.py"


def _example():
    spec = importlib.util.spec_from_file_location("library_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_arm_carries_settings_and_bad_ones_are_one_line_before_any_run():
    ex = _example()
    assert ex.parse_arm("bf16") == ("bf16", {})
    assert ex.parse_arm("mxfp4-all-dh16:mx_compiled=shared:dual=on") == (
        "mxfp4-all-dh16", {"mx_compiled": "shared", "dual": "on"})
    with pytest.raises(SystemExit, match="mx_compiled='bogus' is not a valid value"):
        ex.parse_arm("mxfp4-all-dh16:mx_compiled=bogus")
    with pytest.raises(SystemExit, match="unknown setting"):
        ex.parse_arm("mxfp4-all-dh16:no_such=1")
    with pytest.raises(SystemExit, match="key=value pairs, got 'shared'"):
        ex.parse_arm("mxfp4-all-dh16:shared")


def test_an_unknown_recipe_is_one_line_before_any_run():
    ex = _example()
    with pytest.raises(SystemExit, match="unknown recipe 'mxfp4-al' \\(did you mean mxfp4-all"):
        ex.parse_arm("mxfp4-al")
    assert ex.parse_arm("torchao-tensorwise") == ("torchao-tensorwise", {})


def test_the_torchao_arm_converts_the_layers_mxtrain_converts():
    """The peer arm (torchao's float8 training) and an mxtrain arm convert the same layers of the example's
    Hugging Face Llama: every linear layer but ``lm_head``, the same share of the parameters."""
    pytest.importorskip("torchao.float8")
    import torch
    import transformers
    ex = _example()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    got = {}
    for recipe in ("torchao-tensorwise", "mxfp4-all-dh16"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        got[recipe] = ex.convert_arm(model, recipe)
        assert type(model.lm_head) is torch.nn.Linear, recipe
        kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("q_proj", "down_proj"))}
        if recipe == "torchao-tensorwise":
            assert kinds == {"Float8Linear"}, kinds
        else:   # (mxtrain changes each layer's class in place to an MX subclass)
            assert kinds and "Linear" not in kinds, kinds
    (n_ao, share_ao), (n_mx, share_mx) = got["torchao-tensorwise"], got["mxfp4-all-dh16"]
    assert n_ao == n_mx == 2 * 7
    assert share_ao == pytest.approx(share_mx, rel=1e-12) and 0 < share_ao < 1
