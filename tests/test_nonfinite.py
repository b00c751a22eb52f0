"""Divergence ends cleanly: a non-finite gradient stops before the update (the last checkpoint holds the
weights of the last good step), a non-finite validation loss is divergence, metrics are strict JSON, and the
learning rate may change on resume (the advice "try a lower --lr" can be followed)."""

import json
import math

import pytest
import torch

from mxtrain.train import NonFiniteLoss, experiments, train
from mxtrain.train import checkpoint as ckpt
from mxtrain.train import trainer as TR

from train_helpers import small_data


def _cfg(out, steps, lr=3e-3):
    cfg = experiments.get("debug")
    cfg.recipe = "mxfp4-all"
    cfg.data.path = str(small_data())
    cfg.data.seq_len = 32
    cfg.train.batch_size = 4
    cfg.train.steps = steps
    cfg.train.checkpoint_every = 1
    cfg.optim.lr = lr
    cfg.schedule.horizon_steps = 8
    cfg.log.out, cfg.log.progress, cfg.log.tensorboard = str(out), False, False
    cfg.log.eval_every, cfg.log.eval_tokens = 100, 256
    return cfg


def _strict_rows(path):
    def no_constant(c):
        raise ValueError(f"non-JSON constant {c}")
    return [json.loads(line, parse_constant=no_constant) for line in path.read_text().splitlines()]


def test_non_finite_gradient_stops_before_the_update_and_resume_takes_a_new_lr(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = TR.D.clip_grad_norm_
    calls = []

    def clip(model, max_norm):
        calls.append(1)
        g = real(model, max_norm)
        return torch.tensor(float("inf")) if len(calls) == 3 else g

    monkeypatch.setattr(TR.D, "clip_grad_norm_", clip)
    with pytest.raises(NonFiniteLoss, match=r"gradient norm is inf at step 3; the weights were not updated.*step 2"):
        train(_cfg(out, 6))
    state = ckpt.load(out)
    assert state["step"] == 2
    assert all(torch.isfinite(v).all() for v in state["model"].values())
    rows = _strict_rows(out / "metrics.jsonl")
    assert rows[-1]["event"] == "non-finite gradient" and rows[-1]["grad_norm"] == "inf"
    monkeypatch.setattr(TR.D, "clip_grad_norm_", real)
    # resume with a lower learning rate: allowed (the optimizer's state keeps its shape)
    train(_cfg(out, 4, lr=1e-3), resume=out)
    assert ckpt.load(out)["step"] == 4
    assert ckpt.load(out)["config"]["optim"]["lr"] == 1e-3


def test_non_finite_validation_loss_is_divergence(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(TR, "evaluate", lambda *a, **k: float("nan"))
    cfg = _cfg(out, 3)
    cfg.log.eval_every = 2
    with pytest.raises(NonFiniteLoss, match="validation loss is nan at step 2"):
        train(cfg)
    rows = _strict_rows(out / "metrics.jsonl")
    assert any(r.get("val_loss") == "nan" for r in rows)
    assert not (out / "summary.json").exists()


def test_weights_that_are_not_finite_are_never_checkpointed(tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_step = torch.optim.AdamW.step
    n = []

    def step(self, *a, **k):
        r = real_step(self, *a, **k)
        n.append(1)
        if len(n) == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(math.inf)
        return r

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(NonFiniteLoss, match="weights are not finite at step 2; no checkpoint written"):
        train(_cfg(out, 4))
    assert ckpt.load(out)["step"] == 1
