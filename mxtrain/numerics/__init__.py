"""The numerics: the specification every kernel and layer is checked against. Element and block formats
(``formats``), counter-based random numbers (``rng``), the reference quantizers (``quant``), blockwise Hadamard
rotations (``hadamard``), the six GEMM operands of a linear layer and their recipes (``recipe``, ``recipes``)
and the reference operand of one GEMM (``operand``). They import torch and layer 0 (``settings``, ``errors``)
only (tests/test_layering.py); docs/numerics.md states the rules."""
