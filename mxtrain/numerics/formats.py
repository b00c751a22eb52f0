"""Number formats: element encodings and the block formats built from them.

References: OCP Microscaling Formats (MX) Specification v1.0 (2023), sections 5.1-5.3 (E8M0 scale,
FP8/FP6/FP4 element encodings); NVIDIA, "Pretraining Large Language Models with NVFP4",
arXiv 2509.25149, section 2 (NVFP4: E2M1 elements, 16-element blocks, E4M3 block scale and an
FP32 per-tensor scale); Zhao et al., "Rethinking Shrinkage Bias in LLM FP4 Pretraining: Geometric Origin,
Systemic Impact, and UFP4 Recipe", arXiv 2606.20381 (uniform 4-bit grids, "E1M2/INT4", with block scales:
``mxint4`` and ``mxe1m2`` below).

Uniform 4-bit grids. The paper's abstract names "E1M2/INT4-style uniform grids"; its exact element
definition and block-scale rule were not in the sources this project could read (only the abstract and
third-party summaries), so both readings are here, each with the MX block structure (32 elements, one E8M0
scale, the same scale rules as MXFP4):

* ``mxint4``: sign-magnitude integers -7 .. 7 (``INT4``: no exponent field, 3 magnitude bits; the
  symmetric INT4 range, -8 unused); ``emax`` 2, so the OCP floor rule puts block maxima in [4, 8);
* ``mxe1m2``: E1M2 (1 exponent bit, bias 1, 2 mantissa bits): magnitudes {0, 0.25, ..., 1.75}, the same
  grid divided by 4 (the 4-bit analogue of OCP MXINT8's fixed point); ``emax`` 0, block maxima in [1, 2).

With power-of-two scales the two are the same quantizer: their codes are equal and their E8M0 scales differ
by exactly 2 in the exponent, for every scale rule but ``even`` (which rounds the block maximum to the
element's mantissa width: 3 bits for INT4, 2 for E1M2) and except for blocks whose maximum is below about
2**-125, where E8M0's smallest scale 2**-127 leaves ``mxe1m2`` a finer step (2**-129) than ``mxint4``
(2**-127). Every value of either grid times a power of two within FP8 E4M3's range is exact in E4M3 (at most
3 significant bits; tests/numerics/test_ufp4.py checks it exhaustively), so an FP8 carrier runs them on Hopper:
``mxtrain.linear.fast`` takes both (the fused quantizer's INT4 and E1M2 grids, docs/kernels.md); the compiled MX
forms and the reference path's fused MX kernel take neither.

Element formats are described by (exponent bits, mantissa bits, bias, largest finite value). The
quantizer rounds onto the finite grid only and saturates to +-max, as hardware conversions with
saturation do; FP4 and FP6 have no Inf/NaN encodings at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ElemFormat", "Format", "ELEMENTS", "FORMATS", "REFERENCE_ONLY", "get_format", "format_names"]


@dataclass(frozen=True)
class ElemFormat:
    """A sign-magnitude floating-point element encoding.

    ``emin = 1 - bias`` is the exponent of the smallest normal number; subnormals are spaced
    ``2**(emin - mbits)``. ``emax`` is the exponent of the largest binade (OCP's ``emax_elem``).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float  # largest finite magnitude
    torch_dtype: str | None = None  # name of the torch dtype that stores one element, if any
    # Special codes: "none" (FP4/FP6: every code is finite), "fn" (E4M3: only S.1111.111 is NaN,
    # no Inf), "ieee" (E5M2: all-ones exponent is Inf with zero mantissa, NaN otherwise).
    special: str = "none"

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        return int(math.floor(math.log2(self.max)))

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)

    def decode(self, code: int) -> float:
        """Value of a bit pattern (sign bit highest), by the definition of the encoding.

        NaN and Inf codes of the FP8 encodings decode to NaN and +-Inf (OCP MX v1.0 section 5.3.3).
        """
        sign = -1.0 if (code >> (self.ebits + self.mbits)) & 1 else 1.0
        e = (code >> self.mbits) & ((1 << self.ebits) - 1)
        m = code & ((1 << self.mbits) - 1)
        all_e, all_m = (1 << self.ebits) - 1, (1 << self.mbits) - 1
        if self.special == "fn" and e == all_e and m == all_m:
            return float("nan")
        if self.special == "ieee" and e == all_e:
            return sign * float("inf") if m == 0 else float("nan")
        if e == 0:
            return sign * m * 2.0 ** (self.emin - self.mbits)
        return sign * (1.0 + m / 2**self.mbits) * 2.0 ** (e - self.bias)


E2M1 = ElemFormat("e2m1", 2, 1, 1, 6.0)
E2M3 = ElemFormat("e2m3", 2, 3, 1, 7.5)
E3M2 = ElemFormat("e3m2", 3, 2, 3, 28.0)
E4M3 = ElemFormat("e4m3", 4, 3, 7, 448.0, "float8_e4m3fn", "fn")
E5M2 = ElemFormat("e5m2", 5, 2, 15, 57344.0, "float8_e5m2", "ieee")
# uniform 4-bit grids (arXiv 2606.20381): E1M2 {0, 0.25, ..., 1.75}; INT4 {0, 1, ..., 7} as an encoding with no
# exponent field (every code "subnormal": m * 2**(emin - mbits) with emin = 1 - bias = 3, spacing 1)
E1M2 = ElemFormat("e1m2", 1, 2, 1, 1.75)
INT4 = ElemFormat("int4", 0, 3, -2, 7.0)

ELEMENTS = {f.name: f for f in (E2M1, E2M3, E3M2, E4M3, E5M2, E1M2, INT4)}


@dataclass(frozen=True)
class Format:
    """A tensor format: element encoding plus how scales are shared.

    ``kind``:
      * ``"mx"``: one E8M0 (power-of-two) scale per ``block_size`` elements along the axis;
      * ``"nvfp4"``: one E4M3 scale per 16 elements (or per 16x16 tile), times one FP32 tensor scale;
      * ``"tensor"``: one FP32 scale for the whole tensor (FP8 "current scaling");
      * ``"none"``: no quantization (``bf16``: the operand is used as it is).
    """

    name: str
    kind: str
    elem: ElemFormat | None
    block_size: int | None

    @property
    def quantized(self) -> bool:
        return self.kind != "none"

    @property
    def reference_only(self) -> bool:
        """On the reference path only the reference quantizer (``mxtrain.numerics.quant``) implements this format: no
        fused kernel of that path (``kernels/mxelem.py``) and no compiled form may be given it (the uniform 4-bit
        grids). The fast path has its own answer, ``mxtrain.linear.fast.supported``: it takes both."""
        return self.name in REFERENCE_ONLY


FORMATS = {
    f.name: f
    for f in (
        Format("mxfp4", "mx", E2M1, 32),
        Format("mxfp6_e2m3", "mx", E2M3, 32),
        Format("mxfp6_e3m2", "mx", E3M2, 32),
        Format("mxfp8_e4m3", "mx", E4M3, 32),
        Format("mxfp8_e5m2", "mx", E5M2, 32),
        Format("mxint4", "mx", INT4, 32),
        Format("mxe1m2", "mx", E1M2, 32),
        Format("nvfp4", "nvfp4", E2M1, 16),
        Format("fp8_e4m3", "tensor", E4M3, None),
        Format("fp8_e5m2", "tensor", E5M2, None),
        Format("bf16", "none", None, None),
    )
}


# formats that no kernel of the reference path and no compiled form runs (``Format.reference_only``; the fast
# path's fused quantizer takes both: ``mxtrain.kernels.mxfp4.carrier.KERNEL_FORMATS``)
REFERENCE_ONLY = frozenset({"mxint4", "mxe1m2"})


def format_names() -> list[str]:
    return list(FORMATS)


def get_format(name: str | Format) -> Format:
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown format {name!r}; valid formats: {', '.join(FORMATS)}"
        ) from None
