"""Seed-level statistics for study verdicts: Student t, paired t intervals, the jackknife over seeds, Holm's
correction and the equivalence test (TOST). Plain Python on lists of numbers (no SciPy).

* ``t_cdf(x, df)``: the Student t distribution function for an integer ``df``, in closed form (Abramowitz and
  Stegun 26.7.3 / 26.7.4), exact up to floating point. ``t_ppf`` inverts it by bisection.
* ``paired_t(diffs)``: the mean of per-seed paired differences, its standard error ``sd / sqrt(n)``, a
  two-sided ``1 - alpha`` interval ``mean +- t_{1-alpha/2, n-1} se``, the two-sided p-value of ``mean = 0``
  and the smallest detectable effect ``(t_{1-alpha/2, n-1} + t_{power, n-1}) se``.
* ``jackknife_t(values, estimate)``: the same for a smooth function of seed means (extra tokens): ``se``
  from the leave-one-seed-out estimates, ``sqrt((n-1)/n sum (theta_i - mean theta_i)^2)``, with ``n - 1``
  degrees of freedom. For a mean it is exactly ``paired_t``.
* ``holm(pvalues)``: Holm's step-down adjusted p-values (Holm 1979): sort ascending, multiply the ``i``-th
  smallest (``i`` from 1) by ``m - i + 1``, carry the running maximum, cap at 1. Rejecting where the adjusted
  p-value is below alpha holds the family-wise error rate at alpha.
* ``tost(est, se, df, margin)``: two one-sided tests of ``|effect| < margin`` (Schuirmann 1987): the p-value
  is the larger of ``P(T >= (est + margin) / se)`` and ``P(T <= (est - margin) / se)``; below alpha means
  the ``1 - 2 alpha`` interval lies inside ``+-margin``. ``outside(est, se, df, margin)`` is the mirror
  test (the effect lies beyond the margin on one side): twice the smaller one-sided p-value, so that below
  alpha means the two-sided ``1 - alpha`` interval lies wholly outside ``+-margin``.
"""

from __future__ import annotations

import math

__all__ = ["ALPHA", "POWER", "t_cdf", "t_ppf", "mde_factor", "paired_t", "jackknife_t", "holm", "tost", "outside",
           "t_p_two_sided"]

ALPHA = 0.05      # two-sided level of every interval and test
POWER = 0.80      # the power the detectable effect is quoted at


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with integer ``df`` >= 1."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df must be a positive integer, got {df}")
    df = int(df)
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    th = math.atan(abs(x) / math.sqrt(df))
    c2 = math.cos(th) ** 2
    s = math.sin(th)
    if df % 2 == 1:
        # A = 2/pi [theta + sin(theta) (cos + 2/3 cos^3 + ... + (2.4...(df-3))/(1.3...(df-2)) cos^(df-2))]
        term, acc = math.cos(th), 0.0
        if df > 1:
            acc = term
            for k in range(3, df - 1, 2):
                term *= c2 * (k - 1) / k
                acc += term
        a = 2.0 / math.pi * (th + s * acc)
    else:
        # A = sin(theta) [1 + 1/2 cos^2 + (1.3)/(2.4) cos^4 + ... + (1.3...(df-3))/(2.4...(df-2)) cos^(df-2)]
        term, acc = 1.0, 1.0
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            acc += term
        a = s * acc
    a = min(1.0, max(0.0, a))
    return 0.5 + 0.5 * a if x >= 0 else 0.5 - 0.5 * a


def t_ppf(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with integer ``df`` (bisection on ``t_cdf``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
        if hi > 1e12:
            return hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def t_p_two_sided(t: float, df: int) -> float:
    """Two-sided p-value of a t statistic."""
    if math.isnan(t):
        return float("nan")
    return min(1.0, 2.0 * (1.0 - t_cdf(abs(t), df)))


def mde_factor(df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """``t_{1-alpha/2, df} + t_{power, df}``: the true effect, in standard errors, that a two-sided t test at
    ``alpha`` detects with probability ``power`` (5.36 at 2 degrees of freedom, 2.8 for many)."""
    return t_ppf(1.0 - alpha / 2.0, df) + t_ppf(power, df)


def _interval(est: float, se: float, n: int, alpha: float) -> dict:
    df = n - 1
    q = t_ppf(1.0 - alpha / 2.0, df)
    if se > 0:
        p = t_p_two_sided(est / se, df)
    else:
        p = 0.0 if est != 0 else 1.0
    return {"mean": est, "se": se, "n": n, "df": df, "ci": [est - q * se, est + q * se], "p": p,
            "mde": mde_factor(df, alpha) * se}


def paired_t(diffs, alpha: float = ALPHA) -> dict:
    """``{"mean", "se", "n", "df", "ci", "p", "mde"}`` of per-seed paired differences; ``se``, ``ci``, ``p`` and
    ``mde`` are None with fewer than 2 finite values."""
    xs = [float(x) for x in diffs if x is not None and math.isfinite(x)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "se": None, "n": 0, "df": None, "ci": None, "p": None, "mde": None}
    m = sum(xs) / n
    if n < 2:
        return {"mean": m, "se": None, "n": 1, "df": None, "ci": None, "p": None, "mde": None}
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return _interval(m, sd / math.sqrt(n), n, alpha)


def jackknife_t(estimate: float, leave_one_out, alpha: float = ALPHA) -> dict:
    """The ``paired_t`` fields for a nonlinear ``estimate`` from all ``n`` seeds, its standard error from the
    ``n`` leave-one-seed-out estimates (``leave_one_out``). Returns None fields when any of them is not
    finite or ``n < 2``."""
    th = [float(x) if x is not None else float("nan") for x in leave_one_out]
    n = len(th)
    if n < 2 or estimate is None or not math.isfinite(estimate) or not all(math.isfinite(x) for x in th):
        return {"mean": estimate, "se": None, "n": n, "df": None, "ci": None, "p": None, "mde": None}
    tb = sum(th) / n
    se = math.sqrt((n - 1) / n * sum((x - tb) ** 2 for x in th))
    return _interval(float(estimate), se, n, alpha)


def holm(pvalues) -> list:
    """Holm-adjusted p-values in the input order; None entries stay None and do not count in the family."""
    idx = [i for i, p in enumerate(pvalues) if p is not None and not math.isnan(p)]
    m = len(idx)
    out: list = [None] * len(pvalues)
    run = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        run = max(run, min(1.0, (m - rank) * pvalues[i]))
        out[i] = run
    return out


def tost(est: float, se: float, df: int, margin: float) -> float:
    """p-value of the equivalence test ``|effect| < margin`` (two one-sided t tests)."""
    if se is None or not se > 0:
        return 0.0 if abs(est) < margin else 1.0
    p_low = 1.0 - t_cdf((est + margin) / se, df)     # H0: effect <= -margin
    p_high = t_cdf((est - margin) / se, df)          # H0: effect >= +margin
    return max(p_low, p_high)


def outside(est: float, se: float, df: int, margin: float) -> float:
    """p-value of ``the effect lies beyond +-margin`` (two-sided: twice the smaller one-sided p-value)."""
    if se is None or not se > 0:
        return 0.0 if abs(est) > margin else 1.0
    p_above = 1.0 - t_cdf((est - margin) / se, df)   # H0: effect <= +margin
    p_below = t_cdf((est + margin) / se, df)         # H0: effect >= -margin
    return min(1.0, 2.0 * min(p_above, p_below))
