"""Worker for tests/train/test_distributed.py's trainer tests: several ``mxtrain train`` runs one after another in one
``torchrun`` launch (the start-up of a launch, its agent and its ranks, is most of a short run's cost).

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_dist_trainer.py RUNS.json``,
where RUNS.json holds a list of runs, each the list of its ``mxtrain`` arguments. The ranks keep one process
group for all the runs: the trainer's ``mxtrain.train.parallel.shutdown`` at the end of a run is put off until the
last one (a destroyed gloo group started again in the same processes can fail to connect: the new group's
ranks may read the old group's addresses from torchrun's store). Everything else of a run is as a launch of
its own does it: the trainer's ``init`` finds the group started and joins it.
"""

from __future__ import annotations

import faulthandler
import json
import sys

from mxtrain.train import parallel as D
from mxtrain.cli.core import main


def run_all(runs: list[list[str]]) -> int:
    shutdown = D.shutdown
    D.shutdown = lambda: None
    try:
        for i, args in enumerate(runs):
            print(f"=== run {i}: {' '.join(args)}", file=sys.stderr, flush=True)   # where a failed launch was
            rc = main(list(args))
            if rc:
                return rc
    finally:
        D.shutdown = shutdown
    D.shutdown()
    return 0


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)
    with open(sys.argv[1]) as f:
        sys.exit(run_all(json.load(f)))
