"""Worker process of ``mxtrain study --jobs N``: ``python -m mxtrain.study.worker OUT K N`` trains
pending runs of study folder ``OUT`` (plan and settings from ``OUT/study.json``, written by the
parent), taking them in plan order: a worker claims a run by creating ``OUT/claims/<arm>-seed<k>``
(an atomic create, so no two workers train the same run), which balances fast and slow arms. The
parent clears stale claims before it starts the workers, and writes the summary after them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..errors import UserError
from .runner import StudySpec, plan_order, run_one, train_one


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, k = Path(argv[0]), int(argv[1])
    meta = json.loads((out / "study.json").read_text())
    spec = StudySpec(**meta["spec"])
    order = plan_order(spec)
    claims = out / "claims"
    claims.mkdir(exist_ok=True)
    try:
        for i, (arm, seed) in enumerate(order, 1):
            try:
                os.close(os.open(claims / f"{arm}-seed{seed}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
            run_one(spec, arm, seed, f"[{i}/{len(order)}] worker {k}:", train_one,
                    log=lambda m: print(m, flush=True))
    except UserError as e:
        print(f"mxtrain: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
