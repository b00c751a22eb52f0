"""Does the traced ``fp8`` cast's exact division cost the race against torchao? (BENCHMARKS.md, "The `fp8`
cast's float64 multiply, measured against TransformerEngine's definition").

One process on a GPU, ``bench_step.measure`` (4 blocks of the model) in this order: bf16, torchao tensorwise and
``fp8``; ``fp8`` with ``tracedfp8.cast`` replaced by TransformerEngine's and torchao's definition of the cast
(``scale = max / amax`` in float32, each element multiplied by it; NOT mxtrain's definition, for timing only);
torchao tensorwise; that ``fp8`` again; then ``fp8`` and torchao tensorwise once more. Usage:
``python tools/fp8_multiply_experiment.py OUT.json 8b`` (4 Llama-8B blocks, default compile) or ``... 125m``
(4 blocks of the 125M model under ``reduce-overhead``); torchao installed."""
import json
import sys

import torch

from mxtrain import bench_step, tracedfp8
from mxtrain.formats import get_format


def cast_multiply(t, fmt):
    """Codes ``sat(RN32(t * s))`` with ``s = RN32(max / amax)`` and the dequantization scale ``RN32(1 / s)``
    (the scalar divisions in float64, then rounded: exact)."""
    mx = get_format(fmt).elem.max
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32)
    s = (mx / amax.to(torch.float64)).to(torch.float32)
    s = torch.where(amax > 0, s, torch.ones_like(s))
    s = torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))
    v = t.to(torch.float32) * s
    v = torch.where(torch.isfinite(s), v, torch.zeros_like(v))
    inv = (1.0 / s.to(torch.float64)).to(torch.float32)
    return v.clamp(-mx, mx).to(tracedfp8._DT[fmt]), inv


def run(kw, tag):
    out = {"a": bench_step.measure(["bf16", "torchao-tensorwise", "fp8"], **kw)["runs"]}
    real = tracedfp8.cast
    tracedfp8.cast = cast_multiply
    try:
        out["multiply"] = bench_step.measure(["fp8"], **kw)["runs"]
        out["b"] = bench_step.measure(["torchao-tensorwise"], **kw)["runs"]
        out["multiply2"] = bench_step.measure(["fp8"], **kw)["runs"]
    finally:
        tracedfp8.cast = real
    out["c"] = bench_step.measure(["fp8", "torchao-tensorwise"], **kw)["runs"]
    for k, runs in out.items():
        for v, d in runs.items():
            ms = d.get("ms_all") or [0]
            print(tag, k, v, round(d.get("ms", 0), 2), round(min(ms), 1), round(max(ms), 1),
                  round(d.get("peak_gib", 0), 2), d.get("error", ""), flush=True)
    return out


if __name__ == "__main__":
    which = sys.argv[2]
    kw = {} if which == "8b" else dict(model="125m", compile_mode="reduce-overhead")
    with open(sys.argv[1], "w") as f:
        json.dump(run(kw, which), f, default=str)
