"""Per-call random inputs of one MX layer, derived on the device in one kernel launch.

A layer keeps ``state = [layer, step, call]`` (int64, on its device). ``call_seeds`` turns it into
that call's random inputs without reading it on the host, so a captured CUDA graph or a
torch.compile'd graph replays with the current step and call instead of the values seen at
capture:

* ``keys`` (int32, (24,)): ``keys[4*i]`` is the stochastic-rounding key of operand ``i`` (fprop_x,
  fprop_w, dgrad_dy, dgrad_w, wgrad_dy, wgrad_x), ``rng.stream_key(nn.operand_seed(seed, layer, i,
  step, call))`` as a 32-bit pattern, 0 for operands without stochastic rounding; other entries 0.
  The 16-byte spacing keeps every ``keys[4*i:]`` aligned as a quantize kernel's ``key_tensor``.
* ``signs`` (float32, (3, 128)): row ``g`` (fprop, dgrad, wgrad) holds
  ``hadamard.rotation_signs(size_g, mode_g, seed=seed, layer=layer, gemm=g, step=step)`` in its
  first ``size_g`` entries and 1.0 elsewhere (all 1.0 for mode ``none``).

``advance=True`` also increments ``state[2]`` in the same kernel, after reading it. The kernel folds
the same 32-bit lowbias32 hash as ``mxtrain.numerics.rng`` in uint32 arithmetic and matches
``call_seeds_host`` (the plain-PyTorch reference) bit for bit (``tests/kernels/test_seeds.py``). Modes,
sizes, the SR mask and ``advance`` are runtime arguments: one compiled variant serves every layer.
"""

from __future__ import annotations

import torch

from ..numerics import rng
from ..numerics.hadamard import ROTATION_SIZES, SIGN_MODES, rotation_signs
from . import HAS_TRITON, kernels_available
from .mxfp4.launch import launch_direct, use_plans
from .. import settings as _settings

__all__ = ["call_seeds", "call_seeds_host", "N_OPERANDS", "KEY_STRIDE", "SIGNS_WIDTH"]

N_OPERANDS = 6
KEY_STRIDE = 4  # int32 entries between keys: 16 bytes
SIGNS_WIDTH = 128
_N_KEYS = N_OPERANDS * KEY_STRIDE
_MODE_ID = {m: i for i, m in enumerate(SIGN_MODES)}  # none 0, fixed 1, per_layer 2, per_step 3

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .mxfp4.device import _mix32   # lowbias32 on uint32, as the quantize kernels hash

    @triton.jit
    def _fold(k, lo, hi):
        """One step of ``rng.stream_key``: fold the part with 32-bit words (lo, hi) into key ``k``."""
        return _mix32(k ^ _mix32(lo) ^ hi)

    @triton.jit
    def _signs_row(out_ptr, ks, llo, lhi, slo, shi, lane, G: tl.constexpr, mode, size):
        """Row ``G`` of ``signs``: the rotation signs of GEMM ``G`` (see ``hadamard.rotation_signs``)."""
        z = tl.zeros(lane.shape, tl.uint32)  # tags 0x5157, 0x1A7E, 0x57E9 as in rotation_signs
        k_fixed = _fold(ks, z + 0x5157, z)
        k_layer = _fold(_fold(ks, z + 0x1A7E, z), llo, lhi)
        k_step = _fold(_fold(_fold(_fold(ks, z + 0x57E9, z), llo, lhi), z + G, z), slo, shi)
        key = tl.where(mode == 1, k_fixed, tl.where(mode == 2, k_layer, k_step))
        bit = _mix32(lane.to(tl.uint32) ^ key) & 1
        s = 1.0 - 2.0 * bit.to(tl.float32)
        s = tl.where((mode != 0) & (lane < size), s, 1.0)
        tl.store(out_ptr + G * 128 + lane, s)

    @triton.jit(do_not_specialize=["seed_lo", "seed_hi", "sr_mask", "mode0", "mode1", "mode2",
                                    "size0", "size1", "size2", "advance"])
    def _call_seeds_kernel(state_ptr, keys_ptr, signs_ptr, seed_lo, seed_hi, sr_mask,
                           mode0, mode1, mode2, size0, size1, size2, advance, N_KEYS: tl.constexpr):
        lane = tl.arange(0, 128)
        at = tl.zeros([128], tl.int32)  # every lane reads the same state word
        layer = tl.load(state_ptr + at)
        step = tl.load(state_ptr + 1 + at)
        call = tl.load(state_ptr + 2 + at)
        z = tl.zeros([128], tl.uint32)
        llo = (layer & 0xFFFFFFFF).to(tl.uint32)
        lhi = (layer >> 32).to(tl.uint32)
        slo = (step & 0xFFFFFFFF).to(tl.uint32)
        shi = (step >> 32).to(tl.uint32)
        clo = (call & 0xFFFFFFFF).to(tl.uint32)
        chi = (call >> 32).to(tl.uint32)
        # stream_key(seed, ...) starts from stream_key(seed); the int32 words as uint32 (same bits)
        zi = tl.zeros([128], tl.int32)
        ks = _fold(z, (zi + seed_lo).to(tl.uint32, bitcast=True), (zi + seed_hi).to(tl.uint32, bitcast=True))

        # SR keys: lane j holds operand j // 4; stream_key(x) of a 32-bit x is mix32(mix32(x))
        op = lane // 4
        inner = _fold(_fold(_fold(_fold(ks, llo, lhi), op.to(tl.uint32), z), slo, shi), clo, chi)
        key = _mix32(_mix32(inner)).to(tl.int32, bitcast=True)
        on = ((lane % 4) == 0) & (((sr_mask >> tl.minimum(op, 31)) & 1) != 0)
        tl.store(keys_ptr + lane, tl.where(on, key, 0), mask=lane < N_KEYS)

        _signs_row(signs_ptr, ks, llo, lhi, slo, shi, lane, 0, mode0, size0)
        _signs_row(signs_ptr, ks, llo, lhi, slo, shi, lane, 1, mode1, size1)
        _signs_row(signs_ptr, ks, llo, lhi, slo, shi, lane, 2, mode2, size2)

        # every thread's read of state[2] is ordered before the increment (num_warps > 1 safe)
        tl.debug_barrier()
        tl.store(state_ptr + 2 + at, call + 1, mask=(lane == 0) & (advance != 0))


def _i32(v: int) -> int:
    """The int32 with the 32-bit pattern ``v & 0xFFFFFFFF``."""
    v &= rng.MASK32
    return v - (1 << 32) if v >= (1 << 31) else v


def _check(sr, sign_modes, sign_sizes) -> None:
    if len(sr) != N_OPERANDS:
        raise ValueError(f"sr must have {N_OPERANDS} entries (one per operand), got {len(sr)}")
    if len(sign_modes) != 3 or len(sign_sizes) != 3:
        raise ValueError(f"sign_modes and sign_sizes need 3 entries (fprop, dgrad, wgrad), got "
                         f"{len(sign_modes)} and {len(sign_sizes)}")
    for g, (mode, size) in enumerate(zip(sign_modes, sign_sizes)):
        if mode not in _MODE_ID:
            raise ValueError(f"unknown sign mode {mode!r} for GEMM {g}; valid modes: {', '.join(SIGN_MODES)}")
        if size not in ROTATION_SIZES and not (size == 0 and mode == "none"):
            raise ValueError(f"GEMM {g}: rotation size must be one of {ROTATION_SIZES} (or 0 with mode "
                             f"'none'), got {size!r} with mode {mode!r}")


def call_seeds(state: torch.Tensor, *, seed: int, sr: tuple[bool, ...], sign_modes: tuple[str, str, str],
               sign_sizes: tuple[int, int, int], advance: bool, keys_out: torch.Tensor | None = None,
               signs_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of one layer call, read from ``state`` on the device (one kernel launch).

    **Arguments:**
      * ``state``: int64 (3,) contiguous ``[layer, step, call]``, values in [0, 2**62); CUDA, or CPU
        under ``TRITON_INTERPRET=1``. Never read on the host.
      * ``seed``: the recipe's seed (any int; folded as ``rng.stream_key`` folds it).
      * ``sr``: 6 bools, the operands that use stochastic rounding.
      * ``sign_modes`` / ``sign_sizes``: per GEMM (fprop, dgrad, wgrad), a mode of
        ``hadamard.SIGN_MODES`` and a rotation size (16, 32, 64, 128; 0 with mode ``none``).
      * ``advance``: also increment ``state[2]`` (the returned keys use the value before).
      * ``keys_out`` / ``signs_out``: optional outputs to write into: int32 (24,) and float32
        (3, 128), contiguous, on ``state``'s device (``keys_out`` 16-byte aligned).

    **Returns:** ``(keys, signs)``, as in the module docstring.
    """
    if not kernels_available(state.device):
        raise RuntimeError(f"call_seeds needs the Triton kernels on {state.device} (CUDA, or CPU with "
                           "TRITON_INTERPRET=1); use call_seeds_host")
    if state.dtype != torch.int64 or state.shape != (3,) or not state.is_contiguous():
        raise ValueError(f"state must be a contiguous int64 tensor of shape (3,), got {state.dtype} "
                         f"{tuple(state.shape)}")
    dev = state.device
    if keys_out is None:
        keys_out = torch.empty(_N_KEYS, dtype=torch.int32, device=dev)
    elif keys_out.dtype != torch.int32 or keys_out.shape != (_N_KEYS,) or not keys_out.is_contiguous() \
            or keys_out.device != dev:
        raise ValueError(f"keys_out must be a contiguous int32 ({_N_KEYS},) tensor on {dev}")
    if signs_out is None:
        signs_out = torch.empty(3, SIGNS_WIDTH, dtype=torch.float32, device=dev)
    elif signs_out.dtype != torch.float32 or signs_out.shape != (3, SIGNS_WIDTH) \
            or not signs_out.is_contiguous() or signs_out.device != dev:
        raise ValueError(f"signs_out must be a contiguous float32 (3, {SIGNS_WIDTH}) tensor on {dev}")
    _check(sr, sign_modes, sign_sizes)
    seed = int(seed)
    sr_mask = sum(1 << i for i, on in enumerate(sr) if on)
    ints = (_i32(seed), _i32(seed >> 32), sr_mask, *(_MODE_ID[m] for m in sign_modes),
            *(int(s) for s in sign_sizes), int(bool(advance)))
    key = (("seeds", dev, state.data_ptr() & 15, keys_out.data_ptr() & 15, signs_out.data_ptr() & 15) + ints
           if use_plans(state, _settings.current()) else None)
    launch_direct(_call_seeds_kernel, (1,), (state, keys_out, signs_out, *ints), {"N_KEYS": _N_KEYS}, 1, key)
    return keys_out, signs_out


def call_seeds_host(seed: int, layer: int, step: int, call: int, *, sr: tuple[bool, ...],
                    sign_modes: tuple[str, str, str], sign_sizes: tuple[int, int, int],
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``call_seeds`` computed on the host with ``mxtrain.numerics.rng`` (the reference; CPU without Triton).

    Same outputs for ``state = [layer, step, call]``, on ``device``; nothing is advanced.
    """
    _check(sr, sign_modes, sign_sizes)
    keys = [0] * _N_KEYS
    for i, on in enumerate(sr):
        if on:  # rng.stream_key of nn.operand_seed(seed, layer, operand i, step, call)
            keys[KEY_STRIDE * i] = _i32(rng.stream_key(rng.stream_key(seed, layer, i, step, call)))
    signs = torch.ones(3, SIGNS_WIDTH, dtype=torch.float32)
    for g, (mode, size) in enumerate(zip(sign_modes, sign_sizes)):
        if mode != "none":
            signs[g, :size] = rotation_signs(size, mode, seed=seed, layer=layer, gemm=g, step=step)
    return torch.tensor(keys, dtype=torch.int32, device=device), signs.to(device)
