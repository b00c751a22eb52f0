"""``mxtrain bench experts``: one mixture-of-experts layer's forward + backward, eager, at Mixtral 8x7B's expert
shapes (8 experts, hidden 4,096, expert width 14,336, top-2; ``--batch`` x ``--seq`` tokens routed at random, every
token to ``top_k`` distinct experts, in blocks of 16 tokens that share their experts, so that every expert's group
of tokens is a multiple of 16 long, as torchao's FP8 grouped GEMM requires): Hugging Face's ``MixtralExperts`` in
bf16 with its ``grouped_mm`` experts (``torch.nn.functional.grouped_mm``, what ``transformers`` runs on a GPU by
default) and with its ``eager`` loop; the ``grouped_mm`` experts with torchao's FP8 rowwise grouped GEMM (its MoE
training's, ``_to_fp8_rowwise_then_scaled_grouped_mm``: the FP8 MoE a user would pick on Hopper; when torchao is
installed) in place of each of the two grouped GEMMs; then the same module converted by ``mxtrain.convert`` per
recipe, once through the per-expert loop (``experts_grouped=off``) and once as the dispatcher chooses (``auto``:
the grouped MX experts path where it applies), with the path each took (``MXExperts.mx_experts_path``). Every
variant runs on the same weights, tokens, routing and output gradient, in one process; times are
``triton.testing.do_bench`` medians (``time_fn``), ratios against the ``grouped_mm`` row.

The torchao row calls torchao's function from ``transformers``' own experts forward (its grouped-GEMM helper
replaced for the row), and counts the calls: a row where torchao's GEMM did not run both projections fails
instead of timing BF16 under torchao's name.

``measure`` is the device-independent part (the CPU tests run it on tiny shapes with a stand-in timer)."""

from __future__ import annotations

import copy
import sys
from unittest import mock

import torch
import torch.nn as nn

from .. import settings as _settings
from ..errors import UserError
from ..linear.module import convert

MIXTRAL_EXPERTS = {"experts": 8, "hidden": 4096, "width": 14336, "top_k": 2}   # Mixtral 8x7B (its config.json)
TORCHAO_ROW = "torchao fp8 rowwise grouped_mm"
ALIGN = 16   # tokens a routing block: torchao 0.18's FP8 grouped GEMM needs group sizes divisible by 16


class _Holder(nn.Module):
    """The experts module as a child, so that ``convert`` swaps it as it swaps a model's."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


def hf_experts(experts: int, hidden: int, width: int, top_k: int, device, dtype) -> nn.Module:
    """``transformers``' ``MixtralExperts`` of these sizes (its initialization), or UserError without
    transformers."""
    try:
        from transformers import MixtralConfig  # optional
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # optional
    except ImportError:
        raise UserError("bench experts times Hugging Face's MixtralExperts: pip install transformers") from None
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=width, num_local_experts=experts,
                        num_experts_per_tok=top_k)
    torch.manual_seed(0)
    with torch.device(device):   # (made on the device: Mixtral's experts are 5.6 GiB in float32)
        m = MixtralExperts(cfg)
    with torch.no_grad():   # (the module allocates its weights uninitialized: small normal values, as HF inits)
        for p in m.parameters():
            p.normal_(0.0, cfg.initializer_range)
    return m.to(dtype=dtype)


def routing(tokens: int, experts: int, top_k: int, device, seed: int = 0,
            align: int = ALIGN) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, top_k_weights)`` of ``tokens`` tokens each sent to ``top_k`` distinct experts drawn at random
    (the weights a softmax of random logits over the chosen), as a router's top-k gives them; consecutive blocks
    of ``align`` tokens share their experts, so that with ``tokens`` a multiple of ``align`` every expert receives
    a multiple of ``align`` tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-tokens // align)
    idx = torch.rand(blocks, experts, generator=g).argsort(dim=1)[:, :top_k].repeat_interleave(align, dim=0)[:tokens]
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=1)
    return idx.to(device), w.to(device)


def torchao_grouped_mm():
    """torchao's FP8 rowwise grouped GEMM as ``transformers``' grouped-GEMM helper takes it (``(input, weight,
    offs)``, weight ``(E, K, N)`` column-major per expert), or None without torchao's MoE training."""
    try:
        from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm as ao_mm  # optional
    except ImportError:
        return None

    def grouped_mm(input, weight, offs):
        return ao_mm(input.to(weight.dtype), weight, offs, out_dtype=weight.dtype,
                     pad_token_groups_for_grouped_mm=False)
    return grouped_mm


def _hf_moe():
    from transformers.integrations import moe  # optional
    return moe


def measure(presets: list[str], tokens: int, shape: dict, device, dtype, time_fn) -> dict:
    """The variants' forward + backward times (``time_fn(fn)``, ms) on one set of weights and inputs; see the
    module's docstring. Returns ``{"shape", "tokens", "ms": {variant: ms}, "vs_grouped_mm": {...}, "path":
    {variant: "grouped" | "loop"}}``; a variant that fails is kept as ``{"error": ...}`` under ``errors``."""
    E, H, top_k = shape["experts"], shape["hidden"], shape["top_k"]
    base = hf_experts(E, H, shape["width"], top_k, device, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(tokens, H, generator=g).to(device=device, dtype=dtype)
    idx, w = routing(tokens, E, top_k, device)
    w = w.to(dtype)
    res = {"shape": dict(shape), "tokens": tokens, "ms": {}, "vs_grouped_mm": {}, "path": {}, "errors": {}}

    def call(m):
        def f():
            x.grad = None
            for p in m.parameters():
                p.grad = None
            m(x, idx, w).backward(dy)
        return f

    for impl in ("grouped_mm", "eager"):
        m = copy.deepcopy(base)
        m.config._experts_implementation = impl
        try:
            res["ms"][f"bf16 {impl}"] = time_fn(call(m))
        except Exception as e:  # noqa: BLE001 - the other rows still measure
            res["errors"][f"bf16 {impl}"] = repr(e)[:300]
        del m
    peer = torchao_grouped_mm()
    if peer is not None:
        m = copy.deepcopy(base)
        m.config._experts_implementation = "grouped_mm"
        calls = [0]

        def counted(*a, **k):
            calls[0] += 1
            return peer(*a, **k)
        try:
            with mock.patch.object(_hf_moe(), "_grouped_mm", counted):
                f = call(m)
                f()
                if calls[0] != 2:
                    raise RuntimeError(f"torchao's grouped GEMM ran {calls[0]} times in one forward + backward of "
                                       "transformers' experts, not 2 (gate_up and down): this transformers "
                                       "version does not call its grouped-GEMM helper; no torchao row")
                res["ms"][TORCHAO_ROW] = time_fn(f)
        except Exception as e:  # noqa: BLE001
            res["errors"][TORCHAO_ROW] = repr(e)[:300]
        del m
    for p in presets:
        holder = _Holder(copy.deepcopy(base))
        convert(holder, p, strict=True)
        m = holder.experts
        for mode in ("off", "auto"):
            key = f"{p} {'loop' if mode == 'off' else 'auto'}"
            try:
                with _settings.override(experts_grouped=mode):
                    res["ms"][key] = time_fn(call(m))
                res["path"][key] = m.mx_experts_path
            except Exception as e:  # noqa: BLE001
                res["errors"][key] = repr(e)[:300]
        del holder, m
    ref = res["ms"].get("bf16 grouped_mm")
    for k, v in res["ms"].items():
        res["vs_grouped_mm"][k] = ref / v if ref else None
    return res


def format_table(res: dict) -> str:
    s = res["shape"]
    lines = [f"one MoE layer's experts, forward + backward (eager): {s['experts']} experts, hidden {s['hidden']}, "
             f"width {s['width']}, top-{s['top_k']}, {res['tokens']} tokens", "",
             "| variant | ms | speed vs bf16 grouped_mm | path |", "|---|---|---|---|"]
    for k, v in res["ms"].items():
        r = res["vs_grouped_mm"].get(k)
        lines.append(f"| {k} | {v:.3f} | {f'{r:.3f}x' if r else '-'} | {res['path'].get(k, '')} |")
    for k, e in res["errors"].items():
        lines.append(f"| {k} | failed: {e[:120]} | | |")
    return "\n".join(lines)


def bench_experts(args, time_fn) -> dict:
    """``mxtrain bench experts``: ``measure`` on the GPU at Mixtral's expert shapes, ``--batch`` x ``--seq``
    tokens, the recipes of ``--presets`` (default ``mxfp4-all-dh16``)."""
    presets = [p.strip() for p in (args.presets or "mxfp4-all-dh16").split(",") if p.strip()]
    res = measure(presets, args.batch * args.seq, MIXTRAL_EXPERTS, "cuda", torch.bfloat16, time_fn)
    print(format_table(res), flush=True)
    for k, e in res["errors"].items():
        print(f"bench experts: {k} failed: {e}", file=sys.stderr, flush=True)
    return {"experts": res}
