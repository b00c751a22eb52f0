"""Weight de-oscillation (OsciReset): find master weights whose quantized value flips back and forth between
adjacent grid points, and snap them onto the grid.

Sources: TetraJet-v2 (Chen et al., arXiv 2510.27527; code thu-ml/TetraJet-v2-NVFP4Training, "OsciReset" with its
distance-ratio detector) and AMD's ALTO MXFP4 report (AMD-AGI/ALTO, "weight de-oscillation": GPT-OSS-20B steps
to target +20 % -> +5 %). The method, as both implement it:

* A weight ``w`` close to a boundary between two grid values of its block makes the quantized weight ``Q(w)``
  the forward GEMM sees jump by a whole grid step for a tiny move of ``w``, step after step.
* Over a **window** of ``W`` optimizer steps, accumulate per element ``dist = sum_t |w_t - w_{t-1}|`` (how far
  the master weight moved) and ``dist_q = sum_t |Q(w_t) - Q(w_{t-1})|`` (how far its quantized value moved),
  and here also ``flips``, the number of steps at which ``Q(w)`` changed.
* At the window's end an element **oscillates** when ``dist > 0``, ``dist_q >= threshold * dist`` (the
  quantized value travelled ``threshold`` times farther than the weight: only possible at a grid boundary)
  and ``flips >= min_flips``. Oscillating master weights are **reset** to their current quantized value
  ``Q(w)`` (the bin centre), so the next small update no longer crosses the boundary.
* A window opens every ``period`` steps from step ``start`` (steps done); ``window = period`` (the default)
  tracks continuously, as ALTO does (its defaults: period 200, threshold 4, from step 2000); TetraJet-v2 tracks
  the first 50 steps of every 400 (threshold 8) from 70 % of its run.

**The grid.** ``Q`` is the layer's Fprop weight operand (``recipe.fprop_w``: format, block size or 16x16
tiles, scale rule, prescale) computed by the reference quantizer (``mxtrain.numerics.quant.quantize``) along the
in-features axis, always rounding to nearest (stochastic rounding of ``fprop_w``, which no preset uses, has
no fixed grid to oscillate on). Layers whose recipe keeps ``fprop_w`` in high precision are not tracked;
``check_recipe`` refuses a run none of whose layers would be.

**Rotated recipes.** When the Fprop GEMM is rotated (``fprop_rotation``, e.g. ``mxfp4-all-dh16``) the quantized
values are those of ``V = W R`` (``R``: the layer's blockwise Hadamard, orthogonal), not of ``W``'s elements.
Tracking and the reset then happen in that rotated domain: ``dist`` and ``dist_q`` are measured on ``V``, the
reset moves ``V_i`` to ``Q(V)_i``, and ``W`` changes by ``(Q(V) - V) R^T`` restricted to the reset entries
(one Hadamard block of ``W`` per reset entry). This needs ``R`` fixed over training: sign modes ``none``,
``fixed`` and ``per_layer``; ``per_step`` signs (a new grid every step) are refused.

**Memory.** While a window is open, per element of every tracked weight: the previous (rotated) weight and
its quantized value (float32, 4 + 4 bytes), ``dist`` and ``dist_q`` (float32, 4 + 4 bytes) and ``flips``
(int16, 2 bytes): 18 bytes, 4.5 times the float32 master weights. With ``window < period`` it is freed
between windows. Every tracked step quantizes each tracked weight once more, one layer at a time (a few
temporaries of one layer's size; on a GPU one Triton pass, ``kernels.mxelem.quantize_mx_values``, the
reference's values bit for bit, instead of the reference's ~170 PyTorch operations a layer). The open window's state goes into checkpoints (``state_dict``), so a resumed
run continues bit for bit; checkpoints written while a window is open are larger by the same 18 bytes per
tracked weight.

**Distributed.** One process or DDP (every process holds whole, identical weights and applies the same
resets). FSDP2 shards are refused (``UserError``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .._io import write_text
from ..errors import UserError
from ..numerics.formats import get_format
from ..linear.module import mx_layers
from ..numerics.hadamard import rotation_signs, hadamard
from ..numerics.operand import pad_axis
from ..numerics.quant import quantize, reference_only
from .parallel import unwrap

__all__ = ["DeoscSettings", "Deoscillator", "DeoscCallback", "check_recipe", "tracked_layers", "STATS_NAME"]

STATS_NAME = "deosc.jsonl"   # one row per reset in the run folder (rank 0)
MAX_WINDOW = 32767           # flips are counted in int16


@dataclass(frozen=True)
class DeoscSettings:
    """The knobs of ``Deoscillator`` (the ``deosc`` section of a training config; docs/numerics.md)."""

    period: int = 200            # steps between window starts
    window: int | None = None    # steps tracked before each reset; None: the whole period
    threshold: float = 4.0       # reset when dist_q >= threshold * dist over the window
    min_flips: int = 1           # ... and Q(w) changed at least this many times in it
    start: int = 0               # the first window opens when this many steps are done

    def __post_init__(self):
        def bad(msg):
            raise UserError(f"deosc.{msg}")
        for k in ("period", "min_flips", "start"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f"{k} must be an integer, got {v!r}")
        if self.period < 1:
            bad(f"period must be >= 1, got {self.period}")
        w = self.period if self.window is None else self.window
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= self.period:
            bad(f"window must be an integer from 1 to deosc.period ({self.period}), got {self.window!r}")
        if w > MAX_WINDOW:
            bad(f"window must be at most {MAX_WINDOW} steps, got {w}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            bad(f"threshold must be a positive number, got {t!r}")
        if not 0 <= self.min_flips <= w:
            bad(f"min_flips must be from 0 to the window ({w} steps), got {self.min_flips}")
        if self.start < 0:
            bad(f"start must be >= 0 (steps done), got {self.start}")

    @property
    def steps(self) -> int:
        """The window length in steps."""
        return self.period if self.window is None else self.window

    @classmethod
    def from_config(cls, cfg) -> "DeoscSettings":
        d = cfg.deosc
        return cls(period=d.period, window=d.window, threshold=d.threshold, min_flips=d.min_flips,
                   start=d.start)


def _grid_problem(recipe) -> str | None:
    """Why de-oscillation cannot run on layers of ``recipe`` (None: it can)."""
    op, rot = recipe.fprop_w, recipe.fprop_rotation
    if not op.quantized:
        return (f"recipe {recipe.name!r} keeps the Fprop weight (fprop_w) in high precision: there is no "
                f"quantized weight to de-oscillate")
    if rot.enabled and rot.signs == "per_step":
        return (f"recipe {recipe.name!r} rotates the Fprop GEMM with signs re-drawn every step (H{rot.size}/"
                f"per_step): the weight's grid changes every step, so nothing oscillates on a fixed grid")
    return None


def check_recipe(recipe) -> None:
    """UserError when ``deosc.enable`` cannot work with ``recipe`` (see ``_grid_problem``)."""
    why = _grid_problem(recipe)
    if why:
        fix = ("use a recipe that quantizes fprop_w (e.g. mxfp4-all)" if not recipe.fprop_w.quantized else
               "use a recipe whose Fprop rotation keeps its signs (none, fixed or per_layer; e.g. mxfp4-all-dh16)")
        raise UserError(f"deosc.enable: {why}; {fix}")


def tracked_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, layer)`` of every MX linear layer of ``model`` whose recipe gives its Fprop weight a fixed grid
    (fused MoE experts, ``MXExperts``, have no ``weight`` and are not tracked)."""
    return [(n, m) for n, m in mx_layers(model)
            if isinstance(getattr(m, "weight", None), torch.Tensor) and _grid_problem(m.recipe) is None]


class _Grid:
    """The Fprop weight grid of one layer: ``to_domain(W) -> V`` (float32; rotated when Fprop is rotated),
    ``quantize(V) -> Q(V)`` and ``snap`` (moves entries of ``V`` onto the grid, through ``W``)."""

    def __init__(self, layer):
        r = layer.recipe
        self.op, self.rot = r.fprop_w, r.fprop_rotation
        self.signs = None
        if self.rot.enabled and self.rot.signs != "none":
            self.signs = rotation_signs(self.rot.size, self.rot.signs, seed=r.seed, layer=layer.layer_id, gemm=0,
                                        step=0, device=layer.weight.device)

    def to_domain(self, w: torch.Tensor) -> torch.Tensor:
        v = w.detach().to(torch.float32, copy=True)   # a copy: the window keeps it while the weight moves on
        if self.rot.enabled:
            v = hadamard(pad_axis(v, -1, self.rot.size), self.rot.size, axis=-1, signs=self.signs)
        return v

    def quantize(self, v: torch.Tensor) -> torch.Tensor:
        from ..kernels import mxelem  # startup
        op = self.op
        if not reference_only(op.fmt, op.scale_rule) and mxelem.mx_kernel_applies(v, op.fmt, op.block_size,
                                                                                   "nearest", fp4=True):
            # one Triton pass, the reference's values bit for bit (its variant self-checked once, else the
            # reference below serves); the reference is ~170 PyTorch operations a layer
            block = get_format(op.fmt).block_size if op.block_size is None else op.block_size
            if mxelem.mx_ok(v, op.fmt, 1, block, op.scale_rule, op.prescale):
                q = mxelem.quantize_mx_values(v, op.fmt, 1, block, op.scale_rule, op.prescale)
                return q / op.prescale if op.prescale != 1.0 else q
        mx = quantize(v, op.fmt, axis=-1, block_size=op.block_size, rounding="nearest", scale_rule=op.scale_rule,
                      prescale=op.prescale)
        q = mx.dequantize(torch.float32)
        return q / op.prescale if op.prescale != 1.0 else q

    def snap(self, w: torch.Tensor, mask: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> None:
        """Move the entries ``mask`` of ``V`` (``v``, this grid's domain of ``w``) to their quantized values ``q``,
        in place in ``w`` (under no_grad). Unrotated: ``w[mask] = q[mask]`` exactly, the rest untouched.
        Rotated: ``w += (q - v) R^T`` on the masked entries (``R``'s blocks are orthogonal and fixed)."""
        if not self.rot.enabled:
            w.copy_(torch.where(mask, q.to(w.dtype), w))
            return
        delta = torch.where(mask, q - v, torch.zeros_like(v))
        # R = diag(s) H / sqrt(n) on each block: H / sqrt(n) is symmetric and its own inverse
        delta = hadamard(delta, self.rot.size, axis=-1)
        if self.signs is not None:
            delta = delta * self.signs.to(delta.device, delta.dtype).repeat(delta.shape[-1] // self.rot.size)
        w.add_(delta[..., : w.shape[-1]].to(w.dtype))


class Deoscillator:
    """De-oscillation of every tracked MX layer of ``model`` (see the module docstring).

    Drive it with ``begin(steps_done)`` before each optimizer step (opens a window when one is due) and
    ``end(steps_done)`` after it (tracks; at a window's last step detects and resets, returning the reset's
    statistics). ``state_dict`` / ``load_state_dict`` carry an open window across a checkpoint."""

    def __init__(self, model: torch.nn.Module, settings: DeoscSettings | None = None):
        self.s = settings or DeoscSettings()
        self.layers = tracked_layers(model)
        for name, m in self.layers:
            w = m.weight
            if hasattr(w, "to_local") or type(w.data).__name__ == "DTensor":
                raise UserError("deosc needs whole weights on every process (one process, or parallel.mode=ddp); "
                                "FSDP2 shards them")
        self.grids = {name: _Grid(m) for name, m in self.layers}
        self.opened: int | None = None   # steps done when the open window began; None: no window open
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    # -- schedule ---------------------------------------------------------------------------------

    def due(self, steps_done: int) -> bool:
        """Does a window open when ``steps_done`` steps are done?"""
        s = self.s
        return steps_done >= s.start and (steps_done - s.start) % s.period == 0

    def begin(self, steps_done: int) -> None:
        """Before the optimizer step that follows ``steps_done`` steps: open a window if one is due."""
        if self.opened is None and self.due(steps_done):
            self.open(steps_done)

    def end(self, steps_done: int) -> dict | None:
        """After the optimizer step that makes ``steps_done`` steps: track; at the window's last step, detect
        and reset. Returns the reset's statistics (``reset_stats``) then, else None."""
        if self.opened is None:
            return None
        self.track()
        if steps_done - self.opened < self.s.steps:
            return None
        stats = self.reset()
        stats.update(step=steps_done, window=self.s.steps, opened=self.opened)
        self.close()
        return stats

    # -- the three phases -------------------------------------------------------------------------

    @torch.no_grad()
    def open(self, steps_done: int) -> None:
        """Start a window: remember every tracked weight (in the grid's domain) and its quantized value."""
        self.state = {}
        for name, m in self.layers:
            g = self.grids[name]
            v = g.to_domain(m._mx_weight())
            self.state[name] = {"prev": v, "prev_q": g.quantize(v), "dist": torch.zeros_like(v),
                                "dist_q": torch.zeros_like(v),
                                "flips": torch.zeros(v.shape, dtype=torch.int16, device=v.device)}
        self.opened = steps_done

    @torch.no_grad()
    def track(self) -> None:
        """Accumulate one step's movement of every tracked weight and of its quantized value."""
        for name, m in self.layers:
            st, g = self.state[name], self.grids[name]
            v = g.to_domain(m._mx_weight())
            q = g.quantize(v)
            st["dist"] += (v - st["prev"]).abs_()
            st["flips"] += (q != st["prev_q"])
            st["dist_q"] += (q - st["prev_q"]).abs_()
            st["prev"], st["prev_q"] = v, q

    def oscillating(self, name: str) -> torch.Tensor:
        """The boolean mask of layer ``name``'s oscillating entries (grid domain) in the open window."""
        st = self.state[name]
        return (st["dist"] > 0) & (st["dist_q"] >= self.s.threshold * st["dist"]) & (
            st["flips"] >= self.s.min_flips)

    @torch.no_grad()
    def reset(self) -> dict:
        """Snap every oscillating entry to its quantized value. Returns ``{"tracked", "reset", "changed"}``
        (entries tracked, reset, and whose quantized value changed at least once in the window)."""
        tracked = reset = changed = 0
        for name, m in self.layers:
            st, g = self.state[name], self.grids[name]
            mask = self.oscillating(name)
            n = int(mask.sum())
            tracked += mask.numel()
            changed += int((st["flips"] > 0).sum())
            reset += n
            if n:   # prev / prev_q are the weights after this step: Q(prev) is the current bin centre
                g.snap(m._mx_weight(), mask, st["prev"], st["prev_q"])
        return {"tracked": tracked, "reset": reset, "changed": changed}

    def close(self) -> None:
        self.state = {}
        self.opened = None

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The open window (tensors on the CPU) and the settings it was opened with."""
        return {"settings": asdict(self.s), "opened": self.opened,
                "layers": {n: {k: t.detach().cpu().clone() for k, t in st.items()} for n, st in self.state.items()}}

    def load_state_dict(self, d: dict) -> None:
        """Continue the window of a checkpoint. UserError when it was written with other settings or layers."""
        if not d or d.get("opened") is None:
            self.close()
            return
        if d.get("settings") != asdict(self.s):
            raise UserError(f"the checkpoint's de-oscillation window was opened with deosc settings "
                            f"{d.get('settings')}, not {asdict(self.s)}: resume with the same deosc.* values")
        names = [n for n, _ in self.layers]
        if sorted(d.get("layers", {})) != sorted(names):
            raise UserError("the checkpoint's de-oscillation state tracks other layers than this model's")
        self.state = {}
        for name, m in self.layers:
            dev = m.weight.device
            self.state[name] = {k: t.to(dev) for k, t in d["layers"][name].items()}
        self.opened = int(d["opened"])


class DeoscCallback:
    """The trainer callback of ``Deoscillator`` (added by the trainer when ``deosc.enable`` is on): a window
    opens in ``on_step_begin``, is tracked and reset in ``on_step_end``; each reset appends a row to
    ``RUN/deosc.jsonl`` (rank 0): ``{"step", "opened", "window", "tracked", "reset", "changed",
    "reset_share"}``. Its state rides in checkpoints under ``state_key``."""

    state_key = "deosc"
    reads_step_metrics = False   # on_step_end reads the weights, not the step's loss (mxtrain.train.stepcheck)

    def __init__(self, settings: DeoscSettings | None = None):
        self.settings = settings or DeoscSettings()
        self.deosc: Deoscillator | None = None
        self.path: Path | None = None
        self.rank = 0

    def on_train_begin(self, state) -> None:
        self.deosc = Deoscillator(unwrap(state.model), self.settings)
        if not self.deosc.layers:
            raise UserError("deosc.enable: the model has no MX layer whose Fprop weight is quantized on a fixed "
                            "grid; nothing to de-oscillate")
        self.rank = state.rank
        if state.rank == 0:
            self.path = Path(state.out) / STATS_NAME
            rows = []
            if state.start_step and self.path.is_file():   # a resumed run: drop rows past the checkpoint
                for line in self.path.read_text().splitlines():
                    try:
                        if int(json.loads(line)["step"]) <= state.start_step:
                            rows.append(line)
                    except (ValueError, KeyError, TypeError):
                        continue
            write_text(self.path, "".join(r + "\n" for r in rows))   # (a kill here leaves the old file whole)

    def on_step_begin(self, step: int) -> None:
        self.deosc.begin(step)

    def on_step_end(self, step: int, metrics: dict) -> None:
        stats = self.deosc.end(step)
        if stats is not None and self.rank == 0 and self.path is not None:
            stats["reset_share"] = stats["reset"] / stats["tracked"] if stats["tracked"] else 0.0
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(stats) + "\n")
            except OSError as e:
                raise UserError(f"cannot write {self.path}: {e.strerror or e}") from None

    def state_dict(self) -> dict:
        return self.deosc.state_dict() if self.deosc is not None else {}

    def load_state_dict(self, d: dict) -> None:
        self.deosc.load_state_dict(d)
