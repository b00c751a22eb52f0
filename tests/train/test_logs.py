"""Console logs and metric sinks: plain, time-stamped lines and no carriage returns when stderr is not a
terminal (nohup, batch systems); the progress bar on a terminal; TensorBoard event files for every study run
(so ``tensorboard --logdir STUDY/runs`` compares arms), and the study's diagnostics attached as a callback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from train_helpers import ROOT, run_cli, small_data

STEP_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step +(\d+)/(\d+) \| tokens +[\d,]+ \| loss \d+\.\d{4} \| "
                       r"lr \d\.\d\de[-+]\d\d \| [\d,]+ tok/s")
VAL_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step +(\d+)/\d+ \| tokens +[\d,]+ \| val_loss \d+\.\d{4} \| "
                      r"val_ppl [\d.]+$")


def _train_args(out, steps=4):
    return ["train", "--exp", "debug", "--recipe", "bf16", "--data", str(small_data()), "--seq-len", "32",
            "--batch-size", "4", "--steps", str(steps), "--eval-every", "2", "--eval-tokens", "128", "--out", str(out),
            "--set", "log.log_every=1", "--set", "log.tensorboard=false"]


def test_non_tty_stderr_gets_plain_lines_and_no_carriage_returns(tmp_path):
    """No --no-progress: stderr is a pipe, so no bar; every log interval is one time-stamped line on stdout."""
    p = run_cli(*_train_args(tmp_path / "run"))
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout and "\r" not in p.stderr
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, p.stdout.splitlines()) if m]
    assert steps == [1, 2, 3, 4], p.stdout
    assert [int(m.group(1)) for m in map(VAL_LINE.match, p.stdout.splitlines()) if m] == [2, 4], p.stdout
    first = next(ln for ln in p.stdout.splitlines() if STEP_LINE.match(ln))   # (the first step's line: its eta)
    assert "eta" in first, p.stdout
    assert "train:" not in p.stderr and "it/s" not in p.stderr and "step/s" not in p.stderr


def test_terminal_stderr_gets_the_progress_bar(tmp_path):
    """The same run with stderr on a pseudo-terminal: the bar (carriage returns) is back, loss in its postfix."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))   # a new pty is 0 columns wide
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    try:
        p = subprocess.Popen([sys.executable, "-m", "mxtrain", *_train_args(tmp_path / "run")], stdout=subprocess.PIPE,
                             stderr=slave, env=env, text=True)
        os.close(slave)
        chunks = []
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:   # the child closed the terminal
                break
            if not b:
                break
            chunks.append(b)
        stdout = p.stdout.read()
        assert p.wait(timeout=300) == 0
    finally:
        os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert "\r" in err and "loss=" in err and "step" in err
    assert not any(STEP_LINE.match(ln) for ln in stdout.splitlines())   # the bar shows the loss instead
    assert any("val_loss" in ln for ln in stdout.splitlines() + err.splitlines())


def test_study_runs_write_tensorboard_and_diagnostics_through_callbacks(tmp_path):
    """A tiny 2-arm study: every run folder has TensorBoard events with the training and validation losses
    (tensorboard --logdir OUT/runs compares arms), diagnostics come from the callback on the diagnosed steps,
    and each run's typed outcome is recorded."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mxtrain.cli.core import main

    out = tmp_path / "st"
    assert main(["study", "--preset", "smoke", "--arms", "bf16,mxfp4-all", "--seeds", "1", "--steps", "4",
                 "--diagnose-every", "2", "--data", str(small_data()), "--out", str(out),
                 "--set", "log.eval_tokens=256"]) == 0
    for arm in ("bf16", "mxfp4-all"):
        rd = out / "runs" / arm / "seed0"
        events = list((rd / "tb").glob("events.out.tfevents.*"))
        assert events, f"no TensorBoard events in {rd}"
        acc = EventAccumulator(str(rd / "tb"))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"loss", "val_loss", "lr", "tok_per_s"} <= tags
        rows = [json.loads(x) for x in (rd / "metrics.jsonl").read_text().splitlines()]
        assert [e.step for e in acc.Scalars("val_loss")] == [r["step"] for r in rows if "val_loss" in r]
        assert json.loads((rd / "run.json").read_text())["outcome"]["status"] == "completed"
        assert json.loads((rd / "study_status.json").read_text())["state"] == "done"
    from mxtrain.study import diagnostics as D
    rows = D.load(out / "runs" / "mxfp4-all" / "seed0")
    assert {r["step"] for r in rows} == {0, 2} and {r["gemm"] for r in rows} == {"fprop", "dgrad", "wgrad"}
    assert not (out / "runs" / "bf16" / "seed0" / "diagnostics.jsonl").exists()


def test_resumed_run_tensorboard_has_each_step_once(tmp_path):
    """A run that failed after its checkpoint logged steps past it; the resumed leg logs them again, and
    TensorBoard shows each step once (the earlier leg's events past the checkpoint are purged), as
    metrics.jsonl does."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mxtrain.train import trainer as TR
    from mxtrain.train.callbacks import Callback
    from train_helpers import tiny_run_cfg

    class Crash(Callback):
        def on_step_end(self, step, metrics):
            if step == 4:
                raise RuntimeError("node lost")

    out = tmp_path / "run"
    cfg = tiny_run_cfg(out, 6, checkpoint_every=2)
    cfg.log.tensorboard, cfg.log.log_every = True, 1
    with pytest.raises(RuntimeError):
        TR.train(cfg, callbacks=[Crash()])   # logged steps 1-3, checkpoint at 2, failed in step 4
    TR.train(cfg, resume=out)
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("loss")]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_resumed_leg_event_file_sorts_after_the_earlier_legs(tmp_path):
    """TensorBoard reads event files in name order; a leg started in the same second as an earlier leg's file
    (whose name has a larger counter or pid, e.g. ``...9`` against ``...10``) must still sort after it, or the
    earlier file undoes the purge of the steps past the checkpoint (a CI failure: steps read 3-6 then 1-3)."""
    pytest.importorskip("tensorboard")
    import time

    from mxtrain.train.callbacks import TensorBoardLogger, TrainState

    tb = tmp_path / "tb"
    tb.mkdir()
    earlier = tb / f"events.out.tfevents.{int(time.time()):010d}.zzzz.99999.9"
    earlier.write_bytes(b"")
    log = TensorBoardLogger(log_dir=tb)
    log.on_train_begin(TrainState(cfg=None, config={}, out=tmp_path, model=None, optimizer=None, device=None,
                                  rank=0, world_size=1, start_step=2, total_steps=6))
    try:
        names = sorted(p.name for p in tb.glob("events.out.tfevents.*"))
        assert len(names) == 2 and names[0] == earlier.name, names
    finally:
        log.writer.close()
