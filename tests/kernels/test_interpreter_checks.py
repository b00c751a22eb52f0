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


def test_same_type_operands_are_what_tritons_promotion_hands_back():
    """interp_speed's ``_same_type_operands``: for two tensors of one plain dtype and shape, Triton's own type
    checking (kept aside by interp_speed) returns the operands themselves, which the shortcut returns; for the
    pairs it leaves to Triton (fp16 or bf16 under / and %) Triton's function makes new tensors, and so does the
    patched one."""
    import numpy as np
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter as I
    fn = TritonSemantic.binary_op_type_checking_impl
    orig = getattr(fn, "_mxtrain_original", None)
    if orig is None:
        pytest.skip("the interpreter runs unpatched here (another Triton, or MXTRAIN_TEST_PLAIN_INTERPRETER)")
    sem = I.interpreter_semantic
    core = tl.core
    shortcuts = 0
    for dt in (tl.float32, tl.float64, tl.float16, tl.bfloat16, tl.int1, tl.int8, tl.int32, tl.int64, tl.uint8,
               tl.uint32):
        name, npt = dt.name, I._get_np_dtype(dt)
        for shape in ([], [4], [2, 8]):
            ty = core.block_type(dt, shape) if shape else dt

            def make():
                return core.tensor(I.TensorHandle(np.zeros(shape or (), dtype=npt), dt), ty)
            for check in (True, False):
                for div in (False, True):
                    a, b = make(), make()
                    want = orig(sem, a, b, False, False, check, div)
                    got = fn(sem, a, b, False, False, check, div)
                    assert [x.type for x in got] == [x.type for x in want], (name, shape, check, div)
                    kept = want[0] is a and want[1] is b
                    assert (got[0] is a and got[1] is b) == kept, (name, shape, check, div)
                    shortcuts += kept
                    if name in ("fp16", "bf16") and check and div:
                        assert not kept and want[0].type.scalar == tl.float32
    assert shortcuts > 100
    # a number, two shapes, two dtypes: Triton's answer (a splat, a broadcast, a promotion)
    x = core.tensor(I.TensorHandle(np.zeros((2, 8), dtype=np.float32), tl.float32), core.block_type(tl.float32, [2, 8]))
    y = core.tensor(I.TensorHandle(np.zeros((1, 8), dtype=np.float32), tl.float32), core.block_type(tl.float32, [1, 8]))
    z = core.tensor(I.TensorHandle(np.zeros((2, 8), dtype=np.int32), tl.int32), core.block_type(tl.int32, [2, 8]))
    for a, b in ((x, 2.0), (x, y), (x, z), (z, 3)):
        got, want = fn(sem, a, b), orig(sem, a, b)
        assert [t.type for t in got] == [t.type for t in want] and [t.type for t in got][1] == a.type


def test_known_shapes_make_what_tritons_constructors_make():
    """interp_speed's ``_known_shapes``: a block type and a tensor of a shape met before have the fields Triton's
    own constructors give (element type, shape values and their type, element count; the tensor's shape as
    ``constexpr`` sizes, its numel, dtype and type); every object gets a shape tuple of its own; a wrong shape is
    still refused."""
    import numpy as np
    from triton.runtime import interpreter as I
    core = tl.core
    orig = getattr(core, "_mxtrain_original_inits", {})
    if "tensor" not in orig:
        pytest.skip("the interpreter runs unpatched here (another Triton, or MXTRAIN_TEST_PLAIN_INTERPRETER)")

    def made_by_triton(cls, *args):
        obj = object.__new__(cls)
        orig[cls.__name__](obj, *args)
        return obj
    for shape in ([4, 8], [core.constexpr(4), 8], [16], core.tuple([2, 32])):
        for _ in range(2):   # (the second time from the memo)
            got, want = core.block_type(tl.int32, shape), made_by_triton(core.block_type, tl.int32, shape)
            assert got == want and got.name == want.name and got.numel == want.numel
            assert list(got.shape) == list(want.shape) and got.shape.type == want.shape.type
            assert core.block_type(tl.int32, shape).shape is not got.shape
            h = I.TensorHandle(np.zeros(list(want.shape), dtype=np.int32), tl.int32)
            tg, tw = core.tensor(h, got), made_by_triton(core.tensor, h, want)
            assert [s.value for s in tg.shape] == [s.value for s in tw.shape]
            assert all(isinstance(s, core.constexpr) for s in tg.shape) and tg.shape.type == tw.shape.type
            assert tg.numel.value == tw.numel.value and tg.dtype == tw.dtype and tg.type == tw.type
            assert core.tensor(h, got).shape is not tg.shape
    s = core.tensor(I.TensorHandle(np.zeros((), dtype=np.float32), tl.float32), tl.float32)   # a scalar
    assert list(s.shape) == [] and s.numel.value == 1 and s.dtype == tl.float32
    with pytest.raises(ValueError):
        core.block_type(tl.float32, [3, 8])
    with pytest.raises(TypeError, match="0d block_type"):
        core.block_type(tl.float32, [])
