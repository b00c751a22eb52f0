"""The training step's finite-loss and finite-gradient checks, made on the device (``train.check_every_step``).

Checked on the host (``on``; the default on CPU, and wherever a callback reads a step's numbers): every step the
host reads the loss and the gradient norm before the update, so it waits for the GPU twice a step and cannot
issue the next step's forward while the GPU still runs this step's backward and update.

Checked on the device (``off``; the default on CUDA): ``StepChecks.push`` turns the step's loss and gradient norm
into a sticky flag on the device that fused AdamW takes as ``found_inf`` (as ``torch.amp.GradScaler`` hands it):
from the first step whose loss or gradient norm is not finite on, no update is made, so the weights stay those of
the last good step. The step's numbers are copied to host memory behind the step's work; the host reads a step's
copy one step later (``ready``), when the GPU has finished it, and every step's copy before a log row, an
evaluation or a checkpoint (``drain``). A run that diverges therefore stops one step after the step that
diverged, with the same error, log row and outcome as when checked on the host, and no checkpoint is ever
written after it. On several processes the loss is averaged over the ranks on the device and the gradient
norm is the global one, so every rank reads the same flag at the same step; a signal's vote travels with the
same copy and stops every rank one step after it arrived.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class StepRecord:
    """One step's numbers as the host reads them: ``step`` (0-based), the tokens trained before it, the loss
    (averaged over ranks), the gradient norm, and the largest signal number any rank had caught (0: none)."""
    step: int
    tokens: int
    loss: float
    grad_norm: float
    vote: int

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class _Slot:
    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.buf = torch.empty(3, dtype=torch.float64, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.meta = None   # (step, tokens) of the copy in flight; None when read


class StepChecks:
    """The device-side checks of one run (see the module's docstring). ``found_inf``: a float32 scalar on the
    device, 0 until a step's loss or gradient norm is not finite, 1 from then on; give it to the optimizer once
    (``opt.found_inf = checks.found_inf``): it is updated in place."""

    def __init__(self, device: torch.device):
        self.device = device
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.no_vote = torch.zeros((), dtype=torch.float64, device=device)
        self.slots = [_Slot(device), _Slot(device)]
        self.order: list[_Slot] = []   # slots with a copy in flight, oldest first

    def push(self, step: int, tokens: int, loss: torch.Tensor, grad_norm: torch.Tensor,
             vote: torch.Tensor | None = None) -> None:
        """Step ``step``'s loss and gradient norm (0-dim tensors on the device; ``vote``: the signal vote reduced
        over ranks): the flag updated on the device, the numbers copied to host memory behind the step's work.
        Call it after the backward and the gradient clipping, before ``opt.step()``; the host waits for nothing
        here. Read the step before (``ready``) first: its copy's slot is this step's, and a slot not read yet is
        an error (RuntimeError), never overwritten."""
        loss, grad_norm = loss.detach().reshape(()), grad_norm.detach().reshape(())
        bad = torch.logical_not(torch.isfinite(loss)) | torch.logical_not(torch.isfinite(grad_norm))
        torch.maximum(self.found_inf, bad.to(torch.float32), out=self.found_inf)
        parts = [loss.to(torch.float64), grad_norm.to(torch.float64),
                 vote.reshape(()).to(torch.float64) if vote is not None else self.no_vote]
        slot = self.slots[step % 2]
        if slot.meta is not None:   # two steps back and never read: a caller's error, not a record to lose
            raise RuntimeError("StepChecks: a step's copy was overwritten before it was read (call ready() every step)")
        slot.buf.copy_(torch.stack(parts), non_blocking=slot.event is not None)
        if slot.event is not None:
            slot.event.record()
        slot.meta = (step, tokens)
        self.order.append(slot)

    def ready(self, keep: int = 1) -> list[StepRecord]:
        """The records of every step pushed but not read, oldest first, except the newest ``keep`` (the step the
        GPU may still run): the host waits only for those older copies, which the GPU has usually finished."""
        out = []
        while len(self.order) > keep:
            out.append(self._read(self.order.pop(0)))
        return out

    def drain(self) -> list[StepRecord]:
        """Every record not read yet (the host waits for the GPU to finish the last pushed step)."""
        return self.ready(keep=0)

    def _read(self, slot: _Slot) -> StepRecord:
        if slot.event is not None:
            slot.event.synchronize()
        loss, gnorm, vote = slot.buf.tolist()
        (step, tokens), slot.meta = slot.meta, None
        return StepRecord(step, tokens, loss, gnorm, int(vote))
