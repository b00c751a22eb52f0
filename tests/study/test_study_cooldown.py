"""Cooldown studies: a stable run per arm x seed, cooldown branches at each budget, resumable, summarized."""

from __future__ import annotations

import json
from dataclasses import asdict
import math

import pytest

from mxtrain.errors import UserError
from mxtrain.study.plan import StudySpec, branch_plan
from mxtrain.study.run import train_branch
from mxtrain.study.workers import run_study
from train_helpers import data_cache

SMOKE = ["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "schedule.warmup_steps=2",
         "optim.lr=5e-3", "log.eval_tokens=512", "log.log_every=4", "log.tensorboard=false"]


def _spec(out, **kw):
    kw.setdefault("overrides", list(SMOKE))
    return StudySpec(out=str(out), arms=["bf16", "mxfp4-all"], seeds=2, model="tiny", steps=16, batch_size=4,
                     seq_len=32, eval_every=4, device="cpu", budgets=[0.5, 0.75, 1.0], cooldown=0.25, n_boot=50,
                     **kw)


def test_branch_plan_and_checks(tmp_path):
    assert branch_plan(_spec(tmp_path), 16, 2) == [(0.5, 6, 2), (0.75, 9, 3), (1.0, 12, 4)]
    with pytest.raises(UserError, match="inside the warmup"):
        branch_plan(_spec(tmp_path), 16, 7)
    with pytest.raises(UserError, match="long-cosine"):
        _spec(tmp_path, schedule="long-cosine")
    with pytest.raises(UserError, match=r"in \(0, 1\]"):
        StudySpec(out=str(tmp_path), budgets=[0.5, 1.5])


def test_cooldown_study_end_to_end_and_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    import torch
    torch.set_num_threads(1)
    out = tmp_path / "study"
    calls = []

    def counting(spec, arm, seed, rd, budget, k, n, bd):
        calls.append((arm, seed, budget))
        return train_branch(spec, arm, seed, rd, budget, k, n, bd)

    run_study(_spec(out), log=lambda m: None, branch_fn=counting)
    assert len(calls) == 2 * 2 * 3
    # what the dry run counted is what ran: steps and evaluations of a run and its branches
    from mxtrain.study.run import compute_plan
    plan = compute_plan(_spec(out))
    folders = [out / "runs" / "bf16" / "seed0", *sorted((out / "runs" / "bf16" / "seed0" / "branches").iterdir())]
    rows = [json.loads(x) for f in folders for x in (f / "metrics.jsonl").read_text().splitlines()]
    assert sum("val_loss" in r for r in rows) * 512 * plan["runs"] == plan["eval_tokens"]
    # ... and on the finished folder it counts nothing left; a run missing one branch is left whole
    assert plan["runs_done"] == plan["runs"] == 4 and plan["train_tokens_left"] == 0 == plan["eval_tokens_left"]
    bst = out / "runs" / "bf16" / "seed1" / "branches" / "k9-n3" / "study_status.json"
    kept = bst.read_text()
    bst.unlink()
    part = compute_plan(_spec(out), tokens_per_s=1000.0)
    assert part["runs_done"] == 3 and part["train_tokens_left"] == plan["train_tokens"] / 4
    assert part["hours"] == pytest.approx((part["train_tokens_left"] + part["eval_tokens_left"] / 3) / 1000 / 3600)
    from mxtrain.study.run import describe_compute
    assert "left to train: 1 runs" in describe_compute(part)
    bst.write_text(kept)
    # another base config: the study would refuse the folder, and the dry run says so
    other = compute_plan(StudySpec(**{**asdict(_spec(out)), "steps": 20}))
    assert other["folder_mismatch"] and other["runs_done"] == 0
    assert "different base config" in describe_compute(other)
    rd = out / "runs" / "mxfp4-all" / "seed1"
    cfg = json.loads((rd / "config.json").read_text())
    assert cfg["schedule"]["kind"] == "constant" and cfg["train"]["steps"] == 12
    assert sorted(p.name for p in rd.glob("checkpoint-*.pt")) == ["checkpoint-12.pt", "checkpoint-6.pt",
                                                                  "checkpoint-9.pt"]
    b = rd / "branches" / "k9-n3"
    st = json.loads((b / "study_status.json").read_text())
    assert st["state"] == "done" and st["budget"] == 0.75 and st["at_step"] == 9 and st["cooldown_steps"] == 3
    bcfg = json.loads((b / "config.json").read_text())
    assert bcfg["schedule"]["kind"] == "wsd" and bcfg["schedule"]["decay_shape"] == "1-sqrt"
    s = json.loads((out / "summary.json").read_text())
    assert s["planned_runs"] == 4 and s["planned_branches"] == 12 and s["missing"] == [] and len(s["branches"]) == 12
    assert all(r["state"] == "done" and math.isfinite(r["val_loss"]) for r in s["branches"])
    cool = s["cooldown"]
    assert cool["budgets"] == [0.5, 0.75, 1.0]
    mx = cool["arms"]["mxfp4-all"]
    assert mx["n_seeds"] == 2 and mx["n_windows"] == 512 // 32 and len(mx["budgets"]) == 3
    assert [r["tokens"] for r in mx["budgets"]] == [8 * 128, 12 * 128, 16 * 128]
    # a toy model (0.6 M parameters, 2 seeds): numbers, and no verdict, for both reasons
    (line,) = [v for v in cool["verdict"] if v.startswith("mxfp4-all: ")]
    assert "no verdict: 2 seeds" in line and "gap " in line
    assert any(v.startswith("no verdict in this report: ") and "M parameters, below the 10 M a verdict needs" in v
               for v in cool["verdict"])
    assert cool["scale"]["params"] < 1e6 and cool["scale"]["tokens"] == 16 * 128
    html = (out / "report.html").read_text()
    assert "Cooled-down comparison" in html and "no verdict in this report" in html
    # the per-seed record beside the report: every arm, seed and budget's cooled-down loss
    seeds = json.loads((out / "seeds.json").read_text())
    assert seeds["params"] == cool["scale"]["params"] and seeds["budgets"] == [0.5, 0.75, 1.0]
    assert set(seeds["arms"]) == {"bf16", "mxfp4-all"} and set(seeds["arms"]["bf16"]) == {"0", "1"}
    g = seeds["arms"]["mxfp4-all"]["1"]["cooled"]["1"]["loss"] - seeds["arms"]["bf16"]["1"]["cooled"]["1"]["loss"]
    assert g == pytest.approx(mx["budgets"][-1]["gap_seeds"][1], abs=1e-9)

    # a crash mid-branch: that branch alone is trained again; a failed one too; the rest is skipped
    (b / "study_status.json").unlink()
    f = out / "runs" / "bf16" / "seed0" / "branches" / "k6-n2" / "study_status.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "state": "failed", "message": "boom"}))
    calls.clear()
    run_study(_spec(out), log=lambda m: None, branch_fn=counting)
    assert sorted(calls) == [("bf16", 0, 0.5), ("mxfp4-all", 1, 0.75)]
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["missing"] == [] and s2["cooldown"]["verdict"] == cool["verdict"]     # deterministic, same result
    assert cool["fit_loss"] == "lsq" and cool["fit"]["loss"] == "lsq"

    # the same points refitted with the Huber loss (mxtrain report --fit huber)
    from mxtrain.cli.core import main
    assert main(["report", str(out), "--fit", "huber"]) == 0
    s3 = json.loads((out / "summary.json").read_text())
    assert s3["cooldown"]["fit_loss"] == "huber" and s3["cooldown"]["fit"]["loss"] == "huber"
    assert "Huber loss on log L" in (out / "report.html").read_text()

    # every arm against a further reference chosen when reporting (mxtrain report --references)
    assert main(["report", str(out), "--references", "mxfp4-all"]) == 0
    s4 = json.loads((out / "summary.json").read_text())
    ref = s4["references"]["mxfp4-all"]
    assert set(ref["arms"]) == {"bf16", "mxfp4-all"} and "mxfp4-all" in s4["cooldown"]["references"]
    bf = ref["arms"]["bf16"]["final_gap"]["mean"]
    assert bf == pytest.approx(-s4["arms"]["mxfp4-all"]["final_gap_vs_baseline"]["mean"])   # same pairs, sign flipped
    assert "Against mxfp4-all" in (out / "report.md").read_text()
    assert main(["report", str(out), "--references", "nvfp4"]) == 2
    assert "--references nvfp4: no runs of that arm" in capsys.readouterr().err


def test_cli_and_config_file_budgets(tmp_path, capsys):
    from mxtrain.cli.core import main
    assert main(["study", "--arms", "bf16,mxfp4-all", "--steps", "100", "--budgets", "0.5,1", "--cooldown", "0.1",
                 "--out", str(tmp_path / "s"), "--dry-run"]) == 0
    assert "cooldown branches at budgets 0.5, 1 of the run (0.1 of each branch cooling down, 1-sqrt)" in capsys.readouterr().out
    f = tmp_path / "s.toml"
    f.write_text('[study]\narms = ["bf16"]\nbudgets = [0.25, 1.0]\ncooldown_shape = "linear"\n')
    assert main(["study", "--config", str(f), "--steps", "100", "--out", str(tmp_path / "t"), "--dry-run"]) == 0
    assert "budgets 0.25, 1 of the run (0.2 of each branch cooling down, linear)" in capsys.readouterr().out
    assert main(["study", "--arms", "bf16", "--steps", "100", "--budgets", "0.5,0.75,1", "--fit", "huber",
                 "--out", str(tmp_path / "w"), "--dry-run"]) == 0
    assert main(["study", "--arms", "bf16", "--budgets", "0.5,x", "--out", str(tmp_path / "u"), "--dry-run"]) == 2
    assert main(["study", "--arms", "bf16", "--steps", "10", "--budgets", "0.1", "--out", str(tmp_path / "v"),
                 "--dry-run"]) == 2          # a branch point before the first step: refused before anything runs
    assert "budget 0.1 of a 10-step run branches at step 0" in capsys.readouterr().err


def test_compute_plan_counts_what_the_study_trains(tmp_path, capsys):
    """The dry run's counts: the model's parameters as built, tokens per run and per parameter, every run's
    stable steps plus its branches (16-step runs, budgets 0.5/0.75/1 with a quarter cooling down: the stable
    run to step 12, branches of 2, 3 and 4 steps), evaluations, and the time at a given rate."""
    from mxtrain.cli.core import main
    from mxtrain.study.run import compute_plan
    from mxtrain.train.trainer import _model_config, build_model
    import torch
    spec = _spec(tmp_path / "s")
    c = compute_plan(spec, tokens_per_s=1000.0)
    from mxtrain.study.plan import build_config
    cfg = build_config(spec, "bf16", 0, tmp_path / "r")
    model = build_model(cfg, cfg.data.vocab_size, torch.device("cpu"))
    assert c["params"] == sum(p.numel() for p in model.parameters())
    assert c["params_no_embedding"] == c["params"] - sum(p.numel() for n, p in model.named_parameters()
                                                         if n.startswith(("embed_tokens", "lm_head")))
    assert c["tokens_per_run"] == 16 * 4 * 32 and c["runs"] == 4
    assert c["steps_per_run_and_branches"] == 12 + 2 + 3 + 4
    assert c["train_tokens"] == 4 * 21 * 4 * 32
    # evaluations every 4 steps and at each end: steps 4, 8, 12 of the stable run, and the last step of each
    # branch (8, 12, 16), as the end-to-end test below finds in the run folders
    assert c["eval_tokens"] == 4 * (3 + 1 + 1 + 1) * 512
    assert c["hours"] == pytest.approx((c["train_tokens"] + c["eval_tokens"] / 3) / 1000 / 3600)
    assert c["tokens_per_param"] == pytest.approx(c["tokens_per_run"] / c["params"])
    assert main(["study", "--arms", "bf16", "--steps", "100", "--out", str(tmp_path / "t"), "--dry-run",
                 "--tokens-per-s", "5000"]) == 0
    out = capsys.readouterr().out
    assert "tokens per parameter" in out and "at the rate given: about" in out and "B tokens trained" in out
    # an end-of-run evaluation over more tokens than the periodic ones: the stable run's and each branch's
    big = compute_plan(_spec(tmp_path / "s2", overrides=list(SMOKE) + ["log.final_eval_tokens=2048"]))
    small = compute_plan(_spec(tmp_path / "s3", overrides=list(SMOKE) + ["log.final_eval_tokens=256"]))
    assert big["eval_tokens"] == c["eval_tokens"] + 4 * 4 * 2048 and small["eval_tokens"] == c["eval_tokens"]
    # a rate without --dry-run, or not positive: one line, exit 2, no study folder
    for extra in (["--tokens-per-s", "5000"], ["--dry-run", "--tokens-per-s", "0"]):
        assert main(["study", "--arms", "bf16", "--steps", "100", "--out", str(tmp_path / "x"), *extra]) == 2
        assert "--tokens-per-s" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    from mxtrain.study.run import describe_compute
    # the peak learning rate each arm trains at; a study that names none is told it is the base experiment's
    nolr = [o for o in SMOKE if not o.startswith("optim.lr=")]
    lr = compute_plan(StudySpec(**{**asdict(_spec(tmp_path / "l1", overrides=nolr)), "arms": ["bf16", "bf16@lr1e-3"]}))
    assert lr["lr_by_arm"]["bf16@lr1e-3"] == 1e-3 and lr["lr_given"]
    assert "peak learning rate: bf16 0.003; bf16@lr1e-3 0.001\n" in describe_compute(lr) + "\n"
    plain = compute_plan(_spec(tmp_path / "l2", overrides=nolr))
    assert not plain["lr_given"] and set(plain["lr_by_arm"].values()) == {0.003}
    assert "the base experiment's, not chosen for this model" in describe_compute(plain)
    given = compute_plan(_spec(tmp_path / "l3", overrides=nolr, lr=2e-3))
    assert given["lr_given"] and "peak learning rate: 0.002 for every arm\n" in describe_compute(given) + "\n"
    assert "passes over its training split 2.5 times" in describe_compute({**c, "epochs": 2.5})
    assert "passes over its training split" not in describe_compute({**c, "epochs": 0.5})


@pytest.fixture(scope="module")
def final_eval_study(tmp_path_factory):
    """One study for the two tests below (one run of a study fewer): ``log.final_eval_tokens`` (1024) above
    ``log.eval_tokens`` (512), 1 seed, on a prepared folder with fixed validation files of two domains (code and
    prose)."""
    import random

    import torch

    from mxtrain.data.prepare import prepare
    tmp_path = tmp_path_factory.mktemp("final_eval")
    rnd = random.Random(0)
    prose = "the of and a to in is was he for it with as his on be at by had not are but from or".split()
    code = "def return if else for in range self x y import print class None True".split()

    def doc(words, n):
        return json.dumps({"text": " ".join(rnd.choice(words) for _ in range(n))}) + "\n"
    src = tmp_path / "src"
    (src / "val").mkdir(parents=True)
    (src / "train.jsonl").write_text("".join(doc(prose if i % 2 else code, 400) for i in range(120)))
    (src / "val" / "code.jsonl").write_text("".join(doc(code, 300) for _ in range(6)))
    (src / "val" / "prose.jsonl").write_text("".join(doc(prose, 300) for _ in range(6)))
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MXTRAIN_DATA", str(data_cache()))   # (its own data below; no user cache)
        torch.set_num_threads(1)
        try:
            data = prepare([str(src / "train.jsonl")], tmp_path / "data", vocab_size=512, progress=False,
                           val_sources=[str(src / "val")])
            out = tmp_path / "study"
            spec = _spec(out)
            spec.seeds, spec.data = 1, str(data)
            spec.overrides = spec.overrides + ["log.final_eval_tokens=1024"]
            run_study(spec, log=lambda m: None)
        finally:
            torch.set_num_threads(threads)
    return out


def test_final_evaluation_over_more_tokens_feeds_the_cooled_down_losses(final_eval_study, tmp_path):
    """``log.final_eval_tokens`` above ``log.eval_tokens``: every run and branch ends with one more evaluation
    over that many validation tokens (eval_final.json: its windows, their mean the val_loss); the cooled-down
    metric reads those (more windows than the periodic evaluations) where every finished branch has one over
    the same tokens, and falls back to the periodic ones for all where one lacks it."""
    import shutil

    from mxtrain.study import cooldown as C
    out = final_eval_study
    for f in (out / "runs").glob("*/seed0/branches/*/eval_final.json"):
        r = json.loads(f.read_text())
        assert r["eval_tokens"] == 1024 and len(r["losses"]) == 1024 // 32
        assert r["val_loss"] == pytest.approx(sum(r["losses"]) / len(r["losses"]), abs=1e-5)
    assert len(list((out / "runs").glob("*/seed0/branches/*/eval_final.json"))) == 2 * 3
    assert (out / "runs" / "bf16" / "seed0" / "eval_final.json").is_file()   # the stable run too
    s = json.loads((out / "summary.json").read_text())
    assert s["cooldown"]["arms"]["mxfp4-all"]["n_windows"] == 1024 // 32
    pts = C.load_cooldown_points(out)
    assert all(p.get("eval") == "final" and len(p["losses"]) == 32
               for a in pts.values() for bs in a.values() for p in bs.values())
    # one branch without it: every branch falls back to its last periodic evaluation (512 tokens: 16 windows)
    # (in a copy: the study is the module's)
    out = shutil.copytree(out, tmp_path / "study")
    next((out / "runs").glob("mxfp4-all/seed0/branches/*/eval_final.json")).unlink()
    pts = C.load_cooldown_points(out)
    assert all(p.get("eval") is None and len(p["losses"]) == 512 // 32
               for a in pts.values() for bs in a.values() for p in bs.values())


def test_final_eval_tokens_must_not_be_negative(tmp_path):
    from mxtrain.train.config import _check
    from train_helpers import tiny_run_cfg
    cfg = tiny_run_cfg(tmp_path / "r", 2)
    cfg.log.final_eval_tokens = -5
    with pytest.raises(UserError, match="log.final_eval_tokens must be 0"):
        _check(cfg)


def test_cooled_down_gap_by_validation_source(final_eval_study):
    """A prepared folder with fixed validation files (two domains): every run labels its evaluation windows
    with their file (eval_sources.json, and in eval_final.json), the summary splits each arm's cooled-down gap
    by file at the largest budget (paired by seed and window: equal to a recomputation from the window
    losses), and the report shows it."""
    import numpy as np

    from mxtrain.study import cooldown as C
    out = final_eval_study
    run = out / "runs" / "bf16" / "seed0"
    assert set(json.loads((run / "eval_sources.json").read_text())["sources"]) == {"code.jsonl", "prose.jsonl"}
    s = json.loads((out / "summary.json").read_text())
    by = s["cooldown"]["by_source"]
    assert by["budget"] == 1.0 and set(by["arms"]) == {"mxfp4-all"}
    got = by["arms"]["mxfp4-all"]
    assert set(got) == {"code.jsonl", "prose.jsonl"} and all(v["n_seeds"] == 1 for v in got.values())
    pts = C.load_cooldown_points(out)
    a, b = pts["mxfp4-all"][0][1.0], pts["bf16"][0][1.0]
    for name, v in got.items():
        d = [la - lb for sname, la, lb in zip(a["sources"], a["losses"], b["losses"]) if sname == name]
        assert v["n_windows"] == len(d) and v["gap"] == pytest.approx(float(np.mean(d)), abs=1e-9)
    assert sum(v["n_windows"] for v in got.values()) == 1024 // 32
    assert "By validation source" in (out / "report.md").read_text()


def test_run_stopped_by_a_signal_continues_from_its_checkpoint(tmp_path, monkeypatch):
    """A run that SIGTERM stopped (a device call's time limit) is not trained again from scratch: the next session
    continues it from the checkpoint the trainer wrote when it stopped, and its losses are those of a run never
    stopped, bit for bit (stochastic rounding included); then its cooldown branches train."""
    import os
    import signal
    from mxtrain.study.plan import build_config
    from mxtrain.study.run import StudyInterrupted
    from mxtrain.train import trainer as TR
    from mxtrain.train.callbacks import Callback
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    import torch
    torch.set_num_threads(1)

    def spec(out):
        return StudySpec(out=str(out), arms=["mxfp4-all-sr"], seeds=1, model="tiny", steps=16, batch_size=4,
                         seq_len=32, eval_every=4, device="cpu", overrides=list(SMOKE) + ["log.log_every=1"],
                         budgets=[0.5, 1.0], cooldown=0.25, n_boot=20)

    def losses(out):
        rows = [json.loads(x) for x in (out / "runs" / "mxfp4-all-sr" / "seed0" / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r and "val_loss" not in r}
    run_study(spec(tmp_path / "ref"), log=lambda m: None)

    class StopAt7(Callback):
        def on_step_end(self, step, metrics):
            if step == 7:
                os.kill(os.getpid(), signal.SIGTERM)

    def stopping(sp, arm, seed, rd, resume=None):
        return TR.fit(build_config(sp, arm, seed, rd), resume=resume, callbacks=[StopAt7()])
    out = tmp_path / "s"
    with pytest.raises(StudyInterrupted):
        run_study(spec(out), train_fn=stopping, log=lambda m: None)
    assert max(losses(out)) < 12
    said = []
    run_study(spec(out), log=said.append)
    assert any("unfinished, continuing from its checkpoint at step 7" in m for m in said), said
    ref = losses(tmp_path / "ref")
    assert losses(out) == ref and len(ref) == 12          # the stable run: 16 steps, branch points at 6 and 12
    s = json.loads((out / "summary.json").read_text())
    assert s["missing"] == [] and len(s["branches"]) == 2


def test_carried_study_remakes_gone_checkpoints(tmp_path, monkeypatch):
    """A study carried to another machine without its checkpoints (a GPU lease's study.tgz): a branch whose
    stable-run checkpoint is gone is trained after the stable run is trained again to make it; the remade
    losses equal the first run's, and so does the branch's result."""
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    import torch
    torch.set_num_threads(1)
    out = tmp_path / "study"
    spec = StudySpec(out=str(out), arms=["bf16"], seeds=1, model="tiny", steps=16, batch_size=4, seq_len=32,
                     eval_every=4, device="cpu", overrides=list(SMOKE), budgets=[0.5, 1.0], cooldown=0.25, n_boot=20)
    run_study(spec, log=lambda m: None)
    rd = out / "runs" / "bf16" / "seed0"
    b = rd / "branches" / "k12-n4"
    first = (b / "metrics.jsonl").read_text()
    for p in rd.glob("checkpoint*.pt"):   # what a lease's study.tgz leaves out
        p.unlink()
    import shutil
    shutil.rmtree(b)
    # --start-by passed: no remake starts (it is a whole stable run), the branch waits for the next session
    import time
    said = []
    run_study(spec, log=said.append, start_by=time.time() - 1)
    assert any("not started" in m and "past --start-by" in m for m in said), said
    assert not b.exists() and not (rd / "remake").exists()
    said = []
    run_study(spec, log=said.append)
    assert any("checkpoint(s) at step 12 are gone" in m for m in said), said
    rec = json.loads((rd / "remake.json").read_text())
    assert rec["bit_equal"] and rec["compared_steps"] >= 3 and rec["steps"] == [12]
    assert not (rd / "remake").exists() and (rd / "checkpoint-12.pt").is_file()
    vals = [[json.loads(x)["val_loss"] for x in t.splitlines() if "val_loss" in x]
            for t in (first, (b / "metrics.jsonl").read_text())]
    assert vals[0] == vals[1] and vals[0]
    assert json.loads((out / "summary.json").read_text())["missing"] == []


def test_start_by_starts_no_run_after_it(tmp_path):
    """``mxtrain study --start-by S``: past it no run starts; the summary lists them as not trained; a negative
    value is refused."""
    from mxtrain.cli.core import main
    import time
    said = []
    out = tmp_path / "s"
    run_study(_spec(out), log=said.append, start_by=time.time() - 1)
    assert sum("not started (past --start-by)" in m for m in said) == 4
    assert not (out / "runs").exists() or not any((out / "runs").rglob("metrics.jsonl"))
    assert len(json.loads((out / "summary.json").read_text())["missing"]) == 4
    assert main(["study", "--arms", "bf16", "--steps", "100", "--out", str(tmp_path / "x"), "--start-by", "-5"]) == 2
    # worker processes get it too
    w = tmp_path / "w"
    assert main(["study", "--preset", "smoke", "--arms", "bf16,mxfp4-all", "--seeds", "1", "--steps", "4", "--jobs",
                 "2", "--start-by", "0", "--out", str(w)]) == 1
    logs = "".join((w / f"worker{k}.log").read_text() for k in (0, 1))
    assert logs.count("not started (past --start-by)") == 2 and not any((w / "runs").rglob("metrics.jsonl"))


def test_bf16_cooldown_arm_trains_its_branches_in_bf16(tmp_path, monkeypatch):
    """``mxfp4-all@bf16cool``: the stable run is ``mxfp4-all``'s, shared (not trained again) when both arms are in
    the study, trained alike when alone; every branch switches to BF16 at its branch point
    (``train.switch_recipe``); the option needs a cooldown study."""
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    import torch
    torch.set_num_threads(1)
    out = tmp_path / "s"
    spec = StudySpec(out=str(out), arms=["mxfp4-all", "mxfp4-all@bf16cool"], seeds=1, model="tiny", steps=16,
                     batch_size=4, seq_len=32, eval_every=4, device="cpu", overrides=list(SMOKE), budgets=[1.0],
                     cooldown=0.25, n_boot=20)
    said = []
    run_study(spec, log=said.append)
    assert any("the stable run of mxfp4-all seed 0, shared" in m for m in said), said
    runs = out / "runs"
    st = json.loads((runs / "mxfp4-all@bf16cool" / "seed0" / "study_status.json").read_text())
    assert st["state"] == "done" and st["shared_from"] == "mxfp4-all" and st["arm"] == "mxfp4-all@bf16cool"

    def rows(f):
        return [json.loads(x) for x in (f / "metrics.jsonl").read_text().splitlines()]
    losses = [[r["loss"] for r in rows(runs / a / "seed0") if "loss" in r and "val_loss" not in r]
              for a in ("mxfp4-all", "mxfp4-all@bf16cool")]
    assert losses[0] == losses[1] and losses[0]
    b = [runs / a / "seed0" / "branches" / "k12-n4" for a in ("mxfp4-all", "mxfp4-all@bf16cool")]
    assert not [r for r in rows(b[0]) if r.get("event") == "recipe_switch"]
    assert [(r["step"], r["recipe"]) for r in rows(b[1]) if r.get("event") == "recipe_switch"] == [(12, "bf16")]
    assert json.loads((b[1] / "config.json").read_text())["train"]["switch_recipe"] == "12:bf16"
    # alone in a study (no mxfp4-all arm to share with), the arm trains the same stable run itself
    alone = tmp_path / "alone"
    run_study(StudySpec(**{**spec.__dict__, "out": str(alone), "arms": ["bf16", "mxfp4-all@bf16cool"], "baseline": None}),
              log=lambda m: None)
    mine = [r["loss"] for r in rows(alone / "runs" / "mxfp4-all@bf16cool" / "seed0")
            if "loss" in r and "val_loss" not in r]
    assert mine == losses[0]
    assert "shared_from" not in json.loads((alone / "runs" / "mxfp4-all@bf16cool" / "seed0" /
                                            "study_status.json").read_text())
    with pytest.raises(UserError, match="needs a cooldown study"):
        run_study(StudySpec(out=str(tmp_path / "x"), arms=["bf16", "mxfp4-all@bf16cool"]), log=lambda m: None)
    assert not (tmp_path / "x").exists()


def test_bf16_cooldown_arm_shares_the_stable_run_between_workers(tmp_path):
    """With ``--jobs 2`` the two arms are trained by two workers at once: the ``@bf16cool`` arm waits for the
    plain arm's stable run and shares it (one stable run trained, not two)."""
    from mxtrain.cli.core import main
    out = tmp_path / "s"
    assert main(["study", "--preset", "smoke", "--arms", "mxfp4-all,mxfp4-all@bf16cool", "--baseline", "mxfp4-all",
                 "--seeds", "1", "--steps",
                 "8", "--budgets", "1", "--cooldown", "0.25", "--diagnose-every", "0", "--jobs", "2",
                 "--out", str(out)]) == 0
    logs = "".join((out / f"worker{k}.log").read_text() for k in (0, 1))
    assert "the stable run of mxfp4-all seed 0, shared" in logs, logs[-3000:]
    assert logs.count("mxtrain 0.1.0 | model") == 1 + 2     # one stable run and the two arms' branches
    st = json.loads((out / "runs" / "mxfp4-all@bf16cool" / "seed0" / "study_status.json").read_text())
    assert st["shared_from"] == "mxfp4-all"


def test_trend_preset_plans_one_to_twenty_tokens_per_non_embedding_parameter(tmp_path, capsys):
    """The ``trend`` preset: 30m, 11,500 steps, branches at 5-100 % of the run; its dry run on a corpus with the
    32k vocabulary is what docs/study.md states (here the built-in data's vocabulary, so only the plan)."""
    from mxtrain.cli.core import main
    from mxtrain.study.plan import PRESETS
    p = PRESETS["trend"]
    assert p["arms"] == ["bf16", "mxfp4-all"] and p["steps"] == 11500 and p["budgets"][0] == 0.05
    assert main(["study", "--preset", "trend", "--out", str(tmp_path / "t"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "cooldown branches at budgets 0.05, 0.1, 0.25, 0.5, 1 of the run" in out
    assert "'steps': 11500" in out and "'model': '30m'" in out and "'eval_every': 230" in out
    assert "'lr': 0.0015" in out and "peak learning rate: 0.0015 for every arm" in out   # the rate it was run at
    # the whole design it was run with (benchmarks/study_gpu.sh's flags): 32 x 512 tokens a step, its evaluation
    assert "'batch_size': 32, 'seq_len': 512" in out
    assert "6 runs with their branches: 13,570 steps each, 1.334 B tokens trained" in out
    ev = ["log.eval_tokens=131072", "log.final_eval_tokens=1048576", "schedule.warmup_steps=20"]
    assert f"'overrides': {ev}" in out
    # the same settings repeated on the command line (as study_gpu.sh passes them) leave the plan unchanged: a
    # study started with --preset trend and one started with --arms and the flags resume each other
    from mxtrain.study.plan import StudySpec
    from mxtrain.cli.core import make_parser
    ap = make_parser(["study"])
    flags = ["--batch-size", "32", "--seq-len", "512", "--steps", "11500", "--lr", "1.5e-3", "--model", "30m",
             "--budgets", "0.05,0.1,0.25,0.5,1", "--eval-every", "230", "--diagnose-every", "0",
             *[a for o in ev for a in ("--set", o)], "--out", str(tmp_path / "s")]
    a = StudySpec.from_args(ap.parse_args(["study", "--preset", "trend", *flags]))
    b = StudySpec.from_args(ap.parse_args(["study", "--arms", "bf16,mxfp4-all", *flags]))
    assert a.overrides == b.overrides == ev and a.plan_key() == b.plan_key()
    # a key given twice keeps its last value
    c = StudySpec.from_args(ap.parse_args(["study", "--preset", "trend", "--set", "log.eval_tokens=4096",
                                           "--set", "log.eval_tokens=131072", "--out", str(tmp_path / "c")]))
    assert c.overrides == ["log.final_eval_tokens=1048576", "schedule.warmup_steps=20", "log.eval_tokens=4096",
                           "log.eval_tokens=131072"]


def test_work_order_puts_remakes_after_the_runs_still_to_train(tmp_path):
    """``work_order``: the plan's seed-major order, except that work which starts by remaking a finished stable run
    (its pending branches' checkpoints gone: a study carried from an earlier lease) comes after every run not yet
    trained. A ``@bf16cool`` arm of a seed whose ``mxfp4-all`` run is done without checkpoints would remake it; of a
    seed whose run is still to train, it follows that run as planned; a done run with a pending branch and no
    checkpoint is a remake too; a done run whose branches all finished is not."""
    from mxtrain.study.plan import branch_folder, plan_order, study_branch_plan
    from mxtrain.study.run import work_order
    out = tmp_path / "s"
    spec = StudySpec(out=str(out), arms=["bf16", "mxfp4-all", "mxfp4-all@bf16cool"], seeds=3, model="tiny", steps=16,
                     overrides=list(SMOKE), budgets=[0.5, 1.0], cooldown=0.25)

    def done(arm, seed, branches=True, checkpoints=()):
        rd = out / "runs" / arm / f"seed{seed}"
        rd.mkdir(parents=True)
        (rd / "study_status.json").write_text(json.dumps({"state": "done"}))
        (rd / "run.json").write_text("{}")
        for k in checkpoints:
            (rd / f"checkpoint-{k}.pt").write_bytes(b"")
        if branches:
            for _, k, n in study_branch_plan(spec):
                bd = branch_folder(rd, k, n)
                bd.mkdir(parents=True)
                (bd / "study_status.json").write_text(json.dumps({"state": "done"}))
    steps = [k for _, k, _ in study_branch_plan(spec)]
    for seed in (0, 1):
        done("bf16", seed)
        done("mxfp4-all", seed, checkpoints=steps if seed == 1 else ())
    done("bf16", 2, branches=False)           # its branches pending, their checkpoints gone
    plan = plan_order(spec)
    assert plan == [(a, s) for s in range(3) for a in ("bf16", "mxfp4-all", "mxfp4-all@bf16cool")]
    got = work_order(spec, out)
    # seed 0's bf16cool: its base is done, its checkpoints gone (a remake); seed 1's base kept them; seed 2's base is
    # still to train; bf16 seed 2 is done with its branches pending and no checkpoint (a remake)
    assert got == [p for p in plan if p not in (("mxfp4-all@bf16cool", 0), ("bf16", 2))] + [
        ("mxfp4-all@bf16cool", 0), ("bf16", 2)]
    assert sorted(got) == sorted(plan)
    # without cooldown branches there is nothing to remake: the plan's order
    assert work_order(StudySpec(**{**asdict(spec), "budgets": None}), out) == plan_order(
        StudySpec(**{**asdict(spec), "budgets": None}))


def test_bf16_cooldown_branches_of_a_run_at_hand_train_past_start_by(tmp_path):
    """Past ``--start-by`` no run starts, but a ``@bf16cool`` arm whose base run is done with its checkpoints at hand
    (made in this session) still shares it and trains its branches, as any branch whose checkpoint is at hand; with
    the base run not done, it does not start."""
    import time
    from mxtrain.study.plan import study_branch_plan
    from mxtrain.study.run import run_one
    out = tmp_path / "s"
    spec = StudySpec(out=str(out), arms=["mxfp4-all", "mxfp4-all@bf16cool"], seeds=2, model="tiny", steps=16,
                     overrides=list(SMOKE), budgets=[0.5, 1.0], cooldown=0.25)
    base = out / "runs" / "mxfp4-all" / "seed0"
    base.mkdir(parents=True)
    (base / "study_status.json").write_text(json.dumps({"state": "done"}))
    (base / "run.json").write_text("{}")
    steps = [k for _, k, _ in study_branch_plan(spec)]
    for k in steps:
        (base / f"checkpoint-{k}.pt").write_bytes(b"")
    calls, said = [], []

    def branch(sp, arm, seed, rd, budget, k, n, bd):
        calls.append((arm, seed, k))
        bd.mkdir(parents=True, exist_ok=True)
    past = time.time() - 1
    for seed in (0, 1):
        run_one(spec, "mxfp4-all@bf16cool", seed, "[t]", train_fn=None, log=said.append, branch_fn=branch,
                start_by=past)
    assert calls == [("mxfp4-all@bf16cool", 0, k) for k in steps], (calls, said)
    assert any("the stable run of mxfp4-all seed 0, shared" in m for m in said), said
    assert any("mxfp4-all@bf16cool seed 1: not started (past --start-by)" in m for m in said), said
    assert not (out / "runs" / "mxfp4-all@bf16cool" / "seed1").exists()


def test_carried_study_trains_new_seeds_before_remakes(tmp_path, monkeypatch):
    """End to end on CPU: a study carried without its checkpoints (seed 0 of ``mxfp4-all`` done, its checkpoints
    gone) gains ``mxfp4-all@bf16cool`` and a second seed. The session trains seed 1 first (``mxfp4-all`` and the
    BF16-cooled branches on its fresh checkpoints, shared, not remade), and only then remakes seed 0's stable run
    for seed 0's BF16-cooled branches; every planned branch ends done."""
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    import torch
    torch.set_num_threads(1)
    out = tmp_path / "s"
    base = dict(out=str(out), model="tiny", steps=16, batch_size=4, seq_len=32, eval_every=4, device="cpu",
                overrides=list(SMOKE), budgets=[1.0], cooldown=0.25, n_boot=20)
    run_study(StudySpec(arms=["mxfp4-all"], seeds=1, **base), log=lambda m: None)
    for p in (out / "runs" / "mxfp4-all" / "seed0").glob("checkpoint*.pt"):   # what a lease's study.tgz leaves out
        p.unlink()
    said = []
    run_study(StudySpec(arms=["mxfp4-all", "mxfp4-all@bf16cool"], seeds=2, **base), log=said.append)
    first = next(i for i, m in enumerate(said) if "mxfp4-all seed 1 ->" in m)
    shared = next(i for i, m in enumerate(said) if "mxfp4-all@bf16cool seed 1: the stable run of mxfp4-all seed 1" in m)
    remade = next(i for i, m in enumerate(said) if "are gone" in m and "seed 0" in m)
    assert first < shared < remade, said
    assert not (out / "runs" / "mxfp4-all" / "seed1" / "remake.json").exists()
    assert json.loads((out / "summary.json").read_text())["missing"] == []


def test_only_seeds_trains_those_seeds_and_keeps_the_plan(tmp_path, monkeypatch, capsys):
    """``mxtrain study --only-seeds 1``: this session trains seed 1 of every arm (in worker processes too) and
    leaves seed 0 for a later one; ``study.json`` keeps the plan's seeds and the summary names seed 0's runs as
    missing. A seed outside the plan is refused in one line; ``--dry-run`` says the flag applies when the study
    runs. ``parse_only_seeds`` sorts and deduplicates."""
    from mxtrain.cli.core import main
    from mxtrain.study.run import parse_only_seeds, work_order
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    assert parse_only_seeds("4, 3,4", 5) == [3, 4] and parse_only_seeds(None, 5) is None
    for bad in ("5", "-1", "x", "1,,2"):
        with pytest.raises(UserError, match="is not a seed of this plan"):
            parse_only_seeds(bad, 5)
    spec = _spec(tmp_path / "o")
    assert work_order(spec, tmp_path / "o", [1]) == [p for p in work_order(spec, tmp_path / "o") if p[1] == 1]
    w = tmp_path / "w"
    args = ["study", "--preset", "smoke", "--arms", "bf16,mxfp4-all", "--seeds", "2", "--steps", "4", "--out", str(w)]
    assert main(args + ["--only-seeds", "2"]) == 2
    err = capsys.readouterr().err
    assert "--only-seeds 2: '2' is not a seed of this plan; give seeds from 0 to 1" in err and err.count("\n") == 1
    assert main(args + ["--only-seeds", "1", "--dry-run"]) == 0
    assert "not part of this plan: --only-seeds 1 applies when the study runs" in capsys.readouterr().out
    assert main(args + ["--only-seeds", "1", "--jobs", "2"]) == 1   # (incomplete: seed 0 not trained)
    runs = sorted(str(p.parent.relative_to(w / "runs")) for p in (w / "runs").glob("*/seed*/metrics.jsonl"))
    assert runs == ["bf16/seed1", "mxfp4-all/seed1"], runs
    assert json.loads((w / "study.json").read_text())["seeds"] == [0, 1]
    missing = json.loads((w / "summary.json").read_text())["missing"]
    assert sorted((m["arm"], m["seed"]) for m in missing if m.get("budget") is None) == [("bf16", 0), ("mxfp4-all", 0)]
