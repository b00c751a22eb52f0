"""Published claims judged from a study's cooled-down points (mxtrain.study.claims), on synthetic curves whose
answers are known: losses on a power law L(D) = E + B D^-beta, arms offset from it by a fixed gap plus noise."""
from __future__ import annotations

import numpy as np
import pytest

from mxtrain.study.claims import CLAIMS, claim_lines, claim_pairs, evaluate_claims, judge

D = [1e6, 2e6, 4e6]
BUDGETS = [0.25, 0.5, 1.0]


def _curve(D_):
    return 2.0 + 40.0 * np.asarray(D_) ** -0.3


def _points(offsets: dict[str, float], seeds=3, windows=64, noise=0.002, rng_seed=0) -> dict:
    """Per arm, seed and budget: ``windows`` per-window losses around the curve plus the arm's offset (nats),
    each window with its own fixed difficulty shared by every arm and seed (as real windows are)."""
    rng = np.random.default_rng(rng_seed)
    difficulty = rng.normal(0.0, 0.3, windows)
    seed_shift = rng.normal(0.0, 0.003, seeds)
    out: dict = {}
    for arm, off in offsets.items():
        for s in range(seeds):
            for b, d in zip(BUDGETS, D):
                losses = _curve(d) + off + seed_shift[s] + difficulty + rng.normal(0.0, noise, windows)
                out.setdefault(arm, {}).setdefault(s, {})[b] = {"state": "done", "tokens": d,
                                                                 "losses": losses.tolist(), "path": ""}
    return out


def _by_key(claims):
    return {(c["claim"], c["arm"], c["other"]): c for c in claims}


def test_directional_claims_follow_the_sign_of_the_gap():
    # AMD's ladder: all three better than Fprop+Dgrad (the Wgrad step contradicted), fprop-only worse than bwd
    # (Quartet supported), SR equal to RTN (not resolved)
    pts = _points({"mxfp4-fprop": 0.20, "mxfp4-fprop-dgrad": 0.05, "mxfp4-all": 0.02, "mxfp4-bwd": 0.0,
                   "mxfp4-bwd-sr": 0.0, "bf16": 0.0})
    got = _by_key(evaluate_claims(pts, list(pts), BUDGETS, n_boot=50))
    assert got[("amd-wgrad", "mxfp4-all", "mxfp4-fprop-dgrad")]["verdict"] == "contradicted"
    assert got[("quartet-forward", "mxfp4-fprop", "mxfp4-bwd")]["verdict"] == "supported"
    rtn = got[("quartet-rtn", "mxfp4-bwd-sr", "mxfp4-bwd")]
    assert rtn["verdict"] == "not resolved"
    lo, hi = rtn["budgets"][-1]["gap_ci95"]
    assert lo < 0 < hi
    # the gap of fprop against bwd at every budget is the offset put in (windows and seeds shared)
    fw = got[("quartet-forward", "mxfp4-fprop", "mxfp4-bwd")]
    assert [r["gap"] for r in fw["budgets"]] == pytest.approx([0.20] * 3, abs=0.003)
    assert len(got) == 3     # no other claim has both its arms here
    # Holm over the three: every claim carries the family size and an adjusted p at least its own
    assert all(c["family"] == 3 and c["p_holm"] >= c["p"] for c in got.values())
    # each seed's gap is kept: their mean is the gap
    assert np.mean(fw["budgets"][-1]["gap_seeds"]) == pytest.approx(fw["budgets"][-1]["gap"])


def test_rescue_and_equal_claims():
    # SR no better than plain (consistent), RHT16 better (contradicts "does not rescue"), DH16 better (supported),
    # fp8 on top of bf16 (near-lossless supported), tseng far off (contradicted)
    pts = _points({"bf16": 0.0, "fp8": 0.0, "tseng": 0.15, "mxfp4-all": 0.15, "mxfp4-all-sr": 0.16,
                   "mxfp4-all-rht16": 0.10, "mxfp4-all-dh16": 0.05})
    got = _by_key(evaluate_claims(pts, list(pts), BUDGETS, n_boot=50))
    assert got[("amd-sr", "mxfp4-all-sr", "mxfp4-all")]["verdict"] == "consistent"
    assert got[("amd-rht", "mxfp4-all-rht16", "mxfp4-all")]["verdict"] == "contradicted"
    assert got[("amd-dh16", "mxfp4-all-dh16", "mxfp4-all")]["verdict"] == "supported"
    assert got[("amd-dh16-rht", "mxfp4-all-dh16", "mxfp4-all-rht16")]["verdict"] == "supported"
    fp8 = got[("amd-fp8", "fp8", "bf16")]
    assert fp8["verdict"] == "supported" and abs(fp8["budgets"][-1]["extra"]) < 0.05
    assert "TOST" in fp8["why"]
    ts = got[("tseng", "tseng", "bf16")]
    assert ts["verdict"] == "contradicted" and ts["budgets"][-1]["ci95"][0] > 0.05
    # an arm 0.15 nats above the curve at 4e6 tokens needs D_equiv with L(D_equiv) = L(4e6) + 0.15 (fit exact)
    de = (40.0 / (_curve(4e6) + 0.15 - 2.0)) ** (1 / 0.3)
    assert ts["budgets"][-1]["extra"] == pytest.approx(4e6 / de - 1, rel=0.05)
    lines = claim_lines(list(got.values()))
    assert any(ln.startswith('AMD, "a random Hadamard') and "CONTRADICTED" in ln for ln in lines)


def test_one_or_two_seeds_give_no_verdict_and_missing_runs_no_result():
    pts = _points({"mxfp4-all": 0.1, "mxfp4-all-sr": 0.3}, seeds=1)
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=20)
    assert c["verdict"] == "no verdict" and c["n_seeds"] == 1
    # two seeds: a t interval with 1 degree of freedom; a gap of 0.2 nats is reported, not judged
    pts = _points({"mxfp4-all": 0.1, "mxfp4-all-sr": 0.3}, seeds=2)
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=20)
    assert c["verdict"] == "no verdict" and "below the 3 a verdict needs" in c["why"] and c["p_holm"] is None
    assert c["budgets"][-1]["gap"] == pytest.approx(0.2, abs=0.003)
    pts = _points({"mxfp4-all": 0.1, "mxfp4-all-sr": 0.3})
    pts["mxfp4-all-sr"][0][1.0]["state"] = "diverged"
    pts["mxfp4-all-sr"][1][1.0]["state"] = "diverged"
    pts["mxfp4-all-sr"][2][1.0]["state"] = "diverged"
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=20)
    assert c["verdict"] == "no result"


def test_judge_rules_and_pairs():
    row = {"gap": 0.015, "gap_p": 0.01, "extra": 0.02, "se": 0.005}
    assert judge("more", row, 3)[0] == "supported" and judge("less", row, 3)[0] == "contradicted"
    assert judge("not_less", row, 3)[0] == "consistent"
    # the same row after Holm's correction lifted its p above 0.05: nothing resolved
    assert judge("more", row, 3, p_adj=0.06)[0] == "not resolved"
    assert judge("not_less", {"gap": -0.1, "gap_p": 0.001}, 3)[0] == "contradicted"
    # near-lossless: TOST against +-5 % with the jackknife s.e., df = seeds - 1
    assert judge("equal", {"extra": 0.0, "se": 0.005}, 3)[0] == "supported"
    assert judge("equal", {"extra": 0.10, "se": 0.005}, 3)[0] == "contradicted"
    # an interval that holds 0 but reaches past the margin is not equivalence
    assert judge("equal", {"extra": 0.0, "se": 0.03}, 3)[0] == "not resolved"
    assert judge("more", row, 3, small="0.6 M parameters")[0] == "no verdict"
    with pytest.raises(ValueError):
        judge("bigger", row, 3)
    amd = next(c for c in CLAIMS if c.key == "amd-dh16")
    assert claim_pairs(amd, ["mxfp4-all+amd", "mxfp4-all-dh16+amd", "bf16"]) == [("mxfp4-all-dh16+amd", "mxfp4-all+amd")]
    fp8 = next(c for c in CLAIMS if c.key == "amd-fp8")
    assert claim_pairs(fp8, ["bf16", "fp8"]) == [("fp8", "bf16")]
    quartet = next(c for c in CLAIMS if c.key == "quartet-rtn")
    assert claim_pairs(quartet, ["mxfp4-bwd+amd", "mxfp4-bwd-sr+amd"]) == []


def test_study_command_prints_the_claims(tmp_path, monkeypatch, capsys):
    """``mxtrain study`` ends with the claim lines of the summary (as with the cooled-down verdict)."""
    import json

    from mxtrain.cli.core import main
    from mxtrain.cli import study as runner

    def fake_run_study(spec, jobs=1, start_by=None, only_seeds=None):
        out = tmp_path / "s"
        out.mkdir(exist_ok=True)
        (out / "summary.json").write_text(json.dumps({
            "arms": {}, "planned_runs": 0, "missing": [],
            "cooldown": {"verdict": ["mxfp4-all-sr: +2.0 % tokens"],
                         "claim_lines": ['AMD, "stochastic rounding does not rescue MXFP4": CONSISTENT (x)']}}))
        return out
    monkeypatch.setattr(runner, "run_study", fake_run_study)
    assert main(["study", "--arms", "mxfp4-all,mxfp4-all-sr", "--steps", "40", "--budgets", "0.5,1",
                 "--out", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "cooled down: mxfp4-all-sr: +2.0 % tokens" in out
    assert 'claim: AMD, "stochastic rounding does not rescue MXFP4": CONSISTENT' in out


def test_nvidia_claims():
    # NVFP4 on top of FP8 (close: supported), MXFP4 well above NVFP4 (more tokens: supported); and the
    # other way round: NVFP4 far above FP8 (contradicted), MXFP4 below NVFP4 (contradicted)
    pts = _points({"bf16": 0.0, "fp8": 0.0, "nvfp4": 0.0, "mxfp4-all": 0.12})
    got = _by_key(evaluate_claims(pts, list(pts), BUDGETS, n_boot=50))
    assert got[("nvidia-fp8", "nvfp4", "fp8")]["verdict"] == "supported"
    assert got[("nvidia-mxfp4", "mxfp4-all", "nvfp4")]["verdict"] == "supported"
    pts = _points({"fp8": 0.0, "nvfp4": 0.12, "mxfp4-all": 0.02})
    got = _by_key(evaluate_claims(pts, list(pts), BUDGETS, n_boot=50))
    assert got[("nvidia-fp8", "nvfp4", "fp8")]["verdict"] == "contradicted"
    assert got[("nvidia-mxfp4", "mxfp4-all", "nvfp4")]["verdict"] == "contradicted"
    # NVIDIA's claims have no +amd variants
    c = next(c for c in CLAIMS if c.key == "nvidia-mxfp4")
    assert claim_pairs(c, ["mxfp4-all+amd", "nvfp4+amd", "nvfp4"]) == []


def test_claims_on_arms_with_the_same_further_options():
    """A claim is judged again on arms that carry the same further options on both sides (the claim at another
    learning rate), in any option order, and not across different options."""
    sr = next(c for c in CLAIMS if c.key == "amd-sr")
    arms = ["mxfp4-all", "mxfp4-all-sr", "mxfp4-all@lr1.5e-3", "mxfp4-all-sr@lr1.5e-3", "mxfp4-all-sr@lr7e-4",
            "mxfp4-all+amd@lr1.5e-3", "mxfp4-all-sr+amd@lr1.5e-3"]
    assert claim_pairs(sr, arms) == [("mxfp4-all-sr", "mxfp4-all"),
                                      ("mxfp4-all-sr@lr1.5e-3", "mxfp4-all@lr1.5e-3"),
                                      ("mxfp4-all-sr+amd@lr1.5e-3", "mxfp4-all+amd@lr1.5e-3")]
    alto = next(c for c in CLAIMS if c.key == "alto")
    assert claim_pairs(alto, ["mxfp4-all@lr1e-3", "mxfp4-all@lr1e-3@deosc", "mxfp4-all@deosc"]) == [
        ("mxfp4-all@lr1e-3@deosc", "mxfp4-all@lr1e-3")]
    assert claim_pairs(alto, ["mxfp4-all@lr1e-3", "mxfp4-all@deosc@lr1e-3"]) == [
        ("mxfp4-all@deosc@lr1e-3", "mxfp4-all@lr1e-3")]
    fp8 = next(c for c in CLAIMS if c.key == "amd-fp8")
    assert claim_pairs(fp8, ["bf16@lr1e-3", "fp8@lr1e-3", "fp8"]) == [("fp8@lr1e-3", "bf16@lr1e-3")]
    # judged from the points like any other pair
    pts = _points({"bf16@lr1e-3": 0.0, "fp8@lr1e-3": 0.0})
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=50)
    assert (c["claim"], c["arm"], c["other"], c["verdict"]) == ("amd-fp8", "fp8@lr1e-3", "bf16@lr1e-3", "supported")


def test_a_smoke_scale_study_reports_numbers_without_verdicts():
    """A toy run never issues a verdict on a paper: 0.6 M parameters (the CPU smoke study's model), however clear
    its numbers; and neither does a run shorter than the token floor. The numbers stay in the lines."""
    pts = _points({"mxfp4-all": 0.20, "mxfp4-all-dh16": 0.02})
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=20, scale={"params": 0.6e6, "tokens": 4e6})
    assert c["verdict"] == "no verdict" and "0.6 M parameters, below the 10 M" in c["why"]
    (line,) = claim_lines([c])
    assert "NO VERDICT" in line and "gap -0.18" in line and "seeds -0.18" in line and "SUPPORTED" not in line
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=20, scale={"params": 30e6, "tokens": 4e6})
    assert c["verdict"] == "no verdict" and "4 M tokens" in c["why"]
    (c,) = evaluate_claims(pts, list(pts), BUDGETS, n_boot=20, scale={"params": 30e6, "tokens": 6e7})
    assert c["verdict"] == "supported"


def test_holm_decides_across_the_claims_of_one_report():
    """Three claims' p-values adjusted together: a claim that passes alone can fail in the family."""
    from mxtrain.study.stats import holm
    # hand-computed: sorted 0.01 (x3 = 0.03), 0.02 (x2 = 0.04), 0.04 (x1 = 0.04)
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    # sorted 0.001 x4 = 0.004, 0.02 x3 = 0.06, 0.03 x2 = 0.06, 0.5 x1
    assert holm([0.03, 0.001, 0.5, 0.02]) == pytest.approx([0.06, 0.004, 0.5, 0.06])
    # the running maximum keeps the order: 0.01 x3 = 0.03, then 0.011 x2 = 0.022 is raised to 0.03
    assert holm([0.011, 0.01, 0.04]) == pytest.approx([0.03, 0.03, 0.04])
    assert holm([None, 0.2]) == [None, 0.2]


def test_claims_of_2026_recipes_and_their_preset():
    """Issue #51's published claims (UFP4 against plain and against the same random rotation, Four over Six on
    NVFP4, round-up scales) are judged on the ``recipes-2026`` preset's arms, Holm over every claim of the report:
    a uniform grid clearly better, 4/6 as good as NVFP4 (not resolved, never "contradicted" by a null), round-up
    scales worse (contradicted)."""
    from mxtrain.study.plan import PRESETS, StudySpec
    arms = PRESETS["recipes-2026"]["arms"]
    StudySpec(out="unused", **{k: v for k, v in PRESETS["recipes-2026"].items()})   # a valid study
    keys = {c.key: claim_pairs(c, arms) for c in CLAIMS}
    assert keys["ufp4"] == [("ufp4", "mxfp4-all")] and keys["ufp4-grid"] == [("ufp4", "mxfp4-all-rht16")]
    assert keys["4over6"] == [("nvfp4-4over6", "nvfp4")] and keys["rceil"] == [("mxfp4-all+rceil", "mxfp4-all")]
    assert sum(len(v) for v in keys.values()) == 8          # the 8 tests docs/results.md pre-registers
    pts = _points({"mxfp4-all": 0.10, "mxfp4-all-rht16": 0.10, "ufp4": 0.04, "nvfp4": 0.05, "nvfp4-4over6": 0.05,
                   "mxfp4-all+rceil": 0.13, "bf16": 0.0})
    got = _by_key(evaluate_claims(pts, list(pts), BUDGETS, n_boot=50))
    assert got[("ufp4", "ufp4", "mxfp4-all")]["verdict"] == "supported"
    assert got[("ufp4-grid", "ufp4", "mxfp4-all-rht16")]["verdict"] == "supported"
    assert got[("4over6", "nvfp4-4over6", "nvfp4")]["verdict"] == "not resolved"
    assert got[("rceil", "mxfp4-all+rceil", "mxfp4-all")]["verdict"] == "contradicted"
    assert {c["family"] for c in got.values()} == {len(got)}   # one Holm family: every claim of the report
