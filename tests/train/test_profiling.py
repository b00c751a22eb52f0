"""log.profile_steps (torch.profiler over chosen steps, per rank) and train.gc_every (Python's collector in
step across ranks): settings checked up front, files written, training unchanged."""

import gc
import gzip
import json

import pytest

from mxtrain.errors import UserError
from mxtrain.train import experiments, train
from mxtrain.train import profiling

from train_helpers import small_data


def _cfg(out, steps=6, recipe=None):
    cfg = experiments.get("debug")
    cfg.recipe = recipe or cfg.recipe
    cfg.data.path = str(small_data())
    cfg.data.seq_len = 32
    cfg.train.batch_size = 4
    cfg.train.steps = steps
    cfg.schedule.horizon_steps = steps
    cfg.log.out, cfg.log.progress, cfg.log.tensorboard = str(out), False, False
    cfg.log.eval_every, cfg.log.eval_tokens, cfg.log.log_every = 100, 128, 1
    return cfg


def _losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]


@pytest.mark.parametrize("text,want", [(None, None), ("off", None), ("3", (3, 3)), ("2-5", (2, 5)),
                                       (" 1-6 ", (1, 6))])
def test_parse_steps(text, want):
    assert profiling.parse_steps(text, 6) == want


@pytest.mark.parametrize("text,says", [("a-b", "step range like 20-25"), ("0-2", "1 <= A <= B"),
                                       ("4-2", "1 <= A <= B"), ("5-7", "past train.steps (6)")])
def test_parse_steps_refuses_what_it_cannot_profile(text, says):
    with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")):
        profiling.parse_steps(text, 6)


def test_bad_settings_stop_before_training(tmp_path):
    cfg = _cfg(tmp_path / "a")
    cfg.log.profile_steps = "5-9"
    with pytest.raises(UserError, match="past train.steps"):
        train(cfg)
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    cfg = _cfg(tmp_path / "b")
    cfg.train.gc_every = -1
    with pytest.raises(UserError, match="train.gc_every"):
        train(cfg)


def test_profiled_and_gc_steps_train_the_same_and_write_the_profile(tmp_path):
    # bf16: profiling and the collector do not depend on the recipe (the debug experiment's mxfp4-all-dh16 has no
    # random state either), and a profiled MXFP4 step records thousands of small CPU operators of the reference
    # quantizer (as in tests/bench/test_llama8b_script.py); equal losses are compared bit for bit either way
    plain = train(_cfg(tmp_path / "plain", recipe="bf16"))
    cfg = _cfg(tmp_path / "prof", recipe="bf16")
    cfg.log.profile_steps = "2-4"
    cfg.train.gc_every = 2
    was = gc.isenabled()
    prof = train(cfg)
    assert gc.isenabled() == was                      # the collector is handed back as it was
    assert _losses(prof) == _losses(plain)            # neither changes a bit of training
    d = prof / profiling.PROFILE_DIR
    trace = json.loads(gzip.open(d / "rank0.json.gz").read())
    assert trace["traceEvents"]                       # a Chrome/Perfetto trace with events in it
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("mm" in n or "linear" in n for n in names)
    text = (d / "rank0.txt").read_text()
    assert "steps 2-4" in text and "by self time on the host" in text
    walls = text.split("wall time of each profiled step (s): ")[1].splitlines()[0]
    assert [int(w.split(":")[0]) for w in walls.split(", ")] == [2, 3, 4]
    assert not (d / "rank0.json").exists()            # only the compressed trace stays
    summ = json.loads((d / "summary-rank0.json").read_text())
    assert summ["steps"] == [2, 4] and len(summ["step_wall_s"]) == 3 and summ["device_self_s_per_step"] is None
    assert 0 < summ["host_self_s_per_step"] < 10 * max(summ["step_wall_s"])


def test_garbage_collection_schedule(monkeypatch):
    calls = []
    monkeypatch.setattr(profiling.gc, "collect", lambda gen=2: calls.append(gen))
    was = gc.isenabled()
    g = profiling.GarbageCollection(3)
    try:
        assert not gc.isenabled()
        calls.clear()
        for done in range(1, 121):
            g.step(done)
    finally:
        g.close()
    assert gc.isenabled() == was
    assert len(calls) == 40 and calls.count(2) == 2   # every 3rd step; the oldest generation every 60th
    off = profiling.GarbageCollection(0)
    assert gc.isenabled() == was
    off.step(3)
    off.close()


@pytest.mark.cuda
def test_gpu_profile_has_device_times(tmp_path):
    """On a GPU the report also ranks operators by their self time on the device, and the trace holds
    kernel events."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = _cfg(tmp_path / "g", steps=4)
    cfg.train.device = "cuda"
    cfg.log.profile_steps = "3-4"
    run = train(cfg)
    d = run / profiling.PROFILE_DIR
    assert "by self time on the device" in (d / "rank0.txt").read_text()
    summ = json.loads((d / "summary-rank0.json").read_text())
    assert summ["device_self_s_per_step"] > 0 and summ["host_self_s_per_step"] > 0
    trace = json.loads(gzip.open(d / "rank0.json.gz").read())
    assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])


def test_out_of_gpu_memory_is_one_line_with_what_to_change(tmp_path, monkeypatch, capsys):
    """A CUDA out-of-memory error in training (raised here on CPU in the loss, as torch raises it) ends the
    command with one line that names the step and the settings that need less memory, exit status 1, and the
    run's outcome recorded as failed."""
    import torch
    from mxtrain.cli.core import main
    from mxtrain.model.llama import Llama
    real = Llama.forward
    calls = []

    def forward(self, idx, targets=None):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total "
                                         "capacity of 79.19 GiB of which 1.2 GiB is free.")
        return real(self, idx, targets)
    monkeypatch.setattr(Llama, "forward", forward)
    out = tmp_path / "run"
    rc = main(["train", "--data", str(small_data()), "--model", "tiny", "--steps", "5", "--batch-size", "2",
               "--seq-len", "32", "--no-progress", "--set", "log.tensorboard=false", "--out", str(out)])
    text = capsys.readouterr().err
    err = [ln for ln in text.splitlines() if ln.startswith("mxtrain: error")]
    assert rc == 1 and "Traceback" not in text
    assert len(err) == 1 and err[0].startswith("mxtrain: error: out of GPU memory on cpu in step 3")
    assert "--micro-batch-size" in err[0] and "train.recompute_ffn=true" in err[0] and "--seq-len (now 32)" in err[0]
    outcome = json.loads((out / "run.json").read_text())["outcome"]
    assert outcome["status"] == "failed" and outcome["step"] == 2


def test_profile_before_the_resumed_step_is_said_not_silently_skipped(tmp_path, capsys):
    run = train(_cfg(tmp_path / "r", steps=3))
    cfg = _cfg(tmp_path / "r", steps=6)
    cfg.log.profile_steps = "2-5"
    train(cfg, resume=run)
    assert "nothing is profiled" in capsys.readouterr().out
    assert not (run / profiling.PROFILE_DIR).exists()
