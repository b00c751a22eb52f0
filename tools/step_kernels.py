"""Device time by kernel of the whole training step, torchao's float8 tensorwise against mxtrain's ``fp8``
(BENCHMARKS.md, "The `fp8` recipe on TransformerEngine's and torchao's definition of the cast").

For each variant: 4 blocks of the model (``bench_step._build``), the whole model under ``torch.compile`` (default
mode), fused AdamW under bf16 autocast, 4 x 4096 tokens; 4 warm-up steps, then ``torch.profiler`` over 3 steps;
prints kernels per step, device time per step and the 45 costliest kernels, and writes every kernel's row (name,
calls a step, us a step) to OUT.json. Usage: ``python tools/step_kernels.py 125m OUT.json`` (GPU, torchao
installed)."""
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mxtrain import bench_step


def kernel_rows(model: str, variant: str, steps: int = 3) -> list[tuple[str, int, float]]:
    """(kernel name, calls a step, device us a step) of ``variant``'s training step, costliest first."""
    torch._dynamo.reset()
    dev = torch.device("cuda")
    m = bench_step._build(model, 4, 4096, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, m.cfg.vocab_size, (4, 4097), device=dev, generator=g)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    bench_step._convert(m, variant)
    f = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((e.key[:110], e.count // steps, round(t / steps, 1)))
    return sorted(rows, key=lambda r: -r[2])


def main(model: str, out_path: str) -> dict:
    out = {}
    for variant in ("torchao-tensorwise", "fp8"):
        rows = out[variant] = kernel_rows(model, variant)
        total, n = sum(r[2] for r in rows), sum(r[1] for r in rows)
        print(f"== {variant}: {n} kernels/step, {total / 1e3:.2f} ms device time/step")
        for name, calls, us in rows[:45]:
            print(f"{us:9.1f} us {calls:4d}x  {name}")
    with open(out_path, "w") as f:
        json.dump(out, f)
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
