"""GPU: the one-pass dual quantize (both carrier operands of a 16384x4096 bf16 activation) in several
kernel layouts and block sizes, against the two single passes and a copy, in one run; JSON to argv[1]."""
import json
import sys

import torch

from mxtrain.bench import dual_timings, warm_gpu

x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
warm_gpu()
out = []
copy_us = None
cases = [("dY H16", dict(rot=16), dict(rot=16)), ("X H16, B 128x128", dict(rot=16), dict(rot=16, group_rows=128)),
         ("no rotation", dict(), dict())]
for name, a, b in cases:
    cfgs = ([(s, (bra, 128), nw) for s in (False, True) for bra, nw in ((64, 8), (32, 4), (16, 4), (32, 8))]
            if b.get("group_rows", 1) == 128 else
            [(s, (bra, brb), nw) for s in (False, True) for bra, brb, nw in
             ((32, 64, 4), (16, 64, 2), (16, 64, 4), (64, 128, 8), (32, 128, 4))])
    d = dual_timings(x, a, b, [dict(sequential=s, block_rows=br, num_warps=nw) for s, br, nw in cfgs])
    copy_us, t2 = d["copy_ms"] * 1e3, d["two_pass_ms"]
    for (seq, br, nw), t in zip(cfgs, d["ms"]):
        if t is None:
            continue
        frac = d["bytes"] / (t * 1e-3) / (d["copy_GBps"] * 1e9)
        out.append(dict(case=name, sequential=seq, block_rows=br, num_warps=nw, us=t * 1e3, two_pass_us=t2 * 1e3,
                        frac_of_copy=frac, speedup_vs_two_passes=t2 / t))
        print(f"{name:18s} seq={seq!s:5s} BR={br} warps={nw}: {t*1e3:6.1f} us ({100*frac:4.1f}% of copy), "
              f"two passes {t2*1e3:6.1f} us -> {t2/t:.2f}x", flush=True)
json.dump({"copy_us": copy_us, "device": torch.cuda.get_device_name(), "results": out},
          open(sys.argv[1], "w"), indent=1)
