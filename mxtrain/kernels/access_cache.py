"""Work out once which tensors a launch of one of mxtrain's Triton kernels writes, for ``torch.compile``.

Every ``wrap_triton`` launch in a traced graph is analysed by torch to learn which of its tensor arguments the
kernel writes (functionalization needs it, and inductor asks again when it lowers the launch): torch compiles the
kernel to Triton IR and walks the result, tens to hundreds of milliseconds a launch, with no cache between launches
(upstream: pytorch/pytorch#193227). A compiled MX layer launches three to five quantize kernels, and the analysis
runs several times for each: on an H200 it was 69 s of the 161 s first step of one 125m block (119 analyses of a
handful of distinct launches; ``tools/compile_time.py``), so a 12-block model spent most of ten minutes on it.

What the analysis finds depends only on the kernel's code, on which arguments are tensors, on the constexpr
arguments (which branches exist) and on the integer arguments Triton specializes (equal to 1); not on shapes,
strides or data. ``install()`` wraps torch's analysis function with a cache on exactly that key, for the kernels
defined in mxtrain's own modules only; any other kernel is analysed by torch as before. A cached answer is a deep
copy of the answer torch gave for the first launch with the same key, so it is torch's own result, not a claim of
ours. Where torch's module has neither name the analysis went by (``identify_accessed_tensors``, torch 2.12 and
later; ``identify_mutated_tensors`` before), nothing is installed and compiles are slow but correct.

The cache removes repeats only: the first analysis of each variant is torch's. From torch 2.12 that analysis walks
the IR without a memo (pytorch/pytorch#193703), which takes minutes for the rotated variants (their Hadamard
butterflies share subgraphs deeply): docs/kernels.md, "First compile".
"""

from __future__ import annotations

import copy
import functools
import threading

_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")
_PREFIX = "mxtrain."
_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0, "bypassed": 0}


def _python_function(kernel):
    k = kernel
    for _ in range(4):   # Autotuner -> JITFunction -> the Python function
        if not hasattr(k, "fn"):
            break
        k = k.fn
    return k


def _jit_params(kernel) -> dict:
    k = kernel
    while not hasattr(k, "params") and hasattr(k, "fn"):
        k = k.fn
    return {p.name: bool(getattr(p, "is_constexpr", False)) for p in getattr(k, "params", ())}


def ours(kernel) -> bool:
    """Whether ``kernel`` (a ``triton.jit`` function or an autotuner over one) is defined in an mxtrain module."""
    return getattr(_python_function(kernel), "__module__", "").startswith(_PREFIX)


def _arg_key(name: str, value, constexpr: bool):
    if constexpr:
        return name, "c", repr(value)
    if value is None or isinstance(value, (str, bool)):
        return name, "v", repr(value)
    if isinstance(value, int):
        return name, "i", value == 1          # Triton specializes an integer equal to 1
    if isinstance(value, float):
        return name, "f"
    if type(value).__name__.startswith("Sym"):   # a symbolic integer: its value is not known at trace time
        return name, "s"
    dtype = getattr(value, "dtype", None)
    if dtype is None and callable(getattr(value, "get_dtype", None)):   # inductor's TensorBox
        dtype = value.get_dtype()
    return name, "t", str(dtype)


def key(kernel, kwargs: dict, *rest) -> tuple:
    """The cache key of one analysis: the kernel object, each argument as what the analysis can see of it, and
    the remaining arguments of torch's function (descriptor metadata) by ``repr``."""
    consts = _jit_params(kernel)
    return (id(kernel), tuple(_arg_key(n, v, consts.get(n, False)) for n, v in sorted(kwargs.items())),
            repr(rest))


def _wrap(fn):
    if getattr(fn, "_mxtrain_cached", False):
        return fn
    cache: dict = {}
    keep: list = []   # the kernels whose id is in a key, alive as long as the cache

    @functools.wraps(fn)
    def analysed(kernel, kwargs, *rest, **kw):
        if kw or not ours(kernel):
            with _lock:
                _stats["bypassed"] += 1
            return fn(kernel, kwargs, *rest, **kw)
        k = key(kernel, kwargs, *rest)
        with _lock:
            hit = k in cache
            _stats["hits" if hit else "misses"] += 1
            if hit:
                return copy.deepcopy(cache[k])
        out = fn(kernel, kwargs, *rest)
        with _lock:
            cache[k] = copy.deepcopy(out)
            keep.append(kernel)
        return out

    analysed._mxtrain_cached = True
    analysed.cache = cache
    return analysed


def install() -> str | None:
    """Wrap torch's kernel-access analysis with the cache (idempotent); the name wrapped, or None where torch has
    neither known name."""
    try:
        import torch._higher_order_ops.triton_kernel_wrap as tkw
    except ImportError:   # pragma: no cover - torch without user-kernel support
        return None
    for name in _NAMES:
        fn = getattr(tkw, name, None)
        if fn is not None:
            setattr(tkw, name, _wrap(fn))
            return name
    return None


def stats() -> dict:
    """Hits, misses and launches of other kernels passed through, since the process started."""
    with _lock:
        return dict(_stats)
