"""How long tracing compiled MX layers takes on a CPU machine, with and without the kernel-access table.

``python tools/trace_time.py [--layers 4] [--recipes mxfp4-all-dh16,mxfp4-all] [--declare both|on|off] [--compare]``

Traces ``--layers`` compiled MX layers reading one input, forward and backward, the way
tests/linear/test_compiledmx.py's graph test does (``aot_function`` on meta tensors, Triton IR for sm_90 without a
GPU: its ``_GRAPH_SCRIPT``, read from that file so that the two never differ), and prints the wall time of the
trace, the quantize launches in the joint graph and ``kernels.access_cache``'s counts. ``--declare``: with
``access_cache.DECLARE_MUTATED`` on, off or both (each a fresh process). This is the part of a first compile that
torch's per-launch analysis of what a Triton kernel writes makes slow; inductor's code generation and the Triton
compiles come after it and are not timed here (``tools/compile_time.py`` times a whole first step on a GPU).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _graph_script() -> str:
    """The graph test's script up to its ``GRAPH = ...`` line (the helpers and ``run``)."""
    with open(os.path.join(ROOT, "tests", "linear", "test_compiledmx.py")) as f:
        src = f.read()
    head = "_GRAPH_SCRIPT = r'''"
    body = src[src.index(head) + len(head):]
    return body[:body.index("GRAPH = {")]


def _comparing(access_cache, diffs: list, seen: list) -> None:
    """Wrap torch's analysis (the function ``access_cache`` installed) so that each answer for one of mxtrain's
    kernels is compared with the table's."""
    import torch._higher_order_ops.triton_kernel_wrap as tkw
    name = "identify_accessed_tensors" if hasattr(tkw, "identify_accessed_tensors") else "identify_mutated_tensors"
    fn = getattr(tkw, name)

    def compared(kernel, kwargs, *rest, **kw):
        out = fn(kernel, kwargs, *rest, **kw)
        mine = access_cache.declared_writes(kernel, kwargs) if access_cache.ours(kernel) else None
        if mine is not None:
            got = (sorted(d.name for d in out.read_writes.writes) if name == "identify_accessed_tensors"
                   else sorted(out))
            kname = getattr(access_cache._python_function(kernel), "__name__", "?")
            seen.append(kname)
            if sorted(mine) != got:
                diffs.append((kname, {k: v for k, v in kwargs.items() if not hasattr(v, "shape")}, got, sorted(mine)))
        return out
    setattr(tkw, name, compared)


def child(declare: bool, recipes: list[str], layers: int, compare: bool = False) -> int:
    from mxtrain.kernels import access_cache
    access_cache.DECLARE_MUTATED = declare
    if compare:
        access_cache.DECLARE = False   # (torch analyses every launch, on every torch; the table answers beside it)
        diffs: list = []
        seen: list = []
        _comparing(access_cache, diffs, seen)
    scope: dict = {"__name__": "mxtrain_trace_time"}
    exec(compile(_graph_script(), "graph_script", "exec"), scope)   # noqa: S102 - the test's own script
    for rec in recipes:
        t = time.perf_counter()
        r = scope["run"](rec, layers)
        print(f"{rec} x{layers}, DECLARE_MUTATED={'on' if declare else 'off'}: trace {time.perf_counter() - t:.1f} s; "
              f"launches {r['kernels']}; access cache {access_cache.stats()}", flush=True)
        if compare:
            print(f"  compared with the table: {len(seen)} analyses, {len(diffs)} different", flush=True)
            for d in diffs:
                print(f"  DIFFERENT {d[0]}: torch {d[2]}, table {d[3]}; {d[1]}", flush=True)
            seen.clear()
    return 1 if compare and diffs else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default="mxfp4-all-dh16,mxfp4-all")
    p.add_argument("--declare", choices=("both", "on", "off"), default="both")
    p.add_argument("--compare", action="store_true",
                   help="torch analyses every launch (table off) and each answer is compared with the table's")
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    recipes = a.recipes.split(",")
    if a.child:
        return child(a.child == "on", recipes, a.layers, a.compare)
    import torch
    print(f"torch {torch.__version__}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # (real Triton IR for sm_90)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    rc = 0
    sets = ("off",) if a.compare else (("on", "off") if a.declare == "both" else (a.declare,))
    for d in sets:
        rc |= subprocess.run([sys.executable, os.path.abspath(__file__), "--child", d, "--layers", str(a.layers),
                              "--recipes", a.recipes] + (["--compare"] if a.compare else []), env=env).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
