"""Weights that travel quantized: FSDP2 all-gathers an MX layer's weight as its quantized operands.

Under FSDP2 (``mxtrain.train.parallel.apply_fsdp2``) every rank holds a row shard of each weight (dim 0,
out-features, ``N / world`` rows) and all-gathers the full weight before each block's forward and backward;
the MX linear then quantizes the gathered weight twice: the Fprop operand ``W`` (blocks along in-features)
and the Dgrad operand ``W^T`` (blocks along out-features). With ``apply_fsdp2(..., gather="quantized")``
each rank instead quantizes its own shard into both operands (element codes and scales as ``uint8``
tensors: FP4 two codes a byte, FP6 one a byte, FP8 one a byte, E8M0 or E4M3 scales one a byte) and FSDP2
all-gathers those; the MX linear then reads the gathered operands instead of quantizing the weight again: the
reference path through ``Ctx.operand`` (which asks the weight for them: ``GatheredWeight.mx_gathered``), the
fast path (CUDA; on CPU under Triton's interpreter in tests) through ``fast.gathered_operand``, which hands the
gathered MXFP4 / MXINT4 codes and E8M0 scales to its GEMMs as the fused quantizer's output and, on the
FP8-carrier backend (sm_90), rebuilds the carrier and its group scales from them (``kernels.expand``, the
fused quantizer's bytes). Both layouts put the block axis last, padded with zeros to whole rotation blocks
and then to whole 32-element blocks, two codes a byte with the lower index in the low nibble, one scale byte
per block; the Dgrad operand (blocks along out-features) is made contiguous first (a transposed copy of its
codes and scales, 0.53 bytes an element). (The fast path's use is checked on CPU under the interpreter and on
one GPU; FSDP2 over several GPUs has not run it.)

Exactness: the gathered operands equal the quantization of the gathered weight bit for bit, because

* an MX or NVFP4 block, a 16x16 NVFP4 tile and a Hadamard rotation block never straddle two shards: the
  Fprop operand's blocks run along in-features, inside one row, and the Dgrad operand's run along
  out-features, which needs shards of a multiple of the block (and rotation) size;
* NVFP4's tensor scale and per-tensor FP8's scale come from the amax of the whole tensor: each rank computes
  its shard's amax (finite values; and whether any value is not finite), they are all-reduced (MAX), and
  the shard is quantized by ``mxtrain.numerics.quant.quantize`` itself next to a "phantom" slice holding the global
  amax (a slice of its own along a new leading dimension, so no block of the shard changes), so the
  quantizer computes the whole tensor's scale from the formula it always uses;
* the shard is cast to FSDP2's ``param_dtype`` first, as FSDP2 casts it before a high-precision gather;
* the operand a GEMM reads (``Gathered.get``) is stored as ``quantize`` stores the whole weight's, in the same
  memory layout (``_stored_as_quantize``: equal values in another layout may be summed in another order).

Where it cannot be exact the layer gathers in high precision, said once (a warning on rank 0 naming each
layer and the reason; ``GatherReport``): stochastic rounding of a weight operand (its bits are numbered by
the element's index in the full tensor and by the call), rotation signs re-drawn every step (``per_step``)
on Fprop or Dgrad, an unquantized weight operand (the GEMM needs the high-precision weight), shards that
split a Dgrad block, rotation block or NVFP4 tile, out-features not divisible by the world size (torch's
all-gather extension needs inputs of the padded shard's shape on uneven shards), a compiled block
(``torch.compile`` does not take gathered operands), a weight tied to another module, and on CUDA a
per-tensor FP8 weight, which the FP8 tensor-core GEMM may quantize itself. (Every layer the fast path runs
that the rules above accept takes the quantized gather: its weight operands are MXFP4 or MXINT4 with
round-to-nearest and no per-step signs, e.g. ``mxfp4-all``, ``mxfp4-all-dh16``, ``mxfp4-all-sr``,
``mxfp4-fprop-dgrad``; ``mxfp4-fprop``, ``tseng``, ``mxfp4-all-rht16`` and ``ufp4`` fall back by the rules
above, on any device.) A layer whose recipe changes after ``apply_fsdp2`` to one these rules refuse raises at
its next gather (never a silent high-precision or wrong value).

Each forward's gather quantizes the shard's current values (nothing older is ever reused across a step:
whatever changed the weight, the next forward sees it); the backward's re-gather of the same micro-step
(``reshard_after_forward``) reuses the forward's operands while no in-place update went through the weight
or any view of it (the wrapper's dispatch counts them), and its storage, dtype, plan and (NVFP4, per-tensor
FP8) all-reduced amax are unchanged: one quantization per shard per forward, where the high-precision gather
quantizes the whole weight's two operands in every forward and backward. (Torch's version counters do not
see in-place updates made inside a tensor subclass's dispatch, which is why the wrapper counts them itself.)

State dicts hold the plain high-precision tensors (a state-dict post hook), so ``torch.save``, DCP
checkpoints and their loads work as with ``gather="high"``, in either direction.

The bytes one all-gather assembles, for either gather: ``all_gather_bytes``.

Layer 3 (the MX linear): imports the numerics, ``context`` and ``nn``; nothing below imports it (``Ctx.operand``
and ``fast`` find the gathered operands on the tensor).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map_only

from .context import Ctx, compute_dtype
from ..numerics.formats import get_format
from ..numerics.hadamard import hadamard
from ..numerics.operand import pad_axis
from ..numerics.quant import MXTensor, pack_fp4, quantize
from ..numerics.recipe import Recipe
from ..numerics.recipes import get as get_recipe
from .module import MXLayer, MXExperts

__all__ = ["GATHER_MODES", "GatherReport", "QGatherWeight", "GatheredWeight", "Gathered", "Plan", "plan_layer",
           "prepare", "all_gather_bytes", "amaxes", "quantize_operand", "shard_operands", "assemble"]

GATHER_MODES = ("high", "quantized")
WEIGHT_OPERANDS = (("fprop_w", -1, "fprop"), ("dgrad_w", 0, "dgrad"))   # (operand, block axis of W, GEMM)

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True, eq=False)
class _Spec:
    """One weight operand: its name, W's axis its blocks run along, its GEMM, the rotation size (0: none) and
    the rotation's sign vector (None: no signs), the ``Operand``, and whether the tensor's amax enters it
    (NVFP4's tensor scale, per-tensor FP8's scale)."""
    name: str
    axis: int
    gemm: str
    rot: int
    signs: torch.Tensor | None
    op: object
    amax: bool

    @property
    def fmt(self):
        return get_format(self.op.fmt)


@dataclass(frozen=True, eq=False)
class Plan:
    """What one layer gathers: ``specs`` (both weight operands), ``gathered`` (the ones all-gathered: both, or
    the Fprop one alone where the Dgrad operand has the same values, ``shared``: per-tensor FP8, NVFP4 16x16
    tiles, unrotated), the weight's ``shape``, the ``world`` size it was planned for, the ``recipe`` and the
    layer id (rotation signs)."""
    recipe: Recipe
    layer_id: int
    shape: tuple
    world: int
    specs: tuple
    shared: bool

    @property
    def rows(self) -> int:
        return self.shape[0] // self.world

    @property
    def gathered(self) -> tuple:
        return self.specs[:1] if self.shared else self.specs

    def spec(self, name: str) -> _Spec | None:
        return next((s for s in self.specs if s.name == name), None)


def _block_rows(op) -> int:
    """Rows of W one block of an operand spans when its blocks run along out-features."""
    f = get_format(op.fmt)
    if f.kind == "mx":
        return f.block_size
    if f.kind == "nvfp4":
        return 16
    return 1


def plan_layer(recipe: Recipe | str, shape, world: int, layer_id: int = 0, device=None) -> Plan | str:
    """The ``Plan`` for a weight of ``shape`` (out, in) sharded over ``world`` ranks under ``recipe``, or the
    reason it cannot be gathered quantized exactly (a sentence)."""
    r = get_recipe(recipe)
    if len(shape) != 2:
        return f"a {len(shape)}-d weight (the quantized gather takes 2-d linear weights)"
    N = int(shape[0])
    for name, _, gemm in WEIGHT_OPERANDS:
        op = r.operand(name)
        if not op.quantized:
            return f"{name} is not quantized ({op.fmt}): its GEMM reads the high-precision weight"
        if op.rounding == "stochastic":
            return (f"{name} rounds stochastically (its random bits are numbered by the element's index in the "
                    f"whole weight and by the call)")
        rot = r.rotation(gemm)
        if rot.enabled and rot.signs == "per_step":
            return f"the {gemm} rotation's signs are re-drawn every step (per_step)"
    if N % world:
        return (f"out-features {N} are not divisible by {world} ranks (uneven FSDP2 shards; torch's all-gather "
                f"extension takes only inputs of the padded shard's shape there)")
    rows = N // world
    d_op, d_rot = r.operand("dgrad_w"), r.rotation("dgrad")
    need = math.lcm(_block_rows(d_op), d_rot.size if d_rot.enabled else 1)
    if rows % need:
        return (f"shards of {rows} rows split the Dgrad operand's {need}-row blocks (dgrad_w, blocks along "
                f"out-features: out-features / ranks must be a multiple of {need})")
    if r.operand("fprop_w").block_2d and rows % 16:
        return f"shards of {rows} rows split fprop_w's 16x16 tiles"
    ctx = Ctx(r, layer_id)
    specs = []
    for name, axis, gemm in WEIGHT_OPERANDS:
        op, rot = r.operand(name), r.rotation(gemm)
        specs.append(_Spec(name, axis, gemm, rot.size if rot.enabled else 0,
                           ctx.signs(gemm, device if device is not None else "cpu"), op,
                           get_format(op.fmt).kind in ("nvfp4", "tensor")))
    f, d = specs
    shared = (f.op == d.op and not f.rot and not d.rot
              and (f.fmt.kind == "tensor" or (f.fmt.kind == "nvfp4" and f.op.block_2d)))
    return Plan(r, int(layer_id), (N, int(shape[1])), int(world), tuple(specs), shared)


def _device_reason(recipe: Recipe, device: torch.device) -> str | None:
    """On CUDA: a form that quantizes the weight itself and does not take gathered operands yet (the FP8
    tensor-core GEMM). (The fast path takes them: ``fast.gathered_operand``.)"""
    if device.type != "cuda":
        return None
    if any(get_format(recipe.operand(n).fmt).kind == "tensor" for n, _, _ in WEIGHT_OPERANDS):
        return "on CUDA a per-tensor FP8 weight may go to the FP8 tensor-core GEMM, which quantizes it itself"
    return None


# ---------------------------------------------------------------------------------- quantize one shard

def _rotated(w: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """``w`` as ``operand.fake_quantize_operand`` hands it to the quantizer: in the compute dtype, the block
    axis zero-padded to whole rotation blocks and rotated."""
    r = w.to(compute_dtype(w))
    if spec.rot:
        r = hadamard(pad_axis(r, spec.axis, spec.rot), spec.rot, axis=spec.axis, signs=spec.signs)
    return r


def amaxes(w: torch.Tensor, plan: Plan, group=None) -> dict:
    """For each gathered operand whose scale needs the whole tensor's amax: operand name -> float32
    ``[finite amax, 1 if any value is not finite else 0]`` of the whole weight (this shard's, all-reduced with
    MAX over ``group``; one all-reduce for the layer)."""
    names, rows = [], []
    for s in plan.gathered:
        if not s.amax:
            continue
        r = _rotated(w, s).to(torch.float32)   # (quantize's amax is of float32 values)
        fin = torch.isfinite(r)
        if r.numel():
            rows.append(torch.stack([torch.where(fin, r.abs(), torch.zeros_like(r)).amax(),
                                     (~fin).any().to(torch.float32)]))
        else:
            rows.append(torch.zeros(2, dtype=torch.float32, device=w.device))
        names.append(s.name)
    if not names:
        return {}
    t = torch.stack(rows)
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, t.unbind(0)))


def quantize_operand(w: torch.Tensor, spec: _Spec, amax: torch.Tensor | None = None) -> MXTensor:
    """``spec``'s operand of ``w`` (a shard, or the whole weight) as ``Ctx.operand`` quantizes it; where the
    tensor's amax enters, the whole tensor's (``amax``, from ``amaxes``) stands in a phantom slice next to
    ``w``'s (a new leading dimension: no block of ``w`` changes), so ``quantize`` computes the whole tensor's
    scale by its own formula."""
    r = _rotated(w, spec)
    op = spec.op
    if not spec.amax or amax is None:
        return quantize(r, op.fmt, axis=spec.axis, block_size=op.block_size, rounding=op.rounding,
                        scale_rule=op.scale_rule, prescale=op.prescale)
    top = amax[0]
    if spec.fmt.kind == "tensor":   # (per-tensor FP8: NaN scales where any element of the tensor is not finite)
        top = torch.where(amax[1] > 0, torch.full_like(top, float("nan")), top)
    p = r.new_zeros(r.shape)   # (contiguous: a rotation along out-features leaves ``r`` a transposed view)
    p.view(-1)[:1] = top.to(p.dtype)
    mx = quantize(torch.stack([r, p]), op.fmt, axis=spec.axis % 2 + 1, block_size=op.block_size,
                  rounding=op.rounding, scale_rule=op.scale_rule, prescale=op.prescale)
    scales = mx.scales[0] if mx.scales.ndim else mx.scales
    return MXTensor(mx.fmt, mx.data[0], scales, tuple(r.shape), spec.axis % 2, mx.block_size,
                    global_scale=mx.global_scale, prescale=mx.prescale, dtype=mx.dtype)


def _as_rows(t: torch.Tensor, axis: int) -> torch.Tensor:
    """An ``MXTensor`` field (axis-last layout) with W's out-features first, as contiguous bytes: what is
    gathered (ranks' pieces follow one another along dim 0)."""
    t = t.view(torch.uint8)   # (torch cannot copy float4_e2m1fn_x2)
    if axis == 0:
        t = t.movedim(-1, 0)
    return t.contiguous()


def shard_operands(w: torch.Tensor, plan: Plan, amax: dict | None = None) -> tuple[list[torch.Tensor], list]:
    """The all-gather inputs of one shard ``w`` (rows of W, in the gathered dtype): ``uint8`` tensors with
    out-features first; and what ``assemble`` needs to read them. ``amax``: ``amaxes``' answer (None: ``w``'s
    own, as for the whole weight on one process)."""
    if amax is None:
        amax = amaxes(w, plan)
    inputs, meta = [], []
    for s in plan.gathered:
        mx = quantize_operand(w, s, amax.get(s.name))
        inputs.append(_as_rows(mx.data, s.axis))
        has_scales = mx.scales.ndim > 0   # (per-tensor FP8: one 0-d scale, the same on every rank)
        if has_scales:
            inputs.append(_as_rows(mx.scales, s.axis))
        meta.append((mx.fmt, mx.data.dtype, mx.scales.dtype, has_scales, tuple(mx.shape), mx.block_size,
                     mx.global_scale, None if has_scales else mx.scales, mx.prescale, mx.dtype))
    return inputs, meta


def assemble(outputs, meta, plan: Plan) -> "Gathered":
    """The whole weight's operands from the gathered ``outputs`` (each rank's inputs one after another along
    dim 0) and one rank's ``meta``: views of ``outputs``, nothing copied."""
    it = iter(outputs)
    ops = {}
    for s, (fmt, ddt, sdt, has_scales, shape, bs, g, scalar, pre, dt) in zip(plan.gathered, meta):
        data = next(it)
        scales = next(it) if has_scales else scalar
        if s.axis == 0:
            data = data.movedim(0, -1)
            if has_scales:
                scales = scales.movedim(0, -1)
        if ddt != torch.uint8:
            data = data.view(ddt)
        if has_scales and sdt != torch.uint8:
            scales = scales.view(sdt)
        full = (shape[0] * plan.world, shape[1])   # (the shard's rows, times the ranks: W's layout)
        ops[s.name] = MXTensor(fmt, data, scales, full, s.axis % 2, bs, global_scale=g, prescale=pre, dtype=dt)
    if plan.shared:
        ops["dgrad_w"] = ops["fprop_w"]
    return Gathered(plan, ops)


# ------------------------------------------------------------------------------ the gathered operands

def _stored_as_quantize(mx: MXTensor, spec: _Spec) -> MXTensor:
    """The gathered operand ``mx`` of the whole weight, stored as ``quantize`` stores the whole weight's operand
    ``spec``: the same codes and scales in the same memory layout (``mx`` itself where it already is).

    Equal values are not enough: ``MXTensor.dequantize`` gives its values the memory layout of the codes, and the
    GEMM reading them (a CPU BLAS in particular) may sum in another order for another layout of the same values.
    Gathered operands with another layout gave ``nvfp4`` a dX differing in the last bits from the high-precision
    gather's on 4 gloo ranks (a few tokens a micro-step; the Dgrad operand, read from the Fprop one), and MXFP8 and
    MXFP6 Dgrad operands had another layout too. ``quantize`` stores MX and NVFP4 codes and scales contiguous in its
    axis-last layout, and per-tensor FP8 codes in the layout of the tensor it is given moved axis-last (elementwise
    operations keep it): W's own, or after a rotation along the axis (``hadamard`` computes with the axis last)
    contiguous axis-last. Gathered operands along out-features are views of the all-gather's outputs, out-features
    first; a Dgrad operand shared with the Fprop one (``Plan.shared``) is stored along in-features: its 16x16 NVFP4
    tiles are transposed here (the same tiles and scales), its per-tensor FP8 codes read transposed."""
    axis = spec.axis % 2
    data, scales = mx.data, mx.scales
    if mx.axis != axis:   # (a shared operand: the Fprop one, blocks along in-features)
        if mx.fmt.kind == "tensor":
            data = data.t()
        elif mx.fmt.kind == "nvfp4" and isinstance(mx.block_size, tuple):
            data = pack_fp4(mx.codes().t().contiguous())
            data = data.view(mx.data.dtype) if mx.data.dtype != torch.uint8 else data
            scales = scales.t().contiguous()
        else:
            raise RuntimeError(f"mxtrain: a gathered {mx.fmt.name} operand along axis {mx.axis} read along axis "
                               f"{axis} (an mxtrain bug: please report it)")
    if mx.fmt.kind == "tensor":   # (W's layout moved axis-last; after a rotation, contiguous axis-last)
        laid = data.contiguous() if spec.rot else data.movedim(-1, axis).contiguous().movedim(axis, -1)
        data = data if laid.stride() == data.stride() and laid.data_ptr() == data.data_ptr() else laid
    else:   # (through uint8: torch cannot copy float4_e2m1fn_x2)
        data = data if data.is_contiguous() else data.view(torch.uint8).contiguous().view(data.dtype)
        scales = scales.contiguous()
    if data is mx.data and scales is mx.scales and axis == mx.axis:
        return mx
    return replace(mx, data=data, scales=scales, axis=axis)


class Gathered:
    """A weight's gathered operands (``ops``: operand name -> ``MXTensor`` of the whole weight) and the plan
    they were made with; ``Ctx.operand`` / ``Ctx.operand_factored`` call ``operand`` / ``operand_factored``
    for a weight that carries one (``GatheredWeight.mx_gathered``)."""

    __slots__ = ("plan", "ops")

    def __init__(self, plan: Plan, ops: dict):
        self.plan, self.ops = plan, ops

    def get(self, ctx: Ctx, axis: int, name: str, gemm: str, signs) -> MXTensor:
        """The gathered operand ``name`` (an ``MXTensor`` of the whole weight) for a call of ``ctx``'s recipe along
        ``axis`` of W in GEMM ``gemm`` with rotation ``signs``; raises where it does not fit that call (the
        reference reads it through ``operand``, the fast path through ``fast.gathered_operand``)."""
        plan = self.plan
        spec = plan.spec(name)
        why = None
        if spec is None or name not in self.ops:
            why = f"it holds no {name} operand"
        elif ctx.recipe is not plan.recipe and ctx.recipe._json != plan.recipe._json:
            why = f"it was quantized for recipe {plan.recipe.name}, the call's recipe is {ctx.recipe.name}"
        elif axis % 2 != spec.axis % 2 or gemm != spec.gemm:
            why = f"{name} asked for along axis {axis} of the {gemm} GEMM"
        elif (signs is None) != (spec.signs is None) or (signs is not None and not torch.equal(
                signs.to(spec.signs.device, spec.signs.dtype), spec.signs)):
            why = f"the {gemm} rotation signs of this call differ from layer {plan.layer_id}'s"
        if why is not None:
            raise RuntimeError(f"mxtrain: a weight all-gathered as quantized operands (FSDP2 gather='quantized') "
                               f"does not fit this call: {why}")
        mx = self.ops[name]
        laid = _stored_as_quantize(mx, spec)
        if laid is not mx:   # (once per gather: the Dgrad operand, read once a backward)
            self.ops[name] = laid
        return laid

    def operand(self, ctx: Ctx, t: torch.Tensor, axis: int, name: str, gemm: str, signs):
        """``Ctx.operand``'s (values, prescale): the gathered operand dequantized as the reference does."""
        mx = self.get(ctx, axis, name, gemm, signs)
        return mx.dequantize(torch.float32).to(compute_dtype(t)), mx.prescale

    def operand_factored(self, ctx: Ctx, t: torch.Tensor, axis: int, name: str, gemm: str, signs):
        """``Ctx.operand_factored``'s (values, prescale, tensor scale) of an NVFP4 operand."""
        mx = self.get(ctx, axis, name, gemm, signs)
        v, g = mx.dequantize_factored()
        return v.to(compute_dtype(t)), mx.prescale, g


_NOT_HERE = ("mxtrain: this weight was all-gathered by FSDP2 as its quantized operands (gather='quantized') and "
             "holds no high-precision values; {op} cannot run on it. Only the MX linear (reference and fast "
             "paths) reads it (mxtrain.linear.qgather); use apply_fsdp2(..., gather='high') (parallel.gather=high) for "
             "code that reads the weight itself")


class GatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 sets on an MX layer under gather="quantized": a tensor of the weight's shape,
    dtype and device with no values of its own, holding the gathered operands (``mx_gathered``). Any operation
    that would read values raises (a silent wrong result is impossible); detaching, aliasing and ``zeros_like``
    (what FSDP2 and autograd do to a parameter) work."""

    @staticmethod
    def __new__(cls, shape, dtype, device, box: list, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, shape, dtype, device, box: list, requires_grad: bool = False):
        self._box = box   # [Gathered]: shared by every alias of this weight, refilled at each gather

    @property
    def mx_gathered(self) -> Gathered:
        return self._box[0]

    def __repr__(self):
        return f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, operands={sorted(self._box[0].ops)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default) or (
                func in (aten.as_strided.default, aten.view.default, aten._unsafe_view.default)
                and tuple(args[1]) == tuple(args[0].shape)):
            a = args[0]
            return GatheredWeight(a.shape, a.dtype, a.device, a._box)
        if func in (aten.zeros_like.default, aten.empty_like.default):
            a = args[0]
            kw = {k: v for k, v in kwargs.items() if k in ("dtype", "device")}
            return (torch.zeros if func is aten.zeros_like.default else torch.empty)(
                a.shape, dtype=kw.get("dtype") or a.dtype, device=kw.get("device") or a.device)
        raise RuntimeError(_NOT_HERE.format(op=func))


# -------------------------------------------------------------------------------- the sharded weight

_VIEWS = {aten.slice.Tensor, aten.view.default, aten.as_strided.default, aten.split.Tensor, aten.detach.default,
          aten.alias.default, aten.narrow.default, aten._unsafe_view.default}
_COPIES = {aten.new_zeros.default, aten._to_copy.default, aten._pin_memory.default, aten.clone.default}


def _in_backward() -> bool:
    """Is this inside a backward pass (autograd's engine running a graph task)?"""
    return torch._C._current_graph_task_id() != -1


class QGatherWeight(torch.Tensor):
    """An MX layer's weight (or FSDP2's shard of it) that FSDP2 all-gathers as quantized operands: a wrapper
    around the plain high-precision tensor (``_inner``; the optimizer updates it in place, state dicts hold
    it), with FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``). Operations
    run on the plain tensor; views and copies (what FSDP2 does to shard and pad a parameter) keep the wrapper,
    and every in-place operation through any view of it counts in ``_gen``, shared by the views."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, plan: Plan, gen: list | None = None):
        return torch.Tensor._make_wrapper_subclass(cls, inner.size(), strides=inner.stride(),
                                                   storage_offset=inner.storage_offset(), dtype=inner.dtype,
                                                   layout=inner.layout, device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, plan: Plan, gen: list | None = None):
        self._inner = inner
        self._plan = plan
        self._gen = [0] if gen is None else gen   # in-place updates seen (shared with views)
        self._cache: dict = {}

    def __repr__(self):
        return f"QGatherWeight({self._inner!r}, layer {self._plan.layer_id}, recipe {self._plan.recipe.name})"

    def __tensor_flatten__(self):
        return ["_inner"], (self._plan,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        return QGatherWeight(inner_tensors["_inner"], ctx[0])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        for i, a in enumerate(schema.arguments):   # (in-place ops, foreach lists included: count the update)
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(t, QGatherWeight):
                        t._gen[0] += 1
        out = func(*tree_map_only(QGatherWeight, lambda t: t._inner, args),
                   **tree_map_only(QGatherWeight, lambda t: t._inner, kwargs))
        a0 = schema.arguments[0] if schema.arguments else None
        if a0 is not None and a0.alias_info is not None and a0.alias_info.is_write and args \
                and isinstance(args[0], QGatherWeight):
            return args[0]   # an in-place op (copy_, the optimizer's updates) returns its wrapped self
        if func in _VIEWS or func in _COPIES:
            src = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, QGatherWeight))
            gen = src._gen if func in _VIEWS else None
            return tree_map_only(torch.Tensor, lambda t: QGatherWeight(t, src._plan, gen), out)
        return out

    # ---- FSDP2's all-gather extension (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        plan = _current_plan(self, module, tuple(outer_size), mesh.size())
        w = self._inner
        dt = mp_policy.param_dtype if mp_policy is not None else None
        if dt is not None and dt != w.dtype:
            w = w.to(dt)   # what FSDP2 would gather (its mixed-precision cast, round to nearest even)
        # every rank all-reduces its amax at every gather (NVFP4, per-tensor FP8), so the ranks' collectives
        # match whatever each one reuses
        am = amaxes(w, plan, mesh.get_group() if mesh.size() > 1 else None)
        # A forward's gather quantizes the shard's current values; the backward's re-gather of the same step
        # (reshard_after_forward) reuses them while nothing changed: no in-place update through the weight or
        # any view of it, the same storage, dtype, plan and amax.
        key = (self._gen[0], self._inner.data_ptr(), w.dtype, id(plan), tuple(tuple(v.tolist()) for v in am.values()))
        c = self._cache
        if not (_in_backward() and c.get("key") == key):
            inputs, meta = shard_operands(w, plan, am)
            c.clear()
            c.update(key=key, inputs=inputs, meta=meta, plan=plan)
        return c["inputs"], (c["plan"], c["meta"])

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        plan, meta = metadata
        g = assemble(all_gather_outputs, meta, plan)
        if out is not None:   # (a later gather: the unsharded parameter FSDP2 keeps, refilled)
            out._box[0] = g
            return None
        return GatheredWeight(plan.shape, param_dtype, all_gather_outputs[0].device, [g]), ()


def _current_plan(w: QGatherWeight, module, shape, world: int) -> Plan:
    """The layer's plan for its recipe now (``train.switch_recipe``, ``convert`` again: planned anew); a
    recipe or world the quantized gather cannot serve exactly raises."""
    plan = w._plan
    r = getattr(module, "recipe", plan.recipe)
    lid = getattr(module, "layer_id", plan.layer_id)
    if r is not plan.recipe or lid != plan.layer_id or world != plan.world or shape != plan.shape:
        new = plan_layer(r, shape, world, lid, w.device)
        if isinstance(new, str):
            raise RuntimeError(f"mxtrain: FSDP2 gather='quantized' cannot gather layer {lid} (recipe {r.name}, "
                               f"{world} ranks) exactly: {new}; use gather='high' (parallel.gather=high)")
        plan = new
        w._plan = plan
    return plan


# ---------------------------------------------------------------------------------------- applying it

@dataclass
class GatherReport:
    """What ``prepare`` did: ``quantized``: names of layers whose weights gather as quantized operands;
    ``high``: name -> why that MX layer gathers in high precision."""
    quantized: list = field(default_factory=list)
    high: dict = field(default_factory=dict)

    def message(self) -> str:
        n = len(self.quantized) + len(self.high)
        head = (f"FSDP2 gather='quantized': {len(self.quantized)} of {n} MX layers gather their weights as "
                f"quantized operands")
        if not self.high:
            return head
        by_reason: dict = {}
        for name, why in self.high.items():
            by_reason.setdefault(why, []).append(name)
        parts = [f"{', '.join(names[:6])}{f' and {len(names) - 6} more' if len(names) > 6 else ''}: {why}"
                 for why, names in by_reason.items()]
        return head + "; in high precision (exactness): " + "; ".join(parts)


def _compiled(m: nn.Module) -> bool:
    return getattr(m, "_compiled_call_impl", None) is not None


def prepare(model: nn.Module, blocks, world: int, device: torch.device, warn: bool = True,
            param_dtype: torch.dtype | None = None) -> GatherReport:
    """Turn the weight of every MX layer in ``blocks`` that can be gathered exactly into a ``QGatherWeight``
    (before ``fully_shard``); the others stay as they are, each with its reason in the report (also a layer
    whose operands would not move fewer bytes than gathering it in ``param_dtype``, None: the weight's dtype).
    Says the report once (a warning) when some layer falls back and ``warn``."""
    rep = GatherReport()
    counts: dict = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    names = {id(m): n for n, m in model.named_modules()}
    for block in blocks:
        compiled = _compiled(block) or any(_compiled(m) for m in block.modules())
        for m in block.modules():
            if not isinstance(m, MXLayer):
                continue
            name = names.get(id(m), type(m).__name__)
            if isinstance(m, MXExperts) or m._mx_transposed:
                rep.high[name] = "fused experts or a transposed (Conv1D) weight"
                continue
            w = m.weight
            why = None
            if compiled:
                why = "its block is compiled (torch.compile does not take gathered operands yet)"
            elif type(w) is not nn.Parameter or type(w.data) is not torch.Tensor:
                why = f"its weight is a {type(w.data).__name__}, not a plain tensor"
            elif counts.get(id(w), 0) > 1:
                why = "its weight is shared with another module"
            elif not w.is_floating_point():
                why = f"its weight is {w.dtype}"
            else:
                why = _device_reason(m.recipe, w.device)
            plan = None
            if why is None:
                plan = plan_layer(m.recipe, tuple(w.shape), world, m.layer_id, w.device)
                if isinstance(plan, str):
                    why, plan = plan, None
            if plan is not None:   # (MXFP8 against a bf16 gather: 2 x (1 + 1/32) bytes an element, more than 2)
                hp = (param_dtype or w.dtype).itemsize
                q = _plan_bytes(plan, param_dtype) / w.numel()
                if q >= hp:
                    why, plan = (f"its two quantized operands ({q:.4g} bytes an element) would move no fewer bytes "
                                 f"than the {str(param_dtype or w.dtype).replace('torch.', '')} gather ({hp})"), None
            if why is not None:
                rep.high[name] = why
                continue
            m.weight = nn.Parameter(QGatherWeight(w.data, plan), requires_grad=w.requires_grad)
            m.register_state_dict_post_hook(_plain_state_dict)
            rep.quantized.append(name)
    if warn and rep.high:
        warnings.warn("mxtrain: " + rep.message(), stacklevel=3)
    return rep


def _plain(t):
    """``t`` with a ``QGatherWeight`` (itself, or a ``DTensor``'s local tensor) replaced by its plain tensor."""
    if isinstance(t, QGatherWeight):
        return t._inner
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, QGatherWeight):
        from torch.distributed.tensor import DTensor
        return DTensor(local._inner, t._spec, requires_grad=t.requires_grad)
    return t


def _plain_state_dict(module, state_dict, prefix, local_metadata):
    """State dicts hold the plain high-precision weight (DCP and ``torch.save`` write it as any tensor; a load
    copies into the same storage, which the layer's next gather quantizes anew)."""
    k = prefix + "weight"
    if k in state_dict:
        state_dict[k] = _plain(state_dict[k])


# ---------------------------------------------------------------------------------------- bytes moved

def all_gather_bytes(model: nn.Module, world: int, gather: str = "high", param_dtype: torch.dtype | None = None,
                     blocks=None) -> dict:
    """Bytes of weights one all-gather of every parameter of ``model`` (converted, not yet wrapped; or wrapped,
    its weights' plans as they are) assembles on each rank under ``gather`` ("high" or "quantized") with FSDP2
    over ``world`` ranks: ``{"total": bytes, "mx_weights": bytes of the MX layers' weights, "quantized_layers":
    count, "high_layers": count}``. Each rank receives ``(world - 1) / world`` of it per all-gather; a training
    step gathers each block once in the forward and (``reshard_after_forward``) again in the backward, per
    micro-step. Layers that would fall back are counted at the high-precision size. Computed by quantizing a
    zero weight of each distinct shape (no collective, no change to the model)."""
    if gather not in GATHER_MODES:
        raise ValueError(f"gather must be one of {GATHER_MODES}, got {gather!r}")
    hp = lambda t: t.numel() * (param_dtype.itemsize if param_dtype is not None and t.is_floating_point()
                                else t.element_size())
    mx_ids, total, mx_total, nq, nh = set(), 0, 0, 0, 0
    memo: dict = {}
    block_ids = {id(m) for b in (blocks if blocks is not None else getattr(model, "layers", [])) for m in b.modules()}
    for m in model.modules():
        if not isinstance(m, MXLayer) or id(m) not in block_ids or not hasattr(m, "weight"):
            continue
        w = m.weight
        mx_ids.add(id(w))
        n = None
        if gather == "quantized" and not m._mx_transposed:
            key = (m.recipe._json, tuple(w.shape), world, m.layer_id)
            if key not in memo:
                plan = plan_layer(m.recipe, tuple(w.shape), world, m.layer_id)
                memo[key] = None if isinstance(plan, str) else _plan_bytes(plan, param_dtype)
            n = memo[key]
            if n is not None and n >= hp(w):   # (prepare gathers those in high precision)
                n = None
        if n is None:
            n, nh = hp(w), nh + 1
        else:
            nq += 1
        mx_total += n
    seen = set()
    for p in model.parameters():
        if id(p) in mx_ids or id(p) in seen:
            continue
        seen.add(id(p))
        total += hp(p)
    return {"total": total + mx_total, "mx_weights": mx_total, "quantized_layers": nq, "high_layers": nh}


def _plan_bytes(plan: Plan, param_dtype=None) -> int:
    """Bytes one all-gather of ``plan``'s operands assembles (all ranks' inputs), from the inputs of a zero
    shard a few blocks tall (their size is proportional to the shard's rows)."""
    need = math.lcm(_block_rows(plan.recipe.operand("dgrad_w")), 2, plan.specs[1].rot or 1,
                    16 if plan.recipe.operand("fprop_w").block_2d else 1)
    r0 = need if plan.rows % need == 0 else plan.rows
    z = torch.zeros((r0, plan.shape[1]), dtype=param_dtype or torch.float32)
    inputs, _ = shard_operands(z, plan, {})
    return sum(t.numel() for t in inputs) * (plan.rows // r0) * plan.world
