"""The rate each GPU's FSDP2 collectives reach: all-gather (bf16) and reduce-scatter (float32) of one tensor across
the ranks of ``torchrun``, timed after warm-up, reported as the bytes each rank receives a second ((G - 1) / G of
the whole tensor over the time, a ring's traffic), the quantity ``mxtrain bench limits --gpus N`` prices with
``--rates link_gbs=...``. Sizes default to the 1B model's largest FSDP2 group (a block of 1B, about 0.1 G
parameters: 200 MB in bf16).

    torchrun --nproc-per-node 2 tools/link_rate.py [--mib 200] [--iters 20] [--out link.json]

On CUDA (NCCL) the tensors live on each rank's GPU; without a GPU the ranks use gloo on the CPU (a smoke test of
the tool, not a link rate). Rank 0 prints one line per collective and writes ``--out``.
"""
import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--mib", type=float, default=200.0, help="size of the gathered (whole) tensor in MiB, bf16")
ap.add_argument("--iters", type=int, default=20, help="timed calls of each collective (after 3 warm-up calls)")
ap.add_argument("--out", default=None, help="rank 0 writes the results here (JSON)")
args = ap.parse_args()
# (torch 2.13 calls all_gather_into_tensor and reduce_scatter_tensor deprecated; they are what FSDP2 runs on the
# torch versions mxtrain supports, so they are what is timed)
warnings.filterwarnings("ignore", category=FutureWarning)

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(dev)


def sync():
    if cuda:
        torch.cuda.synchronize(dev)
    dist.barrier()


def timed(fn) -> float:
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(args.iters):
        fn()
    sync()
    return (time.perf_counter() - t) / args.iters


rows = []
n = int(args.mib * 2**20 / 2) // world * world        # bf16 elements of the whole tensor, a multiple of the ranks
for what, dtype in (("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)):
    whole = torch.zeros(n, dtype=dtype, device=dev)
    shard = torch.ones(n // world, dtype=dtype, device=dev)
    if what == "all_gather":
        s = timed(lambda: dist.all_gather_into_tensor(whole, shard))
    else:
        s = timed(lambda: dist.reduce_scatter_tensor(shard, whole))
    received = whole.numel() * whole.element_size() * (world - 1) / world
    rows.append({"collective": what, "dtype": str(dtype).replace("torch.", ""), "ranks": world,
                 "bytes_whole": whole.numel() * whole.element_size(), "ms": s * 1e3,
                 "received_gbs": received / s / 1e9, "backend": dist.get_backend()})
    if rank == 0:
        r = rows[-1]
        print(f"{what:<15}{r['dtype']:<9}{r['bytes_whole'] / 1e6:9.1f} MB  {r['ms']:8.3f} ms  "
              f"{r['received_gbs']:8.1f} GB/s received per rank ({world} ranks, {r['backend']})", flush=True)
if rank == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                   "torch": torch.__version__}, f, indent=1)
dist.destroy_process_group()
