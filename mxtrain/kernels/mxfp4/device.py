"""Triton device functions shared by the MXFP4 quantize kernels (``kernels.py``) and by the kernels that
reuse their arithmetic (``mxtrain.kernels.expand``: ``_e4m3_bits``; ``mxtrain.kernels.seeds``: ``_mix32``).

Every helper does the reference's float32 operations (``mxtrain.numerics.quant``, ``mxtrain.numerics.rng``) so that the kernels
are bit-exact: exact power-of-two scaling built from bits, round-half-even through
``(y + 1.5*2**23) - 1.5*2**23`` (exact for 0 <= y < 2**22), floor by truncation (y >= 0), the reference's
butterfly stage order (``tl.reshape``/``tl.permute``/``tl.split``/``tl.join`` views), and the same 32-bit
counter hash for stochastic rounding. Three groups, by the layout of ``_mxfp4_kernel`` that uses them: the tile
layout's (``_bfly`` and the scalar helpers), the blocks layout's four [BR, 4, 8] pieces (``_bfly8``, ``_piece``,
``_pack4``), and the cols layout's tuples of 32 tensors (``_bfly_tuple``, ``_join_tree``).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:
    # whether Triton's interpreter runs the kernels (as Triton itself reads it where a kernel is decorated)
    _INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

    @triton.jit
    def _mix32(x):
        return _mix32_rest(x ^ (x >> 16))

    @triton.jit
    def _mix32_rest(x):
        """``_mix32`` after its first xor-shift (``_uniform_kk`` writes that round its own way)."""
        x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def _f32(x):
        """Loaded float32 / bf16 / fp16 values in float32, exactly (bf16 subnormals included). Compiled: the
        plain cast (the hardware widening, exact). Interpreted (``TRITON_INTERPRET=1``): bf16 widened by its bits
        (the 16 bits above 16 zero bits), since Triton 3.6's interpreter converts bf16 subnormals wrongly
        (``triton.runtime.interpreter._convert_float`` shifts the significand's leading one out but leaves the
        exponent field 0: bf16 0x0021, 2**-128 + 2**-133, came back as 2**-131), which made the interpreted
        kernels differ from the reference on such inputs while the GPU's did not (docs/kernels.md)."""
        if _INTERPRETED:
            if x.dtype == tl.bfloat16:
                return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            else:
                return x.to(tl.float32)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _f32b(x):
        """``_f32``, with bf16 widened by its bits (the 16 bits above 16 zero bits: the same value as the
        hardware widening, NaN payloads included) compiled too: of two bf16 loaded in one 32-bit register, the
        upper one is then the register with its low half cleared, one logic operation, where the cast's code
        moves it down and shifts it back (two)."""
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return _f32(x)

    @triton.jit
    def _pow2(e):
        """Exact float32 2**e for int32 e in [-149, 127]."""
        normal = ((tl.maximum(e, -126) + 127) << 23)
        sub = (tl.full(e.shape, 1, tl.int32) << tl.minimum(tl.maximum(e + 149, 0), 22))
        bits = tl.where(e >= -126, normal, sub)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _pow2n(e):
        """Exact float32 2**e for int32 e in [-126, 127] (normal range)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _uniform(idx, key):
        """Uniform [0, 1) float32 from the element index and the stream key (``mxtrain.numerics.rng``). An int32
        ``idx`` (callers use one only where every index is below 2**31) skips the high word's hash,
        which is 0 there."""
        if idx.dtype == tl.int64:
            lo = (idx & 0xFFFFFFFF).to(tl.uint32)
            hi = (idx >> 32).to(tl.uint32)
            h = _mix32(lo ^ key.to(tl.uint32, bitcast=True) ^ _mix32(hi))
        else:
            h = _mix32(idx.to(tl.uint32, bitcast=True) ^ key.to(tl.uint32, bitcast=True))
        return (h >> 8).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def _block_scale(abits, RULE: tl.constexpr, GRID: tl.constexpr = 0):
        """E8M0 block exponent s from the bit pattern of the block's |x| maximum (finite, >= 0), as the
        spec: floor(log2 amax) - 2 (+1 where the scale rule rounds up), clamped to [-127, 125];
        -127 for all-zero blocks. Returns (s, nonzero). ``GRID`` (``launch.GRID_ID``): 0 E2M1, 1 INT4 (both have
        emax 2; they differ in where ``rceil`` and ``even`` round up: ``quant.mx_scale_exponent``), 2 E1M2 (emax
        0: floor(log2 amax) (+1), clamped to [-127, 127]; ``_e1m2_scale``)."""
        if GRID == 2:
            return _e1m2_scale(abits, RULE)
        E = (abits >> 23) - 127
        mant = abits & 0x7FFFFF
        if RULE == 0 or RULE == 5:   # floor; adaptive starts from floor's exponent (``_adaptive``)
            bump = tl.zeros_like(E)
        elif RULE == 1:
            bump = (mant != 0).to(tl.int32)
        elif RULE == 2:
            if GRID == 1:   # INT4: sig * 4 > 7
                bump = (mant > 0x600000).to(tl.int32)
            else:           # E2M1: sig * 4 > 6
                bump = (mant > 0x400000).to(tl.int32)
        elif RULE == 3 and GRID == 1:   # INT4 even: round(sig * 8) >= 16 (half to even), sig >= 1.9375
            bump = (mant >= 0x780000).to(tl.int32)
        else:  # even / amd: sig >= 1.75 (identical for FP4); amd for every grid
            bump = (mant >= 0x600000).to(tl.int32)
        s = tl.minimum(tl.maximum(E - 2 + bump, -127), 125)   # [-127, 127 - emax], as the spec
        nz = abits > 0
        return tl.where(nz, s, -127), nz

    @triton.jit
    def _e1m2_scale(abits, RULE: tl.constexpr):
        """``_block_scale`` for the E1M2 grid (``mxe1m2``: emax 0, largest element 1.75): s = floor(log2 amax)
        (+1 where the rule rounds up: ``ceil`` sig > 1, ``rceil`` sig > 1.75, ``even`` round(sig * 4) >= 8 half to
        even, i.e. sig >= 1.875, ``amd`` sig >= 1.75), clamped to [-127, 127]; a subnormal maximum (exponent field
        0, below 2**-126) gives -127 whatever its mantissa, as the reference's exponent (below -127) clamps."""
        E = (abits >> 23) - 127
        mant = abits & 0x7FFFFF
        if RULE == 0 or RULE == 5:   # floor; adaptive starts from floor's exponent (``_adaptive``)
            bump = tl.zeros_like(E)
        elif RULE == 1:
            bump = (mant != 0).to(tl.int32)
        elif RULE == 3:
            bump = (mant >= 0x700000).to(tl.int32)
        else:  # rceil (sig > 1.75) / amd (sig >= 1.75)
            if RULE == 2:
                bump = (mant > 0x600000).to(tl.int32)
            else:
                bump = (mant >= 0x600000).to(tl.int32)
        s = tl.where(E > -127, tl.minimum(E + bump, 127), -127)
        nz = abits > 0
        return tl.where(nz, s, -127), nz

    @triton.jit
    def _adaptive_term(x, sc0, PRESCALE: tl.constexpr, prescale, GRID: tl.constexpr):
        """The ``adaptive`` scale rule's comparison term of each value (``quant._adaptive_exponent``), float64:
        ``(qa - qb) * (qa + qb - 2 |v|)`` with ``v`` the value (prescaled) times ``sc0`` (2**-s0 of floor's
        exponent ``s0``, times 1/sqrt(rot) where the kernel folds it: the same float32 product as the reference's,
        ``launch.FOLD_ROTS``), ``qa`` its magnitude rounded to nearest even onto the grid, ``qb`` that of ``v / 2``
        (``x * sc0 / 2``: exact) times 2. The reference's signed values give the same term (every factor flips
        sign with the value). E1M2 (GRID 2) in units of its grid step (``4 v``, ``_int4_round``): 16 times the
        reference's term, exactly, which keeps the sign of every sum. Every term is exact in float64 and so is
        every partial sum of a block (``mxtrain.numerics.quant``'s docstring), so the block sums do not depend on their
        order; written as explicit FMAs of exact products (the sum's adds then take FMA results, which no
        contraction fuses), so contraction on or off gives the same code and values."""
        if PRESCALE:
            x = x * prescale
        va = x * sc0
        vb = x * (sc0 * 0.5)
        if GRID == 0:
            qa = _fp4_round(va, False, 0, 0)
            qb = _fp4_round(vb, False, 0, 0) * 2.0
            a = tl.abs(va)
        elif GRID == 1:
            qa = _int4_round(va, False, 0, 0)
            qb = _int4_round(vb, False, 0, 0) * 2.0
            a = tl.abs(va)
        else:
            qa = _int4_round(va * 4.0, False, 0, 0)
            qb = _int4_round(vb * 4.0, False, 0, 0) * 2.0
            a = tl.abs(va * 4.0)
        qa64 = qa.to(tl.float64)
        qb64 = qb.to(tl.float64)
        # (qa + qb - 2 a: 2 a is exact, so the FMA rounds the same sum once; the product exact: FMA with +0, which
        # LLVM keeps, so the block sums add FMA results, with nothing left to contract)
        return tl.fma(qa64 - qb64, tl.fma(a.to(tl.float64), -2.0, qa64 + qb64), 0.0)

    @triton.jit
    def _adaptive_pick(s, d, nz, GRID: tl.constexpr):
        """The ``adaptive`` rule's exponent from floor's ``s`` and the block's summed ``_adaptive_term`` ``d``:
        ``s + 1`` where ``d > 0`` (its squared error is lower) and the block is not all zero and ``s + 1`` within
        the clamp (127 - emax: 125 for E2M1 and INT4, 127 for E1M2), else ``s`` (ties keep ``s``; a NaN ``d``, of
        a non-finite block, too: its scale is NaN whatever ``s`` is)."""
        if GRID == 2:
            can = nz & (s < 127)
        else:
            can = nz & (s < 125)
        return tl.where(can & (d > 0.0), s + 1, s)

    @triton.jit
    def _grid_scale(s, GRID: tl.constexpr):
        """2**-s, the elements' multiplier of a block of exponent ``s``: E2M1 and INT4 (s <= 125) through the normal
        range's bits, E1M2 (s up to 127: 2**-127 is a float32 subnormal) through ``_pow2``."""
        if GRID == 2:
            return _pow2(-s)
        else:
            return _pow2n(-s)

    @triton.jit
    def _carrier_factor(kexp, ok, GRID: tl.constexpr):
        """The carrier multiplier of a block's rounded magnitudes (NaN where the block is not finite): 2**kexp for
        E2M1 and INT4 (their magnitudes are the values), 2**(kexp - 2) for E1M2 (whose integer magnitudes 0..7
        are the values times 4); at least 2**-126 (what lies below rounds to e4m3 zero either way)."""
        if GRID == 2:
            return tl.where(ok, _pow2n(tl.maximum(kexp - 2, -126)), float("nan"))
        else:
            return tl.where(ok, _pow2n(tl.maximum(kexp, -126)), float("nan"))

    @triton.jit
    def _inexact(live, kexp, GRID: tl.constexpr):
        """Live blocks the carrier holds inexactly: ``kexp`` below ``carrier.EXACT_KEXP`` (-8 E2M1, -9 INT4, -7
        E1M2)."""
        if GRID == 2:
            return live & (kexp < -7)
        else:
            return live & (kexp < -8 - GRID)

    @triton.jit
    def _carrier_exp(s, live, GROUP_ROWS: tl.constexpr, BFIRST: tl.constexpr = False):
        """Carrier group exponent G (largest live block exponent of the row, or of the whole tile for
        128x128 groups; at least -120) and each block's shift kexp = s - G + 6. Returns (G, kexp). ``s``:
        [BR, 4] (block exponents of each row), or [4, BR] with ``BFIRST``."""
        s_live = tl.where(live, s, -127)
        if GROUP_ROWS == 1:
            if BFIRST:
                G = tl.maximum(tl.max(s_live, axis=0), -120)       # [BR]
                G2 = G[None, :]
            else:
                G = tl.maximum(tl.max(s_live, axis=1), -120)       # [BR]
                G2 = G[:, None]
        else:
            G = tl.maximum(tl.max(tl.max(s_live, axis=1), axis=0), -120)
            G2 = G
        return G, s - G2 + 6

    @triton.jit
    def _bfly(x, BR: tl.constexpr, H: tl.constexpr):
        """One butterfly stage: pairs (x[i], x[i + H]) for i with bit H clear -> (a + b, a - b)."""
        v4 = tl.reshape(x, [BR, 128 // (2 * H), 2, H])
        v4 = tl.permute(v4, (0, 1, 3, 2))
        a, b = tl.split(v4)
        v4 = tl.join(a + b, a - b)
        v4 = tl.permute(v4, (0, 1, 3, 2))
        return tl.reshape(v4, [BR, 128])

    @triton.jit
    def _signs_bfly1(a, b, sa, sb):
        """Signs and butterfly stage 1 of a pair: (a sa, b sb) -> (a sa + b sb, a sa - b sb), the add and the
        subtraction as FMAs b * (+-sb) + a sa. The signs are +-1, so every product is exact: the FMA rounds the
        same sum once, as the add of the two products does (the same signed zeros: x - y is x + (-y)); -sb as
        sb * -1.0, not 0 - sb (+0 for sb = +0). Written so because the add of a product is what contraction
        would fuse: with it on or off the code is the same."""
        a_s = a * sa
        return tl.fma(b, sb, a_s), tl.fma(b, sb * -1.0, a_s)

    @triton.jit
    def _bfly_signs(x, sg, BR: tl.constexpr):
        """``_bfly(x * sg, BR, 1)`` with the stage's adds as FMAs of exact products (``_signs_bfly1``); ``sg``: the
        signs broadcast to x's shape [BR, 128] (split as x is, so its pieces have x's layout)."""
        v4 = tl.permute(tl.reshape(x, [BR, 64, 2, 1]), (0, 1, 3, 2))
        s4 = tl.permute(tl.reshape(sg, [BR, 64, 2, 1]), (0, 1, 3, 2))
        a, b = tl.split(v4)
        sa, sb = tl.split(s4)
        p, m = _signs_bfly1(a, b, sa, sb)
        v4 = tl.permute(tl.join(p, m), (0, 1, 3, 2))
        return tl.reshape(v4, [BR, 128])

    @triton.jit
    def _bfly8_signs(x, sg):
        """``_bfly8(x * sg, 1)`` with the stage's adds as FMAs of exact products (``_signs_bfly1``); ``sg``: the
        signs broadcast to x's shape [BR, 4, 8] (or any [D0, D1, 8]: the blocks layout's ``BFIRST`` [4, BR, 8])."""
        D0: tl.constexpr = x.shape[0]
        D1: tl.constexpr = x.shape[1]
        v = tl.permute(tl.reshape(x, [D0, D1, 4, 2, 1]), (0, 1, 2, 4, 3))
        t = tl.permute(tl.reshape(sg, [D0, D1, 4, 2, 1]), (0, 1, 2, 4, 3))
        a, b = tl.split(v)
        sa, sb = tl.split(t)
        p, m = _signs_bfly1(a, b, sa, sb)
        v = tl.permute(tl.join(p, m), (0, 1, 2, 4, 3))
        return tl.reshape(v, [D0, D1, 8])

    @triton.jit
    def _bfly8(x, H: tl.constexpr):
        """Butterfly stage h = H (1, 2 or 4) inside the last axis (8 values, all held by one thread) of a
        [BR, 4, 8] tensor (or any [D0, D1, 8])."""
        D0: tl.constexpr = x.shape[0]
        D1: tl.constexpr = x.shape[1]
        v = tl.reshape(x, [D0, D1, 8 // (2 * H), 2, H])
        v = tl.permute(v, (0, 1, 2, 4, 3))
        a, b = tl.split(v)
        v = tl.join(a + b, a - b)
        v = tl.permute(v, (0, 1, 2, 4, 3))
        return tl.reshape(v, [D0, D1, 8])

    @triton.jit
    def _e4m3_bits(c, USE_ASM: tl.constexpr, PACK: tl.constexpr = 4):   # PACK: values a thread (1, 2 or 4+)
        """e4m3 byte of float32 ``c``; NaN -> 0x7F. The hardware path rounds half to even and saturates
        everywhere; the bit-arithmetic path (interpreter) is exact where ``c`` is an e4m3 normal value
        (the carrier's case: an E2M1 value times a power of two) and rounds half to even below 2**-6."""
        if USE_ASM and PACK == 1:   # for layouts with 1 value a thread: both bytes of the pair from ``c``
            return tl.inline_asm_elementwise(
                asm="cvt.rn.satfinite.e4m3x2.f32 $0, $1, $1;",
                constraints="=h,r", args=[c], dtype=tl.uint16, is_pure=True, pack=1).to(tl.uint8)
        elif USE_ASM and PACK == 2:   # for layouts with 2 values a thread
            return tl.inline_asm_elementwise(
                asm="cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;",
                constraints="=h,r,r", args=[c], dtype=tl.uint8, is_pure=True, pack=2)
        elif USE_ASM:
            # the hardware conversion, two values per instruction; the first value goes to the low byte
            return tl.inline_asm_elementwise(
                # (one line, no escape sequences: inductor copies a kernel's source into a string literal)
                asm="{ .reg .b16 lo, hi; "
                    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                    "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
                    "mov.b32 $0, {lo, hi}; }",
                constraints="=r,r,r,r,r", args=[c], dtype=tl.uint8, is_pure=True, pack=4)
        else:
            a = tl.abs(c)
            nrm = (a.to(tl.int32, bitcast=True) >> 20) - 960
            sub = tl.fma(a, 512.0, 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000   # (a * 512: exact)
            b = tl.where(a < 0.015625, sub, nrm)
            b = tl.minimum(b, 0x7E) | ((c.to(tl.int32, bitcast=True) >> 24) & 0x80)
            b = tl.where(c != c, 0x7F, b)
            return b.to(tl.uint8)

    @triton.jit
    def _fp4_round(v, SR: tl.constexpr, idx, key, kk=0, KK: tl.constexpr = False):
        """|v| rounded to E2M1 magnitudes (float32 0..6), nearest-even or stochastic (hash of idx). ``KK``: the
        uniform of ``_uniform_kk`` with ``kk`` = key ^ (key >> 16) computed once by the caller, and the floor of
        y >= 0 as one rounding instruction (the same values as the int32 round trip: y < 4)."""
        q, _q2 = _fp4_round2(v, SR, idx, key, kk, KK)
        return q

    @triton.jit
    def _fp4_round2(v, SR: tl.constexpr, idx, key, kk=0, KK: tl.constexpr = False):
        """``_fp4_round``'s q and q + 2 (``_fp4_code``'s), the latter written so that contraction cannot change
        its code: with stochastic rounding q is the product rr * 2**(e-1), which an add of 2 would take into an
        FMA where contraction is on (the same value: the product is exact), so q + 2 is that FMA, explicitly."""
        a = tl.minimum(tl.abs(v), 6.0)
        pbits = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000   # 2**e, e = max(E(a), 0)
        if SR:
            p1 = (0x7F800000 - pbits).to(tl.float32, bitcast=True)
            y = a * p1                                                        # a * 2**(1-e): step 1
            if KK:
                u = _uniform_kk(idx, key, kk)
                fl = tl.floor(y)
            else:
                u = _uniform(idx, key)
                fl = y.to(tl.int32).to(tl.float32)
            # (y - fl as an explicit FMA: a * 2**(1-e) is exact, so it is the product-then-subtract either way,
            # and contraction, on or off, leaves the code as written; -fl as fl * -1.0, a sign flip that ptxas
            # folds into the FMA's operand, where Triton's -fl is an add, 0 - fl)
            rr = fl + tl.where(u < tl.fma(a, p1, fl * -1.0), 1.0, 0.0)
            pe = (pbits - 0x00800000).to(tl.float32, bitcast=True)            # 2**(e-1)
            q = rr * pe
            # q + 2 as the FMA it is: rr is an integer in 0..4 (y < 4: a < 2**(e+1), and a <= 6 where e = 2)
            # and 2**(e-1) a power of two in [0.5, 2], so rr * 2**(e-1) has at most 3 significant bits and is
            # exact: one rounding either way, and q >= 0 (no signed-zero case)
            q2 = tl.fma(rr, pe, 2.0)
        else:
            # round to the step 2**(e-1) by adding and removing m = 1.5 * 2**(22+e), built from 2**e's bits (no
            # multiply: a product feeding the add could be contracted into an FMA where contraction is on)
            m = (pbits + ((22 << 23) | 0x400000)).to(tl.float32, bitcast=True)
            q = (a + m) - m
            q2 = q + 2.0
        return q, q2

    @triton.jit
    def _int4_round(v, SR: tl.constexpr, idx, key, kk=0, KK: tl.constexpr = False):
        """|v| rounded to INT4 magnitudes (float32 integers 0..7; ``quant.round_to_elem`` on the grid of spacing 1
        and maximum 7), nearest-even or stochastic (hash of idx; ``KK`` as in ``_fp4_round2``). No product
        feeds an add here, so contraction on or off leaves the code as written. The E1M2 grid (``mxe1m2``, GRID 2)
        rounds ``4 v`` (exact) with it: E1M2's magnitudes {0, 0.25, ..., 1.75} are INT4's divided by 4, with
        ``quant.round_to_elem``'s spacing 0.25 on |v| (emin 0, 2 mantissa bits) the spacing 1 on 4|v| (the same
        floor and fraction for stochastic rounding, the same ties), and the E1M2 code of magnitude m / 4 is m."""
        a = tl.minimum(tl.abs(v), 7.0)
        if SR:
            if KK:
                u = _uniform_kk(idx, key, kk)
                fl = tl.floor(a)
            else:
                u = _uniform(idx, key)
                fl = a.to(tl.int32).to(tl.float32)
            q = fl + tl.where(u < a - fl, 1.0, 0.0)                          # a - fl: exact (a < 8)
        else:
            q = (a + 12582912.0) - 12582912.0                                 # half to even (a < 2**22)
        return q

    @triton.jit
    def _fp4_code(q, q2, v):
        """E2M1 code of magnitude q (0, .5, 1, 1.5, 2, 3, 4, 6 -> 0..7) with the sign of v; ``q2``: q + 2
        (``_fp4_round2``)."""
        # (an explicit FMA: q * 0.5 is exact, so it is the product-then-add either way, and contraction, on or
        # off, leaves the code as written)
        cf = tl.minimum(tl.minimum(q * 2.0, q2), tl.fma(q, 0.5, 4.0))
        c = (cf + 12582912.0).to(tl.int32, bitcast=True) & 0xF
        return c | ((v.to(tl.int32, bitcast=True) >> 28) & 8)

    @triton.jit
    def _fp4_rne_t(a):
        """``_fp4_round2``'s nearest rounding of ``a`` (in [0, 6]; NaN in non-finite blocks only) with the E2M1
        code in the sum's bits: returns (t, m), t = a + m, where t - m is ``_fp4_round2``'s q (exact) and the low
        byte of t's bit pattern is q's code (0..7). m is ``_fp4_round2``'s magic 1.5 * 2**(22+e) (ulp 2**(e-1),
        e = max(E(a), 0)) plus 2e ulps, built from the exponent field E of max(a, 1) as E * (2**23 + 2) + const
        (integer ops, no float product for contraction to fuse). An even number of ulps keeps the magic's last
        bit even, so a + m rounds (half to even) to the same multiple k of the ulp, and t's low byte, zero in m
        but for 2e, is k + 2e: q = k 2**(e-1) has code k + 2e (e = 0: k 0..4, codes 0..4; e = 1: k 2..4, codes
        4..6; e = 2: k 2..3, codes 6..7)."""
        eb = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) >> 23
        m = (eb * 0x800002 + 0x0B3FFF02).to(tl.float32, bitcast=True)   # (E + 22) << 23 | 0x400000, + 2 (E - 127)
        return a + m, m

    @triton.jit
    def _sign01(v):
        """The sign bit of float32 ``v`` as int32 0 or 1. Compiled, the shift is inline PTX, which LLVM does not
        see into: knowing it 0 or 1, LLVM writes ``s * 8`` as ``(bits >> 28) & 8``, a shift and a logic operation
        where ptxas otherwise folds the multiply into the add that takes it (one LEA)."""
        if _INTERPRETED:
            return (v.to(tl.uint32, bitcast=True) >> 31).to(tl.int32, bitcast=True)
        else:
            return tl.inline_asm_elementwise(asm="shr.b32 $0, $1, 31;", constraints="=r,r",
                                             args=[v.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=True,
                                             pack=1)

    @triton.jit
    def _piece(x_j, sc, fc, ok3, SR: tl.constexpr, idx, key, PRESCALE: tl.constexpr, prescale,
               WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, USE_ASM: tl.constexpr, PACK: tl.constexpr = 4,
               GRID: tl.constexpr = 0, FC_FOLD: tl.constexpr = True):
        if PRESCALE:
            x_j = x_j * prescale
        if GRID == 0 and not SR and WRITE_CARRIER and not WRITE_FP4 and FC_FOLD:
            # the carrier alone, nearest: ``_fp4_round2``'s rounding done on the values times fc (the carrier
            # factor, a power of two), with its bounds and magic times fc too (clamp 6 fc, floor fc, the magic from
            # max(a, fc)'s exponent): one multiply by sc * fc (a normal power of two: 2**(6 - G), times 1/sqrt(ROT)
            # where folded; 2**(-126 - s) where kexp is clamped) for the multiplies by sc and then by fc, the same
            # bytes. Where no product underflows every value is the unscaled one times fc exactly, so the result is
            # q fc. Where one does, fc < 2**-12 (then |q fc| and the result are at most 6 fc, below 2**-10, half
            # e4m3's smallest step) or the value is below 2**-114 (q = 0 and the result 0): both give the zero of
            # v's sign. A non-finite block: fc NaN, so is every value (0x7F), as before.
            v = x_j * (sc * fc)
            a = tl.minimum(tl.abs(v), fc * 6.0)
            m = ((tl.maximum(a, fc).to(tl.int32, bitcast=True) & 0x7F800000)
                 + ((22 << 23) | 0x400000)).to(tl.float32, bitcast=True)
            q = (a + m) - m
            qs = (q.to(tl.int32, bitcast=True)
                  | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
            return _e4m3_bits(qs, USE_ASM, PACK), tl.zeros(v.shape, tl.int32)
        v = x_j * sc
        if GRID == 1:   # INT4: magnitude q (0..7) is its own code
            q = _int4_round(v, SR, idx, key)
            q2 = q
        elif GRID == 2:   # E1M2: 4 v (exact) rounded on INT4's grid, q (0..7) its code (``_int4_round``)
            q = _int4_round(v * 4.0, SR, idx, key)
            q2 = q
        elif SR or not WRITE_FP4:
            q, q2 = _fp4_round2(v, SR, idx, key)
        else:   # nearest, with codes: the code from the bits of the magic sum (``_fp4_rne_t``)
            t, m = _fp4_rne_t(tl.minimum(tl.abs(v), 6.0))
            q = t - m
            q2 = q
        if WRITE_CARRIER:
            qs = (q.to(tl.int32, bitcast=True)
                  | (v.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
            byte = _e4m3_bits(qs * fc, USE_ASM, PACK)
        else:
            byte = tl.zeros(v.shape, tl.uint8)
        if WRITE_FP4:
            if GRID != 0:
                code = tl.where(ok3, q.to(tl.int32) | ((v.to(tl.int32, bitcast=True) >> 28) & 8), 0)
            elif SR:
                code = tl.where(ok3, _fp4_code(q, q2, v), 0)
            else:
                # t's bits plus the sign of v as bit 3: the low byte is the code (t's bits 3..21 are zero:
                # ``_fp4_rne_t``), the bits above it are not (every caller keeps the low 4 bits only: ``_pack4``,
                # the cols layout's packing)
                code = tl.where(ok3, t.to(tl.int32, bitcast=True) + _sign01(v) * 8, 0)
        else:
            code = tl.zeros(v.shape, tl.int32)
        return byte, code

    @triton.jit
    def _pack4(c):
        """[BR, 4, 8] codes -> [BR, 4, 4] bytes (low nibble = lower index; any [D0, D1, 8] likewise). Only the
        codes' low 4 bits count (``_piece``'s nearest E2M1 codes have more): the byte is that of lo + (hi << 4),
        whose low 8 bits take no carry, written as the add (one multiply-add) where an or of bits not known
        disjoint is a shift and a logic operation."""
        D0: tl.constexpr = c.shape[0]
        D1: tl.constexpr = c.shape[1]
        lo, hi = tl.split(tl.reshape(c, [D0, D1, 4, 2]))
        return (lo + (hi << 4)).to(tl.uint8)

    @triton.jit
    def _join_level(v, H: tl.constexpr):
        """Tuple of 2H tensors -> tuple of H: entry i joins entries i and i + H (a new last axis of 2)."""
        w = ()
        for i in tl.static_range(H):
            w = w + (tl.join(v[i], v[i + H]),)
        return w

    @triton.jit
    def _bfly_tuple(xs, H: tl.constexpr):
        """Butterfly stage H over a tuple of 32 tensors: pairs (a, b) = (xs[j], xs[j + H]) for j with bit H
        clear -> (a + b, a - b)."""
        w = ()
        for j in tl.static_range(32):
            if (j // H) % 2 == 0:
                w = w + (xs[j] + xs[j + H],)
            else:
                w = w + (xs[j - H] - xs[j],)
        return w

    @triton.jit
    def _max_level(v, H: tl.constexpr):
        """Tuple of 2H tensors -> tuple of H: entry i the maximum of entries i and i + H, NaN propagating."""
        w = ()
        for i in tl.static_range(H):
            w = w + (tl.maximum(v[i], v[i + H], propagate_nan=tl.PropagateNan.ALL),)
        return w

    @triton.jit
    def _max_tree16(v):
        """The maximum of a tuple of 16 tensors, NaN propagating, as a tree (15 two-operand maxima)."""
        v = _max_level(v, 8)
        v = _max_level(v, 4)
        v = _max_level(v, 2)
        v = _max_level(v, 1)
        return v[0]

    @triton.jit
    def _join_tree(v, N: tl.constexpr, BR: tl.constexpr):
        """Tuple of N (16 or 32) [4, BR] tensors -> one [4, BR, N] tensor, in tuple order. Each level
        pairs entries half the remaining count apart, so the new axes come out in index order and the
        final reshape moves no data (every value stays in its thread's registers)."""
        if N == 32:
            v = _join_level(v, 16)
        v = _join_level(v, 8)
        v = _join_level(v, 4)
        v = _join_level(v, 2)
        v = _join_level(v, 1)
        return tl.reshape(v[0], [4, BR, N])

    # ---- the tile layout's 64-wide rotation (``_mxfp4_kernel`` with ROT == 64): a thread holds one row's whole
    # rotation group as 64 tensors of one value each, so every butterfly stage and block maximum is register-local

    @triton.jit
    def _split8(p):
        """[..., 8] tensor whose last axis a thread holds -> tuple of its 8 slices [...] in index order."""
        BR: tl.constexpr = p.shape[0]
        G: tl.constexpr = p.shape[1]
        a0, a1 = tl.split(tl.reshape(p, [BR, G, 2, 2, 2]))        # index bit 0
        a00, a01 = tl.split(a0)                                    # bit 1
        a10, a11 = tl.split(a1)
        e0, e4 = tl.split(a00)                                     # bit 2
        e2, e6 = tl.split(a01)
        e1, e5 = tl.split(a10)
        e3, e7 = tl.split(a11)
        return e0, e1, e2, e3, e4, e5, e6, e7

    @triton.jit
    def _bfly_tuple_n(xs, H: tl.constexpr, N: tl.constexpr):
        """``_bfly_tuple`` over a tuple of ``N`` tensors."""
        w = ()
        for j in tl.static_range(N):
            if (j // H) % 2 == 0:
                w = w + (xs[j] + xs[j + H],)
            else:
                w = w + (xs[j - H] - xs[j],)
        return w

    @triton.jit
    def _join_all(v, N: tl.constexpr):
        """Tuple of ``N`` (2 to 64) [BR, G] tensors -> one [BR, G, N] tensor, in tuple order (as ``_join_tree``:
        every value stays in its thread's registers)."""
        BR: tl.constexpr = v[0].shape[0]
        G: tl.constexpr = v[0].shape[1]
        if N >= 64:
            v = _join_level(v, 32)
        if N >= 32:
            v = _join_level(v, 16)
        if N >= 16:
            v = _join_level(v, 8)
        if N >= 8:
            v = _join_level(v, 4)
        if N >= 4:
            v = _join_level(v, 2)
        v = _join_level(v, 1)
        return tl.reshape(v[0], [BR, G, N])

    @triton.jit
    def _uniform_kk(idx, key, kk):
        """``_uniform(idx, key)``, with ``kk`` = key ^ (key >> 16) (uint32) computed once by the caller: for an
        int32 ``idx``, mix32's first round on idx ^ key is written idx ^ (idx >> 16) ^ kk (the same bits, one
        instruction fewer an element)."""
        if idx.dtype == tl.int64:
            return _uniform(idx, key)
        else:
            i = idx.to(tl.uint32, bitcast=True)
            x = _mix32_rest(i ^ (i >> 16) ^ kk)
            return (x >> 8).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def _split64(P):
        """[BR, G, 8, 8] tensor (element 8 j + e of each group at [.., j, e]) -> tuple of its 64 slices [BR, G]
        in element order (every value stays in its thread's registers where the layout holds the last two
        axes in one thread)."""
        BR: tl.constexpr = P.shape[0]
        G: tl.constexpr = P.shape[1]
        P = tl.reshape(tl.permute(P, (0, 1, 3, 2)), [BR, G, 8, 2, 2, 2])   # [.., e, bits 2 1 0 of j]
        q0, q1 = tl.split(P)
        q00, q01 = tl.split(q0)
        q10, q11 = tl.split(q1)
        p0, p4 = tl.split(q00)
        p2, p6 = tl.split(q01)
        p1, p5 = tl.split(q10)
        p3, p7 = tl.split(q11)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p0)
        xs = (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p1)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p2)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p3)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p4)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p5)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p6)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        e0, e1, e2, e3, e4, e5, e6, e7 = _split8(p7)
        xs = xs + (e0, e1, e2, e3, e4, e5, e6, e7)
        return xs
