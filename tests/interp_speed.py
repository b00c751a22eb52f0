"""A faster Triton interpreter for the CPU tests: three overheads of Triton 3.6's interpreter removed.

Its type table (``_get_np_dtype``) is built again at every lookup: answered here from a memo. And it patches the
language module (``_patch_lang``: every builtin of ``tl``, ``tl.tensor``, ``tl.math`` and ``tl.core`` replaced by
its interpreter form) when a kernel launch starts, restores it when the launch ends, and patches it again at every
call of a ``@triton.jit`` device function inside the launch, with the same replacements and a scope it never
restores. In the kernels' tests those repeated patches were about a sixth of the time (a profile of
``test_rot64_special_values_carrier``: 14,821 patches, 17.6 of 111 s). Here a device function's patch is skipped
when the modules it would patch were patched already in the same launch; the first patch of each launch, and of
any module a device function sees that the kernel did not, still runs. What the kernels compute is untouched:
the interpreter's functions run as before.

And it recomputes every integer add, sub and mul of a kernel in int64 to check it for signed overflow (about
half of an interpreted launch's time), then hands the result to ``device_assert``, which in Triton 3.6 does
nothing unless the interpreter runs in debug mode (``InterpreterOptions.debug``, off): the check is computed and
dropped. ``install`` turns that computation off (``sanitize_overflow=False``); with debug mode off nothing else
changes.

Applied only to the Triton version it was written against (``_FOR``); any other version runs unpatched."""

from __future__ import annotations

import dataclasses
import inspect

_FOR = "3.6.0"


def install() -> bool:
    """Patch the interpreter (True) or leave it as it is (False: no Triton, another version, or its internals
    are not the ones this was written for)."""
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter as I
    except Exception:
        return False
    if triton.__version__ != _FOR or getattr(I, "_mxtrain_fast_patch", False):
        return False
    grid_call = getattr(getattr(I, "GridExecutor", None), "__call__", None)
    scope_cls = getattr(I, "_LangPatchScope", None)
    orig = getattr(I, "_patch_lang", None)
    if grid_call is None or scope_cls is None or orig is None:
        return False
    langs = (tl, tl.core)
    state = {"depth": 0, "patched": set()}

    seen: dict = {}

    def keys(fn) -> frozenset:   # the language modules a jitted function's globals hold (what _patch_lang patches)
        k = seen.get(id(fn))
        if k is None or k[0] is not fn:
            k = seen[id(fn)] = (fn, frozenset(id(v) for v in fn.__globals__.values()
                                              if inspect.ismodule(v) and v in langs))
        return k[1]

    def _patch_lang(fn):
        k = keys(fn)
        if state["depth"] and k and k <= state["patched"]:
            return scope_cls()          # a device function's call inside a launch that patched these modules
        scope = orig(fn)
        if state["depth"]:
            state["patched"] |= k
        return scope

    def _grid_call(self, *args, **kwargs):
        outer = state["patched"]
        state["depth"] += 1
        state["patched"] = set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            state["patched"] = outer

    orig_np = getattr(I, "_get_np_dtype", None)
    np_cache: dict = {}

    def _get_np_dtype(tt_dtype):   # the same answer, from a memo (Triton's builds its table at every call)
        if isinstance(tt_dtype, tl.pointer_type):
            return orig_np(tt_dtype)
        base = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(base, tl.pointer_type):
            return orig_np(tt_dtype)
        try:
            return np_cache[base]
        except KeyError:
            np_cache[base] = r = orig_np(base)
            return r
        except TypeError:
            return orig_np(tt_dtype)

    I._patch_lang = _patch_lang
    I.GridExecutor.__call__ = _grid_call
    if orig_np is not None:
        I._get_np_dtype = _get_np_dtype
    if not I.interpreter_builder.options.debug:
        I.interpreter_builder.options = dataclasses.replace(I.interpreter_builder.options, sanitize_overflow=False)
    I._mxtrain_fast_patch = True
    return True

