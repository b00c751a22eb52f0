"""The 125m ladder of issue #46 (docs/results.md, "Next experiment, planned before it runs"): the runs trained so far
are kept in the repository (the per-seed record and the study folder without checkpoints), and the ``ladder-125m`` preset
resumes that folder, so the rest of the plan trains beside the runs already done instead of starting a new study."""

import json
import tarfile
from pathlib import Path

import pytest

from mxtrain.study import stats
from mxtrain.study.plan import PRESETS, StudySpec

DATA = Path(__file__).resolve().parents[2] / "docs" / "results" / "data"


def _archived(name: str) -> dict:
    with tarfile.open(DATA / "ladder-125m-study.tgz") as t:
        return json.load(t.extractfile(t.getmember(name)))


def test_the_preset_resumes_the_archived_runs():
    """The preset's base settings (what a study folder must match to be resumed) equal the archived study's, given
    the data path and device it ran with; its arms include the archived ones, at the seeds they trained."""
    old = _archived("./study.json")
    key = old["plan_key"]
    spec = StudySpec(out="unused", data=key["train"]["data"], device=key["train"]["device"], **PRESETS["ladder-125m"])
    assert json.loads(json.dumps(spec.plan_key())) == key
    # (11 arms planned, and the third rate's 5: BF16 did better at 3.75e-4 than at 7.5e-4)
    assert spec.baseline == "bf16" and spec.seeds == 5 and len(spec.arms) == 16
    assert sum(a.endswith("@lr1.875e-4") for a in spec.arms) == 5
    seeds = _archived("./seeds.json")
    common = ("bf16", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4-all", "mxfp4-all-dh16")   # (seeds 3, 4: legs 6, 7)
    assert {a: sorted(v) for a, v in seeds["arms"].items()} == {
        **{a: ["0", "1", "2", "3", "4"] for a in common}, "mxfp4-all@bf16cool": ["4"],
        **{a: ["0", "1", "2"] for a in ("bf16@lr3.75e-4", "bf16@lr1.875e-4", "mxfp4-all@lr3.75e-4",
                                        "mxfp4-fprop@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4",
                                        "mxfp4-all-dh16@lr3.75e-4")}}
    assert set(seeds["arms"]) <= set(spec.arms)


def _full_budget_gaps(rec: dict, arm: str, ref: str, budget: str = "1") -> list:
    return [rec["arms"][arm][s]["cooled"][budget]["loss"] - rec["arms"][ref][s]["cooled"][budget]["loss"]
            for s in ("0", "1", "2")]


def test_the_quoted_contrasts_come_from_the_committed_record():
    """docs/results.md's contrast 1 (Fprop minus BF16 at 7.5e-4, full budget) is what the committed per-seed record
    gives with the project's seed-level test, and Holm over the plan's 8 tests cannot undo it (its adjusted p-value
    is at most 8 p); contrast 2 (the Wgrad step) and the unplanned Dgrad step are not resolved, as quoted."""
    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    assert rec == _archived("./seeds.json")
    t = stats.paired_t(_full_budget_gaps(rec, "mxfp4-fprop", "bf16"))
    assert t["n"] == 3 and t["mean"] == pytest.approx(0.0901, abs=5e-5)
    assert t["ci"][0] == pytest.approx(0.0739, abs=5e-5) and t["ci"][1] == pytest.approx(0.1062, abs=5e-5)
    assert t["p"] == pytest.approx(0.0017, abs=5e-5) and 8 * t["p"] < 0.05
    for others in ([1.0] * 7, [1e-4] * 7, [0.01, 0.02, 0.03, 0.04, 0.2, 0.5, 0.9]):   # the 7 tests still to run
        assert stats.holm([t["p"]] + others)[0] <= 8 * t["p"] < 0.05
    wgrad = stats.paired_t(_full_budget_gaps(rec, "mxfp4-all", "mxfp4-fprop-dgrad"))
    assert wgrad["mean"] == pytest.approx(0.0209, abs=5e-5) and wgrad["p"] == pytest.approx(0.097, abs=5e-4)
    assert wgrad["ci"][0] < 0 < wgrad["ci"][1]
    dgrad = stats.paired_t(_full_budget_gaps(rec, "mxfp4-fprop-dgrad", "mxfp4-fprop"))
    assert dgrad["mean"] == pytest.approx(-0.0323, abs=5e-5) and dgrad["p"] == pytest.approx(0.073, abs=5e-4)
    assert dgrad["ci"][0] < 0 < dgrad["ci"][1]


def test_the_third_legs_contrast_and_rate_check_as_quoted():
    """Contrast 3 (H16 minus plain MXFP4 at 7.5e-4) is not resolved, as quoted; the planned rate check (BF16 at
    3.75e-4 minus BF16 at 7.5e-4) is resolved lower at every seed, which is the plan's rule for the third rate."""
    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    h16 = stats.paired_t(_full_budget_gaps(rec, "mxfp4-all-dh16", "mxfp4-all"))
    assert h16["mean"] == pytest.approx(-0.0319, abs=5e-5) and h16["p"] == pytest.approx(0.098, abs=5e-4)
    assert h16["ci"][0] < 0 < h16["ci"][1]
    gaps = _full_budget_gaps(rec, "bf16@lr3.75e-4", "bf16")
    rate = stats.paired_t(gaps)
    assert all(g < 0 for g in gaps) and rate["mean"] == pytest.approx(-0.0529, abs=5e-5)
    assert rate["ci"][1] < 0 and rate["p"] == pytest.approx(0.012, abs=5e-4)


def _quoted(t: dict, mean: float, lo: float, hi: float, p: float, digits: int = 3) -> None:
    """A paired t result as docs/results.md quotes it: mean and interval to ``digits`` decimals, p as printed."""
    tol = 0.5 * 10 ** -digits + 1e-12
    assert t["n"] == 3
    assert t["mean"] == pytest.approx(mean, abs=tol)
    assert t["ci"][0] == pytest.approx(lo, abs=tol) and t["ci"][1] == pytest.approx(hi, abs=tol)
    assert t["p"] == pytest.approx(p, rel=0.05)


def test_the_fourth_legs_rates_and_cost_as_quoted():
    """docs/results.md's fourth leg (BF16 at 1.875e-4, ``mxfp4-all`` at 3.75e-4; description only) and its two
    table rows, as the committed per-seed record gives them: BF16's lowest seed-mean loss of its three rates is at
    3.75e-4; the lower rate helps ``mxfp4-all`` too; its cost against BF16 at 3.75e-4, in nats and in extra tokens
    on BF16's 3.75e-4 curve (README.md quotes the same figures)."""
    import numpy as np

    from mxtrain.study import cooldown

    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    assert rec == _archived("./seeds.json")
    budgets = ("0.25", "0.5", "1")

    def mean(arm, b="1"):
        return sum(rec["arms"][arm][s]["cooled"][b]["loss"] for s in ("0", "1", "2")) / 3

    def seeds(gaps):
        return [round(g, 4) for g in gaps]

    # the table's two new rows: seed means at 25, 50 and 100 %, and the gap to bf16 at 7.5e-4
    assert [round(mean("bf16@lr1.875e-4", b), 4) for b in budgets] == [4.3637, 3.7837, 3.3641]
    assert [round(mean("mxfp4-all@lr3.75e-4", b), 4) for b in budgets] == [4.2343, 3.7240, 3.3533]
    g = _full_budget_gaps(rec, "bf16@lr1.875e-4", "bf16")
    _quoted(stats.paired_t(g), 0.0145, -0.0144, 0.0434, 0.16, digits=4)
    assert seeds(g) == [0.0022, 0.0158, 0.0254]
    g = _full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "bf16")
    _quoted(stats.paired_t(g), 0.0036, -0.0191, 0.0264, 0.56, digits=4)
    assert seeds(g) == [-0.0044, 0.0017, 0.0136]

    # BF16's best rate of the three (the plan's rule: the lower seed-mean cooled-down loss at the full budget)
    means = {a: round(mean(a), 4) for a in ("bf16@lr1.875e-4", "bf16@lr3.75e-4", "bf16")}
    assert means == {"bf16@lr1.875e-4": 3.3641, "bf16@lr3.75e-4": 3.2967, "bf16": 3.3496}
    assert min(means, key=means.get) == "bf16@lr3.75e-4"
    g = _full_budget_gaps(rec, "bf16@lr1.875e-4", "bf16@lr3.75e-4")
    _quoted(stats.paired_t(g), 0.067, 0.055, 0.080, 0.0019)
    assert seeds(g) == [0.0626, 0.0727, 0.0668]
    assert [round(stats.paired_t(_full_budget_gaps(rec, "bf16@lr1.875e-4", "bf16@lr3.75e-4", b))["mean"], 3)
            for b in ("0.25", "0.5")] == [0.154, 0.103]
    _quoted(stats.paired_t(_full_budget_gaps(rec, "bf16@lr1.875e-4", "bf16")), 0.014, -0.014, 0.043, 0.16)

    # mxfp4-all at the two rates
    g = _full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "mxfp4-all")
    _quoted(stats.paired_t(g), -0.075, -0.112, -0.038, 0.013)
    assert seeds(g) == [-0.0791, -0.0875, -0.0586] and round(mean("mxfp4-all"), 4) == 3.4283

    # the cost at the common lower rate, by budget, and in extra tokens on BF16's 3.75e-4 curve
    g = _full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "bf16@lr3.75e-4")
    _quoted(stats.paired_t(g), 0.057, 0.052, 0.061, 0.00035)
    assert seeds(g) == [0.0560, 0.0586, 0.0550]
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "bf16@lr3.75e-4", "0.25")),
            0.025, -0.001, 0.051, 0.053)
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "bf16@lr3.75e-4", "0.5")),
            0.044, 0.034, 0.054, 0.0027)

    def per_seed(arm):   # (seeds, budgets, 1 window): the seed means, which are all a seed-level interval uses
        return np.array([[[rec["arms"][arm][s]["cooled"][b]["loss"]] for b in budgets] for s in ("0", "1", "2")])

    D = [rec["arms"]["bf16"]["0"]["cooled"][b]["tokens"] for b in budgets]
    out = cooldown.paired_extra_tokens(D, per_seed("mxfp4-all@lr3.75e-4"), per_seed("bf16@lr3.75e-4"), n_boot=0)
    fit, full = out["fit"], out["budgets"][-1]
    assert (round(fit["E"], 4), round(float(fit["B"])), round(fit["beta"], 3)) == (2.2852, 4191, 0.464)
    assert round(100 * full["extra"], 1) == 12.4 and not full["extrapolated"]
    assert [round(100 * x, 1) for x in full["ci95"]] == [11.3, 13.6]

    # the table's extra tokens of the two new rows on BF16's 7.5e-4 curve (with the detectable effect)
    for arm, quoted in (("bf16@lr1.875e-4", [3.2, -3.2, 9.7, 8.0]), ("mxfp4-all@lr3.75e-4", [0.8, -4.2, 5.8, 6.3])):
        row = cooldown.paired_extra_tokens(D, per_seed(arm), per_seed("bf16"), n_boot=0)["budgets"][-1]
        assert [round(100 * x, 1) for x in (row["extra"], *row["ci95"], row["mde"])] == quoted

    # against the same gap at 7.5e-4: the difference of the two costs (one unplanned, uncorrected test)
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-all", "bf16")), 0.079, 0.056, 0.101, 0.0045)
    did = [a - b for a, b in zip(g, _full_budget_gaps(rec, "mxfp4-all", "bf16"))]
    _quoted(stats.paired_t(did), -0.022, -0.040, -0.004, 0.035)
    assert seeds(did) == [-0.0187, -0.0306, -0.0172]


def test_the_fifth_legs_ladder_at_3_75e_4_as_quoted():
    """docs/results.md's fifth leg (``mxfp4-fprop``, ``mxfp4-fprop-dgrad`` and ``mxfp4-all-dh16`` at 3.75e-4;
    description only) and its three table rows, as the committed per-seed record gives them: every MX arm does
    better at 3.75e-4 than at 7.5e-4; the plan's contrasts 1-3 read at 3.75e-4, by paired t over seeds 0-2 and in
    extra tokens on the second arm's curve; Holm over the plan's 8 tests, the two contrast-4 tests not yet run
    (README.md quotes the same figures)."""
    import numpy as np

    from mxtrain.study import cooldown

    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    assert rec == _archived("./seeds.json")
    budgets = ("0.25", "0.5", "1")
    new = ("mxfp4-fprop@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4", "mxfp4-all-dh16@lr3.75e-4")
    assert all(sorted(rec["arms"][a]) == ["0", "1", "2"] for a in new)

    def mean(arm, b="1"):
        return sum(rec["arms"][arm][s]["cooled"][b]["loss"] for s in ("0", "1", "2")) / 3

    def seeds(gaps):
        return [round(g, 4) for g in gaps]

    def per_seed(arm):   # (seeds, budgets, 1 window): the seed means, which are all a seed-level interval uses
        return np.array([[[rec["arms"][arm][s]["cooled"][b]["loss"]] for b in budgets] for s in ("0", "1", "2")])

    D = [rec["arms"]["bf16"]["0"]["cooled"][b]["tokens"] for b in budgets]

    def extra(arm, ref):
        row = cooldown.paired_extra_tokens(D, per_seed(arm), per_seed(ref), n_boot=0)["budgets"][-1]
        return [round(100 * x, 1) for x in (row["extra"], *row["ci95"], row["mde"])], row["extrapolated"]

    # the table's three new rows: seed means at 25, 50 and 100 %, the gap to bf16 at 7.5e-4, extra tokens
    rows = {"mxfp4-fprop@lr3.75e-4": ([4.2255, 3.7176, 3.3431], (-0.0065, -0.0510, 0.0380, 0.59),
                                      [-0.0263, -0.0015, 0.0084], [-1.4, -11.2, 8.3, 12.2]),
            "mxfp4-fprop-dgrad@lr3.75e-4": ([4.2141, 3.7017, 3.3303], (-0.0193, -0.0562, 0.0175, 0.15),
                                            [-0.0347, -0.0182, -0.0051], [-4.3, -12.3, 3.8, 10.0]),
            "mxfp4-all-dh16@lr3.75e-4": ([4.2283, 3.7056, 3.3308], (-0.0189, -0.0544, 0.0166, 0.15),
                                         [-0.0350, -0.0141, -0.0076], [-4.2, -12.0, 3.7, 9.8])}
    for arm, (means, t, each, tokens) in rows.items():
        assert [round(mean(arm, b), 4) for b in budgets] == means
        g = _full_budget_gaps(rec, arm, "bf16")
        _quoted(stats.paired_t(g), *t, digits=4)
        assert seeds(g) == each
        assert extra(arm, "bf16") == (tokens, True)   # better than BF16 at 7.5e-4: beyond its largest budget

    # each MX arm at 3.75e-4 minus at 7.5e-4: lower on every seed
    for arm, t, each in (("mxfp4-fprop", (-0.097, -0.151, -0.042, 0.017), [-0.1183, -0.0970, -0.0745]),
                         ("mxfp4-fprop-dgrad", (-0.077, -0.099, -0.055, 0.0043), [-0.0765, -0.0862, -0.0688]),
                         ("mxfp4-all-dh16", (-0.066, -0.086, -0.046, 0.0050), [-0.0716, -0.0565, -0.0689])):
        g = _full_budget_gaps(rec, arm + "@lr3.75e-4", arm)
        _quoted(stats.paired_t(g), *t)
        assert seeds(g) == each and all(x < 0 for x in g)

    # contrasts 1-3 at 3.75e-4, full budget, with extra tokens on the second arm's curve
    c1 = stats.paired_t(g1 := _full_budget_gaps(rec, "mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4"))
    _quoted(c1, 0.046, 0.019, 0.074, 0.018)
    assert seeds(g1) == [0.0340, 0.0554, 0.0499]
    assert extra("mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4") == ([10.2, 4.6, 15.7, 6.9], False)
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4", "0.25")),
            0.016, -0.025, 0.057, 0.23)
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4", "0.5")),
            0.037, -0.000, 0.075, 0.050)
    c2 = stats.paired_t(g2 := _full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4"))
    _quoted(c2, 0.023, 0.007, 0.039, 0.025)
    assert seeds(g2) == [0.0303, 0.0198, 0.0187]
    assert extra("mxfp4-all@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4") == ([5.1, 1.1, 9.2, 5.1], False)
    c3 = stats.paired_t(g3 := _full_budget_gaps(rec, "mxfp4-all-dh16@lr3.75e-4", "mxfp4-all@lr3.75e-4"))
    _quoted(c3, -0.022, -0.041, -0.004, 0.035)
    assert seeds(g3) == [-0.0306, -0.0157, -0.0212]
    assert extra("mxfp4-all-dh16@lr3.75e-4", "mxfp4-all@lr3.75e-4") == ([-4.9, -9.3, -0.4, 5.6], True)

    # the rest of the ladder against BF16 at 3.75e-4 (mxfp4-all's row is the fourth leg's)
    for arm, t, tokens in (("mxfp4-fprop-dgrad@lr3.75e-4", (0.034, 0.016, 0.051, 0.014), [7.3, 3.9, 10.7, 4.2]),
                           ("mxfp4-all-dh16@lr3.75e-4", (0.034, 0.012, 0.056, 0.021), [7.4, 3.0, 11.8, 5.5])):
        _quoted(stats.paired_t(_full_budget_gaps(rec, arm, "bf16@lr3.75e-4")), *t)
        assert extra(arm, "bf16@lr3.75e-4") == (tokens, False)
    # unplanned steps at 3.75e-4: Dgrad on top of Fprop; H16 against Fprop and Dgrad
    g = _full_budget_gaps(rec, "mxfp4-fprop-dgrad@lr3.75e-4", "mxfp4-fprop@lr3.75e-4")
    _quoted(stats.paired_t(g), -0.013, -0.023, -0.002, 0.033)
    assert seeds(g) == [-0.0084, -0.0166, -0.0135]
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-all-dh16@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4")),
            0.000, -0.008, 0.009, 0.83)
    _quoted(stats.paired_t(_full_budget_gaps(rec, "mxfp4-all@lr3.75e-4", "mxfp4-fprop@lr3.75e-4")),
            0.010, -0.015, 0.036, 0.23)

    # each contrast at 3.75e-4 minus the same contrast at 7.5e-4 (unplanned, uncorrected)
    def did(a, r, a0, r0):
        return stats.paired_t([x - y for x, y in zip(_full_budget_gaps(rec, a, r), _full_budget_gaps(rec, a0, r0))])
    _quoted(did("mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4", "mxfp4-fprop", "bf16"), -0.044, -0.075, -0.012, 0.028)
    _quoted(did("mxfp4-all@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4", "mxfp4-all", "mxfp4-fprop-dgrad"),
            0.002, -0.015, 0.020, 0.66)
    _quoted(did("mxfp4-all-dh16@lr3.75e-4", "mxfp4-all@lr3.75e-4", "mxfp4-all-dh16", "mxfp4-all"),
            0.009, -0.042, 0.061, 0.52)

    # Holm over the plan's 8 tests, were the 3.75e-4 contrasts the best-rate half: the 6 p-values known, the two
    # contrast-4 tests (no BF16-cooled branches yet) at their most and least favourable
    c = [stats.paired_t(_full_budget_gaps(rec, a, r))["p"] for a, r in (
        ("mxfp4-fprop", "bf16"), ("mxfp4-all", "mxfp4-fprop-dgrad"), ("mxfp4-all-dh16", "mxfp4-all"))]
    ps = c + [c1["p"], c2["p"], c3["p"]]
    lo, hi = stats.holm(ps + [0.0, 0.0])[:6], stats.holm(ps + [1.0, 1.0])[:6]
    assert [round(x, 3) for x in lo[3:]] == [0.092, 0.100, 0.105]
    assert [round(x, 3) for x in hi[3:]] == [0.129, 0.150, 0.176]
    assert (round(lo[0], 3), round(hi[0], 3)) == (0.010, 0.014)
    assert all(x > 0.05 for x in lo[1:]) and hi[0] < 0.05   # only contrast 1 at 7.5e-4 is resolved either way


def _readers(rec: dict, seeds: tuple, budgets=("0.25", "0.5", "1")):
    """For the legs' tests: ``gaps(arm, ref, b, seeds)`` (per-seed loss gaps at budget ``b``), ``quoted(t, mean, lo,
    hi, p, digits)`` (a paired t over ``seeds`` as quoted, to the digits shown) and ``extra(arm, ref)`` (extra tokens
    at the full budget, the jackknife over ``seeds``: mean, interval, detectable effect in %; extrapolated?; fit)."""
    import numpy as np

    from mxtrain.study import cooldown

    def gaps(arm, ref, b="1", seeds=seeds):
        return [rec["arms"][arm][s]["cooled"][b]["loss"] - rec["arms"][ref][s]["cooled"][b]["loss"] for s in seeds]

    def quoted(t, mean, lo, hi, p, digits=3):
        tol = 0.5 * 10 ** -digits + 1e-12
        assert t["n"] == len(seeds) and t["mean"] == pytest.approx(mean, abs=tol)
        assert t["ci"][0] == pytest.approx(lo, abs=tol) and t["ci"][1] == pytest.approx(hi, abs=tol)
        assert t["p"] == pytest.approx(p, rel=0.05)

    def per_seed(arm):
        return np.array([[[rec["arms"][arm][s]["cooled"][b]["loss"]] for b in budgets] for s in seeds])

    D = [rec["arms"]["bf16"]["0"]["cooled"][b]["tokens"] for b in budgets]

    def extra(arm, ref):
        out = cooldown.paired_extra_tokens(D, per_seed(arm), per_seed(ref), n_boot=0)
        row = out["budgets"][-1]
        return [round(100 * x, 1) for x in (row["extra"], *row["ci95"], row["mde"])], row["extrapolated"], out["fit"]

    return gaps, quoted, extra


def test_the_sixth_legs_contrasts_at_the_common_rate_as_quoted():
    """The contrasts 1-3 at 7.5e-4 over seeds 0-3 (the sixth leg added seed 3 of the five arms), the table's five rows
    at that rate, Holm over the plan's 8 tests, and the unplanned steps, as docs/results.md and README.md quoted them
    until the seventh leg (the fifth leg's section still quotes the seeds 0-3 figures beside the later ones): the
    record's seeds 0-3 still give them."""
    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    assert rec == _archived("./seeds.json")
    four, budgets = ("0", "1", "2", "3"), ("0.25", "0.5", "1")
    gaps, quoted, extra = _readers(rec, four)

    # the table's rows at 7.5e-4: seed means at 25, 50, 100 %, the gap to bf16 and its seeds, extra tokens
    means = {"bf16": [4.2639, 3.7255, 3.3529], "mxfp4-fprop": [4.3103, 3.7962, 3.4397],
             "mxfp4-fprop-dgrad": [4.3305, 3.7778, 3.4068], "mxfp4-all": [4.3276, 3.7921, 3.4314],
             "mxfp4-all-dh16": [4.2944, 3.7610, 3.3997]}
    for arm, m in means.items():
        assert [round(sum(rec["arms"][arm][s]["cooled"][b]["loss"] for s in four) / 4, 4) for b in budgets] == m
    rows = {"mxfp4-fprop": ((0.0867, 0.0731, 0.1003, 0.00026), [0.0919, 0.0955, 0.0829, 0.0767], [20.4, 18.0, 22.8, 3.1]),
            "mxfp4-fprop-dgrad": ((0.0539, 0.0318, 0.0761, 0.0045), [0.0418, 0.0681, 0.0637, 0.0422],
                                  [12.5, 7.8, 17.2, 6.1]),
            "mxfp4-all": ((0.0785, 0.0666, 0.0904, 0.00024), [0.0747, 0.0892, 0.0722, 0.0779], [18.4, 16.3, 20.5, 2.8]),
            "mxfp4-all-dh16": ((0.0468, 0.0300, 0.0635, 0.0030), [0.0367, 0.0425, 0.0613, 0.0466],
                               [10.8, 6.7, 14.9, 5.4])}
    for arm, (t, each, tokens) in rows.items():
        g = gaps(arm, "bf16")
        quoted(stats.paired_t(g), *t, digits=4)
        assert [round(x, 4) for x in g] == each
        got, extrapolated, fit = extra(arm, "bf16")
        assert got == tokens and not extrapolated
    assert (round(fit["E"], 4), round(float(fit["B"])), round(fit["beta"], 3)) == (2.516, 11632, 0.531)
    # Fprop alone at 25 and 50 %
    quoted(stats.paired_t(gaps("mxfp4-fprop", "bf16", "0.25")), 0.046, -0.029, 0.121, 0.14)
    quoted(stats.paired_t(gaps("mxfp4-fprop", "bf16", "0.5")), 0.071, 0.055, 0.086, 0.00069)

    # contrasts 2 and 3, with extra tokens on the second arm's curve
    c2 = stats.paired_t(g2 := gaps("mxfp4-all", "mxfp4-fprop-dgrad"))
    quoted(c2, 0.025, 0.005, 0.044, 0.029)
    assert [round(x, 4) for x in g2] == [0.0329, 0.0211, 0.0086, 0.0358]
    assert extra("mxfp4-all", "mxfp4-fprop-dgrad")[:2] == ([5.7, 1.2, 10.3, 5.9], False)
    c3 = stats.paired_t(g3 := gaps("mxfp4-all-dh16", "mxfp4-all"))
    quoted(c3, -0.032, -0.056, -0.007, 0.025)
    assert [round(x, 4) for x in g3] == [-0.0380, -0.0467, -0.0109, -0.0313]
    assert extra("mxfp4-all-dh16", "mxfp4-all")[:2] == ([-7.4, -12.6, -2.1, 6.9], True)
    quoted(stats.paired_t(gaps("mxfp4-all-dh16", "bf16")), 0.047, 0.030, 0.064, 0.0030)   # (H16 against BF16)

    # Holm over the plan's 8 tests: contrasts 1-3 at 7.5e-4 (seeds 0-3), at 3.75e-4 (seeds 0-2), contrast 4 at
    # its most and least favourable; and with every test not yet read at p = 0, contrasts 2 and 3 still at 0.050
    c1 = stats.paired_t(gaps("mxfp4-fprop", "bf16"))
    low = [stats.paired_t(gaps(a, r, seeds=("0", "1", "2")))["p"] for a, r in (
        ("mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4"), ("mxfp4-all@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4"),
        ("mxfp4-all-dh16@lr3.75e-4", "mxfp4-all@lr3.75e-4"))]
    ps = [c1["p"], c2["p"], c3["p"]] + low
    lo, hi = stats.holm(ps + [0.0, 0.0])[:6], stats.holm(ps + [1.0, 1.0])[:6]
    assert (round(lo[0], 4), round(hi[0], 4)) == (0.0016, 0.0021) and hi[0] < 0.05
    assert [round(x, 3) for x in lo[1:]] == [0.100, 0.100, 0.092, 0.100, 0.100]
    assert [round(x, 3) for x in hi[1:]] == [0.150, 0.150, 0.129, 0.150, 0.150]
    least = stats.holm([c1["p"], c2["p"], c3["p"]] + [0.0] * 5)
    assert round(least[1], 3) == round(least[2], 3) == 0.050 and min(least[1:3]) >= 0.05

    # unplanned, uncorrected: Dgrad on top of Fprop; all three against Fprop alone; H16 against Fprop and Dgrad
    g = gaps("mxfp4-fprop-dgrad", "mxfp4-fprop")
    quoted(stats.paired_t(g), -0.033, -0.054, -0.012, 0.015)
    assert [round(x, 4) for x in g] == [-0.0501, -0.0274, -0.0192, -0.0345]
    quoted(stats.paired_t(gaps("mxfp4-all", "mxfp4-fprop")), -0.008, -0.021, 0.004, 0.12)
    quoted(stats.paired_t(gaps("mxfp4-all-dh16", "mxfp4-fprop-dgrad")), -0.007, -0.028, 0.013, 0.35)


def test_the_seventh_legs_contrasts_on_the_plans_five_seeds_as_quoted():
    """docs/results.md's contrasts 1-3 at 7.5e-4 over the plan's 5 seeds (the seventh leg added seed 4), the table's
    five rows at that rate, Holm over the plan's 8 tests, the unplanned steps, and contrast 4's one seed (README.md
    quotes the contrasts)."""
    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    assert rec == _archived("./seeds.json")
    five, budgets = ("0", "1", "2", "3", "4"), ("0.25", "0.5", "1")
    gaps, quoted, extra = _readers(rec, five)

    means = {"bf16": [4.2642, 3.7286, 3.3569], "mxfp4-fprop": [4.3131, 3.7974, 3.4389],
             "mxfp4-fprop-dgrad": [4.3406, 3.7839, 3.4097], "mxfp4-all": [4.3303, 3.7950, 3.4323],
             "mxfp4-all-dh16": [4.3096, 3.7709, 3.4045]}
    for arm, m in means.items():
        assert [round(sum(rec["arms"][arm][s]["cooled"][b]["loss"] for s in five) / 5, 4) for b in budgets] == m
    rows = {"mxfp4-fprop": ((0.0820, 0.0660, 0.0980, 0.00014), [0.0919, 0.0955, 0.0829, 0.0767, 0.0631],
                            [19.3, 15.7, 22.8, 4.8]),
            "mxfp4-fprop-dgrad": ((0.0528, 0.0376, 0.0681, 0.00065), [0.0418, 0.0681, 0.0637, 0.0422, 0.0485],
                                  [12.2, 9.0, 15.5, 4.4]),
            "mxfp4-all": ((0.0755, 0.0638, 0.0871, 5.7e-5), [0.0747, 0.0892, 0.0722, 0.0779, 0.0633],
                          [17.7, 15.2, 20.1, 3.3]),
            "mxfp4-all-dh16": ((0.0476, 0.0361, 0.0591, 0.00033), [0.0367, 0.0425, 0.0613, 0.0466, 0.0508],
                               [11.0, 8.1, 13.8, 3.8])}
    for arm, (t, each, tokens) in rows.items():
        g = gaps(arm, "bf16")
        quoted(stats.paired_t(g), *t, digits=4)
        assert [round(x, 4) for x in g] == each
        got, extrapolated, fit = extra(arm, "bf16")
        assert got == tokens and not extrapolated
    assert (round(fit["E"], 4), round(float(fit["B"])), round(fit["beta"], 3)) == (2.5137, 10845, 0.527)
    quoted(stats.paired_t(gaps("mxfp4-fprop", "bf16", "0.25")), 0.049, -0.002, 0.100, 0.057)
    quoted(stats.paired_t(gaps("mxfp4-fprop", "bf16", "0.5")), 0.069, 0.057, 0.080, 7.9e-5)

    c1 = stats.paired_t(gaps("mxfp4-fprop", "bf16"))
    assert 8 * c1["p"] < 0.0012
    c2 = stats.paired_t(g2 := gaps("mxfp4-all", "mxfp4-fprop-dgrad"))
    quoted(c2, 0.023, 0.008, 0.037, 0.012)
    assert [round(x, 4) for x in g2] == [0.0329, 0.0211, 0.0086, 0.0358, 0.0147]
    assert extra("mxfp4-all", "mxfp4-fprop-dgrad")[:2] == ([5.2, 1.8, 8.6, 4.5], False)
    c3 = stats.paired_t(g3 := gaps("mxfp4-all-dh16", "mxfp4-all"))
    quoted(c3, -0.028, -0.047, -0.008, 0.017)
    assert [round(x, 4) for x in g3] == [-0.0380, -0.0467, -0.0109, -0.0313, -0.0125]
    assert extra("mxfp4-all-dh16", "mxfp4-all")[:2] == ([-6.4, -10.8, -2.0, 5.9], True)
    quoted(stats.paired_t(gaps("mxfp4-all-dh16", "bf16")), 0.048, 0.036, 0.059, 0.00033)

    # Holm over the plan's 8 tests: contrasts 1-3 at 7.5e-4 (seeds 0-4), at 3.75e-4 (seeds 0-2), contrast 4's two
    # at 0 or 1; with the five tests not yet read all at 0, contrasts 2 and 3 would be resolved
    low = [stats.paired_t(gaps(a, r, seeds=("0", "1", "2")))["p"] for a, r in (
        ("mxfp4-fprop@lr3.75e-4", "bf16@lr3.75e-4"), ("mxfp4-all@lr3.75e-4", "mxfp4-fprop-dgrad@lr3.75e-4"),
        ("mxfp4-all-dh16@lr3.75e-4", "mxfp4-all@lr3.75e-4"))]
    ps = [c1["p"], c2["p"], c3["p"]] + low
    lo, hi = stats.holm(ps + [0.0, 0.0])[:6], stats.holm(ps + [1.0, 1.0])[:6]
    assert (round(lo[0], 4), round(hi[0], 4)) == (0.0009, 0.0011)
    assert [round(x, 3) for x in lo[1:]] == [0.061, 0.067, 0.067, 0.067, 0.067]
    assert [round(x, 3) for x in hi[1:]] == [0.085, 0.101, 0.101, 0.101, 0.105]
    assert min(lo[1:]) > 0.05
    least = stats.holm([c1["p"], c2["p"], c3["p"]] + [0.0] * 5)
    assert round(least[1], 3) == round(least[2], 3) == 0.024

    # unplanned, uncorrected
    g = gaps("mxfp4-fprop-dgrad", "mxfp4-fprop")
    quoted(stats.paired_t(g), -0.029, -0.047, -0.012, 0.0096)
    assert [round(x, 4) for x in g] == [-0.0501, -0.0274, -0.0192, -0.0345, -0.0145]
    quoted(stats.paired_t(gaps("mxfp4-all", "mxfp4-fprop")), -0.007, -0.016, 0.003, 0.13)
    quoted(stats.paired_t(gaps("mxfp4-all-dh16", "mxfp4-fprop-dgrad")), -0.005, -0.020, 0.010, 0.38)

    # contrast 4: one seed, so no interval; what its branches recovered of that seed's gap
    cool = rec["arms"]["mxfp4-all@bf16cool"]["4"]["cooled"]
    plain, ref = rec["arms"]["mxfp4-all"]["4"]["cooled"], rec["arms"]["bf16"]["4"]["cooled"]
    assert [round(cool[b]["loss"], 4) for b in budgets] == [4.3308, 3.7898, 3.4129]
    assert round(plain["1"]["loss"], 4) == 3.4359 and round(cool["1"]["loss"] - ref["1"]["loss"], 4) == 0.0402
    rec_ = {b: (plain[b]["loss"] - cool[b]["loss"], plain[b]["loss"] - ref[b]["loss"]) for b in budgets}
    assert [round(rec_[b][0], 3) for b in budgets] == [0.010, 0.016, 0.023]
    assert [round(100 * rec_[b][0] / rec_[b][1]) for b in budgets] == [14, 25, 36] and round(rec_["1"][1], 3) == 0.063
    one = stats.paired_t([cool["1"]["loss"] - plain["1"]["loss"]])
    assert one["n"] == 1 and one["ci"] is None and one["p"] is None   # (no interval from one seed)


def test_the_30m_ladder_shares_the_recipes_2026_folder():
    """The 30m ladder's preset has the ``recipes-2026`` plan's base settings, so the two share one study folder and
    the runs both plans name (four arms x 5 seeds) train once."""
    a = StudySpec(out="unused", data="DATA", device="cuda", **PRESETS["ladder-30m"])
    b = StudySpec(out="unused", data="DATA", device="cuda", **PRESETS["recipes-2026"])
    assert a.plan_key() == b.plan_key()
    assert sorted(set(a.arms) & set(b.arms)) == ["bf16", "bf16@lr3.75e-4", "mxfp4-all", "mxfp4-all-dh16"]
    assert a.seeds == b.seeds == 5 and a.baseline == "bf16" and len(a.arms) == 11
