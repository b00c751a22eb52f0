"""Host-time loops shared by the host-overhead tools (``from _timing import ...``: the tools run as scripts,
so their folder is on the import path)."""

import time

import torch


def per_call_us(fn, n: int = 300, warm: int = 30) -> float:
    """Microseconds a call of ``fn`` over ``n`` calls (after ``warm``), the GPU drained before and after."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


from mxtrain.bench.suite import best_us  # noqa: E402,F401  (one definition: mxtrain bench host times the same way)
