"""2-rank worker for tests/train/test_distributed.py: rank 1 reaches the run-folder check late, after rank 0 already
wrote into the new folder (as a fast rank 0 does when it starts training); every rank must still accept the
folder (rank 0 decides for all). Writes ``RANK <r> OK`` or ``RANK <r> ERROR <message>`` to
``<folder>/rank<r>.txt``.

Run as ``torchrun --nproc-per-node 2 tests/_dist_make_out.py FOLDER``, or call ``late_rank`` in ranks that
started their process group (tests/_dist_edges.py)."""

import sys
import time
from pathlib import Path

from mxtrain.train import parallel as D
from mxtrain.errors import UserError
from mxtrain.train import config as C
from mxtrain.train import trainer as TR


def late_rank(root: Path, env: D.DistEnv) -> None:
    cfg = C.TrainConfig()
    cfg.log.out = str(root / "run")
    if env.rank == 1:
        time.sleep(2.0)
    report = root / f"rank{env.rank}.txt"
    try:
        out = TR._make_out(cfg, None, env.rank, [])
        if env.rank == 0:
            (out / "metrics.jsonl").write_text('{"step": 1}\n')   # rank 0 starts training
        report.write_text(f"RANK {env.rank} OK\n")
    except UserError as e:
        report.write_text(f"RANK {env.rank} ERROR {e}\n")
    finally:
        D.barrier()


if __name__ == "__main__":
    env = D.init("cpu", timeout_s=60.0)
    try:
        late_rank(Path(sys.argv[1]), env)
    finally:
        D.shutdown()
