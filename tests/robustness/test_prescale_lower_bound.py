"""Issue #47, third round: an operand prescale that rounds every value to zero, checked in float32 against the
formats' ranges (the smallest prescale exactly where MX blocks become all zero; NVFP4 and per-tensor FP8 on the
safe side), next to the largest (tests/robustness/test_sizes_prescale_bound_llama_biases.py); the usable range in
the one-line message."""

import json

import pytest
import torch

from mxtrain.numerics.formats import FORMATS, get_format
from mxtrain.numerics.quant import ALL_SCALE_RULES, quantize
from mxtrain.numerics.recipe import Operand, _f32, _largest_prescale, _smallest_prescale
from train_helpers import one_line_error, run_main


def _valid(fmt, rule):
    try:
        Operand(fmt, scale_rule=rule, prescale=0.75)
    except ValueError:
        return False
    return True


MX = [(f, r) for f in FORMATS if get_format(f).kind == "mx" for r in ALL_SCALE_RULES if _valid(f, r)]
OTHER = [(f, r) for f in FORMATS if get_format(f).kind in ("nvfp4", "tensor") for r in ("floor",) if _valid(f, r)]


def _blocks(block: int) -> torch.Tensor:
    """Blocks whose largest value takes every significand edge of every rule (just below 1.5, 1.75, 1.875,
    1.9375, 2) over many binades, the rest of each block smaller, signs mixed."""
    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([1.0, 1.5, 1.75, 1.875, 1.9375])
    sig = torch.cat([torch.rand(300, generator=g) + 1, edges, edges - 2 ** -20, torch.tensor([2 - 2 ** -20])])
    amax = sig * 2.0 ** torch.randint(-20, 20, sig.shape, generator=g).float()
    x = torch.rand(len(sig), block, generator=g) * amax[:, None]
    x[:, 0] = amax
    return x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)


def _nonzero(x, fmt, rule, p) -> int:
    return int((quantize(x, fmt, scale_rule=rule, prescale=p).dequantize(torch.float32) != 0).sum())


@pytest.mark.parametrize("fmt,rule", MX, ids=[f"{f}-{r}" for f, r in MX])
def test_smallest_prescale_is_where_every_mx_block_rounds_to_zero(fmt, rule):
    """At the bound (and below) every value of every block rounds to zero; a few float32 steps above it the blocks
    whose largest value sits at the rule's highest point keep it: the bound is exact, nothing usable refused."""
    lo, _ = _smallest_prescale(fmt, rule)
    x = _blocks(32)
    assert _nonzero(x, fmt, rule, lo) == 0 and _nonzero(x, fmt, rule, lo / 3) == 0
    above = _f32(lo * (1 + 2 ** -19))
    assert above > lo and _nonzero(x, fmt, rule, above) > 0
    with pytest.raises(ValueError, match=f"prescale {lo:g} is too small for {fmt} \\(scale rule {rule}\\)"):
        Operand(fmt, scale_rule=rule, prescale=lo)
    assert Operand(fmt, scale_rule=rule, prescale=above).prescale == above
    assert _largest_prescale(fmt, rule)[0] > 1 > lo   # (1 and 0.75 are always usable)


def test_smallest_prescale_of_nvfp4_and_per_tensor_fp8_is_on_the_safe_side():
    """NVFP4: a block 2e5 times below the tensor's largest has a subnormal E4M3 scale that rounds down by up to
    1.5x, so its largest value lands near 9, not 6; per-tensor FP8 maps the largest value to 448 (57344). Below
    the bound nothing survives, even there; a little above the true limit that value does."""
    for fmt, _ in OTHER:
        lo, high = _smallest_prescale(fmt, "floor")
        half = get_format(fmt).elem.min_subnormal / 2
        x = torch.zeros(2, 16)
        x[0, 0] = 1.0
        x[1, 0] = 1.5 * 2 ** -9 / 448 * (1 - 1e-4) if fmt == "nvfp4" else 0.5
        x = torch.cat([x, _blocks(16)[:, :16] / 1e7])
        assert _nonzero(x, fmt, "floor", lo) == 0, fmt
        assert _nonzero(x, fmt, "floor", half / high * (1 - 1e-3)) == 0, fmt
        assert _nonzero(x, fmt, "floor", half / (high / (1 + 2 ** -20)) * (1 + 1e-3)) > 0, fmt
        with pytest.raises(ValueError, match="too small"):
            Operand(fmt, prescale=lo)


def test_small_prescale_is_one_line_naming_the_usable_range(tmp_path):
    one_line_error(run_main("train", "--set", "recipe.fprop_x.prescale=1e-30", "--print-config"),
                   "fprop_x.prescale=1e-30: prescale 1e-30 is too small for mxfp4 (scale rule floor)",
                   "half of mxfp4's smallest nonzero element 0.5",
                   "usable prescales for mxfp4 with scale rule floor lie above 0.03125 and at most 1.5")
    one_line_error(run_main("train", "--set", "recipe.dgrad_dy.prescale=0.03125", "--print-config"), "too small")
    one_line_error(run_main("train", "--set", "recipe.fprop_x.prescale=1e30", "--print-config"),
                   "too large", "lie above 0.03125 and at most 1.5")
    import mxtrain.numerics.recipes as R
    d = R.get("mxfp4-all-dh16").to_dict()
    d["wgrad_x"]["prescale"] = 0.001
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"recipe": d}))
    one_line_error(run_main("train", "--config", str(f), "--print-config"), "prescale 0.001 is too small for mxfp4")
    f.write_text(json.dumps({"recipe_overrides": {"fprop_w.prescale": 1e-6}}))
    one_line_error(run_main("train", "--config", str(f), "--print-config"), "fprop_w.prescale=1e-06")
    one_line_error(run_main("study", "--arms", "bf16,mxfp4-all", "--set", "recipe.fprop_x.prescale=1e-9",
                            "--dry-run", "--out", str(tmp_path / "st")), "too small for mxfp4")


def test_prescales_are_checked_as_the_float32_they_are_used_in():
    """1.5000000001 is 1.5 in float32 (accepted, as 1.5 is); the next float32 above 1.5 is refused."""
    assert Operand("mxfp4", prescale=1.5000000001).prescale == 1.5000000001
    with pytest.raises(ValueError, match="too large"):
        Operand("mxfp4", prescale=1.5 + 2 ** -23)
    assert _f32(1e39) == float("inf") and _f32(1 / 3) != 1 / 3


def test_usable_prescales_and_every_recipe_still_build():
    """Tseng's 3/4, 0.5 to 1.5 on MXFP4 (to 3 with ceil), small ones on MXFP8, and every named recipe."""
    import mxtrain.numerics.recipes as R
    for p in (0.75, 0.5, 0.04, 1.0, 1.25, 1.5):
        assert Operand("mxfp4", rounding="stochastic", prescale=p).prescale == p
    assert Operand("mxfp4", scale_rule="ceil", prescale=2.0).prescale == 2.0
    assert Operand("mxfp8_e4m3", prescale=1e-4).prescale == 1e-4 and Operand("nvfp4", prescale=0.75)
    with pytest.raises(ValueError, match="no effect on a bf16 operand"):   # not quantized: it would be ignored
        Operand("bf16", prescale=1e-30)
    for name in R.names():
        R.get(name)
    assert R.get("tseng").with_(**{"wgrad_dy.prescale": 0.5}).wgrad_dy.prescale == 0.5
