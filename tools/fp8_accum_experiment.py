"""Experiment (timing only): where does mxtrain's ``fp8`` lose to torchao's float8 tensorwise? Variants, in one
process, the order rotated every round, each ``bench_step.measure`` of 4 blocks:

* ``torchao-tensorwise`` (torchao's defaults: fast accumulation in its forward GEMM, the layer input cast to
  the autocast dtype, gradients written in bf16), ``torchao-tensorwise:fast_accum=false``;
* ``fp8`` (mxtrain's defaults), ``fp8:fp8_fast_accum=fprop``;
* ``fp8+amp:...``: mxtrain's traced ``fp8`` layer patched to do what torchao does under autocast (the input
  cast to bf16 before its cast to FP8; dW written by the GEMM in bf16, then widened): not mxtrain's
  definition, for timing only.

Usage: ``python tools/fp8_accum_experiment.py OUT.json 8b|125m ROUNDS VARIANT,VARIANT,...``."""
import json
import statistics
import sys

import torch

from mxtrain import bench_step, tracedfp8 as T


class _AmpFP8(torch.autograd.Function):
    forward = T._TracedFP8Linear.forward

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        f = ctx.fmts
        K, N = x.shape[-1], weight.shape[0]
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, N)
            cdy, sdy = T.cast(dy2, f[2])
            cw, sw = T.cast(weight, f[3])
            dx = T._mm(cdy, sdy, cw.t().contiguous(), sw, x.dtype).reshape(x.shape)
            cx, sx = T.cast(x.reshape(-1, K), f[5])
            dw = T._mm(cdy.t().contiguous(), sdy, cx.t().contiguous(), sx, x.dtype).to(weight.dtype)
        return dx, dw, None, None, None


def _amp_linear(x, weight, bias, fmts):
    dt = x.device.type
    amp = torch.get_autocast_dtype(dt) if torch.is_autocast_enabled(dt) else x.dtype
    assert bias is None
    return _AmpFP8.apply(x.to(amp), weight, bias, fmts, amp)


def one(v: str, kw: dict) -> dict:
    hack = v.startswith("fp8+amp")
    orig = T.linear
    if hack:
        T.linear = _amp_linear
        v = "fp8" + v[len("fp8+amp"):]
    try:
        return bench_step.measure([v], **kw)["runs"][v]
    finally:
        T.linear = orig


def main(out: str, which: str, rounds: int, variants: list) -> dict:
    kw = {} if which == "8b" else dict(model="125m", compile_mode="reduce-overhead")
    res = {"bf16": bench_step.measure(["bf16"], **kw)["runs"]["bf16"], "rounds": []}
    print(which, "bf16", round(res["bf16"]["ms"], 2), flush=True)
    for r in range(rounds):
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        runs = {}
        for v in order:
            runs[v] = one(v, kw)
            ms = runs[v].get("ms_all") or [0]
            print(which, r, v, round(runs[v].get("ms", 0), 2), round(min(ms), 2), round(max(ms), 2),
                  round(runs[v].get("peak_gib", 0), 2), runs[v].get("error", ""), flush=True)
        res["rounds"].append(runs)
        with open(out, "w") as f:
            json.dump(res, f, default=str)
    base = "torchao-tensorwise"
    for v in variants:
        rat = [rr[base]["ms"] / rr[v]["ms"] for rr in res["rounds"] if "ms" in rr.get(v, {}) and "ms" in rr.get(base, {})]
        if rat:
            print(which, v, "vs torchao-tensorwise: median", round(statistics.median(rat), 4), [round(x, 4) for x in rat])
    with open(out, "w") as f:
        json.dump(res, f, default=str)
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","))
