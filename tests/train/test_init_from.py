"""Continued pretraining from a local Hugging Face Llama folder (``train.init_from`` / ``--init-from``): a run
exported with ``mxtrain export`` initialises a new run with its exact weights and shapes (whatever the
config's model section says), resuming that run takes the weights from its checkpoint (only the folder's
config.json is read), and its checkpoints record the model's shapes (so the run exports without the
folder)."""

import shutil

import pytest
import torch

from mxtrain.interop.export import export_hf, load_run
from mxtrain.train import checkpoint as ckpt

from train_helpers import tiny_run_cfg


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from mxtrain.train import train
    base = tmp_path_factory.mktemp("initfrom")
    run = train(tiny_run_cfg(base / "run", 2))
    return run, export_hf(run, base / "hf")


def test_init_from_starts_from_the_exported_weights(exported, tmp_path):
    from mxtrain.train import train
    run, hf_dir = exported
    cfg = tiny_run_cfg(tmp_path / "cont", 1)
    cfg.train.init_from = str(hf_dir)
    cfg.model.dim = 64 * 3            # ignored: the folder's shapes decide
    from mxtrain.train.callbacks import Callback

    class Initial(Callback):          # the weights the first step starts from
        def on_train_begin(self, state):
            from mxtrain.train import parallel as D
            self.sd = {k: v.detach().clone() for k, v in D.unwrap(state.model).state_dict().items()}
    cap = Initial()
    out = train(cfg, callbacks=[cap])
    src = ckpt.load(run)["model"]
    assert set(cap.sd) == set(src)
    for k, v in src.items():
        assert torch.equal(cap.sd[k].to(v.dtype), v), k
    assert ckpt.load(out)["model_config"]["dim"] == load_run(run)[0].cfg.dim
    # resuming reads the weights from the checkpoint (the folder, moved, keeps only its config.json)
    moved = tmp_path / "moved"
    shutil.move(str(hf_dir), moved)
    (moved / "model.safetensors").rename(moved / "weights.bak")
    try:
        cfg2 = tiny_run_cfg(tmp_path / "cont", 2)
        cfg2.train.init_from = str(moved)   # (the config must still name an existing folder)
        cfg2.model.dim = 64 * 3
        out2 = train(cfg2, resume=out)
        assert ckpt.load(out2)["step"] == 2
    finally:
        (moved / "weights.bak").rename(moved / "model.safetensors")
        shutil.move(str(moved), hf_dir)
