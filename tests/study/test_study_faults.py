"""Faults of `mxtrain study`: signals to a parallel study, two studies on one folder, missing runs,
failures that are not divergence. CPU only; the real-training tests use a tiny model on small data."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import ROOT, small_data

# ----------------------------------------------------------------------------------------------
# helpers


def _write_run(d: Path, c: float = 1.0, seed: int = 0, n: int = 30) -> None:
    """A finished synthetic run folder: val loss 2 + 5e4 / (tokens / c)."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(1, n + 1):
            t = 1000.0 * i
            v = 2.0 + 0.002 * seed + 5e4 / (t / c)
            f.write(json.dumps({"step": i, "tokens": t, "loss": v + 0.01}) + "\n")
            f.write(json.dumps({"step": i, "tokens": t, "val_loss": v}) + "\n")
    (d / "summary.json").write_text("{}")


def _fake_trainer(calls, fail=None):
    """Stand-in for ``runner.train_one``: ``fail`` maps (arm, seed) to the exception that run raises."""
    def train_fn(spec, arm, seed, run_dir):
        calls.append((arm, seed))
        if fail and (arm, seed) in fail:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").write_text("")
            raise fail[(arm, seed)]
        _write_run(run_dir, {"bf16": 1.0}.get(arm, 1.1), seed)
    return train_fn


def _snapshot(root: Path) -> dict:
    """Every path under ``root`` with its kind, size, mtime and (for files) content."""
    snap = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        snap[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns,
                                          None if p.is_dir() else p.read_bytes())
    snap["."] = root.stat().st_mtime_ns
    return snap


def _children(pid: int) -> list[int]:
    """The PIDs of `pid`'s children; [] once it has ended (it may end while its /proc entry is read)."""
    kids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for task in tasks:
        try:
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return kids


def _descendants(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo += _children(p)
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has ended: it holds no files, no lock, no CPU)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_gone(pids, timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _lock_is_free(path: Path) -> bool:
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def _study_cmd(out: Path) -> list[str]:
    # far more steps than the test lets it train: the workers are mid-training when the signal comes
    return ["study", "--preset", "smoke", "--arms", "bf16", "--seeds", "2", "--steps", "100000",
            "--diagnose-every", "0", "--data", str(small_data()), "--out", str(out), "--jobs", "2"]


def _start_parallel_study(out: Path):
    """`mxtrain study --jobs 2` as a child of this process; returns it, its worker PIDs (its children) and
    every descendant seen (workers and anything they started), once both workers train (each run folder
    has metrics)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mxtrain", *_study_cmd(out)], env=env, cwd=str(out.parent),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=False)
    workers: set[int] = set()
    seen: set[int] = set()
    end = time.monotonic() + 60
    runs = [out / "runs" / "bf16" / f"seed{s}" / "metrics.jsonl" for s in (0, 1)]
    while time.monotonic() < end and proc.poll() is None:
        workers |= set(_children(proc.pid))
        seen |= workers | set(_descendants(proc.pid))
        if len(workers) >= 2 and all(r.is_file() and r.stat().st_size > 0 for r in runs):
            return proc, sorted(workers), sorted(seen)
        time.sleep(0.1)
    proc.kill()
    o, e = proc.communicate()
    pytest.fail(f"the study's workers did not start training (rc {proc.returncode}): {o[-500:]} {e[-1500:]}")


def _cleanup(proc, pids):
    """SIGKILL what this test started and is still running (and still an mxtrain process: no PID reuse)."""
    for p in [proc.pid] + list(pids):
        try:
            mine = b"mxtrain" in Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            mine = False
        if mine and _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
    if proc.poll() is None:
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------------------------
# 1. workers die with their parent; 2. one owner per study folder


def test_sigterm_to_parallel_study_stops_its_workers(tmp_path, capsys):
    from mxtrain.cli.core import main

    out = tmp_path / "st"
    proc, workers, seen = _start_parallel_study(out)
    try:
        assert len(workers) == 2 and all(_alive(w) for w in workers)
        assert (out / ".lock").read_text().strip() == str(proc.pid)
        # a second study on the folder while the first runs: refused, naming the owner
        capsys.readouterr()
        assert main(_study_cmd(out)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mxtrain: error:") and f"pid {proc.pid}" in err[0], err
        os.kill(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, stderr
        assert stderr.strip().splitlines()[-1].startswith("mxtrain: error: study interrupted by SIGTERM")
        assert _wait_gone(seen, 5) == []
        assert _lock_is_free(out / ".lock")
        assert not (out / "summary.json").exists()
    finally:
        _cleanup(proc, seen)


def test_killed_parallel_study_workers_die_and_release_the_folder(tmp_path):
    """SIGKILL leaves the parent no chance to clean up: the kernel's parent-death signal stops the workers."""
    out = tmp_path / "st"
    proc, workers, seen = _start_parallel_study(out)
    try:
        assert len(workers) == 2 and all(_alive(w) for w in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _wait_gone(seen, 10) == []
        assert _lock_is_free(out / ".lock")   # workers held the inherited lock until they ended
    finally:
        _cleanup(proc, seen)


def test_second_study_on_a_locked_folder_is_refused_and_changes_nothing(tmp_path, monkeypatch, capsys):
    from mxtrain.cli.core import main
    from mxtrain.study import workers as runner

    out = tmp_path / "st"
    args = ["study", "--arms", "bf16,mxfp4-all", "--seeds", "2", "--smooth-k", "1", "--out", str(out)]
    monkeypatch.setattr(runner, "train_one", _fake_trainer([]))
    # an interrupted earlier session: one finished run, stale claims
    assert main(args + ["--seeds", "1"]) == 0
    (out / "claims").mkdir()
    (out / "claims" / "bf16-seed1").write_text("")
    capsys.readouterr()
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.seek(0)
        held.truncate()
        held.write("424242\n")
        held.flush()
        before = _snapshot(out)
        calls = []
        monkeypatch.setattr(runner, "train_one", _fake_trainer(calls))
        for extra in ([], ["--jobs", "2"]):
            assert main(args + extra) == 2
            cap = capsys.readouterr()
            err = cap.err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("mxtrain: error:") and "pid 424242" in err[0], err
            assert "in use" in err[0] and "study done" not in cap.out
        assert calls == [] and _snapshot(out) == before
    # released: the folder is this study's again
    assert main(args[:4] + ["1"] + args[5:]) == 0
    assert (out / ".lock").read_text().strip() == str(os.getpid())


# ----------------------------------------------------------------------------------------------
# 3. missing planned runs; 4. failures are not divergence


def test_missing_planned_run_is_named_and_exits_nonzero(tmp_path, monkeypatch, capsys):
    from mxtrain.cli.core import main
    from mxtrain.study import workers as runner

    out = tmp_path / "st"
    args = ["study", "--arms", "bf16,mxfp4-all", "--seeds", "2", "--smooth-k", "1", "--out", str(out)]
    calls = []
    monkeypatch.setattr(runner, "train_one", _fake_trainer(calls, {("mxfp4-all", 1): RuntimeError("disk on fire")}))
    assert main(args) == 1
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mxtrain: error: study incomplete: 1 of 4 planned runs missing: "
                             "mxfp4-all seed 1 (failed: RuntimeError: disk on fire)")
    assert "study done" not in cap.out
    s = json.loads((out / "summary.json").read_text())
    assert s["planned_runs"] == 4
    assert s["missing"] == [{"arm": "mxfp4-all", "seed": 1, "state": "failed", "reason": "RuntimeError: disk on fire"}]
    assert s["arms"]["mxfp4-all"]["seeds"] == [0] and s["arms"]["bf16"]["seeds"] == [0, 1]
    assert "disk on fire" in (out / "runs" / "mxfp4-all" / "seed1" / "study_error.txt").read_text()
    # `mxtrain report` says so too
    assert main(["report", str(out)]) == 0
    assert "study incomplete: 1 of 4" in capsys.readouterr().err
    # an interrupted run folder (no end status) and a run never trained are missing as well
    (out / "runs" / "bf16" / "seed1" / "study_status.json").unlink()
    (out / "runs" / "bf16" / "seed1" / "summary.json").unlink()
    s = runner.summarize_study(out)
    assert [(m["arm"], m["seed"], m["state"]) for m in s["missing"]] == [("bf16", 1, "interrupted"),
                                                                       ("mxfp4-all", 1, "failed")]
    # the next session trains exactly the missing runs, and then the study is done
    calls2 = []
    monkeypatch.setattr(runner, "train_one", _fake_trainer(calls2))
    assert main(args) == 0
    assert calls2 == [("bf16", 1), ("mxfp4-all", 1)]
    assert "study done" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["missing"] == []


def test_failure_mentioning_nan_is_failed_not_diverged(tmp_path, monkeypatch, capsys):
    from mxtrain.cli.core import main
    from mxtrain.study import workers as runner
    from mxtrain.train import NonFiniteLoss

    out = tmp_path / "st"
    fail = {("mxfp4-all", 0): FileNotFoundError("/data/nan-corpus/train_00000.bin: no such file (nan)"),
            ("mxfp4-all-dh16", 0): NonFiniteLoss("loss is nan at step 3; training stopped")}
    monkeypatch.setattr(runner, "train_one", _fake_trainer([], fail))
    assert main(["study", "--arms", "bf16,mxfp4-all,mxfp4-all-dh16", "--seeds", "1", "--smooth-k", "1",
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 3 planned runs missing: mxfp4-all seed 0 (failed: FileNotFoundError" in err[0], err
    st = json.loads((out / "runs" / "mxfp4-all" / "seed0" / "study_status.json").read_text())
    assert st["state"] == "failed" and "nan-corpus" in st["message"]
    st = json.loads((out / "runs" / "mxfp4-all-dh16" / "seed0" / "study_status.json").read_text())
    assert st["state"] == "diverged"
    s = json.loads((out / "summary.json").read_text())
    assert "mxfp4-all" not in s["arms"]   # a failure is no result
    assert s["arms"]["mxfp4-all-dh16"]["diverged"] == {"0": True}   # a divergence is one


def test_real_trainer_missing_nan_path_is_failed(tmp_path, capsys):
    """The real trainer on a data path containing 'nan' that does not exist: failed, not diverged."""
    from mxtrain.cli.core import main

    out = tmp_path / "st"
    assert main(["study", "--preset", "smoke", "--arms", "bf16", "--seeds", "1", "--steps", "2",
                 "--diagnose-every", "0", "--data", str(tmp_path / "nan-data" / "nan"), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "study incomplete: 1 of 1 planned runs missing: bf16 seed 0 (failed: " in err[0], err
    st = json.loads((out / "runs" / "bf16" / "seed0" / "study_status.json").read_text())
    assert st["state"] == "failed" and "nan-data" in st["message"]
    s = json.loads((out / "summary.json").read_text())
    assert s["arms"] == {} and s["missing"][0]["state"] == "failed"


def test_bad_set_value_is_reported_before_the_study_folder_is_written(tmp_path):
    from train_helpers import run_main
    out = tmp_path / "study"
    p = run_main("study", "--preset", "smoke", "--out", str(out), "--set", "optim.beta2=1.5")   # (in this process)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len(lines) == 1 and lines[0].startswith("mxtrain: error: ") and "optim.beta2" in lines[0], p.stderr
    assert not out.exists()


@pytest.mark.parametrize("args,msg", [(["--steps", "0"], "train.steps must be in [1, inf), got 0"),
                                      (["--steps", "0", "--dry-run"], "train.steps must be in [1, inf), got 0"),
                                      (["--set", "log.eval_every=0"], "log.eval_every must be in [1, inf), got 0"),
                                      (["--jobs", "0", "--dry-run"], "--jobs: must be in [1, 4096], got 0")])
def test_zero_steps_or_jobs_are_refused_before_the_study_folder_is_written(tmp_path, capsys, args, msg):
    """Not one failed run per arm and seed with 'rerun the same command', nor a plan of 0 steps: one line."""
    from mxtrain.cli.core import main
    out = tmp_path / "study"
    assert main(["study", "--arms", "bf16", "--seeds", "1", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mxtrain: error: ") and msg in err, err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# out of GPU memory with several runs sharing one GPU


def test_out_of_memory_worker_gives_its_run_back_and_worker_0_trains_it(tmp_path, monkeypatch):
    """A run that fails by running out of device memory (here a torch.OutOfMemoryError raised from inside the
    training, as an H100 shared by 8 study workers did) is recorded with ``oom``; its worker (not worker 0)
    gives the run back and stops; worker 0 then trains it, so no run is lost; a missing run that ran out of
    memory makes the incomplete message say to train fewer runs at once."""
    import torch

    from mxtrain.study import run as RN
    from mxtrain.study import worker as W
    from mxtrain.study.plan import StudySpec

    out = tmp_path / "st"
    out.mkdir()
    spec = StudySpec(out=str(out), arms=["bf16", "mxfp4-all"], seeds=2)
    (out / "study.json").write_text(json.dumps({"spec": spec.__dict__}))
    trained = []

    def fake_train(spec, arm, seed, rd, worker):
        trained.append((worker, arm, seed))
        if worker == 1 and len(trained) == 1:
            try:
                raise RuntimeError("allocation inside the step")
            except RuntimeError as e:   # chained: the type is found through __context__
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB") from e
        rd.mkdir(parents=True, exist_ok=True)
        _write_run(rd, seed=seed)

    monkeypatch.setattr(W, "die_with_parent", lambda: True)
    monkeypatch.setattr(RN, "train_one", lambda *a: fake_train(*a, worker=1))
    assert W.main([str(out), "1", "2"]) == 0
    assert trained == [(1, "bf16", 0)]                       # stopped after its out-of-memory run
    st = json.loads((out / "runs" / "bf16" / "seed0" / "study_status.json").read_text())
    assert st["state"] == "failed" and st["oom"] is True and RN.ran_out_of_memory(out / "runs" / "bf16" / "seed0")
    assert not (out / "claims" / "bf16-seed0").exists()      # given back
    missing = RN.incomplete_message({"planned_runs": 4, "missing": [
        {"arm": "bf16", "seed": 0, "state": "failed", "reason": st["message"], "oom": True}]})
    assert "ran out of GPU memory: train fewer runs at once" in missing
    monkeypatch.setattr(RN, "train_one", lambda *a: fake_train(*a, worker=0))
    assert W.main([str(out), "0", "2"]) == 0
    assert sorted(trained[1:]) == [(0, "bf16", 0), (0, "bf16", 1), (0, "mxfp4-all", 0), (0, "mxfp4-all", 1)]
    for a in ("bf16", "mxfp4-all"):
        for s in (0, 1):
            st = json.loads((out / "runs" / a / f"seed{s}" / "study_status.json").read_text())
            assert st["state"] == "done" and "oom" not in st


def test_a_run_killed_after_its_checkpoint_continues_from_it(tmp_path):
    """A run killed after a checkpoint (SIGKILL, a lost machine) leaves its checkpoint, a run.json without an
    outcome, no study_status.json and no summary.json: the next session continues it from that checkpoint, its
    folder kept, instead of deleting it and training from step 0."""
    from mxtrain.study.plan import StudySpec, build_config
    from mxtrain.study.workers import run_study
    from mxtrain.train import trainer as TR

    spec = StudySpec(out=str(tmp_path / "s"), arms=["bf16"], seeds=1, model="tiny", steps=4, batch_size=4,
                     seq_len=32, eval_every=4, device="cpu", data=str(small_data()),
                     overrides=["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
                                "log.eval_tokens=256", "log.tensorboard=false"])
    rd = tmp_path / "s" / "runs" / "bf16" / "seed0"
    cfg = build_config(spec, "bf16", 0, rd)
    cfg.train.steps = 2
    TR.fit(cfg)
    info = json.loads((rd / "run.json").read_text())
    del info["outcome"]                                     # what the kill leaves: no outcome, no summary
    (rd / "run.json").write_text(json.dumps(info))
    (rd / "summary.json").unlink()
    (rd / "kept.txt").write_text("")
    said = []
    run_study(spec, log=said.append)
    assert any("bf16 seed 0: unfinished, continuing from its checkpoint at step 2" in m for m in said), said
    assert (rd / "kept.txt").exists()
    assert json.loads((rd / "run.json").read_text())["resumed_from_step"] == 2
    assert json.loads((rd / "study_status.json").read_text())["state"] == "done"


def test_the_incomplete_message_counts_runs_and_branches_apart():
    """A study of 90 runs with 270 branches, 76 runs untrained and one branch of a finished run missing: the
    message says 76 of 90 runs and 1 of 270 branches (it said "77 of 360 planned runs" before)."""
    from mxtrain.study import run as RN
    miss = [{"arm": "a", "seed": s, "state": "not_trained"} for s in range(76)]
    msg = RN.incomplete_message({"planned_runs": 90, "planned_branches": 270, "missing": miss})
    assert msg.startswith("study incomplete: 76 of 90 planned runs missing: a seed 0 (not trained)"), msg
    miss.append({"arm": "b", "seed": 0, "budget": 0.5, "state": "interrupted", "reason": "cooldown branch"})
    msg = RN.incomplete_message({"planned_runs": 90, "planned_branches": 270, "missing": miss})
    assert "76 of 90 planned runs and 1 of 270 cooldown branches of finished runs missing" in msg, msg
