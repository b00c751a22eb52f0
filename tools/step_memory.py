"""Peak GPU memory and time of a full training step (embedding, Llama-8B-shaped blocks, head, loss, fused
AdamW), the whole model under torch.compile, per recipe, in one process (GPU). ``torchao-tensorwise`` and
``torchao-rowwise`` convert the blocks' linear layers with torchao's float8 training (when installed).

    python tools/step_memory.py --layers 4 --batch 4 --seq 4096 bf16 torchao-tensorwise mxfp4-all-dh16

``--peak-report N``: record the allocator's history over the last step and print, for each recipe, what
was alive at that step's peak, grouped by the line that allocated it (the top N lines; for compiled code,
the line of the generated graph and its source text), so that two recipes' peaks can be compared by content.
"""

import argparse
import collections
import json
import linecache
import time

import torch

from mxtrain import convert, settings
from mxtrain.model.llama import Llama, ModelConfig
from mxtrain.train.parallel import apply_ac


def _label(frames) -> str:
    """Where an allocation was made: the innermost frame of generated graph code, mxtrain or the model."""
    for fr in frames:
        fn = fr.get("filename", "")
        if "torchinductor" in fn or "/mxtrain/" in fn or "/torch/optim/" in fn or "/torch/autograd/" in fn:
            text = linecache.getline(fn, fr.get("line", 0)).strip()
            return f"{fn.rsplit('/', 1)[-1]}:{fr.get('line')} {fr.get('name')} | {text[:110]}"
    fr = frames[0] if frames else {}
    return f"{fr.get('filename', '?').rsplit('/', 1)[-1]}:{fr.get('line')} {fr.get('name')}"


def peak_report(snapshot: dict, base: int, top: int) -> dict:
    """Replay the allocator's trace: the bytes alive at the highest point, by allocating line."""
    live, cur, best, at_best = {}, base, base, {}
    for ev in snapshot["device_traces"][torch.cuda.current_device()]:
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            cur += ev["size"]
            if cur > best:
                best, at_best = cur, dict(live)
        elif act in ("free_completed", "free_requested") and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    groups = collections.Counter()
    for size, frames in at_best.values():
        groups[_label(frames)] += size
    return {"peak_gib": best / 2**30, "before_step_gib": base / 2**30,
            "made_in_step_gib": (best - base) / 2**30,
            "by_line_gib": {k: round(v / 2**30, 3) for k, v in groups.most_common(top)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipes", nargs="*", default=["bf16", "mxfp4-all-dh16"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--compile", default="default", help="torch.compile mode, or 'none'")
    ap.add_argument("--out", default=None)
    ap.add_argument("--recompute-ffn", action="store_true",
                    help="every variant's blocks recompute their feed-forward outputs (mxtrain.train.parallel.apply_ac)")
    ap.add_argument("--peak-report", type=int, default=0, metavar="N",
                    help="print the N largest groups of memory alive at the last step's peak")
    a = ap.parse_args()
    dev = "cuda"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers, "batch": a.batch,
           "seq": a.seq, "compile": a.compile, "recompute_ffn": a.recompute_ffn, "runs": {}}
    idx = torch.randint(0, 128256, (a.batch, a.seq + 1), device=dev, generator=torch.Generator(dev).manual_seed(0))
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    for rec in a.recipes:
        torch.manual_seed(0)
        m = Llama(ModelConfig.named("llama3-8b", n_layers=a.layers), device=dev, glue=settings.current().glue)
        apply_ac(m, recompute_ffn=a.recompute_ffn)
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
            record = a.peak_report and s == a.steps - 1
            if record:
                torch.cuda.memory._record_memory_history(max_entries=500000)
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
            if record:
                rep = peak_report(torch.cuda.memory._snapshot(), before, a.peak_report)
                torch.cuda.memory._record_memory_history(enabled=None)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * sorted(times[2:])[len(times[2:]) // 2]
        res["runs"][rec] = {"ms": ms, "peak_gib": peak / 2**30, "forward_held_gib": held / 2**30,
                            "backward_extra_gib": bwd_peak / 2**30, "loss": loss.item()}
        if a.peak_report:
            res["runs"][rec]["at_peak"] = rep
        print(rec, json.dumps(res["runs"][rec], indent=1), flush=True)
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
