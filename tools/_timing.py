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


def best_us(fn, n: int = 200, reps: int = 7, warm: int = 30) -> float:
    """The least of ``reps`` loops of ``n`` calls, microseconds a call (a noisy host's interruptions left out)."""
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
