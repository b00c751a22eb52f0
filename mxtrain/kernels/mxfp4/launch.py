"""How the MXFP4 quantize kernels are launched: which kernel layout and tile shape (the launch table, tuned on
an H100, BENCHMARKS.md), the argument tuples of the two kernels (``_mxfp4_kernel``, ``_mxfp4_dual_kernel``;
built here, one function each), launch options, the one-pass policy, and launch plans.

Launch plans: a configuration quantized once (and, where ``verify`` applies, self-checked) is launched again
through its compiled kernel directly, skipping Triton's generic launch path (argument binding,
specialization, cache-key lookup): about 14 of the 22 us of host time a launch took on an H100's host
(tools/host_overhead.py). Keyed by everything the launch depends on (shapes, strides, pointer alignment,
every option and ``Settings.launch_key``; ``key``, the stochastic-rounding seed, is not specialized on). Kept
in ``CACHES.plans`` / ``CACHES.dual_plans`` (LRU-bounded). The ``fast_launch`` setting: ``auto`` (GPUs),
``always`` (Triton's interpreter too: a plan then calls the interpreted kernel with the same argument tuple a
compiled one gets; tests), ``off``.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import struct
from collections import namedtuple

import torch

from ... import settings as _settings
from .. import INTERPRET
from ..caches import CACHES
from .carrier import TILE_K, QuantOut, ceil_to
from . import kernels as _kernels   # (its kernels exist where Triton imports; read at launch time)

__all__ = ["RULE_ID", "GRID_ID", "KERNEL_RULES", "KERNEL_GRIDS",
           "BLOCK_ROTS", "FOLD_ROTS", "CAPPED_KERNELS", "DUAL_CONFIG", "W_DUAL_CONFIG", "DUAL_CONFIG_SINGLES",
           "W_DUAL_CONFIG_SINGLES", "DUAL_SEQ", "cols_values", "dual_config", "kernel_for",
           "fold_applies", "dual_applies", "block_config", "single_kernel", "launch_opts", "needs_idx64",
           "single_args", "dual_args", "single_spec", "dual_spec", "SingleSpec", "DualSpec", "kernel_kwargs",
           "GROUP_MAX", "GroupSpec", "group_key", "group_consts", "group_spec", "group_args",
           "use_plans", "Plan", "DualPlan", "Launch", "LAUNCHES", "record_launches"]

# The kernels' RULE constexpr, by scale rule: ``RULE_ID`` the rules the fast path takes (``mxtrain.linear.fast``'s
# ``supported`` reads it), ``KERNEL_RULES`` every rule the kernels implement: also ``adaptive`` (5;
# ``quant.REF_SCALE_RULES``' MX rule: per block floor's exponent or the next, whichever gives the lower squared error,
# compared in the reference's exact float64 terms, ``device._adaptive_term``), bit-identical to the reference
# (tests/kernels/test_rules_kernels.py, on CPU and on the GPU) and admitted to the fast path.
RULE_ID = {"floor": 0, "ceil": 1, "rceil": 2, "even": 3, "amd": 4, "adaptive": 5}
KERNEL_RULES = RULE_ID
# The kernels' GRID constexpr, by MX format: the element grid rounded to. ``mxint4`` (integers -7..7 with E8M0
# scales, the uniform 4-bit grid of the ``ufp4`` recipe) has E2M1's emax (2), so the same block exponents but for
# ``rceil`` and ``even``; every INT4 value times a power of two from 2**-9 up is exact in e4m3 (one binade lower
# than E2M1's 0.5), so its carrier blocks are inexact only below ``kexp = -9``. GRID 0 compiles to the code the
# kernels had before the switch (tools/compile_check.py's hashes). ``mxe1m2`` (E1M2: INT4's grid divided by 4, emax 0,
# so block exponents 2 above INT4's and up to 127) rounds ``4 v`` on INT4's grid with the same codes; its carrier holds
# the magnitude code times ``2**(kexp - 2)`` (at most 112), exact from ``kexp = -7`` up (``carrier.EXACT_KEXP``).
# ``GRID_ID``: the formats ``quantize_mxfp4_2d`` and the fast path take; ``KERNEL_GRIDS``: every grid the kernels
# implement, ``mxe1m2`` too (all three admitted: as ``KERNEL_RULES``).
GRID_ID = {"mxfp4": 0, "mxint4": 1, "mxe1m2": 2}
KERNEL_GRIDS = GRID_ID

# ---------------------------------------------------------------------------------------------- the launch table

# Which layout of the single-pass kernel quantizes (its ``LAYOUT`` constexpr, ``kernels.LAYOUTS``): "blocks"
# (each thread holds whole MX blocks; rotations up to 32 wide) or "tile" (any rotation) or "cols" (along columns
# of a row-major input); ``kernel_for`` picks by the input's layout, the ``qkernel`` setting overrides. Blocks
# layout: the four pieces joined into one 32-byte carrier store (16 bytes of FP4 codes) per thread and block
# (1.2-2x faster on an H100 than 8-byte stores straight from the pieces, BENCHMARKS.md).
BLOCK_ROTS = (0, 2, 4, 8, 16, 32)

# Rotations whose normalization 1/sqrt(ROT) is a power of two (H4, H16, H64) on bf16/fp16 inputs: the blocks
# and cols kernels multiply the block scale by it instead of every rotated value (one multiply an element
# fewer). Bit-identical: the butterfly sums of bf16 (fp16) values are multiples of 2**-133 (2**-24), so
# x / sqrt(ROT) is exact in float32, subnormals included, and (x * 2**-k) * 2**-s rounds the same real number
# as x * 2**(-s-k) (a power of two down to 2**-128, exact). Not with a prescale (applied between the two) or
# float32 inputs (x / sqrt(ROT) can round there). Measured faster on an H100 (BENCHMARKS.md); always on.
FOLD_ROTS = (4, 16, 64)

# Extra Triton launch options per kernel ("blocks", "blocks128" = blocks with 128x128 groups, "cols", "tile",
# "dual") on NVIDIA GPUs. Register caps (maxnreg): the cols and dual kernels hold 32 tokens of a feature per
# thread (~127 registers, so 4 blocks of 128 threads per SM: 25 % occupancy under Nsight Compute), the blocks
# kernel with 128x128 groups 64 values per thread (~103 registers); capped at 80 registers they ran
# 1.03-1.09x faster on an H100 with bit-identical output (64 and below much slower; the plain blocks kernel,
# 48 registers, 0.95x; BENCHMARKS.md). The cap is the ``qmaxnreg`` setting (0: no cap); launch plans key on
# it. Which kernels take it: CAPPED_KERNELS (launch plans do not key on it: clear them after rebinding it).
CAPPED_KERNELS = ("cols", "dual", "blocks128")

# Both operands of one activation from one read (``quantize_mxfp4_dual``): the forward's X (Fprop along
# features, Wgrad along tokens) and the backward's dY (Dgrad along features, Wgrad along tokens). Measured on
# an H100 (BENCHMARKS.md, "One-pass dual quantize"): with launch plans 1.08-1.22x faster than the two passes
# without rotations, from 2048x4096 to 16384x14336; with H16 1.01x alone and no faster inside a whole MXLinear
# call (the passes are bound by their arithmetic as much as by memory, so sharing the read pays little). The
# ``dual`` setting: "auto" (default: one pass only without rotations), "on" (always where the kernels apply),
# "off" (never).
# (A block rows, B block rows, warps) for B with 1x128 / 128x128 groups; SEQ: one program per 128x128 input
# block (A tiles, then B tiles) instead of one per tile
DUAL_CONFIG = {False: (32, 64, 4), True: (64, 128, 8)}
# a weight's Fprop and Dgrad operands from one read (128x128 groups on both sides: 128-row tiles, as each single
# pass of a weight takes them, ``block_config``; not yet timed on a GPU)
W_DUAL_CONFIG = (128, 128, 8)
DUAL_SEQ = False
# the same with one value of each of the cols layout's [4, BR] loads a thread (setting ``qcols`` ``singles``: the B
# side's warps doubled, or its rows halved where the A side keeps its warps): compiled for sm_90 without a register
# cap, as inductor compiles them, the dual pass of dY takes 48 registers against 127 and X's (128x128 Wgrad groups,
# FP4 codes) 52 against 80, with no spills (``tools/compile_check.py``, the ``singles ...`` variants); not yet timed
DUAL_CONFIG_SINGLES = {False: (32, 32, 4), True: (128, 128, 16)}
W_DUAL_CONFIG_SINGLES = (128, 128, 16)


def cols_values(st) -> int:
    """Values of each of the cols layout's 32 ``[4, BR]`` loads that one thread holds, by the ``qcols`` setting of
    settings ``st`` (its only reader): 2 for ``pairs`` and ``auto``, 1 for ``singles``. With 1 the cols and dual
    passes launch without the register cap (``single_spec``, ``dual_spec``): they need 48-54 registers uncapped,
    and with a cap of 80 ptxas takes all 80 (``tools/compile_check.py``)."""
    return 1 if st.qcols == "singles" else 2


def dual_config(group_rows_a: int, group_rows_b: int, st) -> tuple[int, int, int]:
    """(A block rows, B block rows, warps) of the dual pass for A's and B's carrier groups under settings ``st``
    (``qcols``)."""
    if cols_values(st) == 1:
        return W_DUAL_CONFIG_SINGLES if group_rows_a == 128 else DUAL_CONFIG_SINGLES[group_rows_b == 128]
    return W_DUAL_CONFIG if group_rows_a == 128 else DUAL_CONFIG[group_rows_b == 128]


def kernel_for(axis: int, rot: int, fp4: bool = False, rows_contiguous: bool = False,
               kernel: str | None = None) -> str:
    """The kernel layout ("tile", "blocks" or "cols": ``_mxfp4_kernel``'s ``LAYOUT``) that quantizes along
    ``axis`` with a ``rot``-wide rotation, given the ``qkernel`` setting (``kernel``; default: the current
    one). ``auto``: "cols" where the output rows are the input's contiguous axis (along columns of a
    row-major tensor: the Wgrad operands), else "blocks" for carrier-only outputs (the Hopper training path)
    and "tile" where packed FP4 codes are written (the blocks kernel's FP4 stores measured slower,
    BENCHMARKS.md). Rotations wider than 32 always run "tile"; "cols" forced where it does not apply runs
    "blocks"."""
    k = _settings.current().qkernel if kernel is None else kernel
    if k == "tile" or rot not in BLOCK_ROTS:
        return "tile"
    if rows_contiguous and k in ("auto", "cols"):
        return "cols"
    if k == "auto" and fp4:
        return "tile"
    return "blocks"


def fold_applies(dtype: torch.dtype, rot: int, prescale: float) -> bool:
    """Whether the blocks and cols kernels fold 1/sqrt(rot) into the block scales (``FOLD_ROTS``)."""
    return rot in FOLD_ROTS and dtype in (torch.bfloat16, torch.float16) and prescale == 1.0


DUAL_SR_MAX = 1 << 22   # the largest tensor (elements) that the dual pass takes with stochastic rounding (auto)


def dual_applies(x: torch.Tensor, rot_a: int, rot_b: int, group_rows_a: int = 1, sr: bool = False) -> bool:
    """Whether ``quantize_mxfp4_dual`` runs one fused pass for ``x`` (else it runs two): a row-major 2-D
    tensor, FP8-carrier outputs, A with 1x128 groups (an activation) or 128x128 (a weight, whose B side then has
    128x128 groups too: ``dual_spec``), and rotations the blocks and cols kernels take (with
    the ``dual`` setting ``auto``: not with stochastic rounding on either side (``sr``) on more than
    ``DUAL_SR_MAX`` elements; ``off``: never). Nearest rounding, with or without H16, measured faster in one
    pass at the sizes from 256 x 512 to 16384 x 4096 (H100, GPU and host time; one noisy outlier); with stochastic rounding one
    pass took 394 us against ~265 us for the two passes with SR on both sides and 249 against 239 us on one
    side at 16384 x 4096, and saved host time below a few million elements (BENCHMARKS.md)."""
    st = _settings.current()
    if st.dual == "off" or (st.dual == "auto" and sr and x.numel() > DUAL_SR_MAX):
        return False
    return (x.ndim == 2 and x.shape[0] > 0 and x.shape[1] > 1 and x.stride(1) == 1
            and group_rows_a in (1, 128) and kernel_for(1, rot_a, False, kernel=st.qkernel) == "blocks"
            and kernel_for(0, rot_b, False, rows_contiguous=True, kernel=st.qkernel) == "cols")


def block_config(kern: str, axis: int, group_rows: int, sr: bool, block_rows: int | None = None,
                 num_warps: int | None = None, cols_per_thread: int = 2) -> tuple[int, int]:
    """(block rows, warps) of a single-pass launch of kernel ``kern``: ``block_rows`` and ``num_warps`` where
    given (benchmark sweeps), else the best on an H100 (BENCHMARKS.md). ``cols_per_thread``: values of each of the
    cols layout's loads a thread holds (``cols_values``; 1: twice the warps)."""
    if kern == "cols":
        # 4 x BR values per load, 2 of them a thread (with stochastic rounding, uncapped, 32 rows x 2 warps:
        # 153.8 us against 163.3 for 64 x 4 without rotation)
        BR = block_rows or (128 if group_rows == 128 else (32 if sr else 64))
        return BR, num_warps or max(1, 4 * BR // (32 * cols_per_thread))
    if kern == "blocks":
        # small tiles along rows, 64 rows along columns, 128 for 128x128 groups; 8 rows x 4 MX blocks per warp
        # (32 values a thread); 128x128 groups: 8 warps (64 values a thread)
        BR = block_rows or (128 if group_rows == 128 else (16 if axis == 1 else 64))
        return BR, num_warps or (8 if group_rows == 128 else max(1, min(16, BR // 8)))
    # tile: 64 rows either way (along columns it was 32 rows before the 64-wide rotation groups: there a thread
    # holds one row's group, so 32 rows x 2 groups would leave half of 4 warps' threads repeating the others)
    BR = block_rows or (128 if group_rows == 128 else 64)
    return BR, num_warps or (8 if BR >= 128 else 4)


def single_kernel(kern: str, dev: torch.device, dtype: torch.dtype, BR: int, num_warps: int, rot: int,
                  has_signs: bool, scale_rule: str, sr: bool, prescale: float, group_rows: int, carrier: bool,
                  fp4: bool, idx64: bool, key_ptr: bool, fmt: str = "mxfp4", form: str = "auto") -> tuple:
    """(the Triton kernel, its constexpr arguments) for one single-pass launch in layout ``kern``: the layout's
    own constexprs only (the others keep their defaults, so that no option they ignore makes a new variant).
    ``form``: the blocks layout's tile arrangement (the ``qblocks`` setting, ``blocks_form``)."""
    assert kern in _kernels.LAYOUTS, kern
    consts = dict(BR=BR, ROT=rot, HAS_SIGNS=has_signs, RULE=KERNEL_RULES[scale_rule], SR=sr,
                  PRESCALE=prescale != 1.0,
                  GROUP_ROWS=group_rows, WRITE_CARRIER=carrier, WRITE_FP4=fp4, IDX64=idx64, KEY_PTR=key_ptr,
                  LAYOUT=kern, GRID=KERNEL_GRIDS[fmt])
    if kern == "cols":
        per_thread = 4 * BR // (32 * num_warps)   # values of each [4, BR] tensor a thread holds
        assert per_thread in (1, 2, 4, 8, 16), "cols kernel: 4 x block_rows must be 1, 2, 4, 8 or 16 x 32 x num_warps"
        consts.update(USE_ASM=dev.type == "cuda", PACK=min(per_thread, 4),
                      FOLD=fold_applies(dtype, rot, prescale))
    elif kern == "blocks":
        consts.update(USE_ASM=dev.type == "cuda", FOLD=fold_applies(dtype, rot, prescale),
                      **blocks_form(form, "", group_rows, has_signs))
    elif rot == 64:   # the tile kernel's 64-wide groups: the hardware e4m3 conversion as blocks and cols
        consts.update(USE_ASM=dev.type == "cuda")
    return _kernels._mxfp4_kernel, consts


def resolve_form(form: str, group_rows: int, has_signs: bool) -> str:
    """The tile arrangement the ``qblocks`` setting's ``form`` gives a blocks-layout pass: ``auto`` is ``lanes``
    (on an H200 the dual pass in 6-23 % less time than ``rows`` at 768 to 4,096 features, 9 % less of its time in a
    step's profile: BENCHMARKS.md) except for a pass in 128x128 groups with random signs (a weight of the
    ``-rht16`` and ``ufp4`` recipes), which spills more under ``lanes`` and ``rows16`` than under ``rows``
    (``tools/compile_check.py``)."""
    if form != "auto":
        return form
    return "rows" if group_rows == 128 and has_signs else "lanes"


def blocks_form(form: str, side: str = "", group_rows: int = 1, has_signs: bool = False) -> dict:
    """The blocks layout's constexprs for the ``qblocks`` setting's ``form`` (``_mxfp4_kernel``'s ``BFIRST`` and
    ``SPLIT16``; ``side`` "_A": the dual kernel's names), ``auto`` resolved for a pass in groups of
    ``group_rows`` rows with or without random signs (``resolve_form``): none for ``rows``, so that its variants
    stay the ones launched before the setting existed."""
    form = resolve_form(form, group_rows, has_signs)
    if form == "rows":
        return {}
    assert form in ("rows16", "lanes"), form
    return {f"SPLIT16{side}": True, **({f"BFIRST{side}": True} if form == "lanes" else {})}


def launch_opts(kern: str, dev: torch.device, sr: bool = False, maxnreg: int | None = None) -> dict:
    """Launch options of one kernel (``maxnreg``: the register cap, default the ``qmaxnreg`` setting).
    Stochastic rounding (a hash per element) needs more registers: capped at 80 the cols kernel spilled and
    ran 2.2-2.7x slower without rotation (H100: 355-488 us against 152-163 us uncapped at 16384 x 4096) and
    2-5 % slower with H16 + signs, so SR variants run uncapped."""
    if dev.type != "cuda" or torch.version.hip is not None or INTERPRET or sr:
        return {}
    cap = _settings.current().qmaxnreg if maxnreg is None else maxnreg
    return {"maxnreg": cap} if cap > 0 and kern in CAPPED_KERNELS else {}


def needs_idx64(Rp: int, Kc: int, Kq: int, sx_r: int, sx_k: int, si) -> bool:
    """32-bit offsets unless some offset (masked lanes of the last tiles included, ``Rp`` rows of
    programs) could pass 2**31 - 1."""
    return max(Rp * abs(sx_r) + Kc * abs(sx_k), Rp * Kc, Rp * Kq,
               Rp * max(si[0], 1) + Kc * max(si[1], 1)) >= 2**31 - 1


# ---------------------------------------------------------------------------------------------- launch specs

SingleSpec = namedtuple("SingleSpec", ["kern", "kfn", "consts", "num_warps", "opts", "grid", "ints", "floats",
                                       "R", "K", "Rc", "Kc", "Kq"])
SingleSpec.__doc__ = """Everything one single-pass launch depends on but the tensors (``single_spec``): the layout
``kern``, the kernel ``kfn`` and its constexprs ``consts``, warps, launch options, the grid, the integer and
float arguments of ``single_args``, and the outputs' sizes (rows ``R``, reduction ``K``, carrier rows ``Rc``
and length ``Kc``, the MX padded length ``Kq``)."""


def single_spec(shape, strides, dtype: torch.dtype, dev: torch.device, axis: int, *, rot: int, has_signs: bool,
                rounding: str, scale_rule: str, prescale: float, index_strides, carrier: bool, fp4: bool,
                group_rows: int, row_multiple: int, block_rows: int | None, num_warps: int | None,
                k_multiple: int, key_ptr: bool, force_idx64: bool, st, fmt: str = "mxfp4") -> SingleSpec:
    """The launch of ``_mxfp4_kernel`` that quantizes a 2-D tensor of ``shape`` / ``strides`` along ``axis``
    (``quantize_mxfp4_2d``'s options; ``st``: the settings): written once, for the eager launch and launch
    plans (``ops.quantize_mxfp4_2d``) and for the traced form under ``torch.compile`` (``traced.q_single``).
    Depends on sizes, strides, dtype, device and options only (works on fake tensors' metadata)."""
    if axis == 1:
        R, K = shape
        sx_r, sx_k = strides[0], strides[1]
        si = index_strides or (shape[1], 1)
    else:
        K, R = shape
        sx_r, sx_k = strides[1], strides[0]
        si = index_strides or (1, shape[1])
    sr = rounding == "stochastic"
    Kq = ceil_to(ceil_to(max(K, 1), rot or 1), 32)   # the reference pads to whole rotation blocks first
    Kc = ceil_to(max(K, 1), k_multiple)  # fp8_carrier uses 512: cuBLAS wants K/128 % 4 == 0
    if group_rows == 128:
        row_multiple = 128
    kern = kernel_for(axis, rot, fp4, rows_contiguous=sx_r == 1 and sx_k != 1, kernel=st.qkernel)
    BR, nw = block_config(kern, axis, group_rows, sr, block_rows, num_warps, cols_values(st))
    Rc = ceil_to(max(R, 1), max(row_multiple, 1)) if carrier else R
    if carrier:
        gsr, gsk = (1, Rc) if group_rows == 1 else (ceil_to(Kc // TILE_K, 4), 1)   # (carrier.carrier_buffers)
    else:
        gsr = gsk = 0
    grid = (-(-max(Rc, 1) // BR), Kc // TILE_K)
    idx64 = force_idx64 or needs_idx64(grid[0] * BR, Kc, Kq, sx_r, sx_k, si)
    kfn, consts = single_kernel(kern, dev, dtype, BR, nw, rot, has_signs, scale_rule, sr, prescale, group_rows,
                                carrier, fp4, idx64, key_ptr, fmt, st.qblocks)
    opts = launch_opts(kern + ("128" if kern == "blocks" and group_rows == 128 else ""), dev, sr=sr,
                       maxnreg=0 if kern == "cols" and cols_values(st) == 1 else st.qmaxnreg)
    ints = (R, K, Rc, sx_r, sx_k, si[0], si[1], Kc, Kq, gsr, gsk)
    return SingleSpec(kern, kfn, consts, nw, opts, grid, ints, rot_floats(rot, prescale), R, K, Rc, Kc, Kq)


DualSpec = namedtuple("DualSpec", ["consts", "num_warps", "opts", "grid", "ints", "floats_a", "floats_b", "sides"])
DualSpec.__doc__ = """Everything one dual-kernel launch depends on but the tensors (``dual_spec``): constexprs,
warps, launch options, grid, the integer arguments of ``dual_args`` and each side's floats; ``sides``: per
output (A, B) ``(R, K, Rc, Kc, Kq, group_rows, fp4)``."""


def dual_spec(shape, stride0: int, dtype: torch.dtype, dev: torch.device, a: dict, b: dict, *, k_multiple: int,
              block_rows, num_warps, sequential, fp4_b: bool, force_idx64: bool, st) -> DualSpec:
    """The launch of ``_mxfp4_dual_kernel`` for a row-major (M, K) tensor with row stride ``stride0``; ``a``,
    ``b``: each side's options as ``ops.quantize_mxfp4_dual`` takes them, where ``signs`` and ``key_tensor``
    only need to say whether they are given. Written once for the eager launch (``ops``) and the traced form
    (``traced.q_dual``)."""
    M, K = shape
    gr_a, gr_b = a.get("group_rows", 1), b.get("group_rows", 1)
    assert gr_a == 1 or gr_b == 128, "dual kernel: a weight's two operands (A in 128x128 groups) need B's too"
    cfg = dual_config(gr_a, gr_b, st)
    nw = num_warps or cfg[2]
    bra, brb = block_rows or cfg[:2]
    seq = DUAL_SEQ if sequential is None else sequential
    BR = {1: bra, 0: brb}
    assert 128 % bra == 0 and brb in (32, 64, 128) and (gr_b == 1 or brb == 128) and (gr_a == 1 or bra == 128), \
        (bra, brb, gr_a, gr_b)
    pack = 4 * brb // (32 * nw)
    assert 4 * brb % (32 * nw) == 0 and pack in (1, 2, 4, 8, 16), \
        "dual kernel: 4 x block_rows[1] must be 1, 2, 4, 8 or 16 x 32 x num_warps"
    dims, floats, consts, geo, sides = [], [], {}, [], []
    for axis, side, R, Kr, sfx in ((1, a, M, K, "A"), (0, b, K, M, "B")):
        rot = side.get("rot", 0)
        gr = side.get("group_rows", 1)
        Kq = ceil_to(ceil_to(Kr, rot or 1), 32)
        Kc = ceil_to(Kr, k_multiple)
        Rc = ceil_to(R, 128 if gr == 128 else 16)
        si = side.get("index_strides") or ((K, 1) if axis == 1 else (1, K))
        rounding = side.get("rounding", "nearest")
        prescale = side.get("prescale", 1.0)
        fp = axis == 0 and fp4_b
        if fp:   # packed codes and scales take the carrier's and group scales' places
            gsr = gsk = 0
        else:
            gsr, gsk = (1, Rc) if gr == 1 else (ceil_to(Kc // TILE_K, 4), 1)   # (carrier.carrier_buffers)
        sides.append((R, Kr, Rc, Kc, Kq, gr, fp))
        nr, nk = -(-Rc // BR[axis]), Kc // TILE_K
        sx = (stride0, 1) if axis == 1 else (1, stride0)
        geo.append((nr, nk, force_idx64 or needs_idx64(nr * BR[axis], Kc, Kq, sx[0], sx[1], si)))
        dims.append((Rc, si[0], si[1], Kc, Kq, gsr, gsk))
        floats.append(rot_floats(rot, prescale))
        consts.update({f"BR_{sfx}": BR[axis], f"ROT_{sfx}": rot, f"HAS_SIGNS_{sfx}": side.get("signs") is not None,
                       f"RULE_{sfx}": KERNEL_RULES[side.get("scale_rule", "floor")],
                       f"SR_{sfx}": rounding == "stochastic",
                       f"PRESCALE_{sfx}": prescale != 1.0, f"KEY_PTR_{sfx}": side.get("key_tensor") is not None,
                       f"FOLD_{sfx}": fold_applies(dtype, rot, prescale),
                       f"GRID_{sfx}": KERNEL_GRIDS[side.get("fmt", "mxfp4")]})
    consts.update(GROUP_ROWS_A=gr_a, GROUP_ROWS_B=gr_b, PACK_B=min(pack, 4), IDX64=geo[0][2] or geo[1][2],
                  USE_ASM=dev.type == "cuda", SEQ=seq, CAR_B=not fp4_b, FP4_B=fp4_b,
                  **blocks_form(st.qblocks, "_A", gr_a, a.get("signs") is not None))
    (nr_a, nk_a, _), (nr_b, nk_b, _) = geo
    NA, NB = 128 // BR[1], 128 // BR[0]
    F = max(nk_a, -(-nr_b // NB))
    T = max(-(-nr_a // NA), nk_b)
    grid = (T * F * (1 if seq else NA + NB),)
    ints = (M, K, stride0, 1, *dims[0], *dims[1], nr_a, nk_a, nr_b, nk_b, F)
    opts = launch_opts("dual", dev, sr=consts["SR_A"] or consts["SR_B"],
                       maxnreg=0 if cols_values(st) == 1 else st.qmaxnreg)
    return DualSpec(consts, nw, opts, grid, ints, floats[0], floats[1], tuple(sides))


def kernel_kwargs(kfn, args: tuple, consts: dict) -> dict:
    """Every argument of ``kfn`` by name: the positional ``args`` (``single_args``, ``dual_args``), then the
    constexprs ``consts``, then the defaults of the rest (``pid_r``...). Under ``torch.compile`` a kernel
    launched with any argument left out is treated as writing every tensor it takes (torch's mutation
    analysis fails), so the traced launches pass them all."""
    names = list(kfn.arg_names)
    kw = dict(zip(names, args))
    kw.update(consts)
    params = inspect.signature(kfn.fn).parameters
    for n in names[len(args):]:
        if n not in kw:
            kw[n] = params[n].default
    return kw


# ---------------------------------------------------------------------------------------------- argument tuples

def f32(v: float) -> float:
    """``v`` rounded to float32 (the kernel's scalar arguments are float32)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def i32(key: int) -> int:
    """A 32-bit key as the signed int32 Triton passes."""
    key &= 0xFFFFFFFF
    return key - (1 << 32) if key >= (1 << 31) else key


def rot_floats(rot: int, prescale: float) -> tuple[float, float]:
    """The kernels' float arguments (1/sqrt(rot), prescale) in float32."""
    return (f32(1.0 / math.sqrt(rot)) if rot else 1.0), f32(prescale)


def single_args(x, cnt, signs, car, gs, packed, scales, key_tensor, ints: tuple, key: int, floats: tuple) -> tuple:
    """The positional arguments of the single-pass kernel ``_mxfp4_kernel`` (every layout) in its order, for
    every launch and launch plan: 8 pointers (input, signs, carrier, group scales, packed codes, E8M0 scales,
    inexact counter, key in device memory; where one is absent, None, the counter ``cnt`` stands in and is
    never touched there), ``ints`` (R, K, grid rows, the input's strides, the index strides, Kc, Kq, the
    group scales' strides), the key as int32 and ``floats`` (``rot_floats``). The constexprs follow by name
    (``single_kernel``); ``pid_r`` / ``pid_k`` keep their defaults (the program ids)."""
    return (x, cnt if signs is None else signs, cnt if car is None else car, cnt if gs is None else gs,
            cnt if packed is None else packed, cnt if scales is None else scales, cnt,
            cnt if key_tensor is None else key_tensor, *ints, i32(key), *floats)


SINGLE_TAIL = ["key", "inv_sqrt", "prescale"]   # the single-pass kernel's last runtime arguments
SINGLE_FIRST_INT = (8, "R")                      # (position, name) of the first argument after the pointers


def dual_args(x, cnt, side_a: tuple, side_b: tuple, ints: tuple, key_a: int, floats_a: tuple, key_b: int,
              floats_b: tuple) -> tuple:
    """The positional arguments of ``_mxfp4_dual_kernel`` in its order, for every launch and launch plan: the
    input, the inexact counter, per side (A: along rows, B: along columns) 4 pointers ``(signs, carrier or
    packed codes, group scales or E8M0 scales, key in device memory)`` (signs and key may be None: ``cnt``
    stands in), ``ints`` (M, K, the input's strides, per side Rc, index strides, Kc, Kq and group-scale
    strides, the grids and F), then per side the key as int32 and ``rot_floats``."""
    sa, ca, ga, ka = side_a
    sb, cb, gb, kb = side_b
    return (x, cnt, cnt if sa is None else sa, ca, ga, cnt if ka is None else ka,
            cnt if sb is None else sb, cb, gb, cnt if kb is None else kb,
            *ints, i32(key_a), *floats_a, i32(key_b), *floats_b)


DUAL_TAIL = ["key_a", "inv_a", "ps_a", "key_b", "inv_b", "ps_b"]
DUAL_FIRST_INT = (10, "M")


# ---------------------------------------------------------------------------------------------- grouped passes

GROUP_MAX = 4   # the tensors one launch of ``_mxfp4_group_kernel`` takes (its slots)
GroupSpec = namedtuple("GroupSpec", ["consts", "num_warps", "opts", "grid", "ints", "floats"])
GroupSpec.__doc__ = """One launch of ``_mxfp4_group_kernel`` (``group_spec``): the shared constexprs (``G`` among them),
warps, launch options, the grid (the members' tiles one after another), per slot the integers that follow its three
pointers (``single_args``' 11, then its reduction blocks and the end of its programs) and the shared floats."""
# the single-pass constexprs that the group kernel takes as they are (the outputs are FP8 carriers only)
_GROUP_CONSTS = ("BR", "ROT", "HAS_SIGNS", "RULE", "SR", "PRESCALE", "GROUP_ROWS", "IDX64", "KEY_PTR", "LAYOUT",
                 "USE_ASM", "PACK", "FOLD", "GRID", "BFIRST", "SPLIT16")


def group_key(sp: SingleSpec) -> tuple | None:
    """What must be equal for single passes to share one group launch (``group_spec``): the variant (constexprs,
    warps, options) and the floats; None where ``sp`` cannot be grouped (packed-code outputs, an empty tensor,
    constexprs the group kernel does not pass on)."""
    c = sp.consts
    if (not c.get("WRITE_CARRIER") or c.get("WRITE_FP4") or sp.R == 0 or sp.K == 0
            or set(c) - set(_GROUP_CONSTS) - {"WRITE_CARRIER", "WRITE_FP4"}):
        return None
    return (tuple(sorted((k, v) for k, v in c.items() if k in _GROUP_CONSTS)), sp.num_warps,
            tuple(sorted(sp.opts.items())), sp.floats)


def group_consts(consts: dict, G: int) -> dict:
    """The constexprs of ``_mxfp4_group_kernel`` for ``G`` passes of the single-pass variant ``consts`` (its
    constexprs, or every argument of a launch of it by name: what the group kernel takes as it is, and ``G``)."""
    out = {k: v for k, v in consts.items() if k in _GROUP_CONSTS}
    out["G"] = G
    return out


def group_spec(specs: list) -> GroupSpec:
    """The launch of ``_mxfp4_group_kernel`` that runs the single passes ``specs`` (``single_spec``'s, 1 to
    ``GROUP_MAX`` of them, one ``group_key``) as one: each member's tiles get the programs after the previous
    member's, in its own (row block, reduction block) order; an unused slot repeats the first member's integers
    (never read: ``G`` slots are)."""
    assert 1 <= len(specs) <= GROUP_MAX, len(specs)
    keys = {group_key(sp) for sp in specs}
    assert len(keys) == 1 and None not in keys, "group_spec: the passes are not one groupable variant"
    first = specs[0]
    ints, end = [], 0
    for sp in specs:
        nr, nk = sp.grid
        end += nr * nk
        ints.append((*sp.ints, nk, end))
    ints += [ints[0]] * (GROUP_MAX - len(specs))
    consts = group_consts(first.consts, len(specs))
    return GroupSpec(consts, first.num_warps, first.opts, (end,), tuple(ints), first.floats)


def group_args(cnt, signs, key_tensor, members: list, gs: GroupSpec, key: int) -> tuple:
    """The positional arguments of ``_mxfp4_group_kernel`` in its order: the signs, counter and key pointers (an
    absent one: ``cnt`` stands in, never touched), the key as int32 and the floats, then per slot the input, its
    carrier and group-scale storage (``members``: ``(x, carrier, group scales)`` each; an unused slot: the first
    input, and ``cnt`` for its outputs) and the slot's integers."""
    out = [cnt if signs is None else signs, cnt, cnt if key_tensor is None else key_tensor, i32(key), *gs.floats]
    for i, ints in enumerate(gs.ints):
        x, car, g = members[i] if i < len(members) else (members[0][0], cnt, cnt)
        out += [x, car, g, *ints]
    return tuple(out)


# ---------------------------------------------------------------------------------------------- launches

Launch = namedtuple("Launch", ["kernel", "shape", "plan"])
Launch.__doc__ = """One recorded quantize launch: ``kernel`` ("tile", "blocks", "cols" or "dual"), the input's
``shape`` and whether it went through a launch ``plan``."""


class LaunchLog:
    """Records the quantize launches of this process inside ``record()`` blocks (tests: which kernel ran on
    which input, and whether through a launch plan). Outside them nothing is recorded: one attribute test
    a launch."""

    __slots__ = ("logs",)

    def __init__(self):
        self.logs: tuple = ()

    @contextlib.contextmanager
    def record(self):
        """A list that receives a ``Launch`` for each launch until the block ends (blocks may nest; every
        active one records; process-wide, as the launches are)."""
        log: list = []
        self.logs = self.logs + (log,)
        try:
            yield log
        finally:
            self.logs = tuple(g for g in self.logs if g is not log)

    def note(self, kernel: str, shape, plan: bool) -> None:
        entry = Launch(kernel, tuple(shape), plan)
        for log in self.logs:
            log.append(entry)


LAUNCHES = LaunchLog()


def record_launches():
    """``LAUNCHES.record()``: ``with record_launches() as log: ...`` collects a ``Launch`` per quantize launch."""
    return LAUNCHES.record()


def launch(kern: str, kfn, grid, args: tuple, consts: dict, num_warps: int, opts: dict, shape):
    """Triton's generic launch of ``kfn`` (kernel name ``kern``); returns the compiled kernel (None under the
    interpreter)."""
    compiled = kfn[grid](*args, **consts, num_warps=num_warps, enable_fp_fusion=False, **opts)
    if LAUNCHES.logs:
        LAUNCHES.note(kern, shape, False)
    return compiled


# ---------------------------------------------------------------------------------------------- launch plans

def use_plans(x: torch.Tensor, st) -> bool:
    """Whether quantize calls on ``x`` use launch plans, by the ``fast_launch`` setting of ``st``."""
    mode = st.fast_launch
    if mode == "auto":
        return x.is_cuda and not INTERPRET
    return mode == "always"


def _direct_runner(kfn, compiled, grid, args, consts, tail: list | None, first_int: tuple | None):
    """(a callable that launches ``kfn`` on ``grid`` with every argument positional, constexprs last; the
    values of the arguments after ``args``, in order), or None where the kernel cannot be called that way: the
    launch's positional ``args`` must have the argument named ``first_int[1]`` at position ``first_int[0]``
    and end with ``tail`` (where given); every later argument is one of ``consts`` or keeps its default (as the
    launch bound it: a constexpr the layout ignores, ``_mxfp4_kernel``'s ``pid_r`` / ``pid_k``), and every one of
    ``consts`` is such an argument. Compiled: the compiled kernel bound to ``grid``; under Triton's
    interpreter: the interpreted kernel."""
    try:
        names = list(kfn.arg_names)
        n = len(args)
        if tail is not None and (names[n - len(tail):n] != tail or names[first_int[0]] != first_int[1]):
            return None
        if any(a not in names[n:] for a in consts):
            return None
        params = inspect.signature(kfn.fn).parameters
        rest = []
        for a in names[n:]:
            if a in consts:
                rest.append(consts[a])
            elif params[a].default is not inspect.Parameter.empty:
                rest.append(params[a].default)
            else:
                return None
        rest = tuple(rest)
        if INTERPRET:
            return (lambda *a: kfn[grid](*a)), rest
        if compiled is None:
            return None
        return compiled[tuple(grid) + (1,) * (3 - len(grid))], rest
    except Exception:  # noqa: BLE001 - a Triton without this interface: keep the generic launch
        return None


def launch_direct(kfn, grid, args: tuple, consts: dict, num_warps: int, key) -> None:
    """Launch the small kernel ``kfn`` (the call seeds, the carrier rebuild) on ``grid``: the first time for
    ``key`` through Triton's generic launch, then through its compiled kernel directly (``CACHES.direct``),
    which costs the host a fraction of the generic launch's argument binding. ``key`` must name everything
    the compiled kernel depends on: the device, every integer argument, the 16-byte alignment of every
    pointer, the constexprs and the grid (callers put the values themselves in it); None: always the
    generic launch (``use_plans`` says no)."""
    if key is not None:
        got = CACHES.direct.get(key)
        if got is not None:
            got[0](*args, *got[1])
            return
    compiled = kfn[grid](*args, **consts, num_warps=num_warps)
    if key is not None:
        got = _direct_runner(kfn, compiled, grid, args, consts, None, None)
        if got is not None:
            CACHES.direct[key] = got


class Plan:
    """A single-pass launch called through its compiled kernel (``quantize_mxfp4_2d``): the output shapes,
    the integer and float arguments and the constexprs of the first launch; each call allocates the
    outputs and passes ``single_args`` of the new input, signs, key and counter."""

    __slots__ = ("run", "kernel", "ints", "floats", "consts", "R", "K", "carrier", "fp4", "group_rows",
                 "car_shape", "gs_shape", "gs_cols", "pk_shape", "sc_shape", "fmt")

    @staticmethod
    def make(kern: str, kfn, compiled, grid, ints: tuple, floats: tuple, consts: dict, out: QuantOut, Kc: int,
             group_rows: int):
        """A plan for this launch, or None where the kernel cannot be called directly (or nothing was
        launched: an empty input)."""
        if kfn is None:
            return None
        args = single_args(None, None, None, None, None, None, None, None, ints, 0, floats)
        got = _direct_runner(kfn, compiled, grid, args, consts, SINGLE_TAIL, SINGLE_FIRST_INT)
        if got is None:
            return None
        p = Plan()
        p.run, p.consts = got
        p.kernel, p.ints, p.floats = kern, ints, floats
        p.R, p.K, p.group_rows, p.fmt = out.R, out.K, group_rows, out.fmt
        p.carrier, p.fp4 = out.carrier is not None, out.packed is not None
        if p.carrier:
            p.car_shape = tuple(out.carrier.shape)
            p.gs_shape = tuple(out.gs_base.shape)
            p.gs_cols = Kc // TILE_K
        if p.fp4:
            p.pk_shape, p.sc_shape = tuple(out.packed.shape), tuple(out.scales.shape)
        return p

    def __call__(self, x: torch.Tensor, signs, key: int, counter, key_tensor=None) -> QuantOut:
        dev = x.device
        car = gs = base = packed = sc = None
        if self.carrier:
            car = torch.empty(self.car_shape, dtype=torch.uint8, device=dev)
            base = torch.empty(self.gs_shape, dtype=torch.float32, device=dev)
            gs = base.t() if self.group_rows == 1 else base[:, : self.gs_cols]
            cnt = counter if counter is not None else torch.zeros((1,), dtype=torch.int32, device=dev)
        else:
            cnt = counter if counter is not None else torch.empty((1,), dtype=torch.int32, device=dev)
        if self.fp4:
            packed = torch.empty(self.pk_shape, dtype=torch.uint8, device=dev)
            sc = torch.empty(self.sc_shape, dtype=torch.uint8, device=dev)
        self.run(*single_args(x, cnt, signs, car, gs, packed, sc, key_tensor, self.ints, key, self.floats),
                 *self.consts)
        if LAUNCHES.logs:
            LAUNCHES.note(self.kernel, x.shape, True)
        return QuantOut(self.R, self.K, car.view(torch.float8_e4m3fn) if car is not None else None, gs,
                        self.group_rows, cnt if car is not None else None, packed, sc, base, self.fmt)


class DualPlan:
    """A dual-kernel launch called through its compiled kernel (see ``Plan``): the generic Triton launch
    of this kernel's ~60 arguments cost more host time than the fused pass saves on mid-sized tensors
    (H100: 16.7M elements, one pass 185 us per call in a loop against 54 us for two planned passes)."""

    __slots__ = ("run", "ints", "floats", "consts", "bufs")

    @staticmethod
    def make(compiled, grid, ints: tuple, floats_a: tuple, floats_b: tuple, consts: dict, outs):
        """A plan for this launch, or None where the kernel cannot be called directly."""
        side = (None, None, None, None)
        args = dual_args(None, None, side, side, ints, 0, floats_a, 0, floats_b)
        got = _direct_runner(_kernels._mxfp4_dual_kernel, compiled, grid, args, consts, DUAL_TAIL, DUAL_FIRST_INT)
        if got is None:
            return None
        p = DualPlan()
        p.run, p.consts = got
        p.ints, p.floats = ints, (floats_a, floats_b)
        p.bufs = [(o.R, o.K, tuple(o.packed.shape), tuple(o.scales.shape), o.group_rows, "fp4", o.fmt)
                  if o.carrier is None
                  else (o.R, o.K, tuple(o.carrier.shape), tuple(o.gs_base.shape), o.group_rows,
                        o.gscale.shape[1] if o.group_rows == 128 else None, o.fmt) for o in outs]
        return p

    def __call__(self, x, a, b, cnt):
        dev = x.device
        outs, ptrs = [], []
        for (R, Kr, cshape, gshape, gr, gcols, fmt), side in zip(self.bufs, (a, b)):
            car = torch.empty(cshape, dtype=torch.uint8, device=dev)
            if gcols == "fp4":   # packed codes (car) and E8M0 scales (gs)
                gs = torch.empty(gshape, dtype=torch.uint8, device=dev)
                outs.append(QuantOut(R, Kr, None, None, gr, None, car, gs, fmt=fmt))
            else:
                base = torch.empty(gshape, dtype=torch.float32, device=dev)
                gs = base.t() if gr == 1 else base[:, :gcols]
                outs.append(QuantOut(R, Kr, car.view(torch.float8_e4m3fn), gs, gr, cnt, None, None, base, fmt))
            sg = side.get("signs")
            if sg is not None and (sg.dtype != torch.float32 or not sg.is_contiguous() or sg.device != dev):
                sg = sg.to(device=dev, dtype=torch.float32).contiguous()
            ptrs.append((sg, car, gs, side.get("key_tensor")))
        fa, fb = self.floats
        self.run(*dual_args(x, cnt, ptrs[0], ptrs[1], self.ints, a.get("key", 0), fa, b.get("key", 0), fb),
                 *self.consts)
        if LAUNCHES.logs:
            LAUNCHES.note("dual", x.shape, True)
        return outs[0], outs[1]

