"""Fused Mixture-of-Experts weights: which Hugging Face experts modules ``convert`` turns into MX layers
(``fused_experts``). Their forward is the package's one experts loop (``mxtrain._experts.experts_forward``) with
each expert's GEMMs through ``mx_linear`` with the expert's own random-input state
(``mxtrain.linear.module.MXExperts``).

The modules are those of ``transformers``' ``@use_experts_implementation`` classes in the standard layout
(Mixtral's ``MixtralExperts``, Qwen3-MoE's ``Qwen3MoeExperts``, and others alike): ``gate_up_proj`` of shape
``(E, 2 I, H)`` with the gate rows first, ``down_proj`` of shape ``(E, H, I)``, no biases, not transposed, gated.

One ``mx_linear`` call per expert and projection, exact MX per GEMM; eagerly on the FP8-carrier fast path, recipes
that draw nothing at random run the grouped MX experts path instead (``mxtrain.linear.experts``: each operand of all
experts from one quantize launch, then one GEMM per expert; the same numbers), as ``dispatch.experts_route`` says.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ._constant import assume_constant_result
from .context import advances_calls
from .dispatch import _recipe_from_json
from ..numerics.recipes import get as get_recipe

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
        return ("not a transformers @use_experts_implementation experts module (layout flags and act_fn unknown; "
                "transformers 5.20 or newer builds Mixtral's and Qwen3-MoE's experts that way)")
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


@assume_constant_result
def advances_calls_json(recipe_json: str) -> bool:
    """``mxtrain.linear.context.advances_calls`` of a recipe given as ``MXLayer._mx_json`` (a constant to dynamo: a
    compiled forward reads no recipe object, whose memo would add guards)."""
    return advances_calls(_recipe_from_json(recipe_json) if recipe_json.startswith("{") else get_recipe(recipe_json))
