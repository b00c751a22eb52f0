"""Run folders are not mixed up: a resumed run continues where its checkpoint is (a copied or moved run
trains in its new place, never in the folder it was copied from), never into a folder that holds another
run, and a run locks its folder so that a second run there is refused."""

import shutil
from pathlib import Path

import pytest

from mxtrain.errors import UserError
from mxtrain.train import train
from mxtrain.train.run_folder import _run_lock

from train_helpers import run_main, small_data, tiny_run_cfg


def _cfg(out, steps):
    return tiny_run_cfg(out, steps)


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != ".lock"}


def test_resuming_a_copied_run_trains_in_the_copy(tmp_path):
    orig = tmp_path / "orig"
    train(_cfg(orig, 2))
    before = _snapshot(orig)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(orig, copy)
    # from another working folder, with the run given by a relative path
    p = run_main("train", "--resume", "../elsewhere/copy", "--steps", "3", "--no-progress", cwd=tmp_path / "orig")
    assert p.returncode == 0, p.stderr
    assert _snapshot(orig) == before                       # the original is untouched
    rows = (copy / "metrics.jsonl").read_text()
    assert '"step": 3' in rows
    assert str(copy.resolve()) in p.stdout


def test_resume_refuses_a_folder_holding_another_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(_cfg(a, 2))
    train(_cfg(b, 2))
    before = _snapshot(b)
    # through mxtrain.cli.core.main in this process (run_main, as run_cli runs it; the paths are absolute): no process
    # boundary needed
    p = run_main("train", "--resume", str(a), "--out", str(b), "--steps", "3", "--no-progress")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mxtrain: error: ") and "holds another run" in lines[0], p.stderr
    assert _snapshot(b) == before
    # into an empty folder it continues there
    p = run_main("train", "--resume", str(a), "--out", str(tmp_path / "c"), "--steps", "3", "--no-progress")
    assert p.returncode == 0, p.stderr


def test_a_locked_folder_is_refused(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    lock = _run_lock(out)   # another run holds the folder
    try:
        with pytest.raises(UserError, match=r"in use by another mxtrain run \(pid \d+\)"):
            train(_cfg(out, 2))
        assert not (out / "metrics.jsonl").exists()
    finally:
        lock.close()
    train(_cfg(out, 2))   # free again
    assert (out / "metrics.jsonl").exists()


def test_runs_started_in_the_same_second_get_a_folder_each(tmp_path, monkeypatch):
    """With no --out the folder is named by the second the run started: a second run of that second (another
    seed, launched by the same script) trains in NAME-2, instead of being refused a folder it never chose."""
    import time
    monkeypatch.chdir(tmp_path)
    real = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *t: "20260101-000000" if fmt == "%Y%m%d-%H%M%S"
                        else real(fmt, *t))
    first = train(_cfg(None, 2))
    busy = tmp_path / "runs" / "debug-mxfp4-all-20260101-000000-2"
    busy.mkdir()
    lock = _run_lock(busy)   # a run of the same second that holds NAME-2 and has written nothing yet
    try:
        second = train(_cfg(None, 2))
    finally:
        lock.close()
    assert first == Path("runs/debug-mxfp4-all-20260101-000000")
    assert second == Path("runs/debug-mxfp4-all-20260101-000000-3")
    assert (first / "checkpoint.pt").exists() and (second / "checkpoint.pt").exists()
    assert not (busy / "metrics.jsonl").exists()


def test_metrics_without_checkpoint_hold_a_run(tmp_path):
    out = tmp_path / "crashed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(UserError, match="already holds a run"):
        train(_cfg(out, 2))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_resume_finishes(tmp_path, sig):
    """SIGINT or SIGTERM in the middle of a run (checkpoint_every=0): the step in progress ends, a checkpoint
    is written, the run stops with one line and exit 128+signal; resuming it finishes the run."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from train_helpers import ROOT
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "mxtrain", "train", "--exp", "debug", "--data", str(small_data()),
                          "--steps", "100000", "--out", str(out), "--no-progress", "--set", "log.log_every=1",
                          "--set", "log.eval_every=100000"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            m = out / "metrics.jsonl"
            if m.exists() and sum(1 for ln in m.read_text().splitlines() if '"loss"' in ln) >= 2:
                break
            time.sleep(0.2)
        p.send_signal(getattr(signal, sig))
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + getattr(signal, sig), stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"mxtrain: error: interrupted by {sig} at step"), stderr
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    from mxtrain.train import checkpoint as ckpt
    assert ckpt.load(out)["step"] == step >= 2
    q = run_main("train", "--resume", str(out), "--steps", str(step + 1), "--no-progress")   # (in this process)
    assert q.returncode == 0, q.stderr
    assert ckpt.load(out)["step"] == step + 1


def test_resume_keeps_every_legs_record_and_cleans_stale_temporaries(tmp_path):
    import json
    out = tmp_path / "legs"
    train(_cfg(out, 2))
    first = json.loads((out / "run.json").read_text())
    stale = out / ".checkpoint.pt.tmp-999999999"   # a write of a process that no longer exists
    stale.write_bytes(b"partial")
    train(_cfg(out, 3), resume=out)
    run = json.loads((out / "run.json").read_text())
    assert run["resumed_from_step"] == 2 and [leg["started"] for leg in run["legs"]] == [first["started"]]
    assert not stale.exists()


def test_absurd_block_size_is_refused():
    import torch
    import mxtrain
    with pytest.raises(ValueError, match="block_size must be an even integer from 2 to 4096"):
        mxtrain.quantize(torch.randn(4, 64), "mxfp4", block_size=2**20)


def test_a_checkpoint_without_its_numpy_rng_state_is_one_line(tmp_path):
    """A checkpoint whose RNG state lacks a part (damaged, or written by something else) cannot continue the run as
    it was: one line, nothing written."""
    from mxtrain import _io
    from mxtrain.train import checkpoint as ckpt
    from train_helpers import one_line_error, run_main
    out = tmp_path / "run"
    train(_cfg(out, 2))
    st = ckpt.load(out)
    del st["rng"]["numpy"]
    st.pop("format")
    ckpt.save(out / ckpt.NAME, st)
    before = _snapshot(out)
    one_line_error(run_main("train", "--resume", str(out), "--steps", "3", "--no-progress"),
                   f"checkpoint {out / ckpt.NAME}: its RNG state is incomplete or damaged (no 'numpy')")
    assert _snapshot(out) == before


def test_a_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    """ENOSPC while the second checkpoint is written (inside torch.save, which reports it as a RuntimeError of its
    own): one line naming the disk, no temporary file left, the first checkpoint whole."""
    import errno
    import io
    from mxtrain import _io
    from mxtrain.train import checkpoint as ckpt
    from train_helpers import one_line_error, run_main

    class Full(io.FileIO):
        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")
    opened = []

    def fake_open(p, mode="r", *a, **k):
        if ".checkpoint.pt.tmp-" in str(p):
            opened.append(p)
            if len(opened) == 2:
                return Full(p, "w")
        return open(p, mode, *a, **k)
    monkeypatch.setattr(_io, "open", fake_open, raising=False)   # (the module's name for the builtin)
    out = tmp_path / "run"
    one_line_error(run_main("train", "--exp", "debug", "--data", str(small_data()), "--steps", "4", "--seq-len", "32",
                            "--batch-size", "4", "--out", str(out), "--no-progress", "--set", "train.checkpoint_every=2",
                            "--set", "log.eval_every=100", "--set", "log.tensorboard=false"),
                   f"cannot write checkpoint {out / ckpt.NAME}: No space left on device", "the previous one is intact")
    assert len(opened) == 2 and not list(out.glob(".*.tmp-*"))
    monkeypatch.undo()
    assert ckpt.load(out)["step"] == 2
