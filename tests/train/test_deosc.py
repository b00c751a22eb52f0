"""Weight de-oscillation (mxtrain.train.deosc): the detector on a weight sequence with known oscillations, the reset
snapping exactly the oscillating entries (in the rotated domain for rotated recipes, against an explicit
Hadamard matrix), bit-exact resume with the open window in the checkpoint, and clear errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mxtrain.train.deosc import DeoscSettings, Deoscillator, check_recipe
from mxtrain.errors import UserError
from mxtrain.numerics.hadamard import hadamard_matrix, rotation_signs
from mxtrain.linear.module import MXLinear
from mxtrain.numerics.quant import fake_quantize
from mxtrain.numerics.recipe import Rotation
from mxtrain.numerics.recipes import get as get_recipe

from train_helpers import one_line_error, run_cli, run_main, small_data, tiny_run_cfg

LO, HI = 1.25 - 1 / 64, 1.25 + 1 / 64   # either side of the FP4 boundary 1.25 (scale 1): Q = 1.0 / 1.5

# one 32-element block per row, scale 2^0 (amax 4.0 is element 0 of every row); per tracked step t = 0..4:
SEQ = {
    1: [LO, HI, LO, HI, LO],                                   # A: oscillates every step
    2: [1.203125, 1.234375, 1.265625, 1.296875, 1.328125],     # B: drifts across the boundary once
    3: [0.5, 1.5, 3.0, 1.5, 0.5],                              # C: large moves from grid point to grid point
    4: [2.0] * 5,                                              # D: still
    5: [0.875 - 1 / 64, 0.875 + 1 / 64] * 2 + [0.875 - 1 / 64],  # E: jitters inside one bin (Q = 1.0)
    6: [-LO, -HI, -LO, -HI, -LO],                              # F: A, negative
}
# expected over the window: dist = sum |dw|, dist_q = sum |dQ(w)|, flips = number of changes of Q(w)
EXPECT = {1: (4 / 32, 2.0, 4), 2: (4 / 32, 0.5, 1), 3: (5.0, 5.0, 4), 4: (0.0, 0.0, 0), 5: (4 / 32, 0.0, 0),
          6: (4 / 32, 2.0, 4)}


def _layer(recipe="mxfp4-all", rows=2):
    lin = MXLinear(32, rows, bias=False, recipe=recipe)
    return torch.nn.Sequential(lin), lin


def _weights(t: int, rows=2) -> torch.Tensor:
    w = torch.zeros(rows, 32)
    w[:, 0] = 4.0
    for j, seq in SEQ.items():
        w[:, j] = seq[t]
    return w


def _drive(model, lin, settings, steps=4):
    """Open a window on the t = 0 weights and track t = 1..steps (no reset)."""
    d = Deoscillator(model, settings)
    with torch.no_grad():
        lin.weight.copy_(_weights(0))
    d.open(0)
    for t in range(1, steps + 1):
        with torch.no_grad():
            lin.weight.copy_(_weights(t))
        d.track()
    return d


def test_detector_counts_on_a_known_sequence():
    model, lin = _layer()
    d = _drive(model, lin, DeoscSettings(period=4, threshold=4.0, min_flips=1))
    assert [n for n, _ in d.layers] == ["0"]
    st = d.state["0"]
    for j, (dist, dist_q, flips) in EXPECT.items():
        for r in range(2):
            assert st["dist"][r, j].item() == dist and st["dist_q"][r, j].item() == dist_q, j   # exact: dyadic values
            assert st["flips"][r, j].item() == flips, j
    assert st["flips"].dtype == torch.int16
    assert torch.count_nonzero(st["dist"][:, 7:]) == 0 and torch.count_nonzero(st["flips"][:, 7:]) == 0
    mask = d.oscillating("0")
    assert sorted(mask[0].nonzero().flatten().tolist()) == [1, 2, 6]     # B's ratio is exactly 4 >= 4
    # a higher bar: only the entries that flipped back and forth
    d.s = DeoscSettings(period=4, threshold=4.0, min_flips=2)
    assert sorted(mask.nonzero()[:, 1].tolist()) == [1, 1, 2, 2, 6, 6]
    assert sorted(d.oscillating("0")[0].nonzero().flatten().tolist()) == [1, 6]
    d.s = DeoscSettings(period=4, threshold=4.5)
    assert sorted(d.oscillating("0")[1].nonzero().flatten().tolist()) == [1, 6]


def test_reset_snaps_exactly_the_oscillating_entries():
    model, lin = _layer()
    d = _drive(model, lin, DeoscSettings(period=4, threshold=4.0))
    before = lin.weight.detach().clone()
    mask = d.oscillating("0").clone()
    stats = d.reset()
    after = lin.weight.detach()
    assert stats == {"tracked": 64, "reset": 6, "changed": 2 * 4}   # A, B, C, F change Q in both rows
    q = fake_quantize(before, "mxfp4", axis=-1)
    assert torch.equal(after[mask], q[mask])                      # snapped to the bin centre, exactly
    assert torch.equal(after[~mask], before[~mask])               # everything else bit for bit
    assert after[0, 1].item() == 1.0 and after[0, 2].item() == 1.5 and after[0, 6].item() == -1.0


def test_schedule_windows_and_stats():
    """begin/end over steps: windows open every period at 'start', reset at the window's last step."""
    model, lin = _layer()
    d = Deoscillator(model, DeoscSettings(period=6, window=4, threshold=4.0, start=2))
    got = {}
    for done in range(0, 14):
        d.begin(done)
        with torch.no_grad():
            lin.weight.copy_(_weights((done + 1 - 2) % 5 if done + 1 >= 2 else 0))
        r = d.end(done + 1)
        if r is not None:
            got[done + 1] = r
    # windows open at 2 and 8 (steps done), are tracked 4 steps and reset at 6 and 12
    assert sorted(got) == [6, 12]
    assert got[6]["opened"] == 2 and got[6]["window"] == 4 and got[6]["reset"] == 6
    assert d.opened is None and d.state == {}                     # window < period: state freed between windows


def _rotation_matrix(size: int, width: int, signs):
    """R with V = W R for the blockwise Hadamard of mxtrain.numerics.hadamard (signs first), from the explicit matrix."""
    h = hadamard_matrix(size)
    s = torch.ones(size, dtype=torch.float64) if signs is None else signs.double()
    blk = torch.diag(s) @ h.t()
    return torch.block_diag(*[blk] * (width // size))


@pytest.mark.parametrize("signs", ["none", "fixed", "per_layer"])
def test_rotated_recipes_snap_in_the_rotated_domain(signs):
    r = get_recipe("mxfp4-all").with_(fprop_rotation=Rotation(16, signs), seed=7)
    model, lin = _layer(r, rows=4)
    lin.layer_id = 3
    torch.manual_seed(1)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 32) * 0.02)
    d = Deoscillator(model, DeoscSettings())
    sv = rotation_signs(16, signs, seed=7, layer=3) if signs != "none" else None
    R = _rotation_matrix(16, 32, sv)
    w0 = lin.weight.detach().double().clone()
    v_ref = w0 @ R
    g = d.grids["0"]
    v = g.to_domain(lin.weight)
    assert torch.allclose(v.double(), v_ref, atol=1e-9)           # the grid's domain is W R
    q = g.quantize(v)
    mask = torch.zeros_like(v, dtype=torch.bool)
    mask[0, 3] = mask[2, 17] = mask[3, 31] = True
    with torch.no_grad():
        g.snap(lin.weight, mask, v, q)
    v_new = lin.weight.detach().double() @ R
    assert torch.allclose(v_new[mask], q[mask].double(), atol=1e-8)
    assert torch.allclose(v_new[~mask], v_ref[~mask], atol=1e-8)
    # W moved by (Q(V) - V) R^T on the masked entries only: rows 1 untouched, row 0 only in its first block
    dw = lin.weight.detach().double() - w0
    assert torch.equal(dw[1], torch.zeros(32, dtype=torch.float64))
    assert torch.count_nonzero(dw[0, 16:]) == 0 and torch.count_nonzero(dw[0, :16]) == 16


def test_recipes_without_a_fixed_weight_grid_are_refused():
    check_recipe(get_recipe("mxfp4-all"))
    check_recipe(get_recipe("mxfp4-all-dh16"))
    check_recipe(get_recipe("nvfp4"))
    for name, frag in (("tseng", "keeps the Fprop weight"), ("bf16", "keeps the Fprop weight"),
                       ("mxfp4-all-rht16", "per_step")):
        with pytest.raises(UserError, match=frag):
            check_recipe(get_recipe(name))
    for bad, frag in ((dict(period=0), "deosc.period"), (dict(period=4, window=5), "deosc.window"),
                      (dict(threshold=0.0), "deosc.threshold"), (dict(min_flips=-1), "deosc.min_flips"),
                      (dict(start=-2), "deosc.start"), (dict(threshold=float("nan")), "deosc.threshold")):
        with pytest.raises(UserError, match=frag):
            DeoscSettings(**bad)


def test_cli_errors_are_one_line(tmp_path):
    base = ["train", "--exp", "debug", "--data", str(small_data()), "--steps", "2", "--device", "cpu"]
    one_line_error(run_cli(*base, "--recipe", "tseng", "--set", "deosc.enable=true", "--out", str(tmp_path / "a")),
                   "deosc.enable", "tseng")
    # the others through mxtrain.cli.core.main in this process (tests/train_helpers.py: run_main)
    one_line_error(run_main(*base, "--set", "deosc.window=500", "--out", str(tmp_path / "b")), "deosc.window")
    one_line_error(run_main(*base, "--set", "deosc.threshold=x", "--out", str(tmp_path / "c")), "deosc.threshold")
    one_line_error(run_main(*base, "--set", "deosc.enable=true", "--parallel", "fsdp2", "--out", str(tmp_path / "d")),
                   "deosc.enable", "FSDP2")


# -- in the trainer -----------------------------------------------------------------------------------------

def _cfg(out, steps, **deosc):
    cfg = tiny_run_cfg(out, steps)
    cfg.log.eval_every, cfg.log.eval_tokens = 4, 256
    cfg.deosc.enable = True
    cfg.deosc.period, cfg.deosc.threshold = 3, 0.5
    for k, v in deosc.items():
        setattr(cfg.deosc, k, v)
    return cfg


def _losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


def test_resume_is_bit_exact_with_the_open_window(tmp_path):
    from mxtrain.train import checkpoint as ckpt
    from mxtrain.train import train
    torch.set_num_threads(1)
    full = train(_cfg(tmp_path / "full", 8))
    rows = [json.loads(x) for x in (full / "deosc.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6] and all(r["reset"] > 0 for r in rows)   # resets happen
    half = train(_cfg(tmp_path / "half", 4))
    st = torch.load(half / ckpt.NAME, weights_only=True)
    assert st["callbacks"]["deosc"]["opened"] == 3                 # step 4 is inside the window opened at 3
    assert set(st["callbacks"]["deosc"]["layers"]) and all(
        set(v) == {"prev", "prev_q", "dist", "dist_q", "flips"} for v in st["callbacks"]["deosc"]["layers"].values())
    resumed = train(_cfg(None, 8), resume=half)
    assert _losses(resumed) == _losses(full)                       # bit for bit
    sa, sb = torch.load(full / ckpt.NAME), torch.load(resumed / ckpt.NAME)
    assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
    assert (resumed / "deosc.jsonl").read_text() == (full / "deosc.jsonl").read_text()

    # the window's state matters: resumed without it, the window opened at step 3 is lost and training differs
    lost = tmp_path / "lost"
    lost.mkdir()
    del st["callbacks"]
    ckpt.save(lost / ckpt.NAME, {k: v for k, v in st.items() if k != "format"})
    other = train(_cfg(lost, 8), resume=lost)
    lo, lf = _losses(other)[0], _losses(full)[0]
    # steps 5-7 the same: no reset before step 6, and a reset leaves Q(w), what step 7's forward sees, unchanged;
    # step 8 differs: step 7's update started from the bin centres in the full run
    assert len(lo) == 4 and lo[:3] == lf[4:7] and lo[3] != lf[7]

    # no deosc, no callback state in the checkpoint
    plain = _cfg(tmp_path / "plain", 2)
    plain.deosc.enable = False
    assert "callbacks" not in torch.load(train(plain) / ckpt.NAME, weights_only=True)


def test_other_settings_on_resume_are_refused(tmp_path):
    from mxtrain.train import train
    half = train(_cfg(tmp_path / "half", 4))
    with pytest.raises(UserError, match="same deosc"):
        train(_cfg(None, 8, period=4), resume=half)


def test_study_arm_with_deosc(tmp_path, capsys):
    """A tiny study whose arm `mxfp4-all@deosc` is mxfp4-all with de-oscillation on: it trains, resets weights,
    and the summary and report carry it; bad arm names are one line."""
    from mxtrain.cli.core import main
    out = tmp_path / "st"
    args = ["study", "--preset", "smoke", "--arms", "bf16,mxfp4-all@deosc", "--seeds", "1", "--steps", "8",
            "--diagnose-every", "0", "--set", "deosc.period=2", "--set", "deosc.threshold=0.5",
            "--set", "log.tensorboard=false", "--out", str(out)]
    assert main(args) == 0
    rd = out / "runs" / "mxfp4-all@deosc" / "seed0"
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["recipe"] == "mxfp4-all" and cfg["deosc"]["enable"] is True and cfg["deosc"]["period"] == 2
    assert json.loads((out / "runs" / "bf16" / "seed0" / "config.json").read_text())["deosc"]["enable"] is False
    rows = [json.loads(x) for x in (rd / "deosc.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8] and sum(r["reset"] for r in rows) > 0
    s = json.loads((out / "summary.json").read_text())
    a = s["arms"]["mxfp4-all@deosc"]
    assert a["recipe"]["name"] == "mxfp4-all" and math.isfinite(a["final_val_loss"]["mean"])
    meta = json.loads((out / "study.json").read_text())
    assert meta["arm_options"] == {"mxfp4-all@deosc": ["deosc.enable=true"]}
    html = (out / "report.html").read_text()
    assert "Weight de-oscillation" in html and "weight de-oscillation (OsciReset" in html
    capsys.readouterr()
    assert main(["study", "--arms", "bf16,mxfp4-all@nope", "--out", str(tmp_path / "x"), "--dry-run"]) == 2
    assert "unknown arm option 'nope'" in capsys.readouterr().err
    assert main(["study", "--arms", "bf16,bf16@deosc", "--out", str(tmp_path / "y"), "--dry-run"]) == 2
    assert "keeps the Fprop weight" in capsys.readouterr().err
    assert main(["study", "--arms", "bf16,mxfp4-all/x", "--out", str(tmp_path / "z"), "--dry-run"]) == 2
    assert "letters, digits" in capsys.readouterr().err


def test_own_loop_with_a_compiled_model_and_foreach_adamw():
    """docs/library.md's loop: a converted MLP under ``torch.compile``, foreach AdamW, a ``Deoscillator`` driven
    by ``begin``/``end``. Windows close at the period with resets; right after each reset the compiled model's
    output is that of a freshly compiled model on the same weights, bit for bit (it reads the snapped weights,
    nothing stale), and the weights it trained on equal an eager run's within the compiler's tolerance."""
    import mxtrain

    def run(compiled):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 64))
        mxtrain.convert(model, "mxfp4-all", skip=())
        f = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
        deosc = Deoscillator(model, DeoscSettings(period=4, threshold=2.0))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
        rows, fresh = [], []
        for step in range(12):
            deosc.begin(step)
            loss = torch.nn.functional.mse_loss(f(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = deosc.end(step + 1)
            if stats is not None:
                rows.append(stats)
                if compiled:
                    with torch.no_grad():
                        a = f(x)
                        torch._dynamo.reset()
                        b = torch.compile(model)(x)
                    fresh.append(torch.equal(a, b))
        return rows, fresh, [p.detach().clone() for p in model.parameters()]
    rows, fresh, w = run(True)
    assert [r["step"] for r in rows] == [4, 8, 12] and all(r["reset"] > 0 for r in rows), rows
    assert fresh == [True, True, True]
    rows_e, _, w_e = run(False)
    assert [r["step"] for r in rows_e] == [4, 8, 12]
    for a, b in zip(w, w_e):
        assert (a - b).norm() <= 1e-2 * b.norm()
