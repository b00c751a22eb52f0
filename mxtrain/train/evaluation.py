"""Evaluation during and at the end of a run: the validation loss over the fixed validation windows, each
window's loss (``RUN/eval_windows.jsonl``), the validation source of each window (``RUN/eval_sources.json``) and
the end-of-run evaluation over more tokens (``RUN/eval_final.json``), as the trainer runs them
(``Trainer.evaluate``, ``Trainer.run``)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from . import parallel as D
from .checkpoint import state_note
from ..data import TokenData, val_batches
from ..data.loader import val_window_sources
from ..errors import UserError
from .config import TrainConfig
from .run_folder import _write_json

__all__ = ["evaluate", "evaluate_windows", "final_evaluation", "write_window_sources", "append_windows",
           "WINDOWS_NAME", "FINAL_EVAL_NAME", "DOMAINS_NAME"]


@torch.no_grad()
def evaluate(model, data: TokenData, cfg: TrainConfig, device, amp_dtype, rank=0, world=1) -> float:
    """The mean validation loss over the fixed validation windows (``log.eval_tokens``)."""
    return evaluate_windows(model, data, cfg, device, amp_dtype, rank, world)[0]


WINDOWS_NAME = "eval_windows.jsonl"   # per evaluation: {"step", "tokens", "losses": [one mean loss per window]}
FINAL_EVAL_NAME = "eval_final.json"   # log.final_eval_tokens: {"step", "tokens", "eval_tokens", "val_loss", "losses"}


def final_evaluation(model, data: TokenData, cfg: TrainConfig, device, amp_dtype, step: int, tokens: int, out: Path,
                     rank=0, world=1) -> float | None:
    """The end-of-run evaluation over ``log.final_eval_tokens`` validation tokens (when that exceeds
    ``log.eval_tokens``): the same spread of windows for every run of that setting, written by rank 0 to
    ``RUN/eval_final.json`` (atomically); returns its mean loss, or None when the setting is off."""
    n = cfg.log.final_eval_tokens
    if not n or n <= cfg.log.eval_tokens:
        return None
    big = copy.deepcopy(cfg)
    big.log.eval_tokens = n
    val, windows = evaluate_windows(model, data, big, device, amp_dtype, rank, world)
    if rank == 0:
        src = val_window_sources(data, cfg.data.seq_len, n)
        _write_json(out / FINAL_EVAL_NAME, {"step": step, "tokens": tokens, "eval_tokens": n, "val_loss": val,
                                            "losses": [round(float(w), 6) for w in windows],
                                            **({"sources": src} if src else {})})
    return val


DOMAINS_NAME = "eval_sources.json"   # the validation source of each window of eval_windows.jsonl (fixed val files)


def write_window_sources(data: TokenData, cfg: TrainConfig, out: Path) -> None:
    """``RUN/eval_sources.json``: ``{"eval_tokens", "sources": [the fixed validation file of each window, in
    eval_windows.jsonl's order]}`` where the prepared folder records its validation files' spans."""
    src = val_window_sources(data, cfg.data.seq_len, cfg.log.eval_tokens)
    if src:
        _write_json(out / DOMAINS_NAME, {"eval_tokens": cfg.log.eval_tokens, "sources": src})


@torch.no_grad()
def evaluate_windows(model, data: TokenData, cfg: TrainConfig, device, amp_dtype, rank=0,
                     world=1) -> tuple[float, list[float]]:
    """``(mean loss, [loss of each validation window])``: the windows are the fixed validation set's
    (``val_batches``), in order, each window's loss the mean over its ``seq_len`` tokens; the mean is the
    token-weighted mean of ``evaluate`` (the same number as ``model(x, y)`` gives, batch by batch). The
    per-window losses let a study bootstrap over evaluation windows (``mxtrain.study.cooldown``)."""
    model.eval()
    total, count = 0.0, 0
    mine: list[float] = []
    bs = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // world)
    # every rank runs as many forwards (FSDP2 gathers in each); padding batches weigh 0
    def first_window():   # a rank without a window of its own (fewer windows than ranks) forwards the first
        # batch of the set (weight 0), of the other ranks' batch size where there are that many windows
        return next(iter(val_batches(data, cfg.data.seq_len, bs, cfg.log.eval_tokens, 0, 1)))
    mine_batches = val_batches(data, cfg.data.seq_len, bs, cfg.log.eval_tokens, rank, world)
    for (x, y), w in D.even_batches(mine_batches, pad=first_window):
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            logits = model(x)
            flat = logits.float().view(-1, logits.size(-1))
            loss = F.cross_entropy(flat, y.reshape(-1))   # as Llama.forward(x, y) computes it
            per = F.cross_entropy(flat, y.reshape(-1), reduction="none").view(y.shape).mean(dim=1)
        total += w * loss.item() * y.numel()
        count += w * y.numel()
        if w:
            mine += per.tolist()
    model.train()
    total, count = D.reduce_sums(total, count)  # token-weighted mean over all ranks
    windows = mine
    if world > 1:   # rank r holds windows r, r + world, ...: gathered in order by one sum
        n = int(round(D.reduce_sums(float(len(mine)))[0]))
        full = [0.0] * n
        for k, v in enumerate(mine):
            full[rank + k * world] = v
        windows = D.reduce_sums(*full) if n else []
    return total / count, [float(v) for v in windows]


def append_windows(path: Path, step: int, tokens: int, losses: list[float]) -> None:
    """One row of ``eval_windows.jsonl`` (losses rounded to 6 decimals: compact, far below seed noise)."""
    row = {"step": step, "tokens": tokens,
           "losses": [round(v, 6) if math.isfinite(v) else str(v) for v in losses]}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}{state_note(path.parent)}") from None
