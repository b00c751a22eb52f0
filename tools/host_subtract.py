"""Host time of one eager ``MXLinear`` forward + backward (256 x 512 x 512, bf16) by subtraction: the whole call,
then with every quantize launch plan replaying its first outputs (no allocation, no launch), then also every
``torch._scaled_mm`` replaying its first output, then also no small-kernel launch; best of 7 x 200 calls each
(BENCHMARKS.md, "The host time of the fast path, continued"). The outputs are wrong on purpose after the first
stage: timing only.

    python tools/host_subtract.py OUT.json [RECIPE]
"""
import json, sys, time
import torch
from mxtrain.linear import fast
from mxtrain.bench.suite import fwd_bwd_call
from mxtrain.linear.module import MXLinear
from mxtrain.kernels.mxfp4 import launch as L
from mxtrain.kernels import gemm as G, expand as E, seeds as S

from _timing import best_us  # noqa: E402

recipe = sys.argv[2] if len(sys.argv) > 2 else "mxfp4-all-dh16"
dev = "cuda"
x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
lin = MXLinear(512, 512, bias=False, device=dev, dtype=torch.bfloat16, recipe=recipe)
base = torch.nn.Linear(512, 512, bias=False, device=dev, dtype=torch.bfloat16)
res = {"recipe": recipe}
f = fwd_bwd_call(lin, x, gy, True)
res["bf16"] = best_us(fwd_bwd_call(base, x, gy, False))
res["full"] = best_us(f)
res["torch_empty"] = best_us(lambda: torch.empty((256, 512), device=dev, dtype=torch.uint8))
res["gy_plus_1"] = best_us(lambda: gy + 1)

def memo_call(orig):
    cache = {}
    def w(self, *a, **k):
        r = cache.get(id(self))
        if r is None:
            r = cache[id(self)] = orig(self, *a, **k)
        return r
    return w

origP, origD = L.Plan.__call__, L.DualPlan.__call__
L.Plan.__call__ = memo_call(origP)
L.DualPlan.__call__ = memo_call(origD)
res["no_quantize"] = best_us(f)
orig_mm = torch._scaled_mm
mm_cache = {}
def fake_mm(a, b, *r, **k):
    key = (tuple(a.shape), tuple(b.shape))
    o = mm_cache.get(key)
    if o is None:
        o = mm_cache[key] = orig_mm(a, b, *r, **k)
    return o
torch._scaled_mm = fake_mm
res["no_quantize_no_mm"] = best_us(f)
orig_ld = L.launch_direct
L.launch_direct = lambda *a, **k: None
res["no_launch_at_all"] = best_us(f)
L.launch_direct = orig_ld
torch._scaled_mm = orig_mm
L.Plan.__call__, L.DualPlan.__call__ = origP, origD
res["full_again"] = best_us(f)
print(json.dumps(res))
json.dump(res, open(sys.argv[1], "w"))
