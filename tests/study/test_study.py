"""Study metrics on synthetic run folders whose answers are known, and the smoke study end to end."""

import json
import math
import re
from pathlib import Path

import pytest

from mxtrain.study import metrics as M


def write_run(d: Path, tokens, losses, train_loss=None, steps=None):
    d.mkdir(parents=True, exist_ok=True)
    steps = steps or list(range(1, len(tokens) + 1))
    with open(d / "metrics.jsonl", "w") as f:
        for i, (st, t, v) in enumerate(zip(steps, tokens, losses)):
            tl = train_loss[i] if train_loss is not None else v + 0.01
            f.write(json.dumps({"step": st, "tokens": t, "loss": tl}) + "\n")
            f.write(json.dumps({"step": st, "tokens": t, "val_loss": v}) + "\n")
    (d / "summary.json").write_text("{}")  # what the trainer writes when a run ends
    return M.read_run(d)


def curve(t, a=2.0, b=5e4):
    return a + b / t


def test_shifted_curve_gives_shift_factor(tmp_path):
    # arm needs c times the tokens: L_arm(t) = L(t / c); all arms share eval points
    c = 1.12
    toks = [1000.0 * i for i in range(1, 401)]
    base = {0: write_run(tmp_path / "b", toks, [curve(t) for t in toks])}
    arm = {0: write_run(tmp_path / "a", toks, [curve(t / c) for t in toks])}
    target = M.default_target(base, 0.8, k=1)
    assert target == pytest.approx(curve(0.8 * toks[-1]), rel=1e-6)
    r = M.extra_token_cost(arm, base, target, k=1)
    assert r["state"] == "ok"
    assert r["mean"] == pytest.approx(c - 1, abs=2e-4)


def test_smoothing_is_exactly_scale_equivariant(tmp_path):
    # the arm's curve is the baseline's stretched along tokens (evaluated at stretched points):
    # smoothing averages tokens too, so the cost is exactly c - 1 for any window k
    c = 1.3
    toks = [100.0 * i for i in range(1, 60)]
    noise = [0.02 * math.sin(7.0 * i) for i in range(len(toks))]
    ls = [curve(t, 1.0, 3e3) + e for t, e in zip(toks, noise)]
    base = {0: write_run(tmp_path / "b", toks, ls)}
    arm = {0: write_run(tmp_path / "a", [c * t for t in toks], ls)}
    for k in (1, 3, 5):
        target = M.default_target(base, 0.8, k)
        r = M.extra_token_cost(arm, base, target, k)
        assert r["state"] == "ok" and r["mean"] == pytest.approx(c - 1, abs=1e-9)


def test_seed_ci_and_pairing(tmp_path):
    toks = [500.0 * i for i in range(1, 201)]
    cs = {0: 1.05, 1: 1.10, 2: 1.15}
    base, arm = {}, {}
    for s, c in cs.items():
        a = 2.0 + 0.01 * s  # seeds differ in level: pairing removes it
        base[s] = write_run(tmp_path / f"b{s}", toks, [curve(t, a) for t in toks])
        arm[s] = write_run(tmp_path / f"a{s}", toks, [curve(t / c, a) for t in toks])
    r = M.extra_token_cost(arm, base, 2.6, k=1)
    assert r["state"] == "ok" and r["n"] == 3
    assert r["mean"] == pytest.approx(0.10, abs=1e-3)
    assert r["sd"] == pytest.approx(0.05, abs=1e-3)
    lo, hi = r["ci95"]
    assert hi - lo == pytest.approx(2 * 4.3027 * 0.05 / math.sqrt(3), rel=1e-2)


def test_mean_ci_known_values():
    r = M.mean_ci([1.0, 2.0, 3.0, 4.0])
    assert r["mean"] == 2.5 and r["sd"] == pytest.approx(math.sqrt(5 / 3))
    h = 3.1824 * math.sqrt(5 / 3) / 2
    assert r["ci95"] == pytest.approx([2.5 - h, 2.5 + h])
    assert M.mean_ci([1.0])["ci95"] is None and M.mean_ci([])["mean"] is None
    assert M.t_quantile(200) == pytest.approx(1.9719, abs=1e-3)


def test_did_not_reach_and_diverged(tmp_path):
    toks = [1000.0 * i for i in range(1, 101)]
    base = {0: write_run(tmp_path / "b", toks, [curve(t) for t in toks])}
    slow = {0: write_run(tmp_path / "s", toks, [curve(t) + 0.5 for t in toks])}
    target = M.default_target(base, 0.8)
    r = M.extra_token_cost(slow, base, target)
    assert r["state"] == "did_not_reach" and r["mean"] is None
    assert r["lower_bound"] == pytest.approx(toks[-1] / M.tokens_to_target(toks, [curve(t) for t in toks], target) - 1)
    bad = [curve(t) for t in toks[:50]] + [float("nan")]
    div = {0: write_run(tmp_path / "d", toks[:51], bad)}
    assert div[0].diverged
    r = M.extra_token_cost(div, base, target)
    assert r["state"] == "diverged" and "seed(s) 0" in r["reason"]
    assert M.extra_token_cost({}, base, target)["state"] == "no_runs"
    assert M.extra_token_cost(base, slow, target)["state"] == "baseline_did_not_reach"


def test_paired_differences_and_summary(tmp_path):
    toks = [1000.0 * i for i in range(1, 21)]
    base, arm = {}, {}
    for s in range(3):
        base[s] = write_run(tmp_path / f"b{s}", toks, [curve(t) + 0.1 * s for t in toks])
        arm[s] = write_run(tmp_path / f"a{s}", toks, [curve(t) + 0.1 * s + 0.03 + 0.01 * s for t in toks])
    pd = M.paired_differences(arm, base)
    assert pd["steps"] == list(range(1, 21))
    assert all(m == pytest.approx(0.04) for m in pd["mean"])
    assert pd["second_half"]["mean"] == pytest.approx(0.04)
    s = M.summarize({"base": base, "arm": arm}, "base", smooth_k=3)
    assert s["arms"]["arm"]["final_gap_vs_baseline"]["mean"] == pytest.approx(0.04)
    assert s["arms"]["base"]["extra_tokens"]["mean"] == 0.0 and s["arms"]["base"]["extra_tokens"]["state"] == "baseline"
    assert s["arms"]["arm"]["extra_tokens"]["state"] in ("ok", "did_not_reach")
    json.dumps(M.sanitize(s), allow_nan=False)


def test_truncated_last_line_is_ignored(tmp_path):
    write_run(tmp_path / "r", [1.0, 2.0], [3.0, 2.5])
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "tok')
    rd = M.read_run(tmp_path / "r")
    assert rd.val_loss == [3.0, 2.5]
    with pytest.raises(FileNotFoundError):
        M.read_run(tmp_path / "nothing")


def test_report_on_synthetic_study(tmp_path):
    from mxtrain.study import report

    toks = [1000.0 * i for i in range(1, 41)]
    for arm, c in (("bf16", 1.0), ("mxfp4-all", 1.2)):
        for s in range(2):
            rd = write_run(tmp_path / "runs" / arm / f"seed{s}", toks, [curve(t / c, 2.0 + 0.01 * s) for t in toks])
            (rd.path / "config.json").write_text(json.dumps({"recipe": arm, "seed": s, "device": "cpu"}))
    summary = M.sanitize(M.summarize(M.load_study_runs(tmp_path), "bf16", smooth_k=2))
    assert summary["arms"]["mxfp4-all"]["extra_tokens"]["mean"] == pytest.approx(0.2, abs=0.01)
    hp, mp = report.write_report(tmp_path, summary)
    text = hp.read_text()
    assert "data:image/png;base64," in text and "mxfp4-all" in text and "+20." in text
    assert "seed-to-seed" in mp.read_text()
    # a single run folder works too
    hp, _ = report.write_report(tmp_path / "runs" / "bf16" / "seed0")
    assert "data:image/png;base64," in hp.read_text()


@pytest.mark.parametrize("flag", [["--baseline", "nope"], ["--references", "fp8"], ["--target-loss", "3"],
                                  ["--smooth-k", "2"], ["--fit", "huber"], ["--arms", "bf16", "--out", "x"]])
def test_report_of_one_run_refuses_the_study_options(tmp_path, capsys, flag):
    """A run folder's report has no arms to compare: a study's option is refused in one line, not ignored."""
    from mxtrain.cli.core import main
    toks = [1000.0 * i for i in range(1, 11)]
    rd = write_run(tmp_path / "run", toks, [curve(t) for t in toks])
    capsys.readouterr()
    assert main(["report", str(rd.path), *flag]) == 2
    err = capsys.readouterr().err
    assert err == f"mxtrain: error: {flag[0]}: {rd.path} is a single run's folder, not a study (these options " \
                  f"compare a study's arms)\n", err
    assert not (rd.path / "report.html").exists()


def _fake_trainer(calls, fail_at=None):
    """A stand-in for the trainer: writes an analytic run folder (arm 'mxfp4-all' needs 10 % more tokens)."""
    def train_fn(spec, arm, seed, run_dir):
        calls.append((arm, seed))
        if fail_at is not None and len(calls) == fail_at:
            run_dir.mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text("")
            raise KeyboardInterrupt
        c = {"bf16": 1.0, "mxfp4-all": 1.1}.get(arm, 1.0)
        toks = [1000.0 * i for i in range(1, 51)]
        if arm == "mxfp4-all-sr":
            write_run(run_dir, toks[:10], [curve(t) for t in toks[:10]])
            raise FloatingPointError(f"non-finite loss at step 11 (arm {arm})")
        write_run(run_dir, toks, [curve(t / c, 2.0 + 0.002 * seed) for t in toks])
    return train_fn


def test_runner_resumes_skips_and_records_divergence(tmp_path):
    from mxtrain.errors import UserError
    from mxtrain.study.plan import StudySpec
    from mxtrain.study.workers import run_study

    spec = StudySpec(out=str(tmp_path / "st"), arms=["bf16", "mxfp4-all", "mxfp4-all-sr"], seeds=2, smooth_k=1)
    calls = []
    with pytest.raises(KeyboardInterrupt):
        run_study(spec, _fake_trainer(calls, fail_at=3), log=lambda *a: None)
    assert calls == [("bf16", 0), ("mxfp4-all", 0), ("mxfp4-all-sr", 0)]
    calls2 = []
    out = run_study(spec, _fake_trainer(calls2), log=lambda *a: None)
    assert calls2 == [("mxfp4-all-sr", 0), ("bf16", 1), ("mxfp4-all", 1), ("mxfp4-all-sr", 1)]
    s = json.loads((out / "summary.json").read_text())
    assert s["arms"]["mxfp4-all"]["extra_tokens"]["mean"] == pytest.approx(0.1, abs=2e-3)
    assert s["arms"]["mxfp4-all-sr"]["extra_tokens"]["state"] == "diverged"
    assert s["arms"]["mxfp4-all-sr"]["diverged"] == {"0": True, "1": True}
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    calls3 = []
    run_study(spec, _fake_trainer(calls3), log=lambda *a: None)
    assert calls3 == []
    with pytest.raises(UserError):
        run_study(StudySpec(out=str(tmp_path / "st"), arms=["bf16"], seeds=1, steps=5), _fake_trainer([]))
    with pytest.raises(UserError):
        StudySpec(arms=["bf16", "nope"])
    with pytest.raises(UserError):
        StudySpec(arms=["bf16"], baseline="mxfp4-all")


@pytest.mark.slow
def test_smoke_preset_end_to_end(tmp_path, capsys, monkeypatch):
    """What CI runs: `mxtrain study --preset smoke` (tiny model, CPU, 3 arms x 2 seeds, diagnostics)."""
    from mxtrain.cli.core import main

    out = tmp_path / "smoke"
    assert main(["study", "--preset", "smoke", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["baseline"] == "bf16" and math.isfinite(s["target_loss"])
    assert set(s["arms"]) == {"bf16", "mxfp4-all", "mxfp4-all-dh16"}
    for name, a in s["arms"].items():
        assert a["seeds"] == [0, 1] and a["diverged"] == {"0": False, "1": False}
        assert isinstance(a["recipe"], dict) and a["recipe"]["name"] == name
        fl = a["final_val_loss"]
        assert all(math.isfinite(v) for v in fl["per_seed"].values())
        assert math.isfinite(fl["mean"]) and all(math.isfinite(v) for v in fl["ci95"])
        e = a["extra_tokens"]
        assert e["state"] in (("baseline",) if name == "bf16" else ("ok", "did_not_reach", "baseline_did_not_reach"))
        if e["state"] in ("ok", "baseline"):
            assert math.isfinite(e["mean"])
        else:
            assert e["reason"]
        assert all(math.isfinite(v) for v in a["paired_diff"]["mean"])
    assert s["arms"]["bf16"]["final_gap_vs_baseline"]["mean"] == 0.0
    # diagnostics: quantized arms have rows for every layer and GEMM at steps 0 and 8
    from mxtrain.study import diagnostics as D
    rows = D.load(out / "runs" / "mxfp4-all" / "seed0")
    assert {r["step"] for r in rows} == {0, 8} and {r["gemm"] for r in rows} == {"fprop", "dgrad", "wgrad"}
    assert all(0 < r["cos"] <= 1 + 1e-9 for r in rows)
    assert not (out / "runs" / "bf16" / "seed0" / "diagnostics.jsonl").exists()
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4 and "Effects next to seed-to-seed spread" in html
    # resume: everything is finished, nothing is trained again, and the report is rewritten
    assert main(["study", "--preset", "smoke", "--out", str(out)]) == 0
    assert "skipped" in capsys.readouterr().out
    # the report command and its errors
    assert main(["report", str(out)]) == 0
    assert main(["report", str(tmp_path / "nope")]) == 2
    empty = tmp_path / "empty"   # a study whose first run has not trained yet: said so, not "no study"
    empty.mkdir()
    (empty / "study.json").write_text((out / "study.json").read_text())
    capsys.readouterr()
    assert main(["report", str(empty)]) == 2 and "no run that trained yet" in capsys.readouterr().err
    assert main(["study", "--arms", "bf16,nope", "--out", str(tmp_path / "x")]) == 2
    # without matplotlib (the README's first command installs no `plots` extra) the report has its tables, says
    # why it has no figures, and the command still succeeds (it once ended in a traceback)
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "Traceback" not in err
    html = (out / "report.html").read_text()
    assert "data:image/png" not in html and "Figures left out: matplotlib is not installed" in html
    assert "Effects next to seed-to-seed spread" in html
    assert "Figures left out" in (out / "report.md").read_text()


def test_arms_added_later_to_the_same_study_are_kept(tmp_path):
    from mxtrain.study.plan import StudySpec
    from mxtrain.study.workers import run_study

    out = str(tmp_path / "st")
    run_study(StudySpec(out=out, arms=["bf16", "mxfp4-all"], seeds=1, smooth_k=1), _fake_trainer([]), log=lambda *a: None)
    calls = []
    run_study(StudySpec(out=out, arms=["bf16", "mxfp4-all-dh16"], seeds=1, smooth_k=1), _fake_trainer(calls),
              log=lambda *a: None)
    assert calls == [("mxfp4-all-dh16", 0)]
    s = json.loads((tmp_path / "st" / "summary.json").read_text())
    assert list(s["arms"]) == ["bf16", "mxfp4-all-dh16", "mxfp4-all"]
    assert s["arms"]["mxfp4-all"]["recipe"]["name"] == "mxfp4-all"


@pytest.mark.slow
def test_parallel_workers_equal_sequential(tmp_path, monkeypatch):
    """`--jobs 2` trains every run once, in worker processes, with the same losses as one by one."""
    import torch

    from mxtrain.cli.core import main

    # bit-equal losses need the same intra-op thread count in this process and in the workers (a CPU matmul
    # split over a different number of threads sums in another order)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _parallel_equal_sequential(tmp_path, main)
    finally:
        torch.set_num_threads(threads)


def _parallel_equal_sequential(tmp_path, main):
    common = ["study", "--preset", "smoke", "--arms", "bf16,mxfp4-all", "--seeds", "2", "--steps", "4",
              "--diagnose-every", "0"]
    assert main(common + ["--out", str(tmp_path / "seq")]) == 0
    assert main(common + ["--out", str(tmp_path / "par"), "--jobs", "2"]) == 0
    for arm in ("bf16", "mxfp4-all"):
        for seed in (0, 1):
            rows = [(tmp_path / d / "runs" / arm / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()
                    for d in ("seq", "par")]
            losses = [[json.loads(r).get("loss", json.loads(r).get("val_loss")) for r in rr
                       if "loss" in json.loads(r) or "val_loss" in json.loads(r)] for rr in rows]
            assert losses[0] == losses[1] and len(losses[0]) >= 4
    logs = "".join((tmp_path / "par" / f"worker{k}.log").read_text() for k in (0, 1))
    assert sum(logs.count(f"{a} seed {s}: done") for a in ("bf16", "mxfp4-all") for s in (0, 1)) == 4
    assert not (tmp_path / "par" / "claims").exists()
    assert main(common + ["--out", str(tmp_path / "bad"), "--jobs", "0"]) == 2


def test_second_reference_arm_and_presets(tmp_path, capsys):
    """An arm list with fp8 beside the bf16 baseline: every arm is also compared with fp8 (its own target), in
    summary.json and the report; the presets that name fp8 as a reference, and the errors."""
    from mxtrain.cli.core import main
    from mxtrain.errors import UserError
    from mxtrain.study.plan import PRESETS, StudySpec
    from mxtrain.study.workers import run_study

    def trainer(spec, arm, seed, run_dir):
        c = {"bf16": 1.0, "fp8": 1.05, "mxfp4-all": 1.2}[arm]
        toks = [1000.0 * i for i in range(1, 51)]
        write_run(run_dir, toks, [curve(t / c, 2.0 + 0.002 * seed) for t in toks])

    spec = StudySpec(out=str(tmp_path / "st"), arms=["bf16", "fp8", "mxfp4-all"], references=["fp8"], seeds=2,
                     smooth_k=1)
    out = run_study(spec, trainer, log=lambda *a: None)
    s = json.loads((out / "summary.json").read_text())
    assert s["arms"]["mxfp4-all"]["extra_tokens"]["mean"] == pytest.approx(0.2, abs=2e-3)
    ref = s["references"]["fp8"]
    assert ref["arms"]["mxfp4-all"]["extra_tokens"]["mean"] == pytest.approx(1.2 / 1.05 - 1, abs=2e-3)
    assert ref["arms"]["bf16"]["extra_tokens"]["mean"] == pytest.approx(1 / 1.05 - 1, abs=2e-3)
    assert ref["arms"]["fp8"]["extra_tokens"]["state"] == "baseline"
    assert ref["target_loss"] > s["target_loss"]                 # fp8's own target: its curve is higher
    html = (out / "report.html").read_text()
    assert "Against fp8" in html and "extra tokens to fp8&#x27;s target" in html

    assert "fp8" in PRESETS["paper"]["arms"] and PRESETS["paper"]["references"] == ["fp8"]
    assert PRESETS["headline"]["arms"] == ["bf16", "fp8", "mxfp4-all", "mxfp4-all-dh16", "mxfp4-all-sr", "tseng",
                                           "mxfp4-all@deosc"]
    for name, p in PRESETS.items():   # every preset is a valid study
        StudySpec(**{k: v for k, v in p.items() if k in StudySpec.__dataclass_fields__})
    assert main(["study", "--preset", "headline", "--out", str(tmp_path / "h"), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert "baseline bf16; also compared with fp8" in said
    assert "peak learning rate: 0.00075 for every arm" in said      # the rate it was run at, not the base's
    # a preset's reference that --arms leaves out is dropped, not an error
    assert main(["study", "--preset", "paper", "--arms", "bf16,mxfp4-all", "--out", str(tmp_path / "p"),
                 "--dry-run"]) == 0
    assert "also compared" not in capsys.readouterr().out
    # flags that shape how a study runs, not its plan, are named by a dry run (never dropped silently) and checked
    assert main(["study", "--preset", "paper", "--arms", "bf16", "--out", str(tmp_path / "j"), "--jobs", "3",
                 "--start-by", "60", "--dry-run"]) == 0
    assert "not part of this plan: --jobs 3 and --start-by 60 apply when the study runs" in capsys.readouterr().out
    assert main(["study", "--preset", "paper", "--arms", "bf16", "--out", str(tmp_path / "j"), "--start-by", "-1",
                 "--dry-run"]) == 2
    assert "--start-by -1" in capsys.readouterr().err
    assert main(["study", "--arms", "bf16,mxfp4-all", "--references", "fp8", "--out", str(tmp_path / "r"),
                 "--dry-run"]) == 2
    assert "--references 'fp8' is not one of the arms" in capsys.readouterr().err
    with pytest.raises(UserError, match="--fit must be"):
        StudySpec(arms=["bf16"], fit="l1")


def test_report_names_the_learning_rate(tmp_path):
    """A study report says how its runs trained, the peak learning rate above all: one value when every run
    shares it, else per arm (an ``@lrVALUE`` arm beside the plain ones)."""
    from mxtrain.study import report

    def run(arm, seed, lr):
        d = tmp_path / "st" / "runs" / arm / f"seed{seed}"
        toks = [1000.0 * i for i in range(1, 21)]
        write_run(d, toks, [curve(t) for t in toks])
        (d / "config.json").write_text(json.dumps({"model": {"name": "tiny"}, "train": {"batch_size": 8},
                                                   "data": {"seq_len": 64}, "schedule": {"warmup_steps": 4},
                                                   "optim": {"lr": lr, "weight_decay": 0.1}}))
    for s in (0, 1):
        run("bf16", s, 3e-3)
        run("mxfp4-all", s, 3e-3)
    runs = M.load_study_runs(tmp_path / "st")
    assert report.training_line(runs) == ("Training: model tiny, 8 x 64 tokens a step, 4 warm-up steps, "
                                          "weight decay 0.1, peak learning rate 0.003 for every run.")
    for s in (0, 1):
        run("bf16@lr1.5e-3", s, 1.5e-3)
    runs = M.load_study_runs(tmp_path / "st")
    line = report.training_line(runs)
    assert "peak learning rate by arm:" in line and "bf16@lr1.5e-3 0.0015" in line and "bf16 0.003" in line
    _, md = report.write_report(tmp_path / "st")
    assert line in md.read_text()
    # runs whose configs record no learning rate: the line names none (no "?" per arm)
    from types import SimpleNamespace
    bare = {a: {0: SimpleNamespace(config={"model": {"name": "tiny"}})} for a in ("bf16", "fp8")}
    assert report.training_line(bare) == "Training: model tiny."


def test_every_arm_has_its_own_colour_past_the_palette():
    """A report of more arms than the palette holds (the 30m study has 23) still gives each its own colour, the
    same in every figure: the palette's first, then generated ones, none repeated."""
    from mxtrain.study import report
    arms = [f"arm{i}" for i in range(40)]
    c = report.arm_colors(arms, ["extra", "arm3"])
    assert len(c) == 41 and len(set(c.values())) == 41
    assert [c[a] for a in arms[:16]] == report._PALETTE
    assert all(len(v) == 7 and v.startswith("#") for v in c.values())
    assert report.arm_colors(arms, ["extra"]) == c        # the same map every time it is built


def test_many_arms_put_the_legend_below_the_figure():
    """A panel with a few arms keeps its legend inside; with many (23 in the 30m study) one legend goes below
    the figure, in columns, where it hides no curve; and arms past the palette are dashed in every line plot."""
    pytest.importorskip("matplotlib")
    from mxtrain.study import report
    plt = report._plt()
    for n, below in ((3, False), (report._LEGEND_INSIDE + 1, True)):
        fig, ax = plt.subplots()
        for i in range(n):
            ax.plot([0, 1], [i, i], label=f"arm{i}")
        assert report._legend(fig, ax) is below
        assert (ax.get_legend() is None) is below and bool(fig.legends) is below
        plt.close(fig)
    colors = report.arm_colors([f"arm{i}" for i in range(20)])
    assert {report._ls(colors, f"arm{i}") for i in range(16)} == {"-"}
    assert {report._ls(colors, f"arm{i}") for i in range(16, 20)} == {"--"}


def test_report_names_numerics_settings_other_than_the_defaults(tmp_path):
    """A report says loudly which numerics settings (those that can change a run's numbers) runs trained with
    other than the defaults, from each run's ``run.json`` (every leg of a resumed run): for every run or by arm;
    nothing when all are the defaults or no run recorded its settings."""
    from types import SimpleNamespace

    from mxtrain import settings
    from mxtrain.study import report
    dflt = settings.Settings().to_dict()

    def rd(**over):
        return SimpleNamespace(info={"settings": dict(dflt, **over)}, config={})
    plain = {a: {s: rd() for s in (0, 1)} for a in ("bf16", "fp8")}
    assert report.numerics_line(plain) is None
    assert report.numerics_line({"bf16": {0: SimpleNamespace(info={}, config={})}}) is None
    every = {a: {s: rd(fp8_fast_accum="fprop") for s in (0, 1)} for a in ("bf16", "fp8")}
    assert report.numerics_line(every) == ("Numerics settings other than the defaults (docs/settings.md): "
                                           "fp8_fast_accum=fprop (every run).")
    some = {"bf16": {0: rd(), 1: rd()}, "fp8": {0: rd(fp8_autocast="autocast"), 1: rd()}}
    assert "fp8_autocast=autocast (fp8: 1 of 2 runs)" in report.numerics_line(some)
    # a resumed run whose first leg ran with another setting; a non-numerics setting is not named
    legs = {"fp8": {0: SimpleNamespace(config={}, info={"settings": dict(dflt, qkernel="tile"),
                                                        "legs": [{"settings": dict(dflt, fast=False)}]})}}
    assert report.numerics_line(legs).endswith(": fast=False.")   # (one run: no "every run")
    # in the written report of a study folder
    d = tmp_path / "st" / "runs" / "fp8" / "seed0"
    toks = [1000.0 * i for i in range(1, 21)]
    write_run(d, toks, [curve(t) for t in toks])
    (d / "run.json").write_text(json.dumps({"settings": dict(dflt, fp8_fast_accum="fprop")}))
    _, md = report.write_report(tmp_path / "st")
    assert "defaults (docs/settings.md): fp8\\_fast\\_accum=fprop.**" in md.read_text()   # (_ escaped)


def test_report_md_escapes_names_from_folders(tmp_path, monkeypatch):
    """Issue #47, 9: an arm folder named <img src=x onerror=alert(1)> stood unescaped in report.md's prose
    (report.html escaped it); a name can neither be raw HTML nor a link, image or code span there."""
    from mxtrain.study import report
    monkeypatch.setattr(report, "plots_available", lambda: False)   # (the figures are not what is tested)
    toks = [1000.0 * i for i in range(1, 21)]
    bad = ("<img src=x onerror=alert(1)>", "[x](javascript:alert(1)) `y`")
    for arm, c in (("bf16", 1.0), (bad[0], 1.2), (bad[1], 1.1)):
        for s in range(2):
            write_run(tmp_path / "runs" / arm / f"seed{s}", toks, [curve(t / c, 2.0 + 0.01 * s) for t in toks])
            (tmp_path / "runs" / arm / f"seed{s}" / "config.json").write_text(json.dumps({"recipe": arm}))
    summary = M.sanitize(M.summarize(M.load_study_runs(tmp_path), "bf16", smooth_k=2))
    hp, mp = report.write_report(tmp_path, summary)
    md = mp.read_text()
    prose = md.split("## Exact configurations")[0]
    assert "<img" not in md.replace("```json", "").split("```")[0] and "<img" not in prose
    assert "&lt;img src=x onerror=alert(1)&gt;" in prose and "&lt;img src=x onerror=alert(1)&gt; seed 0" in md
    assert not re.search(r"(?<!\\)\]\(", prose) and "\\[x\\](javascript:alert(1)) \\`y\\`" in prose
    assert "<img" not in hp.read_text().split("<h2>Exact configurations")[0].replace("<img alt=", "")
    assert report._md_code("a`b") == "``a`b``" and report._md_text("a\nb\\") == "a b\\\\"


def test_report_md_escapes_markdown_specials_in_names(tmp_path, monkeypatch):
    """Issue #47 leftover: arm names with * _ ` | [ ] (a run `a*b_c`) became emphasis, code spans or broke tables
    in report.md; each is backslash-escaped wherever a name is written (prose, tables, headings), and shown as
    itself in the HTML block of the exact configurations."""
    from mxtrain.study import report
    monkeypatch.setattr(report, "plots_available", lambda: False)
    toks = [1000.0 * i for i in range(1, 21)]
    arms = ("bf16", "a*b_c", "x|y~z", "[l]`t`")
    for arm, c in zip(arms, (1.0, 1.2, 1.1, 1.05)):
        for s in range(2):
            write_run(tmp_path / "runs" / arm / f"seed{s}", toks, [curve(t / c, 2.0 + 0.01 * s) for t in toks])
            (tmp_path / "runs" / arm / f"seed{s}" / "config.json").write_text(json.dumps({"recipe": arm}))
    summary = M.sanitize(M.summarize(M.load_study_runs(tmp_path), "bf16", smooth_k=2))
    _, mp = report.write_report(tmp_path, summary)
    md = mp.read_text()
    prose = md.split("## Exact configurations")[0]
    assert "a\\*b\\_c" in prose and "x\\|y\\~z" in prose and "\\[l\\]\\`t\\`" in prose
    for raw in ("a*b_c", "x|y~z", "[l]`t`"):
        assert raw not in prose, raw
    tables = re.findall(r"(?m)(?:^\|.*\n)+", prose)   # every row of a table has its header's cells: no | from a
    assert any("x\\|y" in t for t in tables)              # name ends a cell
    for t in tables:
        assert len({len(re.findall(r"(?<!\\)\|", ln)) for ln in t.splitlines()}) == 1, t
    assert "<summary>a*b_c seed 0: config.json</summary>" in md    # (HTML block: no Markdown escapes there)
    assert report._md_text("a*b_c") == "a\\*b\\_c" and report._table_md([["k"], ["a|b"]]).endswith("| a\\|b |")


def test_markdown_tables_carry_values_as_text():
    """A value from a run folder (a crafted ``run.json`` device name) cannot end a table cell or become HTML in
    report.md (report.html escapes it too)."""
    from mxtrain.study.report import _table_md
    md = _table_md([["key", "value"], ["device", "<img src=x onerror=alert(1)> | x"]])
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)&gt; \\| x" in md


def test_a_study_refuses_to_resume_on_other_data(tmp_path):
    """A study records its prepared folder's fingerprint and refuses to resume on a folder that holds other data
    (its runs would no longer pair by seed); the same data elsewhere, or prepared at another time, resumes."""
    from mxtrain.data.shards import FORMAT, fingerprint
    from mxtrain.errors import UserError
    from mxtrain.study.plan import StudySpec
    from mxtrain.study.workers import run_study

    def folder(name, merges, created="2026-01-01", src="/a/train.jsonl"):
        d = tmp_path / name
        d.mkdir()
        (d / "tok.json").write_text(json.dumps({"merges": merges}))
        (d / "meta.json").write_text(json.dumps({"format": FORMAT, "tokenizer": "tok.json", "created": created,
                                                 "train": [{"file": "train_00000.bin", "tokens": 100}],
                                                 "sources": [{"path": src}]}))
        return d

    a = folder("a", ["t h"])
    assert fingerprint(a) == fingerprint(folder("a2", ["t h"], created="2026-02-02", src="/b/train.jsonl"))
    assert fingerprint(tmp_path) is None
    out = str(tmp_path / "st")
    run_study(StudySpec(out=out, arms=["bf16"], seeds=1, data=str(a)), _fake_trainer([]), log=lambda *x: None)
    assert json.loads((Path(out) / "study.json").read_text())["data_fingerprint"] == fingerprint(a)
    moved = folder("moved", ["t h"], created="2026-03-03")   # the same data prepared again elsewhere: resumes
    calls = []
    run_study(StudySpec(out=out, arms=["bf16"], seeds=2, data=str(moved)), _fake_trainer(calls), log=lambda *x: None)
    assert calls == [("bf16", 1)]
    (a / "tok.json").write_text(json.dumps({"merges": ["h e"]}))   # the same path, other text's BPE
    calls = []
    with pytest.raises(UserError, match="other data"):
        run_study(StudySpec(out=out, arms=["bf16"], seeds=3, data=str(a)), _fake_trainer(calls))
    assert calls == []
    from mxtrain.study.run import compute_plan
    assert compute_plan(StudySpec(out=out, arms=["bf16"], seeds=3, data=str(a)))["folder_mismatch"] is True
    assert compute_plan(StudySpec(out=out, arms=["bf16"], seeds=3, data=str(moved)))["folder_mismatch"] is False
    other = compute_plan(StudySpec(out=out, arms=["bf16"], seeds=3, data=str(moved), steps=7))   # names what differs
    assert other["folder_differs"] == "steps: not set in the folder, 7 now", other["folder_differs"]
    with pytest.raises(UserError, match="steps: not set in the folder, 7 now"):
        run_study(StudySpec(out=out, arms=["bf16"], seeds=3, data=str(moved), steps=7), _fake_trainer(calls))
