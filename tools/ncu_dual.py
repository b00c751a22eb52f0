"""GPU: the one-read dual quantize pass (``quantize_mxfp4_dual``) at a Hugging Face model's shapes, for Nsight
Compute: what limits the pass where it runs at a third of copy speed.

Cases (bf16 in, 8,192 tokens a step as in docs/library.md's example, H16 on both sides, FP8 carriers out, the
default launch configuration): ``X1024``, an activation of 1,024 features with its Wgrad operand in 128x128
groups (the compiled layer's X where ``wgrad_x=auto`` keeps the carrier), and ``dY2816`` / ``dY1024``, output
gradients of 2,816 and 1,024 features (both sides in 1x128 groups). Each case runs three launches; profile the
third (the first compiles and self-checks):

    python3 tools/ncu_dual.py X1024 dY2816          # compile outside the profile first
    ncu --clock-control none -k regex:_mxfp4_dual_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats python3 tools/ncu_dual.py X1024

Results: BENCHMARKS.md, "Why the dual pass runs at a third of copy at small widths".
"""
import sys

import torch

from mxtrain import settings
from mxtrain.kernels import mxfp4 as kq

TOKENS = 8192
CASES = {"X1024": (1024, dict(rot=16), dict(rot=16, group_rows=128)),
         "dY2816": (2816, dict(rot=16), dict(rot=16)),
         "dY1024": (1024, dict(rot=16), dict(rot=16))}


def main(names):
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    for name in names or list(CASES):
        if name not in CASES:
            raise SystemExit(f"ncu_dual: unknown case {name!r}; the cases: {', '.join(CASES)}")
        K, a, b = CASES[name]
        x = torch.randn(TOKENS, K, device="cuda", dtype=torch.bfloat16)
        with settings.override(dual="on"):
            for _ in range(3):
                kq.quantize_mxfp4_dual(x, dict(a, index_strides=(K, 1)), dict(b, index_strides=(1, K)),
                                       k_multiple=512, counter=cnt, fp4_b=False)
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
