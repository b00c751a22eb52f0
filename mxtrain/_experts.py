"""The experts loop of a fused Mixture-of-Experts module, with the GEMM as a parameter: the model's plain experts
(``mxtrain.model.llama.Experts``: ``F.linear``) and the MX experts (``mxtrain.linear.module.MXExperts``:
``mx_linear`` per expert GEMM) run this one loop (the MX experts' grouped path, ``mxtrain.linear.experts``, computes
the same numbers with the operands of all experts quantized together, in this loop's order: ``sorted_choices``).
Layer 0: it imports nothing of the package.

The loop is ``transformers``' eager experts forward (``MixtralExperts.forward``) with ``F.linear`` replaced by
``gemm``: the same routing (the block's router and its top-k are not touched), the same per-expert token order,
the same sums, so with a GEMM that is ``F.linear`` the output is the eager implementation's, bit for bit
(tests/linear/test_moe.py). The module ``m`` has ``gate_up_proj`` ``(E, 2 I, H)`` (gate rows first), ``down_proj``
``(E, H, I)``, ``act_fn`` and ``num_experts``.

Eagerly, each expert's (position, token) pairs come from one stable sort of the choices by expert and one read
of the counts by the host a call (``_groups``), in the order ``transformers``' ``torch.where`` per expert gives.

Under ``torch.compile``: the eager loop iterates over the experts that ``nonzero`` found and gathers each one's
tokens with ``torch.where``, whose output shapes depend on the data, so dynamo breaks the graph there (one graph
per piece between the breaks; ``fullgraph=True`` fails). With ``torch._dynamo.config.capture_dynamic_output_shape_ops
= True`` set before compiling, every expert runs in turn (a loop of static length), its token count an unbacked
symbol, so one graph serves every routing and nothing recompiles per step. Each expert's token rows are padded with
zero rows to the next multiple of ``ROW_MULTIPLE`` (at least one row: an expert no token chose runs on zero rows),
which leaves every real row's numbers as the eager loop's: MX blocks lie along the hidden axis in Fprop and Dgrad
(one token per row), and along the token axis in Wgrad, where the quantizer pads with zeros to a multiple of 32
anyway and a zero row's products are zero; stochastic rounding draws by element position, the same for the real
rows (tests/linear/test_moe.py: compiled losses equal eager bit for bit on CPU).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn

GEMMS_PER_EXPERT = 2   # gate_up_proj, down_proj: expert e's GEMMs are numbered 2 e and 2 e + 1
ROW_MULTIPLE = 32      # an expert's token rows are padded to a multiple of this under torch.compile (the MX block)

DYNAMO_HINT = ("mxtrain: experts compiled without torch._dynamo.config.capture_dynamic_output_shape_ops: the "
               "experts' loop breaks the graph at every expert (about 15 graphs a block; fullgraph=True fails). Set "
               "torch._dynamo.config.capture_dynamic_output_shape_ops = True before compiling for one graph that "
               "serves every routing (same numbers; docs/library.md)")
_warned = False


@torch.compiler.disable
def _warn_graph_breaks() -> None:
    """Said once a process, when dynamo meets the eager experts loop (a graph break here costs nothing more: the
    loop breaks the graph anyway)."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(DYNAMO_HINT, stacklevel=2)


def sorted_choices(top_k_index: torch.Tensor, num_experts: int) -> tuple:
    """The routing's choices sorted by expert: ``(experts, order, counts, host_counts)``, where choice ``p * N + t``
    is top-k position ``p`` of token ``t``; ``order`` lists the choices by expert (a stable sort, so each expert's
    in (position, token) order), ``experts`` is the expert of each choice in that order (``num_experts``, no expert,
    last), ``counts`` the choices of each expert (a device tensor of ``num_experts``) and ``host_counts`` the same
    as a list (the host's one read of the device)."""
    with torch.no_grad():
        flat = top_k_index.t().reshape(-1)                 # choice p * N + t: position p of token t
        experts, order = torch.sort(flat, stable=True)     # grouped by expert, each group in (p, t) order
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        return experts, order, counts, counts.tolist()     # (the host's one read)


def _groups(top_k_index: torch.Tensor, num_experts: int) -> tuple[list, dict]:
    """The eager loop's experts and each one's ``(pos, tok)``: the experts some token chose, in increasing order,
    and for expert e the (top-k position, token) pairs that chose it, ordered by position then token, which is
    ``torch.where(one_hot(top_k_index)[..., e].T)`` (``transformers``' eager loop), so every row and sum comes in
    the same order. One stable sort of the choices by expert and one read of the counts by the host a call,
    instead of a read per expert (``torch.where``'s output size) and an (E + 1, k, N) mask. An index equal to
    ``num_experts`` (no expert) is skipped, as there."""
    n_tok = top_k_index.shape[0]
    _, order, _, counts = sorted_choices(top_k_index, num_experts)
    experts, groups, start = [], {}, 0
    for e, c in enumerate(counts):
        if c:
            idx = order[start:start + c]
            experts.append(e)
            groups[e] = (idx // n_tok, idx % n_tok)
        start += c
    return experts, groups


def experts_forward(m: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor,
                    gemm: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """Each token's output: the sum over its chosen experts of the routing weight times the expert's SwiGLU, with
    ``gemm(x, weight, k)`` for ``F.linear(x, weight)``; ``k`` numbers the GEMM in the module
    (``GEMMS_PER_EXPERT * e + j``). Eagerly only the experts some token chose run, on their rows alone; compiled
    with ``capture_dynamic_output_shape_ops`` every expert, its rows padded (same numbers; module docstring)."""
    traced = False
    if torch.compiler.is_compiling():
        traced = bool(torch._dynamo.config.capture_dynamic_output_shape_ops)
        if not traced:
            _warn_graph_breaks()
    out = torch.zeros_like(hidden_states)
    if not torch.compiler.is_compiling():   # eagerly: one host read a call (_groups)
        experts, groups = _groups(top_k_index, m.num_experts)
    else:   # (dynamo: every expert (traced) or the nonzero ones, each found by torch.where, as transformers does)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=m.num_experts + 1).permute(2, 1, 0)  # (E+1, k, N)
            hit = None if traced else torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        experts, groups = (range(m.num_experts) if traced else hit), None
    for e in experts:
        if groups is None and not traced:
            e = int(e[0])
            if e == m.num_experts:
                continue
        pos, tok = groups[e] if groups is not None else torch.where(mask[e])
        x = hidden_states[tok]
        if traced:
            n = tok.size(0)
            x = torch.cat([x, x.new_zeros(ROW_MULTIPLE - n % ROW_MULTIPLE, x.size(-1))])
        gate, up = gemm(x, m.gate_up_proj[e], GEMMS_PER_EXPERT * e).chunk(2, dim=-1)
        y = gemm(m.act_fn(gate) * up, m.down_proj[e], GEMMS_PER_EXPERT * e + 1)
        if traced:
            y = y[:n]
        y = y * top_k_weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
