"""The plan of ``mxtrain study``: arms (recipes, optionally with training options) x seeds from one base
training config (``StudySpec``, the presets), the cooldown branches, and the training config of each run
(``build_config``). Running the plan: ``mxtrain.study.run`` (one run), ``mxtrain.study.workers`` (the study).

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

Learning-rate schedule: a cosine that ends at the run's last step makes every arm's loss drop at
the end, so a quantized arm can never reach the baseline's final loss and the extra-token cost is
meaningless. Studies therefore default to a constant rate after warmup (``--schedule constant``),
or a cosine whose horizon is ``--lr-horizon`` (10) times the run (``long-cosine``, as MLPerf's
Llama 3.1-8B config does: its cosine spans 1.2 M steps for a ~6 k-step run).

Imports marked ``# startup`` sit in the functions that use them: ``mxtrain.train`` (and the report)
load on first use, not when ``mxtrain report`` or ``mxtrain study --dry-run`` imports this module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..data.shards import fingerprint
from ..errors import UserError, check_number
from . import arms as A

__all__ = ["PRESETS", "SCHEDULES", "FLAG_KEYS", "PER_RUN", "StudySpec", "branch_plan", "study_branch_plan",
           "build_config", "run_steps", "branch_folder", "plan_order", "override_key"]

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
    # issue #46's AMD ladder at 125m, planned before it ran (docs/results.md, "Next experiment, planned before it
    # runs"): the headline study's design (3,840 steps of 32 x 512 tokens, 0.5 tokens per parameter, branches at
    # 25/50/100 %, a 20-step warm-up) with the ladder's arms at the common rate 7.5e-4 and at 3.75e-4, and a BF16
    # cooldown of plain MXFP4 (branches only); 5 seeds. BF16 did better at 3.75e-4 than at 7.5e-4 (the third leg), so
    # by the plan's rule every arm also runs at 1.875e-4. Its base settings equal the first leg's
    # (docs/results/data/ladder-125m-study.tgz), so this preset resumes that folder
    "ladder-125m": dict(arms=["bf16", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4-all", "mxfp4-all-dh16",
                              "mxfp4-all@bf16cool", "bf16@lr3.75e-4", "mxfp4-fprop@lr3.75e-4",
                              "mxfp4-fprop-dgrad@lr3.75e-4", "mxfp4-all@lr3.75e-4", "mxfp4-all-dh16@lr3.75e-4",
                              "bf16@lr1.875e-4", "mxfp4-fprop@lr1.875e-4", "mxfp4-fprop-dgrad@lr1.875e-4",
                              "mxfp4-all@lr1.875e-4", "mxfp4-all-dh16@lr1.875e-4"],
                        baseline="bf16", seeds=5, model="125m", steps=3840, lr=7.5e-4, batch_size=32, seq_len=512,
                        budgets=[0.25, 0.5, 1.0], eval_every=77, diagnose_every=0, overrides=list(_COOLED_EVAL)),
    # the trend with training length: BF16 and plain MXFP4 at 30m, one run per arm x seed of
    # 11,500 steps x 16,384 tokens (188 M tokens: 20 per non-embedding parameter, 5.4 per parameter in all with
    # the 32k vocabulary), cooled-down branches from 1 to 20 tokens per non-embedding parameter; each run must
    # finish inside one time-limited GPU allocation (checkpoints did not travel between them): 18 minutes for all 6 with 3 runs a GPU under
    # MPS on two H100s (docs/results.md). Peak LR 1.5e-3, where the learning-rate sweep at 30m put BF16 and
    # MXFP4 well below 3e-3 (the base experiment's rate)
    "trend": dict(arms=["bf16", "mxfp4-all"], baseline="bf16", seeds=3, model="30m", steps=11500, lr=1.5e-3,
                  batch_size=32, seq_len=512, budgets=[0.05, 0.1, 0.25, 0.5, 1.0], eval_every=230, diagnose_every=0,
                  overrides=list(_COOLED_EVAL)),
    # issue #51's recipes of 2026 at 30m, planned before it runs (docs/results.md, "Next experiment at 30m"): the
    # split study's design (4,224 steps of 32 x 512 tokens, 2 tokens per parameter, branches at 25/50/100 %,
    # evaluation every 2 %) at peak LR 7.5e-4, BF16's lowest-loss rate of those tried at 30m (below 1.5e-3 at every budget, not resolved),
    # with an 84-step (2 %) warm-up instead of 20; BF16 at half the rate as the rate check; 5 seeds. Every arm is
    # also compared with plain MXFP4 (a second reference), the question of each new lever
    "recipes-2026": dict(arms=["bf16", "mxfp4-all", "mxfp4-all-rht16", "mxfp4-all-dh16", "mxfp4-all-dh16-fprop",
                               "ufp4", "mxfp4-all-adaptive", "mxfp4-all+rceil", "nvfp4", "nvfp4-4over6",
                               "bf16@lr3.75e-4"],
                         baseline="bf16", references=["mxfp4-all"], seeds=5, model="30m", steps=4224, lr=7.5e-4,
                         batch_size=32, seq_len=512, budgets=[0.25, 0.5, 1.0], eval_every=84, diagnose_every=0,
                         overrides=["log.eval_tokens=131072", "log.final_eval_tokens=1048576",
                                    "schedule.warmup_steps=84"]),
    # issue #46's AMD ladder at a second size, planned before it runs (docs/results.md, "The ladder at 30m, planned
    # before it runs"): the recipes-2026 design (same base settings, so both plans share one study folder and its
    # runs of bf16, mxfp4-all, mxfp4-all-dh16 and bf16@lr3.75e-4) with the 125m ladder's arms and rates
    "ladder-30m": dict(arms=["bf16", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4-all", "mxfp4-all-dh16",
                             "mxfp4-all@bf16cool", "bf16@lr3.75e-4", "mxfp4-fprop@lr3.75e-4",
                             "mxfp4-fprop-dgrad@lr3.75e-4", "mxfp4-all@lr3.75e-4", "mxfp4-all-dh16@lr3.75e-4"],
                       baseline="bf16", seeds=5, model="30m", steps=4224, lr=7.5e-4, batch_size=32, seq_len=512,
                       budgets=[0.25, 0.5, 1.0], eval_every=84, diagnose_every=0,
                       overrides=["log.eval_tokens=131072", "log.final_eval_tokens=1048576",
                                  "schedule.warmup_steps=84"]),
    # CI: tiny model on CPU, 3 arms x 2 seeds, a few minutes in all
    "smoke": dict(arms=["bf16", "mxfp4-all", "mxfp4-all-dh16"], baseline="bf16", seeds=2, model="tiny",
                  steps=16, batch_size=8, seq_len=64, eval_every=2, diagnose_every=8, device="cpu", target_frac=0.5,
                  overrides=["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
                             "schedule.warmup_steps=4", "optim.lr=5e-3", "log.eval_tokens=512", "log.log_every=1"]),
}


# flag (StudySpec field) -> the training-config key it sets
FLAG_KEYS = {"model": "model.name", "steps": "train.steps", "batch_size": "train.batch_size", "seq_len": "data.seq_len",
             "lr": "optim.lr", "data": "data.path", "device": "train.device", "eval_every": "log.eval_every"}


def model_shape_keys() -> tuple[str, ...]:
    """The model's shape beside its name (``train.config.MODEL_SHAPE_FIELDS``, as ``model.`` keys): a preset's
    values of these go when the user names another model, as a named size drops them in ``mxtrain train``."""
    from ..train.config import MODEL_SHAPE_FIELDS  # startup
    return tuple(f"model.{k}" for k in MODEL_SHAPE_FIELDS)


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
            gone = set(user) | (set(model_shape_keys()) if "model.name" in user else set())
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


def data_fingerprint(spec: StudySpec) -> str | None:
    """The fingerprint of the study's prepared data folder (``mxtrain.data.shards.fingerprint``), or None when
    ``--data`` is not given or is not a prepared folder."""
    return fingerprint(spec.data) if spec.data else None


def resume_refusal(old: dict, spec: StudySpec, data_fp: str | None) -> str | None:
    """Why the study folder whose ``study.json`` is ``old`` cannot be resumed with ``spec`` (``"data"``: it was
    trained on other data; ``"config"``: another base config), or None. The base configs must be equal, the data
    path included, except when both the folder and ``spec`` know their prepared data's fingerprint: then the
    fingerprints must be equal instead of the paths, so that a corpus moved or prepared again on another machine
    resumes the study and other data does not."""
    new = json.loads(json.dumps(spec.plan_key()))
    key = old.get("plan_key")
    old_fp = old.get("data_fingerprint")
    if not (old_fp and data_fp):
        return None if key == new else "config"
    if old_fp != data_fp:
        return "data"

    def pathless(k):
        if not (isinstance(k, dict) and isinstance(k.get("train"), dict)):
            return k
        return {**k, "train": {a: v for a, v in k["train"].items() if a != "data"}}
    return None if pathless(key) == pathless(new) else "config"


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested config as ``{dotted key: value}`` (an empty dict is a value; anything but a dict has no keys)."""
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else ()):
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(a: dict, b: dict, ignore: tuple[str, ...] = ("log.out", "exp")) -> list[tuple[str, object, object]]:
    """Keys (dotted) whose values differ between two nested configs, as ``(key, a's value, b's value)``;
    a key missing on one side counts as a difference (value ``<absent>``)."""
    fa, fb = _flat(json.loads(json.dumps(a))), _flat(json.loads(json.dumps(b)))
    out = []
    for k in sorted(set(fa) | set(fb)):
        if k in ignore:
            continue
        va, vb = fa.get(k, "<absent>"), fb.get(k, "<absent>")
        if va != vb:
            out.append((k, va, vb))
    return out


def plan_differences(old: dict, spec: StudySpec, limit: int = 6) -> str:
    """The base settings in which the study folder whose ``study.json`` is ``old`` differs from ``spec``, as
    ``name: the folder's value, now value`` items (at most ``limit``), for the message that refuses a resume."""
    same_data = old.get("data_fingerprint") and old.get("data_fingerprint") == data_fingerprint(spec)
    show = lambda v: "not set" if v == "<absent>" else repr(v)   # noqa: E731
    diff = [f"{k.removeprefix('train.')}: {show(a)} in the folder, {show(b)} now"
            for k, a, b in config_differences(old.get("plan_key") or {}, spec.plan_key(), ignore=())
            if not (same_data and k == "train.data")]
    more = f"; and {len(diff) - limit} more" if len(diff) > limit else ""
    return "; ".join(diff[:limit]) + more


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
    from ..train.config import apply_overrides  # startup
    from ..train import experiments  # startup

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
    for k in unquantized_prescales(cfg.recipe, cfg.recipe_overrides):   # (the arms that quantize it take it)
        del cfg.recipe_overrides[k]
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


def unquantized_prescales(recipe: str, overrides: dict) -> list[str]:
    """The ``OPERAND.prescale`` keys of recipe ``overrides`` whose operand ``recipe`` (with the overrides'
    formats) does not quantize. A prescale means nothing there (``Operand`` refuses one), so a study's ``--set
    recipe.OPERAND.prescale=P`` applies to the arms that quantize the operand (a prescale for the quantized arms
    beside a bf16 baseline); ``mxtrain study`` refuses it when no arm does and names the arms it skips."""
    from ..numerics import recipes  # startup
    from ..numerics.formats import FORMATS, get_format  # startup
    try:
        r = recipes.get(recipe)
    except (ValueError, TypeError, KeyError, UserError):
        return []   # (refused with its own message where the recipe is resolved)
    out = []
    for k in overrides:
        op, _, fld = str(k).partition(".")
        if fld != "prescale" or not hasattr(r, op) or not hasattr(getattr(r, op), "fmt"):
            continue
        fmt = overrides.get(f"{op}.fmt", getattr(r, op).fmt)
        if isinstance(fmt, str) and fmt in FORMATS and not get_format(fmt).quantized:
            out.append(k)
    return out


def study_branch_plan(spec: StudySpec) -> list[tuple[float, int, int]]:
    """The cooldown branches of every run of ``spec`` (empty without ``budgets``)."""
    if not spec.budgets:
        return []
    base = build_config(StudySpec(**{**asdict(spec), "budgets": None}), spec.arms[0], 0, Path(spec.out) / "plan")
    return branch_plan(spec, run_steps(base), base.schedule.warmup_steps)


def branch_folder(run_dir: Path, k: int, n: int) -> Path:
    return Path(run_dir) / "branches" / f"k{k}-n{n}"


def plan_order(spec: StudySpec) -> list[tuple[str, int]]:
    """Seed-major order: after the first pass over seed 0 every arm has a result to compare. Within a seed, arms
    that share their stable run with another arm (``arms.stable_base``) come after the others."""
    arms = sorted(spec.arms, key=lambda a: A.stable_base(a) in spec.arms)
    return [(a, s) for s in range(spec.seeds) for a in arms]
