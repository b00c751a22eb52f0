"""CPU threads for a training run on the CPU: one per core that is free for it, unless the user chose.

PyTorch starts one intra-op thread per core. On a small machine that other work also keeps busy, threads that
wait at every operation's barrier for a core to come free make each step many times slower: the README's first
command (the tiny model on the built-in data, 2 cores) took 5 minutes on a quiet machine and 87 under load with
two threads, 39 with one, with the same losses bit for bit. So a single-process CPU run whose threads nobody set
(no ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``, no ``torch.set_num_threads`` since mxtrain was imported) takes one
thread per core that the run may use (``os.sched_getaffinity``, a cgroup CPU quota) and that the load average
leaves free, never fewer than one nor more than PyTorch's default, and says so in its log (and in ``run.json``).

The thread count can move a sum's last bit (docs/distributed.md, "Equality with one process"), so a resumed run
takes the count of its first leg, whatever the load: it computes what the uninterrupted run would have. Set
``OMP_NUM_THREADS`` to the count a run's ``run.json`` records (``cpu_threads``) to repeat it on another machine.
"""

from __future__ import annotations

import math
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

_AT_IMPORT = torch.get_num_threads()   # PyTorch's default, unless set before mxtrain was imported
_CHOSEN: int | None = None               # what ``apply`` set last
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Choice:
    threads: int | None   # None: leave PyTorch's setting as it is
    message: str


def choose(*, default: int, cores: int, host_cpus: int, load: float | None, own: float = 0.0,
           user_set: str | None = None, first_leg: int | None = None) -> Choice:
    """How many threads a CPU run takes (a pure function of what was measured).

    ``default``: PyTorch's thread count now; ``cores``: the cores this process may run on; ``host_cpus``: the
    host's CPUs (the load average counts the work on all of them: a process held to a few of them is assumed to
    share their part of it); ``load``: the 1-minute load average (None: unknown); ``own``: this process's part
    of it (preparing the data, building the model); ``user_set``: what the user set (an environment variable,
    ``torch.set_num_threads``), which is kept; ``first_leg``: the count of the run's first leg, when resuming."""
    if user_set:
        return Choice(None, f"cpu threads: {default} ({user_set})")
    if first_leg is not None and first_leg >= 1:
        return Choice(first_leg, f"cpu threads: {first_leg} (as the run's first leg, so that the resumed run computes "
                                 f"what it would have computed uninterrupted)")
    cores, host_cpus = max(1, cores), max(1, host_cpus, cores)
    if load is None:
        n = min(default, cores)
        return Choice(n, f"cpu threads: {n} ({cores} cores available, load unknown)")
    busy = max(0.0, load - own) * cores / host_cpus   # the other work's share on our cores
    free = max(1, min(cores, math.floor(cores - busy + 0.5)))
    n = min(default, free)
    msg = f"cpu threads: {n} ({cores} core{'s' if cores > 1 else ''} available, load average {busy:.1f} on them)"
    if n < min(default, cores):
        msg += (f"; the machine is busy: fewer threads than its {min(default, cores)} cores, as threads waiting for "
                f"a busy core slow every step down (set OMP_NUM_THREADS to choose)")
    return Choice(n, msg)


def _cgroup_cores() -> int | None:
    """The cores a cgroup v2 CPU quota allows (``cpu.max``), or None without one."""
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def _own_load() -> float:
    """This process's part of the 1-minute load average: its CPU time over its life so far, weighed as the
    load average weighs the last minute (0 where /proc cannot tell)."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            wall = float(f.read().split()[0]) - start
        t = os.times()
        return (t.user + t.system) / wall * (1 - math.exp(-wall / 60)) if wall > 0 else 0.0
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def measure() -> dict:
    """What ``choose`` needs, measured on this machine now."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cores()
    if quota is not None:
        cores = min(cores, quota)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    default = torch.get_num_threads()
    if default == _CHOSEN:   # set by an earlier run of this process, not by the user
        default = _AT_IMPORT
    env = next((f"{v}={os.environ[v]}" for v in ENV_VARS if os.environ.get(v)), None)
    user = env or (f"torch.set_num_threads({default})" if default != _AT_IMPORT else None)
    return {"default": default, "cores": cores, "host_cpus": os.cpu_count() or cores, "load": load,
            "own": _own_load(), "user_set": user}


def first_leg(run_dir: Path) -> int | None:
    """The thread count that a run folder's first leg recorded in ``run.json`` (None: none recorded)."""
    try:
        info = json.loads((Path(run_dir) / "run.json").read_text())
        first = (info.get("legs") or [info])[0]
        n = first.get("cpu_threads")
        return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def apply(resumed_from: Path | None = None) -> Choice:
    """Choose this CPU run's threads (``choose`` on ``measure()``; a run resumed from the folder ``resumed_from``:
    its first leg's) and set them."""
    c = choose(**measure(), first_leg=first_leg(resumed_from) if resumed_from is not None else None)
    global _CHOSEN
    if c.threads is not None and c.threads != torch.get_num_threads():
        torch.set_num_threads(c.threads)
        _CHOSEN = c.threads
    return c
