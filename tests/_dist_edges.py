"""2-rank worker for tests/train/test_distributed.py: the edge cases of tests/_dist_make_out.py (a late rank accepts the
new run folder) and tests/_dist_enospc.py (rank 0's disk full at its shards, then at its metadata) one after
another in one torchrun launch, in one process group (a launch's start-up is most of each case's cost), each
case in its own folder under ROOT (``late``, ``shards``, ``meta``), which the caller makes.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_dist_edges.py ROOT``."""

import faulthandler
import sys
from pathlib import Path

from mxtrain.train import parallel as D

from _dist_enospc import full_disk
from _dist_make_out import late_rank

if __name__ == "__main__":
    faulthandler.enable(all_threads=True)
    root = Path(sys.argv[1])
    env = D.init("cpu", timeout_s=60.0)
    try:
        late_rank(root / "late", env)
        for where in ("shards", "meta"):
            print(f"[rank {env.rank}] full disk at {where}", file=sys.stderr, flush=True)
            full_disk(root / where, where, env)
    finally:
        D.shutdown()
