"""Host time of one ``MXLinear`` forward + backward (256 x 512 x 512, bf16), eager and under
``torch.compile(fullgraph=True)``, per recipe, against ``nn.Linear``: best of 7 x 200 calls. For an A/B of two
trees, run it once per tree with ``PYTHONPATH`` pointing at each (alternate them: the host's noise between
processes is large; BENCHMARKS.md, "The host time of the fast path, continued").

    python tools/host_ab.py LABEL mxfp4-all-dh16,tseng
"""
import json, sys, time
import torch
from mxtrain.bench.suite import fwd_bwd_call
from mxtrain.linear.module import MXLinear

from _timing import best_us  # noqa: E402

dev = "cuda"
x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
res = {}
base = torch.nn.Linear(512, 512, bias=False, device=dev, dtype=torch.bfloat16)
res["bf16 eager"] = best_us(fwd_bwd_call(base, x, gy, False))
res["bf16 compiled"] = best_us(fwd_bwd_call(torch.compile(base, fullgraph=True), x, gy, False))
for r in sys.argv[2].split(","):
    lin = MXLinear(512, 512, bias=False, device=dev, dtype=torch.bfloat16, recipe=r)
    res[f"{r} eager"] = best_us(fwd_bwd_call(lin, x, gy, True))
    res[f"{r} compiled"] = best_us(fwd_bwd_call(torch.compile(lin, fullgraph=True), x, gy, True))
print(sys.argv[1], json.dumps({k: round(v, 1) for k, v in res.items()}), flush=True)
