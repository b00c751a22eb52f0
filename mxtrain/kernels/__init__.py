"""Fast kernels: fused Triton quantizers and capability-dispatched MX GEMMs.

Capability flags (evaluated lazily, cheap):

* ``HAS_TRITON``: Triton imports (GPU, or CPU through ``TRITON_INTERPRET=1``).
* ``backend(device)``: which GEMM path a device gets:
  ``"fp8_carrier"`` (sm_90: MXFP4 values carried exactly in FP8 e4m3, blockwise ``torch._scaled_mm``),
  ``"native_mx"`` (NVIDIA sm_100+ and AMD gfx950: MX-scaled GEMM, never run on such a GPU here), or
  ``"dequant"`` (everything else: dequantize the MX operands and multiply).

The plain-PyTorch reference quantizer (``mxtrain.numerics.quant``) is the specification: the kernels in
``mxtrain.kernels.mxfp4`` produce bit-identical codes and scales (see ``tests/kernels/test_kernels.py``).
What the kernels remember within a process (device facts, probes, self-checks, launch plans) is in one
object, ``CACHES`` (``mxtrain.kernels.caches``). See ``docs/kernels.md``.
"""

from __future__ import annotations

import os

import torch

from .. import settings as _settings
from .caches import CACHES, KernelCaches

try:  # Triton is optional: without it every path falls back to the reference implementation
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

__all__ = ["HAS_TRITON", "INTERPRET", "backend", "kernels_available", "capability", "CACHES", "KernelCaches"]


def capability(device) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    caps = CACHES.capability
    if idx not in caps:
        caps[idx] = torch.cuda.get_device_capability(idx)
    return caps[idx]


def kernels_available(device) -> bool:
    """Can the Triton quantize kernels run for tensors on ``device``?"""
    if not HAS_TRITON:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET


def backend(device) -> str:
    """The GEMM path for ``device``: ``fp8_carrier``, ``native_mx`` or ``dequant``.

    The ``gemm_backend`` setting (``MXTRAIN_GEMM_BACKEND``) overrides the choice (e.g. ``dequant`` to debug
    on a GPU). A ``torch.device`` with an index (a tensor's) is looked up once (``CACHES.backends``): this
    runs several times in every call of an MX layer.
    """
    forced = _settings.current().gemm_backend
    if forced != "auto":
        return forced
    if type(device) is torch.device and device.index is not None:
        b = CACHES.backends.get(device)
        if b is None:
            b = CACHES.backends[device] = _backend(device)
        return b
    return _backend(device)


def _backend(device) -> str:
    cap = capability(device)
    if cap is None:
        return "dequant"
    if torch.version.hip:
        # ROCm reports gfx90a as (9, 0) and gfx950 as (9, 5): only MX-native AMD GPUs (gfx950) get the
        # packed-FP4 path (its probe still falls back to dequantize if no MX GEMM there is exact)
        return "native_mx" if _native(device) else "dequant"
    if cap == (9, 0):
        return "fp8_carrier"
    if cap[0] >= 10:
        return "native_mx"
    return "dequant"


def _native(device) -> bool:
    """``mxdot.supports_native(device)``, looked up once per device."""
    d = torch.device(device)
    k = d.index if d.index is not None else torch.cuda.current_device()
    native = CACHES.native
    if k not in native:
        from .mxdot import supports_native  # startup
        native[k] = supports_native(torch.device("cuda", k))
    return native[k]
