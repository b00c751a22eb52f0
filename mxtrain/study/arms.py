"""Arms of a study: a recipe, optionally with training options.

An arm is named ``RECIPE`` or ``RECIPE@OPTION`` (several options: ``RECIPE@A@B``): ``RECIPE`` is any name
``mxtrain.numerics.recipes.get`` knows (a preset, or ``PRESET+RULE``), each ``OPTION`` a name from ``OPTIONS``, which
turns on a training feature by training-config overrides applied to that arm's runs only (after the study's
own ``--set`` items, so the arm's option wins). ``mxfp4-all@deosc`` is ``mxfp4-all`` with weight
de-oscillation (``mxtrain.train.deosc``); ``--set deosc.period=50`` then tunes it for every arm that has it on.
Options in ``BRANCH_OPTIONS`` change a cooldown study's branches only: ``mxfp4-all@bf16cool`` trains the
stable run of ``mxfp4-all`` and cools it down in BF16 (how much of MXFP4's cost a high-precision end of
training recovers, as NVIDIA's NVFP4 recipe ends its runs). ``@lrVALUE`` sets the arm's peak learning rate
(``optim.lr``, over the study's ``--lr``): ``bf16@lr1.5e-3`` next to ``bf16`` and ``mxfp4-all@lr1.5e-3`` next to
``mxfp4-all`` tells in one study whether a recipe's cost holds at another learning rate.

Arm names are folder names (``OUT/runs/<arm>/seed<k>``): letters, digits and ``-``, ``+``, ``@``, ``.``, ``_``
only, all safe in file names on Linux, macOS and Windows.
"""

from __future__ import annotations

import re

from ..numerics import recipes as R
from ..errors import UserError

__all__ = ["OPTIONS", "BRANCH_OPTIONS", "split", "recipe_of", "overrides_of", "branch_overrides_of", "stable_base",
           "describe_options", "check", "is_arm"]

# option -> (training-config overrides, a short description for reports)
OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "deosc": (("deosc.enable=true",), "weight de-oscillation (OsciReset: TetraJet-v2, AMD ALTO)"),
    "bf16cool": ((), "cooldown branches in BF16 (train.switch_recipe at the branch point)"),
}
# option -> overrides of the arm's cooldown branches only, "{k}" the branch point (a cooldown study)
BRANCH_OPTIONS: dict[str, tuple[str, ...]] = {
    "bf16cool": ("train.switch_recipe={k}:bf16",),
}

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+@-]*$")
# @lrVALUE: the arm's peak learning rate, a positive decimal number (1.5e-3, 0.002)
_LR = re.compile(r"^lr((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)$")


def _lr(option: str) -> float | None:
    """The learning rate an ``lrVALUE`` option names (None for any other option, or a value not above 0)."""
    m = _LR.match(option)
    if not m:
        return None
    v = float(m.group(1))
    return v if 0 < v < float("inf") else None


def split(arm: str) -> tuple[str, list[str]]:
    """``(recipe, [options])`` of an arm name (not checked)."""
    recipe, *opts = arm.split("@")
    return recipe, opts


def recipe_of(arm: str) -> str:
    """The recipe name of an arm (``mxfp4-all`` for ``mxfp4-all@deosc``)."""
    return split(arm)[0]


def overrides_of(arm: str) -> list[str]:
    """The training-config overrides the arm's options add (``[]`` for a plain recipe)."""
    out: list[str] = []
    for o in split(arm)[1]:
        lr = _lr(o)
        out += [f"optim.lr={lr!r}"] if lr is not None else list(OPTIONS[o][0])
    return out


def branch_overrides_of(arm: str, k: int) -> list[str]:
    """The training-config overrides the arm's options add to its cooldown branch at step ``k`` (``[]`` for
    most arms): ``mxfp4-all@bf16cool`` trains its stable run as ``mxfp4-all`` and its branches in BF16."""
    out: list[str] = []
    for o in split(arm)[1]:
        out += [x.format(k=k) for x in BRANCH_OPTIONS.get(o, ())]
    return out


def stable_base(arm: str) -> str | None:
    """The arm whose stable run this arm's is, bit for bit, when every option of the arm changes only the
    cooldown branches (``mxfp4-all@bf16cool`` -> ``mxfp4-all``); None otherwise."""
    recipe, opts = split(arm)
    if not opts or any(o not in BRANCH_OPTIONS or OPTIONS[o][0] for o in opts):
        return None
    return recipe


def describe_options(arm: str) -> str:
    """The arm's options in words, ``""`` for a plain recipe."""
    return "; ".join(OPTIONS[o][1] if o in OPTIONS else f"learning rate {_lr(o):g}"
                     for o in split(arm)[1] if o in OPTIONS or _lr(o) is not None)


def check(arm: str) -> None:
    """UserError naming what is wrong with an arm name: an unsafe character, an unknown recipe or option."""
    if not isinstance(arm, str) or not _SAFE.match(arm):
        raise UserError(f"arm name {arm!r} must be a recipe name, optionally with @OPTION (letters, digits and "
                        f"- + @ . _ only; it names the arm's folder)")
    recipe, opts = split(arm)
    if not R.is_name(recipe):
        raise UserError(f"unknown recipe {recipe!r} in arm {arm!r}{R.did_you_mean(recipe)}; valid recipes: "
                        f"{', '.join(R.names())} "
                        f"(optionally +RULE, a scale rule for every MX operand, e.g. mxfp4-all+amd; and @OPTION, "
                        f"e.g. mxfp4-all@deosc)")
    for o in opts:
        if o not in OPTIONS and _lr(o) is None:
            hint = (" (a learning rate is @lr followed by a positive number, e.g. @lr1.5e-3)"
                    if o.startswith("lr") else "")
            raise UserError(f"unknown arm option {o!r} in arm {arm!r}{hint}; options: "
                            f"{', '.join(f'@{k} ({v[1]})' for k, v in OPTIONS.items())}, "
                            f"@lrVALUE (the arm's learning rate, e.g. @lr1.5e-3)")
    if len(set(opts)) != len(opts):
        raise UserError(f"arm {arm!r} names an option twice")
    if sum(_lr(o) is not None for o in opts) > 1:
        raise UserError(f"arm {arm!r} names two learning rates; give one @lrVALUE")


def is_arm(arm: str) -> bool:
    try:
        check(arm)
    except UserError:
        return False
    return True
