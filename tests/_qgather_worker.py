"""Worker for tests/linear/test_qgather.py: a tiny transformer-shaped model of MXLinear layers trained a few steps
under FSDP2 with ``gather="high"`` and ``gather="quantized"`` (torchrun, gloo, CPU), several recipes, one
launch. Rank 0 writes ``results.json``: per scenario the losses, a bit-exact digest of the final weights,
the gather report, and how often a shard was quantized.

Run as ``python -m torch.distributed.run --nproc-per-node N tests/_qgather_worker.py OUT_DIR [four]``. ``four``
(for 4 ranks): a model twice as wide (every weight's out-features 128 or more, so that a 4-way row shard is a whole
number of 32-element Dgrad blocks), ``mxfp4-all-dh16`` and ``nvfp4`` only (NVFP4's tensor scale is the amax
all-reduced over the four shards), no checkpoint.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mxtrain
from mxtrain.train import parallel as D
from mxtrain.linear import qgather as Q

FOUR = len(sys.argv) > 2 and sys.argv[2] == "four"
V, C, T, N_LAYERS = 64, 128 if FOUR else 64, 8, 2
GLOBAL_BATCH = 8
ACCUM = 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.w1 = nn.Linear(C, 2 * C)
        self.w2 = nn.Linear(2 * C, C)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.lm_head = nn.Linear(C, V)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for b in self.layers:
            x = b(x)
        return F.cross_entropy(self.lm_head(x).reshape(-1, V).float(), targets.reshape(-1))


# nvfp4 without its high-precision first and last blocks (two blocks here: both would stay nn.Linear)
NVFP4 = mxtrain.numerics.recipes.get("nvfp4").with_(keep_first=0, keep_last=0, name="nvfp4-all-blocks")
# recipe, FSDP2 param_dtype (None: fp32 gathers; bf16: the shard is cast before it is quantized), fused AdamW
SCENARIOS = {
    "mxfp4-all-dh16": ("mxfp4-all-dh16", None, True),
    "mxfp8": ("mxfp8", None, False),
    "nvfp4": (NVFP4, torch.bfloat16, False),
    "fp8": ("fp8", None, False),
}


def build(env, recipe, gather, param_dtype=None, fused=False):
    torch.manual_seed(0)
    model = mxtrain.convert(Toy(), recipe).model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = D.wrap(model, "fsdp2", env, gather=gather, param_dtype=param_dtype)
    said = [str(w.message) for w in caught if "gather='quantized'" in str(w.message)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused or None,
                            foreach=None if fused else True)
    return model, opt, said


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (GLOBAL_BATCH, T + 1), generator=g)


def train(model, opt, env, start, steps, save=None):
    micro = D.local_batch_size(GLOBAL_BATCH, ACCUM, env.world_size)
    losses = []
    for step in range(start, steps):
        tokens = batch(step)
        total = 0.0
        for k in range(ACCUM):
            lo = (k * env.world_size + env.rank) * micro
            chunk = tokens[lo:lo + micro]
            mxtrain.set_step(model, step, call=k * env.world_size + env.rank)
            with D.grad_sync(model, k == ACCUM - 1):
                loss = model(chunk[:, :-1], chunk[:, 1:]) / ACCUM
                loss.backward()
            total += loss.item()
        D.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(D.all_reduce_sum(torch.tensor(total, dtype=torch.float64)).item())
        if save is not None and step + 1 == save[0]:
            D.save_checkpoint(save[1], model, opt, extra={"step": step + 1}, env=env)
    return losses


def digest(model) -> str:
    """SHA-256 of every parameter's bytes (the full tensors, gathered), in name order: equal digests, equal bits."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k]
        if torch.is_tensor(v):
            assert type(v) is torch.Tensor, (k, type(v))
            h.update(k.encode())
            h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_COUNT = [0]
_shard_operands = Q.shard_operands


def _counting(*a, **k):
    _COUNT[0] += 1
    return _shard_operands(*a, **k)


Q.shard_operands = _counting


def scenario(env, recipe, gather, param_dtype=None, fused=False, steps=3, save=None, resume=None):
    model, opt, said = build(env, recipe, gather, param_dtype, fused)
    start = 0
    if resume is not None:
        start = D.load_checkpoint(resume, model, opt, env=env)["step"]
    _COUNT[0] = 0
    losses = train(model, opt, env, start, steps, save)
    rep = D.gather_report(model)
    types = sorted({type(p.to_local()).__name__ for p in model.parameters()})
    return {"losses": losses, "digest": digest(model), "said": said, "quantizations": _COUNT[0],
            "quantized": rep.quantized if rep else None, "high": rep.high if rep else None, "local_types": types}


def suite(out: Path):
    env = D.init("cpu")
    res = {}
    ck = str(out / "ck")
    if FOUR:
        for key in ("mxfp4-all-dh16", "nvfp4"):
            r, dt, fused = SCENARIOS[key]
            for gather in ("high", "quantized"):
                res[f"{key}:{gather}"] = scenario(env, r, gather, dt, fused)
        if env.is_rank0:
            (out / "results.json").write_text(json.dumps(res))
        D.shutdown()
        return
    for key, (r, dt, fused) in SCENARIOS.items():
        for gather in ("high", "quantized"):
            # (the first one also writes a DCP checkpoint at step 2: model and fused AdamW state)
            save = (2, ck) if key == "mxfp4-all-dh16" and gather == "quantized" else None
            t0 = time.perf_counter()
            res[f"{key}:{gather}"] = scenario(env, r, gather, dt, fused, save=save)
            print(f"[rank {env.rank}] {key}:{gather} {time.perf_counter() - t0:.2f}s", file=sys.stderr, flush=True)
    # resumed for step 3, under either gather
    for gather in ("high", "quantized"):
        res[f"resume:{gather}"] = scenario(env, "mxfp4-all-dh16", gather, None, True, resume=ck)
    # bytes one all-gather assembles, both modes (the model as built, before wrapping)
    m = mxtrain.convert(Toy(), "mxfp4-all-dh16").model
    res["bytes"] = {g: Q.all_gather_bytes(m, env.world_size, g) for g in ("high", "quantized")}
    if env.is_rank0:
        (out / "results.json").write_text(json.dumps(res))
    D.shutdown()


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)
    suite(Path(sys.argv[1]))
