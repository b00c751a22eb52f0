"""Does a finding hold at two model sizes? Planned contrasts judged in the per-seed records of two or more studies
(``seeds.json``, one per size), each size as its own family, and a verdict across them.

A contrast ``(arm, ref)`` is the per-seed gap of the cooled-down loss at one budget (``arm`` minus ``ref``, seeds
both arms finished), tested with the paired t over the seeds (``stats.paired_t``); within one size the contrasts
are one family, Holm-adjusted (``stats.holm``), as in the study's plan. Across sizes (docs/results.md, "The ladder
at 30m, planned before it runs"):

* ``carried (higher|lower)``: every size resolves it, in the same direction (``resolved (...)`` with one size);
* ``sizes disagree``: two sizes resolve it in opposite directions (reported as such, never averaged);
* ``resolved at SIZE only``: one or more sizes resolve it, the others do not;
* ``not resolved``: no size resolves it;
* ``no verdict (...)``: a size has fewer than ``cooldown.MIN_SEEDS`` paired seeds, or lacks an arm.

Nothing here fits curves or converts to tokens: the gap in nats is the quantity every size shares. The command
``mxtrain sizes 125m=DIR 30m=DIR --contrast ARM:REFERENCE ...`` prints the same (``mxtrain/cli/study.py``).
"""

from __future__ import annotations

from ..errors import UserError
from . import stats
from .cooldown import MIN_SEEDS

__all__ = ["contrast", "across_sizes", "lines", "budget_key", "plot"]


def budget_key(records: dict, budget: float) -> float:
    """``budget`` if every record has it among its budgets (else a ``UserError`` naming each record's budgets)."""
    for size, rec in records.items():
        have = sorted({float(b) for a in rec.get("arms", {}).values() for s in a.values() for b in s.get("cooled", {})})
        if not any(abs(b - float(budget)) < 1e-9 for b in have):
            raise UserError(f"the {size} study has no cooled-down budget {budget:g} (it has "
                            f"{', '.join(f'{b:g}' for b in have) or 'none'})")
    return float(budget)


def _cooled(seed: dict, budget) -> dict | None:
    """A seed's cooled-down point at ``budget`` (a number, or its key as the record writes it)."""
    for k, c in seed.get("cooled", {}).items():
        if abs(float(k) - float(budget)) < 1e-9:
            return c
    return None


def contrast(record: dict, arm: str, ref: str, budget="1") -> dict | None:
    """The paired t of ``arm`` minus ``ref`` at ``budget`` in one study's per-seed record, with the seeds used and
    each seed's gap; None where either arm is missing."""
    arms = record.get("arms", {})
    if arm not in arms or ref not in arms:
        return None

    def loss(a, s):
        c = _cooled(arms[a][s], budget)
        return c["loss"] if c and c.get("state") == "done" and c.get("loss") is not None else None
    seeds = sorted((s for s in arms[arm] if s in arms[ref] and loss(arm, s) is not None and loss(ref, s) is not None),
                   key=int)
    gaps = [loss(arm, s) - loss(ref, s) for s in seeds]
    return {**stats.paired_t(gaps), "seeds": seeds, "gaps": gaps}


def across_sizes(records: dict, contrasts: list, budget="1", alpha: float = stats.ALPHA) -> list[dict]:
    """``records``: size name -> per-seed record; ``contrasts``: ``(arm, ref)`` pairs, the planned family of each
    size. Returns one row per contrast: ``{"arm", "ref", "sizes": {size: contrast + "p_holm", "resolved"}, "verdict"}``
    (``resolved``: "higher", "lower" or None)."""
    per = {}
    for size, rec in records.items():
        cs = [contrast(rec, a, r, budget) for a, r in contrasts]
        ps = [c["p"] if c is not None and c["n"] >= MIN_SEEDS else None for c in cs]
        for c, p in zip(cs, stats.holm(ps)):
            if c is not None:
                c["p_holm"] = p
                c["resolved"] = (None if p is None or p >= alpha else ("higher" if c["mean"] > 0 else "lower"))
        per[size] = cs
    rows = []
    for i, (a, r) in enumerate(contrasts):
        sizes = {size: per[size][i] for size in records}
        missing = [s for s, c in sizes.items() if c is None]
        few = [s for s, c in sizes.items() if c is not None and c["n"] < MIN_SEEDS]
        if missing or few:
            why = ", ".join([f"{s}: no run of {a if a not in records[s].get('arms', {}) else r}" for s in missing]
                            + [f"{s}: {sizes[s]['n']} paired seed(s), below {MIN_SEEDS}" for s in few])
            verdict = f"no verdict ({why})"
        else:
            dirs = {s: c["resolved"] for s, c in sizes.items()}
            got = {d for d in dirs.values() if d is not None}
            if len(got) > 1:
                verdict = "sizes disagree"
            elif got and all(d is not None for d in dirs.values()):
                verdict = f"{'carried' if len(dirs) > 1 else 'resolved'} ({got.pop()})"
            elif got:
                verdict = f"resolved at {', '.join(s for s, d in dirs.items() if d is not None)} only"
            else:
                verdict = "not resolved"
        rows.append({"arm": a, "ref": r, "sizes": sizes, "verdict": verdict})
    return rows


def lines(rows: list[dict]) -> list[str]:
    """One line per contrast: the verdict, then each size's gap in nats with its 95 % interval, Holm-adjusted p and
    seeds."""
    out = []
    for row in rows:
        parts = []
        for size, c in row["sizes"].items():
            if c is None:
                parts.append(f"{size}: missing")
            elif c["ci"] is None:
                parts.append(f"{size}: {c['n']} seed(s)")
            else:
                parts.append(f"{size}: {c['mean']:+.4f} nats [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}], "
                             f"Holm p {c['p_holm']:.2g}, {c['n']} seeds" if c.get("p_holm") is not None else
                             f"{size}: {c['mean']:+.4f} nats [{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}], {c['n']} seeds")
        out.append(f"{row['arm']} minus {row['ref']}: {row['verdict']}; " + "; ".join(parts))
    return out


def plot(rows: list[dict], path) -> None:
    """A forest plot of ``across_sizes``' rows to ``path`` (PNG): one line per contrast, each size's gap in nats with
    its 95 % interval side by side, 0 marked, the verdict beside the contrast's name. Needs matplotlib (the
    ``plots`` extra)."""
    from .report import _plt  # startup (matplotlib: optional)
    plt = _plt()
    size_names = list(rows[0]["sizes"]) if rows else []
    n, k = len(rows), max(len(size_names), 1)
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.55 * n * k))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ticks, labels = [], []
    for i, row in enumerate(rows):
        base = (n - 1 - i) * (k + 1)
        for j, size in enumerate(size_names):
            c, y = row["sizes"][size], base + (k - 1 - j)
            if c is None or c.get("mean") is None:
                continue
            lo, hi = c["ci"] if c.get("ci") else (c["mean"], c["mean"])
            ax.plot([lo, hi], [y, y], color=colors[j % len(colors)], lw=2)
            ax.plot([c["mean"]], [y], "o", color=colors[j % len(colors)],
                    label=size if i == 0 else None, mfc="white" if c.get("resolved") is None else None)
        ticks.append(base + (k - 1) / 2)
        labels.append(f"{row['arm']} - {row['ref']}\n{row['verdict']}")
    ax.axvline(0.0, color="0.5", lw=1, ls="--")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("loss gap, nats (95 % interval over seeds; filled: resolved after Holm)")
    if size_names:
        ax.legend(title="size", fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
