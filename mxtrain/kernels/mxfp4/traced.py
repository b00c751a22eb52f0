"""The MXFP4 quantize kernels as ``torch.library.triton_op``s, for the compiled MX layer (``mxtrain.linear.compiledmx``).

Under ``torch.compile`` an op made with ``triton_op`` is not an opaque Python call: its body runs once, at
trace time, on fake tensors, and what it records (the output allocations and one ``wrap_triton`` launch of the
same Triton kernel the eager path launches) goes into the graph. Inductor's generated code then launches the
kernel itself, so a compiled MX layer costs the host a few wrapper lines per kernel instead of a Python call
that re-makes every decision (``docs/kernels.md``, "The compiled MX layer").

* ``mxtrain::q_single``: ``_mxfp4_kernel`` over a 2-D tensor along one axis (``ops.quantize_mxfp4_2d``);
* ``mxtrain::q_dual``: ``_mxfp4_dual_kernel``, both operands of an activation from one read
  (``ops.quantize_mxfp4_dual``);
* ``mxtrain::q_expand``: ``expand._expand_kernel``, the FP8 carrier of an operand kept as FP4 codes
  (``expand.carrier_from_packed``).

Each launch is described by the same function the eager path launches from (``launch.single_spec``,
``launch.dual_spec``): the kernel variant, grid, constexprs and integer arguments are written once. Every kernel
argument is passed by name, defaults included (``launch.kernel_kwargs``): torch's analysis of which tensors a
kernel writes fails on a launch that leaves one out, and then treats every input as written (it would copy X
before each quantize). The inexact-block counter is the one tensor an op mutates besides its fresh outputs.

Eagerly (not compiling) each op runs its body directly: the same launch through Triton's generic path (on a CPU
under ``TRITON_INTERPRET=1``, the interpreted kernel: the tests). The first time a variant is traced on a GPU
its eager twin runs the self-check of ``verify`` (the ``qselfcheck`` setting); a variant that fails it stops the
trace with the way out (``mx_compiled=ops``) instead of compiling a kernel that is known wrong.

What inductor changes: it compiles user kernels with Triton's default options, floating-point contraction on and
no register cap. The kernels' source is written so that contraction changes nothing: no product feeds an add
except through an explicit ``tl.fma`` (each such product is exact), and the rounding constants are built from
bits, not multiplied. ``tools/compile_check.py --fusion`` compiles every variant these ops launch both ways and
finds the same code (tests/linear/test_compiledmx.py runs it in CI), so the bytes are the eager kernels'. The register
caps (``launch.CAPPED_KERNELS``) are lost: a speed matter only. Importing this module installs
``kernels.access_cache``: torch's analysis of which tensors a launch writes runs once per kernel variant instead
of several times per launch (most of a first compile's time without it). Stochastic rounding, random signs and prescales: the keys and
sign vectors are device tensors (``call_seeds``' outputs, read by the kernels at run time), the prescale a
constant of the graph.
"""

from __future__ import annotations

import itertools

import torch

from ... import settings as _settings
from .. import HAS_TRITON
from . import kernels as _kernels
from .carrier import TILE_K
from .launch import KERNEL_GRIDS, dual_args, dual_spec, kernel_kwargs, single_args, single_spec
from .verify import selfcheck_applies, config_ok, dual_ok
from ...errors import UserError
from ..expand import expand_spec

__all__ = ["q_single", "q_dual", "q_expand", "AVAILABLE"]

try:
    from torch.library import triton_op, wrap_triton
    AVAILABLE = HAS_TRITON
except ImportError:  # pragma: no cover - torch without triton_op
    AVAILABLE = False


def _tracing(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t) or torch.compiler.is_compiling()


# Stand-ins for a size not known at trace time (dynamic shapes): the checks depend on a size only through its
# divisibility by 16 (what Triton specializes a kernel on), so one of each kind
_SYMBOLIC_SIZES = (1024, 1027)


def _hint(v) -> int | None:
    """The example value of a symbolic integer (None where it has none), else ``v``."""
    return getattr(v.node, "hint", None) if isinstance(v, torch.SymInt) else v


def _stand_ins(args: tuple) -> list[tuple]:
    """``args`` with every symbolic integer, and every tensor with a symbolic size or stride, replaced by concrete
    ones, once for each divisibility by 16 of each symbolic value (a kernel compiled for dynamic shapes runs on
    sizes of either kind). A tensor's stand-in: an empty tensor of its dtype and device, laid out in the order of
    its strides' example values (row-major where they have none). No guard on the shapes is added."""
    n = sum(sum(isinstance(d, torch.SymInt) for d in a.shape) if isinstance(a, torch.Tensor)
            else isinstance(a, torch.SymInt) for a in args)
    out = []
    for combo in itertools.product(_SYMBOLIC_SIZES, repeat=n):
        it = iter(combo)
        new = []
        for a in args:
            if isinstance(a, torch.SymInt):
                new.append(next(it))
            elif isinstance(a, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*a.shape, *a.stride())):
                sizes = [next(it) if isinstance(d, torch.SymInt) else int(d) for d in a.shape]
                hints = [_hint(st) for st in a.stride()]
                order = (sorted(range(a.ndim), key=lambda i: -hints[i]) if None not in hints
                         else list(range(a.ndim)))   # outermost first
                t = torch.empty([sizes[i] for i in order], dtype=a.dtype, device=a.device)
                new.append(t.permute([order.index(i) for i in range(a.ndim)]))
            else:
                new.append(a)
        out.append(tuple(new))
    return out


def _selfcheck(fn, *args) -> None:
    """Run a ``verify`` check on real tensors (outside the fake and functional modes of a trace); raise where the
    variant failed it on this GPU. Under dynamic shapes, on ``_stand_ins`` of each kind."""
    from torch.utils._python_dispatch import _disable_current_modes
    dev = args[0].device
    if not selfcheck_applies(dev, _settings.current()):
        return
    with _disable_current_modes():
        ok = all(fn(*a) for a in _stand_ins(args))
    if not ok:
        raise UserError("mxtrain: a fused quantize kernel variant failed its self-check on this GPU, so the "
                        "compiled MX layer cannot use it: set mxtrain.settings.configure(mx_compiled='ops') "
                        "(MXTRAIN_MX_COMPILED=ops) and compile again")


if AVAILABLE:
    from ..access_cache import install as _install_access_cache
    _install_access_cache()   # torch's per-launch analysis of which tensors a kernel writes, once per variant

    def _launch(kfn, grid, args: tuple, consts: dict, num_warps: int) -> None:
        # under TRITON_INTERPRET=1 the kernel is an InterpretedFunction: torch 2.13's wrap_triton returns it as it
        # is, torch 2.12 and older raise ("only works on functions annotated with triton.jit"); do what 2.13 does
        k = kfn if _is_interpreted(kfn) else wrap_triton(kfn)
        k[grid](**kernel_kwargs(kfn, args, consts), num_warps=num_warps)

    def _is_interpreted(kfn) -> bool:
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # pragma: no cover - a Triton without the interpreter
            return False
        return isinstance(kfn, InterpretedFunction)

    def _index_strides(shape, axis: int, rot: int) -> tuple[int, int]:
        """The logical index strides of the (rotation-padded) operand, as the eager fast path passes them
        (``fast._index_strides``): the stochastic-rounding stream's element numbering."""
        if axis == 1:
            return (-(-shape[1] // rot) * rot if rot else shape[1], 1)
        return (1, shape[1])

    @triton_op("mxtrain::q_single", mutates_args={"cnt"})
    def q_single(x: torch.Tensor, cnt: torch.Tensor, axis: int, rot: int, rule: str, carrier: bool, fp4: bool,
                 group_rows: int, k_multiple: int, signs: torch.Tensor | None = None, key: torch.Tensor | None = None,
                 rounding: str = "nearest", prescale: float = 1.0, fmt: str = "mxfp4"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``quantize_mxfp4_2d(x, axis, rot=rot, signs=signs, rounding=rounding, scale_rule=rule, key_tensor=key,
        prescale=prescale, carrier=carrier, fp4=fp4, group_rows=..., k_multiple=..., counter=cnt)`` with the index
        strides the eager fast path passes: (carrier bytes (Rc, Kc) uint8, group-scale storage (``carrier_buffers``'
        layout), packed codes, E8M0 scales); an output not written is (0,). ``signs``: the rotation's sign vector
        (``call_seeds``' row, float32, ``rot`` long) or None; ``key``: the stochastic-rounding key in device memory
        (one int32, ``call_seeds``' keys) or None; ``fmt``: the MX format (``launch.GRID_ID``: ``mxfp4``, ``mxint4``,
        ``mxe1m2``), as ``quantize_mxfp4_2d``'s."""
        st = _settings.current()
        sr = rounding == "stochastic"
        sp = single_spec(x.shape, x.stride(), x.dtype, x.device, axis, rot=rot, has_signs=signs is not None,
                         rounding=rounding, scale_rule=rule, prescale=prescale,
                         index_strides=_index_strides(x.shape, axis, rot), carrier=carrier, fp4=fp4,
                         group_rows=group_rows, row_multiple=16, block_rows=None, num_warps=None,
                         k_multiple=k_multiple, key_ptr=key is not None, force_idx64=False, st=st, fmt=fmt)
        dev = x.device
        e = x.new_empty((0,), dtype=torch.uint8)
        car = gs = None
        if carrier:
            car = torch.empty((sp.Rc, sp.Kc), dtype=torch.uint8, device=dev)
            gs = (torch.empty((sp.Kc // TILE_K, sp.Rc), dtype=torch.float32, device=dev) if group_rows == 1 else
                  torch.empty((sp.Rc // 128, sp.ints[9]), dtype=torch.float32, device=dev))
        pk = torch.empty((sp.R, sp.Kq // 2), dtype=torch.uint8, device=dev) if fp4 else None
        sc = torch.empty((sp.R, sp.Kq // 32), dtype=torch.uint8, device=dev) if fp4 else None
        if sp.R > 0 and sp.K > 0:
            if carrier and _tracing(x):
                _selfcheck(lambda *a: config_ok(*a, st, fmt=fmt), x, axis, rot, signs is not None, rule, sr, prescale,
                           group_rows, sp.consts["BR"], sp.num_warps, k_multiple, fp4, sp.R, sp.K)
            args = single_args(x, cnt, signs, car, gs, pk, sc, key, sp.ints, 0, sp.floats)
            _launch(sp.kfn, sp.grid, args, sp.consts, sp.num_warps)
        return (car if car is not None else e, gs if gs is not None else x.new_empty((0,), dtype=torch.float32),
                pk if pk is not None else x.new_empty((0,), dtype=torch.uint8),
                sc if sc is not None else x.new_empty((0,), dtype=torch.uint8))

    @triton_op("mxtrain::q_dual", mutates_args={"cnt"})
    def q_dual(x: torch.Tensor, cnt: torch.Tensor, rot_a: int, rule_a: str, rot_b: int, rule_b: str,
               group_rows_b: int, fp4_b: bool, k_multiple: int, signs_a: torch.Tensor | None = None,
               key_a: torch.Tensor | None = None, rounding_a: str = "nearest", prescale_a: float = 1.0,
               signs_b: torch.Tensor | None = None, key_b: torch.Tensor | None = None, rounding_b: str = "nearest",
               prescale_b: float = 1.0, fmt_a: str = "mxfp4", fmt_b: str = "mxfp4", group_rows_a: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``quantize_mxfp4_dual(x, a, b, k_multiple=..., counter=cnt, fp4_b=fp4_b)`` of a row-major 2-D ``x`` with
        A = (``rot_a``, ``rule_a``, 1x128 groups) and B = (``rot_b``, ``rule_b``, ``group_rows_b``), each side with
        its signs, key tensor, rounding, prescale and MX format (``q_single``'s) and the eager fast path's index strides,
        where ``launch.dual_applies``: (A's carrier, A's group-scale storage, B's carrier or packed codes, B's
        group-scale storage or E8M0 scales). ``group_rows_a`` 128: a weight's Fprop (A) and Dgrad (B) operands,
        both in 128x128 groups (``group_rows_b`` 128)."""
        st = _settings.current()
        a = dict(rot=rot_a, scale_rule=rule_a, group_rows=group_rows_a, signs=signs_a, key_tensor=key_a,
                 rounding=rounding_a, prescale=prescale_a, index_strides=_index_strides(x.shape, 1, rot_a), fmt=fmt_a)
        b = dict(rot=rot_b, scale_rule=rule_b, group_rows=group_rows_b, signs=signs_b, key_tensor=key_b,
                 rounding=rounding_b, prescale=prescale_b, index_strides=_index_strides(x.shape, 0, rot_b), fmt=fmt_b)
        sp = dual_spec(x.shape, x.stride(0), x.dtype, x.device, a, b, k_multiple=k_multiple, block_rows=None,
                       num_warps=None, sequential=None, fp4_b=fp4_b, force_idx64=False, st=st)
        dev = x.device
        bufs = []
        for (R, Kr, Rc, Kc, Kq, gr, fp), dims in zip(sp.sides, (sp.ints[4:11], sp.ints[11:18])):
            if fp:
                bufs.append((torch.empty((R, Kq // 2), dtype=torch.uint8, device=dev),
                             torch.empty((R, Kq // 32), dtype=torch.uint8, device=dev)))
            elif gr == 1:
                bufs.append((torch.empty((Rc, Kc), dtype=torch.uint8, device=dev),
                             torch.empty((Kc // TILE_K, Rc), dtype=torch.float32, device=dev)))
            else:
                bufs.append((torch.empty((Rc, Kc), dtype=torch.uint8, device=dev),
                             torch.empty((Rc // 128, dims[5]), dtype=torch.float32, device=dev)))
        if _tracing(x):
            _selfcheck(lambda *args: dual_ok(*args, fp4_b=fp4_b), x, a, b, k_multiple)
        args = dual_args(x, cnt, (signs_a, bufs[0][0], bufs[0][1], key_a), (signs_b, bufs[1][0], bufs[1][1], key_b),
                         sp.ints, 0, sp.floats_a, 0, sp.floats_b)
        _launch(_kernels._mxfp4_dual_kernel, sp.grid, args, sp.consts, sp.num_warps)
        return bufs[0][0], bufs[0][1], bufs[1][0], bufs[1][1]

    @triton_op("mxtrain::q_expand", mutates_args={"cnt"})
    def q_expand(packed: torch.Tensor, scales: torch.Tensor, cnt: torch.Tensor, K: int, group_rows: int,
                 k_multiple: int, fmt: str = "mxfp4") -> tuple[torch.Tensor, torch.Tensor]:
        """``expand.carrier_from_packed`` of an operand of ``packed.shape[0]`` rows and reduction length ``K``
        (packed codes + E8M0 scales of MX format ``fmt``, ``group_rows`` of its carrier): (carrier bytes,
        group-scale storage)."""
        from ..expand import _expand_kernel  # optional (defined only where Triton is installed)
        R = packed.shape[0]
        Kq = scales.shape[1] * 32
        Rc, Kc, gs_shape, gsr, gsk, BR, grid, nw = expand_spec(R, K, Kq, group_rows, k_multiple)
        car = torch.empty((Rc, Kc), dtype=torch.uint8, device=packed.device)
        gs = torch.empty(gs_shape, dtype=torch.float32, device=packed.device)
        args = (packed, scales, car, gs, cnt, R, Kq, Rc, Kc, gsr, gsk)
        _launch(_expand_kernel, grid, args, {"BR": BR, "GROUP_ROWS": group_rows, "GRID": KERNEL_GRIDS[fmt]}, nw)
        return car, gs
else:  # pragma: no cover
    q_single = q_dual = q_expand = None
