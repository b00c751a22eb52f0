"""The summary of a study folder (``summary.json``, ``seeds.json``) and its report, recomputed from the run
folders: ``summarize_study``, with the further references (``add_references``) and the cooldown design's
results (``add_cooldown``).

Imports marked ``# startup`` sit in the functions that use them: ``mxtrain.train`` (and the report)
load on first use, not when ``mxtrain report`` or ``mxtrain study --dry-run`` imports this module.
"""

from __future__ import annotations

from pathlib import Path

from .._io import write_json
from ..errors import read_json_object
from ..numerics import recipes as R
from . import arms as A
from . import cooldown as C
from . import metrics as M
from .claims import claim_lines, evaluate_claims
from .plan import branch_folder
from .run import _status

__all__ = ["summarize_study", "add_references", "add_cooldown", "study_scale", "per_seed_record"]


def summarize_study(out: str | Path) -> dict:
    """Recompute ``summary.json`` and the report from the run folders.

    ``summary["planned_runs"]`` counts the plan's arm x seed runs and ``summary["missing"]`` lists those
    without a finished run (failed, interrupted or never trained), each with its state and reason. When
    the baseline has no finished run there is nothing to compare with: ``summary.json`` then holds only
    the plan and the missing runs (``"arms": {}``) and no report is written."""
    from .report import write_report  # startup

    out = Path(out)
    meta = read_json_object(out / "study.json")
    runs = M.load_study_runs(out)
    arms = [a for a in meta["arms"] if a in runs] + sorted(a for a in runs if a not in meta["arms"])
    runs = {a: runs[a] for a in arms}  # arms of earlier invocations with other --arms are kept
    recipes = dict(meta.get("recipes") or {})
    for a in arms:
        if a not in recipes and A.is_arm(a):
            recipes[a] = R.get(A.recipe_of(a)).to_dict()
    missing = M.missing_runs(out, meta["arms"], meta["seeds"], runs)
    planned = len(meta["arms"]) * len(meta["seeds"])
    if meta["baseline"] not in runs:
        summary = {"schema": 1, "baseline": meta["baseline"], "target_loss": None,
                   "target_rule": "none: the baseline has no finished run", "arms": {}}
    else:
        summary = M.summarize(runs, meta["baseline"], target_loss=meta.get("target_loss"),
                              target_frac=meta.get("target_frac", 0.8), smooth_k=meta.get("smooth_k", 3),
                              recipes=recipes)
    summary["planned_runs"] = planned
    summary["missing"] = missing
    if summary["arms"]:
        add_references(summary, meta, runs)
    if meta.get("cooldown"):
        add_cooldown(summary, out, meta, runs)
    summary = M.sanitize(summary)
    write_json(out / "summary.json", summary, indent=1, allow_nan=False)
    if summary.get("per_seed"):
        write_json(out / "seeds.json", summary["per_seed"], indent=1, allow_nan=False)
    if summary["arms"]:
        write_report(out, summary)
    return summary


def add_references(summary: dict, meta: dict, runs: dict) -> None:
    """``summary["references"]``: every arm against each further reference arm of the study (``meta
    ["references"]``, e.g. ``fp8``), as ``mxtrain.study.metrics.compare_with`` gives it; a reference without a
    finished run is left out."""
    refs = {}
    for ref in meta.get("references") or []:
        if ref == meta["baseline"]:
            continue
        c = M.compare_with(runs, ref, target_loss=meta.get("target_loss"), target_frac=meta.get("target_frac", 0.8),
                           smooth_k=meta.get("smooth_k", 3))
        if c is not None:
            refs[ref] = c
    if refs:
        summary["references"] = refs


def add_cooldown(summary: dict, out: Path, meta: dict, runs: dict | None = None,
                 only: list[str] | None = None) -> None:
    """The cooldown design's results into ``summary``: ``branches`` (every planned branch of a stable run that
    is done: its state and cooled-down loss), ``cooldown`` (``mxtrain.study.cooldown.summarize_cooldown``:
    extra tokens per budget with seed-level intervals, the verdict lines, the claims), ``per_seed``
    (``per_seed_record``, also written to ``OUT/seeds.json``) and the branches not finished
    under ``missing`` (with their budget); ``planned_branches`` counts the plan's branches. ``only``: these arms'
    branches alone (a report of some of the arms)."""
    cd = meta["cooldown"]
    points = C.load_cooldown_points(out)
    if only is not None:
        points = {a: v for a, v in points.items() if a in only}
    plan = cd.get("branches") or []
    rows, missing = [], []
    for s in meta["seeds"]:
        for a in meta["arms"]:
            st = _status(out / "runs" / a / f"seed{s}")
            if not (st and st.get("state") == "done"):
                continue
            for br in plan:
                p = points.get(a, {}).get(int(s), {}).get(float(br["budget"]))
                bst = _status(branch_folder(out / "runs" / a / f"seed{s}", br["at_step"], br["cooldown_steps"]))
                state = (p or {}).get("state") or ("interrupted" if bst is None and branch_folder(
                    out / "runs" / a / f"seed{s}", br["at_step"], br["cooldown_steps"]).exists() else "not_trained")
                losses = (p or {}).get("losses")
                rows.append({"arm": a, "seed": int(s), **br, "state": state,
                             "val_loss": (sum(losses) / len(losses)) if losses else None,
                             "tokens": (p or {}).get("tokens")})
                if state not in ("done", "diverged"):
                    reason = (bst or {}).get("message") or ""
                    missing.append({"arm": a, "seed": int(s), "budget": br["budget"], "state": state,
                                    "reason": f"cooldown branch at budget {br['budget']:g}" + (f": {reason}" if reason else "")})
    summary["branches"] = rows
    summary["planned_branches"] = len(meta["arms"]) * len(meta["seeds"]) * len(plan)
    summary["missing"] = list(summary.get("missing") or []) + missing
    fit = cd.get("fit") or "lsq"
    if runs is None:
        runs = M.load_study_runs(out)
    scale = study_scale(runs, points)
    cool = C.summarize_cooldown(points, meta["baseline"], cd["budgets"], n_boot=int(cd.get("n_boot", 1000)), fit=fit)
    cool["shape"], cool["cooldown"] = cd.get("shape"), cd.get("cooldown")
    cool["scale"] = {**scale, "min_params": C.MIN_VERDICT_PARAMS, "min_tokens": C.MIN_VERDICT_TOKENS,
                     "min_seeds": C.MIN_SEEDS, "no_verdict": C.verdict_scale(scale["params"], scale["tokens"])}
    cool["verdict"] = C.verdict_lines(cool, scale)
    refs = {}
    for ref in meta.get("references") or []:
        if ref == meta["baseline"] or ref not in points:
            continue
        rc = C.summarize_cooldown(points, ref, cd["budgets"], n_boot=int(cd.get("n_boot", 1000)), fit=fit)
        rc["verdict"] = C.verdict_lines(rc, scale)
        refs[ref] = rc
    if refs:
        cool["references"] = refs
    claims = evaluate_claims(points, meta["arms"], cd["budgets"], n_boot=int(cd.get("n_boot", 1000)), fit=fit,
                             scale=scale)
    if claims:
        cool["claims"] = claims
        cool["claim_lines"] = claim_lines(claims)
    summary["cooldown"] = cool
    summary["per_seed"] = per_seed_record(summary, meta, runs, points)


def study_scale(runs: dict, points: dict) -> dict:
    """``{"params", "tokens"}`` of a cooldown study: the smallest parameter count its runs record (``run.json``'s
    ``model_params``; None where none does) and the tokens of its largest budget's branches (the smallest)."""
    ps = [rd.info.get("model_params") for rs in (runs or {}).values() for rd in rs.values()
          if isinstance(rd.info, dict)]
    ps = [float(p) for p in ps if isinstance(p, (int, float)) and not isinstance(p, bool)]
    bmax = max((b for a in points.values() for bs in a.values() for b in bs), default=None)
    toks = [p["tokens"] for a in points.values() for bs in a.values() for b, p in bs.items()
            if b == bmax and p.get("tokens")]
    return {"params": min(ps) if ps else None, "tokens": min(toks) if toks else None}


def per_seed_record(summary: dict, meta: dict, runs: dict, points: dict) -> dict:
    """The study's per-seed numbers, small enough to keep beside a report (``OUT/seeds.json``; docs/study.md): per
    arm and seed, the cooled-down loss at each budget (mean over its evaluation windows) with its tokens and
    window count, and the stable run's final validation loss; with the design (model, parameters, tokens per
    run, learning rate per arm, budgets, baseline). Every seed-level interval and test of the report can be
    recomputed from it (they use seed means only)."""
    arms: dict = {}
    for a, seeds in sorted(points.items()):
        for s, bs in sorted(seeds.items()):
            cooled = {}
            for b, p in sorted(bs.items()):
                ls = p.get("losses") or []
                fin = [x for x in ls if isinstance(x, (int, float))]
                cooled[f"{b:g}"] = {"state": p.get("state"), "tokens": p.get("tokens"),
                                    "loss": (sum(fin) / len(fin)) if fin and len(fin) == len(ls) else None,
                                    "n_windows": len(ls)}
            rd = (runs.get(a) or {}).get(s)
            t, v, _ = rd.finite_evals if rd is not None else ([], [], [])
            arms.setdefault(a, {})[str(s)] = {"cooled": cooled, "final_val_loss": v[-1] if v else None,
                                              "tokens_trained": t[-1] if t else None,
                                              "lr": ((rd.config or {}).get("optim") or {}).get("lr") if rd else None}
    scale = study_scale(runs, points)
    spec = meta.get("spec") or {}
    return {"schema": 1, "baseline": meta.get("baseline"), "model": spec.get("model"), "params": scale["params"],
            "steps": spec.get("steps"), "budgets": (meta.get("cooldown") or {}).get("budgets"),
            "cooldown": (meta.get("cooldown") or {}).get("cooldown"), "shape": (meta.get("cooldown") or {}).get("shape"),
            "data": spec.get("data"), "arms": arms}
