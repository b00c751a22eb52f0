"""Extra tokens from cooled-down losses at several budgets, with seed-level paired intervals.

A cooldown study (``mxtrain study --budgets 0.25,0.5,0.75,1 --cooldown 0.2``; docs/study.md) gives, for
every arm, seed and budget ``D`` (tokens), the validation loss of every evaluation window after a cooldown
branch that ends at ``D``. This module turns them into the extra-token cost:

1. **Fit** the baseline's cooled-down points ``L(D) = E + B * D^(-beta)`` (``fit_power_law``), by one of
   two losses (``fit``):

   * ``lsq`` (default): least squares on ``L``; for a fixed ``beta`` the model is linear in ``(E, B)`` and has
     a closed form, so the fit is a 1-D search over ``beta`` (a log-spaced grid over [0.01, 4], then a
     golden-section refinement around the best grid point).
   * ``huber``: the Huber loss (``delta`` 1e-3) of the log residuals ``log(E + B D^-beta) - log L``, as
     Hoffmann et al. 2022 (Chinchilla, approach 3) fit their scaling law: quadratic for residuals below
     ``delta``, linear beyond, so one bad point (a branch hit by a loss spike) pulls the curve far less than
     under least squares. For a fixed ``beta``, ``(E, B)`` come from iteratively reweighted Gauss-Newton steps
     started at the least-squares solution; the same 1-D search over ``beta`` follows.

   ``D`` is scaled by the largest budget inside the fit (numerics only). At least 3 budgets are needed (3
   parameters); with exactly 3 the curve goes through the points, so its shape is never checked
   (``fit_exact``: the reports say so).
2. **Invert** an arm's cooled-down loss ``L`` at budget ``D``: the baseline tokens reaching it,
   ``D_equiv = (B / (L - E))^(1 / beta)``, and the **extra tokens** ``D / D_equiv - 1`` (> 0: the arm needs
   more tokens than the baseline for the same loss). ``L <= E`` (below the baseline's fitted floor) has no
   finite ``D_equiv``: the point estimate's state is ``below_floor`` and a leave-one-out estimate counts it
   as the limit, -1. An arm better than the baseline at the largest budget has ``D_equiv`` beyond every
   budget fitted: the estimate **extrapolates** the fit (``extrapolated``).
3. **Intervals are seed-level.** Seed ``s`` of an arm is paired with seed ``s`` of the baseline (same init
   and data order). The loss gap of seed ``s`` at a budget is the mean over the evaluation windows of the
   arm's loss minus the baseline's (the same windows: the same text). The gap's interval is Student's t over
   these per-seed gaps with ``seeds - 1`` degrees of freedom (``stats.paired_t``). The extra tokens are a
   nonlinear function of the seed means (the baseline is fitted to its seed-mean curve), so their standard
   error comes from the **jackknife over seeds**: the estimate recomputed with each seed left out (the
   baseline refitted each time), ``se = sqrt((n-1)/n sum (theta_i - theta_bar)^2)``, and the interval is
   ``extra +- t_{0.975, n-1} se`` (``stats.jackknife_t``; for a plain mean it is exactly the paired t
   interval). Why not resample: a percentile bootstrap over 3 seeds draws from only 10 distinct seed sets and
   its spread is ``sqrt((n-1)/n)`` of the sample's, with normal rather than t quantiles; simulated at 3
   seeds with seed noise far above window noise it covered a null effect about 75 % of the time (the t and
   jackknife-t intervals: about 95 %; tests/study/test_cooldown_metric.py). Evaluation windows are never resampled
   for the interval: a seed's window mean already carries its window noise into the seed-to-seed spread.
   Each seed's gap is kept (``gap_seeds``), with each seed's extra tokens: the baseline's seed-mean loss
   plus that seed's gap, inverted on the baseline fit (``extra_seeds``).
4. **Detectable effect** (``mde``): ``(t_{0.975, n-1} + t_{0.80, n-1}) * se``, the true effect a two-sided
   t test at alpha 0.05 detects with 80 % power: 5.36 standard errors at 3 seeds, 3.72 at 5, 2.8 for many.
5. **Evaluation noise** (``eval_se``, ``n_boot`` replicates, fixed generator seed): a bootstrap over the
   evaluation windows alone, seeds held fixed: the part of the uncertainty more windows would remove. With
   one seed it is the only interval there is (``eval_ci95``), and no verdict is given.
6. **Verdicts** (``verdict_lines``): an arm's effect is *resolved* when the gap's Holm-adjusted p-value
   (over the report's arms, ``stats.holm``) is below 0.05, with at least ``MIN_SEEDS`` seeds, and only for
   runs at or above ``MIN_VERDICT_PARAMS`` parameters and ``MIN_VERDICT_TOKENS`` tokens at the largest budget
   (``scale``): a smaller run reports its numbers and no verdict.
7. **AMD's metric beside ours** (``own_tokens``): the tokens the arm's own cooled-down curve takes to reach
   the baseline's cooled-down loss at the largest budget, over that budget, minus 1 (AMD's definition
   of its token cost, arXiv 2605.09825), read off the arm's points by linear interpolation in ``log D``;
   when the arm does not reach that loss within the run it is ``beyond_run``, never extrapolated.

Everything works on plain numbers and NumPy arrays, so tests can feed synthetic curves with known answers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from . import stats as T

__all__ = ["fit_power_law", "power_law", "equivalent_tokens", "extra_tokens", "paired_extra_tokens", "own_tokens",
           "load_cooldown_points", "summarize_cooldown", "verdict_lines", "verdict_scale", "FITS", "HUBER_DELTA",
           "MIN_SEEDS", "MIN_VERDICT_PARAMS", "MIN_VERDICT_TOKENS"]

MIN_SEEDS = 3                   # fewer: no verdict (2 seeds give a t interval with 1 degree of freedom)
MIN_VERDICT_PARAMS = 10e6       # a smaller model (the CPU smoke study's 0.6 M) reports numbers, no verdict
MIN_VERDICT_TOKENS = 10e6       # nor a run shorter than this (tokens at the largest budget)
FITS = ("lsq", "huber")
HUBER_DELTA = 1e-3          # Hoffmann et al. 2022: Huber on log L with delta 1e-3
_BETAS = np.geomspace(0.01, 4.0, 400)
_BETAS_HUBER = np.geomspace(0.01, 4.0, 120)   # each grid point costs an iterative (E, B) fit
_HUBER_ITERS = 40


def _linfit(x: np.ndarray, L: np.ndarray):
    """Least squares ``L = E + B x`` for each row of ``x`` (G, K) under ``E >= 0`` and ``B >= 0``: E, B, SSE (each
    (G,)). A loss floor below 0 is no cross-entropy's: where the free fit puts ``E`` below 0 (a curve that has not
    yet bent toward its floor), the constrained optimum lies on ``E = 0``, a pure power law ``L = B x``."""
    xm, Lm = x.mean(axis=-1, keepdims=True), L.mean()
    dx = x - xm
    var = (dx * dx).sum(axis=-1)
    B = np.where(var > 0, (dx * (L - Lm)).sum(axis=-1) / np.where(var > 0, var, 1.0), 0.0)
    B = np.maximum(B, 0.0)
    E = Lm - B * xm[..., 0]
    neg = E < 0
    if neg.any():
        xx = (x * x).sum(axis=-1)
        B0 = np.maximum((x * L).sum(axis=-1) / np.where(xx > 0, xx, 1.0), 0.0)
        E, B = np.where(neg, 0.0, E), np.where(neg, B0, B)
    sse = ((E[..., None] + B[..., None] * x - L) ** 2).sum(axis=-1)
    return E, B, sse


def _huber(r: np.ndarray, delta: float) -> np.ndarray:
    """The Huber loss of residuals ``r``: ``r^2 / 2`` for ``|r| <= delta``, else ``delta (|r| - delta / 2)``."""
    a = np.abs(r)
    return np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))


def _huberfit(x: np.ndarray, L: np.ndarray, delta: float):
    """For each row of ``x`` (G, K): ``(E, B)`` minimizing ``sum huber(log(E + B x) - log L)`` with ``B >= 0``, by
    iteratively reweighted Gauss-Newton steps from the least-squares solution. Returns E, B, objective (G,)."""
    E, B, _ = _linfit(x, L)
    logL = np.log(L)

    def objective(E, B):
        p = E[:, None] + B[:, None] * x
        bad = (p <= 0).any(axis=-1)
        r = np.log(np.where(p > 0, p, 1.0)) - logL
        return np.where(bad, np.inf, _huber(r, delta).sum(axis=-1)), r, p

    obj, r, p = objective(E, B)
    active = np.isfinite(obj)
    for _ in range(_HUBER_ITERS):
        w = np.where(np.abs(r) <= delta, 1.0, delta / np.maximum(np.abs(r), 1e-300))
        a, b = 1.0 / p, x / p                    # d r / d E, d r / d B
        saa, sab, sbb = (w * a * a).sum(-1), (w * a * b).sum(-1), (w * b * b).sum(-1)
        sar, sbr = (w * a * r).sum(-1), (w * b * r).sum(-1)
        det = saa * sbb - sab * sab
        ok = active & (det > 1e-14 * saa * sbb)
        safe = np.where(ok, det, 1.0)
        dE = np.where(ok, -(sbb * sar - sab * sbr) / safe, 0.0)
        dB = np.where(ok, -(saa * sbr - sab * sar) / safe, 0.0)
        step = np.ones_like(E)
        tol = 1e-13 * np.abs(obj) + 1e-300
        for _ in range(12):   # step halving: keep only steps that do not raise the objective
            nE, nB = np.maximum(E + step * dE, 0.0), np.maximum(B + step * dB, 0.0)
            nobj, nr, np_ = objective(nE, nB)
            better = nobj <= obj + tol
            if better[ok].all():
                break
            step = np.where(better, step, step / 2)
        better &= ok
        gain = np.where(better, obj - nobj, 0.0)
        E, B = np.where(better, nE, E), np.where(better, nB, B)
        obj = np.where(better, nobj, obj)
        r, p = np.where(better[:, None], nr, r), np.where(better[:, None], np_, p)
        active = ok & better & (gain > 1e-10 * np.abs(obj) + 1e-300)
        if not active.any():
            break
    return E, B, obj


def fit_power_law(D, L, fit: str = "lsq", delta: float = HUBER_DELTA) -> dict | None:
    """Fit ``L = E + B * D^(-beta)`` by least squares (``fit="lsq"``) or by the Huber loss of the log residuals
    (``fit="huber"``, ``delta``); see the module docstring. Returns ``{"E", "B", "beta", "sse", "d_scale",
    "loss"}`` (``B`` in the units of ``D``: ``L = E + B * D^(-beta)`` holds for raw ``D``; ``sse``: the squared
    residuals of the fitted curve; with ``huber`` also ``delta`` and ``objective``), or None with fewer than 3
    finite points or a curve that does not fall with ``D`` (best ``B`` = 0)."""
    if fit not in FITS:
        raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")
    D, L = np.asarray(D, dtype=float), np.asarray(L, dtype=float)
    ok = np.isfinite(D) & np.isfinite(L) & (D > 0)
    if fit == "huber":
        ok &= L > 0
    D, L = D[ok], L[ok]
    if len(np.unique(D)) < 3:
        return None
    scale = float(D.max())
    u = D / scale
    betas = _BETAS if fit == "lsq" else _BETAS_HUBER
    x = u[None, :] ** (-betas[:, None])
    if fit == "lsq":
        E, B, sse = _linfit(x, L)

        def f(b):
            return float(_linfit((u ** -b)[None, :], L)[2][0])
    else:
        E, B, sse = _huberfit(x, L, delta)

        def f(b):
            return float(_huberfit((u ** -b)[None, :], L, delta)[2][0])
    i = int(np.argmin(sse))
    if not np.isfinite(sse[i]):
        return None
    lo, hi = betas[max(0, i - 1)], betas[min(len(betas) - 1, i + 1)]

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(40 if fit == "lsq" else 24):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    beta = (a + b) / 2
    cands = [(f(beta), beta), (float(sse[i]), float(betas[i]))]
    s, beta = min(cands)
    xb = (u ** -beta)[None, :]
    e, bb, _ = _linfit(xb, L) if fit == "lsq" else _huberfit(xb, L, delta)
    if bb[0] <= 0:
        return None
    res = float(((e[0] + bb[0] * xb[0] - L) ** 2).sum())
    out = {"E": float(e[0]), "B": float(bb[0]) * scale ** beta, "beta": float(beta), "sse": res, "d_scale": scale,
           "loss": fit, "floor_at_zero": bool(e[0] <= 0.0)}
    if fit == "huber":
        out.update(delta=delta, objective=s)
    return out


def power_law(fit: dict, D) -> np.ndarray:
    """The fitted curve at token counts ``D``."""
    return fit["E"] + fit["B"] * np.asarray(D, dtype=float) ** (-fit["beta"])


def equivalent_tokens(L: float, fit: dict) -> float | None:
    """Baseline tokens reaching loss ``L``: ``(B / (L - E))^(1 / beta)``; None when ``L <= E``."""
    if fit is None or not math.isfinite(L) or L <= fit["E"]:
        return None
    # in the fit's scaled units, so that large D stay well inside floating point
    s = fit["d_scale"]
    b_scaled = fit["B"] / s ** fit["beta"]
    return s * (b_scaled / (L - fit["E"])) ** (1.0 / fit["beta"])


def extra_tokens(D: float, L: float, fit: dict) -> float | None:
    """``D / D_equiv - 1`` for an arm's cooled-down loss ``L`` at ``D`` tokens; None below the fitted floor."""
    de = equivalent_tokens(L, fit)
    return None if de is None else D / de - 1.0


def _extra_or_limit(D: float, L: float, fit: dict | None) -> float:
    if fit is None:
        return float("nan")
    x = extra_tokens(D, L, fit)
    return -1.0 if x is None else x


def _extras(D, a_pt: np.ndarray, b_pt: np.ndarray, loss: str) -> np.ndarray:
    """Extra tokens at every budget of arm points ``a_pt`` on a fit of baseline points ``b_pt`` (the limit -1
    below the fitted floor, NaN without a fit)."""
    f = fit_power_law(D, b_pt, loss)
    return np.array([_extra_or_limit(D[j], a_pt[j], f) for j in range(len(D))])


def own_tokens(D, a_pt, b_pt) -> dict:
    """AMD's metric (arXiv 2605.09825): the arm's own tokens to reach the baseline's loss at the largest budget
    ``b_pt[-1]``, read off the arm's cooled-down points ``a_pt`` by linear interpolation in ``(log D, L)``,
    over the largest budget, minus 1. ``{"target", "tokens", "extra", "state"}``; ``state``: ``ok``,
    ``beyond_run`` (the arm's loss at the largest budget is still above the target: no value, nothing is
    extrapolated) or ``before_first_budget`` (the arm is there at the smallest budget already: ``tokens`` and
    ``extra`` are upper bounds)."""
    D, a, target = np.asarray(D, dtype=float), np.asarray(a_pt, dtype=float), float(b_pt[-1])
    out = {"target": target, "tokens": None, "extra": None, "state": "beyond_run"}
    hit = [j for j in range(len(D)) if a[j] <= target]
    if not hit:
        return out
    j = hit[0]
    if j == 0:
        out.update(tokens=float(D[0]), extra=float(D[0] / D[-1] - 1), state="before_first_budget")
        return out
    x0, x1, y0, y1 = math.log(D[j - 1]), math.log(D[j]), a[j - 1], a[j]
    t = math.exp(x0 + (x1 - x0) * (y0 - target) / (y0 - y1)) if y0 != y1 else float(D[j])
    out.update(tokens=t, extra=t / float(D[-1]) - 1, state="ok")
    return out


def paired_extra_tokens(D, arm: np.ndarray, base: np.ndarray, *, n_boot: int = 1000, seed: int = 0,
                        fit: str = "lsq") -> dict:
    """Extra tokens and loss gaps of one arm per budget, with seed-level intervals (module docstring).

    ``D``: tokens at each of K budgets. ``arm``, ``base``: arrays (S, K, W) of per-window cooled-down losses,
    seed ``i`` of ``arm`` paired with seed ``i`` of ``base`` (same windows in the same order everywhere).
    ``fit``: the baseline fit's loss, ``lsq`` or ``huber`` (``fit_power_law``). ``n_boot``: replicates of the
    window-only bootstrap (``eval_se``; 0: none). Returns ``{"budgets": [{"tokens", "loss", "base_loss", "gap",
    "gap_seeds", "gap_se", "gap_ci95", "gap_p", "gap_mde", "extra", "extra_seeds", "state", "d_equiv",
    "extrapolated", "ci95", "se", "p", "mde", "eval_se", "eval_gap_se", "eval_ci95"}...], "fit": {...},
    "fit_budgets", "fit_exact", "own_tokens", "n_seeds", "n_windows", "n_boot", "df"}``."""

    D = np.asarray(D, dtype=float)
    arm, base = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if arm.shape != base.shape or arm.ndim != 3 or arm.shape[1] != len(D):
        raise ValueError(f"arm {arm.shape} and base {base.shape} must both be (seeds, {len(D)} budgets, windows)")
    S, K, W = arm.shape
    a_s, b_s = arm.mean(axis=2), base.mean(axis=2)            # (S, K): each seed's window mean
    a_pt, b_pt = a_s.mean(axis=0), b_s.mean(axis=0)
    gap_s = a_s - b_s
    loss = fit
    fit = fit_power_law(D, b_pt, loss)
    # leave one seed out: the baseline refitted each time
    loo = np.stack([_extras(D, np.delete(a_s, i, 0).mean(0), np.delete(b_s, i, 0).mean(0), loss)
                    for i in range(S)]) if S >= 2 else None
    rows = []
    for j in range(K):
        e = extra_tokens(D[j], a_pt[j], fit) if fit is not None else None
        state = "ok" if e is not None else ("no_fit" if fit is None else "below_floor")
        de = equivalent_tokens(a_pt[j], fit) if fit is not None else None
        g = T.paired_t(gap_s[:, j])
        row = {"tokens": float(D[j]), "loss": float(a_pt[j]), "base_loss": float(b_pt[j]),
               "gap": float(a_pt[j] - b_pt[j]), "gap_seeds": [float(x) for x in gap_s[:, j]],
               "gap_se": g["se"], "gap_ci95": g["ci"], "gap_p": g["p"], "gap_mde": g["mde"],
               "extra": e, "state": state, "d_equiv": de,
               "extrapolated": bool(de is not None and de > D.max() * (1 + 1e-9)),
               "extra_seeds": [None if fit is None else extra_tokens(D[j], float(b_pt[j] + x), fit)
                               for x in gap_s[:, j]]}
        jk = T.jackknife_t(e, loo[:, j]) if (loo is not None and e is not None) else {}
        row.update(ci95=jk.get("ci"), se=jk.get("se"), p=jk.get("p"), mde=jk.get("mde"))
        rows.append(row)
    if n_boot:
        # evaluation noise alone: resample the windows (the same ones for every run), seeds held fixed
        rng = np.random.default_rng(seed)
        reps = np.full((n_boot, K), np.nan)
        gaps = np.full((n_boot, K), np.nan)
        for r in range(n_boot):
            wi = rng.integers(0, W, size=W)
            a_r, b_r = arm[:, :, wi].mean(axis=(0, 2)), base[:, :, wi].mean(axis=(0, 2))
            gaps[r] = a_r - b_r
            reps[r] = _extras(D, a_r, b_r, loss)
        for j, row in enumerate(rows):
            v = reps[:, j][np.isfinite(reps[:, j])]
            row["eval_gap_se"] = float(gaps[:, j].std(ddof=1)) if n_boot > 1 else None
            ok = len(v) >= max(10, n_boot // 2)
            row["eval_se"] = float(v.std(ddof=1)) if ok else None
            row["eval_ci95"] = [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] if ok else None
    nb = len(np.unique(D))
    return {"budgets": rows, "fit": fit, "fit_budgets": int(nb), "fit_exact": nb == 3,
            "own_tokens": own_tokens(D, a_pt, b_pt), "n_seeds": S, "n_windows": W, "n_boot": n_boot,
            "df": S - 1 if S >= 2 else None}


# ----------------------------------------------------------------------------------------------
# reading a study


def _last_eval(branch: Path) -> tuple[float, list[float]] | None:
    """(tokens, per-window losses) of a branch's last evaluation; windows from ``eval_windows.jsonl``, or the
    mean ``val_loss`` as a single window for runs that did not record them."""
    def rows(name):
        p = branch / name
        if not p.is_file():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict):
                out.append(r)
        return out
    ev = [r for r in rows("metrics.jsonl") if "val_loss" in r]
    if not ev:
        return None
    last = ev[-1]
    win = [r for r in rows("eval_windows.jsonl") if r.get("step") == last.get("step")]
    try:
        losses = [float(x) for x in win[-1]["losses"]] if win else [float(last["val_loss"])]
    except (TypeError, ValueError, KeyError):
        losses = [float("nan")]
    return float(last["tokens"]), losses


def _final_eval(branch: Path) -> tuple[int, list[float], list[str] | None] | None:
    """(evaluation tokens, per-window losses, each window's validation source or None) of a branch's end-of-run
    evaluation over ``log.final_eval_tokens`` (``RUN/eval_final.json``), or None."""
    p = branch / "eval_final.json"
    try:
        r = json.loads(p.read_text())
        src = r.get("sources")
        return (int(r["eval_tokens"]), [float(x) for x in r["losses"]],
                [str(x) for x in src] if isinstance(src, list) else None)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def _window_sources(branch: Path) -> list[str] | None:
    """The validation source of each window of a run's periodic evaluations (``RUN/eval_sources.json``)."""
    try:
        src = json.loads((branch / "eval_sources.json").read_text())["sources"]
        return [str(x) for x in src] if isinstance(src, list) else None
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def load_cooldown_points(study_dir: str | Path) -> dict:
    """``{arm: {seed: {budget: {"tokens", "losses", "state", "path"}}}}`` from every branch folder of a study
    (``runs/<arm>/seed<k>/branches/*/study_status.json``, written by the runner with the budget). The losses
    are those of each branch's end-of-run evaluation over ``log.final_eval_tokens`` (``eval_final.json``) where
    every finished branch has one over the same number of tokens (the same windows, as the paired comparison
    needs), else those of its last periodic evaluation."""
    out: dict = {}
    finals: list = []
    root = Path(study_dir) / "runs"
    if not root.is_dir():
        return out
    for st_p in sorted(root.glob("*/seed*/branches/*/study_status.json")):
        try:
            st = json.loads(st_p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        bdir = st_p.parent
        arm, seed = bdir.parents[2].name, bdir.parents[1].name
        if not seed.startswith("seed") or not seed[4:].isdigit() or "budget" not in st:
            continue
        pt = {"state": st.get("state"), "path": str(bdir), "tokens": None, "losses": None}
        if st.get("state") == "done":
            ev = _last_eval(bdir)
            if ev is not None:
                pt["tokens"], pt["losses"] = ev
                pt["sources"] = _window_sources(bdir)
            finals.append((pt, _final_eval(bdir)))
        out.setdefault(arm, {}).setdefault(int(seed[4:]), {})[float(st["budget"])] = pt
    if finals and all(f is not None for _, f in finals) and len({f[0] for _, f in finals}) == 1:
        for pt, f in finals:
            pt["losses"], pt["eval"], pt["sources"] = f[1], "final", f[2]
    return out


def gaps_by_source(points: dict, baseline: str, budget: float) -> dict:
    """``{arm: {source: {"gap", "n_windows", "n_seeds"}}}``: at ``budget``, each arm's cooled-down loss minus the
    baseline's on the windows of each validation source (a corpus domain: the fixed validation files), paired
    by seed and window, averaged over the windows and the seeds both finished; only where every one of those
    runs labels its windows with the same sources (``eval_sources.json`` / ``eval_final.json``)."""
    base = points.get(baseline, {})
    out: dict = {}
    for arm, runs in points.items():
        if arm == baseline:
            continue
        diffs: dict = {}
        seeds = 0
        for s, bs in runs.items():
            a, b = bs.get(budget), base.get(s, {}).get(budget)
            if not (a and b and a["state"] == b["state"] == "done" and a.get("losses") and b.get("losses")):
                continue
            src = a.get("sources")
            if not src or src != b.get("sources") or len(src) != len(a["losses"]) or \
                    len(b["losses"]) != len(a["losses"]):
                continue
            seeds += 1
            for name, la, lb in zip(src, a["losses"], b["losses"]):
                diffs.setdefault(name, []).append(la - lb)
        if diffs:
            out[arm] = {name: {"gap": float(np.mean(d)), "n_windows": len(d) // seeds, "n_seeds": seeds}
                        for name, d in sorted(diffs.items())}
    return out


def gaps_by_budget(points: dict, baseline: str, budgets: list[float]) -> dict:
    """``{arm: [{"budget", "gaps": {seed: gap}, "mean", "n_seeds"}...]}``: at each budget, the arm's cooled-down
    loss minus the baseline's of the same seed (mean over the windows both evaluated), for **every** seed whose
    branch at that budget finished in both, whether or not the seed finished its other budgets. The intervals
    of ``summarize_cooldown`` need seeds complete at every budget (one baseline fit across them); this view
    keeps what a study cut short (a GPU allocation that ended mid-way) has already measured."""
    base = points.get(baseline, {})
    out: dict = {}
    for arm, runs in points.items():
        if arm == baseline:
            continue
        rows = []
        for b in budgets:
            gaps = {}
            for s, bs in sorted(runs.items()):
                a, r = bs.get(b), base.get(s, {}).get(b)
                if not (a and r and a["state"] == r["state"] == "done" and a.get("losses") and r.get("losses")):
                    continue
                w = min(len(a["losses"]), len(r["losses"]))
                gaps[int(s)] = float(np.mean(np.asarray(a["losses"][:w], dtype=float)
                                             - np.asarray(r["losses"][:w], dtype=float)))
            rows.append({"budget": b, "gaps": gaps, "n_seeds": len(gaps),
                         "mean": float(np.mean(list(gaps.values()))) if gaps else None})
        out[arm] = rows
    return out


def summarize_cooldown(points: dict, baseline: str, budgets: list[float], *, n_boot: int = 1000,
                       seed: int = 0, fit: str = "lsq") -> dict:
    """The ``cooldown`` section of summary.json: per arm, extra tokens per budget with intervals
    (``paired_extra_tokens`` over the seeds every budget of both the arm and the baseline finished), the
    baseline's fit (``fit``: ``lsq`` or ``huber``), and which branches are missing or diverged."""
    budgets = sorted(float(b) for b in budgets)
    base = points.get(baseline, {})

    def complete(runs: dict) -> dict:
        return {s: bs for s, bs in runs.items()
                if all(b in bs and bs[b]["state"] == "done" and bs[b]["losses"] for b in budgets)}

    base_ok = complete(base)
    how = "least squares on L" if fit == "lsq" else f"Huber loss on log L, delta {HUBER_DELTA:g}"
    res: dict = {"budgets": budgets, "baseline": baseline, "n_boot": n_boot, "fit_loss": fit,
                 "method": f"fit L = E + B D^-beta to the baseline's cooled-down points ({how}, 1-D search "
                           "over beta); extra tokens = D / D_equiv - 1; intervals: Student t over the per-seed "
                           "paired gaps (df = seeds - 1) and, for extra tokens, the jackknife over seeds with the "
                           "same t quantile; detectable effect = (t_0.975 + t_0.80) x s.e.; eval s.e.: bootstrap "
                           "over the evaluation windows with the seeds held fixed", "arms": {}}
    for arm, runs in points.items():
        bad = sorted({(s, b, p["state"]) for s, bs in runs.items() for b, p in bs.items() if p["state"] != "done"})
        ok = complete(runs)
        seeds = sorted(set(ok) & set(base_ok))
        entry: dict = {"seeds": seeds, "not_done": [{"seed": s, "budget": b, "state": st} for s, b, st in bad]}
        if any(st == "diverged" for _, _, st in bad):
            entry["state"] = "diverged"
        if not seeds:
            entry.setdefault("state", "no_runs")
            res["arms"][arm] = entry
            continue
        W = min(len(ok[s][b]["losses"]) for s in seeds for b in budgets)
        W = min(W, min(len(base_ok[s][b]["losses"]) for s in seeds for b in budgets))
        A = np.array([[ok[s][b]["losses"][:W] for b in budgets] for s in seeds], dtype=float)
        Bm = np.array([[base_ok[s][b]["losses"][:W] for b in budgets] for s in seeds], dtype=float)
        D = np.array([np.mean([base_ok[s][b]["tokens"] for s in seeds]) for b in budgets])
        r = paired_extra_tokens(D, A, Bm, n_boot=n_boot, seed=seed, fit=fit)
        for row, b in zip(r["budgets"], budgets):
            row["budget"] = b
        entry.update(r)
        entry.setdefault("state", "baseline" if arm == baseline else "ok")
        res["arms"][arm] = entry
    if baseline in res["arms"] and res["arms"][baseline].get("fit"):
        res["fit"] = res["arms"][baseline]["fit"]
    if budgets:
        res["by_budget"] = gaps_by_budget(points, baseline, budgets)
        by = gaps_by_source(points, baseline, budgets[-1])
        if by:
            res["by_source"] = {"budget": budgets[-1], "arms": by}
    return res


def _pct(x) -> str:
    if x is None:
        return "–"
    v = 100 * x
    return f"{0.0 if abs(v) < 0.05 else v:+.1f} %"   # no "-0.0 %"


def _p(x) -> str:
    return "–" if x is None else (f"{x:.2g}" if x >= 0.001 else "<0.001")


def verdict_scale(params, tokens) -> str | None:
    """Why a run of ``params`` parameters and ``tokens`` tokens (at the largest budget) gets no verdict on a
    published claim, or None when it is large enough (``MIN_VERDICT_PARAMS``, ``MIN_VERDICT_TOKENS``)."""
    if params is None:
        return "the runs record no parameter count, so their scale is unknown"
    if params < MIN_VERDICT_PARAMS:
        return f"{params / 1e6:.2g} M parameters, below the {MIN_VERDICT_PARAMS / 1e6:.0f} M a verdict needs"
    if tokens is not None and tokens < MIN_VERDICT_TOKENS:
        return (f"{tokens / 1e6:.2g} M tokens at the largest budget, below the {MIN_VERDICT_TOKENS / 1e6:.0f} M a "
                f"verdict needs")
    return None


def seeds_text(row: dict, key: str = "gap_seeds", fmt=None) -> str:
    """Each seed's value, ``seeds +0.0123, +0.0101, +0.0150``."""
    xs = row.get(key) or []
    fmt = fmt or (lambda x: f"{x:+.4f}")
    return ", ".join("–" if x is None else fmt(x) for x in xs)


_TOL = 1e-6   # a gap within this of 0 (round-off) is no effect


def fit_notes(cool: dict) -> list[str]:
    """Cautions about the baseline's fit: a floor at its bound, or exactly as many budgets as parameters."""
    out = []
    f = cool.get("fit") or {}
    if f.get("floor_at_zero"):
        out.append("caution: the baseline's fitted loss floor E is at its bound 0: its cooled-down losses do not "
                   "bend toward a floor over these budgets, so L(D) is fitted as a pure power law and the extra "
                   "tokens below extrapolate it (train longer or add budgets)")
    if f and len(cool.get("budgets") or []) == 3:
        out.append("caution: the baseline's fit has 3 parameters and 3 budgets, so it passes through every point "
                   "and its shape is not checked by the data (add budgets to test it)")
    return out


def verdict_lines(cool: dict, scale: dict | None = None) -> list[str]:
    """One line per arm: its extra tokens at the largest budget with the seed-level interval, each seed's gap,
    AMD's own-tokens metric beside ours, and whether the effect is resolved: the gap's paired t test,
    Holm-adjusted over the arms of this list, at alpha 0.05. No verdict with fewer than ``MIN_SEEDS`` seeds
    or, where ``scale`` (``{"params", "tokens"}``) is given, below ``verdict_scale``'s size; the numbers
    stay. The adjusted p-values are written into each arm's ``p_holm``."""

    out = fit_notes(cool)
    arms = {a: e for a, e in (cool.get("arms") or {}).items() if a != cool.get("baseline")}
    small = None
    if scale is not None:
        small = verdict_scale(scale.get("params"), scale.get("tokens"))
        if small:
            out.append(f"no verdict in this report: {small}; the numbers below are measurements only")
    # the family: every arm with a finite gap p-value and enough seeds
    fam = {a: e["budgets"][-1].get("gap_p") for a, e in arms.items()
           if e.get("budgets") and e.get("state") not in ("no_runs", "diverged")
           and (e.get("n_seeds") or 0) >= MIN_SEEDS}
    adj = dict(zip(fam, T.holm(list(fam.values()))))
    for arm, e in arms.items():
        if e.get("state") in ("no_runs", "diverged") or not e.get("budgets"):
            out.append(f"{arm}: {str(e.get('state', 'no result')).replace('_', ' ')} (no cooled-down comparison)")
            continue
        row = e["budgets"][-1]
        e["p_holm"] = adj.get(arm)
        at = f"at {100 * row['budget']:.0f} % budget"
        n = e.get("n_seeds") or 0
        gap = f"gap {row['gap']:+.4f} nats (seeds {seeds_text(row)})"
        if row["state"] != "ok":
            num = (f"cooled-down loss {row['loss']:.4f} is below the baseline's fitted floor {at}, no finite token "
                   f"equivalent; {gap}")
        else:
            ci = row.get("ci95")
            ci_s = f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else ""
            ext = ", extrapolated: the arm is better than the baseline, so D_equiv lies beyond the largest budget " \
                  "fitted" if row.get("extrapolated") else ""
            num = f"{_pct(row['extra'])} tokens {at}{ci_s}{ext}; {gap}"
        own = e.get("own_tokens") or {}
        if own:
            num += ("; the arm's own tokens to the baseline's final loss (AMD's metric): "
                    + ("beyond the run" if own["state"] == "beyond_run" else
                       f"at most {_pct(own['extra'])}" if own["state"] == "before_first_budget" else _pct(own["extra"])))
        if n < 2:
            ec = row.get("eval_ci95")
            out.append(f"{arm}: {num}" + (f"; evaluation-window interval [{_pct(ec[0])}, {_pct(ec[1])}]" if ec else "")
                       + f"; no verdict: 1 seed, so only evaluation-window noise is measured, not seed-to-seed "
                         f"noise (train {MIN_SEEDS} or more seeds)")
            continue
        if n < MIN_SEEDS:
            out.append(f"{arm}: {num}; no verdict: {n} seeds, below the {MIN_SEEDS} a verdict needs (a t interval "
                       f"over {n} seeds has {n - 1} degree of freedom)")
            continue
        mde = row.get("mde")
        mde_s = f"; detectable effect {100 * mde:.1f} %" if mde is not None else ""
        ph = adj.get(arm)
        if small:
            judge = "no verdict (scale)"
        elif ph is None:
            judge = "not resolved (no test)"
        elif ph < 0.05 and abs(row["gap"]) > _TOL:
            judge = "resolved " + ("worse" if row["gap"] > 0 else "better")
        else:
            judge = "not resolved"
        out.append(f"{arm}: {num}{mde_s}; p {_p(row.get('gap_p'))}, Holm-adjusted {_p(ph)}: {judge}; "
                   f"{n} seeds x {e['n_windows']} windows")
    return out
