"""Device time by kernel of the whole training step, torchao's float8 tensorwise against mxtrain's ``fp8``
(BENCHMARKS.md, "The `fp8` recipe on TransformerEngine's and torchao's definition of the cast").

For each variant: 4 blocks of the model (``bench_step._build``), the whole model under ``torch.compile`` (default
mode), fused AdamW under bf16 autocast, 4 x 4096 tokens; 4 warm-up steps, then ``torch.profiler`` over 3 steps;
prints kernels per step, device time per step and the 45 costliest kernels, and writes every kernel's row (name,
calls a step, us a step) to OUT.json. Usage: ``python tools/step_kernels.py 125m OUT.json`` (GPU, torchao
installed)."""
import sys, torch, json
from mxtrain import bench_step as B
from torch.profiler import profile, ProfilerActivity
model = sys.argv[1]
out = {}
for variant in ("torchao-tensorwise", "fp8"):
    torch._dynamo.reset()
    dev = torch.device("cuda")
    m = B._build(model, 4, 4096, dev)
    V = m.cfg.vocab_size
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, V, (4, 4097), device=dev, generator=g)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    B._convert(m, variant)
    f = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(4): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3): step()
        torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((e.key[:110], e.count // 3, round(t / 3, 1)))
    rows.sort(key=lambda r: -r[2])
    tot = sum(r[2] for r in rows); n = sum(r[1] for r in rows)
    print(f"== {variant}: {n} kernels/step, {tot/1e3:.2f} ms device time/step")
    for r in rows[:45]: print(f"{r[2]:9.1f} us {r[1]:4d}x  {r[0]}")
    out[variant] = rows
json.dump(out, open(sys.argv[2], "w"))
