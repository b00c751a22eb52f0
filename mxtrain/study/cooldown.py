"""Extra tokens from cooled-down losses at several budgets, with paired bootstrap intervals.

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
   parameters); with 3 the curve goes through the points.
2. **Invert** an arm's cooled-down loss ``L`` at budget ``D``: the baseline tokens reaching it,
   ``D_equiv = (B / (L - E))^(1 / beta)``, and the **extra tokens** ``D / D_equiv - 1`` (> 0: the arm needs
   more tokens than the baseline for the same loss). ``L <= E`` (below the baseline's fitted floor) has no
   finite ``D_equiv``: the point estimate's state is ``below_floor`` and bootstrap replicates count it as
   the limit, -1.
3. **Intervals**: a paired bootstrap (``n_boot`` replicates, fixed generator seed): each replicate resamples
   the seeds with replacement, each drawn seed bringing its arm run *and* its baseline run (same init and
   data order), and resamples the evaluation windows with replacement, the same windows for every run (the
   same text); the cooled-down loss of a run is its mean over the drawn windows, a point is the mean over
   the drawn seeds; the baseline is refitted in every replicate. The 95 % interval is the 2.5 and 97.5
   percentiles of the replicates; ``se`` is their standard deviation.
4. **Smallest detectable effect** (``mde``): ``2.8 * se``, the true effect a two-sided test at alpha 0.05
   detects with 80 % power under a normal approximation (``z_0.975 + z_0.80 = 1.960 + 0.842``). The verdict
   calls an arm's effect *significant* when its interval excludes 0, else *not distinguishable from 0* at
   that detectable effect.

Everything works on plain numbers and NumPy arrays, so tests can feed synthetic curves with known answers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

__all__ = ["fit_power_law", "power_law", "equivalent_tokens", "extra_tokens", "bootstrap_extra_tokens",
           "load_cooldown_points", "summarize_cooldown", "verdict_lines", "MDE_FACTOR", "FITS", "HUBER_DELTA"]

MDE_FACTOR = 2.8            # z_{0.975} + z_{0.80}: 80 % power at two-sided alpha 0.05
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


def bootstrap_extra_tokens(D, arm: np.ndarray, base: np.ndarray, *, n_boot: int = 1000, seed: int = 0,
                           fit: str = "lsq") -> dict:
    """Extra tokens of one arm per budget, with paired bootstrap intervals (module docstring).

    ``D``: tokens at each of K budgets. ``arm``, ``base``: arrays (S, K, W) of per-window cooled-down losses,
    seed ``i`` of ``arm`` paired with seed ``i`` of ``base`` (same windows in the same order everywhere).
    ``fit``: the baseline fit's loss, ``lsq`` or ``huber`` (``fit_power_law``), in every replicate.
    Returns ``{"budgets": [{"tokens", "loss", "base_loss", "gap", "gap_ci95", "extra", "state", "ci95",
    "se", "mde", "boot_valid"}...], "fit": {...}, "n_seeds", "n_windows", "n_boot"}``."""
    D = np.asarray(D, dtype=float)
    arm, base = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if arm.shape != base.shape or arm.ndim != 3 or arm.shape[1] != len(D):
        raise ValueError(f"arm {arm.shape} and base {base.shape} must both be (seeds, {len(D)} budgets, windows)")
    S, K, W = arm.shape
    a_pt, b_pt = arm.mean(axis=(0, 2)), base.mean(axis=(0, 2))
    loss = fit
    fit = fit_power_law(D, b_pt, loss)
    rows = []
    for j in range(K):
        e = extra_tokens(D[j], a_pt[j], fit) if fit is not None else None
        state = "ok" if e is not None else ("no_fit" if fit is None else "below_floor")
        rows.append({"tokens": float(D[j]), "loss": float(a_pt[j]), "base_loss": float(b_pt[j]),
                     "gap": float(a_pt[j] - b_pt[j]), "extra": e, "state": state})
    rng = np.random.default_rng(seed)
    reps = np.full((n_boot, K), np.nan)
    gaps = np.full((n_boot, K), np.nan)
    # per-seed, per-window sums make a replicate two small matrix products
    for r in range(n_boot):
        si = rng.integers(0, S, size=S)
        wi = rng.integers(0, W, size=W)
        a_r = arm[si][:, :, wi].mean(axis=(0, 2))
        b_r = base[si][:, :, wi].mean(axis=(0, 2))
        gaps[r] = a_r - b_r
        f_r = fit_power_law(D, b_r, loss)
        reps[r] = [_extra_or_limit(D[j], a_r[j], f_r) for j in range(K)]
    for j, row in enumerate(rows):
        v = reps[:, j][np.isfinite(reps[:, j])]
        g = gaps[:, j]
        row["gap_ci95"] = [float(np.percentile(g, 2.5)), float(np.percentile(g, 97.5))]
        row["boot_valid"] = int(len(v))
        if len(v) >= max(10, n_boot // 2):
            row["ci95"] = [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))]
            row["se"] = float(v.std(ddof=1))
            row["mde"] = MDE_FACTOR * row["se"]
        else:
            row["ci95"] = row["se"] = row["mde"] = None
    return {"budgets": rows, "fit": fit, "n_seeds": S, "n_windows": W, "n_boot": n_boot}


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
    every finished branch has one over the same number of tokens (the same windows, as the paired bootstrap
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
    branch at that budget finished in both, whether or not the seed finished its other budgets. The bootstrap
    of ``summarize_cooldown`` needs seeds complete at every budget (one baseline fit across them); this view
    keeps what a study cut short (a lease that ended mid-way) has already measured."""
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
    (``bootstrap_extra_tokens`` over the seeds every budget of both the arm and the baseline finished), the
    baseline's fit (``fit``: ``lsq`` or ``huber``), and which branches are missing or diverged."""
    budgets = sorted(float(b) for b in budgets)
    base = points.get(baseline, {})

    def complete(runs: dict) -> dict:
        return {s: bs for s, bs in runs.items()
                if all(b in bs and bs[b]["state"] == "done" and bs[b]["losses"] for b in budgets)}

    base_ok = complete(base)
    how = "least squares on L" if fit == "lsq" else f"Huber loss on log L, delta {HUBER_DELTA:g}"
    res: dict = {"budgets": budgets, "baseline": baseline, "n_boot": n_boot, "mde_factor": MDE_FACTOR,
                 "fit_loss": fit,
                 "method": f"fit L = E + B D^-beta to the baseline's cooled-down points ({how}, 1-D search "
                           "over beta); extra tokens = D / D_equiv - 1; paired bootstrap over seeds and "
                           "evaluation windows; mde = 2.8 x bootstrap s.e.", "arms": {}}
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
        r = bootstrap_extra_tokens(D, A, Bm, n_boot=n_boot, seed=seed, fit=fit)
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


_TOL = 1e-6   # an interval within this of 0 (fit round-off) does not exclude 0


def verdict_lines(cool: dict) -> list[str]:
    """One line per arm: its extra tokens at the largest budget, the interval, and whether the effect is
    distinguishable from 0 at this design's detectable effect."""
    out = []
    if (cool.get("fit") or {}).get("floor_at_zero"):
        out.append(f"caution: the baseline's fitted loss floor E is at its bound 0: its cooled-down losses do not "
                   f"bend toward a floor over these budgets, so L(D) is fitted as a pure power law and the extra "
                   f"tokens below extrapolate it (train longer or add budgets)")
    for arm, e in (cool.get("arms") or {}).items():
        if arm == cool.get("baseline"):
            continue
        if e.get("state") in ("no_runs", "diverged") or not e.get("budgets"):
            out.append(f"{arm}: {str(e.get('state', 'no result')).replace('_', ' ')} (no cooled-down comparison)")
            continue
        row = e["budgets"][-1]
        at = f"at {100 * row['budget']:.0f} % budget"
        if row["state"] != "ok":
            out.append(f"{arm}: cooled-down loss {row['loss']:.4f} is below the baseline's fitted floor {at} "
                       f"(gap {row['gap']:+.4f} nats): no finite token equivalent")
            continue
        ci, mde = row.get("ci95"), row.get("mde")
        ci_s = f"[{_pct(ci[0])}, {_pct(ci[1])}]" if ci else "[no interval]"
        if (e.get("n_seeds") or 0) < 2:
            # one seed: resampling windows alone measures evaluation noise, not seed-to-seed noise
            out.append(f"{arm}: {_pct(row['extra'])} tokens {at} {ci_s}, no verdict: 1 seed, so the interval "
                       f"covers evaluation-window noise only, not seed-to-seed noise (train 2 or more seeds)")
            continue
        if ci and (ci[0] > _TOL or ci[1] < -_TOL):
            judge = "significant"
        else:
            judge = "not distinguishable from 0"
        mde_s = f" (detectable effect of this design: {100 * mde:.1f} %)" if mde is not None else ""
        out.append(f"{arm}: {_pct(row['extra'])} tokens {at} {ci_s}, {judge}{mde_s}; "
                   f"{e['n_seeds']} seed(s) x {e['n_windows']} window(s)")
    return out
