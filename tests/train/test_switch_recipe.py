"""``train.switch_recipe``: from a step on, every linear layer trains with another recipe (a high-precision end of
an MXFP4 run, as NVIDIA's NVFP4 recipe ends; a cooldown branch in BF16 from an MXFP4 run). Eager and compiled,
resumed past the switch, bad values refused in one line."""

import json

import pytest
import torch

from mxtrain.errors import UserError
from mxtrain.train import train

from train_helpers import tiny_run_cfg


def _losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r and "val_loss" not in r], rows


def _cfg(out, steps, switch=None, **kw):
    cfg = tiny_run_cfg(out, steps, **kw)
    cfg.log.log_every = 1
    cfg.train.switch_recipe = switch
    return cfg


def test_switch_trains_the_rest_with_the_new_recipe_and_resumes_past_it(tmp_path):
    torch.set_num_threads(1)
    mx, _ = _losses(train(_cfg(tmp_path / "mx", 6)))
    sw_run = train(_cfg(tmp_path / "sw", 6, "3:bf16", keep_checkpoints_at="3"))
    sw, rows = _losses(sw_run)
    assert sw[:3] == mx[:3] and sw[3:] != mx[3:]          # the first 3 steps in MXFP4, the rest not
    ev = [r for r in rows if r.get("event") == "recipe_switch"]
    assert [(e["step"], e["recipe"]) for e in ev] == [(3, "bf16")]
    # a BF16 run from the MXFP4 run's step-3 state, in a folder of its own (the kept checkpoint's own folder has
    # the later steps, which a resume there would overwrite): the same steps 4-6 (the switch is all that differs)
    resumed = train(_cfg(tmp_path / "from3", 6, "3:bf16"), resume=sw_run / "checkpoint-3.pt")
    again, rows2 = _losses(resumed)
    assert again[-3:] == sw[3:]
    assert [(e["step"], e["recipe"]) for e in rows2 if e.get("event") == "recipe_switch"][-1] == (3, "bf16")


def test_switch_under_torch_compile(tmp_path):
    """Blocks compiled: the switch takes effect (the compiled blocks follow the layers' new recipe) and the
    losses after it are the eager run's."""
    torch.set_num_threads(1)
    eager, _ = _losses(train(_cfg(tmp_path / "e", 5, "2:bf16")))
    comp, _ = _losses(train(_cfg(tmp_path / "c", 5, "2:bf16", compile="on")))
    mx, _ = _losses(train(_cfg(tmp_path / "m", 5, None, compile="on")))
    assert comp[2:] != mx[2:]
    assert comp == pytest.approx(eager, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("value, what", [("3", "STEP:RECIPE"), ("x:bf16", "STEP:RECIPE"), ("6:bf16", "inside the run"),
                                         ("0:bf16", "inside the run"), ("2:nope", "unknown recipe"),
                                         ("2.5:bf16", "whole number")])
def test_bad_values_are_refused(tmp_path, value, what):
    with pytest.raises(UserError, match=what):
        train(_cfg(tmp_path / "r", 6, value))


def test_fraction_of_the_run():
    from mxtrain.train.config import switch_step
    cfg = _cfg(None, 10, "0.8:bf16")
    assert switch_step(cfg) == (8, "bf16")
    cfg.train.switch_recipe = "4:mxfp4-all-dh16"
    assert switch_step(cfg) == (4, "mxfp4-all-dh16")
    cfg.train.switch_recipe = None
    assert switch_step(cfg) is None
