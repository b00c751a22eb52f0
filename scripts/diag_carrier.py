"""Diagnostic: carrier x group scale vs the packed-FP4 dequantization, and carrier GEMMs vs float64,
for bf16/fp32 inputs, rows/columns, rotations and groupings (GPU)."""
import torch
from mxtrain.kernels.quantize import quantize_mxfp4_2d as q, carrier_values, dequantize_fp4
from mxtrain.kernels.gemm import mx_gemm_nt

torch.manual_seed(0)
for dt in (torch.bfloat16, torch.float32):
    x = torch.randn(1024, 1088, device="cuda").to(dt)
    for axis in (1, 0):
        for rot in (0, 16, 32):
            for gr in (1, 128):
                for br in (None, 32, 64):
                    if gr == 128 and br is not None:
                        continue
                    a = q(x, axis, rot=rot, carrier=True, fp4=True, group_rows=gr, k_multiple=512, block_rows=br)
                    a2 = q(x, axis, rot=rot, carrier=True, fp4=False, group_rows=gr, k_multiple=512, block_rows=br)
                    ref = dequantize_fp4(a)
                    v1 = carrier_values(a)[: a.R, : a.scales.shape[1] * 32]
                    nb1 = int((v1 != ref).sum())
                    v = carrier_values(a2)[: a.R, : a.scales.shape[1] * 32]
                    print("   fp4+carrier mismatches", nb1, "carrier-only below:")
                    bad = (v != ref)
                    nb = int(bad.sum())
                    loc = bad.nonzero()[:3].tolist() if nb else []
                    print(f"{str(dt)[6:]:8s} axis={axis} rot={rot:3d} group={gr:3d} BR={br} mismatches={nb} "
                          f"inexact={int(a.inexact.item())} first={loc}", flush=True)
A = torch.randn(1024, 1088, device="cuda", dtype=torch.bfloat16)
B = torch.randn(768, 1088, device="cuda", dtype=torch.bfloat16)
for rot in (0, 16, 32):
    for ga, gb in ((1, 128), (1, 1)):
        qa = q(A, 1, rot=rot, carrier=True, fp4=True, group_rows=ga, k_multiple=512)
        qb = q(B, 1, rot=rot, carrier=True, fp4=True, group_rows=gb, k_multiple=512)
        qa2 = q(A, 1, rot=rot, carrier=True, fp4=False, group_rows=ga, k_multiple=512)
        qb2 = q(B, 1, rot=rot, carrier=True, fp4=False, group_rows=gb, k_multiple=512)
        y = mx_gemm_nt(qa2, qb2, "fp8_carrier").double()
        r = dequantize_fp4(qa).double() @ dequantize_fp4(qb).double().t()
        print(f"gemm rot={rot} ga={ga} gb={gb} rel={((y - r).norm() / r.norm()).item():.3e}", flush=True)
