"""The cooled-down extra-token metric (mxtrain.study.cooldown) on synthetic curves with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from mxtrain.study import cooldown as C

E, B, BETA = 2.0, 40.0, 0.35
D = np.array([2.5e6, 5e6, 7.5e6, 1e7])


def curve(d):
    return E + B * np.asarray(d, dtype=float) ** (-BETA)


def windows(L, W=32, sd=0.3, seed=0):
    """(K, W) window losses with mean exactly L per budget: the same zero-mean window offsets (text difficulty)
    at every budget, as in a real validation set."""
    off = np.random.default_rng(seed).normal(0, sd, W)
    off -= off.mean()
    return np.asarray(L)[:, None] + off[None, :]


def test_fit_recovers_parameters():
    f = C.fit_power_law(D, curve(D))
    assert f["E"] == pytest.approx(E, abs=1e-6) and f["beta"] == pytest.approx(BETA, rel=1e-5)
    assert f["B"] == pytest.approx(B, rel=1e-4)
    assert np.allclose(C.power_law(f, D), curve(D), atol=1e-9)
    assert C.fit_power_law(D[:2], curve(D[:2])) is None                     # 3 parameters need 3 budgets
    assert C.fit_power_law(D, curve(D)[::-1]) is None                      # a rising curve has no fit


@pytest.mark.parametrize("c", [1.0, 1.25, 1.6, 0.8])
def test_stretched_curve_gives_c_minus_1_at_every_budget(c):
    """An arm whose curve is the baseline's stretched along the token axis by c (L_arm(D) = L_base(D / c))
    needs c times the tokens: extra tokens c - 1 at every budget, and the seed-level interval agrees."""
    base = np.stack([windows(curve(D))] * 3)
    arm = np.stack([windows(curve(D / c))] * 3)
    r = C.paired_extra_tokens(D, arm, base, n_boot=100)
    for row in r["budgets"]:
        assert row["state"] == "ok" and row["extra"] == pytest.approx(c - 1, abs=1e-4)
        # identical seeds: every leave-one-seed-out refit is the same curve, so the interval has no width
        assert row["ci95"][0] == pytest.approx(c - 1, abs=1e-3) and row["ci95"][1] == pytest.approx(c - 1, abs=1e-3)


def test_constant_offset_gives_analytic_equivalent_tokens():
    """L_arm = L_base + delta: D_equiv = (B / (B D^-beta + delta))^(1/beta), so extra tokens
    (1 + delta D^beta / B)^(1/beta) - 1."""
    delta = 0.01
    f = C.fit_power_law(D, curve(D))
    for d in D:
        de = C.equivalent_tokens(float(curve(d) + delta), f)
        assert de == pytest.approx((B / (B * d ** -BETA + delta)) ** (1 / BETA), rel=1e-4)
        assert C.extra_tokens(d, float(curve(d) + delta), f) == pytest.approx(
            (1 + delta * d ** BETA / B) ** (1 / BETA) - 1, rel=1e-3)
    assert C.extra_tokens(D[-1], E - 0.01, f) is None                       # below the floor: no equivalent
    base = np.stack([windows(curve(D))] * 2)
    below = np.stack([windows(np.full(len(D), E - 0.05))] * 2)            # better than the baseline's floor
    r = C.paired_extra_tokens(D, below, base, n_boot=20)
    assert all(row["state"] == "below_floor" and row["extra"] is None for row in r["budgets"])


def _noisy(seeds, W, rng, sd=0.05):
    return np.stack([curve(D)[:, None] + rng.normal(0, sd, (len(D), W)) for _ in range(seeds)])


def test_identical_arms_ci_contains_zero_and_window_noise_shrinks_with_windows():
    widths = []
    for W in (16, 400):
        rng = np.random.default_rng(1)
        base, arm = _noisy(3, W, rng), _noisy(3, W, rng)
        r = C.paired_extra_tokens(D, arm, base, n_boot=300, seed=2)
        for row in r["budgets"]:
            # 3 seeds, 2 degrees of freedom: t_0.975 + t_0.80 = 4.303 + 1.061
            assert row["mde"] == pytest.approx(5.3633 * row["se"], rel=1e-4)
        lo, hi = r["budgets"][-1]["ci95"]      # (at every budget a 95 % interval misses 0 one time in 20)
        assert lo < 0 < hi, (W, r["budgets"][-1])
        widths.append(np.mean([row["eval_se"] for row in r["budgets"]]))
    # the evaluation-window part of the uncertainty: 25x the windows, about 5x smaller (the seed-level interval
    # of 3 seeds is too noisy a width to compare two draws by)
    assert widths[1] < widths[0] / 3.5


def test_summarize_and_verdict_from_points():
    budgets = [0.25, 0.5, 0.75, 1.0]

    def pts(L, state="done"):
        w = windows(L, W=8)
        return {s: {b: {"state": state, "tokens": float(d), "losses": list(w[j]), "path": ""}
                    for j, (b, d) in enumerate(zip(budgets, D))} for s in (0, 1, 2)}
    points = {"bf16": pts(curve(D)), "mx": pts(curve(D / 1.3)), "same": pts(curve(D)), "bad": pts(curve(D), "diverged")}
    # a seed-to-seed difference in the arm's gap, so that the t test has a spread to work with
    for s, dl in ((0, 0.001), (1, -0.001), (2, 0.0)):
        for b in budgets:
            points["mx"][s][b]["losses"] = [x + dl for x in points["mx"][s][b]["losses"]]
    cool = C.summarize_cooldown(points, "bf16", budgets, n_boot=50)
    assert cool["arms"]["mx"]["budgets"][-1]["extra"] == pytest.approx(0.3, abs=1e-3)
    assert cool["arms"]["bad"]["state"] == "diverged" and cool["fit"]["beta"] == pytest.approx(BETA, rel=1e-4)
    lines = C.verdict_lines(cool)
    assert any(ln.startswith("mx: +30.0 % tokens at 100 % budget") and "resolved worse" in ln
               and "Holm-adjusted" in ln for ln in lines)
    assert any(ln.startswith("same: +0.0 % tokens") for ln in lines) and not any(ln.startswith("bf16") for ln in lines)
    assert any(ln.startswith("bad: diverged") for ln in lines)


# -- the Huber fit (Hoffmann et al. 2022: Huber loss on log L, delta 1e-3) ---------------------------------------

D6 = np.array([1e6, 2e6, 4e6, 8e6, 1.6e7, 3.2e7])


def test_huber_fit_recovers_clean_parameters():
    f = C.fit_power_law(D6, curve(D6), "huber")
    assert f["loss"] == "huber" and f["delta"] == C.HUBER_DELTA
    assert f["E"] == pytest.approx(E, abs=1e-5) and f["beta"] == pytest.approx(BETA, rel=1e-4)
    assert np.allclose(C.power_law(f, D6), curve(D6), atol=1e-6)
    # its objective is the Huber loss of the log residuals, recomputed here independently
    r = np.log(C.power_law(f, D6)) - np.log(curve(D6))
    assert f["objective"] == pytest.approx(float(np.sum(0.5 * r * r)), abs=1e-12)
    assert C.fit_power_law(D6[:2], curve(D6[:2]), "huber") is None
    with pytest.raises(ValueError, match="fit must be"):
        C.fit_power_law(D6, curve(D6), "l1")


def test_one_outlier_pulls_least_squares_but_not_huber():
    """Six cooled-down points on the curve, one of them 0.05 nats high (a branch hit by a loss spike): least
    squares bends the whole curve towards it; the Huber fit stays on the five good points."""
    L = curve(D6)
    bad = L.copy()
    bad[2] += 0.05
    good = np.arange(len(D6)) != 2
    ls, hu = C.fit_power_law(D6, bad, "lsq"), C.fit_power_law(D6, bad, "huber")
    err_ls = np.abs(C.power_law(ls, D6) - L)[good].max()
    err_hu = np.abs(C.power_law(hu, D6) - L)[good].max()
    assert err_ls > 0.008 and err_hu < 0.003 and err_hu < err_ls / 4
    assert abs(hu["E"] - E) < abs(ls["E"] - E) / 4 and abs(hu["beta"] - BETA) < abs(ls["beta"] - BETA) / 4
    # and the metric built on it: an arm exactly on the true curve at the largest budget reads as about 0
    assert abs(C.extra_tokens(D6[-1], L[-1], hu)) < abs(C.extra_tokens(D6[-1], L[-1], ls)) / 4
    # the outlier's own residual stays large under Huber: it is not fitted
    assert abs(C.power_law(hu, D6[2:3])[0] - bad[2]) > 0.04


def test_summarize_with_huber_fit():
    budgets = [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0]
    L = curve(D6)
    bad = L.copy()
    bad[2] += 0.05

    def pts(Ls):
        w = windows(Ls, W=8)
        return {s: {b: {"state": "done", "tokens": float(d), "losses": list(w[j]), "path": ""}
                    for j, (b, d) in enumerate(zip(budgets, D6))} for s in (0, 1)}
    points = {"bf16": pts(bad), "same": pts(L)}
    hu = C.summarize_cooldown(points, "bf16", budgets, n_boot=20, fit="huber")
    ls = C.summarize_cooldown(points, "bf16", budgets, n_boot=20, fit="lsq")
    assert hu["fit_loss"] == "huber" and "Huber" in hu["method"] and hu["fit"]["loss"] == "huber"
    e_hu, e_ls = hu["arms"]["same"]["budgets"][-1]["extra"], ls["arms"]["same"]["budgets"][-1]["extra"]
    assert abs(e_ls) > 0.05 and abs(e_hu) < abs(e_ls) / 4      # about +12 % under least squares, +1 % under Huber


# -- a loss floor below zero is no cross-entropy's; a single seed gives no verdict ------------------------------

def test_fit_keeps_the_floor_at_or_above_zero():
    """Losses still falling fast over short runs (log-linear in D, no bend toward a floor) pull a free fit to a
    negative E (a study on an H100 got E = -61). The fit keeps E >= 0, says so, and is then the best pure power
    law: no E = 0 curve on a dense beta grid (B by its own closed form) fits better."""
    d = np.array([8e5, 1.6e6, 2.4e6, 3.3e6])
    L = 9.6 - 0.2 * np.log(d)                      # 6.88 ... 6.60: falling, no curvature toward a floor
    for kind in C.FITS:
        f = C.fit_power_law(d, L, fit=kind)
        assert f is not None and f["E"] >= 0.0 and f["B"] > 0 and f["beta"] > 0
        assert f["floor_at_zero"] is (f["E"] == 0.0)
    f = C.fit_power_law(d, L)
    assert f["floor_at_zero"]
    best = min(float((((L * d ** -b).sum() / (d ** (-2 * b)).sum()) * d ** -b - L) @
                     (((L * d ** -b).sum() / (d ** (-2 * b)).sum()) * d ** -b - L))
               for b in np.geomspace(1e-3, 4, 20000))
    assert f["sse"] <= best * (1 + 1e-6) + 1e-15
    # a curve with a real floor keeps it (the constraint is inactive)
    g = C.fit_power_law(D, curve(D))
    assert not g["floor_at_zero"] and g["E"] == pytest.approx(E, abs=1e-6)
    cool = {"baseline": "bf16", "fit": f, "arms": {}}
    assert any("fitted loss floor E is at its bound 0" in ln for ln in C.verdict_lines(cool))


def test_one_seed_gives_no_verdict():
    """Resampling the evaluation windows of one seed measures evaluation noise, not seed-to-seed noise: the
    verdict names the estimate and interval but calls nothing significant."""
    budgets = [0.25, 0.5, 0.75, 1.0]

    def pts(L, seeds):
        w = windows(L, W=64, sd=0.05)
        return {s: {b: {"state": "done", "tokens": float(dd), "losses": list(w[j]), "path": ""}
                    for j, (b, dd) in enumerate(zip(budgets, D))} for s in seeds}
    points = {"bf16": pts(curve(D), (0, 1)), "mx": pts(curve(D / 1.3), (0,))}
    cool = C.summarize_cooldown(points, "bf16", budgets, n_boot=50)
    (line,) = [ln for ln in C.verdict_lines(cool) if ln.startswith("mx:")]
    assert "no verdict: 1 seed" in line and "significant" not in line


def test_cooldown_figure_without_any_extra_token_estimate():
    """Two budgets give no baseline fit, so no arm has an extra-token estimate: the figure says why instead of
    failing on an empty log axis (it did, on an H100 run)."""
    pytest.importorskip("matplotlib")
    from mxtrain.study import report as R
    rows = [{"budget": b, "tokens": t, "loss": l, "extra": None, "ci95": None} for b, t, l in
            [(0.5, 1e6, 7.4), (1.0, 2e6, 7.0)]]
    cool = {"baseline": "bf16", "fit": None, "arms": {"bf16": {"budgets": rows, "n_seeds": 2},
                                                      "mx": {"budgets": rows, "n_seeds": 2}}}
    png = R._cooldown_plot(cool, {"bf16": "C0", "mx": "C1"})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_gaps_per_budget_keep_seeds_that_finished_some_budgets():
    """A seed that finished only some budgets (a lease ended mid-way) drops out of the bootstrap, which needs
    every budget, but its finished budgets still give paired gaps: each the mean window difference to the
    baseline's same seed; the report shows them only when they add seeds."""
    from mxtrain.study.report import budget_gap_rows
    budgets = [0.5, 1.0]

    def pts(offset, missing=()):
        out = {}
        for s in (0, 1):
            out[s] = {}
            for j, b in enumerate(budgets):
                done = (s, b) not in missing
                out[s][b] = {"state": "done" if done else "failed", "tokens": 1e6 * (j + 1), "path": "",
                             "losses": [4.0 - j + offset + 0.01 * s + 0.001 * w for w in range(4)] if done else None}
        return out
    points = {"bf16": pts(0.0), "mx": pts(0.1, missing={(1, 1.0)})}
    cool = C.summarize_cooldown(points, "bf16", budgets, n_boot=20)
    assert cool["arms"]["mx"]["seeds"] == [0]
    rows = cool["by_budget"]["mx"]
    assert [r["n_seeds"] for r in rows] == [2, 1]
    assert rows[0]["gaps"] == {0: pytest.approx(0.1), 1: pytest.approx(0.1)} and rows[1]["gaps"] == {0: pytest.approx(0.1)}
    table = budget_gap_rows(cool)
    assert table[0][0] == "arm" and table[1][0] == "mx" and "0: +0.1000, 1: +0.1000" in table[1][1]
    # every seed complete: nothing to add
    full = C.summarize_cooldown({"bf16": pts(0.0), "mx": pts(0.1)}, "bf16", budgets, n_boot=20)
    assert budget_gap_rows(full) is None


# -- seed-level intervals (issue #46): coverage at 3 seeds, refusals, equivalence, extrapolation -----------------

D3 = np.array([2.5e6, 5e6, 1e7])


def _null_study(rng, S=3, W=16, seed_sd=0.01, win_sd=0.001):
    """One simulated study of an arm with no effect: every seed draws its own level for the baseline and, on top,
    an arm-by-seed deviation (sd ``seed_sd``, ten times the window noise), the same windows' difficulty for all."""
    diff = rng.normal(0, 0.3, W)
    base, arm = np.empty((S, 3, W)), np.empty((S, 3, W))
    for s in range(S):
        sb = rng.normal(0, seed_sd)
        sa = sb + rng.normal(0, seed_sd)
        base[s] = curve(D3)[:, None] + sb + diff + rng.normal(0, win_sd, (3, W))
        arm[s] = curve(D3)[:, None] + sa + diff + rng.normal(0, win_sd, (3, W))
    return arm, base


def test_seed_level_intervals_cover_a_null_effect_at_three_seeds():
    """400 simulated 3-seed studies of a true null: the 95 % intervals (extra tokens and loss gap) cover 0 at least
    90 % of the time and at most 10 % call the effect resolved. The percentile bootstrap over seeds and windows
    that came before covered it about 74 % of the time here (too narrow at 3 seeds)."""
    rng = np.random.default_rng(46)
    n, cover, gcover, resolved = 400, 0, 0, 0
    for _ in range(n):
        arm, base = _null_study(rng)
        row = C.paired_extra_tokens(D3, arm, base, n_boot=0)["budgets"][-1]
        lo, hi = row["ci95"]
        cover += lo <= 0 <= hi
        glo, ghi = row["gap_ci95"]
        gcover += glo <= 0 <= ghi
        resolved += row["gap_p"] < 0.05
    assert cover / n >= 0.90 and gcover / n >= 0.90 and resolved / n <= 0.10, (cover, gcover, resolved)


def test_student_t_and_equivalence_test_on_known_values():
    from mxtrain.study import stats as T
    # tables: t_0.975 at 2 and 4 degrees of freedom; t_0.80 at 2 (sqrt(9/8)); P(T <= 2) at 6 (numerical integral)
    assert T.t_ppf(0.975, 2) == pytest.approx(4.3027, abs=1e-4) and T.t_ppf(0.975, 4) == pytest.approx(2.7764, abs=1e-4)
    assert T.t_ppf(0.80, 2) == pytest.approx(1.0607, abs=1e-4) and T.t_cdf(2.0, 6) == pytest.approx(0.953787, abs=1e-6)
    assert T.t_cdf(-1.0, 1) == pytest.approx(0.25)
    # paired t over 3 gaps: mean 0.02, sd 0.01, se 0.01/sqrt(3), interval mean +- 4.303 se
    r = T.paired_t([0.01, 0.02, 0.03])
    se = 0.01 / np.sqrt(3)
    assert r["se"] == pytest.approx(se) and r["ci"] == pytest.approx([0.02 - 4.3027 * se, 0.02 + 4.3027 * se], abs=1e-6)
    assert r["p"] == pytest.approx(2 * (1 - T.t_cdf(0.02 / se, 2)))
    # the jackknife of a mean is the paired t interval
    loo = [np.mean([0.02, 0.03]), np.mean([0.01, 0.03]), np.mean([0.01, 0.02])]
    assert T.jackknife_t(0.02, loo)["se"] == pytest.approx(se)
    # TOST at margin 0.05, df 2: estimate 0.01, se 0.01: max(P(T >= 6), P(T <= -4)) = P(T <= -4) = 0.0286
    assert T.tost(0.01, 0.01, 2, 0.05) == pytest.approx(T.t_cdf(-4.0, 2)) and T.tost(0.01, 0.01, 2, 0.05) < 0.05
    assert T.t_cdf(-4.0, 2) == pytest.approx(0.5 - 0.5 * 4 / np.sqrt(18), abs=1e-12)   # closed form at df 2
    # the same estimate with se 0.03: not shown equivalent although its interval holds 0
    assert T.tost(0.01, 0.03, 2, 0.05) > 0.05
    # beyond the margin: estimate 0.12, se 0.01 -> 2 P(T >= 7) at df 2
    assert T.outside(0.12, 0.01, 2, 0.05) == pytest.approx(2 * (1 - T.t_cdf(7.0, 2)))


def _pts(curves: dict, seeds=3, budgets=(0.25, 0.5, 1.0), Ds=D3, jitter=0.002):
    rng = np.random.default_rng(3)
    out = {}
    for arm, L in curves.items():
        for s in range(seeds):
            w = windows(L, W=8, sd=0.05) + rng.normal(0, jitter)
            out.setdefault(arm, {})[s] = {b: {"state": "done", "tokens": float(d), "losses": list(w[j]), "path": ""}
                                          for j, (b, d) in enumerate(zip(budgets, Ds))}
    return out


def test_two_seeds_no_verdict_and_a_smoke_scale_no_verdict():
    cool = C.summarize_cooldown(_pts({"bf16": curve(D3), "mx": curve(D3 / 1.5)}, seeds=2), "bf16",
                                [0.25, 0.5, 1.0], n_boot=0)
    (line,) = [ln for ln in C.verdict_lines(cool) if ln.startswith("mx:")]
    assert "no verdict: 2 seeds, below the 3 a verdict needs" in line and "resolved" not in line
    cool = C.summarize_cooldown(_pts({"bf16": curve(D3), "mx": curve(D3 / 1.5)}), "bf16", [0.25, 0.5, 1.0], n_boot=0)
    lines = C.verdict_lines(cool, scale={"params": 0.6e6, "tokens": 1e7})
    assert any(ln.startswith("no verdict in this report: 0.6 M parameters, below the 10 M a verdict needs")
               for ln in lines)
    (line,) = [ln for ln in lines if ln.startswith("mx:")]
    assert "% tokens at 100 % budget" in line and "no verdict (scale)" in line and "resolved" not in line
    (line,) = [ln for ln in C.verdict_lines(cool, scale={"params": 30e6, "tokens": 1e7}) if ln.startswith("mx:")]
    assert "resolved worse" in line


def test_extrapolation_flag_exact_fit_note_and_amd_metric():
    """An arm better than the baseline at the largest budget has its D_equiv beyond every budget fitted: flagged.
    Three budgets for three parameters: the fit's shape is unchecked, and the report says so. AMD's own-tokens
    metric: the arm's own curve interpolated to the baseline's final loss, or 'beyond the run'."""
    pts = _pts({"bf16": curve(D3), "better": curve(D3 * 1.5), "worse": curve(D3 / 1.5)}, jitter=0.0)
    cool = C.summarize_cooldown(pts, "bf16", [0.25, 0.5, 1.0], n_boot=0)
    b, w = cool["arms"]["better"], cool["arms"]["worse"]
    assert b["budgets"][-1]["extrapolated"] and b["budgets"][-1]["d_equiv"] > D3[-1]
    assert not w["budgets"][-1]["extrapolated"] and w["budgets"][-1]["extra"] == pytest.approx(0.5, abs=1e-3)
    assert b["fit_exact"] and b["fit_budgets"] == 3
    lines = C.verdict_lines(cool)
    assert any("3 parameters and 3 budgets" in ln for ln in lines)
    assert any(ln.startswith("better:") and "extrapolated" in ln for ln in lines)
    # the worse arm never reaches the baseline's final loss within the run; the better one does before 1e7 tokens
    assert w["own_tokens"]["state"] == "beyond_run" and w["own_tokens"]["extra"] is None
    own = b["own_tokens"]
    assert own["state"] == "ok" and -1 / 3 - 0.05 < own["extra"] < 0
    # by hand: linear in log D between the arm's points at 5e6 and 1e7
    la, lb = curve(5e6 * 1.5), curve(1e7 * 1.5)
    t = np.exp(np.log(5e6) + np.log(2) * (la - curve(1e7)) / (la - lb))
    assert own["tokens"] == pytest.approx(t, rel=1e-6)
    # four budgets: no such note
    D4 = np.array([1.25e6, 2.5e6, 5e6, 1e7])
    pts4 = _pts({"bf16": curve(D4), "worse": curve(D4 / 1.5)}, budgets=(0.125, 0.25, 0.5, 1.0), Ds=D4)
    cool4 = C.summarize_cooldown(pts4, "bf16", [0.125, 0.25, 0.5, 1.0], n_boot=0)
    assert not any("3 parameters and 3 budgets" in ln for ln in C.verdict_lines(cool4))
