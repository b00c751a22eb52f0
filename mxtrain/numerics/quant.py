"""Reference quantizers: MX (OCP MX v1.0), NVFP4 and per-tensor FP8, in plain PyTorch.

This module is the oracle for every fast kernel in ``mxtrain.kernels``: the kernels must
produce bit-identical codes and scales. Every step is exact (power-of-two scaling, comparisons,
integer bit manipulation) or a single correctly rounded float32 operation (the NVFP4 and FP8 scale
arithmetic and divisions), so the result does not depend on the device or on evaluation order.

Pipeline for one tensor (``quantize``):

1. Upcast to float32 (bf16/fp16 exactly; float64 is rounded to float32 first), move ``axis``
   last, pad the axis with zeros
   to whole blocks.
2. Scale per block:

   * MX formats: ``amax`` of the block, shared exponent ``s`` by the scale rule (below), clamped
     to [-127, 127 - emax]; stored as the biased E8M0 code ``s + 127``. (The upper bound keeps
     ``max_elem * 2**s`` finite in float32, so a finite block never dequantizes to Inf; it binds
     only for the rules that round up, on block maxima of at least ``2**127``, which then fall
     back to ``floor`` and may saturate.) An all-zero block gets
     ``s = -127`` (code 0); a block holding NaN or +-Inf gets code 0xFF (NaN) and all its
     element codes are +0 (it dequantizes to NaN through the scale).
   * NVFP4: tensor scale ``g = amax(tensor) / (6 * 448)`` in float32 (1 if that is 0: an all-zero
     tensor, or one so tiny that the quotient underflows), block scale
     ``b = e4m3(amax(block) / (g * 6))`` rounded to nearest even and saturated at 448, element
     divisor ``d = float32(b) * g``. Non-finite values are left out of the tensor amax, and their
     block gets the E4M3 NaN scale.
   * per-tensor FP8 (current scaling as TransformerEngine and torchao's float8 define it): multiplier
     ``m = max_elem / amax`` in float32 (1 for an all-zero tensor; at most float32's max), and the
     scale ``1 / m`` in float32 that the codes dequantize with; both NaN if any element is not
     finite (``tensor_fp8_scales``).

3. Elements ``v = x / scale`` (MX and NVFP4: exact for power-of-two scales) or ``v = x * m``
   (per-tensor FP8, a float32 product), clamped to +-max_elem (saturation), then rounded onto the
   element grid:

   * ``nearest``: round half to even;
   * ``stochastic``: on magnitudes: with ``lo <= |v| <= hi`` the neighbouring grid magnitudes,
     ``|v|`` goes to ``hi`` iff ``u < (|v| - lo) / (hi - lo)`` (an exact float32 fraction), else to
     ``lo``; the sign is kept (a negative value that goes to 0 gives -0). ``u`` is the 24-bit
     uniform ``mxtrain.numerics.rng.uniform(i, rng.stream_key(seed))`` of the element's linear index ``i``
     in ``x``'s own (unpadded, contiguous row-major) layout. Unbiased for values inside the range
     (to within 2**-24 of the spacing); values beyond +-max saturate.

Scale rules for MX (``amax = sig * 2**E`` with ``1 <= sig < 2``, ``emax`` the element's
largest binade, ``max_elem`` its largest value):

* ``floor`` (OCP v1.0 section 6.3): ``s = E - emax``. Block maxima land in [2**emax, 2**(emax+1))
  and values above ``max_elem`` saturate (up to 25 % error on FP4's largest element).
* ``ceil``: ``s = ceil(log2 amax) - emax``; never saturates, may waste a binade.
* ``rceil``: the smallest ``s`` with ``amax <= max_elem * 2**s``, i.e. ``ceil(log2(amax / max_elem))``
  in exact arithmetic (NVIDIA's round-up rule); never saturates.
* ``even``: round ``sig`` to the element's mantissa width (half to even) first, then ``floor``.
* ``amd``: ``floor``, plus one when ``sig >= 1.75`` (ROCm Transformer Engine's MXFP4 cast adds
  2**21 to the float32 bit pattern and clears the mantissa). For FP4 this equals ``even``.
* ``adaptive`` (``REF_SCALE_RULES``; in the MXFP4 kernels too): per block, ``floor``'s exponent ``s`` or ``s + 1``,
  whichever gives the lower squared error of the block quantized with round-to-nearest-even (ties, e.g. a
  block both represent exactly, keep ``s``; ``s + 1`` only where it is within the clamp). The E8M0 analogue
  of "Four over Six" (Cook et al., arXiv 2512.02010: per NVFP4 block, scale the maximum to 4 or to 6,
  whichever errs less): ``s + 1`` halves the block onto the grid, so its near-maximal values land in the
  finer binades. The error is compared on the values the quantizer rounds (after ``prescale``), as
  ``sum((qa - qb) * (qa + qb - 2 v))`` in units of ``2**s`` (``qa``, ``qb`` the two candidates' rounded
  values, ``v`` the scaled value), each term and partial sum in float64: exact for FP4 and FP6 elements and
  blocks of 32 (every term is a multiple of one power of two and the sum stays below 2**53 of it), so the
  choice does not depend on summation order; for FP8 elements a near-tie may be decided by float64
  rounding. Stochastic rounding then rounds with the chosen scale (the choice itself is deterministic).

Scale rule for NVFP4 (any other rule leaves NVFP4's standard block scale):

* ``four_over_six`` (``REF_SCALE_RULES``; in the NVFP4 kernel too): "Four over Six" (Cook et al., arXiv 2512.02010).
  Per block (16 values, or a 16x16 tile), two candidate E4M3 block scales, both from the block maximum as the
  standard path computes its own: ``b6 = e4m3(amax / (g * 6))`` (the standard scale, bit for bit) and
  ``b4 = e4m3(amax / (g * 4))`` (``g * 4`` is exact), each rounded to nearest even and saturated at 448. Each
  candidate quantizes the block with round-to-nearest-even as the standard path does (``v = xs / float32(b * g)``);
  the block takes ``b4`` iff its squared error ``sum((q * b * g - xs)**2)`` (``q * b * g`` the exact NVFP4 value,
  as ``MXTensor.dequantize_factored`` gives it; ``xs`` the values after ``prescale``) is strictly lower than
  ``b6``'s; ties (e.g. a block both represent exactly, or an all-zero block) keep ``b6``. The comparison is
  exact for blocks of 16 (for 16x16 tiles, see below): ``err4 - err6 = g * (g * A - 2 * B)`` with ``A = sum(a**2 - c**2)``, ``B = sum(xs * (a - c))`` (``a``,
  ``c`` = ``q * b`` of the 4 and the 6 candidate: at most 6 significant bits); in float64 every square and
  difference of ``A`` is a multiple of ``2**(2k - 2)`` below ``2**25`` of it (``2**k`` the smaller candidate's
  E4M3 quantum; the two candidates' quanta differ by at most a factor 2), so ``A`` is exact (below ``2**29`` of
  that unit for 16 values, ``2**33`` for a tile of 256) and ``g * A`` (``g`` a float32: 24 significant bits) is
  exact for blocks of 16 and rounded once for 16x16 tiles, where a near tie may then keep ``b6`` or take ``b4``
  against the exact errors (the fused kernel rounds it the same way: bit-identical either way); every
  term of ``B`` is a multiple of ``ulp(x_min) * 2**(k - 1)`` (``x_min`` the smallest value some candidate does not
  flush to zero, which is above 1/36 of the block maximum) below ``2**40 * prescale`` of it, so ``B`` is exact
  for tiles of 256 and any prescale up to 16 (``Operand`` allows at most 3); the final subtraction is correctly
  rounded and keeps the exact sign. With stochastic rounding the choice is the same deterministic one and the
  elements are then rounded stochastically with the chosen scale (the authors' reference code compares the
  candidates after the operand's own rounding). With ``b4`` a normal E4M3 number below 448 the block maximum
  lands within 1/16 of 4 and rounds to 4 exactly.

  **The tensor scale is NVFP4's own, unchanged:** ``g = amax(tensor) / (6 * 448)``. Blocks whose maximum is
  above about 2/3 of the tensor's (``amax / (g * 4) > 448``) therefore get ``b4`` saturated at 448: their "4"
  candidate maps the block maximum to ``amax / (448 g)``, between 4 and 6, instead of to 4. The authors'
  reference code (github.com/mit-han-lab/fouroversix, ``quantize/reference.py``) instead divides the tensor
  maximum by ``6 * 256`` under its adaptive rules, so that ``1.5 * b6 <= 384`` never saturates. We keep ``g``
  because then the 6 candidate is the standard ``nvfp4`` block scale bit for bit, so per block the rule never
  errs more than ``nvfp4`` (tests/numerics/test_four_over_six.py), and the tensor scale is the same under both rules;
  the cost is a milder alternative on the blocks near the tensor maximum (with ``6 * 256`` every block scale
  would use 0.8 binade less of E4M3's range instead).

``prescale`` (e.g. 3/4, Tseng et al. arXiv 2502.20586, Algorithm 2) multiplies the values *after*
the scale was chosen from the unscaled block (one float32 multiply, before the exact division by the
scale): with the ``floor`` rule and 3/4, block maxima land in [3, 6) and nothing saturates, so
stochastic rounding stays unbiased at the block maxima; ``MXTensor.dequantize`` returns the quantized grid values (an
estimate of ``prescale * x``), and ``fake_quantize`` divides by ``prescale`` again. The linear
layer divides each GEMM output by the product of its operands' prescales instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import rng
from .formats import ElemFormat, Format, get_format, FORMATS

__all__ = [
    "MXTensor",
    "quantize",
    "fake_quantize",
    "SCALE_RULES",
    "REF_SCALE_RULES",
    "REF_RULE_KIND",
    "ALL_SCALE_RULES",
    "reference_only",
    "ROUNDINGS",
    "pow2",
    "round_to_elem",
    "mx_scale_exponent",
    "encode_elem",
    "elem_table",
    "warm_elem_tables",
    "pack_fp4",
    "unpack_fp4",
]

SCALE_RULES = ("floor", "ceil", "rceil", "even", "amd")   # every implementation has these (kernels included)
# rules that ``reference_only`` keeps on this module: the reference path's MX kernel (``kernels/mxelem.py``) and the
# compiled forms lack them; the NVFP4 kernel implements ``four_over_six`` (``kernels.nvfp4.KERNEL_RULES``) and the
# MXFP4 kernels ``adaptive`` (``kernels.mxfp4.launch.KERNEL_RULES``), each given it only where its caller admits it
REF_SCALE_RULES = ("adaptive", "four_over_six")
REF_RULE_KIND = {"adaptive": "mx", "four_over_six": "nvfp4"}   # the format kind each of them is defined for
ALL_SCALE_RULES = SCALE_RULES + REF_SCALE_RULES
ROUNDINGS = ("nearest", "stochastic")
E8M0_NAN = 255
MAX_BLOCK = 4096   # elements per MX block: far beyond any format's use (the OCP formats use 32)
NVFP4_TENSOR_MAX = 6.0 * 448.0


def reference_only(fmt: str | Format, scale_rule: str = "floor") -> bool:
    """Does only this module implement an operand of format ``fmt`` with ``scale_rule``? (A format of
    ``formats.REFERENCE_ONLY``, or a rule of ``REF_SCALE_RULES`` on a quantized operand.) Such an operand must
    never reach a fused kernel of the reference path or a compiled form: they implement ``SCALE_RULES`` and the
    formats before it only. (The fast path decides for itself, ``mxtrain.linear.fast.supported``: its fused quantizer
    has ``mxint4`` and ``mxe1m2`` and, of ``REF_SCALE_RULES``, the ``adaptive`` rule; the compiled MX layer takes
    those too, unless the setting ``mx_compiled_grids`` is off.)"""
    f = get_format(fmt)
    return f.quantized and (f.reference_only or scale_rule in REF_SCALE_RULES)


def ref_rule_error(scale_rule: str, fmt_name: str) -> str:
    """The one-line refusal of a rule of ``REF_SCALE_RULES`` on a format it is not defined for."""
    if REF_RULE_KIND[scale_rule] == "mx":
        return (f"scale rule {scale_rule!r} is defined for MX formats (E8M0 block scales), not {fmt_name!r} "
                f"(NVFP4's 4-over-6 choice is the rule 'four_over_six')")
    return (f"scale rule {scale_rule!r} is defined for nvfp4 (E4M3 block scales), not {fmt_name!r} "
            f"(its E8M0 analogue for MX formats is the rule 'adaptive')")


# ----------------------------------------------------------------------------------------------
# exact primitives


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**e`` for integer tensors with -149 <= e <= 127 (built from bits)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=0) << 23
    sub = torch.ones_like(e) << (e + 149).clamp(min=0, max=22)
    bits = torch.where(e >= -126, normal, sub)
    return bits.view(torch.float32)


def _floor_log2(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For finite a > 0: (E, sig) with a = sig * 2**E, 1 <= sig < 2 (sig exact, float32)."""
    m, ex = torch.frexp(a)
    return ex - 1, m * 2.0


def round_to_elem(v: torch.Tensor, elem: ElemFormat, rounding: str = "nearest",
                  u: torch.Tensor | None = None) -> torch.Tensor:
    """Round float32 ``v`` (finite) onto ``elem``'s grid, saturating to +-max.

    ``u`` (uniform [0, 1), same shape) is required for ``stochastic``. The result keeps the sign
    of ``v`` (negative values that round to zero give -0.0, as hardware converts do).
    """
    a = v.abs().clamp(max=elem.max)
    ex, _ = _floor_log2(a)
    e = ex.clamp(min=elem.emin)  # subnormal binade shares the spacing of the first normal one
    y = a * pow2(elem.mbits - e)  # exact: a / spacing
    if rounding == "nearest":
        r = torch.round(y)  # round half to even
    elif rounding == "stochastic":
        if u is None:
            raise ValueError("stochastic rounding needs uniforms u")
        fl = torch.floor(y)
        r = fl + (u < (y - fl)).to(y.dtype)
    else:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    q = (r * pow2(e - elem.mbits)).clamp(max=elem.max)
    return torch.copysign(q, v)


def _div_by_constant(a: torch.Tensor, c: float) -> torch.Tensor:
    """``a / c`` (``a`` finite) rounded as IEEE division in eager mode and under ``torch.compile``: inductor
    turns a division by a constant into a multiply by its reciprocal on GPUs (a different rounding unless
    ``c`` is a power of two); a divisor computed from ``a`` (``0 * a + c``, exactly ``c``) is not a constant."""
    return a / (a * 0.0 + c)


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def tensor_fp8_scales(amax: torch.Tensor, max_elem: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 current scaling from the float32 tensor ``amax``: ``(m, scale)``, 0-d float32 tensors.

    Every element is multiplied by ``m = max_elem / amax`` (in float32) before the saturating cast, and the
    codes dequantize with ``scale = 1 / m`` (the GEMM's scale): the definition of TransformerEngine's and
    torchao's float8 tensorwise scaling, so an ``fp8`` recipe's codes are theirs bit for bit (torchao
    additionally clamps ``amax`` at 1e-12; tests/numerics/test_torchao_agree.py). Both quotients are computed in
    float64 and rounded once to float32, which is the IEEE float32 quotient (a float64 quotient of float32
    numbers lands exactly on a float32 halfway point only when the exact quotient does), on every device and
    under ``torch.compile`` (whose float32 division on GPUs is an approximation). An all-zero tensor gets
    ``m = 1``; ``m`` is clamped to float32's max (``amax`` below ``max_elem / 3.4e38``); a non-finite ``amax``
    (NaN or Inf) gives NaN for both."""
    a = amax.to(torch.float64)
    a = torch.where(a > 0, a, torch.ones_like(a))
    m = (a * 0.0 + max_elem) / a   # a division by a, not a multiply by a reciprocal (``_div_by_constant``)
    m = torch.where(amax > 0, m, torch.ones_like(m)).clamp(max=_FLOAT32_MAX).to(torch.float32)
    m = torch.where(torch.isfinite(amax), m, torch.full_like(m, float("nan")))
    return m, (1.0 / m.to(torch.float64)).to(torch.float32)


def mx_scale_exponent(amax: torch.Tensor, elem: ElemFormat, rule: str) -> torch.Tensor:
    """Unbiased shared exponent (int32, in [-127, 127 - emax]) of finite block maxima by ``rule``.

    Zero maxima give -127. Non-finite maxima must be handled by the caller.
    """
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    E, sig = _floor_log2(safe)
    emax = elem.emax
    if rule == "floor":
        bump = torch.zeros_like(E)
    elif rule == "ceil":
        bump = (sig > 1.0).to(E.dtype)
    elif rule == "rceil":
        bump = (sig * 2.0**emax > elem.max).to(E.dtype)
    elif rule == "even":
        bump = (torch.round(sig * 2.0**elem.mbits) >= 2.0 ** (elem.mbits + 1)).to(E.dtype)
    elif rule == "amd":
        bump = (sig >= 1.75).to(E.dtype)
    elif rule in REF_SCALE_RULES:
        raise ValueError(f"scale rule {rule!r} chooses each block's exponent from all its values, not from its "
                         f"maximum: only mxtrain.numerics.quant.quantize computes it (the reference path); valid here: "
                         f"{', '.join(SCALE_RULES)}")
    else:
        raise ValueError(f"unknown scale rule {rule!r}; valid: {', '.join(SCALE_RULES)}")
    s = (E - emax + bump).clamp(-127, 127 - emax)  # upper bound: max_elem * 2**s < 2**128
    return torch.where(amax > 0, s, torch.full_like(s, -127)).to(torch.int32)


def _adaptive_exponent(xs: torch.Tensor, amax: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """The ``adaptive`` rule's exponent per block (module docstring): ``xs`` (..., nblocks, block) the values
    to be quantized (prescaled; 0 in non-finite blocks), ``amax`` (..., nblocks) the unscaled block maxima."""
    s0 = mx_scale_exponent(amax, elem, "floor")
    s1 = s0 + 1
    can = (amax > 0) & (s1 <= 127 - elem.emax)
    v = xs * pow2(-s0)[..., None]                                  # exact (power-of-two scaling)
    qa = round_to_elem(v, elem, "nearest")
    qb = round_to_elem(xs * pow2(-s1.clamp(max=127))[..., None], elem, "nearest") * 2.0   # in units of 2**s0
    qa64, qb64, v64 = qa.double(), qb.double(), v.double()
    d = ((qa64 - qb64) * (qa64 + qb64 - 2.0 * v64)).sum(-1)       # err(s0)**2 - err(s0 + 1)**2, summed
    return torch.where(can & (d > 0), s1, s0)


def _nvfp4_block_values(xs: torch.Tensor, b: torch.Tensor, g: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """float64 ``element * block scale`` (exact) of the finite values ``xs`` (..., nblocks, block) rounded to
    nearest even with E4M3 block scales ``b`` (..., nblocks) and tensor scale ``g``, as ``quantize`` rounds
    them: ``xs / float32(b * g)`` (0 where that divisor is 0)."""
    bf = b.to(torch.float32)
    d = bf * g
    ok = d > 0
    v = torch.where(ok[..., None], xs / torch.where(ok, d, torch.ones_like(d))[..., None], torch.zeros_like(xs))
    return round_to_elem(v, elem, "nearest").double() * bf.double()[..., None]


def _four_over_six(xs: torch.Tensor, b6: torch.Tensor, b4: torch.Tensor, g: torch.Tensor,
                   elem: ElemFormat) -> torch.Tensor:
    """The ``four_over_six`` choice per block (module docstring): True where the candidate ``b4`` gives the lower
    squared error than ``b6``. ``xs`` (..., nblocks, block) the values to be quantized (prescaled; 0 in
    non-finite blocks). With ``a``/``c`` the two candidates' ``element * block scale`` and ``x`` the values,
    ``err4 - err6 = g * (g * A - 2 * B)`` where ``A = sum(a*a - c*c)`` and ``B = sum(x * (a - c))`` (the
    ``x*x`` terms cancel), so the sign of ``g * A - 2 * B`` decides; every product and partial sum of ``A`` and
    ``B`` is exact in float64, and so is ``g * A`` for blocks of 16 (module docstring; for 16x16 tiles it is
    rounded once), the one subtraction rounds correctly, and a correctly rounded difference has the exact
    difference's sign: the choice is exact for blocks of 16."""
    a = _nvfp4_block_values(xs, b4, g, elem)
    c = _nvfp4_block_values(xs, b6, g, elem)
    A = (a * a - c * c).sum(-1)
    B = (xs.double() * (a - c)).sum(-1)
    return g.double() * A - 2.0 * B < 0


def encode_elem(q: torch.Tensor, elem: ElemFormat) -> torch.Tensor:
    """Bit codes (uint8, sign bit highest) of float32 values already on ``elem``'s grid."""
    a = q.abs()
    ex, _ = _floor_log2(torch.where(a > 0, a, torch.ones_like(a)))
    normal = a >= 2.0**elem.emin
    e = torch.where(normal, ex, torch.full_like(ex, elem.emin))
    mant = a * pow2(elem.mbits - e)  # integer-valued
    mant = torch.where(normal, mant - 2**elem.mbits, mant).to(torch.int32)
    efield = torch.where(normal, e + elem.bias, torch.zeros_like(e))
    sign = torch.signbit(q).to(torch.int32)
    code = (sign << (elem.ebits + elem.mbits)) | (efield << elem.mbits) | mant
    return code.to(torch.uint8)


def elem_table(elem: ElemFormat, device=None) -> torch.Tensor:
    """float32 value of every code of ``elem`` (2**bits entries), from the encoding's definition."""
    if torch.compiler.is_compiling():   # (traced: a constant of the graph; the cache is for eager calls)
        return torch.tensor([elem.decode(c) for c in range(2**elem.bits)], dtype=torch.float32, device=device)
    return _elem_table(elem, str(torch.device(device)) if device is not None else "cpu")


def warm_elem_tables(device) -> None:
    """Make the value table of every element format narrower than 8 bits on ``device`` now. Called where a
    layer reaches a GPU (``fast.state.prepare``): a table first made inside a CUDA graph's warm-up or
    capture would be memory of the graph's pool kept alive by this cache, which CUDA graph trees
    (``torch.compile(mode="reduce-overhead")``) refuse."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    for f in FORMATS.values():
        elem = getattr(f, "elem", None)
        if elem is not None and elem.bits < 8:
            elem_table(elem, d)


@functools.lru_cache(maxsize=64)   # a few formats x devices; ``_elem_table.cache_clear()`` forgets them
def _elem_table(elem: ElemFormat, device: str) -> torch.Tensor:
    return torch.tensor([elem.decode(c) for c in range(2**elem.bits)], dtype=torch.float32, device=device)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 FP4 codes (..., 2n) two per byte, lower index in the low nibble -> (..., n)."""
    lo, hi = codes[..., 0::2], codes[..., 1::2]
    return (lo | (hi << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_fp4``: (..., n) bytes -> (..., 2n) uint8 codes."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


# ----------------------------------------------------------------------------------------------
# the quantized tensor


@dataclass
class MXTensor:
    """A quantized tensor: element codes, scales, and how to read them back.

    Layout: ``data`` and ``scales`` have the quantization ``axis`` moved last (``movedim``) and
    padded with zeros to whole blocks. ``data`` holds element codes: ``torch.float4_e2m1fn_x2``
    (two FP4 codes per byte, lower index in the low nibble) for E2M1 formats, packed the same way as ``uint8``
    for the other 4-bit grids (``mxint4``, ``mxe1m2``), ``uint8`` codes
    (one per byte) for FP6, ``float8_e4m3fn``/``float8_e5m2`` for FP8. ``scales``: uint8 biased
    E8M0 exponents for MX formats (one per block; 255 = NaN), ``float8_e4m3fn`` for NVFP4 (one per
    16 elements, or per 16x16 tile), a float32 scalar for per-tensor FP8.
    """

    fmt: Format
    data: torch.Tensor
    scales: torch.Tensor | None
    shape: tuple[int, ...]
    axis: int
    block_size: int | tuple[int, int] | None
    global_scale: torch.Tensor | None = None  # NVFP4's float32 tensor scale g
    prescale: float = 1.0
    dtype: torch.dtype = torch.float32

    def codes(self) -> torch.Tensor:
        """Element codes as uint8, one per element (padded, axis-last layout)."""
        if self.fmt.elem.bits == 4:
            return unpack_fp4(self.data)
        if self.fmt.elem.bits == 8:
            return self.data.view(torch.uint8)
        return self.data

    def elements(self) -> torch.Tensor:
        """float32 element values before scaling (padded, axis-last layout)."""
        if self.fmt.elem.bits == 8:
            return self.data.to(torch.float32)
        return elem_table(self.fmt.elem, self.data.device)[self.codes().long()]

    def scale_values(self) -> torch.Tensor:
        """float32 multiplier of every element (padded, axis-last layout; NaN for NaN blocks)."""
        kind = self.fmt.kind
        padded = self.data.shape[:-1] + (self.codes().shape[-1],)
        if kind == "mx":
            s = self.scales.to(torch.int32) - 127
            val = torch.where(self.scales == E8M0_NAN, torch.full(s.shape, float("nan"), device=s.device),
                              pow2(s.clamp(-127, 127)))
            return val.repeat_interleave(self.block_size, dim=-1)
        if kind == "nvfp4":
            d = self.scales.to(torch.float32) * self.global_scale
            if isinstance(self.block_size, tuple):
                d = d.repeat_interleave(16, dim=-2)
            return d.repeat_interleave(16, dim=-1)
        return self.scales.to(torch.float32).expand(padded)

    def dequantize_factored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """NVFP4: ``(element * block scale, tensor scale)``: float32 values without the tensor scale, in the
        original shape and axis order, exact in bf16 and fp16 (at most 2 + 4 significant bits, magnitudes
        in [2**-10, 2688]), and the 0-d float32 tensor scale ``g``. Their product is the NVFP4 value before
        any rounding; ``dequantize`` rounds the block multiplier ``b * g`` to float32 first."""
        if self.fmt.kind != "nvfp4":
            raise ValueError(f"dequantize_factored is for NVFP4 tensors, not {self.fmt.name}")
        d = self.scales.to(torch.float32)
        if isinstance(self.block_size, tuple):
            d = d.repeat_interleave(16, dim=-2)
        v = self.elements() * d.repeat_interleave(16, dim=-1)
        return _unpad(v, self.shape, self.axis), self.global_scale.to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values ``element * scale`` in the original shape and axis order (prescale not undone)."""
        if not self.fmt.quantized:
            return self.data.to(dtype)
        v = self.elements() * self.scale_values()
        v = _unpad(v, self.shape, self.axis)
        return v.to(dtype)


def _moved_shape(shape, axis):
    s = list(shape)
    k = s.pop(axis)
    return s + [k]


def _unpad(v: torch.Tensor, shape, axis) -> torch.Tensor:
    ms = _moved_shape(shape, axis)
    v = v[..., : ms[-1]]
    if len(ms) >= 2:
        v = v[..., : ms[-2], :]
    return v.movedim(-1, axis)


def _check_args(x, f: Format, axis, block_size, rounding, scale_rule, prescale):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("cannot quantize a 0-d tensor along an axis; reshape it to 1-d")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for a {x.ndim}-d tensor")
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")
    if scale_rule not in ALL_SCALE_RULES:
        raise ValueError(f"unknown scale rule {scale_rule!r}; valid: {', '.join(ALL_SCALE_RULES)}")
    if scale_rule in REF_SCALE_RULES and f.kind != REF_RULE_KIND[scale_rule]:
        raise ValueError(ref_rule_error(scale_rule, f.name))
    if not (prescale > 0):
        raise ValueError(f"prescale must be positive, got {prescale}")
    if f.kind == "mx":
        bs = f.block_size if block_size is None else block_size
        if not isinstance(bs, int) or bs < 2 or bs % 2 or bs > MAX_BLOCK:
            raise ValueError(f"{f.name}: block_size must be an even integer from 2 to {MAX_BLOCK} (MX formats use 32), "
                             f"got {block_size!r}")
        return bs
    if f.kind == "nvfp4":
        bs = 16 if block_size is None else block_size
        if bs == (16, 16):
            if x.ndim < 2:
                raise ValueError("nvfp4 16x16 blocks need a tensor with at least 2 dimensions")
            return (16, 16)
        if bs != 16:
            raise ValueError(f"nvfp4: block_size must be 16 or (16, 16), got {block_size!r}")
        return 16
    if block_size is not None:
        raise ValueError(f"{f.name} uses one scale per tensor; block_size must be None")
    return None


def quantize(x: torch.Tensor, fmt: str | Format, *, axis: int = -1, block_size=None,
             rounding: str = "nearest", scale_rule: str = "floor", seed: int | None = None,
             prescale: float = 1.0, key: int | torch.Tensor | None = None) -> MXTensor:
    """Quantize ``x`` to ``fmt`` with blocks along ``axis``.

    **Arguments:**
      * ``x``: float32/bf16/fp16 (float64 is rounded to float32 first), any shape, CPU or CUDA.
      * ``fmt``: one of ``mxtrain.format_names()``.
      * ``axis``: the axis along which elements share a scale (the GEMM's reduction axis).
      * ``block_size``: elements per scale; default 32 for MX, 16 for NVFP4 (``(16, 16)`` for
        2-D tiles over the last two dimensions); must be ``None`` for per-tensor FP8.
      * ``rounding``: ``"nearest"`` (half to even) or ``"stochastic"``.
      * ``scale_rule``: MX shared-exponent rule: ``floor``, ``ceil``, ``rceil``, ``even``, ``amd``, or
        ``adaptive`` (this module only); for NVFP4 ``four_over_six`` (this module only) or any of the five
        others, which NVFP4 ignores (its standard block scale).
      * ``seed``: stochastic rounding seed; ``None`` draws one from torch's global generator.
      * ``prescale``: multiply values by this after the scales are chosen (e.g. 0.75).
      * ``key``: instead of ``seed``, the stream key itself (``rng.stream_key(seed)``): an int, or an
        int64 0-d tensor on ``x``'s device (read without a host synchronisation, so a CUDA graph
        replays with whatever key the tensor holds).

    **Returns:** an ``MXTensor``; ``.dequantize()`` gives the quantized values in ``x``'s shape.
    """
    f = get_format(fmt)
    bs = _check_args(x, f, axis, block_size, rounding, scale_rule, prescale)
    axis = axis % x.ndim
    shape = tuple(x.shape)
    if not f.quantized:
        return MXTensor(f, x, None, shape, axis, None, dtype=x.dtype)
    elem = f.elem
    xm = x.to(torch.float32).movedim(axis, -1)
    u = None
    if rounding == "stochastic":
        if key is None:
            if seed is None:
                seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
            key = rng.stream_key(seed)
        idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device).reshape(shape).movedim(axis, -1)
    K = xm.shape[-1]

    if f.kind == "tensor":
        finite = torch.isfinite(xm)
        absx = torch.where(finite, xm.abs(), torch.zeros_like(xm))
        amax = absx.amax() if absx.numel() else torch.zeros((), device=xm.device)
        amax = torch.where(finite.all(), amax, torch.full_like(amax, float("nan")))
        m, scale = tensor_fp8_scales(amax, elem.max)
        xs = xm * prescale if prescale != 1.0 else xm
        # (no host read of the scale: a CUDA graph may be capturing)
        v = torch.where(finite & torch.isfinite(m), xs * m, torch.zeros_like(xm))
        if rounding == "stochastic":
            u = rng.uniform(idx, key)
        q = round_to_elem(v, elem, rounding, u)
        data = q.to(getattr(torch, elem.torch_dtype))
        return MXTensor(f, data, scale, shape, axis, None, prescale=prescale, dtype=x.dtype)

    two_d = isinstance(bs, tuple)
    b = bs[1] if two_d else bs
    pad = (-K) % b
    rows_pad = (-xm.shape[-2]) % 16 if two_d else 0
    if pad or rows_pad:
        xm = F.pad(xm, (0, pad, 0, rows_pad) if two_d else (0, pad))
        if rounding == "stochastic":
            idx = F.pad(idx, (0, pad, 0, rows_pad) if two_d else (0, pad))
    if rounding == "stochastic":
        u = rng.uniform(idx, key)
    Kp = xm.shape[-1]
    lead = xm.shape[:-1]
    if two_d:  # (..., R, K) -> (..., R/16, 16, K/16, 16) -> tiles (..., R/16, K/16, 256)
        R = xm.shape[-2]
        xb = xm.reshape(*xm.shape[:-2], R // 16, 16, Kp // 16, 16).transpose(-3, -2)
        xb = xb.reshape(*xm.shape[:-2], R // 16, Kp // 16, 256)
        if u is not None:
            u = u.reshape(*u.shape[:-2], R // 16, 16, Kp // 16, 16).transpose(-3, -2).reshape(xb.shape)
    else:
        xb = xm.reshape(*lead, Kp // b, b)
        if u is not None:
            u = u.reshape(xb.shape)

    finite = torch.isfinite(xb)
    block_ok = finite.all(-1)
    absb = torch.where(finite, xb.abs(), torch.zeros_like(xb))
    amax = absb.amax(-1)

    if f.kind == "mx":
        xs = xb * prescale if prescale != 1.0 else xb
        if scale_rule == "adaptive":
            s = _adaptive_exponent(torch.where(block_ok[..., None], xs, torch.zeros_like(xs)), amax, elem)
        else:
            s = mx_scale_exponent(amax, elem, scale_rule)
        v = torch.where(block_ok[..., None], xs * pow2(-s)[..., None], torch.zeros_like(xb))
        q = round_to_elem(v, elem, rounding, u)
        scales = torch.where(block_ok, s + 127, torch.full_like(s, E8M0_NAN)).to(torch.uint8)
        gscale = None
    else:  # nvfp4
        tmax = amax.amax() if amax.numel() else torch.zeros((), device=xb.device)
        g = _div_by_constant(tmax, NVFP4_TENSOR_MAX)
        g = torch.where(g > 0, g, torch.ones_like(g))  # zero tensor, or g underflowed
        bsc = (amax / (g * 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn)
        xs = xb * prescale if prescale != 1.0 else xb
        if scale_rule == "four_over_six":   # (module docstring; 6 is the line above, 4 the same with g * 4)
            b4 = (amax / (g * 4.0)).clamp(max=448.0).to(torch.float8_e4m3fn)
            four = _four_over_six(torch.where(block_ok[..., None], xs, torch.zeros_like(xs)), bsc, b4, g, elem)
            bsc = torch.where(four, b4.to(torch.float32), bsc.to(torch.float32)).to(torch.float8_e4m3fn)
        bsc = torch.where(block_ok, bsc.to(torch.float32), torch.full_like(amax, float("nan"))).to(torch.float8_e4m3fn)
        d = bsc.to(torch.float32) * g
        ok = block_ok & (d > 0)
        v = torch.where(ok[..., None], xs / torch.where(ok, d, torch.ones_like(d))[..., None], torch.zeros_like(xb))
        q = round_to_elem(v, elem, rounding, u)
        scales, gscale = bsc, g

    if two_d:
        R = xm.shape[-2]
        q = q.reshape(*xm.shape[:-2], R // 16, Kp // 16, 16, 16).transpose(-3, -2).reshape(xm.shape)
    else:
        q = q.reshape(xm.shape)
    codes = encode_elem(q, elem)
    if elem.bits == 4:   # (E2M1 as torch's FP4 dtype; other 4-bit grids as packed uint8 codes, no dtype claims them)
        data = pack_fp4(codes)
        if elem.name == "e2m1":
            data = data.view(torch.float4_e2m1fn_x2)
    elif elem.bits == 8:
        data = q.to(getattr(torch, elem.torch_dtype))
    else:
        data = codes
    return MXTensor(f, data, scales, shape, axis, bs, global_scale=gscale, prescale=prescale, dtype=x.dtype)


def fake_quantize(x: torch.Tensor, fmt: str | Format, *, axis: int = -1, block_size=None,
                  rounding: str = "nearest", scale_rule: str = "floor", seed: int | None = None,
                  prescale: float = 1.0, key: int | torch.Tensor | None = None) -> torch.Tensor:
    """Quantize and dequantize: same arguments as ``quantize``; returns ``x``'s shape and dtype.

    With a ``prescale`` other than 1 the result is divided by it again, so it estimates ``x``.
    """
    mx = quantize(x, fmt, axis=axis, block_size=block_size, rounding=rounding,
                  scale_rule=scale_rule, seed=seed, prescale=prescale, key=key)
    if not mx.fmt.quantized:
        return x
    v = mx.dequantize(torch.float32)
    if prescale != 1.0:
        v = v / prescale
    return v.to(x.dtype)
