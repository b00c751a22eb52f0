"""``mxtrain study``: arms (recipes) x seeds from one base training config, resumable.

Layout of a study folder ``OUT``::

    OUT/study.json                  the plan: arms, seeds, baseline, base overrides, recipes, metric options
    OUT/runs/<arm>/seed<k>/         an ordinary ``mxtrain train`` run folder (metrics.jsonl, config.json, ...)
                  .../study_status.json   written by the runner when the run ended: done | diverged
    OUT/summary.json                per-arm results (see mxtrain.study.metrics.summarize)
    OUT/report.html, OUT/report.md  the report (mxtrain.study.report)

Control: every run of seed ``k`` uses training seed ``k`` (so the same initialization and the same
data order in every arm) and the same evaluation steps and validation set; only the recipe differs.
A run with a ``study_status.json`` is finished and skipped; a run folder without one was
interrupted and is trained again from scratch (its folder is replaced).

Learning-rate schedule: a cosine that ends at the run's last step makes every arm's loss drop at
the end, so a quantized arm can never reach the baseline's final loss and the extra-token cost is
meaningless. Studies therefore default to a constant rate after warmup (``--schedule constant``),
or a cosine whose horizon is ``--lr-horizon`` (10) times the run (``long-cosine``, as MLPerf's
Llama 3.1-8B config does: its cosine spans 1.2 M steps for a ~6 k-step run).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..errors import UserError
from .. import recipes as R
from . import metrics as M

__all__ = ["PRESETS", "SCHEDULES", "StudySpec", "run_study", "run_one", "plan_order", "summarize_study"]

SCHEDULES = ("constant", "long-cosine", "config")

PAPER_ARMS = ["bf16", "mxfp4-fprop", "mxfp4-fprop-dgrad", "mxfp4-all", "mxfp4-all-sr", "mxfp4-all-rht16",
              "mxfp4-all-dh16", "mxfp4-all-dh32"]

# preset -> StudySpec fields (explicit flags override them)
PRESETS: dict[str, dict] = {
    # [AMD] Table 1: the GEMM-by-GEMM ladder and the three interventions, vs a BF16 baseline
    "paper": dict(arms=PAPER_ARMS, baseline="bf16", seeds=3, diagnose_every=0),
    # baseline vs the three papers' complete recipes
    "recipes": dict(arms=["bf16", "mxfp4-all-dh16", "tseng", "nvfp4"], baseline="bf16", seeds=3, diagnose_every=0),
    # CI: tiny model on CPU, 3 arms x 2 seeds, a few minutes in all
    "smoke": dict(arms=["bf16", "mxfp4-all", "mxfp4-all-dh16"], baseline="bf16", seeds=2, model="tiny",
                  steps=16, batch_size=8, seq_len=64, eval_every=2, diagnose_every=8, device="cpu", target_frac=0.5,
                  overrides=["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
                             "schedule.warmup_steps=4", "optim.lr=5e-3", "log.eval_tokens=512", "log.log_every=1"]),
}


@dataclass
class StudySpec:
    """Everything that defines a study. ``overrides`` are ``key=value`` strings for the training config."""

    out: str = "studies/custom"
    arms: list[str] = field(default_factory=lambda: ["bf16", "mxfp4-all-dh16"])
    baseline: str | None = None
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

    def __post_init__(self):
        if not self.arms:
            raise UserError("a study needs at least one arm (--arms a,b,c)")
        if len(set(self.arms)) != len(self.arms):
            raise UserError(f"--arms lists an arm twice: {','.join(self.arms)}")
        valid = R.names()
        for a in self.arms:
            if a not in valid:
                raise UserError(f"unknown recipe {a!r} in --arms; valid recipes: {', '.join(valid)}")
        if self.baseline is None:
            self.baseline = self.arms[0]
        if self.baseline not in self.arms:
            raise UserError(f"--baseline {self.baseline!r} is not one of the arms ({', '.join(self.arms)})")
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

    @classmethod
    def from_args(cls, args) -> "StudySpec":
        base: dict = {}
        if args.preset:
            base.update(json.loads(json.dumps(PRESETS[args.preset])))
            base["preset"] = args.preset
        if args.arms:
            base["arms"] = [a.strip() for a in args.arms.split(",") if a.strip()]
        for k in ("exp", "seeds", "baseline", "model", "steps", "batch_size", "seq_len", "lr", "data", "device", "schedule",
                  "lr_horizon", "eval_every", "diagnose_every", "target_loss", "smooth_k"):
            v = getattr(args, k, None)
            if v is not None:
                base[k] = v
        if getattr(args, "target_frac", None) is not None:
            base["target_frac"] = args.target_frac
        base["overrides"] = list(base.get("overrides", [])) + list(args.overrides or [])
        base["out"] = args.out or f"studies/{args.preset or 'custom'}"
        return cls(**base)

    def describe(self) -> str:
        lines = [f"study -> {self.out}", f"  arms ({len(self.arms)}): {', '.join(self.arms)}; baseline {self.baseline}",
                 f"  seeds: {self.seeds} ({self.seeds * len(self.arms)} runs)",
                 f"  schedule: {self.schedule}" + (f" (horizon {self.lr_horizon:g} x run)" if self.schedule == "long-cosine" else ""),
                 f"  training: {self.train_args()}"]
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
        return {"train": self.train_args(), "diagnose_every": self.diagnose_every}


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
                     ("train.device", spec.device)):
        if val is not None:
            sets.append(f"{key}={val}")
    apply_overrides(cfg, sets + list(spec.overrides))
    if spec.steps is not None:
        cfg.train.tokens = None
    steps = cfg.train.steps
    if cfg.train.tokens:
        steps = -(-cfg.train.tokens // (cfg.train.batch_size * cfg.data.seq_len))
    if spec.eval_every is not None:
        cfg.log.eval_every = spec.eval_every
    elif not any(o.startswith("log.eval_every=") for o in spec.overrides):
        cfg.log.eval_every = max(1, steps // 40)
    if spec.schedule == "constant":
        cfg.schedule.kind = "constant"
    elif spec.schedule == "long-cosine":
        cfg.schedule.kind = "cosine"
        cfg.schedule.horizon_steps = int(round(spec.lr_horizon * steps))
    # the control: only the recipe differs between arms of one seed
    cfg.recipe = arm
    cfg.recipe_overrides = dict(cfg.recipe_overrides, seed=seed)  # SR / random-sign streams differ per seed
    cfg.train.seed = seed
    cfg.model.init_seed = seed
    cfg.data.seed = seed
    cfg.log.out = str(run_dir)
    cfg.log.progress = False
    cfg.log.tensorboard = False
    return cfg


class _DiagnosticsTap:
    """Attach ``Diagnostics`` to a trainer run without changing the trainer.

    The trainer calls ``set_step(model, step)`` at the start of every optimizer step; this wraps that
    call: it ends the previous diagnosed step (its backward pass is over by then; the weights the
    forward pass used were copied) and begins the next one when ``step % every == 0``. The wrapper
    is installed only while one run trains and only when ``every > 0``.
    """

    def __init__(self, set_step_fn, out_dir: Path, every: int):
        self.orig, self.out, self.every = set_step_fn, out_dir, every
        self.diag = None
        self.active: int | None = None
        self.rows = 0

    def __call__(self, model, step):
        self.orig(model, step)
        if self.diag is None:
            from .diagnostics import Diagnostics
            self.diag = Diagnostics(model, self.out, self.every)
        self.finish()
        if self.diag.wants(step):
            self.diag.begin(step)
            self.active = step

    def finish(self):
        if self.diag is not None and self.active is not None:
            self.rows += len(self.diag.end(self.active))
            self.active = None


def train_one(spec: StudySpec, arm: str, seed: int, run_dir: Path) -> None:
    """Train one run with the ordinary trainer into ``run_dir`` (diagnostics attached if asked)."""
    from ..train import trainer as TR

    cfg = build_config(spec, arm, seed, run_dir)
    if spec.diagnose_every and cfg.train.cuda_graphs:
        raise UserError("diagnostics (--diagnose-every) read each step's operands in Python, which a CUDA graph "
                        "replay skips: turn train.cuda_graphs off for a diagnosed study")
    if not spec.diagnose_every:
        TR.train(cfg)
        return
    cfg.train.compile = "off"   # diagnostics hook every MX layer on sampled steps, in Python
    tap = _DiagnosticsTap(TR.set_step, run_dir, spec.diagnose_every)
    TR.set_step = tap
    try:
        TR.train(cfg)
    finally:
        TR.set_step = tap.orig
        tap.finish()
        if tap.diag is not None:
            tap.diag.close()
    if tap.rows == 0 and R.get(arm).quantized:
        print(f"warning: no diagnostics were recorded for {arm} seed {seed} (trainer hook not reached)",
              file=sys.stderr)


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
    try:
        from ..train import NonFiniteLoss
        if isinstance(e, NonFiniteLoss):
            return True
    except ImportError:
        pass
    if isinstance(e, UserError):
        return False
    msg = str(e).lower()
    return any(w in msg for w in ("non-finite", "nonfinite", "not finite", "nan", "diverg", "inf loss"))


def run_study(spec: StudySpec, train_fn: Callable[[StudySpec, str, int, Path], None] | None = None,
              log=print, jobs: int = 1) -> Path:
    """Run (or resume) every arm x seed, then write summary.json and the report. Returns OUT.

    ``jobs`` > 1 trains that many runs at once in worker processes (``python -m mxtrain.study.worker``),
    spread round-robin over the visible GPUs when the study runs on CUDA (several small runs share
    one GPU well: each alone leaves it mostly idle). Every run still trains exactly as alone.
    """
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    out = Path(spec.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write_test").write_text("")
        (out / ".write_test").unlink()
    except OSError as e:
        raise UserError(f"cannot write to study folder {out}: {e.strerror or e}") from None
    meta_p = out / "study.json"
    if meta_p.is_file():
        old = json.loads(meta_p.read_text())
        if old.get("plan_key") != json.loads(json.dumps(spec.plan_key())):
            raise UserError(f"{out} holds a study with a different base config ({old.get('plan_key')}); "
                            f"use another --out, or the same settings to resume it")
    recipes = {a: R.get(a).to_dict() for a in spec.arms}
    meta = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "spec": asdict(spec),
            "plan_key": spec.plan_key(), "baseline": spec.baseline, "arms": spec.arms, "seeds": list(range(spec.seeds)),
            "recipes": recipes, "smooth_k": spec.smooth_k, "target_frac": spec.target_frac,
            "target_loss": spec.target_loss, "command": " ".join(sys.argv)}
    if meta_p.is_file():
        meta["created"] = json.loads(meta_p.read_text()).get("created", meta["created"])
    meta_p.write_text(json.dumps(meta, indent=1, default=str))

    order = plan_order(spec)
    t0 = time.time()
    if jobs > 1 and train_fn is None:
        _run_workers(spec, out, jobs, log)
    else:
        for i, (arm, seed) in enumerate(order, 1):
            run_one(spec, arm, seed, f"[{i}/{len(order)}]", train_fn or train_one, log)
    log(f"all runs finished ({time.time() - t0:.0f} s this session)")
    summarize_study(out)
    return out


def plan_order(spec: StudySpec) -> list[tuple[str, int]]:
    """Seed-major order: after the first pass over seed 0 every arm has a result to compare."""
    return [(a, s) for s in range(spec.seeds) for a in spec.arms]


def run_one(spec: StudySpec, arm: str, seed: int, tag: str, train_fn, log=print) -> None:
    """Train one arm x seed unless its folder says it finished; record done | diverged."""
    rd = Path(spec.out) / "runs" / arm / f"seed{seed}"
    st = _status(rd)
    if st is not None:
        log(f"{tag} {arm} seed {seed}: {st.get('state')} already, skipped")
        return
    if rd.exists():
        log(f"{tag} {arm} seed {seed}: unfinished run folder, training it again")
        shutil.rmtree(rd)
    rd.parent.mkdir(parents=True, exist_ok=True)
    log(f"{tag} {arm} seed {seed} -> {rd}")
    ts = time.time()
    state, msg = "done", None
    try:
        train_fn(spec, arm, seed, rd)
    except Exception as e:  # a diverged run is a result, anything else is an error
        if not _is_divergence(e):
            raise
        state, msg = "diverged", str(e)
        log(f"    diverged: {msg}")
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "study_status.json").write_text(json.dumps(
        {"state": state, "message": msg, "seconds": round(time.time() - ts, 1), "arm": arm, "seed": seed}))
    log(f"{tag} {arm} seed {seed}: {state} in {time.time() - ts:.0f} s")


def _run_workers(spec: StudySpec, out: Path, jobs: int, log) -> None:
    """Start ``jobs`` worker processes over the pending runs and wait for all of them."""
    import os
    import subprocess

    pending = [(a, s) for a, s in plan_order(spec) if _status(out / "runs" / a / f"seed{s}") is None]
    if not pending:
        log("every run of this study has finished already")
        return
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
    shutil.rmtree(out / "claims", ignore_errors=True)  # claims of an interrupted earlier session
    procs = []
    for k in range(jobs):
        env = dict(os.environ)
        if len(gpus) > 1:
            env["CUDA_VISIBLE_DEVICES"] = gpus[k % len(gpus)]
        if dev.startswith("cpu") or not gpus:
            # share the cores instead of oversubscribing them
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
        lf = open(out / f"worker{k}.log", "w")
        procs.append((k, lf, subprocess.Popen([sys.executable, "-m", "mxtrain.study.worker", str(out), str(k),
                                               str(jobs)], env=env, stdout=lf, stderr=subprocess.STDOUT)))
    failed = []
    for k, lf, p in procs:
        rc = p.wait()
        lf.close()
        if rc != 0:
            failed.append(k)
    shutil.rmtree(out / "claims", ignore_errors=True)
    if failed:
        tail = (out / f"worker{failed[0]}.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise UserError(f"study worker(s) {', '.join(map(str, failed))} failed (see {out}/worker{failed[0]}.log: "
                        f"{tail[0][:200]}); rerun the same command to resume")


def summarize_study(out: str | Path) -> dict:
    """Recompute ``summary.json`` and the report from the run folders."""
    from .report import write_report

    out = Path(out)
    meta = json.loads((out / "study.json").read_text())
    runs = M.load_study_runs(out)
    arms = [a for a in meta["arms"] if a in runs] + sorted(a for a in runs if a not in meta["arms"])
    runs = {a: runs[a] for a in arms}  # arms of earlier invocations with other --arms are kept
    recipes = dict(meta.get("recipes") or {})
    for a in arms:
        if a not in recipes and a in R.names():
            recipes[a] = R.get(a).to_dict()
    summary = M.summarize(runs, meta["baseline"], target_loss=meta.get("target_loss"),
                          target_frac=meta.get("target_frac", 0.8), smooth_k=meta.get("smooth_k", 3),
                          recipes=recipes)
    summary = M.sanitize(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, allow_nan=False))
    write_report(out, summary)
    return summary
