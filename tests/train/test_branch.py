"""WSD schedule shapes, kept budget checkpoints, per-window evaluation records and cooldown branches."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from mxtrain.errors import UserError
from mxtrain.train import TrainConfig, branch, lr_at, train
from mxtrain.train import checkpoint as ckpt
from mxtrain.train.config import keep_steps

from train_helpers import one_line_error, run_main, tiny_run_cfg


def test_wsd_shapes_and_decay_steps():
    cfg = TrainConfig()
    cfg.train.steps, cfg.optim.lr, cfg.optim.min_lr_ratio = 100, 1.0, 0.1
    cfg.schedule.kind, cfg.schedule.warmup_steps, cfg.schedule.decay_steps = "wsd", 10, 20
    const = TrainConfig()
    const.train.steps, const.optim.lr, const.schedule.kind, const.schedule.warmup_steps = 100, 1.0, "constant", 10
    # before the cooldown WSD is the constant schedule, exactly (warmup included)
    assert [lr_at(s, cfg) for s in range(80)] == [lr_at(s, const) for s in range(80)]
    assert lr_at(80, cfg) == 1.0 and lr_at(90, cfg) == pytest.approx(1 - 0.9 * 0.5)      # linear
    cfg.schedule.decay_shape = "1-sqrt"
    assert lr_at(80, cfg) == 1.0 and lr_at(85, cfg) == pytest.approx(1 - 0.9 * math.sqrt(0.25))
    assert lr_at(99, cfg) == pytest.approx(1 - 0.9 * math.sqrt(19 / 20))
    lrs = [lr_at(s, cfg) for s in range(80, 100)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))                                       # decreasing
    cfg.schedule.decay_steps = None                                                      # the fraction (0.2)
    assert lr_at(79, cfg) == 1.0 and lr_at(81, cfg) < 1.0


def test_keep_steps_parsing():
    cfg = TrainConfig()
    cfg.train.steps = 40
    cfg.train.keep_checkpoints_at = "0.25,0.5, 30,1.0"
    assert keep_steps(cfg) == [10, 20, 30, 40]
    for bad, msg in (("0", "neither a step"), ("1.5", "neither a step"), ("x", "neither a step"),
                     ("41", "past train.steps")):
        cfg.train.keep_checkpoints_at = bad
        with pytest.raises(UserError, match=msg):
            keep_steps(cfg)


def _model(path):
    return ckpt.load(path)["model"]


def _rows(run, name="metrics.jsonl"):
    return [json.loads(x) for x in (run / name).read_text().splitlines() if x.strip()]


def test_branch_equals_single_wsd_run_bit_for_bit(tmp_path):
    """A constant-LR run kept at step 4, branched with a 3-step cooldown, gives exactly the weights, training
    losses and validation windows of one WSD run of 7 steps whose cooldown starts at step 4."""
    torch.set_num_threads(1)
    k, n = 4, 3
    a = tiny_run_cfg(tmp_path / "stable", 8, keep_checkpoints_at=str(k))
    a.schedule.kind, a.schedule.horizon_steps, a.schedule.warmup_steps = "constant", None, 2
    a.log.eval_every, a.log.log_every = 100, 1
    run = train(a)
    assert (run / f"checkpoint-{k}.pt").is_file() and ckpt.load(run / f"checkpoint-{k}.pt")["step"] == k
    assert ckpt.load(run)["step"] == 8                                        # the latest is still the run's
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}

    for shape in ("linear", "1-sqrt"):
        b = branch(run, k, n, tmp_path / f"branch-{shape}", shape=shape)
        c = tiny_run_cfg(tmp_path / f"single-{shape}", k + n)
        c.schedule.kind, c.schedule.horizon_steps, c.schedule.warmup_steps = "wsd", None, 2
        c.schedule.decay_steps, c.schedule.decay_shape = n, shape
        c.log.eval_every, c.log.log_every = 100, 1
        single = train(c)
        mb, ms = _model(b), _model(single)
        assert mb.keys() == ms.keys()
        assert all(torch.equal(mb[key], ms[key]) for key in mb), shape
        rb = {r["step"]: r for r in _rows(b) if "loss" in r}
        rs = {r["step"]: r for r in _rows(single) if "loss" in r}
        assert sorted(rb) == list(range(k + 1, k + n + 1))
        for st in rb:
            assert rb[st]["loss"] == rs[st]["loss"] and rb[st]["lr"] == rs[st]["lr"], (shape, st)
        wb, ws = _rows(b, "eval_windows.jsonl"), _rows(single, "eval_windows.jsonl")
        assert wb[-1]["step"] == ws[-1]["step"] == k + n and wb[-1]["losses"] == ws[-1]["losses"]
        sb = json.loads((b / "summary.json").read_text())
        assert sb["final_val_loss"] == json.loads((single / "summary.json").read_text())["final_val_loss"]
        info = json.loads((b / "branch.json").read_text())
        assert info["at_step"] == k and info["cooldown_steps"] == n and info["shape"] == shape
        # calling it again returns the finished branch untouched
        assert branch(run, k, n, b, shape=shape) == b
    # resuming from the kept checkpoint into its own folder would overwrite steps 5-8: refused; into another
    # folder it continues from step 4
    again = copy.deepcopy(a)
    again.train.steps, again.log.out = 6, None
    with pytest.raises(UserError, match=f"kept at step {k} .* would overwrite the run after step {k}.*--out NEW"):
        train(again, resume=run / f"checkpoint-{k}.pt")
    again.log.out = str(tmp_path / "continued")
    assert ckpt.load(train(again, resume=run / f"checkpoint-{k}.pt"))["step"] == 6
    after = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}
    assert after == before                                                   # the stable run is never touched


def test_eval_windows_recorded_and_mean_matches(tmp_path):
    torch.set_num_threads(1)
    cfg = tiny_run_cfg(tmp_path / "r", 4)
    cfg.log.eval_every = 2
    run = train(cfg)
    ev = [r for r in _rows(run) if "val_loss" in r]
    win = _rows(run, "eval_windows.jsonl")
    assert [r["step"] for r in win] == [r["step"] for r in ev] == [2, 4]
    for e, w in zip(ev, win):
        assert len(w["losses"]) == 256 // 32 and w["tokens"] == e["tokens"]
        assert sum(w["losses"]) / len(w["losses"]) == pytest.approx(e["val_loss"], abs=1e-5)


def test_branch_errors(tmp_path):
    torch.set_num_threads(1)
    cfg = tiny_run_cfg(tmp_path / "cos", 3)       # cosine, no kept checkpoints
    run = train(cfg)
    with pytest.raises(UserError, match="schedule is cosine"):
        branch(run, 3, 2)
    cfg = tiny_run_cfg(tmp_path / "const", 3)
    cfg.schedule.kind, cfg.schedule.warmup_steps = "constant", 1
    run = train(cfg)
    with pytest.raises(UserError, match="no checkpoint at step 2"):
        branch(run, 2, 2)
    with pytest.raises(UserError, match="own folder"):
        branch(run, 3, 2, run)


def test_a_branch_trained_again_in_its_folder_removes_only_its_own_files(tmp_path):
    """``--branch-at K --out DIR`` where DIR holds an attempt at this branch that stopped before its first
    checkpoint (a matching branch.json): the attempt's files are replaced, the rest of DIR is kept."""
    from mxtrain.train.callbacks import Callback
    torch.set_num_threads(1)
    a = tiny_run_cfg(tmp_path / "stable", 2, keep_checkpoints_at="1")
    a.schedule.kind, a.schedule.horizon_steps, a.schedule.warmup_steps = "constant", None, 1
    run = train(a)

    class Fail(Callback):
        def on_step_end(self, step, metrics):
            raise RuntimeError("stopped")
    out = tmp_path / "mine"
    with pytest.raises(RuntimeError, match="stopped"):
        branch(run, 1, 2, out, callbacks=[Fail()])
    assert (out / "branch.json").is_file() and (out / "metrics.jsonl").is_file() and not ckpt.holds_checkpoint(out)
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "x.bin").write_bytes(b"x")
    assert branch(run, 1, 2, out) == out
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "x.bin").is_file()
    assert ckpt.load(out)["step"] == 3 and (out / "summary.json").is_file()


def test_cli_branch(tmp_path):
    # through mxtrain.cli.core.main in this process (as run_cli runs it): nothing here needs a process of its own
    run = tmp_path / "stable"
    p = run_main("train", "--exp", "debug", "--data", str(__import__("train_helpers").small_data()), "--steps", "4",
                "--seq-len", "32", "--batch-size", "4", "--out", str(run), "--no-progress", "--device", "cpu",
                "--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=1",
                "--set", "train.keep_checkpoints_at=0.5", "--set", "log.tensorboard=false",
                "--set", "log.eval_tokens=256")
    assert p.returncode == 0, p.stderr
    assert (run / "checkpoint-2.pt").is_file()
    p = run_main("train", "--resume", str(run), "--branch-at", "2", "--cooldown", "2", "--cooldown-shape", "1-sqrt",
                "--no-progress")
    assert p.returncode == 0, p.stderr
    b = run / "branches" / "k2-n2"
    assert "cooled-down validation loss" in p.stdout and (b / "summary.json").is_file()
    assert json.loads((b / "config.json").read_text())["schedule"]["decay_shape"] == "1-sqrt"
    one_line_error(run_main("train", "--resume", str(run), "--branch-at", "3", "--cooldown", "2"),
                   "no checkpoint at step 3", "kept: 2")
    one_line_error(run_main("train", "--resume", str(run), "--branch-at", "2"), "--cooldown STEPS")
    one_line_error(run_main("train", "--cooldown", "2"), "go with --branch-at")
