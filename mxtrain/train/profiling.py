"""What a training step spends its time on, and Python's garbage collector kept in step across ranks.

``log.profile_steps = "A-B"`` records steps A to B (1-based, as in metrics.jsonl) with ``torch.profiler`` on
every rank and writes ``RUN/profile/rank<r>.json.gz`` (a Chrome / Perfetto trace: open it at
https://ui.perfetto.dev) and ``RUN/profile/rank<r>.txt`` (the operators with the most self time on the device
and on the host, and the wall time of each profiled step) and ``RUN/profile/summary-rank<r>.json`` (per step:
wall time, the host's and the device's self time), so a slow multi-GPU step can be read without a
trace viewer: which rank waits, in which collective, for how long.

``train.gc_every = N`` turns Python's automatic garbage collection off while training and collects on every rank
every N steps (torchtitan's ``gc_freq``). An automatic collection pauses one process at a time chosen by its
own allocations; under DDP or FSDP2 every other rank then waits for it in the next collective, so the pauses of
N ranks add up. Collected at the same step on every rank, they overlap instead.
"""

from __future__ import annotations

import gc
import gzip
import shutil
import time
from pathlib import Path

import torch

from .._io import write_json, write_text
from ..errors import UserError

PROFILE_DIR = "profile"


def parse_steps(text: str | None, steps: int) -> tuple[int, int] | None:
    """``"A-B"`` (or ``"A"``) -> (A, B), 1-based and inclusive, checked against ``train.steps``; None: off."""
    if text is None or str(text).strip().lower() in ("", "none", "off", "false"):
        return None
    s = str(text).strip()
    try:
        a, _, b = s.partition("-")
        lo, hi = int(a), int(b) if b else int(a)
    except ValueError:
        raise UserError(f"log.profile_steps must be a step range like 20-25 (1-based, inclusive), got {s!r}") from None
    if lo < 1 or hi < lo:
        raise UserError(f"log.profile_steps: {s!r} is not a range of steps A-B with 1 <= A <= B")
    if hi > steps:
        raise UserError(f"log.profile_steps: step {hi} is past train.steps ({steps})")
    return lo, hi


class StepProfiler:
    """Call ``before(step)`` at the start of 0-based step ``step`` and ``after(step)`` at its end (after the
    optimizer), ``close()`` once the loop ends (also on an error: a started profile is then written as far as it
    got)."""

    def __init__(self, span: tuple[int, int] | None, out: Path, rank: int, device: torch.device):
        self.span, self.out, self.rank, self.device = span, Path(out), rank, device
        self.prof = None
        self.walls: list[tuple[int, float]] = []
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before(self, step: int) -> None:
        if self.span is None:
            return
        if step + 1 == self.span[0] and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            self._sync()
            self.prof = profile(activities=acts, record_shapes=False, with_stack=False)
            self.prof.__enter__()
        if self.prof is not None:
            self._sync()
            self._t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if self.prof is None:
            return
        self._sync()
        self.walls.append((step + 1, time.perf_counter() - self._t0))
        if step + 1 >= self.span[1]:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        d = self.out / PROFILE_DIR
        d.mkdir(parents=True, exist_ok=True)
        raw = d / f"rank{self.rank}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        avg = prof.key_averages()
        write_text(d / f"rank{self.rank}.txt", self.report(avg))
        write_json(d / f"summary-rank{self.rank}.json", self.summary(avg), end="\n", indent=1)

    def summary(self, avg) -> dict:
        """Per profiled step: wall time, the host's self time (every operator's, the profiler's own cost
        included) and the device's (every kernel's, all streams summed: overlapping communication counts
        too). A step whose host time reaches its wall time is bound by the host."""
        n = max(len(self.walls), 1)
        host = sum(getattr(e, "self_cpu_time_total", 0.0) for e in avg) / 1e6
        dev = sum(getattr(e, "self_device_time_total", 0.0) for e in avg) / 1e6 if self.device.type == "cuda" else None
        return {"rank": self.rank, "steps": list(self.span), "device": str(self.device),
                "step_wall_s": [w for _, w in self.walls], "host_self_s_per_step": host / n,
                "device_self_s_per_step": dev / n if dev is not None else None}

    def report(self, avg) -> str:
        lines = [f"rank {self.rank}, steps {self.span[0]}-{self.span[1]} (1-based), device {self.device}",
                 "wall time of each profiled step (s): "
                 + ", ".join(f"{s}: {w:.4f}" for s, w in self.walls), ""]
        dev_key = "self_device_time_total"
        if self.device.type == "cuda" and avg and hasattr(avg[0], dev_key):
            lines += ["by self time on the device:", avg.table(sort_by=dev_key, row_limit=30), ""]
        lines += ["by self time on the host:", avg.table(sort_by="self_cpu_time_total", row_limit=30)]
        return "\n".join(lines) + "\n"


class GarbageCollection:
    """``train.gc_every``: 0 leaves Python's automatic collection alone; N > 0 disables it for the loop and
    collects at every N-th step on every rank. ``close()`` restores what was there before."""

    def __init__(self, every: int):
        if every < 0:
            raise UserError(f"train.gc_every must be 0 (Python's automatic collection) or positive, got {every}")
        self.every = every
        self.was_enabled = gc.isenabled()
        if every:
            gc.disable()
            gc.collect()

    def step(self, done: int) -> None:
        if self.every and done % self.every == 0:
            # the young generations (what a step leaves behind, as torchtitan collects), and now and then the
            # oldest too, so that cycles promoted there are not kept for the whole run
            gc.collect(2 if done % (20 * self.every) == 0 else 1)

    def close(self) -> None:
        if self.every and self.was_enabled:
            gc.enable()
