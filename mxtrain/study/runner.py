"""``mxtrain study``: arms (recipes, optionally with training options) x seeds from one base training config,
resumable.

Layout of a study folder ``OUT``::

    OUT/study.json                  the plan: arms, seeds, baseline, base overrides, recipes, metric options
    OUT/runs/<arm>/seed<k>/         an ordinary ``mxtrain train`` run folder (metrics.jsonl, config.json, run.json
                                    with the run's typed outcome, tb/ TensorBoard events, ...)
                  .../study_status.json   written by the runner when the run ended: done | diverged | failed
    OUT/summary.json                per-arm results (see mxtrain.study.metrics.summarize)
    OUT/report.html, OUT/report.md  the report (mxtrain.study.report)

Control: every run of seed ``k`` uses training seed ``k`` (so the same initialization and the same
data order in every arm) and the same evaluation steps and validation set; only the recipe differs (and the
training options an arm names, ``RECIPE@OPTION``: ``mxtrain.study.arms``).
A run whose ``study_status.json`` says done or diverged is finished and skipped; a run folder without
one was interrupted, and one that says ``failed`` (an error other than divergence), is trained again from
scratch (its folder is replaced). A summary that lacks a planned run lists it under ``missing``, and
``mxtrain study`` then exits 1.

Ownership: a study folder has one owner at a time, the process holding an exclusive ``flock`` on
``OUT/.lock`` (which holds its pid) for the whole study; its worker processes inherit the locked file, so
the lock lasts until the owner and every worker have ended. A second ``mxtrain study`` on the folder is
refused meanwhile. Workers die with their parent (``PR_SET_PDEATHSIG`` on Linux), and the parent stops
and waits for its workers on SIGINT, SIGTERM or any error.

Learning-rate schedule: a cosine that ends at the run's last step makes every arm's loss drop at
the end, so a quantized arm can never reach the baseline's final loss and the extra-token cost is
meaningless. Studies therefore default to a constant rate after warmup (``--schedule constant``),
or a cosine whose horizon is ``--lr-horizon`` (10) times the run (``long-cosine``, as MLPerf's
Llama 3.1-8B config does: its cosine spans 1.2 M steps for a ~6 k-step run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from .._child import python_command
from .._io import FolderLock, lock_holder, pid_alive, write_json
from ..errors import UserError, check_number, read_json_object
from .. import recipes as R
from . import arms as A
from . import metrics as M

__all__ = ["PRESETS", "SCHEDULES", "StudySpec", "run_study", "run_one", "plan_order", "summarize_study",
           "StudyIncomplete", "StudyInterrupted", "FINISHED_STATES", "branch_plan", "study_branch_plan", "run_branches",
           "train_branch", "add_cooldown"]

FINISHED_STATES = ("done", "diverged")   # study_status.json states of a finished run (skipped on resume)


class StudyIncomplete(UserError):
    """The study ended but its summary lacks planned runs (failed, interrupted or never trained)."""
    exit_code = 1


class StudyInterrupted(UserError):
    """SIGINT or SIGTERM stopped the study (its workers were stopped first)."""

    def __init__(self, msg: str, signum: int):
        super().__init__(msg)
        self.exit_code = 128 + signum

SCHEDULES = ("constant", "long-cosine", "config")

PAPER_ARMS = ["bf16", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4-all", "mxfp4-all-sr", "mxfp4-all-rht16",
              "mxfp4-all-dh16", "mxfp4-all-dh32"]
FITS = ("lsq", "huber")

# preset -> StudySpec fields (explicit flags override them)
# what the cooled-down studies of docs/results.md evaluated: 131,072 tokens at each evaluation, 1,048,576 in each
# branch's final one, and a 20-step warm-up
_COOLED_EVAL = ("log.eval_tokens=131072", "log.final_eval_tokens=1048576", "schedule.warmup_steps=20")

PRESETS: dict[str, dict] = {
    # [AMD] Table 1: the GEMM-by-GEMM ladder and the three interventions, vs a BF16 baseline and (a second
    # reference) the paper's own FP8 baseline
    "paper": dict(arms=["bf16", "fp8"] + PAPER_ARMS[1:], baseline="bf16", references=["fp8"], seeds=3,
                  diagnose_every=0),
    # [AMD]'s ladder with its kernels' own scale rule (amd: the block exponent rounded up when amax's
    # significand is at least 1.75), and [Quartet II]'s split by GEMM with RTN against SR in the backward
    "paper-amd-rule": dict(arms=["bf16", "fp8"] + [a + "+amd" for a in PAPER_ARMS[1:]], baseline="bf16",
                           references=["fp8"], seeds=3, diagnose_every=0),
    "split": dict(arms=["bf16", "mxfp4-fprop", "mxfp4-dgrad", "mxfp4-wgrad", "mxfp4-bwd", "mxfp4-bwd-sr",
                        "mxfp4-all"], baseline="bf16", seeds=3, diagnose_every=0),
    # baseline vs the papers' complete recipes ([ALTO]'s lever: MXFP4 with weight de-oscillation)
    "recipes": dict(arms=["bf16", "mxfp4-all-dh16", "tseng", "nvfp4", "mxfp4-all@deosc"], baseline="bf16", seeds=3,
                    diagnose_every=0),
    # the headline comparison at 125m: BF16 and FP8 baselines, plain MXFP4, AMD's deterministic Hadamard, SR in
    # the backward, Tseng's recipe and MXFP4 with weight de-oscillation; 3,840 steps x 32 x 512 tokens (62.9 M
    # tokens: 0.5 per parameter with a 32k vocabulary), cooled down at 25/50/100 %, evaluation every 2 %. Peak LR
    # 7.5e-4, the rate it was run at on 4 H200s in 21 minutes (docs/results.md): BF16 at 1.5e-3 was 0.29 nats
    # worse there (one seed); no lower rate was tried
    "headline": dict(arms=["bf16", "fp8", "mxfp4-all", "mxfp4-all-dh16", "mxfp4-all-sr", "tseng", "mxfp4-all@deosc"],
                     baseline="bf16", references=["fp8"], seeds=3, model="125m", steps=3840, lr=7.5e-4, batch_size=32,
                     seq_len=512, budgets=[0.25, 0.5, 1.0], eval_every=77, diagnose_every=0,
                     overrides=list(_COOLED_EVAL)),
    # the trend with training length: BF16 and plain MXFP4 at 30m, one run per arm x seed of
    # 11,500 steps x 16,384 tokens (188 M tokens: 20 per non-embedding parameter, 5.4 per parameter in all with
    # the 32k vocabulary), cooled-down branches from 1 to 20 tokens per non-embedding parameter; each run must
    # finish inside one device lease (checkpoints do not travel): 18 minutes for all 6 with 3 runs a GPU under
    # MPS on two H100s (docs/results.md). Peak LR 1.5e-3, where the learning-rate sweep at 30m put BF16 and
    # MXFP4 well below 3e-3 (the base experiment's rate)
    "trend": dict(arms=["bf16", "mxfp4-all"], baseline="bf16", seeds=3, model="30m", steps=11500, lr=1.5e-3,
                  batch_size=32, seq_len=512, budgets=[0.05, 0.1, 0.25, 0.5, 1.0], eval_every=230, diagnose_every=0,
                  overrides=list(_COOLED_EVAL)),
    # CI: tiny model on CPU, 3 arms x 2 seeds, a few minutes in all
    "smoke": dict(arms=["bf16", "mxfp4-all", "mxfp4-all-dh16"], baseline="bf16", seeds=2, model="tiny",
                  steps=16, batch_size=8, seq_len=64, eval_every=2, diagnose_every=8, device="cpu", target_frac=0.5,
                  overrides=["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
                             "schedule.warmup_steps=4", "optim.lr=5e-3", "log.eval_tokens=512", "log.log_every=1"]),
}


# flag (StudySpec field) -> the training-config key it sets
FLAG_KEYS = {"model": "model.name", "steps": "train.steps", "batch_size": "train.batch_size", "seq_len": "data.seq_len",
             "lr": "optim.lr", "data": "data.path", "device": "train.device", "eval_every": "log.eval_every"}
# the model's shape beside its name: a preset's values go when the user names another model
MODEL_SHAPE = ("model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim")
# set by the study for each run (the control): refused in --set and in a study file
PER_RUN = {"recipe": "the recipe is the arm: list the recipes in --arms or [study] arms",
           "deosc.enable": "an arm option: name the arm RECIPE@deosc",
           "train.seed": "seeds are 0..seeds-1", "model.init_seed": "seeds are 0..seeds-1",
           "data.seed": "seeds are 0..seeds-1",
           "log.out": "runs go to OUT/runs/<arm>/seed<k>: give --out or [study] out",
           "log.progress": "runs log plain lines"}
_NONE = ("none", "null", "")


def override_key(item: str) -> str:
    """The training-config key of a ``KEY=VALUE`` override."""
    return item.split("=", 1)[0].strip()


@dataclass
class StudySpec:
    """Everything that defines a study. ``overrides`` are ``key=value`` strings for the training config."""

    out: str = "studies/custom"
    arms: list[str] = field(default_factory=lambda: ["bf16", "mxfp4-all-dh16"])
    baseline: str | None = None
    references: list[str] = field(default_factory=list)   # further arms every arm is also compared with
    seeds: int = 3
    model: str | None = None
    steps: int | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    data: str | None = None
    device: str | None = None
    overrides: list[str] = field(default_factory=list)
    schedule: str = "constant"
    lr_horizon: float = 10.0
    eval_every: int | None = None
    diagnose_every: int = 0
    target_loss: float | None = None
    target_frac: float = 0.8
    smooth_k: int = 3
    preset: str | None = None
    exp: str | None = None              # base experiment (mxtrain.train.experiments); None: the default
    budgets: list[float] | None = None  # cooldown design: budgets as fractions of the run (e.g. 0.25 .. 1.0)
    cooldown: float = 0.2               # cooldown share of each budget's branch (its last steps)
    cooldown_shape: str = "1-sqrt"      # linear | 1-sqrt decay of each branch
    n_boot: int = 1000                  # bootstrap replicates of the cooled-down metric
    fit: str = "lsq"                    # the baseline's L(D) fit: lsq (least squares) | huber (on log L)

    def __post_init__(self):
        if not self.arms:
            raise UserError("a study needs at least one arm (--arms a,b,c)")
        if len(set(self.arms)) != len(self.arms):
            raise UserError(f"--arms lists an arm twice: {','.join(self.arms)}")
        for a in self.arms:
            A.check(a)
        if self.baseline is None:
            self.baseline = self.arms[0]
        if self.baseline not in self.arms:
            raise UserError(f"--baseline {self.baseline!r} is not one of the arms ({', '.join(self.arms)})")
        self.references = [r for r in dict.fromkeys(self.references or []) if r != self.baseline]
        for r in self.references:
            if r not in self.arms:
                raise UserError(f"--references {r!r} is not one of the arms ({', '.join(self.arms)})")
        if self.fit not in FITS:
            raise UserError(f"--fit must be {' or '.join(FITS)}, got {self.fit!r}")
        # the numbers (a flag's own check said it already; a study file's value is checked here): finite, in range
        for name, lo, hi, lo_open, hi_open, integer, optional in (
                ("seeds", 1, 10**6, False, False, True, False), ("lr_horizon", 1, None, False, False, False, False),
                # (their ranges: the training config's check, which names them train.steps, ...)
                ("steps", None, 2**53, False, False, True, True), ("batch_size", None, None, False, False, True, True),
                ("seq_len", None, None, False, False, True, True), ("lr", None, None, False, False, False, True),
                ("eval_every", None, None, False, False, True, True), ("diagnose_every", 0, None, False, False, True, False),
                ("target_loss", None, None, False, False, False, True), ("target_frac", 0, 1, True, False, False, False),
                ("smooth_k", 1, None, False, False, True, False), ("cooldown", 0, 1, True, True, False, False),
                ("n_boot", 10, 10**7, False, False, True, False)):
            check_number(f"--{name.replace('_', '-')}", getattr(self, name), lo, hi, lo_open, hi_open, integer,
                         optional)
        if self.seeds < 1:
            raise UserError(f"--seeds must be >= 1, got {self.seeds}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}")
        if not self.lr_horizon >= 1:
            raise UserError(f"--lr-horizon must be >= 1 (a multiple of the run length), got {self.lr_horizon}")
        if self.diagnose_every < 0:
            raise UserError("--diagnose-every must be >= 0")
        if self.smooth_k < 1:
            raise UserError("--smooth-k must be >= 1")
        if not 0 < self.target_frac <= 1:
            raise UserError("--target-frac must be in (0, 1]")
        for o in self.overrides:
            if "=" not in o:
                raise UserError(f"--set expects KEY=VALUE, got {o!r}")
        self._check_overrides()
        if self.budgets is not None:
            try:
                bs = sorted({float(b) for b in self.budgets})
            except (TypeError, ValueError):
                raise UserError(f"--budgets expects fractions of the run, e.g. 0.25,0.5,0.75,1; got {self.budgets!r}") from None
            if not bs or not all(0 < b <= 1 for b in bs):
                raise UserError(f"--budgets must be fractions of the run in (0, 1], got {self.budgets!r}")
            self.budgets = bs
            if not 0 < self.cooldown < 1:
                raise UserError(f"--cooldown must be a share of each branch in (0, 1), got {self.cooldown}")
            if self.cooldown_shape not in ("linear", "1-sqrt"):
                raise UserError(f"--cooldown-shape must be linear or 1-sqrt, got {self.cooldown_shape!r}")
            if self.schedule == "long-cosine":
                raise UserError("--budgets trains one constant-LR run per arm x seed and cools it down at each budget: "
                                "use --schedule constant (the default), not long-cosine")
        if self.n_boot < 10:
            raise UserError(f"--n-boot must be >= 10, got {self.n_boot}")

    def _check_overrides(self) -> None:
        """Refuse (one line) an override that the study would replace for each run, or that contradicts one of
        the study's own settings: a setting given is used or refused, never dropped (issue #47)."""
        keys = {override_key(o): o for o in self.overrides}
        for key, o in keys.items():
            if key in PER_RUN:
                raise UserError(f"--set {o}: {key} is set by the study for each run ({PER_RUN[key]}); remove it")
        src = "(--set or the study file)"
        tokens = keys.get("train.tokens")
        if self.steps is not None and tokens is not None and tokens.split("=", 1)[1].strip().lower() not in _NONE:
            raise UserError(f"steps {self.steps} (--steps or [study] steps) and {tokens} {src} both set the length of "
                            f"every run; give one")
        if "schedule.kind" in keys and self.schedule != "config":
            raise UserError(f"{keys['schedule.kind']} {src} and --schedule {self.schedule} both set every run's "
                            f"schedule; give one (--schedule config keeps the training config's)")
        if "schedule.horizon_steps" in keys and self.schedule == "long-cosine":
            raise UserError(f"{keys['schedule.horizon_steps']} {src}: --schedule long-cosine sets the horizon to "
                            f"--lr-horizon x the run's steps; give --lr-horizon, or --schedule config")
        if self.budgets:
            for key in ("schedule.kind", "schedule.horizon_steps", "train.keep_checkpoints_at"):
                if key in keys:
                    raise UserError(f"{keys[key]} {src}: with --budgets every run is constant-LR with checkpoints "
                                    f"at the branch points, which the study sets; remove it")

    @classmethod
    def from_args(cls, args) -> "StudySpec":
        base: dict = {}
        if args.preset:
            base.update(json.loads(json.dumps(PRESETS[args.preset])))
            base["preset"] = args.preset
            # what the user gives (a flag, the file's [study] value, an override of the file or --set) replaces the
            # preset's settings of the same training keys: the preset's own overrides come after the flags in
            # build_config and would win; --model replaces the preset's model shape too; train.tokens its steps
            user = {override_key(o) for o in args.overrides or []}
            user |= {key for flag, key in FLAG_KEYS.items() if getattr(args, flag, None) is not None}
            gone = set(user) | (set(MODEL_SHAPE) if "model.name" in user else set())
            base["overrides"] = [o for o in base.get("overrides", []) if override_key(o) not in gone]
            if "train.tokens" in user and getattr(args, "steps", None) is None:
                base.pop("steps", None)
            if "log.eval_every" in user and getattr(args, "eval_every", None) is None:
                base.pop("eval_every", None)
        if getattr(args, "schedule", None) is None and any(override_key(o) == "schedule.kind"
                                                            for o in args.overrides or []):
            base["schedule"] = "config"   # the user chose the schedule: keep it (the study's default is constant)
        if args.arms:
            base["arms"] = [a.strip() for a in args.arms.split(",") if a.strip()]
            if not getattr(args, "references", None):   # the preset's references that are still arms
                base["references"] = [r for r in base.get("references", []) if r in base["arms"]]
        refs = getattr(args, "references", None)
        if refs is not None:
            base["references"] = [r.strip() for r in refs.split(",") if r.strip()] if isinstance(refs, str) else refs
        for k in ("exp", "seeds", "baseline", "model", "steps", "batch_size", "seq_len", "lr", "data", "device", "schedule",
                  "lr_horizon", "eval_every", "diagnose_every", "target_loss", "smooth_k"):
            v = getattr(args, k, None)
            if v is not None:
                base[k] = v
        if getattr(args, "target_frac", None) is not None:
            base["target_frac"] = args.target_frac
        for k in ("cooldown", "cooldown_shape", "n_boot", "fit"):
            v = getattr(args, k, None)
            if v is not None:
                base[k] = v
        b = getattr(args, "budgets", None)
        if b is not None:
            if isinstance(b, str):
                try:
                    b = [float(x) for x in b.split(",") if x.strip()]
                except ValueError:
                    raise UserError(f"--budgets expects fractions of the run, e.g. 0.25,0.5,0.75,1; got {b!r}") from None
            base["budgets"] = b
        # the preset's overrides, then the flags'; a key=value given again (a preset's, repeated on the command
        # line) is kept once, at its last place, so the last value of each key still wins and the study's plan is
        # the same as without the repetition
        ov = list(base.get("overrides", [])) + list(args.overrides or [])
        base["overrides"] = [o for i, o in enumerate(ov) if o not in ov[i + 1:]]
        base["out"] = args.out or f"studies/{args.preset or 'custom'}"
        # options of one design given without it would be dropped: refused instead
        if getattr(args, "lr_horizon", None) is not None and base.get("schedule", "constant") != "long-cosine":
            raise UserError(f"--lr-horizon {args.lr_horizon:g} is the horizon of --schedule long-cosine; add "
                            f"--schedule long-cosine, or leave it out")
        if not base.get("budgets"):
            for k in ("cooldown", "cooldown_shape", "fit", "n_boot"):
                if getattr(args, k, None) is not None:
                    raise UserError(f"--{k.replace('_', '-')} is an option of a cooldown study: add --budgets "
                                    f"(e.g. 0.25,0.5,1), or leave it out")
        return cls(**base)

    def check_branch_options(self) -> None:
        """An arm whose option changes only the cooldown branches (``@bf16cool``) needs a cooldown study."""
        branch_only = [a for a in self.arms if A.branch_overrides_of(a, 0)]
        if branch_only and not self.budgets:
            raise UserError(f"arm {branch_only[0]} changes only the cooldown branches: it needs a cooldown study "
                            f"(--budgets, e.g. 0.25,0.5,1)")

    def describe(self) -> str:
        lines = [f"study -> {self.out}", f"  arms ({len(self.arms)}): {', '.join(self.arms)}; baseline {self.baseline}"
                 + (f"; also compared with {', '.join(self.references)}" if self.references else ""),
                 f"  seeds: {self.seeds} ({self.seeds * len(self.arms)} runs)",
                 f"  schedule: {self.schedule}" + (f" (horizon {self.lr_horizon:g} x run)" if self.schedule == "long-cosine" else ""),
                 f"  training: {self.train_args()}"]
        if self.budgets:
            lines.insert(3, f"  cooldown branches at budgets {', '.join(f'{b:g}' for b in self.budgets)} of the run "
                            f"({self.cooldown:g} of each branch cooling down, {self.cooldown_shape}); the stable run "
                            f"is constant-LR")
        return "\n".join(lines)

    def train_args(self) -> dict:
        """The base training settings shared by every run (recipe, seed and output are per run)."""
        return {k: v for k, v in (("exp", self.exp), ("model", self.model), ("steps", self.steps), ("batch_size", self.batch_size),
                                  ("seq_len", self.seq_len), ("lr", self.lr), ("data", self.data),
                                  ("device", self.device), ("eval_every", self.eval_every),
                                  ("schedule", self.schedule), ("lr_horizon", self.lr_horizon),
                                  ("overrides", self.overrides)) if v not in (None, [])}

    def plan_key(self) -> dict:
        """What must match for an existing study folder to be resumed."""
        key = {"train": self.train_args(), "diagnose_every": self.diagnose_every}
        if self.budgets:
            key["cooldown"] = {"budgets": self.budgets, "cooldown": self.cooldown, "shape": self.cooldown_shape}
        return key


def branch_plan(spec: StudySpec, steps: int, warmup: int = 0) -> list[tuple[float, int, int]]:
    """``[(budget, k, n)]`` of a cooldown study whose runs are ``steps`` long: budget ``b`` is a branch of
    ``round(b * steps)`` steps in all, its last ``n = max(1, round(cooldown * b * steps))`` decaying, from the
    stable run's checkpoint at ``k = round(b * steps) - n``. UserError when a branch point falls inside the
    warmup or two budgets give the same branch."""
    out = []
    for b in spec.budgets or []:
        total = int(round(b * steps))
        n = max(1, int(round(spec.cooldown * total)))
        k = total - n
        if k < max(1, warmup):
            raise UserError(f"budget {b:g} of a {steps}-step run branches at step {k}, "
                            f"{'inside the warmup (' + str(warmup) + ' steps)' if k >= 1 else 'before the first step'}; "
                            f"use larger budgets, a shorter --cooldown or more steps")
        out.append((b, k, n))
    if len({(k, n) for _, k, n in out}) != len(out):
        raise UserError(f"budgets {spec.budgets} give the same branch twice at {steps} steps; use budgets further apart")
    return out


def compute_plan(spec: StudySpec, tokens_per_s: float | None = None) -> dict:
    """What a study will train, counted before it runs (``mxtrain study --dry-run``): the model's parameters
    (all, and without the embedding table), tokens per run at the full budget and per parameter, the steps and
    tokens of every run and cooldown branch together, the evaluation tokens (forward only), the passes over the
    training split; with ``tokens_per_s`` (training tokens a second of the whole machine, all jobs together,
    measured on it) the hours it needs, counting an evaluated token as a third of a trained one. Parameters
    "without the embedding" leave out the embedding table and the output head."""
    import math as _m
    from ..train.trainer import _model_config
    cfg = build_config(StudySpec(**{**asdict(spec), "budgets": None}), spec.arms[0], 0, Path(spec.out) / "plan")
    vocab, train_tokens = cfg.data.vocab_size, None
    meta = Path(cfg.data.path) / "meta.json" if cfg.data.path else None
    if meta is not None and meta.is_file():
        m = read_json_object(meta)
        vocab, train_tokens = m.get("vocab_size", vocab), m.get("train_tokens")
    mcfg = _model_config(cfg, vocab)
    steps = run_steps(cfg)
    tok_step = cfg.train.batch_size * cfg.data.seq_len
    runs = spec.seeds * len(spec.arms)
    e = cfg.log.eval_every

    def evals_in(a: int, b: int) -> int:   # steps a+1..b: every e-th, and the last one
        return b // e - a // e + (0 if b % e == 0 else 1)
    if spec.budgets:
        plan = branch_plan(spec, steps, cfg.schedule.warmup_steps)
        stable = max(k for _, k, _ in plan)
        per_run = stable + sum(n for _, _, n in plan)
        evals = evals_in(0, stable) + sum(evals_in(k, k + n) for _, k, n in plan)
    else:
        per_run = steps
        evals = evals_in(0, steps)
    # the end-of-run evaluation over log.final_eval_tokens (when it exceeds eval_tokens): the stable run and each branch
    final = cfg.log.final_eval_tokens if cfg.log.final_eval_tokens > cfg.log.eval_tokens else 0
    eval_tok = evals * cfg.log.eval_tokens + final * (1 + len(spec.budgets or []))
    table = mcfg.vocab_size * mcfg.dim * (1 if mcfg.tie_embeddings else 2)
    out = {"params": mcfg.num_params(), "params_no_embedding": mcfg.num_params() - table,
           "tokens_per_run": steps * tok_step,
           "steps_per_run_and_branches": per_run, "runs": runs, "train_tokens": runs * per_run * tok_step,
           "eval_tokens": runs * eval_tok}
    out["tokens_per_param"] = out["tokens_per_run"] / out["params"]
    out["lr_by_arm"] = {a: build_config(spec, a, 0, Path(spec.out) / "plan").optim.lr for a in spec.arms}
    out["lr_given"] = (spec.lr is not None
                       or any(o.startswith("optim.lr=") for a in spec.arms
                              for o in list(spec.overrides) + A.overrides_of(a)))
    out["epochs"] = out["tokens_per_run"] / train_tokens if train_tokens else None
    # an existing study folder (a study resumed, or seeded from an earlier lease's archive): what is finished,
    # stable run and every branch, is not trained again
    done, meta_p = 0, Path(spec.out) / "study.json"
    out["folder_mismatch"] = False
    if meta_p.is_file():
        try:
            old_key = read_json_object(meta_p).get("plan_key")
        except UserError:   # (a damaged study.json: the dry run says the folder is another plan's)
            old_key = None
        out["folder_mismatch"] = old_key != json.loads(json.dumps(spec.plan_key()))
    if (Path(spec.out) / "runs").is_dir() and not out["folder_mismatch"]:
        done = sum(1 for a, sd in plan_order(spec)
                   if _finished(_status(Path(spec.out) / "runs" / a / f"seed{sd}"))
                   and not branches_pending(spec, Path(spec.out), a, sd))
    left = (runs - done) / runs if runs else 0.0
    out["runs_done"] = done
    out["train_tokens_left"] = out["train_tokens"] * left
    out["eval_tokens_left"] = out["eval_tokens"] * left
    if tokens_per_s:
        out["hours"] = (out["train_tokens_left"] + out["eval_tokens_left"] / 3) / tokens_per_s / 3600
    if not _m.isfinite(out["tokens_per_param"]):
        out["tokens_per_param"] = None
    return out


def describe_compute(c: dict) -> str:
    """``compute_plan``'s answer as the dry run prints it."""
    lines = [f"  model: {c['params'] / 1e6:.1f} M parameters ({c['params_no_embedding'] / 1e6:.1f} M without the "
             f"embedding and output head)",
             f"  each run: {c['tokens_per_run'] / 1e6:.2f} M tokens at the full budget = "
             f"{c['tokens_per_param']:.2f} tokens per parameter"
             + (f", {c['epochs']:.2f} passes over the training split" if c.get("epochs") is not None else ""),
             f"  all {c['runs']} runs with their branches: {c['steps_per_run_and_branches']:,} steps each, "
             f"{c['train_tokens'] / 1e9:.3f} B tokens trained, {c['eval_tokens'] / 1e6:.1f} M evaluated"]
    lrs = c.get("lr_by_arm") or {}
    if lrs:
        vals = sorted(set(lrs.values()))
        lines.append("  peak learning rate: " + (f"{vals[0]:g} for every arm" if len(vals) == 1 else
                                                 "; ".join(f"{a} {v:g}" for a, v in lrs.items()))
                     + ("" if c.get("lr_given") else " (the base experiment's, not chosen for this model: a cost "
                        "holds at the learning rate it was measured at; docs/study.md, \"Check the learning rate "
                        "first\")"))
    if c.get("folder_mismatch"):
        lines.append("  the study folder holds a study with a different base config: the study would refuse it "
                     "(use another --out, or that study's settings)")
    if c.get("runs_done"):
        lines.append(f"  finished already in the study folder: {c['runs_done']} of the {c['runs']} runs with all their "
                     f"branches; left to train: {c['runs'] - c['runs_done']} runs, "
                     f"{c['train_tokens_left'] / 1e9:.3f} B tokens trained, {c['eval_tokens_left'] / 1e6:.1f} M evaluated")
    if c.get("hours") is not None:
        lines.append(f"  at the rate given: about {c['hours']:.2f} hours" + (" for what is left" if c.get("runs_done") else ""))
    if c.get("epochs") is not None and c["epochs"] > 1:
        lines.append(f"  note: each run passes over its training split {c['epochs']:.1f} times (repeated tokens "
                     f"lower the loss in ways a larger corpus would not: use more data or fewer steps)")
    return "\n".join(lines)


def run_steps(cfg) -> int:
    """The run length in steps of a config (``train.tokens`` wins when set)."""
    if cfg.train.tokens:
        return -(-cfg.train.tokens // (cfg.train.batch_size * cfg.data.seq_len))
    return cfg.train.steps


# ----------------------------------------------------------------------------------------------
# the trainer adapter


def build_config(spec: StudySpec, arm: str, seed: int, run_dir: Path):
    """The ``TrainConfig`` of one run: the base experiment, the study's settings and overrides, then the
    per-run recipe, seeds and output folder (these last, so no ``--set`` can break the control)."""
    from ..train.config import apply_overrides
    from ..train import experiments

    cfg = experiments.get(spec.exp) if spec.exp else experiments.get(experiments.DEFAULT)
    cfg.exp = f"study-{spec.preset or 'custom'}"
    sets = []
    for key, val in (("model.name", spec.model), ("train.steps", spec.steps), ("train.batch_size", spec.batch_size),
                     ("data.seq_len", spec.seq_len), ("optim.lr", spec.lr), ("data.path", spec.data),
                     ("train.device", spec.device), ("log.eval_every", spec.eval_every)):
        if val is not None:
            sets.append(f"{key}={val}")
    apply_overrides(cfg, sets + list(spec.overrides))   # the overrides last: --set wins over the flags
    if spec.steps is not None:   # (an override of train.tokens with steps is refused by StudySpec)
        cfg.train.tokens = None
    steps = cfg.train.steps
    if cfg.train.tokens:
        steps = -(-cfg.train.tokens // (cfg.train.batch_size * cfg.data.seq_len))
    if spec.eval_every is None and not any(override_key(o) == "log.eval_every" for o in spec.overrides):
        cfg.log.eval_every = max(1, steps // 40)
    if spec.schedule == "constant":
        cfg.schedule.kind = "constant"
    elif spec.schedule == "long-cosine":
        cfg.schedule.kind = "cosine"
        cfg.schedule.horizon_steps = int(round(spec.lr_horizon * steps))
    # the arm's training options (RECIPE@OPTION), over the study's own overrides
    apply_overrides(cfg, A.overrides_of(arm))
    # the control: only the recipe (and the arm's options) differ between arms of one seed
    cfg.recipe = A.recipe_of(arm)
    cfg.recipe_overrides = dict(cfg.recipe_overrides, seed=seed)  # SR / random-sign streams differ per seed
    cfg.train.seed = seed
    cfg.model.init_seed = seed
    cfg.data.seed = seed
    if spec.budgets:   # the stable run of a cooldown study: constant LR up to the last branch point
        plan = branch_plan(spec, steps, cfg.schedule.warmup_steps)
        cfg.schedule.kind, cfg.schedule.horizon_steps = "constant", None
        cfg.train.tokens = None
        cfg.train.steps = max(k for _, k, _ in plan)
        cfg.train.keep_checkpoints_at = ",".join(str(k) for _, k, _ in plan)
    cfg.log.out = str(run_dir)
    cfg.log.progress = False   # a study prints one line per run; log.tensorboard stays as configured (default on)
    return cfg


def study_branch_plan(spec: StudySpec) -> list[tuple[float, int, int]]:
    """The cooldown branches of every run of ``spec`` (empty without ``budgets``)."""
    if not spec.budgets:
        return []
    base = build_config(StudySpec(**{**asdict(spec), "budgets": None}), spec.arms[0], 0, Path(spec.out) / "plan")
    return branch_plan(spec, run_steps(base), base.schedule.warmup_steps)


def branch_folder(run_dir: Path, k: int, n: int) -> Path:
    return Path(run_dir) / "branches" / f"k{k}-n{n}"


def train_branch(spec: StudySpec, arm: str, seed: int, run_dir: Path, budget: float, k: int, n: int, bdir: Path):
    """Train one cooldown branch of the stable run ``run_dir`` (``mxtrain.train.branch_fit``); returns its
    typed ``Outcome``. A branch folder with its own checkpoint resumes from it."""
    from ..train.branch import _run_config, branch_fit
    cfg = None
    extra = A.branch_overrides_of(arm, k)   # an arm whose branches differ from its stable run (@bf16cool)
    if extra:
        from ..train.config import apply_overrides
        cfg = _run_config(Path(run_dir))
        apply_overrides(cfg, extra)
    return branch_fit(run_dir, k, n, bdir, shape=spec.cooldown_shape, cfg=cfg, log=lambda m: None)


def train_one(spec: StudySpec, arm: str, seed: int, run_dir: Path, resume: Path | None = None):
    """Train one run with the ordinary trainer into ``run_dir``; returns its typed ``Outcome`` (completed or
    diverged; an interrupted or failed run raises). ``resume``: continue the interrupted run in ``run_dir``
    from its checkpoint. Callbacks: per-GEMM diagnostics when ``diagnose_every`` is set, and a W&B logger (run
    ``<arm>-seed<k>``, grouped by study) when ``log.wandb`` is on."""
    from ..train import trainer as TR
    from ..train.callbacks import WandbLogger, wandb_project

    cfg = build_config(spec, arm, seed, run_dir)
    callbacks = []
    project = wandb_project(getattr(cfg.log, "wandb", None))
    if project:
        callbacks.append(WandbLogger(project, name=f"{arm}-seed{seed}", group=Path(spec.out).resolve().name))
    diag = None
    if spec.diagnose_every:
        if cfg.train.cuda_graphs:
            raise UserError("diagnostics (--diagnose-every) read each step's operands in Python, which a CUDA graph "
                            "replay skips: turn train.cuda_graphs off for a diagnosed study")
        from .diagnostics import DiagnosticsCallback
        cfg.train.compile = "off"   # diagnostics hook every MX layer on sampled steps, in Python
        diag = DiagnosticsCallback(spec.diagnose_every)
        callbacks.append(diag)
    outcome = TR.fit(cfg, resume=resume, callbacks=callbacks)
    if diag is not None and diag.rows == 0 and outcome.completed and R.get(A.recipe_of(arm)).quantized:
        print(f"warning: no diagnostics were recorded for {arm} seed {seed} (no diagnosed step ran)",
              file=sys.stderr)
    return outcome


# ----------------------------------------------------------------------------------------------
# running


def _status(run_dir: Path) -> dict | None:
    p = run_dir / "study_status.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return None


def _is_divergence(e: BaseException) -> bool:
    """For an exception that carries no typed outcome (a stand-in ``train_fn``), divergence is decided by its
    type, never by its text: the trainer's ``NonFiniteLoss`` (and Python's ``FloatingPointError``, the standard
    type of a floating-point failure) is a diverged run, a result of the study; anything else is a failure."""
    try:
        from ..train import NonFiniteLoss
    except ImportError:  # pragma: no cover - the trainer is part of the package
        NonFiniteLoss = ()
    return isinstance(e, (NonFiniteLoss, FloatingPointError))


def _is_interrupt(e: BaseException) -> bool:
    """A signal stopped the run (the trainer's ``Interrupted``, or an exception whose typed outcome says
    interrupted) or the study: never a result of the run."""
    if isinstance(e, StudyInterrupted):
        return True
    oc = getattr(e, "outcome", None)
    if getattr(oc, "status", None) is not None and getattr(oc.status, "value", None) == "interrupted":
        return True
    try:
        from ..train import Interrupted
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, Interrupted)


def _outcome_of(e: BaseException, rd: Path):
    """The typed outcome of a run that raised ``e``: the exception's own (the trainer attaches it as
    ``e.outcome``), else the one the trainer recorded in ``rd/run.json``, else by the exception's type
    (``_is_divergence``): diverged or failed."""
    from ..train.callbacks import Outcome, Status, read_outcome

    oc = getattr(e, "outcome", None)
    if isinstance(oc, Outcome):
        return oc
    oc = read_outcome(rd)
    if oc is not None and oc.status in (Status.DIVERGED, Status.FAILED):
        return oc
    if _is_divergence(e):
        return Outcome(Status.DIVERGED, getattr(e, "step", None), str(e), rd)
    return Outcome(Status.FAILED, None, str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}", rd)


def is_out_of_memory(e: BaseException | None) -> bool:
    """Whether ``e`` or an exception it was raised from (``__cause__`` / ``__context__``) is the device
    running out of memory (``torch.OutOfMemoryError``), decided by type."""
    import torch
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def ran_out_of_memory(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` or one of its cooldown branches last failed by running out of device
    memory (``"oom": true`` in its ``study_status.json``)."""
    run_dir = Path(run_dir)
    sts = [_status(run_dir)]
    if (run_dir / "branches").is_dir():
        sts += [_status(b) for b in sorted((run_dir / "branches").iterdir())]
    return any(st is not None and st.get("state") == "failed" and st.get("oom") for st in sts)


def _resume_point(rd: Path) -> int | None:
    """The step of the checkpoint an unfinished run continues from, or None (train it again): a run stopped by a
    signal (the trainer writes a checkpoint when SIGINT or SIGTERM stops it, and records the outcome
    ``interrupted`` in ``RUN/run.json``) or killed (SIGKILL, a lost machine: no outcome recorded) after a
    checkpoint. The checkpoint is the run folder's newest (``checkpoint.latest``); a run whose record says it
    ended otherwise, or whose checkpoint cannot be read, has none."""
    from ..train import checkpoint as ckpt
    from ..train.callbacks import Status, read_outcome
    try:
        oc = read_outcome(rd)
    except Exception:  # noqa: BLE001 - an unreadable record: train the run again
        return None
    if oc is not None and oc.status is not Status.INTERRUPTED:
        return None
    latest = ckpt.latest(rd)
    if latest is None:
        return None
    try:
        return ckpt.step_of(latest)
    except UserError:
        return None


def _finished(st: dict | None) -> bool:
    return st is not None and st.get("state") in FINISHED_STATES


def _study_lock(out: Path) -> FolderLock:
    """Exclusive ownership of a study folder: ``FolderLock`` on ``OUT/.lock``, which holds the owner's pid.

    Taken before anything in the folder is written and held for the whole study. Worker processes get the
    locked file descriptor (``pass_fds``), so the lock lasts until the owner and all its workers have
    ended; the system drops it when they end, however they end. Where ``fcntl`` does not exist the folder
    is not locked."""
    def busy(who: str) -> str:
        owner = f"pid {who}" if who else "another process"
        if who.isdecimal() and not pid_alive(int(who)):
            owner = f"the worker processes of pid {who}, which has exited; they stop in a moment"
        return f"study folder {out} is in use by another mxtrain study ({owner}); wait for it to finish or choose " \
               f"another --out"
    try:
        return FolderLock(out, busy, refused=lambda e: f"cannot lock study folder {out} ({e.strerror or e})")
    except OSError as e:
        raise UserError(f"cannot write to study folder {out}: {e.strerror or e}") from None


class _StopOnSignal:
    """While the study runs (main thread only): SIGINT and SIGTERM raise ``StudyInterrupted``, so that
    ``finally`` blocks stop the workers and release the lock. (While a run trains in this process, the
    trainer's own handler takes over and ends the run with ``Interrupted``.)"""

    def __init__(self):
        self.old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.old[s] = signal.signal(s, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise StudyInterrupted(f"study interrupted by {signal.Signals(signum).name}; rerun the same command to "
                               f"resume (finished runs are skipped)", signum)

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}
        return False


def run_study(spec: StudySpec, train_fn: Callable[[StudySpec, str, int, Path], None] | None = None,
              log=print, jobs: int = 1, branch_fn=None, start_by: float | None = None) -> Path:
    """Run (or resume) every arm x seed, then write summary.json and the report. Returns OUT.

    ``jobs`` > 1 trains that many runs at once in worker processes (``python -m mxtrain.study.worker``),
    spread round-robin over the visible GPUs when the study runs on CUDA (several small runs share
    one GPU well: each alone leaves it mostly idle). Every run still trains exactly as alone.
    ``start_by`` (a ``time.time()`` value): no run starts after it (``run_one``).
    """
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    spec.check_branch_options()
    out = Path(spec.out)
    from ..train.callbacks import require_wandb, wandb_project
    from ..train.trainer import validate
    for arm in spec.arms:   # every run's config checked before the study folder is written
        cfg = build_config(spec, arm, 0, out / "runs" / "check")
        validate(cfg)
        if wandb_project(getattr(cfg.log, "wandb", None)):
            require_wandb()   # a missing wandb: one error now, not one per run
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to study folder {out}: {e.strerror or e}") from None
    lock = _study_lock(out)   # before anything in the folder is written: one owner at a time
    try:
        with _StopOnSignal():
            _run_study_locked(spec, out, train_fn, log, jobs, lock, branch_fn, start_by)
    finally:
        lock.close()
    return out


def _run_study_locked(spec: StudySpec, out: Path, train_fn, log, jobs: int, lock: FolderLock, branch_fn=None,
                      start_by: float | None = None) -> None:
    try:
        (out / ".write_test").write_text("")
        (out / ".write_test").unlink()
    except OSError as e:
        raise UserError(f"cannot write to study folder {out}: {e.strerror or e}") from None
    meta_p = out / "study.json"
    if meta_p.is_file():
        old = read_json_object(meta_p)
        if old.get("plan_key") != json.loads(json.dumps(spec.plan_key())):
            raise UserError(f"{out} holds a study with a different base config ({old.get('plan_key')}); "
                            f"use another --out, or the same settings to resume it")
    recipes = {a: R.get(A.recipe_of(a)).to_dict() for a in spec.arms}
    meta = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "spec": asdict(spec),
            "plan_key": spec.plan_key(), "baseline": spec.baseline, "references": spec.references,
            "arms": spec.arms, "seeds": list(range(spec.seeds)),
            "recipes": recipes, "arm_options": {a: A.overrides_of(a) for a in spec.arms if A.overrides_of(a)},
            "smooth_k": spec.smooth_k, "target_frac": spec.target_frac,
            "target_loss": spec.target_loss, "command": " ".join(sys.argv)}
    if spec.budgets:
        meta["cooldown"] = {"budgets": spec.budgets, "cooldown": spec.cooldown, "shape": spec.cooldown_shape,
                            "n_boot": spec.n_boot, "fit": spec.fit,
                            "branches": [{"budget": b, "at_step": k, "cooldown_steps": n}
                                         for b, k, n in study_branch_plan(spec)]}
    if meta_p.is_file():
        _keep_records(read_json_object(meta_p), meta)
    write_json(meta_p, meta, indent=1, default=str)

    order = plan_order(spec)
    t0 = time.time()
    worker_error = None
    try:
        if jobs > 1 and train_fn is None:
            worker_error = _run_workers(spec, out, jobs, log, lock, start_by)
        else:
            for i, (arm, seed) in enumerate(order, 1):
                run_one(spec, arm, seed, f"[{i}/{len(order)}]", train_fn or train_one, log, branch_fn=branch_fn,
                        start_by=start_by)
    except Exception as e:
        if _is_interrupt(e) and not isinstance(e, StudyInterrupted):   # the trainer's Interrupted
            signum = getattr(e, "exit_code", 130) - 128
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            raise StudyInterrupted(f"study interrupted by {name}; rerun the same command to resume (finished runs "
                                   f"are skipped, the run in progress is trained again)", signum) from None
        raise
    log(f"all runs ended ({time.time() - t0:.0f} s this session)")
    summarize_study(out)
    if worker_error:
        raise UserError(worker_error)


def _keep_records(old: dict, meta: dict) -> None:
    """What an earlier study.json records that the command run again does not make: when it was created, and
    what ``study-import`` added (its ``imported`` records, the arms imported with their recipes and options).
    Running the study's own command again after an import keeps them (it replaced them before)."""
    meta["created"] = old.get("created", meta["created"])
    records = old.get("imported")
    if not isinstance(records, list) or not records:
        return
    meta["imported"] = records
    added = [r.get("as") for rec in records if isinstance(rec, dict) and isinstance(rec.get("runs"), list)
             for r in rec["runs"] if isinstance(r, dict)]
    old_arms = old.get("arms") if isinstance(old.get("arms"), list) else []
    for a in dict.fromkeys(added):
        if not isinstance(a, str) or a in meta["arms"] or a not in old_arms:
            continue
        meta["arms"] = meta["arms"] + [a]
        for key in ("recipes", "arm_options"):
            if isinstance(old.get(key), dict) and a in old[key]:
                meta[key][a] = old[key][a]


def plan_order(spec: StudySpec) -> list[tuple[str, int]]:
    """Seed-major order: after the first pass over seed 0 every arm has a result to compare. Within a seed, arms
    that share their stable run with another arm (``arms.stable_base``) come after the others."""
    arms = sorted(spec.arms, key=lambda a: A.stable_base(a) in spec.arms)
    return [(a, s) for s in range(spec.seeds) for a in arms]


def run_one(spec: StudySpec, arm: str, seed: int, tag: str, train_fn, log=print, branch_fn=None,
            start_by: float | None = None) -> None:
    """Train one arm x seed unless its folder says it finished; record done | diverged | failed.

    The state comes from the run's typed ``Outcome`` (``mxtrain.train.callbacks``): the one ``train_fn``
    returns (``train_one`` returns the trainer's), or the one the exception it raised carries, or the one
    the trainer recorded in ``RUN/run.json``; only for a stand-in ``train_fn`` that gives none is divergence
    told by the exception's type (``NonFiniteLoss``, ``FloatingPointError``), never by its text. Completed is
    ``done``, diverged is a result; interrupted (the trainer's ``Interrupted``, ``StudyInterrupted``,
    ``KeyboardInterrupt``) stops the study; failed is recorded with its message (traceback in
    ``RUN/study_error.txt``), the run counts as missing, and the next session trains it again.

    In a cooldown study (``spec.budgets``) a run that is done then trains its cooldown branches
    (``run_branches``), each skipped when finished, as runs are.

    ``start_by`` (a ``time.time()`` value, ``--start-by``): after it, no run starts, none continues and no
    checkpoint is remade; only cooldown branches whose checkpoints are at hand still train (a time-limited GPU
    lease spends its end on what can finish)."""

    rd = Path(spec.out) / "runs" / arm / f"seed{seed}"
    st = _status(rd)
    if _finished(st):
        log(f"{tag} {arm} seed {seed}: {st.get('state')} already, skipped")
        if st.get("state") == "done" and spec.budgets:
            run_branches(spec, arm, seed, tag, branch_fn or train_branch, log, remake_fn=train_fn, start_by=start_by)
        return
    if _past(start_by):
        log(f"{tag} {arm} seed {seed}: not started (past --start-by)")
        return
    if _share_stable_run(spec, arm, seed, rd, tag, log):   # an arm that differs only in its branches (@bf16cool)
        if spec.budgets:
            run_branches(spec, arm, seed, tag, branch_fn or train_branch, log, remake_fn=train_fn, start_by=start_by)
        return
    resume = None
    if rd.exists():
        busy = _run_folder_owner(rd)
        if busy is not None:
            raise UserError(f"run folder {rd} is in use by another process ({busy}); stop it, then rerun the study")
        at = _resume_point(rd) if st is None else None
        if at is not None:   # stopped by a signal (a time limit) or killed: its own checkpoint continues it, bit for bit
            log(f"{tag} {arm} seed {seed}: unfinished, continuing from its checkpoint at step {at}")
            resume = rd
        else:
            log(f"{tag} {arm} seed {seed}: " + (f"failed before ({st.get('message')}), " if st else
                                                "unfinished run folder, ") + "training it again")
            shutil.rmtree(rd)
    rd.parent.mkdir(parents=True, exist_ok=True)
    log(f"{tag} {arm} seed {seed} -> {rd}")
    ts = time.time()
    state = _run_and_record(lambda: train_fn(spec, arm, seed, rd, **({"resume": rd} if resume else {})), rd,
                            f"{arm} seed {seed} was interrupted ({{}}); rerun the same command to resume (finished "
                            f"runs are skipped)", {"arm": arm, "seed": seed}, log)
    log(f"{tag} {arm} seed {seed}: {state} in {time.time() - ts:.0f} s")
    if state == "done" and spec.budgets:
        run_branches(spec, arm, seed, tag, branch_fn or train_branch, log, remake_fn=train_fn, start_by=start_by)


def _share_stable_run(spec: StudySpec, arm: str, seed: int, rd: Path, tag: str, log, poll: float = 5.0) -> bool:
    """For an arm whose options change only its cooldown branches (``arms.stable_base``), with that base arm in
    the study: the base arm's finished stable run of this seed, copied into ``rd`` (checkpoints hard-linked
    where the file system allows), instead of training the same run again; waits while another worker
    trains it. True when ``rd`` now holds a done run; False (train it here) when the base arm is not in the
    study, its run did not finish done, or ``rd`` holds a run of its own already."""
    base = A.stable_base(arm)
    if base is None or base not in spec.arms or rd.exists():
        return False
    brd = Path(spec.out) / "runs" / base / f"seed{seed}"
    claim = claim_path(Path(spec.out), base, seed)   # a worker has taken the base run (--jobs)
    said, idle = False, time.time()
    while _status(brd) is None:   # neither finished nor failed yet
        if _run_folder_owner(brd) is not None:
            idle = time.time()
        elif not claim.exists() or time.time() - idle > 300:   # nobody trains it (or its worker died)
            break
        if not said:
            log(f"{tag} {arm} seed {seed}: waiting for {base} seed {seed}'s stable run (the same run), trained now")
            said = True
        time.sleep(poll)
    st = _status(brd)
    if not (st and st.get("state") == "done"):
        return False
    tmp = rd.parent / f".{rd.name}.sharing"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in brd.iterdir():
        if not f.is_file() or f.name in ("study_status.json", ".lock"):
            continue
        if f.suffix == ".pt":
            try:
                os.link(f, tmp / f.name)
                continue
            except OSError:
                pass
        shutil.copy2(f, tmp / f.name)
    (tmp / "study_status.json").write_text(json.dumps({**st, "arm": arm, "shared_from": base}))
    os.replace(tmp, rd)
    log(f"{tag} {arm} seed {seed}: the stable run of {base} seed {seed}, shared (its options change only the "
        f"cooldown branches)")
    return True


def _run_and_record(call, folder: Path, interrupted: str, fields: dict, log) -> str:
    """Run ``call`` (a run or a branch training into ``folder``) and record its state in
    ``folder/study_status.json`` (done | diverged | failed, with ``fields``; a failure's traceback in
    ``study_error.txt``); the state is the trainer's typed outcome. An interrupted run stops the study
    (``interrupted``: the message, ``{}`` for the reason)."""
    from ..train.callbacks import Outcome, Status, read_outcome
    ts = time.time()
    tb = None
    oom = False
    try:
        res = call()
    except Exception as e:  # a diverged run is a result, a failed one is recorded; a signal stops the study
        if _is_interrupt(e):
            raise
        oc = _outcome_of(e, folder)
        if not oc.diverged:
            tb = traceback.format_exc()
            oom = is_out_of_memory(e)
    else:
        oc = res if isinstance(res, Outcome) else (read_outcome(folder) or Outcome(Status.COMPLETED, None, None, folder))
        if oc.status is Status.INTERRUPTED:
            raise StudyInterrupted(interrupted.replace("{}", str(oc.reason)), signal.SIGINT)
    state = {Status.COMPLETED: "done", Status.DIVERGED: "diverged"}.get(oc.status, "failed")
    msg = oc.reason if state != "done" else None
    if state != "done":
        log(f"    {state}: {msg}")
    folder.mkdir(parents=True, exist_ok=True)
    if tb:
        (folder / "study_error.txt").write_text(tb)
    (folder / "study_status.json").write_text(json.dumps(
        {"state": state, "message": msg, "step": oc.step, "seconds": round(time.time() - ts, 1), **fields,
         **({"oom": True} if oom and state == "failed" else {})}))
    return state


def claim_path(out: Path, arm: str, seed: int) -> Path:
    """The file a study worker creates (atomically) to take run ``arm`` x ``seed`` (``mxtrain.study.worker``)."""
    return out / "claims" / f"{arm}-seed{seed}"


def _past(start_by: float | None) -> bool:
    return start_by is not None and time.time() > start_by


def run_branches(spec: StudySpec, arm: str, seed: int, tag: str, branch_fn, log=print, remake_fn=None,
                 start_by: float | None = None) -> None:
    """The cooldown branches of one finished stable run, in budget order; each records
    ``BRANCH/study_status.json`` (done | diverged | failed, with its budget, branch step and cooldown steps).
    A finished branch is skipped; a failed one is trained again from the stable run's checkpoint; an
    interrupted one resumes from its own checkpoint (``mxtrain.train.branch_fit``). Where the stable run's
    checkpoint for a pending branch is gone (a study carried to another machine without its checkpoints),
    ``remake_fn`` (the study's ``train_fn``) trains the stable run again to make it (``remake_checkpoints``),
    unless ``start_by`` has passed: those branches are then left for the next session."""

    rd = Path(spec.out) / "runs" / arm / f"seed{seed}"
    gone: list[int] = []
    if remake_fn is not None:
        gone = _gone_checkpoints(spec, rd)
        if gone and not _past(start_by):
            remake_checkpoints(spec, arm, seed, rd, gone, remake_fn, log, tag)
            gone = []
        elif gone:
            log(f"{tag} {arm} seed {seed}: branch(es) at step {', '.join(map(str, gone))} not started (their "
                f"checkpoints must be remade; past --start-by)")
    for budget, k, n in study_branch_plan(spec):
        bd = branch_folder(rd, k, n)
        what = f"{tag} {arm} seed {seed} budget {budget:g} (branch at step {k}, {n} cooldown steps)"
        st = _status(bd)
        if _finished(st) or k in gone:
            continue
        if st is not None and bd.exists():   # failed before: trained again from scratch
            log(f"{what}: failed before ({st.get('message')}), training it again")
            shutil.rmtree(bd)
        log(f"{what} -> {bd}")
        ts = time.time()
        state = _run_and_record(lambda: branch_fn(spec, arm, seed, rd, budget, k, n, bd), bd,
                                f"{arm} seed {seed} budget {budget:g} was interrupted ({{}}); rerun the same command "
                                f"to resume", {"arm": arm, "seed": seed, "budget": budget, "at_step": k,
                                               "cooldown_steps": n, "shape": spec.cooldown_shape}, log)
        log(f"{what}: {state} in {time.time() - ts:.0f} s")


def _gone_checkpoints(spec: StudySpec, rd: Path) -> list[int]:
    """Branch steps of ``rd``'s pending branches (neither finished nor holding a checkpoint of their own) whose
    kept checkpoint of the stable run is missing. Only for a run folder the trainer wrote (``run.json``)."""
    from ..train import checkpoint as ckpt
    from ..train.branch import kept_checkpoint
    if not (rd / "run.json").is_file():
        return []
    gone = []
    for _, k, n in study_branch_plan(spec):
        bd = branch_folder(rd, k, n)
        if _finished(_status(bd)) or ckpt.holds_checkpoint(bd):
            continue
        try:
            kept_checkpoint(rd, k)
        except UserError:
            gone.append(k)
    return gone


def _step_losses(folder: Path) -> dict[int, float]:
    """Training loss by step from ``folder/metrics.jsonl`` (the last row of a step wins: a resumed run)."""
    out: dict[int, float] = {}
    p = folder / "metrics.jsonl"
    if p.is_file():
        for line in p.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in r and "val_loss" not in r and "step" in r:
                out[int(r["step"])] = float(r["loss"])
    return out


def remake_checkpoints(spec: StudySpec, arm: str, seed: int, rd: Path, steps: list[int], train_fn, log=print,
                       tag: str = "") -> dict:
    """Train the finished stable run ``rd`` again, in ``rd/remake``, to make its kept checkpoints at ``steps``
    (they were not carried with the study), move them into ``rd``, and compare the remade run's training losses
    with the first run's at every logged step: ``rd/remake.json`` records ``bit_equal`` and the largest
    difference. On the CPU a remake equals the first run bit for bit (tests/test_study_cooldown.py); on a GPU it
    need not unless ``train.deterministic`` is on, since PyTorch's default GPU kernels are not all deterministic
    (which ones moved these runs was not traced): a 30m de-oscillation run remade on the same H100 model
    differed from step 120 on, by up to 0.028 in single logged losses; an H200 run remade on an H100 by up to
    0.25 (docs/results.md). Where the losses differ, a warning says so and the branches start from the remade
    state. A remake stopped by a signal continues from its own checkpoint next time."""
    from ..train.branch import kept_checkpoint
    from ..train.trainer import kept_name
    what = f"{tag} {arm} seed {seed}".strip()
    tmp = rd / "remake"
    at = _resume_point(tmp) if tmp.exists() else None
    if tmp.exists() and at is None:
        shutil.rmtree(tmp)
    log(f"{what}: the stable run's checkpoint(s) at step {', '.join(map(str, steps))} are gone (a study carried "
        f"without checkpoints): training the stable run again to make them"
        + (f", continuing the remake from step {at}" if at is not None else ""))
    ts = time.time()
    oc = train_fn(spec, arm, seed, tmp, **({"resume": tmp} if at is not None else {}))
    from ..train.callbacks import Outcome, Status
    if isinstance(oc, Outcome) and oc.status is Status.INTERRUPTED:
        raise StudyInterrupted(f"{what}: remaking its checkpoints was interrupted ({oc.reason}); rerun the same "
                               f"command to resume", signal.SIGINT)
    for k in steps:
        src = kept_checkpoint(tmp, k)
        os.replace(src, rd / kept_name(k, src.is_dir()))
    first, again = _step_losses(rd), _step_losses(tmp)
    common = sorted(set(first) & set(again))
    diff = max((abs(first[s] - again[s]) for s in common), default=float("nan"))
    rec = {"steps": steps, "compared_steps": len(common), "bit_equal": bool(common) and diff == 0.0,
           "max_abs_loss_diff": diff if common else None, "seconds": round(time.time() - ts, 1)}
    (rd / "remake.json").write_text(json.dumps(rec, indent=1) + "\n")
    try:
        os.replace(tmp / "metrics.jsonl", rd / "remake-metrics.jsonl")
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    if rec["bit_equal"]:
        log(f"{what}: checkpoints remade in {rec['seconds']:.0f} s; the remade run's {len(common)} logged losses "
            f"equal the first run's bit for bit")
    else:
        log(f"warning: {what}: the remade stable run differs from the first (largest loss difference "
            f"{diff:.3g} over {len(common)} logged steps): its branches start from the remade state "
            f"({rd / 'remake.json'})")
    return rec


def branches_pending(spec: StudySpec, out: Path, arm: str, seed: int) -> bool:
    """Does a done stable run of a cooldown study still lack a finished branch?"""
    if not spec.budgets:
        return False
    rd = out / "runs" / arm / f"seed{seed}"
    st = _status(rd)
    if not (st and st.get("state") == "done"):
        return False
    return any(not _finished(_status(branch_folder(rd, k, n))) for _, k, n in study_branch_plan(spec))


def _run_folder_owner(rd: Path) -> str | None:
    """Who holds the trainer's lock on run folder ``rd`` (``RUN/.lock``), or None when nobody does."""
    who = lock_holder(rd / ".lock")
    return None if who is None else f"pid {who}" if who else "unknown pid"


def _run_workers(spec: StudySpec, out: Path, jobs: int, log, lock: FolderLock | None = None,
                 start_by: float | None = None) -> str | None:
    """Start ``jobs`` worker processes over the pending runs and wait for all of them.

    Returns None, or a message naming the workers that exited with an error. The workers are always
    stopped and waited for before this returns or raises (SIGINT/SIGTERM to this process, an error here);
    each also dies with this process if it is killed (``PR_SET_PDEATHSIG``, set by the worker)."""
    import subprocess

    pending = [(a, s) for a, s in plan_order(spec) if not _finished(_status(out / "runs" / a / f"seed{s}"))
               or branches_pending(spec, out, a, s)]
    if not pending:
        log("every run of this study has finished already")
        return None
    jobs = min(jobs, len(pending))
    gpus: list[str] = []
    dev = spec.device or ""
    if not dev.startswith("cpu"):
        try:
            import torch
            if torch.cuda.is_available() and (dev in ("", "cuda")):
                vis = os.environ.get("CUDA_VISIBLE_DEVICES")
                gpus = [g for g in vis.split(",") if g] if vis else [str(i) for i in range(torch.cuda.device_count())]
        except Exception:  # noqa: BLE001
            gpus = []
    log(f"{len(pending)} runs to train in {jobs} worker processes"
        + (f" on GPUs {','.join(gpus[:jobs])}" if len(gpus) > 1 else "") + f"; logs: {out}/worker<k>.log")
    # claims of an interrupted earlier session: safe to drop, the study lock proves none of its workers runs
    shutil.rmtree(out / "claims", ignore_errors=True)
    lock_fd = lock.fileno() if lock is not None else None
    procs = []
    try:
        for k in range(jobs):
            env = dict(os.environ)
            env["MXTRAIN_STUDY_PARENT"] = str(os.getpid())   # the worker exits if this process is gone already
            if start_by is not None:
                env["MXTRAIN_STUDY_START_BY"] = repr(float(start_by))
            else:
                env.pop("MXTRAIN_STUDY_START_BY", None)
            if len(gpus) > 1:
                env["CUDA_VISIBLE_DEVICES"] = gpus[k % len(gpus)]
            if dev.startswith("cpu") or not gpus:
                # share the cores instead of oversubscribing them
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
            lf = open(out / f"worker{k}.log", "w")
            try:
                p = subprocess.Popen(python_command("mxtrain.study.worker", [str(out), str(k), str(jobs)]),
                                     env=env, stdout=lf, stderr=subprocess.STDOUT,
                                     pass_fds=(lock_fd,) if lock_fd is not None else ())
            except BaseException:
                lf.close()
                raise
            procs.append((k, lf, p))
        failed = []
        for k, lf, p in procs:
            if p.wait() != 0:
                failed.append(k)
    finally:
        _stop_workers([p for _, _, p in procs])
        for _, lf, _ in procs:
            lf.close()
    shutil.rmtree(out / "claims", ignore_errors=True)
    if failed:
        tail = (out / f"worker{failed[0]}.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return (f"study worker(s) {', '.join(map(str, failed))} failed (see {out}/worker{failed[0]}.log: "
                f"{tail[0][:200]}); rerun the same command to resume")
    return None


def _stop_workers(procs, grace: float = 10.0) -> None:
    """SIGTERM to every worker still running (the trainer ends its step and stops), then wait; after
    ``grace`` seconds, or at once on another SIGINT/SIGTERM, SIGKILL."""
    import subprocess

    alive = [p for p in procs if p.poll() is None]
    if not alive:
        return

    def kill_all(signum=None, frame=None):
        for p in alive:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old[s] = signal.signal(s, kill_all)
    try:
        for p in alive:
            try:
                p.terminate()
            except OSError:
                pass
        deadline = time.monotonic() + grace
        for p in alive:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all()
                p.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def summarize_study(out: str | Path) -> dict:
    """Recompute ``summary.json`` and the report from the run folders.

    ``summary["planned_runs"]`` counts the plan's arm x seed runs and ``summary["missing"]`` lists those
    without a finished run (failed, interrupted or never trained), each with its state and reason. When
    the baseline has no finished run there is nothing to compare with: ``summary.json`` then holds only
    the plan and the missing runs (``"arms": {}``) and no report is written."""
    from .report import write_report

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
    under ``missing`` (with their budget), counted in ``planned_runs``. ``only``: these arms' branches alone
    (a report of some of the arms)."""
    from . import cooldown as C

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
    summary["planned_runs"] = summary.get("planned_runs", 0) + len(meta["arms"]) * len(meta["seeds"]) * len(plan)
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
    from .claims import claim_lines, evaluate_claims
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


def incomplete_message(summary: dict, limit: int = 8) -> str | None:
    """``study incomplete: N of M planned runs missing: ...`` for a summary that lacks planned runs, else None."""
    miss = summary.get("missing") or []
    if not miss:
        return None
    items = [f"{m['arm']} seed {m['seed']}" + (f" budget {m['budget']:g}" if m.get("budget") is not None else "")
             + f" ({m['state'].replace('_', ' ')}" + (f": {m['reason'][:160]}" if m.get("reason") else "") + ")"
             for m in miss[:limit]]
    more = f", and {len(miss) - limit} more" if len(miss) > limit else ""
    n_oom = sum(1 for m in miss if m.get("oom"))
    oom = (f"; {n_oom} of them ran out of GPU memory: train fewer runs at once (a smaller --jobs; runs sharing "
           f"a GPU each need their own memory)" if n_oom else "")
    return (f"study incomplete: {len(miss)} of {summary.get('planned_runs', '?')} planned runs missing: "
            f"{', '.join(items)}{more}{oom}")
