"""Diagnose stochastic rounding under CUDA-graph replay (GPU): is the key read from device memory at
replay time, and does MXLinear's captured backward use key slots?"""
import torch

import mxtrain.fast as F

F.GRAPH_SR_KEYS = True   # the wiring this script examines (on by default)
from mxtrain import MXLinear, recipes
from mxtrain.kernels.quantize import quantize_mxfp4_2d

dev = "cuda"
kt = torch.zeros(4, dtype=torch.int32, device=dev)
xx = torch.randn(256, 1024, device=dev)
for axis in (1, 0):
    quantize_mxfp4_2d(xx, axis, rounding="stochastic", key=1, key_tensor=kt, carrier=True, fp4=False)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        qg = quantize_mxfp4_2d(xx, axis, rounding="stochastic", key=1, key_tensor=kt, carrier=True, fp4=False)
    kt[0] = 5
    gr.replay()
    a = qg.carrier.view(torch.uint8).clone()
    kt[0] = 6
    gr.replay()
    b = qg.carrier.view(torch.uint8).clone()
    print("manual graph, axis", axis, "replays differ with the key:", not torch.equal(a, b))

log = []
orig = F._quant


outs = {}


def q(qctx, t, axis, name, *a, **k):
    log.append((name, torch.cuda.is_current_stream_capturing(), qctx.call, qctx.step))
    r = orig(qctx, t, axis, name, *a, **k)
    if torch.cuda.is_current_stream_capturing():
        outs[name] = r[0]
    return r


F._quant = q
lin = MXLinear(1024, 512, recipe=recipes.get("mxfp4-all-sr"), device=dev, dtype=torch.bfloat16, layer_id=3)
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
g = torch.cuda.make_graphed_callables(lin, (x,))
print("quant calls (name, capturing, call, step):", log)
for d, s in F._GRAPH_SEEDS.items():
    print("seeds", d, s.key_slots, s.keys is not None)
res = []
for micro in (0, 1, 0):
    F.refresh_graph_seeds(1, micro)
    torch.cuda.synchronize()
    print("keys", F._GRAPH_SEEDS[torch.device(dev, 0)].keys[:8].tolist())
    x.grad = None
    g(x).backward(dy)
    res.append(x.grad.clone())
    torch.cuda.synchronize()
    print("captured dgrad_dy carrier sum", outs["dgrad_dy"].carrier.view(torch.uint8).float().sum().item(),
          "wgrad_dy", outs["wgrad_dy"].carrier.view(torch.uint8).float().sum().item())
print("x.grad micro 0 vs 1 differ:", not torch.equal(res[0], res[1]), "micro 0 twice equal:", torch.equal(res[0], res[2]))
