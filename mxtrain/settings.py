"""Process settings: every ``MXTRAIN_*`` environment variable, typed, in one frozen object.

``Settings`` has one field per setting, each with its type, default, environment variable and a line of
documentation (``docs/settings.md`` is generated from it: ``markdown_table()``). The library reads them
through ``current()`` at use time, never at import, so ``override`` works without reloading modules::

    from mxtrain import settings
    settings.current().gemm_backend          # "auto", or what MXTRAIN_GEMM_BACKEND says
    with settings.override(dual="off", qkernel="tile"):
        ...                                  # code and tests choose kernels and policies this way
    settings.current().to_dict()             # what a run folder records

Layers, highest first: ``override`` blocks (a process-wide stack: an override made in one thread is seen
by all), ``configure`` (process-wide values set from code, e.g. a command-line flag), the environment
(read once, on the first ``current()``; ``reset()`` reads it again), the defaults. ``current()`` returns
a cached object: reading a field costs an attribute lookup, nothing is parsed per call. The two folders
(``data_dir``, ``cache_dir``) are read rarely and pointed elsewhere while a process runs (tests, tools):
their users call ``fresh()``, which reads the environment at that moment.

``mxtrain.linear.fast`` calls ``current()`` when it is imported, so that a model compiled before any eager call
never reads the environment inside a ``torch.compile`` trace. ``MXTRAIN_STUDY_PARENT``,
``MXTRAIN_STUDY_START_BY`` and ``MXTRAIN_STUDY_ONLY_SEEDS`` are not settings: ``mxtrain study`` sets them for its
worker processes (internal plumbing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass, field

from .errors import UserError

__all__ = ["Settings", "SettingsError", "current", "fresh", "override", "configure", "reset", "markdown_table",
           "NUMERICS"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(UserError, ValueError):
    """A setting with a value it cannot take (names the variable or field, the value and what is allowed)."""


# wgrad_x=auto keeps X's Wgrad operand as its FP8 carrier (1.03 bytes a value instead of 0.53) in layers of at most
# this many input features: at the 125M model's widths the rebuild from codes ran at 0.46-0.96 TB/s and keeping the
# carrier made the step 4 % faster (H200, BENCHMARKS.md); at 8B widths memory is the scarcer resource
WGRAD_X_CARRIER_MAX = 2048


# environment variables of settings that no longer exist: setting one is refused, not silently ignored
_REMOVED = {"MXTRAIN_MX_TRACED": "MXFP4 layers under torch.compile now run compiled into the graph "
                                 "(setting mx_compiled; the traced form was slower and held more memory, "
                                 "BENCHMARKS.md)"}


def _knob(default, env: str, doc: str, kind: str, choices: tuple = (), aliases: dict | None = None,
          minimum: int | None = None, numerics: bool = False):
    """A ``Settings`` field: ``kind`` is "bool", "int", "choice" or "path" (a folder, or None for the
    default place); ``numerics``: changing it can change a run's numbers (recorded in each run folder)."""
    return field(default=default, metadata=dict(env=env, doc=doc, kind=kind, choices=tuple(choices),
                                                aliases=dict(aliases or {}), minimum=minimum, numerics=numerics))


_ON_OFF = {**{k: "on" for k in _TRUE}, **{k: "off" for k in _FALSE}}
_AUTO_OFF = {**{k: "auto" for k in _TRUE}, **{k: "off" for k in _FALSE}}


@dataclass(frozen=True)
class Settings:
    """Every setting of mxtrain (``docs/settings.md``). Construct through ``from_env`` or ``replace``
    (both validate); the library reads ``current()``."""

    fast: bool = _knob(
        True, "MXTRAIN_FAST", "The fast path (fused Triton quantizers, MX GEMMs) for CUDA tensors; off: every "
        "`MXLinear` runs the reference path (the same MX values; other accumulation order and rounding).",
        "bool", numerics=True)
    gemm_backend: str = _knob(
        "auto", "MXTRAIN_GEMM_BACKEND", "GEMM path of the fast path; `auto` picks by GPU (sm_90: `fp8_carrier`, "
        "sm_100+: `native_mx`, else `dequant`); `dot_scaled`: Triton `tl.dot_scaled` on any GPU.",
        "choice", choices=("auto", "fp8_carrier", "native_mx", "dot_scaled", "dequant"), numerics=True)
    wgrad_b_group: int = _knob(
        128, "MXTRAIN_WGRAD_B_GROUP", "FP8-carrier group rows of Wgrad's X (GEMM operand B): 128 (128x128 "
        "groups, faster) or 1 (1x128 groups, exact in more cases); a GPU that cannot run 128x128 gets 1.",
        "int", choices=(1, 128), numerics=True)
    carrier_k: int = _knob(
        512, "MXTRAIN_CARRIER_K", "FP8-carrier backend: the multiple of 128 each carrier's reduction length is padded "
        "to with zeros (the GEMM reads the padding). 512 is the safe choice: cuBLAS's blockwise FP8 GEMM gave wrong "
        "results with K/128 = 9, and torch 2.11 refuses its 128x128 weight scale groups unless K/128 is a multiple "
        "of 4 (docs/kernels.md). 256 or 128 pad less (at K = 768, 1,024 becomes 768: a quarter of the GEMM's work), "
        "only where `python tools/carrier_k_probe.py` finds every tested K exact on your GPU, torch and CUDA. The "
        "same MX values either way; the GEMM's float32 sums may be ordered differently.",
        "int", choices=(128, 256, 512), numerics=True)
    exact_carrier: bool = _knob(
        False, "MXTRAIN_EXACT_CARRIER", "FP8-carrier backend: every GEMM checks whether its operands hold MXFP4 "
        "blocks the carrier cannot represent (more than 14 binades under their group's largest) and if so runs "
        "as the exact `dequant` GEMM instead (bf16 tensor cores). Costs codes written beside each carrier, no "
        "one-pass quantize, one device sync per GEMM; not inside CUDA graphs. Set it before compiling a model.",
        "bool", numerics=True)
    dual: str = _knob(
        "auto", "MXTRAIN_QDUAL", "Both operands of an activation from one read (`quantize_mxfp4_dual`): `auto` "
        "wherever the kernels apply except stochastic rounding on tensors of more than 2**22 elements, `on` "
        "wherever the kernels apply, `off` never. Same bytes either way.", "choice", choices=("auto", "on", "off"),
        aliases=_ON_OFF)
    reuse_act: bool = _knob(
        True, "MXTRAIN_REUSE_ACT", "Layers reading one input (q/k/v, gate/up) quantize its operands once "
        "(eager only). Same results either way.", "bool")
    experts_grouped: str = _knob(
        "auto", "MXTRAIN_EXPERTS_GROUPED", "Mixture-of-Experts experts (`MXExperts`), eagerly: the grouped path "
        "(`mxtrain/linear/experts.py`: each operand of all experts from one quantize launch over the tokens sorted by "
        "expert, then one FP8-carrier GEMM per expert) instead of one `mx_linear` call per expert GEMM, for recipes "
        "whose GEMMs are all MX with round-to-nearest and no random signs (`mxfp4-all`, `mxfp4-all-dh16`...; "
        "stochastic rounding and random signs keep the loop): `auto` where the layers run the fast path on the "
        "`fp8_carrier` backend (Hopper), `on` wherever the fused kernels can run the tensors with that backend (on "
        "CPU too, under Triton's interpreter with `gemm_backend=fp8_carrier`: tests), `off` never. The loop's "
        "values bit for bit (CPU tests; a cuda test at E=8, H=1024, I=512). Not under `torch.compile`.",
        "choice", choices=("auto", "on", "off"), aliases=_ON_OFF)
    wgrad_x: str = _knob(
        "auto", "MXTRAIN_WGRAD_X", "Where X's Wgrad operand is quantized on the fast path (and the `fp8` "
        "recipe's FP8 GEMMs): `auto` (`carrier` for layers of at most 2,048 input features, where rebuilding the "
        "carrier costs the most and the memory the least: about 4 % of a 125M model's step, BENCHMARKS.md; "
        "`forward` for wider layers), `forward` (with its Fprop operand; the backward keeps packed FP4 codes + scales, "
        "0.53 bytes a value, or FP8 codes), `carrier` (as `forward`, but an MXFP4 operand is kept as the GEMM's "
        "FP8 carrier, about 1.03 bytes a value, so the backward skips rebuilding it; where the layer runs eagerly on "
        "the fast path or compiled into the graph, `mx_compiled`; the custom ops keep codes), `backward` (the "
        "backward keeps X itself and quantizes it there: faster, more memory unless the compiler recomputes X, e.g. "
        "under `train.memory_budget`; figures in BENCHMARKS.md). Same values every way.",
        "choice", choices=("auto", "forward", "carrier", "backward"))
    wgrad_x_recompute: bool = _knob(
        False, "MXTRAIN_WGRAD_X_RECOMPUTE", "With `wgrad_x` at `backward` (X kept and quantized in the backward), in a "
        "layer compiled into the graph (`mx_compiled`): X is not kept but recomputed in the backward where the forward "
        "makes it from elementwise operations (a norm's output, a SwiGLU product), as the compiler does for torchao's "
        "float8 casts (`compiledmx.recompute_wgrad_inputs`). Counted on fake tensors (`tools/saved_bytes.py`): a "
        "Llama-8B-shaped block then saves what torchao's float8 saves (464.0 MiB at 4,096 tokens, against 503.3 with "
        "`forward`); on an H200 (4 such blocks, 16,384 tokens a step) the step's peak was 0.34 GiB higher with it "
        "(35.64 against 35.30 GiB) and the step 3.6 % slower (BENCHMARKS.md): off by default, kept for study. Same "
        "values either way.", "bool")
    w_group: str = _knob(
        "off", "MXTRAIN_W_GROUP", "How a weight's single quantize passes run in an MX layer compiled into the graph "
        "(`mx_compiled`): `off` (one launch each), `on` (up to 4 consecutive ones of one kernel variant, along K in "
        "the forward or along N in the backward, in one launch of `_mxfp4_group_kernel`: a pass over the joint graph, "
        "which places the group at its first pass, so the later weights' operands are made a few layers early). Same "
        "bytes and inexact counts either way. A weight's pass is a small grid (a 768 x 768 weight: 36 programs of 128 "
        "x 128) that leaves most of a GPU idle; the 96 weight passes of a 125M-class step took 0.82 ms (BENCHMARKS.md). "
        "On an H200 a group launch ran a block's four weights in 0.56-0.82x of four launches' time, but the 125M-class "
        "step moved by 0.1 ms of 41 (one round, within its noise): off by default.",
        "choice", choices=("off", "on"), aliases=_ON_OFF)
    w_dual: str = _knob(
        "off", "MXTRAIN_W_DUAL", "Where a weight's Dgrad operand is quantized in an MX layer compiled into the graph "
        "(`mx_compiled`): `off` (in the backward, from the weight, one pass of its own), `on` (with its Fprop "
        "operand, from one read of the weight in the forward: one launch a layer fewer, and its FP8 carrier, about "
        "1.03 bytes a weight element, kept for the backward). Same values either way (CPU tests under Triton's "
        "interpreter); its inexact carrier blocks are then counted with the forward's. Off by default: on an H200 "
        "it ran a 95M HF model's step of 8,192 tokens 3 % faster and gained nothing at 16,384 tokens a step (125M and "
        "8B shapes), where its memory costs (BENCHMARKS.md).",
        "choice", choices=("off", "on"), aliases=_ON_OFF)
    fast_launch: str = _knob(
        "auto", "MXTRAIN_FAST_LAUNCH", "Launch plans: a quantize configuration seen before is launched through its "
        "compiled kernel directly (less host time): `auto` on GPUs, `always` also under Triton's interpreter "
        "(tests), `off` never. Same results either way.", "choice", choices=("auto", "always", "off"),
        aliases=_AUTO_OFF)
    qkernel: str = _knob(
        "auto", "MXTRAIN_QKERNEL", "Quantize kernel: `auto` (`kernel_for` picks by layout), or `blocks`, `cols`, "
        "`tile` forced where it applies (rotations wider than 32 always run `tile`). Same bytes from each.",
        "choice", choices=("auto", "blocks", "cols", "tile"))
    qblocks: str = _knob(
        "auto", "MXTRAIN_QBLOCKS", "How the `blocks` quantize kernel (operands quantized along rows: Fprop's and "
        "Dgrad's, and the one-read dual pass's first side) holds its tile of rows x 4 MX blocks: `rows` (a row's 4 "
        "blocks in 4 warps, its 1x128 carrier-group maximum exchanged through shared memory; each block's carrier "
        "bytes stored as one 32-byte run), `rows16` (the same, stored as two 16-byte runs: no layout exchange before "
        "the store), `lanes` (a row's 4 blocks in 4 neighbouring lanes of one warp, the group maximum two shuffles; "
        "16-byte stores), `auto` (`lanes`, except `rows` for a pass in 128x128 groups with random signs: a weight of "
        "the `-rht16` and `ufp4` recipes, which spills more registers in the other two). Same bytes from each (CPU "
        "tests under Triton's interpreter). On an H200 `lanes` ran the dual pass in 6-23 % less time than `rows` at "
        "768 to 4,096 features, and took 0.20 ms (9 %) off the dual passes of a 125M-class step (BENCHMARKS.md).",
        "choice", choices=("auto", "rows", "rows16", "lanes"))
    qcols: str = _knob(
        "auto", "MXTRAIN_QCOLS", "How the `cols` quantize kernel (operands quantized along columns: the Wgrad "
        "operands, and the one-read dual pass's second side) spreads its tile over threads: each of its 32 loads "
        "of 4 x block-rows values gives a thread 2 of them (`pairs`) or 1 (`singles`: twice the threads, or half "
        "the rows, a tile); `auto` is `pairs`. Same bytes either way (CPU tests under Triton's interpreter). "
        "Compiled for sm_90 without a register cap, as `torch.compile` compiles the MX layer's kernels, `singles` "
        "takes the dual pass of a gradient from 127 registers to 48, which lets 2.5x the warps run on an SM; "
        "on an H200 it was not faster (the dual pass of an activation 10-12 % slower than `pairs` with the eager "
        "register cap, of a gradient 1-2 %; BENCHMARKS.md), so `auto` stays `pairs`.",
        "choice", choices=("auto", "pairs", "singles"))
    qmaxnreg: int = _knob(
        80, "MXTRAIN_QMAXNREG", "Register cap (Triton `maxnreg`) of the cols, dual and 128x128-group blocks "
        "kernels on NVIDIA GPUs (stochastic rounding runs uncapped); 0: no cap. Same bytes either way.",
        "int", minimum=0)
    qselfcheck: str = _knob(
        "auto", "MXTRAIN_QSELFCHECK", "Self-check of each quantize kernel variant on its first run, against the "
        "reference quantizer (a variant that fails is replaced by an exact torch fallback): `auto` on GPUs, `always` "
        "on every device (Triton's interpreter too: tests), `off` never (the kernels' output without the safety net).",
        "choice", choices=("auto", "always", "off"), aliases=_AUTO_OFF)
    glue: str = _knob(
        "auto", "MXTRAIN_GLUE", "The model's elementwise layers (RMSNorm, RoPE, SwiGLU): `auto` compiled with "
        "`torch.compile` on CUDA, `compiled` on every device, `eager` never (float32 intermediate rounding "
        "may differ). Read by mxtrain's trainer and commands, which pass it to the model they build; a `Llama` "
        "built in your own code takes `glue=` instead (default `auto`).", "choice",
        choices=("auto", "compiled", "eager"), numerics=True)
    ref_compile: str = _knob(
        "off", "MXTRAIN_REF_COMPILE", "Reference path (recipes the fast path does not run: NVFP4, MXFP8, FP6, "
        "FP8): each operand's rotation + quantize + dequantize through `torch.compile` (fused kernels): `auto` on "
        "CUDA tensors with round-to-nearest (stochastic rounding and CUDA graph capture stay eager), `on` also on "
        "CPU and for stochastic rounding on CPU (tests), `off` (default: the GPU test suite has not yet completed "
        "with `auto`) never. Bit-identical to eager (tests/linear/test_ref_compile.py, CPU and H100), faster "
        "(BENCHMARKS.md); a compile that fails warns and runs eagerly.",
        "choice", choices=("auto", "on", "off"),
        aliases={**{k: "auto" for k in _TRUE if k != "on"}, **{k: "off" for k in _FALSE}})
    nvfp4_kernel: str = _knob(
        "auto", "MXTRAIN_NVFP4_KERNEL", "NVFP4 operands of the reference path's factored GEMMs (the `nvfp4` recipe "
        "under autocast): quantized by the fused two-pass Triton kernel (`mxtrain/kernels/nvfp4.py`; a 16-wide "
        "Hadamard rotation runs inside both passes, other rotations in torch before them), instead of the "
        "plain-PyTorch quantizer: `auto` on CUDA tensors, `always` also on CPU "
        "under Triton's interpreter (tests), `off` never. Bit-identical either way (each kernel variant checks "
        "itself against the reference on first use: `qselfcheck`).",
        "choice", choices=("auto", "always", "off"), aliases=_AUTO_OFF)
    mx_kernel: str = _knob(
        "auto", "MXTRAIN_MX_KERNEL", "MXFP8/MXFP6 operands of the reference path (the `mxfp8` recipe and custom "
        "recipes with FP6/FP8 MX elements, round-to-nearest): fake-quantized by one fused Triton kernel "
        "(`mxtrain/kernels/mxelem.py`) after the rotation in torch, instead of the plain-PyTorch quantizer; the "
        "same kernel gives weight de-oscillation (`deosc`) its weights' MX grid, MXFP4 included: `auto` "
        "on CUDA tensors, `always` also on CPU under Triton's interpreter (tests), `off` never. Bit-identical either "
        "way (each kernel variant checks itself against the reference on first use: `qselfcheck`).",
        "choice", choices=("auto", "always", "off"), aliases=_AUTO_OFF)
    fp8_traced: str = _knob(
        "auto", "MXTRAIN_FP8_TRACED", "Under `torch.compile`, the `fp8` recipe's layers (every operand per-tensor "
        "FP8, round-to-nearest) as traced operations around `torch._scaled_mm` (`mxtrain/linear/tracedfp8.py`), which the "
        "compiler fuses with the kernels around them and recomputes in the backward as it does torchao's float8: "
        "`auto` on GPUs with FP8 tensor cores, `off`: the custom op (Triton casts, X's codes kept). Same values "
        "either way.", "choice", choices=("auto", "off"), aliases=_AUTO_OFF)
    fp8_fast_accum: str = _knob(
        "off", "MXTRAIN_FP8_FAST_ACCUM", "Accumulation of the GEMMs that run on FP8 tensor cores with per-tensor "
        "scales (the `fp8` recipe's): `off`: float32 accumulation in all three GEMMs; `fprop`: the forward GEMM "
        "in the tensor cores' fast mode (`torch._scaled_mm(use_fast_accum=True)`: partial sums kept in fewer "
        "bits on Hopper), as TransformerEngine and torchao's float8 run it by default, faster; Dgrad and Wgrad "
        "stay float32. Where no FP8 tensor core runs the GEMM (CPU, older GPUs) the product is float32 either "
        "way.", "choice", choices=("off", "fprop"), numerics=True)
    fp8_autocast: str = _knob(
        "float32", "MXTRAIN_FP8_AUTOCAST", "Under autocast, the layers of the `fp8` recipe (and of any recipe "
        "whose operands are all per-tensor FP8 with round-to-nearest, no prescale or rotation: those `fp8_traced` "
        "takes): `float32`: the input quantized as given (float32 where a float32 norm feeds the layer) and float32 "
        "gradients written to float32 tensors (the input, the master weight); `autocast`: as `nn.Linear`, "
        "torchao's float8 and TransformerEngine do, the input cast to the autocast dtype before its FP8 cast, "
        "dX and dW written by their GEMMs in the autocast dtype (autograd widens them to float32): fewer bytes, "
        "gradients rounded to bf16. With `fp8_fast_accum=fprop` the layers compute what torchao's float8 "
        "tensorwise layers do.", "choice", choices=("float32", "autocast"), numerics=True)
    mx_compiled: str = _knob(
        "auto", "MXTRAIN_MX_COMPILED", "Under `torch.compile`, the layers of MXFP4 recipes whose GEMMs all use "
        "round-to-nearest, prescale 1 and no or a deterministic Hadamard rotation (`mxfp4-all`, `mxfp4-all-dh16`, "
        "`mxfp4-fprop`...): `auto`: compiled into the graph (`mxtrain/linear/compiledmx.py`: the quantize kernels as "
        "`triton_op`s and the carrier GEMM traced, every decision made when the graph is traced, so a layer "
        "costs the host what inductor's generated code spends on it) on GPUs with FP8 tensor cores, and layers "
        "that read one input (separate q/k/v, gate/up) quantize it once (`compiledmx.share_inputs`, a pass over "
        "the captured graph) and rebuild its Wgrad carrier once (`share_carriers`), so a shared input's inexact "
        "carrier blocks are counted once, not once per layer; `separate`: compiled into the graph, each layer "
        "quantizing its own input (`auto`'s values bit for bit, a cuda test; 5-6 % slower on a Hugging Face Llama "
        "whose step the GPU bounds, BENCHMARKS.md); `ops`: the opaque custom ops, which decide in Python at every "
        "call (the same values as `separate` and its inexact-block counts). `shared` is another name for `auto` "
        "(the sharing was its own choice before it became the default).", "choice",
        choices=("auto", "separate", "ops"), aliases={"shared": "auto"})
    mx_compiled_seeded: bool = _knob(
        True, "MXTRAIN_MX_COMPILED_SEEDED", "With `mx_compiled` `auto` or `separate`, also compile into the graph "
        "the layers of MXFP4 recipes with stochastic rounding, random Hadamard signs or prescales (`tseng`, "
        "`mxfp4-all-sr`, `mxfp4-all-rht16`...), their keys and signs read from device memory: the eager fast "
        "path's bits, layer by layer and step after step (cuda tests, bit for bit, in both compile modes). Off: "
        "they run as the custom ops (an escape hatch; same values).", "bool")
    mx_compiled_grids: bool = _knob(
        True, "MXTRAIN_MX_COMPILED_GRIDS", "With `mx_compiled` `auto` or `separate`, also compile into the graph the "
        "layers whose MX operands use the uniform 4-bit grids (`mxint4`, `mxe1m2`: `ufp4`...) or the `adaptive` "
        "scale rule (`mxfp4-all-adaptive`...): the eager fast path's values bit for bit (cuda tests, also under "
        "CUDA graphs). Off: they run as the custom ops (an escape hatch; same values).", "bool")
    data_dir: str | None = _knob(
        None, "MXTRAIN_DATA", "Folder of the prepared built-in corpus (default `~/.cache/mxtrain/data`). "
        "Read when used.", "path")
    cache_dir: str | None = _knob(
        None, "MXTRAIN_CACHE", "Folder of mxtrain's cache, e.g. the records of checked data shards (default "
        "`$XDG_CACHE_HOME/mxtrain`, else `~/.cache/mxtrain`). Read when used.", "path")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f, getattr(self, f.name), f"Settings.{f.name}"))
        # what quantize launch plans and self-check results depend on, hashed once per object
        object.__setattr__(self, "launch_key", (self.qkernel, self.qblocks, self.qcols, self.dual, self.qmaxnreg,
                                                self.qselfcheck))

    def shares_inputs(self) -> bool:
        """Do compiled MX layers that read one input quantize it once (``mx_compiled`` ``auto``)?"""
        return self.mx_compiled == "auto"

    def wgrad_x_for(self, in_features: int) -> str:
        """``wgrad_x`` for a layer of ``in_features`` inputs: ``auto`` resolved (``WGRAD_X_CARRIER_MAX``)."""
        if self.wgrad_x != "auto":
            return self.wgrad_x
        return "carrier" if in_features <= WGRAD_X_CARRIER_MAX else "forward"

    @classmethod
    def from_env(cls, environ=None) -> "Settings":
        """The settings an environment (default ``os.environ``) gives; unset or empty variables keep the
        default. A bad value raises ``SettingsError`` naming the variable, the value and the allowed ones."""
        environ = os.environ if environ is None else environ
        for var, why in _REMOVED.items():
            if (environ.get(var) or "").strip():
                raise SettingsError(f"{var} is set, but that setting was removed: {why}; unset it")
        kw = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(f.metadata["env"])
            if raw is not None and raw.strip():
                kw[f.name] = _coerce(f, raw, f.metadata["env"])
        return cls(**kw)

    def replace(self, **changes) -> "Settings":
        """A copy with ``changes`` (validated; strings are parsed as the environment's are)."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """``{field: value}`` (JSON types), for a run folder."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def numerics(self) -> dict:
        """The fields that can change a run's numbers (``NUMERICS``)."""
        return {n: getattr(self, n) for n in NUMERICS}


NUMERICS = tuple(f.name for f in dataclasses.fields(Settings) if f.metadata["numerics"])
_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _allowed(f) -> str:
    m = f.metadata
    if m["kind"] == "bool":
        return "one of " + ", ".join(_TRUE + _FALSE) + " (any case)"
    if m["choices"]:
        return "one of " + ", ".join(str(c) for c in m["choices"])
    if m["kind"] == "int":
        return "an integer" + (f" >= {m['minimum']}" if m["minimum"] is not None else "")
    return "a folder"


def _coerce(f, value, source: str):
    """``value`` (a string as in the environment, or a typed value) as field ``f`` holds it; the one parser."""
    m = f.metadata
    v = value
    if isinstance(v, str) and m["kind"] != "path":
        s = v.strip().lower()
        if m["kind"] == "bool":
            v = True if s in _TRUE else False if s in _FALSE else None
        elif m["kind"] == "int" or (m["choices"] and isinstance(m["choices"][0], int)):
            try:
                v = int(s)
            except ValueError:
                v = None
        else:
            v = m["aliases"].get(s, s)
    elif isinstance(v, bool) and m["kind"] == "choice" and m["aliases"]:
        v = m["aliases"]["1" if v else "0"]
    ok = v is not None
    if m["kind"] == "bool":
        ok = isinstance(v, bool)
    elif m["kind"] in ("int", "choice") and m["choices"] and isinstance(m["choices"][0], int):
        ok = isinstance(v, int) and not isinstance(v, bool) and v in m["choices"]
    elif m["kind"] == "int":
        ok = isinstance(v, int) and not isinstance(v, bool) and (m["minimum"] is None or v >= m["minimum"])
    elif m["kind"] == "choice":
        ok = v in m["choices"]
    elif m["kind"] == "path":
        if v is None:
            return None
        ok = isinstance(v, (str, os.PathLike))
        if ok:
            v = os.fspath(v)
            return v if v.strip() else None
    if not ok:
        raise SettingsError(f"{source}={value!r} is not a valid value: use {_allowed(f)} (docs/settings.md)")
    return v


def _check_names(fields: dict) -> None:
    bad = sorted(set(fields) - set(_FIELDS))
    if bad:
        raise SettingsError(f"unknown setting(s) {', '.join(bad)}; the settings are {', '.join(_FIELDS)}")


# ---------------------------------------------------------------------------------------------- state

_lock = threading.RLock()
_env: Settings | None = None        # the environment's settings, read on first use
_configured: dict = {}              # configure()
_stack: list = []                   # override() blocks, innermost last: [(token, {field: value})]
_current: Settings | None = None    # cached: the environment, then configure, then the overrides (None only
                                    # before the first current(); every change rebuilds it at once)


def current() -> Settings:
    """The active settings (cached; cheap enough for every call of the fast path)."""
    s = _current
    if s is None:
        s = _rebuild()
    return s


def _layers(base: Settings) -> Settings:
    changes = dict(_configured)
    for _, ov in _stack:
        changes.update(ov)
    return dataclasses.replace(base, **changes) if changes else base


def _rebuild() -> Settings:
    global _env, _current
    with _lock:
        if _env is None:
            _env = Settings.from_env(os.environ)
        _current = _layers(_env)
        return _current


def fresh() -> Settings:
    """The settings with the environment read now (not cached), configure and overrides applied: for
    settings read rarely and pointed elsewhere while a process runs (the folders)."""
    with _lock:
        return _layers(Settings.from_env(os.environ))


def _validate(fields: dict) -> dict:
    _check_names(fields)
    return {n: _coerce(_FIELDS[n], v, n) for n, v in fields.items()}


@contextlib.contextmanager
def override(**fields):
    """Within the block, ``current()`` has these values (validated; e.g. ``override(dual="off")``).
    Process-wide (every thread sees it) and nestable; blocks may end in any order."""
    ov = _validate(fields)
    token = object()
    with _lock:
        _stack.append((token, ov))
        s = _rebuild()
    try:
        yield s
    finally:
        with _lock:
            _stack[:] = [e for e in _stack if e[0] is not token]
            _rebuild()   # at once: a torch.compile trace must find the settings cached, never build them


def configure(**fields) -> Settings:
    """Set process-wide values, above the environment and below ``override`` blocks (e.g. from a
    command-line flag); returns the new ``current()``."""
    ov = _validate(fields)
    with _lock:
        _configured.update(ov)
        return _rebuild()


def reset() -> Settings:
    """Forget ``configure``'d values and read the environment again (``override`` blocks stay); returns the
    new ``current()``."""
    global _env
    with _lock:
        _env = None
        _configured.clear()
        return _rebuild()


# ---------------------------------------------------------------------------------------------- docs

_PAGE_HEAD = """# Settings

<!-- generated by mxtrain.settings.markdown_table(); tests/test_settings.py checks that this page is current -->

Every setting of mxtrain is an environment variable, read once per process (on first use), and a field of
`mxtrain.settings.Settings`. From Python, `mxtrain.settings.current()` returns the active settings and
`with mxtrain.settings.override(dual="off"): ...` changes some of them inside a block (tests and benchmarks
choose kernels and policies this way); `mxtrain.settings.configure(...)` sets process-wide values.
Booleans accept 1/0, true/false, yes/no, on/off in any case; a bad value stops with an error that names the
variable, the value and the allowed values.

Settings that can change a run's numbers are marked under "numerics": {numerics}.
Each run folder records them, with all the others (`mxtrain.settings.current().to_dict()`). The rest change
speed, memory or where files go, never a result.

"""

_PAGE_TAIL = """
Internal, not settings: `MXTRAIN_STUDY_PARENT`, `MXTRAIN_STUDY_START_BY` and `MXTRAIN_STUDY_ONLY_SEEDS` are set
by `mxtrain study` for its worker processes (a worker exits if that parent process is gone; it starts no run after
`--start-by`; it trains only the seeds of `--only-seeds`).
"""


def markdown_table() -> str:
    """The settings page (``docs/settings.md``): one row per field."""
    rows = ["| environment variable | field | type | default | numerics | what it does |",
            "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(Settings):
        m = f.metadata
        typ = {"bool": "bool", "int": "int", "path": "folder"}.get(m["kind"], "choice")
        if m["choices"]:
            typ += ": " + " / ".join(f"`{c}`" for c in m["choices"])
        default = "unset" if f.default is None else f"`{f.default}`"
        rows.append(f"| `{m['env']}` | `{f.name}` | {typ} | {default} | {'yes' if m['numerics'] else ''} "
                    f"| {m['doc']} |")
    head = _PAGE_HEAD.format(numerics=", ".join(f"`{n}`" for n in NUMERICS))
    return head + "\n".join(rows) + "\n" + _PAGE_TAIL
