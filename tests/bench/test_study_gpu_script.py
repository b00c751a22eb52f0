"""``benchmarks/study_gpu.sh`` (the GPU machine's study call), ``study_lease.sh`` (a study across the calls of one
lease), ``study_probe.sh`` and ``unpack_corpus.sh`` run on CPU with a tiny model: a study that spans two leases,
corpus parts carried over two calls, two named studies sharing a lease and one MPS daemon."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from train_helpers import small_data

ROOT = Path(__file__).resolve().parents[2]

# The scripts' mechanics (leases, skipped and carried runs, the probe, MPS) do not depend on the model's size:
# "tiny" cut to 2 blocks of width 64 (0.2M parameters, not 0.8M), and (where a test names no steps of its own)
# 16-step studies (branches at budgets 0.75 and 1: steps 10 and 13, after the 4 warm-up steps)
SMALL = "--set model.dim=64 --set model.n_layers=2 --set model.n_heads=2 --set model.n_kv_heads=1"


def _call(tmp, name, arms, seed_study=None, data=None):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               OUT=str(tmp / f"out-{name}"), STUDY=str(tmp / f"study-{name}"), DATA=str(data),
               ARMS=arms, MODEL="tiny", STEPS="16", SEEDS="1", BUDGETS="0.75,1", JOBS="1", DEVICE="cpu",
               EVAL_EVERY="8", EVAL_TOKENS="1024", FINAL_EVAL_TOKENS="2048",
               EXTRA=f"--batch-size 2 --seq-len 32 --set schedule.warmup_steps=4 {SMALL}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if seed_study:
        env["SEED_STUDY"] = str(seed_study)
    r = subprocess.run(["bash", "benchmarks/study_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    log = (tmp / f"out-{name}" / "study_log.txt").read_text()
    assert r.returncode == 0 and "study exit: 0" in log, (r.stdout, r.stderr, log)
    return tmp / f"out-{name}", log


def _unpack(parts, data, ship, **env):
    return subprocess.run(["bash", "benchmarks/unpack_corpus.sh", str(parts), str(data)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, SHIP=str(ship), PY=sys.executable, **env))


def test_corpus_parts_carried_over_two_calls(tmp_path):
    """``benchmarks/unpack_corpus.sh``: the prepared folder, xz-compressed and cut in two parts with a SHA-256
    manifest, carried one part a call: the first call keeps its part and says which is still to carry (exit 3),
    the second unpacks the folder byte for byte; a part that differs from the manifest, a non-empty target
    without meta.json and no parts at all are refused with exit 2 (and the target left alone)."""
    import hashlib
    import io
    import lzma
    import tarfile
    src = small_data()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for f in sorted(src.iterdir()):
            t.add(f, arcname=f.name)
    blob = lzma.compress(buf.getvalue())
    cut = len(blob) // 2
    names = ["corpus-32k.tar.xz.00", "corpus-32k.tar.xz.01"]
    chunks = [blob[:cut], blob[cut:]]
    manifest = "".join(f"{hashlib.sha256(c).hexdigest()}  {n}\n" for n, c in zip(names, chunks))
    ships = []
    for i, (n, c) in enumerate(zip(names, chunks)):
        d = tmp_path / f"ship{i}"
        d.mkdir()
        (d / n).write_bytes(c)
        (d / "corpus-32k.parts").write_text(manifest)
        ships.append(d)
    parts, data = tmp_path / "parts", tmp_path / "c32k"
    r = _unpack(parts, data, ships[0])
    assert r.returncode == 3 and "1 of 2 parts" in r.stdout and names[1] in r.stdout, (r.stdout, r.stderr)
    assert not data.exists()
    # study_lease.sh's NAME (a study's name, exported with the call's other settings) names no corpus here
    r = _unpack(parts, data, ships[1], NAME="trend")
    assert r.returncode == 0, (r.stdout, r.stderr)
    for f in src.iterdir():
        assert (data / f.name).read_bytes() == f.read_bytes(), f.name
    assert _unpack(parts, data, tmp_path / "none").returncode == 0      # already there: nothing to do

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / names[0]).write_bytes(b"x" + chunks[0][1:])
    (bad / "corpus-32k.parts").write_text(manifest)
    r = _unpack(tmp_path / "parts2", tmp_path / "d2", bad)
    assert r.returncode == 2 and "differs from the manifest" in r.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep me")
    r = _unpack(parts, busy, tmp_path / "none")
    assert r.returncode == 2 and "not empty" in r.stderr and (busy / "mine.txt").read_text() == "keep me"
    r = _unpack(tmp_path / "empty", tmp_path / "d3", tmp_path / "none")
    assert r.returncode == 2 and "no corpus-32k parts" in r.stderr


def _env(tmp, **kw):
    # (POLL: study_lease.sh's watch and collect look every 0.5 s, not every 5 s, for the end of these short studies)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               POLL="0.5",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.update({k: str(v) for k, v in kw.items()})
    return env


def test_a_study_spans_two_leases_through_the_lease_script(tmp_path):
    """Two leases: the first call (``study_gpu.sh`` alone) trains one arm and returns ``study.tgz`` (run folders
    without checkpoints); the second lease carries it (``SEED_STUDY``) with one more arm, skips the finished arm
    and trains only the new one, its summary holding both. The second lease runs through
    ``benchmarks/study_lease.sh``: ``start`` returns at once with the study training in a session of its own,
    ``watch`` waits for it (exit 1 while it runs, 0 once it ended), ``collect`` copies its results; a second
    ``start`` while one runs is refused, and ``stop`` with nothing running says so. (One test, so that the suite
    trains the first arm once.)"""
    data = small_data()
    out1, _ = _call(tmp_path, "a", "bf16", data=data)
    seed = tmp_path / "carried" / "study.tgz"           # what the next lease carries
    seed.parent.mkdir()
    shutil.copy(out1 / "study.tgz", seed)
    env = _env(tmp_path, PARTS=tmp_path / "parts", DATA=data, ARMS="bf16,mxfp4-all", MODEL="tiny", STEPS="16",
               SEEDS="1", BUDGETS="0.75,1", JOBS="1", DEVICE="cpu", EVAL_EVERY="8", EVAL_TOKENS="1024",
               FINAL_EVAL_TOKENS="2048", EXTRA=f"--batch-size 2 --seq-len 32 --set schedule.warmup_steps=4 {SMALL}",
               SEED_STUDY=seed,
               # MPS=auto measures first (here: no MPS on the machine, the plain probe only, so MPS stays off;
               # RECIPE: the probe's runs in bf16, see test_study_probe_measures_runs_sharing_a_device)
               MPS="auto", PROBE_FORCE="1", PROBE_STEPS="12", PROBE_EXTRA=f"--batch-size 2 --seq-len 32 {SMALL}",
               RECIPE="bf16")

    def lease(*args, **kw):
        return subprocess.run(["bash", "benchmarks/study_lease.sh", *args], cwd=ROOT, env={**env, **kw},
                              capture_output=True, text=True, timeout=600)
    r = lease("start", "auto")
    assert r.returncode == 2 and "mark" in r.stderr                   # auto needs the lease's start
    assert lease("mark").returncode == 0
    t0 = (tmp_path / "parts" / "t0").read_text()
    assert lease("mark").returncode == 0 and (tmp_path / "parts" / "t0").read_text() == t0   # kept
    r = lease("start", "auto", LEASE="200", MARGIN="100")            # 200 - 45 - 100 < 60 s: refused
    assert r.returncode == 2 and "left" in r.stderr
    r = lease("start", "auto", LEASE="900", MARGIN="100", START_BY="auto", RUN_SECONDS="300")
    assert r.returncode == 0 and "started" in r.stdout, (r.stdout, r.stderr)
    secs = int(r.stdout.split("at most ")[1].split(" s")[0])
    assert 740 <= secs <= 755 and f"no run starting after {secs - 300} s" in r.stdout
    assert lease("start", "300").returncode == 2                     # one at a time
    while lease("watch", "30").returncode == 1:
        pass
    r = lease("collect", OUT=str(tmp_path / "out"))
    assert r.returncode == 0, (r.stdout, r.stderr)
    out2 = tmp_path / "out"
    log = (out2 / "study_log.txt").read_text()
    assert "study exit: 0" in log and (out2 / "study.tgz").is_file()
    assert "bf16 seed 0: done already, skipped" in log
    assert "mxfp4-all seed 0 ->" in log and "bf16 seed 0 ->" not in log
    summary = json.loads((out2 / "summary.json").read_text())
    assert {"bf16", "mxfp4-all"} <= set(summary["arms"]) and summary["missing"] == [], summary.keys()
    with tarfile.open(out2 / "study.tgz") as t:                     # the archive holds no checkpoints
        assert not [n for n in t.getnames() if n.endswith(".pt")]
    assert "--start-by" in (out2 / "device.txt").read_text()     # START_BY=auto reached the study
    assert "MPS=auto: MPS=0" in (out2 / "mps.txt").read_text()
    assert json.loads((out2 / "probe.json").read_text())["plain"]["tok_per_s"] > 0
    assert lease("stop").returncode == 2


def test_study_probe_measures_runs_sharing_a_device(tmp_path):
    """``benchmarks/study_probe.sh`` (plain mode on CPU): JOBS runs at once, the aggregate tokens/s in probe.json.
    (RECIPE bf16, not the script's mxfp4-all: what the probe does with its runs does not depend on their recipe,
    and MXFP4's kernels run in Triton's plain interpreter in the runs' processes here.)"""
    env = _env(tmp_path, OUT=tmp_path / "out", DATA=small_data(), MODES="plain", JOBS="2", STEPS="12", MODEL="tiny",
               DEVICE="cpu", RECIPE="bf16", EXTRA=f"--seq-len 32 --batch-size 2 {SMALL}")
    r = subprocess.run(["bash", "benchmarks/study_probe.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "plain:" in r.stdout, (r.stdout, r.stderr)
    res = json.loads((tmp_path / "out" / "probe.json").read_text())["plain"]
    assert res["rc"] == [0, 0] and res["tok_per_s"] > 0 and len(res["per_run"]) == 2
    assert res["tok_per_s"] == sum(res["per_run"])


MPS_STUB = r"""#!/usr/bin/env bash
# stands in for NVIDIA's MPS control: logs each call; -d makes the control pipe, quit removes it
echo "${CUDA_VISIBLE_DEVICES-unset} $*" >> "$MPS_STUB_LOG"
if [ "${1:-}" = -d ]; then
  [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] && exit 1      # one daemon at a time, as the real one
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
read -r cmd; echo "cmd $cmd" >> "$MPS_STUB_LOG"
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


def test_two_named_studies_share_a_lease_and_one_mps_daemon(tmp_path):
    """``study_lease.sh`` with NAME: two studies at once on one lease, each with its own state, folder and GPUS;
    under MPS=1 the first starts the daemon (seeing every GPU), the second joins it, and the daemon is stopped
    once, by the last study to end (here a stand-in for NVIDIA's control program records the calls)."""
    import time
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    stub = bin_ / "nvidia-cuda-mps-control"
    stub.write_text(MPS_STUB)
    stub.chmod(0o755)
    log = tmp_path / "mps.log"
    parts = tmp_path / "parts"
    env = _env(tmp_path, PARTS=parts, DATA=small_data(), MODEL="tiny", SEEDS="1", BUDGETS="1", JOBS="1",
               DEVICE="cpu", EVAL_EVERY="8", EVAL_TOKENS="1024", FINAL_EVAL_TOKENS="1024", MPS="1",
               MPS_STUB_LOG=log, EXTRA="--batch-size 2 --seq-len 32 --set schedule.warmup_steps=4")
    env["PATH"] = f"{bin_}{os.pathsep}{env['PATH']}"

    def lease(*args, **kw):
        return subprocess.run(["bash", "benchmarks/study_lease.sh", *args], cwd=ROOT, env={**env, **kw},
                              capture_output=True, text=True, timeout=600)
    assert lease("start", "300", NAME="a b").returncode == 2                 # a NAME names files: refused
    r = lease("start", "600", NAME="a", GPUS="0", ARMS="bf16", STEPS="16")
    assert r.returncode == 0, (r.stdout, r.stderr)
    for _ in range(100):
        if (parts / "a.out" / "mps.txt").exists():
            break
        time.sleep(0.2)
    # (a keeps tiny's full size: it must still run when b starts; b, the longer study, is the small model)
    r = lease("start", "600", NAME="b", GPUS="1", ARMS="mxfp4-all", STEPS="24", EXTRA=f"{env['EXTRA']} {SMALL}")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert lease("start", "600", NAME="b").returncode == 2                   # b is running
    for name in ("a", "b"):
        while lease("watch", "30", NAME=name).returncode == 1:
            pass
        r = lease("collect", NAME=name, OUT=str(tmp_path / f"out-{name}"))
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert "study exit: 0" in (tmp_path / f"out-{name}" / "study_log.txt").read_text()
    # PACK=1: the same in one archive (and the report beside it), two files a study
    r = lease("collect", NAME="b", OUT=str(tmp_path / "packed"), PACK="1")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == ["b-collected.tgz", "b-report.md"]
    with tarfile.open(tmp_path / "packed" / "b-collected.tgz") as tf:
        names = {n.lstrip("./") for n in tf.getnames()}
        assert {"study.tgz", "study_log.txt", "device.txt", "lease.log", "mps.txt"} <= names, names
        assert b"study exit: 0" in tf.extractfile("./study_log.txt").read()
    assert (parts / "study-a" / "runs" / "bf16").is_dir() and not (parts / "study-a" / "runs" / "mxfp4-all").exists()
    assert (parts / "study-b" / "runs" / "mxfp4-all").is_dir() and not (parts / "study-b" / "runs" / "bf16").exists()
    assert (tmp_path / "out-a" / "mps.txt").read_text().strip() == "MPS on"
    assert "joined" in (tmp_path / "out-b" / "mps.txt").read_text()
    calls = log.read_text().splitlines()
    # one start (the daemon sees every GPU), one quit: by whichever ended last (the first found the other alive)
    assert calls[0] == "unset -d" and calls[1] in ("0 ", "1 ") and calls[2:] == ["cmd quit"], calls
    assert not (parts / "mps-pipe" / "control").exists() and not list((parts / "mps-users").iterdir())
