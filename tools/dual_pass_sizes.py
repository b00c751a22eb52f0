"""The one-pass quantize of both operands (``quantize_mxfp4_dual``) against two single passes, small to large
tensors: GPU time (``triton.testing.do_bench``: at the small sizes this is the launch rate, not the kernel) and
host time per call in a loop (best of 5 x 300), for H16 with nearest rounding (``mxfp4-all-dh16``'s X and dY),
H16 with stochastic rounding on B, and no rotation (BENCHMARKS.md, "The host time of the fast path, continued").

    python tools/dual_pass_sizes.py OUT.json
"""
import json, sys, time
import torch
import triton
from mxtrain import settings
from mxtrain.kernels import mxfp4 as kq
from mxtrain.kernels.mxfp4.launch import dual_applies
from mxtrain.numerics.hadamard import rotation_signs

dev = "cuda"
res = []
signs16 = torch.ones(16, device=dev)
def host_us(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best
cnt = torch.zeros(1, dtype=torch.int32, device=dev)
for name, a, b in (
        ("H16 nearest (mxfp4-all-dh16)", dict(rot=16), dict(rot=16, group_rows=128)),
        ("H16 + SR on B", dict(rot=16), dict(rot=16, rounding="stochastic", key=7, group_rows=128)),
        ("no rotation", dict(), dict(group_rows=128))):
    for M, K in ((256, 512), (1024, 1024), (2048, 2048), (4096, 2048), (8192, 2048), (8192, 4096), (16384, 4096)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        sa = dict(a, index_strides=(K, 1)); sb = dict(b, index_strides=(1, K))
        with settings.override(dual="on"):
            ok = dual_applies(x, a.get("rot", 0), b.get("rot", 0), sr=b.get("rounding") == "stochastic")
            one = lambda: kq.quantize_mxfp4_dual(x, sa, sb, k_multiple=512, counter=cnt, fp4_b=True)
            two = lambda: (kq.quantize_mxfp4_2d(x, 1, **sa, carrier=True, fp4=False, k_multiple=512, counter=cnt),
                           kq.quantize_mxfp4_2d(x, 0, **sb, carrier=False, fp4=True, k_multiple=512, counter=cnt))
            r = dict(case=name, M=M, K=K, dual_applies_on=ok)
            if ok:
                r["gpu_one_us"] = triton.testing.do_bench(one, warmup=25, rep=100) * 1e3
                r["gpu_two_us"] = triton.testing.do_bench(two, warmup=25, rep=100) * 1e3
                r["host_one_us"] = host_us(one)
                r["host_two_us"] = host_us(two)
        print(r, flush=True)
        res.append(r)
json.dump(res, open(sys.argv[1], "w"), indent=1)
