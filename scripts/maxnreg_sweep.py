"""GPU: the fused quantize kernels with register caps (Triton's ``maxnreg``; the cols and dual kernels hold
32 tokens a thread, ~127 registers uncapped, 4 blocks of 128 threads per SM), timed in one run, the caps
interleaved and repeated so that run-to-run noise shows; every output checked bit-identical to the
uncapped kernel's. Also the two single H16 passes of one activation against the one-pass dual kernel.

    python3 scripts/maxnreg_sweep.py OUT.json [caps, default none,128,96,80,64,48] [repeats, default 1]
"""
import json
import sys

import torch

from mxtrain.bench import _bench, warm_gpu
from mxtrain import settings
from mxtrain.kernels import CACHES
from mxtrain.kernels import quantize as kq

caps = [None if c == "none" else int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "none,128,96,80,64,48").split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
warm_gpu()
copy_us = _bench(lambda: y.copy_(x)) * 1e3
q = kq.quantize_mxfp4_2d
cases = [
    ("act cols H16", ("cols",), lambda: q(x, 0, rot=16, fp4=False)),
    ("act cols", ("cols",), lambda: q(x, 0, fp4=False)),
    ("act rows H16", ("blocks",), lambda: q(x, 1, rot=16, fp4=False)),
    ("weight rows 128x128 H16", ("blocks128",), lambda: q(w, 1, rot=16, fp4=False, group_rows=128)),
    ("weight cols 128x128 H16", ("cols",), lambda: q(w, 0, rot=16, fp4=False, group_rows=128)),
    ("two passes H16 (rows + cols)", ("cols",), lambda: (q(x, 1, rot=16, fp4=False), q(x, 0, rot=16, fp4=False))),
    ("dual H16", ("dual",), lambda: kq.quantize_mxfp4_dual(x, dict(rot=16), dict(rot=16), _check=False)),
    ("dual no rotation", ("dual",), lambda: kq.quantize_mxfp4_dual(x, dict(), dict(), _check=False)),
]
settings.configure(dual="on")
saved = settings.current().qmaxnreg, kq.CAPPED_KERNELS


def with_cap(kerns, cap):
    """The register cap ``cap`` (None: uncapped) on the kernels ``kerns`` only (the plain "blocks" kernel
    included, which the library never caps)."""
    kq.CAPPED_KERNELS = tuple(kerns)
    settings.configure(qmaxnreg=cap or 0)
    CACHES.clear_plans()   # plans key on the setting, not on CAPPED_KERNELS


def outs(r):
    r = r if isinstance(r, tuple) else (r,)
    return [(o.carrier.view(torch.uint8).clone(), o.gscale.clone()) for o in r]


out = []
for name, kerns, f in cases:
    with_cap(kerns, None)
    ref = outs(f())
    for rep in range(reps):
        base = None
        for cap in caps:
            with_cap(kerns, cap)
            try:
                same = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(outs(f()), ref))
                us = _bench(f) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"{name} maxnreg={cap}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                continue
            base = base or us
            out.append(dict(case=name, maxnreg=cap, repeat=rep, us=us, same=same, vs_first=base / us))
            print(f"{name:30s} maxnreg={cap!s:5s} {us:7.1f} us  {base / us:5.2f}x  identical={same}", flush=True)
settings.configure(qmaxnreg=saved[0])
kq.CAPPED_KERNELS = saved[1]
json.dump({"device": torch.cuda.get_device_name(), "copy_us": copy_us, "results": out}, open(sys.argv[1], "w"),
          indent=1)
