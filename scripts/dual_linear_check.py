"""GPU: what the one-pass dual quantize changes inside MXLinear, in one run.

1. MXLinear fwd+bwd at the Llama-8B shapes (M = 16384), mxfp4-all-dh16 and mxfp4-all, eager and replayed
   from a CUDA graph, with the default one-pass policy (MXTRAIN_QDUAL=auto: no rotations) and with one
   pass for rotated operands too ("on"), against nn.Linear BF16 (eager and replayed);
2. kernel times inside one dh16 fwd+bwd at 16384x4096x4096 (torch.profiler), both settings;
3. one-pass dual quantize against two passes (no rotation) over several activation shapes.

    python3 scripts/dual_linear_check.py OUT.json [--quick]
"""
from __future__ import annotations

import json
import sys

import torch

from mxtrain import fast
from mxtrain import settings
from mxtrain.bench import LLAMA8B_NK, _bench, _graphed, dual_timings, fwd_bwd_call, warm_gpu
from mxtrain.nn import MXLinear


def timings(quick: bool) -> list:
    M, out = 16384, []
    shapes = LLAMA8B_NK[:1] if quick else LLAMA8B_NK
    for N, K in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        base = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        r = {"M": M, "N": N, "K": K, "bf16_ms": _bench(fwd_bwd_call(base, x, gy)),
             "bf16_graph_ms": _bench(_graphed(fwd_bwd_call(base, x, gy)))}
        for p in ("mxfp4-all-dh16", "mxfp4-all"):
            lin = MXLinear(K, N, bias=False, device="cuda", dtype=torch.bfloat16, recipe=p)
            lin.weight.data.copy_(base.weight.data)
            for ov in ("auto", "on", "auto", "on"):   # twice each, interleaved: run-to-run noise is visible
                settings.configure(dual=ov)
                tag = f"{p}_{ov}"
                r.setdefault(tag + "_ms", []).append(_bench(fwd_bwd_call(lin, x, gy, True)))
                r.setdefault(tag + "_graph_ms", []).append(_bench(_graphed(fwd_bwd_call(lin, x, gy, True))))
            settings.configure(dual="auto")
            del lin
        bf = min(r["bf16_ms"], r["bf16_graph_ms"])
        print(f"{M}x{N}x{K}: bf16 {r['bf16_ms']:.3f} / graph {r['bf16_graph_ms']:.3f} ms; " + "; ".join(
            f"{k} {min(v):.3f} ms ({bf / min(v):.2f}x)" for k, v in r.items() if isinstance(v, list)), flush=True)
        out.append(r)
        del x, gy, base
    return out


def kernel_profile() -> dict:
    from torch.profiler import ProfilerActivity, profile
    M, N, K = 16384, 4096, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    lin = MXLinear(K, N, bias=False, device="cuda", dtype=torch.bfloat16, recipe="mxfp4-all-dh16")
    res = {}
    for ov in ("auto", "on"):
        settings.configure(dual=ov)
        g = _graphed(fwd_bwd_call(lin, x, gy, True))
        for _ in range(5):
            g()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g()
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kern = {}
        for e in ev:
            kern.setdefault(e.name[:90], []).append(e.device_time)
        span = (max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)) / 10
        tot = sum(sum(v) for v in kern.values()) / 10
        res[ov] = {"wall_us_per_call": span, "kernel_us_per_call": tot,
                                         "kernels": {k: [len(v) // 10, sum(v) / 10] for k, v in kern.items()}}
        print(f"profile MXTRAIN_QDUAL={ov}: wall {span:.0f} us/call, kernel sum {tot:.0f} us/call", flush=True)
        for k, (n, t) in sorted(res[ov]["kernels"].items(), key=lambda kv: -kv[1][1]):
            print(f"   {t:8.1f} us  x{n}  {k}", flush=True)
    settings.configure(dual="auto")
    return res


def dual_shapes(quick: bool) -> list:
    out = []
    shapes = [(4096, 4096), (16384, 4096)] if quick else [(2048, 4096), (4096, 4096), (8192, 4096), (16384, 4096),
                                                         (4096, 14336), (16384, 14336)]
    for R, C in shapes:
        x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
        d = dual_timings(x, {}, {}, [{}])
        r = {"shape": [R, C], "one_pass_us": d["ms"][0] * 1e3, "two_pass_us": d["two_pass_ms"] * 1e3,
             "copy_us": d["copy_ms"] * 1e3}
        print(f"dual {R}x{C}: one pass {r['one_pass_us']:.1f} us, two {r['two_pass_us']:.1f} us "
              f"({r['two_pass_us'] / r['one_pass_us']:.2f}x), copy {r['copy_us']:.1f} us", flush=True)
        out.append(r)
        del x
    return out


def main():
    quick = "--quick" in sys.argv
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "warmup_s": warm_gpu()}
    res["dual"] = dual_shapes(quick)
    res["linear"] = timings(quick)
    res["profile"] = kernel_profile()
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
