"""NVFP4 quantization in two passes (the ``nvfp4`` recipe's operand quantizer on a GPU).

``quantize_nvfp4_factored(x, axis, block_2d, rounding, key, prescale)`` gives the ``(values, g)`` that
``mxtrain.linear.context.fake_quantize_operand(..., factored=True)`` gives for an NVFP4 operand (the definition, bit
for bit: ``mxtrain.numerics.quant.quantize`` then ``MXTensor.dequantize_factored``) of an already rotated 2-D float32 or
bf16 tensor ``x``: the tensor scale ``g = tmax / (6 * 448)`` of the largest finite magnitude (1 if that is not
> 0), per block of 16 along ``axis`` (or 16x16 tile) the E4M3 block scale ``b = e4m3(amax / (g * 6))``
saturated at 448 (NaN for a block holding NaN or +-Inf), each element ``x * prescale / (b * g)`` (an IEEE
division) rounded onto E2M1 (half to even, or stochastically with the hash ``mxtrain.numerics.rng.uniform`` of the
element's row-major index in ``x``), and written as ``element * b`` (exact in bf16) in ``x``'s shape. A block
whose divisor ``b * g`` is 0 gives +0 everywhere, a non-finite block NaN everywhere (``+0 * NaN``), as the
reference does; negative values that round to zero stay -0.

Pass 1 is the tensor amax of the finite values (a Triton reduction to one partial maximum per program, then
a torch ``amax`` of those and the reference's own 0-d ops for ``g``: ``quant._div_by_constant``). Pass 2 is one
Triton kernel: one read of ``x``, one write of the values; ``g`` and a stochastic-rounding key given as a
tensor are read from device memory (no host synchronisation; a CUDA graph replays with the new ones). The
reference did the same in about twenty full-tensor PyTorch passes plus the int64 hash of every element.

With ``rot=16`` (the ``nvfp4`` recipe's Wgrad operands: a 16-wide Hadamard with one sign vector along the
quantization axis) ``x`` is the unrotated bf16/float32 operand and both passes rotate it as they read it
(``_tile``): pass 1 (``_rot_amax_kernel``) takes the amax of the rotated finite values, pass 2 rotates again
and quantizes, writing the rotated tensor's values (its axis padded to a multiple of 16; the stochastic-rounding
index is the row-major index in that padded shape): no float32 rotated copy and none of the torch rotation's
full-tensor passes (``hadamard(pad_axis(x))`` before the kernel, as other rotation sizes still run). The rotation is
``mxtrain.numerics.hadamard.hadamard``'s float32 arithmetic step for step: signs times the +0-padded values (so padding
next to a -1 sign is -0, as in the reference), butterfly stages h = 1, 2, 4, 8 (``mxfp4.device._bfly``), one
multiply by 0.25. A rotation block is exactly one NVFP4 block, so no block mixes real and wholly padded
rotation blocks (``factored_operand`` picks the route).

Why bit-exact: every step is the reference's float32 operation or exact. The block amax is a maximum; ``g * 6``,
``amax / (g * 6)`` (``div_rn``), ``b * g`` and ``x * prescale / d`` (``div_rn``) are single correctly rounded
float32 operations in the reference's order (so are the rotation's sign multiply, adds and subtracts and its
multiply by 0.25); the E4M3 rounding of the block scale is done with exact power-of-two
scaling built from bits and round-half-even through ``(y + 1.5 * 2**23) - 1.5 * 2**23`` (Triton's hardware
fp32->e4m3 cast wrote wrong bytes on sm_90 in some layouts: ``mxfp4/device.py``), as is the E2M1 rounding
(``device._fp4_round``, shared with the MXFP4 kernels); ``element * b`` is exact. The kernel is launched with
``enable_fp_fusion=False`` so that no multiply-add becomes an FMA. ``tests/kernels/test_nvfp4_kernel.py`` and
``tests/kernels/test_nvfp4_rot_kernel.py`` compare it with the reference; each variant (its key names the rotation) also
checks itself on its first GPU run (``nvfp4_ok``: the ``qselfcheck`` setting) and falls back where it differs:
a rotating variant to the torch rotation and the unrotated kernel, that one to the reference.
"""

from __future__ import annotations

import warnings

import torch

from .. import settings as _settings
from ..numerics.operand import compute_dtype, fake_quantize_operand, pad_axis
from ..numerics.quant import NVFP4_TENSOR_MAX, SCALE_RULES, _div_by_constant
from . import HAS_TRITON, INTERPRET, kernels_available
from .caches import CACHES
from ..numerics.formats import get_format
from ..numerics.hadamard import hadamard

__all__ = ["quantize_nvfp4_factored", "tensor_scale_nvfp4", "nvfp4_kernel_applies", "nvfp4_ok",
           "nvfp4_selfcheck", "factored_operand", "fused_rotation_applies", "kernel_rule", "KERNEL_RULES", "CALLS"]

# The scale rules the kernel takes: NVFP4's standard block scale (the MX rules of ``quant.SCALE_RULES``, which
# NVFP4 ignores) and ``four_over_six`` (``FOUR_SIX``), the one rule of ``quant.REF_SCALE_RULES`` defined for NVFP4.
KERNEL_RULES = SCALE_RULES + ("four_over_six",)


def kernel_rule(scale_rule: str) -> bool:
    """Does the NVFP4 kernel implement ``scale_rule``, though ``quant.reference_only`` names it a rule of the
    reference alone (``four_over_six``)? What ``Ctx.operand_factored`` asks before it gives such an operand to
    ``factored_operand``."""
    return scale_rule == "four_over_six"

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4.device import _bfly, _f32, _fp4_round, _uniform

    @triton.jit
    def _finite_amax_kernel(x_ptr, part_ptr, n, BLOCK: tl.constexpr):
        """One partial maximum of the finite |x| per program (0 where none)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = _f32(tl.load(x_ptr + offs, mask=offs < n, other=0.0))
        a = tl.abs(x)
        a = tl.where((x == x) & (a != float("inf")), a, 0.0)
        tl.store(part_ptr + tl.program_id(0), tl.max(a, axis=0))

    @triton.jit
    def _tile(x_ptr, signs_ptr, pid_m, pid_k, M, K, s_m, s_k, TM: tl.constexpr, NB: tl.constexpr,
              ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, IDX64: tl.constexpr):
        """The program's [TM, 16, NB, 16] piece of the logical (M, K) view of ``x`` in float32 (element (m, k) at
        ``x_ptr + m*s_m + k*s_k``; +0 outside it), with ``ROT`` 16: rotated along K as ``mxtrain.numerics.hadamard``
        rotates the +0-padded tensor (signs first, butterfly stages h = 1, 2, 4, 8 of ``mxfp4.device._bfly`` on a
        [TM*NB*2, 128] view whose rows hold 8 whole rotation blocks, then one multiply by 0.25). Returns (x, m, k)."""
        r = tl.arange(0, 16)
        m = pid_m * (TM * 16) + tl.arange(0, TM)[:, None, None, None] * 16 + r[None, :, None, None]
        k = pid_k * (NB * 16) + tl.arange(0, NB)[None, None, :, None] * 16 + r[None, None, None, :]
        if IDX64:
            m = m.to(tl.int64)
            k = k.to(tl.int64)
        x = _f32(tl.load(x_ptr + (m * s_m + k * s_k), mask=(m < M) & (k < K), other=0.0))
        if ROT == 16:
            # A rotation block is an NVFP4 block (16 along K from a multiple of 16). The reference pads the axis
            # with +0 to a multiple of 16 and then applies the signs, so its padding inside the last block is
            # sign * +0 (-0 where the sign is -1), as this masked load times the signs gives; blocks wholly past
            # the padded length (and rows past M) come out +-0, are never stored and only add |0| to maxima.
            if HAS_SIGNS:
                x = x * tl.load(signs_ptr + r)[None, None, None, :]
            BR: tl.constexpr = TM * NB * 2
            y = tl.reshape(x, [BR, 128])
            y = _bfly(y, BR, 1)
            y = _bfly(y, BR, 2)
            y = _bfly(y, BR, 4)
            y = _bfly(y, BR, 8)
            x = tl.reshape(y, [TM, 16, NB, 16]) * 0.25     # float32(1 / sqrt(16)), exact
        return x, m, k

    @triton.jit
    def _rot_amax_kernel(x_ptr, signs_ptr, part_ptr, M, K, s_m, s_k, TM: tl.constexpr, NB: tl.constexpr,
                         HAS_SIGNS: tl.constexpr, IDX64: tl.constexpr):
        """Pass 1 of a rotated operand: one partial maximum of the finite |rotated x| per program (0 where none),
        over the same pieces as ``_nvfp4_kernel``'s (``_tile``)."""
        x, m, k = _tile(x_ptr, signs_ptr, tl.program_id(0), tl.program_id(1), M, K, s_m, s_k, TM, NB, 16,
                        HAS_SIGNS, IDX64)
        a = tl.abs(x)
        a = tl.where((x == x) & (a != float("inf")), a, 0.0)
        a = tl.max(tl.max(tl.max(tl.max(a, axis=3), axis=2), axis=1), axis=0)
        tl.store(part_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), a)

    @triton.jit
    def _e4m3_scale(amax, gk):
        """E4M3 block scale ``amax / gk`` (IEEE division), saturated at 448, rounded half to even (the reference's
        ``(amax / (g * k)).clamp(max=448).to(float8_e4m3fn)``), as float32: exact power-of-two scaling built from
        bits and round-half-even through the add of 1.5 * 2**23 (module docstring)."""
        c = tl.minimum(tl.math.div_rn(amax, tl.zeros_like(amax) + gk), 448.0)
        E = ((c.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(E, -6)                           # E4M3: emin -6, 3 mantissa bits
        y = c * ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)            # c / spacing, exact (< 16)
        rr = (y + 12582912.0) - 12582912.0                                   # half to even
        return rr * ((127 - 3 + e) << 23).to(tl.float32, bitcast=True)       # back on the grid, exact

    @triton.jit
    def _block_values(xs, b, g):
        """float32 ``element * block scale`` (exact: at most 2 + 4 significant bits, no underflow) of the values
        ``xs`` rounded to nearest even onto E2M1 with block scale ``b`` (broadcast to ``xs``) and tensor scale
        ``g``, as ``quant._nvfp4_block_values`` rounds them: ``xs / float32(b * g)``, 0 where that divisor is 0."""
        d = b * g
        okd = d > 0.0
        v = tl.where(okd, tl.math.div_rn(xs, tl.where(okd, d, 1.0)), 0.0)
        q = _fp4_round(v, False, 0, 0)
        qs = (q.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                                bitcast=True)
        return qs * b

    @triton.jit
    def _four_over_six(xs, fin, b6, b4, g, TILE2D: tl.constexpr):
        """The ``four_over_six`` choice per block (``quant._four_over_six``): True where the candidate scale ``b4``
        gives a strictly lower squared error than ``b6``. ``xs`` [TM, 16, NB, 16] the values to be quantized
        (prescaled; ``fin`` where finite: the others count as 0, as the reference zeroes a non-finite block, whose
        scale is NaN whatever this says). With ``a`` and ``c`` the two candidates' ``element * block scale``, the
        sign of ``g * A - 2 * B`` decides, ``A = sum(a*a - c*c)``, ``B = sum(xs * (a - c))``, in float64 and in
        the reference's operations: every product, difference and partial sum of ``A`` and ``B`` is exact
        (``mxtrain.numerics.quant``'s docstring), so the sums do not depend on their order, and ``g * A`` and the final
        subtraction are the reference's two correctly rounded float64 operations, kept apart with contraction on
        or off (an FMA of the two could round differently)."""
        xz = tl.where(fin, xs, 0.0)
        a = _block_values(xz, b4, g).to(tl.float64)
        c = _block_values(xz, b6, g).to(tl.float64)
        ta = a * a - c * c
        tb = xz.to(tl.float64) * (a - c)
        A = tl.sum(ta, axis=3)                          # [TM, 16, NB]
        B = tl.sum(tb, axis=3)
        if TILE2D:
            A = tl.sum(A, axis=1)[:, None, :, None]     # [TM, 1, NB, 1]
            B = tl.sum(B, axis=1)[:, None, :, None]
        else:
            A = A[:, :, :, None]
            B = B[:, :, :, None]
        # (g * A as an FMA with +0: the reference's rounded product, which no contraction can fuse into the
        # subtraction; 2 * B is exact, so an FMA of it rounds the same difference)
        return tl.fma(g.to(tl.float64), A, 0.0) - 2.0 * B < 0.0

    @triton.jit(do_not_specialize=["key"])
    def _nvfp4_kernel(x_ptr, out_ptr, g_ptr, key64_ptr, signs_ptr, key, prescale, M, K, Ko, s_m, s_k, o_m, o_k,
                      i_m, i_k,
                      TM: tl.constexpr, NB: tl.constexpr, TILE2D: tl.constexpr, SR: tl.constexpr,
                      KEY_PTR: tl.constexpr, PRESCALE: tl.constexpr, IDX64: tl.constexpr, ROT: tl.constexpr = 0,
                      HAS_SIGNS: tl.constexpr = False, FOUR_SIX: tl.constexpr = False):
        """Logical (M, K) view of ``x`` (K: the quantization axis): element (m, k) at ``x_ptr + m*s_m + k*s_k``,
        its output at ``out_ptr + m*o_m + k*o_k`` (``ROT`` 0: the input's offset), its stochastic-rounding index
        ``m*i_m + k*i_k``. ``ROT`` 16: ``x`` is rotated first (``_tile``) and the output has ``Ko`` (K rounded
        up to a multiple of 16: the reference's padded axis) entries along K; ``ROT`` 0: ``Ko`` is ``K``. A
        program quantizes a [TM, 16, NB, 16] piece: rows ``16*TM`` from ``pid_m``, ``NB`` blocks of 16 from
        ``pid_k``. ``FOUR_SIX``: the ``four_over_six`` scale rule (``_four_over_six``: per block the E4M3 scale
        mapping the maximum to 4 or to 6, whichever errs less); False: NVFP4's standard block scale."""
        pid_m = tl.program_id(0)
        pid_k = tl.program_id(1)
        x, m, k = _tile(x_ptr, signs_ptr, pid_m, pid_k, M, K, s_m, s_k, TM, NB, ROT, HAS_SIGNS, IDX64)
        if ROT == 0:
            offs = m * s_m + k * s_k
            msk = (m < M) & (k < K)
        else:
            offs = m * o_m + k * o_k
            msk = (m < M) & (k < Ko)
        g = tl.load(g_ptr)
        # block maxima of the finite magnitudes, and whether the block is finite (padding reads 0)
        ax = tl.abs(x)
        fin = (x == x) & (ax != float("inf"))
        af = tl.where(fin, ax, 0.0)
        bad = tl.where(fin, 0, 1)
        amax = tl.max(af, axis=3)                       # [TM, 16, NB]
        nbad = tl.max(bad, axis=3)
        if TILE2D:
            amax = tl.max(amax, axis=1)                 # [TM, NB]
            nbad = tl.max(nbad, axis=1)
            amax = amax[:, None, :, None]
            nbad = nbad[:, None, :, None]
        else:
            amax = amax[:, :, :, None]
            nbad = nbad[:, :, :, None]
        # E4M3 block scale: amax / (g * 6) (IEEE division), saturated at 448, rounded half to even
        g6 = g * 6.0
        b = _e4m3_scale(amax, g6)
        if FOUR_SIX:   # the candidate mapping the block maximum to 4 where it errs less (g * 4: exact)
            if PRESCALE:
                xs = x * prescale
            else:
                xs = x
            b4 = _e4m3_scale(amax, g * 4.0)
            b = tl.where(_four_over_six(xs, fin, b, b4, g, TILE2D), b4, b)
        b = tl.where(nbad == 0, b, float("nan"))
        d = b * g
        ok = (nbad == 0) & (d > 0.0)
        if PRESCALE:
            x = x * prescale
        v = tl.where(ok, tl.math.div_rn(x, tl.where(ok, d, 1.0)), 0.0)
        if SR:
            idx = m * i_m + k * i_k
            if KEY_PTR:
                kk = tl.load(key64_ptr).to(tl.int32)      # the low 32 bits of the int64 key
            else:
                kk = key
            q = _fp4_round(v, True, idx, kk)
        else:
            q = _fp4_round(v, False, 0, 0)
        # the element with v's sign (+0 where the block is not quantized), times the block scale (exact)
        qs = (q.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                                 bitcast=True)
        el = tl.where(ok, qs, 0.0)
        tl.store(out_ptr + offs, (el * b).to(out_ptr.dtype.element_ty), mask=msk)


def tensor_scale_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """The reference's float32 tensor scale ``g`` of contiguous ``x`` (0-d, on ``x``'s device): the largest
    finite magnitude over 6 * 448, 1 if that is not > 0."""
    n = x.numel()
    if n == 0:
        tmax = torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        BLOCK = 4096
        nprog = triton.cdiv(n, BLOCK)
        part = torch.empty(nprog, dtype=torch.float32, device=x.device)
        _finite_amax_kernel[(nprog,)](x, part, n, BLOCK=BLOCK, num_warps=8)
        tmax = part.amax()
    return _scale_of_tmax(tmax)


def _scale_of_tmax(tmax: torch.Tensor) -> torch.Tensor:
    """The reference's 0-d ops from the largest finite magnitude to ``g`` (1 if not > 0)."""
    g = _div_by_constant(tmax, NVFP4_TENSOR_MAX)
    return torch.where(g > 0, g, torch.ones_like(g))   # zero tensor, or g underflowed


def _key_args(key, device):
    """(key as a signed int32 value, key tensor or None) for the kernel."""
    if isinstance(key, torch.Tensor):
        if key.dim() != 0 or key.dtype != torch.int64:
            raise ValueError("quantize_nvfp4_factored: a key tensor must be an int64 0-d tensor")
        return 0, key.to(device)
    k = int(key) & 0xFFFFFFFF
    return (k - (1 << 32) if k >= 1 << 31 else k), None


def _launch_config(axis: int, block_2d: bool) -> tuple[int, int, int]:
    """(TM, NB, num_warps): rows of 16 and blocks of 16 a program."""
    if INTERPRET:
        return 4, 8, 4          # fewer, larger programs for the interpreter
    return (2, 4, 4) if axis == 1 else (4, 2, 4)


def _signs_arg(signs, device) -> torch.Tensor | None:
    """The 16 rotation signs as a contiguous float32 tensor on ``device`` (the reference's ``signs.to(float32)``),
    or None."""
    if signs is None:
        return None
    return signs.to(device=device, dtype=torch.float32).reshape(-1).contiguous()


def fused_rotation_applies(x: torch.Tensor, rot: int, signs) -> bool:
    """Can ``quantize_nvfp4_factored`` rotate this operand itself? Only the 16-wide rotation (one rotation block
    per NVFP4 block) with no signs or one sign per block element (not one per axis element), of a non-empty
    float32/bf16/fp16 ``x`` (a float64 one rotates in float64: never the kernel)."""
    return (rot == 16 and x.ndim == 2 and x.numel() > 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (signs is None or (isinstance(signs, torch.Tensor) and signs.numel() == 16)))


def quantize_nvfp4_factored(x: torch.Tensor, axis: int = -1, block_2d: bool = False, rounding: str = "nearest",
                            key=None, prescale: float = 1.0, out_dtype: torch.dtype = torch.float32,
                            rot: int = 0, signs: torch.Tensor | None = None, scale_rule: str = "floor",
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, g)`` of 2-D float32/bf16 ``x`` as ``fake_quantize_operand(x, signs, key, axis, rot, "nvfp4",
    (16, 16) if block_2d else 16, rounding, "floor", prescale, factored=True)`` gives them (bit for bit):
    ``values`` in ``x``'s shape (with ``rot`` 16: the rotated tensor's, ``axis`` padded to a multiple of 16),
    dtype ``out_dtype`` (float32, or bf16/fp16: exact), ``g`` a 0-d float32 tensor.
    ``key``: the stochastic-rounding stream key (an int, or an int64 0-d tensor on ``x``'s device, read on the
    device), required for ``rounding="stochastic"``. ``rot``: 0 (``x`` is already rotated, or not rotated) or 16
    (both passes rotate ``x`` along ``axis`` by the 16-wide Hadamard with the 16 ``signs`` (None: all +1), as
    ``mxtrain.numerics.hadamard.hadamard`` of the +0-padded tensor does, reading ``x`` unrotated). ``scale_rule``:
    ``four_over_six`` (per block the E4M3 scale that maps the maximum to 4 or to 6, whichever errs less:
    ``mxtrain.numerics.quant``), or one of ``quant.SCALE_RULES``, which NVFP4 ignores (its standard block scale)."""
    if not HAS_TRITON:
        raise RuntimeError("quantize_nvfp4_factored needs Triton")
    if x.ndim != 2:
        raise ValueError(f"quantize_nvfp4_factored: expected a 2-D tensor, got {x.ndim}-d")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_nvfp4_factored: expected float32/bf16/fp16, got {x.dtype}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"unknown rounding {rounding!r}")
    if scale_rule not in KERNEL_RULES:
        raise ValueError(f"quantize_nvfp4_factored: scale rule {scale_rule!r} is not NVFP4's; valid: "
                         f"{', '.join(KERNEL_RULES)}")
    if not prescale > 0:
        raise ValueError(f"prescale must be positive, got {prescale}")
    if rot not in (0, 16):
        raise ValueError(f"quantize_nvfp4_factored rotates by 16-wide blocks only (rot 0 or 16), got {rot}")
    if rot == 0 and signs is not None:
        raise ValueError("quantize_nvfp4_factored: signs without a rotation")
    if signs is not None and signs.numel() != 16:
        raise ValueError(f"quantize_nvfp4_factored: expected 16 rotation signs, got {signs.numel()}")
    sr = rounding == "stochastic"
    if sr and key is None:
        raise ValueError("stochastic rounding needs a key")
    axis = axis % 2
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()           # (the kernel is specialized for 16-byte aligned pointers)
    R0, C0 = x.shape
    if axis == 1:
        M, K, s_m, s_k = R0, C0, C0, 1
    else:
        M, K, s_m, s_k = C0, R0, 1, C0
    Ko = -(-K // 16) * 16 if rot else K              # the reference pads the rotated axis to whole blocks
    oshape = (R0, Ko) if axis == 1 else (Ko, C0)
    o_m, o_k = (Ko, 1) if axis == 1 else (1, C0)     # the output's (contiguous) strides; the SR index
    out = torch.empty(oshape, dtype=out_dtype, device=x.device)
    idx64 = out.numel() >= 2**31 - 1
    TM, NB, nw = _launch_config(axis, block_2d)
    grid = (triton.cdiv(M, 16 * TM), triton.cdiv(K, 16 * NB))
    sg = _signs_arg(signs, x.device)
    if not rot:
        g = tensor_scale_nvfp4(x)
    elif x.numel() == 0:
        g = _scale_of_tmax(torch.zeros((), dtype=torch.float32, device=x.device))
    else:
        # pass 1: the finite amax of the rotated values, from the unrotated input
        part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
        _rot_amax_kernel[grid](x, sg if sg is not None else x, part, M, K, s_m, s_k, TM=TM, NB=NB,
                               HAS_SIGNS=sg is not None, IDX64=idx64, num_warps=nw, enable_fp_fusion=False)
        g = _scale_of_tmax(part.amax())
    if x.numel() == 0:
        return out, g
    kval, kt = _key_args(key, x.device) if sr else (0, None)
    ps = float(torch.tensor(prescale, dtype=torch.float32))
    _nvfp4_kernel[grid](x, out, g, kt if kt is not None else g, sg if sg is not None else g, kval, ps, M, K, Ko,
                        s_m, s_k, o_m if rot else s_m, o_k if rot else s_k, o_m, o_k,
                        TM=TM, NB=NB, TILE2D=bool(block_2d), SR=sr, KEY_PTR=kt is not None,
                        PRESCALE=ps != 1.0, IDX64=idx64, ROT=rot, HAS_SIGNS=sg is not None, num_warps=nw,
                        enable_fp_fusion=False, **_rule_consts(scale_rule))
    return out, g


def _rule_consts(scale_rule: str) -> dict:
    """The kernel's constexpr of the scale rule: ``FOUR_SIX`` for ``four_over_six`` only (the standard rule's
    launches keep their constexprs, variants and code as before the rule came)."""
    return {"FOUR_SIX": True} if scale_rule == "four_over_six" else {}


# ----------------------------------------------------------------------------------------------
# where the kernel serves the reference path, and its runtime self-check


def nvfp4_kernel_applies(t: torch.Tensor, fmt: str, block_size, rounding: str, scale_rule: str = "floor",
                         st=None) -> bool:
    """Does ``fake_quantize_operand(t, ..., factored=True)`` of this NVFP4 operand run through the kernel? The
    ``nvfp4_kernel`` setting: ``auto`` on CUDA tensors, ``always`` also on CPU under Triton's interpreter
    (tests), ``off`` never. Only 2-D float32/bf16/fp16 operands, never inside a ``torch.compile`` trace, with a
    scale rule of ``KERNEL_RULES``."""
    st = st or _settings.current()
    mode = st.nvfp4_kernel
    if mode == "off" or not HAS_TRITON or t.ndim != 2 or t.dtype not in (torch.float32, torch.bfloat16,
                                                                            torch.float16):
        return False
    if (block_size not in (None, 16, (16, 16)) or rounding not in ("nearest", "stochastic")
            or scale_rule not in KERNEL_RULES):
        return False
    if get_format(fmt).kind != "nvfp4" or torch.compiler.is_compiling():
        return False
    if t.device.type == "cuda":
        return True
    return mode == "always" and kernels_available(t.device)


def _variant_key(x: torch.Tensor, axis: int, block_2d: bool, sr: bool, key_ptr: bool, prescale: float,
                 rot: int = 0, has_signs: bool = False, scale_rule: str = "floor"):
    """The kernel variant of input ``x`` (for ``rot`` 16: the unrotated operand the kernel rotates; its 64-bit
    offsets follow the padded output's size; ``four_over_six`` adds itself at the end)."""
    R0, C0 = x.shape
    n = x.numel()
    if rot:
        n = (-(-R0 // 16) * 16) * C0 if axis % 2 == 0 else R0 * (-(-C0 // 16) * 16)
    key = ("nvfp4", x.device.index, x.dtype, axis % 2, bool(block_2d), sr, key_ptr, prescale != 1.0,
           R0 % 16 == 0, C0 % 16 == 0, R0 == 1, C0 == 1, n >= 2**31 - 1)
    # (the unrotated variants keep their keys as they were; a rotated one adds its rotation and signs)
    if rot:
        key = key + (("rot", rot, bool(has_signs)),)
    return key + (("rule", scale_rule),) if _rule_consts(scale_rule) else key


def _adversarial(R: int, C: int, seed: int = 99) -> torch.Tensor:
    """Magnitudes over many binades, ties, a zero block, tiny values, a NaN and an Inf block (CPU float32)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    Rb, Cb = max(R, 8), max(C, 24)
    t = torch.randn(Rb, Cb, generator=gen) * torch.exp2(torch.randint(-20, 20, (Rb, Cb), generator=gen).float())
    t[0, :16] = 0.0
    t[1, :8] = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, -5.0])
    t[2, 3] = 1e-40
    t[-2, 5] = float("inf")
    t[5, -3] = -float("inf")
    t = t[:R, :C].clone()
    if t.numel() > 16:
        t[-1, -1] = float("nan")
    return t


def _mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Entries of equal-shaped ``a`` and ``b`` that differ in their float32 bits (NaN matches any NaN: NaN
    payloads may differ)."""
    ia, ib = a.float().view(torch.int32), b.float().view(torch.int32)
    return int((~((ia == ib) | (torch.isnan(a) & torch.isnan(b)))).sum())


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype, NaN positions and bits elsewhere (NaN payloads may differ)."""
    return a.shape == b.shape and a.dtype == b.dtype and _mismatches(a, b) == 0


SELFCHECK_SIGNS = (1, -1, -1, 1, -1, 1, 1, 1, -1, -1, 1, -1, 1, 1, -1, -1)   # rotated variants' check signs


def nvfp4_selfcheck(device, dtype, axis: int, block_2d: bool, sr: bool, key_ptr: bool, prescale: float,
                    r16: bool, c16: bool, quantize_fn=None, r1: bool = False, c1: bool = False, rot: int = 0,
                    has_signs: bool = False, scale_rule: str = "floor") -> dict:
    """Run one kernel variant on an adversarial tensor of the same divisibility of sizes by 16 and compare
    ``(values, g)`` with the reference (``fake_quantize_operand``); ``r1``/``c1``: a single row / column (a size
    of 1, which Triton specializes on); ``rot`` 16: the variant that rotates (with ``SELFCHECK_SIGNS`` where
    ``has_signs``: -1 at some padded positions, whose padding then is -0 as in the reference).
    ``quantize_fn``: the quantizer checked (default ``quantize_nvfp4_factored``; tests pass a faulty one; a
    rotated variant's gets ``rot`` and ``signs`` as keywords, a ``four_over_six`` one ``scale_rule``). Returns
    ``ok`` and mismatch counts."""
    quantize_fn = quantize_fn or quantize_nvfp4_factored
    if torch.device(device).type == "cpu":
        R, C = (48 if r16 else 49), (64 if c16 else 67)
    else:
        R, C = (256 if r16 else 257), (512 if c16 else 525)
    R, C = (1 if r1 else R), (1 if c1 else C)
    t = _adversarial(R, C).to(device=device, dtype=dtype)
    key = 0x9E3779B9 if sr else None
    kq = torch.tensor(key, dtype=torch.int64, device=device) if (sr and key_ptr) else key
    bs = (16, 16) if block_2d else 16
    rnd = "stochastic" if sr else "nearest"
    signs = None
    kw = {"scale_rule": scale_rule} if _rule_consts(scale_rule) else {}
    if rot:
        signs = torch.tensor(SELFCHECK_SIGNS, dtype=torch.float32, device=device) if has_signs else None
        v, g = quantize_fn(t, axis, block_2d, rnd, kq, prescale, rot=rot, signs=signs, **kw)
    else:
        v, g = quantize_fn(t, axis, block_2d, rnd, kq, prescale, **kw)
    rv, rg = fake_quantize_operand(t, signs, key, axis, rot, "nvfp4", bs, rnd, scale_rule if kw else "floor",
                                   prescale, True)
    nv = _mismatches(v, rv) if v.shape == rv.shape else v.numel()
    out = {"values": nv, "g": int(not _bits_equal(g, rg))}
    out["ok"] = nv == 0 and out["g"] == 0
    return out


def checked_once(x: torch.Tensor, vkey: tuple, check, what: str, st=None) -> bool:
    """Once per kernel variant ``vkey`` (where the ``qselfcheck`` setting says: ``auto`` on GPUs, ``always``
    everywhere): did it reproduce the reference? ``check()`` runs the variant's self-check and returns a dict
    with ``ok``. A variant that fails warns once (naming ``what``) and the reference serves it from then on.
    Inside a CUDA-graph capture an unchecked variant is not checked (it reads to the host): False (reference).
    Used by this module's and ``mxelem``'s kernels."""
    st = st or _settings.current()
    mode = st.qselfcheck
    if not (mode == "always" or (mode == "auto" and x.device.type == "cuda")):
        return True
    ok = CACHES.verified.get(vkey)
    if ok is None:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        res = check()
        ok = CACHES.verified[vkey] = res["ok"]
        if not ok:
            warnings.warn(f"mxtrain: {what} quantize kernel variant {vkey} differed from the reference quantizer on "
                          f"this device ({res}); using the reference (slower) for it", RuntimeWarning, stacklevel=4)
    return ok


def nvfp4_ok(x: torch.Tensor, axis: int, block_2d: bool, sr: bool, key_ptr: bool, prescale: float,
             st=None, rot: int = 0, has_signs: bool = False, scale_rule: str = "floor") -> bool:
    """``checked_once`` for this NVFP4 kernel variant (``rot`` 16: the one that rotates ``x`` itself;
    ``scale_rule`` ``four_over_six``: the one with that rule)."""
    vkey = _variant_key(x, axis, block_2d, sr, key_ptr, prescale, rot, has_signs, scale_rule)
    return checked_once(x, vkey, lambda: nvfp4_selfcheck(x.device, x.dtype, axis, block_2d, sr, key_ptr, prescale,
                                                         vkey[8], vkey[9], r1=vkey[10], c1=vkey[11], rot=rot,
                                                         has_signs=has_signs, scale_rule=scale_rule), "NVFP4", st)


def factored_operand(t: torch.Tensor, signs, key, axis: int, rot: int, fmt: str, block_size, rounding: str,
                     scale_rule: str, prescale: float, out_dtype: torch.dtype | None = None):
    """``fake_quantize_operand(..., factored=True)`` through the kernel where ``nvfp4_kernel_applies`` and its
    variant passed its self-check, else None (the caller runs the reference). A 16-wide rotation
    (``fused_rotation_applies``) runs inside both kernel passes, which read ``t`` unrotated (the variant's key
    names the rotation; if it failed its self-check, the torch rotation below serves it); other rotations stay
    in torch (float32, then the kernel). Without one a bf16/fp16 ``t`` goes to the kernel as it is (its upcast
    is exact). ``out_dtype``: the values' dtype (default float32; bf16/fp16 hold them exactly)."""
    if not nvfp4_kernel_applies(t, fmt, block_size, rounding, scale_rule):
        return None
    block_2d = block_size == (16, 16)
    sr = rounding == "stochastic"
    key_ptr = isinstance(key, torch.Tensor)
    od = out_dtype if out_dtype is not None else torch.float32
    rule = scale_rule if _rule_consts(scale_rule) else "floor"   # (NVFP4 ignores the MX rules)
    if rot and fused_rotation_applies(t, rot, signs) and nvfp4_ok(t, axis, block_2d, sr, key_ptr, prescale,
                                                                   rot=rot, has_signs=signs is not None,
                                                                   scale_rule=rule):
        CALLS["kernel"] += 1
        CALLS["fused_rotation"] += 1
        return quantize_nvfp4_factored(t, axis, block_2d, rounding, key, prescale, out_dtype=od, rot=rot,
                                       signs=signs, scale_rule=rule)
    r = t
    if rot:
        r = hadamard(pad_axis(t.to(compute_dtype(t)), axis, rot), rot, axis=axis, signs=signs)
    if not nvfp4_ok(r, axis, block_2d, sr, key_ptr, prescale, scale_rule=rule):
        return None
    CALLS["kernel"] += 1
    return quantize_nvfp4_factored(r, axis, block_2d, rounding, key, prescale, out_dtype=od, scale_rule=rule)


# operands quantized by ``factored_operand`` in this process ("kernel"), and of those the ones whose rotation
# ran inside the kernel ("fused_rotation"); tests read them
CALLS = {"kernel": 0, "fused_rotation": 0}
