"""Is the FP8-carrier GEMM exact with less reduction padding on this GPU? (The setting ``carrier_k``.)

cuBLAS's blockwise FP8 GEMM (1x128 scales for A, 128x128 for B, what ``torch._scaled_mm`` runs for the carrier)
returned wrong results at K/128 = 9, so the carrier pads K to a multiple of 512 by default. This probe multiplies
real MXFP4 operands (the fused quantizer's carriers of random data, with outliers) padded to a multiple of 128 only,
for every K/128 from 1 to 24 and several row counts, and compares each product with the exact MX values multiplied
in float64. A wrong kernel shows as an error of the size of the result; float32 accumulation as one near 1e-6.

    python tools/carrier_k_probe.py [--out probe.json]

Prints one line per K/128 (REFUSED where ``_scaled_mm`` will not run that layout: torch 2.11 refuses 128x128 B
groups unless K/128 is a multiple of 4) and the smallest ``carrier_k`` (128, 256 or 512) for which every tested K
that is a multiple of it came out right; set ``MXTRAIN_CARRIER_K`` to it only on this GPU model, torch and CUDA.
``--b-group-rows 1`` probes 1x128 B groups instead of the weights' default 128x128.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--b-group-rows", type=int, default=128, choices=(1, 128),
                    help="B's scale groups: 128 (128x128, the weights' default) or 1 (1x128)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest error relative to the result's largest value")
    a = ap.parse_args()
    import torch
    from mxtrain.errors import UserError
    from mxtrain.kernels import gemm
    from mxtrain.kernels.mxfp4 import quantize_op
    from mxtrain.kernels.mxfp4.carrier import group_values
    if not torch.cuda.is_available():
        print("carrier_k_probe: needs a CUDA GPU with FP8 tensor cores", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    res, errors = {}, {}
    for m in range(1, 25):
        K = 128 * m
        worst = 0.0
        for rows_a, rows_b in ((128, 128), (256, 384), (4096, 768), (1000, 2048)):
            A = torch.randn(rows_a, K, device=dev, generator=g, dtype=torch.bfloat16)
            B = torch.randn(rows_b, K, device=dev, generator=g, dtype=torch.bfloat16)
            A[::7, ::13] *= 64                                  # (outliers: blocks with other scales)
            qa = quantize_op(A, 1, carrier=True, fp4=False, group_rows=1, k_multiple=128)
            qb = quantize_op(B, 1, carrier=True, fp4=False, group_rows=a.b_group_rows, k_multiple=128)
            try:
                y = gemm.mx_gemm_nt(qa, qb, "fp8_carrier", torch.float32).double()
            except (RuntimeError, UserError) as e:           # refused (gemm's UserError names carrier_k): say why
                errors.setdefault(m, f"{rows_a}x{rows_b}: {str(e).splitlines()[0][:120]}")
                worst = float("inf")
                continue
            va = group_values(qa.carrier, qa.gscale).double()[:rows_a]
            vb = group_values(qb.carrier, qb.gscale).double()[:rows_b]
            want = va @ vb.t()
            err = ((y - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()
            worst = max(worst, err)
        res[m] = worst
        verdict = "REFUSED" if m in errors else "ok" if worst < a.tol else "WRONG"
        print(f"K = {K:5d} (K/128 = {m:2d}): largest relative error {worst:.2e} {verdict}"
              + (f" ({errors[m]})" if m in errors else ""), flush=True)
    ok = {k: all(res[m] < a.tol for m in res if (128 * m) % k == 0) for k in (128, 256, 512)}
    best = min((k for k, v in ok.items() if v), default=None)
    name = torch.cuda.get_device_name(dev)
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}, B groups {a.b_group_rows}x128: "
          f"carrier_k {best or 'none'} is exact for every tested K ({', '.join(f'{k}: {v}' for k, v in ok.items())})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": name, "b_group_rows": a.b_group_rows, "torch": torch.__version__,
                       "cuda": torch.version.cuda,
                       "relative_error_by_k_over_128": {m: (None if m in errors else v) for m, v in res.items()},
                       "refused": errors, "exact": ok, "carrier_k": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
