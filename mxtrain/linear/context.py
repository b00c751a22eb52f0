"""The per-call quantization context: which random inputs one call of an MX linear layer uses, and
how one GEMM operand is rotated, padded and quantized. The reference layer, the fast path, the
compiled op and the study diagnostics all import it from here, so each formula is written once.

Random inputs of a call (see ``docs/numerics.md``): GEMM ``g`` (fprop 0, dgrad 1, wgrad 2) of layer
``layer`` rotates with ``rotation_signs(size, mode, seed=recipe.seed, layer=layer, gemm=g, step=step)``;
a stochastically rounded operand ``k`` (its index in ``mxtrain.numerics.recipe.OPERANDS``) draws its uniforms
from the stream key ``rng.stream_key(operand_seed(recipe.seed, layer, k, step, call))``, where ``call``
counts the layer's forward calls that record gradients since its step last changed (micro-batches of one
step draw different bits; the backward pass of a call reuses its forward's). A call under ``no_grad`` or
``inference_mode`` draws the bits the next such call will draw and does not advance the count: evaluating
between steps leaves training's bits as they were, and reentrant activation checkpointing (Hugging Face's
default), whose first pass runs without gradients, recomputes with the bits that first pass drew.

A ``Ctx`` holds them in one of two forms with equal values:

* host integers (``Ctx(recipe, layer, step, call)``): the reference on CPU, the diagnostics and tests;
* device tensors (``Ctx.from_seeds``): what ``mxtrain.kernels.seeds.call_seeds`` wrote from a layer's
  ``[layer, step, call]`` state tensor without a host synchronisation, so that CUDA graphs and
  ``torch.compile`` replay each call with the current step and call.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.nn.functional as F

from ..numerics import rng
from .. import settings as _settings
from ..numerics.formats import get_format
from ..numerics.hadamard import hadamard, rotation_signs
from ..numerics.quant import MXTensor, quantize, reference_only
from ..numerics.operand import compute_dtype, fake_quantize_operand, pad_axis
from ..numerics.recipe import GEMMS, OPERANDS, Operand, Recipe, Rotation

__all__ = ["OPERAND_ID", "GEMM_ID", "operand_seed", "Ctx", "needs_seeds", "seed_spec", "compute_dtype",
           "pad_axis", "gemm_dtype", "bf16_exact", "fake_quantize_operand", "REF_COMPILE"]

OPERAND_ID = {n: i for i, n in enumerate(OPERANDS)}   # fprop_x 0, fprop_w 1, ... wgrad_x 5
GEMM_ID = {g: i for i, g in enumerate(GEMMS)}          # fprop 0, dgrad 1, wgrad 2


def operand_seed(seed: int, layer: int, operand: str, step: int, call: int) -> int:
    """Stochastic-rounding seed of one operand of one layer call: ``rng.stream_key(seed, layer, k,
    step, call)`` with ``k`` the operand's index in ``mxtrain.numerics.recipe.OPERANDS``. The quantizer's stream
    key is ``rng.stream_key`` of this (``mxtrain.numerics.quant.quantize(seed=...)``)."""
    return rng.stream_key(seed, layer, OPERAND_ID[operand], step, call)


def seed_spec(recipe: Recipe) -> tuple[tuple[bool, ...], tuple[str, ...], tuple[int, ...]]:
    """(stochastic rounding per operand, sign mode per GEMM, rotation size per GEMM)."""
    return recipe.memo("seed_spec", _seed_spec)


def _seed_spec(recipe: Recipe) -> tuple[tuple[bool, ...], tuple[str, ...], tuple[int, ...]]:
    sr = tuple(recipe.operand(n).quantized and recipe.operand(n).rounding == "stochastic" for n in OPERANDS)
    rots = [recipe.rotation(g) for g in GEMMS]
    modes = tuple(r.signs if r.enabled else "none" for r in rots)
    sizes = tuple(r.size if r.enabled else 0 for r in rots)
    return sr, modes, sizes


def needs_seeds(recipe: Recipe) -> bool:
    """Does a call of this recipe draw anything random (stochastic rounding or signed rotations)?"""
    return recipe.memo("needs_seeds", lambda r: any(seed_spec(r)[0]) or any(m != "none" for m in seed_spec(r)[1]))


def advances_calls(recipe: Recipe) -> bool:
    """Does the call counter matter (some operand is stochastically rounded)?"""
    return recipe.memo("advances_calls", lambda r: any(seed_spec(r)[0]))


def bf16_exact(op: Operand, rot: Rotation) -> bool:
    """Can the dequantized operand be cast to bf16 without rounding? (MX values have at most 4
    significant bits and a power-of-two scale; an unquantized operand only when it is not rotated.)"""
    if op.quantized:
        return get_format(op.fmt).kind == "mx"
    return not rot.enabled


def gemm_dtype(recipe: Recipe, a: str, b: str, gemm: str, amp: torch.dtype | None,
               default: torch.dtype = torch.float32) -> torch.dtype:
    """The GEMM's multiply dtype: ``amp`` (the autocast dtype, or None outside autocast) when both
    operands are exact in it, else ``default`` (float32, or float64 for gradcheck)."""
    if amp is not None:
        rot = recipe.rotation(gemm)
        if bf16_exact(recipe.operand(a), rot) and bf16_exact(recipe.operand(b), rot):
            return amp
    return default


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type``, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class Ctx:
    """The recipe and the random inputs of one layer call (see the module docstring)."""

    __slots__ = ("recipe", "layer", "step", "call", "keys", "sign_rows", "count")

    def __init__(self, recipe: Recipe, layer: int = 0, step: int = 0, call: int = 0):
        self.recipe, self.layer, self.step, self.call = recipe, int(layer), int(step), int(call)
        self.keys = self.sign_rows = None
        # add the fast path's inexact carrier blocks to mxtrain.linear.fast.inexact_blocks(): True, "existing" (only
        # into counters made earlier: inside the custom ops) or False
        self.count = True

    @classmethod
    def from_seeds(cls, recipe: Recipe, keys: torch.Tensor | None, signs: torch.Tensor | None) -> "Ctx":
        """A context whose keys and signs are ``call_seeds``' device tensors: ``keys`` int32 (24,) with
        operand ``k``'s stream key at ``4 k``, ``signs`` float32 (3, 128) with GEMM ``g``'s vector in row
        ``g``. Either may be None when the recipe draws no such thing."""
        c = cls.__new__(cls)
        c.recipe, c.keys, c.sign_rows = recipe, keys, signs
        c.layer = c.step = c.call = None
        c.count = True
        return c

    @property
    def on_device(self) -> bool:
        return self.layer is None

    def signs(self, gemm: str, device) -> torch.Tensor | None:
        """The sign vector of ``gemm``'s rotation (None without rotation or with mode ``none``)."""
        rot = self.recipe.rotation(gemm)
        if not rot.enabled or rot.signs == "none":
            return None
        if self.on_device:
            return self.sign_rows[GEMM_ID[gemm], : rot.size]
        return rotation_signs(rot.size, rot.signs, seed=self.recipe.seed, layer=self.layer,
                              gemm=GEMM_ID[gemm], step=self.step, device=device)

    def stream_key(self, name: str):
        """Operand ``name``'s stochastic-rounding stream key: an int, or for a device context an int64
        0-d tensor holding the same 32-bit value."""
        if self.on_device:
            return self.keys[4 * OPERAND_ID[name]].to(torch.int64) & rng.MASK32
        return rng.stream_key(operand_seed(self.recipe.seed, self.layer, name, self.step, self.call))

    def kernel_key(self, name: str) -> tuple[int, torch.Tensor | None]:
        """(scalar key, int32 key tensor or None) for the fused quantize kernels: a device context gives
        the kernel a pointer to the key (read at run time: CUDA graphs replay with the current key)."""
        if self.on_device:
            i = 4 * OPERAND_ID[name]
            return 0, self.keys[i: i + 1]
        return self.stream_key(name), None

    def rotate(self, t: torch.Tensor, axis: int, gemm: str, signs) -> torch.Tensor:
        """``t`` in float32 (float64 stays float64), rotated along ``axis`` by ``gemm``'s Hadamard
        blocks after zero-padding the axis to whole blocks (unchanged without rotation)."""
        rot = self.recipe.rotation(gemm)
        t = t.to(compute_dtype(t))
        if rot.enabled:
            t = hadamard(pad_axis(t, axis, rot.size), rot.size, axis=axis, signs=signs)
        return t

    def quantize(self, r: torch.Tensor, axis: int, name: str) -> MXTensor | None:
        """Quantize the rotated operand ``r`` as operand ``name`` (None if it is not quantized)."""
        op: Operand = self.recipe.operand(name)
        if not op.quantized:
            return None
        key = self.stream_key(name) if op.rounding == "stochastic" else None
        return quantize(r, op.fmt, axis=axis, block_size=op.block_size, rounding=op.rounding,
                        scale_rule=op.scale_rule, key=key, prescale=op.prescale)

    def operand(self, t: torch.Tensor, axis: int, name: str, gemm: str, signs,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, float]:
        """Rotate (padding the axis to whole rotation blocks) and fake-quantize one operand.

        Returns float32 values (float64 for a float64 ``t``; prescale not undone) and the operand's
        prescale. ``out_dtype``: the dtype the caller casts the values to next (its GEMM's); where the fused
        MX kernel makes them it writes that dtype itself (the same values as a cast of its float32 ones);
        other paths return float32 as before, so callers still cast. Runs ``fake_quantize_operand``, or its
        ``torch.compile``'d twin where the ``ref_compile`` setting says so (bit-identical:
        tests/linear/test_ref_compile.py), or for FP6/FP8 MX operands with nearest
        rounding the fused kernel where the ``mx_kernel`` setting says so (bit-identical:
        tests/kernels/test_mx_kernel.py).
        """
        gathered = getattr(t, "mx_gathered", None)   # a weight FSDP2 all-gathered quantized (mxtrain.linear.qgather)
        if gathered is not None:
            return gathered.operand(self, t, axis, name, gemm, signs)
        op: Operand = self.recipe.operand(name)
        if not op.quantized:
            return self.rotate(t, axis, gemm, signs), 1.0
        rot = self.recipe.rotation(gemm)
        key = self.stream_key(name) if op.rounding == "stochastic" else None
        spec = (axis, rot.size if rot.enabled else 0, op.fmt, op.block_size, op.rounding, op.scale_rule,
                op.prescale)
        mode = _settings.current().mx_kernel
        # (the fused kernel implements the formats and scale rules before the reference-only ones)
        if (op.rounding == "nearest" and not reference_only(op.fmt, op.scale_rule)
                and (mode == "always" or (mode == "auto" and t.is_cuda))):
            from ..kernels.mxelem import mx_operand  # startup; the fused MXFP8/MXFP6 kernel (mxtrain/kernels/mxelem.py)
            v = mx_operand(t, signs if rot.enabled else None, key, *spec, out_dtype=out_dtype)
            if v is not None:
                return v, op.prescale
        return REF_COMPILE.run(t, signs if rot.enabled else None, key, spec), op.prescale

    def operand_factored(self, t: torch.Tensor, axis: int, name: str, gemm: str, signs,
                         out_dtype: torch.dtype | None = None):
        """``operand``, with an NVFP4 operand's tensor scale taken out: ``(values, prescale, g)``, the values
        exact in bf16 and ``g`` a 0-d float32 tensor (None for other formats, whose values are as
        ``operand`` gives them). NVFP4 operands of 2-D tensors run through the fused Triton quantizer where the
        ``nvfp4_kernel`` setting says (``auto``: CUDA tensors; bit-identical: tests/kernels/test_nvfp4_kernel.py, and
        tests/kernels/test_nvfp4_rot_kernel.py for a 16-wide rotation, which runs inside the kernel), which writes the
        values in ``out_dtype`` (bf16/fp16: exact; the GEMM's operand dtype, so no cast pass follows) where given;
        the reference's values are float32 either way."""
        op: Operand = self.recipe.operand(name)
        if not (op.quantized and get_format(op.fmt).kind == "nvfp4"):
            return (*self.operand(t, axis, name, gemm, signs), None)
        gathered = getattr(t, "mx_gathered", None)
        if gathered is not None:
            return gathered.operand_factored(self, t, axis, name, gemm, signs)
        rot = self.recipe.rotation(gemm)
        key = self.stream_key(name) if op.rounding == "stochastic" else None
        spec = (axis, rot.size if rot.enabled else 0, op.fmt, op.block_size, op.rounding, op.scale_rule,
                op.prescale, True)
        mode = _settings.current().nvfp4_kernel
        if mode == "always" or (mode == "auto" and t.is_cuda):
            from ..kernels.nvfp4 import factored_operand, kernel_rule  # startup
            # (the kernel has NVFP4's standard block scale and ``four_over_six``, a rule ``reference_only`` names)
            if not reference_only(op.fmt, op.scale_rule) or kernel_rule(op.scale_rule):
                res = factored_operand(t, signs if rot.enabled else None, key, *spec[:-1], out_dtype=out_dtype)
                if res is not None:
                    return res[0], op.prescale, res[1]
        v, g = REF_COMPILE.run(t, signs if rot.enabled else None, key, spec)
        return v, op.prescale, g


# inductor settings that keep eager's float32 semantics on GPUs: IEEE division (not div.full), no FMA
# contraction, no flush of subnormals (names missing from this torch's config are left out)
_EAGER_NUMERICS = ("emulate_precision_casts", "eager_numerics.division_rounding", "eager_numerics.disable_ftz")


def _inductor_options() -> dict:
    from torch._inductor import config as ic
    out = {}
    for name in _EAGER_NUMERICS:
        obj = ic
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        out[name] = True
    return out


class RefCompileState:
    """The reference path's compiled twins of ``fake_quantize_operand`` (``ref_compile`` setting), one per
    operand spec (axis, rotation size, format, block, rounding, scale rule, prescale), each with its own code
    object so that dynamo's recompile limit counts shapes of one spec only; and the reason compiling failed,
    if it did (then the reference runs eagerly for the rest of the process). One instance: ``REF_COMPILE``;
    ``clear()`` forgets both, as a new process would.

    ``auto`` compiles CUDA tensors of every format with round-to-nearest (checked bit for bit against eager
    on an H100: ``test_cuda_layer_matches_eager``); stochastic rounding, float64 and CUDA graph capture run
    eagerly. (NVFP4 and per-tensor FP8 divide by constants, which inductor would turn into a multiply by
    the reciprocal on GPUs; ``quant._div_by_constant`` keeps them divisions.)"""

    __slots__ = ("compiled", "failed", "backend")

    def __init__(self):
        self.compiled: dict = {}
        self.failed: str | None = None
        self.backend = "inductor"   # tests may set "aot_eager" (then clear())

    def clear(self) -> None:
        self.compiled.clear()
        self.failed = None

    def wanted(self, t: torch.Tensor, fmt: str, rounding: str = "nearest") -> bool:
        """Does this operand run through the compiled twin? Never stochastic rounding on a GPU: its compiled
        form was not bit-identical to eager on an H100 (NVFP4, tests/linear/test_ref_compile.py), so it runs eagerly."""
        if self.failed is not None or t.dtype == torch.float64 or torch.compiler.is_compiling():
            return False
        if rounding == "stochastic" and t.device.type != "cpu":
            return False
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return False   # (a CUDA graph records the eager kernels: the same values, no compile inside capture)
        mode = _settings.current().ref_compile
        if mode == "on":
            return True
        return mode == "auto" and t.device.type == "cuda"

    def twin(self, spec: tuple):
        c = self.compiled.get(spec)
        if c is None:
            f = fake_quantize_operand
            code = f.__code__.replace(co_name=f"fake_quantize_operand_{len(self.compiled)}")
            fn = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
            opts = _inductor_options() if self.backend == "inductor" else None
            comp = torch.compile(fn, backend=self.backend, dynamic=False, fullgraph=True, options=opts)
            c = self.compiled[spec] = lambda t, signs, key: comp(t, signs, key, *spec)
        return c

    def run(self, t: torch.Tensor, signs, key, spec: tuple) -> torch.Tensor:
        if not self.wanted(t, spec[2], spec[4]):
            return fake_quantize_operand(t, signs, key, *spec)
        if isinstance(key, int):   # a tensor: one graph for every key
            key = torch.tensor(key, dtype=torch.int64, device=t.device)
        try:
            return self.twin(spec)(t, signs, key)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a missing compiler must not stop training
            self.failed = repr(e)
            warnings.warn(f"mxtrain: torch.compile of the reference quantizer failed ({type(e).__name__}: "
                          f"{str(e)[:200]}); running it eagerly (set MXTRAIN_REF_COMPILE=off to skip the attempt)",
                          RuntimeWarning, stacklevel=3)
            return fake_quantize_operand(t, signs, key, *spec)


REF_COMPILE = RefCompileState()
