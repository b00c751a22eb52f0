"""2-rank worker for tests/test_distributed.py: rank 1 reaches the run-folder check late, after rank 0 already
wrote into the new folder (as a fast rank 0 does when it starts training); every rank must still accept the
folder (rank 0 decides for all). Writes ``RANK <r> OK`` or ``RANK <r> ERROR <message>`` to
``<folder>/rank<r>.txt``."""

import sys
import time
from pathlib import Path

from mxtrain import distributed as D
from mxtrain.errors import UserError
from mxtrain.train import config as C
from mxtrain.train import trainer as TR

env = D.init("cpu", timeout_s=60.0)
root = Path(sys.argv[1])
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
    D.shutdown()
