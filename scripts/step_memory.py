"""Peak GPU memory and time of a full training step (embedding, Llama-8B-shaped blocks, head, loss, fused
AdamW), the whole model under torch.compile, per recipe, in one process (GPU). ``torchao-tensorwise`` and
``torchao-rowwise`` convert the blocks' linear layers with torchao's float8 training (when installed).

    python scripts/step_memory.py --layers 4 --batch 4 --seq 4096 bf16 torchao-tensorwise mxfp4-all-dh16
"""

import argparse
import json
import time

import torch

from mxtrain import convert
from mxtrain.model import Llama, ModelConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipes", nargs="*", default=["bf16", "mxfp4-all-dh16"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--compile", default="default", help="torch.compile mode, or 'none'")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers, "batch": a.batch,
           "seq": a.seq, "compile": a.compile, "runs": {}}
    idx = torch.randint(0, 128256, (a.batch, a.seq + 1), device=dev, generator=torch.Generator(dev).manual_seed(0))
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    for rec in a.recipes:
        torch.manual_seed(0)
        m = Llama(ModelConfig.named("llama3-8b", n_layers=a.layers), device=dev)
        if rec.startswith("torchao-"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(rec.split("-", 1)[1]),
                                       module_filter_fn=lambda mod, fqn: fqn.startswith("layers."))
        elif rec != "bf16":
            convert(m, rec)
        f = m if a.compile == "none" else torch.compile(m, mode=None if a.compile == "default" else a.compile)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        times = []
        peak = 0
        for s in range(a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(x, y)
            held = torch.cuda.memory_allocated() - before   # what the forward keeps for the backward
            phases = [torch.cuda.max_memory_allocated()]
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            phases.append(torch.cuda.max_memory_allocated())
            bwd_peak = phases[-1] - before - held
            torch.cuda.reset_peak_memory_stats()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            phases.append(torch.cuda.max_memory_allocated())
            peak = max(peak, *phases)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * sorted(times[2:])[len(times[2:]) // 2]
        res["runs"][rec] = {"ms": ms, "peak_gib": peak / 2**30, "forward_held_gib": held / 2**30,
                            "backward_extra_gib": bwd_peak / 2**30, "loss": loss.item()}
        print(rec, res["runs"][rec], flush=True)
        del m, f, opt, loss
        torch.cuda.empty_cache()
    bf = res["runs"].get("bf16")
    for k, v in res["runs"].items():
        if bf:
            v["speed_vs_bf16"] = bf["ms"] / v["ms"]
            v["memory_vs_bf16"] = v["peak_gib"] / bf["peak_gib"]
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
