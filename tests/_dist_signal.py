"""Worker for tests/train/test_distributed.py's signal test: 2 gloo ranks train with the step's checks on the
device (``train.check_every_step off``); rank 1 alone gets a SIGTERM at the end of step 3. Every rank must stop
at the same step with a checkpoint of that step. Each rank writes one JSON file, ``OUT-rank<N>.json``, with its
rank and the step at which it stopped (or null when it did not stop): a file each, since two ranks printing to
one pipe can join their lines.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 tests/_dist_signal.py OUT DATA``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mxtrain.train import trainer as TR  # noqa: E402
from mxtrain.train.callbacks import Callback  # noqa: E402


class SignalOnRank1(Callback):
    reads_step_metrics = False

    def on_train_begin(self, state):
        self.rank = state.rank

    def on_step_end(self, step, metrics):
        if step == 3 and self.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def main(out: str, data: str) -> int:
    from mxtrain.train import experiments
    cfg = experiments.get("debug")
    cfg.recipe, cfg.data.path, cfg.data.seq_len = "bf16", data, 32
    cfg.train.batch_size, cfg.train.steps, cfg.train.check_every_step = 4, 12, "off"
    cfg.parallel.mode = "ddp"
    cfg.log.out, cfg.log.progress, cfg.log.tensorboard, cfg.log.eval_every = out, False, False, 100
    rank = int(os.environ.get("RANK", "0"))
    try:
        TR.train(cfg, callbacks=[SignalOnRank1()])
        stopped = None
    except TR.Interrupted as e:
        stopped = e.step
    with open(f"{out}-rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "stopped": stopped}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
