"""Fast MXLinear path: fused Triton quantizers + capability-dispatched MX GEMMs.

Same function as the reference ``mxtrain.nn._MXLinearFunction`` (the spec): every MXFP4 operand
is quantized from the high-precision tensor by the fused kernel, bit-identical to
``_Ctx.operand`` (same rotation, signs, seeds and stochastic-rounding index), and the GEMMs
multiply exactly those MX values (on sm_90 through the FP8 e4m3 carrier and blockwise
``torch._scaled_mm``). Only fp32 accumulation order and the bf16 rounding of GEMM outputs differ.

Used automatically by ``MXLinear`` for CUDA inputs when ``supported(recipe)``: every operand is
``mxfp4`` (32-element blocks) or ``bf16``, with any rotation, rounding, scale rule or prescale.
A GEMM whose two operands are not both MXFP4 runs exactly as the reference does.

Weight reuse: a weight operand with round-to-nearest is quantized once per (weight version, step,
sign vector) and reused by later micro-batches (stochastic rounding of W draws a fresh stream for
every call in the reference, so it is never reused). Fprop quantizes W along in-features and
Dgrad along out-features, so those two are different operands and are not shared.

Activation reuse: layers that read the same input (a Llama block's q/k/v and gate/up projections)
quantize its Fprop and Wgrad operands once (nearest rounding, same rotation and sign vector; see
``REUSE_ACTIVATIONS``). ``inexact_blocks()`` then counts such an operand once.

CUDA graphs (``train.cuda_graphs``): while a graph is captured, both caches only return operands
quantized within that capture, so every replay recomputes them from the current weights and inputs.
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import rng
from .kernels import backend as _backend, kernels_available
from .kernels import gemm as _gemm
from .kernels import quantize as _quantize
from .kernels.quantize import QuantOut, quantize_op
from .nn import _OPERAND_ID, _Ctx, _gemm_dtype

__all__ = ["supported", "apply", "ENABLED", "inexact_blocks", "clear_caches", "refresh_graph_seeds",
           "prepare_graph_seeds"]

# False forces the reference path everywhere; the environment variable MXTRAIN_FAST=0 does the same
# from the command line (e.g. `MXTRAIN_FAST=0 mxtrain train ...`).
ENABLED = os.environ.get("MXTRAIN_FAST", "1").strip().lower() not in ("0", "false", "no", "off")


def supported(recipe) -> bool:
    """Recipes the fast path implements: every operand ``mxfp4`` (default blocks) or ``bf16``."""
    if not ENABLED:
        return False
    from .recipe import OPERANDS
    for n in OPERANDS:
        op = recipe.operand(n)
        if op.fmt not in ("mxfp4", "bf16") or op.block_2d:
            return False
    return True


_COUNTERS: dict = {}


def _counter(device) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros((1,), dtype=torch.int32, device=device)
    return c


def inexact_blocks(device="cuda") -> int:
    """Running count of MXFP4 blocks that the FP8 carrier could not hold exactly (more than 14
    binades below their group's largest block) over every fast-path quantize on ``device`` so far
    (0 means every GEMM multiplied the exact MX values). Reading it synchronizes the device."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    c = _COUNTERS.get(d)
    return int(c.item()) if c is not None else 0


# Activation reuse: the last quantized X operand of Fprop and of Wgrad (nearest rounding) is kept and
# reused when the next layer quantizes the same tensor the same way, as the q/k/v projections and the
# gate/up projections of a Llama block do (three and two layers on one input). The reference
# quantizes each time; the operands are identical, so results are too. One entry per operand holds
# the input tensor and its quantized form until the next quantize of that operand or clear_caches().
REUSE_ACTIVATIONS = os.environ.get("MXTRAIN_REUSE_ACT", "1").strip().lower() not in ("0", "false", "no", "off")
_ACT_OPERANDS = ("fprop_x", "wgrad_x")
_ACT_CACHE: dict = {}


def clear_caches() -> None:
    """Drop the reused activation operands (frees their memory; results are unaffected)."""
    _ACT_CACHE.clear()


def _ceil(a: int, b: int) -> int:
    return -(-a // b) * b


# Host-side per-call work is what limits small layers (scripts/host_overhead.py): the recipe's
# operand and rotation specs are looked up once per recipe object, and sign vectors are made once per
# (size, mode, seed, layer, GEMM, step, device) instead of by ~20 small kernels every call.
_SPECS: dict = {}
_SIGNS: dict = {}


def _spec(recipe):
    e = _SPECS.get(id(recipe))
    if e is None or e[0] is not recipe:
        from .recipe import GEMMS, OPERANDS
        e = (recipe, {n: recipe.operand(n) for n in OPERANDS}, {g: recipe.rotation(g) for g in GEMMS})
        _SPECS[id(recipe)] = e
    return e


class _GraphSeeds:
    """The random inputs of kernels captured in a CUDA graph, kept in device memory that is rewritten
    before each replay: per-step sign vectors (one 128-float row per (layer, GEMM)) and int32
    stochastic-rounding keys (one slot per (layer, operand, call), 16 bytes apart, read by the quantize
    kernel through ``key_tensor``). ``refresh(step, micro)`` writes what the eager path would use for
    that optimizer step and micro-step, so replays draw the same bits as eager training does.

    Both buffers are made when the object is made, which must happen outside any capture (the eager
    path makes it on its first call with stochastic rounding or per-step signs, so the warm-up calls of
    ``torch.cuda.make_graphed_callables`` do). Made inside a capture they would come from the graph's
    private memory pool, where a block freed by the captured forward can be handed to the backward:
    every forward replay then overwrites the refreshed values (this is what made replays inside
    ``make_graphed_callables`` ignore refreshed keys on the H100, scripts/diag_graph_sr.py)."""

    KEY_SLOTS = 16384
    SIGN_ROWS = 4096

    def __init__(self, device):
        self.device = device
        # torch.empty: no kernel (nothing to record if a capture were under way); refresh() writes every
        # used slot and row before a replay reads it
        self.keys = torch.empty((self.KEY_SLOTS * 4,), dtype=torch.int32, device=device)
        self.key_slots: dict = {}    # (seed, layer, operand id, call at capture) -> slot
        self.signs = torch.empty((self.SIGN_ROWS, 128), dtype=torch.float32, device=device)
        self.sign_rows: dict = {}    # (size, seed, layer, GEMM id) -> row
        self.signs_step = None

    def key(self, seed: int, layer: int, op_id: int, call: int) -> torch.Tensor:
        k = (seed, layer, op_id, call)
        i = self.key_slots.get(k)
        if i is None:
            i = len(self.key_slots)
            if i >= self.KEY_SLOTS:
                raise RuntimeError(f"mxtrain: more than {self.KEY_SLOTS} stochastically rounded operands in "
                                   "CUDA graphs; capture fewer layers per graph")
            self.key_slots[k] = i
        return self.keys[4 * i: 4 * i + 1]

    def sign_row(self, size: int, seed: int, layer: int, gemm_id: int) -> torch.Tensor:
        k = (size, seed, layer, gemm_id)
        i = self.sign_rows.get(k)
        if i is None:
            i = len(self.sign_rows)
            if i >= self.SIGN_ROWS:
                raise RuntimeError(f"mxtrain: more than {self.SIGN_ROWS} per-step sign vectors in CUDA graphs")
            self.sign_rows[k] = i
            self.signs_step = None
        return self.signs[i, :size]

    def refresh(self, step: int, micro: int) -> None:
        """Keys for ``call = micro * n + j`` (the layer's j-th of n calls of that operand per micro-step in
        the captured pass) and signs of ``step``; asynchronous host-to-device copies (pinned memory)."""
        if self.key_slots:
            slots = list(self.key_slots.items())
            first: dict = {}
            count: dict = {}
            for (seed, layer, op, call), _ in slots:
                g = (seed, layer, op)
                first[g] = min(first.get(g, call), call)
                count[g] = count.get(g, 0) + 1
            rows = []
            for (seed, layer, op, call), _ in slots:
                g = (seed, layer, op)
                rows.append((seed, layer, op, step, call - first[g] + micro * count[g]))
            cols = list(zip(*rows))
            keys = rng.stream_key_t(rng.stream_key_t(*[torch.tensor(c, dtype=torch.int64) for c in cols]))
            keys = torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)
            idx = torch.tensor([i for _, i in slots], dtype=torch.int64)
            host = torch.zeros((len(self.key_slots), 4), dtype=torch.int32)
            host[idx, 0] = keys
            self.keys[: host.numel()].copy_(_pinned(host.flatten()), non_blocking=True)
        if self.sign_rows and self.signs_step != step:
            rows = list(self.sign_rows.items())
            ks = torch.tensor([rng.stream_key(seed, 0x57E9, layer, g, step) for (_, seed, layer, g), _ in rows],
                              dtype=torch.int64)
            bits = rng.mix32(torch.arange(128, dtype=torch.int64)[None, :] ^ ks[:, None]) & 1
            host = torch.ones((len(rows), 128), dtype=torch.float32)
            host[torch.tensor([i for _, i in rows])] = 1.0 - 2.0 * bits.to(torch.float32)
            self.signs[: len(rows)].copy_(_pinned(host), non_blocking=True)
            self.signs_step = step


def _pinned(t: torch.Tensor) -> torch.Tensor:
    # page-locked, so that the copy to the GPU is asynchronous (PyTorch's host allocator keeps the
    # block until the copy has run)
    return t.pin_memory() if torch.cuda.is_available() else t


_GRAPH_SEEDS: dict = {}
# stochastically rounded operands captured in a CUDA graph read their keys from _GraphSeeds slots
# (MXTRAIN_GRAPH_SR_KEYS=0: the captured scalar key, so every replay repeats the captured draws)
GRAPH_SR_KEYS = os.environ.get("MXTRAIN_GRAPH_SR_KEYS", "1") != "0"


def _graph_seeds(device) -> _GraphSeeds:
    g = _GRAPH_SEEDS.get(device)
    if g is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "mxtrain: a CUDA graph is being captured around a layer with stochastic rounding or per-step "
                "random signs that never ran outside the capture; run it once eagerly before capturing (the "
                "warm-up of torch.cuda.make_graphed_callables does), or call "
                "mxtrain.fast.prepare_graph_seeds(device) first")
        g = _GRAPH_SEEDS[device] = _GraphSeeds(device)
    return g


def prepare_graph_seeds(device) -> None:
    """Make the device buffers that captured kernels read their per-step signs and stochastic-rounding
    keys from (done by the first eager call that needs them; call it before a capture that has none)."""
    _graph_seeds(torch.device(device))


def refresh_graph_seeds(step: int, micro: int = 0) -> None:
    """Before replaying a CUDA graph captured with per-step signs or stochastic rounding (fast path):
    load the signs and keys of optimizer ``step``,
    micro-step ``micro`` (what eager training would draw). The trainer calls it before every replay
    (``train.cuda_graphs``); without it a replay repeats the last ones."""
    for g in _GRAPH_SEEDS.values():
        g.refresh(step, micro)


def _signs(qctx: _Ctx, gemm: str, device) -> torch.Tensor | None:
    """``qctx.signs(gemm, device)``, made once and shared (callers never write to it)."""
    rot = _spec(qctx.recipe)[2][gemm]
    if not rot.enabled or rot.signs == "none":
        return None
    mode = rot.signs
    if mode == "per_step" and device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            # a captured kernel reads its signs from a row that refresh_graph_seeds rewrites every step
            from .nn import _GEMM_ID
            return _graph_seeds(device).sign_row(rot.size, qctx.recipe.seed, qctx.layer, _GEMM_ID[gemm])
        if device not in _GRAPH_SEEDS:
            _graph_seeds(device)   # made eagerly, before any capture (see _GraphSeeds)
    k = (rot.size, mode, qctx.recipe.seed, device,
         qctx.layer if mode in ("per_layer", "per_step") else 0,
         gemm if mode == "per_step" else "", qctx.step if mode == "per_step" else 0)
    s = _SIGNS.get(k)
    if s is None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return qctx.signs(gemm, device)   # made inside the graph: not valid outside it, so not kept
    if s is None:
        if len(_SIGNS) >= 4096:  # per-step signs: old steps are never asked for again
            _SIGNS.clear()
        s = _SIGNS[k] = qctx.signs(gemm, device)
    return s


class _WeightCache:
    """Per-module cache of quantized weight operands (see module docstring)."""

    def __init__(self):
        self.entries: dict = {}


def _key(qctx: _Ctx, op, name: str, t: torch.Tensor, capturing: bool):
    """(scalar stochastic-rounding key, device key slot or None) of operand ``name`` in this call."""
    if op.rounding != "stochastic":
        return 0, None
    seed = rng.stream_key(qctx.recipe.seed, qctx.layer, _OPERAND_ID[name], qctx.step, qctx.call)
    key_t = None
    if GRAPH_SR_KEYS and t.is_cuda and not torch.compiler.is_compiling():
        if capturing:   # the captured kernel reads its key from a slot refreshed before each replay
            key_t = _graph_seeds(t.device).key(qctx.recipe.seed, qctx.layer, _OPERAND_ID[name], qctx.call)
        elif t.device not in _GRAPH_SEEDS:
            _graph_seeds(t.device)   # made eagerly, before any capture (see _GraphSeeds)
    return rng.stream_key(seed), key_t


def _index_strides(t: torch.Tensor, axis: int, rsize: int) -> tuple[int, int]:
    """Logical index strides of the (rotation-padded) tensor the reference quantizes."""
    if axis == 1:
        return (_ceil(t.shape[1], rsize) if rsize else t.shape[1], 1)
    return (1, t.shape[1])


def _act_key(name, t, axis, rsize, signs, op, backend, group_rows, capturing):
    """Activation-cache key: the same input (address, version, layout) quantized the same way. A CUDA
    graph being captured may only reuse operands quantized inside the same capture (an eagerly made one
    would be a constant of the graph, never recomputed on replay), and eager code only eager ones."""
    return (name, t.device, t.dtype, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t._version, axis, rsize, id(signs), op.scale_rule, op.prescale, backend, group_rows, capturing)


def _act_put(name: str, act, t, signs, q) -> None:
    # holding t (and signs) keeps their memory from being reused, so the address, version and
    # layout in the key name these very values for as long as the entry lives
    _ACT_CACHE[name] = (act, (t, signs), q)


def _quant(qctx: _Ctx, t: torch.Tensor, axis: int, name: str, gemm: str, signs, backend: str,
           group_rows: int, cache: dict | None = None) -> tuple[QuantOut, float]:
    """Quantize one MXFP4 operand of a 2-D tensor along ``axis`` exactly as ``_Ctx.operand`` does."""
    _, ops, rots = _spec(qctx.recipe)
    op = ops[name]
    rot = rots[gemm]
    rsize = rot.size if rot.enabled else 0
    capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
    key, key_t = _key(qctx, op, name, t, capturing)
    carrier, fp4 = _gemm.outputs_for(backend)
    ck = None
    act = None
    if op.rounding == "nearest" and not torch.compiler.is_compiling():
        if cache is not None:   # the capture state is part of every key (see _act_key)
            ck = (name, t.data_ptr(), t._version, qctx.step, backend, group_rows, capturing)
            hit = cache.get(name)
            if hit is not None and hit[0] == ck:
                return hit[1], op.prescale
        elif name in _ACT_OPERANDS and REUSE_ACTIVATIONS:
            # the same input quantized the same way by the layer before (q/k/v, gate/up projections)
            act = _act_key(name, t, axis, rsize, signs, op, backend, group_rows, capturing)
            hit = _ACT_CACHE.get(name)
            if hit is not None and hit[0] == act:
                return hit[2], op.prescale
    q = quantize_op(t, axis, rot=rsize, signs=signs, rounding=op.rounding, scale_rule=op.scale_rule, key=key,
                    prescale=op.prescale, index_strides=_index_strides(t, axis, rsize), carrier=carrier, fp4=fp4,
                    group_rows=group_rows, k_multiple=_gemm.k_multiple_for(backend), counter=_counter(t.device),
                    key_tensor=key_t)
    if ck is not None:
        cache[name] = (ck, q)
    if act is not None:
        _act_put(name, act, t, signs, q)
    return q, op.prescale


# Both operands of one activation from one pass (quantize_mxfp4_dual, where it applies) for tensors of
# at least this many elements (MXTRAIN_QDUAL_MIN; MXTRAIN_QDUAL=0: never). With launch plans for the
# fused kernel, one pass measured 1.08-1.22x faster than two on an H100 from 2048x4096 to 16384x14336
# (BENCHMARKS.md), and one launch costs the host less than two: no lower bound by default.
DUAL_MIN_ELEMENTS = int(os.environ.get("MXTRAIN_QDUAL_MIN", "0"))


def _quant_pair(qctx: _Ctx, t: torch.Tensor, na: str, ga: str, nb: str, gb: str, backend: str,
                group_rows_b: int, always: bool = False) -> dict | None:
    """Operand ``na`` (``t`` along rows, GEMM ``ga``, 1x128 groups) and ``nb`` (along columns, GEMM
    ``gb``) of a 2-D tensor, each exactly as ``_quant`` makes it: ``{name: (QuantOut, prescale)}``. From
    one read (``quantize_mxfp4_dual``) where that applies; else None, or with ``always`` two passes."""
    if backend != "fp8_carrier" or t.ndim != 2 or torch.compiler.is_compiling():
        return None
    _, ops, rots = _spec(qctx.recipe)
    ra, rb = rots[ga], rots[gb]
    rsa, rsb = (ra.size if ra.enabled else 0), (rb.size if rb.enabled else 0)
    sr = ops[na].rounding != "nearest" or ops[nb].rounding != "nearest"
    one = t.numel() >= DUAL_MIN_ELEMENTS and _quantize.dual_applies(t, rsa, rsb, sr=sr)
    if not (one or always):
        return None
    dev = t.device
    capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
    sides, acts = [], []
    for n, g, axis, rsize, gr in ((na, ga, 1, rsa, 1), (nb, gb, 0, rsb, group_rows_b)):
        op = ops[n]
        signs = _signs(qctx, g, dev)
        key, key_t = _key(qctx, op, n, t, capturing)
        act = None
        if op.rounding == "nearest" and n in _ACT_OPERANDS and REUSE_ACTIVATIONS:
            act = _act_key(n, t, axis, rsize, signs, op, backend, gr, capturing)
        acts.append((n, act, signs, op.prescale))
        sides.append(dict(rot=rsize, signs=signs, rounding=op.rounding, scale_rule=op.scale_rule, key=key,
                          prescale=op.prescale, index_strides=_index_strides(t, axis, rsize), key_tensor=key_t,
                          group_rows=gr))
    hits = [_ACT_CACHE.get(n) for n, act, _, _ in acts]
    if all(act is not None and h is not None and h[0] == act for (_, act, _, _), h in zip(acts, hits)):
        return {n: (h[2], ps) for (n, _, _, ps), h in zip(acts, hits)}
    km = _gemm.k_multiple_for(backend)
    if one:
        qs = _quantize.quantize_mxfp4_dual(t, sides[0], sides[1], k_multiple=km, counter=_counter(dev))
    else:
        qs = [quantize_op(t, ax, **sd, carrier=True, fp4=False, k_multiple=km, counter=_counter(dev))
              for ax, sd in ((1, sides[0]), (0, sides[1]))]
    out = {}
    for (n, act, signs, ps), q in zip(acts, qs):
        if act is not None:
            _act_put(n, act, t, signs, q)
        out[n] = (q, ps)
    return out


def _both_mx(recipe, a: str, b: str) -> bool:
    ops = _spec(recipe)[1]
    return ops[a].fmt == "mxfp4" and ops[b].fmt == "mxfp4"


def _b_group_rows(dev, backend: str) -> int:
    """Group rows of an activation that is GEMM operand B (Wgrad's X)."""
    return _gemm.activation_b_group_rows(dev) if backend == "fp8_carrier" else 1


def _gemm_fn(qctx: _Ctx, A: torch.Tensor, axA: int, nA: str, B: torch.Tensor | None, axB: int, nB: str, gemm: str,
             b_is_weight: bool, backend: str, out_dtype, cache, pre: dict | None = None) -> torch.Tensor:
    """One GEMM ``op(A) op(B)^T`` reduced along the quantization axes, in float32 (or out_dtype).
    ``pre``: operands already quantized (``_quant_pair``), by name; ``B`` may then be None."""
    dev = A.device
    signs = _signs(qctx, gemm, dev)
    recipe = qctx.recipe
    if _both_mx(recipe, nA, nB):
        pre = pre or {}
        qa, pa = pre[nA] if nA in pre else _quant(qctx, A, axA, nA, gemm, signs, backend, 1)
        gr = _gemm.weight_group_rows(dev) if b_is_weight else _b_group_rows(dev, backend)
        qb, pb = pre[nB] if nB in pre else _quant(qctx, B, axB, nB, gemm, signs, backend, gr,
                                                   cache if b_is_weight else None)
        return _gemm.mx_gemm_nt(qa, qb, backend, out_dtype, pa * pb)
    else:  # as the reference: fake-quantized / rotated dense operands
        gd = _gemm_dtype(recipe, nA, nB, gemm, dev.type)
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


def _no_autocast(device_type: str, enabled: bool):
    """Autocast off inside (entering ``torch.autocast`` costs host time, so only when it is on)."""
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


class _FastMXLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, qctx: _Ctx, cache, grad: bool):
        dev = x.device
        amp = torch.is_autocast_enabled(dev.type)
        out_dtype = torch.get_autocast_dtype(dev.type) if amp else x.dtype
        backend = _backend(dev)
        x2 = x.reshape(-1, x.shape[-1])
        pre = None
        with _no_autocast(dev.type, amp):
            # (``grad``: grad mode at the call; needs_input_grad says True under torch.no_grad too, where
            # no backward will come, e.g. evaluation)
            if (grad and ctx.needs_input_grad[1] and _both_mx(qctx.recipe, "fprop_x", "fprop_w")
                    and _both_mx(qctx.recipe, "wgrad_dy", "wgrad_x")):
                # X's Wgrad operand made now (with Fprop's, from one read where that pays): the
                # backward then keeps the 1-byte Wgrad carrier instead of the 2- or 4-byte X
                pre = _quant_pair(qctx, x2, "fprop_x", "fprop", "wgrad_x", "wgrad", backend,
                                  _b_group_rows(dev, backend), always=True)
            ydt = torch.float32 if (bias is not None or backend != "fp8_carrier") else out_dtype
            y = _gemm_fn(qctx, x2, 1, "fprop_x", weight, 1, "fprop_w", "fprop", True, backend, ydt, cache, pre)
            if bias is not None:
                y = y + bias.to(torch.float32)
        ctx.wgrad_x = pre["wgrad_x"] if pre is not None else None
        ctx.save_for_backward(x2 if pre is None else None, weight)
        ctx.qctx, ctx.cache, ctx.has_bias, ctx.x_shape, ctx.x_dtype = qctx, cache, bias is not None, x.shape, x.dtype
        ctx.backend = backend
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight = ctx.saved_tensors
        qctx: _Ctx = ctx.qctx
        backend = ctx.backend
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        pre = {} if ctx.wgrad_x is None else {"wgrad_x": ctx.wgrad_x}
        with _no_autocast(dy.device.type, torch.is_autocast_enabled(dy.device.type)):
            if (ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and _both_mx(qctx.recipe, "dgrad_dy", "dgrad_w")
                    and _both_mx(qctx.recipe, "wgrad_dy", "wgrad_x")):
                # dY's Dgrad and Wgrad operands from one read
                pre.update(_quant_pair(qctx, dy2, "dgrad_dy", "dgrad", "wgrad_dy", "wgrad", backend, 1) or {})
            if ctx.needs_input_grad[0]:
                # dX (M, K) = Q(dY) [rows, along N] x Q(W) [columns, along N]
                dx = _gemm_fn(qctx, dy2, 1, "dgrad_dy", weight, 0, "dgrad_w", "dgrad", True, backend,
                              ctx.x_dtype if backend == "fp8_carrier" else torch.float32, ctx.cache, pre)
                dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                # dW (N, K) = Q(dY^T) [along tokens] x Q(X^T) [along tokens]
                dw = _gemm_fn(qctx, dy2, 0, "wgrad_dy", x2, 0, "wgrad_x", "wgrad", False, backend,
                              weight.dtype if backend == "fp8_carrier" else torch.float32, None, pre)
                dw = dw.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = dy2.to(torch.float32).sum(0).to(weight.dtype)
        return dx, dw, db, None, None, None


def apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, qctx: _Ctx,
          module=None) -> torch.Tensor:
    """The fast MXLinear forward (autograd-aware). ``module`` (optional) holds the weight cache."""
    ok_dt = (torch.float32, torch.bfloat16, torch.float16)
    if not kernels_available(x.device) or x.dtype not in ok_dt or weight.dtype not in ok_dt:
        from .nn import _MXLinearFunction
        return _MXLinearFunction.apply(x, weight, bias, qctx)
    cache = None
    if module is not None:
        cache = module.__dict__.setdefault("_mx_weight_cache", {})
    return _FastMXLinearFunction.apply(x, weight, bias, qctx, cache, torch.is_grad_enabled())
