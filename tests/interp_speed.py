"""A faster Triton interpreter for the CPU tests: six overheads of Triton 3.6's interpreter removed.

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

And every interpreted operation makes new tensors, block types and ``tl.tuple`` shapes, each of which formats a
display name and works out a tuple type that almost nothing reads (``_lazy_type_names``: a quarter of a kernel
test's time). Here those are made when first read, from the same fields; tests/kernels/test_interpreter_checks.py
compares them with Triton's own constructors. The kernel tests of tests/kernels/test_kernels.py and test_expand.py
took 155 s instead of 248 s with it (one process, a 2-core machine).

And every binary operation on two tensors runs Triton's type promotion and broadcasting, which for two operands of
one type and shape change nothing and hand them back (``_same_type_operands``): half of a kernel test's binary
operations, a fifth of its time. Here those are handed back at once; any other pair (a Python number, two
dtypes, two shapes, pointers, a half-precision division) goes through Triton's code as before. And every block
type and tensor made unwraps, checks and wraps its shape again (``_known_shapes``): a shape of plain sizes checked
once is remembered, and a new block type or tensor of it takes the same values (a ``tl.tuple`` of its own each
time, the sizes' ``constexpr`` objects shared: nothing changes one in place). With both, tests/kernels/test_expand.py
took 26 s instead of 39 s, test_nvfp4_kernel.py 22 s instead of 29 s (one process, a 2-core machine).

Applied only to the Triton version it was written against (``_FOR``); any other version runs unpatched."""

from __future__ import annotations

import builtins
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

    _lazy_type_names(tl.core)
    _same_type_operands(tl.core)
    _known_shapes(tl.core)
    I._patch_lang = _patch_lang
    I.GridExecutor.__call__ = _grid_call
    if orig_np is not None:
        I._get_np_dtype = _get_np_dtype
    if not I.interpreter_builder.options.debug:
        I.interpreter_builder.options = dataclasses.replace(I.interpreter_builder.options, sanitize_overflow=False)
    I._mxtrain_fast_patch = True
    return True



def _lazy_type_names(core) -> None:
    """``tuple_type`` and ``block_type`` build their display name (``name``, what ``str`` prints) when made; the
    interpreter makes about a million of them in a kernel test (every tensor's shape is a ``tl.tuple`` with its
    own ``tuple_type``), and formatting the names was a sixth of the time. Here the name is formatted the first
    time it is read, from the same fields and with the same text. Equality, hashing and mangling do not read it
    (``tuple_type.__eq__`` compares types and fields, ``block_type.__eq__`` element type and shape)."""
    tt, bt = core.tuple_type, core.block_type

    def tt_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    def tt_name(self):
        n = self.__dict__.get("_name")
        if n is None:
            n = self._name = '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'
        return n

    bt_init_orig = bt.__init__
    unwrap, validate = core._unwrap_shape, core.validate_block_shape

    ttuple = core.tuple   # (``tuple`` in Triton's core module: its own ``tl.tuple``, not the builtin)

    def bt_init(self, element_ty, shape):
        self.element_ty = element_ty
        assert isinstance(shape, (list, ttuple))
        self.shape = ttuple(unwrap(shape))
        if not self.shape:
            raise TypeError('0d block_type is forbidden')
        self.numel = validate(self.shape)

    def bt_name(self):
        n = self.__dict__.get("_name")
        if n is None:
            n = self._name = f'<{self.shape}, {self.element_ty}>'
        return n

    def setter(self, v):
        self.__dict__["_name"] = v

    # (checked against the source this was written for: a Triton whose constructors differ keeps its own)
    src_tt, src_bt = inspect.getsource(tt.__init__), inspect.getsource(bt_init_orig)
    if "self.name = '[' + ','.join([f\"{k}:{v}\" for k, v in zip(self.fields, self.types)]) + ']'" not in src_tt \
            or "self.name = f'<{self.shape}, {self.element_ty}>'" not in src_bt or "_unwrap_shape" not in src_bt:
        return
    core._mxtrain_original_inits = {"tuple_type": tt.__init__, "block_type": bt_init_orig}
    tt.__init__, tt.name = tt_init, property(tt_name, setter)
    bt.__init__, bt.name = bt_init, property(bt_name, setter)

    # A ``tl.tuple`` (every tensor's shape, every block type's) works out its ``tuple_type`` from its values when
    # made; most are never asked for it. Here it is worked out, by the same function from the same values, the
    # first time it is read; a type given to the constructor is kept as given. (``tl.tuple._setitem``, the one
    # place that changes a tuple's values, assigns the type again.)
    tup = core.tuple
    src_tup = inspect.getsource(tup.__init__)
    if "self.type = _type_for_tuple_values(self.values)" not in src_tup or "self.type = tuple_type(type)" not in src_tup:
        return
    type_for = core._type_for_tuple_values

    def tup_init(self, args, type=None):
        self.values = [i for i in args]
        if isinstance(type, tt):
            self.__dict__["_type"] = type
        elif type is not None:
            self.__dict__["_type"] = tt(type)

    def tup_type(self):
        t = self.__dict__.get("_type")
        if t is None:
            t = self.__dict__["_type"] = type_for(self.values)
        return t

    def tup_set(self, v):
        self.__dict__["_type"] = v

    core._mxtrain_original_inits["tuple"] = tup.__init__
    tup.__init__, tup.type = tup_init, property(tup_type, tup_set)


def _same_type_operands(core) -> None:
    """``TritonSemantic.binary_op_type_checking_impl`` for two tensors of one dtype (integer or floating, not a
    pointer) and one shape: Triton's checks pass, the computation type is that dtype (``computation_type_impl``:
    except for fp16 and bf16 under / and %, which promote to fp32 and are left to Triton), ``cast`` to one's own
    dtype returns the tensor, and broadcasting two equal shapes returns both: the operands themselves. Those are
    returned at once; everything else runs Triton's function."""
    from triton.language.semantic import TritonSemantic
    orig = TritonSemantic.binary_op_type_checking_impl
    src = inspect.getsource(orig)
    if ("else self.cast(lhs, ret_sca_ty)" not in src or "self.broadcast_impl_value(lhs, rhs)" not in src
            or getattr(orig, "_mxtrain_same_type", False)):
        return
    tensor, block_type, dtype = core.tensor, core.block_type, core.dtype
    kept = {"fp32", "fp64", "int1", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    halves = {"fp16", "bf16"}

    def same(a, b, check, div_or_mod) -> bool:   # one plain dtype that the operation keeps
        return (a.__class__ is dtype and b.__class__ is dtype and a.name == b.name
                and (a.name in kept or (a.name in halves and not (check and div_or_mod))))

    def checked(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if isinstance(lhs, tensor) and isinstance(rhs, tensor):
            lt, rt = lhs.type, rhs.type
            if lt.__class__ is block_type and rt.__class__ is block_type:
                if (same(lt.element_ty, rt.element_ty, arithmetic_check, div_or_mod)
                        and lt.shape.values == rt.shape.values):
                    return lhs, rhs
            elif same(lt, rt, arithmetic_check, div_or_mod):
                return lhs, rhs
        return orig(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    checked._mxtrain_same_type = True
    checked._mxtrain_original = orig
    TritonSemantic.binary_op_type_checking_impl = checked


def _known_shapes(core) -> None:
    """``block_type`` and ``tensor`` made from a shape of plain ``int`` sizes that an earlier block type checked:
    the same fields as Triton's constructors (``_lazy_type_names``' for the block type) give, from a memo of the
    shape's element count and its sizes as ``constexpr`` objects. Needs ``_lazy_type_names``' ``tl.tuple`` (made
    without its type, worked out when read); a shape of anything else (``constexpr`` sizes, a wrong shape) runs
    the constructors as they are, which check it as before."""
    made = getattr(core, "_mxtrain_original_inits", {})
    if "tuple" not in made or "block_type" not in made or "tensor" in made:
        return
    bt, ttuple, tensor, constexpr = core.block_type, core.tuple, core.tensor, core.constexpr
    t_src = inspect.getsource(tensor.__init__)
    if ("self.numel = constexpr(math.prod(self.shape))" not in t_src or "self.dtype = type.scalar" not in t_src
            or "self.shape = tuple([constexpr(s) for s in self.shape])" not in t_src):
        return
    bt_init, t_init = bt.__init__, tensor.__init__
    shapes: dict = {}   # sizes (a tuple of ints) -> (element count, constexpr of it, constexpr of each size)

    def _tuple(values):   # a tl.tuple of these values (the lazy __init__'s fields: its type worked out when read)
        t = object.__new__(ttuple)
        t.values = list(values)
        return t

    def bt_init_known(self, element_ty, shape):
        cls = shape.__class__
        if cls is ttuple or cls is list:
            key = builtins.tuple(shape.values if cls is ttuple else shape)
            hit = shapes.get(key) if all(d.__class__ is int for d in key) else None
            if hit is not None:
                self.element_ty = element_ty
                self.shape, self.numel = _tuple(key), hit[0]
                return
        bt_init(self, element_ty, shape)   # (checks the shape; raises for a wrong one)
        key = builtins.tuple(self.shape.values)
        if key not in shapes and all(d.__class__ is int for d in key):
            shapes[key] = (self.numel, constexpr(self.numel), [constexpr(d) for d in key])

    def t_init_known(self, handle, type):
        if type.__class__ is bt:
            hit = shapes.get(builtins.tuple(type.shape.values))
            if hit is not None:
                self.handle = handle
                self.numel, self.shape = hit[1], _tuple(hit[2])
                self.type = type
                self.dtype = type.element_ty
                return
        t_init(self, handle, type)

    made["tensor"] = t_init
    made["block_type_lazy"] = bt_init
    bt.__init__, tensor.__init__ = bt_init_known, t_init_known
