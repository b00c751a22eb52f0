"""mxtrain: pretraining with microscaling numbers (MXFP4/6/8, NVFP4), every GEMM operand configurable.

Public API (see README.md and docs/):
  quantize, fake_quantize, MXTensor      reference quantizers (mxtrain.numerics.quant)
  hadamard, rotation_signs               blockwise Hadamard rotations (mxtrain.numerics.hadamard)
  Recipe, Operand, Rotation, recipes     per-GEMM-operand recipes and named presets
  MXLinear, convert, set_step            the linear layer and the model converter (mxtrain.linear.module)
  mx_linear                              the MX linear as a function (eager or torch.compile; mxtrain.linear)
"""

from .numerics import recipes as recipes
from .numerics.formats import format_names as format_names
from .numerics.hadamard import hadamard as hadamard, rotation_signs as rotation_signs
from .linear import mx_linear as mx_linear
from .linear.module import ConvertReport as ConvertReport, MXLinear as MXLinear, checkpoint as checkpoint, convert as convert, \
    set_step as set_step
from .numerics.quant import MXTensor as MXTensor, fake_quantize as fake_quantize, quantize as quantize
from .numerics.recipe import Operand as Operand, Recipe as Recipe, Rotation as Rotation

__version__ = "0.1.0"
