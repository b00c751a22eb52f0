"""Shared helpers of the tests of traced layers under torch.compile (tests/test_tracedfp8.py,
tests/test_tracedmx.py)."""

from __future__ import annotations

import torch


def fwd_bwd(x, w, b, gy, fn):
    """``fn(x, w, b)`` and its backward from ``gy``: [y, dX, dW(, db)] as float32."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    y.backward(gy)
    return [t.detach().float() for t in (y, x.grad, w.grad, *(() if b is None else (b.grad,)))]


def ops_of(fn, *args):
    """The call_function targets of the graph(s) ``torch.compile`` makes of ``fn`` (fullgraph)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen
