"""train.checkpoint_blocks (train.parallel.apply_ac, Block.checkpoint): full activation checkpointing. The block keeps only its
input and runs its forward again in the backward; the recomputation draws the random inputs the first forward
drew (stochastic rounding, per-step signs), so gradients and losses are those without checkpointing."""

import json

import pytest
import torch

import mxtrain
from mxtrain.model.llama import Llama, ModelConfig
from mxtrain.train import experiments, train
from mxtrain.train.parallel import apply_ac

from train_helpers import small_data


def _model(recipe, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=96, max_seq_len=32)
    m = Llama(cfg)
    mxtrain.convert(m, recipe)
    return m


def _step(m, idx, tgt, checkpoint, compiled=False):
    """Two micro-steps' gradients (the second sees the call counters the first advanced) and the bytes the
    forward kept for the backward."""
    apply_ac(m, checkpoint_blocks=checkpoint)
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t
    m.zero_grad(set_to_none=True)
    for k in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = m(idx[k], tgt[k])
        loss.backward()
    return [p.grad.clone() for p in m.parameters()], kept[0]


@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "tseng", "mxfp4-all-sr", "bf16"])
def test_eager_checkpointing_gives_the_same_gradients_and_keeps_less(recipe):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 96, (2, 4, 32), generator=g)
    tgt = torch.randint(0, 96, (2, 4, 32), generator=g)
    plain, kept_plain = _step(_model(recipe), idx, tgt, False)
    ckpt, kept_ckpt = _step(_model(recipe), idx, tgt, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))       # bit for bit, stochastic rounding included
    assert kept_ckpt < kept_plain / 2


def test_without_putting_the_counters_back_stochastic_rounding_would_differ(monkeypatch):
    """The test above can fail: recomputing with the call counters left advanced draws other bits."""
    from mxtrain.train import parallel as N   # (apply_ac's blocks call mxtrain.linear.module.checkpoint as mx_checkpoint)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 96, (2, 4, 32), generator=g)
    tgt = torch.randint(0, 96, (2, 4, 32), generator=g)
    plain, _ = _step(_model("mxfp4-all-sr"), idx, tgt, False)
    real = N.mx_checkpoint

    def forgetful(fn, *args, layers, **kw):   # plain checkpointing: the recomputation advances the counters again
        import torch.nn as tnn
        return real(fn, *args, layers=tnn.Module(), **kw)
    monkeypatch.setattr(N, "mx_checkpoint", forgetful)
    ckpt, _ = _step(_model("mxfp4-all-sr"), idx, tgt, True)
    assert not all(torch.equal(a, b) for a, b in zip(plain, ckpt))


def _compiled(recipe, idx, tgt, ck):
    torch._dynamo.reset()
    m = _model(recipe)
    for b in m.layers:
        b.compile()
    return _step(m, idx, tgt, ck)


@pytest.mark.parametrize("recipe", ["mxfp4-all-dh16", "tseng"])
def test_compiled_checkpointing_gives_the_same_gradients_and_keeps_less(recipe):
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 96, (2, 4, 32), generator=g)
    tgt = torch.randint(0, 96, (2, 4, 32), generator=g)
    (plain, kept_plain), (ckpt, kept_ckpt) = (_compiled(recipe, idx, tgt, ck) for ck in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt))
    assert kept_ckpt < kept_plain / 2


def test_compiled_without_keeping_the_seeds_stochastic_rounding_would_differ(monkeypatch):
    """The policy's one kept operation is what makes the compiled test above pass for stochastic rounding."""
    from torch.utils.checkpoint import CheckpointPolicy
    from mxtrain.linear import module as N
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 96, (2, 4, 32), generator=g)
    tgt = torch.randint(0, 96, (2, 4, 32), generator=g)
    plain, _ = _compiled("mxfp4-all-sr", idx, tgt, False)
    monkeypatch.setattr(N, "_checkpoint_policy", lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    ckpt, _ = _compiled("mxfp4-all-sr", idx, tgt, True)
    assert not all(torch.equal(a, b) for a, b in zip(plain, ckpt))


def test_trainer_setting_trains_the_same(tmp_path):
    def cfg(out, on):
        c = experiments.get("debug")
        c.recipe = "tseng"
        c.data.path = str(small_data())
        c.data.seq_len = 32
        c.train.batch_size, c.train.micro_batch_size, c.train.steps = 4, 2, 5
        c.train.checkpoint_blocks = on
        c.schedule.horizon_steps = 5
        c.log.out, c.log.progress, c.log.tensorboard, c.log.log_every = str(out), False, False, 1
        return c

    def losses(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r and "val_loss" not in r]
    assert losses(train(cfg(tmp_path / "a", False))) == losses(train(cfg(tmp_path / "b", True)))


def test_with_cuda_graphs_refused_up_front(tmp_path):
    from mxtrain.errors import UserError
    c = experiments.get("debug")
    c.data.path = str(small_data())
    c.log.out = str(tmp_path / "x")
    c.train.checkpoint_blocks = c.train.cuda_graphs = True
    with pytest.raises(UserError, match="checkpoint_blocks and train.cuda_graphs"):
        train(c)
    assert not (tmp_path / "x").exists()
