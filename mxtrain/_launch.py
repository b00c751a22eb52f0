"""torchrun, with a failed rank reported in one line instead of torchrun's traceback.

``mxtrain train --nproc N`` runs ``python -P -m mxtrain._launch --standalone --nproc-per-node N --no-python
python -P -u -m mxtrain ...`` (``launch`` below; ``-P``: the working folder is not on ``sys.path``,
``mxtrain._child``). Arguments are torchrun's, parsed by torchrun. What changes:

* a rank that fails has already said why on stderr (``mxtrain: error: ...`` for a bad input, a Python
  traceback for a bug); torchrun's own ``ChildFailedError`` traceback and its agent's log lines about
  the failure are left out, and this process exits with the failed rank's exit code;
* a rank killed by a signal (out of memory, a crash inside a library) says nothing itself, so this
  process prints ``mxtrain: error: rank R was killed by SIGNAME ...`` and exits with 128 + the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from ._child import python_command
from .errors import UserError

# NVLink multicast (NVLS) off in NCCL, PyTorch symmetric memory and NVSHMEM: on shared hosts a program that uses it
# can take the GPUs out of service. ``mxtrain.train.parallel.init`` and ``launch`` set these unless already set.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def int_env(name: str, default: int) -> int:
    """The integer environment variable ``name`` (``default`` when unset or empty); one line if not an integer."""
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise UserError(f"environment variable {name}={v!r} is not an integer") from None


def launch(nproc: int, argv: list[str], module: str = "mxtrain") -> int:
    """Run ``torchrun --standalone --nproc-per-node nproc -m module *argv`` and return its exit status
    (the ``--nproc N`` convenience). torchrun runs through ``mxtrain._launch``, which reports a failed
    rank in one line rather than torchrun's traceback. The NVLink-multicast switches in ``SAFE_ENV``
    are set in the children's environment unless already set."""
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {nproc}")
    if "RANK" in os.environ and int_env("WORLD_SIZE", 1) > 1:
        raise UserError("--nproc given inside a torchrun launch; use one or the other")
    env = dict(os.environ)
    for k, v in SAFE_ENV.items():
        env.setdefault(k, v)
    # torchrun starts each rank with our command (--no-python), not its own ``python -u -m module``: neither
    # it nor a rank has the working folder on its sys.path (mxtrain._child)
    cmd = python_command("mxtrain._launch", ["--standalone", f"--nproc-per-node={nproc}", "--no-python",
                                             *python_command(module, argv, unbuffered=True)])
    return subprocess.call(cmd, env=env)


def strip_nproc(argv: list[str]) -> tuple[int | None, list[str]]:
    """Split ``--nproc N`` / ``--nproc=N`` out of ``argv``: returns (N or None, the other args)."""
    out, n, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--nproc":
            if i + 1 >= len(argv):
                raise UserError("--nproc needs a number")
            n, i = argv[i + 1], i + 2
            continue
        if a.startswith("--nproc="):
            n, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    if n is not None:
        try:
            n = int(n)
        except ValueError:
            raise UserError(f"--nproc needs a number, got {n!r}") from None
    return n, out




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
