"""``study.diagnostics.error_split``: hand-computed blocks (exact rationals), the energy identity, and the
shrinkage it is meant to show, against float64 arithmetic written here from the definitions."""

import math

import pytest
import torch

from mxtrain import Operand
from mxtrain.numerics.quant import quantize
from mxtrain.study.diagnostics import error_split


def lattice(n: int) -> torch.Tensor:
    """Midpoints (2j + 1) / 32 of n cells of width 1/16: uniform data, no value on a rounding tie of E2M1
    (ties at k/4) or of the integer grid (ties at k + 1/2)."""
    return (2 * torch.arange(n, dtype=torch.float64) + 1) / 32


def test_uniform_data_on_whole_cells_has_no_bias_on_any_grid():
    """On [0, 6) (96 values, one block: scale 1 for E2M1 and INT4) every cell between grid neighbours holds a
    lattice symmetric about its midpoint, so its rounding errors cancel: bias 0 exactly, E2M1 included."""
    x = lattice(96).float()
    for fmt in ("mxfp4", "mxint4", "mxe1m2"):
        t = x / 4 if fmt == "mxe1m2" else x
        d = error_split(t, fmt, block_size=96)
        assert d["bias"] == 0.0, (fmt, d)
        assert d["clip_rate"] == 0.0 and d["n"] == 96


def test_e2m1_shrinks_where_a_block_ends_in_its_wide_top_cell():
    """On [0, 5) (80 values, one block, scale 1): E2M1's cells up to 4 are whole, and all 16 values in (4, 5)
    round down to 4 (its cell [4, 6) splits at 5), so sum(sign(x)(q - x)) = -sum((2i + 1) / 32, i < 16) = -8
    over sum|x| = 200: bias -0.04 exactly. The integer grid's cells [k, k + 1] are all whole: bias 0."""
    x = lattice(80).float()
    a, b = error_split(x, "mxfp4", block_size=80), error_split(x, "mxint4", block_size=80)
    assert a["bias"] == -0.04 and b["bias"] == 0.0
    sx2 = 80 * 159 * 161 / 3 / 1024                                    # sum of x**2, exactly
    # E2M1 flushes x < 1/4 (4 values), INT4 x < 1/2 (8 values)
    assert a["flush_rate"] == 4 / 80 and b["flush_rate"] == 8 / 80
    assert a["flush_energy"] == pytest.approx((1 + 9 + 25 + 49) / 1024 / sx2, rel=1e-12)
    assert b["flush_energy"] == pytest.approx(8 * 15 * 17 / 3 / 1024 / sx2, rel=1e-12)


def reference(t: torch.Tensor, fmt: str, rule: str, rounding: str, seed: int) -> dict:
    """The definitions in float64, element by element, from the quantized values and scales."""
    mx = quantize(t, fmt, scale_rule=rule, rounding=rounding, seed=seed)
    q = mx.dequantize().double().flatten().tolist()
    sc = mx.scale_values().double().flatten().tolist()           # (2-D, blocks along the last axis, whole)
    top = mx.fmt.elem.max
    xs = t.double().flatten().tolist()
    S = {"bias": 0.0, "abs": 0.0, "sig": 0.0, "err": 0.0, "fl": 0.0, "cl": 0.0, "nz": 0, "nfl": 0, "ncl": 0}
    rounded = []
    for x, y, s in zip(xs, q, sc):
        if not (math.isfinite(x) and math.isfinite(y)) or x == 0:
            continue
        S["nz"] += 1
        S["bias"] += math.copysign(1.0, x) * (y - x)
        S["abs"] += abs(x)
        S["sig"] += x * x
        S["err"] += (y - x) ** 2
        if y == 0:
            S["nfl"] += 1
            S["fl"] += x * x
        elif abs(x) > top * s:
            S["ncl"] += 1
            S["cl"] += (y - x) ** 2
        else:
            rounded.append((x, y))
    g = sum((y - x) * x for x, y in rounded) / sum(x * x for x, _ in rounded)
    return {"bias": S["bias"] / S["abs"], "flush_rate": S["nfl"] / S["nz"], "clip_rate": S["ncl"] / S["nz"],
            "error_energy": S["err"] / S["sig"], "flush_energy": S["fl"] / S["sig"], "clip_energy": S["cl"] / S["sig"],
            "gain_rounded": g, "systematic_energy": g * g * sum(x * x for x, _ in rounded) / S["sig"],
            "noise_energy": sum((y - x - g * x) ** 2 for x, y in rounded) / S["sig"]}


@pytest.mark.parametrize("fmt,rule,rounding", [("mxfp4", "floor", "nearest"), ("mxint4", "floor", "stochastic"),
                                               ("mxfp4", "adaptive", "nearest")])
def test_matches_the_definitions_and_the_energies_add_up(fmt, rule, rounding):
    g = torch.Generator().manual_seed(5)
    t = torch.randn(16, 64, generator=g) * torch.logspace(-2, 2, 16)[:, None]
    t[0, 3] = float("nan")                                        # its block is left out
    t[1, 7] = float("inf")
    t[2, :5] = 0.0
    d = error_split(t, Operand(fmt, rounding=rounding, scale_rule=rule), seed=9)
    want = reference(t, fmt, rule, rounding, 9)
    assert d["n"] == 16 * 64 - 64
    for k, v in want.items():
        assert d[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k
    parts = d["flush_energy"] + d["clip_energy"] + d["systematic_energy"] + d["noise_energy"]
    assert parts == pytest.approx(d["error_energy"], rel=1e-12)


def test_gaussian_blocks_e2m1_shrinks_more_than_the_uniform_grid():
    """Gaussian blocks, floor scales, round to nearest: E2M1's rounded values have a negative least-squares
    gain (shrinkage, without flushing or saturation), the integer grid's does not; stochastic rounding has
    no rounding bias (|gain| well below nearest's)."""
    t = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    e2m1, int4 = error_split(t, "mxfp4"), error_split(t, "mxint4")
    sr = error_split(t, Operand("mxfp4", rounding="stochastic"))
    assert e2m1["gain_rounded"] < -0.005 and int4["gain_rounded"] > 0
    assert e2m1["bias"] < int4["bias"] < 0          # (both shrink in total: flushing and saturation)
    assert abs(sr["gain_rounded"]) < 0.5 * abs(e2m1["gain_rounded"])


def test_prescale_and_unquantized_operands():
    t = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    d = error_split(t, Operand("mxfp4", prescale=0.75))
    assert d["clip_rate"] == 0.0                                 # 3/4: block maxima land in [3, 6)
    b = error_split(t, "bf16")
    assert b["error_energy"] == 0.0 and b["bias"] == 0.0 and b["flush_rate"] == 0.0


def test_each_diagnosed_operand_row_holds_its_split():
    """``gemm_diagnostics`` (the ``--diagnose-every`` rows) carries the split of every quantized operand: for an
    unrotated nearest-rounding operand it is ``error_split`` of that tensor; ``aggregate`` averages it."""
    from mxtrain.numerics import recipes
    from mxtrain.linear.context import Ctx
    from mxtrain.study.diagnostics import SPLIT_KEYS, aggregate, gemm_diagnostics
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)
    rows = gemm_diagnostics(Ctx(recipes.get("mxfp4-all-adaptive"), 0, 0, 0), x, w, dy)
    st = rows["fprop"]["operands"]["fprop_x"]
    want = error_split(x, Operand("mxfp4", scale_rule="adaptive"))
    for k in SPLIT_KEYS:
        assert st[f"split_{k}"] == pytest.approx(want[k], rel=1e-12, abs=1e-15), k
    flat = [{"step": 0, "gemm": gm, "operands": r["operands"]} for gm, r in rows.items()]
    assert aggregate(flat)["operand"]["fprop_x"]["split_bias"] == [pytest.approx(want["bias"])]
