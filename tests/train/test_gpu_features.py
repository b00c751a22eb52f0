"""GPU runs of features first tested on CPU: activation checkpointing of MX layers on the fast path
(``mxtrain.checkpoint``, eager and compiled), a real CUDA out-of-memory error in the trainer, and background
(asynchronous) distributed checkpoints through NCCL on 2 GPUs."""

import json
import os
import subprocess
import sys

import pytest
import torch

import mxtrain

from train_helpers import small_data

pytestmark = pytest.mark.cuda


def _mlp(recipe):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    mxtrain.convert(m, recipe)
    return m


def _grads(m, x, how, compiled):
    """Two calls' gradients (the second draws the next call's bits) of ``m``, checkpointed or not."""
    def body(t):
        return m(t)
    f = torch.compile(body) if compiled else body
    m.zero_grad(set_to_none=True)
    for k in range(2):
        if how == "mxtrain":
            y = mxtrain.checkpoint(f, x[k], layers=m)
        elif how == "plain":
            y = torch.utils.checkpoint.checkpoint(f, x[k], use_reentrant=False)
        else:
            y = f(x[k])
        (y.float().square().mean()).backward()
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["mxfp4-all-sr", "tseng", "mxfp4-all-dh16"])
def test_checkpointed_mx_layers_give_the_same_gradients_on_the_fast_path(recipe, compiled):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 512, 512, device="cuda", generator=g).requires_grad_(False)
    plain = _grads(_mlp(recipe), x, "none", compiled)
    ck = _grads(_mlp(recipe), x, "mxtrain", compiled)
    assert all(torch.equal(a, b) for a, b in zip(plain, ck)), recipe
    if recipe != "mxfp4-all-dh16" and not compiled:   # negative control: plain checkpointing draws other bits
        other = _grads(_mlp(recipe), x, "plain", compiled)
        assert not all(torch.equal(a, b) for a, b in zip(plain, other))


def test_real_cuda_out_of_memory_is_one_line(tmp_path, capsys):
    """The allocator's own OutOfMemoryError (this process limited to a sliver of the GPU) ends the command with
    one line, exit status 1, no traceback."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mxtrain.cli.core import main
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, 0.1 * 2**30 / total), 0)
    try:
        rc = main(["train", "--data", str(small_data()), "--model", "30m", "--steps", "3", "--batch-size", "64",
                   "--seq-len", "64", "--device", "cuda", "--no-progress", "--set", "log.tensorboard=false",
                   "--set", "train.compile=off", "--out", str(tmp_path / "run")])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()
    text = capsys.readouterr().err
    err = [ln for ln in text.splitlines() if ln.startswith("mxtrain: error")]
    assert rc == 1 and "Traceback" not in text, text[-3000:]
    assert len(err) == 1 and "out of GPU memory on cuda" in err[0], err


def test_background_checkpoint_through_nccl_resumes(tmp_path):
    """train.async_checkpoint on 2 GPUs (NCCL for training, a gloo group for the background save): the
    step-4 checkpoint completes, and a run resumed from it follows the uninterrupted run (GPU runs are not
    bit-reproducible: atomics in the embedding's and attention's backward)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    common = ["train", "--data", str(small_data()), "--model", "tiny", "--batch-size", "8", "--seq-len", "64",
              "--device", "cuda", "--no-progress", "--set", "log.tensorboard=false", "--set", "log.log_every=1",
              "--nproc", "2", "--parallel", "fsdp2", "--recipe", "mxfp4-all-dh16", "--steps", "8"]

    def two(*args):
        p = subprocess.run([sys.executable, "-m", "mxtrain", *common, *args], env=env, capture_output=True,
                           text=True, timeout=500)
        assert p.returncode == 0, p.stderr[-4000:]
    a, b = tmp_path / "a", tmp_path / "b"
    two("--out", str(a), "--set", "train.checkpoint_every=4", "--set", "train.async_checkpoint=true",
        "--set", "train.keep_checkpoints_at=4")
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if r.get("event") == "checkpoint"]
    assert [(r["step"], r.get("background", False)) for r in ev] == [(4, True), (8, False)]
    assert (a / "checkpoint-4.dcp" / ".metadata").is_file()
    two("--out", str(b), "--resume", str(a / "checkpoint-4.dcp"))
    ref = [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]
    got = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in got if "loss" in r and "val_loss" not in r]
    assert len(ref) == 8 and len(got) >= 4
    assert max(abs(x - y) for x, y in zip(got[-4:], ref[4:])) < 0.05, (got, ref)
