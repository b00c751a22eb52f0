"""Trainer callbacks, the typed outcome of a run, and the metric sinks (TensorBoard, Weights & Biases).

A callback is an object with any of the ``Callback`` methods; pass a list of them to
``mxtrain.train.trainer.train(cfg, callbacks=[...])`` (or ``fit``). The trainer calls them, in list order:

* ``on_train_begin(state)`` once, after the run folder, ``config.json`` and ``run.json`` are written and
  before the first step; ``state`` is the ``TrainState`` (config, run folder, model, optimizer, device, rank,
  first and last step). The trainer keeps ``state.step`` (optimizer steps done) and ``state.tokens`` current.
* ``on_step_begin(step)`` before each optimizer step's first forward pass; ``step`` is the number of steps
  done so far (0 for the first step of a fresh run; the step's 0-based index, as ``mxtrain.set_step`` and
  the learning-rate schedule count it).
* ``on_step_end(step, metrics)`` after that step's optimizer update; ``step`` is now the number of steps done
  (so ``on_step_begin(k)`` is followed by ``on_step_end(k + 1, ...)``), ``metrics`` holds this step's
  ``loss``, ``lr``, ``grad_norm`` (before clipping) and ``tokens`` (so far, all ranks). Not called for a step
  whose loss or gradient was not finite: that step made no update, and the run ends there. Reading ``loss`` or
  ``grad_norm`` means waiting for the GPU every step; a callback whose ``on_step_end`` reads neither says so with
  the class attribute ``reads_step_metrics = False``. When every callback does, the trainer checks the step on
  the GPU (``train.check_every_step``, ``mxtrain.train.stepcheck``): ``metrics`` then holds ``lr`` and ``tokens``
  only, and ``on_step_end`` is also called for the non-finite step and the one after it (neither made an update),
  before the run ends one step later.
* ``on_log(step, row)`` for every row written to ``metrics.jsonl`` (training rows every ``log.log_every``
  steps, evaluation rows, events such as a non-finite loss); rank 0 only.
* ``on_eval(step, metrics)`` after each evaluation (``val_loss``, ``val_ppl``, ``tokens``), also for a
  non-finite one, just before the run ends as diverged.
* ``on_checkpoint(step, path)`` after a checkpoint of ``step`` steps was written to ``path``.
* ``on_train_end(outcome)`` once, however the run ends (``Outcome``: completed, diverged, interrupted or
  failed), to every callback whose ``on_train_begin`` was called. After an error, an exception raised here
  is printed as a warning and the run's own error goes on.

A callback with state that must survive a resume (as ``mxtrain.train.deosc.DeoscCallback``'s open window) has a
``state_key`` (a name) and ``state_dict()`` / ``load_state_dict(d)``: every checkpoint holds each such callback's
``state_dict()`` under ``"callbacks"`` / ``state_key``, and a resumed run hands it back to ``load_state_dict``
right after ``on_train_begin`` (not called when the checkpoint has none for that key). On several processes
the checkpoint holds rank 0's state and every rank gets it back.

Every method is called on every rank of a multi-process run (``state.rank`` tells which), except ``on_log``.
An exception raised by a callback (outside ``on_train_end`` after an error) ends the run as failed.

The outcome of every run is recorded in ``RUN/run.json`` under ``"outcome"`` (``{"status", "step", "reason",
"ended"}``) when the run ends; ``read_outcome(RUN)`` reads it back. A run folder whose ``run.json`` has no
outcome is training, or its process was killed (SIGKILL, power loss).
"""

from __future__ import annotations

import enum
import json
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._io import write_text
from ..errors import UserError

__all__ = ["Status", "Outcome", "TrainState", "Callback", "CallbackList", "TensorBoardLogger", "WandbLogger",
           "read_outcome", "wandb_project", "require_wandb", "scalars"]


class Status(str, enum.Enum):
    """How a run ended."""
    COMPLETED = "completed"       # every step ran; the final checkpoint and summary.json are written
    DIVERGED = "diverged"         # a loss, gradient norm, validation loss or weight became NaN or infinite
    INTERRUPTED = "interrupted"   # SIGINT / SIGTERM: checkpoint at the step in progress, resumable
    FAILED = "failed"             # any other error (bad data, full disk, a bug, a callback's exception)


@dataclass(frozen=True)
class Outcome:
    """The typed result of a run. ``step``: optimizer steps done when it ended; for ``diverged`` the step whose
    value was not finite (as the error message and the ``metrics.jsonl`` event row number it). ``reason``: the
    one-line message (None when completed). ``out``: the run folder."""

    status: Status
    step: int | None = None
    reason: str | None = None
    out: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "status", Status(self.status))

    @property
    def completed(self) -> bool:
        return self.status is Status.COMPLETED

    @property
    def diverged(self) -> bool:
        return self.status is Status.DIVERGED

    def to_dict(self) -> dict:
        return {"status": self.status.value, "step": self.step, "reason": self.reason,
                "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    @classmethod
    def from_dict(cls, d: dict, out: str | Path | None = None) -> "Outcome":
        step = d.get("step")
        return cls(Status(d["status"]), int(step) if step is not None else None, d.get("reason"),
                   Path(out) if out is not None else None)


def read_outcome(run_dir: str | Path) -> Outcome | None:
    """The outcome recorded in ``run_dir/run.json`` (the latest leg of a resumed run), or None when the run
    folder has none (no run.json, a run still training or killed, or a run of an mxtrain without outcomes)."""
    p = Path(run_dir) / "run.json"
    try:
        d = json.loads(p.read_text())
        return Outcome.from_dict(d["outcome"], run_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class TrainState:
    """What a callback can see of the run (``on_train_begin``). The trainer updates ``step`` and ``tokens``."""

    cfg: Any                  # the run's TrainConfig (read it; changing it during the run is not supported)
    config: dict              # the config as recorded in config.json
    out: Path                 # the run folder
    model: Any                # the model as trained (wrapped by DDP / FSDP2 on several processes)
    optimizer: Any
    device: Any
    rank: int
    world_size: int
    start_step: int           # steps done before this leg (0 for a fresh run, the checkpoint's step on resume)
    total_steps: int          # the run ends when step reaches this
    step: int = 0             # optimizer steps done
    tokens: int = 0           # tokens trained on so far (all ranks)


class Callback:
    """Base class of trainer callbacks: every method does nothing; override the ones you need."""

    def on_train_begin(self, state: TrainState) -> None:
        pass

    def on_step_begin(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, metrics: dict) -> None:
        pass

    def on_log(self, step: int, row: dict) -> None:
        pass

    def on_eval(self, step: int, metrics: dict) -> None:
        pass

    def on_checkpoint(self, step: int, path: Path) -> None:
        pass

    def on_train_end(self, outcome: Outcome) -> None:
        pass


class CallbackList:
    """Calls each callback in order (a method a callback lacks is skipped: any object with some of
    ``Callback``'s methods will do); ``end`` reaches exactly the callbacks that began, once."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks or ())
        self._begun: list = []
        self._ended = False

    def _call(self, name: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(*args)

    def begin(self, state: TrainState) -> None:
        for cb in self.callbacks:
            self._begun.append(cb)
            fn = getattr(cb, "on_train_begin", None)
            if fn is not None:
                fn(state)

    def step_begin(self, step: int) -> None:
        self._call("on_step_begin", step)

    def step_end(self, step: int, metrics: dict) -> None:
        self._call("on_step_end", step, metrics)

    def log(self, step: int, row: dict) -> None:
        self._call("on_log", step, row)

    def eval(self, step: int, metrics: dict) -> None:
        self._call("on_eval", step, metrics)

    def checkpoint(self, step: int, path: Path) -> None:
        self._call("on_checkpoint", step, path)

    def _stateful(self) -> list:
        return [cb for cb in self.callbacks if getattr(cb, "state_key", None) and hasattr(cb, "state_dict")]

    def state_dicts(self) -> dict:
        """``{state_key: state_dict()}`` of every callback with state (saved in checkpoints)."""
        out: dict = {}
        for cb in self._stateful():
            if cb.state_key in out:
                raise UserError(f"two callbacks keep their state under the same key {cb.state_key!r}")
            out[cb.state_key] = cb.state_dict()
        return out

    def load_state_dicts(self, states: dict | None) -> None:
        """Hand each callback with state its part of a checkpoint's ``states`` (those it has)."""
        for cb in self._stateful():
            if states and cb.state_key in states and hasattr(cb, "load_state_dict"):
                cb.load_state_dict(states[cb.state_key])

    def end(self, outcome: Outcome, quiet: bool = False) -> None:
        """``on_train_end`` to every callback that began. ``quiet`` (the run is ending with an error): an
        exception of a callback is printed as a warning, so that the run's own error is the one raised."""
        if self._ended:
            return
        self._ended = True
        for cb in self._begun:
            fn = getattr(cb, "on_train_end", None)
            if fn is None:
                continue
            try:
                fn(outcome)
            except Exception as e:  # noqa: BLE001 - reported, and the run's own error goes on
                if not quiet:
                    raise
                print(f"mxtrain: warning: callback {type(cb).__name__}.on_train_end failed: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)


def scalars(row: dict) -> dict:
    """The numbers of a ``metrics.jsonl`` row that TensorBoard and W&B plot (all but ``step``, ``tokens`` and a
    checkpoint row's ``world_size``; strings such as an event's name or a non-finite value written as ``"nan"``
    are left out)."""
    return {k: float(v) for k, v in row.items()
            if k not in ("step", "tokens", "world_size") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _after_existing_event_files(log_dir: Path) -> None:
    """Wait (at most a second) until a new event file's name sorts after every one already in ``log_dir``.

    TensorBoard reads a folder's event files in name order, and a name is ``events.out.tfevents.<seconds>.<host>.
    <pid>.<counter>``: a resumed leg started within the same second as an earlier leg's file could sort before it
    (counter 10 before 9, or a smaller pid), and its purge of the steps past the checkpoint would then be read
    first and undone by the earlier file."""
    newest = 0
    for f in log_dir.glob("events.out.tfevents.*"):
        parts = f.name.split(".")
        if len(parts) > 3 and parts[3].isdigit():
            newest = max(newest, int(parts[3]))
    if newest and newest - time.time() < 2:   # a file from the future (a clock moved back): no wait helps
        while int(time.time()) <= newest:
            time.sleep(0.02)


class TensorBoardLogger(Callback):
    """Every ``metrics.jsonl`` row's numbers as TensorBoard scalars (x axis: the step) in ``log_dir``
    (default ``RUN/tb``); rank 0 only. Does nothing when ``tensorboard`` is not installed."""

    def __init__(self, log_dir: str | Path | None = None, flush_secs: int = 10):
        self.log_dir, self.flush_secs = log_dir, flush_secs
        self.writer = None

    def on_train_begin(self, state: TrainState) -> None:
        if state.rank:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional
        except Exception:  # noqa: BLE001 - tensorboard not installed (or broken): no event files
            return
        log_dir = Path(self.log_dir or Path(state.out) / "tb")
        _after_existing_event_files(log_dir)
        # a resumed run: hide events an earlier leg logged past the checkpoint (as metrics.jsonl drops its rows)
        self.writer = SummaryWriter(str(log_dir), flush_secs=self.flush_secs,
                                    purge_step=state.start_step + 1 if state.start_step else None)

    def on_log(self, step: int, row: dict) -> None:
        if self.writer is None:
            return
        for k, v in scalars(row).items():
            self.writer.add_scalar(k, v, step)

    def on_eval(self, step: int, metrics: dict) -> None:
        if self.writer is not None:
            self.writer.flush()   # evaluations are rare and matter most: on disk at once

    def on_train_end(self, outcome: Outcome) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


# ----------------------------------------------------------------------------------------------
# Weights & Biases

DEFAULT_WANDB_PROJECT = "mxtrain"
_OFF = ("", "0", "false", "off", "no", "none")
_ON = ("1", "true", "on", "yes")


def wandb_project(value) -> str | None:
    """The W&B project named by a ``log.wandb`` value, or None when W&B is off. ``False`` / ``None`` / ``"off"``:
    off; ``True`` / ``"on"``: project ``mxtrain``; any other string: that project."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_WANDB_PROJECT
    if isinstance(value, str):
        v = value.strip()
        if v.lower() in _OFF:
            return None
        if v.lower() in _ON:
            return DEFAULT_WANDB_PROJECT
        return v
    raise UserError(f"log.wandb must be true, false or a W&B project name, got {value!r}")


def require_wandb():
    """The ``wandb`` module, or one UserError saying how to install it."""
    try:
        import wandb  # optional
    except ImportError as e:
        if getattr(e, "name", None) == "wandb":
            raise UserError("log.wandb is on but the wandb package is not installed: pip install wandb "
                            "(or turn it off: --set log.wandb=false)") from None
        raise UserError(f"log.wandb is on but wandb could not be imported ({e}); reinstall it: "
                        f"pip install --upgrade wandb") from None
    return wandb


class WandbLogger(Callback):
    """Every ``metrics.jsonl`` row's numbers (the scalars TensorBoard gets) logged to a Weights & Biases run;
    rank 0 only. The W&B run's files go to ``RUN/wandb/``, its id to ``RUN/wandb_id`` so that a resumed run
    continues the same W&B run. ``WANDB_MODE=offline`` (read by wandb itself) logs without any network;
    upload later with ``wandb sync RUN/wandb/offline-run-*``. The wandb module is imported when the logger
    is made (an error saying ``pip install wandb`` if it is missing)."""

    def __init__(self, project: str = DEFAULT_WANDB_PROJECT, name: str | None = None, group: str | None = None):
        self.wandb = require_wandb()
        self.project, self.name, self.group = project, name, group
        self.run = None

    def on_train_begin(self, state: TrainState) -> None:
        if state.rank:
            return
        out = Path(state.out)
        id_file = out / "wandb_id"
        rid = None
        if state.start_step and id_file.is_file():
            rid = id_file.read_text().strip() or None
        if rid is None:
            rid = uuid.uuid4().hex[:12]
            write_text(id_file, rid + "\n")
        try:
            self.run = self.wandb.init(project=self.project, name=self.name or out.name, group=self.group,
                                       id=rid, resume="allow", dir=str(out), config=state.config)
        except Exception as e:  # noqa: BLE001 - wandb's errors vary by version: one clear line
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise UserError(f"could not start the Weights & Biases run ({msg}); log in with `wandb login` (or set "
                            f"WANDB_API_KEY), or log offline with WANDB_MODE=offline") from None

    def on_log(self, step: int, row: dict) -> None:
        if self.run is None:
            return
        vals = scalars(row)
        if vals:
            self.run.log(vals, step=step)

    def on_train_end(self, outcome: Outcome) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            run.summary["outcome"] = outcome.status.value
            if outcome.step is not None:
                run.summary["outcome_step"] = outcome.step
        except Exception:  # noqa: BLE001 - a summary is a nicety; finishing matters
            pass
        run.finish(exit_code=0 if outcome.completed else 1)
