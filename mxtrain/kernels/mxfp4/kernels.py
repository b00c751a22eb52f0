"""The MXFP4 quantize kernels (Triton): [signs * Hadamard] -> block amax -> E8M0 scale -> prescale ->
nearest/stochastic rounding -> packed FP4 codes + E8M0 scales and/or the FP8 e4m3 carrier (``carrier.py``).

One program handles a tile of ``BR`` rows x 128 reduction elements (4 MX blocks of 32, one carrier group).
The tile is read through two strides, so quantizing along columns (Wgrad: along tokens) reads the
transposed tile directly from the row-major tensor: no transpose copy. Two kernels:

* ``_mxfp4_kernel``: one pass along rows or columns. Its ``LAYOUT`` constexpr picks how a program holds the
  tile (each layout writes identical bytes; ``launch.kernel_for`` picks one, the ``qkernel`` setting forces
  one), and only that layout's code is compiled:

  - "tile": any rotation, the whole tile as one [BR, 128] tensor; 64-wide rotations (``tseng``) in a path of
    their own where each thread holds one row's whole 64-wide group (every stage register-local);
  - "blocks": rotations up to 32 wide; the tile as four pieces so that a thread holds whole MX blocks
    (1.2-2x faster on an H100, BENCHMARKS.md);
  - "cols": inputs whose output rows are the contiguous axis; the tile as 32 coalesced [4, BR] tensors.

* ``_mxfp4_dual_kernel`` ("dual"): both FP8-carrier operands of a row-major tensor from one read. Each of its
  programs runs ``_mxfp4_kernel`` as a device function on one tile ("blocks" along rows, "cols" along
  columns), naming the tile through ``pid_r`` / ``pid_k`` (launched, ``_mxfp4_kernel`` takes its program
  ids).

Element grid: the ``GRID`` constexpr (``GRID_A`` / ``GRID_B`` in the dual kernel; ``launch.GRID_ID``) rounds to
E2M1 (0: ``mxfp4``) or to the uniform INT4 grid (1: ``mxint4``, integers 0..7 with sign; the ``ufp4`` recipe); both
have emax 2, and the carrier holds either (docs/kernels.md, "The uniform 4-bit grid"); or to the uniform E1M2 grid
(2: ``mxe1m2``, INT4's grid divided by 4, emax 0: block exponents up to 127, scaled through ``device._grid_scale``,
rounded as ``4 v`` on INT4's grid, the same codes; carrier ``device._carrier_factor``). GRID 0 compiles to the code
the kernels had before the switch.

The single-pass signature (8 pointers, sizes and strides, key, 1/sqrt(rot), prescale, then the constexprs) is
written once, in ``_mxfp4_kernel``; the constexprs that only some layouts read (``USE_ASM``, ``PACK``,
``FOLD``) have defaults that the others ignore. Spelled out elsewhere are only what must name each
argument: the call sites in ``_mxfp4_dual_kernel`` (per side, which of its own arguments fills each one) and,
on the host, the argument tuples (``launch.single_args``, ``launch.dual_args``), one place each. Kernels are
launched with ``enable_fp_fusion=False`` so no multiply-add is contracted to an FMA; ``tools/compile_check.py``
compiles representative variants for sm_90 without a GPU.

Triton's float32 -> float8e4nv cast (the hardware cvt.rn.satfinite.e4m3x2.f32, which converts pairs of
registers) wrote wrong bytes for every other row of many register layouts on sm_90 with Triton 3.6 (on an H100,
17 of 82 variants failed, all with that cast; BENCHMARKS.md). The tile layout builds the e4m3 bits with
float32 ops; the blocks and cols layouts issue the instruction through their own inline PTX on pairs of one
thread's consecutive values (``_e4m3_bits``). The per-variant self-check (``verify.py``) stays as the safety
net for all of them.
"""

from __future__ import annotations

from .device import triton

LAYOUTS = ("tile", "blocks", "cols")   # values of _mxfp4_kernel's LAYOUT (the names launch.kernel_for returns)

if triton is not None:
    import triton.language as tl

    from .device import (_bfly, _bfly8, _bfly8_signs, _bfly_signs, _bfly_tuple, _bfly_tuple_n, _block_scale,
                         _adaptive_pick, _adaptive_term, _carrier_exp, _carrier_factor, _e4m3_bits, _f32, _f32b,
                         _fp4_round2, _grid_scale, _inexact,
                         _int4_round, _join_all, _join_tree, _max_tree16, _pack4, _piece, _pow2, _pow2n, _signs_bfly1,
                         _split64, _uniform)

    @triton.jit(do_not_specialize=["key"])
    def _mxfp4_kernel(
        x_ptr, signs_ptr, car_ptr, gs_ptr, fp4_ptr, sc_ptr, cnt_ptr, key_ptr,
        R, K, Rc,
        sx_r, sx_k,            # memory strides of x along (outer row, reduction)
        si_r, si_k,            # logical index strides (stochastic rounding index)
        Kc, Kq,                # carrier row length (mult. of 128), MX padded length (mult. of 32)
        gs_sr, gs_sk,          # group-scale strides (per row-group, per k-group)
        key, inv_sqrt, prescale,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr,
        WRITE_CARRIER: tl.constexpr, WRITE_FP4: tl.constexpr, IDX64: tl.constexpr, KEY_PTR: tl.constexpr,
        LAYOUT: tl.constexpr,              # "tile", "blocks" or "cols" (LAYOUTS)
        USE_ASM: tl.constexpr = False,     # blocks, cols: the hardware e4m3 conversion (inline PTX)
        PACK: tl.constexpr = 4,            # cols: e4m3 conversions per inline-PTX call (1, 2 or 4)
        FOLD: tl.constexpr = False,        # blocks, cols: 1/sqrt(ROT) folded into the block scales
        GRID: tl.constexpr = 0,            # the element grid (launch.GRID_ID): 0 E2M1 (mxfp4), 1 INT4 (mxint4),
                                           # 2 E1M2 (mxe1m2)
        BFIRST: tl.constexpr = False,      # blocks: the pieces as [4, BR, 8] (a row's blocks in one warp's lanes)
        SPLIT16: tl.constexpr = False,     # blocks: each block's carrier bytes stored as two 16-byte runs
        pid_r=None, pid_k=None,            # the tile (row block, reduction block); launched: the program ids
    ):
        """Quantize the tile (row block ``pid_r``, reduction block ``pid_k``) of a (R, K) view, read through
        the strides (``sx_r``, ``sx_k``), in the layout ``LAYOUT``. Launched, the tile is the program's;
        ``_mxfp4_dual_kernel`` calls it as a device function with ``pid_r`` and ``pid_k``."""
        if pid_r is None:
            pid_r = tl.program_id(0)
            pid_k = tl.program_id(1)
        # float32 arithmetic whatever type the launcher gave the float arguments (Triton's launch: float32;
        # inductor's generated launch of a user kernel: float64); their values are float32 (launch.rot_floats)
        inv_sqrt = tl.cast(inv_sqrt, tl.float32)
        prescale = tl.cast(prescale, tl.float32)
        if KEY_PTR:  # the seed read from device memory (refreshed between CUDA-graph replays)
            key = tl.load(key_ptr)
        if IDX64:  # offsets beyond 2**31 - 1: 64-bit index math (costs integer throughput)
            rows = pid_r.to(tl.int64) * BR + tl.arange(0, BR).to(tl.int64)
            kbase = pid_k.to(tl.int64) * 128
        else:
            rows = pid_r * BR + tl.arange(0, BR)
            kbase = pid_k * 128

        if LAYOUT == "tile" and ROT == 64:
            # ================================================================ tile, 64-wide rotation groups
            # The 128-wide tile as 2 rotation groups a row, loaded as one [BR, 2, 8, 8] tensor (element 8 j + e
            # of group g of row r at [r, g, j, e]) in which each thread holds one row's whole group (along
            # columns, rows contiguous, Triton converts the load's layout to it through shared memory): split
            # into 64 tensors of one value a thread (xs[i] = element i of the group), the butterfly, the block
            # maxima and the element math are all register-local, and the results are joined back for 64-byte
            # stores. One value a thread of each [BR, 2] tensor: BR x 2 must be at least the thread count.
            r2 = rows[:, None]                                         # [BR, 1]
            gk = kbase + tl.arange(0, 2)[None, :] * 64                 # [1, 2] first column of each group
            rm = r2 < R
            cc = (gk[:, :, None, None] + tl.arange(0, 8)[None, None, :, None] * 8
                  + tl.arange(0, 8)[None, None, None, :])                # [1, 2, 8, 8] columns
            r4 = rows[:, None, None, None]
            P = tl.load(x_ptr + r4 * sx_r + cc * sx_k, mask=(r4 < R) & (cc < K), other=0.0)
            xs = _split64(_f32(P))
            if HAS_SIGNS:   # signs and butterfly stage 1: (a s, b t) -> (a s + b t, a s - b t) as fused
                # multiply-adds b * (+-t) + a s (exact products: the same rounding and signed zeros as the add
                # and subtraction; -t as t * -1.0, not 0 - t, which is +0 for t = +0); the 64 signs read once
                # as one [1, 2, 8, 8] tensor
                sgs = _split64(tl.load(signs_ptr + (cc - gk[:, :, None, None])))
                w = ()
                for i in tl.static_range(0, 64, 2):
                    a_s = xs[i] * sgs[i]
                    w = w + (tl.fma(xs[i + 1], sgs[i + 1], a_s), tl.fma(xs[i + 1], sgs[i + 1] * -1.0, a_s))
                xs = w
            else:
                xs = _bfly_tuple_n(xs, 1, 64)
            xs = _bfly_tuple_n(xs, 2, 64)
            xs = _bfly_tuple_n(xs, 4, 64)
            xs = _bfly_tuple_n(xs, 8, 64)
            xs = _bfly_tuple_n(xs, 16, 64)
            xs = _bfly_tuple_n(xs, 32, 64)
            w = ()
            for i in tl.static_range(64):
                w = w + (xs[i] * inv_sqrt,)
            xs = w
            # the reference pads with +0 to whole rotation blocks only (a group lies wholly inside or past
            # them), and padding rows (up to Rc) hold +0: there the values are +-0 (signs), and the outputs
            # take no sign from them (smask: the sign bit of live groups' values only)
            live_g = (gk < K) & rm                                     # [BR, 2]
            smask = tl.where(live_g, -2147483648, 0)

            # ---- block scales of the group's two MX blocks (elements 0..31, 32..63): |x| maximum, NaN
            # propagating, read as bit patterns (ordered as the values; NaN above all)
            m0 = tl.abs(xs[0])
            m1 = tl.abs(xs[32])
            for i in tl.static_range(1, 32):
                m0 = tl.maximum(m0, tl.abs(xs[i]), propagate_nan=tl.PropagateNan.ALL)
                m1 = tl.maximum(m1, tl.abs(xs[32 + i]), propagate_nan=tl.PropagateNan.ALL)
            ab0 = m0.to(tl.int32, bitcast=True)
            ab1 = m1.to(tl.int32, bitcast=True)
            ok0 = ab0 < 0x7F800000
            ok1 = ab1 < 0x7F800000
            s0, nz0 = _block_scale(tl.where(ok0, ab0, 0), RULE, GRID)
            s1, nz1 = _block_scale(tl.where(ok1, ab1, 0), RULE, GRID)
            if RULE == 5:   # adaptive: floor's exponent or the next, by the blocks' squared errors
                sa0 = _grid_scale(s0, GRID)
                sa1 = _grid_scale(s1, GRID)
                d0 = _adaptive_term(xs[0], sa0, PRESCALE, prescale, GRID)
                d1 = _adaptive_term(xs[32], sa1, PRESCALE, prescale, GRID)
                for i in tl.static_range(1, 32):
                    d0 = d0 + _adaptive_term(xs[i], sa0, PRESCALE, prescale, GRID)
                    d1 = d1 + _adaptive_term(xs[32 + i], sa1, PRESCALE, prescale, GRID)
                s0 = _adaptive_pick(s0, d0, nz0, GRID)
                s1 = _adaptive_pick(s1, d1, nz1, GRID)
            if GRID == 2:   # (E1M2's 2**-127: a float32 subnormal; device._grid_scale)
                sc0 = _pow2(-s0)
                sc1 = _pow2(-s1)
            else:
                sc0 = _pow2n(-s0)
                sc1 = _pow2n(-s1)
            if WRITE_CARRIER:
                live0 = ok0 & nz0
                live1 = ok1 & nz1
                smax = tl.maximum(tl.where(live0, s0, -127), tl.where(live1, s1, -127))   # [BR, 2]
                if GROUP_ROWS == 1:
                    G = tl.maximum(tl.max(smax, axis=1), -120)                           # [BR]
                    G2 = G[:, None]
                else:
                    G = tl.maximum(tl.max(tl.max(smax, axis=1), axis=0), -120)
                    G2 = G
                k0 = s0 - G2 + 6
                k1 = s1 - G2 + 6
                if GRID == 2:   # (device._carrier_factor, device._inexact)
                    fc0 = _carrier_factor(k0, ok0, GRID)
                    fc1 = _carrier_factor(k1, ok1, GRID)
                    inexact = _inexact(live0, k0, GRID).to(tl.int32) + _inexact(live1, k1, GRID).to(tl.int32)
                else:
                    fc0 = tl.where(ok0, _pow2n(tl.maximum(k0, -126)), float("nan"))
                    fc1 = tl.where(ok1, _pow2n(tl.maximum(k1, -126)), float("nan"))
                    inexact = (live0 & (k0 < -8 - GRID)).to(tl.int32) + (live1 & (k1 < -8 - GRID)).to(tl.int32)

            # ---- elements: stochastic-rounding index of element i = base + i * si_k
            if SR:
                if IDX64:
                    ibase = r2.to(tl.int64) * si_r + gk.to(tl.int64) * si_k
                else:
                    ibase = r2 * si_r + gk * si_k
                ku = key.to(tl.uint32, bitcast=True)
                kk = ku ^ (ku >> 16)
            else:
                kk = 0
            cs = ()
            qs = ()
            for i in tl.static_range(64):
                if i < 32:
                    sc = sc0
                    ok = ok0
                else:
                    sc = sc1
                    ok = ok1
                v = xs[i]
                if PRESCALE:
                    v = v * prescale
                v = v * sc
                if SR:
                    idx = ibase + i * si_k
                else:
                    idx = 0
                if GRID == 1:
                    q = _int4_round(v, SR, idx, key, kk, True)
                    q2 = q
                elif GRID == 2:   # E1M2: 4 v on INT4's grid (device._int4_round)
                    q = _int4_round(v * 4.0, SR, idx, key, kk, True)
                    q2 = q
                else:
                    q, q2 = _fp4_round2(v, SR, idx, key, kk, True)
                if WRITE_CARRIER:
                    if i < 32:
                        fc = fc0
                    else:
                        fc = fc1
                    cs = cs + ((q.to(tl.int32, bitcast=True)
                                | (v.to(tl.int32, bitcast=True) & smask)).to(tl.float32, bitcast=True) * fc,)
                if WRITE_FP4:
                    if GRID != 0:   # INT4, E1M2: the magnitude is the code
                        c = q.to(tl.int32) | (((v.to(tl.int32, bitcast=True) & smask) >> 28) & 8)
                    else:
                        cf = tl.minimum(tl.minimum(q * 2.0, q2), tl.fma(q, 0.5, 4.0))   # as _fp4_code (q2 = q + 2)
                        c = ((cf + 12582912.0).to(tl.int32, bitcast=True) & 0xF) | (((v.to(tl.int32, bitcast=True)
                                                                                      & smask) >> 28) & 8)
                    qs = qs + (tl.where(ok, c, 0),)

            r3 = rows[:, None, None]
            if WRITE_FP4:
                pk = ()
                for i in tl.static_range(32):
                    pk = pk + ((qs[2 * i] | (qs[2 * i + 1] << 4)).to(tl.uint8),)
                jb = gk[:, :, None] // 2 + tl.arange(0, 32)[None, None, :]
                tl.store(fp4_ptr + r3 * (Kq // 2) + jb, _join_all(pk, 32), mask=(r3 < R) & (jb * 2 < Kq))
                bidx = gk // 32                                          # [1, 2] first MX block of each group
                scp = sc_ptr + r2 * (Kq // 32) + bidx
                tl.store(scp, tl.where(ok0, s0 + 127, 255).to(tl.uint8), mask=rm & (bidx * 32 < Kq))
                tl.store(scp + 1, tl.where(ok1, s1 + 127, 255).to(tl.uint8), mask=rm & (bidx * 32 + 32 < Kq))

            if WRITE_CARRIER:
                cb = gk[:, :, None] + tl.arange(0, 64)[None, None, :]
                tl.store(car_ptr + r3 * Kc + cb, _e4m3_bits(_join_all(cs, 64), USE_ASM), mask=r3 < Rc)
                gval = _pow2(G - 6)
                if GROUP_ROWS == 1:
                    tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
                else:
                    tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
                nin = tl.sum(tl.sum(tl.where(rm, inexact, 0), axis=1), axis=0)
                tl.atomic_add(cnt_ptr, nin, mask=nin > 0)  # rare: no contention on the common path

        elif LAYOUT == "tile":
            # ================================================================ tile: one [BR, 128] tensor
            cols = kbase + tl.arange(0, 128)
            r2 = rows[:, None]
            c2 = cols[None, :]
            r3 = rows[:, None, None]
            c3 = kbase + (tl.arange(0, 4) * 32)[None, :, None] + tl.arange(0, 32)[None, None, :]
            inb = (r2 < R) & (c2 < K)
            x = _f32(tl.load(x_ptr + r2 * sx_r + c2 * sx_k, mask=inb, other=0.0))

            # ---- optional blockwise Hadamard (signs first, butterfly h = 1..ROT/2, one scale multiply)
            if ROT > 0:
                if HAS_SIGNS and ROT > 1:   # signs and stage 1 as FMAs of exact products (_signs_bfly1)
                    sg = tl.load(signs_ptr + (tl.arange(0, 128) % ROT))
                    x = _bfly_signs(x, tl.broadcast_to(sg[None, :], [BR, 128]), BR)
                elif HAS_SIGNS:
                    sg = tl.load(signs_ptr + (tl.arange(0, 128) % ROT))
                    x = x * sg[None, :]
                elif ROT > 1:
                    x = _bfly(x, BR, 1)
                if ROT > 2:
                    x = _bfly(x, BR, 2)
                if ROT > 4:
                    x = _bfly(x, BR, 4)
                if ROT > 8:
                    x = _bfly(x, BR, 8)
                if ROT > 16:
                    x = _bfly(x, BR, 16)
                if ROT > 32:
                    x = _bfly(x, BR, 32)
                if ROT > 64:
                    x = _bfly(x, BR, 64)
                x = x * inv_sqrt
                # the reference pads with +0 only to whole rotation blocks; beyond that, +0 block padding;
                # padding rows (up to Rc) hold +0
                Kr = ((K + ROT - 1) // ROT) * ROT
                x = tl.where((c2 < Kr) & (r2 < R), x, 0.0)
            xb = tl.reshape(x, [BR, 4, 32])
            # ---- block scales (from the values before the prescale, as the reference) (4 blocks of 32 per row)
            # |x| bit patterns order like the values; NaN/Inf have the largest ones (exponent 0xFF)
            mbits = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)   # [BR, 4]
            ok = mbits < 0x7F800000
            abits = tl.where(ok, mbits, 0)
            s, nz = _block_scale(abits, RULE, GRID)
            if RULE == 5:   # adaptive: floor's exponent or the next, by the block's squared errors
                d = tl.sum(_adaptive_term(xb, _grid_scale(s, GRID)[:, :, None], PRESCALE, prescale, GRID), axis=2)
                s = _adaptive_pick(s, d, nz, GRID)
            code_sc = tl.where(ok, s + 127, 255)

            # ---- elements
            if PRESCALE:
                xb = xb * prescale
            if GRID == 2:
                v = xb * _grid_scale(s, GRID)[:, :, None]
            else:
                v = xb * _pow2n(-s)[:, :, None]
            v = tl.where(ok[:, :, None], v, 0.0)
            vbits = v.to(tl.int32, bitcast=True)
            if GRID == 1:   # INT4: rr the magnitude (0..7), which is also the code
                if SR:
                    rr = _int4_round(v, SR, r3.to(tl.int64) * si_r + c3.to(tl.int64) * si_k, key)
                else:
                    rr = _int4_round(v, SR, 0, key)
                mag = rr.to(tl.int32)
            elif GRID == 2:   # E1M2: 4 v on INT4's grid (device._int4_round), rr the code
                if SR:
                    rr = _int4_round(v * 4.0, SR, r3.to(tl.int64) * si_r + c3.to(tl.int64) * si_k, key)
                else:
                    rr = _int4_round(v * 4.0, SR, 0, key)
                mag = rr.to(tl.int32)
            else:
                a = tl.minimum(tl.abs(v), 6.0)
                e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 0)
                p = _pow2n(1 - e)
                if SR:
                    y = a * p
                    idx = r3.to(tl.int64) * si_r + c3.to(tl.int64) * si_k
                    u3 = _uniform(idx, key)
                    fl = y.to(tl.int32).to(tl.float32)
                    # (y - fl as an explicit FMA: p = 2**(1-e) with e = 0 for a < 2 (p = 2) and a >= 2**e, so a * p
                    # is exact (no underflow: a times 2, 1 or 0.5 where a >= 4): the product-then-subtract either
                    # way, and contraction, on or off, leaves the code as written; -fl as fl * -1.0: _fp4_round2)
                    rr = fl + tl.where(u3 < tl.fma(a, p, fl * -1.0), 1.0, 0.0)
                else:
                    # (a * p is exact: written as the FMA it is, so contraction on or off leaves the code as written)
                    rr = tl.fma(a, p, 12582912.0) - 12582912.0
                ri = rr.to(tl.int32)
                mag = tl.minimum(ri + 2 * e, 7)                              # E2M1 magnitude code

            if WRITE_FP4:
                code = mag | ((vbits >> 28) & 8)
                c2d = tl.reshape(code, [BR, 64, 2])
                lo4, hi4 = tl.split(c2d)
                byte = (lo4 | (hi4 << 4)).to(tl.uint8)
                jb = kbase // 2 + tl.arange(0, 64)
                m4 = (r2 < R) & (jb[None, :] * 2 < Kq)
                tl.store(fp4_ptr + r2 * (Kq // 2) + jb[None, :], byte, mask=m4)
                bidx = kbase // 32 + tl.arange(0, 4)
                msc = (r2 < R) & (bidx[None, :] * 32 < Kq)
                tl.store(sc_ptr + r2 * (Kq // 32) + bidx[None, :], code_sc.to(tl.uint8), mask=msc)

            if WRITE_CARRIER:
                live = ok & nz
                G, kexp = _carrier_exp(s, live, GROUP_ROWS)                # kexp [BR, 4]
                if GRID == 2:
                    inexact = _inexact(live, kexp, GRID)
                else:
                    inexact = live & (kexp < -8 - GRID)
                # e4m3 bits of c = (FP4 value) * 2**kexp, exact in float32 (the value has at most two
                # significant bits). In e4m3's normal range the bits are the float32 exponent and top
                # mantissa bits, rebiased; below 2**-6 they are the subnormal count k = RNE(c * 2**9),
                # rounded by the float add of 1.5 * 2**23. (Float ops: the integer pipes have half the
                # throughput, and Triton's fp32 -> e4m3 cast wrote wrong bytes on sm_90: module docstring.)
                if GRID == 1:   # INT4: magnitude rr (an integer) times 2**kexp
                    cval = rr * _pow2n(tl.maximum(kexp, -126))[:, :, None]
                elif GRID == 2:   # E1M2: rr / 4 times 2**kexp
                    cval = rr * _pow2n(tl.maximum(kexp - 2, -126))[:, :, None]
                else:
                    cval = rr * _pow2n(tl.maximum(e - 1 + kexp[:, :, None], -126))
                nrm = (cval.to(tl.int32, bitcast=True) >> 20) - 960
                sub = tl.fma(cval, 512.0, 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000   # (exact product)
                bits8 = tl.where(cval < 0.015625, sub, nrm)
                bits8 = bits8 | ((vbits >> 24) & 0x80)
                bits8 = tl.where(ok[:, :, None], bits8, 0x7F)
                # stored through 3-D pointers (no reshape back to [BR, 128])
                tl.store(car_ptr + r3 * Kc + c3, bits8.to(tl.uint8), mask=r3 < Rc)
                gval = _pow2(G - 6)
                if GROUP_ROWS == 1:
                    tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
                else:
                    tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
                nin = tl.sum(tl.sum((inexact & (rows[:, None] < R)).to(tl.int32), axis=1), axis=0)
                tl.atomic_add(cnt_ptr, nin, mask=nin > 0)  # rare: no contention on the common path

        elif LAYOUT == "blocks":
            # ================================================================ blocks: four [BR, 4, 8] pieces
            # For ROT in (0, 2, 4, 8, 16, 32). The 128-wide tile is loaded as four pieces x0..x3 of shape
            # [BR, 4, 8] (piece j = elements 8j..8j+7 of each MX block), so each thread holds whole MX blocks:
            # block maxima and rotation stages h >= 8 are register-local; stages h < 8 stay inside a thread's
            # 8 contiguous values. ``BFIRST``: the pieces as [4, BR, 8] (blocks first), the same values and bytes.
            # Triton orders a load's axes by contiguity and keeps ties in axis order, so after the 8 contiguous
            # values the next lanes go along the first axis: rows in [BR, 4, 8] (a row's 4 blocks then lie in
            # 4 warps, and its 1x128 group maximum crosses warps through shared memory), blocks in [4, BR, 8] (a
            # row's 4 blocks in 4 neighbouring lanes of one warp: the group maximum is two shuffles).
            if BFIRST:
                r3 = rows[None, :, None]
                blk = tl.arange(0, 4)[:, None, None]
            else:
                r3 = rows[:, None, None]
                blk = tl.arange(0, 4)[None, :, None]
            ee = tl.arange(0, 8)[None, None, :]
            c0 = kbase + blk * 32 + ee                     # [1, 4, 8] ([4, 1, 8]) columns of piece 0
            c1 = c0 + 8
            c2 = c0 + 16
            c3 = c0 + 24
            rm = r3 < R
            xp = x_ptr + r3 * sx_r
            x0 = _f32b(tl.load(xp + c0 * sx_k, mask=rm & (c0 < K), other=0.0))
            x1 = _f32b(tl.load(xp + c1 * sx_k, mask=rm & (c1 < K), other=0.0))
            x2 = _f32b(tl.load(xp + c2 * sx_k, mask=rm & (c2 < K), other=0.0))
            x3 = _f32b(tl.load(xp + c3 * sx_k, mask=rm & (c3 < K), other=0.0))

            if ROT > 0:
                if HAS_SIGNS and ROT > 1:   # signs and stage 1 as FMAs of exact products (_signs_bfly1)
                    lb = blk * 32 + ee
                    x0 = _bfly8_signs(x0, tl.broadcast_to(tl.load(signs_ptr + lb % ROT), x0.shape))
                    x1 = _bfly8_signs(x1, tl.broadcast_to(tl.load(signs_ptr + (lb + 8) % ROT), x1.shape))
                    x2 = _bfly8_signs(x2, tl.broadcast_to(tl.load(signs_ptr + (lb + 16) % ROT), x2.shape))
                    x3 = _bfly8_signs(x3, tl.broadcast_to(tl.load(signs_ptr + (lb + 24) % ROT), x3.shape))
                elif HAS_SIGNS:
                    lb = blk * 32 + ee
                    x0 = x0 * tl.load(signs_ptr + lb % ROT)
                    x1 = x1 * tl.load(signs_ptr + (lb + 8) % ROT)
                    x2 = x2 * tl.load(signs_ptr + (lb + 16) % ROT)
                    x3 = x3 * tl.load(signs_ptr + (lb + 24) % ROT)
                elif ROT > 1:
                    x0 = _bfly8(x0, 1)
                    x1 = _bfly8(x1, 1)
                    x2 = _bfly8(x2, 1)
                    x3 = _bfly8(x3, 1)
                if ROT > 2:
                    x0 = _bfly8(x0, 2)
                    x1 = _bfly8(x1, 2)
                    x2 = _bfly8(x2, 2)
                    x3 = _bfly8(x3, 2)
                if ROT > 4:
                    x0 = _bfly8(x0, 4)
                    x1 = _bfly8(x1, 4)
                    x2 = _bfly8(x2, 4)
                    x3 = _bfly8(x3, 4)
                if ROT > 8:
                    t0 = x0 - x1
                    x0 = x0 + x1
                    x1 = t0
                    t2 = x2 - x3
                    x2 = x2 + x3
                    x3 = t2
                if ROT > 16:
                    t0 = x0 - x2
                    x0 = x0 + x2
                    x2 = t0
                    t1 = x1 - x3
                    x1 = x1 + x3
                    x3 = t1
                if not FOLD:   # FOLD: the 1/sqrt(ROT) normalization goes into the block scales (below)
                    x0 = x0 * inv_sqrt
                    x1 = x1 * inv_sqrt
                    x2 = x2 * inv_sqrt
                    x3 = x3 * inv_sqrt
                if HAS_SIGNS:  # signs turn padding zeros into -0; the reference pads +0 past whole rotation
                    # blocks, and padding rows (up to Rc) hold +0
                    Kr = ((K + ROT - 1) // ROT) * ROT
                    x0 = tl.where((c0 < Kr) & rm, x0, 0.0)
                    x1 = tl.where((c1 < Kr) & rm, x1, 0.0)
                    x2 = tl.where((c2 < Kr) & rm, x2, 0.0)
                    x3 = tl.where((c3 < Kr) & rm, x3, 0.0)

            # ---- block scales: |x| maximum per MX block (NaN propagates), as the reference
            m = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1), propagate_nan=tl.PropagateNan.ALL),
                           tl.maximum(tl.abs(x2), tl.abs(x3), propagate_nan=tl.PropagateNan.ALL),
                           propagate_nan=tl.PropagateNan.ALL)
            # the last 8 in-thread values by their bit patterns (ordered as the values; NaN above all)
            abits = tl.max(m.to(tl.int32, bitcast=True), axis=2)             # [BR, 4]
            if FOLD:   # the normalized block maximum (exact: launch.FOLD_ROTS)
                abits = (abits.to(tl.float32, bitcast=True) * inv_sqrt).to(tl.int32, bitcast=True)
            ok = abits < 0x7F800000                                           # not NaN / Inf
            abits = tl.where(ok, abits, 0)
            s, nz = _block_scale(abits, RULE, GRID)
            if RULE == 5:   # adaptive: floor's exponent or the next, by the block's squared errors
                if FOLD:
                    sa = (_grid_scale(s, GRID) * inv_sqrt)[:, :, None]
                else:
                    sa = _grid_scale(s, GRID)[:, :, None]
                d = (tl.sum(_adaptive_term(x0, sa, PRESCALE, prescale, GRID), axis=2)
                     + tl.sum(_adaptive_term(x1, sa, PRESCALE, prescale, GRID), axis=2)
                     + tl.sum(_adaptive_term(x2, sa, PRESCALE, prescale, GRID), axis=2)
                     + tl.sum(_adaptive_term(x3, sa, PRESCALE, prescale, GRID), axis=2))
                s = _adaptive_pick(s, d, nz, GRID)
            code_sc = tl.where(ok, s + 127, 255)
            if GRID == 2:
                if FOLD:
                    sc = (_grid_scale(s, GRID) * inv_sqrt)[:, :, None]
                else:
                    sc = _grid_scale(s, GRID)[:, :, None]
            elif FOLD:
                sc = (_pow2n(-s) * inv_sqrt)[:, :, None]
            else:
                sc = _pow2n(-s)[:, :, None]
            ok3 = ok[:, :, None]

            if WRITE_CARRIER:
                live = ok & nz
                G, kexp = _carrier_exp(s, live, GROUP_ROWS, BFIRST)
                if GRID == 2:
                    inexact = _inexact(live, kexp, GRID)
                    fc = _carrier_factor(kexp, ok, GRID)[:, :, None]
                else:
                    inexact = live & (kexp < -8 - GRID)
                    fc = tl.where(ok, _pow2n(tl.maximum(kexp, -126)), float("nan"))[:, :, None]
            else:
                fc = sc

            if SR:
                if IDX64:
                    ri = r3.to(tl.int64) * si_r
                    i0 = ri + c0.to(tl.int64) * si_k
                    i1 = ri + c1.to(tl.int64) * si_k
                    i2 = ri + c2.to(tl.int64) * si_k
                    i3 = ri + c3.to(tl.int64) * si_k
                else:   # every index below 2**31 (IDX64 counts the index strides too)
                    ri = r3 * si_r
                    i0 = ri + c0 * si_k
                    i1 = ri + c1 * si_k
                    i2 = ri + c2 * si_k
                    i3 = ri + c3 * si_k
            else:
                i0 = 0
                i1 = 0
                i2 = 0
                i3 = 0
            # (FC_FOLD: the carrier's multiplies by sc and fc as one, device._piece; not for the adaptive rule with
            # 128x128 groups, whose 128-row launch under its 80-register cap spilled with the two per-block
            # factors that the fold keeps live)
            FC_FOLD: tl.constexpr = not (RULE == 5 and GROUP_ROWS != 1)
            b0, q0 = _piece(x0, sc, fc, ok3, SR, i0, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM,
                            GRID=GRID, FC_FOLD=FC_FOLD)
            b1, q1 = _piece(x1, sc, fc, ok3, SR, i1, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM,
                            GRID=GRID, FC_FOLD=FC_FOLD)
            b2, q2 = _piece(x2, sc, fc, ok3, SR, i2, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM,
                            GRID=GRID, FC_FOLD=FC_FOLD)
            b3, q3 = _piece(x3, sc, fc, ok3, SR, i3, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4, USE_ASM,
                            GRID=GRID, FC_FOLD=FC_FOLD)

            if WRITE_FP4:
                fb = fp4_ptr + r3 * (Kq // 2)
                # the block's 16 bytes in one store
                D0: tl.constexpr = q0.shape[0]   # BR, or 4 (BFIRST)
                D1: tl.constexpr = q0.shape[1]
                p01 = tl.reshape(tl.permute(tl.join(_pack4(q0), _pack4(q1)), (0, 1, 3, 2)), [D0, D1, 8])
                p23 = tl.reshape(tl.permute(tl.join(_pack4(q2), _pack4(q3)), (0, 1, 3, 2)), [D0, D1, 8])
                pp = tl.reshape(tl.permute(tl.join(p01, p23), (0, 1, 3, 2)), [D0, D1, 16])
                jb = kbase // 2 + blk * 16 + tl.arange(0, 16)[None, None, :]
                # (a block's 16 bytes lie wholly before Kq, a multiple of 32, or wholly past it: the mask by the
                # block's first column is the same for each byte and lets the store be one 16-byte access)
                tl.store(fb + jb, pp, mask=rm & (kbase + blk * 32 < Kq))
                if BFIRST:
                    r2 = rows[None, :]
                    bidx = kbase // 32 + tl.arange(0, 4)[:, None]
                else:
                    r2 = rows[:, None]
                    bidx = kbase // 32 + tl.arange(0, 4)[None, :]
                tl.store(sc_ptr + r2 * (Kq // 32) + bidx, code_sc.to(tl.uint8), mask=(r2 < R) & (bidx * 32 < Kq))

            if WRITE_CARRIER:
                # one 32-byte run per thread and block: join the pieces back in column order. (Triton stores at
                # most 16 bytes a thread at once, so its store layout spreads the run over two lanes and the 32
                # bytes pass through shared memory first; ``SPLIT16``: the two 16-byte halves stored from the
                # thread that holds them, no exchange.)
                E0: tl.constexpr = b0.shape[0]   # BR, or 4 (BFIRST)
                E1: tl.constexpr = b0.shape[1]
                b01 = tl.reshape(tl.permute(tl.join(b0, b1), (0, 1, 3, 2)), [E0, E1, 16])
                b23 = tl.reshape(tl.permute(tl.join(b2, b3), (0, 1, 3, 2)), [E0, E1, 16])
                if SPLIT16:
                    cb = kbase + blk * 32 + tl.arange(0, 16)[None, None, :]
                    tl.store(car_ptr + r3 * Kc + cb, b01, mask=r3 < Rc)
                    tl.store(car_ptr + r3 * Kc + cb + 16, b23, mask=r3 < Rc)
                else:
                    bb = tl.reshape(tl.permute(tl.join(b01, b23), (0, 1, 3, 2)), [E0, E1, 32])
                    cb = kbase + blk * 32 + tl.arange(0, 32)[None, None, :]
                    tl.store(car_ptr + r3 * Kc + cb, bb, mask=r3 < Rc)
                gval = _pow2(G - 6)
                if GROUP_ROWS == 1:
                    tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
                else:
                    tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
                if BFIRST:
                    bad = inexact & (rows[None, :] < R)
                else:
                    bad = inexact & (rows[:, None] < R)
                tl.atomic_add(cnt_ptr + tl.zeros_like(s), 1, mask=bad)   # rare: usually no lane is active

        else:
            # ================================================================ cols: 32 [4, BR] tensors
            # For ROT in (0, 2, 4, 8, 16, 32), made for inputs whose output rows are the contiguous axis
            # (quantizing along columns: a [tokens, features] activation or gradient along tokens, for Wgrad).
            # The 128-long reduction range is loaded as 32 tensors x[j] of shape [4, BR] (x[j][b, r] = element
            # 32 b + j of the range, row r): every load is coalesced along the rows, and the block maxima and
            # every rotation stage are element-wise between the 32 tensors. Only the 1-byte results change
            # layout: joined into [4, BR, 32], each thread stores whole 32-byte carrier blocks (16-byte FP4
            # blocks) of the transposed output.
            tl.static_assert(LAYOUT == "cols", "LAYOUT: tile, blocks or cols")
            r2 = rows[None, :]                                  # [1, BR]
            kb = kbase + tl.arange(0, 4)[:, None] * 32          # [4, 1] first column of each MX block
            rm = r2 < R
            # (column kb + j read through a pointer stepped by sx_k from column kb's, and masked by j < K - kb:
            # the same addresses and masks as xp + (kb + j) * sx_k and kb + j < K, with one 64-bit add a column
            # for the address and one comparison with a constant for the mask)
            xq = x_ptr + r2 * sx_r + kb * sx_k
            kl = K - kb
            xs = ()
            for j in tl.static_range(32):
                xs = xs + (_f32b(tl.load(xq, mask=rm & (j < kl), other=0.0)),)
                xq += sx_k

            if ROT > 0:
                if HAS_SIGNS and ROT > 1:   # signs and stage 1 as FMAs of exact products (_signs_bfly1)
                    w = ()
                    for j in tl.static_range(0, 32, 2):
                        p, m = _signs_bfly1(xs[j], xs[j + 1], tl.load(signs_ptr + j % ROT),
                                            tl.load(signs_ptr + (j + 1) % ROT))
                        w = w + (p, m)
                    xs = w
                elif HAS_SIGNS:
                    w = ()
                    for j in tl.static_range(32):
                        w = w + (xs[j] * tl.load(signs_ptr + j % ROT),)
                    xs = w
                elif ROT > 1:
                    xs = _bfly_tuple(xs, 1)
                if ROT > 2:
                    xs = _bfly_tuple(xs, 2)
                if ROT > 4:
                    xs = _bfly_tuple(xs, 4)
                if ROT > 8:
                    xs = _bfly_tuple(xs, 8)
                if ROT > 16:
                    xs = _bfly_tuple(xs, 16)
                w = ()
                for j in tl.static_range(32):
                    if FOLD:   # the 1/sqrt(ROT) normalization goes into the block scales (below)
                        v = xs[j]
                    else:
                        v = xs[j] * inv_sqrt
                    if HAS_SIGNS:  # signs turn padding zeros into -0: +0 past whole rotation blocks and rows
                        v = tl.where(rm & (kb + j < ((K + ROT - 1) // ROT) * ROT), v, 0.0)
                    w = w + (v,)
                xs = w

            # ---- block scales: |x| maximum per MX block (NaN propagates, as the blocks layout's), a tree of float
            # maxima whose first level takes the absolute values as operand modifiers; read as a bit pattern (NaN
            # and Inf at or above 0x7F800000, finite maxima the same as the integer maximum of |x|'s patterns)
            ms = ()
            for j in tl.static_range(0, 32, 2):
                ms = ms + (tl.maximum(tl.abs(xs[j]), tl.abs(xs[j + 1]), propagate_nan=tl.PropagateNan.ALL),)
            abits = _max_tree16(ms).to(tl.int32, bitcast=True)
            if FOLD:   # the normalized block maximum (exact: launch.FOLD_ROTS)
                abits = (abits.to(tl.float32, bitcast=True) * inv_sqrt).to(tl.int32, bitcast=True)
            ok = abits < 0x7F800000                                           # not NaN / Inf
            abits = tl.where(ok, abits, 0)
            s, nz = _block_scale(abits, RULE, GRID)                                 # [4, BR]
            if RULE == 5:   # adaptive: floor's exponent or the next, by the blocks' squared errors
                if FOLD:
                    sa = _grid_scale(s, GRID) * inv_sqrt
                else:
                    sa = _grid_scale(s, GRID)
                d = _adaptive_term(xs[0], sa, PRESCALE, prescale, GRID)
                for j in tl.static_range(1, 32):
                    d = d + _adaptive_term(xs[j], sa, PRESCALE, prescale, GRID)
                s = _adaptive_pick(s, d, nz, GRID)
            code_sc = tl.where(ok, s + 127, 255)
            if GRID == 2:
                if FOLD:
                    sc = _grid_scale(s, GRID) * inv_sqrt
                else:
                    sc = _grid_scale(s, GRID)
            elif FOLD:
                sc = _pow2n(-s) * inv_sqrt
            else:
                sc = _pow2n(-s)

            if WRITE_CARRIER:
                live = ok & nz
                s_live = tl.where(live, s, -127)
                if GROUP_ROWS == 1:
                    G = tl.maximum(tl.max(s_live, axis=0), -120)              # [BR]
                    G2 = G[None, :]
                else:
                    G = tl.maximum(tl.max(tl.max(s_live, axis=0), axis=0), -120)
                    G2 = G
                kexp = s - G2 + 6
                if GRID == 2:
                    inexact = _inexact(live, kexp, GRID)
                    fc = _carrier_factor(kexp, ok, GRID)
                else:
                    inexact = live & (kexp < -8 - GRID)
                    fc = tl.where(ok, _pow2n(tl.maximum(kexp, -126)), float("nan"))
            else:
                fc = sc

            bs = ()
            qs = ()
            for j in tl.static_range(32):
                if SR:
                    if IDX64:
                        idx = r2.to(tl.int64) * si_r + (kb + j).to(tl.int64) * si_k
                    else:
                        idx = r2 * si_r + (kb + j) * si_k
                else:
                    idx = 0
                b, q = _piece(xs[j], sc, fc, ok, SR, idx, key, PRESCALE, prescale, WRITE_CARRIER, WRITE_FP4,
                              USE_ASM, PACK, GRID)
                bs = bs + (b,)
                qs = qs + (q,)

            r3 = rows[None, :, None]
            kb3 = kb[:, :, None]
            if WRITE_FP4:
                pk = ()
                for i in tl.static_range(16):   # (low 4 bits of each code: as device._pack4)
                    pk = pk + ((qs[2 * i] + (qs[2 * i + 1] << 4)).to(tl.uint8),)
                jb = kb3 // 2 + tl.arange(0, 16)[None, None, :]
                # (by the block's first column: one mask for its 16 bytes, as in the blocks layout; the row length
                # Kq / 2 written (Kq // 32) * 16, its value, so that the compiler sees 16-byte aligned rows)
                tl.store(fp4_ptr + r3 * ((Kq // 32) * 16) + jb, _join_tree(pk, 16, BR), mask=(r3 < R) & (kb3 < Kq))
                bi = kb // 32
                tl.store(sc_ptr + r2 * (Kq // 32) + bi, code_sc.to(tl.uint8), mask=rm & (kb < Kq))

            if WRITE_CARRIER:
                cb = kb3 + tl.arange(0, 32)[None, None, :]
                tl.store(car_ptr + r3 * Kc + cb, _join_tree(bs, 32, BR), mask=r3 < Rc)
                gval = _pow2(G - 6)
                if GROUP_ROWS == 1:
                    tl.store(gs_ptr + rows * gs_sr + pid_k * gs_sk, gval, mask=rows < Rc)
                else:
                    tl.store(gs_ptr + pid_r * gs_sr + pid_k * gs_sk, gval)
                bad = inexact & rm
                tl.atomic_add(cnt_ptr + tl.zeros_like(s), 1, mask=bad)   # rare: usually no lane is active


    @triton.jit(do_not_specialize=["key_a", "key_b"])
    def _mxfp4_dual_kernel(
        x_ptr, cnt_ptr,
        sg_a, car_a, gs_a, kp_a,
        sg_b, car_b, gs_b, kp_b,
        M, K, sx_m, sx_k,
        Rc_a, si_ra, si_ka, Kc_a, Kq_a, gsr_a, gsk_a,
        Rc_b, si_rb, si_kb, Kc_b, Kq_b, gsr_b, gsk_b,
        nr_a, nk_a, nr_b, nk_b, F,
        key_a, inv_a, ps_a, key_b, inv_b, ps_b,
        BR_A: tl.constexpr, ROT_A: tl.constexpr, HAS_SIGNS_A: tl.constexpr, RULE_A: tl.constexpr,
        SR_A: tl.constexpr, PRESCALE_A: tl.constexpr, KEY_PTR_A: tl.constexpr,
        BR_B: tl.constexpr, ROT_B: tl.constexpr, HAS_SIGNS_B: tl.constexpr, RULE_B: tl.constexpr,
        SR_B: tl.constexpr, PRESCALE_B: tl.constexpr, KEY_PTR_B: tl.constexpr, GROUP_ROWS_B: tl.constexpr,
        PACK_B: tl.constexpr,
        IDX64: tl.constexpr, USE_ASM: tl.constexpr, SEQ: tl.constexpr,
        FOLD_A: tl.constexpr, FOLD_B: tl.constexpr, CAR_B: tl.constexpr = True, FP4_B: tl.constexpr = False,
        GRID_A: tl.constexpr = 0, GRID_B: tl.constexpr = 0, GROUP_ROWS_A: tl.constexpr = 1,
        BFIRST_A: tl.constexpr = False, SPLIT16_A: tl.constexpr = False,
    ):
        """Both FP8-carrier operands of a row-major (M, K) tensor from one read of it: A quantized along
        rows (K; the "blocks" layout of ``_mxfp4_kernel``, 1x128 group scales) and B along columns (M; the
        "cols" layout). Programs come in groups of ``128 / BR_A`` A tiles and ``128 / BR_B`` B tiles that
        cover the same 128 x 128 block of the input, so the B tiles read what the A tiles just brought into
        the L2 cache (one pass over HBM instead of two). ``SEQ``: one program runs all of a block's A tiles,
        then its B tiles (the B reads come after the A reads, from L2). ``F``: 128-wide blocks along K;
        ``nr_*``, ``nk_*``: each output's grid. ``FP4_B`` (with ``CAR_B`` False): B as packed FP4 codes
        (``car_b``) and E8M0 scales (``gs_b``) instead of the carrier. A's FP4 pointers are the counter
        (never written); B's carrier and FP4 pointers are the same two buffers, of which one kind is written.
        ``GROUP_ROWS_A``: A's carrier groups, 1x128 (activations) or 128x128 (a weight's Fprop operand, with
        ``BR_A`` 128; B then holds its Dgrad operand, also 128x128). ``BFIRST_A``, ``SPLIT16_A``: A's tile as [4, BR_A,
        8] pieces, A's carrier in 16-byte stores (``_mxfp4_kernel``'s ``BFIRST``, ``SPLIT16``)."""
        NA: tl.constexpr = 128 // BR_A
        NB: tl.constexpr = 128 // BR_B
        pid = tl.program_id(0)
        if SEQ:
            tb = pid // F
            fb = pid % F
            for w in range(NA):
                pr = tb * NA + w
                if (pr < nr_a) & (fb < nk_a):
                    _mxfp4_kernel(x_ptr, sg_a, car_a, gs_a, cnt_ptr, cnt_ptr, cnt_ptr, kp_a,
                                  M, K, Rc_a, sx_m, sx_k, si_ra, si_ka, Kc_a, Kq_a, gsr_a, gsk_a, key_a, inv_a, ps_a,
                                  BR_A, ROT_A, HAS_SIGNS_A, RULE_A, SR_A, PRESCALE_A, GROUP_ROWS_A, True, False, IDX64,
                                  KEY_PTR_A, "blocks", USE_ASM=USE_ASM, FOLD=FOLD_A, GRID=GRID_A,
                                  BFIRST=BFIRST_A, SPLIT16=SPLIT16_A, pid_r=pr, pid_k=fb)
            for w in range(NB):
                pr = fb * NB + w
                if (pr < nr_b) & (tb < nk_b):
                    _mxfp4_kernel(x_ptr, sg_b, car_b, gs_b, car_b, gs_b, cnt_ptr, kp_b,
                                  K, M, Rc_b, sx_k, sx_m, si_rb, si_kb, Kc_b, Kq_b, gsr_b, gsk_b, key_b, inv_b, ps_b,
                                  BR_B, ROT_B, HAS_SIGNS_B, RULE_B, SR_B, PRESCALE_B, GROUP_ROWS_B, CAR_B, FP4_B,
                                  IDX64, KEY_PTR_B, "cols", USE_ASM=USE_ASM, PACK=PACK_B, FOLD=FOLD_B, GRID=GRID_B,
                                  pid_r=pr, pid_k=tb)
        else:
            g = pid // (NA + NB)
            w = pid % (NA + NB)
            tb = g // F          # 128-row block of the input (tokens)
            fb = g % F           # 128-column block (features)
            if w < NA:
                pr = tb * NA + w
                if (pr < nr_a) & (fb < nk_a):
                    _mxfp4_kernel(x_ptr, sg_a, car_a, gs_a, cnt_ptr, cnt_ptr, cnt_ptr, kp_a,
                                  M, K, Rc_a, sx_m, sx_k, si_ra, si_ka, Kc_a, Kq_a, gsr_a, gsk_a, key_a, inv_a, ps_a,
                                  BR_A, ROT_A, HAS_SIGNS_A, RULE_A, SR_A, PRESCALE_A, GROUP_ROWS_A, True, False, IDX64,
                                  KEY_PTR_A, "blocks", USE_ASM=USE_ASM, FOLD=FOLD_A, GRID=GRID_A,
                                  BFIRST=BFIRST_A, SPLIT16=SPLIT16_A, pid_r=pr, pid_k=fb)
            else:
                pr = fb * NB + (w - NA)
                if (pr < nr_b) & (tb < nk_b):
                    _mxfp4_kernel(x_ptr, sg_b, car_b, gs_b, car_b, gs_b, cnt_ptr, kp_b,
                                  K, M, Rc_b, sx_k, sx_m, si_rb, si_kb, Kc_b, Kq_b, gsr_b, gsk_b, key_b, inv_b, ps_b,
                                  BR_B, ROT_B, HAS_SIGNS_B, RULE_B, SR_B, PRESCALE_B, GROUP_ROWS_B, CAR_B, FP4_B,
                                  IDX64, KEY_PTR_B, "cols", USE_ASM=USE_ASM, PACK=PACK_B, FOLD=FOLD_B, GRID=GRID_B,
                                  pid_r=pr, pid_k=tb)

    @triton.jit(do_not_specialize=["key"])
    def _mxfp4_group_kernel(
        signs_ptr, cnt_ptr, key_ptr, key, inv_sqrt, prescale,
        x0, car0, gs0, R0, K0, Rc0, sxr0, sxk0, sir0, sik0, Kc0, Kq0, gsr0, gsk0, nk0, end0,
        x1, car1, gs1, R1, K1, Rc1, sxr1, sxk1, sir1, sik1, Kc1, Kq1, gsr1, gsk1, nk1, end1,
        x2, car2, gs2, R2, K2, Rc2, sxr2, sxk2, sir2, sik2, Kc2, Kq2, gsr2, gsk2, nk2, end2,
        x3, car3, gs3, R3, K3, Rc3, sxr3, sxk3, sir3, sik3, Kc3, Kq3, gsr3, gsk3, nk3, end3,
        G: tl.constexpr,
        BR: tl.constexpr, ROT: tl.constexpr, HAS_SIGNS: tl.constexpr, RULE: tl.constexpr,
        SR: tl.constexpr, PRESCALE: tl.constexpr, GROUP_ROWS: tl.constexpr, IDX64: tl.constexpr,
        KEY_PTR: tl.constexpr, LAYOUT: tl.constexpr, USE_ASM: tl.constexpr = False, PACK: tl.constexpr = 4,
        FOLD: tl.constexpr = False, GRID: tl.constexpr = 0, BFIRST: tl.constexpr = False,
        SPLIT16: tl.constexpr = False,
    ):
        """Up to 4 tensors (``G``) quantized in one launch, each as its own single pass of ``_mxfp4_kernel`` would
        (one variant: the same constexprs, signs, key and floats; FP8 carriers only): tensor ``g``'s tiles are the
        programs from ``end{g-1}`` (0 for the first) to ``end{g}``, ``nk{g}`` reduction blocks a row block. Made for
        the weights of a model, whose passes are small grids that one launch each leaves mostly idle
        (``launch.group_spec``; the compiled layer's ``w_group`` setting). Unused slots (``g >= G``) are never
        read."""
        pid = tl.program_id(0)
        # the slot of this program, chosen by selects (one straight-line body: a branch per slot made the compiler
        # keep each copy's shared-memory barriers and spill under the register cap): its pointers, integers and the
        # first program of its tiles
        slot = (x0, car0, gs0, R0, K0, Rc0, sxr0, sxk0, sir0, sik0, Kc0, Kq0, gsr0, gsk0, nk0, pid * 0)
        if G > 1:
            slot = _pick(pid >= end0, (x1, car1, gs1, R1, K1, Rc1, sxr1, sxk1, sir1, sik1, Kc1, Kq1, gsr1, gsk1, nk1,
                                       end0), slot)
        if G > 2:
            slot = _pick(pid >= end1, (x2, car2, gs2, R2, K2, Rc2, sxr2, sxk2, sir2, sik2, Kc2, Kq2, gsr2, gsk2, nk2,
                                       end1), slot)
        if G > 3:
            slot = _pick(pid >= end2, (x3, car3, gs3, R3, K3, Rc3, sxr3, sxk3, sir3, sik3, Kc3, Kq3, gsr3, gsk3, nk3,
                                       end2), slot)
        x, car, gs, R, K, Rc, sxr, sxk, sir, sik, Kc, Kq, gsr, gsk, nk, base = slot
        p = pid - base
        _mxfp4_kernel(x, signs_ptr, car, gs, cnt_ptr, cnt_ptr, cnt_ptr, key_ptr,
                      R, K, Rc, sxr, sxk, sir, sik, Kc, Kq, gsr, gsk, key, inv_sqrt, prescale,
                      BR, ROT, HAS_SIGNS, RULE, SR, PRESCALE, GROUP_ROWS, True, False, IDX64, KEY_PTR, LAYOUT,
                      USE_ASM=USE_ASM, PACK=PACK, FOLD=FOLD, GRID=GRID, BFIRST=BFIRST, SPLIT16=SPLIT16,
                      pid_r=p // nk, pid_k=p % nk)

    @triton.jit
    def _pick(s, new, cur):
        """``new`` where ``s`` else ``cur``, element by element of two tuples of 16 scalars (``_mxfp4_group_kernel``'s
        slots)."""
        out = ()
        for i in tl.static_range(16):
            out = out + (tl.where(s, new[i], cur[i]),)
        return out
