"""GPU: the H16 quantize passes with the rotation's 1/4 folded into the block scales (``MXTRAIN_QFOLD``,
the ``qfold`` setting) against the multiply per element, interleaved and repeated in one run; every folded
output checked bit-identical to the unfolded one. Then block rows x warps of the cols kernel for the Wgrad
operands (activations and weights along columns), timed the same way.

    python3 scripts/fold_sweep.py OUT.json [repeats, default 2]
"""
import json
import sys

import torch

from mxtrain.bench import _bench, warm_gpu
from mxtrain import settings
from mxtrain.kernels import quantize as kq

reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
xb = torch.randn(16384, 14336, device="cuda", dtype=torch.bfloat16)
w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
warm_gpu()
copies = {}
for name, t in (("x", x), ("xb", xb), ("w", w)):
    y = torch.empty_like(t)
    copies[name] = _bench(lambda: y.copy_(t)) * 1e3
    del y
q = kq.quantize_mxfp4_2d
cases = [
    ("act 16384x4096 cols H16", "x", lambda **k: q(x, 0, rot=16, fp4=False, **k)),
    ("act 16384x4096 rows H16", "x", lambda **k: q(x, 1, rot=16, fp4=False, **k)),
    ("act 16384x14336 cols H16", "xb", lambda **k: q(xb, 0, rot=16, fp4=False, **k)),
    ("act 16384x14336 rows H16", "xb", lambda **k: q(xb, 1, rot=16, fp4=False, **k)),
    ("weight 14336x4096 rows 128x128 H16", "w", lambda **k: q(w, 1, rot=16, fp4=False, group_rows=128, **k)),
    ("weight 14336x4096 cols 128x128 H16", "w", lambda **k: q(w, 0, rot=16, fp4=False, group_rows=128, **k)),
]


def outs(r):
    return (r.carrier.view(torch.uint8).clone(), r.gscale.clone(), int(r.inexact.item()))


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def bytes_moved(t, o):
    return t.numel() * t.element_size() + o.carrier.numel() + o.gscale.numel() * 4


res = []
for name, src, f in cases:
    t = {"x": x, "xb": xb, "w": w}[src]
    settings.configure(qfold=False)
    ref = outs(f())
    nbytes = bytes_moved(t, f())
    for rep in range(reps):
        for fold in (False, True):
            settings.configure(qfold=fold)
            ok = same(outs(f()), ref)
            us = _bench(f) * 1e3
            pct = 100 * nbytes / us / (2 * t.numel() * t.element_size() / copies[src])   # copy: 2 x bf16 bytes
            res.append(dict(case=name, fold=fold, repeat=rep, us=us, pct_copy=pct, identical=ok))
            print(f"{name:38s} fold={fold!s:5s} {us:7.1f} us {pct:5.1f} % of copy identical={ok}", flush=True)
settings.configure(qfold=True)
# cols kernel configurations (block rows, warps), with the fold
cfgs = [(64, 4), (32, 2), (64, 2), (32, 1), (128, 8), (128, 4)]
for name, src, f in cases:
    if "cols" not in name or "128x128" in name:
        continue
    t = {"x": x, "xb": xb, "w": w}[src]
    ref = outs(f())
    nbytes = bytes_moved(t, f())
    for rep in range(reps):
        for br, nw in cfgs:
            try:
                ok = same(outs(f(block_rows=br, num_warps=nw)), ref)
                us = _bench(lambda: f(block_rows=br, num_warps=nw)) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"{name} {br}x{nw}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            pct = 100 * nbytes / us / (2 * t.numel() * t.element_size() / copies[src])
            res.append(dict(case=name, block_rows=br, num_warps=nw, repeat=rep, us=us, pct_copy=pct, identical=ok))
            print(f"{name:38s} {br:3d}x{nw} {us:7.1f} us {pct:5.1f} % of copy identical={ok}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "copy_us": copies, "results": res}, open(sys.argv[1], "w"), indent=1)
