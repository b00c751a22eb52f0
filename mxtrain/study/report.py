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
from datetime import datetime, timezone
from pathlib import Path

from . import diagnostics as D
from . import metrics as M

__all__ = ["write_report", "recipe_brief", "arm_table_rows", "arm_colors", "cooldown_table_rows"]

_OPS = (("fprop", "fprop_x", "fprop_w"), ("dgrad", "dgrad_dy", "dgrad_w"), ("wgrad", "wgrad_dy", "wgrad_x"))


# ----------------------------------------------------------------------------------------------
# formatting helpers


def _f(x, nd=4):
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _pct(x, nd=1):
    return "–" if x is None else f"{100 * x:+.{nd}f} %"


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
    head = ["arm", "FP4 GEMMs / interventions", "seeds", "extra tokens to target (mean [95% CI])",
            "final val loss", "final gap vs baseline", "paired Δ, 2nd half", "diverged"]
    rows = [head]
    for name, a in summary["arms"].items():
        div = sum(1 for v in a["diverged"].values() if v)
        rows.append([name, recipe_brief(a.get("recipe")), str(len(a["seeds"])), _extra_cell(a["extra_tokens"]),
                     _ci(a["final_val_loss"]), _ci(a["final_gap_vs_baseline"], lambda x: f"{x:+.4f}"),
                     _ci(a["paired_diff"]["second_half"], lambda x: f"{x:+.4f}"), f"{div}/{len(a['seeds'])}"])
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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


# one colour per arm in every figure: the study's arm order (summary, then any other arm) picks from this list
_PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
            "#7f7f7f", "#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173", "#3182bd"]


def arm_colors(*arm_lists) -> dict[str, str]:
    """The fixed arm -> colour map of a report: arms in the order first seen over ``arm_lists`` (the summary's
    arms first), each its own colour; every plot of the report uses this one map."""
    out: dict[str, str] = {}
    for arms in arm_lists:
        for a in arms or []:
            if a not in out:
                out[a] = _PALETTE[len(out) % len(_PALETTE)]
    return out


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
            ax.plot(t, mean, color=c, label=f"{arm} ({len(curves)} seeds)")
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
    axes[0].legend(fontsize=9)
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
        ax.plot(x, pd["mean"], label=n, color=colors.get(n))
        if all(v is not None for v in pd["ci_lo"]):
            ax.fill_between(x, pd["ci_lo"], pd["ci_hi"], alpha=0.2, color=colors.get(n))
    ax.axhline(0, color="k", lw=1)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"val loss - {summary['baseline']} (same seed)")
    ax.set_title("paired per-evaluation differences vs baseline (band: 95% CI over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return _png(fig)


def _cooldown_plot(cool: dict, colors: dict[str, str]) -> bytes | None:
    """Left: every arm's cooled-down loss per budget (seed mean) and the baseline's fitted L(D) = E + B D^-beta;
    right: extra tokens per budget with 95 % paired bootstrap intervals. Colours: the report's arm map."""
    import numpy as np

    from . import cooldown as C
    arms = {n: a for n, a in (cool.get("arms") or {}).items() if a.get("budgets")}
    if not arms:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    base = cool.get("baseline")
    nb = len(arms)
    for i, (n, a) in enumerate(arms.items()):
        c = colors.get(n)
        rows = a["budgets"]
        t = [r["tokens"] for r in rows]
        axes[0].plot(t, [r["loss"] for r in rows], marker="o", ls="" if n == base else "-", color=c,
                     label=f"{n} ({a.get('n_seeds')} seeds)")
        if n != base:
            # small horizontal offsets keep overlapping intervals apart
            off = [x * (1 + 0.015 * (i - nb / 2)) for x in t]
            ys = [100 * r["extra"] if r.get("extra") is not None else float("nan") for r in rows]
            lo = [y - 100 * r["ci95"][0] if r.get("ci95") and r.get("extra") is not None else 0 for y, r in zip(ys, rows)]
            hi = [100 * r["ci95"][1] - y if r.get("ci95") and r.get("extra") is not None else 0 for y, r in zip(ys, rows)]
            axes[1].errorbar(off, ys, yerr=[lo, hi], marker="o", capsize=4, color=c, label=n)
    fit = cool.get("fit")
    if fit:
        tt = [r["tokens"] for r in arms[base]["budgets"]] if base in arms else []
        if tt:
            xs = np.geomspace(min(tt) * 0.8, max(tt) * 1.25, 100)
            axes[0].plot(xs, C.power_law(fit, xs), color=colors.get(base), lw=1.5, alpha=0.8,
                         label=f"{base} fit: {fit['E']:.3f} + B D^-{fit['beta']:.2f}")
    axes[1].axhline(0, color="k", lw=1)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("tokens (end of the cooldown branch)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=9)
    axes[0].set_ylabel("cooled-down val loss")
    axes[0].set_title("cooled-down loss per budget (seed mean)\nand the baseline's power-law fit", fontsize=10)
    axes[1].set_ylabel("extra tokens vs baseline (%)")
    axes[1].set_title("extra tokens D / D_equiv - 1\n(bars: 95 % paired bootstrap over seeds and windows)",
                      fontsize=10)
    return _png(fig)


def cooldown_table_rows(cool: dict) -> list[list[str]]:
    """The cooled-down table: per arm and budget, tokens, loss, gap vs baseline, extra tokens, each with its
    95 % paired bootstrap interval, and the smallest detectable effect (2.8 x bootstrap s.e.)."""
    rows = [["arm", "budget", "tokens", "cooled-down val loss", "gap vs baseline [95 % CI]",
             "extra tokens [95 % CI]", "detectable effect", "seeds x windows"]]
    for n, a in (cool.get("arms") or {}).items():
        if not a.get("budgets"):
            rows.append([n, "–", "–", "–", "–", str(a.get("state", "no runs")).replace("_", " "), "–", "–"])
            continue
        for r in a["budgets"]:
            g = r.get("gap_ci95")
            ci = r.get("ci95")
            if n == cool.get("baseline"):
                extra = "reference"
            elif r.get("state") != "ok":
                extra = "below the baseline's floor" if r.get("state") == "below_floor" else "no fit"
            else:
                extra = f"{_pct(r['extra'])} [{_pct(ci[0])}, {_pct(ci[1])}]" if ci else _pct(r["extra"])
            rows.append([n, f"{100 * r['budget']:.0f} %" if r.get("budget") is not None else "–",
                         f"{r['tokens']:,.0f}", _f(r["loss"]),
                         "–" if n == cool.get("baseline") else
                         f"{r['gap']:+.4f} [{g[0]:+.4f}, {g[1]:+.4f}]" if g else f"{r['gap']:+.4f}",
                         extra, "–" if n == cool.get("baseline") or r.get("mde") is None else _pct(r["mde"]).lstrip("+"),
                         f"{a.get('n_seeds')} x {a.get('n_windows')}"])
    return rows


def _diag_plots(aggs: dict[str, dict], colors: dict[str, str] | None = None) -> list[tuple[str, bytes]]:
    """Diagnostics plots across arms: output cosine, rel. error/bias and dW error correlation by GEMM;
    operand SQNR, clip and underflow rates; block-scale exponent histograms."""
    plt = _plt()
    aggs = {k: v for k, v in aggs.items() if v.get("steps")}
    if not aggs:
        return []
    out = []
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    colors = colors or arm_colors(list(aggs))
    styles = {g: ls for g, ls in zip(("fprop", "dgrad", "wgrad"), ("-", "--", ":"))}
    for ai, (arm, ag) in enumerate(aggs.items()):
        for ax, (m, title) in zip(axes, (("rel_err", "GEMM output rel. error ||Q-H||/||H||"),
                                         ("rel_bias", "GEMM output rel. bias <Q-H,H>/<H,H>"),
                                         ("cos", "GEMM output cosine"), ("err_corr_prev", "dW error corr. with previous diagnosed step"))):
            for gemm, gd in ag["gemm"].items():
                ys = gd[m]
                if all(y is None for y in ys):
                    continue
                ax.plot(ag["steps"], [float("nan") if y is None else y for y in ys], marker=".",
                        color=colors.get(arm), ls=styles[gemm], label=f"{arm}:{gemm}")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
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
        ax.set_xticklabels(opnames, rotation=30, fontsize=8)
        ax.set_title(title + " (mean over layers and steps)", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    out.append(("quantized operands (mean over layers and diagnosed steps)", _png(fig)))

    fig, axes = plt.subplots(1, len(aggs), figsize=(5 * len(aggs), 3.5), squeeze=False)
    for ax, (arm, ag) in zip(axes[0], aggs.items()):
        for o, h in sorted(ag["scale_hist"].items()):
            if not h:
                continue
            ks = sorted(int(e) for e in h)
            tot = sum(h.values())
            ax.plot(ks, [h[str(e)] / tot for e in ks], marker=".", label=o)
        ax.set_title(f"{arm}: block-scale exponent histogram", fontsize=9)
        ax.set_xlabel("log2(scale)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    out.append(("block-scale exponents", _png(fig)))
    return out


# ----------------------------------------------------------------------------------------------
# writers


def _table_html(rows: list[list[str]]) -> str:
    h = "<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in rows[0]) + "</tr>"
    for r in rows[1:]:
        h += "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
    return h + "</table>"


def _table_md(rows: list[list[str]]) -> str:
    esc = [[c.replace("|", "\\|") for c in r] for r in rows]
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


_CSS = ("body{font-family:sans-serif;max-width:1300px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #bbb;padding:4px 8px;text-align:left}"
        "th{background:#eee}pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto}img{max-width:100%}")


def write_report(d: str | Path, summary: dict | None = None) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` into ``d`` (a study or a run folder)."""
    d = Path(d)
    single = (d / "metrics.jsonl").is_file() and not (d / "runs").is_dir()
    study_meta = {}
    if (d / "study.json").is_file():
        study_meta = json.loads((d / "study.json").read_text())
    if single:
        rd = M.read_run(d, arm=d.name, seed=0)
        runs = {d.name: {0: rd}}
        k = 1
    else:
        runs = M.load_study_runs(d)
        if not runs:
            raise FileNotFoundError(f"{d}: neither a run folder (metrics.jsonl) nor a study (runs/<arm>/seed<k>)")
        if summary is None and (d / "summary.json").is_file():
            summary = json.loads((d / "summary.json").read_text())
        if summary is None:
            base = study_meta.get("baseline") or next(iter(runs))
            summary = M.sanitize(M.summarize(runs, base, smooth_k=study_meta.get("smooth_k", 3),
                                             recipes=study_meta.get("recipes")))
        k = summary["smoothing"]["k"]
    colors = arm_colors(list((summary or {}).get("arms") or []), study_meta.get("arms"), list(runs))
    cool = (summary or {}).get("cooldown") if not single else None
    figs: list[tuple[str, bytes]] = []
    if cool:
        p = _cooldown_plot(cool, colors)
        if p:
            figs.append(("cooled-down comparison", p))
    figs.append(("validation loss" + (" (stable runs)" if cool else ""), _curve_plot(runs, summary, k, colors)))
    if single:
        figs.append(("training loss", _train_plot(runs[d.name][0])))
    elif summary:
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
    figs += _diag_plots(aggs, colors)

    env = _env_of(runs)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = f"mxtrain {'run' if single else 'study'} report: {d.name}"
    h = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
         f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>",
         f"<p>Generated {now} from <code>{html.escape(str(d))}</code>.</p>"]
    md = [f"# {title}", "", f"Generated {now} from `{d}`.", ""]
    if cool:
        verdict = cool.get("verdict") or []
        if not verdict:
            from .cooldown import verdict_lines
            verdict = verdict_lines(cool)
        vnote = (f"Extra tokens to reach the same cooled-down loss as {cool.get('baseline')} at each budget's end "
                 f"(largest budget below), 95 % paired bootstrap interval over seeds and evaluation windows; "
                 f"significant: the interval excludes 0; detectable effect: 2.8 x bootstrap s.e. (80 % power, "
                 f"alpha 0.05).")
        h += ["<h2>Verdict</h2><ul>"] + [f"<li><b>{html.escape(v.split(':', 1)[0])}</b>:{html.escape(v.split(':', 1)[1])}</li>"
                                          for v in verdict] + ["</ul>", f"<p>{html.escape(vnote)}</p>"]
        md += ["## Verdict", ""] + [f"* {v}" for v in verdict] + ["", vnote, ""]
    if summary and not single:
        intro = (f"Baseline: {summary['baseline']}. Target val loss "
                 f"{_f(summary['target_loss'])} ({summary['target_rule']}). Smoothing: "
                 f"{summary['smoothing']['kind']}, k = {k}. Extra tokens = tokens to reach the "
                 f"target / the same seed's baseline tokens - 1; CIs are t-based 95 % over seeds.")
        h.append(f"<p>{html.escape(intro)}</p>")
        md += [intro, ""]
        rows = arm_table_rows(summary)
        h += ["<h2>Extra-token cost and final loss</h2>", _table_html(rows)]
        md += ["## Extra-token cost and final loss", "", _table_md(rows), ""]
        if cool:
            fit = cool.get("fit") or {}
            cnote = (f"Cooldown design: one constant-LR run per arm x seed, a cooldown branch at each budget "
                     f"({', '.join(f'{100 * b:.0f} %' for b in cool.get('budgets', []))} of the run; the last "
                     f"{_f(cool.get('cooldown'), 2)} of each branch decays, {cool.get('shape')}). Baseline fit "
                     + (f"L(D) = {fit['E']:.4f} + {fit['B']:.4g} D^-{fit['beta']:.3f}. " if fit else "failed. ")
                     + f"Extra tokens = D / D_equiv - 1, D_equiv = (B / (L - E))^(1/beta); "
                     f"{cool.get('n_boot')} bootstrap replicates. docs/study.md.")
            crows = cooldown_table_rows(cool)
            h += ["<h2>Cooled-down comparison</h2>", f"<p>{html.escape(cnote)}</p>", _table_html(crows)]
            md += ["## Cooled-down comparison", "", cnote, "", _table_md(crows), ""]
        noise = _noise_lines(summary)
        h += ["<h2>Effects next to seed-to-seed spread</h2><ul>"] + [f"<li>{html.escape(x)}</li>" for x in noise] + ["</ul>"]
        md += ["## Effects next to seed-to-seed spread", ""] + [f"* {x}" for x in noise] + [""]
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
        md += ["## Per-GEMM diagnostics", "", dnote, "", _table_md(drows), ""]
    h.append("<h2>Plots</h2>")
    md += ["## Plots", ""]
    files = d / "report_files"
    files.mkdir(exist_ok=True)
    for i, (cap, png) in enumerate(figs):
        if png is None:
            continue
        h.append(f"<h3>{html.escape(cap)}</h3><img alt='{html.escape(cap)}' "
                 f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
        fn = f"fig{i}.png"
        (files / fn).write_bytes(png)
        md += [f"### {cap}", "", f"![{cap}](report_files/{fn})", ""]
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
                md += [f"<details><summary>{arm} seed {s}: config.json</summary>", "", "```json", t, "```",
                       "</details>", ""]
    h.append("</body></html>")
    hp, mp = d / "report.html", d / "report.md"
    hp.write_text("\n".join(h))
    mp.write_text("\n".join(md))
    return hp, mp


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
