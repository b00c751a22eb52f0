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


def mlp_losses(recipe: str, compiled: bool, dev: str, width: int = 64, batch: int = 32, steps: int = 6):
    """Losses of ``steps`` AdamW steps of a converted 3-layer MLP (``width`` -> 2 ``width`` -> ``width``) in a
    plain loop under bf16 autocast, the whole model under ``torch.compile(fullgraph=True)`` or eager."""
    import mxtrain
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                            torch.nn.Linear(2 * width, width)).to(dev)
    mxtrain.convert(m, recipe, skip=())
    f = torch.compile(m, fullgraph=True) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=g).to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = (f(x).float() - x.flip(-1)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
