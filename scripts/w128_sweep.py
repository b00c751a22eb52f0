"""GPU: the weight passes with 128x128 groups (W along in-features for Fprop, blocks kernel; along
out-features for Dgrad, cols kernel) over (warps, register cap), timed in one run against a bf16 copy of
the same tensor, the settings interleaved and repeated; every output checked bit-identical to the default
configuration's.

    python3 scripts/w128_sweep.py OUT.json [repeats, default 2]
"""
import json
import sys

import torch

from mxtrain.bench import _bench, warm_gpu
from mxtrain import settings
from mxtrain.kernels import quantize as kq

reps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(w)
q = kq.quantize_mxfp4_2d
# (case, launch-options key, axis, [(block rows, warps)], [caps])
cases = [
    ("weight rows 128x128 H16", "blocks128", 1, [(128, 8), (128, 16)], [None, 96, 80, 64, 56]),
    ("weight cols 128x128 H16", "cols", 0, [(128, 8), (128, 4)], [None, 96, 80, 72, 64]),
]
saved = settings.current().qmaxnreg


def setting(key=None, cap=None):
    """The library's launch options, with the register cap set to ``cap`` (None: uncapped; each case runs
    only the kernel ``key``); no key: the library's defaults. Launch plans key on the setting."""
    assert key is None or key in kq.CAPPED_KERNELS, key
    settings.configure(qmaxnreg=saved if key is None else (cap or 0))


def outs(o):
    return o.carrier.view(torch.uint8).clone(), o.gscale.clone()


warm_gpu()
res = []
for name, key, axis, cfgs, caps in cases:
    setting()
    ref = outs(q(w, axis, rot=16, fp4=False, group_rows=128))
    for rep in range(reps):
        copy_us = _bench(lambda: y.copy_(w)) * 1e3
        for br, nw in cfgs:
            for cap in caps:
                setting(key, cap)
                f = lambda: q(w, axis, rot=16, fp4=False, group_rows=128, block_rows=br, num_warps=nw)  # noqa: E731
                try:
                    c, g = outs(f())
                    same = torch.equal(c, ref[0]) and torch.equal(g, ref[1])
                    us = _bench(f) * 1e3
                except Exception as e:  # noqa: BLE001
                    print(f"{name} {br}x{nw} maxnreg={cap}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                    continue
                frac = (3 * w.numel() + w.numel() // 128 * 4) / us / (4 * w.numel() / copy_us)   # as bench quantize
                res.append(dict(case=name, block_rows=br, num_warps=nw, maxnreg=cap, repeat=rep, us=us,
                                copy_us=copy_us, frac_of_copy=frac, same=same))
                print(f"{name:26s} {br}x{nw:<2d} maxnreg={cap!s:5s} {us:7.1f} us  copy {copy_us:6.1f} us  "
                      f"{100 * frac:5.1f} % of copy  identical={same}", flush=True)
setting()
json.dump({"device": torch.cuda.get_device_name(), "results": res}, open(sys.argv[1], "w"), indent=1)
