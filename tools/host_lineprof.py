"""A line profile (the ``line_profiler`` package, carried as a wheel) of 200 ``MXLinear`` forward + backward calls
(256 x 512 x 512, bf16) over the fast path's functions, eager or compiled. The profiler's own cost per line
inflates short lines: read it for where the time goes relative to the rest, not for absolute times.

    python tools/host_lineprof.py [RECIPE] [compiled]
"""
import sys, torch
from line_profiler import LineProfiler
from mxtrain.linear import fast, skeleton
from mxtrain.bench.suite import fwd_bwd_call
from mxtrain.linear.module import MXLinear
from mxtrain.kernels.mxfp4 import ops as Q, launch as L
from mxtrain.kernels import gemm as G, expand as E
from mxtrain import linear as LIN
from mxtrain.linear import ops as LOPS

recipe = sys.argv[1] if len(sys.argv) > 1 else "mxfp4-all-dh16"
comp = len(sys.argv) > 2 and sys.argv[2] == "compiled"
dev = "cuda"
x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
lin = MXLinear(512, 512, bias=False, device=dev, dtype=torch.bfloat16, recipe=recipe)
mod = torch.compile(lin, fullgraph=True) if comp else lin
f = fwd_bwd_call(mod, x, gy, True)
for _ in range(30):
    f()
torch.cuda.synchronize()
lp = LineProfiler()
for fn in (fast.backward, fast.forward, fast.quantize_input, fast._quant, fast._quant_pair, fast._gemm_fn,
           fast.carrier_of, skeleton.EagerLinear.forward, skeleton.EagerLinear.backward, skeleton.forward,
           skeleton.backward, fast.FastBackend.start_forward, fast.FastBackend.start_backward, fast.FastBackend.gemm,
           fast.apply,
           Q.quantize_mxfp4_2d, Q.quantize_op, L.Plan.__call__, G.mx_gemm_nt, G._scaled_mm, E.carrier_from_packed,
           LIN.mx_linear, LOPS._linear_backward_op, LOPS._linear_q_op, LOPS._quantize_input_op, fast.unpack_operand,
           fast.pack_operand, fast._outputs, fast._counter):
    try:
        lp.add_function(fn)
    except Exception as e:
        print("skip", fn, e)
lp.enable_by_count()
for _ in range(200):
    f()
lp.disable_by_count()
torch.cuda.synchronize()
lp.print_stats(output_unit=1e-6, stripzeros=True)
