"""CPU time to issue one MXLinear fwd+bwd and its parts (the host overhead of the fast path).

Tiny shapes so that the GPU finishes each kernel before the CPU issues the next: the time per call is
then the CPU's. Every part of one fwd+bwd is captured once (the quantize calls, the Triton launches,
the ``_scaled_mm`` calls) and replayed alone in a loop.

    python3 tools/host_overhead.py [--recipe mxfp4-all-dh16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from _timing import per_call_us  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="mxfp4-all-dh16")
    ap.add_argument("--M", type=int, default=256)
    ap.add_argument("--N", type=int, default=512)
    ap.add_argument("--K", type=int, default=512)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of 100 fwd+bwd calls")
    ap.add_argument("--compiled", action="store_true",
                    help="only the layer under torch.compile(fullgraph=True): time, cProfile and torch.profiler")
    a = ap.parse_args()
    from mxtrain.linear import fast, skeleton
    from mxtrain.bench.suite import fwd_bwd_call
    from mxtrain.kernels.mxfp4 import kernels as QK
    from mxtrain.kernels.mxfp4 import ops as Q   # where quantize_op and the dual pass look quantize_mxfp4_2d up
    from mxtrain.linear.module import MXLinear

    dev = "cuda"
    res: dict = {"device": torch.cuda.get_device_name(), "recipe": a.recipe, "shape": [a.M, a.N, a.K]}
    x = torch.randn(a.M, a.K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(a.M, a.N, device=dev, dtype=torch.bfloat16)
    base = torch.nn.Linear(a.K, a.N, bias=False, device=dev, dtype=torch.bfloat16)
    lin = MXLinear(a.K, a.N, bias=False, device=dev, dtype=torch.bfloat16, recipe=a.recipe)

    def step(mod, clear):
        return fwd_bwd_call(mod, x, gy, clear)

    if a.compiled:
        return compiled_profile(a, res, base, lin, x, gy, step)

    res["bf16_fwd_bwd_us"] = per_call_us(step(base, False))
    res["mx_fwd_bwd_us"] = per_call_us(step(lin, True))
    res["mx_fwd_bwd_reuseW_us"] = per_call_us(step(lin, False))
    res["mx_fwd_only_us"] = per_call_us(lambda: (fast.clear_caches(), lin(x.detach())))
    res["torch_empty_us"] = per_call_us(lambda: torch.empty((256, 512), device=dev, dtype=torch.uint8))
    res["torch_add_us"] = per_call_us(lambda: gy + 1)

    # capture the parts of one fwd+bwd
    qcalls, launches, mms = [], [], []
    orig_q = Q.quantize_mxfp4_2d
    kerns = [QK._mxfp4_kernel]   # the single-pass kernel, every layout
    orig_runs = {k: k.run for k in kerns}
    orig_mm = torch._scaled_mm

    def rec_q(*args, **kw):
        qcalls.append((args, dict(kw)))
        return orig_q(*args, **kw)

    def mk_run(k):
        def run(*args, grid, warmup, **kw):
            kern = orig_runs[k](*args, grid=grid, warmup=warmup, **kw)
            launches.append((k, args, dict(kw), grid, kern))
            return kern
        return run

    def rec_mm(*args, **kw):
        mms.append((args, kw))
        return orig_mm(*args, **kw)

    Q.quantize_mxfp4_2d = rec_q
    for k in kerns:
        k.run = mk_run(k)
    torch._scaled_mm = rec_mm
    try:
        step(lin, True)()
    finally:
        Q.quantize_mxfp4_2d = orig_q
        for k in kerns:
            k.run = orig_runs[k]
        torch._scaled_mm = orig_mm
    torch.cuda.synchronize()
    res["n_quantize"], res["n_launch"], res["n_scaled_mm"] = len(qcalls), len(launches), len(mms)
    res["quantize_us"] = [per_call_us(lambda c=c: orig_q(*c[0], **c[1])) for c in qcalls]
    res["jit_launch_us"] = [per_call_us(lambda k=k, ar=ar, kw=kw, g=g: k[g](*ar, **kw)) for k, ar, kw, g, _ in launches]
    runner = []
    for k, ar, kw, g, kern in launches:
        # the compiled kernel called directly with every bound argument (constexprs included)
        bound, _, _ = k.device_caches[torch.cuda.current_device()][4](*ar, **kw)
        vals = tuple(bound.values())
        r = kern[tuple(g) + (1,) * (3 - len(g))]
        runner.append(per_call_us(lambda r=r, vals=vals: r(*vals)))
    res["compiled_runner_us"] = runner
    res["scaled_mm_us"] = [per_call_us(lambda c=c: orig_mm(*c[0], **c[1])) for c in mms]
    # inclusive wall time of each level of the fast path inside real fwd+bwd calls
    import collections
    from mxtrain.kernels import gemm as G
    acc = collections.defaultdict(float)
    cnt = collections.Counter()

    def timed(mod, name, label):
        orig = getattr(mod, name)

        def w(*args, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                acc[label] += time.perf_counter() - t0
                cnt[label] += 1
        setattr(mod, name, w)
        return lambda: setattr(mod, name, orig)

    Fn = skeleton.EagerLinear
    undo = [timed(fast, "_gemm_fn", "fast._gemm_fn"), timed(fast, "_quant", "fast._quant"),
            timed(Q, "quantize_mxfp4_2d", "quantize_mxfp4_2d"), timed(G, "mx_gemm_nt", "gemm.mx_gemm_nt"),
            timed(torch, "_scaled_mm", "torch._scaled_mm"), timed(torch.autograd, "backward", "autograd.backward"),
            timed(fast, "_backend", "fast._backend")]
    fwd0, bwd0 = Fn.forward, Fn.backward
    undo += [timed(Fn, "forward", "Function.forward"), timed(Fn, "backward", "Function.backward")]
    Fn.forward, Fn.backward = staticmethod(Fn.forward), staticmethod(Fn.backward)
    f = step(lin, True)
    for _ in range(20):
        f()
    acc.clear()
    cnt.clear()
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    total = time.perf_counter() - t0
    torch.cuda.synchronize()
    for u in undo:
        u()
    Fn.forward, Fn.backward = staticmethod(fwd0), staticmethod(bwd0)
    res["breakdown_us_per_fwd_bwd"] = dict({"total": total / n * 1e6},
                                           **{k: v / n * 1e6 for k, v in sorted(acc.items())})
    res["breakdown_calls_per_fwd_bwd"] = {k: v / n for k, v in sorted(cnt.items())}

    # where the rest goes: synchronizing calls (warned) and a profile of the Python side
    torch.cuda.set_sync_debug_mode("warn")
    step(lin, True)()
    torch.cuda.set_sync_debug_mode(0)
    if a.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        f = step(lin, True)
        pr.enable()
        for _ in range(100):
            f()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(40)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(60)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def compiled_profile(a, res, base, lin, x, gy, step):
    """The module under ``torch.compile(fullgraph=True)``: time per fwd+bwd (BF16 and MX), then where the
    MX layer's host time goes (cProfile by own time; torch.profiler by self CPU time)."""
    import cProfile
    import pstats
    cb = torch.compile(base, fullgraph=True)
    cm = torch.compile(lin, fullgraph=True)
    res["compiled_bf16_fwd_bwd_us"] = per_call_us(step(cb, False))
    res["compiled_mx_fwd_bwd_us"] = per_call_us(step(cm, True))
    f = step(cm, True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        f()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(45)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50):
            f()
    torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
