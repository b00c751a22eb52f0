"""What a training step can reach on a GPU, counted: ``mxtrain bench limits`` (runs anywhere, no GPU).

A whole training step (the model of ``mxtrain bench step``) is split into what a recipe changes and what it
does not:

* the linear layers' GEMMs (Fprop, Dgrad, Wgrad of every block projection), the only part a recipe speeds up;
* the head's three GEMMs, which stay in BF16 (``convert`` keeps the head in high precision), and causal
  attention (BF16 in every recipe);
* the bytes the fast path's quantize passes move for the recipe's MXFP4 operands (the FP8-carrier path on
  Hopper, eager or compiled into the graph: each activation read once for its two operands, layers reading one
  input sharing it, dY likewise, each weight twice; X's Wgrad operand where the setting ``wgrad_x`` puts it for
  the layer's width: kept as the GEMM's carrier, kept as FP4 codes and rebuilt as a carrier before its GEMM, or
  quantized from X in the backward), or of the ``fp8`` and ``nvfp4`` recipes'
  quantize passes as their code stands (``reference_bytes``); blocks a recipe keeps in BF16 count as BF16;
* everything else (embedding, norms, RoPE, SwiGLU, loss, the optimizer): taken from a measured BF16 step as
  its time minus its GEMM and attention time at the measured rates (``--bf16-step-ms``), or left out;
* under FSDP2 on several GPUs (``--gpus``, ``fsdp_traffic``): the bytes each GPU's collectives move in a step
  (every parameter all-gathered in the forward and again in the backward, every gradient reduce-scattered), and
  what they cost at a link rate (``Rates.link_gbs``) if nothing overlapped them with compute: a floor on the
  efficiency per GPU that the links alone allow.

With GEMM rates and a memory bandwidth (defaults: an H100's, measured, BENCHMARKS.md), the ideal step time of
each recipe is ``other + linear GEMMs at the recipe's rate + head + attention + quantize bytes / bandwidth``:
a ceiling no kernel work can pass at the given rates. The counts are exact for the model's shapes (FLOPs
checked against ``torch.utils.flop_counter`` in the tests); the times are the rates' consequences, not
measurements.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import settings
from ..errors import UserError
from ..numerics.formats import get_format
from ..numerics import recipes as R

__all__ = ["Rates", "linear_shapes", "flops", "quantize_bytes", "reference_bytes", "fsdp_traffic", "limits",
           "format_table"]


@dataclass(frozen=True)
class Rates:
    """Throughputs of one GPU. Defaults: an H100 80GB HBM3 as measured in BENCHMARKS.md (2026-11-24/25):
    BF16 GEMM 697-750 TFLOP/s and the FP8-carrier MXFP4 GEMM 1214-1267 TFLOP/s at the Llama-8B shapes (a
    middle value of each), FP8 tensorwise 1245-1282; a bf16 copy of a 14336 x 4096 tensor in 83.4 us (2.82
    TB/s) and the quantize kernels at 85-90 % of it; causal flash attention is assumed at half the BF16 GEMM
    rate (not measured here)."""

    bf16_tflops: float = 720.0
    fp8_tflops: float = 1265.0
    mx_carrier_tflops: float = 1240.0
    copy_tbs: float = 2.82
    quantize_of_copy: float = 0.87
    attention_tflops: float = 360.0
    link_gbs: float = 450.0   # GB/s a GPU's collectives move each way: NVLink 4's 900 GB/s (both ways), not measured


def linear_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, out_features N, in_features K) of one block's linear layers."""
    D, hd = cfg.dim, cfg.head_dim
    return [("wq", cfg.n_heads * hd, D), ("wk", cfg.n_kv_heads * hd, D), ("wv", cfg.n_kv_heads * hd, D),
            ("wo", D, cfg.n_heads * hd), ("w1", cfg.hidden_dim, D), ("w3", cfg.hidden_dim, D),
            ("w2", D, cfg.hidden_dim)]


def flops(cfg, batch: int, seq: int, layers: int | None = None) -> dict:
    """FLOPs of one training step (forward + backward) by part: ``linear`` (the blocks' projections,
    3 GEMMs each), ``head`` (3 GEMMs), ``attention`` (causal: half of QK^T and PV; backward 2.5x forward,
    as FlashAttention counts it)."""
    L = layers if layers is not None else cfg.n_layers
    M = batch * seq
    lin = sum(3 * 2 * M * n * k for _, n, k in linear_shapes(cfg)) * L
    head = 3 * 2 * M * cfg.dim * cfg.vocab_size
    attn_fwd = 2 * 2 * batch * cfg.n_heads * seq * seq * cfg.head_dim / 2   # QK^T and PV, causal half
    return {"linear": lin, "head": head, "attention": attn_fwd * 3.5 * L}


def _mx_blocks(recipe, n_blocks: int) -> int:
    """Blocks ``convert`` quantizes: all but the recipe's ``keep_first`` and ``keep_last`` (``nvfp4`` keeps one
    of each in BF16)."""
    return max(0, n_blocks - recipe.keep_first - recipe.keep_last)


def _is_mx(recipe, name: str) -> bool:
    return recipe.operand(name).fmt == "mxfp4"


def quantize_bytes(recipe, cfg, batch: int, seq: int, layers: int | None = None,
                   weight_bytes: int = 4, act_bytes: int = 2, wgrad_x_for=None) -> dict:
    """Bytes the fast path's quantize passes read and write in one step for ``recipe`` (0 for BF16 operands):
    ``activations`` (X: read once for its Fprop and Wgrad operands, layers reading one input share it; the Fprop
    operand an FP8 carrier, 1.03 bytes an element; the Wgrad operand, when both of its GEMM's operands are
    MXFP4, where ``wgrad_x_for(in_features)`` puts it: ``carrier`` 1.03 bytes, ``forward`` FP4 codes and scales
    0.53, ``backward`` a second pass in the backward reading X again and writing its carrier),
    ``wgrad_rebuild`` (``forward``'s codes read and carrier written before the Wgrad GEMM), ``grads`` (dY: read
    once, a carrier for each MXFP4 GEMM that takes it), ``weights`` (each MXFP4 weight operand read in
    ``weight_bytes`` and written as a carrier). ``wgrad_x_for``: default the current settings'
    (``Settings.wgrad_x_for``). Blocks the recipe keeps in high precision (``keep_first``, ``keep_last``) are not
    counted."""
    if wgrad_x_for is None:
        wgrad_x_for = settings.current().wgrad_x_for
    L = _mx_blocks(recipe, layers if layers is not None else cfg.n_layers)
    M = batch * seq
    car, codes = 1 + 4 / 128, 0.5 + 1 / 32          # carrier + its float32 group scales; codes + E8M0 scales
    shapes = linear_shapes(cfg)
    inputs = {("wq", "wk", "wv"): cfg.dim, ("wo",): cfg.n_heads * cfg.head_dim, ("w1", "w3"): cfg.dim,
              ("w2",): cfg.hidden_dim}
    fx, wx = _is_mx(recipe, "fprop_x"), _is_mx(recipe, "wgrad_x") and _is_mx(recipe, "wgrad_dy")
    act = rebuild = grads = weights = 0.0
    for _, K in inputs.items():
        n = M * K
        where = wgrad_x_for(K) if wx else None
        if fx or where in ("carrier", "forward"):      # the forward's pass: X read once for what it makes there
            act += n * (act_bytes + (car if fx else 0) + {"carrier": car, "forward": codes}.get(where, 0))
        if where == "forward":
            rebuild += n * (codes + car)
        elif where == "backward":                      # X read again in the backward for its Wgrad carrier
            act += n * (act_bytes + car)
    gd, gw = _is_mx(recipe, "dgrad_dy") and _is_mx(recipe, "dgrad_w"), wx
    for _, N, K in shapes:
        n = M * N
        if gd or gw:
            grads += n * (act_bytes + car * (int(gd) + int(gw)))
        w = N * K
        for a, b in (("fprop_x", "fprop_w"), ("dgrad_dy", "dgrad_w")):
            if _is_mx(recipe, a) and _is_mx(recipe, b):
                weights += w * (weight_bytes + car)
    return {k: v * L for k, v in (("activations", act), ("wgrad_rebuild", rebuild), ("grads", grads),
                                  ("weights", weights))}


def _fmt_kind(recipe, name: str) -> str:
    op = recipe.operand(name)
    return get_format(op.fmt).kind if op.quantized else "none"


def reference_bytes(recipe, cfg, batch: int, seq: int, layers: int | None = None,
                    weight_bytes: int = 4, act_bytes: int = 2) -> dict | None:
    """Bytes the quantize passes of the per-tensor ``fp8`` recipe (its custom op: ``tensorfp8``,
    ``kernels/fp8cast.py``; eager, or compiled with ``fp8_traced=off``; the traced default fuses its casts into
    other kernels, which this does not model) or of
    ``nvfp4`` (the factored path, ``kernels/nvfp4.py``) read and write in one step as the code stands; None
    for other recipes. Every layer quantizes its own input (no sharing between layers reading one tensor).

    * ``fp8``, per element: X an amax pass (read) and a cast (read, 1-byte write), its codes transposed for
      Wgrad (1 + 1); dY likewise; W (the float32 master) quantized for Fprop and again for Dgrad, plus its Dgrad
      codes transposed. The GEMMs write their bf16 output themselves.
    * ``nvfp4``, per element: an operand an amax pass and one kernel pass writing bf16 values, a 16-wide
      rotation (Wgrad's X and dY) done inside both passes; another rotation size first made float32 and rotated
      in torch (counted as one read and write of float32), then the two passes from float32; W for Fprop and
      Dgrad. ``outputs``: each GEMM's
      float32 output multiplied by the tensor scales, then cast (Y and dX to bf16; dW stays float32).
    Blocks the recipe keeps in high precision are not counted."""
    kinds = {_fmt_kind(recipe, n) for n in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")}
    L = _mx_blocks(recipe, layers if layers is not None else cfg.n_layers)
    M = batch * seq
    mk = sum(M * k for _, _, k in linear_shapes(cfg))
    mn = sum(M * n for _, n, _ in linear_shapes(cfg))
    nk = sum(n * k for _, n, k in linear_shapes(cfg))
    if kinds == {"tensor"}:
        per = {"activations": mk * (2 * act_bytes + 1 + 2), "grads": mn * (2 * act_bytes + 1 + 2),
               "weights": nk * (2 * (2 * weight_bytes + 1) + 2), "outputs": 0.0}
    elif kinds == {"nvfp4"}:
        plain = lambda b: 2 * b + 2                       # noqa: E731  amax read, kernel read, bf16 write
        def op(gemm: str) -> int:   # one operand of ``gemm``, per element
            r = recipe.rotation(gemm)
            if not r.enabled or r.size == 16:              # no rotation, or H16 inside the kernel's two passes
                return plain(act_bytes)
            return act_bytes + 4 + 8 + plain(4)            # to float32, the rotation in torch, then from float32
        per = {"activations": mk * (op("fprop") + op("wgrad")),
               "grads": mn * (op("dgrad") + op("wgrad")),
               "weights": nk * 2 * plain(weight_bytes),
               # Y and dX: the float32 write, the scale pass (read, write), the cast's read (its bf16 write, BF16
               # pays too); dW: the scale pass
               "outputs": (mn + mk) * (4 + 8 + 4) + nk * 8}
    else:
        return None
    return {k: float(v) * L for k, v in per.items()}


def fsdp_traffic(cfg, gpus: int, layers: int | None = None, param_bytes: float = 2, reduce_bytes: float = 4,
                 reshard_after_forward: bool = True) -> dict:
    """Bytes each GPU receives in one FSDP2 step (``train.parallel.apply_fsdp2``'s defaults), every collective a
    ring over ``gpus`` GPUs in which each GPU receives (and sends) ``(gpus - 1) / gpus`` of the whole tensor:
    ``all_gather_forward`` (every parameter in ``param_bytes``: bf16 under the mixed-precision policy; about 1.03
    for MX weights gathered as their quantized operands, ``parallel.gather=quantized``), ``all_gather_backward``
    (again, where blocks free their gathered weights after the forward), ``reduce_scatter`` (every gradient in
    ``reduce_bytes``, float32 by default). ``params``: the model's parameter count (``layers`` blocks).
    ``all_gather_backward`` leaves out the last block, which keeps its gathered weights from its forward to its
    backward (they are needed again at once)."""
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    c = cfg if layers is None else type(cfg)(**{**cfg.to_dict(), "n_layers": layers})
    P = c.num_params()
    with_layers = lambda n: type(c)(**{**c.to_dict(), "n_layers": n}).num_params()   # noqa: E731
    block = with_layers(2) - with_layers(1)      # one block's parameters
    share = (gpus - 1) / gpus
    out = {"params": P, "all_gather_forward": share * P * param_bytes,
           "all_gather_backward": share * (P - block) * param_bytes if reshard_after_forward else 0.0,
           "reduce_scatter": share * P * reduce_bytes}
    out["total"] = out["all_gather_forward"] + out["all_gather_backward"] + out["reduce_scatter"]
    return out


def _gemm_rate(recipe, rates: Rates) -> float:
    """TFLOP/s of the linear layers' GEMMs: the carrier's where all three GEMMs are MXFP4, else a
    FLOP-weighted mix (BF16 for the GEMMs that are not)."""
    pairs = (("fprop_x", "fprop_w"), ("dgrad_dy", "dgrad_w"), ("wgrad_dy", "wgrad_x"))
    n_mx = sum(_is_mx(recipe, a) and _is_mx(recipe, b) for a, b in pairs)
    if recipe.name == "fp8":
        return rates.fp8_tflops
    return 3 / (n_mx / rates.mx_carrier_tflops + (3 - n_mx) / rates.bf16_tflops)


def limits(cfg, batch: int, seq: int, recipes: list[str], rates: Rates = Rates(), layers: int | None = None,
           bf16_step_ms: float | None = None, gpus: int = 1, one_gpu_step_ms: float | None = None) -> dict:
    """Counts and ideal times per recipe (milliseconds). ``other_ms``: a measured BF16 step minus its
    GEMMs and attention at ``rates`` (None without ``bf16_step_ms``); ``ceiling_ms``: the fastest step the
    recipe can run at ``rates`` (needs ``other_ms``). ``gpus`` > 1: ``fsdp`` holds each GPU's collective traffic in
    a step of ``batch`` x ``seq`` tokens a GPU (``fsdp_traffic``), its time at ``rates.link_gbs``, and the
    efficiency per GPU a step of T ms keeps with none of it overlapped, T / (T + that time): for each recipe's
    ceiling (``fsdp_floor``; the fastest step, so the lowest floor) and for ``one_gpu_step_ms``, a measured step
    on one GPU."""
    fl = flops(cfg, batch, seq, layers)
    ms = lambda f, tf: f / (tf * 1e12) * 1e3   # noqa: E731
    head_ms, attn_ms = ms(fl["head"], rates.bf16_tflops), ms(fl["attention"], rates.attention_tflops)
    bf16_lin_ms = ms(fl["linear"], rates.bf16_tflops)
    other = None if bf16_step_ms is None else bf16_step_ms - bf16_lin_ms - head_ms - attn_ms
    if other is not None and not other > -1e-9 * abs(bf16_step_ms):   # else negative ceilings and ratios
        raise UserError(f"--bf16-step-ms {bf16_step_ms:g} is shorter than the BF16 step's GEMMs, head and attention "
                        f"alone at these rates ({bf16_lin_ms + head_ms + attn_ms:.1f} ms): give the measured BF16 "
                        f"step of this model, batch and sequence (mxtrain bench step), or the GPU's --rates")
    bw = rates.copy_tbs * rates.quantize_of_copy * 1e12
    out = {"flops": fl, "tokens": batch * seq, "rates": asdict(rates), "head_ms": head_ms, "attention_ms": attn_ms,
           "other_ms": other, "recipes": {}}
    for name in recipes:
        if name.startswith("torchao-"):
            rec_ms = {"linear_gemm_ms": ms(fl["linear"], rates.fp8_tflops), "quantize_bytes": None,
                      "quantize_ms": None}
        else:
            if not R.is_name(name):
                raise UserError(f"unknown recipe {name!r}; choose from {', '.join(R.names())} or torchao-tensorwise")
            r = R.get(name)
            qb = reference_bytes(r, cfg, batch, seq, layers)
            if qb is None:
                qb = quantize_bytes(r, cfg, batch, seq, layers)
            nb = layers if layers is not None else cfg.n_layers
            share = _mx_blocks(r, nb) / nb if nb else 0.0    # kept blocks' GEMMs run at BF16's rate
            lin_ms = (ms(fl["linear"] * share, _gemm_rate(r, rates) if r.quantized else rates.bf16_tflops)
                      + ms(fl["linear"] * (1 - share), rates.bf16_tflops))
            rec_ms = {"linear_gemm_ms": lin_ms,
                      "quantize_bytes": qb, "quantize_ms": (sum(qb.values()) / bw * 1e3) if qb else None}
        fixed = rec_ms["linear_gemm_ms"] + head_ms + attn_ms + (rec_ms["quantize_ms"] or 0.0)
        rec_ms["ceiling_ms"] = None if other is None else other + fixed
        rec_ms["ceiling_vs_bf16"] = None if other is None else bf16_step_ms / rec_ms["ceiling_ms"]
        out["recipes"][name] = rec_ms
    if one_gpu_step_ms is not None and not (one_gpu_step_ms > 0 and one_gpu_step_ms < float("inf")):
        raise UserError(f"--one-gpu-step-ms must be a positive number of milliseconds (a measured step), "
                        f"got {one_gpu_step_ms:g}")
    if gpus > 1:
        tr = fsdp_traffic(cfg, gpus, layers)
        comm = tr["total"] / (rates.link_gbs * 1e9) * 1e3
        floor = lambda t: t / (t + comm)   # noqa: E731
        out["fsdp"] = {"gpus": gpus, "bytes_per_gpu": tr, "comm_ms": comm,
                       "one_gpu_step_ms": one_gpu_step_ms,
                       "floor_measured": None if one_gpu_step_ms is None else floor(one_gpu_step_ms)}
        for r in out["recipes"].values():
            r["fsdp_floor"] = None if r["ceiling_ms"] is None else floor(r["ceiling_ms"])
    elif one_gpu_step_ms is not None:
        raise UserError("--one-gpu-step-ms is the one-GPU step that --gpus N (2 or more) is judged against: give --gpus")
    return out


def format_table(res: dict) -> str:
    f = res["flops"]
    lines = [f"step of {res['tokens']} tokens: linear {f['linear'] / 1e12:.1f} TFLOP, head {f['head'] / 1e12:.1f}, "
             f"attention {f['attention'] / 1e12:.1f}; head {res['head_ms']:.1f} ms, attention "
             f"{res['attention_ms']:.1f} ms" + ("" if res["other_ms"] is None else
                                                f", everything else {res['other_ms']:.1f} ms (from the BF16 step)"),
             f"{'recipe':<22}{'linear GEMMs ms':>16}{'quantize GB':>13}{'quantize ms':>13}{'ceiling ms':>12}"
             f"{'vs BF16':>9}"]
    for name, r in res["recipes"].items():
        qb = r["quantize_bytes"]
        gb = "-" if qb is None else f"{sum(qb.values()) / 1e9:.1f}"
        qm = "-" if r["quantize_ms"] is None else f"{r['quantize_ms']:.1f}"
        cm = "-" if r["ceiling_ms"] is None else f"{r['ceiling_ms']:.1f}"
        cv = "-" if r["ceiling_vs_bf16"] is None else f"{r['ceiling_vs_bf16']:.3f}x"
        lines.append(f"{name:<22}{r['linear_gemm_ms']:>16.1f}{gb:>13}{qm:>13}{cm:>12}{cv:>9}")
    fs = res.get("fsdp")
    if fs:
        b = fs["bytes_per_gpu"]
        lines.append(f"FSDP2 on {fs['gpus']} GPUs ({b['params'] / 1e9:.2f} B parameters): each GPU receives "
                     f"{b['total'] / 1e9:.2f} GB a step (all-gathers {b['all_gather_forward'] / 1e9:.2f} + "
                     f"{b['all_gather_backward'] / 1e9:.2f}, reduce-scatter {b['reduce_scatter'] / 1e9:.2f}), "
                     f"{fs['comm_ms']:.1f} ms at {res['rates']['link_gbs']:g} GB/s")
        floors = [f"{n} {r['fsdp_floor']:.1%}" for n, r in res["recipes"].items() if r.get("fsdp_floor") is not None]
        if floors:
            lines.append("  efficiency per GPU with none of it overlapped, at each ceiling: " + ", ".join(floors))
        if fs["floor_measured"] is not None:
            lines.append(f"  at the measured one-GPU step of {fs['one_gpu_step_ms']:g} ms: {fs['floor_measured']:.1%}")
    return "\n".join(lines)
