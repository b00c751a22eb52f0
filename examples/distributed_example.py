"""mxtrain in your own data-parallel training loop: a Hugging Face Llama converted with ``mxtrain.convert``,
sharded with FSDP2 (or wrapped in DDP) by you, trained by your loop (docs/library.md, "Several GPUs").

    torchrun --standalone --nproc-per-node 2 examples/distributed_example.py --parallel fsdp2 --recipe tseng
    python examples/distributed_example.py --recipe tseng --accum 2      # one process, the same global batch

Each rank takes the micro-batches ``k * N + r`` of every global batch, and before its micro-step ``k`` tells
mxtrain so (``set_step(model, step, call=k * N + r)``): its stochastic rounding then draws what one process
with gradient accumulation draws for that micro-batch, so the two commands above print the same losses (within
float rounding). Runs on GPUs (NCCL) or CPUs (gloo); ``--out losses.json`` writes the losses.
"""

import argparse
import contextlib
import gc
import json
import os

import torch
import torch.distributed as dist
import transformers

import mxtrain


def batch(step: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """The global batch of ``step`` (rows x seq token ids), the same on every rank: a learnable toy
    language (t[i+1] = 5 t[i] + 3 mod vocab) with 1 token in 8 replaced by noise."""
    g = torch.Generator().manual_seed(1000 + step)
    t = [torch.randint(0, vocab, (rows, 1), generator=g)]
    for _ in range(seq - 1):
        t.append((t[-1] * 5 + 3) % vocab)
    t = torch.cat(t, 1)
    return torch.where(torch.rand(t.shape, generator=g) < 0.125, torch.randint(0, vocab, t.shape, generator=g), t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="mxfp4-all-dh16")
    ap.add_argument("--parallel", choices=["fsdp2", "ddp"], default="fsdp2", help="under torchrun")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences a step, all ranks)")
    ap.add_argument("--accum", type=int, default=1, help="micro-steps per rank and step")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (torchtitan's way)")
    ap.add_argument("--convert-late", action="store_true", help="convert after sharding or wrapping (the same)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    # the model, its optimizer and every tensor of its last graph live in train() and are gone when it returns:
    # a sharded or wrapped model still alive when the process group is destroyed (or at interpreter exit) can
    # abort the process after a finished run (gloo: "terminate called without an active exception")
    losses = train(a, world, rank, device, cuda)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"recipe": a.recipe, "world": world, "parallel": a.parallel if world > 1 else "none",
                       "losses": losses}, f)
    if world > 1:
        gc.collect()   # (modules in reference cycles, e.g. DDP's hooks, go now)
        dist.destroy_process_group()


def train(a, world: int, rank: int, device: torch.device, cuda: bool) -> list:
    """Build, convert, shard or wrap and train the model; the losses of every step."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=a.seq)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    if not a.convert_late:
        report = mxtrain.convert(model, a.recipe)
        if rank == 0:
            print(report, flush=True)
    if a.compile:   # before sharding or wrapping, as torchtitan does; MX layers are custom ops in the graphs
        for layer in model.model.layers:
            layer.compile()
    if world > 1 and a.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if not cuda:   # gloo's reduce-scatter returned the sum for an average on torch 2.8 (pytorch#162338):
            for m in (*model.model.layers, model):   # sum, and FSDP2 divides by the world size itself
                m.set_force_sum_reduction_for_comms(True)
    elif world > 1:
        # convert keeps the MX layers' states out of DDP's buffer broadcast (each rank numbers its own calls)
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    if a.convert_late:   # FSDP2's sharded layers convert as they are (DDP: convert the module it wraps)
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        report = mxtrain.convert(inner, a.recipe)
        if rank == 0:
            print(report, flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=cuda)

    micro = a.batch // (world * a.accum)
    losses = []
    for step in range(a.steps):
        tokens = batch(step, a.batch, a.seq, cfg.vocab_size)
        total = torch.zeros((), device=device)
        for k in range(a.accum):
            g = k * world + rank                              # this micro-batch's index in the global batch
            mxtrain.set_step(model, step, call=g)            # the random draws one process gives it
            x = tokens[g * micro:(g + 1) * micro].to(device)
            last = k == a.accum - 1                           # gradients are reduced over ranks once a step
            if world > 1 and a.parallel == "fsdp2":
                model.set_requires_gradient_sync(last)
            quiet = world > 1 and a.parallel == "ddp" and not last
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss = model(input_ids=x, labels=x).loss / a.accum   # the model shifts the labels itself
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.6f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
