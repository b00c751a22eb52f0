"""``mxtrain study-import``: bring the finished runs of one study folder into another, under arm names of the
destination, after proving that the destination would have trained exactly those runs.

A study is often assembled over several sessions of a time-limited machine, and a question asked later (a
learning-rate check trained as its own study with ``--lr 1.5e-3``) can turn out to be an arm of the main study
(``bf16@lr1.5e-3`` beside the main study's ``bf16`` at its base learning rate). Training those runs again would
spend GPU time on runs that exist. ``import_runs`` copies them instead, and copies a run only when:

* the source run is finished (``study_status.json`` says done or diverged), with every branch of its cooldown
  plan finished;
* the training config the destination study builds for the new arm and that seed (``plan.build_config``)
  equals the source run's ``config.json`` in every key but the run's own folder (``log.out``) and the
  experiment's name (``exp``: ``study-<preset>``, a label that changes nothing trained, so a check run with
  ``--arms`` imports into a study made from a preset);
* both studies have the same cooldown plan (budgets, cooldown share and shape, branch steps);
* the destination holds no folder for that arm and seed yet (nothing is overwritten).

A mismatch is one ``UserError`` naming the keys that differ and both values. The copied runs keep their files
(metrics, evaluations, branches); their ``study_status.json`` files name the new arm; the destination's
``study.json`` lists the new arms and records each import (source folder, arm names, seeds, time) under
``imported``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, fields
from datetime import datetime, timezone
from pathlib import Path

from .._io import write_json
from ..errors import UserError, read_json_object
from . import arms as A
from . import metrics as M
from .plan import StudySpec, branch_folder, build_config, config_differences, study_branch_plan
from .run import _finished, _status
from ..numerics import recipes as R

__all__ = ["import_runs", "parse_renames", "config_differences"]


def parse_renames(text: str | None) -> dict[str, str]:
    """``"bf16=bf16@lr1.5e-3,mxfp4-dgrad=mxfp4-dgrad@lr1.5e-3"`` -> ``{old: new}``; an item without ``=``
    keeps its name."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        old, _, new = item.partition("=")
        old, new = old.strip(), (new.strip() or old.strip())
        if not old:
            raise UserError(f"--arms: {item!r} names no source arm; give SOURCE_ARM or SOURCE_ARM=NEW_ARM")
        if old in out:
            raise UserError(f"--arms names the source arm {old!r} twice")
        out[old] = new
    if len(set(out.values())) != len(out):
        raise UserError(f"--arms maps two source arms to one destination arm: {text}")
    return out


def _spec_of(meta: dict, where: Path):
    spec = meta.get("spec")
    if not isinstance(spec, dict):
        raise UserError(f"{where}/study.json has no study spec (written by an older mxtrain?): cannot check the runs")
    names = {f.name for f in fields(StudySpec)}
    return StudySpec(**{k: v for k, v in spec.items() if k in names})


def _read_meta(folder: Path) -> dict:
    p = folder / "study.json"
    if not p.is_file():
        raise UserError(f"{folder} is not a study folder (no study.json); give the OUT folder of mxtrain study")
    return read_json_object(p, "is the study folder damaged?")


def import_runs(src: str | Path, dst: str | Path, renames: dict[str, str] | None = None,
                dry_run: bool = False, log=print) -> list[tuple[str, str, int]]:
    """Copy the finished runs of study ``src`` into study ``dst`` (see the module docstring). ``renames`` maps
    source arms to destination arms (default: every arm of ``src`` under its own name). Returns the
    ``(source arm, destination arm, seed)`` of the runs copied (or, with ``dry_run``, that would be)."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise UserError(f"{src} is both the source and the destination; give two study folders")
    smeta, dmeta = _read_meta(src), _read_meta(dst)
    sspec, dspec = _spec_of(smeta, src), _spec_of(dmeta, dst)
    renames = dict(renames or {a: a for a in smeta.get("arms", [])})
    if not renames:
        raise UserError(f"{src} lists no arms; name them with --arms")
    for old, new in renames.items():
        if not (src / "runs" / old).is_dir():
            have = sorted(p.name for p in (src / "runs").iterdir() if p.is_dir()) if (src / "runs").is_dir() else []
            raise UserError(f"{src} has no runs of arm {old!r} (it has: {', '.join(have) or 'none'})")
        A.check(new)

    # one cooldown plan for both (the branches are copied as they are)
    if (sspec.budgets, sspec.cooldown, sspec.cooldown_shape) != (dspec.budgets, dspec.cooldown, dspec.cooldown_shape):
        raise UserError(f"the two studies' cooldown designs differ: {src} budgets {sspec.budgets} cooldown "
                        f"{sspec.cooldown} {sspec.cooldown_shape}; {dst} budgets {dspec.budgets} cooldown "
                        f"{dspec.cooldown} {dspec.cooldown_shape}: their runs are not interchangeable")
    plan_s = study_branch_plan(sspec) if sspec.budgets else []
    plan_d = study_branch_plan(dspec) if dspec.budgets else []
    if plan_s != plan_d:
        raise UserError(f"the two studies branch at different steps ({plan_s} and {plan_d}): their runs are not "
                        f"interchangeable")

    todo: list[tuple[str, str, int, Path, Path]] = []
    problems: list[str] = []
    for old, new in renames.items():
        spec_new = StudySpec(**{**asdict(dspec), "arms": list(dict.fromkeys(list(dspec.arms) + [new]))})
        seeds = sorted(int(p.name[4:]) for p in (src / "runs" / old).iterdir()
                       if p.is_dir() and M.SEED_DIR.fullmatch(p.name))
        for seed in seeds:
            rd = src / "runs" / old / f"seed{seed}"
            st = _status(rd)
            if not _finished(st):
                log(f"skipped {old} seed {seed}: not finished ({(st or {}).get('state', 'no status')})")
                continue
            pending = [f"{k}+{n}" for _, k, n in plan_s if not _finished(_status(branch_folder(rd, k, n)))]
            if pending and (st or {}).get("state") == "done":
                log(f"skipped {old} seed {seed}: cooldown branches not finished (at step+length {', '.join(pending)})")
                continue
            target = dst / "runs" / new / f"seed{seed}"
            if target.exists():
                problems.append(f"{target} exists already (nothing is overwritten; remove it to import {old} seed "
                                f"{seed} again)")
                continue
            if seed >= dspec.seeds:
                problems.append(f"{old} seed {seed}: {dst} trains seeds 0..{dspec.seeds - 1} only")
                continue
            cfg_p = rd / "config.json"
            if not cfg_p.is_file():
                problems.append(f"{rd} has no config.json: cannot check it")
                continue
            want = build_config(spec_new, new, seed, target).to_dict()
            diff = config_differences(read_json_object(cfg_p, "a run's config"), want)
            if diff:
                shown = "; ".join(f"{k}: {a!r} in the run, {b!r} for {new} in {dst.name}" for k, a, b in diff[:6])
                problems.append(f"{old} seed {seed} is not the run {dst} would train as {new}: {shown}"
                                f"{f' (and {len(diff) - 6} more)' if len(diff) > 6 else ''}")
                continue
            todo.append((old, new, seed, rd, target))
    if problems:
        raise UserError("nothing imported: " + " | ".join(problems))
    if not todo:
        raise UserError(f"nothing to import: no finished run of {', '.join(renames)} in {src}")
    if dry_run:
        for old, new, seed, _, target in todo:
            log(f"would import {old} seed {seed} as {new} ({target})")
        return [(o, n, s) for o, n, s, _, _ in todo]

    done = []
    for old, new, seed, rd, target in todo:
        tmp = target.with_name(target.name + ".importing")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(rd, tmp, ignore=shutil.ignore_patterns("*.pt", "*.importing"))
        for sp in tmp.rglob("study_status.json"):
            st = read_json_object(sp, "a run's study status")
            if "arm" in st:
                st["arm"] = new
                write_json(sp, st)
        tmp.rename(target)   # a crash leaves a *.importing folder, never a half-copied run
        done.append((old, new, seed))
        log(f"imported {old} seed {seed} as {new}")

    # the destination lists the new arms and remembers where they came from
    arms = list(dmeta.get("arms", []))
    for _, new, _ in done:
        if new not in arms:
            arms.append(new)
    dmeta["arms"] = arms
    dmeta.setdefault("recipes", {})
    for new in {n for _, n, _ in done}:
        dmeta["recipes"].setdefault(new, R.get(A.recipe_of(new)).to_dict())
        if A.overrides_of(new):
            dmeta.setdefault("arm_options", {})[new] = A.overrides_of(new)
    dmeta.setdefault("imported", []).append({
        "from": str(src.resolve()), "at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "runs": [{"arm": o, "as": n, "seed": s} for o, n, s in done]})
    spec = dict(dmeta.get("spec") or {})
    spec["arms"] = arms
    dmeta["spec"] = spec
    write_json(dst / "study.json", dmeta, user_error=False, indent=1, default=str)
    return done
