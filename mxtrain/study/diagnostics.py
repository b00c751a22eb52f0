"""Per-GEMM quantization diagnostics on sampled training steps (``--diagnose-every N``).

On a diagnosed step, a forward hook on every quantized ``MXLinear`` keeps the layer's input ``X``
and a copy of its weight ``W`` (first call of the step only), and a hook on the layer's output
keeps the incoming gradient ``dY``. After the backward pass, ``Diagnostics.end`` recomputes each
of the layer's three GEMMs with the reference quantizer, exactly as the layer did (same rotation
signs, same stochastic-rounding stream: the layer's ``Ctx`` for that step and call), and
against the same GEMM in float32, and appends one JSON row per (step, layer, GEMM) to
``diagnostics.jsonl``:

* per operand: ``sqnr_db`` (10 log10 of signal over quantization-error energy, measured in the
  rotated, prescaled domain the quantizer sees), ``clip_rate`` (elements whose ``|value / scale|``
  exceeded the element format's largest value, so they saturated), ``underflow_rate`` (nonzero
  inputs that quantized to 0, over nonzero inputs), ``scale_hist`` (histogram of block-scale
  exponents ``log2(scale)``: the E8M0 exponent for MX formats), and for weights
  ``scale_change_rate`` (fraction of blocks whose scale exponent changed since the previous
  diagnosed step: how often a block maximum crossed a power of two);
* per GEMM output (Fprop ``Y``, Dgrad ``dX``, Wgrad ``dW``): ``cos`` (cosine to the float32
  GEMM), ``rel_err`` (``||Q - H|| / ||H||``) and ``rel_bias`` (``<Q - H, H> / <H, H>``: the part
  of the error along the true output; negative means the quantized output is shrunk);
* ``impl_rel_diff``: ``||A - Q|| / ||Q||`` between what the layer actually produced in training
  (its output ``Y``, the gradient ``dX`` it passed back, the gradient ``dW`` its weight got; fast
  kernels or reference path) and the reference recomputation ``Q``. Only accumulation order and
  bf16 output rounding may differ (about 1e-3 under bf16 autocast); a large value means the path
  that trained is not computing the recipe;
* Wgrad only: ``err_corr_prev``: Pearson correlation between the weight-gradient quantization
  error ``dW_q - dW`` at this diagnosed step and at the previous one (on a fixed subsample of
  at most ``max_corr_elems`` entries per layer). Near 0: the error is fresh noise each step;
  near 1: the same structured error is applied again and again, so it accumulates in the weights;
* per operand, the error split (``error_split`` below, on the same values): ``split_bias``,
  ``split_gain_rounded``, ``split_flush_energy``, ``split_clip_energy``, ``split_systematic_energy``,
  ``split_noise_energy``.

``error_split(t, op)`` splits one operand's quantization error by where it comes from (a function, for
any tensor; each diagnosed operand's row holds it too): values flushed to zero, values saturated at the element's
largest value, and the values rounded onto the grid, whose error splits again into a systematic part (a
common relative gain, the least-squares ``g`` in ``q - x = g x + n``) and rounding noise ``n``.

With ``every = 0`` nothing is registered: no hooks, no overhead. Layers whose recipe quantizes
nothing are skipped, and so are fused MoE experts (``MXExperts``: their GEMMs run per expert inside one module,
out of reach of a layer's hooks; the rest of a mixture-of-experts model is diagnosed). Cost on a diagnosed step: a few extra GEMMs per layer, in float32.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

# the first layer's input needs no gradient; its full backward hook still gives us dY
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                        "to module outputs")

from ..linear.context import Ctx
from ..linear.module import MXLinear, mx_layers
from ..numerics.formats import get_format
from ..numerics.quant import E8M0_NAN, quantize, _unpad

from ..train.callbacks import Callback
from ..numerics.recipe import Operand

__all__ = ["Diagnostics", "DiagnosticsCallback", "operand_quantize", "gemm_diagnostics", "error_split", "load",
           "aggregate"]

# (gemm, operand A, A's quantization axis, operand B, B's axis); A/B name the tensors X, W, dY
_GEMMS = (
    ("fprop", ("fprop_x", "x", -1), ("fprop_w", "w", -1)),
    ("dgrad", ("dgrad_dy", "dy", -1), ("dgrad_w", "w", 0)),
    ("wgrad", ("wgrad_dy", "dy", 0), ("wgrad_x", "x", 0)),
)


def operand_quantize(ctx: Ctx, t: torch.Tensor, axis: int, name: str, gemm: str, signs):
    """Rotate and quantize one operand exactly like ``Ctx.operand``; also return stats.

    Returns ``(q, prescale, rotated, mx)``: ``q`` float32 quantized values (prescale not undone),
    ``rotated`` the float32 rotated (padded) high-precision operand, ``mx`` the ``MXTensor``
    (``None`` when the operand is not quantized).
    """
    r = ctx.rotate(t.to(torch.float32), axis, gemm, signs)
    mx = ctx.quantize(r, axis, name)
    if mx is None:
        return r, 1.0, r, None
    return mx.dequantize(torch.float32), mx.prescale, r, mx


def error_split(t: torch.Tensor, op, axis: int = -1, *, seed: int = 0, block_size=None) -> dict:
    """Where the quantization error of ``t`` as operand ``op`` comes from (reference quantizer; float64 sums).

    ``op``: an ``Operand`` (format, rounding, scale rule, prescale, 16x16 tiles) or a format name (round to
    nearest, ``floor``); ``axis``: the block axis; ``seed``: the stochastic-rounding seed; ``block_size``:
    instead of ``op``'s (tests: one block holding a whole hand-made set). The values compared
    are those the quantizer sees, ``x = t * prescale`` (float32), and their quantized values ``q``; elements that are
    not finite, or lie in a block that holds a NaN or an Inf (its values read back NaN), are left out
    (``n``: the elements counted). Every nonzero ``x`` is in exactly one set:

    * flushed: ``q == 0``; * saturated: ``|x| / scale`` above the element's largest value (``q`` is that
      value); * rounded: the rest.

    Returns a dict (None where a denominator is 0):

    * ``bias``: ``sum(sign(x) (q - x)) / sum(|x|)`` over all nonzero ``x``: the mean signed relative error
      weighted by ``|x|`` (negative: values shrink toward zero on average, as E2M1's "shrinkage bias" of
      arXiv 2606.20381; flushed values count -1 each). On data uniform over whole cells of the grid (between
      neighbouring grid values) it is 0 on every grid, E2M1 included: each cell's errors cancel. E2M1 shrinks
      where a block's data ends inside one of its wide top cells ([4, 6): all of [4, 5) rounds down),
      where the density falls within its wide cells, and by saturation (tests/study/test_error_split.py);
    * ``flush_rate``, ``clip_rate``: flushed and saturated elements over nonzero ones;
    * ``error_energy``: ``sum((q - x)**2) / sum(x**2)`` (1 / SQNR), the sum of four shares of the signal energy:
      ``flush_energy`` (``sum(x**2)`` over the flushed), ``clip_energy`` (the saturated elements' squared
      errors), ``systematic_energy`` (``g**2 sum(x**2)`` over the rounded set, with ``g = sum((q - x) x) /
      sum(x**2)`` there, reported as ``gain_rounded``: the least-squares relative gain, negative for shrinkage)
      and ``noise_energy`` (``sum((q - x - g x)**2)`` over the rounded set, orthogonal to ``x`` there).
    """
    if isinstance(op, str):
        op = Operand(op)
    x32 = t.detach().to(torch.float32)
    bs = op.block_size if block_size is None else block_size
    mx = quantize(x32, op.fmt, axis=axis, block_size=bs, rounding=op.rounding,
                  scale_rule=op.scale_rule, seed=seed, prescale=op.prescale)
    x = x32 * op.prescale if op.prescale != 1.0 else x32   # (as the quantizer multiplies, in float32)
    if not mx.fmt.quantized:
        return _split(x, x, None)
    return _split(x, mx.dequantize(torch.float32), mx)


def _split(x: torch.Tensor, q: torch.Tensor, mx) -> dict:
    """``error_split``'s numbers from the values the quantizer saw (``x``), their quantized values (``q``,
    prescale not undone) and the ``MXTensor`` (None: not quantized)."""
    x, q = x.double(), q.double()
    if mx is None:
        scale, top = torch.ones_like(x), float("inf")
    else:
        scale = _unpad(mx.scale_values(), mx.shape, mx.axis).double()
        top = mx.fmt.elem.max
    ok = torch.isfinite(x) & torch.isfinite(q)
    nz = ok & (x != 0)
    e = torch.where(ok, q - x, torch.zeros_like(x))
    x0 = torch.where(ok, x, torch.zeros_like(x))
    flushed = nz & (q == 0)
    clipped = nz & ~flushed & (x.abs() > top * scale)
    rounded = nz & ~flushed & ~clipped
    sig = float((x0 * x0).sum())
    absx = float(x0.abs().sum())
    n_nz = int(nz.sum())

    def frac(a, b):
        return a / b if b > 0 else None

    xr = torch.where(rounded, x0, torch.zeros_like(x0))
    er = torch.where(rounded, e, torch.zeros_like(e))
    sr = float((xr * xr).sum())
    g = float((er * xr).sum()) / sr if sr > 0 else 0.0
    noise = er - g * xr
    return {
        "n": int(ok.sum()),
        "bias": frac(float((torch.sign(x0) * e).sum()), absx),
        "gain_rounded": g if sr > 0 else None,
        "flush_rate": frac(int(flushed.sum()), n_nz),
        "clip_rate": frac(int(clipped.sum()), n_nz),
        "error_energy": frac(float((e * e).sum()), sig),
        "flush_energy": frac(float((x0 * x0)[flushed].sum()), sig),
        "clip_energy": frac(float((e * e)[clipped].sum()), sig),
        "systematic_energy": frac(g * g * sr, sig),
        "noise_energy": frac(float((noise * noise).sum()), sig),
    }


# the error split's numbers in each diagnostics row's operand stats (``split_<name>``)
SPLIT_KEYS = ("bias", "gain_rounded", "flush_energy", "clip_energy", "systematic_energy", "noise_energy")


def _operand_stats(q: torch.Tensor, p: float, r: torch.Tensor, mx, axis: int) -> dict:
    sig = float((r.double() ** 2).sum())
    err = float(((q.double() / p - r.double()) ** 2).sum())
    nz = r != 0
    n_nz = int(nz.sum())
    st = {
        "sqnr_db": (10 * math.log10(sig / err) if err > 0 and sig > 0 else None),
        "underflow_rate": (float(((q == 0) & nz).sum()) / n_nz if n_nz else 0.0),
    }
    f = mx.fmt
    sv = mx.scale_values()  # padded, axis-last
    rm = r.movedim(axis, -1) * p if p != 1.0 else r.movedim(axis, -1)
    pads = []
    for d in (-1, -2)[: rm.ndim]:
        pads += [0, sv.shape[d] - rm.shape[d]]
    rm = torch.nn.functional.pad(rm, pads)
    ok = torch.isfinite(sv) & (sv > 0)
    v = torch.where(ok, rm.abs() / torch.where(ok, sv, torch.ones_like(sv)), torch.zeros_like(rm))
    st["clip_rate"] = float((v > f.elem.max).sum()) / max(1, r.numel())
    if f.kind == "mx":
        codes = mx.scales.reshape(-1).long()
        codes = codes[codes != E8M0_NAN]
        exps = codes - 127
        st["_scale_codes"] = mx.scales
    elif f.kind == "nvfp4":
        d = mx.scales.to(torch.float32).reshape(-1) * mx.global_scale
        d = d[torch.isfinite(d) & (d > 0)]
        exps = torch.floor(torch.log2(d)).long()
        st["_scale_codes"] = None
    else:
        exps = None
        st["_scale_codes"] = None
    if exps is not None and exps.numel():
        u, c = torch.unique(exps, return_counts=True)
        st["scale_hist"] = {str(int(a)): int(b) for a, b in zip(u.tolist(), c.tolist())}
    sp = _split(r * p if p != 1.0 else r, q, mx)
    st.update({f"split_{k}": sp[k] for k in SPLIT_KEYS})
    return st


def _out_stats(q: torch.Tensor, h: torch.Tensor) -> dict:
    q, h = q.double().reshape(-1), h.double().reshape(-1)
    hh = float(h @ h)
    qq = float(q @ q)
    e = q - h
    return {
        "cos": (float(q @ h) / math.sqrt(qq * hh) if qq > 0 and hh > 0 else None),
        "rel_err": (math.sqrt(float(e @ e) / hh) if hh > 0 else None),
        "rel_bias": (float(e @ h) / hh if hh > 0 else None),
    }


def gemm_diagnostics(ctx: Ctx, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor | None) -> dict:
    """Diagnostics of one layer's GEMMs: ``{gemm: {"operands": {...}, "cos", "rel_err", "rel_bias",
    "_err": quantized-minus-exact output}}``. ``x`` (M, K), ``w`` (N, K), ``dy`` (M, N) or None."""
    tensors = {"x": x.reshape(-1, x.shape[-1]).float(), "w": w.float(),
               "dy": (dy.reshape(-1, dy.shape[-1]).float() if dy is not None else None)}
    out = {}
    for gemm, (a, ta, ax_a), (b, tb, ax_b) in _GEMMS:
        if tensors[ta] is None or tensors[tb] is None:
            continue
        rec = ctx.recipe
        if not (rec.operand(a).quantized or rec.operand(b).quantized):
            continue
        signs = ctx.signs(gemm, tensors[ta].device)
        qa, pa, ra, mxa = operand_quantize(ctx, tensors[ta], ax_a, a, gemm, signs)
        qb, pb, rb, mxb = operand_quantize(ctx, tensors[tb], ax_b, b, gemm, signs)
        X, W, dY = tensors["x"], tensors["w"], tensors["dy"]
        if gemm == "fprop":
            yq, yh = qa @ qb.t(), X @ W.t()
        elif gemm == "dgrad":
            yq, yh = qa @ qb, dY @ W
        else:
            yq, yh = qa.t() @ qb, dY.t() @ X
        if pa * pb != 1.0:
            yq = yq / (pa * pb)
        ops = {}
        for name, q, p, r, mx, ax in ((a, qa, pa, ra, mxa, ax_a), (b, qb, pb, rb, mxb, ax_b)):
            ops[name] = _operand_stats(q, p, r, mx, ax) if mx is not None else None
        row = {"operands": ops, **_out_stats(yq, yh)}
        row["_err"] = (yq - yh)
        row["_q"] = yq
        out[gemm] = row
    return out


def _corr(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    return float(a @ b) / den if den > 0 else None


class Diagnostics:
    """Collect per-GEMM diagnostics every ``every`` optimizer steps into ``out_dir/diagnostics.jsonl``.

    Use: ``d = Diagnostics(model, out_dir, every)``; in the training loop call ``d.begin(step)``
    before the step's first forward pass and ``d.end(step)`` after its last backward pass (before
    or after ``optimizer.step()``: the weights used are copied in the forward pass). Both are
    no-ops on other steps; ``every = 0`` disables everything.
    """

    def __init__(self, model: torch.nn.Module, out_dir: str | Path | None, every: int,
                 max_corr_elems: int = 65536):
        if every < 0:
            raise ValueError("diagnose_every must be >= 0")
        self.model, self.every, self.max_corr = model, int(every), int(max_corr_elems)
        self.path = Path(out_dir) / "diagnostics.jsonl" if out_dir is not None else None
        self.rows: list[dict] = []  # rows of the last diagnosed step
        self._handles: list = []
        self._cap: dict[str, dict] = {}
        self._prev_err: dict[str, torch.Tensor] = {}
        self._prev_scales: dict[str, torch.Tensor] = {}
        self._idx: dict[str, torch.Tensor] = {}
        self._active_step: int | None = None

    def wants(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    # -- capture --------------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        if not self.wants(step) or self._active_step is not None:
            return
        self._active_step = step
        self._cap = {}
        for name, m in mx_layers(self.model):
            if m.recipe.quantized and isinstance(m, MXLinear):
                self._handles.append(m.register_forward_hook(self._fwd_hook(name)))
                self._handles.append(m.register_full_backward_hook(self._bwd_hook(name)))
                if m.weight.requires_grad:
                    self._handles.append(m.weight.register_hook(self._w_hook(name)))

    def _fwd_hook(self, name: str):
        def hook(m: MXLinear, inputs, output):
            if name in self._cap or not torch.is_grad_enabled():
                return
            self._cap[name] = {"x": inputs[0].detach(), "w": m.weight.detach().clone(), "dy": None,
                               "y_act": output.detach(), "dx_act": None, "dw_act": None,
                               "b": m.bias.detach().clone() if m.bias is not None else None,
                               "ctx": m.call_context(last=True)}
        return hook

    def _bwd_hook(self, name: str):
        def hook(m, grad_input, grad_output):
            rec = self._cap.get(name)
            if rec is None or rec["dy"] is not None:
                return
            rec["dy"] = grad_output[0].detach() if grad_output[0] is not None else None
            rec["dx_act"] = grad_input[0].detach() if grad_input and grad_input[0] is not None else None
        return hook

    def _w_hook(self, name: str):
        def hook(g):
            rec = self._cap.get(name)
            if rec is not None and rec["dw_act"] is None:
                rec["dw_act"] = g.detach().clone()
        return hook

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- compute --------------------------------------------------------------------------------
    def end(self, step: int) -> list[dict]:
        if self._active_step is None or self._active_step != step:
            return []
        self._remove()
        self._active_step = None
        rows = []
        with torch.no_grad():
            for name, cap in self._cap.items():
                d = gemm_diagnostics(cap["ctx"], cap["x"], cap["w"], cap["dy"])
                acts = {"fprop": cap["y_act"], "dgrad": cap["dx_act"], "wgrad": cap["dw_act"]}
                for gemm, row in d.items():
                    err = row.pop("_err")
                    q = row.pop("_q")
                    a = acts.get(gemm)
                    row["impl_rel_diff"] = None
                    if a is not None and gemm == "fprop" and cap["b"] is not None:
                        a = a.float() - cap["b"].float()
                    if a is not None and a.numel() == q.numel():
                        qd = q.double().reshape(-1)
                        nq = float(qd @ qd)
                        dd = a.double().reshape(-1) - qd
                        row["impl_rel_diff"] = math.sqrt(float(dd @ dd) / nq) if nq > 0 else None
                    for opname, st in row["operands"].items():
                        if st is None:
                            continue
                        codes = st.pop("_scale_codes", None)
                        if opname.endswith("_w") and codes is not None:
                            key = f"{name}/{opname}"
                            prev = self._prev_scales.get(key)
                            if prev is not None and prev.shape == codes.shape:
                                st["scale_change_rate"] = float((prev != codes).float().mean())
                            self._prev_scales[key] = codes.clone()
                    if gemm == "wgrad":
                        flat = err.reshape(-1)
                        if name not in self._idx:
                            g = torch.Generator().manual_seed(0)
                            n = flat.numel()
                            self._idx[name] = (torch.randperm(n, generator=g)[: self.max_corr].sort().values
                                               if n > self.max_corr else torch.arange(n))
                        sub = flat[self._idx[name].to(flat.device)].float().cpu()
                        prev = self._prev_err.get(name)
                        row["err_corr_prev"] = _corr(sub, prev) if prev is not None else None
                        self._prev_err[name] = sub
                    rows.append({"step": step, "layer": name, "layer_id": cap["ctx"].layer,
                                 "recipe": cap["ctx"].recipe.name, "gemm": gemm, **row})
        self._cap = {}
        self.rows = rows
        if self.path is not None and rows:
            with open(self.path, "a") as f:
                for r in rows:
                    f.write(json.dumps(r, allow_nan=False, default=_nan_none) + "\n")
        return rows

    def close(self) -> None:
        self._remove()
        self._cap = {}
        self._active_step = None


class DiagnosticsCallback(Callback):
    """``Diagnostics`` attached to a trainer run as a callback (what ``mxtrain study --diagnose-every N`` uses):
    ``mxtrain.train.train(cfg, callbacks=[DiagnosticsCallback(N)])`` writes ``diagnostics.jsonl`` into the run
    folder (or ``out_dir``). Each diagnosed step (``step % every == 0``, 0-based as ``on_step_begin`` counts)
    begins before its first forward pass and ends after its update. Rank 0 only. ``rows``: rows written."""

    reads_step_metrics = False   # on_step_end ends the diagnosed step; it reads no loss (mxtrain.train.stepcheck)

    def __init__(self, every: int, out_dir: str | Path | None = None, max_corr_elems: int = 65536):
        if every < 0:
            raise ValueError("diagnose_every must be >= 0")
        self.every, self.out_dir, self.max_corr = int(every), out_dir, max_corr_elems
        self.diag: Diagnostics | None = None
        self.active: int | None = None
        self.rows = 0

    def on_train_begin(self, state) -> None:
        if state.rank or not self.every:
            return
        self.diag = Diagnostics(state.model, self.out_dir if self.out_dir is not None else state.out, self.every,
                                self.max_corr)

    def on_step_begin(self, step: int) -> None:
        if self.diag is not None and self.diag.wants(step):
            self.diag.begin(step)
            self.active = step

    def on_step_end(self, step: int, metrics: dict) -> None:
        if self.diag is not None and self.active is not None:
            self.rows += len(self.diag.end(self.active))
            self.active = None

    def on_train_end(self, outcome) -> None:
        if self.diag is not None:
            self.diag.close()   # a step that never ended (the run stopped in it): its hooks go, no row
        self.active = None


def _nan_none(o):
    return None


def load(path: str | Path) -> list[dict]:
    """Rows of a ``diagnostics.jsonl`` (or of ``DIR/diagnostics.jsonl``); ``[]`` if absent."""
    p = Path(path)
    if p.is_dir():
        p = p / "diagnostics.jsonl"
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def aggregate(rows: list[dict]) -> dict:
    """Layer means per (GEMM, step) and overall, for reports.

    Returns ``{"steps": [...], "gemm": {gemm: {metric: [per step]}}, "operand": {operand:
    {metric: [per step]}}, "overall": {...}, "scale_hist": {operand: {exp: count}}}``.
    """
    steps = sorted({r["step"] for r in rows})
    gm = ("cos", "rel_err", "rel_bias", "err_corr_prev", "impl_rel_diff")
    om = ("sqnr_db", "clip_rate", "underflow_rate", "scale_change_rate") + tuple(f"split_{k}" for k in SPLIT_KEYS)
    out = {"steps": steps, "gemm": {}, "operand": {}, "overall": {"gemm": {}, "operand": {}}, "scale_hist": {}}
    by = {}
    for r in rows:
        by.setdefault((r["gemm"], r["step"]), []).append(r)
    for gemm in ("fprop", "dgrad", "wgrad"):
        if not any(g == gemm for g, _ in by):
            continue
        out["gemm"][gemm] = {m: [_mean([r.get(m) for r in by.get((gemm, s), [])]) for s in steps] for m in gm}
        out["overall"]["gemm"][gemm] = {m: _mean(out["gemm"][gemm][m]) for m in gm}
        for r in rows:
            if r["gemm"] != gemm:
                continue
            for opname, st in r["operands"].items():
                if st is None:
                    continue
                h = out["scale_hist"].setdefault(opname, {})
                for e, c in (st.get("scale_hist") or {}).items():
                    h[e] = h.get(e, 0) + c
        opnames = sorted({o for r in rows if r["gemm"] == gemm for o, st in r["operands"].items() if st})
        for o in opnames:
            out["operand"][o] = {m: [_mean([(r["operands"].get(o) or {}).get(m) for r in by.get((gemm, s), [])])
                                     for s in steps] for m in om}
            out["overall"]["operand"][o] = {m: _mean(out["operand"][o][m]) for m in om}
    return out
