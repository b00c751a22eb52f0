"""One run of a study and its cooldown branches (``run_one``, ``run_branches``), and the status of a run
folder (``study_status.json``). The plan: ``mxtrain.study.plan``; the study around the runs:
``mxtrain.study.workers``.

A run whose ``study_status.json`` says done or diverged is finished and skipped; a run folder without
one was interrupted, and one that says ``failed`` (an error other than divergence), is trained again from
scratch (its folder is replaced). A summary that lacks a planned run lists it under ``missing``, and
``mxtrain study`` then exits 1 (``StudyIncomplete``, ``incomplete_message``).

Imports marked ``# startup`` sit in the functions that use them: ``mxtrain.train`` (and the report)
load on first use, not when ``mxtrain report`` or ``mxtrain study --dry-run`` imports this module.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from .._io import lock_holder, write_json, write_text
from ..errors import UserError, read_json_object
from ..numerics import recipes as R
from . import arms as A
from .plan import (StudySpec, branch_folder, branch_plan, build_config, data_fingerprint, plan_differences, plan_order,
                   resume_refusal, run_steps, study_branch_plan)

__all__ = ["FINISHED_STATES", "StudyIncomplete", "StudyInterrupted", "compute_plan", "describe_compute",
           "train_one", "train_branch", "run_one", "run_branches", "remake_checkpoints", "branches_pending",
           "work_order", "parse_only_seeds", "claim_path", "is_out_of_memory", "ran_out_of_memory",
           "incomplete_message"]


FINISHED_STATES = ("done", "diverged")   # study_status.json states of a finished run (skipped on resume)


class StudyIncomplete(UserError):
    """The study ended but its summary lacks planned runs (failed, interrupted or never trained)."""
    exit_code = 1


class StudyInterrupted(UserError):
    """SIGINT or SIGTERM stopped the study (its workers were stopped first)."""

    def __init__(self, msg: str, signum: int):
        super().__init__(msg)
        self.exit_code = 128 + signum


def compute_plan(spec: StudySpec, tokens_per_s: float | None = None) -> dict:
    """What a study will train, counted before it runs (``mxtrain study --dry-run``): the model's parameters
    (all, and without the embedding table), tokens per run at the full budget and per parameter, the steps and
    tokens of every run and cooldown branch together, the evaluation tokens (forward only), the passes over the
    training split; with ``tokens_per_s`` (training tokens a second of the whole machine, all jobs together,
    measured on it) the hours it needs, counting an evaluated token as a third of a trained one. Parameters
    "without the embedding" leave out the embedding table and the output head."""
    from ..train.trainer import _model_config  # startup
    cfg = build_config(StudySpec(**{**asdict(spec), "budgets": None}), spec.arms[0], 0, Path(spec.out) / "plan")
    vocab, train_tokens = cfg.data.vocab_size, None
    meta = Path(cfg.data.path) / "meta.json" if cfg.data.path else None
    if meta is not None and meta.is_file():
        m = read_json_object(meta)
        vocab, train_tokens = m.get("vocab_size", vocab), m.get("train_tokens")
    if cfg.train.init_from:   # the runs train the folder's model, whatever size the study's base names
        from ..model import hf_io  # startup
        mcfg = hf_io.config_from_hf(cfg.train.init_from, vocab_multiple=32, max_seq_len=cfg.data.seq_len)
    else:
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
    # an existing study folder (a study resumed, or seeded from an earlier allocation's archive): what is finished,
    # stable run and every branch, is not trained again
    done, meta_p = 0, Path(spec.out) / "study.json"
    out["folder_mismatch"] = False
    if meta_p.is_file():
        try:
            old = read_json_object(meta_p)
        except UserError:   # (a damaged study.json: the dry run says the folder is another plan's)
            old = {}
        why = resume_refusal(old, spec, data_fingerprint(spec))
        out["folder_mismatch"] = why is not None
        if why == "config":
            out["folder_differs"] = plan_differences(old, spec)
        elif why == "data":
            out["folder_differs"] = (f"the data: the folder's runs trained on data of fingerprint "
                                     f"{old.get('data_fingerprint')}, --data has {data_fingerprint(spec)}")
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
    if not math.isfinite(out["tokens_per_param"]):
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
                     "(use another --out, or that study's settings)"
                     + (f"; it differs in {c['folder_differs']}" if c.get("folder_differs") else ""))
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


# ----------------------------------------------------------------------------------------------
# training one run


def train_branch(spec: StudySpec, arm: str, seed: int, run_dir: Path, budget: float, k: int, n: int, bdir: Path):
    """Train one cooldown branch of the stable run ``run_dir`` (``mxtrain.train.branch_fit``); returns its
    typed ``Outcome``. A branch folder with its own checkpoint resumes from it."""
    from ..train.branch import _run_config, branch_fit  # startup
    cfg = None
    extra = A.branch_overrides_of(arm, k)   # an arm whose branches differ from its stable run (@bf16cool)
    if extra:
        from ..train.config import apply_overrides  # startup
        cfg = _run_config(Path(run_dir))
        apply_overrides(cfg, extra)
    return branch_fit(run_dir, k, n, bdir, shape=spec.cooldown_shape, cfg=cfg, log=lambda m: None)


def train_one(spec: StudySpec, arm: str, seed: int, run_dir: Path, resume: Path | None = None):
    """Train one run with the ordinary trainer into ``run_dir``; returns its typed ``Outcome`` (completed or
    diverged; an interrupted or failed run raises). ``resume``: continue the interrupted run in ``run_dir``
    from its checkpoint. Callbacks: per-GEMM diagnostics when ``diagnose_every`` is set, and a W&B logger (run
    ``<arm>-seed<k>``, grouped by study) when ``log.wandb`` is on."""
    from ..train import trainer as TR  # startup
    from ..train.callbacks import WandbLogger, wandb_project  # startup

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
        from .diagnostics import DiagnosticsCallback  # startup
        cfg.train.compile = "off"   # diagnostics hook every MX layer on sampled steps, in Python
        diag = DiagnosticsCallback(spec.diagnose_every)
        callbacks.append(diag)
    outcome = TR.fit(cfg, resume=resume, callbacks=callbacks)
    if diag is not None and diag.rows == 0 and outcome.completed and R.get(A.recipe_of(arm)).quantized:
        print(f"warning: no diagnostics were recorded for {arm} seed {seed} (no diagnosed step ran)",
              file=sys.stderr)
    return outcome


# ----------------------------------------------------------------------------------------------
# status of a run folder


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
    from ..train import NonFiniteLoss  # startup
    return isinstance(e, (NonFiniteLoss, FloatingPointError))


def _is_interrupt(e: BaseException) -> bool:
    """A signal stopped the run (the trainer's ``Interrupted``, or an exception whose typed outcome says
    interrupted) or the study: never a result of the run."""
    if isinstance(e, StudyInterrupted):
        return True
    oc = getattr(e, "outcome", None)
    if getattr(oc, "status", None) is not None and getattr(oc.status, "value", None) == "interrupted":
        return True
    from ..train import Interrupted  # startup
    return isinstance(e, Interrupted)


def _outcome_of(e: BaseException, rd: Path):
    """The typed outcome of a run that raised ``e``: the exception's own (the trainer attaches it as
    ``e.outcome``), else the one the trainer recorded in ``rd/run.json``, else by the exception's type
    (``_is_divergence``): diverged or failed."""
    from ..train.callbacks import Outcome, Status, read_outcome  # startup

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
    from ..train import checkpoint as ckpt  # startup
    from ..train.callbacks import Status, read_outcome  # startup
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


def branches_pending(spec: StudySpec, out: Path, arm: str, seed: int) -> bool:
    """Does a done stable run of a cooldown study still lack a finished branch?"""
    if not spec.budgets:
        return False
    rd = out / "runs" / arm / f"seed{seed}"
    st = _status(rd)
    if not (st and st.get("state") == "done"):
        return False
    return any(not _finished(_status(branch_folder(rd, k, n))) for _, k, n in study_branch_plan(spec))


def parse_only_seeds(text: str | None, seeds: int) -> list[int] | None:
    """``--only-seeds``: comma-separated seeds of a plan of ``seeds`` seeds (0 to seeds - 1), sorted, each once;
    None when not given. UserError naming the bad entry otherwise."""
    if text is None:
        return None
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= seeds:
            raise UserError(f"--only-seeds {text}: {part!r} is not a seed of this plan; give seeds from 0 to "
                            f"{seeds - 1} (--seeds {seeds}), comma-separated, e.g. --only-seeds {seeds - 1}")
        out.append(int(part))
    return sorted(set(out))


def work_order(spec: StudySpec, out: Path, only_seeds: list[int] | None = None) -> list[tuple[str, int]]:
    """``plan_order`` for a session over study folder ``out``: the same order, except that the arm x seeds whose
    next work is a remake (``remake_checkpoints``: a finished stable run trained again, because the checkpoints its
    pending branches need are gone, as in a study carried to another machine) come last. A remake costs a whole
    stable run to make branches a run trained earlier could have made, so within a time-limited session every run
    not yet trained goes first: listing ``mxfp4-all@bf16cool`` beside the arm whose seed 4 is still to train no
    longer spends the session remaking seeds 0-3 first. Stable otherwise (seed-major, as ``plan_order``).
    ``only_seeds`` (``--only-seeds``): this session's seeds; the others' work is left out."""
    order = [(a, s) for a, s in plan_order(spec) if only_seeds is None or s in only_seeds]
    late = {(a, s) for a, s in order if _needs_remake(spec, out, a, s)}
    return [x for x in order if x not in late] + [x for x in order if x in late]


def _needs_remake(spec: StudySpec, out: Path, arm: str, seed: int) -> bool:
    """Would ``run_one`` start this arm x seed by remaking a stable run? True for a done run whose pending branches'
    checkpoints are gone, and for an arm sharing a done stable run of its base arm (``arms.stable_base``, e.g.
    ``@bf16cool``) that lacks the checkpoint of one of this arm's pending branches."""
    if not spec.budgets:
        return False
    from ..train.branch import kept_checkpoint  # startup
    rd = out / "runs" / arm / f"seed{seed}"
    st = _status(rd)
    if _finished(st):
        return st.get("state") == "done" and bool(_gone_checkpoints(spec, rd))
    base = A.stable_base(arm)
    if base is None or base not in spec.arms:
        return False
    bd = out / "runs" / base / f"seed{seed}"
    bst = _status(bd)
    if not (bst and bst.get("state") == "done" and (bd / "run.json").is_file()):
        return False   # (its base is still to train: this session makes the checkpoints)
    for _, k, n in study_branch_plan(spec):
        if _finished(_status(branch_folder(rd, k, n))):
            continue
        try:
            kept_checkpoint(bd, k)
        except UserError:
            return True
    return False


def _run_folder_owner(rd: Path) -> str | None:
    """Who holds the trainer's lock on run folder ``rd`` (``RUN/.lock``), or None when nobody does."""
    who = lock_holder(rd / ".lock")
    return None if who is None else f"pid {who}" if who else "unknown pid"


def incomplete_message(summary: dict, limit: int = 8) -> str | None:
    """``study incomplete: N of M planned runs[ and B of P cooldown branches of finished runs] missing: ...`` for a
    summary that lacks planned runs or cooldown branches (entries of ``missing`` with a ``budget``), else None. Runs
    and branches are counted apart: a run not trained leaves its branches untrained too, which are not counted
    again."""
    miss = summary.get("missing") or []
    if not miss:
        return None
    n_br = sum(1 for m in miss if m.get("budget") is not None)
    counts = f"{len(miss) - n_br} of {summary.get('planned_runs', '?')} planned runs"
    if n_br:
        counts += f" and {n_br} of {summary.get('planned_branches', '?')} cooldown branches of finished runs"
    items = [f"{m['arm']} seed {m['seed']}" + (f" budget {m['budget']:g}" if m.get("budget") is not None else "")
             + f" ({m['state'].replace('_', ' ')}" + (f": {m['reason'][:160]}" if m.get("reason") else "") + ")"
             for m in miss[:limit]]
    more = f", and {len(miss) - limit} more" if len(miss) > limit else ""
    n_oom = sum(1 for m in miss if m.get("oom"))
    oom = (f"; {n_oom} of them ran out of GPU memory: train fewer runs at once (a smaller --jobs; runs sharing "
           f"a GPU each need their own memory)" if n_oom else "")
    return (f"study incomplete: {counts} missing: "
            f"{', '.join(items)}{more}{oom}")


# ----------------------------------------------------------------------------------------------
# running one run and its branches


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
    late = _past(start_by)
    # an arm that differs only in its branches (@bf16cool) shares its base arm's stable run; past --start-by only
    # where that run is done or in training now (its branches then train as any branch whose checkpoint is at hand)
    if (not late or _base_at_hand(spec, arm, seed)) and _share_stable_run(spec, arm, seed, rd, tag, log):
        if spec.budgets:
            run_branches(spec, arm, seed, tag, branch_fn or train_branch, log, remake_fn=train_fn, start_by=start_by)
        return
    if late:
        log(f"{tag} {arm} seed {seed}: not started (past --start-by)")
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


def _base_at_hand(spec: StudySpec, arm: str, seed: int) -> bool:
    """Is the stable run this arm shares (``arms.stable_base``) done, or being trained by a worker now?"""
    base = A.stable_base(arm)
    if base is None or base not in spec.arms:
        return False
    brd = Path(spec.out) / "runs" / base / f"seed{seed}"
    st = _status(brd)
    return (st is not None and st.get("state") == "done") or (st is None and _run_folder_owner(brd) is not None)


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
    write_json(tmp / "study_status.json", {**st, "arm": arm, "shared_from": base})
    os.replace(tmp, rd)
    log(f"{tag} {arm} seed {seed}: the stable run of {base} seed {seed}, shared (its options change only the "
        f"cooldown branches)")
    return True


def _run_and_record(call, folder: Path, interrupted: str, fields: dict, log) -> str:
    """Run ``call`` (a run or a branch training into ``folder``) and record its state in
    ``folder/study_status.json`` (done | diverged | failed, with ``fields``; a failure's traceback in
    ``study_error.txt``); the state is the trainer's typed outcome. An interrupted run stops the study
    (``interrupted``: the message, ``{}`` for the reason)."""
    from ..train.callbacks import Outcome, Status, read_outcome  # startup
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
        write_text(folder / "study_error.txt", tb)
    write_json(folder / "study_status.json",
               {"state": state, "message": msg, "step": oc.step, "seconds": round(time.time() - ts, 1), **fields,
                **({"oom": True} if oom and state == "failed" else {})})
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
    from ..train import checkpoint as ckpt  # startup
    from ..train.branch import kept_checkpoint  # startup
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
    difference. On the CPU a remake equals the first run bit for bit (tests/study/test_study_cooldown.py); on a GPU it
    need not unless ``train.deterministic`` is on, since PyTorch's default GPU kernels are not all deterministic
    (which ones moved these runs was not traced): a 30m de-oscillation run remade on the same H100 model
    differed from step 120 on, by up to 0.028 in single logged losses; an H200 run remade on an H100 by up to
    0.25 (docs/results.md). Where the losses differ, a warning says so and the branches start from the remade
    state. A remake stopped by a signal continues from its own checkpoint next time."""
    from ..train.branch import kept_checkpoint  # startup
    from ..train.checkpoint import kept_name  # startup
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
    from ..train.callbacks import Outcome, Status  # startup
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
    write_json(rd / "remake.json", rec, end="\n", indent=1)
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
