"""A converted Hugging Face Llama trained by ``transformers.Trainer``, checkpointed and resumed: with
``mxtrain.interop.hftrainer.StepCallback`` the resumed steps draw the uninterrupted run's bits (their losses equal, bit
for bit, with ``tseng``'s per-step signs and stochastic rounding); without it they draw the first steps' bits."""

import pytest
import torch

import mxtrain

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")   # (Trainer needs it)

from mxtrain.interop.hftrainer import StepCallback   # noqa: E402

STEPS, SAVE = 4, 2


class _Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 96, (24, 16), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _Trainer(transformers.Trainer):
    """Keeps every micro-batch's loss as computed (the logged ones are rounded)."""

    losses: list

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


def _train(out, callbacks, resume=None):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    mxtrain.convert(model, "tseng")
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, save_strategy="steps", save_steps=SAVE, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = _Trainer(model=model, args=args, train_dataset=_Data(), callbacks=callbacks)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer.losses


def test_resumed_trainer_draws_the_uninterrupted_runs_bits(tmp_path):
    whole = _train(tmp_path / "whole", [StepCallback()])
    assert len(whole) == 2 * STEPS
    ckpt = tmp_path / "whole" / f"checkpoint-{SAVE}"
    resumed = _train(tmp_path / "resumed", [StepCallback()], resume=str(ckpt))
    assert torch.equal(torch.stack(resumed), torch.stack(whole[2 * SAVE:]))
    # without the callback the resumed steps restart at MX step 0: other signs and rounding, other losses
    bare = _train(tmp_path / "bare", [], resume=str(ckpt))
    assert not torch.equal(torch.stack(bare), torch.stack(whole[2 * SAVE:]))
