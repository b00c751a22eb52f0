"""The whole training step, per variant, in one process: ``mxtrain bench step``.

One step is what a user's loop runs: embedding, every block, the final norm and head, the cross-entropy
loss, ``backward`` and a fused AdamW update, with float32 master weights under bf16 autocast (or, with
``param_dtype="bfloat16"``, the whole model and its AdamW state in bf16 without autocast), the whole model
under ``torch.compile`` (the same mode for every variant). Each variant is a fresh model with
the same initialization, on the same random tokens:

* ``bf16``: nothing converted;
* ``torchao-tensorwise``, ``torchao-rowwise``: torchao's float8 training (``convert_to_float8_training``)
  on the blocks' linear layers, when torchao is installed (the FP8 a user would pick on Hopper);
* any mxtrain recipe (``fp8``, ``mxfp4-all-dh16``, ...): ``mxtrain.convert`` with its defaults (the
  head and the embedding stay in high precision, as torchao's variants leave them).

Per variant: the median step time (and the fastest and slowest) over ``steps`` timed steps after ``warmup``
steps (CUDA events around whole steps, waiting after each one), the mean time of as many steps run back to back
with one wait at the end (``ms_back_to_back``: the host issues the next step while the GPU runs this one, as in a
loop that reads no value every step; the difference to ``ms`` is the GPU's idle time at each step's start),
tokens per second, the peak memory of a step (``max_memory_allocated``, the
weights and optimizer state included), on a GPU the fast path's inexact carrier blocks counted over the
variant's steps by tensor, and the ratios to BF16 and to the fastest FP8 variant of the same run. A
variant that fails (out of memory, say) is reported with its error; the others still run.

A variant may carry settings (``docs/settings.md``) after a colon, applied while it is built, compiled and
timed: ``mxfp4-all-dh16:wgrad_x=forward`` or ``mxfp4-all:dual=off:qkernel=tile``; and the model options
``recompute_ffn`` and ``checkpoint_blocks`` (``STEP_OPTIONS``; true or false) for that variant alone, over the
run-wide ones: ``mxfp4-all-dh16:recompute_ffn=true`` beside a plain ``bf16`` compares an MX recipe that
recomputes its feed-forward GEMMs with a BF16 step that does not, in one run. A torchao variant takes
``fast_accum=false`` (its forward GEMM accumulating in float32, as mxtrain's ``fp8`` does by default) or ``true``
(torchao's default); mxtrain's ``fp8`` takes the setting ``fp8_fast_accum=fprop`` (torchao's accumulation).
Any variant takes ``static_launch=true`` (``INDUCTOR_OPTIONS``): inductor launches the Triton kernels it did not
generate itself (mxtrain's quantizers compiled into the graph) through its own static CUDA launcher instead of
Triton's, torch's ``static_launch_user_defined_triton_kernels`` (off by default in torch 2.11-2.13), to measure
what the launcher costs the host; and ``cpp_wrapper=true``: inductor writes the code that runs a compiled graph in
C++ instead of Python (``torch._inductor.config.cpp_wrapper``; it needs a C++ compiler where the model compiles),
so that no Python runs between the graph's launches.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from ..errors import UserError
from ..model.llama import Llama, ModelConfig
from ..linear.module import convert, MXLayer
from ..train.cpp_wrapper import bind_backward_thread, check_cpp_compiler
from ..train.parallel import apply_ac
from ..settings import _FALSE, _TRUE   # the booleans the settings accept, the same words here
from .. import settings

__all__ = ["MODELS", "USER_MODELS", "HF_MODELS", "UserLlama", "HFLlama", "FP8_VARIANTS", "split_variant", "measure", "summarize", "format_table"]

# Shapes: Llama-8B layers (the paper's model, ``--layers`` of them, its 128k vocabulary), and two whole
# small models where launch overhead shows.
MODELS = {"8b-layers": "llama3-8b", "1b": "1b", "125m": "125m"}
TORCHAO = ("torchao-tensorwise", "torchao-rowwise")
FP8_VARIANTS = TORCHAO + ("fp8",)


# Models written as a user writes one, outside mxtrain (``UserLlama``): fused q|k|v and gate|up projections (4
# linear layers a block, an ``nn.Linear`` subclass that ``mxtrain.convert`` converts), vocabulary 32,768.
# ``125m-fused``: the 125M class (d768, 12 heads and KV heads, feed-forward 2048, 12 blocks); ``8b-fused``: Llama-8B
# layer shapes (d4096, 32 heads, 8 KV heads, feed-forward 14336, 4 blocks unless ``--layers`` says otherwise).
USER_MODELS = {"125m-fused": dict(dim=768, n_heads=12, n_kv_heads=12, ffn_dim=2048, n_layers=12),
               "8b-fused": dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, n_layers=4)}


# A Hugging Face model built from a config, as a user of ``transformers`` trains one (needs ``transformers``):
# ``hf-95m`` is the Llama of docs/library.md and examples/library_example.py (8 layers, hidden 1024, feed-forward
# 2816, 16 heads, 8 KV heads, a byte vocabulary of 256; 56 linear layers, ``lm_head`` kept), the loss its own
# (``labels``).
HF_MODELS = {"hf-95m": dict(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=8)}
# The models written outside mxtrain: mxtrain's activation-checkpoint options do not apply to them.
OUTSIDE = tuple(USER_MODELS) + tuple(HF_MODELS)


class HFLlama(torch.nn.Module):
    """A ``transformers.LlamaForCausalLM`` built from ``HF_MODELS``' config, timed as ``bench step`` times the
    others: ``forward(idx, targets)`` returns the model's own loss with ``labels=idx`` (it shifts the labels
    itself, as in docs/library.md's loop; ``targets`` is not used)."""

    def __init__(self, seq: int, device=None, **config):
        super().__init__()
        try:
            import transformers  # optional
        except ImportError:
            raise UserError("bench step --model hf-95m needs transformers (pip install transformers)") from None
        from types import SimpleNamespace
        cfg = transformers.LlamaConfig(**config, max_position_embeddings=seq)
        self.cfg = SimpleNamespace(vocab_size=cfg.vocab_size)
        self.hf = transformers.LlamaForCausalLM(cfg).to(device)

    def forward(self, idx, targets=None):
        return self.hf(input_ids=idx, labels=idx).loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class UserLinear(torch.nn.Linear):
    """A user's own linear layer: an ``nn.Linear`` subclass (``convert`` converts subclasses too)."""


class _UserBlock(torch.nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, ffn_dim, device):
        super().__init__()
        self.h, self.kv, self.hd = n_heads, n_kv_heads, dim // n_heads
        self.qkv = UserLinear(dim, (n_heads + 2 * n_kv_heads) * self.hd, bias=False, device=device)
        self.o = UserLinear(dim, dim, bias=False, device=device)
        self.up = UserLinear(dim, 2 * ffn_dim, bias=False, device=device)
        self.down = UserLinear(ffn_dim, dim, bias=False, device=device)
        self.n1 = torch.nn.RMSNorm(dim, device=device)
        self.n2 = torch.nn.RMSNorm(dim, device=device)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], dim=-1)
        q, k, v = (t.view(B, T, -1, self.hd).transpose(1, 2) for t in (q, k, v))

        def rope(t):
            a, b = t.float().chunk(2, dim=-1)
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).type_as(t)
        y = torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                                             enable_gqa=self.kv != self.h)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(g) * u)


class UserLlama(torch.nn.Module):
    """A Llama-style decoder written outside mxtrain (``USER_MODELS``): ``forward(idx, targets)`` returns the
    cross-entropy loss, as ``mxtrain.model.Llama`` does, so ``bench step`` times it the same way."""

    def __init__(self, dim, n_heads, n_kv_heads, ffn_dim, n_layers, vocab=32768, seq=1024, device=None):
        super().__init__()
        from types import SimpleNamespace
        self.cfg = SimpleNamespace(vocab_size=vocab)
        self.emb = torch.nn.Embedding(vocab, dim, device=device)
        self.layers = torch.nn.ModuleList(_UserBlock(dim, n_heads, n_kv_heads, ffn_dim, device)
                                          for _ in range(n_layers))
        self.norm = torch.nn.RMSNorm(dim, device=device)
        self.head = torch.nn.Linear(dim, vocab, bias=False, device=device)
        hd = dim // n_heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.emb(idx)
        for b in self.layers:
            x = b(x, self.cos[:T], self.sin[:T])
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def counted_config(model: str) -> ModelConfig:
    """``model``'s shapes as a ``ModelConfig`` (``bench limits`` counts from these): mxtrain's own models, and
    those written outside it, whose fused q|k|v and gate|up projections do the same GEMMs and quantize the same
    bytes as separate layers sharing one input (the count ``bench limits`` makes)."""
    if model in MODELS:
        return ModelConfig.named(MODELS[model])
    if model in USER_MODELS:
        u = USER_MODELS[model]
        return ModelConfig(dim=u["dim"], n_layers=u["n_layers"], n_heads=u["n_heads"], n_kv_heads=u["n_kv_heads"],
                           ffn_dim=u["ffn_dim"], vocab_size=32768)
    if model in HF_MODELS:
        h = HF_MODELS[model]
        return ModelConfig(dim=h["hidden_size"], n_layers=h["num_hidden_layers"], n_heads=h["num_attention_heads"],
                           n_kv_heads=h["num_key_value_heads"], ffn_dim=h["intermediate_size"],
                           vocab_size=h["vocab_size"])
    raise UserError(f"unknown model {model!r}; choose from {', '.join(list(MODELS) + list(OUTSIDE))}")


def _build(model: str, layers: int | None, seq: int, device):
    if model in HF_MODELS:
        kw = dict(HF_MODELS[model])
        if layers:
            kw["num_hidden_layers"] = layers
        torch.manual_seed(0)
        return HFLlama(seq=max(seq, 128), device=device, **kw)
    if model in USER_MODELS:
        kw = dict(USER_MODELS[model])
        if layers:
            kw["n_layers"] = layers
        torch.manual_seed(0)
        return UserLlama(**kw, seq=max(seq, 128), device=device)
    over = {"max_seq_len": max(seq, 128)}
    if layers:
        over["n_layers"] = layers
    torch.manual_seed(0)
    return Llama(ModelConfig.named(MODELS.get(model, model), **over), device=device, glue=settings.current().glue)


def _convert(m, variant: str, torchao_fast_accum: bool | None = None) -> None:
    if variant == "bf16":
        return
    if variant in TORCHAO:
        import dataclasses

        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional
        from torchao.float8.config import Float8GemmConfig  # optional
        config = Float8LinearConfig.from_recipe_name(variant.split("-", 1)[1])
        if torchao_fast_accum is not None:   # (torchao's default: fast accumulation in the forward GEMM only)
            config = dataclasses.replace(config, gemm_config_output=Float8GemmConfig(use_fast_accum=torchao_fast_accum))
        # (the blocks' linear layers: mxtrain's models' and UserLlama's ``layers.*``, a Hugging Face model's
        # ``hf.model.layers.*``; never the output head, which mxtrain's recipes keep in high precision too)
        convert_to_float8_training(m, config=config, module_filter_fn=lambda mod, fqn: ".layers." in f".{fqn}")
        return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the conversion report's warnings are not the benchmark's
        convert(m, variant)


def _one_variant(variant: str, model: str, layers: int | None, batch: int, seq: int, steps: int, warmup: int,
                 compile_mode: str, device, recompute_ffn: bool = False, param_dtype: str = "float32",
                 checkpoint_blocks: bool = False, torchao_fast_accum: bool | None = None, profile: int = 0) -> dict:
    import contextlib
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    m = _build(model, layers, seq, dev)
    if param_dtype == "bfloat16":
        m.to(torch.bfloat16)
    elif param_dtype != "float32":
        raise ValueError(f"param_dtype must be float32 or bfloat16, not {param_dtype!r}")
    if model in OUTSIDE and (recompute_ffn or checkpoint_blocks):
        raise ValueError(f"model {model}: recompute_ffn and checkpoint_blocks are options of mxtrain's own models")
    if model not in OUTSIDE:   # (activation checkpointing from outside the model, as the trainer applies it)
        apply_ac(m, checkpoint_blocks=checkpoint_blocks, recompute_ffn=recompute_ffn)
    V = m.cfg.vocab_size
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, V, (batch, seq + 1), device=dev, generator=g)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    _convert(m, variant, torchao_fast_accum)
    f = m if compile_mode == "none" else torch.compile(m, mode=None if compile_mode == "default" else compile_mode)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=cuda)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16) if param_dtype == "float32" else contextlib.nullcontext()

    def step():
        with amp:
            loss = f(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    from ..linear import fast  # startup
    inexact0 = fast.inexact_by_tensor(dev) if cuda else None
    t_compile = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    if cuda:
        torch.cuda.synchronize()
    t_compile = time.perf_counter() - t_compile
    times, host, peak = [], [], 0.0
    for _ in range(steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            loss = step()
            host.append(1e3 * (time.perf_counter() - t0))   # (the host's time to issue the step: nothing syncs)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append(1e3 * (time.perf_counter() - t0))
    # the same number of steps back to back, one wait at the end: the host issues step n + 1 while the GPU runs
    # step n, as in a training loop that reads no value every step ("ms" above waits after each step, so the GPU
    # idles while the host issues the start of the next one)
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if cuda:
        b.record()
        b.synchronize()
        ms_b2b = a.elapsed_time(b) / steps
    else:
        ms_b2b = 1e3 * (time.perf_counter() - t0) / steps
    out = {"ms": statistics.median(times), "ms_all": times, "warmup_s": t_compile,
           "tokens_per_s": batch * seq / (statistics.median(times) * 1e-3), "loss": float(loss.item()),
           "params": m.num_params(), "ms_back_to_back": ms_b2b}
    if cuda:
        out["peak_gib"] = peak
        # the host's time to issue a step (CPU wall time until the step's Python returns, nothing synchronized):
        # near ms, the step is bound by the host; and over the MX layers, an upper bound of one layer's host time
        out["host_ms"] = statistics.median(host)
        n_mx = sum(isinstance(mod, MXLayer) for mod in m.modules())
        out["mx_layers"] = n_mx
        if n_mx:
            out["host_us_per_mx_layer_at_most"] = 1e3 * out["host_ms"] / n_mx
        # MXFP4 blocks the FP8 carrier could not hold exactly, over this variant's steps, by tensor
        # (``mxtrain.linear.fast.inexact_by_tensor``; 0 everywhere: every GEMM multiplied the exact MX values)
        after = fast.inexact_by_tensor(dev)
        out["inexact_blocks"] = {k: after[k] - inexact0[k] for k in after}
    if profile:   # after the timed steps, so that the profiler does not slow them
        out["profile"] = kernel_profile(step, 3, dev)
        out["profile"]["kernels"] = out["profile"]["kernels"][:profile]
    del m, f, opt
    return out


def kernel_class(name: str) -> str:
    """The class of a profiled kernel by its name: quantize, attention, gemm, glue (compiled), or other."""
    n = name.lower()
    if any(t in n for t in ("_mxfp4", "quantize", "nvfp4", "_mx_kernel", "_fp8_cast", "amax_kernel", "_expand_kernel")):
        return "quantize"   # (mxtrain's Triton quantize, cast and carrier kernels by name)
    if any(t in n for t in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(t in n for t in ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "scaled_mm", "matmul", "cublas", "_mx_dot",
                                   "aten::mm", "aten::addmm", "aten::bmm")):
        return "gemm"
    if n.startswith("triton_"):
        return "glue (compiled)"
    return "glue (eager) / other"


def kernel_profile(step, steps: int = 3, device="cuda") -> dict:
    """``steps`` calls of ``step`` under ``torch.profiler``: ``kernels``, a list of ``[name, calls a step, ms a
    step]`` (self time on the device; on a CPU, of the operators), costliest first, and ``by_class``, their ms
    a step summed by ``kernel_class`` with the ``total``."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if cuda:
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append([e.key, e.count / steps, t / 1e3 / steps])
    rows.sort(key=lambda r: -r[2])
    by_class: dict = {}
    for name, _, ms in rows:
        c = kernel_class(name)
        by_class[c] = by_class.get(c, 0.0) + ms
    by_class = dict(sorted(by_class.items(), key=lambda kv: -kv[1]))
    by_class["total"] = sum(r[2] for r in rows)
    return {"kernels": rows, "by_class": by_class, "time": "device" if cuda else "cpu"}


def host_profile(fn, calls: int = 20, top: int = 12, device="cuda") -> dict:
    """Where the host's time of ``calls`` calls of ``fn`` goes, under ``torch.profiler`` (which slows each call, so
    read the shares, not the totals): ``launches``, the kernel launches the host issued a call (the CUDA runtime's
    and driver's launch calls, Triton's included); ``kernels``, the kernels the device ran a call; ``host``, a list of
    ``[operator, calls a call, us a call]`` of the ``top`` operators by their own host time. On a CPU there are no
    launches or kernels (both 0) and the operators are the CPU ones."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()   # (one call outside the profile: nothing of a first call is counted)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    launches = kernels = 0.0
    host = []
    for e in prof.key_averages():
        dev_t = getattr(e, "self_device_time_total", None)
        if dev_t is None:
            dev_t = getattr(e, "self_cuda_time_total", 0)
        if "LaunchKernel" in e.key:   # cudaLaunchKernel(ExC), cuLaunchKernel(Ex): one host launch each
            launches += e.count / calls
        if cuda and dev_t > 0 and e.self_cpu_time_total == 0:
            kernels += e.count / calls   # (a device-side event: a kernel, memset or copy)
        elif e.self_cpu_time_total > 0:
            host.append([e.key, e.count / calls, e.self_cpu_time_total / calls])
    host.sort(key=lambda r: -r[2])
    return {"launches": launches, "kernels": kernels, "host": host[:top], "calls": calls}


STEP_OPTIONS = ("recompute_ffn", "checkpoint_blocks")   # model options a variant may set for itself


def step_options(over: dict, **defaults: bool) -> dict:
    """The model options of one variant: ``defaults`` (the run's), replaced by those among the variant's
    ``key=value`` pairs ``over`` (removed from it, so that the rest are settings). Refuses a value that is not a
    boolean."""
    opts = dict(defaults)
    for key in STEP_OPTIONS:
        if key in over:
            opts[key] = _pop_bool(over, key)
    return opts


def _pop_bool(over: dict, key: str) -> bool:
    """``over[key]`` (removed from it) as a boolean; refuses any other word."""
    val = str(over.pop(key)).strip().lower()
    if val not in _TRUE + _FALSE:
        raise ValueError(f"{key}={val!r}: give true or false")
    return val in _TRUE


# variant options that patch inductor's config while the variant is compiled and timed: option -> config key
INDUCTOR_OPTIONS = {"static_launch": "static_launch_user_defined_triton_kernels", "cpp_wrapper": "cpp_wrapper"}


def inductor_options(over: dict) -> dict:
    """The inductor config a variant's ``INDUCTOR_OPTIONS`` ask for (removed from ``over``), as
    ``torch._inductor.config.patch`` takes it. Refuses a value that is not a boolean."""
    return {cfg: _pop_bool(over, key) for key, cfg in INDUCTOR_OPTIONS.items() if key in over}


def torchao_option(base: str, over: dict) -> bool | None:
    """A torchao variant's ``fast_accum=true|false`` (removed from ``over``): whether torchao's forward GEMM
    accumulates in the fast mode (its default: true); None where not given. Refused on other variants."""
    if "fast_accum" not in over:
        return None
    if base not in TORCHAO:
        raise ValueError(f"fast_accum= is an option of the torchao variants; for mxtrain's fp8 give "
                         f"fp8_fast_accum=fprop or off")
    return _pop_bool(over, "fast_accum")


def variant_options(base: str, over: dict, **defaults: bool) -> tuple[dict, bool | None, dict]:
    """Every option of one variant that is not a setting, removed from ``over`` (what is left are settings):
    its model options (``step_options``), a torchao variant's ``fast_accum`` (``torchao_option``) and its
    inductor options (``inductor_options``). The one place that knows them all: the command checks the variants
    with it before any GPU work, and each variant is measured with what it returns."""
    return step_options(over, **defaults), torchao_option(base, over), inductor_options(over)


def split_variant(v: str) -> tuple[str, dict]:
    """``"name:key=value:key=value"`` -> ``("name", {key: value})`` (values parsed by ``settings``)."""
    name, _, rest = v.partition(":")
    over = {}
    for item in filter(None, (p.strip() for p in rest.split(":"))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"variant {v!r}: settings after ':' are key=value pairs, got {item!r}")
        over[key.strip()] = value.strip()
    return name, over


def measure(variants, model: str = "8b-layers", layers: int | None = 4, batch: int = 4, seq: int = 4096,
            steps: int = 10, warmup: int = 3, compile_mode: str = "default", device="cuda",
            recompute_ffn: bool = False, on_variant=None, memory_budget: float | None = None,
            param_dtype: str = "float32", checkpoint_blocks: bool = False,
            recompute_gemm_inputs: bool = False, rounds: int = 1, profile: int = 0) -> dict:
    """Time and memory of the whole training step for each variant (see the module docstring);
    ``recompute_ffn``: every variant's blocks recompute their feed-forward outputs (``train.parallel.apply_ac``);
    ``checkpoint_blocks``: every variant's blocks keep only their input and run again in the backward
    (``train.parallel.apply_ac``, full activation checkpointing);
    ``on_variant(name, result)`` is called as each variant finishes (progress; nothing lost if a later one
    hangs or the process is stopped); ``memory_budget``: torch's ``activation_memory_budget`` (in (0, 1]: the
    compiler recomputes activations in the backward to keep that share of what it would save) for every
    variant; ``param_dtype``: ``float32`` (master weights under bf16 autocast) or ``bfloat16`` (the whole model
    and its optimizer state in bf16, no autocast), for every variant; ``recompute_gemm_inputs``: the compiler may
    recompute activations that feed GEMMs in the backward (``train.recompute_gemm_inputs``), for every
    variant.

    ``rounds``: every variant is built, compiled and timed that many times, the order of the variants rotated
    each round so that none always runs first (a ratio of two variants moves by a percent or two from one
    measurement to the next on the same GPU). Each round's results and ratios are kept under ``rounds``;
    a variant's ``ms`` is then the median of its rounds' medians, and its ratios the medians of the rounds'
    ratios (each round's variant against BF16 and against the run's best FP8 variant timed in the same round),
    with their lowest and highest in ``speed_vs_bf16_range`` and ``speed_vs_best_fp8_range``.

    ``profile``: after its timed steps, each variant runs 3 more under ``torch.profiler`` (``kernel_profile``):
    its device time a step by kernel class and its ``profile`` costliest kernels (with rounds, in each round's
    results), and on a GPU ``device_speed_vs_bf16``, BF16's device time a step over the variant's (with rounds,
    from the last round that profiled each)."""
    if int(rounds) < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds!r}")
    rounds = int(rounds)
    res = {"model": model, "layers": layers, "batch": batch, "seq": seq, "tokens": batch * seq,
           "compile": compile_mode, "steps": steps, "warmup": warmup, "recompute_ffn": recompute_ffn,
           "memory_budget": memory_budget, "param_dtype": param_dtype, "checkpoint_blocks": checkpoint_blocks,
           "recompute_gemm_inputs": recompute_gemm_inputs, "rounds_run": rounds, "runs": {}}
    variants = list(dict.fromkeys(variants))   # (a variant named twice is timed once a round)
    kw = dict(model=model, layers=layers, batch=batch, seq=seq, steps=steps, warmup=warmup,
              compile_mode=compile_mode, device=device, recompute_ffn=recompute_ffn, param_dtype=param_dtype,
              checkpoint_blocks=checkpoint_blocks, recompute_gemm_inputs=recompute_gemm_inputs,
              memory_budget=memory_budget, profile=profile)
    if rounds == 1:
        for v in variants:
            res["runs"][v] = _measure_variant(v, on_variant, **kw)
        return summarize(res)
    res["rounds"] = []
    for r in range(rounds):
        k = r % len(variants) if variants else 0
        order = variants[k:] + variants[:k]
        runs = {}
        for v in order:
            runs[v] = _measure_variant(v, None if on_variant is None else
                                       (lambda name, out, r=r: on_variant(f"{name} (round {r + 1}/{rounds})", out)),
                                       **kw)
        res["rounds"].append(summarize({"order": order, "runs": {v: runs[v] for v in variants}}))
    return _over_rounds(res, variants)


def _measure_variant(v: str, on_variant, *, model, layers, batch, seq, steps, warmup, compile_mode, device,
                     recompute_ffn, param_dtype, checkpoint_blocks, recompute_gemm_inputs, memory_budget,
                     profile) -> dict:
    """One variant built, compiled and timed (``_one_variant``) under its own settings; a failure is a result."""
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    try:
        base, over = split_variant(v)
        opts, tao_fa, inductor = variant_options(base, over, recompute_ffn=recompute_ffn,
                                                 checkpoint_blocks=checkpoint_blocks)
        budget = {} if memory_budget is None else {"activation_memory_budget": float(memory_budget)}
        if recompute_gemm_inputs:
            budget["ban_recompute_materialized_backward"] = False
        if inductor.get("cpp_wrapper"):
            check_cpp_compiler("cpp_wrapper=true")
            bind_backward_thread(device)   # (torch's issue #144609: mxtrain/train/cpp_wrapper.py)
        with settings.override(**over), torch._functorch.config.patch(**budget), \
                torch._inductor.config.patch(**inductor):
            out = _one_variant(base, model, layers, batch, seq, steps, warmup, compile_mode, device,
                               opts["recompute_ffn"], param_dtype, opts["checkpoint_blocks"], tao_fa, profile)
            out["settings"] = over
            if inductor:
                out["inductor"] = inductor
            out["step_options"] = opts
            if on_variant is not None:   # (inside: it sees the variant's settings)
                on_variant(v, out)
    except Exception as e:  # noqa: BLE001 - one variant's failure (OOM, torchao missing) is a result
        out = {"error": f"{type(e).__name__}: {e}"[:400]}
        if on_variant is not None:
            on_variant(v, out)
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return out


def _over_rounds(res: dict, variants: list) -> dict:
    """Each variant's result over the rounds of ``res["rounds"]`` (each already ``summarize``d): the median of
    its rounds' medians and of their ratios, the ratios' range, all steps' times; the best FP8 variant is the
    one with the lowest median over the rounds, and each round's ratio is against it in that round."""
    rounds = res["rounds"]
    timed = {v: [rr["runs"][v] for rr in rounds if "ms" in rr["runs"][v]] for v in variants}
    fp8 = {v: statistics.median(x["ms"] for x in rs) for v, rs in timed.items()
           if v.partition(":")[0] in FP8_VARIANTS and rs}
    best = min(fp8, key=fp8.get) if fp8 else None
    res["best_fp8"] = best
    for v in variants:
        rs = timed[v]
        if not rs:   # failed in every round: the last round's error
            res["runs"][v] = {"error": rounds[-1]["runs"][v].get("error", "?"), "rounds_timed": 0}
            continue
        ms = statistics.median(x["ms"] for x in rs)
        out = {"ms": ms, "ms_all": [t for x in rs for t in x["ms_all"]], "ms_rounds": [x["ms"] for x in rs],
               "rounds_timed": len(rs), "tokens_per_s": res["tokens"] / (ms * 1e-3),
               "warmup_s": statistics.median(x["warmup_s"] for x in rs), "loss": rs[-1]["loss"],
               "params": rs[-1]["params"], "settings": rs[-1]["settings"], "step_options": rs[-1]["step_options"]}
        if all("ms_back_to_back" in x for x in rs):
            out["ms_back_to_back"] = statistics.median(x["ms_back_to_back"] for x in rs)
        if all("peak_gib" in x for x in rs):
            out["peak_gib"] = max(x["peak_gib"] for x in rs)
        if all("host_ms" in x for x in rs):
            out["host_ms"] = statistics.median(x["host_ms"] for x in rs)
            out["mx_layers"] = rs[-1]["mx_layers"]
            if out["mx_layers"]:
                out["host_us_per_mx_layer_at_most"] = 1e3 * out["host_ms"] / out["mx_layers"]
        if "profile" in rs[-1]:
            out["profile"] = rs[-1]["profile"]   # (the last round that timed it)
        if all("inexact_blocks" in x for x in rs):
            out["inexact_blocks"] = {k: sum(x["inexact_blocks"][k] for x in rs) for k in rs[0]["inexact_blocks"]}
        for key, ref in (("speed_vs_bf16", "bf16"), ("speed_vs_best_fp8", best)):
            rat = [rr["runs"][ref]["ms"] / rr["runs"][v]["ms"] for rr in rounds
                   if ref is not None and "ms" in rr["runs"].get(ref, {}) and "ms" in rr["runs"][v]]
            if rat:
                out[key] = statistics.median(rat)
                out[key + "_range"] = [min(rat), max(rat)]
        res["runs"][v] = out
    bf = res["runs"].get("bf16", {})
    for out in res["runs"].values():
        if "peak_gib" in out and "peak_gib" in bf:
            out["memory_vs_bf16"] = out["peak_gib"] / bf["peak_gib"]
    _device_ratios(res["runs"])
    return res


def _device_total(v: dict) -> float | None:
    """A variant's device time a step from its kernel profile (``--profile`` on a GPU), else None."""
    prof = v.get("profile") or {}
    return prof.get("by_class", {}).get("total") if prof.get("time") == "device" else None


def _device_ratios(runs: dict) -> None:
    """``device_speed_vs_bf16``: BF16's device time a step over the variant's, where both were profiled on the
    GPU: the rate the step would run at if nothing but its kernels took time (a kernel change shows here when
    the wall clock's spread between calls hides it)."""
    base = _device_total(runs.get("bf16", {}))
    for v in runs.values():
        total = _device_total(v)
        if base and total:
            v["device_speed_vs_bf16"] = base / total


def summarize(res: dict) -> dict:
    """Add each variant's ratios: ``speed_vs_bf16``, ``memory_vs_bf16``, ``speed_vs_best_fp8`` (against the
    fastest FP8 variant of the run, with or without options, named in ``best_fp8``)."""
    runs = res["runs"]
    bf = runs.get("bf16", {})
    fp8 = {k: v["ms"] for k, v in runs.items() if k.partition(":")[0] in FP8_VARIANTS and "ms" in v}
    best = min(fp8, key=fp8.get) if fp8 else None
    res["best_fp8"] = best
    for k, v in runs.items():
        if "ms" not in v:
            continue
        if "ms" in bf:
            v["speed_vs_bf16"] = bf["ms"] / v["ms"]
            if "peak_gib" in v and "peak_gib" in bf:
                v["memory_vs_bf16"] = v["peak_gib"] / bf["peak_gib"]
        if best is not None:
            v["speed_vs_best_fp8"] = fp8[best] / v["ms"]
    _device_ratios(runs)
    return res


def format_table(res: dict) -> str:
    """The results as a Markdown table (what ``mxtrain bench step`` prints)."""
    best = res.get("best_fp8")
    rounds = res.get("rounds_run", 1)
    head = (f"whole training step: model {res['model']}" + (f" ({res['layers']} layers)" if res.get("layers") else "")
            + f", {res['batch']} x {res['seq']} tokens, compile {res['compile']}, median of {res['steps']} steps"
            + (f"; {rounds} rounds, the order rotated: ms the median of the rounds' medians, ratios the median "
               f"of the rounds' ratios (lowest-highest)" if rounds > 1 else "")
            + (", bf16 parameters" if res.get("param_dtype") == "bfloat16" else "")
            + (", feed-forward recomputed" if res.get("recompute_ffn") else "")
            + (", GEMM inputs recomputable" if res.get("recompute_gemm_inputs") else "")
            + (", blocks checkpointed (full activation checkpointing)" if res.get("checkpoint_blocks") else ""))
    lines = [head, "", f"| variant | ms/step | min-max ms | tokens/s | vs bf16 | vs {best or 'best FP8'} | peak GiB | "
             "vs bf16 mem |", "|---|---|---|---|---|---|---|---|"]

    def f(v, key, fmt, unit=""):
        if key not in v:
            return "-"
        lo_hi = v.get(key + "_range") if rounds > 1 else None
        return format(v[key], fmt) + unit + (f" ({lo_hi[0]:{fmt}}-{lo_hi[1]:{fmt}})" if lo_hi else "")
    for k, v in res["runs"].items():
        if "ms" not in v:
            lines.append(f"| {k} | failed: {v.get('error', '?')[:80]} | | | | | | |")
            continue
        spread = f"{min(v['ms_all']):.1f}-{max(v['ms_all']):.1f}" if v.get("ms_all") else "-"
        lines.append(f"| {k} | {v['ms']:.1f} | {spread} | {f(v, 'tokens_per_s', ',.0f')} | "
                     f"{f(v, 'speed_vs_bf16', '.3f', 'x')} | "
                     f"{f(v, 'speed_vs_best_fp8', '.3f', 'x')} | {f(v, 'peak_gib', '.2f')} | "
                     f"{f(v, 'memory_vs_bf16', '.3f', 'x')} |")
    b2b = [(k, v) for k, v in res["runs"].items() if "ms_back_to_back" in v]
    if b2b:
        lines += ["", "ms a step with the steps back to back (one wait at the end, as a training loop that reads "
                  "no value every step; ms/step above waits after each step): "
                  + ", ".join(f"{k} {v['ms_back_to_back']:.1f}" for k, v in b2b)]
    hosts = [(k, v) for k, v in res["runs"].items() if "host_ms" in v]
    if hosts:
        lines += ["", "host time to issue a step (ms; near ms/step: bound by the host), and over the MX layers: "
                  + ", ".join(f"{k} {v['host_ms']:.1f}"
                              + (f" ({v['host_us_per_mx_layer_at_most']:.0f} us a layer at most, {v['mx_layers']} layers)"
                                 if v.get("mx_layers") else "") for k, v in hosts)]
        bound = [k for k, v in hosts if "ms_back_to_back" in v and v["host_ms"] >= 0.9 * v["ms_back_to_back"]]
        if bound:
            lines += [f"bound by the host (it takes at least 90 % of a back-to-back step to issue one): "
                      f"{', '.join(bound)}; less host time a step: a variant option cpp_wrapper=true (inductor's C++ "
                      f"wrapper), --compile reduce-overhead, or more tokens a step"]
    for k, v in res["runs"].items():
        prof = v.get("profile")
        if not prof:
            continue
        what = "device ms" if prof.get("time") == "device" else "CPU ms (operators' self time)"
        lines += ["", f"{k}: {what} a step by kernel class: "
                  + ", ".join(f"{c} {ms:.2f}" for c, ms in prof["by_class"].items())
                  + (f" ({v['device_speed_vs_bf16']:.3f}x BF16's device time)"
                     if "device_speed_vs_bf16" in v and k != "bf16" else "")]
        lines += [f"  {ms:8.3f} ms {calls:6.1f}x  {name[:100]}" for name, calls, ms in prof["kernels"][:10]]
    return "\n".join(lines)
