"""The step's finite checks made on the device (``train.check_every_step off``, mxtrain.train.stepcheck): the
same bits as the host's checks, no update from the first non-finite step on, the same error one step later,
never a checkpoint after a bad step, and the host check kept wherever a callback reads a step's loss. Run on CPU
with the setting forced off (fused AdamW on CPU takes the same ``found_inf``); CUDA picks it by default."""

import copy
import json

import pytest
import test_callbacks
import torch

from mxtrain.errors import UserError
from mxtrain.study.diagnostics import DiagnosticsCallback
from mxtrain.train import NonFiniteLoss, train
from mxtrain.train import checkpoint as ckpt
from mxtrain.train import trainer as TR
from mxtrain.train.callbacks import Callback
from mxtrain.train.deosc import DeoscCallback
from mxtrain.train.stepcheck import StepChecks

from train_helpers import tiny_run_cfg


def _cfg(out, steps, check, **train_values):
    cfg = tiny_run_cfg(out, steps, **train_values)
    cfg.train.check_every_step = check
    cfg.log.log_every = 3
    return cfg


def _fused_on_host(monkeypatch):
    """The host's checks with the fused AdamW the device's checks use (on CPU the host's default is foreach)."""
    real = TR._optimizer
    monkeypatch.setattr(TR, "_optimizer", lambda model, cfg, fused: real(model, cfg, fused=True))


def _losses(out):
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r and "event" not in r]


class _Weights(Callback):
    """Keeps the model's weights after step ``at`` and at the end; reads no step metrics."""
    reads_step_metrics = False

    def __init__(self, at=None):
        self.at, self.after, self.state = at, None, None

    def on_train_begin(self, state):
        self.state = state

    def on_step_end(self, step, metrics):
        if self.state.cfg.train.check_every_step == "off":
            assert set(metrics) == {"lr", "tokens"}   # nothing that would make the host wait
        if step == self.at:
            self.after = copy.deepcopy(self.state.model.state_dict())

    def now(self):
        return copy.deepcopy(self.state.model.state_dict())


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checks_on_the_device_train_the_bits_of_checks_on_the_host(tmp_path, monkeypatch):
    w = _Weights()
    train(_cfg(tmp_path / "dev", 7, "off"), callbacks=[w])
    dev_w = w.now()
    assert isinstance(w.state.optimizer.found_inf, torch.Tensor) and w.state.optimizer.found_inf.item() == 0
    assert w.state.optimizer.defaults["fused"]
    _fused_on_host(monkeypatch)
    h = _Weights()
    train(_cfg(tmp_path / "host", 7, "on"), callbacks=[h])
    assert getattr(h.state.optimizer, "found_inf", None) is None
    assert _losses(tmp_path / "dev") == _losses(tmp_path / "host")
    assert [s for s, _ in _losses(tmp_path / "dev")] == [1, 3, 6, 7]   # rows read one step late and drained
    _same(dev_w, h.now())
    _same(ckpt.load(tmp_path / "dev")["model"], ckpt.load(tmp_path / "host")["model"])


def _inf_gradient_at(monkeypatch, n):
    real = TR.D.clip_grad_norm_
    calls = []

    def clip(model, max_norm):
        calls.append(1)
        g = real(model, max_norm)
        return g * float("inf") if len(calls) == n else g
    monkeypatch.setattr(TR.D, "clip_grad_norm_", clip)


def test_a_non_finite_gradient_on_the_device_makes_no_update_and_stops_a_step_later(tmp_path, monkeypatch):
    ref = _Weights(at=2)
    train(_cfg(tmp_path / "ref", 8, "off"), callbacks=[ref])
    _inf_gradient_at(monkeypatch, 3)
    w = _Weights()
    out = tmp_path / "run"
    cfg = _cfg(out, 8, "off")
    cfg.log.log_every = 10   # no row at step 3: the record of step 3 is read at the end of step 4
    with pytest.raises(NonFiniteLoss, match=r"gradient norm is inf at step 3; the weights were not updated "
                                            r"\(no checkpoint was written yet\)") as e:
        train(cfg, callbacks=[w])
    assert e.value.step == 3 and e.value.outcome.step == 3
    assert w.state.step == 4            # read one step later: step 4 ran, and made no update either
    _same(w.now(), ref.after)           # the weights of the last good step, not one update more
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "non-finite gradient" and rows[-1]["step"] == 3 and rows[-1]["grad_norm"] == "inf"
    assert rows[-1]["tokens"] == 2 * 4 * 32   # the tokens trained before the step that diverged
    assert not (out / ckpt.NAME).exists()


def test_no_checkpoint_after_a_step_that_was_not_finite(tmp_path, monkeypatch):
    _inf_gradient_at(monkeypatch, 3)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match="gradient norm is inf at step 3"):
        train(_cfg(out, 8, "off", checkpoint_every=1))   # step 3's checkpoint is due at once: checked first
    assert ckpt.load(out)["step"] == 2


def _diverging(out, check):
    cfg = _cfg(out, 8, check)
    cfg.recipe = "bf16"
    cfg.optim.lr = 1e30          # the first update makes the weights ~1e30: a later loss overflows
    cfg.optim.grad_clip = 0.0
    cfg.schedule.warmup_steps = 0
    return cfg


def test_a_diverging_run_ends_alike_with_either_check(tmp_path, monkeypatch):
    with pytest.raises(NonFiniteLoss) as dev:
        train(_diverging(tmp_path / "dev", "off"))
    _fused_on_host(monkeypatch)
    with pytest.raises(NonFiniteLoss) as host:
        train(_diverging(tmp_path / "host", "on"))
    assert str(dev.value) == str(host.value) and dev.value.step == host.value.step > 1
    last = [json.loads((tmp_path / k / "metrics.jsonl").read_text().splitlines()[-1]) for k in ("dev", "host")]
    assert last[0] == last[1] and last[0]["event"] in ("non-finite loss", "non-finite gradient")
    outcome = [json.loads((tmp_path / k / "run.json").read_text())["outcome"] for k in ("dev", "host")]
    assert [o["status"] for o in outcome] == ["diverged"] * 2 and outcome[0]["step"] == outcome[1]["step"]


class _Reads(Callback):
    def on_step_end(self, step, metrics):
        pass


class _ReadsNot(_Reads):
    reads_step_metrics = False


def test_who_checks_where():
    cfg = tiny_run_cfg(None, 2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert cfg.train.check_every_step == "auto"
    assert TR.checks_on_device(cfg, cuda, []) and not TR.checks_on_device(cfg, cpu, [])
    # a callback that reads the step's loss keeps the host's check; the built-in ones do not read it
    assert not TR.checks_on_device(cfg, cuda, [_Reads()])
    assert TR.checks_on_device(cfg, cuda, [_ReadsNot(), DeoscCallback(), DiagnosticsCallback(5), Callback()])
    cfg.train.check_every_step = "off"
    assert TR.checks_on_device(cfg, cpu, [])
    with pytest.raises(UserError, match="callback _Reads reads each step's loss"):
        TR.checks_on_device(cfg, cuda, [_Reads()])
    cfg.train.check_every_step = "on"
    assert not TR.checks_on_device(cfg, cuda, [])


def test_check_every_step_takes_three_values(tmp_path):
    with pytest.raises(UserError, match="train.check_every_step must be auto, on or off, got 'sometimes'"):
        train(_cfg(tmp_path / "r", 2, "sometimes"))


class _SignalAt(test_callbacks._SignalAt):   # its SIGTERM after step ``at``; it reads no step metrics
    reads_step_metrics = False


def test_a_signal_still_checkpoints_at_its_step(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(TR.Interrupted) as e:
        train(_cfg(out, 8, "off"), callbacks=[_SignalAt(4)])
    assert e.value.outcome.step == 4 and ckpt.load(out)["step"] == 4


def test_step_checks_read_a_step_late_and_keep_the_flag():
    c = StepChecks(torch.device("cpu"))
    t = torch.tensor
    c.push(0, 0, t(2.0), t(1.0))
    assert c.ready() == []                                  # the newest step is left to the GPU
    c.push(1, 10, t(float("nan")), t(1.0), vote=t(15.0))
    assert c.found_inf.item() == 1.0
    (r0,) = c.ready()
    assert (r0.step, r0.tokens, r0.loss, r0.grad_norm, r0.vote, r0.finite) == (0, 0, 2.0, 1.0, 0, True)
    c.push(2, 20, t(1.0), t(1.0))
    assert c.found_inf.item() == 1.0                        # sticky: no update after the bad step either
    r1, r2 = c.drain()
    assert (r1.step, r1.finite, r1.vote) == (1, False, 15) and (r2.step, r2.finite) == (2, True)
    assert c.drain() == []
    c.push(3, 30, t(1.0), t(float("inf")))
    c.push(4, 40, t(1.0), t(1.0))
    with pytest.raises(RuntimeError, match="overwritten before it was read"):
        c.push(5, 50, t(1.0), t(1.0))


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _gpu_cfg(out, check, recipe):
    cfg = _cfg(out, 8, check)
    cfg.train.device, cfg.recipe, cfg.train.deterministic = "cuda", recipe, True
    cfg.train.compile = "off"
    return cfg


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["bf16", "mxfp4-all-dh16"])
def test_cuda_checks_on_the_device_are_the_default_and_train_the_same_bits(tmp_path, recipe):
    """On a GPU ``auto`` checks on the device (pinned copies read a step late): the same losses and weights bit
    for bit as the host's checks with the same fused AdamW."""
    _gpu()
    w = _Weights()
    train(_gpu_cfg(tmp_path / "dev", "auto", recipe), callbacks=[w])
    assert isinstance(w.state.optimizer.found_inf, torch.Tensor) and w.state.optimizer.found_inf.is_cuda
    h = _Weights()
    train(_gpu_cfg(tmp_path / "host", "on", recipe), callbacks=[h])
    assert _losses(tmp_path / "dev") == _losses(tmp_path / "host")
    _same(w.now(), h.now())


@pytest.mark.cuda
def test_cuda_a_non_finite_gradient_on_the_device_keeps_the_last_good_weights(tmp_path, monkeypatch):
    _gpu()
    ref = _Weights(at=2)
    train(_gpu_cfg(tmp_path / "ref", "auto", "mxfp4-all-dh16"), callbacks=[ref])
    _inf_gradient_at(monkeypatch, 3)
    w = _Weights()
    cfg = _gpu_cfg(tmp_path / "run", "auto", "mxfp4-all-dh16")
    cfg.log.log_every = 10
    with pytest.raises(NonFiniteLoss, match="gradient norm is inf at step 3; the weights were not updated"):
        train(cfg, callbacks=[w])
    assert w.state.step == 4
    _same(w.now(), ref.after)
