"""2-rank worker for tests/train/test_distributed.py: rank 0's checkpoint files hit a full disk (``shards``: a patched
``torch.save`` raises ENOSPC inside DCP's writer; ``meta``: rank 0's metadata file after the shards); every rank must get the same one-line error instead of waiting forever at
the closing barrier. Writes ``RANK <r> ERROR <message>`` (then exits 3) or ``RANK <r> SAVED`` to
``<folder>/rank<r>.txt`` (two ranks printing to one pipe can interleave their lines).

Run as ``torchrun --nproc-per-node 2 tests/_dist_enospc.py FOLDER shards|meta``, or call ``full_disk`` in ranks
that started their process group (tests/_dist_edges.py: both cases and tests/_dist_make_out.py's in one launch)."""

import errno
import sys
from pathlib import Path

import torch

from mxtrain.train import parallel as D
from mxtrain.errors import UserError

import _dist_worker as W


def full_disk(folder: Path, where: str, env: D.DistEnv) -> bool:
    """One save with rank 0's disk full at ``where``; True if it saved (the patched function is put back)."""
    model, opt = W.build("ddp", env)
    W.train(model, opt, env, 0, 1, 1)
    save, write_json = torch.save, D.write_json
    if env.rank == 0:
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        if where == "shards":   # inside DCP's writers (rank 0's shard file)
            torch.save = full
        else:                   # rank 0's own last file, after every rank wrote its shards
            D.write_json = full
    report = folder / f"rank{env.rank}.txt"
    try:
        D.save_checkpoint(folder / "ck", model, opt, extra={"step": 1}, env=env)
        report.write_text(f"RANK {env.rank} SAVED\n")
        return True
    except UserError as e:
        report.write_text(f"RANK {env.rank} ERROR {e}\n")
        return False
    finally:
        torch.save, D.write_json = save, write_json


if __name__ == "__main__":
    env = D.init("cpu", timeout_s=60.0)
    try:
        saved = full_disk(Path(sys.argv[1]), sys.argv[2], env)
    finally:
        D.shutdown()
    sys.exit(0 if saved else 3)
