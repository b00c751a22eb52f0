"""The grouped MX experts path (issue #48): the eager forward and backward of a fused Mixture-of-Experts experts
module (``MXExperts``: ``gate_up_proj`` ``(E, 2 I, H)``, ``down_proj`` ``(E, H, I)``) with each operand of all
experts quantized together, the values of the per-expert loop (``mxtrain._experts.experts_forward`` with one
``mx_linear`` call per expert GEMM) bit for bit. Which one runs is the dispatcher's (``dispatch.experts_route``,
setting ``experts_grouped``); this module chooses nothing.

The loop quantizes every operand of every expert GEMM on its own: four quantize launches an expert GEMM (X's two
operands in one pass, W, dY's two in one pass, W's Dgrad operand), ``8 E`` for the ``E`` experts of a layer in a
forward and backward. Here, 8 in all where the weights' shapes allow:

* the tokens come sorted by expert (the loop's order: ``_experts.sorted_choices``), each expert's rows padded with
  zero rows to a multiple of ``P``, the FP8 carrier's reduction padding (setting ``carrier_k``, 512 by default), in
  one stacked matrix: X's Fprop operand (blocks along H, one token a row) and its Wgrad operand (blocks along the
  tokens) of all experts come from one quantize launch (``fast._quant_pair``: the one-pass kernel where it
  applies, else two), and dY's Dgrad and Wgrad operands likewise in the backward;
* the weights of all experts are quantized in one launch per operand: ``(E, N, K)`` as ``(E N, K)``, along K
  (Fprop; blocks along a row do not depend on the expert) where ``N`` is a multiple of 128 (the weight's 128x128
  carrier groups then never straddle two experts), and along ``E N`` (Dgrad) where ``N`` is a multiple of ``P``
  (each expert's reduction is then the loop's, padding included); an operand whose shape does not allow it is
  quantized per expert, as the loop does;
* each expert's GEMM is one ``mx_gemm_nt`` on slices of those operands (torch has no blockwise-scaled grouped
  GEMM): rows of an activation operand, rows of a weight operand, or a range of the reduction axis (Wgrad: the
  expert's token segment; Dgrad: the expert's ``N`` columns of the stacked weight). ``_scaled_mm`` takes a 1x128
  scale of an operand of ``M`` rows only with strides ``(1, M)`` and a 128x128 scale only with its row length, so
  a row slice's 1x128 scales and a reduction slice's 128x128 scales are copied to that layout (float32, one per
  128 elements of the slice); the carriers themselves are views.

Why ``P`` and not 32: MX blocks of 32 along the tokens would already keep to one expert each, but the carrier's
128-wide scale groups and ``_scaled_mm``'s reduction length must too: every slice then has the loop's reduction
length and group scales, the GEMM is called with the loop's shapes, and the extra rows are zeros (they cost
quantize work, not GEMM work, in the Fprop and Dgrad GEMMs, whose slices keep the loop's row counts). Each GEMM's
operands, shapes and output dtype are the loop's, so its result is too; the routing weights, the SwiGLU and the
sums over experts run as in the loop, per expert and in its order (the gradient of the hidden states sums the
experts' contributions from the last expert to the first, as autograd sums the loop's gathers, which matters from
top-3 on: tests/linear/test_moe.py).

Scope: the eager fast path on the ``fp8_carrier`` backend, recipes whose GEMMs are all MX on both operands (the
fused quantizer's formats) and draw nothing at random (``supported``): round-to-nearest, no rotation or a
deterministic Hadamard (``mxfp4-all``, ``mxfp4-all-dh16``, ...). Stochastic rounding and random signs draw by the
GEMM's layer id and the element's position in its tensor, so those recipes keep the loop, as do ``exact_carrier``
(which decides each GEMM on the host) and ``torch.compile`` (the compiled loop, ``_experts``). The weights of all
``E`` experts are quantized, also those no token chose (the loop skips them).
"""

from __future__ import annotations

import torch

from .. import settings as _settings
from . import fast, skeleton
from .context import Ctx, autocast_dtype, needs_seeds
from ..kernels import backend as _backend
from ..kernels import gemm as _gemm
from ..kernels.mxfp4 import TILE_K, QuantOut
from ..kernels.mxfp4.carrier import ceil_to
from .._experts import sorted_choices

__all__ = ["supported", "why_not", "forward", "A_ROWS", "W_ROWS"]

A_ROWS = 16    # an activation operand's carrier rows are padded to this (1x128 groups: ``carrier.out_shapes``)
W_ROWS = 128   # a weight operand's rows per carrier scale group (128x128 groups)

# (A, B) of the three GEMMs
_PAIRS = (("fprop_x", "fprop_w"), ("dgrad_dy", "dgrad_w"), ("wgrad_dy", "wgrad_x"))


def supported(recipe) -> bool:
    """Recipes the grouped path runs: the fast path's (``fast.supported``), every GEMM of fused-quantizer MX
    formats on both operands, and nothing drawn at random (no stochastic rounding, no random signs:
    ``context.needs_seeds``), so that an operand's values depend neither on the GEMM's layer id nor on where an
    element sits in its tensor. Depends on the recipe only."""
    return recipe.memo("experts_grouped", _supported)


def _supported(r) -> bool:
    return bool(r.quantized and fast.supported(r) and not needs_seeds(r)
                and all(fast._both_mx(r, a, b) for a, b in _PAIRS))


def why_not(recipe, x: torch.Tensor, gate_up_proj: torch.Tensor, backend: str) -> str | None:
    """None where the grouped path can run an experts call of ``recipe`` on hidden states ``x`` with weights
    ``gate_up_proj`` on ``backend`` (``supported`` aside), else why not (shapes and the backend)."""
    if backend != "fp8_carrier":
        return f"the GEMM backend is {backend}, not fp8_carrier (the grouped path slices FP8 carriers)"
    if x.ndim != 2 or gate_up_proj.ndim != 3:
        return "the hidden states are not 2-D or the weights not 3-D"
    if getattr(gate_up_proj, "mx_gathered", None) is not None:
        return "weights all-gathered quantized (mxtrain.linear.qgather) run per expert"
    P = _gemm.k_multiple_for(backend)
    for g in ("fprop", "dgrad", "wgrad"):
        rot = recipe.rotation(g)
        if rot.enabled and P % rot.size:
            return f"the {g} rotation ({rot.size} wide) does not divide the carrier padding {P}"
    return None


class _Plan:
    """One call's routing: the experts some token chose (increasing), each one's (position, token) pairs in the
    loop's order, and where its rows sit in the stacked matrix (``off``: first row, ``n``: real rows, ``seg``:
    rows with the zero padding, a multiple of ``P``)."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int, P: int):
        n_tok = top_k_index.shape[0]
        sorted_e, order, counts, host = sorted_choices(top_k_index, num_experts)   # (the host's one read)
        self.experts = [e for e, c in enumerate(host) if c]
        self.n = [host[e] for e in self.experts]
        self.seg = [ceil_to(c, P) for c in self.n]
        self.off, o = [], 0
        for s in self.seg:
            self.off.append(o)
            o += s
        self.rows = o
        total = sum(self.n)
        with torch.no_grad():
            valid = order[:total]
            tok, pos = valid % n_tok, valid // n_tok
            # the stacked row of each choice: its index among the sorted choices, moved by its expert's padding
            pad = (counts + (P - 1)) // P * P
            shift = (torch.cumsum(pad, 0) - pad) - (torch.cumsum(counts, 0) - counts)
            self.dest = torch.arange(total, device=order.device) + shift[sorted_e[:total]]
        self.tok_all = tok
        self.tok, self.pos, start = [], [], 0
        for c in self.n:
            self.tok.append(tok[start:start + c])
            self.pos.append(pos[start:start + c])
            start += c


class _Call:
    """What both GEMMs of one experts call share: the context, the backend, the autocast dtype, the grad mode at
    the call and the plan."""

    __slots__ = ("qctx", "backend", "amp", "grad", "plan")

    def __init__(self, qctx: Ctx, backend: str, amp, grad: bool, plan: _Plan):
        self.qctx, self.backend, self.amp, self.grad, self.plan = qctx, backend, amp, grad, plan


# ---------------------------------------------------------------------------------------------- operand slices

def _a_rows(q: QuantOut, start: int, n: int) -> QuantOut:
    """Rows ``[start, start + n)`` of an activation operand (1x128 groups) as the loop's quantize of those rows
    alone makes it: the carrier's rows padded to ``A_ROWS`` (zero rows of the expert's padding), its scales copied
    to ``(Kc / 128, rows)`` (``_scaled_mm`` wants strides ``(1, rows)``)."""
    rc = ceil_to(max(n, 1), A_ROWS)
    base = q.gs_base[:, start:start + rc].contiguous()
    return QuantOut(n, q.K, q.carrier[start:start + rc], base.t(), 1, None, None, None, base, q.fmt)


def _w_rows(q: QuantOut, start: int, n: int) -> QuantOut:
    """Rows ``[start, start + n)`` of a weight operand quantized along its rows (``start`` and ``n`` multiples of
    ``W_ROWS``): 128x128 scales are a row slice of the loop's layout; 1x128 ones are copied as ``_a_rows``."""
    if q.group_rows == W_ROWS:
        g0, g1 = start // W_ROWS, (start + n) // W_ROWS
        return QuantOut(n, q.K, q.carrier[start:start + n], q.gscale[g0:g1], q.group_rows, None, None, None,
                        q.gs_base[g0:g1], q.fmt)
    base = q.gs_base[:, start:start + n].contiguous()
    return QuantOut(n, q.K, q.carrier[start:start + n], base.t(), 1, None, None, None, base, q.fmt)


def _k_cols(q: QuantOut, start: int, length: int, k: int) -> QuantOut:
    """Reduction elements ``[start, start + length)`` of an operand (a multiple of the carrier padding, so
    ``length`` is the loop's padded reduction; ``k`` the real one): the carrier is a view; 1x128 scales are
    contiguous rows of their ``(Kc / 128, rows)`` storage; 128x128 ones are copied to the loop's layout (rows padded
    to a multiple of 4 scales: ``carrier.carrier_buffers``)."""
    g0, kg = start // TILE_K, length // TILE_K
    car = q.carrier[:, start:start + length]
    if q.group_rows == 1:
        base = q.gs_base[g0:g0 + kg]
        return QuantOut(q.R, k, car, base.t(), 1, None, None, None, base, q.fmt)
    base = q.gs_base.new_empty((q.gs_base.shape[0], ceil_to(kg, 4)))
    base[:, :kg] = q.gscale[:, g0:g0 + kg]
    return QuantOut(q.R, k, car, base[:, :kg], q.group_rows, None, None, None, base, q.fmt)


def _weights(call: _Call, w: torch.Tensor, axis: int, name: str, gemm: str) -> list:
    """Operand ``name`` of every chosen expert's weight ``w[e]`` (``(N, K)``, blocks along ``axis``) as
    ``_quant`` makes it for that matrix alone: from one launch over ``w`` as ``(E N, K)`` where the shapes keep
    every expert's carrier groups and reduction its own (module docstring), else one launch per expert."""
    qctx, backend, plan = call.qctx, call.backend, call.plan
    E, N, K = w.shape
    dev = w.device
    signs = qctx.signs(gemm, dev)
    gr = _gemm.weight_group_rows(dev)
    if w.is_contiguous():
        if axis == 1 and N % W_ROWS == 0:
            q, p = fast._quant(qctx, w.view(E * N, K), 1, name, gemm, signs, backend, gr)
            return [(_w_rows(q, e * N, N), p) for e in plan.experts]
        if axis == 0 and N % _gemm.k_multiple_for(backend) == 0:
            q, p = fast._quant(qctx, w.view(E * N, K), 0, name, gemm, signs, backend, gr)
            return [(_k_cols(q, e * N, N, N), p) for e in plan.experts]
    return [fast._quant(qctx, w[e], axis, name, gemm, signs, backend, gr) for e in plan.experts]


def _stack(parts, plan: _Plan) -> torch.Tensor:
    """The per-expert ``(n, C)`` tensors one under the other, each followed by its zero padding rows."""
    pads = [s - n for s, n in zip(plan.seg, plan.n)]
    z = parts[0].new_zeros((max(pads), parts[0].shape[1])) if max(pads) else None
    pieces = []
    for t, p in zip(parts, pads):
        pieces.append(t)
        if p:
            pieces.append(z[:p])
    return torch.cat(pieces)


def _gemm_nt(qa: QuantOut, pa: float, qb: QuantOut, pb: float, backend: str, out_dtype) -> torch.Tensor:
    """One expert's GEMM as ``fast._gemm_fn`` runs it on the carrier backend (``exact_carrier`` off)."""
    return _gemm.mx_gemm_nt(qa, qb, backend, out_dtype, pa * pb).to(out_dtype)


class _ExpertBackend(skeleton.Backend):
    """One expert's GEMMs for ``skeleton.forward`` and ``skeleton.backward``: each GEMM's two operands are slices of
    the operands ``_Grouped`` quantized for all experts together (``ops``: GEMM name -> ``(qa, pa, qb, pb)``), so
    the tensors the skeleton passes give only the shapes; the skeleton does the rest of the layer (the order of
    the GEMMs, the dtypes each result is cast to), as for every other form of the layer."""

    def __init__(self, backend: str, ops: dict):
        self.backend, self.ops = backend, ops

    def gemm(self, g, a, b, final, dims):
        qa, pa, qb, pb = self.ops[g.name]
        return _gemm_nt(qa, pa, qb, pb, self.backend, final)


# ---------------------------------------------------------------------------------------------- the two GEMMs

class _Grouped(torch.autograd.Function):
    """One of the experts' two GEMMs for every chosen expert: ``y_e = x_e w[e]^T``. The input is either the hidden
    states ``src`` (gathered here by the plan's tokens) or one ``(n_e, K)`` tensor per chosen expert (``parts``);
    the outputs are one ``(n_e, N)`` tensor per chosen expert, as the loop's ``mx_linear`` calls return them. The
    operands of all experts are quantized together here; each expert's layer then runs through
    ``skeleton.forward`` and ``skeleton.backward`` with an ``_ExpertBackend`` holding its slices."""

    @staticmethod
    def forward(ctx, call: _Call, weight, src, *parts):
        plan, qctx, backend = call.plan, call.qctx, call.backend
        if src is not None:
            xp = src.new_zeros((plan.rows, src.shape[1]))
            xp[plan.dest] = src[plan.tok_all]
        else:
            xp = _stack(parts, plan)
        dev, K = xp.device, xp.shape[1]
        out_dtype = call.amp if call.amp is not None else xp.dtype
        where = _settings.current().wgrad_x_for(K)   # (as skeleton.EagerLinear for a layer of K inputs)
        need_wgrad = call.grad and ctx.needs_input_grad[1] and where != "backward"
        with skeleton.no_autocast(dev.type):
            if need_wgrad:
                pre = fast._quant_pair(qctx, xp, "fprop_x", "fprop", "wgrad_x", "wgrad", backend,
                                       fast._b_group_rows(dev, backend), always=True, keep_b=where == "forward")
            else:
                pre = {"fprop_x": fast._quant(qctx, xp, 1, "fprop_x", "fprop", qctx.signs("fprop", dev), backend, 1)}
            qx, px = pre["fprop_x"]
            ys = tuple(skeleton.forward(_ExpertBackend(backend, {"fprop": (_a_rows(qx, o, n), px, qw, pw)}),
                                        xp[o:o + n], weight[e], None, out_dtype)
                       for (qw, pw), e, o, n in zip(_weights(call, weight, 1, "fprop_w", "fprop"), plan.experts,
                                                    plan.off, plan.n))
        ctx.call, ctx.x_dtype, ctx.n_parts = call, xp.dtype, len(parts)
        ctx.src_shape = None if src is None else src.shape
        ctx.kept = pre.get("wgrad_x")
        keep_x = call.grad and ctx.needs_input_grad[1] and where == "backward"
        ctx.save_for_backward(weight, xp if keep_x else None)
        return ys

    @staticmethod
    def backward(ctx, *dys):
        fast.state.activations.clear()   # (as the loop's backward: reused activations are not needed any more)
        call, plan = ctx.call, ctx.call.plan
        qctx, backend = call.qctx, call.backend
        weight, xp = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        n = ctx.needs_input_grad
        need_x, need_w = n[2] or any(n[3:]), n[1]
        dyp = _stack(dys, plan)
        dev, x_dtype = dyp.device, ctx.x_dtype
        dsrc, dparts, dw = None, [None] * ctx.n_parts, None
        with skeleton.no_autocast(dev.type):
            if need_x and need_w:
                pre = fast._quant_pair(qctx, dyp, "dgrad_dy", "dgrad", "wgrad_dy", "wgrad", backend, 1, always=True)
            elif need_x:
                pre = {"dgrad_dy": fast._quant(qctx, dyp, 1, "dgrad_dy", "dgrad", qctx.signs("dgrad", dev), backend, 1)}
            else:
                pre = {"wgrad_dy": fast._quant(qctx, dyp, 0, "wgrad_dy", "wgrad", qctx.signs("wgrad", dev), backend, 1)}
            # each expert's GEMMs: the skeleton's backward on slices of the operands quantized above
            ops = [{} for _ in plan.experts]
            if need_x:
                qd, pd = pre["dgrad_dy"]
                for op, (qw, pw), o, c in zip(ops, _weights(call, weight, 0, "dgrad_w", "dgrad"), plan.off, plan.n):
                    op["dgrad"] = (_a_rows(qd, o, c), pd, qw, pw)
            if need_w:
                qa, pa = pre["wgrad_dy"]
                if kept is not None:
                    qb, pb = kept
                    qb = fast.carrier_of(qb, backend, qctx)
                else:
                    qb, pb = fast._quant(qctx, xp, 0, "wgrad_x", "wgrad", qctx.signs("wgrad", dev), backend,
                                         fast._b_group_rows(dev, backend))
                for op, o, s, c in zip(ops, plan.off, plan.seg, plan.n):
                    op["wgrad"] = (_k_cols(qa, o, s, c), pa, _k_cols(qb, o, s, c), pb)
            dxs = []
            dw = torch.zeros_like(weight) if need_w else None
            for op, dy, e in zip(ops, dys, plan.experts):
                dx, dwe, _ = skeleton.backward(_ExpertBackend(backend, op), dy, None, weight[e], x_dtype,
                                               (need_x, need_w, False))
                dxs.append(dx)
                if need_w:
                    dw[e] = dwe
            if need_x:
                if ctx.src_shape is not None:
                    # the loop's sum: autograd adds its experts' gathers from the last expert to the first
                    dsrc = dxs[0].new_zeros(ctx.src_shape)
                    for tok, dx in zip(reversed(plan.tok), reversed(dxs)):
                        dsrc.index_add_(0, tok, dx)
                else:
                    dparts = dxs
        return (None, dw, dsrc, *dparts)


def forward(m, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            recipe) -> torch.Tensor:
    """The experts' output, as ``_experts.experts_forward`` with ``mx_linear`` per expert GEMM computes it, through
    the grouped GEMMs (the dispatcher decided that they apply: ``dispatch.experts_route``). The SwiGLU, the routing
    weights and the sum into each token's output run per expert, in the loop's order."""
    backend = _backend(hidden_states.device)
    plan = _Plan(top_k_index, m.num_experts, _gemm.k_multiple_for(backend))
    out = torch.zeros_like(hidden_states)
    if not plan.experts:
        return out
    call = _Call(Ctx(recipe), backend, autocast_dtype(hidden_states.device.type), torch.is_grad_enabled(), plan)
    hs = []
    for y in _Grouped.apply(call, m.gate_up_proj, hidden_states):
        gate, up = y.chunk(2, dim=-1)
        hs.append(m.act_fn(gate) * up)
    for y, pos, tok in zip(_Grouped.apply(call, m.down_proj, None, *hs), plan.pos, plan.tok):
        y = y * top_k_weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
