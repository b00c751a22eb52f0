"""The three GEMMs of an MX linear layer, written once over backends.

``Y = X W^T + b`` runs three GEMMs (the package docstring, ``mxtrain.linear``, states what each quantizes):

* Fprop  ``Y  (M, N) = X (M, K) . W (N, K)^T``, reduced along K (``FPROP``),
* Dgrad  ``dX (M, K) = dY (M, N) . W (N, K)``,  reduced along N (``DGRAD``),
* Wgrad  ``dW (N, K) = dY^T . X``,               reduced along M, the tokens (``WGRAD``).

``forward`` and ``backward`` are the layer, once: the shapes, the order of the GEMMs, the bias and its gradient,
and the dtypes each result is cast to. What differs between the forms of the layer is how one GEMM quantizes its
two operands and multiplies them, and which operands are made together from one read of a tensor; that is a
``Backend``'s:

* the reference (``reference.RefBackend``: the spec; per-tensor FP8 GEMMs on FP8 tensor cores, NVFP4 operands
  factored under autocast),
* the fast Hopper path (``fast.FastBackend``: fused Triton quantizers, the FP8-carrier GEMM),
* the layer compiled into the graph (``compiledmx``: the same kernels as ``triton_op``s, decided at trace time),
* per-tensor FP8 as traced operations (``tracedfp8``).

A GEMM's result comes back in the dtype ``final`` names where the backend's GEMM writes that dtype itself (a
bf16 output of a tensor-core GEMM), else in its accumulation dtype (``Backend.acc``: float32, float64 for
float64 inputs); ``forward`` and ``backward`` cast it after. Which backend runs a call is the dispatcher's
(``dispatch``): this module chooses nothing.

``EagerLinear`` is the autograd function of the eager forms (reference and fast): the forward keeps X, or the
Wgrad operand the backend made from X in the forward (``Backend.kept``), for the backward.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .. import settings as _settings

__all__ = ["Gemm", "FPROP", "DGRAD", "WGRAD", "GEMMS", "Backend", "forward", "backward", "EagerLinear",
           "no_autocast"]


class Gemm(NamedTuple):
    """One GEMM of the layer: its name, its operands A and B (``recipe.OPERANDS`` names) and the axis of each 2-D
    operand tensor the GEMM reduces along (1: the tensor's columns, its stored layout; 0: its rows, the tensor is
    used transposed). The product is ``op(A) op(B)^T`` with ``op(T) = T`` for axis 1 and ``T^T`` for axis 0."""
    name: str
    a: str
    a_axis: int
    b: str
    b_axis: int


FPROP = Gemm("fprop", "fprop_x", 1, "fprop_w", 1)      # X (M, K), W (N, K)
DGRAD = Gemm("dgrad", "dgrad_dy", 1, "dgrad_w", 0)     # dY (M, N), W (N, K)
WGRAD = Gemm("wgrad", "wgrad_dy", 0, "wgrad_x", 0)     # dY (M, N), X (M, K)
GEMMS = (FPROP, DGRAD, WGRAD)


class Backend:
    """How one form of the layer quantizes a GEMM's operands and multiplies them. Subclasses set ``acc`` and
    implement ``gemm``; ``start_forward`` and ``start_backward`` make the operands one read of a tensor gives
    (X's Fprop and Wgrad operands, dY's Dgrad and Wgrad operands) where the form does so.

    * ``acc``: the dtype the bias is added in and its gradient summed in.
    * ``autocast_off``: run the GEMMs with autocast off (entered only where autocast is on). The compiled layer
      enters no autocast context (a traced one inside an autograd function left autocast off for later layers).
    * ``kept``: after ``forward``, what the backward takes instead of X (X's Wgrad operand made in the forward),
      or None (then X is kept).
    """

    acc: torch.dtype = torch.float32
    autocast_off: bool = True
    kept = None

    def start_forward(self, x2: torch.Tensor, weight: torch.Tensor, need_wgrad: bool) -> None:
        """Before Fprop: X's operands made together (``need_wgrad``: a backward will compute dW from X's Wgrad
        operand made here, where the form makes one). Sets ``kept``."""

    def start_backward(self, dy2: torch.Tensor, weight: torch.Tensor, need: tuple) -> torch.Tensor:
        """Before Dgrad and Wgrad: dY's operands made together. Returns the 2-D dY the GEMMs read."""
        return dy2

    def gemm(self, g: Gemm, a: torch.Tensor, b: torch.Tensor | None, final: torch.dtype | None,
             dims: tuple[int, int, int]) -> torch.Tensor:
        """``op(a) op(b)^T`` of GEMM ``g`` with both operands quantized as the recipe says (``b`` None where its
        operand was kept from the forward). ``final``: the dtype the result is cast to next (None: the bias is
        added first, in ``acc``); ``dims``: (rows, columns, reduction) of the product."""
        raise NotImplementedError

    def save(self, ctx, x: torch.Tensor | None, weight: torch.Tensor) -> None:
        """Keep for ``EagerLinear``'s backward: ``x`` (None where ``kept`` stands in for it), the weight and
        ``kept`` (here as an attribute of ``ctx``, as the fast path keeps its operand; ``restore`` drops it)."""
        ctx.save_for_backward(x, weight)
        ctx.kept = self.kept

    @staticmethod
    def restore(ctx) -> tuple:
        """``(x, weight, kept)`` as ``save`` kept them."""
        x, weight = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        return x, weight, kept


def no_autocast(device_type: str, off: bool = True):
    """Autocast off inside where it is on (entering ``torch.autocast`` costs host time, so only then)."""
    return (torch.autocast(device_type, enabled=False) if off and torch.is_autocast_enabled(device_type)
            else contextlib.nullcontext())


def forward(be: Backend, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out_dtype: torch.dtype, need_wgrad: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``out_dtype`` (the autocast dtype under autocast, else ``x``'s), Fprop by
    ``be``. ``need_wgrad``: a backward will compute dW (``be.kept`` then holds what it keeps, where it keeps
    anything)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    with no_autocast(x.device.type, be.autocast_off):
        be.start_forward(x2, weight, need_wgrad)
        y = be.gemm(FPROP, x2, weight, out_dtype if bias is None else None, (x2.shape[0], N, K))
        if bias is not None:
            y = y + bias.to(be.acc)
    return y.to(out_dtype).reshape(*x.shape[:-1], N)


def backward(be: Backend, dy: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, x_dtype: torch.dtype,
             need: tuple[bool, bool, bool]) -> tuple:
    """(dX, dW, db) by ``be``; an entry is None where ``need`` says False. ``x``: the layer's input, or None where
    the backward has X's Wgrad operand from the forward (``be`` holds it); ``x_dtype``: X's dtype."""
    N, K = weight.shape
    dx = dw = db = None
    with no_autocast(dy.device.type, be.autocast_off):
        dy2 = be.start_backward(dy.reshape(-1, N), weight, need)
        M = dy2.shape[0]
        if need[0]:
            dx = be.gemm(DGRAD, dy2, weight, x_dtype, (M, K, N)).to(x_dtype).reshape(*dy.shape[:-1], K)
        if need[1]:
            x2 = x.reshape(-1, K) if x is not None else None
            dw = be.gemm(WGRAD, dy2, x2, weight.dtype, (N, K, M)).to(weight.dtype)
        if need[2]:
            db = dy2.to(be.acc).sum(0).to(weight.dtype)
    return dx, dw, db


class EagerLinear(torch.autograd.Function):
    """The layer as an autograd function for eager calls. ``make(x_dtype, weight, kept, where=None)`` builds the
    call's backend: for the forward with ``where``, the setting ``wgrad_x`` for this layer (``Settings.wgrad_x_for``:
    ``forward`` keeps X's Wgrad operand as packed FP4 codes, ``carrier`` as its GEMM's FP8 carrier, ``backward``
    keeps X); for the backward with ``kept``, what the forward's backend kept. ``grad``: the grad mode at the call
    (``needs_input_grad`` says True under ``torch.no_grad`` too, where no backward comes)."""

    @staticmethod
    def forward(ctx, x, weight, bias, make, out_dtype, grad: bool):
        where = _settings.current().wgrad_x_for(x.shape[-1])
        need_wgrad = grad and ctx.needs_input_grad[1] and where != "backward"
        be = make(x.dtype, weight, None, where)
        y = forward(be, x, weight, bias, out_dtype, need_wgrad)
        ctx.make, ctx.has_bias, ctx.x_dtype = make, bias is not None, x.dtype
        be.save(ctx, None if be.kept is not None else x, weight)
        ctx.restore = type(be).restore
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, kept = ctx.restore(ctx)
        n = ctx.needs_input_grad
        be = ctx.make(ctx.x_dtype, weight, kept)
        dx, dw, db = backward(be, dy, x, weight, ctx.x_dtype, (n[0], n[1], ctx.has_bias and n[2]))
        return dx, dw, db, None, None, None
