"""The published claims a cooled-down study can test, each judged from the study's own runs.

A claim compares two arms of the study (``arm`` against ``other``), both with finished cooled-down branches at
every budget. Its numbers are those of the study's metric with ``other`` as the reference: ``other``'s
cooled-down points are fitted, ``arm``'s losses inverted to ``other``'s tokens (extra tokens), and the loss gap
``arm - other`` per budget, each with a paired bootstrap interval over seeds and evaluation windows
(``cooldown.summarize_cooldown``). The verdict is read at the largest budget:

* ``more`` ("``arm`` costs more than ``other``"): **supported** when the gap's interval lies above 0,
  **contradicted** when below, else **not resolved**. ``less`` likewise, mirrored. Directions use the loss gap
  in nats, which needs no fit.
* ``not_less`` ("``arm`` does not rescue ``other``"): **contradicted** when ``arm`` is resolved better than
  ``other`` (the gap's interval below 0), else **consistent**.
* ``equal`` ("near-lossless"): **supported** when the extra-token interval lies within +-``MARGIN``,
  **contradicted** when it lies wholly outside, else **not resolved**.

With one seed there is no verdict: the interval covers evaluation-window noise only. Sources: the papers
cited in docs/results.md (NVIDIA: arXiv 2509.25149, whose MXFP4 comparison used a 32-wide random Hadamard and
kept the last blocks in BF16; ``mxfp4-all`` against ``nvfp4`` compares the formats as this project's presets
use them). The AMD paper's claims also match their ``+amd`` scale-rule arms
(``mxfp4-all-dh16+amd`` against ``mxfp4-all+amd``; ``bf16`` and ``fp8`` keep their names), and every claim
matches arms that carry the same further options on both sides (``mxfp4-all-sr@lr1.5e-3`` against
``mxfp4-all@lr1.5e-3``)."""
from __future__ import annotations

from dataclasses import dataclass

from .arms import split

__all__ = ["Claim", "CLAIMS", "MARGIN", "EXPECTS", "claim_pairs", "judge", "evaluate_claims", "claim_lines"]

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
    Claim("amd-wgrad", "AMD", "Wgrad drives MXFP4's cost: MXFP4 on Wgrad alone costs more than on Fprop alone",
          "mxfp4-wgrad", "mxfp4-fprop", "more"),
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


def judge(expect: str, row: dict | None, n_seeds: int, margin: float = MARGIN) -> tuple[str, str]:
    """``(verdict, why)`` for one claim from the largest budget's ``row`` of ``bootstrap_extra_tokens``."""
    if expect not in EXPECTS:
        raise ValueError(f"expect {expect!r}: one of {', '.join(EXPECTS)}")
    if row is None:
        return "no result", "no cooled-down comparison (a run missing or diverged)"
    if n_seeds < 2:
        return "no verdict", "1 seed: the interval covers evaluation-window noise only"
    g = row.get("gap_ci95")
    if expect in ("more", "less", "not_less"):
        if not g:
            return "not resolved", "no interval"
        above, below = g[0] > 0, g[1] < 0
        if expect == "more":
            return ("supported", "loss gap above 0") if above else (
                ("contradicted", "loss gap below 0") if below else ("not resolved", "the gap's interval holds 0"))
        if expect == "less":
            return ("supported", "loss gap below 0") if below else (
                ("contradicted", "loss gap above 0") if above else ("not resolved", "the gap's interval holds 0"))
        return ("contradicted", "resolved better: loss gap below 0") if below else (
            "consistent", "not resolved better: the gap's interval holds 0 or lies above it")
    ci = row.get("ci95")
    if not ci:
        return "not resolved", "no extra-token interval"
    if -margin <= ci[0] and ci[1] <= margin:
        return "supported", f"extra tokens within +-{100 * margin:g} %"
    if ci[0] > margin or ci[1] < -margin:
        return "contradicted", f"extra tokens outside +-{100 * margin:g} %"
    return "not resolved", f"the extra-token interval crosses +-{100 * margin:g} %"


def evaluate_claims(points: dict, arms, budgets: list[float], *, n_boot: int = 1000, fit: str = "lsq",
                    margin: float = MARGIN) -> list[dict]:
    """Every claim of ``CLAIMS`` the study's ``arms`` can test, judged from ``points``
    (``cooldown.load_cooldown_points``): ``[{"claim", "source", "text", "arm", "other", "expect", "verdict",
    "why", "n_seeds", "budgets": [{"budget", "extra", "ci95", "mde", "gap", "gap_ci95", "state"}]}]``."""
    from .cooldown import summarize_cooldown

    out = []
    for c in CLAIMS:
        for a, b in claim_pairs(c, arms):
            if a not in points or b not in points:
                continue
            r = summarize_cooldown({a: points[a], b: points[b]}, b, budgets, n_boot=n_boot, fit=fit)
            e = r["arms"].get(a) or {}
            rows = e.get("budgets") or []
            ok = rows and e.get("state") not in ("no_runs", "diverged")
            verdict, why = judge(c.expect, rows[-1] if ok else None, int(e.get("n_seeds") or 0), margin)
            out.append({"claim": c.key, "source": c.source, "text": c.text, "arm": a, "other": b,
                        "expect": c.expect, "verdict": verdict, "why": why, "n_seeds": int(e.get("n_seeds") or 0),
                        "budgets": [{k: row.get(k) for k in ("budget", "extra", "ci95", "mde", "gap", "gap_ci95",
                                                             "state")} for row in rows]})
    return out


def claim_lines(claims: list[dict]) -> list[str]:
    """One line per tested claim: source, statement, verdict, and the numbers at the largest budget."""
    from .cooldown import _pct

    out = []
    for c in claims:
        row = c["budgets"][-1] if c["budgets"] else None
        nums = ""
        if row:
            g = row.get("gap_ci95")
            gs = f" [{g[0]:+.4f}, {g[1]:+.4f}]" if g else ""
            ci = row.get("ci95")
            xs = (f"{_pct(row['extra'])} extra tokens" + (f" [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else "")
                  if row.get("extra") is not None else "no token equivalent")
            nums = (f": {c['arm']} vs {c['other']} at {100 * row['budget']:.0f} % budget, gap {row['gap']:+.4f} "
                    f"nats{gs}, {xs}, {c['n_seeds']} seed(s)")
        out.append(f"{c['source']}, \"{c['text']}\": {c['verdict'].upper()} ({c['why']}){nums}")
    return out
