"""Hugging Face model folders in and out of mxtrain's ``Llama``: names, configs, weights, safetensors.

``config_from_hf(hf_dir)`` reads a local Hugging Face Llama folder's ``config.json`` into mxtrain's
``ModelConfig``, and ``load_hf_llama(model, hf_dir)`` copies its weights into an mxtrain ``Llama`` built with
that config (``llama_from_hf`` both: continued pretraining, ``train.init_from``). Mistral folders (no sliding
window shorter than the sequences: the same computation), Qwen2 folders (q/k/v biases: ``ModelConfig.qkv_bias``)
and Llama folders with ``attention_bias`` / ``mlp_bias`` (``ModelConfig.attention_bias``, ``mlp_bias``) load too,
and a model loaded from one exports back as its type (``ModelConfig.hf_model_type``). A mixture of experts
(``ModelConfig.n_experts``) is a Mixtral both ways: mxtrain's routing is Mixtral's (``MoEFeedForward``), and its
fused experts are Mixtral's per-expert weights stacked (``hf_state_dict``). The way out: ``hf_name`` /
``hf_state_dict`` (mxtrain's parameter names and tensors as Hugging Face's), ``hf_config`` (a ``config.json``),
``save_safetensors``; ``mxtrain.interop.export`` writes whole folders from run folders with them. Nothing is
downloaded, and nothing in a folder is executed: safetensors files are read by the small reader below (a JSON
header and raw bytes), a ``pytorch_model.bin`` only with ``torch.load(weights_only=True)``.

Layouts match without any permutation: mxtrain's RoPE rotates the halves ``(x[..., :D/2], x[..., D/2:])`` of
each head (``mxtrain.model.apply_rope``), which is Hugging Face Llama's ``rotate_half`` convention, with the
same frequencies ``theta ** (-2i / D)``; RMSNorm, SwiGLU (``w1`` = ``gate_proj``, ``w3`` = ``up_proj``,
``w2`` = ``down_proj``) and grouped-query attention (query head ``h`` uses key/value head
``h // (n_heads / n_kv_heads)``) are the same computations.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from pathlib import Path

import torch

from ..errors import UserError
from .llama import Llama, ModelConfig
from .._io import write_atomic

__all__ = ['load_hf_llama', 'config_from_hf', 'llama_from_hf', 'hf_name', 'hf_state_dict', 'hf_config', 'save_safetensors', 'load_safetensors']


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


_BLOCK_MAP = {  # mxtrain name inside a block -> Hugging Face name inside model.layers.N
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",      # (qkv_bias: Qwen2)
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",      # (attention_bias: Llama's, with q/k/v)
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w1.bias": "mlp.gate_proj.bias",      # (mlp_bias: Llama's)
    "feed_forward.w3.bias": "mlp.up_proj.bias",
    "feed_forward.w2.bias": "mlp.down_proj.bias",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


_TOP_MAP = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}


# A mixture of experts in Mixtral's names, as transformers saves a MixtralForCausalLM (and as Mixtral's own
# checkpoints are): the router ``block_sparse_moe.gate.weight`` (E, C); per expert e ``block_sparse_moe.experts.e.w1``
# (gate, (F, C)), ``w3`` (up, (F, C)) and ``w2`` (down, (C, F)). mxtrain keeps the experts fused as transformers 5
# does in memory (``model.Experts``): ``gate_up_proj[e]`` is w1 over w3 (gate rows first), ``down_proj[e]`` is w2.
# Reading takes that fused layout under transformers 5's module names too (``mlp.gate.weight``,
# ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``).
_MOE_ROUTER, _MOE_GATE_UP, _MOE_DOWN = ("feed_forward.router.weight", "feed_forward.experts.gate_up_proj",
                                        "feed_forward.experts.down_proj")


def hf_name(name: str) -> str:
    """The Hugging Face ``LlamaForCausalLM`` (``MistralForCausalLM``, ``Qwen2ForCausalLM``) parameter name of
    mxtrain ``Llama`` parameter ``name``."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _BLOCK_MAP:
        return f"model.layers.{m.group(1)}.{_BLOCK_MAP[m.group(2)]}"
    if m and m.group(2) == _MOE_ROUTER:
        return f"model.layers.{m.group(1)}.block_sparse_moe.gate.weight"
    raise KeyError(name)   # (also the fused experts: one tensor per expert, ``hf_state_dict``)


def hf_state_dict(state_dict: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder holding the mxtrain ``Llama`` of ``cfg`` whose ``state_dict`` this is:
    Hugging Face names (``hf_name``), a tied head left out, fused experts split into Mixtral's per-expert weights
    (views, no copies)."""
    out = {}
    F_ = cfg.hidden_dim
    for name, t in state_dict.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # tied: transformers re-ties lm_head to the embedding
        m = _LAYER.fullmatch(name)
        if m and m.group(2) in (_MOE_GATE_UP, _MOE_DOWN):
            base = f"model.layers.{m.group(1)}.block_sparse_moe.experts"
            for e in range(t.shape[0]):
                if m.group(2) == _MOE_GATE_UP:
                    out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = t[e, :F_], t[e, F_:]
                else:
                    out[f"{base}.{e}.w2.weight"] = t[e]
        else:
            out[hf_name(name)] = t
    return out


def _hf_sources(name: str, cfg: ModelConfig) -> list[list[tuple[str, tuple | None]]]:
    """Where mxtrain parameter ``name`` comes from in a Hugging Face folder: the layouts it may be stored in, each
    a list of (Hugging Face name, the part of the parameter it fills: an index, or None for all of it)."""
    m = _LAYER.fullmatch(name)
    if not m or m.group(2) not in (_MOE_ROUTER, _MOE_GATE_UP, _MOE_DOWN):
        return [[(hf_name(name), None)]]
    i, key = m.group(1), m.group(2)
    legacy, fused = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
    if key == _MOE_ROUTER:
        return [[(f"{legacy}.gate.weight", None)], [(f"{fused}.gate.weight", None)]]
    E, F_ = cfg.n_experts, cfg.hidden_dim
    if key == _MOE_GATE_UP:
        per = [(f"{legacy}.experts.{e}.{w}.weight", (e, rows)) for e in range(E)
               for w, rows in (("w1", slice(0, F_)), ("w3", slice(F_, 2 * F_)))]
        return [per, [(f"{fused}.experts.gate_up_proj", None)]]
    return [[(f"{legacy}.experts.{e}.w2.weight", (e,)) for e in range(E)], [(f"{fused}.experts.down_proj", None)]]


def _has_bias(cfg: ModelConfig, key: str) -> bool:
    """Whether block parameter ``key`` (a ``_BLOCK_MAP`` key) is in a model of ``cfg``."""
    if not key.endswith(".bias"):
        return True
    if key.startswith("feed_forward."):
        return bool(cfg.mlp_bias)
    if key == "attention.wo.bias":
        return bool(cfg.attention_bias)
    return bool(cfg.qkv_bias or cfg.attention_bias)


def _expected_names(cfg: ModelConfig) -> list[str]:
    names = ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    moe = ("feed_forward.router.weight", "feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")
    for i in range(cfg.n_layers):
        names += [f"layers.{i}.{k}" for k in _BLOCK_MAP if _has_bias(cfg, k)
                  and not (cfg.n_experts and k.startswith("feed_forward."))]
        names += [f"layers.{i}.{k}" for k in (moe if cfg.n_experts else ())]   # (run folders only: no HF names)
    return names


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


for _n, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _n):
        _ST_DTYPES[getattr(torch, _n)] = _code


_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def save_safetensors(path: str | Path, tensors: dict[str, torch.Tensor],
                     metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (CPU, any shapes; no two may share storage) as a safetensors file, atomically."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    order = sorted(tensors)
    for name in order:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise UserError(f"cannot write tensor {name} of dtype {t.dtype} as safetensors")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)   # the data starts 8-byte aligned

    def write(f):
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for name in order:
            t = tensors[name].detach().to("cpu").contiguous()
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    write_atomic(Path(path), write, "")


def load_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file. The tensors are CPU copy-on-write views of a memory map of
    the file (nothing is read until used). A damaged or crafted file is one ``UserError``."""
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise UserError(f"cannot read {p}: {e.strerror or e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) < 8:
            raise UserError(f"{p}: not a safetensors file (too short)")
        n = int.from_bytes(raw, "little")
        if n > min(size - 8, 100 << 20):
            raise UserError(f"{p}: not a safetensors file (header of {n:,} bytes in a {size:,}-byte file)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise UserError(f"{p}: not a safetensors file (header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise UserError(f"{p}: not a safetensors file (header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        data_len = size - 8 - n
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    out = {}
    for name, d in header.items():
        try:
            dtype = _ST_TORCH[d["dtype"]]
            shape = [int(s) for s in d["shape"]]
            begin, end = (int(x) for x in d["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{p}: tensor {name!r} has an unknown dtype or a malformed entry ({str(d)[:80]})") from None
        numel = 1
        for s in shape:
            if s < 0:
                raise UserError(f"{p}: tensor {name!r} has a negative dimension")
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_len or end - begin != numel * itemsize:
            raise UserError(f"{p}: tensor {name!r} does not fit the file (offsets {begin}..{end} for {numel} "
                            f"values of {d['dtype']}; {data_len} data bytes): the file is damaged or truncated")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(mm, dtype=dtype, count=numel, offset=8 + n + begin).view(shape)
    return out, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def _rope_parameters(mcfg: ModelConfig) -> dict:
    if not mcfg.rope_scaling:
        return {"rope_type": "default", "rope_theta": mcfg.rope_theta}
    factor, low, high, old = mcfg.rope_scaling
    return {"rope_type": "llama3", "rope_theta": mcfg.rope_theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": int(old)}


def hf_config(mcfg: ModelConfig, eot_id: int | None, dtype: str = "float32") -> dict:
    """The ``config.json`` of a ``LlamaForCausalLM`` computing exactly what mxtrain's ``Llama(mcfg)`` does (a
    ``MistralForCausalLM`` without sliding window or a ``Qwen2ForCausalLM`` without sliding window, as
    ``mcfg.hf_model_type`` says: a model loaded from such a folder goes back as one). The RoPE base is given both
    as transformers 5's ``rope_parameters`` and as the older ``rope_theta``.

    A mixture of experts (``n_experts``) is a ``MixtralForCausalLM`` (no sliding window, no router jitter): its
    routing is mxtrain's (softmax in float32, top-k renormalized; ``MoEFeedForward``). Its
    ``router_aux_loss_coef`` (weight of the load-balancing loss transformers adds when asked for router logits;
    it changes no logits) is ``router_aux_coef / top_k``: transformers' loss is ``E * sum_e f_e P_e`` with ``f_e``
    counted per token rather than per assignment, ``top_k`` times mxtrain's, and pools the layers instead of
    averaging them. Refused (``UserError``): a mixture of experts with attention biases, which no Mixtral has."""
    mt = mcfg.hf_model_type
    if mcfg.n_experts:
        if mcfg.qkv_bias or mcfg.attention_bias:
            what = "q/k/v biases (Qwen2)" if mcfg.qkv_bias else "attention_bias"
            raise UserError(f"a mixture of experts with {what} cannot be exported: the Hugging Face mixture of "
                            f"experts mxtrain writes is a Mixtral, whose attention has no biases")
        mt = "mixtral"
    own = {   # what each architecture's config has beyond the shared fields
        "llama": {"attention_bias": bool(mcfg.attention_bias), "mlp_bias": bool(mcfg.mlp_bias), "pretraining_tp": 1},
        "mistral": {"sliding_window": None},
        "qwen2": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": mcfg.n_layers,
                  "layer_types": ["full_attention"] * mcfg.n_layers},
        "mixtral": {"sliding_window": None, "num_local_experts": mcfg.n_experts, "num_experts_per_tok": mcfg.top_k,
                    "router_aux_loss_coef": mcfg.router_aux_coef / mcfg.top_k, "router_jitter_noise": 0.0,
                    "output_router_logits": False},
    }[mt]
    return {
        "architectures": [_HF_ARCHS[mt]],
        "model_type": mt,
        "vocab_size": mcfg.vocab_size,
        "hidden_size": mcfg.dim,
        "intermediate_size": mcfg.hidden_dim,
        "num_hidden_layers": mcfg.n_layers,
        "num_attention_heads": mcfg.n_heads,
        "num_key_value_heads": mcfg.n_kv_heads,
        "head_dim": mcfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": mcfg.max_seq_len,
        "initializer_range": mcfg.init_std,
        "rms_norm_eps": mcfg.norm_eps,
        "rope_theta": mcfg.rope_theta,
        "rope_parameters": _rope_parameters(mcfg),
        **({"rope_scaling": _rope_parameters(mcfg)} if mcfg.rope_scaling else {}),   # (transformers 4's key)
        **own,
        "attention_dropout": 0.0,
        "tie_word_embeddings": mcfg.tie_embeddings,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _read_hf_config(hf_dir: Path) -> dict:
    p = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise UserError(f"Hugging Face model folder not found: {hf_dir} (a local folder with config.json and "
                        f"model.safetensors; nothing is downloaded)")
    try:
        cfg = json.loads(p.read_text())
    except OSError:
        raise UserError(f"{hf_dir} is not a Hugging Face model folder (no readable config.json)") from None
    except ValueError as e:
        raise UserError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{p}: expected a JSON object")
    return cfg


# Every field of a foreign config.json that mxtrain reads, with the type it must have: checked in one place
# (``_check_hf_types``) before any is used, so that a string "false" is not a true value and a null or a string in a
# number's place is one line naming the field, not a traceback. ``None`` after the kind: a null means "absent".
_POS_INT, _POS_NUM, _NUM, _BOOL, _STR, _DICT, _STRS = ("a positive integer", "a positive finite number",
                                                       "a finite number", "true or false", "a string", "an object",
                                                       "a list of strings")


_HF_FIELDS = {
    "model_type": (_STR, None), "architectures": (_STRS, None),
    "hidden_size": (_POS_INT,), "intermediate_size": (_POS_INT,), "num_hidden_layers": (_POS_INT,),
    "num_attention_heads": (_POS_INT,), "vocab_size": (_POS_INT,),
    "num_key_value_heads": (_POS_INT, None), "head_dim": (_POS_INT, None),
    "max_position_embeddings": (_POS_INT, None),
    "hidden_act": (_STR,), "attention_bias": (_BOOL,), "mlp_bias": (_BOOL,), "tie_word_embeddings": (_BOOL,),
    "rope_theta": (_POS_NUM,), "partial_rotary_factor": (_POS_NUM,), "rms_norm_eps": (_POS_NUM,),
    "initializer_range": (_NUM,),
    "rope_parameters": (_DICT, None), "rope_scaling": (_DICT, None),
    "num_local_experts": (_POS_INT,), "num_experts_per_tok": (_POS_INT,),   # (Mixtral's)
    "router_aux_loss_coef": (_NUM,), "router_jitter_noise": (_NUM,),
}


_HF_ROPE_FIELDS = {   # inside rope_parameters / rope_scaling
    "rope_type": (_STR,), "type": (_STR,), "rope_theta": (_POS_NUM,), "partial_rotary_factor": (_POS_NUM,),
    "factor": (_POS_NUM,), "low_freq_factor": (_POS_NUM,), "high_freq_factor": (_POS_NUM,),
    "original_max_position_embeddings": (_POS_NUM,),
}


def _hf_type_ok(kind: str, v) -> bool:
    if kind == _BOOL:
        return isinstance(v, bool)
    if kind == _STR:
        return isinstance(v, str)
    if kind == _DICT:
        return isinstance(v, dict)
    if kind == _STRS:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if kind == _POS_INT:
        return isinstance(v, int) and v > 0
    return math.isfinite(v) and (v > 0 or kind == _NUM)


def _check_hf_types(c: dict, where: Path) -> None:
    """Refuse (one ``UserError`` naming each field, its value and what it must be) any field of a Hugging Face
    ``config.json`` that mxtrain reads (``_HF_FIELDS``, and ``_HF_ROPE_FIELDS`` inside the RoPE objects) whose
    value has the wrong type; an absent field takes its default later."""
    bad = []

    def check(table: dict, obj: dict, prefix: str) -> None:
        for key, (kind, *nullable) in table.items():
            if key not in obj or (nullable and obj[key] is None):
                continue
            v = obj[key]
            if not _hf_type_ok(kind, v):
                try:
                    shown = json.dumps(v)
                except (ValueError, RecursionError):
                    shown = f"a {type(v).__name__}"
                shown = shown if len(shown) <= 40 else shown[:37] + "..."
                bad.append(f"{prefix}{key} is {shown}, expected {kind}{' or null' if nullable else ''}")

    check(_HF_FIELDS, c, "")
    for k in ("rope_parameters", "rope_scaling"):
        if isinstance(c.get(k), dict):
            check(_HF_ROPE_FIELDS, c[k], f"{k}.")
    if bad:
        raise UserError(f"{where}: {'; '.join(bad)}")


def config_from_hf(hf_dir: str | Path, vocab_multiple: int = 1, max_seq_len: int | None = None) -> ModelConfig:
    """mxtrain's ``ModelConfig`` for a local Hugging Face Llama, Mistral, Qwen2 or Mixtral folder (its ``config.json``).

    ``vocab_multiple``: round the vocab up to this multiple (the trainer pads its vocab to 32 for MX blocks;
    ``load_hf_llama`` fills the extra rows' embedding and head weights with zeros). ``max_seq_len``: the
    longest sequence the model will see (the run's ``data.seq_len``), when above ``max_position_embeddings``.
    Refused with a ``UserError``: another model type, or a feature mxtrain's model does not compute (RoPE
    scaling other than Llama 3.1's ``llama3``, another activation, a head size other than hidden_size / heads,
    a Mistral or Qwen2 sliding window shorter than the longest sequence, ``attention_bias`` / ``mlp_bias``
    outside a Llama config). A Qwen2 model's q/k/v biases are ``qkv_bias``; a Llama's ``attention_bias`` (q/k/v
    and output projection) and ``mlp_bias`` (gate/up/down) are ``attention_bias`` and ``mlp_bias``; the model
    type is ``hf_model_type`` (what an export writes back).

    A Mixtral is a mixture of experts: ``num_local_experts`` is ``n_experts``, ``num_experts_per_tok`` ``top_k``,
    ``intermediate_size`` each expert's width, and ``router_aux_coef`` is ``top_k * router_aux_loss_coef``
    (transformers' load-balancing loss is ``top_k`` times mxtrain's, ``hf_config``). Its ``router_jitter_noise``
    (noise transformers puts on the block's input in training only) changes no logits and is not applied in
    mxtrain's training. Absent fields take transformers' defaults for the type (a Mixtral's RoPE base 1e6, epsilon
    1e-5, 8 experts, 2 a token). Refused besides: fewer than 2 experts, or more experts a token than experts.
    """
    hf_dir = Path(hf_dir)
    c = _read_hf_config(hf_dir)
    where = hf_dir / "config.json"
    _check_hf_types(c, where)
    mt = _hf_model_type(c, where)
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    miss = [k for k in need if k not in c]
    if miss:
        raise UserError(f"{where}: missing {', '.join(miss)} (each a positive integer)")
    bad = []
    if c.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {c['hidden_act']!r} (mxtrain's feed-forward is SwiGLU with silu)")
    for k in ("attention_bias", "mlp_bias"):   # Llama's (ModelConfig.attention_bias, mlp_bias); others ignore them
        if c.get(k) and mt != "llama":
            bad.append(f"{k} true (a Llama config's field: transformers' {_HF_NAMES[mt]} has no such biases)")
    mixtral = mt == "mixtral"
    moe = {}
    if mixtral:
        E, k = c.get("num_local_experts", 8), c.get("num_experts_per_tok", 2)
        coef = c.get("router_aux_loss_coef", 0.001)
        if E < 2:
            bad.append(f"num_local_experts {E} (mxtrain's mixture of experts has at least 2)")
        elif k > E:
            bad.append(f"num_experts_per_tok {k} above num_local_experts {E}")
        if coef < 0:
            bad.append(f"router_aux_loss_coef {coef} below 0")
        moe = dict(n_experts=E, top_k=k, router_aux_coef=k * float(coef))
    rp, rs = c.get("rope_parameters"), c.get("rope_scaling")
    rtype = (rp or {}).get("rope_type") or (rp or {}).get("type") or "default"
    if rs:
        rtype = rs.get("rope_type") or rs.get("type") or rtype
    scaling = ()
    if rtype == "llama3":   # Llama 3.1 / 3.2's frequency scaling (model.rope_tables)
        src = {**(rp or {}), **(rs or {})}
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        vals = [src.get(k) for k in keys]
        wrong = [k for k, v in zip(keys, vals) if isinstance(v, bool) or not isinstance(v, (int, float))
                 or not math.isfinite(v) or v <= 0]
        if wrong:
            bad.append(f"RoPE scaling 'llama3' without a positive number for {', '.join(wrong)}")
        elif vals[2] <= vals[1]:
            bad.append("RoPE scaling 'llama3' with high_freq_factor not above low_freq_factor")
        else:
            scaling = tuple(float(v) for v in vals)
    elif rtype != "default":
        bad.append(f"RoPE scaling {rtype!r} (mxtrain computes the plain RoPE and Llama 3.1's 'llama3' scaling)")
    theta = (rp or {}).get("rope_theta", c.get("rope_theta", 1e6 if mixtral else 10000.0))   # (transformers' defaults)
    if (rp or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append("partial_rotary_factor (mxtrain rotates the whole head)")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    hd = c.get("head_dim")
    if hd is not None and heads and hd * heads != hidden:
        bad.append(f"head_dim {hd} x {heads} heads != hidden_size {hidden} (mxtrain's head size is dim / heads)")
    longest = int(c.get("max_position_embeddings") or (4096 * 32 if mixtral else 2048))
    if max_seq_len is not None:
        longest = max(longest, int(max_seq_len))
    window = _sliding_window(c, mt, where)
    if window is not None and window < longest:
        bad.append(f"sliding_window {window} below the longest sequence, {longest} tokens (mxtrain's attention sees "
                   f"every earlier position; a window at least as long as the sequences computes the same)")
    if bad:
        raise UserError(f"{where}: this {_HF_NAMES[mt]} uses what mxtrain's model does not compute: {'; '.join(bad)}")
    vocab = c["vocab_size"]
    m = max(1, int(vocab_multiple))
    eps = c.get("rms_norm_eps", 1e-5 if mixtral else 1e-6)
    try:
        return ModelConfig(dim=hidden, n_layers=c["num_hidden_layers"], n_heads=heads,
                           n_kv_heads=c.get("num_key_value_heads") or heads, ffn_dim=c["intermediate_size"],
                           vocab_size=m * -(-vocab // m), max_seq_len=longest,
                           rope_theta=float(theta), rope_scaling=scaling, norm_eps=float(eps),
                           tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                           init_std=float(c.get("initializer_range", 0.02)), qkv_bias=mt == "qwen2",
                           attention_bias=mt == "llama" and bool(c.get("attention_bias", False)),
                           mlp_bias=mt == "llama" and bool(c.get("mlp_bias", False)), hf_model_type=mt, **moe)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


_HF_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "mixtral": "MixtralForCausalLM"}


_HF_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "mixtral": "Mixtral"}


def _hf_model_type(c: dict, where: Path) -> str:
    """``llama``, ``mistral``, ``qwen2`` or ``mixtral``: the config's model_type, else its architectures'; else a
    UserError."""
    mt, arch = c.get("model_type"), c.get("architectures") or []
    if mt in _HF_ARCHS:
        return mt
    for t, a in _HF_ARCHS.items():
        if isinstance(arch, list) and a in arch:
            return t
    shown = ", ".join(map(str, arch)) if isinstance(arch, list) else str(arch)
    raise UserError(f"{where}: model_type {mt!r} ({shown or 'no architectures'}) is not a Llama, Mistral, Qwen2 or "
                    f"Mixtral; mxtrain loads these model types only")


def _sliding_window(c: dict, mt: str, where: Path) -> int | None:
    """The attention window of a Mistral, Mixtral or Qwen2 config (None: full causal attention). Mistral's and
    Mixtral's ``sliding_window`` applies when it is set; Qwen2's only with ``use_sliding_window: true`` (transformers
    ignores it otherwise)."""
    if mt == "llama":
        return None
    if mt == "qwen2":
        use = c.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise UserError(f"{where}: use_sliding_window is {json.dumps(use)[:40]}, expected true or false")
        if not use:
            return None
    w = c.get("sliding_window")
    if w is None:
        return None
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        raise UserError(f"{where}: sliding_window is {json.dumps(w)[:40]}, expected a positive integer or null")
    return w


def _weight_files(hf_dir: Path) -> list[Path]:
    from ..data.loader import bare_name  # startup
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        ip = hf_dir / index
        if ip.is_file():
            try:
                wm = json.loads(ip.read_text())["weight_map"]
                files = sorted(set(wm.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{ip}: not a valid weight index ({e})") from None
            for f in files:
                if not isinstance(f, str) or not bare_name(f):
                    raise UserError(f"{ip}: weight file {f!r} is not a plain file name inside the folder")
                if not (hf_dir / f).is_file():
                    raise UserError(f"{ip}: weight file {f} is missing")
            return [hf_dir / f for f in files]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (hf_dir / name).is_file():
            return [hf_dir / name]
    raise UserError(f"{hf_dir} holds no weights (no model.safetensors, model.safetensors.index.json or "
                    f"pytorch_model.bin)")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.name.endswith(".safetensors"):
        return load_safetensors(path)[0]
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - a pickle with code, a truncated zip...
        raise UserError(f"{path}: cannot read it as plain tensors ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    if not isinstance(sd, dict):
        raise UserError(f"{path}: not a state dict")
    return sd


@torch.no_grad()
def load_hf_llama(model: Llama, hf_dir: str | Path) -> dict:
    """Copy a local Hugging Face Llama (Mistral, Qwen2, Mixtral) folder's weights into the mxtrain ``model`` (built
    from a matching ``ModelConfig``, e.g. ``config_from_hf(hf_dir, 32)``; plain or already converted to MX layers,
    before any DDP / FSDP2 wrapping). Returns ``{"tensors", "hf_vocab", "padded_rows", "source"}``.

    The shapes must match: a differing width, depth, head count, key/value heads, FFN size, expert count or
    experts a token, RoPE base or norm epsilon is one ``UserError`` naming each difference. A Mixtral's experts
    come per expert (``block_sparse_moe.experts.E.w1/w2/w3``, as transformers saves them) or fused (transformers
    5's ``mlp.experts.gate_up_proj`` / ``down_proj``). The model's vocab may exceed the folder's
    (padding to a multiple of 32): the extra rows of the embedding and the head are set to zero. Weights are
    cast to the model's dtype. Missing or unexpected tensors are refused by name.
    """
    hf_dir = Path(hf_dir)
    mcfg = getattr(model, "cfg", None)
    if not isinstance(mcfg, ModelConfig) or not hasattr(model, "layers"):
        raise UserError(f"load_hf_llama needs an mxtrain Llama model, got {type(model).__name__}")
    hcfg = config_from_hf(hf_dir, max_seq_len=mcfg.max_seq_len)
    diffs = []
    for ours, theirs, label in (("dim", "dim", "hidden_size"), ("n_layers", "n_layers", "num_hidden_layers"),
                                ("n_heads", "n_heads", "num_attention_heads"),
                                ("n_kv_heads", "n_kv_heads", "num_key_value_heads"),
                                ("hidden_dim", "hidden_dim", "intermediate_size"),
                                ("rope_theta", "rope_theta", "rope_theta"),
                                ("rope_scaling", "rope_scaling", "rope scaling"), ("norm_eps", "norm_eps", "rms_norm_eps"),
                                ("tie_embeddings", "tie_embeddings", "tie_word_embeddings"),
                                ("qkv_bias", "qkv_bias", "q/k/v biases"),
                                ("attention_bias", "attention_bias", "attention_bias"),
                                ("mlp_bias", "mlp_bias", "mlp_bias"), ("n_experts", "n_experts", "num_local_experts")):
        a, b = getattr(mcfg, ours), getattr(hcfg, theirs)
        if a != b:
            diffs.append(f"{ours} {a} here, {label} {b} in the Hugging Face config")
    if mcfg.n_experts and hcfg.n_experts and mcfg.top_k != hcfg.top_k:
        diffs.append(f"top_k {mcfg.top_k} here, num_experts_per_tok {hcfg.top_k} in the Hugging Face config")
    if mcfg.vocab_size < hcfg.vocab_size:
        diffs.append(f"vocab_size {mcfg.vocab_size} here, smaller than vocab_size {hcfg.vocab_size} in the Hugging "
                     f"Face config")
    if diffs:
        raise UserError(f"{hf_dir} does not fit this model: {'; '.join(diffs)}; build the model from "
                        f"mxtrain.model.hf_io.config_from_hf({str(hf_dir)!r})")
    params = dict(model.named_parameters(remove_duplicate=False))
    want = {}      # Hugging Face name -> (mxtrain name, the part of it the tensor fills: an index or None)
    layouts = {}   # mxtrain name -> the layouts it may come in (``_hf_sources``)
    for name in _expected_names(mcfg):
        if name == "lm_head.weight" and mcfg.tie_embeddings:
            continue
        layouts[name] = _hf_sources(name, mcfg)
        for layout in layouts[name]:
            for key, index in layout:
                want[key] = (name, index)
    done: set[str] = set()
    unexpected = []
    for f in _weight_files(hf_dir):
        sd = _read_weights(f)
        for key, t in sd.items():
            if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and mcfg.tie_embeddings):
                continue  # buffers of old exports; a tied head saved anyway
            if key not in want:
                unexpected.append(key)
                continue
            name, index = want[key]
            p = params[name] if index is None else params[name][index]
            if not isinstance(t, torch.Tensor):
                raise UserError(f"{f}: {key} is not a tensor")
            shape = tuple(t.shape)
            if name in ("embed_tokens.weight", "lm_head.weight"):
                ok = len(shape) == 2 and shape[1] == p.shape[1] and shape[0] == hcfg.vocab_size
                if ok:
                    p[: shape[0]].copy_(t.to(p.dtype))
                    p[shape[0]:].zero_()
            else:
                ok = shape == tuple(p.shape)
                if ok:
                    p.copy_(t.to(p.dtype))
            if not ok:
                need = [hcfg.vocab_size, p.shape[1]] if name in ("embed_tokens.weight", "lm_head.weight") \
                    else list(p.shape)
                raise UserError(f"{f}: {key} has shape {list(shape)}, the model's {name} needs {need}")
            done.add(key)
        del sd
    if unexpected:
        raise UserError(f"{hf_dir}: tensors mxtrain's Llama does not have: {', '.join(sorted(unexpected)[:4])}"
                        f"{' ...' if len(unexpected) > 4 else ''}")
    missing = []
    for name, options in layouts.items():
        hit = [layout for layout in options if any(k in done for k, _ in layout)]
        if len(hit) > 1:
            raise UserError(f"{hf_dir}: {name} is given in two layouts ({hit[0][0][0]} and {hit[1][0][0]}); a folder "
                            f"holds one of them")
        missing += [k for k, _ in (hit or options)[0] if k not in done]
    missing.sort()
    if missing:
        raise UserError(f"{hf_dir}: missing weights {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    return {"tensors": len(done), "hf_vocab": hcfg.vocab_size, "padded_rows": mcfg.vocab_size - hcfg.vocab_size,
            "source": str(hf_dir)}


def llama_from_hf(hf_dir: str | Path, *, vocab_size: int | None = None, max_seq_len: int | None = None,
                  device: str | torch.device = "cpu", **options) -> Llama:
    """An mxtrain ``Llama`` with the shapes and weights of a local Hugging Face Llama folder (not converted to MX
    layers: ``convert`` it with a recipe, then wrap it for DDP / FSDP2, as the trainer does).

    ``vocab_size``: the training data's vocab (``TokenData.vocab_size``); refused when it exceeds the model's
    (the data was tokenized with another tokenizer). The model's vocab is the folder's, padded to a multiple of
    32 for MX blocks (zero rows). Their logits are 0, not minus infinity, so where the folder's vocab is not a
    multiple of 32 the imported model's loss over the padded vocab is above the Hugging Face model's until
    training lowers those logits (the real vocab's logits are the same; Llama 2 and 3, Mistral and Qwen2
    vocabularies are multiples of 32). ``max_seq_len``: at least this (the run's ``data.seq_len``). ``options``:
    ``Llama``'s options (``glue``, ``checkpoint``, ``ffn_checkpoint``, ``experts``)."""
    mcfg = config_from_hf(hf_dir, vocab_multiple=32, max_seq_len=max_seq_len)
    if vocab_size is not None and vocab_size > mcfg.vocab_size:
        raise UserError(f"the training data's vocab ({vocab_size:,} ids) is larger than the model's in {hf_dir} "
                        f"({mcfg.vocab_size:,}): tokenize the data with the model's tokenizer (mxtrain data prepare "
                        f"FILES --tokenizer {Path(hf_dir) / 'tokenizer.json'} --out DIR)")
    model = Llama(mcfg, device="meta", **options).to_empty(device=device)
    if mcfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_hf_llama(model, hf_dir)
    return model
