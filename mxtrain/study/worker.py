"""Worker process of ``mxtrain study --jobs N``: ``python -P -m mxtrain.study.worker OUT K N`` (``mxtrain._child``)
trains pending runs of study folder ``OUT`` (plan and settings from ``OUT/study.json``, written by the
parent), taking them in plan order: a worker claims a run by creating ``OUT/claims/<arm>-seed<k>``
(an atomic create, so no two workers train the same run), which balances fast and slow arms. The
parent clears stale claims before it starts the workers (it holds the study lock, ``OUT/.lock``, whose
locked file every worker inherits, so no worker of an earlier session still runs), and writes the
summary after them.

A run that fails by running out of GPU memory (runs sharing one GPU each need their own) makes its worker,
unless it is worker 0, give the run back (its claim removed) and stop, so the remaining workers share the GPU
and one of them trains the run again; a worker makes passes over the plan until it claims nothing.

A worker dies with its parent: on Linux it asks for SIGTERM when the parent ends
(``prctl(PR_SET_PDEATHSIG)``) and exits at once if the parent (``MXTRAIN_STUDY_PARENT``) is already
gone; the parent also stops its workers on SIGINT, SIGTERM and errors."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent() -> bool:
    """Ask the kernel to send SIGTERM when the parent process ends (Linux ``prctl(PR_SET_PDEATHSIG)``;
    a no-op elsewhere). Returns False if the parent named by ``MXTRAIN_STUDY_PARENT`` has already gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: rely on the parent stopping its workers
            pass
    parent = os.environ.get("MXTRAIN_STUDY_PARENT")
    if parent and parent.isdigit() and os.getppid() != int(parent):
        return False  # the parent died before prctl took effect
    return True


def main(argv: list[str] | None = None) -> int:
    if not die_with_parent():
        print("mxtrain: error: the study process that started this worker has ended", file=sys.stderr)
        return 2
    import json
    import threading
    from pathlib import Path

    # a worker whose parent is gone exits before it imports torch, the study and the trainer
    from ..errors import UserError, thread_limit_hook  # startup
    from .plan import StudySpec  # startup
    from .run import claim_path, parse_only_seeds, ran_out_of_memory, run_one, train_one, work_order  # startup

    # a background thread stopped by a full disk (TensorBoard's writer) leaves no traceback in this worker's log:
    # the run's own next write fails and its folder records why
    threading.excepthook, _ = thread_limit_hook([])

    argv = sys.argv[1:] if argv is None else argv
    out, k = Path(argv[0]), int(argv[1])
    meta = json.loads((out / "study.json").read_text())
    spec = StudySpec(**meta["spec"])
    # --only-seeds, set by the parent (which checked it)
    order = work_order(spec, out, parse_only_seeds(os.environ.get("MXTRAIN_STUDY_ONLY_SEEDS"), spec.seeds))
    sb = os.environ.get("MXTRAIN_STUDY_START_BY")
    start_by = float(sb) if sb else None   # --start-by, set by the parent
    claims = out / "claims"
    claims.mkdir(exist_ok=True)
    try:
        claimed = True
        while claimed:  # passes over the plan until nothing is left to claim (runs released by others, below)
            claimed = False
            for i, (arm, seed) in enumerate(order, 1):
                claim = claim_path(out, arm, seed)
                try:
                    os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    continue
                claimed = True
                run_one(spec, arm, seed, f"[{i}/{len(order)}] worker {k}:", train_one,
                        log=lambda m: print(m, flush=True), start_by=start_by)
                if k > 0 and ran_out_of_memory(out / "runs" / arm / f"seed{seed}"):
                    # Workers sharing a GPU ran out of its memory: this one gives its run back (another worker
                    # trains it again when it next looks) and stops, so fewer runs share the GPU. Worker 0
                    # never stops early, so every run is still tried; its own failures stay recorded.
                    claim.unlink(missing_ok=True)
                    print(f"worker {k}: {arm} seed {seed} ran out of GPU memory; giving it back to the other "
                          f"workers and stopping (fewer runs at once)", flush=True)
                    return 0
    except UserError as e:
        print(f"mxtrain: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2) or 2
    except KeyboardInterrupt:
        print("mxtrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
