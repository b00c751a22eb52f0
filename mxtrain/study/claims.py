"""The published claims a cooled-down study can test, each judged from the study's own runs.

A claim compares two arms of the study (``arm`` against ``other``), both with finished cooled-down branches at
every budget. Its numbers are those of the study's metric with ``other`` as the reference: ``other``'s
cooled-down points are fitted, ``arm``'s losses inverted to ``other``'s tokens (extra tokens), and the loss gap
``arm - other`` per budget, each seed paired with the same seed of ``other``
(``cooldown.paired_extra_tokens``: Student t over the per-seed gaps; the jackknife over seeds for extra
tokens). The verdict is read at the largest budget, from a p-value per claim, **Holm-adjusted over every claim
of the report** (``stats.holm``; family-wise error 0.05):

* ``more`` ("``arm`` costs more than ``other``"): the paired t test of the loss gap (two-sided). **supported**
  when the adjusted p is below 0.05 and the gap is above 0, **contradicted** when below 0, else **not
  resolved**. ``less`` likewise, mirrored. Directions use the loss gap in nats, which needs no fit.
* ``not_less`` ("``arm`` does not rescue ``other``"): **contradicted** when ``arm`` is resolved better than
  ``other`` (adjusted p below 0.05, gap below 0), else **consistent**.
* ``equal`` ("near-lossless"): an equivalence test (TOST, ``stats.tost``) of the extra tokens against
  +-``MARGIN`` with the jackknife standard error: **supported** when its adjusted p is below 0.05 (the 90 %
  interval inside +-5 %); **contradicted** when the mirror test (``stats.outside``) resolves the effect beyond
  the margin; else **not resolved**. An interval that merely holds 0 never supports it.

No verdict with fewer than ``cooldown.MIN_SEEDS`` seeds, nor from runs below the scale of
``cooldown.verdict_scale`` (a smoke study reports numbers, not verdicts on papers). Sources: the papers
cited in docs/results.md (NVIDIA: arXiv 2509.25149, whose MXFP4 comparison used a 32-wide random Hadamard and
kept the last blocks in BF16; ``mxfp4-all`` against ``nvfp4`` compares the formats as this project's presets
use them; UFP4: Zhao et al., arXiv 2606.20381, whose ``ufp4`` differs from ``mxfp4-all-rht16`` in the grid and
dY's rounding only; Four over Six: Cook et al., arXiv 2512.02010; Mishra, Stosic and Layton, arXiv 2506.08027,
whose round-up rule (``rceil``) was shown on MXFP8 and is judged here on MXFP4; AMD: arXiv 2605.09825, whose Wgrad claim rests on a cumulative ladder, Fprop, then +Dgrad, then
+Wgrad, so it is judged as the ladder's last step, ``mxfp4-all`` against ``mxfp4-fprop-dgrad``). The AMD
paper's claims also match their ``+amd`` scale-rule arms (``mxfp4-all-dh16+amd`` against ``mxfp4-all+amd``;
``bf16`` and ``fp8`` keep their names), and every claim matches arms that carry the same further options on
both sides (``mxfp4-all-sr@lr1.5e-3`` against ``mxfp4-all@lr1.5e-3``)."""
from __future__ import annotations

from dataclasses import dataclass

from .arms import split
from .stats import outside, tost, holm
from .cooldown import MIN_SEEDS, summarize_cooldown, verdict_scale, _p, _pct, seeds_text

__all__ = ["Claim", "CLAIMS", "MARGIN", "EXPECTS", "claim_pairs", "claim_p", "judge", "evaluate_claims", "claim_lines"]

MARGIN = 0.05   # "near-lossless": within 5 % extra tokens either way
EXPECTS = ("more", "less", "not_less", "equal")


@dataclass(frozen=True)
class Claim:
    key: str
    source: str
    text: str
    arm: str
    other: str
    expect: str


CLAIMS: tuple[Claim, ...] = (
    Claim("amd-wgrad", "AMD", "the Wgrad step of the cumulative ladder (Fprop, +Dgrad, +Wgrad) adds to MXFP4's "
          "cost: all three GEMMs cost more than Fprop and Dgrad", "mxfp4-all", "mxfp4-fprop-dgrad", "more"),
    Claim("quartet-forward", "Quartet II", "the forward pass carries most of the gap: MXFP4 on Fprop alone costs "
          "more than on Dgrad and Wgrad together", "mxfp4-fprop", "mxfp4-bwd", "more"),
    Claim("quartet-rtn", "Quartet II", "round-to-nearest beats SR in the MXFP4 backward", "mxfp4-bwd-sr",
          "mxfp4-bwd", "more"),
    Claim("amd-sr", "AMD", "stochastic rounding does not rescue MXFP4 on all three GEMMs", "mxfp4-all-sr",
          "mxfp4-all", "not_less"),
    Claim("amd-rht", "AMD", "a random Hadamard rotation (16) does not rescue MXFP4 on all three GEMMs",
          "mxfp4-all-rht16", "mxfp4-all", "not_less"),
    Claim("amd-dh16", "AMD", "the deterministic Hadamard rotation (H16) lowers MXFP4's cost", "mxfp4-all-dh16",
          "mxfp4-all", "less"),
    Claim("amd-dh16-rht", "AMD", "the deterministic H16 costs less than a random H16", "mxfp4-all-dh16",
          "mxfp4-all-rht16", "less"),
    Claim("amd-fp8", "AMD", "per-tensor FP8 (the paper's baseline) is near-lossless against BF16", "fp8", "bf16",
          "equal"),
    Claim("tseng", "Tseng et al.", "SR with a random Hadamard rotation in the backward is near-lossless against "
          "BF16", "tseng", "bf16", "equal"),
    Claim("alto", "ALTO", "weight de-oscillation lowers MXFP4's cost", "mxfp4-all@deosc", "mxfp4-all", "less"),
    Claim("nvidia-fp8", "NVIDIA", "NVFP4 with its recipe trains close to the FP8 baseline (validation loss within "
          "1.5 % relative at 12B)", "nvfp4", "fp8", "equal"),
    Claim("nvidia-mxfp4", "NVIDIA", "MXFP4 needs more tokens than NVFP4 to reach the same loss (36 % more at 8B)",
          "mxfp4-all", "nvfp4", "more"),
    Claim("ufp4", "UFP4", "a uniform 4-bit grid (UFP4: random H16 on all three GEMMs, SR on dY) costs less than "
          "E2M1's MXFP4", "ufp4", "mxfp4-all", "less"),
    Claim("ufp4-grid", "UFP4", "under the same random H16 rotation the uniform grid costs less than E2M1, whose "
          "shrinkage bias the rotation amplifies", "ufp4", "mxfp4-all-rht16", "less"),
    Claim("4over6", "Four over Six", "scaling each block's maximum to 4 or to 6, whichever errs less, lowers "
          "NVFP4's cost", "nvfp4-4over6", "nvfp4", "less"),
    Claim("rceil", "Mishra et al.", "block scales rounded up instead of OCP's floor train MX formats better "
          "(shown for MXFP8; judged here on MXFP4)", "mxfp4-all+rceil", "mxfp4-all", "less"),
)
_BASELINES = ("bf16", "fp8")


def _parse(arm: str) -> tuple[str, frozenset]:
    recipe, opts = split(arm)
    return recipe, frozenset(opts)


def claim_pairs(claim: Claim, arms) -> list[tuple[str, str]]:
    """The ``(arm, other)`` pairs of the study's arms that test ``claim``: its own names; for the AMD paper's
    claims the ``+amd`` scale-rule variants (``X+amd``; BF16 and FP8 unchanged); and either of those with the
    same further training options on both sides (``mxfp4-all-sr@lr1.5e-3`` against ``mxfp4-all@lr1.5e-3``:
    the claim judged at another learning rate), whatever the order the options are written in."""
    arms = list(dict.fromkeys(arms))
    parsed = {a: _parse(a) for a in arms}
    bases = [(claim.arm, claim.other)]
    if claim.source == "AMD":
        a = claim.arm if claim.arm in _BASELINES else claim.arm + "+amd"
        b = claim.other if claim.other in _BASELINES else claim.other + "+amd"
        if (a, b) != (claim.arm, claim.other):
            bases.append((a, b))
    out: list[tuple[str, str]] = []
    for a, b in bases:
        (ra, oa), (rb, ob) = _parse(a), _parse(b)
        # the plain pair first, then each set of further options both sides carry
        extras = [frozenset()] + sorted({o - oa for r, o in parsed.values() if r == ra and o > oa}, key=sorted)
        for extra in extras:
            x = next((k for k, v in parsed.items() if v == (ra, oa | extra)), None)
            y = next((k for k, v in parsed.items() if v == (rb, ob | extra)), None)
            if x is not None and y is not None and (x, y) not in out:
                out.append((x, y))
    return out


def claim_p(expect: str, row: dict | None, df: int | None, margin: float = MARGIN) -> float | None:
    """The claim's p-value before correction: the paired t test of the loss gap for the directional claims;
    for ``equal`` the smaller of the equivalence test's (TOST) and the beyond-the-margin test's (only one of
    them can be small). None without a test (no row, no standard error, fewer than 2 seeds)."""
    if row is None or not df:
        return None
    if expect != "equal":
        return row.get("gap_p")
    if row.get("extra") is None or row.get("se") is None:
        return None
    return min(tost(row["extra"], row["se"], df, margin), outside(row["extra"], row["se"], df, margin))


def judge(expect: str, row: dict | None, n_seeds: int, margin: float = MARGIN, p_adj: float | None = None,
          small: str | None = None, alpha: float = 0.05) -> tuple[str, str]:
    """``(verdict, why)`` for one claim from the largest budget's ``row`` of ``paired_extra_tokens``.
    ``p_adj``: the claim's Holm-adjusted p-value (default: its own, uncorrected); ``small``: why the runs are
    too small for a verdict (``cooldown.verdict_scale``)."""

    if expect not in EXPECTS:
        raise ValueError(f"expect {expect!r}: one of {', '.join(EXPECTS)}")
    if row is None:
        return "no result", "no cooled-down comparison (a run missing or diverged)"
    if n_seeds < MIN_SEEDS:
        return "no verdict", (f"{n_seeds} seed{'' if n_seeds == 1 else 's'}, below the {MIN_SEEDS} a verdict needs"
                              + (": the interval covers evaluation-window noise only" if n_seeds < 2 else ""))
    if small:
        return "no verdict", small
    p = p_adj if p_adj is not None else claim_p(expect, row, n_seeds - 1, margin)
    if p is None:
        return "not resolved", "no test (no standard error)"
    if expect in ("more", "less", "not_less"):
        res = p < alpha and row.get("gap") is not None and row["gap"] != 0
        above, below = res and row["gap"] > 0, res and row["gap"] < 0
        if expect == "more":
            return ("supported", "loss gap above 0") if above else (
                ("contradicted", "loss gap below 0") if below else ("not resolved", "the gap is not resolved from 0"))
        if expect == "less":
            return ("supported", "loss gap below 0") if below else (
                ("contradicted", "loss gap above 0") if above else ("not resolved", "the gap is not resolved from 0"))
        return ("contradicted", "resolved better: loss gap below 0") if below else (
            "consistent", "not resolved better")
    e, se, df = row["extra"], row["se"], n_seeds - 1
    equiv = tost(e, se, df, margin) <= outside(e, se, df, margin)
    if p < alpha and equiv:
        return "supported", f"equivalent within +-{100 * margin:g} % extra tokens (TOST)"
    if p < alpha:
        return "contradicted", f"extra tokens resolved beyond +-{100 * margin:g} %"
    return "not resolved", f"neither equivalent within +-{100 * margin:g} % (TOST) nor resolved beyond it"


def evaluate_claims(points: dict, arms, budgets: list[float], *, n_boot: int = 1000, fit: str = "lsq",
                    margin: float = MARGIN, scale: dict | None = None) -> list[dict]:
    """Every claim of ``CLAIMS`` the study's ``arms`` can test, judged from ``points``
    (``cooldown.load_cooldown_points``) with Holm's correction over all of them: ``[{"claim", "source", "text",
    "arm", "other", "expect", "verdict", "why", "n_seeds", "p", "p_holm", "family", "own_tokens",
    "budgets": [{"budget", "extra", "ci95", "se", "mde", "gap", "gap_seeds", "gap_ci95", "gap_p", "state",
    "extrapolated"}]}]``. ``scale``: ``{"params", "tokens"}`` of the runs (``cooldown.verdict_scale``); None:
    not checked."""

    small = verdict_scale(scale.get("params"), scale.get("tokens")) if scale is not None else None
    out, rows_of = [], []
    for c in CLAIMS:
        for a, b in claim_pairs(c, arms):
            if a not in points or b not in points:
                continue
            r = summarize_cooldown({a: points[a], b: points[b]}, b, budgets, n_boot=n_boot, fit=fit)
            e = r["arms"].get(a) or {}
            rows = e.get("budgets") or []
            ok = rows and e.get("state") not in ("no_runs", "diverged")
            n = int(e.get("n_seeds") or 0)
            row = rows[-1] if ok else None
            p = claim_p(c.expect, row, n - 1 if n >= 2 else None, margin)
            out.append({"claim": c.key, "source": c.source, "text": c.text, "arm": a, "other": b,
                        "expect": c.expect, "n_seeds": n, "p": p, "own_tokens": e.get("own_tokens"),
                        "fit_exact": e.get("fit_exact"),
                        "budgets": [{k: row.get(k) for k in ("budget", "extra", "ci95", "se", "mde", "gap", "gap_seeds",
                                                             "gap_ci95", "gap_p", "state", "extrapolated")}
                                    for row in rows]})
            rows_of.append(row)
    # the family: the claims that can get a verdict here
    fam = [i for i, c in enumerate(out) if c["p"] is not None and c["n_seeds"] >= MIN_SEEDS and not small]
    adj = holm([out[i]["p"] for i in fam])
    for c in out:
        c["p_holm"], c["family"] = None, len(fam)
    for i, q in zip(fam, adj):
        out[i]["p_holm"] = q
    for c, row in zip(out, rows_of):
        c["verdict"], c["why"] = judge(c["expect"], row, c["n_seeds"], margin, p_adj=c["p_holm"], small=small)
    return out


def claim_lines(claims: list[dict]) -> list[str]:
    """One line per tested claim: source, statement, verdict, and the numbers at the largest budget: the loss gap
    with its seed-level 95 % interval and each seed's gap, the extra tokens (flagged where they extrapolate the
    fit), AMD's own-tokens metric, the p-value and its Holm adjustment."""

    out = []
    for c in claims:
        row = c["budgets"][-1] if c["budgets"] else None
        nums = ""
        if row:
            g = row.get("gap_ci95")
            gs = f" [{g[0]:+.4f}, {g[1]:+.4f}]" if g else ""
            ci = row.get("ci95")
            xs = (f"{_pct(row['extra'])} extra tokens" + (f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else "")
                  + (" (extrapolated beyond the largest budget)" if row.get("extrapolated") else "")
                  if row.get("extra") is not None else "no token equivalent")
            own = c.get("own_tokens") or {}
            os_ = ""
            if own:
                os_ = ("; own tokens to the reference's final loss: "
                       + ("beyond the run" if own["state"] == "beyond_run" else
                          f"at most {_pct(own['extra'])}" if own["state"] == "before_first_budget"
                          else _pct(own["extra"])))
            ps = ""
            if c.get("p") is not None:
                ps = f"; p {_p(c['p'])}" + (f", Holm over {c['family']}: {_p(c['p_holm'])}"
                                            if c.get("p_holm") is not None else "")
            nums = (f": {c['arm']} vs {c['other']} at {100 * row['budget']:.0f} % budget, gap {row['gap']:+.4f} "
                    f"nats{gs} (seeds {seeds_text(row)}), {xs}{os_}{ps}, {c['n_seeds']} seed(s)")
        out.append(f"{c['source']}, \"{c['text']}\": {c['verdict'].upper()} ({c['why']}){nums}")
    return out
