"""Compile the MXFP4 and NVFP4 quantize kernels for a GPU without one: catches GPU compile errors that Triton's
interpreter does not see, and reports each variant's registers and instruction counts.

A representative set of variants (each layout of ``_mxfp4_kernel``, rotations 0/16/32 and wider ones on the
tile layout, nearest and stochastic rounding, carrier / FP4 / both outputs, 64-bit offsets, a key in device
memory, 128x128 groups, folded normalization, and the dual kernel; the same kernels and the carrier rebuild with
the uniform INT4 grid (``GRID=1``: ``mxint4``, the ``int4 ...`` variants) and E1M2 grid (``GRID=2``: ``mxe1m2``,
the ``e1m2 ...`` variants); the ``adaptive`` scale rule (``RULE=5``, the ``adaptive ...`` variants); ``kernels/nvfp4.py``'s quantize kernel for
rows and columns, 1-D blocks and 16x16 tiles, stochastic rounding with a key in device memory, the 16-wide
Hadamard rotation inside it, its ``four_over_six`` scale rule (the ``4over6 ...`` variants), and its amax kernels
(plain and rotating); ``kernels/mxelem.py``'s MX quantizer for
FP6/FP8 elements, rows and columns, each scale rule) compiled with
``triton.compile(ASTSource(...), target=GPUTarget(...))`` and the launch options the kernels run with
(``enable_fp_fusion=False``, ``maxnreg`` where ``launch.launch_opts`` sets it), and with the argument
specialization a real launch on an example operand gets (default 16384 x 768 bf16, the 125M model's activations;
``--shape``): the launcher builds the arguments (on uninitialized CPU tensors, its kernel launch recorded instead
of run) and Triton's binder specializes them as a launch does (integers equal to 1 as constants, those divisible
by 16 and 16-byte aligned pointers marked so; ``example_launch``, ``specialized_source``). With ``--no-specialize``, the
earlier hand-kept specialization: the unit strides passed as 1, the pointers and the padded sizes as multiples of
16, the rest (M, K, the row strides) as plain int32, so the blocks and cols layouts load element by element
(about 2x the SASS of the blocks-layout and dual passes as launched). For each variant: registers and SASS instruction
count (the bundled ``cuobjdump``; for the single-pass MXFP4 kernel, straight-line code, also SASS instructions per
element of its tile: at the GPU's issue rate an estimate of the time it needs, to compare variants before
measuring them; with ``--json``, the count of each SASS opcode as well, to see which pipe the code loads:
integer and logic operations issue to the ALU pipe, float operations to the FMA pipe), PTX instruction count and a hash of the PTX code without debug information and symbol names (equal hashes: identical PTX; ptxas may still schedule it slightly differently, as the line
table it reads differs).

    python tools/compile_check.py [--arch 90] [--jobs 2] [--json out.json] [--only SUBSTRING ...] [--exact] [--fusion]
                                  [--shape 16384x768 | --no-specialize]

``--fusion``: the variants the compiled MX layer launches (``FUSION_CHECKED``; or those ``--only`` names) compiled
with contraction off and on: inductor compiles user kernels with it on, and every one of them must compile to the
same code (``fusion_check``; tests/linear/test_compiledmx.py runs it in CI). The second build starts from the first
one's TTGIR (``compile_pair``: the same code as a build from the source, in half the time).

Runs on a CPU machine (``TRITON_INTERPRET`` is cleared for the run); needs only the Triton wheel. Exit status
1 if a variant fails to compile. ``tests/kernels/test_kernels.py`` runs a few variants.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the hand-kept specialization (--no-specialize; by default the example launch's, ``specialized_source``): runtime
# argument types of the kernels, by name (everything else is int32 or a constexpr), and the integers passed as
# multiples of 16
PTR_TYPES = {"pk_ptr": "*u8", "x_ptr": "*bf16", "signs_ptr": "*fp32", "car_ptr": "*u8", "gs_ptr": "*fp32", "fp4_ptr": "*u8",
             "sc_ptr": "*u8", "cnt_ptr": "*i32", "key_ptr": "*i32",
             "sg_a": "*fp32", "car_a": "*u8", "gs_a": "*fp32", "kp_a": "*i32",
             "sg_b": "*fp32", "car_b": "*u8", "gs_b": "*fp32", "kp_b": "*i32",
             "out_ptr": "*fp32", "g_ptr": "*fp32", "key64_ptr": "*i64", "part_ptr": "*fp32",
             **{f"{n}{i}": t for i in range(4) for n, t in (("x", "*fp32"), ("car", "*u8"), ("gs", "*fp32"))}}
FLOATS = {"inv_sqrt", "prescale", "inv_a", "ps_a", "inv_b", "ps_b"}
DIV16 = {"R", "Rc", "Kc", "Kq", "Kc_a", "Kq_a", "Kc_b", "Kq_b", "Rc_a", "Rc_b", "sx_m"}

BASE = dict(HAS_SIGNS=False, RULE=0, SR=False, PRESCALE=False, GROUP_ROWS=1, WRITE_CARRIER=True, WRITE_FP4=False,
            IDX64=False, KEY_PTR=False)


def _single(layout, BR, nw, rot=0, maxnreg=None, ones=None, div16=(), ptr_types=None, **kw):
    """A variant of ``_mxfp4_kernel``; ``ones``: the arguments passed as 1 (default: the input's unit stride
    along the reduction, the cols layout's along rows; also the example launch's axis: along columns where
    ``sx_r`` is among them); ``div16``: more integer arguments passed as multiples of 16 (``ones`` and ``div16``:
    the hand-kept specialization of ``--no-specialize``); ``ptr_types``: pointer types other than ``PTR_TYPES``'
    (``{"x_ptr": "*fp32"}``: a float32 input, the weights; also the example launch's input dtype)."""
    consts = dict(BASE, BR=BR, ROT=rot, **kw)
    if layout != "tile" or rot == 64:
        consts.setdefault("USE_ASM", True)
        consts.setdefault("FOLD", False)
    if layout == "cols":
        consts.setdefault("PACK", min(4 * BR // (32 * nw), 4))
    if ones is None:
        ones = ("sx_r",) if layout == "cols" else ("sx_k",)
    return dict(kind="single", layout=layout, consts=consts, ones=ones, num_warps=nw, maxnreg=maxnreg,
                div16=div16, ptr_types=ptr_types or {})


def _dual(bra=32, brb=64, nw=4, gr_b=1, rot=0, sr=False, fp4_b=False, maxnreg=80, **kw):
    consts = dict(BR_A=bra, ROT_A=rot, HAS_SIGNS_A=bool(rot), RULE_A=0, SR_A=sr, PRESCALE_A=False, KEY_PTR_A=False,
                  BR_B=brb, ROT_B=rot, HAS_SIGNS_B=bool(rot), RULE_B=0, SR_B=sr, PRESCALE_B=False, KEY_PTR_B=False,
                  GROUP_ROWS_B=gr_b, PACK_B=min(4 * brb // (32 * nw), 4), IDX64=False, USE_ASM=True,
                  SEQ=False, FOLD_A=rot == 16, FOLD_B=rot == 16, CAR_B=not fp4_b, FP4_B=fp4_b)
    consts.update(kw)
    return dict(kind="dual", layout="dual", consts=consts, ones=("sx_k",), num_warps=nw,
                maxnreg=None if sr else maxnreg)


def _group(layout, G=4, rot=16, maxnreg=80, **kw):
    """A variant of ``_mxfp4_group_kernel``: ``G`` float32 weights of the 125M-class model's shapes (``GROUP_SHAPES``)
    quantized in 128x128 groups along K (``blocks``) or N (``cols``), as ``ops.quantize_mxfp4_group`` launches them
    (the compiled layer's ``w_group``)."""
    BR, nw = 128, 8
    consts = dict(G=G, BR=BR, ROT=rot, HAS_SIGNS=False, RULE=0, SR=False, PRESCALE=False, GROUP_ROWS=128,
                  IDX64=False, KEY_PTR=False, LAYOUT=layout, USE_ASM=True, FOLD=False, GRID=0)
    if layout == "cols":
        consts["PACK"] = 2
    consts.update(kw)
    return dict(kind="group", layout=layout, consts=consts, ones=(), num_warps=nw, maxnreg=maxnreg,
                ptr_types={"x_ptr": "*fp32"})


# (N, K) of the weights of one 125m-fused block: q|k|v, o, gate|up, down
GROUP_SHAPES = ((2304, 768), (768, 768), (4096, 768), (768, 2048))


def _mxelem(axis, TM, NB, _ebits, mbits, emin, emax, maxv, rule, prescale=False, idx64=False, bf16=False, B=32,
            nw=4):
    """A variant of ``kernels/mxelem.py``'s ``_mx_kernel`` (the unit stride of ``axis`` passed as 1)."""
    consts = dict(TM=TM, NB=NB, B=B, MAXV=maxv, MBITS=mbits, EMIN=emin, EMAX=emax, RULE=rule, PRESCALE=prescale,
                  IDX64=idx64, OUT_BF16=bf16)
    return dict(kind="mxelem", layout="mxelem", consts=consts, ones=("s_k",) if axis == 1 else ("s_m",),
                num_warps=nw, maxnreg=None, ptr_types={"out_ptr": "*i16"} if bf16 else {})


def _nvfp4(axis, TM, NB, tile2d=False, sr=False, key_ptr=False, prescale=False, idx64=False, nw=4, rot=0,
           signs=False, four_six=False):
    """A variant of ``kernels/nvfp4.py``'s ``_nvfp4_kernel`` (the unit strides of ``axis`` passed as 1); ``rot``
    16: the variant that rotates its input (``signs``: with a sign vector); ``four_six``: the ``four_over_six``
    scale rule (``FOUR_SIX``)."""
    consts = dict(TM=TM, NB=NB, TILE2D=tile2d, SR=sr, KEY_PTR=key_ptr, PRESCALE=prescale, IDX64=idx64, ROT=rot,
                  HAS_SIGNS=signs)
    if four_six:
        consts["FOUR_SIX"] = True
    return dict(kind="nvfp4", layout="nvfp4", consts=consts,
                ones=("s_k", "o_k", "i_k") if axis == 1 else ("s_m", "o_m", "i_m"), num_warps=nw, maxnreg=None)


def _nvfp4_rot_amax(axis, TM, NB, signs=True, idx64=False, nw=4):
    """A variant of ``kernels/nvfp4.py``'s ``_rot_amax_kernel`` (pass 1 of a rotated operand)."""
    consts = dict(TM=TM, NB=NB, HAS_SIGNS=signs, IDX64=idx64)
    return dict(kind="nvfp4_rot_amax", layout="nvfp4_rot_amax", consts=consts, ones=("s_k",) if axis == 1 else
                ("s_m",), num_warps=nw, maxnreg=None)


# (name, variant): block rows and warps as launch.block_config picks them
VARIANTS = {
    "tile r0 car": _single("tile", 64, 4),
    "tile r0 fp4": _single("tile", 64, 4, WRITE_CARRIER=False, WRITE_FP4=True),
    "tile r16 signs car+fp4": _single("tile", 64, 4, 16, HAS_SIGNS=True, WRITE_FP4=True),
    "tile r32 sr fp4 keyptr": _single("tile", 64, 4, 32, SR=True, WRITE_CARRIER=False, WRITE_FP4=True,
                                      KEY_PTR=True),
    "tile r128 signs car idx64": _single("tile", 64, 4, 128, HAS_SIGNS=True, IDX64=True),
    "tile r0 g128 prescale": _single("tile", 128, 8, GROUP_ROWS=128, PRESCALE=True, RULE=2),
    # tseng's backward operands (H64 with per-step signs, SR, prescale 3/4: only the tile layout rotates 64
    # wide), along rows and along columns as launch.block_config sizes them and as a launch on a row-major
    # 16384 x 4096 operand specializes the integers (the unit strides of input, index and group scales passed
    # as 1, the other sizes and strides as multiples of 16; fast.py's index strides)
    "tile r64 signs sr prescale rows": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True, PRESCALE=True,
                                               ones=("sx_k", "si_k", "gs_sr"),
                                               div16=("R", "K", "sx_r", "si_r", "gs_sk")),
    "tile r64 signs sr prescale cols": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True, PRESCALE=True,
                                               ones=("sx_r", "si_r", "gs_sr"),
                                               div16=("R", "K", "sx_k", "si_k", "gs_sk")),
    # the 64-wide path's other branches (no signs, FP4 codes, 64-bit index, key in memory, 128x128 groups)
    "tile r64 signs sr fp4 idx64 keyptr": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True, WRITE_CARRIER=False,
                                                  WRITE_FP4=True, IDX64=True, KEY_PTR=True),
    "tile r64 g128 car+fp4": _single("tile", 128, 8, 64, GROUP_ROWS=128, WRITE_FP4=True),
    "blocks r0 car": _single("blocks", 16, 2),
    "blocks r0 fp4": _single("blocks", 16, 2, WRITE_CARRIER=False, WRITE_FP4=True),
    "blocks r16 signs fold car": _single("blocks", 16, 2, 16, HAS_SIGNS=True, FOLD=True),
    "blocks r32 signs sr car+fp4": _single("blocks", 16, 2, 32, HAS_SIGNS=True, SR=True, WRITE_FP4=True),
    "blocks r16 sr idx64 keyptr": _single("blocks", 16, 2, 16, SR=True, IDX64=True, KEY_PTR=True),
    "blocks r0 g128": _single("blocks", 128, 8, GROUP_ROWS=128, maxnreg=80),
    "cols r0 car": _single("cols", 64, 4, maxnreg=80),
    "cols r0 fp4": _single("cols", 64, 4, WRITE_CARRIER=False, WRITE_FP4=True, maxnreg=80),
    "cols r16 signs fold car": _single("cols", 64, 4, 16, HAS_SIGNS=True, FOLD=True, maxnreg=80),
    "cols r32 sr car+fp4": _single("cols", 32, 2, 32, SR=True, WRITE_FP4=True),
    "cols r0 sr idx64 keyptr": _single("cols", 32, 2, SR=True, IDX64=True, KEY_PTR=True),
    "cols r0 g128 pack2": _single("cols", 128, 8, GROUP_ROWS=128, maxnreg=80, PACK=2),
    "dual r0": _dual(),
    "dual r0 g128": _dual(64, 128, 8, gr_b=128),
    "dual r16 sr": _dual(rot=16, sr=True),
    "dual r0 fp4_b seq idx64": _dual(fp4_b=True, SEQ=True, IDX64=True),
    # what the compiled MX layer launches through inductor (mxtrain/compiledmx.py: round to nearest, no signs,
    # prescale 1; bf16 activations, float32 weights): X's two operands (B as FP4 codes), dY's two carriers, W
    # along K and along N with 128x128 groups, and the carrier rebuild; FUSION_CHECKED below
    "graph dual x r0 g128 fp4_b": _dual(64, 128, 8, gr_b=128, fp4_b=True),
    "graph dual x r16 g128 fp4_b": _dual(64, 128, 8, gr_b=128, rot=16, fp4_b=True, HAS_SIGNS_A=False,
                                         HAS_SIGNS_B=False),
    "graph dual x r32 g128 fp4_b": _dual(64, 128, 8, gr_b=128, rot=32, fp4_b=True, HAS_SIGNS_A=False,
                                         HAS_SIGNS_B=False),
    "graph dual dy r16": _dual(rot=16, HAS_SIGNS_A=False, HAS_SIGNS_B=False),
    # a weight's Fprop and Dgrad operands from one read (setting w_dual): float32, 128x128 groups on both sides
    "graph dual w r16 g128": dict(_dual(128, 128, 8, gr_b=128, rot=16, HAS_SIGNS_A=False, HAS_SIGNS_B=False,
                                        GROUP_ROWS_A=128, FOLD_A=False, FOLD_B=False), ptr_types={"x_ptr": "*fp32"}),
    "graph blocks w r16 g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, maxnreg=80),
    "graph blocks w r32 g128 amd": _single("blocks", 128, 8, 32, GROUP_ROWS=128, RULE=4, maxnreg=80),
    "graph cols w r16 g128": _single("cols", 128, 8, 16, GROUP_ROWS=128, maxnreg=80, PACK=2),
    "graph blocks x r16 fold": _single("blocks", 16, 2, 16, FOLD=True),
    "graph tile x r16 fp4 cols": _single("tile", 64, 4, 16, WRITE_CARRIER=False, WRITE_FP4=True,
                                         ones=("sx_r",)),
    # what it launches for the seeded recipes (mx_compiled_seeded: keys in device memory, sign vectors, prescales;
    # launch.single_spec / dual_spec as traced.q_single / q_dual call them): tseng's dY along rows and W (float32)
    # along N with 128x128 groups (the 64-wide tile path with signs, SR and prescale 3/4, specialized as the r64
    # rows / cols variants above), mxfp4-all-sr's dY (SR on both sides; auto takes the dual pass up to
    # launch.DUAL_SR_MAX elements), mxfp4-all-rht16's X and dY (signs, 1/4 folded into the block scales) and W
    # along K (float32: no fold)
    "graph tile dy r64 signs sr prescale keyptr rows": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True,
                                                               PRESCALE=True, KEY_PTR=True,
                                                               ones=("sx_k", "si_k", "gs_sr"),
                                                               div16=("R", "K", "sx_r", "si_r", "gs_sk")),
    "graph tile w r64 signs sr prescale keyptr g128 cols": _single("tile", 128, 8, 64, GROUP_ROWS=128, HAS_SIGNS=True,
                                                                   SR=True, PRESCALE=True, KEY_PTR=True,
                                                                   ones=("sx_r", "si_r", "gs_sk"),
                                                                   div16=("R", "K", "sx_k", "si_k"),
                                                                   ptr_types={"x_ptr": "*fp32"}),
    "graph dual dy sr keyptr r0": _dual(sr=True, KEY_PTR_A=True, KEY_PTR_B=True),
    "graph dual x signs r16 fold g128 fp4_b": _dual(64, 128, 8, gr_b=128, rot=16, fp4_b=True),
    "graph dual dy signs r16 fold": _dual(rot=16),
    "graph blocks w signs r16 g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, HAS_SIGNS=True, maxnreg=80,
                                             ptr_types={"x_ptr": "*fp32"}),
    "graph expand g128": dict(kind="expand", layout="expand", consts=dict(BR=128, GROUP_ROWS=128), ones=(),
                              num_warps=8, maxnreg=None),
    # the uniform 4-bit grid (GRID=1: mxint4, the ufp4 recipe's format) in each layout, as the ufp4 recipe launches
    # it (H16 with per-step signs on every GEMM, SR on dY; bf16 inputs fold 1/4 into the scales), the 64-wide tile
    # path, the scale rules whose bump differs from E2M1's (rceil, even), and the carrier rebuild of its codes
    "int4 tile r16 signs sr car+fp4": _single("tile", 64, 4, 16, HAS_SIGNS=True, SR=True, WRITE_FP4=True, GRID=1),
    "int4 tile r0 fp4 even": _single("tile", 64, 4, WRITE_CARRIER=False, WRITE_FP4=True, RULE=3, GRID=1),
    "int4 tile r64 signs sr car+fp4": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True, WRITE_FP4=True, GRID=1),
    "int4 blocks r16 fold signs car": _single("blocks", 16, 2, 16, HAS_SIGNS=True, FOLD=True, GRID=1),
    "int4 blocks r16 signs sr car+fp4": _single("blocks", 16, 2, 16, HAS_SIGNS=True, SR=True, WRITE_FP4=True,
                                                GRID=1),
    "int4 blocks w r16 signs g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, HAS_SIGNS=True, maxnreg=80,
                                            ptr_types={"x_ptr": "*fp32"}, GRID=1),
    "int4 blocks r0 car rceil": _single("blocks", 16, 2, RULE=2, GRID=1),
    "int4 cols r16 signs sr car": _single("cols", 32, 2, 16, HAS_SIGNS=True, SR=True, GRID=1),
    "int4 cols r16 signs fold fp4": _single("cols", 64, 4, 16, HAS_SIGNS=True, FOLD=True, WRITE_CARRIER=False,
                                            WRITE_FP4=True, maxnreg=80, GRID=1),
    "int4 dual x signs r16 fold fp4_b": _dual(rot=16, fp4_b=True, GRID_A=1, GRID_B=1),
    "int4 dual dy signs r16 sr": _dual(rot=16, sr=True, GRID_A=1, GRID_B=1),
    "int4 expand": dict(kind="expand", layout="expand", consts=dict(BR=32, GROUP_ROWS=1, GRID=1), ones=(),
                        num_warps=4, maxnreg=None),
    # the uniform E1M2 grid (GRID=2: mxe1m2; E8M0 exponents up to 127, 4 v rounded on INT4's grid, the carrier's
    # 2**(kexp - 2)) in each layout, the 64-wide path, the rules whose bump is E1M2's own, dual and the rebuild
    "e1m2 tile r16 signs sr car+fp4": _single("tile", 64, 4, 16, HAS_SIGNS=True, SR=True, WRITE_FP4=True, GRID=2),
    "e1m2 tile r64 signs sr car+fp4": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True, WRITE_FP4=True, GRID=2),
    "e1m2 blocks r16 fold signs car even": _single("blocks", 16, 2, 16, HAS_SIGNS=True, FOLD=True, RULE=3, GRID=2),
    "e1m2 blocks r0 car+fp4 rceil": _single("blocks", 16, 2, RULE=2, WRITE_FP4=True, GRID=2),
    "e1m2 cols r16 signs sr car": _single("cols", 32, 2, 16, HAS_SIGNS=True, SR=True, GRID=2),
    "e1m2 cols r16 signs fold fp4": _single("cols", 64, 4, 16, HAS_SIGNS=True, FOLD=True, WRITE_CARRIER=False,
                                            WRITE_FP4=True, maxnreg=80, GRID=2),
    "e1m2 dual x signs r16 fold fp4_b": _dual(rot=16, fp4_b=True, GRID_A=2, GRID_B=2),
    "e1m2 expand": dict(kind="expand", layout="expand", consts=dict(BR=32, GROUP_ROWS=1, GRID=2), ones=(),
                        num_warps=4, maxnreg=None),
    # the adaptive scale rule (RULE=5: per block floor's exponent or the next, by the exact float64 comparison of the
    # squared errors, device._adaptive_term) in each layout, the 64-wide path, with folded normalization, SR and
    # prescale, on the uniform grids, and in the dual kernel (an mxfp4-all-adaptive activation's two operands)
    "adaptive tile r16 signs sr car+fp4": _single("tile", 64, 4, 16, HAS_SIGNS=True, SR=True, WRITE_FP4=True, RULE=5),
    "adaptive tile r64 signs sr prescale car": _single("tile", 64, 4, 64, HAS_SIGNS=True, SR=True, PRESCALE=True,
                                                       RULE=5),
    "adaptive blocks r0 car": _single("blocks", 16, 2, RULE=5),
    "adaptive blocks r16 signs fold car": _single("blocks", 16, 2, 16, HAS_SIGNS=True, FOLD=True, RULE=5),
    "adaptive blocks w r16 g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, maxnreg=80, RULE=5,
                                          ptr_types={"x_ptr": "*fp32"}),
    "adaptive cols r0 sr car": _single("cols", 32, 2, SR=True, RULE=5),
    "adaptive cols r16 signs fold fp4": _single("cols", 64, 4, 16, HAS_SIGNS=True, FOLD=True, WRITE_CARRIER=False,
                                                WRITE_FP4=True, maxnreg=80, RULE=5),
    "adaptive dual x r0 fp4_b": _dual(fp4_b=True, RULE_A=5, RULE_B=5),
    "adaptive int4 blocks r16 signs sr car+fp4": _single("blocks", 16, 2, 16, HAS_SIGNS=True, SR=True, WRITE_FP4=True,
                                                         RULE=5, GRID=1),
    "adaptive e1m2 cols r16 signs car": _single("cols", 64, 4, 16, HAS_SIGNS=True, maxnreg=80, RULE=5, GRID=2),
    # the NVFP4 quantizer (kernels/nvfp4.py), as quantize_nvfp4_factored launches it on a GPU
    "nvfp4 rows 1d": _nvfp4(1, 2, 4),
    "nvfp4 rows 2d sr prescale": _nvfp4(1, 2, 4, tile2d=True, sr=True, prescale=True),
    "nvfp4 cols 1d sr keyptr idx64": _nvfp4(0, 4, 2, sr=True, key_ptr=True, idx64=True),
    "nvfp4 cols 2d": _nvfp4(0, 4, 2, tile2d=True),
    "nvfp4 amax": dict(kind="nvfp4_amax", layout="nvfp4_amax", consts=dict(BLOCK=4096), ones=(), num_warps=8,
                       maxnreg=None),
    # its rotating variants (the 16-wide Hadamard inside both passes: the nvfp4 recipe's Wgrad operands)
    "nvfp4 rows rot16 signs sr": _nvfp4(1, 2, 4, sr=True, rot=16, signs=True),
    "nvfp4 cols rot16 signs sr keyptr": _nvfp4(0, 4, 2, sr=True, key_ptr=True, rot=16, signs=True),
    "nvfp4 rot amax rows signs": _nvfp4_rot_amax(1, 2, 4),
    "nvfp4 rot amax cols idx64": _nvfp4_rot_amax(0, 4, 2, signs=False, idx64=True),
    # the same quantizer with NVFP4's "Four over Six" rule (FOUR_SIX: the nvfp4-4over6 recipe's operands: 1-D
    # blocks along rows, 16x16 tiles (the weights), SR with a key in device memory, the fused 16-wide rotation)
    # (named without "nvfp4": tests/kernels/test_nvfp4_kernel.py counts the variants that name it)
    "4over6 rows 1d": _nvfp4(1, 2, 4, four_six=True),
    "4over6 cols 2d prescale": _nvfp4(0, 4, 2, tile2d=True, prescale=True, four_six=True),
    "4over6 rows 2d": _nvfp4(1, 2, 4, tile2d=True, four_six=True),
    "4over6 cols rot16 signs sr keyptr": _nvfp4(0, 4, 2, sr=True, key_ptr=True, rot=16, signs=True, four_six=True),
    # the MX fake quantizer for FP6/FP8 elements (kernels/mxelem.py), as quantize_mx_values launches it
    "mxelem e4m3 rows floor": _mxelem(1, 16, 4, 8, 3, -6, 8, 448.0, 0),
    "mxelem e4m3 cols floor bf16": _mxelem(0, 32, 2, 8, 3, -6, 8, 448.0, 0, bf16=True),
    "mxelem e5m2 cols even prescale": _mxelem(0, 32, 2, 5, 2, -14, 15, 57344.0, 3, prescale=True),
    "mxelem e2m3 rows rceil idx64": _mxelem(1, 16, 4, 5, 3, 0, 2, 7.5, 2, idx64=True),
    "mxelem e3m2 cols amd": _mxelem(0, 32, 2, 6, 2, -2, 4, 28.0, 4),
    # the blocks layout's tile arrangements (setting qblocks) beside the rows variants above; the graph variants
    # take the default's (auto: _as_launched below):
    # "rows16" stores each block's carrier bytes as two 16-byte runs, "lanes" also holds a row's 4 blocks in one
    # warp's lanes ([4, BR, 8] pieces)
    "rows16 blocks x r16 fold": _single("blocks", 16, 2, 16, FOLD=True, SPLIT16=True),
    "lanes blocks x r16 fold": _single("blocks", 16, 2, 16, FOLD=True, SPLIT16=True, BFIRST=True),
    "lanes blocks w r16 g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, maxnreg=80, SPLIT16=True, BFIRST=True),
    "lanes blocks r8 adaptive sr car+fp4": _single("blocks", 32, 4, 8, HAS_SIGNS=True, RULE=5, SR=True,
                                                   WRITE_FP4=True, SPLIT16=True, BFIRST=True),
    "rows16 blocks w signs r16 g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, HAS_SIGNS=True, maxnreg=80,
                                              ptr_types={"x_ptr": "*fp32"}, SPLIT16=True),
    "lanes blocks w signs r16 g128": _single("blocks", 128, 8, 16, GROUP_ROWS=128, HAS_SIGNS=True, maxnreg=80,
                                             ptr_types={"x_ptr": "*fp32"}, SPLIT16=True, BFIRST=True),
    "rows16 dual dy signs r16 fold": _dual(rot=16, SPLIT16_A=True),
    "lanes dual dy signs r16 fold": _dual(rot=16, SPLIT16_A=True, BFIRST_A=True),
    "lanes dual x signs r16 fold g128 fp4_b": _dual(64, 128, 8, gr_b=128, rot=16, fp4_b=True, SPLIT16_A=True,
                                                    BFIRST_A=True),
    # the cols layout with one value of each load a thread (setting qcols singles: launch.DUAL_CONFIG_SINGLES, the
    # single passes' warps doubled), in the default's blocks arrangement (lanes): the compiled layer's dual passes
    # (dY; X with 128x128 Wgrad groups as FP4 codes, without and with random signs), a weight's Dgrad pass and its
    # dual pass, an activation's Wgrad pass with SR; launched without the register cap (launch.cols_values)
    "singles dual dy r16": _dual(32, 32, 4, rot=16, HAS_SIGNS_A=False, HAS_SIGNS_B=False, SPLIT16_A=True,
                                 BFIRST_A=True, maxnreg=None),
    "singles dual x r16 g128 fp4_b": _dual(128, 128, 16, gr_b=128, rot=16, fp4_b=True, HAS_SIGNS_A=False,
                                           HAS_SIGNS_B=False, SPLIT16_A=True, BFIRST_A=True, maxnreg=None),
    "singles dual x signs r16 fold g128 fp4_b": _dual(128, 128, 16, gr_b=128, rot=16, fp4_b=True, SPLIT16_A=True,
                                                      BFIRST_A=True, maxnreg=None),
    "singles cols w r16 g128": _single("cols", 128, 16, 16, GROUP_ROWS=128),
    "singles dual w r16 g128": dict(_dual(128, 128, 16, gr_b=128, rot=16, HAS_SIGNS_A=False, HAS_SIGNS_B=False,
                                          GROUP_ROWS_A=128, FOLD_A=False, FOLD_B=False, SPLIT16_A=True,
                                          BFIRST_A=True, maxnreg=None), ptr_types={"x_ptr": "*fp32"}),
    "singles cols r16 signs sr car": _single("cols", 32, 4, 16, HAS_SIGNS=True, SR=True),
    # a block's four weights in one launch (setting w_group): along K (Fprop) and along N (Dgrad), H16
    "graph group w r16 g128 blocks": _group("blocks"),
    "graph group w r16 g128 cols": _group("cols"),
}


def _as_launched(v):
    """A ``graph`` variant in the tile arrangement the compiled layer launches it in: the ``qblocks`` setting's
    default (``auto``, ``launch.resolve_form``) for a blocks-layout pass, by its groups and signs."""
    from mxtrain.kernels.mxfp4.launch import blocks_form
    c = v["consts"]
    if v["kind"] == "dual":
        c.update(blocks_form("auto", "_A", c.get("GROUP_ROWS_A", 1), c["HAS_SIGNS_A"]))
    elif v["layout"] == "blocks":
        c.update(blocks_form("auto", "", c["GROUP_ROWS"], c["HAS_SIGNS"]))
    return v


VARIANTS.update({n: _as_launched(v) for n, v in VARIANTS.items() if n.startswith("graph ")})


def kernel_of(v):
    """(the Triton kernel of variant ``v``, constexprs it adds)."""
    if v["kind"] == "mxelem":
        from mxtrain.kernels import mxelem as X
        return X._mx_kernel, {}
    if v["kind"] in ("nvfp4", "nvfp4_amax", "nvfp4_rot_amax"):
        from mxtrain.kernels import nvfp4 as N
        return {"nvfp4": N._nvfp4_kernel, "nvfp4_amax": N._finite_amax_kernel,
                "nvfp4_rot_amax": N._rot_amax_kernel}[v["kind"]], {}
    if v["kind"] == "expand":
        from mxtrain.kernels import expand as E
        return E._expand_kernel, {}
    from mxtrain.kernels.mxfp4 import kernels as K
    if v["kind"] == "dual":
        return K._mxfp4_dual_kernel, {}
    if v["kind"] == "group":
        return K._mxfp4_group_kernel, {}
    return K._mxfp4_kernel, {"LAYOUT": v["layout"]}


def source(v):
    """``ASTSource`` of variant ``v`` with the hand-kept specialization (``--no-specialize``)."""
    from triton.compiler import ASTSource
    kfn, extra = kernel_of(v)
    consts = dict(v["consts"], **extra)
    consts.update({n: 1 for n in v["ones"]})
    sig, attrs = {}, {}
    for i, p in enumerate(kfn.params):
        n = p.name
        if n in consts or p.is_constexpr or p.default is None:
            sig[n] = "constexpr"
            consts.setdefault(n, p.default)
        else:
            sig[n] = v.get("ptr_types", {}).get(n) or PTR_TYPES.get(n, "fp32" if n in FLOATS else "i32")
            if n in PTR_TYPES or n in DIV16 or n in v.get("div16", ()):
                attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {n: c for n, c in consts.items() if n in sig}
    return ASTSource(kfn, sig, constexprs=consts, attrs=attrs)


# ---------------------------------------------------------------------------------------------- specialization
# Triton specializes a launch on its runtime arguments (``triton.runtime.jit``: an integer equal to 1 becomes the
# constant 1, one divisible by 16 gets ``tt.divisibility = 16``, so does a pointer aligned to 16 bytes; not the
# arguments named in ``do_not_specialize``, the stochastic-rounding keys), and the code depends on it: the blocks and
# cols layouts vectorize their loads only where the row strides are known multiples of 16. By default each variant
# is compiled with the specialization of a real launch on an example operand (``SHAPE``, ``--shape``): the launcher
# itself (``ops.quantize_mxfp4_2d`` / ``quantize_mxfp4_dual`` through ``launch.single_spec`` / ``dual_spec``,
# ``expand.carrier_from_packed``, ``nvfp4.quantize_nvfp4_factored``, ``mxelem.quantize_mx_values``) runs on
# uninitialized CPU tensors with the kernel launch replaced by a recorder, and Triton's own binder specializes the
# recorded arguments (pointers at 16-byte aligned addresses plus the view's offset: what the CUDA allocator gives).
# The constexprs stay the variant's (``VARIANTS``); where a launch with the variant's options would set one
# otherwise, the tool says so on stderr (``differs``). The graph variants get the same specialization: inductor
# specializes a user kernel's arguments alike where the shapes are static (sizes known multiples of 16 and
# equal to 1). ``--no-specialize``: the earlier hand-kept specialization
# (``PTR_TYPES``, ``DIV16``, each variant's ``ones`` and ``div16``; the other integers plain int32).

# the example operand: 16,384 tokens x 768 features (the 125M model's activations), row-major; along rows (axis 1)
# R = tokens, K = features; along columns (axis 0, the cols layout, Wgrad operands) R = features, K = tokens. The
# carrier's K padding is the FP8-carrier backend's (``gemm.k_multiple_for("fp8_carrier")``: the ``carrier_k``
# setting), the stochastic-rounding key an int that is neither 1 nor a multiple of 16 (the MXFP4 kernels do not
# specialize on it; the NVFP4 kernel does, as a launch with a random key would 15 times in 16)
SHAPE = (16384, 768)
EXAMPLE_KEY = 0x2545F491
PRESCALE = 0.75      # a variant's PRESCALE: tseng's 3/4


class _Ptr:
    """A tensor argument as Triton's binder sees it: its dtype and an address, 16-byte aligned plus the view's
    offset in bytes."""

    def __init__(self, t):
        self.dtype = t.dtype
        self._addr = (1 << 20) + t.storage_offset() * t.element_size()

    def data_ptr(self):
        return self._addr


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records ``(args, kwargs)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((a, kw))


def _empty(shape, dtype):
    """An example argument: uninitialized CPU memory (not meta tensors: torch's meta reductions import sympy, a
    second per worker)."""
    import torch
    return torch.empty(shape, dtype=dtype)


def _index_strides(shape, axis, rot):
    """The stochastic-rounding index strides the fast path passes (``fast._index_strides``,
    ``traced._index_strides``; not imported: ``mxtrain.linear.fast`` costs seconds to import in every worker)."""
    if axis == 1:
        return (-(-shape[1] // rot) * rot if rot else shape[1], 1)
    return (1, shape[1])


def example_launch(v, shape=SHAPE):
    """``(positional arguments, constexprs)`` of the launch that variant ``v`` stands for, on the ``shape``
    operand (``SHAPE``), as the launcher makes them (on uninitialized CPU tensors, its kernel launches recorded
    instead of run)."""
    import torch
    from mxtrain import settings
    c, kind = v["consts"], v["kind"]
    M, N = shape
    f32, i32 = torch.float32, torch.int32
    x_dtype = torch.float32 if v.get("ptr_types", {}).get("x_ptr") == "*fp32" else torch.bfloat16
    rec = []
    if kind in ("single", "dual", "expand", "group"):
        from mxtrain.kernels import expand as E
        from mxtrain.kernels.mxfp4 import ops
        from mxtrain.kernels.mxfp4.launch import GRID_ID, RULE_ID
        rules = {i: n for n, i in RULE_ID.items()}
        fmts = {i: n for n, i in GRID_ID.items()}
        km = settings.current().carrier_k   # gemm.k_multiple_for("fp8_carrier") (gemm imports torch._dynamo: 2 s)

        def record(kern, kfn, grid, args, consts, *rest):
            rec.append((args, consts))

        def record_direct(kfn, grid, args, consts, *rest):
            rec.append((args, consts))

        quiet = dict(qselfcheck="off", fast_launch="off")
        sfx = "_A" if kind == "dual" else ""   # the blocks layout's tile arrangement (setting qblocks)
        quiet["qblocks"] = ("lanes" if c.get("BFIRST" + sfx) else "rows16" if c.get("SPLIT16" + sfx) else "rows")
    if kind == "single":
        axis = 0 if v["layout"] == "cols" or "sx_r" in v["ones"] else 1
        x, rot = _empty((M, N), x_dtype), c["ROT"]
        with settings.override(qkernel=v["layout"], **quiet), _patched(ops, "launch", record):
            ops.quantize_mxfp4_2d(
                x, axis, rot=rot, signs=_empty((rot,), f32) if c["HAS_SIGNS"] else None,
                rounding="stochastic" if c["SR"] else "nearest", scale_rule=rules[c["RULE"]], key=EXAMPLE_KEY,
                prescale=PRESCALE if c["PRESCALE"] else 1.0, index_strides=_index_strides(shape, axis, rot),
                carrier=c["WRITE_CARRIER"], fp4=c["WRITE_FP4"], group_rows=c["GROUP_ROWS"], block_rows=c["BR"],
                num_warps=v["num_warps"], k_multiple=km, key_tensor=_empty((1,), i32) if c["KEY_PTR"] else None,
                force_idx64=c["IDX64"], fmt=fmts[c.get("GRID", 0)], _check=False)
    elif kind == "dual":
        sides = []
        for s, axis in (("A", 1), ("B", 0)):
            rot = c[f"ROT_{s}"]
            sides.append(dict(rot=rot, signs=_empty((rot,), f32) if c[f"HAS_SIGNS_{s}"] else None,
                              rounding="stochastic" if c[f"SR_{s}"] else "nearest", scale_rule=rules[c[f"RULE_{s}"]],
                              key=EXAMPLE_KEY, prescale=PRESCALE if c[f"PRESCALE_{s}"] else 1.0,
                              index_strides=_index_strides(shape, axis, rot),
                              key_tensor=_empty((1,), i32) if c[f"KEY_PTR_{s}"] else None,
                              group_rows=c["GROUP_ROWS_B"] if s == "B" else c.get("GROUP_ROWS_A", 1),
                              fmt=fmts[c.get(f"GRID_{s}", 0)]))
        with settings.override(dual="on", qkernel="auto", **quiet), _patched(ops, "launch", record):
            ops.quantize_mxfp4_dual(_empty((M, N), x_dtype), sides[0], sides[1], k_multiple=km,
                                    block_rows=(c["BR_A"], c["BR_B"]), num_warps=v["num_warps"], sequential=c["SEQ"],
                                    fp4_b=c["FP4_B"], force_idx64=c["IDX64"], _check=False)
    elif kind == "group":
        axis = 0 if c["LAYOUT"] == "cols" else 1
        xs = [_empty(sh, x_dtype) for sh in GROUP_SHAPES[:c["G"]]]
        with settings.override(qkernel=c["LAYOUT"], **quiet), _patched(ops, "launch", record):
            ops.quantize_mxfp4_group(xs, axis, rot=c["ROT"], scale_rule=rules[c["RULE"]], group_rows=c["GROUP_ROWS"],
                                     k_multiple=km, fmt=fmts[c.get("GRID", 0)])
    elif kind == "expand":
        # the carrier rebuilt from the packed codes of X's Wgrad operand (along tokens: R features, K tokens)
        from mxtrain.kernels.mxfp4.carrier import QuantOut
        R, K = N, M
        Kq = -(-K // 32) * 32
        q = QuantOut(R, K, None, None, c["GROUP_ROWS"], None, _empty((R, Kq // 2), torch.uint8),
                     _empty((R, Kq // 32), torch.uint8), fmt=fmts[c.get("GRID", 0)])
        with settings.override(**quiet), _patched(E, "launch_direct", record_direct):
            E.carrier_from_packed(q, k_multiple=km)
    elif kind in ("nvfp4", "nvfp4_amax", "nvfp4_rot_amax"):
        from mxtrain.kernels import nvfp4 as NV
        recs = {n: _Recorder() for n in ("_nvfp4_kernel", "_finite_amax_kernel", "_rot_amax_kernel")}
        with contextlib.ExitStack() as stack:
            for n, r in recs.items():
                stack.enter_context(_patched(NV, n, r))
            x = _empty((M, N), x_dtype)
            if kind == "nvfp4_amax":
                NV.tensor_scale_nvfp4(x)
            else:
                axis = 1 if "s_k" in v["ones"] else 0
                sr, rot = c.get("SR", False), c["ROT"] if kind == "nvfp4" else 16
                NV.quantize_nvfp4_factored(
                    x, axis, block_2d=c.get("TILE2D", False), rounding="stochastic" if sr else "nearest",
                    key=(_empty((), torch.int64) if c.get("KEY_PTR") else EXAMPLE_KEY) if sr else None,
                    prescale=PRESCALE if c.get("PRESCALE") else 1.0, rot=rot,
                    signs=_empty((16,), f32) if c["HAS_SIGNS"] else None,
                    scale_rule="four_over_six" if c.get("FOUR_SIX") else "floor")
        rec = recs[{"nvfp4": "_nvfp4_kernel", "nvfp4_amax": "_finite_amax_kernel",
                    "nvfp4_rot_amax": "_rot_amax_kernel"}[kind]].calls
    elif kind == "mxelem":
        from mxtrain.kernels import mxelem as MX
        from mxtrain.numerics.formats import FORMATS, get_format
        fmt = next(n for n in FORMATS if get_format(n).kind == "mx" and getattr(get_format(n), "elem", None)
                   and (get_format(n).elem.mbits, get_format(n).elem.emin, get_format(n).elem.emax)
                   == (c["MBITS"], c["EMIN"], c["EMAX"]))
        r = _Recorder()
        with _patched(MX, "_mx_kernel", r):
            MX.quantize_mx_values(_empty((M, N), x_dtype), fmt, 1 if "s_k" in v["ones"] else 0, block_size=c["B"],
                                  scale_rule={i: n for n, i in MX._RULE.items()}[c["RULE"]],
                                  prescale=PRESCALE if c["PRESCALE"] else 1.0,
                                  out_dtype=torch.bfloat16 if c["OUT_BF16"] else torch.float32)
        rec = r.calls
    else:
        raise ValueError(f"no example launch for kind {kind!r}")
    assert len(rec) == 1, f"example launch of {kind}: {len(rec)} kernel launches recorded"
    return rec[0]


_BINDERS: dict = {}   # (kernel, arch) -> (Triton's backend for the target, the kernel's argument binder)


def specialized_source(v, shape=SHAPE, arch=90):
    """``(ASTSource of variant v specialized as its example launch on shape is, what was specialized)``: ``one``
    the integer arguments that became the constant 1, ``div16`` those marked divisible by 16 (pointers
    included), and ``differs``: the variant's constexprs that a launch with its options sets otherwise, ``{name:
    (variant's, launcher's)}`` (``USE_ASM`` and ``IDX64`` left out: the launcher sets the first on a GPU only,
    and the variant forces the second): such a variant is compiled as written, not as anything launches it."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    kfn, extra = kernel_of(v)
    args, launched = example_launch(v, shape)
    names = list(kfn.arg_names)
    consts = {n: c for n, c in dict(v["consts"], **extra).items() if n in names}
    key = (kfn, arch)
    if key not in _BINDERS:
        backend = make_backend(GPUTarget("cuda", arch, 32))
        _BINDERS[key] = backend, create_function_from_signature(kfn.signature, kfn.params, backend)
    backend, binder = _BINDERS[key]
    bound, spec, opts = binder(*(_Ptr(a) if isinstance(a, torch.Tensor) else a for a in args), **consts)
    _, signature, constexprs, attrs = kfn._pack_args(backend, {}, bound, spec, opts)
    runtime = [p.name for p in kfn.params if not p.is_constexpr and p.name not in consts]
    info = {"one": [n for n in runtime if spec[names.index(n)] == ("constexpr", 1)],
            "div16": [n for n in runtime if spec[names.index(n)][1] == "D"],
            "differs": {n: (consts[n], launched[n]) for n in launched
                        if n in consts and n not in ("USE_ASM", "IDX64") and consts[n] != launched[n]}}
    return ASTSource(kfn, signature, constexprs, attrs), info


def _source(v, arch, shape):
    """Variant ``v``'s source: specialized as its example launch on ``shape`` is, or (``shape`` None) with the
    hand-kept specialization."""
    return source(v) if shape is None else specialized_source(v, shape, arch)[0]


def _tool(name):
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_one(item):
    name, v, arch, *rest = item
    fusion = bool(rest and rest[0])
    shape = rest[1] if len(rest) > 1 else SHAPE
    import triton
    from triton.backends.compiler import GPUTarget
    if fusion:   # as inductor compiles a user kernel: Triton's defaults (contraction on, no register cap)
        opts = dict(num_warps=v["num_warps"], enable_fp_fusion=True)
    else:
        opts = dict(num_warps=v["num_warps"], enable_fp_fusion=False)
        if v["maxnreg"]:
            opts["maxnreg"] = v["maxnreg"]
    try:
        if shape is None:
            src, spec = source(v), None
        else:
            src, spec = specialized_source(v, shape, arch)
        t0 = time.perf_counter()
        c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        took = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported per variant
        return name, {"error": f"{type(e).__name__}: {e}"[:2000]}
    r = _stats(v, c)
    r["compile_s"] = round(took, 2)
    if spec is not None:
        r["specialized"] = spec
    return name, r


def compile_pair(item):
    """``(name, (stats off, stats on))``: variant ``v`` compiled as mxtrain launches it (contraction off, its
    register cap) and as inductor compiles it (contraction on, no cap). The second build starts from the
    first one's TTGIR with the register-cap attribute removed: up to TTGIR neither option is read (Triton 3.6's
    NVIDIA backend reads ``enable_fp_fusion`` making PTX and SASS, and ``maxnreg`` only to set that attribute),
    so it is the TTGIR a build from the source would make, and the front end and TTGIR passes, most of a
    build's time, run once."""
    name, v, arch, *rest = item
    shape = rest[0] if rest else SHAPE
    import triton
    from triton.backends.compiler import GPUTarget
    opts = dict(num_warps=v["num_warps"], enable_fp_fusion=False)
    if v["maxnreg"]:
        opts["maxnreg"] = v["maxnreg"]
    try:
        off = triton.compile(_source(v, arch, shape), target=GPUTarget("cuda", arch, 32), options=opts)
        ttgir = re.sub(r"ttg\.maxnreg = \d+ : i32, ", "", off.asm["ttgir"])
        assert "maxnreg" not in ttgir, "compile_pair: the register cap attribute not removed"
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ttgir")
            with open(path, "w") as f:
                f.write(ttgir)
            on = triton.compile(path, target=GPUTarget("cuda", arch, 32), options=dict(enable_fp_fusion=True))
    except Exception as e:  # noqa: BLE001 - reported per variant
        err = {"error": f"{type(e).__name__}: {e}"[:2000]}
        return name, (err, err)
    return name, (_stats(v, off), _stats(v, on))


def _stats(v, c):
    """Registers, instruction counts and PTX hashes of the compiled kernel ``c`` of variant ``v``."""
    ptx = c.asm["ptx"]
    # the PTX code without debug information (line table, file names, labels for it) nor symbol names (kernels
    # of different names compile to the same code)
    code = ptx.split("\t.file\t")[0]
    code = [re.sub(r"\s*//.*$", "", ln).strip() for ln in code.splitlines()]
    code = [ln for ln in code if ln and not ln.startswith(".loc") and not re.match(r"\$L__tmp\d+:$", ln)]
    body = code[next(i for i, ln in enumerate(code) if ".entry" in ln):]
    n_ptx = sum(1 for ln in body if ln.endswith(";") and not ln.startswith((".reg", ".shared", ".param")))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    n_sass = sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln))
    text = re.sub(r"_(mxfp4|nvfp4|finite_amax|expand)\w*", "K", "\n".join(code))
    # the same PTX but for the rounding modifiers of float adds and multiplies, float32 and float64 (the adaptive
    # rule's terms) (".rn": what a build without contraction writes so that ptxas fuses nothing) and the register
    # cap directive (a launch option)
    plain = re.sub(r"^(add|sub|mul)\.rn\.f(32|64)", r"\1.f\2", text, flags=re.M)
    plain = re.sub(r"^\.maxnreg \d+\n", "", plain, flags=re.M)
    r = {"regs": regs, "sass": n_sass, "ptx": n_ptx, "hash": hashlib.sha1(text.encode()).hexdigest()[:12],
         "hash_plain": hashlib.sha1(plain.encode()).hexdigest()[:12]}
    ops: dict[str, int] = {}   # SASS opcode (first word after the address, predicate dropped) -> count
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    r["ops"] = dict(sorted(ops.items(), key=lambda t: -t[1]))
    if v["kind"] == "single":
        # the single-pass kernel is straight-line code (no loops) over one tile of BR x 128 elements: every
        # thread issues its SASS once, so SASS instructions per element estimate its time at the GPU's issue
        # rate (one warp instruction a clock per scheduler); a guide, not a bound (BENCHMARKS.md)
        r["sass_per_elem"] = round(n_sass * 32 * v["num_warps"] / (v["consts"]["BR"] * 128), 1)
    return r


# The variants the compiled MX layer launches through inductor, which compiles user kernels with floating-point
# contraction on (mxtrain/kernels/mxfp4/traced.py): each must compile to the same code either way.
FUSION_CHECKED = tuple(n for n in VARIANTS if n.startswith("graph "))
FLOAT_OPS = ("FFMA", "FMUL", "FADD", "DFMA", "DMUL", "DADD")


def fusion_check(names=FUSION_CHECKED, arch: int = 90, jobs: int = 1, shape=SHAPE) -> dict:
    """For each variant: compiled with contraction off (mxtrain's launches) and on (inductor's), is the code the
    same? ``same``: the PTX equal but for the ``.rn`` modifiers of float adds and multiplies, and the SASS holds
    the same number of each float instruction (no product was fused into an FMA, by LLVM or by ptxas).
    ``shape``: the example launch's operand (``example_launch``); None: the hand-kept specialization."""
    items = [(n, VARIANTS[n], arch, shape) for n in names]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            res = list(ex.map(compile_pair, items))
    else:
        res = [compile_pair(it) for it in items]
    out = {}
    for name, (off, on) in res:
        if "error" in off or "error" in on:
            out[name] = {"same": False, "error": off.get("error") or on.get("error")}
            continue
        fl = {k: (off["ops"].get(k, 0), on["ops"].get(k, 0)) for k in FLOAT_OPS}
        out[name] = {"same": off["hash_plain"] == on["hash_plain"] and all(a == b for a, b in fl.values()),
                     "float_ops": fl, "regs": (off["regs"], on["regs"])}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", action="append", default=None,
                    help="variants whose name contains this (repeatable: any of them)")
    ap.add_argument("--exact", action="store_true", help="--only names whole variant names, not substrings")
    ap.add_argument("--fusion", action="store_true",
                    help="compile each variant (default: FUSION_CHECKED) with contraction off and on and say whether "
                         "the code is the same (exit status 1 if not)")
    ap.add_argument("--shape", default="x".join(map(str, SHAPE)),
                    help="the example operand (tokens x features, row-major) whose launch's argument "
                         "specialization every variant is compiled with (default %(default)s)")
    ap.add_argument("--no-specialize", action="store_true",
                    help="the earlier hand-kept specialization instead (M, K and the row strides plain int32)")
    a = ap.parse_args(argv)
    shape = None if a.no_specialize else tuple(int(t) for t in a.shape.lower().split("x"))
    assert shape is None or len(shape) == 2, "--shape: M x K, e.g. 16384x768"
    picked = (lambda n: n in a.only) if a.exact else (lambda n: any(o in n for o in a.only))
    if a.fusion:
        names = [n for n in VARIANTS if picked(n)] if a.only else list(FUSION_CHECKED)
        res = fusion_check(names, a.arch, a.jobs, shape)
        for name, r in res.items():
            print(f"{name:34s} {'same' if r['same'] else 'DIFFERENT'}  {r.get('error') or r['float_ops']}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if all(r["same"] for r in res.values()) else 1
    items = [(n, v, a.arch, False, shape) for n, v in VARIANTS.items() if a.only is None or picked(n)]
    out = {}
    with ProcessPoolExecutor(a.jobs) as ex:
        for name, r in ex.map(compile_one, items):
            out[name] = r
            if "error" in r:
                print(f"{name:32s} FAILED {r['error']}", flush=True)
                continue
            per = f"  sass/element {r['sass_per_elem']:5.1f}" if "sass_per_elem" in r else ""
            ops = r.get("ops", {})
            # (register spills: local-memory stores; barriers: shared-memory exchanges between warps)
            spill = f"  spills {ops['STL']}" if ops.get("STL") else ""
            print(f"{name:32s} regs {r['regs']:4d}  sass {r['sass']:6d}  ptx {r['ptx']:6d}  {r['hash']}{per}"
                  f"  bar {ops.get('BAR', 0)}{spill}  {r['compile_s']:.1f} s",
                  flush=True)
            differs = r.get("specialized", {}).get("differs")
            if differs:   # (on stderr: tests read every stdout line as a variant's)
                print(f"  note: a launch with {name!r}'s options sets "
                      + ", ".join(f"{k}={got} (the variant: {mine})" for k, (mine, got) in differs.items()),
                      file=sys.stderr, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if any("error" in r for r in out.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
