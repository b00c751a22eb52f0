"""The training loop: ``train(cfg) -> run folder`` (``fit(cfg) -> Outcome``), with callbacks.

The phases of a run are the methods of ``Trainer``: ``setup()`` (checkpoint read, data, model, optimizer,
run folder, callbacks), ``run()`` (the loop, the final evaluation, the outcome), ``train_step()`` (one
optimizer step: micro-steps eager or replayed as a CUDA graph), ``evaluate()`` and ``save()``. The run folder
(which folder, its lock, ``run.json``, the outcome record) is ``mxtrain.train.run_folder``; the checks of a
config are ``mxtrain.train.config.validate``.

One code path for every device and world size: the loop never assumes a single process (the data
loader takes rank / world size, the global batch is split into micro-batches per rank). The
multi-GPU code wraps the model (DDP / FSDP2) in ``_wrap_parallel`` and reduces metrics in
``_reduce_mean``; nothing else changes.

Hooks: ``callbacks=[...]`` (``mxtrain.train.callbacks.Callback``) are called at the start and end of the run,
of every step, at every log row, evaluation and checkpoint. How a run ended is a typed ``Outcome``
(completed, diverged, interrupted, failed), recorded in ``RUN/run.json`` under ``"outcome"``, handed to
``on_train_end``, carried by the exception that ends a run early (``e.outcome``) and returned by ``fit``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from .. import __version__, convert, set_step
from . import parallel as D  # DDP / FSDP2 / DCP hooks
from .. import settings as _settings
from .._io import write_text
from ..data import Loader, TokenData, ensure_builtin
from ..errors import OutOfMemory, UserError
from ..model.llama import Llama, ModelConfig, set_glue
from . import checkpoint as ckpt
from . import profiling, stepcheck, threads
from .callbacks import (Callback, CallbackList, Outcome, Status, TensorBoardLogger, TrainState, WandbLogger,
                        read_outcome, wandb_project)
from .config import TrainConfig, _check, keep_steps, shape_overrides, switch_step
from .cpp_wrapper import bind_backward_thread, check_cpp_compiler, cpp_wrapper_config
from .evaluation import WINDOWS_NAME, append_windows, evaluate_windows, final_evaluation, write_window_sources
from .run_folder import _git_sha, _make_out, _record_outcome, _refuse_rewind, _write_json, write_run_json, _holds_run
from ..model import hf_io as hf
from .deosc import DeoscCallback, DeoscSettings

# re-exported for callers of this module: Callback, Outcome, Status, TrainState, read_outcome (mxtrain.train.callbacks)

# dense bf16 peak TFLOP/s for MFU, matched against torch.cuda.get_device_name()
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
               "A10G": 70.0, "RTX 4090": 165.0, "B200": 2250.0}


class Interrupted(UserError):
    """SIGINT or SIGTERM: the run saved a checkpoint at the end of the step in progress and stopped.
    ``outcome``: the run's ``Outcome`` (interrupted, at ``step``)."""

    def __init__(self, msg: str, signum: int, step: int | None = None):
        super().__init__(msg)
        self.exit_code = 128 + signum
        self.step = step
        self.outcome: Outcome | None = None


class _Signals:
    """While a run trains (main thread only): SIGINT and SIGTERM set ``caught`` instead of stopping the
    process, so the loop can checkpoint at the end of the step; a second signal stops at once."""

    def __init__(self):
        import signal
        import threading
        self.caught = None
        self.old = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self.old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.caught is not None:   # a second signal: stop now
            raise KeyboardInterrupt
        self.caught = signum

    def restore(self):
        import signal
        for s, h in self.old.items():
            signal.signal(s, h)
        self.old = {}


class NonFiniteLoss(UserError):
    """The loss (or gradient norm, validation loss, weights) became NaN or infinite at ``step``; the run
    stopped and its last checkpoint was kept. ``outcome``: the run's ``Outcome`` (diverged)."""
    exit_code = 3

    def __init__(self, msg: str, step: int | None = None):
        super().__init__(msg)
        self.step = step
        self.outcome: Outcome | None = None


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"unsupported device {name!r}; use auto, cpu, cuda or cuda:N")
    return dev


def _autocast_dtype(cfg: TrainConfig, dev: torch.device):
    d = cfg.train.dtype
    if d == "auto":
        return torch.bfloat16 if dev.type == "cuda" else None
    if d == "bf16":
        return torch.bfloat16
    if d == "fp32":
        return None
    raise UserError(f"train.dtype must be auto, bf16 or fp32, got {d!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then cosine / WSD / constant over the horizon.

    WSD (warmup-stable-decay): the peak LR until ``decay_start = horizon - n`` (``n``: ``schedule.decay_steps``,
    else ``round(decay_fraction * horizon)``), then a cooldown towards ``min_lr = lr * min_lr_ratio`` over the
    last ``n`` steps, with ``t = (step - decay_start) / n`` in [0, 1): ``linear`` is ``lr - (lr - min_lr) * t``,
    ``1-sqrt`` is ``lr - (lr - min_lr) * sqrt(t)`` (Hägele et al., arXiv 2405.18392). Before ``decay_start``
    WSD gives exactly the constant schedule's LR, so a constant run branched at step k with a cooldown of
    n steps (``mxtrain.train.branch``) is the WSD run of horizon k + n."""
    s, o = cfg.schedule, cfg.optim
    horizon = s.horizon_steps or cfg.train.steps
    lr_min = o.lr * o.min_lr_ratio
    if s.warmup_steps and step < s.warmup_steps:
        return o.lr * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return o.lr
    if s.kind == "cosine":
        t = min(1.0, (step - s.warmup_steps) / max(1, horizon - s.warmup_steps))
        return lr_min + 0.5 * (o.lr - lr_min) * (1 + math.cos(math.pi * t))
    if s.kind == "wsd":
        decay_start = wsd_decay_start(cfg)
        if step < decay_start:
            return o.lr
        t = min(1.0, (step - decay_start) / max(1, horizon - decay_start))
        if getattr(s, "decay_shape", "linear") == "1-sqrt":
            return o.lr - (o.lr - lr_min) * math.sqrt(t)
        return o.lr - (o.lr - lr_min) * t
    raise UserError(f"schedule.kind must be cosine, wsd or constant, got {s.kind!r}")


def wsd_decay_start(cfg: TrainConfig) -> int:
    """The first step of a WSD schedule's cooldown (``horizon - decay_steps``)."""
    s = cfg.schedule
    horizon = s.horizon_steps or cfg.train.steps
    n = s.decay_steps if getattr(s, "decay_steps", None) is not None else int(round(s.decay_fraction * horizon))
    return max(0, horizon - n)


def _switch(model, name: str, log, step: int, tokens: int) -> None:
    """Every linear layer of ``model`` to recipe ``name`` (``convert`` again: converted layers change recipe, the
    kept ones stay; under torch.compile the blocks compile again once for it), said and logged."""
    convert(D.unwrap(model), name)
    log.say(f"step {step}: recipe switched to {name} (train.switch_recipe)")
    log.row({"step": step, "tokens": tokens, "event": "recipe_switch", "recipe": name})


def graph_blockers(recipe, device: torch.device, world: int) -> list[str]:
    """Why the micro-step cannot be replayed as a CUDA graph (empty: it can). A graph replays the kernels
    captured once; every MX layer's random inputs (per-step signs, stochastic-rounding keys) are computed
    on the device from the layer's state tensor, so replays follow the step and call as eager training
    does, on the fast and the reference path alike."""
    why = []
    if device.type != "cuda":
        why.append(f"the device is {device}, not a CUDA GPU")
    if world > 1:
        why.append("training runs on several processes (CUDA graphs are for one GPU here)")
    return why


def compiles(cfg, device: torch.device) -> bool:
    """Does this run compile its transformer blocks (``train.compile``)?"""
    if cfg.train.compile == "auto":
        return device.type == "cuda" and not cfg.train.cuda_graphs
    return cfg.train.compile == "on"


class _LossModule(torch.nn.Module):
    """model(x, y) under the run's autocast, as one module for ``torch.cuda.make_graphed_callables``."""

    def __init__(self, model, device_type: str, amp_dtype):
        super().__init__()
        self.model = model
        self.device_type, self.amp_dtype = device_type, amp_dtype

    def forward(self, x, y):
        # autocast's weight-cast cache must be off while capturing (it would hold casts from the capture)
        with torch.autocast(self.device_type, dtype=self.amp_dtype or torch.float32,
                            enabled=self.amp_dtype is not None, cache_enabled=False):
            return self.model(x, y)


def _model_config(cfg: TrainConfig, vocab: int) -> ModelConfig:
    m = cfg.model
    over = shape_overrides(m)
    if m.vocab_size is not None and m.vocab_size < vocab:
        raise UserError(f"model.vocab_size={m.vocab_size:,} is smaller than the data's vocabulary ({vocab:,} ids): "
                        f"raise it to at least {vocab:,} or leave it unset")
    rows = vocab if m.vocab_size is None else m.vocab_size
    padded = 32 * math.ceil(rows / 32)  # MX blocks of 32: pad the vocab (extra rows are never targets)
    base = ModelConfig.named(m.name)
    return ModelConfig.named(m.name, **over, vocab_size=padded, max_seq_len=max(base.max_seq_len, cfg.data.seq_len))


def _check_folder_model(cfg: TrainConfig, model: Llama) -> None:
    """What the config says beside a model read from ``train.init_from``: the load-balancing weight
    (``model.router_aux_coef``) replaces the folder's, and the combinations ``validate`` refuses for a named
    mixture-of-experts size are refused for one read from a folder (it knows the folder's shape only now)."""
    if not model.cfg.n_experts:
        if cfg.model.router_aux_coef is not None:
            raise UserError(f"model.router_aux_coef={cfg.model.router_aux_coef!r} weighs a mixture of experts' "
                            f"load-balancing loss, but {cfg.train.init_from} is a dense model; remove it")
        return
    if cfg.model.router_aux_coef is not None:
        model.cfg = dataclasses.replace(model.cfg, router_aux_coef=float(cfg.model.router_aux_coef))
    if cfg.train.cuda_graphs:
        raise UserError(f"train.cuda_graphs with a mixture of experts ({cfg.train.init_from} has "
                        f"{model.cfg.n_experts} experts) is not supported (the experts' token counts change from "
                        f"step to step); leave train.cuda_graphs off")


def build_model(cfg: TrainConfig, vocab: int, device: torch.device, load_init: bool = True) -> Llama:
    """The model with its init fixed by ``model.init_seed`` (default ``train.seed``), whatever the recipe;
    with ``train.init_from``, the shapes and (``load_init``: not when resuming, the checkpoint has them)
    the weights of that local Hugging Face Llama, Mistral, Qwen2 or Mixtral folder (``model.router_aux_coef``, a
    loss weight and not a shape, replaces the folder's)."""
    if cfg.train.init_from:
        if load_init:
            model = hf.llama_from_hf(cfg.train.init_from, vocab_size=vocab, max_seq_len=cfg.data.seq_len,
                                     device=device)
        else:
            mcfg = hf.config_from_hf(cfg.train.init_from, vocab_multiple=32, max_seq_len=cfg.data.seq_len)
            model = Llama(mcfg, device="meta").to_empty(device=device)
            if mcfg.tie_embeddings:
                model.lm_head.weight = model.embed_tokens.weight
        _check_folder_model(cfg, model)
        return model
    mcfg = _model_config(cfg, vocab)
    seed = cfg.model.init_seed if cfg.model.init_seed is not None else cfg.train.seed
    init_dev = torch.device("cpu") if mcfg.num_params() < 1e9 else device
    model = Llama(mcfg, device="meta").to_empty(device=init_dev)
    if mcfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    gen = torch.Generator(device=init_dev).manual_seed(seed)
    model.init_weights(generator=gen)
    return model.to(device)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in n else no_decay).append(p)
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)


def _reads_step_metrics(cb) -> bool:
    """Does callback ``cb`` read a step's loss or gradient norm in ``on_step_end``? Yes when it has its own
    ``on_step_end``, unless it says otherwise (``reads_step_metrics = False``)."""
    own = getattr(type(cb), "on_step_end", None)
    return own is not None and own is not Callback.on_step_end and getattr(cb, "reads_step_metrics", True)


def checks_on_device(cfg: TrainConfig, device: torch.device, callbacks: list) -> bool:
    """Are the step's finite checks made on the device (``train.check_every_step``, ``mxtrain.train.stepcheck``)?"""
    mode = cfg.train.check_every_step
    readers = [type(c).__name__ for c in callbacks if _reads_step_metrics(c)]
    if mode == "off" and readers:
        raise UserError(f"train.check_every_step off: callback {readers[0]} reads each step's loss in on_step_end "
                        f"(give it reads_step_metrics = False if it does not), or use train.check_every_step auto")
    if mode == "auto":
        return device.type == "cuda" and not readers
    return mode == "off"


def _apply_optim_values(opt: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Set betas, eps and weight decay (of the decayed group) from ``cfg`` after loading a checkpoint's state;
    the learning rate is set at every step from the schedule."""
    o = cfg.optim
    for g in opt.param_groups:
        g["betas"], g["eps"] = (o.beta1, o.beta2), o.eps
        if g["weight_decay"] != 0.0:
            g["weight_decay"] = o.weight_decay


def _all_finite(model: torch.nn.Module) -> bool:
    """Are all weights finite (on every rank: each checks its shards)?"""
    ok = []
    for p in model.parameters():
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t   # FSDP2's DTensor shards
        ok.append(torch.isfinite(t).all())
    here = bool(torch.stack([t.to(ok[0].device) for t in ok]).all()) if ok else True
    return _reduce_mean(0.0 if here else 1.0) == 0.0   # any rank non-finite: all stop


def _wrap_parallel(model, cfg, env):  # DDP / FSDP2 (mxtrain.train.parallel.wrap)
    p = cfg.parallel
    mode = ("ddp" if env.distributed else "none") if p.mode == "auto" else p.mode
    if mode != "fsdp2":
        return D.wrap(model, mode, env)
    dt = {"auto": "auto", "bf16": torch.bfloat16, "fp32": None}[p.param_dtype]
    if p.gather == "quantized":   # (its fallbacks are said once, in the run's log, by _begin; not as a warning too.
        import warnings           # A filter, not catch_warnings, which would also undo the filter wrap installs)
        warnings.filterwarnings("ignore", message="mxtrain: FSDP2 gather='quantized'")
    return D.wrap(model, mode, env, param_dtype=dt, reshard_after_forward=p.reshard_after_forward,
                  prefetch=p.prefetch, gather=p.gather)


def _reduce_mean(x: float) -> float:  # all-reduce over ranks
    return D.reduce_mean(x)


def rate_fields(tps: float, flops_tok: float, peak_tflops: float | None, world: int) -> dict:
    """A training row's per-GPU rates from ``tps``, the tokens per second of all ``world`` ranks together:
    ``tok_per_s_per_gpu`` (several ranks) and ``mfu``, each GPU's model FLOP rate over its peak."""
    row = {"tok_per_s_per_gpu": tps / world} if world > 1 else {}
    if peak_tflops:
        row["mfu"] = flops_tok * tps / world / (peak_tflops * 1e12)
    return row


def _peak_tflops(cfg: TrainConfig, dev: torch.device) -> float | None:
    if cfg.log.peak_tflops:
        return cfg.log.peak_tflops
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    for k, v in PEAK_TFLOPS.items():
        if k in name:
            return v
    return None


def _isatty(stream) -> bool:
    """Is ``stream`` a terminal? (False for None, a pipe, a file, a closed stream.)"""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _duration(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _row_step(line: str) -> int | None:
    """The step of one JSONL row (0 when it has none), or None for a line cut short by a crash."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return None


class _Log:
    """metrics.jsonl + console; every row also goes to the callbacks' ``on_log`` (TensorBoard, W&B, yours).

    Console: a progress bar only when ``log.progress`` is on and stderr is a terminal. Otherwise (``--no-progress``,
    nohup, a batch system's log file) every log row is one plain line on stdout, prefixed with the time, with
    no carriage returns."""

    def __init__(self, out: Path, cfg: TrainConfig, start_step: int, total: int, rank: int,
                 callbacks: CallbackList | None = None):
        self.rank = rank
        self.cbs = callbacks if callbacks is not None else CallbackList()
        self.path = out / "metrics.jsonl"
        self.total, self.start_step, self.t0 = total, start_step, time.perf_counter()
        if rank:  # only rank 0 touches metrics.jsonl
            self.f = self.bar = None
            self._bar_args = (False, total, start_step)
            return
        for path in (self.path, out / WINDOWS_NAME):
            if start_step > 0 and path.exists():  # drop rows past the checkpoint (a crash after it)
                try:
                    text = path.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:   # (a damaged file: refused, not rewritten without its rows)
                    raise UserError(f"{path} is damaged (bytes that are not UTF-8 text at byte {e.start}): restore "
                                    f"it, or cut it off before that byte, to resume this run") from None
                keep = [ln for ln in text.splitlines()
                        if ln.strip() and _row_step(ln) is not None and _row_step(ln) <= start_step]
                write_text(path, "".join(ln + "\n" for ln in keep))   # (a kill here leaves the old file whole)
            elif start_step == 0:
                path.write_text("")
        self.f = open(self.path, "a")
        self.bar = None
        self._bar_args = (cfg.log.progress and rank == 0 and _isatty(sys.stderr), total, start_step)

    def start_bar(self):
        self.t0 = time.perf_counter()
        on, total, start_step = self._bar_args
        if on:
            try:
                from tqdm import tqdm  # optional
                self.bar = tqdm(total=total, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                                file=sys.stderr)
            except ImportError:
                pass

    def row(self, r: dict, callbacks: bool = True):
        if self.rank:
            return
        # strict JSON: a non-finite number is written as its name in a string ("nan", "inf")
        line = json.dumps({k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                           for k, v in r.items()}, allow_nan=False) + "\n"
        try:
            self.f.write(line)
            self.f.flush()
        except OSError as e:
            raise UserError(f"cannot write {self.path}: {e.strerror or e}{ckpt.state_note(self.path.parent)}") from None
        if callbacks:
            self.cbs.log(r["step"], r)

    def train_line(self, done: int, row: dict):
        """The console's view of a training row: the bar's postfix, or one plain line with the time left."""
        if self.rank:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{row['lr']:.2e}", tok_s=f"{row['tok_per_s']:,.0f}")
            return
        msg = (f"{self.step_str(done)} | tokens {row['tokens']:>11,} | loss {row['loss']:.4f} | "
               f"lr {row['lr']:.2e} | {row['tok_per_s']:,.0f} tok/s")
        if done > self.start_step and done < self.total:
            per = (time.perf_counter() - self.t0) / (done - self.start_step)
            msg += f" | eta {_duration(per * (self.total - done))}"
        self.say(msg, stamp=True)

    def step_str(self, done: int) -> str:
        return f"step {done:>{len(str(self.total))}}/{self.total}"

    def say(self, msg: str, stamp: bool = False):
        """One console line (rank 0): above the bar, or on stdout (prefixed with the time if ``stamp``)."""
        if self.rank:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}" if stamp else msg, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.f:
            self.f.close()
            self.f = None


def _callbacks(cfg: TrainConfig, callbacks) -> list:
    """The run's callbacks: the caller's, plus a ``WandbLogger`` when ``log.wandb`` is on and the caller gave
    none (made here, before anything is written: a missing ``wandb`` is one error at startup), plus
    ``mxtrain.train.deosc.DeoscCallback`` when ``deosc.enable`` is on."""
    cbs = list(callbacks or ())
    project = wandb_project(getattr(cfg.log, "wandb", None))
    if project and not any(isinstance(c, WandbLogger) for c in cbs):
        cbs.insert(0, WandbLogger(project))
    if cfg.deosc.enable:
        if not any(isinstance(c, DeoscCallback) for c in cbs):   # first: the others see the step's final weights
            cbs.insert(0, DeoscCallback(DeoscSettings.from_config(cfg)))
    return cbs


def _run(cfg: TrainConfig, resume, callbacks) -> Outcome:
    cfg = copy.deepcopy(cfg)
    _check(cfg)
    cbs = _callbacks(cfg, callbacks)
    device = _resolve_device(cfg.train.device)
    env = D.init(str(device) if device.index is not None or device.type == "cpu" else "cuda")
    locks: list = []
    # (the partitioner reads it when a block's graph is first compiled, during the first steps)
    budget = cfg.train.memory_budget
    patch = {} if budget is None else {"activation_memory_budget": float(budget)}
    if cfg.train.recompute_gemm_inputs:
        patch["ban_recompute_materialized_backward"] = False
    import torch._functorch.config as functorch_config   # (explicitly: mxtrain does not import torch._dynamo)
    try:
        try:
            with functorch_config.patch(**patch), cpp_wrapper_config(cfg.train.cpp_wrapper):
                outcome = _train(cfg, resume, env, locks, cbs)
        except torch.OutOfMemoryError as e:   # one line that says what to change, not a traceback
            err = OutOfMemory(_oom_message(cfg, device, e, getattr(e, "outcome", None)))
            err.outcome = getattr(e, "outcome", None)
            raise err from None
        finally:
            for lock in locks:   # the run folder's lock (rank 0)
                lock.close()
    except BaseException as e:
        _shutdown_after_failure(env, e)
        raise
    # _train's frame is gone, and with it the DDP / FSDP2 model that holds the process group:
    # D.shutdown destroys the group while the interpreter is whole (not at exit, where gloo can abort)
    if env.distributed:
        D.barrier()
        D.shutdown()
    return outcome


def _shutdown_after_failure(env, e: BaseException) -> None:
    """A rank whose training failed (a bad input every rank finds, a crash) destroys its gloo process group now:
    a group left for the interpreter's exit can abort the process ("terminate called without an active
    exception", ``D.shutdown``), which turned a one-line error into SIGABRT (exit 134) once under load. The failed
    frames' locals (the model that holds the group) are cleared first; the traceback's lines stay. NCCL groups are
    left as they are: their destruction can wait on ranks still in a collective, and torchrun stops those."""
    if not (env.distributed and env.backend == "gloo"):
        return
    import traceback
    traceback.clear_frames(e.__traceback__)
    try:
        D.shutdown()
    except Exception:  # noqa: BLE001 - the failure being raised is the one to report
        pass


def _oom_message(cfg: TrainConfig, device: torch.device, e: BaseException, outcome) -> str:
    """``torch.OutOfMemoryError`` as one line: where, how much, and the settings that need less memory."""
    import re
    found = re.search(r"Tried to allocate ([0-9.]+ ?[KMGT]?i?B)", str(e))
    asked = found.group(1) if found else None
    where = f"out of GPU memory on {device}"
    step = getattr(outcome, "step", None)
    if step is not None and step < cfg.train.steps:
        where += f" in step {step + 1}"
    held = ""
    if device.type == "cuda" and torch.cuda.is_available():
        try:
            total = torch.cuda.get_device_properties(device).total_memory / 2**30
            peak = torch.cuda.max_memory_allocated(device) / 2**30
            held = f" (the GPU has {total:.1f} GiB; PyTorch's peak {peak:.1f} GiB" + \
                (f", then asked for {asked}" if asked else "") + ")"
        except Exception:   # the report must not fail where the run already has
            held = ""
    m = cfg.train.micro_batch_size or "the per-rank batch"
    return (f"{where}{held}; to need less: a smaller --micro-batch-size (now {m}; gradient accumulation keeps "
            f"--batch-size), a shorter --seq-len (now {cfg.data.seq_len}), --set train.checkpoint_blocks=true, "
            f"--set train.recompute_ffn=true, --set train.memory_budget=0.5, --set train.recompute_gemm_inputs=true, "
            f"or the model sharded over more GPUs "
            f"(--nproc N --parallel fsdp2)")


# what a run folder holds (a run, and what eval, report, a study, a branch, a profile write beside it; hidden
# files: its lock, temporaries, write tests): a run with --out a folder that holds no run yet refuses one holding
# anything else, which is another command's (a study's summary.json, a data folder) or the user's (#47)
_RUN_FOLDER_NAMES = frozenset({
    "config.json", "recipe.json", "run.json", "metrics.jsonl", "summary.json", "eval_windows.jsonl",
    "eval_sources.json", "eval_final.json", "diagnostics.jsonl", "deosc.jsonl", "tb", "wandb", "wandb_id",
    "profile", "branches", "branch.json", "remake", "remake.json", "remake-metrics.jsonl", "study_status.json",
    "study_error.txt", "report.html", "report.md", "report_files", "seeds.json"})


def _check_out_folder(cfg: TrainConfig, rank: int) -> None:
    """``--out`` (``log.out``) names a new folder, an empty one, one a run trained in, or one only a run's files
    are in: a folder holding other files (a study folder, a data folder, the file system's root) is refused in one
    line before anything is built or written, not written into (a run with --out STUDY replaced the study's
    summary.json). Rank 0 looks; every rank acts on its answer."""
    verdict = None
    if rank == 0 and cfg.log.out:
        out = Path(cfg.log.out)
        try:
            # (a cooldown branch's folder: the branch command checked it, and keeps what is not its own there)
            other = [] if not out.is_dir() or _holds_run(out) or (out / "branch.json").is_file() else sorted(
                p.name for p in out.iterdir() if p.name not in _RUN_FOLDER_NAMES
                and not p.name.startswith((".", "checkpoint")))
        except OSError:   # (unreadable: the run folder's own checks say why)
            other = []
        if other:
            verdict = (f"output folder {out} holds files a run does not write ({', '.join(other[:3])}"
                       f"{', ...' if len(other) > 3 else ''}): a run would write its config.json, metrics.jsonl, "
                       f"summary.json and checkpoints among them; give a new or empty --out")
    verdict = D.from_rank0(verdict)
    if verdict is not None:
        raise UserError(verdict)


def train(cfg: TrainConfig, resume: str | Path | None = None, callbacks=None) -> Path:
    """Train as ``cfg`` says; returns the run folder. ``resume``: a run folder or checkpoint to continue.
    ``callbacks``: ``mxtrain.train.callbacks.Callback`` objects called during the run (see that module).

    A run that does not complete raises: ``NonFiniteLoss`` (diverged), ``Interrupted`` (SIGINT / SIGTERM),
    ``UserError`` or any other exception (failed); once the run folder is written, the exception carries the
    run's typed ``Outcome`` as ``e.outcome``, and ``RUN/run.json`` records it under ``"outcome"``."""
    return _run(cfg, resume, callbacks).out


def fit(cfg: TrainConfig, resume: str | Path | None = None, callbacks=None) -> Outcome:
    """``train``, returning the typed ``Outcome``: ``completed`` or ``diverged`` (a result, not an error).
    Interrupted and failed runs still raise (with ``e.outcome`` once the run folder is written)."""
    try:
        return _run(cfg, resume, callbacks)
    except NonFiniteLoss as e:
        if e.outcome is None:
            raise
        return e.outcome


class Trainer:
    """One training run, phase by phase: ``setup()`` reads a resumed checkpoint and builds the data, the model
    (converted, compiled, wrapped for DDP / FSDP2), the optimizer, the run folder and the callbacks; ``run()``
    trains to ``train.steps`` and returns the run's ``Outcome``; each step is ``train_step(step)`` (one
    optimizer step: micro-steps, eager or replayed as a CUDA graph), then its log row, ``evaluate(done)`` and
    ``save(done)`` when due. What the phases share is an attribute (the model, the optimizer, ``tokens``,
    ``last_ckpt_step``, the background checkpoint ``pending``, the captured graph ``graphed``)."""

    def __init__(self, cfg: TrainConfig, resume: str | Path | None, env: D.DistEnv, locks: list, callbacks: list):
        self.cfg, self.resume, self.env, self.locks, self.callbacks = cfg, resume, env, locks, callbacks
        self.rank, self.world, self.device = env.rank, env.world_size, env.device
        self.graphed = None   # train.cuda_graphs: the loss module captured at the first micro-step
        self.pending = None   # train.async_checkpoint: (PendingCheckpoint, step, tokens, t_start, seconds waited)
        self.val_loss = None

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Everything before the first step, in this order: checks of the device, the checkpoint read (when
        resuming), the data, the model and optimizer (with the checkpoint's state), the run folder with its
        ``config.json``, ``recipe.json`` and ``run.json``, the callbacks and the ``TrainState`` they see."""
        cfg, device = self.cfg, self.device
        _check_out_folder(cfg, self.rank)   # another command's folder: refused now, before anything is built
        self.amp_dtype = _autocast_dtype(cfg, device)
        self.recipe = cfg.resolved_recipe()
        if cfg.train.cuda_graphs:
            why = graph_blockers(self.recipe, device, self.world)
            if why:
                raise UserError("train.cuda_graphs needs one GPU: " + "; ".join(why))
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self._read_checkpoint()
        self._setup_data()
        self.on_device = checks_on_device(cfg, device, self.callbacks)   # fused AdamW takes the device's flag
        self._setup_model()
        self._load_state()
        self._setup_folder()
        builtin = []
        if cfg.log.tensorboard and not any(isinstance(c, TensorBoardLogger) for c in self.callbacks):
            builtin.append(TensorBoardLogger())
        self.cbs = CallbackList(builtin + list(self.callbacks))
        self.tstate = TrainState(cfg=cfg, config=self.cfg_dict, out=self.out, model=self.model, optimizer=self.opt,
                                 device=device, rank=self.rank, world_size=self.world, start_step=self.start_step,
                                 total_steps=cfg.train.steps, step=self.start_step, tokens=self.tokens)

    def _read_checkpoint(self) -> None:
        """``state``: the resumed checkpoint's (None for a new run); ``src``: its path; ``dcp_path``: the same
        when it is a DCP folder (whose model and optimizer are loaded later, in ``_load_state``)."""
        cfg, resume = self.cfg, self.resume
        self.state = None
        t_read = time.perf_counter()
        self.src = src = ckpt.find(resume) if resume is not None else None   # a run folder: its newest checkpoint
        self.dcp_path = src if src is not None and src.is_dir() else None  # a DCP checkpoint?
        if self.dcp_path is not None:
            self.state = D.read_extra(self.dcp_path)
        elif src is not None:
            self.state = ckpt.load(src)
        if src is not None and cfg.log.out is None:
            cfg.log.out = str(src.parent)
        self.read_s = time.perf_counter() - t_read   # reading checkpoint.pt (a DCP folder's extra state only)
        # one thread per free core on a CPU run of one process, a resumed run its first leg's
        # (mxtrain.train.threads; said in the log)
        self.cpu_threads = threads.apply(src.parent if src is not None else None) \
            if self.device.type == "cpu" and self.world == 1 else None

    def _setup_data(self) -> None:
        """The token data, the micro-batch size and gradient accumulation, this rank's loader."""
        cfg, world = self.cfg, self.world
        if cfg.data.path == "builtin":
            self.data_dir = ensure_builtin(cfg.data.vocab_size, progress=cfg.log.progress and _isatty(sys.stderr))
        else:
            self.data_dir = Path(cfg.data.path)
            if not self.data_dir.exists():
                raise UserError(f"data folder not found: {self.data_dir} (prepare it with: mxtrain data prepare "
                                f"SOURCES --out {self.data_dir})")
        self.data = TokenData(self.data_dir)
        B, T = cfg.train.batch_size, cfg.data.seq_len
        micro = cfg.train.micro_batch_size or B // world
        if micro <= 0 or B % (micro * world):
            raise UserError(f"train.batch_size ({B}) must be a multiple of micro_batch_size x world size "
                            f"({micro} x {world})")
        self.accum = B // (micro * world)
        data_seed = cfg.data.seed if cfg.data.seed is not None else cfg.train.seed
        self.loader = Loader(self.data, T, micro, data_seed, self.rank, world)

    def _setup_model(self) -> None:
        """The model (its init from ``train.seed``), converted to the recipe, its blocks compiled (each on its
        own, before DDP / FSDP2 wrap them, as torchtitan does; state_dict keys are unchanged), wrapped; the
        optimizer; the run's config as a dict (the recipe in full unless it is a preset's name)."""
        cfg, device = self.cfg, self.device
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg, self.data.vocab_size, device, load_init=self.state is None)
        convert(model, self.recipe)
        set_glue(model, _settings.current().glue)   # (the model reads no setting: it is told)
        compiled = compiles(cfg, device)
        # activation checkpointing from outside the model (train.parallel.apply_ac, MX-aware); the feed-forward's
        # recomputation is for compiled blocks only
        D.apply_ac(model, checkpoint_blocks=cfg.train.checkpoint_blocks,
                   recompute_ffn=compiled and cfg.train.recompute_ffn)
        if compiled:   # (one graph shared by all blocks: layer numbers and steps are tensors)
            if model.cfg.n_experts:   # the experts as one traced loop, not a graph break per expert (mxtrain.linear.moe)
                torch._dynamo.config.capture_dynamic_output_shape_ops = True
            if cfg.train.cpp_wrapper:   # (inductor's config is patched for the whole run: _run)
                check_cpp_compiler()
                bind_backward_thread(device)   # (torch's issue #144609: mxtrain/train/cpp_wrapper.py)
            for block in model.layers:
                block.compile()
        self.model = _wrap_parallel(model, cfg, self.env)
        self.opt = _optimizer(self.model, cfg, fused=device.type == "cuda" or self.on_device)
        self.mcfg = D.unwrap(self.model).cfg
        self.cfg_dict = cfg.to_dict()
        self.cfg_dict["recipe"] = cfg.recipe if isinstance(cfg.recipe, str) else self.recipe.to_dict()

    def _load_state(self) -> None:
        """A resumed run: the checkpoint's model, optimizer (with this run's optimizer values), loader and RNG
        state, its step and tokens; ``load_s``: the time that took. A new run starts at step 0."""
        cfg, state, env = self.cfg, self.state, self.env
        self.start_step, self.tokens, self.load_s = 0, 0, None
        self.last_ckpt_step = None
        if state is None:
            return
        ckpt.check_compatible(state["config"], self.cfg_dict, self.resume)
        t_load = time.perf_counter()
        try:
            if self.dcp_path is not None:  # any writer world size -> this one
                D.load_checkpoint(self.dcp_path, self.model, self.opt, env=env)
            elif env.distributed:  # a single-process checkpoint.pt -> DDP / FSDP2
                D.load_full_state(self.model, self.opt, state["model"], state["optimizer"])
            else:
                self.model.load_state_dict(state["model"])
                self.opt.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise UserError(f"checkpoint {self.resume} does not fit this model "
                            f"({str(e).splitlines()[0][:160]})") from None
        self.load_s = self.read_s + time.perf_counter() - t_load
        _apply_optim_values(self.opt, cfg)   # this run's optimizer values, not the checkpoint's
        self.loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state.get("rng"), self.src)
        self.start_step, self.tokens = int(state["step"]), int(state["tokens"])
        self.last_ckpt_step = self.start_step
        if self.start_step >= cfg.train.steps:
            raise UserError(f"checkpoint is at step {self.start_step}, nothing to do for --steps {cfg.train.steps}; "
                            f"raise --steps to continue")

    def _setup_folder(self) -> None:
        """The run folder (``run_folder._make_out``: decided by rank 0, locked) and, by rank 0, its
        ``config.json``, ``recipe.json`` and ``run.json``."""
        cfg, device, state = self.cfg, self.device, self.state
        resume_dir = None
        if state is not None:
            resume_dir = self.src.parent
            _refuse_rewind(self.src, Path(cfg.log.out), self.start_step)
        self.out = out = _make_out(cfg, resume_dir, self.rank, self.locks)
        self.ckpt_path = out / ckpt.NAME
        self.keep = set(keep_steps(cfg))   # train.keep_checkpoints_at
        if self.rank != 0:
            return
        _write_json(out / "config.json", self.cfg_dict)
        _write_json(out / "recipe.json", self.recipe.to_dict())
        data, mcfg, T = self.data, self.mcfg, cfg.data.seq_len
        info = {"mxtrain": __version__, "torch": torch.__version__, "python": platform.python_version(),
                "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                else (platform.processor() or platform.machine()), "cpu_threads": torch.get_num_threads(),
                "git_sha": _git_sha(), "argv": sys.argv, "data": str(Path(self.data_dir).resolve()),
                "data_meta": {k: data.meta[k] for k in ("train_tokens", "val_tokens", "vocab_size", "sources",
                                                         "corpus_sources") if k in data.meta},
                "model_params": mcfg.num_params(), "flops_per_token": mcfg.flops_per_token(T),
                "world_size": self.world, "grad_accum": self.accum,
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "resumed_from_step": self.start_step or None,
                "cpu_threads_chosen": self.cpu_threads.message if self.cpu_threads is not None else None,
                # every knob of mxtrain.settings (docs/settings.md), those that change numerics included
                "settings": _settings.current().to_dict()}
        write_run_json(out, info, resumed=state is not None)

    # -------------------------------------------------------------------------------------------------- run
    def run(self) -> Outcome:
        """Train from ``start_step`` to ``train.steps``, then the final evaluation and ``summary.json``. How
        the run ended is an ``Outcome``: recorded in ``run.json`` (rank 0), handed to the callbacks, carried
        by the exception that ends a run early (``e.outcome``), returned when it completes."""
        cfg, rank, device, out, tstate = self.cfg, self.rank, self.device, self.out, self.tstate
        outcome = None
        self.log = log = self.sig = None
        try:
            self.log = log = _Log(out, cfg, self.start_step, cfg.train.steps, rank, self.cbs)
            self._begin()
            self.sig = _Signals()
            val_loss = self._loop()
            tokens = tstate.tokens
            big_val = final_evaluation(self.model, self.data, cfg, device, self.amp_dtype, tstate.step, tokens, out,
                                       rank, self.world)
            if big_val is not None:
                log.say(f"final evaluation over {cfg.log.final_eval_tokens:,} validation tokens: val_loss "
                        f"{big_val:.4f}")
            if rank == 0:
                summary = {"steps": cfg.train.steps, "tokens": tokens, "final_val_loss": val_loss,
                           "final_val_ppl": math.exp(min(val_loss, 50)) if val_loss is not None else None,
                           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                _write_json(out / "summary.json", summary)
            outcome = Outcome(Status.COMPLETED, tstate.step, None, out)
        except NonFiniteLoss as e:
            outcome = e.outcome = Outcome(Status.DIVERGED, e.step if e.step is not None else tstate.step, str(e), out)
            raise
        except Interrupted as e:
            outcome = e.outcome = Outcome(Status.INTERRUPTED, e.step if e.step is not None else tstate.step, str(e),
                                          out)
            raise
        except KeyboardInterrupt:
            outcome = Outcome(Status.INTERRUPTED, tstate.step, "stopped at once by a second signal (or Ctrl-C "
                              "outside the training loop); resume from the last checkpoint", out)
            raise
        except BaseException as e:
            outcome = Outcome(Status.FAILED, tstate.step,
                              str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}", out)
            try:
                e.outcome = outcome
            except AttributeError:  # an exception type that takes no attributes
                pass
            raise
        finally:
            if self.sig is not None:
                self.sig.restore()
            if log is not None:
                log.close()
            if outcome is not None:
                failing = not outcome.completed
                if rank == 0:
                    _record_outcome(out, outcome, quiet=failing)
                self.cbs.end(outcome, quiet=failing)
        return outcome

    def _begin(self) -> None:
        """The run's first lines, ``eval_sources.json``, the callbacks' ``on_train_begin`` (and their state from
        the checkpoint), the resumed row, the progress bar."""
        cfg, log, device, out = self.cfg, self.log, self.device, self.out
        B, T, mcfg = cfg.train.batch_size, cfg.data.seq_len, self.mcfg
        self.flops_tok = flops_tok = mcfg.flops_per_token(T)
        self.peak = _peak_tflops(cfg, device)
        self.inexact = _inexact_reader(device)
        log.say(f"mxtrain {__version__} | model {cfg.model.name} ({mcfg.num_params() / 1e6:.1f}M params, "
                f"{flops_tok / 1e6:.1f} MFLOP/token) | recipe {self.recipe.name} | {device}"
                f"{' bf16 autocast' if self.amp_dtype else ' fp32'} | {cfg.train.steps} steps x {B} x {T} tokens | "
                f"run {out}")
        if self.cpu_threads is not None:
            log.say(self.cpu_threads.message)
        if D.gather_report(self.model) is not None:   # parallel.gather=quantized: which layers, and why not the others
            log.say(D.gather_report(self.model).message())
        if self.rank == 0:
            write_window_sources(self.data, cfg, out)
        self.cbs.begin(self.tstate)
        if self.state is not None:
            self.cbs.load_state_dicts(self.state.get("callbacks"))
        if self.load_s is not None:   # the checkpoint's load into this world size, timed (metrics.jsonl only: a
            # logger that continues the run, such as W&B, takes no row at a step it already has)
            log.row({"step": self.start_step, "tokens": self.tokens, "event": "resumed", "load_s": self.load_s,
                     "world_size": self.world}, callbacks=False)
        log.start_bar()
        if device.type == "cuda":   # peak_mem_gib: training only (not a whole model built before FSDP2 shards it)
            torch.cuda.reset_peak_memory_stats(device)

    def _loop(self) -> float | None:
        """Steps ``start_step`` .. ``train.steps`` inside ``log.profile_steps`` and ``train.gc_every``
        (mxtrain.train.profiling). Returns the last validation loss (None if none ran)."""
        cfg, log, tstate = self.cfg, self.log, self.tstate
        span = profiling.parse_steps(cfg.log.profile_steps, cfg.train.steps)
        if span is not None and span[0] <= tstate.start_step:   # a resumed run starts after the first profiled step
            log.say(f"note: log.profile_steps {span[0]}-{span[1]} starts at or before the resumed step "
                    f"{tstate.start_step}; nothing is profiled (choose steps after it)")
            span = None
        self.prof = profiling.StepProfiler(span, tstate.out, self.rank, self.device)
        self.gcol = profiling.GarbageCollection(cfg.train.gc_every)
        try:
            return self._steps()
        finally:
            self.gcol.close()
            self.prof.close()

    def _steps(self) -> float | None:
        """The loop: each step's update, log row, evaluation, checkpoint, callbacks, and the stop on a signal."""
        cfg, env, log, cbs, tstate = self.cfg, self.env, self.log, self.cbs, self.tstate
        start_step = self.start_step
        if cfg.train.async_checkpoint and not env.distributed:
            log.say("note: train.async_checkpoint applies to runs of several processes (DCP checkpoints); this one "
                    "writes checkpoint.pt at once")
        if cfg.train.cpp_wrapper and not compiles(cfg, self.device):
            log.say(f"note: train.cpp_wrapper applies to compiled blocks; train.compile=auto does not compile on "
                    f"{self.device.type}, so this run has no C++ wrapper (train.compile=on compiles here)")
        self.model.train()
        self.t_last, self.tok_last, self.steps_last = time.perf_counter(), self.tokens, 0
        self.loss_acc = 0.0
        self.t_ckpt = time.perf_counter()
        self.inexact0 = self.inexact() if self.inexact is not None else None
        self.record_inexact = self.device.type == "cuda"   # where the fast path's kernels run; elsewhere once nonzero
        self.said_uncounted = False
        self.checks, self.voted, self.gnorm = None, 0, float("nan")
        if self.on_device:   # the step's checks on the device (mxtrain.train.stepcheck): fused AdamW reads the flag
            self.checks = stepcheck.StepChecks(self.device)
            self.opt.found_inf = self.checks.found_inf
        switch = switch_step(cfg)
        if switch is not None and start_step >= switch[0]:   # resumed (or branched) past the switch
            _switch(self.model, switch[1], log, start_step, self.tokens)
        for step in range(start_step, cfg.train.steps):
            if switch is not None and step == switch[0] and step > start_step:
                _switch(self.model, switch[1], log, step, self.tokens)
            lr = lr_at(step, cfg)
            for g in self.opt.param_groups:
                g["lr"] = lr
            set_step(self.model, step)
            cbs.step_begin(step)
            self.prof.before(step)
            loss_val, gnorm = self.train_step(step)
            self.tokens += cfg.train.batch_size * cfg.data.seq_len
            done = step + 1
            self.prof.after(step)
            self.gcol.step(done)
            tstate.step, tstate.tokens = done, self.tokens
            if self.checks is None:
                cbs.step_end(done, {"loss": loss_val, "lr": lr, "grad_norm": gnorm, "tokens": self.tokens})
                self._take(loss_val, gnorm)
            else:   # no callback reads the step's numbers; the last step's are read now, this one's a step later
                cbs.step_end(done, {"lr": lr, "tokens": self.tokens})
                self._read_checks(self.checks.ready())
            if done % cfg.log.log_every == 0 or done == cfg.train.steps or done == start_step + 1:
                self._read_checks()
                self._log_row(done, lr, self.gnorm)
            if log.bar is not None:
                log.bar.update(1)
            if done % cfg.log.eval_every == 0 or done == cfg.train.steps:
                self._read_checks()
                self.evaluate(done)
            self._checkpoint_or_stop(done)
        self._read_checks()
        self._finish_pending()   # a background checkpoint still being written completes before the run ends
        return self.val_loss

    # --------------------------------------------------------------------------------------------- one step
    def train_step(self, step: int) -> tuple[float | None, float | None]:
        """One optimizer step (the LR and the layers' step already set): ``accum`` micro-steps, the loss
        averaged over ranks and checked, the gradient clipped and checked (before the update: the weights and
        the last checkpoint stay those of the last good step), the update. Returns (loss, gradient norm); with
        the checks on the device (``train.check_every_step``) (None, None): the step's numbers are pushed to
        ``self.checks`` and read later (``_read_checks``), and a non-finite step makes no update."""
        cfg, env, model = self.cfg, self.env, self.model
        loss_sum = torch.zeros((), device=self.device)
        for k in range(self.accum):
            if env.world_size > 1:   # this rank's micro-batch k is the global batch's k * N + r: its SR draws too
                set_step(model, step, call=k * env.world_size + env.rank)
            x, y = self.loader.next()
            if self.device.type == "cuda":   # a copy from pinned memory waits for nothing: the host runs ahead
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            loss = self._graphed_micro_step(x, y, step) if cfg.train.cuda_graphs else self._micro_step(x, y, k)
            loss_sum += loss.detach()
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        if self.checks is not None:
            vote = None
            if env.distributed:   # a signal on any rank: every rank reads the same vote at the same step
                vote = D.reduce_over_ranks_(torch.full((), float(self.sig.caught or 0), device=self.device), "max")
            self.checks.push(step, self.tokens, D.reduce_over_ranks_(loss_sum), D.clip_grad_norm_(model, clip), vote)
            self.opt.step()   # no update once a step was not finite (found_inf)
            self.opt.zero_grad(set_to_none=self.graphed is None)
            return None, None
        loss_val = _reduce_mean(loss_sum.item())
        self._stop_if_not_finite(step, self.tokens, loss_val)
        gnorm = float(D.clip_grad_norm_(model, clip))   # DTensor grads
        self._stop_if_not_finite(step, self.tokens, loss_val, gnorm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=self.graphed is None)
        return loss_val, gnorm

    def _stop_if_not_finite(self, step: int, tokens: int, loss: float, gnorm: float | None = None) -> None:
        """Step ``step`` (0-based; ``tokens`` trained before it) diverged if its loss, or its gradient norm when
        given, is not finite: its row, then ``NonFiniteLoss`` (no update was made in that step)."""
        log = self.log
        if not math.isfinite(loss):
            log.row({"step": step + 1, "tokens": tokens, "event": "non-finite loss", "loss": str(loss)})
            raise NonFiniteLoss(f"loss is {loss} at step {step + 1}; training stopped ({self._where()}); "
                                f"try a lower --lr or another recipe", step=step + 1)
        if gnorm is not None and not math.isfinite(gnorm):
            log.row({"step": step + 1, "tokens": tokens, "event": "non-finite gradient", "grad_norm": gnorm})
            advice = ("resume with a lower --lr (it may change on resume) or another recipe"
                      if self.last_ckpt_step is not None else "start again with a lower --lr or another recipe")
            raise NonFiniteLoss(f"gradient norm is {gnorm} at step {step + 1}; the weights were not updated "
                                f"({self._where()}); {advice}", step=step + 1)

    def _take(self, loss: float, gnorm: float) -> None:
        """A checked step's numbers into the next log row."""
        self.loss_acc += loss
        self.steps_last += 1
        self.gnorm = gnorm

    def _read_checks(self, records=None) -> None:
        """The device-checked steps' records (``records``; None: every one not read yet, waiting for the GPU):
        the first non-finite one stops the run as a host check would have at that step; a signal's vote is
        kept for ``_checkpoint_or_stop``."""
        if self.checks is None:
            return
        for r in (self.checks.drain() if records is None else records):
            self._stop_if_not_finite(r.step, r.tokens, r.loss, r.grad_norm)
            self._take(r.loss, r.grad_norm)
            self.voted = max(self.voted, r.vote)

    def _micro_step(self, x, y, k: int) -> torch.Tensor:
        """Micro-step ``k``, eager: forward under autocast, backward (gradients reduced on the last one only)."""
        amp_dtype = self.amp_dtype
        with D.grad_sync(self.model, k == self.accum - 1):
            with torch.autocast(self.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                loss = self.model(x, y) / self.accum
            loss.backward()
        return loss

    def _graphed_micro_step(self, x, y, step: int) -> torch.Tensor:
        """A micro-step as a replay of the CUDA graph (``train.cuda_graphs``), captured at the first one (after
        3 eager warm-up passes)."""
        model = self.model
        if self.graphed is None:
            try:
                self.graphed = torch.cuda.make_graphed_callables(_LossModule(model, self.device.type, self.amp_dtype),
                                                                 (x, y))
            except RuntimeError as e:
                raise UserError(f"could not capture the training step as a CUDA graph "
                                f"({str(e).splitlines()[0][:300]}); run without train.cuda_graphs") from None
            # a replayed backward hands autograd its static gradient buffers; a .grad that already exists is
            # added to in place, so accumulation never aliases (and sums) those buffers. The grads stay
            # allocated: zero_grad zeroes, not frees.
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # the warm-up and capture passes advanced the layers' call counters: this first replay is call 0
            # of this step, as in eager training
            set_step(model, step)
        loss = self.graphed(x, y) / self.accum
        loss.backward()
        return loss

    def _log_row(self, done: int, lr: float, gnorm: float) -> None:
        """A training row of metrics.jsonl (the mean loss since the last row, rates, memory, inexact blocks)."""
        device, log, inexact = self.device, self.log, self.inexact
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        tps = (self.tokens - self.tok_last) / max(now - self.t_last, 1e-9)
        row = {"step": done, "tokens": self.tokens, "loss": self.loss_acc / self.steps_last, "lr": lr,
               "grad_norm": gnorm, "tok_per_s": tps, "epoch": self.loader.epoch}
        row.update(rate_fields(tps, self.flops_tok, self.peak, self.env.world_size))
        if device.type == "cuda":   # the largest of the ranks' peaks (GiB), since the run started
            row["peak_mem_gib"] = D.reduce_max(torch.cuda.max_memory_allocated(device) / 2**30)
        cur = inexact() if inexact is not None else None
        if cur is not None and self.inexact0 is not None:
            d = {k: v - self.inexact0.get(k, 0) for k, v in cur.items()}
            self.record_inexact = self.record_inexact or d["inexact_blocks"] != 0
            if self.record_inexact:
                row.update(d)
        elif inexact is not None and not self.said_uncounted:
            self.said_uncounted = True   # say so, rather than record a count of 0 that was never made
            log.say(f"note: inexact FP8-carrier blocks are not counted on {device} in this run (a compiled "
                    "MX call found no counter); "
                    "metrics.jsonl has no inexact_blocks")
        log.row(row)
        log.train_line(done, row)
        self.loss_acc, self.steps_last = 0.0, 0
        self.t_last, self.tok_last = now, self.tokens

    # --------------------------------------------------------------------------------------------- evaluate
    def evaluate(self, done: int) -> float:
        """The validation loss after step ``done``: logged (with each window's loss in eval_windows.jsonl),
        handed to the callbacks; a non-finite one is divergence. Its time is kept out of tokens/s."""
        cfg, log, tokens, last = self.cfg, self.log, self.tokens, self.last_ckpt_step
        te = time.perf_counter()
        val_loss, windows = evaluate_windows(self.model, self.data, cfg, self.device, self.amp_dtype, self.rank,
                                             self.env.world_size)
        self.val_loss = val_loss
        if self.rank == 0:
            append_windows(self.out / WINDOWS_NAME, done, tokens, windows)
        ppl = math.exp(min(val_loss, 50))
        log.row({"step": done, "tokens": tokens, "val_loss": val_loss, "val_ppl": ppl})
        self.cbs.eval(done, {"val_loss": val_loss, "val_ppl": ppl, "tokens": tokens})
        if not math.isfinite(val_loss):
            raise NonFiniteLoss(f"validation loss is {val_loss} at step {done}; training stopped (last good "
                                f"checkpoint: {self.ckpt_path} (step {last})); resume with a lower --lr "
                                f"or another recipe" if last is not None else
                                f"validation loss is {val_loss} at step {done}; training stopped (no checkpoint "
                                f"was written yet); try a lower --lr or another recipe", step=done)
        log.say(f"{log.step_str(done)} | tokens {tokens:>11,} | val_loss {val_loss:.4f} | val_ppl {ppl:.2f}",
                stamp=True)
        self.t_last += time.perf_counter() - te  # keep evaluation out of tokens/s
        return val_loss

    # ------------------------------------------------------------------------------------------------- save
    def _checkpoint_or_stop(self, done: int) -> None:
        """After step ``done``: a checkpoint when one is due (every ``checkpoint_every`` steps or minutes, the
        last step, a kept step, a signal), a background one completed once written; a signal stops the run."""
        cfg, env, log = self.cfg, self.env, self.log
        sig = self.sig
        if not env.distributed:
            caught = sig.caught
        elif self.checks is not None:   # the ranks' vote, read with the step's checks (one step later)
            caught = self.voted or None
        else:   # a signal on any rank stops every rank at the same step
            caught = int(_reduce_mean(float(sig.caught or 0)) > 0) and (sig.caught or 15)
        minutes = cfg.train.checkpoint_minutes
        due = minutes > 0 and time.perf_counter() - self.t_ckpt >= 60 * minutes
        if self.pending is not None and done % cfg.log.log_every == 0 and D.reduce_sums(
                0.0 if self.pending[0].done() else 1.0)[0] == 0.0:
            self._finish_pending()   # every rank's shards are written: complete it now rather than at the next one
        if ((cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0)
                or (done == cfg.train.steps and cfg.train.final_checkpoint) or due or caught or done in self.keep):
            self._read_checks()   # never a checkpoint after a step that was not finite
            # in the background where asked (several processes), except the last one and one for a signal
            self.save(done, background=cfg.train.async_checkpoint and env.distributed and not caught
                      and done < cfg.train.steps)
            self.t_ckpt = time.perf_counter()
        if caught and done < cfg.train.steps:
            import signal
            name = signal.Signals(caught).name
            log.row({"step": done, "tokens": self.tokens, "event": f"interrupted ({name})"})
            raise Interrupted(f"interrupted by {name} at step {done}; checkpoint saved in {self.out}; continue "
                              f"with: mxtrain train --resume {self.out}", caught, step=done)

    def save(self, step: int, background: bool = False) -> None:
        """A checkpoint at ``step`` (never of non-finite weights): ``checkpoint.pt`` (one process) or a DCP
        folder (every rank its shards; ``background``: copied to host memory now, written by a thread and
        completed later by ``_finish_pending``). One checkpoint at a time, completed in order."""
        env, model, opt, out, ckpt_path = self.env, self.model, self.opt, self.out, self.ckpt_path
        self._finish_pending()
        if not _all_finite(model):
            raise NonFiniteLoss(f"weights are not finite at step {step}; no checkpoint written (last good "
                                f"checkpoint: {ckpt_path if self.last_ckpt_step is not None else 'none'}); try a "
                                f"lower --lr", step=step)
        rest = {"schedule": {"step": step, "lr": lr_at(step, self.cfg)}, "loader": self.loader.state_dict(),
                "rng": ckpt.rng_state(), "step": step, "tokens": self.tokens, "config": self.cfg_dict,
                "model_config": D.unwrap(model).cfg.to_dict()}
        cb_states = self.cbs.state_dicts()   # callbacks with state (mxtrain.train.deosc's open window)
        if cb_states:
            rest["callbacks"] = cb_states
        t_save = time.perf_counter()
        if env.distributed:  # DCP folder, every rank writes its shards; atomic rename
            path = out / D.DCP_NAME
            if background:
                job = D.save_checkpoint(path, model, opt, extra=rest, env=env, background=True)
                self.pending = (job, step, self.tokens, t_save, time.perf_counter() - t_save)
                return
            D.save_checkpoint(path, model, opt, extra=rest, env=env)
        else:
            path = ckpt_path
            if self.rank == 0:
                ckpt.save(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), **rest})
                for old in (out / D.DCP_NAME, out / D.DCP_OLD):   # an older multi-process leg's checkpoint
                    if D.is_checkpoint(old):
                        import shutil
                        shutil.rmtree(old)
        # the time every rank waited for the checkpoint (a DCP save ends with the ranks together)
        self._completed(path, step, self.tokens, {"save_s": time.perf_counter() - t_save})

    def _finish_pending(self) -> None:
        """The background checkpoint completed (every rank together): shards waited for, folder renamed."""
        if self.pending is None:
            return
        (job, step, at_tokens, t0, wait_s), self.pending = self.pending, None
        t_fin = time.perf_counter()
        path = job.finish()
        # save_s: what the ranks waited (the copy to host memory, then this finish); write_s: start to complete
        self._completed(path, step, at_tokens, {"save_s": wait_s + time.perf_counter() - t_fin,
                                                "write_s": time.perf_counter() - t0, "background": True})

    def _completed(self, path, step: int, at_tokens: int, row: dict) -> None:
        """A checkpoint written: its row, a kept copy (``train.keep_checkpoints_at``), the callbacks told."""
        env = self.env
        if env.distributed and self.rank == 0 and self.ckpt_path.exists():
            self.ckpt_path.unlink()  # a single-process leg's older checkpoint: resume must find the newest
        self.log.row({"step": step, "tokens": at_tokens, "event": "checkpoint", **row, "world_size": env.world_size})
        if step in self.keep and self.rank == 0:   # a budget checkpoint (train.keep_checkpoints_at): kept by its step
            ckpt.keep_copy(path, step)
        self.last_ckpt_step = step
        self.cbs.checkpoint(step, path)

    def _where(self) -> str:
        return (f"last good checkpoint: {self.ckpt_path} (step {self.last_ckpt_step})"
                if self.last_ckpt_step is not None else "no checkpoint was written yet")


def _train(cfg: TrainConfig, resume: str | Path | None, env: D.DistEnv, locks: list, callbacks: list) -> Outcome:
    trainer = Trainer(cfg, resume, env, locks, callbacks)
    trainer.setup()
    return trainer.run()


def _inexact_reader(device: torch.device):
    """A function that returns the fast path's running counts of inexact MXFP4 carrier blocks on ``device``:
    ``{"inexact_blocks": all, "inexact_x": inputs, "inexact_w": weights, "inexact_dy": output gradients}``
    (``mxtrain.linear.fast.inexact_blocks``; by tensor on a GPU), or None from a call where some fast-path call
    could not count; the function is None where this mxtrain has no such count."""
    try:
        from ..linear import fast  # startup
    except ImportError:
        return None
    fn = getattr(fast, "inexact_blocks", None)
    if fn is None:
        return None
    by = getattr(fast, "inexact_by_tensor", None) if device.type == "cuda" else None

    def read() -> dict | None:
        st = getattr(fast, "state", None)
        if st is not None and hasattr(st, "counted") and not st.counted(device):
            return None
        try:
            v = {"inexact_blocks": int(fn(device))}
        except TypeError:   # a count that takes no device
            v = {"inexact_blocks": int(fn())}
        if by is not None:
            v.update({f"inexact_{r}": int(n) for r, n in by(device).items()})
        return v
    return read
