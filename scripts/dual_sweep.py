"""GPU: the one-pass dual quantize (both carrier operands of a 16384x4096 bf16 activation) in several
kernel layouts and block sizes, against the two single passes and a copy, in one run; JSON to argv[1]."""
import json
import sys

import torch

from mxtrain.bench import _bench
from mxtrain.kernels import quantize as kq

dev = "cuda"
x = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
y = torch.empty_like(x)
t_copy = _bench(lambda: y.copy_(x))
n = x.numel()
moved = 2 * n + 2 * (n + n // 128 * 4)
copy_bw = 4 * n / (t_copy * 1e-3)
out = []
cases = [("dY H16", dict(rot=16), dict(rot=16)), ("X H16, B 128x128", dict(rot=16), dict(rot=16, group_rows=128)),
         ("no rotation", dict(), dict())]
for name, a, b in cases:
    t2 = _bench(lambda: (kq.quantize_mxfp4_2d(x, 1, fp4=False, **a), kq.quantize_mxfp4_2d(x, 0, fp4=False, **b)))
    cfgs = ([(s, (bra, 128), nw) for s in (False, True) for bra, nw in ((64, 8), (32, 4), (16, 4), (32, 8))]
            if b.get("group_rows", 1) == 128 else
            [(s, (bra, brb), nw) for s in (False, True) for bra, brb, nw in
             ((32, 64, 4), (16, 64, 2), (16, 64, 4), (64, 128, 8), (32, 128, 4))])
    for seq, br, nw in cfgs:
        try:
            t = _bench(lambda: kq.quantize_mxfp4_dual(x, a, b, block_rows=br, num_warps=nw, sequential=seq))
        except Exception as e:  # noqa: BLE001
            print(name, seq, br, nw, "error", repr(e)[:200], flush=True)
            continue
        bw = moved / (t * 1e-3)
        r = dict(case=name, sequential=seq, block_rows=br, num_warps=nw, us=t * 1e3, two_pass_us=t2 * 1e3,
                 frac_of_copy=bw / copy_bw, speedup_vs_two_passes=t2 / t)
        out.append(r)
        print(f"{name:18s} seq={seq!s:5s} BR={br} warps={nw}: {t*1e3:6.1f} us ({100*bw/copy_bw:4.1f}% of copy), "
              f"two passes {t2*1e3:6.1f} us -> {t2/t:.2f}x", flush=True)
json.dump({"copy_us": t_copy * 1e3, "device": torch.cuda.get_device_name(), "results": out},
          open(sys.argv[1], "w"), indent=1)
