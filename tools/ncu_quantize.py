"""GPU: the fused quantize kernels of the Hopper path under Nsight Compute (what limits each one).

Warms every case up (compiles, self-checks), then profiles one call of each between
cudaProfilerStart/Stop, so that ``ncu --profile-from-start off`` sees only those:

    ncu --clock-control none --profile-from-start off --csv --metrics <list> python3 tools/ncu_quantize.py

Cases (bf16 in, FP8 carrier out): the activation (16384 x 4096) along rows with H16, along columns
(Wgrad) without and with H16, the weight (14336 x 4096) in 128x128 groups with H16 along rows and along
columns, and a bf16 copy of the activation for the memory ceiling.
"""
import torch

from mxtrain.kernels.mxfp4 import quantize_mxfp4_2d as q

x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
cases = [
    ("act rows H16", lambda: q(x, 1, rot=16, fp4=False)),
    ("act cols", lambda: q(x, 0, fp4=False)),
    ("act cols H16", lambda: q(x, 0, rot=16, fp4=False)),
    ("weight rows 128x128 H16", lambda: q(w, 1, rot=16, fp4=False, group_rows=128)),
    ("weight cols 128x128 H16", lambda: q(w, 0, rot=16, fp4=False, group_rows=128)),
    ("copy", lambda: y.copy_(x)),
]
for _, f in cases:
    for _ in range(3):
        f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for name, f in cases:
    torch.cuda.nvtx.range_push(name)
    f()
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("cases in order:", [n for n, _ in cases])
