"""The MX step under Hugging Face's ``transformers.Trainer``: ``StepCallback`` numbers the random inputs of a
converted model's MX layers by the trainer's own optimizer step.

An MX layer's stochastic rounding and random signs are numbered by its ``mx_state`` buffer ``[layer, step,
call]`` (``mxtrain.linear.module``), which advances after every optimizer step but is not in the model's ``state_dict``
(``convert`` keeps a model's keys as they were, so a converted model's checkpoint loads into the plain model, into
``transformers`` and into anything that reads Hugging Face folders). A run resumed from a checkpoint therefore
starts its MX steps at 0 again and draws the bits of the first steps once more. ``Trainer`` saves and restores
its step (``state.global_step``, in ``trainer_state.json``); the callback sets every MX layer's step to it
before each optimizer step (``mxtrain.set_step``), so a resumed run draws what the uninterrupted run drew::

    trainer = transformers.Trainer(model, args, train_dataset=data, callbacks=[mxtrain.interop.hftrainer.StepCallback()])
    trainer.train(resume_from_checkpoint=True)
"""

from __future__ import annotations

try:
    from transformers import TrainerCallback
except ImportError as e:   # (mxtrain itself never imports this module)
    raise ImportError(f"mxtrain.interop.hftrainer needs transformers (pip install transformers accelerate): {e}") from None

from ..linear.module import set_step

__all__ = ["StepCallback"]


class StepCallback(TrainerCallback):
    """Set the step of every MX layer of the trained model to ``state.global_step`` before each optimizer step
    (``on_step_begin``, once per step whatever the gradient accumulation; the call counters start again as
    after an optimizer step: ``mxtrain.linear.module.call_base()``, each data-parallel rank its own). Uninterrupted, that
    is the step the layers hold anyway; resumed from a checkpoint, it is the checkpoint's step, not 0."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            set_step(model, state.global_step)
        return control
