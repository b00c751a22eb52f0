"""The MX linear layer: ``mx_linear`` (``api``); the layer's three GEMMs written once (``skeleton``) over backends:
the reference it is defined by (``reference``) and the forms that run it fast (``fast``, ``tensorfp8``,
``tracedfp8``, ``compiledmx``); the dispatcher that chooses among them (``dispatch``), the custom ops
``torch.compile`` sees (``ops``) and the module ``convert`` puts in a model (``module``). docs/architecture.md maps
the package; its modules import one way, bottom to top: ``_constant``, ``context``, ``skeleton``, ``tensorfp8``,
``tracedfp8``, ``reference``, ``fast``, ``compiledmx``, ``experts``, ``dispatch``, ``ops``, ``api``, then ``moe``, ``module``,
``qgather`` (tests/test_layering.py).

``Y = X W^T + b`` runs three GEMMs, each quantizing both operands along that GEMM's reduction axis as
the ``Recipe`` says:

* Fprop  ``Y  = Q(X R_f) Q(W R_f)^T``           blocks along in-features,
* Dgrad  ``dX = Q(dY R_d) Q(R_d^T W)``          blocks along out-features,
* Wgrad  ``dW = Q(R_w^T dY)^T Q(R_w^T X)``      blocks along tokens,

where ``R`` is the GEMM's blockwise Hadamard rotation (identity when off) and ``Q`` quantize +
dequantize. Each operand is quantized from the high-precision tensor of this call, never from another
quantized copy or from an earlier call's. Each GEMM output is divided by the product of its operands'
prescales (Tseng et al.'s 16/9 for a 3/4 prescale on both).

On a CUDA GPU with FP8 tensor cores, a GEMM of two per-tensor FP8 operands (the ``fp8`` recipe) multiplies
the reference's FP8 codes with ``torch._scaled_mm`` (``mxtrain.linear.tensorfp8``); otherwise the reference
multiplies dequantized operands in float32, or in the autocast dtype when both operands
are exact in it (MX values have at most 4 significant bits and a power-of-two scale; the one exception
is a block whose scale is below about 2**-117, where FP6/FP8 subnormal elements fall under bf16's
smallest subnormal; MXFP4 is always exact), which changes only the accumulation order. Under autocast an
NVFP4 operand enters its GEMM without its float32 tensor scale (element x E4M3 block scale: exact in bf16),
the GEMM accumulates in float32 (bf16 tensor cores on GPUs), and the product is multiplied by the tensor
scales (``factors_nvfp4``): the NVFP4 values before any rounding, as block-scaled hardware multiplies them,
where ``MXTensor.dequantize`` rounds block scale x tensor scale to float32 first. Float64 inputs
(``gradcheck``) keep float64 for everything that is not quantized.

Routes (``route``): ``plain`` (the recipe quantizes nothing: ``F.linear``), ``fast`` (CUDA tensors and a
recipe ``mxtrain.linear.fast`` implements: fused Triton quantizers and MX GEMMs, bit-identical operands), else
``reference``. Eagerly, ``mx_linear`` calls an autograd function directly (no dispatcher overhead);
under ``torch.compile`` it calls the custom ops ``mxtrain::call_seeds`` (the call's random inputs from
the layer's state tensor; advances its call counter), ``mxtrain::linear`` and ``mxtrain::linear_backward``
(opaque to the compiler, with fake implementations and registered autograd), so a converted model
compiles to one graph with no guards on steps, calls or layer numbers. Both run the same functions. The
``fp8`` recipe is the exception under ``torch.compile`` on GPUs with FP8 tensor cores: traced operations the
compiler fuses and recomputes (``mxtrain.linear.tracedfp8``, setting ``fp8_traced``), the same codes and GEMMs.
"""

from .api import mx_linear
from .dispatch import COMPILED_FORMS, call_context, implementation, new_state, route

__all__ = ["mx_linear", "route", "call_context", "new_state", "implementation", "COMPILED_FORMS"]
