"""A run folder: which folder a run trains in (a new one, or the one it resumes), its lock, ``run.json`` (every
leg of the run, the settings) and the typed outcome recorded in it.

Rank 0 decides the folder and locks it (``RUN/.lock``, ``mxtrain._io.FolderLock``); every rank acts on its
answer. JSON files are written whole (``mxtrain._io.write_json``)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import parallel as D
from .._io import FolderLock, pid_alive, write_json
from ..errors import UserError
from . import checkpoint as ckpt
from .callbacks import Outcome
from .config import TrainConfig


def _git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if sha.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _run_lock(out: Path) -> FolderLock:
    """An exclusive lock on a run folder while a run trains in it (``RUN/.lock``, which holds the owner's pid;
    the system drops the lock when the process ends, however it ends)."""
    return FolderLock(out, lambda who: f"output folder {out} is in use by another mxtrain run"
                      f"{f' (pid {who})' if who else ''}; wait for it to finish or choose another --out")


def _clean_stale(out: Path) -> None:
    """Temporary files of processes that died in this folder (checkpoint writes, write tests): removed once
    the folder is locked (no live run can be writing them)."""
    for p in list(out.glob(".*.tmp-*")) + list(out.glob(".write-test-*")):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            try:
                p.unlink()
            except OSError:
                pass


_NO_CHECKPOINT = "the metrics of a run that wrote no checkpoint"


def _holds_run(out: Path) -> str | None:
    """What makes ``out`` a run folder (a checkpoint, or metrics of a run that wrote none), or None."""
    if ckpt.holds_checkpoint(out):
        return "a checkpoint"
    if (out / "metrics.jsonl").exists():
        return _NO_CHECKPOINT
    return None


def _new_default_folder(out: Path) -> Path:
    """A new folder for a run given no ``--out``: ``out`` (named by the second the run started), or ``out-2``,
    ``out-3``, ... when a run started in the same second (say another seed) has taken it. ``mkdir`` without
    ``exist_ok`` is atomic, so two runs never get one folder, nor is the second refused a folder it never chose."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, 1000):
        p = out if i == 1 else out.with_name(f"{out.name}-{i}")
        try:
            p.mkdir()
            return p
        except FileExistsError:
            continue
    raise UserError(f"no free run folder named like {out}; give one with --out")


def _refuse_rewind(src: Path, out: Path, step: int) -> None:
    """Resuming from a kept checkpoint (``checkpoint-<step>.pt``, ``.dcp``), or from an older one than the run's
    newest (``checkpoint.latest``), into its own run folder would overwrite the run's later checkpoint and
    metrics: refused, with the ways that keep them."""
    if out.resolve() != src.parent.resolve():
        return
    latest = ckpt.latest(out)
    if latest is None or latest.resolve() == src.resolve():
        return
    try:
        later = ckpt.step_of(latest)
    except UserError:   # unreadable: not a later state of the run
        return
    if later <= step:
        return
    what = "a checkpoint kept" if src.name.startswith("checkpoint-") else "an older checkpoint"
    raise UserError(f"{src} is {what} at step {step} of the run in {out}, which has a later one "
                    f"({latest.name}, step {later}): resuming into {out} would overwrite the run after step {step}; "
                    f"continue from it into another folder (--out NEW), or branch it (--resume {out} --branch-at "
                    f"{step} ...)")


def _make_out(cfg: TrainConfig, resume_dir: Path | None, rank: int, locks: list) -> Path:
    """The run folder, created and (rank 0) locked. A new run refuses a folder that holds a run; a resumed run
    refuses one that holds another run than the one it continues. Rank 0 decides, before it writes anything,
    and every rank acts on its answer (a rank that looked later would find rank 0's first files)."""
    default = not cfg.log.out
    out = Path(cfg.log.out) if cfg.log.out else Path("runs") / f"{cfg.exp}-{cfg.recipe_name()}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        verdict = None
        if rank == 0:
            try:
                if default:   # rank 0 names it for all ranks (their clocks may be a second apart)
                    out = _new_default_folder(out)
                if out.exists() and not out.is_dir():
                    raise UserError(f"output folder {out} exists and is not a folder")
                out.mkdir(parents=True, exist_ok=True)
                locks.append(_run_lock(out))
                _clean_stale(out)
                what = _holds_run(out)
                same = resume_dir is not None and out.resolve() == resume_dir.resolve()
                if what == _NO_CHECKPOINT and resume_dir is None:
                    raise UserError(f"output folder {out} already holds a run that stopped before its first "
                                    f"checkpoint (its metrics, no checkpoint.pt): there is nothing to resume; "
                                    f"train into another --out, or remove {out} and train again")
                if what and resume_dir is None:
                    raise UserError(f"output folder {out} already holds a run ({what}); use --resume {out} or "
                                    "another --out")
                if what and not same:
                    raise UserError(f"output folder {out} holds another run ({what}) than the one resumed from "
                                    f"{resume_dir}; resume into {resume_dir} (leave --out out) or choose an empty --out")
            except UserError as e:
                verdict = str(e)
            except OSError as e:
                verdict = f"cannot write to output folder {out}: {e.strerror or e}"
            except Exception as e:  # noqa: BLE001 - the other ranks wait for this answer: never leave them waiting
                verdict = f"cannot use output folder {out}: {type(e).__name__}: {e}"
        verdict, out = D.from_rank0((verdict, str(out)))
        out = Path(out)
        if verdict is not None:
            raise UserError(verdict)
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except UserError:
        raise
    except OSError as e:
        raise UserError(f"cannot write to output folder {out}: {e.strerror or e}") from None
    return out


def _write_json(path: Path, obj) -> None:
    """A run folder's JSON file, written whole (``_io.write_json``): indented, ending in a newline."""
    write_json(path, obj, end="\n", indent=2, default=str, allow_nan=False)


def write_run_json(out: Path, info: dict, resumed: bool) -> None:
    """``RUN/run.json``: ``info`` (versions, device, data, settings). Every leg of a resumed run keeps its record:
    the earlier legs go under ``"legs"``, oldest first."""
    legs = []
    if resumed and (out / "run.json").exists():
        try:
            prev = json.loads((out / "run.json").read_text())
            legs = prev.pop("legs", []) + [prev] if isinstance(prev, dict) else []
        except (OSError, json.JSONDecodeError):
            legs = []
    if legs:
        info["legs"] = legs
    _write_json(out / "run.json", info)


def _record_outcome(out: Path, outcome: Outcome, quiet: bool) -> None:
    """``outcome`` into ``out/run.json`` (replaced whole). When the run is already ending with an error
    (``quiet``), a failure to write is a warning, so that the run's own error is the one raised."""
    p = out / "run.json"
    try:
        info = json.loads(p.read_text()) if p.exists() else {}
        info["outcome"] = outcome.to_dict()
        write_json(p, info, end="\n", indent=2, default=str, allow_nan=False, user_error=False)
    except (OSError, ValueError, UserError) as e:
        if not quiet:
            if isinstance(e, OSError):
                e = f"{e.strerror or e}" + ("; the previous one is intact" if p.exists() else "")
            raise UserError(f"cannot record the outcome in {p}: {e}") from None
        if isinstance(e, OSError) and e.errno in _FULL:
            return   # the disk that stopped the run: its own error says so, in the command's one line
        print(f"mxtrain: warning: cannot record the outcome ({outcome.status.value}) in {p}: "
              f"{e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)   # a full disk or quota, the file size limit
