"""What one compiled transformer block saves for its backward, counted without a GPU: the tensors the min-cut
partitioner (``compiler="inductor"``) hands from the forward graph to the backward graph of an
``mxtrain.model.Block``, traced on fake CUDA tensors with the device probes answering as an H100/H200 does
(``tests/compile_helpers.py``: the machinery of tests/linear/test_graph_structure.py). Per variant: every saved
tensor's bytes, and the activations alone (parameters and the block's input, which live anyway, left out; and the
attention's score matrix, which a CPU build of torch saves because its attention is not the GPU's flash kernel).

Variants: ``bf16``, ``torchao`` (torchao's float8 tensorwise training, when installed), and MX recipes with
settings (``mxfp4-all-dh16:wgrad_x=forward``; a variant that names no ``wgrad_x`` gets ``forward``, which
``compile_helpers.fake_hopper`` sets, not ``auto``). Parameters and inputs are bf16 (no autocast on a CPU build).

    python tools/saved_bytes.py [--dim 4096 --ffn 14336 --heads 32 --kv-heads 8 --tokens 4096] [--out saved.json]
                                [--top 12] [--recompute-gemm-inputs] [VARIANT ...]
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)   # (wrap_triton takes real jitted kernels)

import torch  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("variants", nargs="*", default=["bf16", "torchao", "mxfp4-all-dh16:wgrad_x=forward",
                                               "mxfp4-all-dh16:wgrad_x=carrier", "mxfp4-all-dh16:wgrad_x=backward"])
ap.add_argument("--dim", type=int, default=4096)
ap.add_argument("--ffn", type=int, default=14336)
ap.add_argument("--heads", type=int, default=32)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--tokens", type=int, default=4096, help="one sequence of this many tokens")
ap.add_argument("--top", type=int, default=0, help="list the largest N saved activations of each variant")
ap.add_argument("--recompute-gemm-inputs", action="store_true",
                help="every variant as with train.recompute_gemm_inputs (the partitioner may recompute activations "
                     "that feed GEMMs and kernels in the backward: torch._functorch.config."
                     "ban_recompute_materialized_backward off), as bench step's flag")
ap.add_argument("--out", default=None)
args = ap.parse_args()
if args.recompute_gemm_inputs:
    import torch._functorch.config as _fc
    _fc.ban_recompute_materialized_backward = False

import compile_helpers as h  # noqa: E402

h.fake_hopper()

import mxtrain  # noqa: E402
from mxtrain import settings  # noqa: E402
from mxtrain.bench.step import split_variant  # noqa: E402
from mxtrain.model import Block, ModelConfig, rope_tables  # noqa: E402
from torch._inductor import config as ic  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "int8": 1, "int32": 4, "int64": 8,
        "float8_e4m3fn": 1, "float8_e5m2": 1, "bool": 1}


def nbytes(desc) -> int:
    dt, shape = desc
    n = 1
    for s in shape:
        n *= s
    return n * SIZE[dt]


mode = FakeTensorMode()
T, C = args.tokens, args.dim
rows = []
for v in args.variants:
    name, over = split_variant(v)
    ic.pre_grad_custom_pass = ic.joint_custom_pre_pass = None
    with settings.override(**over), mode:
        torch.set_default_dtype(torch.bfloat16)
        try:
            m = Block(ModelConfig(dim=C, n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn,
                                  max_seq_len=T), device="cuda")
        finally:
            torch.set_default_dtype(torch.float32)
        if name == "torchao":
            from torchao.float8 import convert_to_float8_training
            convert_to_float8_training(m)
        elif name != "bf16":
            mxtrain.convert(m, name, skip=())
        x = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        try:
            res = h.capture(m, (x,) + rope_tables(C // args.heads, T, 10000.0, device="cuda"))
        except Exception as e:   # noqa: BLE001 - a variant the fake GPU cannot trace (e.g. fp8's capability probe)
            print(f"{v:40s} not traced: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            rows.append({"variant": v, "error": f"{type(e).__name__}: {e}"[:500]})
            continue
    saved = [(n, d) for n, d in res["bw"]["inputs"] if d and not n.startswith("tangents")]
    scores = [(n, d) for n, d in saved if len(d[1]) >= 3 and d[1][-1] == d[1][-2] == T]   # ([B,] H, T, T)
    acts = [(n, d) for n, d in saved if not n.startswith("primals") and (n, d) not in scores]
    row = {"variant": v, "saved_mib": sum(nbytes(d) for _, d in saved) / 2**20,
           "activations_mib": sum(nbytes(d) for _, d in acts) / 2**20, "tensors": len(saved),
           "largest": [[n, d, nbytes(d) / 2**20] for n, d in sorted(acts, key=lambda a: -nbytes(a[1]))[:args.top]]}
    rows.append(row)
    print(f"{v:40s} activations saved {row['activations_mib']:9.1f} MiB ({row['saved_mib']:.1f} MiB with parameters, "
          f"input and attention scores; {row['tensors']} tensors)", flush=True)
    for n, d, mib in row["largest"]:
        print(f"    {mib:9.1f} MiB  {n} {d[0]} {d[1]}")
if args.out:
    with open(args.out, "w") as f:
        json.dump({"block": {"dim": C, "ffn": args.ffn, "heads": args.heads, "kv_heads": args.kv_heads, "tokens": T},
                   "recompute_gemm_inputs": args.recompute_gemm_inputs,
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
