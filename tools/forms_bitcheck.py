"""Every form of the MX linear layer on one device, bit for bit against another checkout of the package.

A change to the layer's code that should not change a single bit (a refactor, a move) is checked by running this
script under the old and the new package and comparing the files:

    git worktree add /tmp/old REV                     # the package before the change
    tool=$PWD/tools/forms_bitcheck.py                 # (the old checkout may not have the tool)
    (cd /tmp/old && python3 "$tool" /tmp/old.pt)
    python3 tools/forms_bitcheck.py /tmp/new.pt       # from the new checkout
    python3 tools/forms_bitcheck.py --compare /tmp/old.pt /tmp/new.pt

The package is imported from the current directory. Each case is Y, dX, dW (and db) of one call, forward and
backward, twice in a row (a stochastic recipe's second call draws new bits): the reference (setting ``fast`` off),
the eager fast path on a GPU (each ``wgrad_x`` choice), per-tensor FP8 on FP8 tensor cores, and with ``--compiled``
the layer under ``torch.compile`` (compiled into the graph, the custom ops, traced FP8). On a CPU only the reference
runs (``mx_linear`` routes CPU tensors there; tests/linear compares the other forms' CPU emulations with it). Progress
goes to stderr; ``--only`` takes a comma-separated list of recipe names.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.getcwd())


def _compare(a_path: str, b_path: str) -> int:
    import torch
    a, b = torch.load(a_path), torch.load(b_path)
    if a.keys() != b.keys():
        print(f"the files hold different cases: {sorted(set(a) ^ set(b))[:10]}")
        return 1
    bad = [k for k in a if len(a[k]) != len(b[k]) or not all(
        torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)) and torch.equal(torch.isnan(x), torch.isnan(y))
        for x, y in zip(a[k], b[k]))]
    print(f"{len(a)} cases, {len(bad)} differ" + (f": {bad[:20]}" if bad else ""))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--compiled", action="store_true", help="also the compiled forms (GPU; minutes of compiling)")
    ap.add_argument("--quick", action="store_true", help="one shape per recipe")
    ap.add_argument("--only", default="", help="recipe names, comma-separated")
    a = ap.parse_args()
    if a.compare:
        return _compare(*a.compare)
    if not a.out:
        ap.error("give the output file (or --compare A B)")
    import torch
    import mxtrain
    from mxtrain import settings
    from mxtrain.numerics import recipes

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"mxtrain from {mxtrain.__file__}, device {dev}", file=sys.stderr, flush=True)
    out, states, t0 = {}, {}, time.time()

    def run(name, fn, shape, N, dtype, bias, amp=None):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-4, 4, (*shape[:-1], 1), generator=g).float())
        w = torch.randn(N, shape[-1], generator=g) / shape[-1] ** 0.5
        b = torch.randn(N, generator=g) if bias else None
        gy = torch.randn(*shape[:-1], N, generator=g)
        res = []
        for _ in range(2):
            xx = x.to(dev, dtype).requires_grad_()
            ww = w.to(dev, dtype).requires_grad_()
            bb = b.to(dev, dtype).requires_grad_() if b is not None else None
            with (torch.autocast(dev, dtype=amp) if amp is not None else torch.autocast(dev, enabled=False)):
                y = fn(xx, ww, bb)
            y.backward(gy.to(dev, y.dtype))
            res += [t.detach().cpu().clone() for t in (y, xx.grad, ww.grad) + ((bb.grad,) if bb is not None else ())]
        out[name] = res

    def layer(rec, key):
        st = states.setdefault(key, torch.tensor([3, 5, 0], device=dev))
        return lambda x, w, b: mxtrain.mx_linear(x, w, b, rec, st)

    if dev == "cuda":
        cases = [((2, 512, 768), 512, torch.bfloat16, True, None), ((1000, 768), 384, torch.float32, False,
                                                                     torch.bfloat16),
                 ((3, 100, 320), 192, torch.bfloat16, False, None)]
    else:
        cases = [((33, 72), 40, torch.float32, True, None), ((2, 16, 64), 48, torch.bfloat16, False, None),
                 ((24, 64), 32, torch.float32, False, torch.bfloat16)]
    if a.quick:
        cases = cases[:1]
    names = ["mxfp4-all", "mxfp4-all-dh16", "mxfp4-all-sr", "tseng", "mxfp4-fprop", "mxfp4-all-rht16", "ufp4",
             "mxfp4-all-adaptive", "mxfp4-all-dh16+amd", "mxfp8", "nvfp4", "fp8", "bf16"]
    names = [n for n in (a.only.split(",") if a.only else names) if n in recipes.names()]
    for r in names:
        rec = recipes.get(r)
        for i, (shape, N, dt, bias, amp) in enumerate(cases):
            with settings.override(fast=False):
                run(f"reference/{r}/{i}", layer(rec, ("r", r, i)), shape, N, dt, bias, amp)
            if dev == "cuda":
                for wx in ("auto", "forward", "backward"):
                    with settings.override(wgrad_x=wx):
                        run(f"eager/{r}/{wx}/{i}", layer(rec, ("e", r, wx, i)), shape, N, dt, bias, amp)
        print(f"{r}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if a.compiled and dev == "cuda":
        for r, form in (("mxfp4-all-dh16", "auto"), ("mxfp4-all-sr", "auto"), ("tseng", "auto"), ("fp8", "auto"),
                        ("mxfp4-all", "ops"), ("mxfp4-fprop", "auto")):
            if r not in names:
                continue
            rec = recipes.get(r)
            torch._dynamo.reset()
            with settings.override(mx_compiled=form):
                f = torch.compile(layer(rec, ("c", r, form)), fullgraph=True)
                for i, (shape, N, dt, bias, amp) in enumerate(cases[:2]):
                    run(f"compiled/{r}/{form}/{i}", f, shape, N, dt, bias, amp)
            print(f"compiled {r} ({form}): {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    torch.save(out, a.out)
    print(f"{len(out)} cases in {time.time() - t0:.0f} s -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
