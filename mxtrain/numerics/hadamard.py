"""Blockwise Hadamard rotations (reference implementation).

A rotation of block size ``n`` (16, 32, 64 or 128) multiplies every contiguous group of ``n``
elements along an axis by ``diag(s) H_n / sqrt(n)``, where ``H_n`` is the Sylvester Hadamard
matrix (``H_1 = [1]``, ``H_2k = [[H_k, H_k], [H_k, -H_k]]``) and ``s`` an optional +-1 sign
vector. The matrix is orthogonal, so rotating both operands of a GEMM along its reduction axis
leaves the exact product unchanged: ``(A R)(B R)^T = A B^T``.

Arithmetic is fixed so that the Triton kernels can reproduce it bit for bit: signs are applied
first (exact), then the fast Walsh-Hadamard transform in float32 with stages ``h = 1, 2, 4, ...,
n/2``, each replacing the pair ``(a, b) = (x[i], x[i + h])`` (for ``i`` with bit ``h`` clear) by
``(a + b, a - b)``, and finally one float32 multiply by ``float32(1 / sqrt(n))`` (exact for
n = 16 and 64). Float64 inputs are transformed in float64 the same way.

Sign modes used by recipes (see ``mxtrain.numerics.recipe.Rotation``):
  * ``none``: all +1 (the deterministic Hadamard of the AMD MXFP4 recipe, arXiv 2605.09825);
  * ``fixed``: one random vector for the whole run, shared by all layers (NVIDIA NVFP4 recipe);
  * ``per_layer``: one random vector per layer, fixed over training;
  * ``per_step``: re-drawn every optimizer step, per layer and GEMM (Tseng et al., arXiv 2502.20586).
"""

from __future__ import annotations

import math

import torch

from . import rng

__all__ = ["hadamard", "hadamard_matrix", "rotation_signs", "SIGN_MODES", "ROTATION_SIZES"]

ROTATION_SIZES = (16, 32, 64, 128)
SIGN_MODES = ("none", "fixed", "per_layer", "per_step")
# float(dtype(1 / sqrt(n))): the normalization, rounded once to the transform's dtype
_INV_SQRT = {(n, dt): float(torch.tensor(1.0 / math.sqrt(n), dtype=dt))
             for n in ROTATION_SIZES for dt in (torch.float32, torch.float64)}


def hadamard_matrix(n: int, dtype=torch.float64) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``H_n / sqrt(n)`` (for tests and docs)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)


def _check_size(size: int) -> None:
    if size not in ROTATION_SIZES:
        raise ValueError(
            f"Hadamard block size must be one of {ROTATION_SIZES}, got {size!r}"
        )


def hadamard(x: torch.Tensor, size: int, *, axis: int = -1, signs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x`` by normalized ``size x size`` Hadamard blocks along ``axis``.

    **Arguments:**
      * ``x``: any shape; the length along ``axis`` must be a multiple of ``size``.
      * ``size``: 16, 32, 64 or 128.
      * ``axis``: the axis whose consecutive groups of ``size`` elements are rotated.
      * ``signs``: optional +-1 vector of length ``size`` (the same for every block) or of the
        axis length (one entry per element), applied before the transform.

    **Returns:** a tensor of ``x``'s shape, float32 (float64 if ``x`` is float64).
    """
    _check_size(size)
    axis = axis % x.ndim if x.ndim else 0
    length = x.shape[axis]
    if length % size:
        raise ValueError(
            f"axis {axis} has length {length}, not a multiple of the Hadamard size {size}; "
            f"pad it with zeros to a multiple of {size} first"
        )
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(dt).movedim(axis, -1)
    if signs is not None:
        signs = signs.to(device=y.device, dtype=dt).reshape(-1)
        if signs.numel() == size:
            y = (y.reshape(*y.shape[:-1], length // size, size) * signs).reshape(y.shape)
        elif signs.numel() == length:
            y = y * signs
        else:
            raise ValueError(
                f"signs must have {size} (one block) or {length} (the axis) entries, got {signs.numel()}"
            )
    lead = y.shape[:-1]
    h = 1
    while h < size:
        # view each block of 2h as (2, h): first half a, second half b
        v = y.reshape(*lead, length // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, length)
        h *= 2
    # 1/sqrt(size) rounded once to dt, multiplied as a scalar (no host-to-device copy: a CUDA graph may
    # be capturing; a Python constant: no tensor read under torch.compile)
    y = y * _INV_SQRT[(size, dt)]
    return y.movedim(-1, axis)


def rotation_signs(size: int, mode: str, *, seed: int = 0, layer: int = 0, gemm: int = 0, step: int = 0,
                   device=None) -> torch.Tensor | None:
    """The sign vector a recipe's rotation uses; ``None`` for mode ``none``.

    ``fixed`` depends on the seed only, ``per_layer`` on (seed, layer), ``per_step`` on
    (seed, layer, gemm, step). Both operands of one GEMM are always given the same vector.
    """
    _check_size(size)
    if mode == "none":
        return None
    if mode == "fixed":
        key = rng.stream_key(seed, 0x5157)
    elif mode == "per_layer":
        key = rng.stream_key(seed, 0x1A7E, layer)
    elif mode == "per_step":
        key = rng.stream_key(seed, 0x57E9, layer, gemm, step)
    else:
        raise ValueError(f"unknown sign mode {mode!r}; valid modes: {', '.join(SIGN_MODES)}")
    return rng.random_signs(size, key, device=device)
