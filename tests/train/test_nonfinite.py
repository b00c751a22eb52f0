"""Divergence ends cleanly: a non-finite gradient stops before the update (the last checkpoint holds the
weights of the last good step), a non-finite validation loss is divergence, metrics are strict JSON, and the
learning rate may change on resume (the advice "try a lower --lr" can be followed)."""

import json
import math

import pytest
import torch

from mxtrain.train import NonFiniteLoss, train
from mxtrain.train import checkpoint as ckpt
from mxtrain.train import trainer as TR

from train_helpers import tiny_run_cfg


def _cfg(out, steps, lr=3e-3):
    cfg = tiny_run_cfg(out, steps, checkpoint_every=1)
    cfg.optim.lr = lr
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
    monkeypatch.setattr(TR, "evaluate_windows", lambda *a, **k: (float("nan"), [float("nan")]))
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


def test_full_disk_while_logging_is_one_clear_error_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    """A disk that fills up mid-run: writing metrics fails with one clear line (no traceback through the
    CLI), the last checkpoint stays loadable, and JSON files are replaced whole or not at all."""
    from mxtrain.errors import UserError
    out = tmp_path / "run"
    real_init = TR._Log.__init__

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, s):
            self.n += 1
            if self.n > 3:
                raise OSError(28, "No space left on device")
            return self.f.write(s)

        def __getattr__(self, k):
            return getattr(self.f, k)

    def init(self, *a, **k):
        real_init(self, *a, **k)
        if self.f is not None:
            self.f = Full(self.f)

    monkeypatch.setattr(TR._Log, "__init__", init)
    with pytest.raises(UserError, match=r"cannot write .*metrics.jsonl: No space left on device; the last "
                                         r"checkpoint \(step \d+\) is intact"):
        train(_cfg(out, 8))
    assert ckpt.load(out)["step"] >= 1
    monkeypatch.setattr(TR._Log, "__init__", real_init)
    real_replace = TR.os.replace

    def full_replace(a, b):
        raise OSError(28, "No space left on device")

    before = (out / "config.json").read_text()
    monkeypatch.setattr(TR.os, "replace", full_replace)
    with pytest.raises(UserError, match=r"cannot write .*config.json: No space left"):
        TR._write_json(out / "config.json", {"x": 1})
    monkeypatch.setattr(TR.os, "replace", real_replace)
    assert (out / "config.json").read_text() == before
    assert not list(out.glob(".config.json.tmp-*"))
