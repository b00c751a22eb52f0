"""How long tracing compiled MX layers takes on a CPU machine, with and without the kernel-access table.

``python tools/trace_time.py [--layers 4] [--recipes mxfp4-all-dh16,mxfp4-all] [--declare both|on|off]``

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


def child(declare: bool, recipes: list[str], layers: int) -> int:
    from mxtrain.kernels import access_cache
    access_cache.DECLARE_MUTATED = declare
    scope: dict = {"__name__": "mxtrain_trace_time"}
    exec(compile(_graph_script(), "graph_script", "exec"), scope)   # noqa: S102 - the test's own script
    for rec in recipes:
        t = time.perf_counter()
        r = scope["run"](rec, layers)
        print(f"{rec} x{layers}, DECLARE_MUTATED={'on' if declare else 'off'}: trace {time.perf_counter() - t:.1f} s; "
              f"launches {r['kernels']}; access cache {access_cache.stats()}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--recipes", default="mxfp4-all-dh16,mxfp4-all")
    p.add_argument("--declare", choices=("both", "on", "off"), default="both")
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    recipes = a.recipes.split(",")
    if a.child:
        return child(a.child == "on", recipes, a.layers)
    import torch
    print(f"torch {torch.__version__}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # (real Triton IR for sm_90)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    rc = 0
    for d in (("on", "off") if a.declare == "both" else (a.declare,)):
        rc |= subprocess.run([sys.executable, os.path.abspath(__file__), "--child", d, "--layers", str(a.layers),
                              "--recipes", a.recipes], env=env).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
