"""Does the custom-op form of one MX layer read memory it did not write at its first call? (GPU; diagnosis of
tests/linear/test_compiled_seeded_model.py, BENCHMARKS.md "GPU test runs", 2026-11-29.)

Runs one call of ``mxtrain::call_seeds``, ``mxtrain::linear`` and ``mxtrain::linear_backward`` (the ops a layer is
under ``torch.compile`` with ``mx_compiled=ops``) in two fresh processes, one with every new allocation NaN-filled
(``torch.use_deterministic_algorithms(True, warn_only=True)`` and
``torch.utils.deterministic.fill_uninitialized_memory``), one without, and compares what each produced: the keys and
signs, Y, dX, dW, and every operand the fast path quantized on the way (each ``quantize_op``, one-pass dual quantize
and carrier rebuild of ``linear.fast``, in call order, as raw bytes). Correct code gives identical bytes; the first
operand or output that differs is where an unwritten read starts.

    python3 tools/first_call_fill.py [RECIPE] [M K N] [--calls C]

(defaults: ``tseng``, 512 x 128 x 128, one call). ``--calls C``: C calls in each process, compared call by call (a read
of unwritten memory at the first call only shows at call 0). ``--cpu``: on a CPU under Triton's interpreter with the
fast path forced and the FP8-carrier GEMM emulated (a check of the tool itself; the CPU kernels read nothing unwritten).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch


def _child(fill: bool, recipe: str, M: int, K: int, N: int, calls: int, cpu: bool, path: str) -> None:
    if fill:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    from mxtrain import settings
    from mxtrain.linear import dispatch as D, fast
    from mxtrain.numerics.recipes import get
    import mxtrain.linear.ops  # noqa: F401  (registers the custom ops)
    dev = "cpu" if cpu else "cuda"
    over = {}
    if cpu:   # the fast path on a CPU: route forced, seeds from the kernel, the carrier GEMM emulated
        from mxtrain.kernels import gemm as kg
        from mxtrain.linear import compiledmx
        import mxtrain.linear.ops as O
        O.route = lambda r, x, w: "fast"
        D._seeds_on_device = lambda s: True
        kg.mx_gemm_nt = lambda a, b, backend, out_dtype=torch.float32, divisor=1.0: compiledmx._mm(
            a.carrier.view(torch.uint8), a.gs_base, a.R, b.carrier.view(torch.uint8), b.gs_base, b.group_rows, b.R,
            out_dtype, 1.0 / divisor)
        kg.activation_b_group_rows = lambda d: 128
        over = dict(gemm_backend="fp8_carrier", fast_launch="always", qselfcheck="always")
    seen = []   # every quantized operand, in call order

    def record(q):
        for name in ("carrier", "gs_base", "packed", "scales"):
            t = getattr(q, name, None)
            if t is not None:
                seen.append((f"{len(seen)}:{name}{tuple(t.shape)}", t.detach().clone().view(torch.uint8).cpu()
                             if t.element_size() == 1 else t.detach().clone().cpu()))
        return q
    real_quant, real_rebuild, real_dual = fast.quantize_op, fast.carrier_from_packed, fast.quantize_mxfp4_dual
    fast.quantize_op = lambda *a, **k: record(real_quant(*a, **k))
    fast.carrier_from_packed = lambda *a, **k: record(real_rebuild(*a, **k))
    fast.quantize_mxfp4_dual = lambda *a, **k: tuple(record(q) for q in real_dual(*a, **k))
    r = get(recipe)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dev)
    dy = torch.randn(M, N, generator=g).to(dev, torch.bfloat16)
    state = torch.tensor([3, 0, 0], dtype=torch.int64, device=dev)
    out = []
    with settings.override(**over):
        for _ in range(calls):
            seen.clear()
            keys, signs = D.call_seeds(state, r, True)
            y, s0, s1 = torch.ops.mxtrain.linear(x, w, None, keys, signs, r._json, "bfloat16", True)
            dx, dw, _ = torch.ops.mxtrain.linear_backward(dy, x if s0.numel() == 0 else None, w, s0, s1, keys, signs,
                                                          r._json, "bfloat16", x.dtype, True, True, False)
            outs = [("keys", keys), ("signs", signs), ("y", y), ("s0", s0), ("s1", s1), ("dx", dx), ("dw", dw)]
            out.append([(n, t.detach().clone().cpu()) for n, t in outs] + list(seen))
    torch.save(out, path)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
    ua = a.contiguous().view(torch.uint8) if a.numel() else a
    ub = b.contiguous().view(torch.uint8) if b.numel() else b
    n = int((ua != ub).sum()) if a.numel() else 0
    return "same" if n == 0 else f"{n} of {ua.numel()} bytes differ"


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--child":
        fill, recipe, M, K, N, calls, cpu, path = argv[1:]
        _child(fill == "1", recipe, int(M), int(K), int(N), int(calls), cpu == "1", path)
        return
    cpu = "--cpu" in argv
    calls = 1
    if "--calls" in argv:
        calls = int(argv[argv.index("--calls") + 1])
    pos = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--calls")]
    recipe = pos[0] if pos else "tseng"
    M, K, N = (int(v) for v in pos[1:4]) if len(pos) >= 4 else (512, 128, 128)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    if cpu:
        env["TRITON_INTERPRET"] = "1"
    got = {}
    with tempfile.TemporaryDirectory() as d:
        for fill in ("0", "1"):
            path = os.path.join(d, f"{fill}.pt")
            subprocess.run([sys.executable, __file__, "--child", fill, recipe, str(M), str(K), str(N), str(calls),
                            "1" if cpu else "0", path], check=True, env=env)
            got[fill] = torch.load(path)
    print(f"{recipe}, x {M} x {K}, w {N} x {K}, {'CPU (interpreter)' if cpu else 'GPU'}: NaN-filled allocations "
          "against plain ones")
    for c, (plain, filled) in enumerate(zip(got["0"], got["1"])):
        names = [n for n, _ in plain]
        if names != [n for n, _ in filled]:
            print(f"call {c}: other operands quantized: {names} against {[n for n, _ in filled]}")
        for (n, a), (_, b) in zip(plain, filled):
            print(f"call {c} {n}: {_diff(a, b)}")


if __name__ == "__main__":
    main(sys.argv[1:])
