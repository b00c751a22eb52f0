"""Worker for tests/train/test_distributed.py: a toy transformer-shaped model of MXLinear layers trained on
deterministic synthetic batches, under 1 process or ``torchrun`` (gloo, CPU) with DDP or FSDP2.

Run as ``python -m torch.distributed.run --nproc-per-node 2 tests/_dist_worker.py OUT_DIR [REF_DIR]``
(the "suite" of 2-rank scenarios) or import ``run_scenario`` for the 1-process reference.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mxtrain
from mxtrain.train import parallel as D
from mxtrain.linear.module import MXLinear

V, C, T, N_LAYERS = 128, 64, 16, 2
GLOBAL_BATCH = 8
RECIPE = "mxfp4-all-dh16"
# every preset under DDP and FSDP2 but those that add no distributed behaviour to one already run (CI time):
# mxfp4-all-dh16-fprop (mxfp4-all-dh16's deterministic rotation, on one GEMM), mxfp4-all-dh32 (the same, 32 wide),
# mxfp4-all-bf16last (mxfp4-all plus keep_last, which nvfp4 runs; no random stream of its own), and the subsets
# of mxfp4-all's GEMMs (mxfp4-fprop, -fprop-dgrad, -dgrad, -wgrad, -bwd: the same operands, fewer of them, all
# round to nearest; mxfp4-bwd-sr stays for its random stream on the backward GEMMs alone)
DIST_RECIPES = [r for r in mxtrain.numerics.recipes.names()
                if r not in ("mxfp4-all-dh16-fprop", "mxfp4-all-dh32", "mxfp4-all-bf16last", "mxfp4-fprop",
                             "mxfp4-fprop-dgrad", "mxfp4-dgrad", "mxfp4-wgrad", "mxfp4-bwd")]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.w1 = nn.Linear(C, 2 * C)
        self.w2 = nn.Linear(2 * C, C)

    def forward(self, x):  # (B, T, C)
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.lm_head = nn.Linear(C, V)

    def forward(self, idx, targets):  # idx (B, T) -> mean cross-entropy
        x = self.embed_tokens(idx)
        for b in self.layers:
            x = b(x)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1))


def build(mode: str, env: D.DistEnv, recipe: str = RECIPE):
    torch.manual_seed(0)
    model = mxtrain.convert(Toy(), recipe).model
    model = D.wrap(model, mode, env)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def global_batch(step: int) -> torch.Tensor:
    """The global batch of ``step``: (GLOBAL_BATCH, T + 1) tokens, the same for any world size."""
    g = torch.Generator().manual_seed(1000 + step)
    # learnable: t[i+1] = (5 t[i] + 3) mod V from a random start, with 1 token in 8 replaced by noise
    start = torch.randint(0, V, (GLOBAL_BATCH, 1), generator=g)
    seq = [start]
    for _ in range(T):
        seq.append((seq[-1] * 5 + 3) % V)
    tokens = torch.cat(seq, 1)
    noise = torch.randint(0, V, tokens.shape, generator=g)
    return torch.where(torch.rand(tokens.shape, generator=g) < 0.125, noise, tokens)


def train(model, opt, env, start: int, steps: int, accum: int, save_at: int | None = None,
          save_dir: str | None = None, capture: dict | None = None) -> list[float]:
    micro = D.local_batch_size(GLOBAL_BATCH, accum, env.world_size)
    losses = []
    for step in range(start, steps):
        mxtrain.set_step(model, step)
        tokens = global_batch(step)
        for k in range(accum):
            # micro-batch k of this rank: rows [(k * world + rank) * micro, ... + micro)
            lo = (k * env.world_size + env.rank) * micro
            chunk = tokens[lo:lo + micro]
            # the call number one process gives that micro-batch: its stochastic rounding draws
            mxtrain.set_step(model, step, call=k * env.world_size + env.rank)
            with D.grad_sync(model, k == accum - 1):
                loss = model(chunk[:, :-1], chunk[:, 1:]) / accum
                loss.backward()
            if k == 0:
                total = loss.detach()
            else:
                total = total + loss.detach()
        D.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(D.all_reduce_sum(total).item() / env.world_size)
        if capture is not None:
            capture["done"] = True  # keep only the first step's capture
        if save_at is not None and step + 1 == save_at:
            D.save_checkpoint(save_dir, model, opt, extra={"step": step + 1}, env=env)
            if not env.distributed:  # also the single-process trainer's format: plain state dicts
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1},
                           save_dir + ".pt")
    return losses


def add_capture_hooks(model, capture: dict):
    """Record, at the first forward of every MXLinear, the weight it sees (type, shape) and its
    fprop-quantized value computed exactly as MXLinear.forward computes it (same ``Ctx``)."""
    def hook(m, args):
        if capture.get("done"):
            return
        w = m.weight
        q = m.call_context(last=False)
        wq, _ = q.operand(w, -1, "fprop_w", "fprop", q.signs("fprop", w.device))
        capture[f"layer{m.layer_id}"] = {"type": type(w.data).__name__, "shape": list(w.shape), "wq": wq.detach().clone()}
    for _, m in mxtrain.linear.module.mx_layers(model):
        m.register_forward_pre_hook(hook)


def full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def run_scenario(name: str, mode: str, env: D.DistEnv, out: Path, *, accum=1, steps=20, save_at=None,
                 resume: str | None = None, capture=False, recipe: str = RECIPE) -> dict:
    if env.distributed:  # where each rank was, should the launch fail
        print(f"[rank {env.rank}] {name}", file=sys.stderr, flush=True)
    model, opt = build(mode, env, recipe)
    start = 0
    if resume and resume.endswith(".pt"):
        st = torch.load(resume, weights_only=True)
        D.load_full_state(model, opt, st["model"], st["optimizer"])
        start = st["step"]
    elif resume:
        start = D.load_checkpoint(resume, model, opt, env=env)["step"]
    cap = {} if capture else None
    if capture:
        add_capture_hooks(model, cap)
    save_dir = str(out / f"ck_{name}") if save_at else None
    res = {"losses": train(model, opt, env, start, steps, accum, save_at, save_dir, cap)}
    sd = full_state(model)
    if env.is_rank0:
        res["state_sum"] = float(sum(v.double().sum() for v in sd.values() if torch.is_tensor(v)))
    if capture:
        torch.save(cap, out / f"wq_{name}_rank{env.rank}.pt")
    return res


def grad_vs_one_process(env: D.DistEnv) -> dict:
    """The gradient FSDP2 hands the optimizer against one process's, before clipping (a clipped gradient has norm
    1 whatever its scale, which is how a sum-for-mean reduction once passed for ulps): step 0's global batch, each
    rank its rows under FSDP2 (no accumulation), and on every rank a plain copy of the model accumulating the
    ranks' micro-batches as one process does. Returns the ratio of the gradient norms and the largest difference
    relative to each parameter's largest gradient."""
    torch.manual_seed(0)
    ref = Toy()
    torch.manual_seed(0)
    model = D.wrap(Toy(), "fsdp2", env)
    tokens = global_batch(0)
    micro = GLOBAL_BATCH // env.world_size
    for r in range(env.world_size):
        chunk = tokens[r * micro:(r + 1) * micro]
        (ref(chunk[:, :-1], chunk[:, 1:]) / env.world_size).backward()
    chunk = tokens[env.rank * micro:(env.rank + 1) * micro]
    model(chunk[:, :-1], chunk[:, 1:]).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    want = {n: p.grad for n, p in ref.named_parameters()}
    assert got.keys() == want.keys()
    norm = lambda gs: float(sum(g.double().square().sum() for g in gs.values()) ** 0.5)  # noqa: E731
    return {"norm_ratio": norm(got) / norm(want),
            "max_rel": max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)}


def suite(out: Path, ref: Path):
    """The 2-rank scenarios, run in one torchrun launch (process start-up is most of the cost)."""
    env = D.init("cpu")
    results = {
        "grad_vs_one_process": grad_vs_one_process(env),
        "ddp": run_scenario("ddp", "ddp", env, out, save_at=10),
        "ddp_accum2": run_scenario("ddp_accum2", "ddp", env, out, accum=2),
        "fsdp2": run_scenario("fsdp2", "fsdp2", env, out, save_at=10, capture=True),
        "fsdp2_accum2": run_scenario("fsdp2_accum2", "fsdp2", env, out, accum=2),
        # same world size: resume from our own step-10 checkpoints
        "ddp_resume_ddp": run_scenario("ddp_resume_ddp", "ddp", env, out, resume=str(out / "ck_ddp")),
        "fsdp2_resume_fsdp2": run_scenario("fsdp2_resume_fsdp2", "fsdp2", env, out, resume=str(out / "ck_fsdp2")),
        # across world sizes and modes: 1 process wrote it (micro-batch 4, 2 accumulation steps), 2 ranks read it
        "ddp_resume_single": run_scenario("ddp_resume_single", "ddp", env, out, resume=str(ref / "ck_single")),
        "fsdp2_resume_single": run_scenario("fsdp2_resume_single", "fsdp2", env, out, resume=str(ref / "ck_single")),
        # a plain torch.save checkpoint of one process (the single-process trainer's format)
        "fsdp2_resume_plain": run_scenario("fsdp2_resume_plain", "fsdp2", env, out, resume=str(ref / "ck_single.pt")),
        "ddp_resume_plain": run_scenario("ddp_resume_plain", "ddp", env, out, resume=str(ref / "ck_single.pt")),
    }
    # the float reductions of logging: rank r contributes r + 1
    results["reductions"] = {"max": D.reduce_max(env.rank + 1.0), "mean": D.reduce_mean(env.rank + 1.0),
                             "sums": D.reduce_sums(env.rank + 1.0, 10.0)}
    # evaluation with fewer batches than ranks: rank 0 has none, rank 1 two; rank 0 runs the padding batch twice
    results["even_pad"] = [list(bw) for bw in D.even_batches([] if env.rank == 0 else ["a", "b"], pad=lambda: "pad")]
    # every recipe under both modes: 3 steps each
    for r in DIST_RECIPES:
        for mode in ("ddp", "fsdp2"):
            results[f"recipe:{r}:{mode}"] = run_scenario(f"{r}_{mode}", mode, env, out, steps=3, recipe=r)
    if env.is_rank0:
        (out / "results.json").write_text(json.dumps(results))
    print(f"[rank {env.rank}] all scenarios done", file=sys.stderr, flush=True)
    D.shutdown()
    print(f"[rank {env.rank}] process group destroyed", file=sys.stderr, flush=True)


if __name__ == "__main__":
    # A crash inside torch's C++ (an abort, a segfault) prints every Python thread's stack to stderr,
    # which the test shows when the launch fails.
    faulthandler.enable(all_threads=True)
    suite(Path(sys.argv[1]), Path(sys.argv[2]))
