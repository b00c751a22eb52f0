"""Fast MX linear path: fused Triton quantizers + capability-dispatched MX GEMMs, as a backend of the layer's one
skeleton (``FastBackend``; ``mxtrain.linear.skeleton`` writes the three GEMMs, the bias and the dtypes).

Same function as the reference ``mxtrain.linear.reference.ref_forward`` / ``ref_backward`` (the spec): every
MXFP4 operand is quantized from the high-precision tensor of this call by the fused kernel,
bit-identical to ``Ctx.operand`` (same rotation, signs, stochastic-rounding key and index), and the
GEMMs multiply exactly those MX values (on sm_90 through the FP8 e4m3 carrier and blockwise
``torch._scaled_mm``). Only fp32 accumulation order and the bf16 rounding of GEMM outputs differ.

Used by ``mxtrain.linear`` for CUDA inputs when ``supported(recipe)``: every operand is ``mxfp4`` or the
uniform 4-bit grid ``mxint4`` (32-element blocks; ``kernels.mxfp4.carrier.KERNEL_FORMATS``) or ``bf16``, with any
rotation, rounding, prescale and a scale rule the kernels have (``adaptive`` is the reference's alone). A GEMM
whose two operands are not both of those MX formats runs exactly as the reference does. (``mxint4`` runs through
the same FP8 carrier: every INT4 value times a power of two is exact in e4m3.)

Weights are quantized from their current values at every call: nothing is cached across calls, so
any update (fused, foreach or for-loop optimizers, ``p.data.copy_``, ``load_state_dict``, FSDP2
resharding) is seen by the next call. The random inputs (stochastic-rounding keys, rotation signs)
come from the call's ``Ctx``: on a CUDA device they are tensors written by one kernel from the
layer's state, read by the quantize kernels at run time, so CUDA graphs replay with the current step.
A weight FSDP2 all-gathered as its quantized operands (``mxtrain.linear.qgather``, ``gather="quantized"``) is not
quantized here: ``gathered_operand`` turns its gathered codes and scales into the operand the GEMM takes
(bit-identical to quantizing the whole weight).

Activation reuse (eager only): layers that read the same input (a Llama block's q/k/v and gate/up
projections) quantize its Fprop and Wgrad operands once when both use nearest rounding and no sign
vector (the ``reuse_act`` setting). The entry holds the input, so its address, version and layout name
these very values while it lives; it is dropped at the next such quantize and when a backward pass
starts. Under ``torch.compile`` there is no reuse (a compiled graph may reuse an input's memory without
a version bump).

State: what the fast path remembers between calls (the reused activation operands, the inexact-block
counters per tensor role) is one object, ``state`` (a ``FastState``); the kernels' own memory (probes, self-checks,
launch plans) is ``mxtrain.kernels.CACHES``. Settings (``mxtrain.settings``: ``fast``, ``gemm_backend``,
``wgrad_b_group``, ``dual``, ``reuse_act``...) are read at each call, so ``settings.override`` applies at
once.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import settings as _settings
from . import skeleton
from .context import Ctx, gemm_dtype, autocast_dtype
from .skeleton import FPROP, WGRAD, Backend
from ..kernels import HAS_TRITON as _HAS_TRITON, backend as _backend, kernels_available
from ..kernels import gemm as _gemm
from ..kernels.mxfp4 import TILE_K, QuantOut, dual_applies, quantize_mxfp4_dual, quantize_op
from ..kernels.mxfp4.carrier import KERNEL_FORMATS, out_shapes
from ..kernels.mxfp4.launch import RULE_ID
from ..numerics.recipe import OPERANDS
from ..numerics.quant import warm_elem_tables
from ..errors import UserError
from ..kernels.expand import carrier_from_packed

__all__ = ["supported", "applies", "apply", "FastBackend", "forward", "backward", "inexact_blocks", "inexact_by_tensor",
           "clear_caches", "FastState", "state", "ROLES"]

# The ``fast`` setting off (MXTRAIN_FAST=0, ``settings.override(fast=False)``) forces the reference path
# everywhere. Read now, once: a model compiled before any eager call then never reads the environment
# inside a torch.compile trace (a bad value stops here, with the variable named).
_settings.current()


# Triton is importable (the fused kernels can run on CUDA tensors)
KERNELS = _HAS_TRITON


def supported(recipe) -> bool:
    """Recipes the fast path implements: every operand ``mxfp4``, ``mxint4`` or ``mxe1m2`` (default blocks, a scale
    rule the kernels have: ``launch.RULE_ID``, the ``adaptive`` rule included) or ``bf16``. Depends on the recipe only: whether the fast path runs a call (the ``fast`` setting,
    the device) is ``linear.route``'s decision."""
    return recipe.memo("fast_supported", _supported)


def _supported(recipe) -> bool:
    # (MX operands only with a scale rule the kernels implement, ``RULE_ID``, which has ``adaptive`` since issue
    # #51; NVFP4's ``four_over_six`` and the other formats go to the reference path)
    ops = [recipe.operand(n) for n in OPERANDS]
    return all((op.fmt == "bf16" or (op.fmt in KERNEL_FORMATS and op.scale_rule in RULE_ID)) and not op.block_2d
               for op in ops)


OK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the fused kernels run these tensors (device and dtypes)? Works on fake tensors."""
    return kernels_available(x.device) and x.dtype in OK_DTYPES and weight.dtype in OK_DTYPES


# the tensor each operand is quantized from: the counts of inexact carrier blocks are kept per tensor role
# (one fused pass makes both operands of a tensor, and adds their blocks to one count)
ROLES = ("x", "w", "dy")
# The counters kept per device: one per role, and for ``x`` and ``w`` a second one that only the compiled layer's
# backward adds to (``compiledmx``): a counter both of its graphs wrote would be an input the forward mutates,
# which aot_autograd finishes in the forward graph, pulling the backward's launches that write it (W's Dgrad
# operand, X's carrier rebuilt from its codes) into the forward (tests/linear/test_graph_structure.py). A role's count
# adds its counters.
COUNTERS = ROLES + ("x.bwd", "w.bwd")
ROLE = {"fprop_x": "x", "wgrad_x": "x", "fprop_w": "w", "dgrad_w": "w", "dgrad_dy": "dy", "wgrad_dy": "dy"}


class FastState:
    """What the fast path remembers between calls, for the life of the process (one instance: ``state``).

    * ``activations``: operand name -> (key, input, QuantOut): the activation operand the layer before
      quantized from the same input (activation reuse); an entry holds its input, and is replaced by the
      next quantize of that operand and dropped when a backward pass starts (``clear_activations``).
    * ``counters``: (device, role) -> int32 tensor of one element, the running count of inexact carrier
      blocks the quantize kernels add to, per tensor role (``x`` a layer's input, ``w`` its weight, ``dy``
      its output gradient). Kernels and CUDA graphs hold these tensors: ``clear`` makes new ones. They are
      made outside any graph (``prepare``: when an MX layer is made on or moved to a GPU, or at an eager
      call), because a CUDA graph tree refuses a lasting tensor first made during its warm-up; a compiled
      call that finds none does not count, and its device is then in ``missed``.
    """

    __slots__ = ("activations", "counters", "missed", "by_name")

    def __init__(self):
        self.activations: dict = {}
        self.counters: dict = {}
        self.missed: set = set()
        self.by_name: dict = {}   # str(device) -> the COUNTERS (x, w, dy, x.bwd, w.bwd), for compiledmx

    @staticmethod
    def _dev(device) -> torch.device:
        if isinstance(device, torch.device) and (device.index is not None or device.type != "cuda"):
            return device   # a tensor's device (the per-call case): nothing to build
        d = torch.device(device)
        if d.type == "cuda" and d.index is None and torch.cuda.is_available():
            d = torch.device("cuda", torch.cuda.current_device())
        return d   # ("cuda" without a GPU: no counter is kept under it, so its counts read 0)

    def prepare(self, device) -> None:
        """Make the counters of ``device`` now (outside any CUDA graph), if they do not exist yet."""
        d = self._dev(device)
        if any((d, r) not in self.counters for r in COUNTERS):
            warm_elem_tables(d)    # (the reference quantizer's tables, used by the kernels' self-check too)
        for r in COUNTERS:
            if (d, r) not in self.counters:
                c = self.counters[(d, r)] = torch.zeros((1,), dtype=torch.int32, device=d)
                if d.type == "cuda":   # (a CUDA graph replays writes to it: its address never changes)
                    torch._dynamo.mark_static_address(c)
        self.by_name[str(d)] = tuple(self.counters[(d, r)] for r in COUNTERS)

    def counter(self, device, role: str = "x", create: bool = True) -> torch.Tensor | None:
        """The running count of ``role`` on ``device``; without ``create``, None (and the device noted in
        ``missed``) where it does not exist yet."""
        d = self._dev(device)
        c = self.counters.get((d, role))
        if c is None:
            if not create:
                self.missed.add(d)
                return None
            self.prepare(d)
            c = self.counters[(d, role)]
        return c

    def inexact_blocks(self, device="cuda", role: str | None = None) -> int:
        """Running count of MX blocks that the FP8 carrier could not hold exactly (more than 14 binades below
        their group's largest block; 15 for ``mxint4``) over every fast-path quantize on ``device`` so far (0 means
        every GEMM multiplied the exact MX values), of one tensor ``role`` or all. Reading it synchronizes the
        device."""
        d = self._dev(device)
        return sum(int(c.item()) for (cd, r), c in self.counters.items() if cd == d and role in (None, r.split(".")[0]))

    def counted(self, device="cuda") -> bool:
        """Did every fast-path call on ``device`` count its inexact blocks (no compiled call found its
        counter missing)?"""
        return self._dev(device) not in self.missed

    def clear_activations(self) -> None:
        """Drop the reused activation operands (frees their memory; results are unaffected)."""
        self.activations.clear()

    def clear(self) -> None:
        """Forget everything, as a new process would start (the inexact-block counts start again from 0)."""
        self.activations.clear()
        self.counters.clear()
        self.missed.clear()
        self.by_name.clear()


state = FastState()


def _counter(qctx: Ctx, device, name: str) -> torch.Tensor | None:
    """The counter a quantize of operand ``name`` adds its inexact blocks to (None: not counted, or a count
    of its own: with the ``exact_carrier`` setting each GEMM reads its operands' counts, then adds them to
    the running ones). Inside the custom ops (``qctx.count == "existing"``) only a counter made earlier is
    used."""
    if not qctx.count or _settings.current().exact_carrier:
        return None
    return state.counter(device, ROLE[name], create=qctx.count != "existing")


def _outputs(backend: str, keep_codes: bool) -> tuple[bool, bool]:
    """(carrier, fp4) outputs of a quantize: codes only for an operand kept for later; on the FP8-carrier
    backend with ``exact_carrier``, codes beside the carrier (the exact GEMM's input when one is needed)."""
    if keep_codes:
        return False, True
    carrier, fp4 = _gemm.outputs_for(backend)
    if carrier and _settings.current().exact_carrier:
        return True, True
    return carrier, fp4


def _exact_gemm(qctx: Ctx, qa: QuantOut, nA: str, qb: QuantOut, nB: str, backend: str, out_dtype,
                divisor: float) -> torch.Tensor:
    """The ``exact_carrier`` GEMM: the carrier GEMM where both operands' carriers hold their MX values
    exactly, else the exact ``dequant`` GEMM of their FP4 codes (one device sync to decide). The operands'
    counts are added to the running ones."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise UserError("the exact_carrier setting decides each GEMM on the host, which a CUDA graph cannot "
                        "capture: turn train.cuda_graphs / mode='reduce-overhead' off, or exact_carrier off")
    n = None
    for q, name in ((qa, nA), (qb, nB)):
        if q.inexact is None:
            continue
        n = q.inexact if n is None else n + q.inexact
        c = state.counter(q.inexact.device, ROLE[name], create=qctx.count != "existing") if qctx.count else None
        if c is not None:
            c.add_(q.inexact)
    if n is not None and int(n.item()) > 0:
        if qa.packed is None or qb.packed is None:
            raise RuntimeError(f"exact_carrier: operand {nA if qa.packed is None else nB} has no FP4 codes for the "
                               "exact GEMM (an mxtrain bug: please report it)")
        return _gemm.mx_gemm_nt(qa, qb, "dequant", out_dtype, divisor)
    return _gemm.mx_gemm_nt(qa, qb, backend, out_dtype, divisor)


def inexact_blocks(device="cuda") -> int:
    """Running count of MX blocks that the FP8 carrier could not hold exactly (more than 14 binades
    below their group's largest block; 15 for ``mxint4``) over every fast-path quantize on ``device`` so far (0
    means every GEMM multiplied the exact MX values). Reading it synchronizes the device.
    ``inexact_by_tensor`` splits it by tensor; ``state.counted(device)`` says whether every call counted."""
    return state.inexact_blocks(device)


def inexact_by_tensor(device="cuda") -> dict:
    """``inexact_blocks`` by tensor: ``{"x": inputs, "w": weights, "dy": output gradients}``."""
    return {r: state.inexact_blocks(device, r) for r in ROLES}


_ACT_OPERANDS = ("fprop_x", "wgrad_x")


def clear_caches() -> None:
    """Drop the reused activation operands (frees their memory; results are unaffected)."""
    state.clear_activations()


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


def _index_strides(t: torch.Tensor, axis: int, rsize: int) -> tuple[int, int]:
    """Logical index strides of the (rotation-padded) tensor the reference quantizes."""
    if axis == 1:
        return (_ceil(t.shape[1], rsize) if rsize else t.shape[1], 1)
    return (1, t.shape[1])


def _act_key(name, t, axis, rsize, op, backend, group_rows, capturing, fp4=False):
    """Activation-cache key: the same input (address, version, layout) quantized the same way (into the
    same outputs). A CUDA graph being captured may only reuse operands quantized inside the same capture
    (an eagerly made one would be a constant of the graph, never recomputed on replay), and eager code
    only eager ones."""
    return (name, t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t._version, axis, rsize, op.fmt, op.scale_rule, op.prescale, backend, group_rows, capturing, fp4,
            _settings.current().exact_carrier)


def _act_put(name: str, act, t, q) -> None:
    # holding t keeps its memory from being reused, so the address, version and layout in the key name
    # these very values for as long as the entry lives
    state.activations[name] = (act, t, q)


def _reusable(name: str, op, signs, reuse: bool) -> bool:
    return (reuse and name in _ACT_OPERANDS and op.rounding == "nearest" and signs is None
            and _settings.current().reuse_act)


def _quant(qctx: Ctx, t: torch.Tensor, axis: int, name: str, gemm: str, signs, backend: str,
           group_rows: int, reuse: bool = False, fp4: bool = False) -> tuple[QuantOut, float]:
    """Quantize one MXFP4 operand of a 2-D tensor along ``axis`` exactly as ``Ctx.operand`` does
    (``fp4``: as packed codes and scales whatever the backend, for an operand kept for later)."""
    op = qctx.recipe.operand(name)
    rot = qctx.recipe.rotation(gemm)
    rsize = rot.size if rot.enabled else 0
    key, key_t = qctx.kernel_key(name) if op.rounding == "stochastic" else (0, None)
    carrier, fp4 = _outputs(backend, fp4)
    act = None
    if _reusable(name, op, signs, reuse):
        # the same input quantized the same way by the layer before (q/k/v, gate/up projections)
        capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
        act = _act_key(name, t, axis, rsize, op, backend, group_rows, capturing, not carrier)
        hit = state.activations.get(name)
        if hit is not None and hit[0] == act:
            return hit[2], op.prescale
    q = quantize_op(t, axis, rot=rsize, signs=signs, rounding=op.rounding, scale_rule=op.scale_rule, key=key,
                    prescale=op.prescale, index_strides=_index_strides(t, axis, rsize), carrier=carrier, fp4=fp4,
                    group_rows=group_rows, k_multiple=_gemm.k_multiple_for(backend),
                    counter=_counter(qctx, t.device, name), key_tensor=key_t, fmt=op.fmt)
    if act is not None:
        _act_put(name, act, t, q)
    return q, op.prescale


def gathered_operand(qctx: Ctx, w: torch.Tensor, axis: int, name: str, gemm: str, signs, backend: str,
                     group_rows: int) -> tuple[QuantOut, float]:
    """W's operand ``name`` (blocks along ``axis`` of W) where ``w`` was all-gathered by FSDP2 as its quantized
    operands (``mxtrain.linear.qgather``: ``w.mx_gathered``), as ``_quant`` would make it from the whole weight: the
    gathered codes and E8M0 scales (the reference quantizer's of the rotated weight, which the fused quantizer
    equals bit for bit) as a ``QuantOut`` of ``w.shape[1 - axis]`` rows reduced along ``w.shape[axis]``, and
    where the backend's GEMM reads the FP8 carrier, the carrier and group scales ``carrier_from_packed`` rebuilds
    from them (the fused quantizer's bytes; inexact blocks counted as its would be). The layouts agree: both
    have the block axis last, padded with zeros to whole rotation blocks and then to whole 32-blocks, two codes
    a byte with the lower index in the low nibble, one scale byte per block."""
    mx = w.mx_gathered.get(qctx, axis, name, gemm, signs)   # (refuses another recipe, axis or signs)
    op = qctx.recipe.operand(name)
    R, K = w.shape[1 - axis], w.shape[axis]
    if mx.fmt.name != op.fmt or mx.fmt.name not in KERNEL_FORMATS or mx.block_size != 32 or mx.data.shape[0] != R:
        raise RuntimeError(f"mxtrain: the gathered {name} operand ({mx.fmt.name}, blocks of {mx.block_size}, "
                           f"{tuple(mx.data.shape)} codes) is not the fast path's {op.fmt} operand of {R} rows "
                           "(an mxtrain bug: please report it)")
    # (the kernels read contiguous rows, as ``Gathered.get`` stores them: no copy here)
    packed = mx.data.view(torch.uint8).contiguous()
    scales = mx.scales.view(torch.uint8).contiguous()
    q = QuantOut(R, K, None, None, group_rows, None, packed, scales, fmt=op.fmt)
    if _outputs(backend, False)[0]:
        q = carrier_from_packed(q, k_multiple=_gemm.k_multiple_for(backend), counter=_counter(qctx, w.device, name))
    return q, op.prescale


# Both operands of one activation from one pass (quantize_mxfp4_dual, where it applies: the ``dual``
# setting) at any size: with launch plans for the fused kernel, one pass measured 1.08-1.22x faster than
# two on an H100 from 2048x4096 to 16384x14336 (BENCHMARKS.md), and one launch costs the host less than two.


def _quant_pair(qctx: Ctx, t: torch.Tensor, na: str, ga: str, nb: str, gb: str, backend: str,
                group_rows_b: int, always: bool = False, reuse: bool = False, keep_b: bool = False) -> dict | None:
    """Operand ``na`` (``t`` along rows, GEMM ``ga``, 1x128 groups) and ``nb`` (along columns, GEMM
    ``gb``) of a 2-D tensor, each exactly as ``_quant`` makes it: ``{name: (QuantOut, prescale)}``. From
    one read (``quantize_mxfp4_dual``) where that applies; else None, or with ``always`` two passes.
    ``keep_b``: ``nb`` is kept for the backward pass, so on the FP8-carrier backend it comes as packed
    FP4 codes and E8M0 scales (0.53 bytes an element instead of 1.03; ``carrier_of`` rebuilds the
    carrier before its GEMM)."""
    if backend != "fp8_carrier" or t.ndim != 2:
        if always:
            ga_s, gb_s = qctx.signs(ga, t.device), qctx.signs(gb, t.device)
            return {na: _quant(qctx, t, 1, na, ga, ga_s, backend, 1, reuse),
                    nb: _quant(qctx, t, 0, nb, gb, gb_s, backend, group_rows_b, reuse, fp4=keep_b)}
        return None
    recipe = qctx.recipe
    ra, rb = recipe.rotation(ga), recipe.rotation(gb)
    rsa, rsb = (ra.size if ra.enabled else 0), (rb.size if rb.enabled else 0)
    sr = recipe.operand(na).rounding != "nearest" or recipe.operand(nb).rounding != "nearest"
    # (exact_carrier: one count per operand, so two passes)
    one = dual_applies(t, rsa, rsb, sr=sr) and not _settings.current().exact_carrier
    if not (one or always):
        return None
    dev = t.device
    capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
    sides, acts = [], []
    for n, g, axis, rsize, gr in ((na, ga, 1, rsa, 1), (nb, gb, 0, rsb, group_rows_b)):
        op = recipe.operand(n)
        signs = qctx.signs(g, dev)
        key, key_t = qctx.kernel_key(n) if op.rounding == "stochastic" else (0, None)
        act = (_act_key(n, t, axis, rsize, op, backend, gr, capturing, keep_b and axis == 0)
               if _reusable(n, op, signs, reuse) else None)
        acts.append((n, act, op.prescale))
        sides.append(dict(rot=rsize, signs=signs, rounding=op.rounding, scale_rule=op.scale_rule, key=key,
                          prescale=op.prescale, index_strides=_index_strides(t, axis, rsize), key_tensor=key_t,
                          group_rows=gr, fmt=op.fmt))
    hits = [state.activations.get(n) for n, _, _ in acts]
    if all(act is not None and h is not None and h[0] == act for (_, act, _), h in zip(acts, hits)):
        return {n: (h[2], ps) for (n, _, ps), h in zip(acts, hits)}
    km = _gemm.k_multiple_for(backend)
    cnt = _counter(qctx, dev, na)
    if one:
        qs = quantize_mxfp4_dual(t, sides[0], sides[1], k_multiple=km, counter=cnt, fp4_b=keep_b)
    else:
        qs = [quantize_op(t, ax, **sd, carrier=out[0], fp4=out[1], k_multiple=km, counter=cnt)
              for ax, sd, out in ((1, sides[0], _outputs(backend, False)), (0, sides[1], _outputs(backend, keep_b)))]
    out = {}
    for (n, act, ps), q in zip(acts, qs):
        if act is not None:
            _act_put(n, act, t, q)
        out[n] = (q, ps)
    return out


def _both_mx(recipe, a: str, b: str) -> bool:
    """Are both operands of a GEMM of an MX format of the fused quantizer (``mxfp4``, ``mxint4``)? Their GEMM
    multiplies the MX values (the carrier holds either grid, so they may differ)."""
    return recipe.operand(a).fmt in KERNEL_FORMATS and recipe.operand(b).fmt in KERNEL_FORMATS


def _as_fmt(q: QuantOut, fmt: str) -> QuantOut:
    """``q`` naming its codes' format ``fmt`` (an operand that came back from a custom op's tensors,
    ``unpack_operand``, carries the default)."""
    return q if q.fmt == fmt else dataclasses.replace(q, fmt=fmt)


def _b_group_rows(dev, backend: str) -> int:
    """Group rows of an activation that is GEMM operand B (Wgrad's X)."""
    return _gemm.activation_b_group_rows(dev) if backend == "fp8_carrier" else 1


def _gemm_fn(qctx: Ctx, A: torch.Tensor, axA: int, nA: str, B: torch.Tensor | None, axB: int, nB: str, gemm: str,
             b_is_weight: bool, backend: str, out_dtype, amp, pre: dict | None = None,
             reuse: bool = False) -> torch.Tensor:
    """One GEMM ``op(A) op(B)^T`` reduced along the quantization axes, in float32 (or out_dtype).
    ``pre``: operands already quantized (``_quant_pair``), by name; ``B`` may then be None."""
    dev = A.device
    signs = qctx.signs(gemm, dev)
    recipe = qctx.recipe
    if _both_mx(recipe, nA, nB):
        pre = pre or {}
        qa, pa = pre[nA] if nA in pre else _quant(qctx, A, axA, nA, gemm, signs, backend, 1, reuse)
        gr = _gemm.weight_group_rows(dev) if b_is_weight else _b_group_rows(dev, backend)
        if nB in pre:
            qb, pb = pre[nB]
        elif getattr(B, "mx_gathered", None) is not None:   # (a weight FSDP2 gathered quantized: mxtrain.linear.qgather)
            qb, pb = gathered_operand(qctx, B, axB, nB, gemm, signs, backend, gr)
        else:
            qb, pb = _quant(qctx, B, axB, nB, gemm, signs, backend, gr, reuse)
        qa, qb = _as_fmt(qa, recipe.operand(nA).fmt), _as_fmt(qb, recipe.operand(nB).fmt)
        if backend == "fp8_carrier" and _settings.current().exact_carrier:
            return _exact_gemm(qctx, qa, nA, qb, nB, backend, out_dtype, pa * pb)
        return _gemm.mx_gemm_nt(qa, qb, backend, out_dtype, pa * pb)
    # as the reference: fake-quantized / rotated dense operands
    gd = gemm_dtype(recipe, nA, nB, gemm, amp)
    plain = not (recipe.rotation(gemm).enabled or recipe.operand(nA).quantized or recipe.operand(nB).quantized)
    if plain and A.dtype == torch.bfloat16 and B.dtype == torch.bfloat16:
        # plain bf16 operands (e.g. tseng's Fprop): exact in bf16, fp32 accumulation in cuBLAS
        ta, tb, pa, pb, gd = A, B, 1.0, 1.0, torch.bfloat16
    else:
        ta, pa = qctx.operand(A, axA, nA, gemm, signs)
        tb, pb = qctx.operand(B, axB, nB, gemm, signs)
    ta = ta if axA == 1 else ta.t()
    tb = tb if axB == 1 else tb.t()
    y = torch.matmul(ta.to(gd), tb.to(gd).t()).to(torch.float32)
    if pa * pb != 1.0:
        y = y / (pa * pb)
    return y.to(out_dtype)


def quantize_input(x2: torch.Tensor, qctx: Ctx, need_wgrad: bool, reuse: bool = False,
                   codes: bool = True) -> dict:
    """X's operands made in the forward: ``{"fprop_x": (QuantOut, prescale)}``, plus ``"wgrad_x"`` when a
    backward will compute dW and Wgrad is MXFP4 on both sides (from one read with Fprop's where that
    pays), as packed FP4 codes and E8M0 scales: the backward keeps 0.53 bytes an element instead of the
    2- or 4-byte X, and rebuilds the FP8 carrier where its GEMM needs one (``carrier_of``). Needs
    MXFP4 on both Fprop operands."""
    dev = x2.device
    backend = _backend(dev)
    with skeleton.no_autocast(dev.type):
        if need_wgrad and _both_mx(qctx.recipe, "wgrad_dy", "wgrad_x"):
            return _quant_pair(qctx, x2, "fprop_x", "fprop", "wgrad_x", "wgrad", backend,
                               _b_group_rows(dev, backend), always=True, reuse=reuse, keep_b=codes)
        return {"fprop_x": _quant(qctx, x2, 1, "fprop_x", "fprop", qctx.signs("fprop", dev), backend, 1, reuse)}


class FastBackend(Backend):
    """The fast path's GEMMs (``skeleton.Backend``): a GEMM whose two operands are both of the fused quantizer's MX
    formats quantizes them with the fused kernels and multiplies them with the device's MX GEMM (``_gemm_fn``);
    any other GEMM runs as the reference does. X's Fprop and Wgrad operands come from one read of X where a
    backward needs both (``quantize_input``; the Wgrad one kept, ``kept``, as packed FP4 codes or with ``codes``
    False as its FP8 carrier); dY's two operands likewise. ``pre``: X's operands made already (by name);
    ``reuse``: share activation operands between layers that read one input (eager forward only)."""

    def __init__(self, qctx: Ctx, amp: torch.dtype | None, kept: QuantOut | None = None, reuse: bool = False,
                 pre: dict | None = None, codes: bool = True):
        self.qctx, self.amp, self.kept, self.reuse, self.codes = qctx, amp, kept, reuse, codes
        self.pre = dict(pre) if pre else {}

    def start_forward(self, x2, weight, need_wgrad):
        r = self.qctx.recipe
        self.backend = _backend(x2.device)
        if not self.pre and _both_mx(r, "fprop_x", "fprop_w") and need_wgrad and _both_mx(r, "wgrad_dy", "wgrad_x"):
            self.pre = quantize_input(x2, self.qctx, need_wgrad, self.reuse, self.codes)
        wq = self.pre.get("wgrad_x")
        self.kept = wq[0] if wq is not None else None

    def start_backward(self, dy2, weight, need):
        state.activations.clear()   # the forward pass is over: reused activations are not needed any more
        r = self.qctx.recipe
        self.backend = _backend(dy2.device)
        wq = self.kept
        if wq is not None:   # (its format from the recipe: the custom ops' tensors do not carry it)
            wq = _as_fmt(wq, r.operand("wgrad_x").fmt)
        if wq is not None and need[1]:
            wq = carrier_of(wq, self.backend, self.qctx)
        self.pre = {} if wq is None else {"wgrad_x": (wq, r.operand("wgrad_x").prescale)}
        if need[0] and need[1] and _both_mx(r, "dgrad_dy", "dgrad_w") and _both_mx(r, "wgrad_dy", "wgrad_x"):
            # dY's Dgrad and Wgrad operands from one read
            self.pre.update(_quant_pair(self.qctx, dy2, "dgrad_dy", "dgrad", "wgrad_dy", "wgrad", self.backend, 1)
                            or {})
        return dy2

    def gemm(self, g, a, b, final, dims):
        # (the FP8-carrier GEMM writes the final dtype itself; the others' results are float32)
        out = final if final is not None and self.backend == "fp8_carrier" else torch.float32
        return _gemm_fn(self.qctx, a, g.a_axis, g.a, b, g.b_axis, g.b, g.name, g is not WGRAD, self.backend, out,
                        self.amp, self.pre, self.reuse and g is FPROP)


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: Ctx, amp: torch.dtype | None,
            need_wgrad: bool, reuse: bool = False, pre: dict | None = None,
            codes: bool = True) -> tuple[torch.Tensor, QuantOut | None]:
    """``(Y, X's Wgrad operand or None)`` (``skeleton.forward`` over ``FastBackend``; see ``quantize_input``).
    ``pre``: X's operands already made. ``codes``: the Wgrad operand as packed FP4 codes (else as the GEMM's FP8
    carrier: setting ``wgrad_x=carrier``)."""
    be = FastBackend(qctx, amp, reuse=reuse, pre=pre, codes=codes)
    y = skeleton.forward(be, x, weight, bias, amp if amp is not None else x.dtype, need_wgrad)
    return y, be.kept


def carrier_of(q: QuantOut, backend: str, qctx: Ctx) -> QuantOut:
    """``q`` as the GEMM of ``backend`` takes it: on the FP8-carrier backend, an operand kept as packed
    codes gets its carrier (the fused quantizer's bytes; inexact blocks counted here)."""
    if backend != "fp8_carrier" or q.carrier is not None:
        return q
    dev = q.packed.device
    return carrier_from_packed(q, k_multiple=_gemm.k_multiple_for(backend), counter=_counter(qctx, dev, "wgrad_x"))


def backward(dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, wq: QuantOut | None, qctx: Ctx,
             amp: torch.dtype | None, x_dtype: torch.dtype, need: tuple[bool, bool, bool]) -> tuple:
    """(dX, dW, db) (``skeleton.backward`` over ``FastBackend``; None where ``need`` says False); ``wq``: X's
    Wgrad operand from ``forward``, else ``x`` is needed for dW."""
    return skeleton.backward(FastBackend(qctx, amp, kept=wq), dy, x, weight, x_dtype, need)


# X's Wgrad operand as the two tensors the custom op returns and the backward op takes back

def pack_operand(q: QuantOut) -> tuple[torch.Tensor, torch.Tensor]:
    if q.carrier is not None:
        return q.carrier.view(torch.uint8), q.gs_base
    return q.packed, q.scales


def unpack_operand(s0: torch.Tensor, s1: torch.Tensor, R: int, K: int, group_rows: int | None = None,
                   fmt: str = "mxfp4") -> QuantOut:
    """Inverse of ``pack_operand``: an operand of R rows reduced along K. ``group_rows``: of the carrier's
    scales, made or to be made (default: what X's Wgrad operand uses on this device). ``fmt``: its MX format
    (the tensors do not say; ``forward`` and ``backward`` also set it from the recipe)."""
    gr = group_rows if group_rows is not None else _b_group_rows(s0.device, _backend(s0.device))
    if s1.dtype == torch.float32:   # FP8 carrier and its group scales
        Kc = s0.shape[1]
        gview = s1.t() if gr == 1 else s1[:, : Kc // TILE_K]
        return QuantOut(R, K, s0.view(torch.float8_e4m3fn), gview, gr, None, None, None, s1, fmt)
    return QuantOut(R, K, None, None, gr, None, s0, s1, fmt=fmt)


def operand_shapes(recipe, x: torch.Tensor, name: str):
    """Shapes and dtypes of ``pack_operand`` of X's operand ``name`` (``fprop_x`` or ``wgrad_x``), for the
    custom ops' fake implementations."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    dev = x.device
    with unset_fake_temporarily():   # the GEMM probes run real kernels on the device, once
        backend = _backend(dev)
        gr = _b_group_rows(dev, backend) if name == "wgrad_x" else 1
    carrier, fp4 = (False, True) if name == "wgrad_x" else _gemm.outputs_for(backend)   # (quantize_input)
    rot = recipe.rotation("wgrad" if name == "wgrad_x" else "fprop")
    M = 1
    for d in x.shape[:-1]:
        M = M * d
    R, K = (x.shape[-1], M) if name == "wgrad_x" else (M, x.shape[-1])
    car, gs, pk, sc = out_shapes(R, K, rot.size if rot.enabled else 0, carrier, fp4, gr, 16,
                                 _gemm.k_multiple_for(backend))
    if carrier:
        return (car, torch.uint8), (gs, torch.float32)
    return (pk, torch.uint8), (sc, torch.uint8)


def saved_operand_shapes(recipe, x: torch.Tensor, weight: torch.Tensor, need_wgrad: bool):
    """Shapes and dtypes of ``pack_operand(forward(...)[1])`` (None when the forward keeps none)."""
    if not (need_wgrad and _both_mx(recipe, "fprop_x", "fprop_w") and _both_mx(recipe, "wgrad_dy", "wgrad_x")):
        return None
    return operand_shapes(recipe, x, "wgrad_x")


def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: Ctx, amp="auto") -> torch.Tensor:
    """The fast MX linear (autograd-aware, eager: ``skeleton.EagerLinear`` over ``FastBackend``). ``amp``: the
    autocast dtype, or "auto" to read it. Only where ``applies(x, weight)``: the choice between this and the
    reference is ``linear.route``'s (``mx_linear``)."""
    if amp == "auto":
        amp = autocast_dtype(x.device.type)
    if not applies(x, weight):
        raise ValueError(f"mxtrain.linear.fast.apply: the fused kernels cannot run these tensors (device {x.device}, "
                         f"dtypes {x.dtype} and {weight.dtype}); call mxtrain.mx_linear, which routes them")

    def make(x_dtype, w, kept, where=None):   # (where: the forward's wgrad_x_for; None in the backward)
        if where is None:
            return FastBackend(qctx, amp, kept=kept)
        return FastBackend(qctx, amp, reuse=True, codes=where == "forward")

    return skeleton.EagerLinear.apply(x, weight, bias, make, amp if amp is not None else x.dtype,
                                      torch.is_grad_enabled())
