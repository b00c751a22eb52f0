"""torchrun, with a failed rank reported in one line instead of torchrun's traceback.

``mxtrain train --nproc N`` runs ``python -P -m mxtrain._launch --standalone --nproc-per-node N --no-python
python -P -u -m mxtrain ...`` (``mxtrain.train.parallel.launch``; ``-P``: the working folder is not on ``sys.path``,
``mxtrain._child``). Arguments are torchrun's, parsed by torchrun. What changes:

* a rank that fails has already said why on stderr (``mxtrain: error: ...`` for a bad input, a Python
  traceback for a bug); torchrun's own ``ChildFailedError`` traceback and its agent's log lines about
  the failure are left out, and this process exits with the failed rank's exit code;
* a rank killed by a signal (out of memory, a crash inside a library) says nothing itself, so this
  process prints ``mxtrain: error: rank R was killed by SIGNAME ...`` and exits with 128 + the signal.
"""

from __future__ import annotations

import logging
import signal
import sys


def failure_message(rank: int, exitcode: int) -> tuple[str | None, int]:
    """(the line to print or None, the exit status) for the first failed rank."""
    if exitcode >= 0:
        return None, exitcode or 1
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    hint = " (out of memory?)" if name == "SIGKILL" else ""
    return (f"mxtrain: error: rank {rank} was killed by {name}{hint}; the other ranks were stopped",
            128 + (-exitcode))


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    # the elastic agent's "failed (exitcode: ...)" / "Sending process ... closing signal" lines; each of its
    # loggers sets its own level when its module is imported, and torchrun has imported them all by now
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        line, code = failure_message(rank, failure.exitcode)
        if line:
            print(line, file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print("mxtrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
