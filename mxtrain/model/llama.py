"""A Llama-3-style decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Shapes use ``B`` batch, ``T`` sequence, ``C`` model width, ``H`` query heads, ``G`` key/value
heads, ``D`` head dim. The blocks live in ``model.layers`` (an ``nn.ModuleList``), so
``mxtrain.convert`` numbers them 0..n-1 for ``keep_first``/``keep_last``; the output head is
``lm_head`` and the embedding ``embed_tokens``, which ``convert`` keeps in high precision.

Named sizes (``SIZES``, ``ModelConfig.named(name)``) go from ``tiny`` (trains on 2 CPU cores in
minutes) to ``llama3-8b`` (the exact Llama 3.1-8B shapes). Build large models on the meta device
(``Llama(cfg, device="meta")``) to count parameters without allocating them.

The model reads no setting and knows no number format. What a caller may choose comes in as options of
``Llama`` (and ``Block``): ``glue`` (how the elementwise pieces run), ``checkpoint`` / ``ffn_checkpoint``
(activation checkpointing of a block, or of its feed-forward) and ``experts`` (the experts module of a mixture of
experts). ``mxtrain.train`` reads the settings and passes or applies them (``mxtrain.train.parallel.apply_ac``);
``mxtrain.convert`` swaps the linear layers and experts for MX ones after the model is built.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError

__all__ = ["ModelConfig", "Llama", "MoEFeedForward", "SIZES", "size_names", "GLUE_MODES", "set_glue"]

# the Hugging Face architectures mxtrain's Llama computes exactly (ModelConfig.hf_model_type; "mixtral": a mixture of
# experts, ``n_experts`` > 0)
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of the decoder. ``vocab_size`` is usually set from the tokenizer at train time."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 0              # 0: Llama's rule, 8/3 * dim rounded up to ``multiple_of``
    multiple_of: int = 32
    vocab_size: int = 8192
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Llama 3.1's RoPE frequency scaling ("llama3" in Hugging Face configs): () for none, else (factor,
    # low_freq_factor, high_freq_factor, original_max_position_embeddings) (``rope_tables``)
    rope_scaling: tuple = ()
    # biases on the query, key and value projections (Qwen2; the output projection and the FFN have none)
    qkv_bias: bool = False
    # Llama's ``attention_bias``: biases on the query, key, value and output projections; ``mlp_bias``: on the
    # feed-forward's three (gate w1, up w3, down w2). Hugging Face Llama configs only (hf_model_type "llama")
    attention_bias: bool = False
    mlp_bias: bool = False
    # the Hugging Face model type of an export (``mxtrain.model.hf_io.hf_config``): "llama", "mistral" (a Llama without
    # a sliding window) or "qwen2" (a Llama with q/k/v biases: ``qkv_bias``); "mixtral" (a model loaded from a
    # Mixtral folder; needs ``n_experts``). A mixture of experts exports as a Mixtral whatever this says
    hf_model_type: str = "llama"
    # Mixture of experts (``MoEFeedForward``): 0 for the dense SwiGLU feed-forward; else each block's feed-forward
    # is ``n_experts`` SwiGLU experts of width ``hidden_dim``, ``top_k`` of them per token (Mixtral's routing),
    # and training adds ``router_aux_coef`` times the load-balancing loss of Switch Transformers (Fedus et al.,
    # arXiv 2101.03961, eq. 4; their coefficient 0.01) to the training loss (not to the validation loss)
    n_experts: int = 0
    top_k: int = 2
    router_aux_coef: float = 0.01

    def __post_init__(self):
        rs = tuple(float(v) for v in (self.rope_scaling or ()))   # (a list from a checkpoint's JSON, too)
        object.__setattr__(self, "rope_scaling", rs)
        if rs and (len(rs) != 4 or not all(math.isfinite(v) and v > 0 for v in rs) or rs[2] <= rs[1]):
            raise UserError(f"model.rope_scaling={list(rs)}: give (factor, low_freq_factor, high_freq_factor, "
                            f"original_max_position_embeddings), all positive, high_freq_factor above low_freq_factor")
        f32 = torch.finfo(torch.float32)   # RoPE's frequencies and RMSNorm's epsilon are computed in float32
        for k in ("rope_theta", "norm_eps"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not f32.tiny <= v <= f32.max:
                raise UserError(f"model.{k}={v!r} must be a positive number within float32's normal range "
                                f"({f32.tiny:.4g} to {f32.max:.4g}; it is used in float32)")
        if self.hf_model_type not in HF_MODEL_TYPES:
            raise UserError(f"model.hf_model_type={self.hf_model_type!r}: one of {', '.join(HF_MODEL_TYPES)}")
        if bool(self.qkv_bias) != (self.hf_model_type == "qwen2"):
            raise UserError(f"model.qkv_bias={bool(self.qkv_bias)} with hf_model_type={self.hf_model_type!r}: q/k/v "
                            f"biases are Qwen2's (qkv_bias=True goes with hf_model_type='qwen2' and only with it)")
        for k in ("attention_bias", "mlp_bias"):
            if getattr(self, k) and self.hf_model_type != "llama":
                raise UserError(f"model.{k}=True with hf_model_type={self.hf_model_type!r}: {k} is a Llama config's "
                                f"field (hf_model_type='llama')")
        if self.dim % self.n_heads:
            raise UserError(f"model.dim={self.dim} must be a multiple of model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise UserError("head dim (model.dim / model.n_heads) must be even for RoPE")
        for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "multiple_of"):
            if getattr(self, f) <= 0:
                raise UserError(f"model.{f} must be positive, got {getattr(self, f)}")
        if self.n_experts:
            if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 2:
                raise UserError(f"model.n_experts={self.n_experts!r}: 0 (a dense feed-forward) or at least 2 experts")
            if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.n_experts:
                raise UserError(f"model.top_k={self.top_k!r}: between 1 and model.n_experts={self.n_experts}")
            c = self.router_aux_coef
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf:
                raise UserError(f"model.router_aux_coef={c!r}: a number >= 0 (0: no load-balancing loss)")
            if self.mlp_bias:
                raise UserError("model.mlp_bias=True with model.n_experts: the experts have no biases (Mixtral's)")
        elif self.hf_model_type == "mixtral":
            raise UserError("model.hf_model_type='mixtral' with model.n_experts=0: a Mixtral is a mixture of experts")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        h = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(h / self.multiple_of)

    @staticmethod
    def named(name: str, **overrides) -> "ModelConfig":
        if name not in SIZES:
            raise UserError(f"unknown model {name!r}; valid models: {', '.join(SIZES)}")
        return replace(SIZES[name], **overrides)

    def to_dict(self) -> dict:
        return asdict(self)

    # -- counting ---------------------------------------------------------------------------------
    def num_params(self, embeddings: bool = True) -> int:
        """Parameter count (exact; equals ``sum(p.numel())`` of the built model)."""
        C, F_, V, L = self.dim, self.hidden_dim, self.vocab_size, self.n_layers
        kv = self.n_kv_heads * self.head_dim
        ffn = 3 * C * F_ * self.n_experts + C * self.n_experts if self.n_experts else 3 * C * F_   # (+ router)
        block = C * C * 2 + C * kv * 2 + ffn + 2 * C  # wq, wo, wk, wv, w1/w2/w3 (or the experts), 2 norms
        if self.qkv_bias or self.attention_bias:
            block += C + 2 * kv
        if self.attention_bias:
            block += C             # wo
        if self.mlp_bias:
            block += 2 * F_ + C    # w1, w3, w2
        n = L * block + C  # final norm
        if embeddings:
            n += V * C * (1 if self.tie_embeddings else 2)
        elif not self.tie_embeddings:
            n += V * C  # the head is a matmul, count it
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * (matmul params incl. head) + attention (12 * L * C * T), as in PaLM/nanoGPT.

        With causal attention only half the score matrix matters; we count the full product, like
        the PaLM formula, so MFU is comparable to published numbers. A mixture of experts counts the ``top_k``
        experts a token runs through and its router (the active parameters), not all experts.
        """
        C, F_, V, L = self.dim, self.hidden_dim, self.vocab_size, self.n_layers
        kv = self.n_kv_heads * self.head_dim
        ffn = 3 * C * F_ * self.top_k + C * self.n_experts if self.n_experts else 3 * C * F_
        matmul = L * (2 * C * C + 2 * C * kv + ffn) + V * C
        return 6.0 * matmul + 12.0 * L * C * seq_len


SIZES: dict[str, ModelConfig] = {
    # tiny: the CPU main job (1.8M parameters with the 4k built-in vocab; see docs/training.md)
    "tiny": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=512),
    # tiny-moe: tiny with 4 experts a block, 2 a token (3.4M parameters, 2.3M of them active a token, 4k vocab)
    "tiny-moe": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=4096, max_seq_len=512,
                            n_experts=4, top_k=2),
    "30m": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=16384, max_seq_len=1024),
    # 30m-moe: 30m with 8 experts a block, 2 a token (Mixtral's ratio)
    "30m-moe": ModelConfig(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=16384, max_seq_len=1024,
                           n_experts=8, top_k=2),
    "125m": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=16384, max_seq_len=2048),
    "350m": ModelConfig(dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, vocab_size=32768, max_seq_len=2048),
    "1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=32768,
                      max_seq_len=4096),
    # Llama 3.1-8B: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256, theta 5e5
    "llama3-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                             max_seq_len=8192, rope_theta=500000.0),
}


def size_names() -> list[str]:
    return list(SIZES)


# ------------------------------------------------------------------------------------------- glue
# The elementwise work between the linear layers (RMSNorm, RoPE, SwiGLU) is written once, in plain
# PyTorch, and on CUDA runs through torch.compile, which fuses each function (and its backward) into
# one or two Triton kernels instead of the ~10 separate passes eager PyTorch makes over the tensor.
# Same formulas either way (float32 math, one rounding to the input dtype); only the rounding of
# float32 intermediate steps may differ. The modules that run them take a ``glue`` option: "auto" (default)
# compiles on CUDA only, "compiled" on every device, "eager" never; or a function ``glue(fn, *args)`` that runs
# ``fn(*args)`` its own way. mxtrain's trainer and commands pass the ``glue`` setting (``MXTRAIN_GLUE``);
# ``set_glue`` changes it on a built model.

GLUE_MODES = ("auto", "compiled", "eager")


def _check_glue(glue):
    if not callable(glue) and glue not in GLUE_MODES:
        raise ValueError(f"glue={glue!r}: one of {', '.join(GLUE_MODES)}, or a function glue(fn, *args)")
    return glue


class GlueState:
    """The compiled twins of the elementwise functions (made on first use) and the reason compiling them
    failed, if it did (then they run eagerly for the rest of the process). One instance: ``GLUE_STATE``;
    ``clear()`` forgets both, as a new process would."""

    __slots__ = ("compiled", "failed")

    def __init__(self):
        self.compiled: dict = {}
        self.failed: str | None = None

    def clear(self) -> None:
        self.compiled.clear()
        self.failed = None


GLUE_STATE = GlueState()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # normalize in float32 (bf16 autocast would lose precision in the mean of squares)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).type_as(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)


def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def _glue(fn, x: torch.Tensor, mode: str = "auto"):
    """``fn`` itself or its torch.compile'd twin, per the glue ``mode`` and the device of ``x``."""
    if torch.compiler.is_compiling():
        return fn
    if mode == "eager" or (mode == "auto" and x.device.type != "cuda") or GLUE_STATE.failed is not None:
        return fn
    c = GLUE_STATE.compiled.get(fn)
    if c is None:
        c = GLUE_STATE.compiled[fn] = torch.compile(fn, dynamic=False)
    return c


def _run_glue(glue, fn, *args):
    """``fn(*args)`` as ``glue`` says (a mode of ``GLUE_MODES``, or a function that runs it)."""
    if callable(glue):
        return glue(fn, *args)
    f = _glue(fn, args[0], glue)
    if f is fn:
        return fn(*args)
    try:
        return f(*args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing compiler must not stop training
        GLUE_STATE.failed = repr(e)
        warnings.warn(f"mxtrain: torch.compile of the elementwise layers failed ({type(e).__name__}: "
                      f"{str(e)[:200]}); running them eagerly (glue='eager' or MXTRAIN_GLUE=eager skips the "
                      f"attempt)", RuntimeWarning, stacklevel=2)
        return fn(*args)


def set_glue(module: nn.Module, glue) -> None:
    """Make every glue-running module inside ``module`` (a ``Llama``, a ``Block``, a list of blocks) run its
    elementwise pieces as ``glue`` says (``GLUE_MODES``, or a function ``glue(fn, *args)``)."""
    _check_glue(glue)
    for m in module.modules():
        if isinstance(m, (RMSNorm, Attention, FeedForward)):
            m.glue = glue


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, glue="auto"):
        super().__init__()
        self.eps = eps
        self.glue = _check_glue(glue)
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _run_glue(self.glue, _rms_norm, x, self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, D/2) for rotary embeddings with base ``theta``; ``scaling``: Llama 3.1's frequency
    scaling ``(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)`` (Meta's Llama 3.1
    reference code, ``apply_scaling``; Hugging Face's ``rope_type: "llama3"``): wavelengths longer than
    ``original / low_freq_factor`` are stretched by ``factor``, those shorter than ``original / high_freq_factor``
    kept, those between interpolated."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling:
        factor, low, high, old = scaling
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = torch.where(medium, smoothed, scaled)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    ang = torch.outer(t, inv)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, glue="auto") -> torch.Tensor:
    """x: (B, H, T, D); rotate pairs (x[..., :D/2], x[..., D/2:]) (the HF/Llama "rotate_half" layout); ``glue``:
    how it runs (``GLUE_MODES`` or a function ``glue(fn, *args)``)."""
    return _run_glue(glue, _rope, x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, glue="auto"):
        super().__init__()
        self.glue = _check_glue(glue)   # (of RoPE)
        C, D = cfg.dim, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, D
        b = bool(cfg.qkv_bias or cfg.attention_bias)
        self.wq = nn.Linear(C, cfg.n_heads * D, bias=b, device=device)
        self.wk = nn.Linear(C, cfg.n_kv_heads * D, bias=b, device=device)
        self.wv = nn.Linear(C, cfg.n_kv_heads * D, bias=b, device=device)
        self.wo = nn.Linear(cfg.n_heads * D, C, bias=bool(cfg.attention_bias), device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)     # (B, G, T, D)
        v = self.wv(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.glue), apply_rope(k, cos, sin, self.glue)
        if self.n_kv != self.n_heads and q.device.type == "cuda":
            # GQA inside the attention kernel: each K/V head serves n_heads / n_kv query heads
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if self.n_kv != self.n_heads:  # the same sharing as explicit copies (CPU kernels)
                rep = self.n_heads // self.n_kv
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)         # (B, H, T, D)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x) (with biases on all three where ``mlp_bias``: Llama's)."""

    def __init__(self, cfg: ModelConfig, device=None, glue="auto"):
        super().__init__()
        self.glue = _check_glue(glue)   # (of SwiGLU)
        b = bool(cfg.mlp_bias)
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=b, device=device)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=b, device=device)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=b, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_run_glue(self.glue, _swiglu, self.w1(x), self.w3(x)))


class Router(nn.Module):
    """The gate of a mixture of experts: ``(N, C) -> (N, E)`` logits. Not an ``nn.Linear``, so ``convert`` keeps it
    in high precision (as it keeps Hugging Face's MoE routers)."""

    def __init__(self, dim: int, n_experts: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Experts(nn.Module):
    """``E`` SwiGLU experts as two fused weights in the layout of ``transformers``' experts modules (Mixtral's
    ``MixtralExperts``): ``gate_up_proj`` ``(E, 2 F, C)`` with the gate rows first, ``down_proj`` ``(E, C, F)``.
    Plain PyTorch (``F.linear`` per expert); ``mxtrain.convert`` finds it by that layout and swaps it for an MX
    experts module after the model is built, as it swaps ``nn.Linear`` layers."""

    # the layout flags of transformers' experts modules (what ``convert`` checks before it converts one)
    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True
    has_post_expert_norm, _is_expert_parallel = False, False

    def __init__(self, cfg: ModelConfig, device=None):
        super().__init__()
        E, C, F_ = cfg.n_experts, cfg.dim, cfg.hidden_dim
        self.num_experts = E
        self.act_fn = F.silu
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, C, device=device))
        self.down_proj = nn.Parameter(torch.empty(E, C, F_, device=device))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from .._experts import experts_forward  # startup (it makes a torch.compiler.disable'd function: dynamo)
        return experts_forward(self, hidden_states, top_k_index, top_k_weights, _plain_gemm)


def _plain_gemm(x: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    return F.linear(x, weight)


class MoEFeedForward(nn.Module):
    """A mixture of SwiGLU experts with Mixtral's routing: softmax of the router's logits in float32, the
    ``top_k`` largest kept and renormalized to sum to 1, each token's output the weighted sum of its experts'.

    ``aux_loss`` (set by a forward that records gradients, else None): Switch Transformers' load-balancing loss
    ``E * sum_e f_e P_e`` with ``f_e`` the share of the ``N * top_k`` token-to-expert assignments that went to
    expert ``e`` and ``P_e`` its mean router probability (1 when the load is even; ``Llama`` adds
    ``router_aux_coef`` times its mean over blocks to the training loss). ``experts``: a factory
    ``experts(cfg, device)`` of the experts module (default ``Experts``)."""

    def __init__(self, cfg: ModelConfig, device=None, experts: Callable | None = None):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = Router(cfg.dim, cfg.n_experts, device)
        # ``experts(cfg, device)``: a module called as ``experts(hidden (N, C), top_k_index, top_k_weights)``
        self.experts = (experts or Experts)(cfg, device)
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(h).float(), dim=-1)              # (N, E)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = self.experts(h, idx, w.to(h.dtype))
        if torch.is_grad_enabled():
            E = probs.shape[-1]
            with torch.no_grad():
                share = torch.zeros(E, device=h.device).index_add_(
                    0, idx.reshape(-1), torch.ones(idx.numel(), device=h.device)) / idx.numel()
            self.aux_loss = E * (share * probs.mean(dim=0)).sum()
        else:
            self.aux_loss = None
        return out.reshape(shape)


class Block(nn.Module):
    """Pre-norm attention and SwiGLU feed-forward with residuals.

    Activation checkpointing comes from outside, as two optional functions (None: none, the default):

    * ``checkpoint(block, fn, *args)``: full checkpointing. When gradients are recorded the block's forward is
      ``checkpoint(self, self._block, x, cos, sin)``, which must return ``fn(*args)`` and may keep only the inputs
      and run ``fn`` again in the backward (``torch.utils.checkpoint``).
    * ``ffn_checkpoint(block, fn, x)``: the same for the feed-forward and its norm alone (selective
      checkpointing), used where ``checkpoint`` is not.

    They get the block so that they can reach what it holds (a quantized layer's random-input state, say).
    ``mxtrain.train.parallel.apply_ac`` sets both for mxtrain's trainer (``train.checkpoint_blocks``,
    ``train.recompute_ffn``), aware of MX layers; the model itself knows nothing of them.
    """

    def __init__(self, cfg: ModelConfig, device=None, *, glue="auto", checkpoint: Callable | None = None,
                 ffn_checkpoint: Callable | None = None, experts: Callable | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, glue)
        self.attention = Attention(cfg, device, glue)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device, glue)
        self.feed_forward = (MoEFeedForward(cfg, device, experts) if cfg.n_experts
                             else FeedForward(cfg, device, glue))
        self.checkpoint = checkpoint
        self.ffn_checkpoint = ffn_checkpoint

    def _ffn(self, x):
        return self.feed_forward(self.ffn_norm(x))

    # the flags blocks had before ``checkpoint`` / ``ffn_checkpoint``: refused rather than ignored
    def _gone(self, on, name="checkpoint_block"):
        raise AttributeError(f"Block.{name} is gone: the model applies no checkpointing of its own; call "
                             f"mxtrain.train.parallel.apply_ac(model, checkpoint_blocks=..., recompute_ffn=...) "
                             f"(MX-aware), or give the block checkpoint= / ffn_checkpoint= functions")

    checkpoint_block = property(lambda self: self.checkpoint is not None, _gone)
    recompute_ffn = property(lambda self: self.ffn_checkpoint is not None,
                             lambda self, on: self._gone(on, "recompute_ffn"))

    def forward(self, x, cos, sin):
        if self.checkpoint is not None and torch.is_grad_enabled():
            return self.checkpoint(self, self._block, x, cos, sin)
        return self._block(x, cos, sin)

    def _block(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.ffn_checkpoint is not None and self.checkpoint is None:
            return x + self.ffn_checkpoint(self, self._ffn, x)
        return x + self._ffn(x)


class Llama(nn.Module):
    """Decoder-only transformer. ``forward(idx (B, T) int64, targets=None) -> logits (B, T, V)`` or, with
    targets, the mean cross-entropy loss (float32 scalar; a mixture of experts in training mode adds its
    load-balancing loss, ``ModelConfig.router_aux_coef``).

    Options (keyword only; none reads a setting or knows a number format): ``glue`` how RMSNorm, RoPE and
    SwiGLU run (``GLUE_MODES``: "auto", the default, compiles them on CUDA; or a function ``glue(fn, *args)``);
    ``checkpoint`` and ``ffn_checkpoint`` each block's activation checkpointing (``Block``; default none);
    ``experts`` the factory ``experts(cfg, device)`` of a mixture of experts' experts module (default
    ``Experts``)."""

    def __init__(self, cfg: ModelConfig, device=None, *, glue="auto", checkpoint: Callable | None = None,
                 ffn_checkpoint: Callable | None = None, experts: Callable | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, device=device)
        self.layers = nn.ModuleList(Block(cfg, device, glue=glue, checkpoint=checkpoint,
                                          ffn_checkpoint=ffn_checkpoint, experts=experts)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, device, glue)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, device=device)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if str(device) != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) everywhere; output projections (wo, w2, the experts' down_proj) scaled by 1/sqrt(2 * n_layers)
        (GPT-2); norms to 1, biases (``qkv_bias``, ``attention_bias``, ``mlp_bias``) to 0. Pass a ``generator``
        for an init independent of the global RNG."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight", "down_proj")):
                p.normal_(0.0, out_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)

    def rope(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables for ``T`` positions: cached on the module when eager; recomputed inside a compiled
        graph (a few tiny ops), because a tensor a graph stores on the module is one of its outputs, which CUDA
        graphs (``mode="reduce-overhead"``) overwrite at the next replay."""
        if torch.compiler.is_compiling():
            return rope_tables(self.cfg.head_dim, T, self.cfg.rope_theta, device, self.cfg.rope_scaling)
        key = (T, str(device))
        if getattr(self, "_rope_key", None) != key:
            self._rope = rope_tables(self.cfg.head_dim, T, self.cfg.rope_theta, device, self.cfg.rope_scaling)
            self._rope_key = key
        return self._rope

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        cos, sin = self.rope(T, idx.device)
        x = self.embed_tokens(idx)                       # (B, T, C)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))               # (B, T, V)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if self.cfg.n_experts and self.cfg.router_aux_coef and self.training and torch.is_grad_enabled():
            aux = [b.feed_forward.aux_loss for b in self.layers]
            loss = loss + self.cfg.router_aux_coef * torch.stack(aux).mean()
        return loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

