"""2-rank worker for tests/test_distributed.py: rank 0's checkpoint files hit a full disk (``shards``: a patched
``torch.save`` raises ENOSPC inside DCP's writer; ``meta``: rank 0's metadata file after the shards); every rank must get the same one-line error instead of waiting forever at
the closing barrier. Writes ``RANK <r> ERROR <message>`` (then exits 3) or ``RANK <r> SAVED`` to
``<folder>/rank<r>.txt`` (two ranks printing to one pipe can interleave their lines)."""

import errno
import sys
from pathlib import Path

import torch

from mxtrain import distributed as D
from mxtrain.errors import UserError

import _dist_worker as W

env = D.init("cpu", timeout_s=60.0)
model, opt = W.build("ddp", env)
W.train(model, opt, env, 0, 1, 1)
if env.rank == 0:
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    if sys.argv[2] == "shards":   # inside DCP's writers (rank 0's shard file)
        torch.save = full
    else:                         # rank 0's own last file, after every rank wrote its shards
        D.write_json = full
report = Path(sys.argv[1]) / f"rank{env.rank}.txt"
try:
    D.save_checkpoint(Path(sys.argv[1]) / "ck", model, opt, extra={"step": 1}, env=env)
    report.write_text(f"RANK {env.rank} SAVED\n")
except UserError as e:
    report.write_text(f"RANK {env.rank} ERROR {e}\n")
    sys.exit(3)
finally:
    D.shutdown()
