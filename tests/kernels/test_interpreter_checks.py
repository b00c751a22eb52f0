"""The interpreter the CPU tests run (tests/interp_speed.py, installed by conftest.py): a kernel calling device
functions computes what it is written to, and the signed-overflow check that interp_speed turns off is one
that Triton's interpreter only acts on in debug mode (off in these tests), so turning it off drops nothing."""

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter (CPU) only")


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, _twice(_twice(v)) * k, mask=m)


def _run(x, k):
    out = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 16),)](x, out, x.numel(), k, BLOCK=16)
    return out


def test_device_functions_compute_as_written():
    x = torch.arange(-20, 20, dtype=torch.int32)
    assert torch.equal(_run(x, 3), x * 12)
    f = torch.linspace(-3, 3, 40)
    assert torch.equal(_run(f, 0.5), f * 2.0)


def test_the_overflow_check_acts_only_in_debug_mode():
    from triton.runtime import interpreter as I
    opts = I.interpreter_builder.options
    assert not opts.debug
    x = torch.full((20,), 2 ** 29, dtype=torch.int32)   # x * 4 leaves int32
    try:
        I.interpreter_builder.options = dataclasses.replace(opts, sanitize_overflow=True)
        assert torch.equal(_run(x, 1), x * 4)            # checked, and the result dropped: it wraps
        I.interpreter_builder.options = dataclasses.replace(opts, sanitize_overflow=True, debug=True)
        with pytest.raises(Exception, match="overflow"):
            _run(x, 1)
    finally:
        I.interpreter_builder.options = opts


def test_lazy_type_names_and_tuple_types_equal_tritons_own():
    """interp_speed makes ``tuple_type`` / ``block_type`` names and a ``tl.tuple``'s type when first read: the same
    text and the same type as Triton's own constructors (kept aside by interp_speed) give, a type given to the
    constructor kept as given, and a type assigned later (``_setitem``) the one read back."""
    import sys
    core = tl.core
    orig = getattr(core, "_mxtrain_original_inits", None)
    if not getattr(sys.modules["triton.runtime.interpreter"], "_mxtrain_fast_patch", False) or orig is None:
        pytest.skip("the interpreter runs unpatched here (another Triton, or MXTRAIN_TEST_PLAIN_INTERPRETER)")

    def made_by_triton(cls, *args):
        obj = object.__new__(cls)
        orig[cls.__name__](obj, *args)
        return obj
    types = [tl.int32, core.constexpr_type(3), tl.float32]
    for args in ((types, ["a", "b", "c"]), (types,)):
        lazy, eager = core.tuple_type(*args), made_by_triton(core.tuple_type, *args)
        assert lazy == eager and lazy.name == str(lazy) == eager.name
    assert core.tuple_type(types, ["a", "b", "c"]).name == "[a:int32,b:constexpr_type[3],c:fp32]"
    for shape in ([4, 8], [core.constexpr(4), 8], [16]):
        lazy, eager = core.block_type(tl.float32, shape), made_by_triton(core.block_type, tl.float32, shape)
        assert lazy == eager and lazy.name == str(lazy) == eager.name and lazy.numel == eager.numel
        assert type(lazy.shape) is type(eager.shape) and list(lazy.shape) == list(eager.shape)
    assert core.block_type(tl.float32, [4, 8]) != core.block_type(tl.float32, [8, 4])
    with pytest.raises(TypeError, match="0d block_type"):
        core.block_type(tl.float32, [])
    with pytest.raises(ValueError):
        core.block_type(tl.float32, [3, 8])         # (not a power of two: Triton's own shape check still runs)
    for args in (([1, 2.0, tl.float16],), ([5], core.tuple_type([tl.int8])), ([5], [tl.int8])):
        assert core.tuple(*args).type == made_by_triton(core.tuple, *args).type
    given = core.tuple_type([tl.int8])
    assert core.tuple([5], given).type is given
    tup = core.tuple([1, 2.0, tl.float16])
    tup._setitem(0, 7)
    assert tup.values[0] == 7 and tup.type == made_by_triton(core.tuple, [7, 2.0, tl.float16]).type
    t = core.tuple_type(types)
    t.name = "renamed"                              # (a subclass or caller may assign a name)
    assert t.name == "renamed"
