"""Real machine limits, not simulated ones (#47): a file size limit (``RLIMIT_FSIZE``: every write past it fails
with EFBIG, as a full disk fails with ENOSPC, through the same code: ``torch.save``, the JSON writes, the token
shards), an address-space limit (``RLIMIT_AS``: torch's CPU allocator and numpy really fail) and, when the tests
run as root, a real full disk (a small tmpfs). The limits are set in a child process (or, for a soft limit that is
raised again at once, around one call in this one), with SIGXFSZ ignored so that a write past the limit fails
instead of killing the process (CPython ignores it at startup already; the child says so anyway). Each command must exit non-zero with one ``mxtrain: error:`` line on stderr, leave
no temporary file or half folder, and keep what it had written whole (a resume continues bit for bit).

The manual sweep behind these tests (2026-11-29, as root, on tmpfs mounts; the `tiny` model at dim 64, 1 layer,
batch 2 x 32 tokens, bf16, a 6.6 MiB checkpoint; train: 6 steps, a checkpoint every 2). "free N": a filler file
left N bytes free on a larger mount. 56 full-disk cases, 49 of them filling the disk (7 controls that fit ran to
the end with status 0), then 7 host-memory and 4 file-size-limit cases. In every failing case, after the fixes of
this change: a non-zero status, one ``mxtrain: error:`` line, no traceback, no ``.tmp-*``, ``.old-*``,
``.write-test-*`` or ``.NAME.lock`` left, the earlier output whole. "resume": after the space was freed
(``mount -o remount,size=...``), resumed to step 6 and compared with an uninterrupted run's checkpoint, tensor for
tensor. "fixed": what it did before this change.

| command | disk | filled at | outcome |
|---|---|---|---|
| train | 8k; 32M free 0, free 1000 | recipe.json, config.json, the folder's write test | one line; training again into the same --out works, bit-exact |
| train | 24k | eval_windows.jsonl | one line (fixed: a second line, the warning that run.json's outcome could not be recorded); now says that no checkpoint was written yet (it said "the last checkpoint is intact") |
| train | 64k, 256k, 2M; 32M free 30000 (fixed: two lines, as for 24k), free 100000 | first checkpoint | one line; the same --out is refused (metrics, no checkpoint) with a hint; a new --out trains |
| train | 7M, 10M | second checkpoint | one line, "the previous one is intact"; the step-2 checkpoint loads; resume bit-exact |
| train, keep_checkpoints_at=2,4 | 14M | third checkpoint | one line; the hard-linked step-2 and step-4 files load; resume bit-exact |
| train --resume from step 4 | free 0, 3000 | config.json | one line; the step-4 checkpoint whole; resume bit-exact |
| train --resume from step 4 | free 60000, 3M | checkpoint | one line; the step-4 checkpoint whole; resume bit-exact |
| train, MXTRAIN_DATA on the full disk | 1M | the built-in corpus's shards | one line naming the data folder (fixed: it named the run's --out, on another disk) |
| data prepare (500 kB text) | 4k, 16k, 48k, 128k, 400k | tokenizer, shards, meta.json | one line naming --out; no half folder, no temporary folder |
| data prepare --force over a prepared folder | free 0 | the lock file's pid | one line; old folder byte-identical (fixed: ``.data.lock`` left behind) |
| data prepare --force over a prepared folder | free 20000, 200000 | shards | one line; old folder byte-identical |
| data prepare builtin | 2M | shards | one line; nothing left |
| export | 4k, 64k, 1M, 2M | model.safetensors | one line; no partial export (fixed: the line named the removed temporary folder's file) |
| export --force over an earlier export | free 0 | the lock file's pid, model.safetensors | one line; earlier export byte-identical (fixed: ``.hf.lock`` left behind) |
| export --force over an earlier export | free 50000 | model.safetensors | one line; earlier export byte-identical |
| report RUN --out NEW | 4k, 32k, 128k | figures, report.html | one line; NEW removed (fixed: a half report, figures without report.html) |
| report STUDY --out NEW | 4k, 64k, 256k | summary.json, figures, report.html | as above (fixed: the half folder's summary.json made the same --out refused once space was back) |
| report STUDY in place | free 0, 4000, 40000 | summary.json, figures | one line; the earlier summary.json and report.md whole |
| study (2 arms x 1 seed) | 8k | study.json | one line; the same command finishes once space is freed |
| study | 64k | a run's files | one line (fixed: the outcome warning and a traceback of TensorBoard's event writer thread) |
| study | 4M, 8M | first, second run's checkpoint | one line, "study incomplete ... (failed: cannot write checkpoint ...)"; finished runs load; the rerun finishes |
| study --jobs 2 | 64k, 8M | a run's files, summary.json; second run's checkpoint | one line on the terminal; worker0.log held a traceback of TensorBoard's writer thread (fixed: the workers install the CLI's thread hook, `errors.thread_limit_hook`) |
| eval --json | free 0, 100 | the JSON file | one line; no file left |
| controls | train 20M keep 2,4; export 3M; export --force free 1.5M (bf16); report 512k, 1M; study 16M, 24M | - | everything fits: status 0 |

Host memory (``RLIMIT_AS``): ``train --batch-size 4096 --seq-len 512`` at 3 and 4 GiB, the same with
``--micro-batch-size 1024``, ``eval --batch-size 4096`` on 2 MB of text: status 1, one line "out of host (CPU)
memory: a block of N MiB could not be allocated; ..." and the command's own flags to lower (fixed: torch's
allocator text cut mid-word, and training flags named for eval); the run's checkpoint untouched. A checkpoint
read when memory runs out (fixed: called "corrupt or truncated; restore it or start a new run"). ``eval
--batch-size 100000`` on the built-in split, ``data prepare`` at 1 GiB and ``generate --max-tokens 2000`` at
3 GiB fit (the split holds fewer windows; generate keeps a window of seq_len tokens).

File size limit (``RLIMIT_FSIZE``, EFBIG): the checkpoint, a JSON file and the report were one line already
("File too large"); ``data prepare``'s tokenizer file and shards reached the CLI's handler as a traceback (fixed:
one line, "file too large ... `ulimit -f`").
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mxtrain import _io
from mxtrain.errors import UserError

ROOT = Path(__file__).resolve().parents[2]

# a child that ignores SIGXFSZ, sets the limits it is given, then runs the CLI
_CHILD = ("import resource, signal, sys\n"
          "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
          "fs, as_ = int(sys.argv[1]), int(sys.argv[2])\n"
          "if fs: resource.setrlimit(resource.RLIMIT_FSIZE, (fs, resource.RLIM_INFINITY))\n"
          "if as_: resource.setrlimit(resource.RLIMIT_AS, (as_, resource.RLIM_INFINITY))\n"
          "from mxtrain.cli.core import main\n"
          "sys.exit(main(sys.argv[3:]))\n")

TINY = ["--model", "tiny", "--set", "model.dim=64", "--set", "model.n_layers=1", "--set", "model.n_heads=2",
        "--set", "model.n_kv_heads=1", "--device", "cpu", "--no-progress", "--recipe", "bf16", "--eval-every", "2",
        "--eval-tokens", "128"]


def _mx(*args, fsize: int = 0, mem: int = 0, cwd=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", _CHILD, str(fsize), str(mem), *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def _one_error(p: subprocess.CompletedProcess, *says: str) -> str:
    """The one ``mxtrain: error:`` line of a failed command (progress and log lines aside), holding ``says``."""
    assert p.returncode != 0, p.stdout[-2000:]
    assert "Traceback" not in p.stderr and "Exception in thread" not in p.stderr, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("mxtrain:")]
    assert len(lines) == 1 and lines[0].startswith("mxtrain: error: "), p.stderr[-3000:]
    for s in says:
        assert s in lines[0], lines[0]
    return lines[0]


def _leftovers(folder: Path) -> list[str]:
    return [str(p) for p in Path(folder).rglob("*") if ".tmp" in p.name or ".old-" in p.name
            or ".write-test" in p.name or (p.name.endswith(".lock") and p.name != ".lock")]


class _SoftFileLimit:
    """A real file size limit on this process for a moment: the soft ``RLIMIT_FSIZE`` lowered to ``n`` bytes
    (SIGXFSZ ignored, so a write past it fails with EFBIG), both put back on exit."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.n, self.old[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
        signal.signal(signal.SIGXFSZ, self.sig)


# ---------------------------------------------------------------------------------------------------------------
# the file size limit (EFBIG): unprivileged, so it runs everywhere


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """About 60 kB of English text (the project's own documentation) to prepare."""
    docs = "".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    f = tmp_path_factory.mktemp("text") / "text.txt"
    f.write_text(docs[:60_000], encoding="utf-8")
    return f


@pytest.mark.parametrize("limit", [3_000, 40_000])
def test_prepare_past_the_file_size_limit_is_one_line(tmp_path, text_file, limit):
    """The tokenizer file (3 kB) or a token shard (40 kB) grows past the limit: EFBIG reached the CLI's handler
    from the shard writer as a traceback; now one line that names the folder and the limit, nothing left."""
    out = tmp_path / "data"
    p = _mx("data", "prepare", text_file, "--vocab-size", "512", "--out", out, "--no-progress", fsize=limit)
    _one_error(p, "file too large", str(out), "ulimit -f")
    assert not out.exists() and _leftovers(tmp_path) == []


_PREPARE = ("import argparse, resource, signal, sys\n"
            "from mxtrain.data import prepare\n"
            "from mxtrain.cli.core import machine_limit_message\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, resource.RLIM_INFINITY))\n"
            "try:\n"
            "    prepare([sys.argv[1]], sys.argv[2], vocab_size=512, progress=False)\n"
            "except OSError as e:\n"
            "    print(machine_limit_message(e, argparse.Namespace(out='RUN-FOLDER')))\n")


def test_a_full_data_folder_is_named_not_the_run_folder(tmp_path, text_file):
    """``mxtrain train`` prepares the built-in corpus into the cache folder on first use: when that disk is the
    full one, the line names the data folder (before: the run's --out, on another disk, maybe not even made)."""
    out = tmp_path / "cache" / "builtin"
    p = subprocess.run([sys.executable, "-c", _PREPARE, str(text_file), str(out)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"cannot write into {out}: file too large" in p.stdout and "RUN-FOLDER" not in p.stdout, p.stdout
    assert _leftovers(tmp_path) == [] and not out.exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A reference run of 4 steps (checkpoints at 2 and 4) and, as "half", the same run as it was at step 2 (its
    checkpoint kept at step 2 put back as its latest)."""
    import shutil
    d = tmp_path_factory.mktemp("runs")
    p = _mx("train", *TINY, "--batch-size", "2", "--seq-len", "32", "--steps", 4, "--set", "train.checkpoint_every=2",
            "--set", "train.keep_checkpoints_at=2", "--out", d / "ref")
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.copytree(d / "ref", d / "half")
    os.replace(d / "half" / "checkpoint-2.pt", d / "half" / "checkpoint.pt")
    return d


def _model_equal(a: Path, b: Path) -> bool:
    import torch

    from mxtrain.train import checkpoint as ckpt
    x, y = ckpt.load(a), ckpt.load(b)
    return x["step"] == y["step"] and x["model"].keys() == y["model"].keys() and all(
        torch.equal(x["model"][k], y["model"][k]) for k in x["model"])


def test_checkpoint_past_the_file_size_limit_keeps_the_last_one(tmp_path, runs):
    """Resuming a run under a file size limit smaller than its checkpoint: the step-4 checkpoint cannot be written
    (a real EFBIG inside torch.save). One line, no temporary file, the step-2 checkpoint whole; resumed again
    without the limit, the run ends bit for bit where the uninterrupted run ended."""
    import shutil

    from mxtrain.train import checkpoint as ckpt
    run = tmp_path / "run"
    shutil.copytree(runs / "half", run)
    before = (run / ckpt.NAME).read_bytes()
    p = _mx("train", "--resume", run, "--steps", 4, "--no-progress", fsize=1 << 20)
    _one_error(p, f"cannot write checkpoint {run / ckpt.NAME}", "File too large", "the previous one is intact")
    assert (run / ckpt.NAME).read_bytes() == before and _leftovers(run) == []
    assert ckpt.load(run)["step"] == 2
    p = _mx("train", "--resume", run, "--steps", 4, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _model_equal(run / ckpt.NAME, runs / "ref" / ckpt.NAME)


@pytest.mark.parametrize("what", ["run", "study"])
def test_report_into_a_new_folder_past_the_limit_leaves_no_half_report(tmp_path, runs, what):
    """A report into a new --out that cannot be written whole: the folder it made is removed (before: figures
    and a summary.json without report.html stayed, and a summary.json there made the same --out refused once
    space was back). With the limit gone the same command writes the report."""
    import shutil
    src = runs / "ref"
    if what == "study":   # a study of one arm and one run, made from the reference run
        src = tmp_path / "study"
        shutil.copytree(runs / "ref", src / "runs" / "bf16" / "seed0")
    out = tmp_path / "rep"
    p = _mx("report", src, "--out", out, fsize=2_000)
    _one_error(p, "cannot write")
    assert not out.exists() and _leftovers(tmp_path) == []
    p = _mx("report", src, "--out", out)
    assert p.returncode == 0 and (out / "report.html").is_file(), p.stderr[-3000:]


def test_folder_lock_on_a_full_disk_holds_and_leaves_nothing(tmp_path):
    """A lock taken where not even its pid can be written (a real EFBIG: a file size limit of 0) still locks,
    and a lock of its own (``remove``) is removed on close. Before, the constructor raised and left the file,
    which ``data prepare`` and ``export`` then left beside their output (``.NAME.lock``)."""
    with _SoftFileLimit(0):
        lock = _io.FolderLock(tmp_path, lambda who: f"busy {who}", name=".out.lock", remove=True)
    try:
        assert (tmp_path / ".out.lock").is_file()
        with pytest.raises(UserError, match="busy"):   # it is held: a second one is refused
            _io.FolderLock(tmp_path, lambda who: f"busy {who}", name=".out.lock", remove=True)
    finally:
        lock.close()
    assert list(tmp_path.iterdir()) == []


def test_outcome_not_recorded_for_a_full_disk_adds_no_line(tmp_path, capsys):
    """A run failing on a full disk cannot record its outcome either: no warning line beside the run's own error
    (before: a second line on stderr). With nothing failing before it, the same write is an error naming run.json."""
    from mxtrain.train.callbacks import Outcome, Status
    from mxtrain.train.run_folder import _record_outcome
    (tmp_path / "run.json").write_text(json.dumps({"pad": "x" * 100}))
    outcome = Outcome(Status.FAILED, step=2, reason="disk full")
    with _SoftFileLimit(50):
        _record_outcome(tmp_path, outcome, quiet=True)
        with pytest.raises(UserError, match=r"cannot record the outcome in .*run.json: File too large; the previous"):
            _record_outcome(tmp_path, outcome, quiet=False)
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "run.json").read_text()) == {"pad": "x" * 100}
    assert _leftovers(tmp_path) == []


def test_a_resumed_leg_that_cannot_record_its_outcome_shows_none_not_the_last_legs(tmp_path):
    """A resumed run that fails on a full disk: run.json must not keep the previous leg's outcome as the run's
    (``read_outcome`` would call an interrupted or failed run by the earlier leg's status and step). The leg's
    start moves the earlier record under ``legs``, so an outcome that cannot be written reads as none (a run
    still training or killed) and the earlier leg's stays in its own record."""
    from mxtrain.train.callbacks import Outcome, Status, read_outcome
    from mxtrain.train.run_folder import _record_outcome, write_run_json
    (tmp_path / "run.json").write_text(json.dumps({"started": "leg 1", "outcome": Outcome(
        Status.INTERRUPTED, step=4, reason="signal").to_dict()}))
    assert read_outcome(tmp_path).status is Status.INTERRUPTED
    write_run_json(tmp_path, {"started": "leg 2", "pad": "x" * 200}, resumed=True)
    assert read_outcome(tmp_path) is None
    with _SoftFileLimit(100):   # smaller than run.json: the outcome's write fails with EFBIG
        _record_outcome(tmp_path, Outcome(Status.FAILED, step=6, reason="disk full"), quiet=True)
    assert read_outcome(tmp_path) is None
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["legs"][0]["outcome"]["status"] == "interrupted" and info["started"] == "leg 2"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("fails", [False, True])
def test_a_background_writer_stopped_by_a_full_disk_prints_no_traceback(tmp_path, monkeypatch, capsys, fails):
    """A thread of the command hits a real EFBIG (as TensorBoard's event writer thread does on a full disk): no
    thread traceback. The command's own error (its next write) is its one line; a command that still succeeds
    warns once."""
    from mxtrain import settings
    from mxtrain.cli import core
    current = settings.current

    def first_step():   # the command's first step runs the thread, then meets the full disk itself (or not)
        def write():
            with open(tmp_path / "events", "wb") as f:
                f.write(b"x" * 100)
                f.flush()
        with _SoftFileLimit(10):
            t = threading.Thread(target=write)
            t.start()
            t.join()
        if fails:
            raise OSError(errno.ENOSPC, "No space left on device")
        return current()

    monkeypatch.setattr(core.settings, "current", first_step)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)   # (pytest's own turns it into a warning)
    hook = threading.excepthook
    rc = core.main(["--version"])
    assert threading.excepthook is hook   # put back
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err and err.count("\n") == 1, err
    if fails:
        assert rc == 1 and err.startswith("mxtrain: error: ") and "no space left" in err, err
    else:
        assert rc == 0 and err.startswith("mxtrain: warning: ") and "file too large" in err, err


# ---------------------------------------------------------------------------------------------------------------
# host memory (RLIMIT_AS)

_MEM = 3 << 30   # 3 GiB of address space: torch imports and a tiny model trains; 4096 x 512 tokens do not fit


def test_train_out_of_host_memory_is_one_line(tmp_path):
    """The issue's example: a batch that cannot fit in host memory. One line that says memory ran out and what
    to lower, without the allocator's internals (before: torch's message, cut mid-word)."""
    p = _mx("train", *TINY, "--batch-size", "4096", "--seq-len", "512", "--steps", "2", "--out", tmp_path / "r",
            mem=_MEM)
    line = _one_error(p, "out of host (CPU) memory", "--batch-size", "--seq-len")
    assert "alloc_cpu" not in line and "enforce fail" not in line
    assert p.returncode == 1 and _leftovers(tmp_path) == []


def test_eval_out_of_host_memory_keeps_the_run(tmp_path, runs, text_file):
    """``eval --batch-size`` too large for host memory: one line; the run's checkpoint is untouched."""
    from mxtrain.train import checkpoint as ckpt
    before = (runs / "ref" / ckpt.NAME).read_bytes()
    big = tmp_path / "big.txt"
    big.write_text(text_file.read_text(encoding="utf-8") * 8, encoding="utf-8")
    p = _mx("eval", runs / "ref", "--data", big, "--batch-size", "4096", "--no-progress", mem=_MEM)
    line = _one_error(p, "out of host (CPU) memory", "use a smaller --batch-size")
    assert "--seq-len" not in line   # (a training flag: eval takes the run's)
    assert (runs / "ref" / ckpt.NAME).read_bytes() == before


_LOAD = ("import resource, sys, torch\n"
         "from mxtrain.train import checkpoint as ckpt\n"
         "from mxtrain.cli.core import machine_limit_message\n"
         "p = sys.argv[1]\n"
         "torch.save({'format': ckpt.FORMAT, 'model': {'w': torch.zeros(10_000_000)}, 'optimizer': {}, 'step': 2,\n"
         "            'loader': {}, 'config': {}, 'rng': {}}, p)\n"
         "vm = next(int(ln.split()[1]) * 1024 for ln in open('/proc/self/status') if ln.startswith('VmSize'))\n"
         "resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))\n"
         "try:\n"
         "    ckpt.load(p)\n"
         "    print('loaded')\n"
         "except BaseException as e:\n"
         "    print(type(e).__name__, machine_limit_message(e) or str(e)[:300])\n")


def test_a_good_checkpoint_read_out_of_memory_is_not_called_corrupt(tmp_path):
    """Host memory running out while a 40 MB checkpoint is read (16 MiB of address space left) is the memory's
    fault: before, the file was called "corrupt or truncated; restore it or start a new run", which could have a
    good checkpoint deleted. Now the error reaches the CLI, which says memory ran out."""
    p = subprocess.run([sys.executable, "-c", _LOAD, str(tmp_path / "big.pt")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "out of host (CPU) memory" in p.stdout and "corrupt" not in p.stdout, p.stdout


# ---------------------------------------------------------------------------------------------------------------
# a real full disk: a tmpfs, root only (the tests above cover the same paths without it)


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_real_full_disk_at_the_second_checkpoint(tmpfs, runs):
    """8 MiB holds one 6.6 MiB checkpoint, not the second one written beside it: ENOSPC from the file system
    itself. One line, the step-2 checkpoint whole, nothing left; with space freed the resume is bit-exact."""
    from mxtrain.train import checkpoint as ckpt
    run = tmpfs / "run"
    p = _mx("train", *TINY, "--batch-size", "2", "--seq-len", "32", "--steps", 4, "--set",
            "train.checkpoint_every=2", "--out", run)
    _one_error(p, f"cannot write checkpoint {run / ckpt.NAME}", "No space left on device", "previous one is intact")
    assert ckpt.load(run)["step"] == 2 and _leftovers(tmpfs) == []
    subprocess.run(["mount", "-o", "remount,size=32m", str(tmpfs)], check=True)
    p = _mx("train", "--resume", run, "--steps", 4, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert _model_equal(run / ckpt.NAME, runs / "ref" / ckpt.NAME)


def test_a_failed_log_write_says_whether_a_checkpoint_exists(tmp_path):
    """A write of eval_windows.jsonl (or metrics.jsonl) that fails names the checkpoint a user can resume from,
    or says that none was written yet, instead of always calling "the last checkpoint" intact."""
    import torch
    from mxtrain.train.checkpoint import FORMAT, NAME
    from mxtrain.train.evaluation import append_windows
    (tmp_path / "eval_windows.jsonl").mkdir()   # opening it for appending fails (an OSError, as a full disk)
    with pytest.raises(UserError, match=r"; no checkpoint was written yet$"):
        append_windows(tmp_path / "eval_windows.jsonl", 4, 256, [1.0])
    torch.save({"format": FORMAT, "step": 7}, tmp_path / NAME)
    with pytest.raises(UserError, match=r"; the last checkpoint \(step 7\) is intact$"):
        append_windows(tmp_path / "eval_windows.jsonl", 4, 256, [1.0])


def test_export_past_the_file_size_limit_names_the_export_not_its_temporary_folder(tmp_path, runs):
    """An export whose model.safetensors cannot be written (a real EFBIG): one line naming the file as the export
    would hold it (before: the temporary folder's file, already removed), saying nothing was written; no
    temporary folder left. Over an earlier export (``--force``), that one stays and the line says so."""
    out = tmp_path / "hf"
    p = _mx("export", runs / "ref", "--out", out, fsize=20_000)
    line = _one_error(p, f"cannot write {out / 'model.safetensors'}", "nothing was written")
    assert ".tmp-" not in line and not out.exists() and _leftovers(tmp_path) == []
    p = _mx("export", runs / "ref", "--out", out)
    assert p.returncode == 0, p.stderr[-3000:]
    before = (out / "model.safetensors").read_bytes()
    p = _mx("export", runs / "ref", "--out", out, "--force", fsize=20_000)
    _one_error(p, f"cannot write {out / 'model.safetensors'}", "the earlier export there is intact")
    assert (out / "model.safetensors").read_bytes() == before and _leftovers(tmp_path) == []


def test_a_study_worker_keeps_a_stopped_writer_threads_traceback_out_of_its_log():
    """The hook a study worker installs (``errors.thread_limit_hook``, the CLI's): a background thread stopped by a
    full disk goes to no traceback (the run's next write fails and says why); any other thread error still reaches
    the previous hook (a bug's traceback)."""
    import threading

    from mxtrain.errors import thread_limit_hook
    outer, passed, seen = threading.excepthook, [], []
    threading.excepthook = lambda a: passed.append(a.exc_type)   # the hook before: records what reaches it
    try:
        hook, previous = thread_limit_hook(seen)
        threading.excepthook = hook

        def full():
            raise OSError(errno.ENOSPC, "No space left on device")

        def bug():
            raise ValueError("a bug")
        for fn in (full, bug):
            t = threading.Thread(target=fn)
            t.start()
            t.join()
    finally:
        threading.excepthook = outer
    assert len(seen) == 1 and "no space left on the device" in seen[0]
    assert passed == [ValueError]
    src = (ROOT / "mxtrain" / "study" / "worker.py").read_text()
    assert "threading.excepthook, _ = thread_limit_hook(" in src   # (the worker installs it before any run)
