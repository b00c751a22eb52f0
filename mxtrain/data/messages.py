"""The data pipeline's one-line messages: ``warn`` (stderr) and ``note`` (stdout). A leaf of ``mxtrain.data``:
the tokenizer, the sources and prepare all report through it."""

from __future__ import annotations

import sys


def warn(msg: str) -> None:
    """One line on stderr: ``mxtrain: warning: <msg>``."""
    sys.stderr.write(f"mxtrain: warning: {' '.join(msg.splitlines())}\n")
    sys.stderr.flush()


def note(msg: str) -> None:
    """One log line on stdout: ``mxtrain: <msg>`` (what was read or skipped; not a warning)."""
    print(f"mxtrain: {' '.join(msg.splitlines())}", flush=True)
