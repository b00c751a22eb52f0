"""Run folders are not mixed up: a resumed run continues where its checkpoint is (a copied or moved run
trains in its new place, never in the folder it was copied from), never into a folder that holds another
run, and a run locks its folder so that a second run there is refused."""

import shutil

import pytest

from mxtrain.errors import UserError
from mxtrain.train import experiments, train
from mxtrain.train.trainer import _RunLock

from train_helpers import run_cli, small_data


def _cfg(out, steps):
    cfg = experiments.get("debug")
    cfg.recipe = "mxfp4-all"
    cfg.data.path = str(small_data())
    cfg.data.seq_len = 32
    cfg.train.batch_size = 4
    cfg.train.steps = steps
    cfg.schedule.horizon_steps = 8
    cfg.log.out, cfg.log.progress, cfg.log.tensorboard = str(out), False, False
    cfg.log.eval_every, cfg.log.eval_tokens = 100, 256
    return cfg


def _snapshot(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name != ".lock"}


def test_resuming_a_copied_run_trains_in_the_copy(tmp_path):
    orig = tmp_path / "orig"
    train(_cfg(orig, 2))
    before = _snapshot(orig)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(orig, copy)
    # from another working folder, with the run given by a relative path
    p = run_cli("train", "--resume", "../elsewhere/copy", "--steps", "3", "--no-progress", cwd=tmp_path / "orig")
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
    p = run_cli("train", "--resume", str(a), "--out", str(b), "--steps", "3", "--no-progress", cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mxtrain: error: ") and "holds another run" in lines[0], p.stderr
    assert _snapshot(b) == before
    # into an empty folder it continues there
    p = run_cli("train", "--resume", str(a), "--out", str(tmp_path / "c"), "--steps", "3", "--no-progress",
                cwd=tmp_path)
    assert p.returncode == 0, p.stderr


def test_a_locked_folder_is_refused(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    lock = _RunLock(out)   # another run holds the folder
    try:
        with pytest.raises(UserError, match=r"in use by another mxtrain run \(pid \d+\)"):
            train(_cfg(out, 2))
        assert not (out / "metrics.jsonl").exists()
    finally:
        lock.close()
    train(_cfg(out, 2))   # free again
    assert (out / "metrics.jsonl").exists()


def test_metrics_without_checkpoint_hold_a_run(tmp_path):
    out = tmp_path / "crashed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(UserError, match="already holds a run"):
        train(_cfg(out, 2))
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
