"""Profile one training step of the 125m model (GPU): bf16 vs mxfp4-all-dh16 on the fast path.
Prints ms/step with a sync per step, CPU time to issue a step, and the top ops of torch.profiler.
Usage: PYTHONPATH=. python3 tools/profile_125m.py [--graphs] [--quick] [recipe ...]
--graphs: forward + backward replayed from a CUDA graph (as train.cuda_graphs does); --quick: timing only."""
import sys
import time

import torch

from mxtrain import settings
from mxtrain.linear import fast
from mxtrain.model.llama import Llama, ModelConfig
from mxtrain.linear.module import convert, set_step

dev = "cuda"
B, T = 16, 1024
args = sys.argv[1:]
graphs, quick = "--graphs" in args, "--quick" in args
recipes = [a for a in args if not a.startswith("--")] or ["bf16", "mxfp4-all-dh16"]
torch.manual_seed(0)
idx = torch.randint(0, 16384, (B, T + 1), device=dev)
for rec in recipes:
    torch.manual_seed(0)
    m = Llama(ModelConfig.named("125m", vocab_size=16384), device=dev, glue=settings.current().glue)
    if rec != "bf16":
        convert(m, rec)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    fwd = None
    if graphs:
        from mxtrain.train.trainer import _LossModule
        fwd = torch.cuda.make_graphed_callables(_LossModule(m, "cuda", torch.bfloat16), (x, y))

    def step(i):
        set_step(m, i)
        if fwd is not None:
            loss = fwd(x, y)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    n = 10
    t0 = time.perf_counter()
    issue = 0.0
    for i in range(n):
        a = time.perf_counter()
        step(3 + i)
        issue += time.perf_counter() - a
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / n
    n_mx = sum(type(mod).__name__ == "MXLinear" for mod in m.modules())
    print(f"{rec}{' (CUDA graph)' if graphs else ''} [{n_mx} MXLinear layers]: {dt*1e3:.1f} ms/step ({B*T/dt:,.0f} tok/s); CPU issue time {issue/n*1e3:.1f} ms/step", flush=True)
    if rec != "bf16" and not quick:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(2):
                step(20 + i)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for i in range(3):
            step(30 + i)
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
