"""Worker for tests/train/test_distributed.py's user-loop test: ``examples/distributed_example.py`` run several
times one after another in one ``torchrun`` launch (a launch's start-up, its agent and two ranks importing torch and
transformers, is most of a 6-step run's cost).

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_dist_example.py RUNS.json``,
where RUNS.json holds a list of runs, each the list of the example's arguments. Each run is the script run as
``__main__`` (``runpy``), as torchrun runs it. The ranks keep one process group for all the runs: the first run's
``init_process_group`` starts it, the later runs' calls are skipped, and the last run's
``destroy_process_group`` destroys it (a destroyed gloo group started again in the same processes can fail to
connect: the new group's ranks may read the old group's addresses from torchrun's store; tests/_dist_trainer.py).
Everything else of a run is as a launch of its own does it.
"""

from __future__ import annotations

import faulthandler
import json
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "distributed_example.py"


def run_all(runs: list[list[str]]) -> None:
    init, destroy = dist.init_process_group, dist.destroy_process_group
    try:
        for i, args in enumerate(runs):
            print(f"=== run {i}: {' '.join(args)}", file=sys.stderr, flush=True)   # where a failed launch was
            if i > 0:          # the group the first run started
                dist.init_process_group = lambda *a, **k: None
            if i < len(runs) - 1:
                dist.destroy_process_group = lambda *a, **k: None
            else:
                dist.destroy_process_group = destroy
            sys.argv = [str(SCRIPT), *args]
            runpy.run_path(str(SCRIPT), run_name="__main__")
            torch._dynamo.reset()   # (a compiled run's graphs go with its model)
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy
    if dist.is_initialized():   # a run that failed before the last
        dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)
    with open(sys.argv[1]) as f:
        run_all(json.load(f))
