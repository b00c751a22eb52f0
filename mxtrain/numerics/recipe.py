"""Recipes: how each of the six GEMM operands of a linear layer is quantized.

A linear layer ``Y = X W^T`` runs three GEMMs, each with two operands quantized along that GEMM's
reduction axis:

=========  ===============  ===================  =====================================
GEMM       computes         operands             reduction axis (block / rotation axis)
=========  ===============  ===================  =====================================
Fprop      Y  = X  W^T      ``fprop_x``, ``fprop_w``    in-features  (X rows, W rows)
Dgrad      dX = dY W        ``dgrad_dy``, ``dgrad_w``   out-features (dY rows, W columns)
Wgrad      dW = dY^T X      ``wgrad_dy``, ``wgrad_x``   tokens       (dY columns, X columns)
=========  ===============  ===================  =====================================

Each operand has a format, rounding, scale rule and prescale (``Operand``); each GEMM has one
rotation (``Rotation``) applied to both of its operands, so the exact product is unchanged.
Layers can stay in high precision by module-name pattern or by block position.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field, fields, replace

from .formats import FORMATS, get_format
from .hadamard import ROTATION_SIZES, SIGN_MODES
from .quant import ALL_SCALE_RULES, REF_RULE_KIND, REF_SCALE_RULES, ROUNDINGS, ref_rule_error

__all__ = ["Operand", "Rotation", "Recipe", "OPERANDS", "GEMMS", "BF16", "NONE"]

OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
GEMMS = ("fprop", "dgrad", "wgrad")
_OPERAND_SET = frozenset(OPERANDS)
_ROTATION_FIELD = {g: f"{g}_rotation" for g in GEMMS}


def _as_int(value):
    """``value`` as a Python int if it is an integer (numpy integers included, bools not), else None."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    return int(value.__index__())


_F32_TINY, _F32_MAX = 2.0 ** -126, float.fromhex("0x1.fffffep+127")


def _check_float32(what: str, value: float) -> None:
    """A prescale is used in float32 (the operand times it, the GEMM output divided by the product of its two
    operands' prescales): a finite Python float that float32 rounds to inf or to zero or a subnormal makes every
    MX layer output only its bias, so it is refused here."""
    if not _F32_TINY <= abs(value) <= _F32_MAX:
        raise ValueError(f"{what} must be a normal float32 number (between {_F32_TINY:.4g} and {_F32_MAX:.4g}; "
                         f"it is used in float32), got {value!r}")


def _f32(x: float) -> float:
    """``x`` rounded to float32 (to nearest), as a Python float (inf past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _largest_prescale(fmt: str, scale_rule: str) -> tuple[float, float]:
    """``(bound, low)`` for a quantized format: the prescale multiplies the values after the scale was chosen (so
    the E8M0 scale's own range never limits it), and the scale puts a block's largest value at ``low`` or above
    before it. A prescale above ``bound`` = largest element / ``low`` pushes the largest value of every block past
    the format's largest element, where it saturates: no prescale that large can be meant. Values above 1 up to
    ``bound`` are legitimate where the scale rule leaves headroom (``ceil`` puts MXFP4 block maxima in (2, 4], so
    up to 1.5 none saturates and up to 3 some block still fits), and they trade saturation for resolution.

    ``low`` by the scale rule: MX ``floor`` 2**emax (MXFP4: 4, bound 1.5); ``ceil`` and ``adaptive`` above
    2**(emax - 1) (3); ``rceil`` above half the largest element (2); ``even``, ``amd`` 7/8 of 2**emax or above.
    NVFP4: the E4M3 block scale of ``amax / 6`` rounds up by at most 1/16 among its normal numbers (block maxima
    at 5.625 and above) but by up to 2x among its subnormals (a block 28672x below the tensor's largest: above 3),
    so ``low`` is 3 (bound 2); ``four_over_six`` may take the scale of ``amax / 4`` instead (above 2, bound 3).
    Per-tensor FP8: the one scale maps the tensor's largest value to the largest element itself (``m = max /
    amax``, rounded once to float32), so every prescale above 1 saturates it: bound 1 (below 1 leaves room, e.g.
    for stochastic rounding)."""
    f = get_format(fmt)
    elem = f.elem
    emax, top = elem.emax, elem.max
    if f.kind == "mx":
        low = {"floor": 2.0 ** emax, "rceil": top / 2, "even": 2.0 ** emax * (1 - 2.0 ** -(elem.mbits + 2)),
               "amd": 0.875 * 2.0 ** emax}.get(scale_rule, 2.0 ** (emax - 1))
    elif f.kind == "nvfp4":
        low = top / 3 if scale_rule == "four_over_six" else top / 2
    else:   # (per-tensor FP8)
        low = top
    return top / low, low


def _smallest_prescale(fmt: str, scale_rule: str) -> tuple[float, float]:
    """``(bound, high)`` for a quantized format: the block scale puts a block's largest value at ``high`` or below
    before the prescale (``floor`` and ``adaptive`` below 2**(emax + 1), ``ceil`` at 2**emax, ``rceil`` at the
    largest element, ``even`` below 2**emax * (2 - 2**-(mbits + 1)), ``amd`` below 1.75 * 2**emax; per-tensor FP8
    maps the tensor's largest value to the largest element; NVFP4's E4M3 block scale rounds down by up to 1.5x
    among its subnormals (a block 2e5 times below the tensor's largest), so a block's largest value stays below
    1.5 * 6 = 9; both with 2**-20 to spare for their float32 roundings). A prescale with ``prescale * high`` at
    or below half the smallest nonzero element (``bound`` = that half / ``high``) rounds every value of every
    block to zero: the operand is nothing. (Exact for MX formats: tests/robustness/test_prescale_lower_bound.py.)"""
    f = get_format(fmt)
    elem = f.elem
    emax = elem.emax
    if f.kind == "mx":
        high = {"ceil": 2.0 ** emax, "rceil": elem.max, "even": 2.0 ** emax * (2 - 2.0 ** -(elem.mbits + 1)),
                "amd": 1.75 * 2.0 ** emax}.get(scale_rule, 2.0 ** (emax + 1))
    else:
        high = (1.5 if f.kind == "nvfp4" else 1.0) * elem.max * (1 + 2.0 ** -20)
    return elem.min_subnormal / 2 / high, high


def _usable(fmt: str, scale_rule: str) -> str:
    lo, hi = _smallest_prescale(fmt, scale_rule)[0], _largest_prescale(fmt, scale_rule)[0]
    return f"usable prescales for {fmt} with scale rule {scale_rule} lie above {lo:.4g} and at most {hi:.4g}"


def _check_prescale_range(fmt: str, scale_rule: str, prescale: float) -> None:
    """The prescale as float32 (the operand is multiplied by it in float32) may not saturate every block."""
    if not get_format(fmt).quantized:
        return
    bound, low = _largest_prescale(fmt, scale_rule)
    if _f32(prescale) > bound:
        top = get_format(fmt).elem.max
        if get_format(fmt).kind == "tensor":
            why = (f"its per-tensor scale puts the tensor's largest value at {fmt}'s largest element {top:g} before "
                   f"the prescale, so any prescale above 1 makes it overflow and saturate")
        else:
            why = (f"the block scale puts a block's largest value at {low:g} or above before the prescale, so every "
                   f"block's largest value would overflow {fmt}'s largest element {top:g} and saturate")
        raise ValueError(f"prescale {prescale:g} is too large for {fmt} (scale rule {scale_rule}): {why}; use a "
                         f"prescale of at most {bound:.4g} ({_usable(fmt, scale_rule)}; below 1, e.g. 0.75, leaves room for "
                         f"stochastic rounding)")


def _check_prescale_small(fmt: str, scale_rule: str, prescale: float) -> None:
    """The prescale as float32 may not round every value of every block to zero: the quantizer rounds the float32
    product of a value and the float32 prescale (then scales it by a power of two, exactly), and a value at most
    half the smallest element (a power of two: ties go to zero) rounds to zero."""
    if not get_format(fmt).quantized:
        return
    bound, high = _smallest_prescale(fmt, scale_rule)
    half = get_format(fmt).elem.min_subnormal / 2
    if _f32(_f32(prescale) * high) <= half:
        raise ValueError(f"prescale {prescale:g} is too small for {fmt} (scale rule {scale_rule}): the block scale "
                         f"puts a block's largest value at {high:g} or below before the prescale, so every value "
                         f"would be at most {half:g}, half of {fmt}'s smallest nonzero element {2 * half:g}, and "
                         f"round to zero (to nearest; stochastic rounding keeps one now and then); "
                         f"{_usable(fmt, scale_rule)}")


def _choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"{what}: {value!r} is not valid; choose one of: {', '.join(map(str, valid))}")


@dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized.

    * ``fmt``: a format name (``mxtrain.format_names()``); ``bf16`` means not quantized.
    * ``rounding``: ``nearest`` or ``stochastic``.
    * ``scale_rule``: MX shared-exponent rule (``floor``, ``ceil``, ``rceil``, ``even``, ``amd``; or
      ``adaptive``: the reference quantizer, ``mxtrain.numerics.quant``, and the fast path's fused quantizers, not the
      compiled MX forms); for ``nvfp4``, ``four_over_six`` (the reference and the fused NVFP4 quantizer) chooses
      each block's scale by "Four over Six".
    * ``prescale``: multiply before quantizing; the GEMM output is divided by the operands' product. Only for a
      quantized operand (a ``bf16`` operand reaches its GEMM as it is: a prescale other than 1 there would be
      ignored, so it is refused; ``Recipe.with_`` setting ``fmt`` to ``bf16`` sets an inherited prescale to 1),
      and within the format's usable range (``_largest_prescale``, ``_smallest_prescale``).
    * ``block_2d``: NVFP4 only: 16x16 tiles (weights), so W and W^T quantize identically.
    """

    fmt: str = "bf16"
    rounding: str = "nearest"
    scale_rule: str = "floor"
    prescale: float = 1.0
    block_2d: bool = False

    def __post_init__(self):
        _choice("format", self.fmt, list(FORMATS))
        _choice("rounding", self.rounding, ROUNDINGS)
        _choice("scale_rule", self.scale_rule, ALL_SCALE_RULES)
        if self.scale_rule in REF_SCALE_RULES and get_format(self.fmt).kind not in (REF_RULE_KIND[self.scale_rule],
                                                                                    "none"):
            raise ValueError(ref_rule_error(self.scale_rule, self.fmt))
        if (isinstance(self.prescale, bool) or not isinstance(self.prescale, (int, float)) or not self.prescale > 0
                or not math.isfinite(self.prescale)):
            raise ValueError(f"prescale must be a positive finite number, got {self.prescale!r}")
        _check_float32("prescale", self.prescale)
        if not get_format(self.fmt).quantized and self.prescale != 1:
            raise ValueError(f"prescale {self.prescale:g} has no effect on a {self.fmt} operand: it is not "
                             f"quantized, its values reach the GEMM as they are (nothing multiplies them, nothing "
                             f"divides the output); leave the prescale at 1, or quantize the operand (fmt=mxfp4, ...)")
        _check_prescale_range(self.fmt, self.scale_rule, float(self.prescale))
        _check_prescale_small(self.fmt, self.scale_rule, float(self.prescale))
        if self.block_2d and self.fmt != "nvfp4":
            raise ValueError(f"block_2d (16x16 tiles) is only defined for nvfp4, not {self.fmt!r}")

    @property
    def quantized(self) -> bool:
        return get_format(self.fmt).quantized

    @property
    def block_size(self):
        return (16, 16) if self.block_2d else None


@dataclass(frozen=True)
class Rotation:
    """Blockwise Hadamard rotation of both operands of one GEMM along its reduction axis.

    ``size``: 0 (off), 16, 32, 64 or 128. ``signs``: ``none`` (deterministic), ``fixed`` (one random
    vector per run), ``per_layer``, ``per_step`` (re-drawn each optimizer step, per layer and GEMM).
    """

    size: int = 0
    signs: str = "none"

    def __post_init__(self):
        if _as_int(self.size) is None:
            raise ValueError(f"rotation size must be an integer, one of: 0, {', '.join(map(str, ROTATION_SIZES))}; "
                             f"got {self.size!r}")
        object.__setattr__(self, "size", _as_int(self.size))
        _choice("rotation size", self.size, (0,) + ROTATION_SIZES)
        _choice("rotation signs", self.signs, SIGN_MODES)

    @property
    def enabled(self) -> bool:
        return self.size > 0


BF16 = Operand()
NONE = Rotation()


@dataclass(frozen=True)
class Recipe:
    """Per-operand quantization of every linear layer, plus which layers stay in high precision.

    * ``fprop_x`` ... ``wgrad_x``: an ``Operand`` for each of the six GEMM operands.
    * ``fprop_rotation``, ``dgrad_rotation``, ``wgrad_rotation``: a ``Rotation`` per GEMM.
    * ``keep_hp``: fnmatch patterns of module names (e.g. ``"*.attn.wo"``) kept as ``nn.Linear``.
    * ``keep_first`` / ``keep_last``: number of leading / trailing transformer blocks kept as
      ``nn.Linear`` (blocks are the numbered children of the model's layer list).
    * ``seed``: seed of random rotation signs and of stochastic rounding.
    """

    name: str = "custom"
    fprop_x: Operand = BF16
    fprop_w: Operand = BF16
    dgrad_dy: Operand = BF16
    dgrad_w: Operand = BF16
    wgrad_dy: Operand = BF16
    wgrad_x: Operand = BF16
    fprop_rotation: Rotation = NONE
    dgrad_rotation: Rotation = NONE
    wgrad_rotation: Rotation = NONE
    keep_hp: tuple[str, ...] = ()
    keep_first: int = 0
    keep_last: int = 0
    seed: int = 0
    description: str = field(default="", compare=False)

    def __post_init__(self):
        for n in OPERANDS:
            if not isinstance(getattr(self, n), Operand):
                raise TypeError(f"Recipe.{n} must be an Operand, got {type(getattr(self, n)).__name__}")
        for g in GEMMS:
            if not isinstance(getattr(self, f"{g}_rotation"), Rotation):
                raise TypeError(f"Recipe.{g}_rotation must be a Rotation")
        if isinstance(self.keep_hp, str) or not all(isinstance(p, str) for p in self.keep_hp):
            raise TypeError("Recipe.keep_hp must be a tuple of name patterns")
        object.__setattr__(self, "keep_hp", tuple(self.keep_hp))
        for n in ("keep_first", "keep_last"):
            v = getattr(self, n)
            if _as_int(v) is None or v < 0:
                raise ValueError(f"Recipe.{n} must be a non-negative integer, got {v!r}")
            object.__setattr__(self, n, _as_int(v))
        if _as_int(self.seed) is None:
            raise ValueError(f"Recipe.seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", _as_int(self.seed))
        for g, (a, b) in zip(GEMMS, (("fprop_x", "fprop_w"), ("dgrad_dy", "dgrad_w"), ("wgrad_dy", "wgrad_x"))):
            pa, pb = getattr(self, a).prescale, getattr(self, b).prescale
            if pa != 1.0 or pb != 1.0:
                try:
                    _check_float32(f"the product of {a}.prescale and {b}.prescale (the {g} output is divided by it)",
                                   float(pa) * float(pb))
                except ValueError as e:
                    raise ValueError(f"{e} ({a}.prescale={pa!r}, {b}.prescale={pb!r})") from None
        # the recipe as one string (every field but the description): the argument of the custom ops,
        # and what a compiled ``mx_linear`` reads from a Recipe object (a plain attribute, no tracing)
        d = dataclasses.asdict(self)
        d.pop("description", None)
        object.__setattr__(self, "_json", json.dumps(d, sort_keys=True))
        # 2-D weight tiles must be consistent between Fprop and Dgrad, or W and W^T differ silently
        # only by choice; allowed, so nothing to check. A rotation on a GEMM with no quantized
        # operand is legal (it only costs time) and is kept.

    # -- helpers ----------------------------------------------------------------------------
    def operand(self, name: str) -> Operand:
        if not (isinstance(name, str) and name in _OPERAND_SET):
            _choice("operand", name, OPERANDS)
        return getattr(self, name)

    def rotation(self, gemm: str) -> Rotation:
        field_name = _ROTATION_FIELD.get(gemm) if isinstance(gemm, str) else None
        if field_name is None:
            _choice("GEMM", gemm, GEMMS)
        return getattr(self, field_name)

    @property
    def quantized(self) -> bool:
        """True if any operand is quantized or any GEMM rotated."""
        return self.memo("quantized", lambda r: any(getattr(r, n).quantized for n in OPERANDS) or any(
            r.rotation(g).enabled for g in GEMMS))

    def memo(self, key: str, fn):
        """``fn(self)``, computed once for this recipe (recipes are immutable): what a layer derives from its
        recipe at every call (is it quantized, which operands draw random bits, does the fast path run it)
        then costs a dictionary lookup. Not a field: equality, ``asdict`` and the JSON form ignore it."""
        m = self.__dict__.get("_memo")
        if m is None:
            m = self.__dict__["_memo"] = {}
        try:
            return m[key]
        except KeyError:
            v = m[key] = fn(self)
            return v

    def with_(self, **changes) -> "Recipe":
        """A copy with fields replaced; dotted keys reach into operands: ``{"wgrad_dy.rounding": "stochastic"}``.
        The dotted changes of one operand are made together (``{"fprop_x.fmt": "mxfp4", "fprop_x.prescale": 0.75}``
        on a bf16 operand, in either order); a whole value (``fprop_x=Operand(...)``) replaces the dotted changes
        given before it. Setting ``fmt`` to a format that is not quantized (``bf16``) without a prescale sets the
        operand's prescale to 1: one inherited from the recipe (``tseng``'s 3/4) would mean nothing there."""
        base: dict = {}
        sub: dict = {}
        for key, value in changes.items():
            head, _, rest = key.partition(".")
            if not any(f.name == head for f in fields(self)):
                raise ValueError(f"unknown recipe field {head!r}; fields: {', '.join(f.name for f in fields(self))}")
            if rest:
                inner = base.get(head, getattr(self, head))
                if not dataclasses.is_dataclass(inner):
                    raise ValueError(f"unknown recipe field {key!r}: {head} has no fields of its own")
                if not any(f.name == rest for f in fields(inner)):
                    raise ValueError(f"unknown recipe field {key!r}; fields of {head}: "
                                     f"{', '.join(f.name for f in fields(inner))}")
                sub.setdefault(head, {})[rest] = value
            else:
                base[head] = value
                sub.pop(head, None)
        top = dict(base)
        for head, ch in sub.items():
            inner = base.get(head, getattr(self, head))
            fmt = ch.get("fmt")
            if (isinstance(inner, Operand) and "prescale" not in ch and isinstance(fmt, str) and fmt in FORMATS
                    and not get_format(fmt).quantized):
                ch = {**ch, "prescale": 1.0}
            try:
                top[head] = replace(inner, **ch)
            except ValueError as e:
                if not str(e).startswith("prescale"):
                    raise
                k = "prescale" if "prescale" in ch else next(iter(ch))
                raise ValueError(f"{head}.{k}={ch[k]!r}: {e}") from None   # (names the operand)
        return replace(self, **top)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Recipe":
        d = dict(d)
        for n in OPERANDS:
            if n in d and isinstance(d[n], dict):
                d[n] = Operand(**d[n])
        for g in GEMMS:
            k = f"{g}_rotation"
            if k in d and isinstance(d[k], dict):
                d[k] = Rotation(**d[k])
        if "keep_hp" in d:
            d["keep_hp"] = tuple(d["keep_hp"])
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown recipe fields: {', '.join(sorted(unknown))}")
        return cls(**d)

    def summary(self) -> str:
        """One line per GEMM, for logs and reports."""
        lines = [f"recipe {self.name}"]
        for g, (a, b) in zip(GEMMS, (("fprop_x", "fprop_w"), ("dgrad_dy", "dgrad_w"), ("wgrad_dy", "wgrad_x"))):
            r = self.rotation(g)
            rot = f"H{r.size}/{r.signs}" if r.enabled else "no rotation"
            def d(o: Operand):
                if not o.quantized:
                    return "bf16"
                s = f"{o.fmt}{'(16x16)' if o.block_2d else ''} {o.rounding}"
                if get_format(o.fmt).kind == "mx" or o.scale_rule in REF_SCALE_RULES:   # (NVFP4: four_over_six)
                    s += f" {o.scale_rule}"
                if o.prescale != 1.0:
                    s += f" x{o.prescale:g}"
                return s
            lines.append(f"  {g}: {a.split('_', 1)[1]}={d(self.operand(a))}, {b.split('_', 1)[1]}={d(self.operand(b))}, {rot}")
        if self.keep_hp or self.keep_first or self.keep_last:
            lines.append(f"  high precision: first {self.keep_first}, last {self.keep_last} blocks; patterns {list(self.keep_hp)}")
        return "\n".join(lines)
