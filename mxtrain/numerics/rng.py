"""Counter-based random numbers shared by the reference quantizer and the GPU kernels.

Stochastic rounding and random Hadamard signs must be reproducible and identical on every
device and in every implementation (plain PyTorch here, Triton in ``mxtrain.kernels``). Both
derive their random bits from a stateless 32-bit integer hash of (key, element index), so the
bits depend only on the seed and on the element's position, never on launch order or device.

The mixing function is the "lowbias32" integer hash published by Chris Wellons
(https://nullprogram.com/blog/2018/07/31/): xorshift-multiply rounds with constants 0x7feb352d
and 0x846ca68b. It maps 0 to 0 and is a bijection on 32-bit integers.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (host side: seeds and keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    x ^= x >> 16
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for int64 tensors holding values < 2**32, without int64 overflow:
    # split c into 16-bit halves so every partial product stays below 2**49.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL2)
    x = x ^ (x >> 16)
    return x


def stream_key(*parts: int) -> int:
    """Fold integers (seed, layer, GEMM, step, ...) into one 32-bit key."""
    k = 0
    for p in parts:
        k = mix32_int(k ^ mix32_int(int(p) & MASK32) ^ ((int(p) >> 32) & MASK32))
    return k


def uniform(index: torch.Tensor, key: int) -> torch.Tensor:
    """Uniform float32 in [0, 1) with 24 random bits, one per element index.

    ``index`` is an int64 tensor of linear element indices. For indices below 2**32 the bits are
    ``mix32(index ^ key) >> 8``; higher indices fold their upper word in through a second mix.
    """
    lo = index & MASK32
    hi = index >> 32
    h = mix32(lo ^ (key & MASK32) ^ mix32(hi))
    return (h >> 8).to(torch.float32) * (2.0**-24)


def random_signs(n: int, key: int, device=None) -> torch.Tensor:
    """A +-1 float32 vector of length ``n`` from the key (bit 0 of the hash of each index)."""
    idx = torch.arange(n, dtype=torch.int64, device=device)
    bits = mix32(idx ^ (key & MASK32)) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


def stream_key_t(*parts) -> torch.Tensor:
    """``stream_key`` element-wise: each part an int64 tensor (values in [0, 2**63)) or an int; the
    parts broadcast. Equals ``stream_key`` on every element (tests/numerics/test_quant.py)."""
    k = None
    for p in parts:
        p = torch.as_tensor(p, dtype=torch.int64)
        t = mix32(p & MASK32) ^ ((p >> 32) & MASK32)
        k = mix32(t if k is None else (k ^ t))
    return k if k is not None else torch.zeros((), dtype=torch.int64)
