"""``mxtrain study``: ``run_study`` runs (or resumes) every arm x seed of a plan (``mxtrain.study.plan``),
one run at a time in this process (``mxtrain.study.run``) or in a pool of worker processes
(``--jobs``, ``mxtrain.study.worker``), then writes the summary and the report (``mxtrain.study.summary``).

Ownership: a study folder has one owner at a time, the process holding an exclusive ``flock`` on
``OUT/.lock`` (which holds its pid) for the whole study; its worker processes inherit the locked file, so
the lock lasts until the owner and every worker have ended. A second ``mxtrain study`` on the folder is
refused meanwhile. Workers die with their parent (``PR_SET_PDEATHSIG`` on Linux), and the parent stops
and waits for its workers on SIGINT, SIGTERM or any error.

Imports marked ``# startup`` sit in the functions that use them: ``mxtrain.train`` (and the report)
load on first use, not when ``mxtrain report`` or ``mxtrain study --dry-run`` imports this module.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .._child import python_command
from .._io import FolderLock, pid_alive, write_json
from ..errors import UserError, read_json_object
from ..numerics import recipes as R
from . import arms as A
from .plan import (StudySpec, build_config, data_fingerprint, plan_differences, resume_refusal,
                   study_branch_plan)
from .run import (StudyInterrupted, _finished, _is_interrupt, _status, branches_pending, parse_only_seeds, run_one,
                  train_one, work_order)
from .summary import summarize_study

__all__ = ["run_study"]


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
              log=print, jobs: int = 1, branch_fn=None, start_by: float | None = None,
              only_seeds: list[int] | None = None) -> Path:
    """Run (or resume) every arm x seed, then write summary.json and the report. Returns OUT.

    ``jobs`` > 1 trains that many runs at once in worker processes (``python -m mxtrain.study.worker``),
    spread round-robin over the visible GPUs when the study runs on CUDA (several small runs share
    one GPU well: each alone leaves it mostly idle). Every run still trains exactly as alone.
    ``start_by`` (a ``time.time()`` value): no run starts after it (``run_one``). ``only_seeds``: this session
    trains those seeds' work only (``work_order``); the plan keeps every seed.
    """
    if jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {jobs}")
    if only_seeds is not None:
        only_seeds = parse_only_seeds(",".join(map(str, only_seeds)), spec.seeds)
    spec.check_branch_options()
    out = Path(spec.out)
    from ..train.callbacks import require_wandb, wandb_project  # startup
    from ..train.config import validate  # startup
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
            _run_study_locked(spec, out, train_fn, log, jobs, lock, branch_fn, start_by, only_seeds)
    finally:
        lock.close()
    return out


def _run_study_locked(spec: StudySpec, out: Path, train_fn, log, jobs: int, lock: FolderLock, branch_fn=None,
                      start_by: float | None = None, only_seeds: list[int] | None = None) -> None:
    try:
        (out / ".write_test").write_text("")
        (out / ".write_test").unlink()
    except OSError as e:
        raise UserError(f"cannot write to study folder {out}: {e.strerror or e}") from None
    meta_p = out / "study.json"
    data_fp = data_fingerprint(spec)
    old = read_json_object(meta_p) if meta_p.is_file() else None
    why = resume_refusal(old, spec, data_fp) if old is not None else None
    if why == "config":
        raise UserError(f"{out} holds a study with a different base config ({plan_differences(old, spec)}); use "
                        f"another --out, or the same settings to resume it")
    if why == "data":
        raise UserError(f"{out} holds runs trained on other data than {spec.data} (its prepared folder's "
                        f"fingerprint was {old['data_fingerprint']}, now {data_fp}): resumed, its runs would not "
                        f"pair by seed. Give the folder the study was trained on (the same text prepared with the "
                        f"same options gives the same fingerprint), or another --out")
    recipes = {a: R.get(A.recipe_of(a)).to_dict() for a in spec.arms}
    meta = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "spec": asdict(spec),
            "plan_key": spec.plan_key(), "baseline": spec.baseline, "references": spec.references,
            "arms": spec.arms, "seeds": list(range(spec.seeds)),
            "recipes": recipes, "arm_options": {a: A.overrides_of(a) for a in spec.arms if A.overrides_of(a)},
            "smooth_k": spec.smooth_k, "target_frac": spec.target_frac,
            "target_loss": spec.target_loss, "command": " ".join(sys.argv)}
    if data_fp:
        meta["data_fingerprint"] = data_fp
    if spec.budgets:
        meta["cooldown"] = {"budgets": spec.budgets, "cooldown": spec.cooldown, "shape": spec.cooldown_shape,
                            "n_boot": spec.n_boot, "fit": spec.fit,
                            "branches": [{"budget": b, "at_step": k, "cooldown_steps": n}
                                         for b, k, n in study_branch_plan(spec)]}
    if old is not None:
        _keep_records(old, meta)
    write_json(meta_p, meta, indent=1, default=str)

    order = work_order(spec, out, only_seeds)
    if only_seeds is not None:
        log(f"--only-seeds {','.join(map(str, only_seeds))}: the other seeds' runs and branches wait for a later "
            f"session")
    t0 = time.time()
    worker_error = None
    try:
        if jobs > 1 and train_fn is None:
            worker_error = _run_workers(spec, out, jobs, log, lock, start_by, only_seeds)
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


def _run_workers(spec: StudySpec, out: Path, jobs: int, log, lock: FolderLock | None = None,
                 start_by: float | None = None, only_seeds: list[int] | None = None) -> str | None:
    """Start ``jobs`` worker processes over the pending runs and wait for all of them.

    Returns None, or a message naming the workers that exited with an error. The workers are always
    stopped and waited for before this returns or raises (SIGINT/SIGTERM to this process, an error here);
    each also dies with this process if it is killed (``PR_SET_PDEATHSIG``, set by the worker)."""
    pending = [(a, s) for a, s in work_order(spec, out, only_seeds)
               if not _finished(_status(out / "runs" / a / f"seed{s}")) or branches_pending(spec, out, a, s)]
    if not pending:
        log("every run of this study has finished already")
        return None
    jobs = min(jobs, len(pending))
    gpus: list[str] = []
    dev = spec.device or ""
    if not dev.startswith("cpu"):
        try:
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
            if only_seeds is not None:
                env["MXTRAIN_STUDY_ONLY_SEEDS"] = ",".join(map(str, only_seeds))
            else:
                env.pop("MXTRAIN_STUDY_ONLY_SEEDS", None)
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
