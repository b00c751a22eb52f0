"""Named recipes. Each preset is a function whose docstring cites where the recipe comes from.

``mxtrain.numerics.recipes.get(name)`` builds one, ``mxtrain.numerics.recipes.names()`` lists them. Presets
are plain ``Recipe`` values: derive variants with ``recipe.with_(**{"wgrad_dy.rounding": "stochastic"})``.
Papers: [AMD] Cim et al., arXiv 2605.09825; [Tseng] Tseng, Yu, Park, arXiv 2502.20586;
[NVIDIA] arXiv 2509.25149; [Quartet II] its published runs; [UFP4] Zhao et al., arXiv 2606.20381;
[4/6] Cook et al., "Four over Six", arXiv 2512.02010. Round-up scales ([Mishra] Mishra, Stosic, Layton,
arXiv 2506.08027: the ``rceil`` rule) are ``mxfp4-all+rceil`` (any preset ``+rceil``), on the fast path.
docs/numerics.md tabulates every preset. ``nvfp4-4over6`` runs on the reference path everywhere
(``mxtrain.numerics.quant.reference_only``); ``mxfp4-all-adaptive`` (the ``adaptive`` rule) and ``ufp4`` (the INT4
grid) take the fast path where the MXFP4 presets do (CUDA, the ``fast`` setting), and under ``torch.compile`` are
compiled into the graph (the setting ``mx_compiled_grids``, on; off, they run as the custom ops).
"""

from __future__ import annotations

import difflib
from typing import Callable

from .recipe import BF16, Operand, Recipe, Rotation
from .formats import get_format
from .quant import ALL_SCALE_RULES, REF_RULE_KIND

__all__ = ["get", "names", "register", "is_name"]

_REGISTRY: dict[str, Callable[[], Recipe]] = {}
_OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")


def register(name: str):
    def deco(fn: Callable[[], Recipe]):
        _REGISTRY[name] = fn
        return fn
    return deco


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str | Recipe) -> Recipe:
    """The preset called ``name`` (a ``Recipe`` passes through unchanged). ``PRESET+RULE`` (for example
    ``mxfp4-all-dh16+amd``) is the preset with scale rule RULE on every MX operand (``floor``, ``ceil``,
    ``rceil``, ``even``, ``amd``, ``adaptive``: ``mxtrain.numerics.quant.ALL_SCALE_RULES``), e.g. [AMD]'s ladder with
    its own rule; ``four_over_six`` goes on every NVFP4 operand instead (``nvfp4+four_over_six``)."""
    if isinstance(name, Recipe):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a recipe is a preset name (mxtrain.numerics.recipes.names()) or an mxtrain.Recipe, got "
                        f"{type(name).__name__} {name!r}")
    base, plus, rule = name.partition("+")
    try:
        fn = _REGISTRY[base]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}{did_you_mean(name)}; valid recipes: {', '.join(_REGISTRY)} "
                         f"(optionally +RULE, a scale rule for every MX operand)") from None
    r = fn()
    if plus:
        if rule not in ALL_SCALE_RULES:
            raise ValueError(f"unknown scale rule {rule!r} in recipe {name!r}; valid: {', '.join(ALL_SCALE_RULES)}")
        kind = REF_RULE_KIND.get(rule, "mx")   # (``four_over_six``: the NVFP4 operands)
        mx = [n for n in _OPERANDS if get_format(r.operand(n).fmt).kind == kind]
        if not mx:
            raise ValueError(f"recipe {name!r}: {base} has no {'MX' if kind == 'mx' else kind.upper()} operand for "
                             f"scale rule {rule!r}")
        r = r.with_(**{f"{n}.scale_rule": rule for n in mx})
    return r if r.name == name else r.with_(name=name)


def did_you_mean(name: str) -> str:
    """``" (did you mean mxfp4-all?)"`` for a misspelt recipe name (the closest presets; with a ``+RULE`` the closest
    rules too), or ``""`` when nothing is close."""
    base, plus, rule = str(name).partition("+")
    near = [base] if base in _REGISTRY else difflib.get_close_matches(base, list(_REGISTRY), n=2, cutoff=0.75)
    if plus and rule not in ALL_SCALE_RULES:
        rules = difflib.get_close_matches(rule, list(ALL_SCALE_RULES), n=1, cutoff=0.6)
        near = [f"{b}+{r}" for b in near for r in rules]
    else:
        near = [f"{b}{plus}{rule}" for b in near]
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def is_name(name: str) -> bool:
    """Does ``get(name)`` know ``name`` (a preset, or ``PRESET+RULE``)?"""
    try:
        get(name)
    except ValueError:
        return False
    return True


MX4 = Operand("mxfp4")
MX4_SR = Operand("mxfp4", rounding="stochastic")


def _all(op: Operand, **kw) -> dict:
    return {n: op for n in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")} | kw


@register("bf16")
def bf16() -> Recipe:
    """No quantization: every GEMM runs in the working precision (bf16 autocast on GPU, fp32 on CPU)."""
    return Recipe("bf16", description=bf16.__doc__)


@register("fp8")
def fp8() -> Recipe:
    """FP8 with per-tensor current scaling: E4M3 for X and W, E5M2 for the gradient dY.

    The "hybrid" FP8 format of Transformer Engine, used as the FP8 baseline by [AMD] and MLPerf.
    """
    e4, e5 = Operand("fp8_e4m3"), Operand("fp8_e5m2")
    return Recipe("fp8", fprop_x=e4, fprop_w=e4, dgrad_dy=e5, dgrad_w=e4, wgrad_dy=e5, wgrad_x=e4,
                  description=fp8.__doc__)


@register("mxfp8")
def mxfp8() -> Recipe:
    """MXFP8 (E4M3 elements, 32-element E8M0 blocks) on all six operands, OCP floor scales, RNE."""
    return Recipe("mxfp8", **_all(Operand("mxfp8_e4m3")), description=mxfp8.__doc__)


@register("mxfp4-fprop")
def mxfp4_fprop() -> Recipe:
    """[AMD] Table 1, row 2: MXFP4 (OCP floor scale, RNE) on the Fprop GEMM only; 8-9 % extra tokens there."""
    return Recipe("mxfp4-fprop", fprop_x=MX4, fprop_w=MX4, description=mxfp4_fprop.__doc__)


@register("mxfp4-fprop-dgrad")
def mxfp4_fprop_dgrad() -> Recipe:
    """[AMD] Table 1, row 3: MXFP4 on Fprop and Dgrad; 10-11 % extra tokens there."""
    return Recipe("mxfp4-fprop-dgrad", fprop_x=MX4, fprop_w=MX4, dgrad_dy=MX4, dgrad_w=MX4,
                  description=mxfp4_fprop_dgrad.__doc__)


@register("mxfp4-dgrad")
def mxfp4_dgrad() -> Recipe:
    """[Quartet II]'s split of the gap by GEMM: MXFP4 (OCP floor, RNE) on the Dgrad GEMM only."""
    return Recipe("mxfp4-dgrad", dgrad_dy=MX4, dgrad_w=MX4, description=mxfp4_dgrad.__doc__)


@register("mxfp4-wgrad")
def mxfp4_wgrad() -> Recipe:
    """[Quartet II]'s split: MXFP4 on the Wgrad GEMM only (at most 0.006 nats there); [AMD] finds Wgrad
    drives the cost."""
    return Recipe("mxfp4-wgrad", wgrad_dy=MX4, wgrad_x=MX4, description=mxfp4_wgrad.__doc__)


@register("mxfp4-bwd")
def mxfp4_bwd() -> Recipe:
    """MXFP4 on the backward GEMMs only (Dgrad and Wgrad, round to nearest), Fprop in BF16: with
    ``mxfp4-bwd-sr``, [Quartet II]'s RTN-against-SR comparison in the MXFP4 backward."""
    return Recipe("mxfp4-bwd", dgrad_dy=MX4, dgrad_w=MX4, wgrad_dy=MX4, wgrad_x=MX4, description=mxfp4_bwd.__doc__)


@register("mxfp4-bwd-sr")
def mxfp4_bwd_sr() -> Recipe:
    """``mxfp4-bwd`` with stochastic rounding on the gradient dY of Dgrad and Wgrad."""
    return Recipe("mxfp4-bwd-sr", dgrad_dy=MX4_SR, dgrad_w=MX4, wgrad_dy=MX4_SR, wgrad_x=MX4,
                  description=mxfp4_bwd_sr.__doc__)


@register("mxfp4-all")
def mxfp4_all() -> Recipe:
    """[AMD] Table 1, row 4: MXFP4 on all three GEMMs, no rotation; 26-27 % extra tokens there."""
    return Recipe("mxfp4-all", **_all(MX4), description=mxfp4_all.__doc__)


@register("mxfp4-all-sr")
def mxfp4_all_sr() -> Recipe:
    """[AMD] Table 1 SR row: MXFP4 everywhere, stochastic rounding on the gradient dY of Dgrad and Wgrad.

    The paper does not say which tensors got SR; this preset follows [NVIDIA] (SR on gradients
    only, RNE on weights and activations). "Does not converge" in [AMD] with all three GEMMs.
    """
    return Recipe("mxfp4-all-sr", **_all(MX4, dgrad_dy=MX4_SR, wgrad_dy=MX4_SR), description=mxfp4_all_sr.__doc__)


@register("mxfp4-all-rht16")
def mxfp4_all_rht16() -> Recipe:
    """[AMD] Table 1 randomized-Hadamard row: MXFP4 everywhere, H16 with random signs on every GEMM,
    re-drawn every optimizer step (shared by the two operands of each GEMM)."""
    rot = Rotation(16, "per_step")
    return Recipe("mxfp4-all-rht16", **_all(MX4, fprop_rotation=rot, dgrad_rotation=rot, wgrad_rotation=rot),
                  description=mxfp4_all_rht16.__doc__)


@register("mxfp4-all-dh16")
def mxfp4_all_dh16() -> Recipe:
    """[AMD] stabilized recipe: MXFP4 everywhere, deterministic H16 (no signs) on every operand of
    every GEMM; 8-9 % extra tokens over FP8 there (Table 1), +20 % step throughput (Table 2)."""
    rot = Rotation(16, "none")
    return Recipe("mxfp4-all-dh16", **_all(MX4, fprop_rotation=rot, dgrad_rotation=rot, wgrad_rotation=rot),
                  description=mxfp4_all_dh16.__doc__)


@register("mxfp4-all-dh32")
def mxfp4_all_dh32() -> Recipe:
    """[AMD] Table 1: as mxfp4-all-dh16 with 32-wide deterministic Hadamard blocks; also 8-9 % there."""
    rot = Rotation(32, "none")
    return Recipe("mxfp4-all-dh32", **_all(MX4, fprop_rotation=rot, dgrad_rotation=rot, wgrad_rotation=rot),
                  description=mxfp4_all_dh32.__doc__)


@register("mxfp4-all-dh16-fprop")
def mxfp4_all_dh16_fprop() -> Recipe:
    """One of issue #51's "cheapest levers on the forward": MXFP4 everywhere (OCP floor, RNE) with
    ``mxfp4-all-dh16``'s deterministic H16 (no signs) on the Fprop GEMM only (both its operands), Dgrad and
    Wgrad unrotated. Motivation: [Quartet II] and our own studies (docs/results.md) find the forward GEMM
    carries most of MXFP4's cost; against ``mxfp4-all`` and ``mxfp4-all-dh16`` it says how much of the
    rotation's gain the forward alone holds."""
    return Recipe("mxfp4-all-dh16-fprop", **_all(MX4, fprop_rotation=Rotation(16, "none")),
                  description=mxfp4_all_dh16_fprop.__doc__)


@register("mxfp4-all-bf16last")
def mxfp4_all_bf16last() -> Recipe:
    """One of issue #51's "cheapest levers on the forward": ``mxfp4-all`` with the last transformer block's
    linear layers in BF16 (``keep_last=1``; as [NVIDIA]'s high-precision last blocks, without its NVFP4).
    Motivation: [Quartet II] and our own studies (docs/results.md) find the forward carries most of MXFP4's
    cost, and the last block's output goes straight into the head. More blocks for one run:
    ``--set recipe.keep_last=N`` (docs/numerics.md)."""
    return Recipe("mxfp4-all-bf16last", **_all(MX4), keep_last=1, description=mxfp4_all_bf16last.__doc__)


@register("mxfp4-all-adaptive")
def mxfp4_all_adaptive() -> Recipe:
    """The E8M0 analogue of [4/6] ("Four over Six": per NVFP4 block, scale the maximum to 4 or to 6,
    whichever gives the lower error): MXFP4 everywhere (RNE, no rotation), each block's exponent OCP's floor
    or one more, whichever quantizes the block with the lower squared error (``adaptive``; ties keep floor).
    Reference path only (no kernel implements the rule yet)."""
    return Recipe("mxfp4-all-adaptive", **_all(Operand("mxfp4", scale_rule="adaptive")),
                  description=mxfp4_all_adaptive.__doc__)


@register("ufp4")
def ufp4() -> Recipe:
    """[UFP4] recipe: a uniform 4-bit grid instead of E2M1 on all three GEMMs, a random Hadamard rotation on
    all three GEMMs, stochastic rounding on the gradient dY only (Dgrad and Wgrad; RNE elsewhere).

    The grid is ``mxint4`` (integers -7..7, 32-element blocks, E8M0 scales by OCP's floor rule); the paper's
    own element definition, block size, scale rule and rotation size were not in the sources read (only the
    abstract): ``mxe1m2`` is the same quantizer here (docs/numerics.md), and the rotation is 16-wide with
    signs re-drawn every step, as ``mxfp4-all-rht16``, so the two differ in the grid and dY's rounding only.
    On the fast path (``mxtrain.linear.fast``: the fused quantizer's INT4 grid and the FP8-carrier GEMMs, exact as for
    MXFP4; its cuda tests passed on an H200, 2026-11-28/29: kernels, eager, compiled and under CUDA graphs,
    docs/kernels.md)."""
    u = Operand("mxint4")
    u_sr = Operand("mxint4", rounding="stochastic")
    rot = Rotation(16, "per_step")
    return Recipe("ufp4", **_all(u, dgrad_dy=u_sr, wgrad_dy=u_sr, fprop_rotation=rot, dgrad_rotation=rot,
                                 wgrad_rotation=rot), description=ufp4.__doc__)


@register("tseng")
def tseng() -> Recipe:
    """[Tseng] (code amazon-science/mxfp4-llm, mode 3): Fprop in BF16; Dgrad and Wgrad in MXFP4 with
    values pre-multiplied by 3/4, stochastic rounding on all four backward operands, and a random-sign
    H64 rotation re-drawn every step; each backward GEMM output is multiplied by 16/9."""
    op = Operand("mxfp4", rounding="stochastic", prescale=0.75)
    rot = Rotation(64, "per_step")
    return Recipe("tseng", dgrad_dy=op, dgrad_w=op, wgrad_dy=op, wgrad_x=op,
                  dgrad_rotation=rot, wgrad_rotation=rot, description=tseng.__doc__)


@register("nvfp4")
def nvfp4() -> Recipe:
    """[NVIDIA] section 4: NVFP4 everywhere; weights in 16x16 tiles (so W and W^T match); stochastic
    rounding on the gradient dY of Dgrad and Wgrad; one fixed random-sign H16 on both Wgrad operands;
    the first and last transformer blocks in high precision (NVIDIA kept 2 + 8 of 62 blocks at 12B;
    raise ``keep_first``/``keep_last`` for deep models)."""
    a = Operand("nvfp4")
    w = Operand("nvfp4", block_2d=True)
    g = Operand("nvfp4", rounding="stochastic")
    return Recipe("nvfp4", fprop_x=a, fprop_w=w, dgrad_dy=g, dgrad_w=w, wgrad_dy=g, wgrad_x=a,
                  wgrad_rotation=Rotation(16, "fixed"), keep_first=1, keep_last=1, description=nvfp4.__doc__)


@register("nvfp4-4over6")
def nvfp4_4over6() -> Recipe:
    """[4/6] Cook et al., "Four over Six", arXiv 2512.02010: the ``nvfp4`` preset ([NVIDIA]'s recipe) with each
    block's E4M3 scale chosen so that the block maximum maps to 6 (the standard scale) or to 4, whichever gives
    the lower squared error (``scale_rule="four_over_six"``; ties keep 6). On all six operands: the paper's
    abstract has every GEMM operand (weights, activations, gradients) in NVFP4 and 4/6 evaluating two scales
    "for each block of values", and the authors' code gives the rule to activations, weights and gradients
    alike (github.com/mit-han-lab/fouroversix, ``model/config.py``: one ``scale_rule`` for all three; its
    training configs set it per layer). The weights' 16x16 tiles take the rule per tile. NVFP4's tensor
    scale is kept (``amax / (6 * 448)``, where the authors' code uses ``6 * 256``: ``mxtrain.numerics.quant``'s
    docstring says why). Reference path only (``mxtrain.numerics.quant.reference_only``); also ``nvfp4+four_over_six``."""
    return nvfp4().with_(name="nvfp4-4over6", description=nvfp4_4over6.__doc__,
                         **{f"{n}.scale_rule": "four_over_six" for n in _OPERANDS})


_ = BF16  # re-exported name kept for users building recipes from this module
