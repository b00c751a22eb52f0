"""Fused Mixture-of-Experts weights: which Hugging Face experts modules ``convert`` turns into MX layers, and
their forward with each expert's GEMMs through a given GEMM function (``mxtrain.linear.module.MXExperts`` passes
``mx_linear`` with the expert's own random-input state).

The modules are those of ``transformers``' ``@use_experts_implementation`` classes in the standard layout
(Mixtral's ``MixtralExperts``, Qwen3-MoE's ``Qwen3MoeExperts``, and others alike): ``gate_up_proj`` of shape
``(E, 2 I, H)`` with the gate rows first, ``down_proj`` of shape ``(E, H, I)``, no biases, not transposed, gated.
The forward below is ``transformers``' eager experts forward with ``F.linear`` replaced by ``gemm``: the same
routing (the block's router and its top-k are not touched), the same per-expert token order, the same sums, so
with a GEMM that is ``F.linear`` the output is the eager implementation's, bit for bit (tests/test_moe.py).

Reference numerics only: one ``mx_linear`` call per expert and projection, exact MX per GEMM; a grouped kernel
(all experts in one launch) is not built.

Under ``torch.compile``: the eager loop iterates over the experts that ``nonzero`` found and gathers each one's
tokens with ``torch.where``, whose output shapes depend on the data, so dynamo breaks the graph there (one graph
per piece between the breaks; ``fullgraph=True`` fails). With ``torch._dynamo.config.capture_dynamic_output_shape_ops
= True`` set before compiling, the forward is ``_traced_experts_forward``: every expert in turn (a loop of static
length), its token count an unbacked symbol, so one graph serves every routing and nothing recompiles per step.
Each expert's token rows are padded with zero rows to the next multiple of 32 (at least one row: an expert no token
chose runs on zero rows), which leaves every real row's numbers as the eager loop's: MX blocks lie along the hidden
axis in Fprop and Dgrad (one token per row), and along the token axis in Wgrad, where the quantizer pads with zeros
to a multiple of 32 anyway and a zero row's products are zero; stochastic rounding draws by element position, the
same for the real rows (tests/test_moe.py: compiled losses equal eager bit for bit on CPU).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn

from ._constant import assume_constant_result
from .context import advances_calls
from .dispatch import _recipe_from_json
from ..numerics.recipes import get as get_recipe

GEMMS_PER_EXPERT = 2   # gate_up_proj, down_proj: expert e's GEMMs are numbered 2 e and 2 e + 1

# the layout flags ``transformers.integrations.moe.use_experts_implementation`` sets on an instance, as they must be
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
           "has_post_expert_norm": False, "_is_expert_parallel": False}


def _default_gate(cls: type) -> bool:
    gate = getattr(cls, "_apply_gate", None)
    return gate is None or (gate.__name__ == "_default_apply_gate" and gate.__module__.startswith("transformers"))


def fused_experts(m: nn.Module) -> str | None:
    """None when ``m`` is a fused experts module that ``convert`` converts; else why not (for a module holding
    3-D parameters that is not one). ``m`` may be converted already."""
    own = dict(m.named_parameters(recurse=False))
    gu, down = own.get("gate_up_proj"), own.get("down_proj")
    if gu is None or down is None or set(own) != {"gate_up_proj", "down_proj"}:
        return "not a fused experts module with exactly the parameters gate_up_proj and down_proj"
    if not all(hasattr(m, k) for k in _LAYOUT) or not hasattr(m, "act_fn") or not hasattr(m, "num_experts"):
        return "not a transformers @use_experts_implementation experts module (layout flags and act_fn unknown)"
    off = [f"{k}={getattr(m, k)!r}" for k, v in _LAYOUT.items() if getattr(m, k) != v]
    if off:
        return "fused experts in a layout mxtrain does not convert (" + ", ".join(off) + ")"
    if not _default_gate(type(m)):
        return "fused experts with a gate function of their own (_apply_gate)"
    e = m.num_experts
    if (gu.ndim != 3 or down.ndim != 3 or gu.shape[0] != e or down.shape[0] != e or gu.shape[2] != down.shape[1]
            or gu.shape[1] != 2 * down.shape[2]):
        return (f"fused experts with shapes gate_up_proj {tuple(gu.shape)}, down_proj {tuple(down.shape)} (expected "
                f"({e}, 2 I, H) and ({e}, H, I))")
    return None


def experts_forward(m: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor,
                    gemm: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """``transformers``' eager experts forward (``MixtralExperts.forward``) with ``gemm(x, weight, k)`` for
    ``F.linear(x, weight)``; ``k`` numbers the GEMM in the module (``GEMMS_PER_EXPERT * e + j``). Under
    ``torch.compile`` with ``capture_dynamic_output_shape_ops`` on: ``_traced_experts_forward`` (same numbers)."""
    if torch.compiler.is_compiling():
        if torch._dynamo.config.capture_dynamic_output_shape_ops:
            return _traced_experts_forward(m, hidden_states, top_k_index, top_k_weights, gemm)
        _warn_graph_breaks()
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=m.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    for expert_idx in expert_hit:
        e = int(expert_idx[0])
        if e == m.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[e])
        current_state = hidden_states[token_idx]
        gate, up = gemm(current_state, m.gate_up_proj[e], GEMMS_PER_EXPERT * e).chunk(2, dim=-1)
        current_hidden_states = m.act_fn(gate) * up
        current_hidden_states = gemm(current_hidden_states, m.down_proj[e], GEMMS_PER_EXPERT * e + 1)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


DYNAMO_HINT = ("mxtrain: MX experts compiled without torch._dynamo.config.capture_dynamic_output_shape_ops: the "
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


ROW_MULTIPLE = 32   # an expert's token rows are padded to a multiple of this under torch.compile (the MX block)


def _traced_experts_forward(m: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor,
                            gemm: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """``experts_forward`` as one graph: every expert in turn (none skipped: no host read), each one's token
    count ``n`` an unbacked symbol, its rows padded with ``32 - n % 32`` zero rows (never none, so that the MX
    layer's routing never asks whether ``n`` is 0; a multiple of 32, as the traced GPU forms ask of every GEMM
    dimension), the padding's outputs dropped. The same sums in the same order as the eager loop."""
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=m.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)

    for e in range(m.num_experts):
        top_k_pos, token_idx = torch.where(expert_mask[e])
        n = token_idx.size(0)
        current_state = hidden_states[token_idx]
        pad = current_state.new_zeros(ROW_MULTIPLE - n % ROW_MULTIPLE, current_state.size(-1))
        current_state = torch.cat([current_state, pad])
        gate, up = gemm(current_state, m.gate_up_proj[e], GEMMS_PER_EXPERT * e).chunk(2, dim=-1)
        current_hidden_states = m.act_fn(gate) * up
        current_hidden_states = gemm(current_hidden_states, m.down_proj[e], GEMMS_PER_EXPERT * e + 1)[:n]
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))

    return final_hidden_states


@assume_constant_result
def advances_calls_json(recipe_json: str) -> bool:
    """``mxtrain.linear.context.advances_calls`` of a recipe given as ``MXLayer._mx_json`` (a constant to dynamo: a
    compiled forward reads no recipe object, whose memo would add guards)."""
    return advances_calls(_recipe_from_json(recipe_json) if recipe_json.startswith("{") else get_recipe(recipe_json))
