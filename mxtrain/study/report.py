"""Reports: ``mxtrain report DIR`` for a study (``DIR/runs/<arm>/seed<k>``) or a single run folder.

Writes ``DIR/report.html`` (self-contained: plots are PNGs embedded as base64, no scripts, opens
offline) and ``DIR/report.md`` (plots saved next to it under ``DIR/report_files/``).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import platform
import re
from datetime import datetime, timezone
from pathlib import Path

from ..errors import read_json_object
from . import arms as A
from . import diagnostics as D
from . import metrics as M, cooldown as C
from ..numerics import recipes as R
from .. import settings as S
from .cooldown import verdict_lines
from ..train.checkpoint import write_atomic   # each file whole or not at all: a full disk keeps the old one

__all__ = ["write_report", "recipe_brief", "arm_table_rows", "arm_colors", "cooldown_table_rows", "budget_gap_rows",
           "source_table_rows",
           "reference_table_rows"]

_OPS = (("fprop", "fprop_x", "fprop_w"), ("dgrad", "dgrad_dy", "dgrad_w"), ("wgrad", "wgrad_dy", "wgrad_x"))


# ----------------------------------------------------------------------------------------------
# formatting helpers


def _f(x, nd=4):
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _pct(x, nd=1):
    if x is None:
        return "–"
    v = 100 * x
    return f"{0.0 if abs(v) < 0.5 * 10 ** -nd else v:+.{nd}f} %"   # no "-0.0 %"


def _ci(d: dict, fmt=_f) -> str:
    if not d or d.get("mean") is None:
        return "–"
    s = fmt(d["mean"])
    if d.get("ci95"):
        lo, hi = d["ci95"]
        s += f" [{fmt(lo)}, {fmt(hi)}]"
    return s


def recipe_brief(r) -> str:
    """One short line for a recipe dict (``Recipe.to_dict()``) or name."""
    if r is None:
        return "?"
    if isinstance(r, str):
        return r
    parts = []
    for gemm, a, b in _OPS:
        oa, ob = r.get(a) or {}, r.get(b) or {}
        fa, fb = oa.get("fmt", "bf16"), ob.get("fmt", "bf16")
        if fa == "bf16" and fb == "bf16":
            continue
        fm = fa if fa == fb else f"{fa}/{fb}"
        tags = []
        sr = [n.split("_", 1)[1] for n, o in ((a, oa), (b, ob)) if o.get("rounding") == "stochastic"]
        if sr:
            tags.append("SR " + "+".join(sr))
        if oa.get("prescale", 1.0) != 1.0 or ob.get("prescale", 1.0) != 1.0:
            tags.append(f"x{oa.get('prescale', 1.0):g}")
        rot = r.get(f"{gemm}_rotation") or {}
        if rot.get("size"):
            tags.append(f"H{rot['size']}{'' if rot.get('signs') == 'none' else '/' + str(rot.get('signs'))}")
        rules = {o.get("scale_rule") for o in (oa, ob) if o.get("fmt", "bf16") != "bf16"} - {"floor", None}
        if rules:
            tags.append("scale " + "/".join(sorted(rules)))
        parts.append(f"{gemm[0].upper()}:{fm}" + (f" ({', '.join(tags)})" if tags else ""))
    keep = []
    if r.get("keep_first"):
        keep.append(f"first {r['keep_first']} HP")
    if r.get("keep_last"):
        keep.append(f"last {r['keep_last']} HP")
    return ("; ".join(parts) or "high precision") + (f"; {', '.join(keep)}" if keep else "")


def _extra_cell(e: dict) -> str:
    st = e.get("state")
    if st == "baseline":
        return "reference" + (" (a seed did not reach the target)" if e.get("reason") else "")
    if st == "ok":
        return _ci(e, _pct)
    if st == "diverged":
        return "diverged"
    if st == "did_not_reach":
        lb = e.get("lower_bound")
        return "did not reach" + (f" (> {_pct(lb)})" if lb is not None else "")
    return (st or "–").replace("_", " ")


def arm_table_rows(summary: dict) -> list[list[str]]:
    """Rows of the extra-token table (header first)."""
    head = ["arm", "quantized GEMMs / interventions", "seeds", "extra tokens to target (mean [95% CI])",
            "final val loss", "final gap vs baseline", "paired Δ, 2nd half", "diverged"]
    rows = [head]
    for name, a in summary["arms"].items():
        div = sum(1 for v in a["diverged"].values() if v)
        brief = recipe_brief(a.get("recipe"))
        opts = A.describe_options(name)
        rows.append([name, brief + (f"; + {opts}" if opts else ""), str(len(a["seeds"])),
                     _extra_cell(a["extra_tokens"]),
                     _ci(a["final_val_loss"]), _ci(a["final_gap_vs_baseline"], lambda x: f"{x:+.4f}"),
                     _ci(a["paired_diff"]["second_half"], lambda x: f"{x:+.4f}"), f"{div}/{len(a['seeds'])}"])
    return rows


def reference_table_rows(summary: dict, ref: str) -> list[list[str]]:
    """Rows (header first) of every arm against a further reference arm ``ref`` (``summary["references"]``)."""
    c = (summary.get("references") or {}).get(ref) or {}
    rows = [["arm", f"extra tokens to {ref}'s target (mean [95% CI])", f"final gap vs {ref}",
             f"paired Δ vs {ref}, 2nd half"]]
    for name, a in (c.get("arms") or {}).items():
        rows.append([name, _extra_cell(a["extra_tokens"]), _ci(a["final_gap"], lambda x: f"{x:+.4f}"),
                     _ci(a["second_half"], lambda x: f"{x:+.4f}")])
    return rows


def _noise_lines(summary: dict) -> list[str]:
    """Effects next to seed-to-seed spread, one sentence per arm."""
    base = summary["arms"][summary["baseline"]]
    bs = base["seed_spread"]
    out = []
    sd_f, rel_t = bs.get("final_val_loss_sd"), bs.get("tokens_to_target_rel_sd")
    out.append(f"Baseline seed-to-seed spread ({bs['n']} seeds): s.d. of final val loss "
               f"{_f(sd_f)} nats; s.d. of tokens-to-target {('–' if rel_t is None else f'{100 * rel_t:.1f} %')} "
               f"of its mean. An effect smaller than about twice these is not resolved by this study.")
    for name, a in summary["arms"].items():
        if name == summary["baseline"]:
            continue
        g = a["final_gap_vs_baseline"].get("mean")
        e = a["extra_tokens"]
        bits = []
        if g is not None and sd_f:
            bits.append(f"final-loss gap {g:+.4f} nats = {g / sd_f:+.1f} x the baseline's seed s.d.")
        elif g is not None:
            bits.append(f"final-loss gap {g:+.4f} nats (seed s.d. unknown: one seed)")
        if e.get("state") == "ok" and e.get("mean") is not None and rel_t:
            bits.append(f"extra tokens {_pct(e['mean'])} = {e['mean'] / rel_t:+.1f} x the baseline's tokens-to-target s.d.")
        elif e.get("state") != "ok":
            bits.append(f"extra tokens: {_extra_cell(e)}")
        ci = a["final_gap_vs_baseline"].get("ci95")
        if ci is not None:
            bits.append("paired CI excludes 0" if (ci[0] > 0 or ci[1] < 0) else "paired CI includes 0")
        out.append(f"{name}: " + "; ".join(bits) + ".")
    return out


# ----------------------------------------------------------------------------------------------
# plots


def _plt():
    import matplotlib  # optional
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional
    return plt


PLOTS_MISSING = ("figures left out: matplotlib is not installed (pip install 'mxtrain[plots]', then `mxtrain report "
                 "FOLDER` draws them); the tables are complete")


def plots_available() -> bool:
    """Whether matplotlib can be imported (the ``plots`` extra); without it reports have tables only."""
    try:
        import matplotlib  # optional  # noqa: F401
    except ImportError:
        return False
    return True


def tokens_label(v: float) -> str:
    """A token count as a short tick label: 51.2k, 1.5M, 2B (six-digit counts ran together on a run's axis)."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.4g}{unit}"
    return f"{v:.4g}"


def _tokens_axes(fig) -> None:
    """Every x axis of ``fig`` that counts tokens: at most 6 ticks, labelled ``tokens_label``."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator  # optional
    for ax in fig.axes:
        if ax.get_xlabel().startswith("tokens"):
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: tokens_label(v)))


def _png(fig) -> bytes:
    _tokens_axes(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


# one colour per arm in every figure: the study's arm order (summary, then any other arm) picks from this list
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#7f7f7f", "#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173", "#3182bd"]


def _extra_color(i: int, taken: set[str]) -> str:
    """The colour of arm ``i`` past the palette: hues a golden angle apart, lightness alternating, none taken."""
    import colorsys
    j = i
    while True:
        h = (j * 0.6180339887498949) % 1.0
        light = (0.38, 0.55, 0.30)[j % 3]
        r, g, b = colorsys.hls_to_rgb(h, light, 0.8)
        c = f"#{round(255 * r):02x}{round(255 * g):02x}{round(255 * b):02x}"
        if c not in taken:
            return c
        j += 1


def arm_colors(*arm_lists) -> dict[str, str]:
    """The fixed arm -> colour map of a report: arms in the order first seen over ``arm_lists`` (the summary's
    arms first), each its own colour (the palette's, then generated ones for studies of more arms); every plot of
    the report uses this one map."""
    out: dict[str, str] = {}
    for arms in arm_lists:
        for a in arms or []:
            if a not in out:
                n = len(out)
                out[a] = _PALETTE[n] if n < len(_PALETTE) else _extra_color(n, set(out.values()))
    return out


_LEGEND_INSIDE = 8   # legend entries a panel holds inside itself; more go below the figure


def _legend(fig, ax, fontsize: int = 9) -> bool:
    """The panel's legend: inside it for a few entries; for many (a study of many arms) one legend below the
    figure, in columns, where it hides no curve. Returns True when it went below."""
    h, lab = ax.get_legend_handles_labels()
    if not h:   # nothing labelled (e.g. a run with one logged step): no legend, and no matplotlib warning (#47)
        return False
    if len(h) <= _LEGEND_INSIDE:
        ax.legend(fontsize=fontsize)
        return False
    fig.legend(h, lab, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4 if len(h) > 12 else 3,
               fontsize=fontsize, frameon=False)
    return True


def _ls(colors: dict[str, str], arm: str) -> str:
    """Line style of an arm: solid for the palette's arms, dashed (then dotted) past it, so that arms with
    similar generated colours still differ in every line plot."""
    idx = list(colors).index(arm) if arm in colors else 0
    return ("-", "--", ":")[(idx // len(_PALETTE)) % 3]


def _curve_plot(runs: dict[str, dict[int, M.RunData]], summary: dict | None, k: int,
                colors: dict[str, str] | None = None) -> bytes:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = colors or arm_colors(list(runs))
    for i, (arm, rs) in enumerate(runs.items()):
        c = colors.get(arm, _PALETTE[i % len(_PALETTE)])
        curves = [M.smooth(*rd.finite_evals[:2], k) for rd in rs.values() if rd.finite_evals[0]]
        if not curves:
            continue
        n = min(len(t) for t, _ in curves)
        t = [sum(cv[0][j] for cv in curves) / len(curves) for j in range(n)]
        ys = [[cv[1][j] for cv in curves] for j in range(n)]
        mean = [sum(y) / len(y) for y in ys]
        for ax in axes:
            ax.plot(t, mean, color=c, ls=_ls(colors, arm),
                    label=f"{arm} ({len(curves)} seed{'s' if len(curves) != 1 else ''})")
            if len(curves) > 1:
                ax.fill_between(t, [min(y) for y in ys], [max(y) for y in ys], color=c, alpha=0.2)
        if n > 1 and t[n // 2] < t[-1]:
            lo = min(mean[n // 2:])
            hi = max(mean[n // 2:])
            axes[1].set_xlim(t[n // 2], t[-1])
            axes[1]._ylim = (min(getattr(axes[1], "_ylim", (lo, hi))[0], lo), max(getattr(axes[1], "_ylim", (lo, hi))[1], hi))
    if hasattr(axes[1], "_ylim"):
        lo, hi = axes[1]._ylim
        pad = 0.1 * (hi - lo) + 1e-3
        axes[1].set_ylim(lo - pad, hi + pad)
    for ax, title in zip(axes, ("validation loss (smoothed, band = seed min..max)", "second half, zoomed")):
        if summary and summary.get("target_loss") is not None:
            ax.axhline(summary["target_loss"], color="k", ls=":", lw=1, label="target")
        ax.set_xlabel("tokens")
        ax.set_ylabel("val loss")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    _legend(fig, axes[0])
    return _png(fig)


def _diff_plot(summary: dict, colors: dict[str, str] | None = None) -> bytes | None:
    plt = _plt()
    arms = [(n, a) for n, a in summary["arms"].items() if n != summary["baseline"] and a["paired_diff"]["steps"]]
    if not arms:
        return None
    colors = colors or arm_colors(list(summary["arms"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n, a in arms:
        pd = a["paired_diff"]
        x = pd["tokens"] if all(v is not None for v in pd["tokens"]) else pd["steps"]
        ax.plot(x, pd["mean"], label=n, color=colors.get(n), ls=_ls(colors, n))
        if all(v is not None for v in pd["ci_lo"]):
            ax.fill_between(x, pd["ci_lo"], pd["ci_hi"], alpha=0.2, color=colors.get(n))
    ax.axhline(0, color="k", lw=1)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"val loss - {summary['baseline']} (same seed)")
    ax.set_title("paired per-evaluation differences vs baseline (band: 95% CI over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    return _png(fig)


def _cooldown_plot(cool: dict, colors: dict[str, str]) -> bytes | None:
    """Left: every arm's cooled-down loss per budget (seed mean) and the baseline's fitted L(D) = E + B D^-beta;
    right: extra tokens per budget with seed-level 95 % intervals (jackknife-t). Colours: the report's arm map."""
    import numpy as np

    arms = {n: a for n, a in (cool.get("arms") or {}).items() if a.get("budgets")}
    if not arms:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    base = cool.get("baseline")
    nb = len(arms)
    any_extra = False
    for i, (n, a) in enumerate(arms.items()):
        c = colors.get(n)
        rows = a["budgets"]
        t = [r["tokens"] for r in rows]
        axes[0].plot(t, [r["loss"] for r in rows], marker="o", ls="" if n == base else _ls(colors, n), color=c,
                     label=f"{n} ({a.get('n_seeds')} seed{'' if a.get('n_seeds') == 1 else 's'})")
        if n != base:
            # small horizontal offsets keep overlapping intervals apart
            off = [x * (1 + 0.015 * (i - nb / 2)) for x in t]
            ys = [100 * r["extra"] if r.get("extra") is not None else float("nan") for r in rows]
            lo = [y - 100 * r["ci95"][0] if r.get("ci95") and r.get("extra") is not None else 0 for y, r in zip(ys, rows)]
            hi = [100 * r["ci95"][1] - y if r.get("ci95") and r.get("extra") is not None else 0 for y, r in zip(ys, rows)]
            if any(y == y for y in ys):  # not all NaN
                any_extra = True
                axes[1].errorbar(off, ys, yerr=[lo, hi], marker="o", capsize=4, color=c, label=n)
    fit = cool.get("fit")
    if fit:
        tt = [r["tokens"] for r in arms[base]["budgets"]] if base in arms else []
        if tt:
            xs = np.geomspace(min(tt) * 0.8, max(tt) * 1.25, 100)
            axes[0].plot(xs, C.power_law(fit, xs), color=colors.get(base), lw=1.5, alpha=0.8,
                         label=f"{base} fit: {fit['E']:.3f} + B D^-{fit['beta']:.2f}")
    axes[1].axhline(0, color="k", lw=1)
    if not any_extra:  # e.g. too few budgets or seeds for the baseline's fit: say so instead of an empty plot
        axes[1].text(0.5, 0.5, "no extra-token estimate:\nthe baseline's L(D) fit needs at least 3 budgets",
                     ha="center", va="center", transform=axes[1].transAxes, fontsize=10)
    for ax in (axes if any_extra else axes[:1]):
        ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
    # a few arms: each panel its legend; many: one below the figure (the colours are the same in both panels)
    if not _legend(fig, axes[0]) and any_extra:
        axes[1].legend(fontsize=9)
    for ax in axes:
        ax.set_xlabel("tokens (end of the cooldown branch)")
    axes[0].set_ylabel("cooled-down val loss")
    axes[0].set_title("cooled-down loss per budget (seed mean)\nand the baseline's power-law fit", fontsize=10)
    axes[1].set_ylabel("extra tokens vs baseline (%)")
    axes[1].set_title("extra tokens D / D_equiv - 1\n(bars: 95 % seed-level interval, jackknife over seeds, t)",
                      fontsize=10)
    return _png(fig)


def source_table_rows(cool: dict) -> list[list[str]] | None:
    """The cooled-down gap to the baseline by validation source (the corpus's domains) at the largest budget:
    one row per arm, one column per source (``summary["cooldown"]["by_source"]``), or None."""
    by = (cool.get("by_source") or {}).get("arms") or {}
    if not by:
        return None
    names = sorted({n for a in by.values() for n in a})
    rows = [["arm"] + [f"{n} (windows)" for n in names] + ["seeds"]]
    for arm, d in by.items():
        cells = [f"{d[n]['gap']:+.4f} ({d[n]['n_windows']})" if n in d else "–" for n in names]
        rows.append([arm] + cells + [str(max(v["n_seeds"] for v in d.values()))])
    return rows


def budget_gap_rows(cool: dict) -> list[list[str]] | None:
    """Paired gaps per budget over every seed with that branch (``summary["cooldown"]["by_budget"]``): one row
    per arm, one column per budget (mean gap, then each seed's), or None when they add nothing to the
    cooled-down table (every arm's seeds at every budget are the ones its intervals used)."""
    by = cool.get("by_budget") or {}
    arms = cool.get("arms") or {}
    if not by or all(r["n_seeds"] == len((arms.get(a) or {}).get("seeds") or []) for a, rows in by.items()
                     for r in rows):
        return None
    budgets = [r["budget"] for r in next(iter(by.values()))]
    out = [["arm"] + [f"{100 * b:.0f} %: mean gap (seeds: each)" for b in budgets]]
    for arm, rows in by.items():
        cells = []
        for r in rows:
            if not r["gaps"]:
                cells.append("–")
                continue
            each = ", ".join(f"{s}: {g:+.4f}" for s, g in sorted(r["gaps"].items(), key=lambda kv: int(kv[0])))
            cells.append(f"{r['mean']:+.4f} ({each})")
        out.append([arm] + cells)
    return out


def cooldown_table_rows(cool: dict) -> list[list[str]]:
    """The cooled-down table: per arm and budget, tokens, loss, the gap vs baseline with its seed-level 95 % t
    interval and each seed's gap, the extra tokens with their jackknife-t interval (flagged where they
    extrapolate the fit), the smallest detectable effect ((t_0.975 + t_0.80) x s.e.) and the evaluation-window
    s.e. (the part more windows would remove)."""
    rows = [["arm", "budget", "tokens", "cooled-down val loss", "gap vs baseline [95 % CI] (each seed)",
             "extra tokens [95 % CI]", "detectable effect", "window s.e.", "seeds x windows"]]
    for n, a in (cool.get("arms") or {}).items():
        if not a.get("budgets"):
            rows.append([n, "–", "–", "–", "–", str(a.get("state", "no runs")).replace("_", " "), "–", "–", "–"])
            continue
        for r in a["budgets"]:
            g = r.get("gap_ci95")
            ci = r.get("ci95")
            base = n == cool.get("baseline")
            if base:
                extra = "reference"
            elif r.get("state") != "ok":
                extra = "below the baseline's floor" if r.get("state") == "below_floor" else "no fit"
            else:
                extra = f"{_pct(r['extra'])} [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else _pct(r["extra"])
                if r.get("extrapolated"):
                    extra += " (extrapolated)"
            each = ", ".join(f"{x:+.4f}" for x in r.get("gap_seeds") or [])
            gap = (f"{r['gap']:+.4f} [{g[0]:+.4f}, {g[1]:+.4f}]" if g else f"{r['gap']:+.4f}") + (f" ({each})" if each else "")
            rows.append([n, f"{100 * r['budget']:.0f} %" if r.get("budget") is not None else "–",
                         f"{r['tokens']:,.0f}", _f(r["loss"]), "–" if base else gap,
                         extra, "–" if base or r.get("mde") is None else _pct(r["mde"]).lstrip("+"),
                         "–" if base or r.get("eval_se") is None else _pct(r["eval_se"]).lstrip("+"),
                         f"{a.get('n_seeds')} x {a.get('n_windows')}"])
    return rows


ZERO_BLOCK_EXP = -127   # the E8M0 exponent of an all-zero MX block (no magnitude to scale)


def hist_range(hists: list[dict], min_share: float = 1e-3) -> tuple[int, int, float, float] | None:
    """The populated range ``(lo, hi, share outside, share of all-zero blocks)`` of block-scale exponent
    histograms (``{exp: count}``): the exponents holding at least ``min_share`` of some histogram's blocks, so
    that a few stray blocks do not stretch the axis, and never the all-zero blocks (E8M0 codes them as
    2^-127, far from every real scale). The two shares are the largest over the histograms. None when there
    is nothing to plot."""
    keep: set[int] = set()
    for h in hists:
        tot = sum(h.values())
        keep |= {int(e) for e, c in h.items() if tot and c / tot >= min_share and int(e) != ZERO_BLOCK_EXP}
    if not keep:
        return None
    lo, hi = min(keep), max(keep)
    out = zero = 0.0
    for h in hists:
        tot = max(1, sum(h.values()))
        out = max(out, sum(c for e, c in h.items() if not lo <= int(e) <= hi and int(e) != ZERO_BLOCK_EXP) / tot)
        zero = max(zero, h.get(str(ZERO_BLOCK_EXP), 0) / tot)
    return lo, hi, out, zero


def _diag_plots(aggs: dict[str, dict], colors: dict[str, str] | None = None) -> list[tuple[str, bytes]]:
    """Diagnostics plots across arms, each arm in its report colour: output cosine, rel. error/bias and dW
    error correlation by GEMM (line style); operand SQNR, clip and underflow rates; block-scale exponent
    histograms, one panel per operand, clipped to the populated range."""
    plt = _plt()
    from matplotlib.lines import Line2D  # optional
    from matplotlib.ticker import MaxNLocator  # optional
    aggs = {k: v for k, v in aggs.items() if v.get("steps")}
    if not aggs:
        return []
    out = []
    colors = colors or arm_colors(list(aggs))
    styles = {g: ls for g, ls in zip(("fprop", "dgrad", "wgrad"), ("-", "--", ":"))}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.3))
    for ai, (arm, ag) in enumerate(aggs.items()):
        for ax, (m, title) in zip(axes, (("rel_err", "GEMM output rel. error ||Q-H||/||H||"),
                                         ("rel_bias", "GEMM output rel. bias <Q-H,H>/<H,H>"),
                                         ("cos", "GEMM output cosine"), ("err_corr_prev", "dW error corr. with previous diagnosed step"))):
            for gemm, gd in ag["gemm"].items():
                ys = gd[m]
                if all(y is None for y in ys):
                    continue
                ax.plot(ag["steps"], [float("nan") if y is None else y for y in ys], marker=".",
                        color=colors.get(arm), ls=styles[gemm])
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    # one legend below the panels: the arms (colour) and the GEMMs (line style)
    handles = [Line2D([], [], color=colors.get(a), lw=2.5, label=a) for a in aggs]
    handles += [Line2D([], [], color="k", ls=ls, label=g) for g, ls in styles.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=10, frameon=False,
               bbox_to_anchor=(0.5, -0.02 - 0.05 * ((len(handles) - 1) // 6)))
    fig.subplots_adjust(bottom=0.22 + 0.05 * ((len(handles) - 1) // 6))
    out.append(("GEMM outputs vs float32 (layer means)", _png(fig)))

    fig, axes = plt.subplots(1, 3, figsize=(18, 4))
    opnames = sorted({o for ag in aggs.values() for o in ag["overall"]["operand"]})
    width = 0.8 / max(1, len(aggs))
    for j, (arm, ag) in enumerate(aggs.items()):
        for ax, m in zip(axes, ("sqnr_db", "clip_rate", "underflow_rate")):
            ys = [(ag["overall"]["operand"].get(o) or {}).get(m) for o in opnames]
            ax.bar([i + j * width for i in range(len(opnames))], [0 if y is None else y for y in ys], width, label=arm,
                   color=colors.get(arm))
    for ax, title in zip(axes, ("operand SQNR (dB)", "saturation (clip) rate", "underflow-to-zero rate")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(opnames))])
        ax.set_xticklabels(opnames, rotation=30, fontsize=9)
        ax.set_title(title + " (mean over layers and steps)", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.subplots_adjust(bottom=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(aggs), 6), fontsize=10,
               frameon=False, bbox_to_anchor=(0.5, 0.0))
    out.append(("quantized operands (mean over layers and diagnosed steps)", _png(fig)))

    ops = sorted({o for ag in aggs.values() for o, h in ag["scale_hist"].items() if h})
    if ops:
        ncol = min(3, len(ops))
        nrow = -(-len(ops) // ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(6 * ncol, 3.6 * nrow), squeeze=False)
        for ax, o in zip(axes.flat, ops):
            hs = {arm: ag["scale_hist"][o] for arm, ag in aggs.items() if ag["scale_hist"].get(o)}
            rng = hist_range(list(hs.values()))
            if rng is None:
                ax.set_visible(False)
                continue
            lo, hi, outside, zero = rng
            for arm, h in hs.items():
                tot = sum(h.values())
                ks = list(range(lo, hi + 1))
                ax.plot(ks, [h.get(str(e), 0) / tot for e in ks], marker=".", color=colors.get(arm),
                        ls=_ls(colors, arm), label=arm)
            ax.set_xlim(lo - 0.5, hi + 0.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            notes = ([f"{100 * zero:.2g} % all-zero blocks"] if zero > 0 else []) + (
                [f"{100 * outside:.2g} % outside"] if outside > 0 else [])
            ax.set_title(f"{o}: block-scale exponents" + (f"\n({', '.join(notes)})" if notes else ""), fontsize=10)
            ax.set_xlabel("log2(block scale)")
            ax.set_ylabel("share of blocks")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(ops):]:
            ax.set_visible(False)
        arms_h = [a for a in aggs if any(aggs[a]["scale_hist"].get(o) for o in ops)]
        fig.legend(handles=[Line2D([], [], color=colors.get(a), ls=_ls(colors, a), marker=".", lw=2, label=a)
                            for a in arms_h],
                   loc="lower center", ncol=min(len(arms_h), 6), fontsize=10, frameon=False,
                   bbox_to_anchor=(0.5, -0.06 / nrow))
        fig.tight_layout()
        out.append(("block-scale exponents (per operand, all layers and diagnosed steps; x axis: the populated "
                    "range)", _png(fig)))
    p = _split_plot(aggs, colors)
    if p is not None:
        out.append((SPLIT_CAPTION, p))
    return out


# the error split's four energies (``diagnostics.error_split``) in the order they are stacked, with their colours
SPLIT_PARTS = (("flush_energy", "flushed to zero", "#4c72b0"), ("clip_energy", "saturated (clipped)", "#c44e52"),
               ("systematic_energy", "systematic (common gain)", "#dd8452"),
               ("noise_energy", "rounding noise", "#8c8c8c"))
SPLIT_CAPTION = ("where each operand's quantization error comes from (error split, mean over layers and diagnosed "
                 "steps; bar height = 1/SQNR; above each bar its bias)")


def split_data(aggs: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """Per arm, per operand (GEMM order: Fprop X, W, Dgrad dY, W, Wgrad dY, X) the error split's means over
    layers and diagnosed steps: ``{arm: {operand: {"flush_energy": ..., ..., "bias": ...}}}``. Operands without
    split numbers (runs from before the split, unquantized operands) and arms without any are left out."""
    out = {}
    for arm, ag in aggs.items():
        ops = (ag.get("overall") or {}).get("operand") or {}
        row = {}
        for o in (o for _, a, b in _OPS for o in (a, b)):
            st = ops.get(o) or {}
            vals = {k: st.get(f"split_{k}") for k, _, _ in SPLIT_PARTS}
            if all(v is None for v in vals.values()):
                continue
            row[o] = {k: (v or 0.0) for k, v in vals.items()} | {"bias": st.get("split_bias")}
        if row:
            out[arm] = row
    return out


def _split_plot(aggs: dict[str, dict], colors: dict[str, str] | None = None) -> bytes | None:
    """One panel per arm: per quantized operand a bar of its error energy relative to its signal energy (1/SQNR)
    stacked by where it comes from (flushed, saturated, systematic gain, rounding noise), and its bias (the
    |x|-weighted mean signed relative error, negative: shrinkage) written above the bar. None without split data."""
    data = split_data(aggs)
    if not data:
        return None
    plt = _plt()
    from matplotlib.patches import Patch  # optional
    colors = colors or arm_colors(list(aggs))
    ncol = min(4, len(data))
    nrow = -(-len(data) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.6 * nrow), squeeze=False, sharey=True)
    top = max(sum(v[k] for k, _, _ in SPLIT_PARTS) for row in data.values() for v in row.values())
    # the same operand slots in every panel (an operand an arm does not quantize stays empty)
    slots = [o for _, a, b in _OPS for o in (a, b) if any(o in row for row in data.values())]
    for ax, (arm, row) in zip(axes.flat, data.items()):
        xs = [i for i, o in enumerate(slots) if o in row]
        names = [o for o in slots if o in row]
        bottom = [0.0] * len(names)
        for k, _, c in SPLIT_PARTS:
            hs = [row[o][k] for o in names]
            ax.bar(xs, hs, 0.7, bottom=bottom, color=c)
            bottom = [b + h for b, h in zip(bottom, hs)]
        for x, o, b in zip(xs, names, bottom):
            bias = row[o]["bias"]
            if bias is not None:
                ax.annotate(f"{100 * bias:+.2g} %", (x, b), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=8)
        ax.set_xticks(range(len(slots)))
        ax.set_xticklabels(slots, rotation=30, fontsize=8)
        ax.set_xlim(-0.6, len(slots) - 0.4)
        ax.set_title(arm, fontsize=10, color=colors.get(arm, "k"))
        ax.grid(alpha=0.3, axis="y")
        ax.set_ylim(0, 1.2 * top if top > 0 else 1)
    for ax in list(axes.flat)[len(data):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("error energy / signal energy")
    handles = [Patch(color=c, label=lab) for _, lab, c in reversed(SPLIT_PARTS)]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False,
               title="stacked: where the error comes from; above each bar: bias (mean signed relative error, "
                     "negative = shrinkage)", title_fontsize=9, bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.1 / nrow + 0.02, 1, 1))
    return _png(fig)


def _read_json(p: Path):
    try:
        return json.loads(Path(p).read_text())
    except (OSError, ValueError):
        return None


def deosc_stats(run_dir: Path) -> dict | None:
    """A run's weight de-oscillation record (``RUN/deosc.jsonl``, ``mxtrain.train.deosc``): windows, entries tracked,
    mean share reset and mean share whose quantized value changed per window; None without one."""
    p = Path(run_dir) / "deosc.jsonl"
    if not p.is_file():
        return None
    rows = []
    for line in p.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("tracked"):
            rows.append(r)
    if not rows:
        return {"windows": 0, "tracked": None, "reset_share": None, "changed_share": None, "reset": 0}
    return {"windows": len(rows), "tracked": rows[-1]["tracked"], "reset": sum(r["reset"] for r in rows),
            "reset_share": sum(r["reset"] / r["tracked"] for r in rows) / len(rows),
            "changed_share": sum(r.get("changed", 0) / r["tracked"] for r in rows) / len(rows)}


def deosc_table_rows(runs: dict[str, dict[int, M.RunData]]) -> list[list[str]] | None:
    """Rows (header first) of every run that de-oscillated its weights; None when none did."""
    rows = [["arm", "seed", "windows", "weights tracked", "reset per window (mean)",
             "quantized value changed per window (mean)", "settings"]]
    for arm, rs in runs.items():
        for s, rd in sorted(rs.items()):
            st = deosc_stats(rd.path)
            if st is None:
                continue
            cfg = (rd.config or {}).get("deosc") or {}
            sets = ", ".join(f"{k} {cfg[k]}" for k in ("period", "window", "threshold", "min_flips", "start")
                             if k in cfg and cfg[k] is not None)
            pc = (lambda x: "–" if x is None else f"{100 * x:.3g} %")
            rows.append([arm, str(s), str(st["windows"]), "–" if st["tracked"] is None else f"{st['tracked']:,}",
                         pc(st["reset_share"]), pc(st["changed_share"]), sets])
    return rows if len(rows) > 1 else None


def single_run_rows(d: Path, rd: M.RunData) -> list[list[str]]:
    """The facts a reader of a single-run report looks for first: recipe, model, length, outcome, final losses."""
    cfg = rd.config or {}
    info = rd.info or {}
    rec = _read_json(d / "recipe.json") or cfg.get("recipe")
    if isinstance(rec, str):
        rec = R.get(rec).to_dict() if R.is_name(rec) else rec
    name = rec.get("name") if isinstance(rec, dict) else rec
    desc = (rec.get("description") or "").strip().split("\n")[0] if isinstance(rec, dict) else ""
    rows = [["item", "value"], ["run folder", str(d)],
            ["recipe", f"{name}: {recipe_brief(rec)}" + (f" ({desc})" if desc else "")]]
    dc = cfg.get("deosc") or {}
    if dc.get("enable"):
        st = deosc_stats(d) or {}
        rows.append(["weight de-oscillation", f"period {dc.get('period')}, "
                     f"window {dc.get('window') or dc.get('period')}, "
                     f"threshold {dc.get('threshold')}, min_flips {dc.get('min_flips')}, start {dc.get('start')}; "
                     f"{st.get('windows', 0)} windows, {st.get('reset', 0):,} resets"])
    m = cfg.get("model") or {}
    params = info.get("model_params")
    rows.append(["model", f"{m.get('name', '?')}" + (f" ({params / 1e6:.1f}M parameters)" if params else "")])
    t = cfg.get("train") or {}
    steps = rd.train_steps[-1] if rd.train_steps else None
    toks = rd.train_tokens[-1] if rd.train_tokens else None
    rows.append(["trained", f"{steps if steps is not None else '?'} of {t.get('steps', '?')} steps"
                 + (f", {toks:,.0f} tokens" if toks is not None and math.isfinite(toks) else "")])
    oc = info.get("outcome") if isinstance(info.get("outcome"), dict) else None
    if oc:
        rows.append(["outcome", str(oc.get("status")) + (f" at step {oc.get('step')}" if oc.get("step") else "")
                     + (f": {oc.get('reason')}" if oc.get("reason") else "")])
    _, v, st = rd.finite_evals
    if v:
        rows.append(["final val loss", f"{v[-1]:.4f} (ppl {math.exp(min(v[-1], 50)):.2f}) at step {st[-1]}"])
    if rd.train_loss:
        rows.append(["last training loss", f"{rd.train_loss[-1]:.4f} (logged at step {rd.train_steps[-1]})"])
    if info.get("device"):
        rows.append(["device", f"{info.get('device')} {info.get('device_name') or ''}".strip()])
    return rows


# ----------------------------------------------------------------------------------------------
# writers


def _table_html(rows: list[list[str]]) -> str:
    h = "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in rows[0]) + "</tr>"
    for r in rows[1:]:
        h += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
    return h + "</table>"


_MD_SPECIAL = re.compile(r"([\\`\[\]*_|~#$])")
# what starts a block where the text starts a line: a bullet (``- x``, ``+ x``), a thematic break or setext
# underline (``---``, ``===``), an ordered list item (``1. x``, ``2)``); not ``-0.5`` or ``1.5``
_MD_LEAD = re.compile(r"^(?:([-+=])(?=\s|$|\1)|(\d{1,9})(?=[.)](?:\s|$)))")


def _md_text(s) -> str:
    """``s`` as literal text in report.md: names there come from folders and files (an arm folder named ``<img src=x
    onerror=alert(1)>``, a run ``a*b_c``), so nothing in them may become raw HTML (``&``, ``<``, ``>`` as entities),
    a link or image or code span, emphasis or strikethrough, a heading or its closing ``#``s, math (GitHub's
    ``$...$``), or the end of a table cell (backslash escapes of ``\\ ` [ ] * _ | ~ # $``: CommonMark shows each as
    itself), nor a new line or block: line breaks as spaces, leading spaces as entities (no indented code), and a
    leading block marker escaped (``_MD_LEAD``: no list, rule or setext heading where the text starts a line)."""
    s = re.sub(r"[\r\n]+", " ", str(s))
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _MD_SPECIAL.sub(r"\\\1", s)
    lead = len(s) - len(s.lstrip(" \t"))
    s = "".join("&#9;" if c == "\t" else "&#32;" for c in s[:lead]) + s[lead:]
    m = _MD_LEAD.match(s) if lead == 0 else None
    if m:
        s = "\\" + s if m.group(1) else s[:m.end()] + "\\" + s[m.end():]
    return s


def _one_line(s) -> str:
    """``s`` with its line breaks as spaces: a blank line inside an HTML block ends it, and Markdown starts there."""
    return re.sub(r"[\r\n]+", " ", str(s))


def _md_code(s) -> str:
    """``s`` as a Markdown code span (literal: no HTML, no escapes), fenced by more backticks than it holds."""
    s = re.sub(r"[\r\n]+", " ", str(s))
    n = max((len(m) for m in re.findall(r"`+", s)), default=0) + 1
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{'`' * n}{pad}{s}{pad}{'`' * n}"


def _table_md(rows: list[list[str]]) -> str:
    # (a cell's text is data, e.g. a run.json value: no Markdown table break, no raw HTML a renderer would run)
    esc = [[_md_text(c) for c in r] for r in rows]   # (_md_text escapes | too)
    lines = ["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(esc[0])]
    lines += ["| " + " | ".join(r) + " |" for r in esc[1:]]
    return "\n".join(lines)


def _env_of(runs: dict[str, dict[int, M.RunData]]) -> dict:
    for rs in runs.values():
        for rd in rs.values():
            c = dict(rd.config or {}, **(rd.info or {}))
            keep = {k: c[k] for k in ("mxtrain", "torch", "python", "device", "device_name", "cpu_threads", "git_sha",
                                      "versions", "data", "data_meta", "model_params", "world_size", "started")
                    if k in c}
            if keep:
                return keep
    return {}


def training_line(runs: dict) -> str | None:
    """One sentence on how the study's runs trained, from their ``config.json``: model, tokens a step, warm-up,
    weight decay and the peak learning rate, for every run if they share one, else by arm (a cost measured at
    one learning rate holds at that rate only: docs/study.md, "Check the learning rate first"). None when no
    run has a config."""
    cfgs = {arm: [rd.config for rd in rs.values() if rd.config] for arm, rs in runs.items()}
    cfgs = {a: c for a, c in cfgs.items() if c}
    if not cfgs:
        return None

    def get(c, sec, key):
        return (c.get(sec) or {}).get(key)

    def one(vals):
        vals = {v for v in vals if v is not None}
        return next(iter(vals)) if len(vals) == 1 else None

    allc = [c for cs in cfgs.values() for c in cs]
    parts = []
    model = one(get(c, "model", "name") for c in allc)
    bs, sl = one(get(c, "train", "batch_size") for c in allc), one(get(c, "data", "seq_len") for c in allc)
    if model:
        parts.append(f"model {model}")
    if bs and sl:
        parts.append(f"{bs} x {sl} tokens a step")
    wu = one(get(c, "schedule", "warmup_steps") for c in allc)
    if wu is not None:
        parts.append(f"{wu} warm-up steps")
    wd = one(get(c, "optim", "weight_decay") for c in allc)
    if wd is not None:
        parts.append(f"weight decay {wd:g}")
    lr = one(get(c, "optim", "lr") for c in allc)
    if lr is not None:
        parts.append(f"peak learning rate {lr:g} for every run")
    elif any(get(c, "optim", "lr") is not None for c in allc):
        by = []
        for arm, cs in cfgs.items():
            v = {get(c, "optim", "lr") for c in cs} - {None}
            by.append(f"{arm} {', '.join(f'{x:g}' for x in sorted(v)) or '?'}")
        parts.append("peak learning rate by arm: " + "; ".join(by))
    return "Training: " + ", ".join(parts) + "."


def _numerics_of(info: dict) -> set[tuple[str, str]] | None:
    """The numerics settings (``settings.NUMERICS``) a run trained with that are not the defaults, over every
    leg its ``run.json`` records; None where no leg recorded its settings."""
    defaults = S.Settings().to_dict()
    legs = [info] + [g for g in (info.get("legs") or []) if isinstance(g, dict)]
    recorded = [g["settings"] for g in legs if isinstance(g.get("settings"), dict)]
    if not recorded:
        return None
    return {(k, str(st[k])) for st in recorded for k in S.NUMERICS if k in st and st[k] != defaults.get(k)}


def numerics_line(runs: dict) -> str | None:
    """One sentence naming the numerics settings (docs/settings.md: those that can change a run's numbers, e.g.
    ``fp8_fast_accum``) that runs trained with other than the defaults, and which runs: "every run" (nothing for a
    single run) or by arm (runs out of the arm's). None when every run that recorded its settings used the
    defaults."""
    seen: dict[tuple[str, str], dict[str, int]] = {}
    total = {arm: len(rs) for arm, rs in runs.items()}
    for arm, rs in runs.items():
        for rd in rs.values():
            for kv in _numerics_of(rd.info if isinstance(rd.info, dict) else {}) or ():
                seen.setdefault(kv, {}).setdefault(arm, 0)
                seen[kv][arm] += 1
    if not seen:
        return None
    parts = []
    for (k, v), by in sorted(seen.items()):
        if by == total:
            parts.append(f"{k}={v}" + (" (every run)" if sum(total.values()) > 1 else ""))
        else:
            parts.append(f"{k}={v} (" + ", ".join(f"{a}: {n} of {total[a]} runs" for a, n in by.items()) + ")")
    return "Numerics settings other than the defaults (docs/settings.md): " + "; ".join(parts) + "."


_CSS = ("body{font-family:sans-serif;max-width:1300px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #bbb;padding:4px 8px;text-align:left}"
        "th{background:#eee}pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto}img{max-width:100%}")


def verdict_note(cool: dict) -> str:
    """The sentence under the verdict lines: what the intervals, the test, the correction and the refusals are."""
    sc = cool.get("scale") or {}
    size = ""
    if sc.get("min_params"):
        size = (f" No verdict below {sc['min_params'] / 1e6:.0f} M parameters or {sc['min_tokens'] / 1e6:.0f} M tokens "
                f"at the largest budget (this study: "
                + (f"{sc['params'] / 1e6:.3g} M parameters" if sc.get("params") else "parameters not recorded")
                + (f", {sc['tokens'] / 1e6:.3g} M tokens" if sc.get("tokens") else "") + ").")
    return (f"Extra tokens to reach the same cooled-down loss as {cool.get('baseline')} at each budget's end "
            f"(largest budget below), with a seed-level 95 % interval (the jackknife over seeds, Student t with "
            f"seeds - 1 degrees of freedom); each seed's paired gap in nats beside it. Resolved: the paired t test of "
            f"the gap, Holm-adjusted over the arms listed, below 0.05. Detectable effect: (t_0.975 + t_0.80) x s.e., "
            f"80 % power at alpha 0.05 (5.4 s.e. at 3 seeds). No verdict with fewer than 3 seeds.{size} "
            f"AMD's metric (the arm's own tokens to the baseline's final loss) is given beside ours; it differs "
            f"from ours and the two are not compared with each other's figures.")


def claims_note(cool: dict) -> str:
    """The sentence under the claim lines: how a claim is judged and corrected."""
    cl = cool.get("claims") or []
    fam = max((c.get("family") or 0 for c in cl), default=0)
    return ("Each published claim this study's arms can test, judged at the largest budget from the two arms it "
            "compares (the second one's cooled-down points fitted; each seed paired with the same seed): "
            "directions from the paired t test of the loss gap (supported / contradicted / not resolved; 'does "
            "not rescue' claims are consistent unless the arm is resolved better), 'near-lossless' from an "
            "equivalence test (TOST) of the extra tokens against +-5 %. "
            + (f"p-values Holm-adjusted over the {fam} claims judged in this report (family-wise error 0.05); "
               if fam else "No claim is judged here (too few seeds, or runs below the scale a verdict needs); ")
            + "intervals shown are unadjusted 95 %. docs/study.md, \"Published claims\".")


def write_report(d: str | Path, summary: dict | None = None, out: str | Path | None = None,
                 arms: list[str] | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` of ``d`` (a study or a run folder) into ``out`` (default ``d``);
    ``arms``: only these arms' runs (the summary given holds only them too)."""
    d = Path(d)
    out = Path(out) if out is not None else d
    out.mkdir(parents=True, exist_ok=True)
    single = (d / "metrics.jsonl").is_file() and not (d / "runs").is_dir()
    study_meta = {}
    if (d / "study.json").is_file():
        study_meta = read_json_object(d / "study.json")
    if single:
        rd = M.read_run(d, arm=d.name, seed=0)
        rec = (rd.config or {}).get("recipe")
        label = rec if isinstance(rec, str) else (rec or {}).get("name") if isinstance(rec, dict) else None
        label = label or d.name
        runs = {label: {0: rd}}
        k = 1
    else:
        runs = M.load_study_runs(d)
        if not runs:
            raise FileNotFoundError(f"{d}: neither a run folder (metrics.jsonl) nor a study (runs/<arm>/seed<k>)")
        every_arm = list(runs)   # the whole study's order, which its own report colours by
        if arms:
            runs = {a: runs[a] for a in arms if a in runs}
        if summary is None and (d / "summary.json").is_file():
            summary = read_json_object(d / "summary.json")
        if summary is None:
            base = study_meta.get("baseline") or next(iter(runs))
            summary = M.sanitize(M.summarize(runs, base, smooth_k=study_meta.get("smooth_k", 3),
                                             recipes=study_meta.get("recipes")))
        k = summary["smoothing"]["k"]
    # some arms of a study: the colours of the whole study's report
    colors = arm_colors(every_arm if arms and not single else list((summary or {}).get("arms") or []),
                        study_meta.get("arms"), list(runs))
    cool = (summary or {}).get("cooldown") if not single else None
    figs: list[tuple[str, bytes]] = []
    plots = plots_available()
    if plots and cool:
        p = _cooldown_plot(cool, colors)
        if p:
            figs.append(("cooled-down comparison", p))
    if plots:
        figs.append(("validation loss" + (" (stable runs)" if cool else ""), _curve_plot(runs, summary, k, colors)))
    if plots and single:
        figs.append(("training loss", _train_plot(rd)))
    elif plots and summary:
        p = _diff_plot(summary, colors)
        if p:
            figs.append(("paired differences", p))
    aggs = {}
    for arm, rs in runs.items():
        rows = []
        for rd in rs.values():
            rows += D.load(rd.path)
        if rows:
            aggs[arm] = D.aggregate(rows)
    if plots:
        figs += _diag_plots(aggs, colors)

    env = _env_of(runs)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"mxtrain {'run' if single else 'study'} report: {d.name}"
    h = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
         f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
         f"<p>Generated {now} from <code>{html.escape(str(d))}</code>.</p>"]
    md = [f"# {_md_text(title)}", "", f"Generated {now} from {_md_code(d)}.", ""]
    if arms:
        shown = (f"Arms in this report: {', '.join(runs)} (the study has "
                 f"{len(study_meta.get('arms') or M.load_study_runs(d))}).")
        h.append(f"<p>{html.escape(shown)}</p>")
        md += [_md_text(shown), ""]
    tline = None if single else training_line(runs)
    if tline:
        h.append(f"<p>{html.escape(tline)}</p>")
        md += [_md_text(tline), ""]
    nline = numerics_line(runs)
    if nline:
        h.append(f"<p><b>{html.escape(nline)}</b></p>")
        md += [f"**{_md_text(nline)}**", ""]
    if single:
        srows = single_run_rows(d, rd)
        h += ["<h2>Run</h2>", _table_html(srows)]
        md += ["## Run", "", _table_md(srows), ""]
    if cool:
        verdict = cool.get("verdict") or []
        if not verdict:
            verdict = verdict_lines(cool, cool.get("scale"))
        vnote = verdict_note(cool)
        h += ["<h2>Verdict</h2><ul>"] + [f"<li><b>{html.escape(v.split(':', 1)[0])}</b>:{html.escape(v.split(':', 1)[1])}</li>"
                                          for v in verdict] + ["</ul>", f"<p>{html.escape(vnote)}</p>"]
        md += ["## Verdict", ""] + [f"* {_md_text(v)}" for v in verdict] + ["", _md_text(vnote), ""]
        for ref, rc in (cool.get("references") or {}).items():
            rv = rc.get("verdict") or []
            if rv:
                h += [f"<p>Against {html.escape(ref)} (its own fit, same method):</p><ul>"] + [
                    f"<li><b>{html.escape(v.split(':', 1)[0])}</b>:{html.escape(v.split(':', 1)[1])}</li>"
                    for v in rv] + ["</ul>"]
                md += [f"Against {_md_text(ref)} (its own fit, same method):", ""] + [
                    f"* {_md_text(v)}" for v in rv] + [""]
        cl = cool.get("claim_lines") or []
        if cl:
            cnote = claims_note(cool)
            h += ["<h2>Published claims</h2><ul>"] + [f"<li>{html.escape(v)}</li>" for v in cl] + [
                "</ul>", f"<p>{html.escape(cnote)}</p>"]
            md += ["## Published claims", ""] + [f"* {_md_text(v)}" for v in cl] + ["", _md_text(cnote), ""]
    if summary and not single:
        intro = (f"Baseline: {summary['baseline']}. Target val loss "
                 f"{_f(summary['target_loss'])} ({summary['target_rule']}). Smoothing: "
                 f"{summary['smoothing']['kind']}, k = {k}. Extra tokens = tokens to reach the "
                 f"target / the same seed's baseline tokens - 1; CIs are t-based 95 % over seeds.")
        h.append(f"<p>{html.escape(intro)}</p>")
        md += [_md_text(intro), ""]
        rows = arm_table_rows(summary)
        h += ["<h2>Extra-token cost and final loss</h2>", _table_html(rows)]
        md += ["## Extra-token cost and final loss", "", _table_md(rows), ""]
        for ref, c in (summary.get("references") or {}).items():
            rnote = (f"Every arm against {ref} as well: target val loss {_f(c.get('target_loss'))} "
                     f"({c.get('target_rule')}); extra tokens and gaps paired by seed with {ref}'s runs.")
            rrows = reference_table_rows(summary, ref)
            h += [f"<h2>Against {html.escape(ref)}</h2>", f"<p>{html.escape(rnote)}</p>", _table_html(rrows)]
            md += [f"## Against {_md_text(ref)}", "", _md_text(rnote), "", _table_md(rrows), ""]
        if cool:
            fit = cool.get("fit") or {}
            cnote = (f"Cooldown design: one constant-LR run per arm x seed, a cooldown branch at each budget "
                     f"({', '.join(f'{100 * b:.0f} %' for b in cool.get('budgets', []))} of the run; the last "
                     f"{_f(cool.get('cooldown'), 2)} of each branch decays, {cool.get('shape')}). Baseline fit "
                     + (f"L(D) = {fit['E']:.4f} + {fit['B']:.4g} D^-{fit['beta']:.3f} "
                        f"({'Huber loss on log L' if fit.get('loss') == 'huber' else 'least squares'}). "
                        if fit else "failed. ")
                     + f"Extra tokens = D / D_equiv - 1, D_equiv = (B / (L - E))^(1/beta). Intervals: Student t "
                     f"over the per-seed paired gaps (df = seeds - 1); for extra tokens the jackknife over seeds "
                     f"with the same t quantile; window s.e.: {cool.get('n_boot')} bootstrap replicates over the "
                     f"evaluation windows, seeds fixed. docs/study.md.")
            crows = cooldown_table_rows(cool)
            h += ["<h2>Cooled-down comparison</h2>", f"<p>{html.escape(cnote)}</p>", _table_html(crows)]
            md += ["## Cooled-down comparison", "", _md_text(cnote), "", _table_md(crows), ""]
            grows = budget_gap_rows(cool)
            if grows:
                gnote = ("Some seeds finished only some budgets, so the table above (seeds complete at every "
                         "budget) leaves measurements out. Here, each budget's cooled-down loss minus the "
                         "baseline's of the same seed, for every seed whose branch at that budget finished in both "
                         "(nats; mean over windows; no interval: the seeds differ from budget to budget).")
                h += ["<h3>Paired gaps per budget, every finished seed</h3>", f"<p>{html.escape(gnote)}</p>",
                      _table_html(grows)]
                md += ["### Paired gaps per budget, every finished seed", "", _md_text(gnote), "", _table_md(grows), ""]
            srows = source_table_rows(cool)
            if srows:
                snote = (f"Cooled-down loss minus the baseline's at the {100 * cool['by_source']['budget']:.0f} % "
                         f"budget, by validation source (the prepared folder's fixed validation files), paired by "
                         f"seed and window, mean over windows and seeds (nats; windows per seed in brackets).")
                h += ["<h3>By validation source</h3>", f"<p>{html.escape(snote)}</p>", _table_html(srows)]
                md += ["### By validation source", "", _md_text(snote), "", _table_md(srows), ""]
            for ref, rc in (cool.get("references") or {}).items():
                rf = rc.get("fit") or {}
                rnote = (f"Against {ref}: its cooled-down points fitted the same way"
                         + (f", L(D) = {rf['E']:.4f} + {rf['B']:.4g} D^-{rf['beta']:.3f}." if rf else " (fit failed)."))
                rrows = cooldown_table_rows(rc)
                h += [f"<h3>Cooled-down, against {html.escape(ref)}</h3>", f"<p>{html.escape(rnote)}</p>",
                      _table_html(rrows)]
                md += [f"### Cooled-down, against {_md_text(ref)}", "", _md_text(rnote), "", _table_md(rrows), ""]
        drows = deosc_table_rows(runs)
        if drows:
            dnote = ("Weight de-oscillation (mxtrain.train.deosc; docs/numerics.md): per window, the share of tracked "
                     "weights reset to their quantized value, and the share whose quantized value changed at least "
                     "once.")
            h += ["<h2>Weight de-oscillation</h2>", f"<p>{html.escape(dnote)}</p>", _table_html(drows)]
            md += ["## Weight de-oscillation", "", _md_text(dnote), "", _table_md(drows), ""]
        noise = _noise_lines(summary)
        h += ["<h2>Effects next to seed-to-seed spread</h2><ul>"] + [f"<li>{html.escape(x)}</li>" for x in noise] + ["</ul>"]
        md += ["## Effects next to seed-to-seed spread", ""] + [f"* {_md_text(x)}" for x in noise] + [""]
    if aggs:
        drows = [["arm", "GEMM", "cos", "rel. error", "rel. bias", "dW err corr (step to step)", "trained path vs reference",
                  "operand SQNR dB (A / B)", "clip rate (A / B)", "underflow (A / B)"]]
        for arm, ag in aggs.items():
            for gemm, a, b in _OPS:
                g = ag["overall"]["gemm"].get(gemm)
                if not g:
                    continue
                oa, ob = ag["overall"]["operand"].get(a) or {}, ag["overall"]["operand"].get(b) or {}
                drows.append([arm, gemm, _f(g["cos"], 5), _f(g["rel_err"]), _f(g["rel_bias"]),
                              _f(g["err_corr_prev"], 3) if gemm == "wgrad" else "", _f(g.get("impl_rel_diff"), 4),
                              f"{_f(oa.get('sqnr_db'), 1)} / {_f(ob.get('sqnr_db'), 1)}",
                              f"{_f(oa.get('clip_rate'))} / {_f(ob.get('clip_rate'))}",
                              f"{_f(oa.get('underflow_rate'))} / {_f(ob.get('underflow_rate'))}"])
        dnote = ("Per-GEMM diagnostics (mean over quantized layers and diagnosed steps); A / B are the GEMM's "
                 "operands (Fprop X / W, Dgrad dY / W, Wgrad dY / X). 'trained path vs reference' is "
                 "||actual - reference|| / ||reference|| for the output the layer really produced in training (fast "
                 "kernels or reference path): about 1e-3 under bf16 autocast; far above that, the path that trained "
                 "does not compute the recipe. Definitions: docs/study.md.")
        h += ["<h2>Per-GEMM diagnostics</h2>", f"<p>{dnote}</p>", _table_html(drows)]
        md += ["## Per-GEMM diagnostics", "", _md_text(dnote), "", _table_md(drows), ""]
    h.append("<h2>Plots</h2>")
    md += ["## Plots", ""]
    if not plots:
        h.append(f"<p>{html.escape(PLOTS_MISSING[0].upper() + PLOTS_MISSING[1:])}.</p>")
        md += [PLOTS_MISSING[0].upper() + PLOTS_MISSING[1:] + ".", ""]
    files = out / "report_files"
    made = not files.is_dir()
    files.mkdir(exist_ok=True)
    try:
        _write_figures(figs, files, h, md, write_atomic)
    except BaseException:
        if made and not any(files.iterdir()):
            files.rmdir()
        raise
    h.append("<h2>Environment</h2>")
    envtxt = json.dumps({**env, "report_python": platform.python_version()}, indent=1, default=str)
    h.append(f"<pre>{html.escape(envtxt)}</pre>")
    md += ["## Environment", "", "```json", envtxt, "```", ""]
    h.append("<h2>Exact configurations</h2>")
    md += ["## Exact configurations", ""]
    if study_meta:
        t = json.dumps(study_meta, indent=1, default=str)
        h.append(f"<details><summary>study.json</summary><pre>{html.escape(t)}</pre></details>")
        md += ["<details><summary>study.json</summary>", "", "```json", t, "```", "</details>", ""]
    for arm, rs in runs.items():
        for s, rd in sorted(rs.items()):
            if rd.config:
                t = json.dumps({"config": rd.config, "run": rd.info}, indent=1, default=str)
                h.append(f"<details><summary>{html.escape(arm)} seed {s}: config.json</summary>"
                         f"<pre>{html.escape(t)}</pre></details>")
                # (an HTML block: no Markdown in it, so the name is escaped as HTML only)
                md += [f"<details><summary>{html.escape(_one_line(arm))} seed {s}: config.json</summary>", "", "```json",
                       t, "```",
                       "</details>", ""]
    h.append("</body></html>")
    hp, mp = out / "report.html", out / "report.md"
    html_text, md_text = "\n".join(h).encode(), "\n".join(md).encode()
    write_atomic(hp, lambda f: f.write(html_text))
    write_atomic(mp, lambda f: f.write(md_text))
    return hp, mp


def _write_figures(figs, files: Path, h: list, md: list, write_atomic) -> None:
    """The figures as report_files/figN.png (each written whole) and their places in the two pages."""
    for i, (cap, png) in enumerate(figs):
        if png is None:
            continue
        h.append(f"<h3>{html.escape(cap)}</h3><img alt='{html.escape(cap)}' "
                 f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
        fn = f"fig{i}.png"
        write_atomic(files / fn, lambda f, png=png: f.write(png))
        md += [f"### {_md_text(cap)}", "", f"![{_md_text(cap)}](report_files/{fn})", ""]


def _train_plot(rd: M.RunData) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    x = rd.train_tokens if all(math.isfinite(t) for t in rd.train_tokens) else rd.train_steps
    ax.plot(x, rd.train_loss, lw=0.8, label="train loss")
    t, v, _ = rd.finite_evals
    ax.plot(t, v, marker=".", label="val loss")
    ax.set_xlabel("tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)
