"""``mxtrain bench quantize|gemm|breakdown|linear|step|blocks|host|experts|limits|all``: GPU benchmarks of the fast path, JSON out.

Every ratio is measured in the same run (``triton.testing.do_bench`` medians, random data):

* ``quantize``: fused MXFP4 quantize (bf16 in; FP8 carrier + group scales out, optionally packed
  FP4 + E8M0 too) as bytes moved per second, against a bf16 device-to-device copy of the same
  tensor (bytes read + written).
* ``gemm``: TFLOP/s of the exact-MXFP4 GEMM (FP8 carrier, blockwise ``_scaled_mm``) vs cuBLAS BF16
  and FP8 (tensorwise and rowwise ``_scaled_mm``) at 8192^3 and Llama-8B shapes (M = 16384 tokens).
* ``breakdown``: each fused quantize and each GEMM of one MXLinear fwd+bwd (16384x4096x4096, H16) alone.
* ``linear``: ``MXLinear`` forward+backward per preset vs ``nn.Linear`` BF16 at 8B shapes.
* ``step``: the whole training step (embedding, blocks, head, loss, fused AdamW; the whole model under
  ``torch.compile``) per variant: BF16, torchao's float8 (tensorwise, rowwise; when torchao is
  installed), mxtrain's ``fp8`` and MXFP4 presets, with peak memory and the ratios to BF16 and to the
  fastest FP8 of the run (``mxtrain.bench.step``). ``--model 8b-layers|1b|125m``, a model written outside
  mxtrain (``125m-fused``, ``8b-fused``), or ``hf-95m``: the Hugging Face Llama of docs/library.md, built from a
  config and trained on its own loss, as in a user's loop (needs ``transformers``). ``--rounds R``: every
  variant timed R times in one process, the order rotated each round; medians of the rounds' ratios with
  their range (a ratio near 1 moves by a percent or two between measurements).
* ``blocks``: forward+backward of a stack of Llama blocks with 8B shapes only (bf16, an unfused FP8
  rowwise reference, MXFP4 presets), eager and with compiled elementwise layers: a breakdown of the
  step without embedding, head, loss and optimizer.
* ``host``: the host's time to issue one compiled layer's forward and backward at a tiny shape (256 x 512 x
  512, bf16), ``nn.Linear``, torchao's float8 and ``MXLinear`` per recipe, with the ratio to ``nn.Linear`` and
  the compiled form each MX layer takes.
* ``experts``: one mixture-of-experts layer's experts forward + backward at Mixtral 8x7B's shapes, eager:
  Hugging Face's ``MixtralExperts`` in bf16 (``grouped_mm`` and its loop) and with torchao's FP8 rowwise grouped
  GEMM (when torchao is installed) against each recipe through the per-expert loop and the grouped MX experts path
  (``mxtrain.bench.experts``; needs ``transformers``).
* ``limits`` (no GPU needed): the step's FLOPs and quantize bytes counted per recipe, and the fastest
  step each recipe can reach at given GEMM rates and bandwidth (``mxtrain.bench.limits``; ``--bf16-step-ms``
  a measured BF16 step, ``--rates bf16_tflops=...,copy_tbs=...``); with ``--gpus N`` also each GPU's FSDP2
  traffic in a step and the efficiency it allows with none of it overlapped (``--one-gpu-step-ms``: a measured
  one-GPU step to judge it against). Printed as a table, JSON with ``--out``.

Run as ``mxtrain bench all --out bench.json`` or ``python -m mxtrain.bench all``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from .._io import write_json, write_text
from ..errors import UserError
from ..numerics.hadamard import rotation_signs
from .. import settings as _settings
from ..linear.module import MXLinear, convert
from ..model.llama import Block, ModelConfig, rope_tables
from . import experts as _experts, step as _bs, limits as BL
from ..linear import implementation
from .step import counted_config, host_profile, kernel_profile, TORCHAO, split_variant, variant_options
from ..numerics import recipes as _recipes

__all__ = ["register", "main"]

LLAMA8B_NK = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]
LINEAR_PRESETS = ["mxfp4-all-dh16", "mxfp4-all", "mxfp4-all-sr", "tseng"]
STEP_PRESETS = ["mxfp4-all-dh16", "mxfp4-all", "tseng"]


def _bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of ``fn`` (triton.testing.do_bench)."""
    import triton.testing  # optional
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _env() -> dict:
    import triton  # optional
    d = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        d["device"] = torch.cuda.get_device_name()
        d["capability"] = list(torch.cuda.get_device_capability())
    from ..kernels import backend  # startup
    d["backend"] = backend("cuda" if torch.cuda.is_available() else "cpu")
    return d


# ---------------------------------------------------------------------------------------- quantize

def bench_quantize(args) -> dict:
    from ..kernels.mxfp4 import quantize_mxfp4_2d  # startup
    dev = "cuda"
    res = []
    cases = [
        ("act 16384x4096 rows carrier", (16384, 4096), 1, dict()),
        ("act 16384x4096 rows carrier H16", (16384, 4096), 1, dict(rot=16)),
        ("act 16384x4096 rows carrier H64 signs SR x0.75", (16384, 4096), 1,
         dict(rot=64, signs=rotation_signs(64, "fixed", device=dev), rounding="stochastic", key=123, prescale=0.75)),
        ("act 16384x4096 cols (wgrad) carrier", (16384, 4096), 0, dict()),
        ("act 16384x4096 cols (wgrad) carrier H16", (16384, 4096), 0, dict(rot=16)),
        ("act 16384x4096 cols (wgrad) carrier H32 signs SR", (16384, 4096), 0,
         dict(rot=32, signs=rotation_signs(32, "fixed", device=dev), rounding="stochastic", key=123)),
        ("act 16384x4096 cols (wgrad) carrier H64 signs SR x0.75", (16384, 4096), 0,
         dict(rot=64, signs=rotation_signs(64, "fixed", device=dev), rounding="stochastic", key=123, prescale=0.75)),
        ("act 16384x4096 cols fp4 only H16", (16384, 4096), 0, dict(rot=16, carrier=False, fp4=True)),
        ("act 16384x14336 rows carrier H16", (16384, 14336), 1, dict(rot=16)),
        ("act 16384x14336 cols (wgrad) carrier H16", (16384, 14336), 0, dict(rot=16)),
        ("weight 14336x4096 rows 128x128 H16", (14336, 4096), 1, dict(rot=16, group_rows=128)),
        ("weight 14336x4096 cols (dgrad) 128x128 H16", (14336, 4096), 0, dict(rot=16, group_rows=128)),
        ("act 16384x4096 rows carrier+fp4 H16", (16384, 4096), 1, dict(rot=16, fp4=True)),
        ("act 16384x4096 rows fp4 only", (16384, 4096), 1, dict(carrier=False, fp4=True)),
    ]
    from ..kernels import mxfp4 as kq  # startup
    flt = getattr(args, "filter", "") or ""
    for name, shape, axis, kw in cases:
        if flt not in name:
            continue
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        t_copy = _bench(lambda: y.copy_(x))
        kw = dict(kw)
        kw.setdefault("fp4", False)
        kw.setdefault("carrier", True)
        n = x.numel()
        out_bytes = 0
        if kw["carrier"]:
            out_bytes += n + n // 128 * 4
        if kw["fp4"]:
            out_bytes += n // 2 + n // 32
        moved = 2 * n + out_bytes
        copy_bw = 4 * n / (t_copy * 1e-3)
        # every kernel that can run this case, each at its best of a few configurations; the default first
        if kw.get("rot", 0) not in kq.BLOCK_ROTS:
            kernels = ["tile"]
        elif axis == 0:   # a row-major input along columns
            kernels = ["cols", "blocks"]
        else:
            kernels = ["blocks", "tile"]
        for kern in kernels:
            with _settings.override(qkernel=kern):   # this kernel
                # (block rows, warps): the fastest ones of earlier sweeps on the H100 (BENCHMARKS.md); compiling
                # more takes minutes
                if kern == "cols":   # 2 or 4 values of each [4, BR] tensor a thread
                    cfgs = ((64, 4), (32, 2), (16, 1)) if kw.get("group_rows", 1) == 1 else ((128, 8), (128, 4))
                elif kern == "tile":   # (64, 4): the launch table's choice (a thread per 64-wide row group)
                    cfgs = ((64, 4), (32, 4), (64, 8), (128, 8)) if kw.get("group_rows", 1) == 1 else ((128, 8),)
                else:
                    cfgs = ((16, 2), (32, 4), (64, 4)) if kw.get("group_rows", 1) == 1 else ((128, 8),)
                best = None
                for br, nw in cfgs:
                    try:
                        fn = lambda: quantize_mxfp4_2d(x, axis, block_rows=br, num_warps=nw, **kw)  # noqa: E731
                        t = _bench(fn)
                        if best is None or t < best[0]:
                            best = (t, br, nw)
                    except Exception as e:  # noqa: BLE001
                        res.append({"case": name, "kernel": kern, "block_rows": br, "num_warps": nw, "error": repr(e)[:300]})
                if best is None:
                    continue
                t = best[0]
                bw = moved / (t * 1e-3)
                res.append({"case": name, "kernel": kern, "shape": list(shape), "axis": axis, "ms": t,
                            "block_rows": best[1], "num_warps": best[2], "bytes": moved, "GBps": bw / 1e9,
                            "copy_ms": t_copy, "copy_GBps": copy_bw / 1e9, "frac_of_copy_bw": bw / copy_bw})
                print(f"quantize {name:46s} {kern:12s} {t*1e3:8.1f} us  {bw/1e9:7.0f} GB/s  copy {copy_bw/1e9:6.0f} GB/s  "
                      f"{100*bw/copy_bw:5.1f}%  (BR={best[1]}, warps={best[2]})", flush=True)
        del x, y
    # both operands of one activation from one read (quantize_mxfp4_dual) against the two passes
    dual_cases = [
        ("act 16384x4096 rows + cols carrier (dual)", dict(), dict()),
        ("act 16384x4096 rows + cols carrier H16 (dual, dY)", dict(rot=16), dict(rot=16)),
        ("act 16384x4096 rows + cols 128x128 H16 (dual, X)", dict(rot=16), dict(rot=16, group_rows=128)),
    ]
    for name, a, b in dual_cases:
        if flt not in name:
            continue
        x = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
        d = dual_timings(x, a, b)
        t, t2 = d["ms"][0], d["two_pass_ms"]
        bw, copy_bw = d["bytes"] / (t * 1e-3), d["copy_GBps"] * 1e9
        res.append({"case": name, "kernel": "dual", "shape": [16384, 4096], "ms": t, "two_pass_ms": t2,
                    "bytes": d["bytes"], "GBps": bw / 1e9, "copy_ms": d["copy_ms"], "copy_GBps": copy_bw / 1e9,
                    "frac_of_copy_bw": bw / copy_bw, "speedup_vs_two_passes": t2 / t})
        print(f"quantize {name:46s} {'dual':12s} {t*1e3:8.1f} us  {bw/1e9:7.0f} GB/s  copy {copy_bw/1e9:6.0f} GB/s  "
              f"{100*bw/copy_bw:5.1f}%  (two passes {t2*1e3:.1f} us: {t2/t:.2f}x)", flush=True)
        del x
    return {"quantize": res}


def dual_timings(x: torch.Tensor, a: dict, b: dict, configs=({},)) -> dict:
    """``quantize_mxfp4_dual(x, a, b, **cfg)`` timed for each kernel configuration in ``configs`` (ms, in
    order; None where it failed), the two single passes it replaces, and a copy of ``x``: with the bytes
    one pass moves (2-byte input read once, both carriers and their group scales written)."""
    from ..kernels import mxfp4 as kq  # startup
    y = torch.empty_like(x)
    t_copy = _bench(lambda: y.copy_(x))
    n = x.numel()
    two = _bench(lambda: (kq.quantize_mxfp4_2d(x, 1, fp4=False, **a), kq.quantize_mxfp4_2d(x, 0, fp4=False, **b)))
    ms = []
    for cfg in configs:
        try:
            ms.append(_bench(lambda: kq.quantize_mxfp4_dual(x, a, b, **cfg)))
        except Exception as e:  # noqa: BLE001 - a configuration the kernel refuses (sweeps)
            print(f"dual quantize {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            ms.append(None)
    return {"ms": ms, "two_pass_ms": two, "copy_ms": t_copy, "copy_GBps": 4 * n / (t_copy * 1e-3) / 1e9,
            "bytes": 2 * n + 2 * (n + n // 128 * 4)}


# -------------------------------------------------------------------------------------------- gemm

def _fp8_rowwise(x: torch.Tensor):
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    s = amax / 448.0
    return (x.float() / s).to(torch.float8_e4m3fn), s


def bench_gemm(args) -> dict:
    from ..kernels.gemm import mx_gemm_nt, probe  # startup
    from ..kernels.mxfp4 import quantize_mxfp4_2d  # startup
    dev = "cuda"
    res = {"probe": probe(dev), "shapes": []}
    shapes = [(8192, 8192, 8192)] + [(16384, n, k) for n, k in LLAMA8B_NK]
    for M, N, K in shapes:
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        flops = 2.0 * M * N * K
        r = {"M": M, "N": N, "K": K}
        r["bf16_ms"] = _bench(lambda: torch.matmul(a, b.t()))
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        try:
            r["fp8_tensorwise_ms"] = _bench(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16))
        except Exception as e:  # noqa: BLE001
            r["fp8_tensorwise_error"] = repr(e)[:200]
        try:
            qa8, sa = _fp8_rowwise(a)
            qb8, sb = _fp8_rowwise(b)
            r["fp8_rowwise_ms"] = _bench(lambda: torch._scaled_mm(qa8, qb8.t(), sa, sb.t(), out_dtype=torch.bfloat16))
        except Exception as e:  # noqa: BLE001
            r["fp8_rowwise_error"] = repr(e)[:200]
        qa = quantize_mxfp4_2d(a, 1, carrier=True, fp4=False, group_rows=1)
        qb = quantize_mxfp4_2d(b, 1, carrier=True, fp4=False, group_rows=128)
        r["mxfp4_carrier_ms"] = _bench(lambda: mx_gemm_nt(qa, qb, "fp8_carrier", torch.bfloat16))
        r["mxfp4_carrier_plus_quant_act_ms"] = _bench(
            lambda: mx_gemm_nt(quantize_mxfp4_2d(a, 1, carrier=True, fp4=False, rot=16), qb, "fp8_carrier",
                               torch.bfloat16))
        # exactness vs float64 of the dequantized operands (sample rows to keep it cheap)
        y = mx_gemm_nt(qa, qb, "fp8_carrier", torch.bfloat16)[:256].double()
        from ..kernels.mxfp4 import carrier_values  # startup
        ref = carrier_values(qa)[:256].double() @ carrier_values(qb)[:N].double().t()
        r["rel_err_vs_f64"] = ((y - ref).norm() / ref.norm()).item()
        r["inexact_blocks"] = int(qa.inexact.item() + qb.inexact.item())
        # the packed-FP4 paths (FP4-native GPUs; emulated or decoded here): Triton tl.dot_scaled and
        # dequantize + bf16 GEMM, each checked against float64 like the carrier
        fa = quantize_mxfp4_2d(a, 1, carrier=False, fp4=True)
        fb = quantize_mxfp4_2d(b, 1, carrier=False, fp4=True)
        from ..kernels.mxfp4 import dequantize_fp4  # startup
        ref4 = dequantize_fp4(fa)[:256].double() @ dequantize_fp4(fb).double().t()
        for name in ("dot_scaled", "dequant"):
            try:
                r[f"mxfp4_{name}_ms"] = _bench(lambda: mx_gemm_nt(fa, fb, name, torch.bfloat16))
                y4 = mx_gemm_nt(fa, fb, name, torch.bfloat16)[:256].double()
                r[f"{name}_rel_err_vs_f64"] = ((y4 - ref4).norm() / ref4.norm()).item()
            except Exception as e:  # noqa: BLE001
                r[f"mxfp4_{name}_error"] = repr(e)[:200]
        del fa, fb
        for k in list(r):
            if k.endswith("_ms") and not k.startswith("mxfp4_carrier_plus"):
                r[k.replace("_ms", "_tflops")] = flops / (r[k] * 1e-3) / 1e12
        r["carrier_over_bf16"] = r["bf16_ms"] / r["mxfp4_carrier_ms"]
        if "fp8_tensorwise_ms" in r:
            r["carrier_over_fp8_tensorwise"] = r["fp8_tensorwise_ms"] / r["mxfp4_carrier_ms"]
        print(f"gemm {M}x{N}x{K}: bf16 {r['bf16_tflops']:6.0f}  fp8 {r.get('fp8_tensorwise_tflops', 0):6.0f}  "
              f"fp8-row {r.get('fp8_rowwise_tflops', 0):6.0f}  mxfp4-carrier {r['mxfp4_carrier_tflops']:6.0f} "
              f"TFLOP/s  ({r['carrier_over_bf16']:.2f}x bf16; err {r['rel_err_vs_f64']:.2e}); "
              f"packed FP4: dot_scaled {r.get('mxfp4_dot_scaled_tflops', 0):6.0f} (err "
              f"{r.get('dot_scaled_rel_err_vs_f64', float('nan')):.2e}), dequant+bf16 "
              f"{r.get('mxfp4_dequant_tflops', 0):6.0f} TFLOP/s", flush=True)
        res["shapes"].append(r)
        del a, b, a8, b8, qa, qb
    return {"gemm": res}


# ------------------------------------------------------------------------------------------ linear

class _FP8RowwiseLinearFn(torch.autograd.Function):
    """FP8 baseline: every GEMM operand cast to e4m3 with one scale per row along the reduction
    (plain PyTorch casts, unfused), PyTorch rowwise ``_scaled_mm``."""

    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.shape[-1])
        qx, sx = _fp8_rowwise(x2)
        qw, sw = _fp8_rowwise(w)
        y = torch._scaled_mm(qx, qw.t(), sx, sw.t(), out_dtype=torch.bfloat16)
        ctx.save_for_backward(x2, w)
        ctx.xs = x.shape
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        qd, sd = _fp8_rowwise(dy2)
        qwt, swt = _fp8_rowwise(w.t().contiguous())
        dx = torch._scaled_mm(qd, qwt.t(), sd, swt.t(), out_dtype=torch.bfloat16)
        qdt, sdt = _fp8_rowwise(dy2.t().contiguous())
        qxt, sxt = _fp8_rowwise(x2.t().contiguous())
        dw = torch._scaled_mm(qdt, qxt.t(), sdt, sxt.t(), out_dtype=torch.bfloat16)
        return dx.reshape(ctx.xs), dw


class FP8RowwiseLinear(torch.nn.Linear):
    def forward(self, x):
        return _FP8RowwiseLinearFn.apply(x, self.weight)


def fwd_bwd_call(mod, x: torch.Tensor, gy: torch.Tensor, clear_weight: bool = False):
    """A function doing one ``mod(x).backward(gy)`` call as a layer benchmark times it: the same x every
    call, so its reused activation operands are dropped first (or they would be quantized once for all
    repeats; a real layer sees a new input every call). Weights are quantized at every call
    (``clear_weight`` is kept for callers; nothing caches them)."""
    from ..linear import fast as _fast  # startup

    def f():
        _fast.clear_caches()
        x.grad = None
        mod.weight.grad = None
        mod(x).backward(gy)
    return f


def _graphed(fn):
    """``fn`` captured once in a CUDA graph (after 3 eager warm-up calls on a side stream); returns the
    replay, or raises where capture fails. Isolates the GPU time from the host's time to issue ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _presets(args, default: list) -> list:
    """The MX recipes a benchmark times: ``--presets`` (comma-separated recipe names) or ``default``."""
    names = [p.strip() for p in (getattr(args, "presets", "") or "").split(",") if p.strip()]
    return names or list(default)


def bench_linear(args) -> dict:
    from ..train.trainer import graph_blockers  # startup
    dev = "cuda"
    M = 16384
    res = []
    presets = _presets(args, LINEAR_PRESETS)
    for N, K in LLAMA8B_NK:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        base = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)

        def step(mod, clear=False):
            return fwd_bwd_call(mod, x, gy, clear)

        r = {"M": M, "N": N, "K": K, "bf16_ms": _bench(step(base))}
        r["bf16_graph_ms"] = _bench(_graphed(step(base)))
        fp8 = FP8RowwiseLinear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
        try:
            r["fp8_rowwise_ms"] = _bench(step(fp8))
        except Exception as e:  # noqa: BLE001
            r["fp8_rowwise_error"] = repr(e)[:200]
        for p in presets:
            lin = MXLinear(K, N, bias=False, device=dev, dtype=torch.bfloat16, recipe=p)
            lin.weight.data.copy_(base.weight.data)
            r[f"{p}_ms"] = _bench(step(lin, clear=True))           # W quantized every call
            r[f"{p}_reuseW_ms"] = _bench(step(lin, clear=False))   # micro-batches: W reused
            r[f"{p}_speedup"] = r["bf16_ms"] / r[f"{p}_ms"]
            r[f"{p}_reuseW_speedup"] = r["bf16_ms"] / r[f"{p}_reuseW_ms"]
            if not graph_blockers(lin.recipe, torch.device(dev), 1):
                # the same call replayed from a CUDA graph (as `mxtrain train --cuda-graphs` runs it):
                # no host time in the measurement, both for this preset and for BF16
                try:
                    r[f"{p}_graph_ms"] = _bench(_graphed(step(lin, clear=True)))
                    # against the faster of BF16 eager and BF16 replayed (cuBLAS may pick other
                    # kernels under capture: BF16 replay measured slower than eager at 4096x4096)
                    r[f"{p}_graph_speedup"] = min(r["bf16_ms"], r["bf16_graph_ms"]) / r[f"{p}_graph_ms"]
                except Exception as e:  # noqa: BLE001
                    r[f"{p}_graph_error"] = repr(e)[:200]
            if p == "mxfp4-all":
                # the same call with each activation's two operands quantized in two passes (no
                # quantize_mxfp4_dual, which by default runs only without rotations): what the
                # one-pass kernel saves, measured in this run
                with _settings.override(dual="off"):
                    r[f"{p}_twopass_reuseW_ms"] = _bench(step(lin, clear=False))
                    if f"{p}_graph_ms" in r:
                        r[f"{p}_twopass_graph_ms"] = _bench(_graphed(step(lin, clear=True)))
            del lin
        if "fp8_rowwise_ms" in r:
            r["fp8_rowwise_speedup"] = r["bf16_ms"] / r["fp8_rowwise_ms"]
        print("linear " + f"{M}x{N}x{K}: bf16 {r['bf16_ms']:.2f} ms; " + "; ".join(
            f"{p} {r[f'{p}_speedup']:.2f}x ({r[f'{p}_reuseW_speedup']:.2f}x reuse)" for p in presets)
            + (f"; fp8-rowwise {r['fp8_rowwise_speedup']:.2f}x" if "fp8_rowwise_speedup" in r else "")
            + "; CUDA graph: " + ", ".join(f"{p} {r[f'{p}_graph_speedup']:.2f}x" for p in presets
                                            if f"{p}_graph_speedup" in r)
            + "".join(f"; mxfp4-all two passes {r['mxfp4-all_' + k]:.3f} ms vs one {r['mxfp4-all_' + v]:.3f} ms"
                      for k, v in (("twopass_reuseW_ms", "reuseW_ms"), ("twopass_graph_ms", "graph_ms"))
                      if "mxfp4-all_" + k in r), flush=True)
        res.append(r)
        del x, gy, base, fp8
    tot = {k: sum(r[k] for r in res) for k in res[0] if k.endswith("_ms") and all(k in q for q in res)}
    # time-weighted speed-ups over the shapes; graph-replay times against the faster BF16 of each shape
    bf16_best = sum(min(r["bf16_ms"], r["bf16_graph_ms"]) for r in res)
    summary = {k.replace("_ms", "_speedup_sum"): (bf16_best if k.endswith("_graph_ms") else tot["bf16_ms"]) / v
               for k, v in tot.items() if k != "bf16_graph_ms"}
    return {"linear": res, "linear_summary": summary}


def bench_breakdown(args) -> dict:
    """Where an MXLinear fwd+bwd (mxfp4-all-dh16) spends its time at 16384x4096x4096: each fused
    quantize and each GEMM timed alone (bf16 GEMMs for comparison)."""
    from ..kernels.gemm import mx_gemm_nt  # startup
    from ..kernels.mxfp4 import quantize_mxfp4_2d as q  # startup
    dev = "cuda"
    M, N, K = 16384, 4096, 4096
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    kw = dict(rot=16, carrier=True, fp4=False)
    r = {}
    r["q_x_rows"] = _bench(lambda: q(x, 1, **kw))
    r["q_w_rows_128"] = _bench(lambda: q(w, 1, group_rows=128, block_rows=128, num_warps=8, **kw))
    r["q_dy_rows"] = _bench(lambda: q(dy, 1, **kw))
    r["q_w_cols_128"] = _bench(lambda: q(w, 0, group_rows=128, block_rows=128, num_warps=8, **kw))
    r["q_dy_cols"] = _bench(lambda: q(dy, 0, **kw))
    r["q_x_cols"] = _bench(lambda: q(x, 0, **kw))
    qx, qw = q(x, 1, **kw), q(w, 1, group_rows=128, block_rows=128, num_warps=8, **kw)
    qdy, qwc = q(dy, 1, **kw), q(w, 0, group_rows=128, block_rows=128, num_warps=8, **kw)
    qdyc, qxc = q(dy, 0, **kw), q(x, 0, **kw)
    qxc128 = q(x, 0, group_rows=128, block_rows=128, num_warps=8, **kw)
    r["gemm_fprop"] = _bench(lambda: mx_gemm_nt(qx, qw, "fp8_carrier", torch.bfloat16))
    r["gemm_dgrad"] = _bench(lambda: mx_gemm_nt(qdy, qwc, "fp8_carrier", torch.bfloat16))
    r["gemm_wgrad_b1x128"] = _bench(lambda: mx_gemm_nt(qdyc, qxc, "fp8_carrier", torch.bfloat16))
    r["gemm_wgrad_b128x128"] = _bench(lambda: mx_gemm_nt(qdyc, qxc128, "fp8_carrier", torch.bfloat16))
    r["bf16_fprop"] = _bench(lambda: x @ w.t())
    r["bf16_dgrad"] = _bench(lambda: dy @ w)
    r["bf16_wgrad"] = _bench(lambda: dy.t() @ x)
    print("breakdown (ms) " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
    return {"breakdown": r}


# -------------------------------------------------------------------------------------------- step

def bench_blocks(args) -> dict:
    from ..linear import fast as _fast  # startup
    dev = "cuda"
    n_layers = args.layers or 2
    cfg = ModelConfig.named("llama3-8b", n_layers=n_layers)
    B, T = args.batch, args.seq
    res = {"layers": n_layers, "batch": B, "seq": T, "tokens": B * T, "runs": {}}
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta, dev)
    torch.manual_seed(0)
    blocks0 = torch.nn.ModuleList(Block(cfg, dev) for _ in range(n_layers)).to(torch.bfloat16)
    state = {k: v.clone() for k, v in blocks0.state_dict().items()}
    x = torch.randn(B, T, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def make(kind):
        blocks = torch.nn.ModuleList(Block(cfg, dev, glue=glue) for _ in range(n_layers)).to(torch.bfloat16)
        blocks.load_state_dict(state)
        if kind == "fp8_rowwise":
            for name, m in list(blocks.named_modules()):
                if type(m) is torch.nn.Linear:
                    parent = blocks.get_submodule(name.rsplit(".", 1)[0])
                    new = FP8RowwiseLinear.__new__(FP8RowwiseLinear)
                    torch.nn.Module.__init__(new)
                    new.in_features, new.out_features, new.weight, new.bias = m.in_features, m.out_features, m.weight, None
                    setattr(parent, name.rsplit(".", 1)[1], new)
        elif kind != "bf16":
            convert(blocks, kind, skip=())
        return blocks

    def fwd_bwd(blocks):
        def f():
            for p in blocks.parameters():
                p.grad = None
            _fast.clear_caches()   # every step starts with no reused operands, as with new data
            h = x
            for blk in blocks:
                h = blk(h, cos, sin)
            h.float().square().mean().backward()
        return f

    glues = args.glue.split(",")
    for glue in glues:
        for kind in ["bf16", "fp8_rowwise"] + _presets(args, STEP_PRESETS):
            name = kind if glue == glues[0] else f"{kind}@{glue}"
            try:
                blocks = make(kind)
                f = fwd_bwd(blocks)
                # ~1 s of steps (25-35 of them at these shapes) for each median; the wall-clock times
                # of each measurement go in the JSON (to line up with a clock/power log of the GPU)
                t0 = time.time()
                t = _bench(f, warmup=200, rep=1000)
                res["runs"][name] = {"ms": t, "glue": glue, "recipe": kind, "unix_s": [t0, time.time()],
                                     "peak_gib": _peak_gib(f)}
                if getattr(args, "graphs", False):
                    # the same step replayed from one CUDA graph: GPU time only, where the eager step is
                    # bound by the host's Python and launches (as `mxtrain train --cuda-graphs` avoids)
                    try:
                        t0 = time.time()
                        res["runs"][name]["graph_ms"] = _bench(_graphed(f), warmup=200, rep=1000)
                        res["runs"][name]["graph_unix_s"] = [t0, time.time()]
                    except Exception as e:  # noqa: BLE001
                        res["runs"][name]["graph_error"] = repr(e)[:300]
                if args.profile and kind in ("bf16", "mxfp4-all-dh16"):
                    res["runs"][name]["profile_ms"] = _profile(f)
                del blocks, f
            except Exception as e:  # noqa: BLE001
                res["runs"][name] = {"error": repr(e)[:300], "glue": glue, "recipe": kind}
            torch.cuda.empty_cache()
    for glue in glues:
        sfx = "" if glue == glues[0] else f"@{glue}"
        bfr = res["runs"].get("bf16" + sfx, {})
        bf = bfr.get("ms")
        bfg = min(bf, bfr["graph_ms"]) if bf and "graph_ms" in bfr else None
        for k, v in res["runs"].items():
            if "ms" in v and v["glue"] == glue and bf:
                v["speedup_vs_bf16"] = bf / v["ms"]
                v["tokens_per_s"] = B * T / (v["ms"] * 1e-3)
                if "graph_ms" in v and bfg:   # against the faster of BF16 eager and replayed
                    v["graph_speedup_vs_bf16"] = bfg / v["graph_ms"]
    print("blocks " + "; ".join(f"{k} {v.get('ms', float('nan')):.1f} ms ({v.get('speedup_vs_bf16', 0):.2f}x, "
                              f"peak {v.get('peak_gib', float('nan')):.1f} GiB)"
                              + (f", graph {v['graph_ms']:.1f} ms ({v.get('graph_speedup_vs_bf16', 0):.2f}x)"
                                 if "graph_ms" in v else "")
                              for k, v in res["runs"].items()), flush=True)
    for k, v in res["runs"].items():
        if "profile_ms" in v:
            print(f"profile {k} (ms per step): " + ", ".join(f"{c} {t:.2f}" for c, t in v["profile_ms"].items()),
                  flush=True)
    return {"blocks": res}


STEP_VARIANTS = ["bf16", "torchao-tensorwise", "torchao-rowwise", "fp8"]


def _step_progress(name: str, r: dict) -> None:
    if "error" in r:
        line = f"failed: {r['error']}"
    else:
        line = f"{r['ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, peak {r.get('peak_gib', float('nan')):.2f} GiB"
        if "ms_back_to_back" in r:
            line += f", {r['ms_back_to_back']:.1f} ms a step back to back"
        if "host_ms" in r:
            line += f", host {r['host_ms']:.1f} ms to issue a step"
        total = ((r.get("profile") or {}).get("by_class") or {}).get("total")
        if total is not None:
            line += f", device {total:.1f} ms a step"
        if any((r.get("inexact_blocks") or {}).values()):
            line += ", inexact carrier blocks " + ", ".join(f"{k} {v:,}" for k, v in r["inexact_blocks"].items())
    print(f"bench step: {name}: {line}", file=sys.stderr, flush=True)


def _keeping(args, key: str, progress):
    """``progress`` for ``measure``'s ``on_variant``, which also writes what is measured so far to ``--out`` (as
    ``{key}_partial``) after each variant, so that a run stopped by a time limit or a crash keeps its finished
    variants; the complete result replaces the file at the end."""
    done: dict = {}

    def on_variant(name: str, r: dict) -> None:
        progress(name, r)
        done[name] = r
        if getattr(args, "out", None):
            write_text(Path(args.out), json.dumps({"env": _env(), "command": " ".join(sys.argv),
                                                   f"{key}_partial": {"runs": done}}, indent=1, default=str))
    return on_variant


def bench_step(args) -> dict:
    only = [v.strip() for v in (getattr(args, "variants", "") or "").split(",") if v.strip()]
    variants = only or STEP_VARIANTS + _presets(args, STEP_PRESETS)
    try:
        import torchao.float8  # optional  # noqa: F401
    except ImportError:
        variants = [v for v in variants if not v.startswith("torchao-")]
        print("bench step: torchao is not installed (pip install torchao): no torchao float8 variants",
              file=sys.stderr, flush=True)
    layers = args.layers if args.layers is not None else (4 if args.model == "8b-layers" else None)
    if layers is not None and layers <= 0:
        raise UserError("--layers must be positive")
    res = _bs.measure(variants, model=args.model, layers=layers, batch=args.batch, seq=args.seq,
                      steps=args.steps, warmup=args.warmup, compile_mode=args.compile,
                      recompute_ffn=args.recompute_ffn, on_variant=_keeping(args, "step", _step_progress),
                      memory_budget=args.memory_budget, param_dtype=args.param_dtype,
                      checkpoint_blocks=args.checkpoint_blocks,
                      recompute_gemm_inputs=args.recompute_gemm_inputs, rounds=args.rounds,
                      profile=args.profile)
    res["variants"] = variants
    print(_bs.format_table(res), flush=True)
    return {"step": res}


# ------------------------------------------------------------------------------------------ host

HOST_SHAPE = (256, 512, 512)   # tokens, in, out: GPU work of microseconds, so a call's time is the host's


def best_us(fn, n: int = 200, reps: int = 7, warm: int = 30) -> float:
    """The least of ``reps`` loops of ``n`` calls, microseconds a call, the GPU drained after each loop (a
    noisy host's interruptions left out; at ``HOST_SHAPE`` a call's time is the host's time to issue it)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def bench_host(args) -> dict:
    """The host's time to issue one linear layer's forward and backward under ``torch.compile(fullgraph=True)``
    (default mode) at ``HOST_SHAPE``, bf16: ``nn.Linear``, torchao's float8 tensorwise layer (when installed) and
    ``MXLinear`` per recipe, with the ratio to ``nn.Linear`` and the form each compiled MX layer takes
    (``linear.implementation``). Issue #45's target: a compiled MX layer at most 1.5x ``nn.Linear``."""
    dev = "cuda"
    M, K, N = HOST_SHAPE
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

    res = {"shape": {"M": M, "K": K, "N": N}, "us": {}, "vs_nn_linear": {}, "form": {}, "profile": {}}

    def compiled_us(key: str, mod) -> None:
        torch._dynamo.reset()
        fn = fwd_bwd_call(torch.compile(mod, fullgraph=True), x, gy)
        res["us"][key] = best_us(fn)
        print(f"bench host: {key}: {res['us'][key]:.1f} us a layer call (fwd+bwd)", file=sys.stderr, flush=True)
        if args.profile:   # (after the timing: the profiler slows the calls it records)
            res["profile"][key] = host_profile(fn, top=args.profile)
        if getattr(args, "out", None):   # (what is measured so far, should a time limit stop the run)
            write_text(Path(args.out), json.dumps({"env": _env(), "command": " ".join(sys.argv),
                                                   "host_partial": res}, indent=1, default=str))
    base = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
    compiled_us("nn.Linear", base)
    try:
        from torchao.float8 import convert_to_float8_training  # optional
        seq = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16))
        convert_to_float8_training(seq)   # (it swaps the children of a module: the converted layer is seq[0])
        compiled_us("torchao-tensorwise", seq[0])
    except ImportError:
        print("bench host: torchao is not installed: no torchao float8 row", file=sys.stderr, flush=True)
    for p in _presets(args, STEP_PRESETS):
        lin = MXLinear(K, N, bias=False, device=dev, dtype=torch.bfloat16, recipe=p)
        res["form"][p] = implementation(p, x, lin.weight)
        compiled_us(p, lin)
    for k, v in res["us"].items():
        res["vs_nn_linear"][k] = v / res["us"]["nn.Linear"]
        print(f"bench host: {k}: {v:.1f} us a layer call (fwd+bwd), {res['vs_nn_linear'][k]:.2f}x nn.Linear"
              + (f"  [{res['form'][k]}]" if k in res["form"] else ""), flush=True)
    for k, pr in res["profile"].items():
        print(f"bench host: {k}: {pr['launches']:.0f} kernel launches and {pr['kernels']:.0f} kernels a call; host "
              "time by operator (us a call, under the profiler): "
              + ", ".join(f"{n} {us:.0f} ({c:g}x)" for n, c, us in pr["host"]), flush=True)
    torch._dynamo.reset()
    return {"host": res}


def _peak_gib(f) -> float:
    """Peak GPU memory allocated during one call of ``f`` (GiB), the memory held before it included."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    f()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def _profile(f, steps: int = 3) -> dict:
    """GPU kernel time of one step by class (quantize, gemm, attention, glue), from torch.profiler; prints the
    12 costliest kernels."""
    f()
    prof = kernel_profile(f, steps, "cuda")
    for name, _, ms in prof["kernels"][:12]:
        print(f"  {ms:7.3f} ms  {name[:90]}", flush=True)
    return prof["by_class"]


# --------------------------------------------------------------------------------------------- CLI

def bench_experts(args) -> dict:
    return _experts.bench_experts(args, _bench)


_WHAT = {"quantize": bench_quantize, "gemm": bench_gemm, "breakdown": bench_breakdown, "linear": bench_linear,
         "step": bench_step, "blocks": bench_blocks, "host": bench_host, "experts": bench_experts}


def warm_gpu(seconds: float = 1.0) -> float:
    """Keep the GPU busy with bf16 matrix products for about ``seconds`` before the first timing: an idle
    GPU runs at low clocks, and the first timings of a process measured up to 2x slow on the H100 without
    this (the one-pass and two-pass quantize of a 4096x4096 tensor timed first: 90 and 82 us; timed after
    another shape in a run of the same code: 44 and 53 us)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    return time.time() - t


def _limits(args) -> int:
    from dataclasses import asdict, fields
    rates = {}
    for item in filter(None, args.rates.split(",")):
        k, eq, v = item.partition("=")
        if k.strip() not in {f.name for f in fields(BL.Rates)} or not eq:
            raise UserError(f"--rates: bad item {item!r}; use NAME=VALUE with NAME one of "
                            f"{', '.join(asdict(BL.Rates()))}")
        try:
            rates[k.strip()] = float(v)
        except ValueError:
            raise UserError(f"--rates: {k.strip()} must be a number, got {v!r}") from None
        if not (math.isfinite(rates[k.strip()]) and rates[k.strip()] > 0):
            raise UserError(f"--rates: {k.strip()} must be a positive finite number, got {v!r}")
    cfg = counted_config(args.model)
    layers = args.layers if args.layers is not None else (4 if args.model == "8b-layers" else None)
    if args.batch <= 0 or args.seq <= 0 or (layers is not None and layers <= 0):
        raise UserError("--batch, --seq and --layers must be positive")
    res = BL.limits(cfg, args.batch, args.seq, ["bf16", "torchao-tensorwise"] + _presets(args, STEP_PRESETS),
                    BL.Rates(**rates), layers, args.bf16_step_ms, args.gpus, args.one_gpu_step_ms)
    print(BL.format_table(res))
    if args.out:
        write_json(Path(args.out), {"limits": res, "command": " ".join(sys.argv)}, indent=1)
    return 0


# The benchmarks that take each option (every one takes --out). An option given to a benchmark that does not
# take it is refused in one line, never dropped (#47); the options default to None so that "given" is exact,
# and take their default values (_DEFAULTS) once the check has passed.
def _either(names) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_TAKES = {"filter": ("quantize",), "presets": ("linear", "step", "blocks", "host", "experts", "limits"),
          "layers": ("step", "blocks", "limits"), "batch": ("step", "blocks", "experts", "limits"),
          "seq": ("step", "blocks", "experts", "limits"), "model": ("step", "limits"), "compile": ("step",),
          "bf16_step_ms": ("limits",), "rates": ("limits",), "gpus": ("limits",), "one_gpu_step_ms": ("limits",), "steps": ("step",), "rounds": ("step",),
          "recompute_ffn": ("step",), "checkpoint_blocks": ("step",), "variants": ("step",),
          "memory_budget": ("step",), "recompute_gemm_inputs": ("step",), "param_dtype": ("step",),
          "warmup": ("step",), "glue": ("blocks",), "graphs": ("blocks",), "profile": ("step", "blocks", "host")}
_DEFAULTS = {"filter": "", "presets": "", "batch": 4, "seq": 4096, "model": "8b-layers", "compile": "default",
             "rates": "", "gpus": 1, "steps": 10, "rounds": 1, "recompute_ffn": False, "checkpoint_blocks": False,
             "variants": "", "recompute_gemm_inputs": False, "param_dtype": "float32", "warmup": 3,
             "glue": "auto,eager", "graphs": False, "profile": 0}


def _check_options(args, what: list[str]) -> None:
    """Refuse an option none of the benchmarks ``what`` takes, naming the ones that do; then fill in the
    defaults of the options not given."""
    for dest, takes in _TAKES.items():
        if getattr(args, dest, None) in (None, False):   # not given (a store_true flag given is True)
            continue
        if not set(what) & set(takes):
            raise UserError(f"--{dest.replace('_', '-')} is an option of bench {_either(takes)}, "
                            f"not of bench {args.what}")
    if args.variants is not None and args.presets is not None and not set(what) & {"linear", "blocks", "host",
                                                                                   "experts"}:
        raise UserError("--presets and --variants: bench step times exactly the --variants; "
                        "name the recipes there")
    for dest, value in _DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


def run(args) -> int:
    what = ["limits"] if args.what == "limits" else list(_WHAT) if args.what == "all" else args.what.split(",")
    bad = [w for w in what if w not in _WHAT]
    if "limits" in bad and len(what) > 1:
        raise UserError("bench limits runs alone (it counts, needs no GPU): give it without other benchmarks")
    if bad and what != ["limits"]:
        raise UserError(f"unknown benchmark {bad[0]!r}; choose from {', '.join(_WHAT)}, limits or all")
    _check_options(args, what)
    if args.what == "limits":
        return _limits(args)
    named = _presets(args, []) + [v.strip() for v in (getattr(args, "variants", "") or "").split(",") if v.strip()]
    for p in named:
        try:
            name, over = split_variant(p)
            variant_options(name, over)   # (a variant's own options: the rest are settings)
            _settings.fresh().replace(**over)
        except ValueError as e:
            raise UserError(f"variant {p!r}: {e}") from None
        if name not in TORCHAO and not _recipes.is_name(name):
            raise UserError(f"unknown recipe {name!r} in variant {p!r}; choose from {', '.join(_recipes.names())}")
    if not torch.cuda.is_available():
        raise UserError("mxtrain bench needs a CUDA GPU (the fast path's kernels and GEMMs run there)")
    out = {"env": _env(), "command": " ".join(sys.argv)}
    t0 = time.time()
    out["warmup_s"] = warm_gpu()
    for w in what:
        try:
            out.update(_WHAT[w](args))
        except Exception as e:  # noqa: BLE001 - keep the other benchmarks' numbers
            out[w + "_error"] = repr(e)[:500]
            print(f"bench {w} failed: {e!r}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    out["seconds"] = time.time() - t0
    text = json.dumps(out, indent=1)
    if args.out:
        write_text(Path(args.out), text)
    else:
        print(text)
    return 0


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return v


def _budget(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
    return v


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", help="quantize, gemm, breakdown, linear, step, blocks, host, experts, all, or a comma-separated list; "
                                "limits (no GPU: the step's ceilings counted)")
    p.add_argument("--out", default=None, help="write the JSON results here (default: stdout)")
    p.add_argument("--filter", default=None, help="quantize: only the cases whose name contains this text")
    p.add_argument("--presets", default=None,
                   help="linear, step, blocks, host, experts, limits: comma-separated recipes to time against BF16, each "
                        "optionally with settings for step (mxfp4-all-dh16:wgrad_x=forward:dual=off) (default: "
                        + ", ".join(LINEAR_PRESETS) + " for linear; " + ", ".join(STEP_PRESETS) + " for the others)")
    p.add_argument("--layers", type=int, default=None,
                   help="step, blocks, limits: number of blocks (default: 4 for 8b-layers, 2 for blocks; "
                        "step's 1b and 125m: the whole model)")
    p.add_argument("--batch", type=int, default=None, help="step, blocks, experts, limits: batch size (default 4; experts: tokens = batch x "
                                                                "seq)")
    p.add_argument("--seq", type=int, default=None, help="step, blocks, experts, limits: sequence length (default 4096)")
    p.add_argument("--model", default=None, choices=["8b-layers", "1b", "125m", "125m-fused", "8b-fused", "hf-95m"],
                   help="step, limits: Llama-8B-shaped layers (default; 128k vocabulary), a whole 1B / 125M model, "
                        "or a model written outside mxtrain with fused q|k|v and gate|up layers (125m-fused: the 125M class; 8b-fused: "
                        "Llama-8B layer shapes, 32k vocabulary), or hf-95m, the Hugging Face Llama of docs/library.md (step: needs "
                        "transformers; limits counts its shapes, give --batch 16 --seq 512 for its step)")
    p.add_argument("--compile", default=None, choices=["default", "reduce-overhead", "none"],
                   help="step: torch.compile mode of the whole model, the same for every variant (default: default)")
    p.add_argument("--bf16-step-ms", type=float, default=None,
                   help="limits: a measured BF16 step (ms); the part of the step no recipe changes is taken from it")
    p.add_argument("--rates", default=None, help="limits: NAME=VALUE,... (bf16_tflops, fp8_tflops, mx_carrier_tflops, "
                                               "copy_tbs, quantize_of_copy, attention_tflops, link_gbs; defaults: an "
                                               "H100's, link_gbs NVLink 4's 450 GB/s each way)")
    p.add_argument("--gpus", type=_positive, default=None,
                   help="limits: GPUs under FSDP2, --batch x --seq tokens each: count each GPU's all-gathers and "
                        "reduce-scatter in a step and the efficiency they allow with no overlap")
    p.add_argument("--one-gpu-step-ms", type=float, default=None,
                   help="limits, with --gpus: a measured step on one GPU (same per-GPU batch) to judge the links "
                        "against")
    p.add_argument("--steps", type=int, default=None, help="step: timed steps (median reported; default 10)")
    p.add_argument("--rounds", type=_positive, default=None,
                   help="step: build, compile and time every variant this many times (default 1), the order rotated "
                        "each round; ms and ratios are the medians over the rounds, with their lowest and highest (a ratio near "
                        "1 moves by a percent or two between measurements; 3 or more rounds to judge it)")
    p.add_argument("--recompute-ffn", action="store_true",
                   help="step: every variant's compiled blocks recompute their feed-forward outputs in the backward")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="step: every variant's blocks keep only their input and run again in the backward "
                        "(full activation checkpointing, train.checkpoint_blocks)")
    p.add_argument("--variants", default=None,
                   help="step: exactly these variants, comma-separated (bf16, torchao-tensorwise, torchao-rowwise, "
                        "recipes, each optionally with settings or its own recompute_ffn / checkpoint_blocks, e.g. "
                        "mxfp4-all-dh16:recompute_ffn=true; torchao-tensorwise:fast_accum=false for torchao's forward "
                        "GEMM in float32, fp8:fp8_fast_accum=fprop:fp8_autocast=autocast for torchao's numerics in "
                        "mxtrain's fp8; any variant:static_launch=true for inductor's own launcher of mxtrain's kernels), "
                        "instead of the FP8 baselines + --presets")
    p.add_argument("--memory-budget", type=_budget, default=None,
                   help="step: torch's activation_memory_budget for every variant, in (0, 1] (the compiler "
                        "recomputes activations in the backward to save only that share)")
    p.add_argument("--recompute-gemm-inputs", action="store_true",
                   help="step: the compiler may recompute activations that feed GEMMs in the backward instead of "
                        "keeping them, for every variant (train.recompute_gemm_inputs)")
    p.add_argument("--param-dtype", default=None, choices=["float32", "bfloat16"],
                   help="step: float32 master weights and AdamW state under bf16 autocast (default), or the whole "
                        "model and its AdamW state in bfloat16 without autocast")
    p.add_argument("--warmup", type=int, default=None, help="step: untimed steps first (compilation; default 3)")
    p.add_argument("--glue", default=None,
                   help="blocks: elementwise layers (RMSNorm, RoPE, SwiGLU) compiled ('auto' on CUDA) and/or 'eager'; "
                        "comma-separated, each measured for every recipe (default auto,eager)")
    p.add_argument("--graphs", action="store_true",
                   help="blocks: also time each step replayed from a CUDA graph (no host time in it)")
    p.add_argument("--profile", type=_positive, nargs="?", const=45, default=None, metavar="N",
                   help="step: after timing, profile 3 more steps of each variant (torch.profiler): device time by "
                        "kernel class and the N costliest kernels (default 45) in the JSON, the 10 costliest printed; "
                        "blocks: also print GPU time by kernel class for bf16 and mxfp4-all-dh16; host: after timing, profile 20 "
                        "more calls of each layer: kernel launches a call and the N operators with the most host time")


def register(subparsers) -> None:
    """Add the ``bench`` subcommand to the ``mxtrain`` CLI."""
    p = subparsers.add_parser("bench", help="GPU benchmarks of the fast MXFP4 path (JSON out)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=run)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mxtrain.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    try:
        return run(p.parse_args(argv))
    except UserError as e:
        print(f"mxtrain: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
