"""Fused MXFP4 quantizer (Triton), the fast path's quantize step, bit-identical to ``mxtrain.numerics.quant.quantize``; also
the uniform 4-bit grid ``mxint4`` (``fmt="mxint4"``, the kernels' ``GRID`` constexpr: ``launch.GRID_ID``).

The public surface (what ``mxtrain.linear.fast``, the GEMMs, benchmarks and tests use); one module per concept:

* ``ops``: ``quantize_mxfp4_2d``, ``quantize_mxfp4_dual``, the drop-in ``quantize`` and the custom op
  ``mxtrain::quantize_mxfp4`` (``quantize_mxfp4_op``, ``quantize_op``);
* ``carrier``: ``QuantOut``, the FP8 carrier's definition (``carrier_from_fp4``), output shapes and buffers,
  ``carrier_values``, ``dequantize_fp4`` and the reference quantizer with rotation;
* ``launch``: the launch table (``kernel_for``, ``block_config``, register caps, folded normalization, the
  one-pass policy ``dual_applies``), the kernels' argument tuples, launch plans and ``record_launches``;
* ``verify``: the once-per-variant self-check and its fallback (``selfcheck``);
* ``kernels``: the two Triton kernels (single-pass, in three layouts: tile, blocks, cols; and dual); ``device``:
  their shared device functions.

Tests and benchmarks choose kernels and policies through ``mxtrain.settings`` (``qkernel``, ``qmaxnreg``,
``dual``, ``fast_launch``, ``qselfcheck``) and through arguments (``force_idx64``, ``block_rows``,
``num_warps``), not by changing module attributes.
"""

from .carrier import TILE_K, QuantOut, carrier_from_fp4, carrier_values, dequantize_fp4
from .launch import (BLOCK_ROTS, CAPPED_KERNELS, DUAL_CONFIG, DUAL_SEQ, RULE_ID, Launch, dual_applies, kernel_for,
                     record_launches)
from .ops import (quantize, quantize_mxfp4_2d, quantize_mxfp4_dual, quantize_mxfp4_group, quantize_mxfp4_op,
                  quantize_op, supported)
from .verify import selfcheck

__all__ = ["TILE_K", "QuantOut", "carrier_from_fp4", "carrier_values", "dequantize_fp4", "BLOCK_ROTS",
           "CAPPED_KERNELS", "DUAL_CONFIG", "DUAL_SEQ", "RULE_ID", "Launch", "dual_applies", "kernel_for",
           "record_launches", "quantize", "quantize_mxfp4_2d", "quantize_mxfp4_dual", "quantize_mxfp4_group",
           "quantize_mxfp4_op", "quantize_op", "supported", "selfcheck"]
