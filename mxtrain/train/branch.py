"""Cooldown branches: the cooled-down loss at several budgets from one constant-LR run.

A *stable* run (``schedule.kind = constant``, or ``wsd`` before its decay) keeps checkpoints at chosen steps
(``train.keep_checkpoints_at``: ``RUN/checkpoint-<step>.pt``). ``branch(RUN, k, n)`` resumes from the step-``k``
checkpoint (model, optimizer, data position, RNG states) and trains ``n`` more steps whose LR decays to
``min_lr`` (a WSD schedule of horizon ``k + n`` and ``decay_steps = n``), into its own run folder
(default ``RUN/branches/k<k>-n<n>/``); the main run is never touched. Because WSD equals the constant
schedule before its decay and a resumed run continues bit for bit, the branch's weights and losses are
those of a single WSD run of ``k + n`` steps whose cooldown starts at ``k`` (tests/train/test_branch.py checks
it on CPU). Hägele et al. (arXiv 2405.18392): constant LR plus a short cooldown matches a cosine run of
that length, so one run gives the cooled-down loss at every budget.

A branch folder holds an ordinary run (metrics.jsonl, eval_windows.jsonl, run.json with the outcome,
summary.json, checkpoint.pt) plus ``branch.json``: ``{"from", "at_step", "cooldown_steps", "shape"}``.
Calling ``branch`` again resumes an interrupted branch from its own checkpoint, and returns a finished one
as it is.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from . import parallel as D
from .._io import write_json
from ..errors import UserError
from . import checkpoint as ckpt
from .config import TrainConfig, DECAY_SHAPES
from .evaluation import DOMAINS_NAME, WINDOWS_NAME
from .trainer import wsd_decay_start, fit, NonFiniteLoss
from .profiling import PROFILE_DIR
from .callbacks import read_outcome, Outcome, Status

__all__ = ["branch", "branch_fit", "branch_config", "branch_dir", "kept_checkpoint", "BRANCH_INFO"]

BRANCH_INFO = "branch.json"


def branch_dir(run_dir: str | Path, at_step: int, cooldown_steps: int) -> Path:
    """The default folder of a branch: ``RUN/branches/k<at_step>-n<cooldown_steps>``."""
    return Path(run_dir) / "branches" / f"k{at_step}-n{cooldown_steps}"


def kept_checkpoint(run_dir: str | Path, at_step: int) -> Path:
    """The checkpoint of ``run_dir`` at step ``at_step``: ``checkpoint-<step>.pt`` (or ``.dcp``), or the
    latest checkpoint when it is at that step. UserError naming the kept steps otherwise."""
    run = Path(run_dir)
    for dcp in (False, True):
        p = run / ckpt.kept_name(at_step, dcp)
        if (p.is_dir() if dcp else p.is_file()):
            return p
    latest = ckpt.latest(run)
    if latest is not None and ckpt.step_of(latest) == at_step:
        return latest
    kept = sorted(int(p.name.split("-", 1)[1].split(".")[0]) for p in run.glob("checkpoint-*.*")
                  if p.name.split("-", 1)[1].split(".")[0].isdigit())
    raise UserError(f"{run} has no checkpoint at step {at_step} (kept: {', '.join(map(str, kept)) or 'none'}); "
                    f"train the stable run with --set train.keep_checkpoints_at={at_step} (steps or fractions)")


def _run_config(run_dir: Path) -> TrainConfig:
    p = run_dir / "config.json"
    try:
        return TrainConfig.from_dict(json.loads(p.read_text()), source=str(p))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {p} to branch from {run_dir} ({e})") from None


def branch_config(base: TrainConfig, at_step: int, cooldown_steps: int, out: str | Path,
                  shape: str | None = None) -> TrainConfig:
    """The branch's config: ``base`` (the stable run's) with a WSD schedule of horizon ``at_step +
    cooldown_steps`` decaying over the last ``cooldown_steps`` (``shape``: linear or 1-sqrt; default the
    base's ``schedule.decay_shape``), ``train.steps = at_step + cooldown_steps``, no kept checkpoints, into
    ``out``. UserError if the base run's LR is not constant (after warmup) up to ``at_step``."""
    if not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 1:
        raise UserError(f"--branch-at must be a step >= 1, got {at_step!r}")
    if not isinstance(cooldown_steps, int) or isinstance(cooldown_steps, bool) or cooldown_steps < 1:
        raise UserError(f"--cooldown must be a number of steps >= 1, got {cooldown_steps!r}")
    s = base.schedule
    if s.kind == "cosine":
        raise UserError("a cooldown branch starts from a stable (constant-LR) run; this run's schedule is cosine "
                        "(train the stable run with --set schedule.kind=constant, or wsd with a horizon past the "
                        "branch point)")
    if s.kind == "wsd" and wsd_decay_start(base) < at_step:
        raise UserError(f"the run's WSD cooldown starts at step {wsd_decay_start(base)}, before the branch point "
                        f"{at_step}: a branch starts from the stable phase")
    if at_step < s.warmup_steps:
        raise UserError(f"--branch-at {at_step} is inside the warmup ({s.warmup_steps} steps)")
    shape = shape or getattr(s, "decay_shape", "linear")
    if shape not in DECAY_SHAPES:
        raise UserError(f"the cooldown shape must be {' or '.join(DECAY_SHAPES)}, got {shape!r}")
    cfg = copy.deepcopy(base)
    cfg.schedule.kind = "wsd"
    cfg.schedule.horizon_steps = at_step + cooldown_steps
    cfg.schedule.decay_steps = cooldown_steps
    cfg.schedule.decay_shape = shape
    cfg.train.steps = at_step + cooldown_steps
    cfg.train.tokens = None
    cfg.train.keep_checkpoints_at = None
    cfg.log.out = str(out)
    return cfg


def _attempt_files(out: Path) -> list[Path]:
    """What an earlier attempt at the branch in ``out`` wrote there: ``branch.json``, and what a run writes into
    its folder (the trainer, its callbacks, a study's runner). Nothing else in ``out`` is the branch's."""
    import re
    names = {BRANCH_INFO, "metrics.jsonl", WINDOWS_NAME, DOMAINS_NAME, "run.json", "config.json", "recipe.json",
             "summary.json", "diagnostics.jsonl", "deosc.jsonl", "wandb_id", "tb", PROFILE_DIR, "study_status.json",
             "study_error.txt", ckpt.NAME, D.DCP_NAME, D.DCP_OLD, D.DCP_NAME + ".tmp"}

    def written(name: str) -> bool:
        m = re.fullmatch(r"\.(.+)\.tmp-\d+", name)   # _io.write_atomic's temporary of one of them
        name = m.group(1) if m else name
        return name in names or re.fullmatch(r"checkpoint-\d+\.(pt|dcp)", name) is not None   # (kept ones)
    return [p for p in out.iterdir() if written(p.name) or p.name.startswith(".write-test-")]


def _finished(out: Path) -> bool:
    oc = read_outcome(out)
    return (out / "summary.json").is_file() and (oc is None or oc.completed)


def branch_fit(run_dir: str | Path, at_step: int, cooldown_steps: int, out: str | Path | None = None, *,
               shape: str | None = None, cfg: TrainConfig | None = None, callbacks=None, log=print):
    """``branch``, returning the trainer's typed ``Outcome`` (completed or diverged; ``fit``'s contract)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise UserError(f"no run folder at {run_dir}")
    out = Path(out) if out is not None else branch_dir(run, at_step, cooldown_steps)
    if out.resolve() == run.resolve():
        raise UserError(f"a branch needs its own folder, not the stable run's ({run}); leave --out out or name "
                        f"another folder")
    base = cfg if cfg is not None else _run_config(run)
    bcfg = branch_config(base, at_step, cooldown_steps, out, shape)
    info = {"from": str(run.resolve()), "at_step": at_step, "cooldown_steps": cooldown_steps,
            "shape": bcfg.schedule.decay_shape}
    if out.exists():
        old = None
        try:
            old = json.loads((out / BRANCH_INFO).read_text())
        except (OSError, json.JSONDecodeError):
            pass
        ours = isinstance(old, dict) and all(old.get(k) == info[k] for k in ("at_step", "cooldown_steps", "shape"))
        if any(out.iterdir()) and not ours:
            raise UserError(f"{out} exists and is not this branch (k={at_step}, n={cooldown_steps}, "
                            f"{info['shape']}); choose another --out")
        if ours and _finished(out):
            log(f"branch {out} finished already")
            return Outcome(Status.COMPLETED, at_step + cooldown_steps, None, out)
        if ours and ckpt.holds_checkpoint(out):
            log(f"branch {out}: resuming from its own checkpoint")
            return fit(bcfg, resume=out, callbacks=callbacks)
        if ours:   # a branch that stopped before its first checkpoint: trained again, in place of its own files
            for p in _attempt_files(out):   # (only those: anything else in the folder is not the branch's)
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
    src = kept_checkpoint(run, at_step)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / BRANCH_INFO, {**info, "checkpoint": str(src.resolve())}, end="\n", indent=1)
    log(f"branch of {run} at step {at_step}: {cooldown_steps} cooldown steps ({info['shape']}) -> {out}")
    return fit(bcfg, resume=src, callbacks=callbacks)


def branch(run_dir: str | Path, at_step: int, cooldown_steps: int, out: str | Path | None = None, *,
           shape: str | None = None, cfg: TrainConfig | None = None, callbacks=None) -> Path:
    """Train a cooldown branch of stable run ``run_dir`` from its step-``at_step`` checkpoint: ``cooldown_steps``
    steps with the LR decaying to ``min_lr`` (``shape``: linear or 1-sqrt), into ``out`` (default
    ``RUN/branches/k<at_step>-n<cooldown_steps>``). ``cfg``: the base config (default: the run's
    config.json; the identity keys must match its checkpoint). Returns the branch's run folder; a diverged
    branch raises ``NonFiniteLoss`` as ``train`` does. A finished branch is returned as it is, an
    interrupted one resumes from its own checkpoint."""
    oc = branch_fit(run_dir, at_step, cooldown_steps, out, shape=shape, cfg=cfg, callbacks=callbacks)
    if oc.diverged:
        e = NonFiniteLoss(oc.reason or "the branch diverged", step=oc.step)
        e.outcome = oc
        raise e
    return oc.out
