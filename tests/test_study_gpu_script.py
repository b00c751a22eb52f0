"""``benchmarks/study_gpu.sh`` (the GPU machine's study call) run on CPU with a tiny model: a study that spans two
leases. The first call trains one arm and returns ``study.tgz`` (run folders without checkpoints); a second call
in a fresh study folder, seeded with that archive (``SEED_STUDY``) and given one more arm, skips the finished arm
and trains only the new one, and its summary holds both."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from train_helpers import small_data

ROOT = Path(__file__).resolve().parents[1]



def _call(tmp, name, arms, seed_study=None, data=None):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               OUT=str(tmp / f"out-{name}"), STUDY=str(tmp / f"study-{name}"), DATA=str(data),
               ARMS=arms, MODEL="tiny", STEPS="24", SEEDS="1", BUDGETS="0.75,1", JOBS="1", DEVICE="cpu",
               EVAL_EVERY="8", EVAL_TOKENS="1024", FINAL_EVAL_TOKENS="2048",
               EXTRA="--batch-size 2 --seq-len 32 --set schedule.warmup_steps=4",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if seed_study:
        env["SEED_STUDY"] = str(seed_study)
    r = subprocess.run(["bash", "benchmarks/study_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    log = (tmp / f"out-{name}" / "study_log.txt").read_text()
    assert r.returncode == 0 and "study exit: 0" in log, (r.stdout, r.stderr, log)
    return tmp / f"out-{name}", log


def test_a_study_spans_two_leases(tmp_path):
    data = small_data()
    out1, _ = _call(tmp_path, "a", "bf16", data=data)
    seed = tmp_path / "carried" / "study.tgz"           # what the next lease carries
    seed.parent.mkdir()
    shutil.copy(out1 / "study.tgz", seed)
    out2, log = _call(tmp_path, "b", "bf16,mxfp4-all", seed_study=seed, data=data)
    assert "bf16 seed 0: done already, skipped" in log
    assert "mxfp4-all seed 0 ->" in log and "bf16 seed 0 ->" not in log
    summary = json.loads((out2 / "summary.json").read_text())
    assert {"bf16", "mxfp4-all"} <= set(summary["arms"]), summary.keys()
    # the archive holds no checkpoints
    import tarfile
    with tarfile.open(out2 / "study.tgz") as t:
        assert not [n for n in t.getnames() if n.endswith(".pt")]
