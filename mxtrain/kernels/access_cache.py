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

From torch 2.12 the analysis walks the IR without a memo (pytorch/pytorch#193703), which takes minutes for the
rotated variants (their Hadamard butterflies share subgraphs deeply): mxtrain's quantize kernels are answered from a
table of the arguments each only reads (``READ_ONLY``; every other tensor argument counts as written, every one as
read), checked in CI against torch's own analysis of the unrotated variants (docs/kernels.md, "First compile").
Before torch 2.12 (``identify_mutated_tensors``, which answers the written arguments' names) the same table can
answer as well (``DECLARE_MUTATED``): there the analysis takes about 0.7 s a variant on an H200 host, tens of
seconds of a model's first compile.

The kernels' source, once per kernel. Inductor keys its FX graph cache on the source of every user kernel a graph
launches together with every ``triton.jit`` function it calls (``user_defined_triton_kernel_transitive_closure_source_code``),
computed again for each launch with no memo: for a quantize kernel and its helpers about 45 ms on a 2-core CPU, some
200 launches for 4 blocks of a 125M model, at every process start, warm caches included (about 5 s of the 21.6 s
warm first step of that model on an H200 under cProfile; BENCHMARKS "First compile time"). ``install()`` wraps that
function too, for mxtrain's kernels only: the text depends on the kernel's source and its module's globals, which
mxtrain never changes at run time, so each kernel's text is torch's own answer for its first launch.
"""

from __future__ import annotations

import copy
import functools
import threading

_NAMES = ("identify_accessed_tensors", "identify_mutated_tensors")
_PREFIX = "mxtrain."
_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0, "bypassed": 0, "declared": 0, "source_hits": 0, "source_misses": 0}
_SOURCE = "user_defined_triton_kernel_transitive_closure_source_code"


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


# The tensor arguments each of mxtrain's kernels only reads (its inputs: the tensor quantized, random signs, a
# key in device memory, packed codes and scales to expand); every other tensor argument is one it may write (its
# outputs and the inexact-block counter; an unused output slot holds the counter and is not written). Rotation, rounding and layout change
# what a kernel computes, never where it stores: every ``tl.store`` / ``tl.atomic_*`` of these kernels writes
# through an output pointer (tests/linear/test_compiledmx.py compares this table with torch's own analysis of every
# unrotated variant the compiled layer launches, and scans the sources).
READ_ONLY = {
    "_mxfp4_kernel": frozenset({"x_ptr", "signs_ptr", "key_ptr"}),
    "_mxfp4_dual_kernel": frozenset({"x_ptr", "sg_a", "kp_a", "sg_b", "kp_b"}),
    "_expand_kernel": frozenset({"pk_ptr", "sc_ptr"}),
    "_mxfp4_group_kernel": frozenset({"x0", "x1", "x2", "x3", "signs_ptr", "key_ptr"}),
}
# The kernels of ``READ_ONLY`` are answered from that table instead of being analysed: writes = the counter and
# every tensor argument neither in the table nor the counter itself (an unused slot). With torch 2.12 and later
# (``identify_accessed_tensors``, whose walk of the IR has no memo and takes minutes on the rotated variants,
# pytorch/pytorch#193703) also reads = every tensor argument and no epilogue fusion; before 2.12
# (``identify_mutated_tensors``) the writes' names. Off: torch analyses them (once per variant, cached).
DECLARE = True
# The pre-2.12 form (``declared_writes``) answers only with this on. A wrong answer would let the compiler drop a
# write, so its answer is checked against torch's own analysis: in CI on torch 2.13, and on torch 2.11.0 (the CUDA
# build, Triton 3.6.0, on a CPU machine; 2026-11-30) by tests/linear/test_compiledmx.py with this on, where the
# answer equalled ``identify_mutated_tensors``' for all 12 launches of the access test and the graph tests found no
# copy or clone of an input, and by ``tools/trace_time.py --compare`` for every launch of two compiled layers of
# each of ten recipes (rotated, random-signed, stochastic, 64-wide, uniform-grid, adaptive, rceil, amd, Fprop-only
# and dh32 variants: no difference); and on an H200 (torch 2.11.0+cu130, 2026-11-30, commit 9c4f26c), where inductor
# also asks it while lowering each launch, by the 47 cuda tests of tests/linear/test_compiledmx.py (compiled against
# eager, bit for bit, inexact counts included): all passed. There it took the HF example's MX arm (one process,
# compile included) from 180 s to 62 s (BENCHMARKS "First compile time").
DECLARE_MUTATED = True


def _tensor_args(kwargs: dict) -> list | None:
    """The names of the tensor arguments in ``kwargs`` (torch tensors, or inductor's ``TensorBox`` while it
    lowers a launch), in their order; None where torch lacks either type."""
    try:
        import torch
        from torch._inductor.ir import TensorBox
    except ImportError:
        return None
    return [n for n, v in kwargs.items() if isinstance(v, (torch.Tensor, TensorBox))]


def declared_writes(kernel, kwargs: dict) -> list | None:
    """The table's answer for a launch of ``kernel`` with ``kwargs`` in the form of torch's
    ``identify_mutated_tensors`` (torch before 2.12): the names of the tensor arguments it may write, in their
    order; None where the kernel is not in ``READ_ONLY``."""
    name = getattr(_python_function(kernel), "__name__", "")
    if name not in READ_ONLY:
        return None
    tensors = _tensor_args(kwargs)
    cnt = kwargs.get("cnt_ptr")
    if tensors is None or cnt is None:
        return None
    # (an output slot the launch does not use holds the counter itself: not a write of its own; counted as one,
    # functionalization would copy the counter twice and could write back the copy without the kernel's adds)
    # (the counter counts inexact carrier blocks: ``_mxfp4_kernel`` without its carrier output never adds to it)
    counts = not (name == "_mxfp4_kernel" and not kwargs.get("WRITE_CARRIER", True))
    return [n for n in tensors if n not in READ_ONLY[name]
            and (counts if n == "cnt_ptr" else kwargs[n] is not cnt)]


def declared(kernel, kwargs: dict):
    """The table's answer for a launch of ``kernel`` with ``kwargs``, in the form of torch's
    ``identify_accessed_tensors``; None where the kernel is not in ``READ_ONLY`` or torch has no such form."""
    writes = declared_writes(kernel, kwargs)
    if writes is None:
        return None
    try:
        from torch._higher_order_ops.triton_kernel_wrap import TensorAccesses
        from torch._inductor.dependencies import ReadWrites, StarDep
        from torch.utils._ordered_set import OrderedSet
    except ImportError:
        return None
    tensors = _tensor_args(kwargs)
    return TensorAccesses(read_writes=ReadWrites(reads=OrderedSet(StarDep(n) for n in tensors),
                                                 writes=OrderedSet(StarDep(n) for n in writes),
                                                 index_exprs=OrderedSet()), can_fuse_epilogue=False)


def _wrap(fn):
    if getattr(fn, "_mxtrain_cached", False):
        return fn
    accessed = fn.__name__ == "identify_accessed_tensors"
    cache: dict = {}
    keep: list = []   # the kernels whose id is in a key, alive as long as the cache

    @functools.wraps(fn)
    def analysed(kernel, kwargs, *rest, **kw):
        if kw or not ours(kernel):
            with _lock:
                _stats["bypassed"] += 1
            return fn(kernel, kwargs, *rest, **kw)
        if DECLARE and (accessed or DECLARE_MUTATED):
            out = declared(kernel, kwargs) if accessed else declared_writes(kernel, kwargs)
            if out is not None:
                with _lock:
                    _stats["declared"] += 1
                return out
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


def _wrap_source(fn):
    if getattr(fn, "_mxtrain_cached", False):
        return fn
    cache: dict = {}
    keep: list = []   # the kernels whose id is a key, alive as long as the cache

    @functools.wraps(fn)
    def source(kernel, *rest, **kw):
        # (an epilogue fused into the launch changes the text: torch's own answer then)
        if any(v is not None for v in (*rest, *kw.values())) or not ours(kernel):
            return fn(kernel, *rest, **kw)
        with _lock:
            out = cache.get(id(kernel))
            _stats["source_misses" if out is None else "source_hits"] += 1
        if out is None:
            out = fn(kernel, *rest, **kw)
            with _lock:
                cache[id(kernel)] = out
                keep.append(kernel)
        return out

    source._mxtrain_cached = True
    source.cache = cache
    return source


def _install_source() -> bool:
    """Wrap inductor's kernel-source function with the once-per-kernel memo (idempotent); False where this torch
    has no such function (then nothing changes)."""
    try:
        import torch._inductor.codegen.wrapper as wrapper
    except ImportError:   # pragma: no cover - torch without inductor
        return False
    fn = getattr(wrapper, _SOURCE, None)
    if fn is None:
        return False
    setattr(wrapper, _SOURCE, _wrap_source(fn))   # (its callers import it by name when they call it)
    return True


def install() -> str | None:
    """Wrap torch's kernel-access analysis with the cache and inductor's kernel-source function with its memo
    (idempotent); the name of the analysis wrapped, or None where torch has neither known name."""
    try:
        import torch._higher_order_ops.triton_kernel_wrap as tkw
    except ImportError:   # pragma: no cover - torch without user-kernel support
        return None
    _install_source()
    for name in _NAMES:
        fn = getattr(tkw, name, None)
        if fn is not None:
            setattr(tkw, name, _wrap(fn))
            return name
    return None


def stats() -> dict:
    """Hits, misses, launches of other kernels passed through, and answers from ``READ_ONLY`` (``declared``),
    since the process started; and the kernel-source memo's hits and misses (``source_hits``, ``source_misses``)."""
    with _lock:
        return dict(_stats)
