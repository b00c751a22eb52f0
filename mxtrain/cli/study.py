"""``mxtrain study`` and ``mxtrain report``: argument parsers, registered by ``mxtrain.cli.core``.

``mxtrain study --config FILE`` reads a TOML / JSON / YAML file whose ``[study]`` table sets what the flags
set (arms, seeds, baseline, out, ...) and whose other tables are the base training config of every run, as
in ``mxtrain train --config`` (docs/config.md). Precedence: preset < file < flags < ``--set``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

from .._io import write_json
from ..errors import UserError, number_flag, read_json_object
from ..study.plan import FLAG_KEYS, PER_RUN, PRESETS, SCHEDULES, StudySpec, build_config, override_key, model_shape_keys
from ..study.run import StudyIncomplete, compute_plan, describe_compute, incomplete_message, parse_only_seeds
from ..study.summary import add_cooldown, add_references
from ..study.workers import run_study
from ..study import metrics as M
from ..study.importruns import import_runs, parse_renames

__all__ = ["register", "study_main", "report_main"]


def register(subparsers) -> None:
    """Add the ``study`` and ``report`` sub-commands to an argparse ``subparsers`` object."""
    p = subparsers.add_parser(
        "study", help="run a controlled study: recipes (arms) x seeds, then summary.json and report.html",
        description="Train every arm (recipe) with every seed from one base config (same init, data order and "
                    "evaluation points), skip runs already finished, then write OUT/summary.json, OUT/report.html "
                    "and OUT/report.md. See docs/study.md.")
    p.add_argument("--config", metavar="FILE", help="study config file (.toml, .json, .yaml): a [study] table "
                   "(arms, seeds, baseline, out, ...) and the base training config; flags override it "
                   "(docs/config.md, examples/study.toml)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named study (arms, seeds, sizes); a config file and "
                   "flags given explicitly override the preset's values")
    p.add_argument("--arms", help="comma-separated arms: recipe names, each optionally with @OPTION training "
                   "options, e.g. bf16,mxfp4-all,mxfp4-all-dh16,mxfp4-all@deosc (docs/study.md)")
    p.add_argument("--seeds", type=number_flag(lo=1, hi=10**6, integer=True), help="seeds per arm (seeds 0..N-1)")
    p.add_argument("--baseline", help="arm the others are compared with (default: the first arm)")
    p.add_argument("--references", help="comma-separated further arms every arm is also compared with, e.g. fp8 "
                   "(the report gives extra tokens and loss gaps against each)")
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
    p.add_argument("--lr-horizon", type=number_flag(lo=1), help="cosine horizon as a multiple of the run length "
                   "(with --schedule long-cosine; default 10)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (default: about 1/40 of the run)")
    p.add_argument("--diagnose-every", type=number_flag(lo=0, integer=True), help="per-GEMM diagnostics every N steps (0: off)")
    p.add_argument("--target-loss", type=number_flag(), help="val loss the extra-token cost is measured at "
                   "(default: the baseline's smoothed loss at --target-frac of its tokens)")
    p.add_argument("--target-frac", type=number_flag(lo=0, lo_open=True, hi=1), help="share of the baseline's tokens the target loss is read at "
                   "(default 0.8)")
    p.add_argument("--smooth-k", type=number_flag(lo=1, integer=True), help="running mean over the last k evaluations (default 3)")
    p.add_argument("--budgets", help="cooldown design: comma-separated budgets as fractions of the run, e.g. "
                   "0.25,0.5,0.75,1; every arm x seed trains one constant-LR run with checkpoints at the branch "
                   "points, then a cooldown branch per budget, and the report gives the extra tokens per budget "
                   "with seed-level paired intervals (docs/study.md)")
    p.add_argument("--cooldown", type=number_flag(lo=0, hi=1, lo_open=True, hi_open=True), help="with --budgets: share of each budget spent cooling down "
                   "(default 0.2)")
    p.add_argument("--cooldown-shape", choices=["linear", "1-sqrt"], help="with --budgets: the decay's shape "
                   "(default 1-sqrt)")
    p.add_argument("--n-boot", type=number_flag(lo=10, hi=10**7, integer=True), help="replicates of the bootstrap over evaluation windows (seeds held fixed) "
                   "that measures the evaluation-noise share of the cooled-down metric (default 1000); the "
                   "intervals themselves are seed-level t intervals (docs/study.md)")
    p.add_argument("--fit", choices=["lsq", "huber"], help="with --budgets: fit the baseline's L(D) = E + B D^-beta "
                   "by least squares on L (lsq, default) or by a Huber loss on log L (huber, delta 1e-3, as "
                   "Hoffmann et al. 2022): robust to one bad point")
    p.add_argument("--jobs", type=number_flag(lo=1, hi=4096, integer=True), help="train this many runs at once, in worker processes "
                   "(spread over the visible GPUs; small models share one GPU well). Default 1")
    p.add_argument("--start-by", type=number_flag(), metavar="SECONDS", help="start no run later than SECONDS from now "
                   "(nor continue or remake one); cooldown branches whose checkpoints are at hand still train: a "
                   "time-limited machine spends its end on what can finish, and the rest waits for the next session")
    p.add_argument("--only-seeds", metavar="SEEDS", help="comma-separated seeds of the plan (0 to --seeds - 1) this "
                   "session trains, e.g. 4: the other seeds' runs, branches and remakes wait for a later session "
                   "(the plan and the report keep every arm and seed). A time-limited machine spends its time "
                   "on the seeds that complete a comparison")
    p.add_argument("--dry-run", action="store_true", help="print the plan and what it will train (parameters, "
                   "tokens per run and per parameter, tokens of all runs and branches) and exit")
    p.add_argument("--tokens-per-s", type=number_flag(), help="with --dry-run: training tokens a second of this machine, "
                   "all jobs together (measured: a finished study's runs report tok_per_s), for a time estimate")
    p.set_defaults(func=study_main)

    r = subparsers.add_parser(
        "report", help="write report.html / report.md for a study folder or a single run folder",
        description="Recompute the study summary (or read a run folder) and write a self-contained HTML page "
                    "(plots embedded) and a Markdown page into DIR.")
    r.add_argument("dir", help="a study folder (OUT of mxtrain study) or a run folder (OUT of mxtrain train)")
    r.add_argument("--baseline", help="baseline arm (default: the study's)")
    r.add_argument("--references", help="comma-separated further arms every arm is also compared with (default: "
                   "the study's), e.g. mxfp4-all to see what an intervention changes against plain MXFP4")
    r.add_argument("--target-loss", type=number_flag())
    r.add_argument("--target-frac", type=number_flag(lo=0, lo_open=True, hi=1))
    r.add_argument("--smooth-k", type=number_flag(lo=1, integer=True))
    r.add_argument("--fit", choices=["lsq", "huber"], help="the cooled-down baseline fit (default: the study's)")
    r.add_argument("--arms", help="comma-separated arms to report (the baseline among them), e.g. to leave out a "
                   "learning-rate check whose curve dwarfs the others in the figures; needs --out")
    r.add_argument("--out", help="write report.html, report.md, its figures and summary.json here instead of DIR "
                   "(DIR's own summary and report stay as they are)")
    r.set_defaults(func=report_main)
    register_import(subparsers)
    register_sizes(subparsers)


def study_main(args: argparse.Namespace) -> int:
    cli_sets = list(args.overrides or [])
    cli_model = getattr(args, "model", None)   # (--model on the command line, before [study] model fills it)
    if getattr(args, "config", None):
        apply_study_file(args, args.config)
    if isinstance(args.arms, str) and not [a for a in args.arms.split(",") if a.strip()]:
        # "" (or "," or arms = [] in a file) names no arm: refused, not replaced by the default arms (#47)
        raise UserError(f"--arms {args.arms!r} names no arm: list recipe names, e.g. --arms bf16,mxfp4-all "
                        "(or leave it out for the default arms)")
    jobs_given = args.jobs is not None
    if args.jobs is None:
        args.jobs = 1
    if args.jobs < 1:   # as run_study checks, also before a --dry-run's plan
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    spec = StudySpec.from_args(args)
    spec.check_branch_options()
    from ..train.config import check_init_from, check_model_shape, validate  # startup
    from .core import _refuse_shape_with_init_from  # startup
    how = _override_sources(spec, args, cli_sets)
    kept = {}   # arm -> the recipe overrides its runs keep
    for arm in spec.arms:  # every run's config is valid (as run_study checks first), before anything is written
        cfg = build_config(spec, arm, 0, Path(spec.out) / "runs" / "check")
        kept[arm] = set(cfg.recipe_overrides)
        check_model_shape(cfg, how)   # a named size and shape fields that contradict it: one line, as for train
        if args.dry_run:
            validate(cfg)
        check_init_from(cfg.train.init_from)
        if cfg.train.init_from:   # the folder's shape: a size or shape key the user gave would be ignored (#47)
            _refuse_shape_with_init_from(cfg, _user_given(spec, args, cli_sets, cli_model, how), {})
    prescale_note = _prescales_by_arm(spec, how, kept)
    rate = getattr(args, "tokens_per_s", None)
    if rate is not None and (not args.dry_run or not rate > 0):
        raise UserError(f"--tokens-per-s {rate:g}: " + ("give a positive rate" if args.dry_run else
                        "it only sizes the plan of --dry-run; add --dry-run, or leave it out"))
    sb = getattr(args, "start_by", None)
    if sb is not None and not sb >= 0:
        raise UserError(f"--start-by {sb:g}: give the seconds from now after which no run starts (0 or more)")
    only = parse_only_seeds(getattr(args, "only_seeds", None), spec.seeds)
    if args.dry_run:
        print(spec.describe())
        if prescale_note:
            print(prescale_note)
        print(describe_compute(compute_plan(spec, getattr(args, "tokens_per_s", None))))
        later = (([f"--jobs {args.jobs}"] if jobs_given else []) + ([f"--start-by {sb:g}"] if sb is not None else [])
                 + ([f"--only-seeds {args.only_seeds}"] if only is not None else []))
        if later:   # (a flag given is never dropped silently: these shape how the study runs, not its plan)
            print(f"not part of this plan: {' and '.join(later)} {'apply' if len(later) > 1 else 'applies'} when "
                  "the study runs (the same command without --dry-run)")
        return 0
    _check_study_out(Path(spec.out))
    if prescale_note:
        print(prescale_note)
    import time
    out = run_study(spec, jobs=args.jobs, start_by=None if sb is None else time.time() + sb, only_seeds=only)
    _check_runs_have_evaluations(M.load_study_runs(out))
    s = json.loads((out / "summary.json").read_text())
    incomplete = incomplete_message(s)
    if incomplete is None:
        print(f"study done: {out}/report.html")
    elif s["arms"]:
        print(f"study summary of the finished runs (incomplete): {out}/report.html")
    if s["arms"]:
        _say_if_no_plots()
    for name, a in s["arms"].items():
        e = a["extra_tokens"]
        cost = (f"{100 * e['mean']:+.1f} % tokens" if e.get("state") == "ok" and e.get("mean") is not None
                else "reference" if e.get("state") == "baseline" else str(e.get("state")).replace("_", " "))
        fl = a["final_val_loss"].get("mean")
        print(f"  {name:22s} final val loss {('–' if fl is None else f'{fl:.4f}')}   extra tokens: {cost}")
    for line in (s.get("cooldown") or {}).get("verdict") or []:
        print(f"  cooled down: {line}")
    for line in (s.get("cooldown") or {}).get("claim_lines") or []:
        print(f"  claim: {line}")
    if incomplete is not None:
        raise StudyIncomplete(f"{incomplete}; {out}/summary.json lists them; rerun the same command to train them")
    return 0


def _override_sources(spec: StudySpec, args, cli_sets: list[str]) -> dict:
    """key -> how the user gave each of the study's overrides (``--set model.dim=64``, ``model.dim=64 (study file
    s.toml)``, ``model.dim=64 (preset smoke)``), for messages that name where a value came from."""
    config = getattr(args, "config", None)
    how = {}
    for o in spec.overrides:
        if o in cli_sets:
            how[override_key(o)] = f"--set {o}"
        elif config and o in (args.overrides or []):
            how[override_key(o)] = f"{o} (study file {config})"
        else:
            how[override_key(o)] = f"{o} (preset {spec.preset})" if spec.preset else o
    return how


def _prescales_by_arm(spec: StudySpec, how: dict, kept: dict) -> str | None:
    """A prescale override (``recipe.OPERAND.prescale``) applies to the arms that quantize the operand
    (``plan.unquantized_prescales``; ``kept``: arm -> the recipe overrides its runs keep): refused in one line
    where no arm does (it would change nothing), else a line naming the arms it skips (None when it skips none)."""
    notes = []
    for o in spec.overrides:
        key = override_key(o)
        if not (key.startswith("recipe.") and key.endswith(".prescale")):
            continue
        op = key.split(".")[1]
        skipped = [a for a in spec.arms if key[len("recipe."):] not in kept[a]]
        if len(skipped) == len(spec.arms):
            raise UserError(f"{how.get(key, o)}: no arm quantizes {op} ({', '.join(spec.arms)}), so the prescale "
                            f"would change nothing; remove it, or add an arm that quantizes {op}")
        if skipped:
            notes.append(f"{o} applies to the arms that quantize {op}: not to {', '.join(skipped)}")
    return "; ".join(notes) or None


def _user_given(spec: StudySpec, args, cli_sets: list[str], cli_model, how: dict) -> dict:
    """key -> how the user gave it, for the settings the user gave (``--set``, the study file, ``--model`` or
    ``[study] model``), not a preset's: a preset's model shape gives way to an ``init_from`` folder's as an
    experiment's does in ``mxtrain train``, one the user gave is refused there."""
    mine = set(cli_sets) | set(args.overrides or [])
    given = {override_key(o): how.get(override_key(o), f"--set {o}") for o in spec.overrides if o in mine}
    if cli_model is not None:
        given["model.name"] = f"--model {cli_model}"
    elif getattr(args, "config", None) and getattr(args, "model", None) is not None:
        given["model.name"] = f"[study] model = {args.model!r} (study file {args.config})"
    return given


def _check_runs_have_evaluations(runs: dict) -> None:
    """A finished run (not diverged) records a validation loss at its end at least: one with none has a damaged
    or emptied metrics.jsonl, and its arm was reported as "did not reach" the target (#47). Refused in one line."""
    for arm, seeds in runs.items():
        for seed, rd in seeds.items():
            if not rd.val_loss and rd.status.get("state") != "diverged":
                raise UserError(f"{rd.path}/metrics.jsonl holds no validation loss, though the run finished: the "
                                f"file is damaged or emptied; restore it, or remove {rd.path} to train {arm} seed "
                                f"{seed} again")


# what a study folder holds (before its study.json is written, too): anything else is another command's folder
_STUDY_FILES = {"study.json", "runs", "claims", ".lock", ".write_test", "summary.json", "seeds.json", "report.html",
                "report.md", "report_files"}


def _check_study_out(out: Path) -> None:
    """A study writes summary.json, report.html and report.md into OUT: an existing folder that is not a
    study's (a run folder, a data folder, anything else) is refused, not written over (#47: a study with --out
    RUN replaced the run's summary.json)."""
    if not out.is_dir() or (out / "study.json").exists():
        return
    try:
        other = sorted(p.name for p in out.iterdir() if p.name not in _STUDY_FILES)
    except OSError as e:
        raise UserError(f"cannot read the study folder {out}: {e.strerror or e}") from None
    if other:
        raise UserError(f"--out {out} is not a study folder (no study.json) and holds other files "
                        f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): a study would write its "
                        f"summary.json and report there; give a new or empty folder")


# [study] keys that are not StudySpec fields
_STUDY_EXTRA = ("jobs",)


def _text(v) -> str:
    """A config value as ``--set`` reads it."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


def apply_study_file(args: argparse.Namespace, path) -> None:
    """Fill ``args`` from a study config file: the ``[study]`` table's values where no flag was given, and the
    other tables (the base training config) as ``--set`` items placed before the command line's (so
    ``--set`` wins), leaving out the keys that a flag sets. Every key and value is checked now (one-line
    ``UserError`` naming the file, the key and the nearest valid keys)."""
    import dataclasses
    import difflib
    import typing

    from ..train import experiments  # startup
    from ..train.config import TrainConfig, _coerce, apply_dict, config_file_path, read_config_file  # startup

    p = config_file_path(path)
    src = str(p)
    d = {k: v for k, v in read_config_file(p).items() if not (isinstance(k, str) and k.startswith("_"))}
    cli_keys = {override_key(o) for o in args.overrides or []}   # (--set on the command line)
    # the model size named on the command line (before [study] model fills --model): --set model.name=M names it
    # as --model M does (and wins over it, as in mxtrain train)
    named = [f"--set {o}" for o in args.overrides or [] if override_key(o) == "model.name"]
    model_flag = named[-1] if named else (f"--model {args.model}" if getattr(args, "model", None) else None)
    file_overrides: list[str] = []   # [study] overrides
    from_study: dict = {}            # flag -> the value the [study] table gave it
    study = d.pop("study", {})
    if not isinstance(study, dict):
        raise UserError(f"{src}: study must be a table ([study] in TOML) of arms, seeds, baseline, ...; got {study!r}")

    # [study]: StudySpec fields (and jobs), where the command line gave no value
    hints = typing.get_type_hints(StudySpec)
    valid = [f.name for f in dataclasses.fields(StudySpec)] + list(_STUDY_EXTRA)
    for k, v in study.items():
        if k not in valid:
            near = difflib.get_close_matches(k, valid, n=2, cutoff=0.6)
            raise UserError(f"{src}: unknown key 'study.{k}'{'; did you mean ' + ' or '.join('study.' + n for n in near) + '?' if near else ''}"
                            f" (keys of study: {', '.join(valid)})")
        if k in ("arms", "references"):
            if isinstance(v, str):
                v = [a.strip() for a in v.split(",") if a.strip()]
            if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
                raise UserError(f"{src}: study.{k}: expected a list of arm names, got {v!r}")
            if getattr(args, k, None) is None:
                setattr(args, k, ",".join(v))
            continue
        if k == "budgets":
            if isinstance(v, str):
                v = [x.strip() for x in v.split(",") if x.strip()]
            if not isinstance(v, list) or not all(isinstance(x, (int, float, str)) and not isinstance(x, bool)
                                                  for x in v):
                raise UserError(f"{src}: study.budgets: expected a list of fractions of the run, got {v!r}")
            if getattr(args, "budgets", None) is None:
                args.budgets = ",".join(str(x) for x in v)
            continue
        if k == "overrides":
            if not isinstance(v, list) or not all(isinstance(o, str) for o in v):
                raise UserError(f"{src}: study.overrides: expected a list of \"KEY=VALUE\" texts, got {v!r}")
            args.overrides = list(v) + list(args.overrides or [])
            file_overrides += v
            continue
        tp = int if k == "jobs" else hints[k]
        v = _coerce(v, tp, f"study.{k}", src)
        if k == "preset" and v is not None and v not in PRESETS:
            raise UserError(f"{src}: study.preset: unknown preset {v!r}; presets: {', '.join(sorted(PRESETS))}")
        if v == "":   # (not "not given": the file gave it; a flag's '' is refused the same way)
            raise UserError(f"{src}: study.{k} = '': an empty value; give one, or leave study.{k} out")
        if k == "exp" and v is not None and v not in experiments.names():   # (even where --exp wins)
            raise UserError(f"{src}: study.exp: {v!r} is not an experiment (the base config of every run); "
                            f"experiments: {', '.join(experiments.names())}")
        if getattr(args, k, None) is None:
            setattr(args, k, v)
            from_study[k] = v

    # the base training config: top-level exp names the base experiment; the tables become --set items
    if "exp" in d:
        exp = _coerce(d.pop("exp"), str, "exp", src)
        if exp not in experiments.names():
            raise UserError(f"{src}: exp {exp!r} is not an experiment (the base config of every run); experiments: "
                            f"{', '.join(experiments.names())}")
        if args.exp is None:
            args.exp = exp
    if args.exp is not None:
        experiments.get(args.exp)  # an unknown name: one clear error now
    keys = _given_keys(d, f"{src}: ")
    for key in keys:
        per_run = "recipe" if key == "recipe" or key.startswith("recipe.") else key
        if per_run in PER_RUN:
            raise UserError(f"{src}: {per_run} is set by the study for each run ({PER_RUN[per_run]}); remove it")
    given = apply_dict(TrainConfig(), d, src)  # types and unknown keys checked, values read as the fields' types
    _check_file_against_flags(src, keys, given, from_study, model_flag, cli_keys, file_overrides)
    items = []
    for key in keys:
        if key.startswith("recipe_overrides."):
            rk = key.split(".", 1)[1]
            items.append(f"recipe.{rk}={_text(given.recipe_overrides[rk])}")
            continue
        flag = next((f for f, fk in FLAG_KEYS.items() if fk == key), None)
        if flag is not None and getattr(args, flag, None) is not None:
            continue  # the flag (or [study] value) wins
        sec, field = key.split(".", 1)
        items.append(f"{key}={_text(getattr(getattr(given, sec), field))}")
    args.overrides = items + list(args.overrides or [])   # (StudySpec.from_args keeps a schedule.kind given)


def _check_file_against_flags(src: str, keys: list[str], given, from_study: dict, model_flag, cli_keys: set,
                              file_overrides: list[str]) -> None:
    """A setting a study file gives twice ([study] steps and [train] steps, [study] model and [model] name) with
    two values, and a model size named on the command line (``model_flag``: ``--model M`` or ``--set
    model.name=M``) over a study file that sets the model's shape, are refused in one line, as ``mxtrain train``
    refuses the second: neither value may be dropped silently (#47)."""
    for key in keys:
        flag = next((f for f, fk in FLAG_KEYS.items() if fk == key), None)
        if flag in from_study:
            sec, fld = key.split(".", 1)
            v = getattr(getattr(given, sec), fld)
            if v != from_study[flag]:
                raise UserError(f"{src}: [study] {flag} = {_text(from_study[flag])} and {key} = {_text(v)} both set "
                                f"{key} of every run; give one of them")
    if model_flag is None:
        return
    shape = set(model_shape_keys())
    items = {k: f"{k}={_text(getattr(given.model, k.split('.', 1)[1]))}" for k in keys if k in shape}
    items.update({override_key(o): o for o in file_overrides if override_key(o) in shape})
    dropped = {k: o for k, o in items.items() if k not in cli_keys}
    if dropped:
        keep = " ".join(f"--set {o}" for o in dropped.values())
        raise UserError(f"{model_flag} names a model size, and the study file {src} sets "
                        f"{', '.join(dropped)} of the shape: say which shape you mean: add {keep} to keep the file's "
                        f"on top of the size, or name the size in the file ([study] model) instead of the flag")


def _given_keys(d: dict, where: str = "") -> list[str]:
    """The dotted keys a config file's tables set (``optim.lr``, ``recipe_overrides.wgrad_dy.rounding``)."""
    from ..train.config import _flat, _nest  # startup
    out = []
    for k, v in _nest(d, where).items():
        if k == "recipe_overrides" and isinstance(v, dict):
            out += [f"recipe_overrides.{rk}" for rk in _flat(v)]
        elif isinstance(v, dict):
            out += [f"{k}.{fk}" for fk in v]
        else:
            out.append(k)
    return out


def report_main(args: argparse.Namespace) -> int:
    from ..study.report import write_report  # startup

    d = Path(args.dir)
    if not d.is_dir():
        raise UserError(f"{d}: no such folder")
    single = (d / "metrics.jsonl").is_file() and not (d / "runs").is_dir()
    out = Path(args.out) if getattr(args, "out", None) else d
    sel = [a.strip() for a in (getattr(args, "arms", None) or "").split(",") if a.strip()]
    if single:   # the study's options would be silently ignored for one run
        given = [f for f, v in (("--arms", sel), ("--baseline", args.baseline), ("--references", args.references),
                                ("--target-loss", args.target_loss), ("--target-frac", args.target_frac),
                                ("--smooth-k", args.smooth_k), ("--fit", args.fit)) if v not in (None, [])]
        if given:
            raise UserError(f"{', '.join(given)}: {d} is a single run's folder, not a study (these options compare "
                            f"a study's arms)")
    if sel and out.resolve() == d.resolve():
        raise UserError("--arms needs --out: a report of some of the arms goes to its own folder, so that the "
                        f"study's summary.json and report in {d} stay whole")
    if out.resolve() != d.resolve() and out.exists():
        if not out.is_dir():
            raise UserError(f"--out {out} exists and is not a folder; give a new or empty folder")
        mine = {"report.html", "report.md", "summary.json", "seeds.json", "report_files"}
        other = sorted(p.name for p in out.iterdir() if p.name not in mine)
        if other or ((out / "summary.json").is_file() and not (out / "report.html").is_file()):
            raise UserError(f"--out {out} holds other files ({', '.join(other[:3]) or 'a summary.json of its own'}"
                            f"{', ...' if len(other) > 3 else ''}): the report would overwrite its summary.json; "
                            f"give a new or empty folder, or a folder an earlier report was written to")
    if args.smooth_k is not None and args.smooth_k < 1:
        raise UserError(f"--smooth-k must be >= 1, got {args.smooth_k}")
    if args.target_frac is not None and not 0 < args.target_frac <= 1:
        raise UserError(f"--target-frac must be in (0, 1], got {args.target_frac}")
    if args.target_loss is not None and not math.isfinite(args.target_loss):
        raise UserError(f"--target-loss must be a finite number, got {args.target_loss}")
    if out.is_dir():   # a read-only run folder: said now, before the report is computed
        with _report_writes(out):
            probe = out / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
    new_out = not out.exists()   # a folder this report makes: removed again if the report fails (a half report
    try:                         # there, its summary.json without report.html, would make --out refused next time)
        return _report(args, d, out, single, sel, write_report)
    except BaseException:
        if new_out and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _report(args, d: Path, out: Path, single: bool, sel: list, write_report) -> int:
    """``report_main`` once its arguments are checked: the summary and the report written into ``out``."""
    summary = None
    if not single:
        runs = M.load_study_runs(d)
        if not runs:
            if (d / "study.json").is_file():
                raise UserError(f"{d}: a study with no run that trained yet (nothing to report); run "
                                f"`mxtrain study` with its settings to train it")
            raise UserError(f"{d}: neither a run folder (metrics.jsonl) nor a study folder (runs/<arm>/seed<k>)")
        meta = read_json_object(d / "study.json") if (d / "study.json").is_file() else {}
        _check_runs_have_evaluations(runs)   # (after study.json: the study's own definition is checked first)
        old = read_json_object(d / "summary.json") if (d / "summary.json").is_file() else {}
        base = args.baseline or meta.get("baseline") or old.get("baseline") or next(iter(runs))
        if base not in runs:
            raise UserError(f"baseline {base!r} has no runs in {d}; arms: {', '.join(runs)}")
        if sel:
            unknown = [a for a in sel if a not in runs]
            if unknown:
                raise UserError(f"--arms {','.join(unknown)}: no finished runs of that arm in {d}; arms: "
                                f"{', '.join(runs)}")
            if base not in sel:
                raise UserError(f"--arms leaves out the baseline {base!r}: add it, or name another baseline "
                                f"among them with --baseline")
            runs = {a: runs[a] for a in dict.fromkeys(sel)}
            meta = {**meta, "references": [r for r in meta.get("references") or [] if r in runs]}
            if meta.get("arms"):
                meta["arms"] = [a for a in meta["arms"] if a in runs]
        k = args.smooth_k if args.smooth_k is not None else meta.get("smooth_k") or 3
        tl = args.target_loss if args.target_loss is not None else meta.get("target_loss")
        tf = args.target_frac if args.target_frac is not None else meta.get("target_frac") or 0.8
        summary = M.summarize(runs, base, target_loss=tl, target_frac=tf, smooth_k=k, recipes=meta.get("recipes"))
        if meta.get("arms") and meta.get("seeds") is not None:
            summary["planned_runs"] = len(meta["arms"]) * len(meta["seeds"])
            summary["missing"] = M.missing_runs(d, meta["arms"], meta["seeds"], runs)
            msg = incomplete_message(summary)
            if msg:
                print(f"warning: {msg}", file=sys.stderr)
            meta = {**meta, "baseline": base, "target_loss": tl, "target_frac": tf, "smooth_k": k}
            if getattr(args, "references", None) is not None:
                refs = [r.strip() for r in args.references.split(",") if r.strip()]
                unknown = [r for r in refs if r not in runs]
                if unknown:
                    raise UserError(f"--references {','.join(unknown)}: no runs of that arm in {d}; arms: "
                                    f"{', '.join(runs)}")
                meta["references"] = [r for r in dict.fromkeys(refs) if r != base]
            if summary["arms"]:
                add_references(summary, meta, runs)
            if meta.get("cooldown"):
                if args.fit:
                    meta = {**meta, "cooldown": {**meta["cooldown"], "fit": args.fit}}
                add_cooldown(summary, d, meta, runs, only=list(runs) if sel else None)
        summary = M.sanitize(summary)
        with _report_writes(out):
            out.mkdir(parents=True, exist_ok=True)
            write_json(out / "summary.json", summary, indent=1, allow_nan=False)
            if summary.get("per_seed"):
                write_json(out / "seeds.json", summary["per_seed"], indent=1, allow_nan=False)
    with _report_writes(out):
        hp, mp = write_report(d, summary, out=out, arms=list(runs) if sel else None)
    print(f"wrote {hp} and {mp}")
    _say_if_no_plots()
    return 0


@contextlib.contextmanager
def _report_writes(out: Path):
    """Writing the report into ``out``: a folder that cannot be written (read-only, a full disk) is one
    UserError that says where else to write it (``write_json`` says so itself)."""
    try:
        yield
    except OSError as e:
        raise UserError(f"cannot write the report into {out}: {e.strerror or e}; write it to another folder with "
                        f"--out DIR") from None


def _say_if_no_plots() -> None:
    """One line on stderr when the report just written has no figures (matplotlib missing)."""
    from ..study.report import PLOTS_MISSING, plots_available  # startup
    if not plots_available():
        print(f"mxtrain: {PLOTS_MISSING}", file=sys.stderr)


def register_import(subparsers) -> None:
    """Add the ``study-import`` sub-command."""
    p = subparsers.add_parser(
        "study-import", help="copy finished runs of one study folder into another, as arms of it (checked)",
        description="Copy the finished runs (with their cooldown branches) of study SRC into study DST, under "
                    "DST's arm names, e.g. a learning-rate check trained as its own study (--lr 1.5e-3) into the "
                    "main study as bf16@lr1.5e-3. A run is copied only if DST would train exactly it: the config "
                    "DST builds for that arm and seed equals the run's config.json (all but its folder), and both "
                    "studies branch at the same steps; nothing in DST is overwritten. Then run mxtrain report DST.")
    p.add_argument("src", help="the study folder to copy runs from")
    p.add_argument("dst", help="the study folder to copy them into")
    p.add_argument("--arms", help="comma-separated SOURCE_ARM=NEW_ARM (or SOURCE_ARM to keep its name), e.g. "
                   "bf16=bf16@lr1.5e-3,mxfp4-dgrad=mxfp4-dgrad@lr1.5e-3 (default: every arm of SRC, same names)")
    p.add_argument("--dry-run", action="store_true", help="check and list what would be copied; copy nothing")
    p.set_defaults(func=study_import_main)


def study_import_main(args: argparse.Namespace) -> int:

    done = import_runs(args.src, args.dst, parse_renames(args.arms) or None, dry_run=args.dry_run)
    if args.dry_run:
        print(f"dry run: {len(done)} runs would be imported; nothing copied")
    else:
        print(f"{len(done)} runs imported into {args.dst}; `mxtrain report {args.dst}` writes its report")
    return 0


def register_sizes(subparsers) -> None:
    """Add the ``sizes`` sub-command (``mxtrain.study.sizes``)."""
    p = subparsers.add_parser(
        "sizes", help="judge planned contrasts in studies at several model sizes: does each size carry a finding?",
        description="Each contrast ARM:REFERENCE is the per-seed gap of the cooled-down loss at one budget, tested "
                    "at each size with the paired t over its seeds, Holm-adjusted over the contrasts given (one "
                    "family per size); the verdict says whether every size resolves it the same way (carried), only "
                    "some do, two disagree, or none does; no verdict below 3 seeds. Reads each study's seeds.json "
                    "(mxtrain report writes it).")
    p.add_argument("studies", nargs="+", metavar="SIZE=PATH",
                   help="a name for the size and its study folder or seeds.json, e.g. 125m=studies/ladder-125m")
    p.add_argument("--contrast", action="append", required=True, metavar="ARM:REFERENCE",
                   help="a planned contrast, e.g. mxfp4-all:mxfp4-fprop-dgrad (repeat for each)")
    p.add_argument("--budget", type=number_flag(lo=0, lo_open=True, hi=1), default=1.0,
                   help="the budget (fraction of the run) the contrasts are read at (default 1, the full budget)")
    p.add_argument("--json", help="also write the rows (each size's test and the verdict) to this file")
    p.add_argument("--plot", help="also draw them as a forest plot (PNG) to this file (needs mxtrain[plots])")
    p.set_defaults(func=sizes_main)


def _seeds_record(path: str) -> tuple[Path, dict]:
    p = Path(path)
    f = p / "seeds.json" if p.is_dir() else p
    if not f.is_file():
        raise UserError(f"{path}: no seeds.json {'in that folder' if p.is_dir() else 'file there'} (mxtrain report "
                        "writes it into a study folder)")
    rec = read_json_object(f, "a study's per-seed record")
    if not isinstance(rec.get("arms"), dict):
        raise UserError(f"{f} is not a study's per-seed record (no 'arms'): give the seeds.json mxtrain report wrote")
    return f, rec


def sizes_main(args: argparse.Namespace) -> int:
    from ..study import sizes  # startup
    import difflib
    records = {}
    for item in args.studies:
        name, eq, path = item.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise UserError(f"{item!r}: give each study as SIZE=PATH, e.g. 125m=studies/ladder-125m")
        if name in records:
            raise UserError(f"size {name!r} is given twice")
        records[name] = _seeds_record(path)[1]
    contrasts = []
    every = sorted({a for r in records.values() for a in r["arms"]})
    for c in args.contrast:
        arm, colon, ref = (x.strip() for x in c.partition(":"))
        if not colon or not arm or not ref:
            raise UserError(f"--contrast {c!r}: give ARM:REFERENCE, e.g. mxfp4-all:mxfp4-fprop-dgrad")
        for a in (arm, ref):
            if a not in every:
                near = difflib.get_close_matches(a, every, n=1)
                raise UserError(f"--contrast {c!r}: no study has an arm {a!r}"
                                f"{f' (did you mean {near[0]}?)' if near else ''}; arms: {', '.join(every)}")
        contrasts.append((arm, ref))
    budget = sizes.budget_key(records, args.budget)
    rows = sizes.across_sizes(records, contrasts, budget)
    print(f"at budget {args.budget:g}, {len(contrasts)} contrast(s), Holm within each size:")
    print("\n".join(sizes.lines(rows)))
    if args.json:
        write_json(args.json, {"budget": args.budget, "sizes": list(records), "rows": rows})
    if args.plot:
        from ..study.report import PLOTS_MISSING, plots_available  # startup
        if not plots_available():
            raise UserError(f"--plot: {PLOTS_MISSING.split(' (')[0].replace('figures left out: ', '')} "
                            "(pip install 'mxtrain[plots]')")
        try:
            sizes.plot(rows, args.plot)
        except OSError as e:
            raise UserError(f"--plot {args.plot}: cannot write it ({e.strerror or e})") from None
        print(f"forest plot: {args.plot}")
    return 0
