"""``mxtrain study`` and ``mxtrain report``: argument parsers, registered by ``mxtrain.cli``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import UserError

__all__ = ["register", "study_main", "report_main"]


def register(subparsers) -> None:
    """Add the ``study`` and ``report`` sub-commands to an argparse ``subparsers`` object."""
    from .runner import PRESETS, SCHEDULES

    p = subparsers.add_parser(
        "study", help="run a controlled study: recipes (arms) x seeds, then summary.json and report.html",
        description="Train every arm (recipe) with every seed from one base config (same init, data order and "
                    "evaluation points), skip runs already finished, then write OUT/summary.json, OUT/report.html "
                    "and OUT/report.md. See docs/study.md.")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named study (arms, seeds, sizes); flags given "
                   "explicitly override the preset's values")
    p.add_argument("--arms", help="comma-separated recipe names, e.g. bf16,mxfp4-all,mxfp4-all-dh16")
    p.add_argument("--seeds", type=int, help="seeds per arm (seeds 0..N-1)")
    p.add_argument("--baseline", help="arm the others are compared with (default: the first arm)")
    p.add_argument("--out", help="study folder (default: studies/<preset or 'custom'>)")
    p.add_argument("--exp", help="base experiment config (as for mxtrain train --exp; default: tiny-main)")
    p.add_argument("--model", help="model size (as for mxtrain train)")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--data", help="prepared data folder (default: the built-in corpus)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: as for mxtrain train)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any training-config key for every run (repeatable)")
    p.add_argument("--schedule", choices=SCHEDULES, help="learning-rate schedule of every run: 'constant' "
                   "(after warmup; default), 'long-cosine' (cosine over --lr-horizon x the run's steps, as MLPerf), "
                   "or 'config' (leave the training config's schedule alone)")
    p.add_argument("--lr-horizon", type=float, help="cosine horizon as a multiple of the run length "
                   "(with --schedule long-cosine; default 10)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (default: about 1/40 of the run)")
    p.add_argument("--diagnose-every", type=int, help="per-GEMM diagnostics every N steps (0: off)")
    p.add_argument("--target-loss", type=float, help="val loss the extra-token cost is measured at "
                   "(default: the baseline's smoothed loss at --target-frac of its tokens)")
    p.add_argument("--target-frac", type=float, default=0.8)
    p.add_argument("--smooth-k", type=int, help="running mean over the last k evaluations (default 3)")
    p.add_argument("--jobs", type=int, default=1, help="train this many runs at once, in worker processes "
                   "(spread over the visible GPUs; small models share one GPU well). Default 1")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.set_defaults(func=study_main)

    r = subparsers.add_parser(
        "report", help="write report.html / report.md for a study folder or a single run folder",
        description="Recompute the study summary (or read a run folder) and write a self-contained HTML page "
                    "(plots embedded) and a Markdown page into DIR.")
    r.add_argument("dir", help="a study folder (OUT of mxtrain study) or a run folder (OUT of mxtrain train)")
    r.add_argument("--baseline", help="baseline arm (default: the study's)")
    r.add_argument("--target-loss", type=float)
    r.add_argument("--target-frac", type=float)
    r.add_argument("--smooth-k", type=int)
    r.set_defaults(func=report_main)


def study_main(args: argparse.Namespace) -> int:
    from .runner import StudyIncomplete, StudySpec, incomplete_message, run_study

    spec = StudySpec.from_args(args)
    if args.dry_run:
        print(spec.describe())
        return 0
    out = run_study(spec, jobs=args.jobs)
    s = json.loads((out / "summary.json").read_text())
    incomplete = incomplete_message(s)
    if incomplete is None:
        print(f"study done: {out}/report.html")
    elif s["arms"]:
        print(f"study summary of the finished runs (incomplete): {out}/report.html")
    for name, a in s["arms"].items():
        e = a["extra_tokens"]
        cost = (f"{100 * e['mean']:+.1f} % tokens" if e.get("state") == "ok" and e.get("mean") is not None
                else "reference" if e.get("state") == "baseline" else str(e.get("state")).replace("_", " "))
        fl = a["final_val_loss"].get("mean")
        print(f"  {name:22s} final val loss {('–' if fl is None else f'{fl:.4f}')}   extra tokens: {cost}")
    if incomplete is not None:
        raise StudyIncomplete(f"{incomplete}; {out}/summary.json lists them; rerun the same command to train them")
    return 0


def report_main(args: argparse.Namespace) -> int:
    from . import metrics as M
    from .report import write_report

    d = Path(args.dir)
    if not d.is_dir():
        raise UserError(f"{d}: no such folder")
    single = (d / "metrics.jsonl").is_file() and not (d / "runs").is_dir()
    summary = None
    if not single:
        runs = M.load_study_runs(d)
        if not runs:
            raise UserError(f"{d}: neither a run folder (metrics.jsonl) nor a study folder (runs/<arm>/seed<k>)")
        meta = json.loads((d / "study.json").read_text()) if (d / "study.json").is_file() else {}
        old = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
        base = args.baseline or meta.get("baseline") or old.get("baseline") or next(iter(runs))
        if base not in runs:
            raise UserError(f"baseline {base!r} has no runs in {d}; arms: {', '.join(runs)}")
        k = args.smooth_k or meta.get("smooth_k") or 3
        tl = args.target_loss if args.target_loss is not None else meta.get("target_loss")
        tf = args.target_frac or meta.get("target_frac") or 0.8
        summary = M.summarize(runs, base, target_loss=tl, target_frac=tf, smooth_k=k, recipes=meta.get("recipes"))
        if meta.get("arms") and meta.get("seeds") is not None:
            from .runner import incomplete_message
            summary["planned_runs"] = len(meta["arms"]) * len(meta["seeds"])
            summary["missing"] = M.missing_runs(d, meta["arms"], meta["seeds"], runs)
            msg = incomplete_message(summary)
            if msg:
                print(f"warning: {msg}", file=sys.stderr)
        summary = M.sanitize(summary)
        (d / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    hp, mp = write_report(d, summary)
    print(f"wrote {hp} and {mp}")
    return 0
