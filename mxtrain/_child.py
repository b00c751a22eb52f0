"""The command line of every Python child process mxtrain starts (``study --jobs N``'s workers, ``--nproc N``'s
torchrun and its ranks), without the working folder on the child's ``sys.path``.

``python -m module`` puts the current folder first on ``sys.path``: a folder named ``mxtrain/`` there (a
crafted one, or the user's clone of this repository) would be imported by every child instead of the
installed package. Python 3.11+ leaves it out with ``-P``; on 3.10 the child runs a one-line ``-c`` program
that drops it and then runs the module as ``-m`` does.
"""

from __future__ import annotations

import sys

# ``python -c`` puts "" (the working folder) first on sys.path; argv is then ["-c", module, *args]
_RUN_MODULE = ("import runpy, sys; del sys.path[0]; sys.argv[:2] = sys.argv[1:2]; "
               "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def python_command(module: str, args: list[str] = (), *, unbuffered: bool = False,
                   safe_path: bool | None = None) -> list[str]:
    """``[python, ..., args]`` that runs ``module`` as ``python -m module args`` would, the working folder
    not on its ``sys.path``. ``unbuffered``: ``-u``. ``safe_path``: ``-P`` (None: where the Python has it,
    3.11+; False: the 3.10 form, for tests)."""
    if safe_path is None:
        safe_path = sys.version_info >= (3, 11)
    flags = ["-u"] if unbuffered else []
    if safe_path:
        return [sys.executable, "-P", *flags, "-m", module, *args]
    return [sys.executable, *flags, "-c", _RUN_MODULE, module, *args]
