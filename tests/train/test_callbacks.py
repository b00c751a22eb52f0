"""Trainer callbacks and typed outcomes: the calls a callback sees (and their steps) in a tiny CPU run and
its resumption; diverged, interrupted and failed runs end with the matching ``Outcome`` in the exception,
``run.json`` and ``on_train_end``; the study runner takes a run's state from its typed outcome; the fast
path's inexact-block count in metrics; Weights & Biases (missing package, and a stand-in module)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import types
from pathlib import Path

import pytest
import torch

from mxtrain.errors import UserError
from mxtrain.train import NonFiniteLoss, lr_at
from mxtrain.train import trainer as TR
from mxtrain.train.callbacks import Callback, Outcome, Status, read_outcome, scalars

from train_helpers import tiny_run_cfg

B, T = 4, 32   # tiny_run_cfg's batch size and sequence length


class Recorder(Callback):
    """Every call, as a tuple: ("begin", start, total), ("sb", k), ("se", k), ("log", k, kind), ("eval", k),
    ("ckpt", k, file name), ("end", status, step)."""

    def __init__(self):
        self.events, self.metrics, self.state, self.outcome = [], {}, None, None

    def on_train_begin(self, state):
        self.state = state
        self.events.append(("begin", state.start_step, state.total_steps))

    def on_step_begin(self, step):
        self.events.append(("sb", step))

    def on_step_end(self, step, metrics):
        self.metrics[step] = dict(metrics)
        self.events.append(("se", step))

    def on_log(self, step, row):
        self.events.append(("log", step, "val" if "val_loss" in row else row.get("event", "train")))

    def on_eval(self, step, metrics):
        self.events.append(("eval", step))

    def on_checkpoint(self, step, path):
        assert Path(path).is_file()   # called after the checkpoint is on disk
        self.events.append(("ckpt", step, Path(path).name))

    def on_train_end(self, outcome):
        self.outcome = outcome
        self.events.append(("end", outcome.status.value, outcome.step))


def _cfg(out, steps, **train):
    cfg = tiny_run_cfg(out, steps, **train)
    cfg.log.eval_every, cfg.log.log_every = 2, 2
    return cfg


def _expected(start, stop, ckpt_every=2, end=("completed",)):
    ev = [("begin", start, stop)]
    for k in range(start, stop):
        done = k + 1
        ev += [("sb", k), ("se", done)]
        if done % 2 == 0 or done == stop or done == start + 1:
            ev.append(("log", done, "train"))
        if done % 2 == 0 or done == stop:
            ev += [("log", done, "val"), ("eval", done)]
        if done % ckpt_every == 0 or done == stop:   # its timing row, then the callback
            ev += [("log", done, "checkpoint"), ("ckpt", done, "checkpoint.pt")]
    return ev + [("end", end[0], stop)]


def test_callback_sees_every_call_with_its_step_and_resume_continues_the_count(tmp_path):
    out = tmp_path / "run"
    rec = Recorder()
    oc = TR.fit(_cfg(out, 4, checkpoint_every=2), callbacks=[rec])
    assert oc == Outcome(Status.COMPLETED, 4, None, out) and oc.completed
    assert rec.events == _expected(0, 4)
    assert rec.outcome == oc and rec.state.out == out and rec.state.rank == 0 and rec.state.step == 4
    assert rec.state.tokens == 4 * B * T and rec.state.model is not None and rec.state.optimizer is not None
    cfg = _cfg(out, 4)
    for done, m in rec.metrics.items():   # the step's own values
        assert m["tokens"] == done * B * T and m["lr"] == pytest.approx(lr_at(done - 1, cfg))
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows if "loss" in r][:1] == [pytest.approx(rec.metrics[1]["loss"])]
    assert json.loads((out / "run.json").read_text())["outcome"]["status"] == "completed"
    assert read_outcome(out) == oc
    # resume to 7: steps continue from the checkpoint's count, the outcome of leg 1 stays in "legs"
    rec2 = Recorder()
    assert TR.train(_cfg(out, 7, checkpoint_every=2), resume=out, callbacks=[rec2]) == out
    assert rec2.events == _expected(4, 7)
    info = json.loads((out / "run.json").read_text())
    assert info["outcome"]["step"] == 7 and info["legs"][0]["outcome"]["step"] == 4


def _diverging_cfg(out, steps=6):
    cfg = tiny_run_cfg(out, steps, checkpoint_every=1)
    cfg.recipe = "bf16"
    cfg.optim.lr = 1e30          # the first update makes the weights ~1e30: a later loss overflows
    cfg.optim.grad_clip = 0.0
    cfg.schedule.warmup_steps = 0
    return cfg


def test_diverging_run_yields_a_typed_diverged_outcome(tmp_path):
    rec = Recorder()
    oc = TR.fit(_diverging_cfg(tmp_path / "a"), callbacks=[rec])
    assert oc.status is Status.DIVERGED and oc.diverged and not oc.completed
    assert 1 < oc.step < 6 and f"at step {oc.step}" in oc.reason and oc.out == tmp_path / "a"
    assert rec.outcome == oc and rec.events[-1] == ("end", "diverged", oc.step)
    # the diverged step began, wrote its event row, and never ended (no update was made)
    assert ("sb", oc.step - 1) in rec.events and ("se", oc.step) not in rec.events
    assert ("se", oc.step - 1) in rec.events and ("log", oc.step, "non-finite loss") in rec.events
    assert read_outcome(tmp_path / "a") == oc
    # train() raises, with the same outcome attached
    with pytest.raises(NonFiniteLoss) as e:
        TR.train(_diverging_cfg(tmp_path / "b"))
    assert e.value.outcome.status is Status.DIVERGED and e.value.outcome.step == e.value.step == oc.step
    assert json.loads((tmp_path / "b" / "run.json").read_text())["outcome"]["status"] == "diverged"


class _SignalAt(Callback):
    def __init__(self, at):
        self.at = at

    def on_step_end(self, step, metrics):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_signal_gives_interrupted_outcome_after_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    rec = Recorder()
    with pytest.raises(TR.Interrupted) as e:
        TR.train(tiny_run_cfg(out, 8), callbacks=[_SignalAt(3), rec])
    oc = e.value.outcome
    assert oc.status is Status.INTERRUPTED and oc.step == 3 and "SIGTERM" in oc.reason
    assert rec.events[-3:] == [("ckpt", 3, "checkpoint.pt"), ("log", 3, "interrupted (SIGTERM)"),
                               ("end", "interrupted", 3)]
    assert read_outcome(out) == Outcome(Status.INTERRUPTED, 3, oc.reason, out)


class _Boom(Callback):
    def on_step_end(self, step, metrics):
        if step == 2:
            raise RuntimeError("callback exploded")


def test_callback_error_is_a_failed_outcome(tmp_path):
    out = tmp_path / "run"
    rec = Recorder()
    with pytest.raises(RuntimeError, match="callback exploded") as e:
        TR.fit(tiny_run_cfg(out, 5), callbacks=[rec, _Boom()])
    assert e.value.outcome == Outcome(Status.FAILED, 2, "RuntimeError: callback exploded", out)
    assert rec.outcome == e.value.outcome and read_outcome(out) == e.value.outcome
    assert not (out / "summary.json").exists()


def test_study_state_comes_from_the_typed_outcome(tmp_path):
    """run_one records what the outcome says: returned, carried by any exception type, or in run.json."""
    from mxtrain.study.plan import StudySpec
    from mxtrain.study.run import StudyInterrupted, run_one

    spec = StudySpec(out=str(tmp_path / "st"), arms=["bf16"], seeds=1)

    def status(fn, seed=0):
        run_one(spec, "bf16", seed, "", fn, log=lambda *a: None)
        return json.loads((tmp_path / "st" / "runs" / "bf16" / f"seed{seed}" / "study_status.json").read_text())

    def returns(oc):
        return lambda spec, arm, seed, rd: (rd.mkdir(parents=True), oc)[1]

    st = status(returns(Outcome(Status.DIVERGED, 7, "loss is nan at step 7")))
    assert (st["state"], st["step"], st["message"]) == ("diverged", 7, "loss is nan at step 7")
    st = status(returns(Outcome(Status.FAILED, 2, "disk full")), seed=1)
    assert (st["state"], st["message"]) == ("failed", "disk full")

    def raises_typed(spec, arm, seed, rd):   # an exception type that says nothing; its outcome decides
        e = RuntimeError("wrapped")
        e.outcome = Outcome(Status.DIVERGED, 3, "gradient norm is inf at step 3")
        raise e
    st = status(raises_typed, seed=2)
    assert st["state"] == "diverged" and st["step"] == 3

    def records(spec, arm, seed, rd):   # the outcome only in run.json (as the trainer writes it)
        rd.mkdir(parents=True)
        (rd / "run.json").write_text(json.dumps({"outcome": {"status": "diverged", "step": 4, "reason": "r"}}))
        raise ValueError("no outcome attached")
    st = status(records, seed=3)
    assert (st["state"], st["step"]) == ("diverged", 4)
    st = status(returns(None), seed=4)
    assert st["state"] == "done" and st["message"] is None
    with pytest.raises(StudyInterrupted):
        status(returns(Outcome(Status.INTERRUPTED, 1, "SIGTERM")), seed=5)


def test_study_train_one_returns_the_trainers_outcome(tmp_path):
    """A real diverging study run: train_one returns the typed outcome, run_one records it as diverged."""
    from mxtrain.study.plan import StudySpec
    from mxtrain.study.run import run_one, train_one
    from train_helpers import small_data

    spec = StudySpec(out=str(tmp_path / "st"), arms=["bf16"], seeds=1, model="tiny", steps=6, batch_size=4,
                     seq_len=32, data=str(small_data()), device="cpu", eval_every=100,
                     overrides=["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
                                "optim.lr=1e30", "optim.grad_clip=0", "schedule.warmup_steps=0",
                                "log.tensorboard=false", "log.eval_tokens=256"])
    rd = tmp_path / "st" / "runs" / "bf16" / "seed0"
    oc = train_one(spec, "bf16", 0, rd)
    assert oc.status is Status.DIVERGED and oc.step is not None
    import shutil
    shutil.rmtree(rd)
    run_one(spec, "bf16", 0, "", train_one, log=lambda *a: None)
    st = json.loads((rd / "study_status.json").read_text())
    assert st["state"] == "diverged" and st["step"] == read_outcome(rd).step and "at step" in st["message"]
    assert not (rd / "study_error.txt").exists()


def test_inexact_blocks_recorded_per_run(tmp_path, monkeypatch):
    from mxtrain.linear import fast
    count = {"n": 1000}   # a running count that an earlier run in this process left at 1000

    def inexact_blocks(device="cuda"):
        count["n"] += 5
        return count["n"]

    monkeypatch.setattr(fast, "inexact_blocks", inexact_blocks)
    monkeypatch.setattr(fast.state, "missed", set())   # (an earlier test in this process may have left a mark)
    cfg = tiny_run_cfg(tmp_path / "a", 3)
    cfg.log.log_every = 1
    TR.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["inexact_blocks"] for r in rows if "loss" in r] == [5, 10, 15]   # counted from this run's start
    monkeypatch.setattr(fast, "inexact_blocks", lambda device="cuda": 0)   # CPU: always 0, not recorded
    cfg = tiny_run_cfg(tmp_path / "b", 2)
    TR.train(cfg)
    assert all("inexact_blocks" not in json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines())


# ----------------------------------------------------------------------------------------------
# Weights & Biases


def test_wandb_missing_is_one_clear_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # import wandb -> ImportError, as when not installed
    cfg = tiny_run_cfg(tmp_path / "run", 2)
    cfg.log.wandb = "my-project"   # read with getattr: works whether or not LogSection has the field yet
    with pytest.raises(UserError, match=r"wandb package is not installed: pip install wandb"):
        TR.train(cfg)
    assert not (tmp_path / "run").exists()
    cfg.log.wandb = False          # off: no import at all
    TR.train(cfg)
    assert read_outcome(tmp_path / "run").completed


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records init, log and finish calls."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.runs = [], []

    def init(self, **kw):
        self.inits.append(kw)
        run = types.SimpleNamespace(logs=[], finished=None, summary={})
        run.log = lambda data, step=None: run.logs.append((step, dict(data)))
        run.finish = lambda exit_code=0: setattr(run, "finished", exit_code)
        self.runs.append(run)
        return run


def test_wandb_logs_the_tensorboard_scalars_and_resume_continues_the_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    cfg = tiny_run_cfg(out, 3)
    cfg.log.log_every, cfg.log.wandb = 1, True
    TR.train(cfg)
    (kw,) = fake.inits
    assert kw["project"] == "mxtrain" and kw["dir"] == str(out) and kw["name"] == "run"
    assert kw["config"]["optim"]["lr"] == cfg.optim.lr and kw["id"] == (out / "wandb_id").read_text().strip()
    run = fake.runs[0]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert run.logs == [(r["step"], scalars(r)) for r in rows]   # every row, the same numbers as TensorBoard
    assert {"loss", "lr", "grad_norm", "tok_per_s"} <= set(run.logs[0][1])
    assert [s for s, d in run.logs if "val_loss" in d] == [3] and "save_s" in run.logs[-1][1]   # eval, then ckpt
    assert run.finished == 0 and run.summary["outcome"] == "completed"
    # resuming continues the same W&B run (its id is kept in the run folder)
    cfg = tiny_run_cfg(out, 4)
    cfg.log.wandb = "other"
    TR.train(cfg, resume=out)
    assert fake.inits[1]["id"] == kw["id"] and fake.inits[1]["project"] == "other"
    assert [s for s, _ in fake.runs[1].logs][0] == 4   # the resume's timing row stays in metrics.jsonl
    assert any(r.get("event") == "resumed" for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))
    # a diverged run finishes its W&B run with a non-zero exit code and the outcome in its summary
    cfg = _diverging_cfg(tmp_path / "nan")
    cfg.log.wandb = "p"
    assert TR.fit(cfg).diverged and fake.runs[-1].finished == 1 and fake.runs[-1].summary["outcome"] == "diverged"


def test_wandb_values():
    from mxtrain.train.callbacks import wandb_project
    assert [wandb_project(v) for v in (None, False, "", "off", "false", True, "on", "proj")] == \
        [None, None, None, None, None, "mxtrain", "mxtrain", "proj"]
    with pytest.raises(UserError, match="log.wandb must be"):
        wandb_project(3)


def test_uncounted_inexact_blocks_are_said_not_recorded_as_zero(tmp_path, monkeypatch, capsys):
    """Where a compiled call could not count inexact blocks, the run says so once and its metrics carry no
    inexact_blocks (never a count of 0 that was not made)."""
    from mxtrain.linear import fast
    monkeypatch.setattr(fast, "inexact_blocks", lambda device="cuda": 3)
    monkeypatch.setattr(fast.state, "missed", {torch.device("cpu")})
    cfg = tiny_run_cfg(tmp_path / "a", 3)
    cfg.log.log_every = 1
    TR.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all("inexact_blocks" not in r for r in rows)
    assert capsys.readouterr().out.count("inexact FP8-carrier blocks are not counted") == 1


def test_memory_budget_applies_while_the_run_compiles_and_is_restored(tmp_path):
    """``train.memory_budget`` is torch's ``activation_memory_budget`` during the run (when blocks compile),
    torch's own value again afterwards; values outside (0, 1] are refused before anything is written."""
    import torch._functorch.config as fc
    before = fc.activation_memory_budget
    seen = []

    class Rec(Callback):
        def on_step_begin(self, step):
            seen.append(fc.activation_memory_budget)
    cfg = _cfg(tmp_path / "a", 2)
    cfg.train.memory_budget = 0.4
    TR.fit(cfg, callbacks=[Rec()])
    assert seen == [0.4, 0.4] and fc.activation_memory_budget == before
    for bad in (0, 1.5, float("nan")):
        cfg = _cfg(tmp_path / f"b{bad}", 2)
        cfg.train.memory_budget = bad
        with pytest.raises(UserError, match="train.memory_budget"):
            TR.fit(cfg)
        assert not (tmp_path / f"b{bad}").exists()
