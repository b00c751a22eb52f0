"""Extra tokens from cooled-down losses at several budgets, with paired bootstrap intervals.

A cooldown study (``mxtrain study --budgets 0.25,0.5,0.75,1 --cooldown 0.2``; docs/study.md) gives, for
every arm, seed and budget ``D`` (tokens), the validation loss of every evaluation window after a cooldown
branch that ends at ``D``. This module turns them into the extra-token cost:

1. **Fit** the baseline's cooled-down points ``L(D) = E + B * D^(-beta)`` (``fit_power_law``): least
   squares on ``L``; for a fixed ``beta`` the model is linear in ``(E, B)`` and has a closed form, so the fit
   is a 1-D search over ``beta`` (a log-spaced grid over [0.01, 4], then a golden-section refinement around
   the best grid point). ``D`` is scaled by the largest budget inside the fit (numerics only). At least 3
   budgets are needed (3 parameters); with 3 the curve goes through the points.
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
           "load_cooldown_points", "summarize_cooldown", "verdict_lines", "MDE_FACTOR"]

MDE_FACTOR = 2.8            # z_{0.975} + z_{0.80}: 80 % power at two-sided alpha 0.05
_BETAS = np.geomspace(0.01, 4.0, 400)


def _linfit(x: np.ndarray, L: np.ndarray):
    """Least squares ``L = E + B x`` for each row of ``x`` (G, K): E, B, SSE (each (G,)). B clipped at 0."""
    xm, Lm = x.mean(axis=-1, keepdims=True), L.mean()
    dx = x - xm
    var = (dx * dx).sum(axis=-1)
    B = np.where(var > 0, (dx * (L - Lm)).sum(axis=-1) / np.where(var > 0, var, 1.0), 0.0)
    B = np.maximum(B, 0.0)
    E = Lm - B * xm[..., 0]
    sse = ((E[..., None] + B[..., None] * x - L) ** 2).sum(axis=-1)
    return E, B, sse


def fit_power_law(D, L) -> dict | None:
    """Least-squares fit of ``L = E + B * D^(-beta)`` (see the module docstring). Returns ``{"E", "B", "beta",
    "sse", "d_scale"}`` (``B`` in the units of ``D``: ``L = E + B * D^(-beta)`` holds for raw ``D``), or None
    with fewer than 3 finite points or a curve that does not fall with ``D`` (best ``B`` = 0)."""
    D, L = np.asarray(D, dtype=float), np.asarray(L, dtype=float)
    ok = np.isfinite(D) & np.isfinite(L) & (D > 0)
    D, L = D[ok], L[ok]
    if len(np.unique(D)) < 3:
        return None
    scale = float(D.max())
    u = D / scale
    x = u[None, :] ** (-_BETAS[:, None])
    E, B, sse = _linfit(x, L)
    i = int(np.argmin(sse))
    lo, hi = _BETAS[max(0, i - 1)], _BETAS[min(len(_BETAS) - 1, i + 1)]

    def f(b):
        return float(_linfit((u ** -b)[None, :], L)[2][0])

    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    beta = (a + b) / 2
    cands = [(f(beta), beta), (float(sse[i]), float(_BETAS[i]))]
    s, beta = min(cands)
    e, bb, _ = _linfit((u ** -beta)[None, :], L)
    if bb[0] <= 0:
        return None
    return {"E": float(e[0]), "B": float(bb[0]) * scale ** beta, "beta": float(beta), "sse": s, "d_scale": scale}


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


def bootstrap_extra_tokens(D, arm: np.ndarray, base: np.ndarray, *, n_boot: int = 1000, seed: int = 0) -> dict:
    """Extra tokens of one arm per budget, with paired bootstrap intervals (module docstring).

    ``D``: tokens at each of K budgets. ``arm``, ``base``: arrays (S, K, W) of per-window cooled-down losses,
    seed ``i`` of ``arm`` paired with seed ``i`` of ``base`` (same windows in the same order everywhere).
    Returns ``{"budgets": [{"tokens", "loss", "base_loss", "gap", "gap_ci95", "extra", "state", "ci95",
    "se", "mde", "boot_valid"}...], "fit": {...}, "n_seeds", "n_windows", "n_boot"}``."""
    D = np.asarray(D, dtype=float)
    arm, base = np.asarray(arm, dtype=float), np.asarray(base, dtype=float)
    if arm.shape != base.shape or arm.ndim != 3 or arm.shape[1] != len(D):
        raise ValueError(f"arm {arm.shape} and base {base.shape} must both be (seeds, {len(D)} budgets, windows)")
    S, K, W = arm.shape
    a_pt, b_pt = arm.mean(axis=(0, 2)), base.mean(axis=(0, 2))
    fit = fit_power_law(D, b_pt)
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
        f_r = fit_power_law(D, b_r)
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


def load_cooldown_points(study_dir: str | Path) -> dict:
    """``{arm: {seed: {budget: {"tokens", "losses", "state", "path"}}}}`` from every branch folder of a study
    (``runs/<arm>/seed<k>/branches/*/study_status.json``, written by the runner with the budget)."""
    out: dict = {}
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
        out.setdefault(arm, {}).setdefault(int(seed[4:]), {})[float(st["budget"])] = pt
    return out


def summarize_cooldown(points: dict, baseline: str, budgets: list[float], *, n_boot: int = 1000,
                       seed: int = 0) -> dict:
    """The ``cooldown`` section of summary.json: per arm, extra tokens per budget with intervals
    (``bootstrap_extra_tokens`` over the seeds every budget of both the arm and the baseline finished), the
    baseline's fit, and which branches are missing or diverged."""
    budgets = sorted(float(b) for b in budgets)
    base = points.get(baseline, {})

    def complete(runs: dict) -> dict:
        return {s: bs for s, bs in runs.items()
                if all(b in bs and bs[b]["state"] == "done" and bs[b]["losses"] for b in budgets)}

    base_ok = complete(base)
    res: dict = {"budgets": budgets, "baseline": baseline, "n_boot": n_boot, "mde_factor": MDE_FACTOR,
                 "method": "fit L = E + B D^-beta to the baseline's cooled-down points (least squares, 1-D search "
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
        r = bootstrap_extra_tokens(D, A, Bm, n_boot=n_boot, seed=seed)
        for row, b in zip(r["budgets"], budgets):
            row["budget"] = b
        entry.update(r)
        entry.setdefault("state", "baseline" if arm == baseline else "ok")
        res["arms"][arm] = entry
    if baseline in res["arms"] and res["arms"][baseline].get("fit"):
        res["fit"] = res["arms"][baseline]["fit"]
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
        if ci and (ci[0] > _TOL or ci[1] < -_TOL):
            judge = "significant"
        else:
            judge = "not distinguishable from 0"
        mde_s = f" (detectable effect of this design: {100 * mde:.1f} %)" if mde is not None else ""
        out.append(f"{arm}: {_pct(row['extra'])} tokens {at} {ci_s}, {judge}{mde_s}; "
                   f"{e['n_seeds']} seed(s) x {e['n_windows']} window(s)")
    return out
