"""Diagnostic (GPU): run the fused-kernel self-check (``mxtrain.kernels.quantize.selfcheck``) for many
kernel variants, print which outputs differ and where, and time a few carrier configurations. Usage: PYTHONPATH=. python3 scripts/diag_selfcheck.py [OUT.json]"""
import json
import sys

import torch
import triton

from mxtrain.kernels import quantize as kq

# (dtype, axis, rot, signs, rule, sr, prescale, group_rows, BR, warps, k_multiple, fp4, r16, k16)
V = []
for dt in (torch.bfloat16, torch.float32):
    for axis in (1, 0):
        for rot, signs, sr in ((0, False, False), (0, False, True), (16, False, False), (32, True, True)):
            for gr, br, nw in ((1, 32, 4), (1, 64, 4), (128, 128, 8)):
                for fp4 in (False, True):
                    V.append((dt, axis, rot, signs, "floor", sr, 1.0, gr, br, nw, 512, fp4, True, True))
V.append((torch.bfloat16, 1, 0, False, "floor", False, 1.0, 1, 64, 4, 512, True, False, False))
V.append((torch.float32, 1, 0, False, "floor", False, 1.0, 1, 64, 4, 128, True, False, False))
V.append((torch.bfloat16, 1, 64, True, "floor", True, 0.75, 1, 32, 4, 512, False, True, True))
res = []
summary = {}
for v in V:
    dt, axis, rot, signs, rule, sr, ps, gr, br, nw, km, fp4, r16, k16 = v
    try:
        r = kq.selfcheck("cuda", dt, axis, rot, signs, rule, sr, ps, gr, br, nw, km, fp4, r16, k16, samples=4)
    except Exception as e:  # noqa: BLE001
        r = {"ok": False, "error": repr(e)[:200]}
    tag = f"{str(dt)[6:]:8s} ax{axis} rot{rot:3d} sg{int(signs)} sr{int(sr)} g{gr:3d} BR{br:3d} fp4{int(fp4)} " \
          f"r16{int(r16)} k16{int(k16)} km{km}"
    print(tag, "OK" if r["ok"] else "FAIL", {k: x for k, x in r.items() if k != "ok"}, flush=True)
    res.append({"variant": [str(x) for x in v], **r})
    summary["ok" if r["ok"] else "fail"] = summary.get("ok" if r["ok"] else "fail", 0) + 1
print(f"{summary.get('ok', 0)} pass, {summary.get('fail', 0)} fail")
# timing of a few carrier configurations
x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
for axis, rot, br in ((1, 0, 32), (1, 0, 64), (1, 16, 32), (1, 16, 64), (0, 16, 32), (0, 0, 32)):
    ms = triton.testing.do_bench(lambda: kq.quantize_mxfp4_2d(x, axis, rot=rot, carrier=True, fp4=False,
                                                              k_multiple=512, block_rows=br, _check=False),
                                 warmup=25, rep=100)
    gbs = x.numel() * 3 / ms / 1e6
    print(f"time axis={axis} rot={rot} BR={br}: {ms*1e3:.1f} us {gbs:.0f} GB/s", flush=True)
    res.append({"time": [axis, rot, br], "us": ms * 1e3})
if len(sys.argv) > 1:
    json.dump(res, open(sys.argv[1], "w"), indent=1)
