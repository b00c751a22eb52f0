"""``mxtrain study-import``: finished runs of one study become arms of another only when the destination would
have trained exactly them; nothing in the destination is overwritten."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from mxtrain.errors import UserError
from mxtrain.study.importruns import config_differences, import_runs, parse_renames
from mxtrain.study.plan import StudySpec
from mxtrain.study.workers import run_study
from train_helpers import data_cache

SMOKE = ["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "schedule.warmup_steps=2",
         "log.eval_tokens=512", "log.log_every=4", "log.tensorboard=false"]


def _spec(out, lr, arms=("bf16",), **kw):
    return StudySpec(out=str(out), arms=list(arms), seeds=1, model="tiny", steps=16, batch_size=4, seq_len=32,
                     eval_every=4, device="cpu", lr=lr, overrides=list(SMOKE), budgets=[0.5, 1.0], cooldown=0.25,
                     n_boot=20, **kw)


def test_parse_renames():
    assert parse_renames("bf16=bf16@lr1e-3, fp8") == {"bf16": "bf16@lr1e-3", "fp8": "fp8"}
    assert parse_renames(None) == {}
    with pytest.raises(UserError, match="twice"):
        parse_renames("bf16=a,bf16=b")
    with pytest.raises(UserError, match="two source arms"):
        parse_renames("bf16=x,fp8=x")
    assert config_differences({"a": {"b": 1, "c": 2}, "log": {"out": "x"}}, {"a": {"b": 1, "c": 3}, "log": {"out": "y"}}) \
        == [("a.c", 2, 3)]


def test_import_lr_check_into_main_study(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MXTRAIN_DATA", str(data_cache()))   # the built-in corpus, prepared once
    import torch
    torch.set_num_threads(1)
    src, dst = tmp_path / "lrcheck", tmp_path / "main"
    run_study(_spec(src, 2e-3), log=lambda m: None)          # the check: its own study at another LR
    run_study(_spec(dst, 5e-3, preset="smoke"), log=lambda m: None)   # the main study at its base LR, named by
    # a preset (its runs' exp is study-smoke, the check's study-custom: a label, not a difference in training)
    assert json.loads((dst / "runs" / "bf16" / "seed0" / "config.json").read_text())["exp"] == "study-smoke"

    # the wrong LR, or a name the destination would train differently: refused, with the key and both values
    with pytest.raises(UserError, match=r"optim\.lr: 0\.002 in the run, 0\.003"):
        import_runs(src, dst, {"bf16": "bf16@lr3e-3"}, log=lambda m: None)
    with pytest.raises(UserError, match="exists already"):
        import_runs(src, dst, {"bf16": "bf16"}, log=lambda m: None)
    assert sorted(p.name for p in (dst / "runs").iterdir()) == ["bf16"]       # nothing was copied

    said = []
    assert import_runs(src, dst, {"bf16": "bf16@lr2e-3"}, dry_run=True, log=said.append) == [("bf16", "bf16@lr2e-3", 0)]
    assert not (dst / "runs" / "bf16@lr2e-3").exists() and "would import" in said[0]
    assert import_runs(src, dst, {"bf16": "bf16@lr2e-3"}, log=lambda m: None) == [("bf16", "bf16@lr2e-3", 0)]
    new = dst / "runs" / "bf16@lr2e-3" / "seed0"
    old = src / "runs" / "bf16" / "seed0"
    assert (new / "metrics.jsonl").read_text() == (old / "metrics.jsonl").read_text()
    assert not list(new.rglob("*.pt"))                                          # checkpoints stay behind
    for st in new.rglob("study_status.json"):
        assert json.loads(st.read_text())["arm"] == "bf16@lr2e-3"
    meta = json.loads((dst / "study.json").read_text())
    assert meta["arms"] == ["bf16", "bf16@lr2e-3"] and meta["imported"][0]["runs"] == [
        {"arm": "bf16", "as": "bf16@lr2e-3", "seed": 0}]

    # the destination's runner counts the imported run (and its branches) as finished: nothing trains again
    def must_not_train(*a, **k):
        raise AssertionError(f"trained again: {a[1:3]}")
    # the study's own command again (its arms without the imported one) keeps the import's records (issue #47, 8:
    # study.json was written anew, without them)
    run_study(_spec(dst, 5e-3, preset="smoke"), train_fn=must_not_train, branch_fn=must_not_train, log=lambda m: None)
    again = json.loads((dst / "study.json").read_text())
    assert again["arms"] == ["bf16", "bf16@lr2e-3"] and again["imported"] == meta["imported"]
    assert again["recipes"]["bf16@lr2e-3"] == meta["recipes"]["bf16@lr2e-3"] and again["spec"]["arms"] == ["bf16"]
    assert set(json.loads((dst / "summary.json").read_text())["arms"]) == {"bf16", "bf16@lr2e-3"}
    run_study(_spec(dst, 5e-3, arms=("bf16", "bf16@lr2e-3"), preset="smoke"), train_fn=must_not_train, branch_fn=must_not_train,
              log=lambda m: None)
    s = json.loads((dst / "summary.json").read_text())
    assert set(s["arms"]) == {"bf16", "bf16@lr2e-3"} and s["missing"] == []
    assert len([b for b in s["branches"] if b.get("arm") == "bf16@lr2e-3"]) == 2

    # a report of some arms (the check left out) goes to its own folder; the study's summary stays whole
    from mxtrain.cli.core import main
    whole = (dst / "summary.json").read_text()
    assert main(["report", str(dst), "--arms", "bf16", "--out", str(tmp_path / "only")]) == 0
    part = json.loads((tmp_path / "only" / "summary.json").read_text())
    assert set(part["arms"]) == {"bf16"} and part["missing"] == []
    assert {b["arm"] for b in part["branches"]} == {"bf16"}
    md = (tmp_path / "only" / "report.md").read_text()
    assert "Arms in this report: bf16 (the study has 2)" in md and "bf16@lr2e-3" not in md.split("## Exact")[0]
    assert (dst / "summary.json").read_text() == whole
    from mxtrain.study import report as R
    seen = []
    monkeypatch.setattr(R, "arm_colors", lambda *lists: seen.append(lists) or {})
    R.write_report(dst, part, out=tmp_path / "only", arms=["bf16@lr2e-3"])
    assert list(seen[0][0]) == ["bf16", "bf16@lr2e-3"]     # coloured in the whole study's order
    capsys.readouterr()
    for extra, err in ((["--arms", "bf16"], "needs --out"), (["--arms", "bf16@lr2e-3", "--out", "x"], "baseline"),
                       (["--arms", "bf16,nope", "--out", "x"], "no finished runs")):
        assert main(["report", str(dst), *[str(tmp_path / a) if a == "x" else a for a in extra]]) != 0
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and err in said[0], said


def test_import_refuses_another_cooldown_plan(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    for out, spec in ((src, _spec(src, 2e-3)), (dst, StudySpec(**{**asdict(_spec(dst, 5e-3)), "budgets": [0.25, 1.0]}))):
        (out / "runs" / "bf16" / "seed0").mkdir(parents=True)
        (out / "study.json").write_text(json.dumps({"spec": asdict(spec), "arms": spec.arms}))
    with pytest.raises(UserError, match="cooldown designs differ"):
        import_runs(src, dst, {"bf16": "bf16@lr2e-3"}, log=lambda m: None)
    with pytest.raises(UserError, match="not a study folder"):
        import_runs(tmp_path / "nothing", dst, log=lambda m: None)


def test_cli_one_line_error(tmp_path, capsys):
    from mxtrain.cli.core import main
    assert main(["study-import", str(tmp_path / "x"), str(tmp_path / "y")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a study folder" in err[0]
