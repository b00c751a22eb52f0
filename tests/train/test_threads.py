"""CPU threads of a training run (mxtrain.train.threads): one per core the load leaves free, never fewer than
one nor more than PyTorch's default; what the user set is kept; the run says what it chose."""

import json
import os

import torch

from mxtrain.train import threads
from mxtrain.train.threads import choose

from train_helpers import tiny_run_cfg


def test_quiet_machine_keeps_a_thread_per_core():
    c = choose(default=2, cores=2, host_cpus=2, load=0.2)
    assert c.threads == 2 and c.message == "cpu threads: 2 (2 cores available, load average 0.2 on them)"


def test_busy_machine_takes_the_free_cores_and_says_why():
    c = choose(default=2, cores=2, host_cpus=2, load=2.4)   # the README's 87-minute case: other work on both cores
    assert c.threads == 1
    assert "the machine is busy" in c.message and "OMP_NUM_THREADS" in c.message
    assert choose(default=16, cores=16, host_cpus=16, load=6.2).threads == 10
    assert choose(default=8, cores=8, host_cpus=8, load=30.0).threads == 1   # never fewer than one


def test_own_work_is_not_counted_as_the_machines_load():
    # a process that prepared its data for a minute made the load average 1.0 itself: the machine is quiet
    assert choose(default=2, cores=2, host_cpus=2, load=1.0, own=0.95).threads == 2
    assert choose(default=2, cores=2, host_cpus=2, load=1.0).threads == 1


def test_affinity_and_host_load():
    # 4 of a 64-CPU host's cores, the host's load average 32: half of those 4 cores busy
    assert choose(default=64, cores=4, host_cpus=64, load=32.0).threads == 2
    # PyTorch's default (physical cores) is never exceeded, nor the cores the process may use
    assert choose(default=4, cores=8, host_cpus=8, load=0.0).threads == 4
    assert choose(default=8, cores=3, host_cpus=8, load=0.0).threads == 3
    assert choose(default=8, cores=3, host_cpus=8, load=None).threads == 3


def test_what_the_user_set_is_kept():
    c = choose(default=2, cores=2, host_cpus=2, load=9.0, user_set="OMP_NUM_THREADS=2")
    assert c.threads is None and c.message == "cpu threads: 2 (OMP_NUM_THREADS=2)"


def test_measure_sees_the_environment_and_set_num_threads(monkeypatch):
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads.measure()["user_set"] == "OMP_NUM_THREADS=1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "_AT_IMPORT", torch.get_num_threads() + 1)   # set since mxtrain was imported
    assert threads.measure()["user_set"] == f"torch.set_num_threads({torch.get_num_threads()})"
    monkeypatch.setattr(threads, "_AT_IMPORT", torch.get_num_threads())
    m = threads.measure()
    assert m["user_set"] is None and m["cores"] >= 1 and m["own"] >= 0


def test_cpu_run_says_its_threads(tmp_path, capsys, monkeypatch):
    from mxtrain.train import train
    before = torch.get_num_threads()
    # (4 cores, whatever this process's own thread count is: under pytest-xdist it is 1)
    monkeypatch.setattr(threads, "measure", lambda: {"default": 4, "cores": 4, "host_cpus": 4,
                                                     "load": 9.0, "own": 0.0, "user_set": None})
    try:
        out = train(tiny_run_cfg(tmp_path / "run", 1))
    finally:
        torch.set_num_threads(before)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("cpu threads: "))
    assert line.startswith("cpu threads: 1 (") and "busy" in line
    info = json.loads((out / "run.json").read_text())
    assert info["cpu_threads"] == 1 and info["cpu_threads_chosen"] == line


def test_thread_count_leaves_the_losses_alone(tmp_path, monkeypatch):
    """The losses of a CPU run do not depend on its threads (the choice changes speed only)."""
    from mxtrain.train import train
    before, losses = torch.get_num_threads(), {}
    for n in (1, 2):
        monkeypatch.setenv("OMP_NUM_THREADS", str(n))
        torch.set_num_threads(n)
        try:
            out = train(tiny_run_cfg(tmp_path / f"run{n}", 2))
        finally:
            torch.set_num_threads(before)
        rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
        losses[n] = [r["loss"] for r in rows if "loss" in r]
    assert len(losses[1]) == 2 and losses[1] == losses[2]


def test_resumed_run_takes_its_first_legs_count(tmp_path):
    c = choose(default=2, cores=2, host_cpus=2, load=0.0, first_leg=1)
    assert c.threads == 1 and "first leg" in c.message
    assert choose(default=2, cores=2, host_cpus=2, load=0.0, first_leg=1, user_set="OMP_NUM_THREADS=2").threads is None
    (tmp_path / "run.json").write_text(json.dumps({"cpu_threads": 2, "legs": [{"cpu_threads": 1}, {"cpu_threads": 2}]}))
    assert threads.first_leg(tmp_path) == 1
    (tmp_path / "run.json").write_text(json.dumps({"cpu_threads": 3}))
    assert threads.first_leg(tmp_path) == 3
    (tmp_path / "run.json").write_text("{")
    assert threads.first_leg(tmp_path) is None and threads.first_leg(tmp_path / "gone") is None


def test_a_second_run_in_one_process_chooses_again(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_AT_IMPORT", 2)
    monkeypatch.setattr(threads, "_CHOSEN", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "_own_load", lambda: 0.0)
        monkeypatch.setattr(threads.os, "getloadavg", lambda: (100.0 * (os.cpu_count() or 1), 0, 0))
        assert threads.apply().threads == 1 and torch.get_num_threads() == 1
        m = threads.measure()   # the 1 thread is the first run's choice, not the user's
        assert m["user_set"] is None and m["default"] == 2
    finally:
        torch.set_num_threads(before)
