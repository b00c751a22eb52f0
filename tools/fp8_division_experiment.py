"""What the traced ``fp8`` cast's exact division costs (BENCHMARKS.md, "`fp8` as traced operations").

One process on a GPU: ``bench_step.measure`` for bf16, torchao tensorwise and ``fp8``; then ``fp8`` again with
``tracedfp8.cast`` replaced by a float32 division (the compiler's approximate one in Triton: NOT the definition,
for timing only); then torchao tensorwise and ``fp8`` once more. Usage: ``python tools/fp8_division_experiment.py
OUT.json`` (torchao installed)."""
import json
import sys

import torch

from mxtrain.linear import tracedfp8
from mxtrain.bench import step as bench_step
from mxtrain.numerics.formats import get_format


def cast_float32_division(t, fmt):
    mx = get_format(fmt).elem.max
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)
    scale = amax / mx
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    v = t.to(torch.float32) / scale
    v = torch.where(torch.isfinite(scale), v, torch.zeros_like(v))
    return v.clamp(-mx, mx).to(tracedfp8._DT[fmt]), scale


def main(path):
    out = {"a": bench_step.measure(["bf16", "torchao-tensorwise", "fp8"])["runs"]}
    real = tracedfp8.cast
    tracedfp8.cast = cast_float32_division
    try:
        out["fp32div"] = bench_step.measure(["fp8"])["runs"]
    finally:
        tracedfp8.cast = real
    out["b"] = bench_step.measure(["torchao-tensorwise", "fp8"])["runs"]
    for k, runs in out.items():
        for v, d in runs.items():
            print(k, v, round(d.get("ms", 0), 1), round(d.get("peak_gib", 0), 2), d.get("error", ""))
    with open(path, "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
