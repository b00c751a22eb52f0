"""A run folder is data, never code: resuming from a crafted ``checkpoint.dcp`` cannot run anything.

``torch.distributed.checkpoint`` unpickles ``.metadata`` with plain ``pickle`` and its non-tensor values
(``BytesStorageMetadata`` entries, e.g. optimizer hyper-parameters) with ``torch.load(weights_only=False)``.
mxtrain reads the first through an allow-list unpickler and the second with ``weights_only=True``; a
checkpoint that references anything else (``os.system``, ``subprocess``, ``exec``...) is refused with a
one-line ``UserError`` before anything in it runs. Each payload here would create a marker file.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import random
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mxtrain.train import parallel as D
from mxtrain.errors import UserError
from mxtrain.train import checkpoint as ckpt

TESTS = Path(__file__).resolve().parents[1]   # tests/: the shared helpers and the workers it starts
sys.path.insert(0, str(TESTS))
import _dist_worker as W  # noqa: E402
from train_helpers import one_line_error, run_cli, run_main, small_data, tiny_run_cfg  # noqa: E402

REFUSED = ("never contains", "not trusted", "nothing from it was executed")


# ------------------------------------------------------------------------------------------ helpers

class _Payload:
    """Unpickles to ``fn(*args)``: what an attacker puts in a checkpoint."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload(kind: str, marker: Path) -> _Payload:
    if kind == "os.system":
        return _Payload(os.system, (f"touch {shlex.quote(str(marker))}",))
    if kind == "subprocess":
        return _Payload(subprocess.check_call, (["touch", str(marker)],))
    if kind == "exec":
        return _Payload(builtins.exec, (f"open({str(marker)!r}, 'w').close()",))
    raise ValueError(kind)


PAYLOADS = ["os.system", "subprocess", "exec"]
PAYLOAD_NAME = {"os.system": "system", "subprocess": "subprocess", "exec": "builtins.exec"}


def _real_metadata(ck: Path):
    """The checkpoint's own ``Metadata`` (read with plain pickle: the test wrote it itself)."""
    with open(ck / ".metadata", "rb") as f:
        return pickle.load(f)


def _poison_metadata(ck: Path, kind: str, marker: Path) -> None:
    """Replace ``.metadata`` by the real metadata with a payload hidden in ``planner_data``."""
    md = _real_metadata(ck)
    md.planner_data = {"model.x": _payload(kind, marker)}
    (ck / ".metadata").write_bytes(pickle.dumps(md))


def _save_toy(path: Path, steps: int = 1):
    env = D.DistEnv()
    model, opt = W.build("none", env)
    W.train(model, opt, env, 0, steps, 1)
    D.save_checkpoint(path, model, opt, extra={"step": steps}, env=env)
    return model, opt


@pytest.fixture(scope="module")
def toy_ck(tmp_path_factory):
    ck = tmp_path_factory.mktemp("toy") / "ck"
    model, opt = _save_toy(ck)
    return ck, {k: v.clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------- real checkpoints

def test_real_checkpoint_saves_and_loads(toy_ck):
    ck, weights = toy_ck
    env = D.DistEnv()
    model, opt = W.build("none", env)
    torch.nn.init.zeros_(model.lm_head.weight)
    assert D.read_extra(ck) == {"step": 1}
    assert D.load_checkpoint(ck, model, opt, env=env) == {"step": 1}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, weights[k], atol=0, rtol=0, msg=k)
    st = opt.state_dict()
    assert st["param_groups"][0]["lr"] == 1e-2 and st["param_groups"][0]["betas"] == (0.9, 0.999)
    assert all(int(s["step"]) == 1 for s in st["state"].values())


def test_allow_list_covers_what_dcp_writes(toy_ck):
    """Every global a real save references is allowed (the list in D._dcp_allowed was collected this way;
    2-rank DDP and FSDP2 saves reference the same set: a DTensor shard is just more chunks)."""
    ck, _ = toy_ck
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(ck / ".metadata", "rb") as f:
        Recorder(f).load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    allowed = D._dcp_allowed()
    assert seen <= set(allowed), seen - set(allowed)
    md = D._read_dcp_metadata(ck)
    assert md.state_dict_metadata.keys() == _real_metadata(ck).state_dict_metadata.keys()


# ---------------------------------------------------------------------------------- crafted checkpoints

@pytest.mark.parametrize("kind", PAYLOADS)
def test_crafted_metadata_is_refused(toy_ck, tmp_path, kind):
    ck = tmp_path / "ck"
    shutil.copytree(toy_ck[0], ck)
    marker = tmp_path / "pwned"
    _poison_metadata(ck, kind, marker)
    env = D.DistEnv()
    model, opt = W.build("none", env)
    assert D.find_dcp(ck) == ck          # finding a checkpoint reads no pickle
    for load in (lambda: D.read_extra(ck),                     # what the trainer's resume calls first
                 lambda: D.load_checkpoint(ck, model, opt, env=env)):
        with pytest.raises(UserError) as ei:
            load()
        msg = str(ei.value)
        assert "\n" not in msg and PAYLOAD_NAME[kind] in msg, msg
        assert all(f in msg for f in REFUSED), msg
        assert not marker.exists()


def test_the_load_itself_is_restricted(toy_ck, tmp_path, monkeypatch):
    """With the up-front read skipped, the storage reader given to ``dcp.load`` reads ``.metadata`` through
    the allow-list itself (normally it is handed the metadata already read, and reads no file)."""
    ck = tmp_path / "ck"
    shutil.copytree(toy_ck[0], ck)
    marker = tmp_path / "pwned"
    _poison_metadata(ck, "os.system", marker)
    monkeypatch.setattr(D, "_read_dcp_metadata", lambda path: None)
    env = D.DistEnv()
    model, opt = W.build("none", env)
    with pytest.raises(UserError, match="never contains"):
        D.load_checkpoint(ck, model, opt, env=env)
    assert not marker.exists()


@pytest.mark.parametrize("kind", PAYLOADS)
def test_crafted_saved_value_is_refused(toy_ck, tmp_path, kind):
    """DCP loads non-tensor values (here the optimizer's ``lr``) with ``torch.load(weights_only=False)``;
    mxtrain's planner loads them with ``weights_only=True``."""
    ck = tmp_path / "ck"
    shutil.copytree(toy_ck[0], ck)
    marker = tmp_path / "pwned"
    import io
    buf = io.BytesIO()
    torch.save(_payload(kind, marker), buf)
    (ck / "__evil.distcp").write_bytes(buf.getvalue())
    md = _real_metadata(ck)
    (idx,) = [k for k in md.storage_data if k.fqn == "optim.param_groups.0.lr"]
    assert isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata)
    md.storage_data[idx] = _StorageInfo("__evil.distcp", 0, len(buf.getvalue()))
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    D.read_extra(ck)  # the metadata itself is fine
    env = D.DistEnv()
    model, opt = W.build("none", env)
    with pytest.raises(UserError) as ei:
        D.load_checkpoint(ck, model, opt, env=env)
    msg = str(ei.value)
    assert "optim.param_groups.0.lr" in msg and PAYLOAD_NAME[kind] in msg and all(f in msg for f in REFUSED), msg
    assert not marker.exists()


def _raw_global(module: str, name: str, arg: str = "x") -> bytes:
    """A protocol-0 pickle calling ``module.name(arg)``, written by hand (no object needed)."""
    return f"c{module}\n{name}\n(V{arg}\ntR.".encode()


@pytest.mark.parametrize("module,name", [
    ("torch", "load"), ("builtins", "getattr"), ("builtins", "eval"), ("posix", "system"), ("nt", "system"),
    ("subprocess", "Popen"), ("importlib", "import_module"), ("torch.serialization", "load"),
    ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),           # attribute walk from an allowed class
    ("torch.distributed.checkpoint.metadata", "torch"),                        # a module re-exported by one
    ("copyreg", "_reconstructor"), ("pathlib", "Path.read_text"), ("torch", "ops"),
])
def test_everything_else_is_refused(tmp_path, module, name):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".metadata").write_bytes(_raw_global(module, name))
    with pytest.raises(UserError) as ei:
        D._read_dcp_metadata(ck)
    msg = str(ei.value)
    assert f"{module}.{name}" in msg and all(f in msg for f in REFUSED), msg


@pytest.mark.parametrize("target", ["pathlib\nPosixPath", "torch.distributed.checkpoint.metadata\nMetadata"])
def test_classes_cannot_be_changed(tmp_path, target):
    """BUILD on a class (not an instance) would change it for the whole process: here every path's
    ``parent``. Only fresh instances of the data classes may get a state."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".metadata").write_bytes(f"c{target}\n(N(Vparent\nVx\ndtb.".encode())
    with pytest.raises(UserError) as ei:
        D._read_dcp_metadata(ck)
    assert "BUILD" in str(ei.value) and all(f in str(ei.value) for f in REFUSED), str(ei.value)
    assert Path("/a/b").parent == Path("/a")
    from torch.distributed.checkpoint.metadata import Metadata
    assert "parent" not in vars(Metadata)


def test_shared_objects_cannot_be_changed(tmp_path):
    """Nor on an object every checkpoint shares (an enum member)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as E
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(I0\ntR"
                                   b"(V_value_\nI7\ndb.")
    with pytest.raises(UserError, match="BUILD"):
        D._read_dcp_metadata(ck)
    assert E(0).value == 0


@pytest.mark.parametrize("case", ["not metadata", "layout lookup", "escaping path", "garbage"])
def test_malformed_metadata_is_refused(toy_ck, tmp_path, case):
    ck = tmp_path / "ck"
    shutil.copytree(toy_ck[0], ck)
    if case == "not metadata":
        data = pickle.dumps({"state_dict_metadata": {}})
    elif case == "layout lookup":  # the one allowed function only maps a layout's name to the layout
        data = _raw_global("torch.serialization", "_get_layout", "os")
    elif case == "escaping path":  # a data file outside the checkpoint folder
        md = _real_metadata(ck)
        k = next(iter(md.storage_data))
        md.storage_data[k] = _StorageInfo("../../etc/passwd", 0, 10)
        data = pickle.dumps(md)
    else:
        data = b"\x80\x04garbage"
    (ck / ".metadata").write_bytes(data)
    with pytest.raises(UserError, match="metadata"):
        D.read_extra(ck)


# ----------------------------------------------------------------------------------- the command line

def _tiny_dcp_run(run: Path) -> None:
    """A real 2-step run (checkpoint.pt), turned into the run folder of a multi-process run: the same state
    in ``checkpoint.dcp`` (as ``save_checkpoint`` writes it under torchrun), no ``checkpoint.pt``."""
    from mxtrain import convert
    from mxtrain.data import TokenData
    from mxtrain.train import checkpoint as ckpt
    from mxtrain.train import experiments, train
    from mxtrain.train import trainer as T
    cfg = experiments.get("debug")
    cfg.recipe = "bf16"
    cfg.data.path = str(small_data())
    cfg.data.seq_len = 32
    cfg.train.batch_size = 4
    cfg.train.steps = 2
    cfg.schedule.horizon_steps = 8
    cfg.log.out, cfg.log.progress, cfg.log.tensorboard = str(run), False, False
    cfg.log.eval_every, cfg.log.eval_tokens = 100, 128
    train(cfg)
    st = ckpt.load(run)
    cpu = torch.device("cpu")
    model = T.build_model(cfg, TokenData(small_data()).vocab_size, cpu)
    convert(model, cfg.resolved_recipe())
    opt = T._optimizer(model, cfg, cpu)
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    rest = {k: v for k, v in st.items() if k not in ("model", "optimizer", "format")}
    D.save_checkpoint(run / D.DCP_NAME, model, opt, extra=rest)
    (run / ckpt.NAME).unlink()


def test_cli_resume_refuses_crafted_run_folder(tmp_path):
    good = tmp_path / "good"
    _tiny_dcp_run(good)
    evil = tmp_path / "evil"
    shutil.copytree(good, evil, ignore=shutil.ignore_patterns(".lock"))
    marker = tmp_path / "pwned"
    _poison_metadata(evil / D.DCP_NAME, "os.system", marker)

    p = run_cli("train", "--resume", str(evil), "--steps", "3", "--no-progress", cwd=tmp_path)
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mxtrain: error: "), p.stderr
    assert "system" in lines[0] and all(f in lines[0] for f in REFUSED), lines[0]
    assert not marker.exists()

    # the untouched copy resumes from its DCP checkpoint in one process (the allow-list covers it)
    p = run_main("train", "--resume", str(good), "--steps", "3", "--no-progress", cwd=tmp_path)   # (this process)
    assert p.returncode == 0, p.stderr
    assert '"step": 3' in (good / "metrics.jsonl").read_text()


def _files(d: Path) -> dict:
    """Every file and folder under ``d`` with its size and modification time (what a read-only command leaves)."""
    return {str(p.relative_to(d)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


def test_the_newest_checkpoint_by_step_is_resumed_and_read_without_writing(tmp_path, capsys):
    """The instant between ``checkpoint.dcp -> checkpoint.dcp.old`` and the new folder's rename leaves only
    ``checkpoint.dcp.old``: the run resumes from it. A later one-process leg writes ``checkpoint.pt`` (step 4);
    a stale ``.old`` (step 2) beside it never wins: resume, branch and export take step 4, and export, eval
    and generate write nothing into the run folder."""
    from mxtrain.interop.export import load_run
    from train_helpers import run_main
    run = tmp_path / "run"
    _tiny_dcp_run(run)
    (run / D.DCP_NAME).rename(run / D.DCP_OLD)
    before = _files(run)
    assert D.find_dcp(run) == run / D.DCP_OLD and ckpt.latest(run) == run / D.DCP_OLD
    assert load_run(run)[1].step == 2
    assert _files(run) == before                                   # finding it renamed nothing
    stale = tmp_path / "stale"
    shutil.copytree(run / D.DCP_OLD, stale)
    assert run_main("train", "--resume", str(run), "--steps", "4", "--no-progress").returncode == 0
    assert ckpt.load(run)["step"] == 4 and not (run / D.DCP_OLD).exists()   # the writer removed the old one
    shutil.copytree(stale, run / D.DCP_OLD)                        # a stale .old at step 2 beside step 4
    assert ckpt.latest(run) == run / ckpt.NAME and ckpt.find(run) == run / ckpt.NAME
    assert ckpt.step_of(ckpt.find(run / D.DCP_NAME)) == 2          # (named explicitly, it is still found)
    before = _files(run)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40))
    for argv in (["export", str(run), "--out", str(tmp_path / "hf")],
                 ["eval", str(run), "--data", str(text), "--no-progress"],
                 ["generate", str(run), "--prompt", "The", "--max-tokens", "2"]):
        p = run_main(*argv)
        assert p.returncode == 0, (argv, p.stderr)
    assert json.loads((tmp_path / "hf" / "mxtrain_export.json").read_text())["step"] == 4
    assert _files(run) == before                                   # read-only commands wrote nothing
    # resuming from the stale one into its own folder would overwrite steps 3-4: refused
    one_line_error(run_main("train", "--resume", str(run / D.DCP_OLD), "--steps", "5", "--no-progress"),
                   "older checkpoint at step 2", "(checkpoint.pt, step 4)", "--out NEW")
    assert run_main("train", "--resume", str(run), "--steps", "5", "--no-progress").returncode == 0
    assert '"resumed_from_step": 4' in (run / "run.json").read_text()
    assert ckpt.load(run)["step"] == 5 and not (run / D.DCP_OLD).exists()


def test_full_disk_during_a_dcp_save_is_one_clear_error(tmp_path, monkeypatch):
    """A writer failing with ENOSPC inside torch's DCP save: one UserError naming the checkpoint, the
    temporary folder removed, the previous checkpoint intact."""
    import torch.distributed.checkpoint as dcp
    from mxtrain.train import parallel as D
    from mxtrain.errors import UserError
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    path = tmp_path / "checkpoint.dcp"
    D.save_checkpoint(path, model)
    real = dcp.save

    def full(*a, **k):
        try:
            raise OSError(28, "No space left on device")
        except OSError as e:
            raise RuntimeError("checkpoint write failed") from e

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(UserError, match="cannot write checkpoint .*No space left on device; the previous checkpoint"):
        D.save_checkpoint(path, torch.nn.Linear(8, 8))
    monkeypatch.setattr(dcp, "save", real)
    assert not path.with_name(path.name + ".tmp").exists()
    fresh = torch.nn.Linear(8, 8)
    D.load_checkpoint(path, fresh)
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickle header", "missing"])
def test_cli_resume_with_a_damaged_shard_is_one_line(tmp_path, damage):
    """A DCP checkpoint whose shard file was cut short, overwritten or lost: resuming says so in one line
    (no traceback logged by torch), and nothing of the run folder is changed."""
    run = tmp_path / "run"
    _tiny_dcp_run(run)
    shards = sorted((run / D.DCP_NAME).glob("*.distcp"))
    assert shards
    sh = shards[0]
    if damage == "truncate":
        sh.write_bytes(sh.read_bytes()[: sh.stat().st_size // 3])
    elif damage == "garbage":
        sh.write_bytes(random.Random(0).randbytes(sh.stat().st_size))
    elif damage == "pickle header":   # bytes that start like a pickle of protocol 33 where an item is read: torch's
        # unpickler warned about the protocol on stderr beside the error line (random garbage did so once in a
        # fresh-clone run); every item of the shard is read at its own offset, so the pair fills the file
        sh.write_bytes(b"\x80\x21" * (sh.stat().st_size // 2))
    else:
        sh.unlink()
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file()}
    p = run_cli("train", "--resume", str(run), "--steps", "3", "--no-progress", cwd=tmp_path)
    one_line_error(p, "checkpoint")
    after = {p.name: p.stat().st_mtime_ns for p in run.iterdir() if p.is_file() and p.name in before}
    assert after == before


def test_resume_of_a_run_still_training_without_a_checkpoint_names_it(tmp_path):
    """--resume on a folder whose run holds the lock but has written no checkpoint yet: the error says so and
    names the run's pid, instead of "no checkpoint"."""
    import fcntl
    from mxtrain.train import checkpoint as ck
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write("4242\n")
        f.flush()
        with pytest.raises(UserError, match=r"the run training there \(pid 4242\) has not written one"):
            ck.find(run)
    with pytest.raises(UserError, match="no checkpoint at .*expected a run folder"):
        ck.find(run)   # the lock is free: an ordinary missing checkpoint


def test_a_run_stopped_before_its_first_checkpoint_gets_advice_that_works(tmp_path):
    """A run killed before its first checkpoint leaves metrics and no checkpoint: --resume says there is nothing
    to resume, and training into the folder again says so too, instead of each sending the user to the other;
    following the advice (another --out) trains."""
    from mxtrain.train import train
    from mxtrain.train import checkpoint as ck
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    with pytest.raises(UserError, match="stopped before its first checkpoint.*nothing to resume.*another --out"):
        ck.find(run)
    cfg = tiny_run_cfg(run, 1)
    with pytest.raises(UserError, match="stopped before its first checkpoint.*nothing to resume.*another --out"):
        train(cfg)
    assert (run / "metrics.jsonl").read_text().count("\n") == 1   # the folder left as it was
    cfg.log.out = str(tmp_path / "again")
    assert ck.load(train(cfg))["step"] == 1


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol,says", [(2, r"holds objects other than tensors and plain data \(posix.system\)"
                                                r".*not trusted"),
                                           (4, r"corrupt or truncated \(UnpicklingError: Unsupported operand")])
def test_a_crafted_or_empty_checkpoint_pt_is_one_clear_refusal(tmp_path, protocol, says):
    """``checkpoint.pt`` whose pickle would run a command is never unpickled, and says so, naming what it would
    call (not 'corrupt' with a cut-off torch message; a protocol-4 pickle is refused before any object: 'corrupt'
    with torch's reason, one line); an empty file says it is corrupt or truncated (not an IndexError from the
    handler)."""
    import warnings
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil" / ckpt.NAME
    bad.parent.mkdir()
    with open(bad, "wb") as f:
        pickle.dump({"format": 1, "model": _Evil(marker)}, f, protocol=protocol)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # (torch warns on protocol-4 files: the message must be the one line)
        with pytest.raises(UserError, match=says):
            ckpt.load(bad.parent)
    assert not marker.exists()
    empty = tmp_path / "empty" / ckpt.NAME
    empty.parent.mkdir()
    empty.write_bytes(b"")
    with pytest.raises(UserError, match=r"is corrupt or truncated \(EOFError\); restore it"):
        ckpt.load(empty.parent)
