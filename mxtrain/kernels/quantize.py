"""Compatibility module: the fused MXFP4 quantizer now lives in the package ``mxtrain.kernels.mxfp4`` (one
module per concept: ``ops``, ``carrier``, ``launch``, ``verify``, ``kernels``, ``device``; docs/kernels.md,
"File layout"). This module re-exports the names code outside it imported from here, so
``from mxtrain.kernels.quantize import quantize_mxfp4_2d`` and the like keep working.

Its attributes are aliases: rebinding one changes nothing inside the package. Kernels and policies are chosen
through ``mxtrain.settings`` (``qkernel``, ``dual``, ``fast_launch``, ``qselfcheck``, ...) and arguments
(``force_idx64``), as ``mxtrain.kernels.mxfp4`` describes.
"""

from __future__ import annotations

from .mxfp4 import (BLOCK_ROTS, CAPPED_KERNELS, DUAL_CONFIG, DUAL_SEQ, RULE_ID, TILE_K, QuantOut, carrier_from_fp4,
                    carrier_values, dequantize_fp4, dual_applies, kernel_for, quantize, quantize_mxfp4_2d,
                    quantize_mxfp4_dual, quantize_mxfp4_op, quantize_op, selfcheck, supported)
# earlier private names that other modules imported from here
from .mxfp4.carrier import carrier_buffers as _carrier_buffers  # noqa: F401
from .mxfp4.carrier import ceil_to as _ceil  # noqa: F401
from .mxfp4.carrier import out_shapes as _out_shapes  # noqa: F401
from .mxfp4.carrier import reference_quantize as _reference  # noqa: F401
from .mxfp4.launch import i32 as _i32  # noqa: F401

try:
    from .mxfp4.device import _e4m3_bits, _mix32  # noqa: F401
    from .mxfp4.kernels import _mxfp4_dual_kernel, _mxfp4_kernel  # noqa: F401
except ImportError:  # pragma: no cover - without Triton
    pass

__all__ = ["BLOCK_ROTS", "CAPPED_KERNELS", "DUAL_CONFIG", "DUAL_SEQ", "RULE_ID", "TILE_K", "QuantOut",
           "carrier_from_fp4", "carrier_values", "dequantize_fp4", "dual_applies", "kernel_for", "quantize",
           "quantize_mxfp4_2d", "quantize_mxfp4_dual", "quantize_mxfp4_op", "quantize_op", "selfcheck", "supported"]
