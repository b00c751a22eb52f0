"""mxtrain._io: files written whole, folders swapped into place, the folder lock and its probe."""

import errno
import os
import subprocess
import sys

import pytest

from mxtrain import _io
from mxtrain.errors import UserError


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _no_temporaries(folder):
    return not [p.name for p in folder.iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------------------------------------- atomic writes

def test_write_atomic_writes_the_whole_file(tmp_path):
    p = tmp_path / "a.json"
    _io.write_json(p, {"x": 1, "y": [1, 2]}, end="\n", indent=2)
    assert p.read_text() == '{\n  "x": 1,\n  "y": [\n    1,\n    2\n  ]\n}\n'
    _io.write_text(p, "é\n")
    assert p.read_bytes() == "é\n".encode()
    _io.write_bytes(p, b"\x00\xff")
    assert p.read_bytes() == b"\x00\xff" and _no_temporaries(tmp_path)


def test_a_writer_that_fails_midway_leaves_the_old_file(tmp_path):
    p = tmp_path / "f.txt"
    p.write_text("old")

    def half(f):
        f.write(b"new, half of it")
        raise ValueError("the serializer broke")

    with pytest.raises(ValueError, match="the serializer broke"):   # not an OSError: raised as it came
        _io.write_atomic(p, half)
    assert p.read_text() == "old" and _no_temporaries(tmp_path)


def test_a_failed_rename_is_one_user_error_and_the_old_file_stays(tmp_path, monkeypatch):
    p = tmp_path / "config.json"
    p.write_text("old")

    def full(a, b):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(UserError) as e:
        _io.write_json(p, {"x": 1})
    assert str(e.value) == f"cannot write {p}: No space left on device; the previous one is intact"
    with pytest.raises(OSError, match="No space left"):   # user_error=False: the caller words it
        _io.write_json(p, {"x": 1}, user_error=False)
    monkeypatch.undo()
    assert p.read_text() == "old" and _no_temporaries(tmp_path)


def test_an_oserror_a_writer_reports_as_its_own_error_is_named(tmp_path):
    """torch.save turns the OSError of a full disk into a RuntimeError that does not name it."""
    p = tmp_path / "checkpoint.pt"

    class Full:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    def writer(f):
        f.f = Full()   # the file under write_atomic's wrapper fails its writes
        try:
            f.write(b"x")
        except OSError:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from None

    with pytest.raises(UserError, match=r"^cannot write checkpoint .*checkpoint.pt: No space left on device$"):
        _io.write_atomic(p, writer, "checkpoint ")
    assert not p.exists() and _no_temporaries(tmp_path)


def test_json_that_cannot_be_written_is_refused_before_any_file(tmp_path):
    p = tmp_path / "summary.json"
    with pytest.raises(ValueError):
        _io.write_json(p, {"loss": float("nan")}, allow_nan=False)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- folder swaps

def _folder(path, text):
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_swap_in_replaces_a_folder_and_deletes_the_old_one(tmp_path):
    dst, aside = _folder(tmp_path / "d", "old"), tmp_path / "d.old"
    _io.swap_in(_folder(tmp_path / "new", "new"), dst, aside)
    assert (dst / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_swap_in_puts_the_old_folder_back_when_the_new_one_cannot_move_in(tmp_path, monkeypatch):
    dst, aside, new = _folder(tmp_path / "d", "old"), tmp_path / "d.old", _folder(tmp_path / "new", "new")
    real = os.rename

    def failing(a, b):
        if str(a) == str(new):
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(KeyboardInterrupt):
        _io.swap_in(new, dst, aside)
    monkeypatch.undo()
    assert (dst / "f").read_text() == "old" and not aside.exists() and new.exists()


def test_swap_in_after_a_crash_between_the_renames(tmp_path):
    """The previous folder was left aside and none at ``dst``: it stays until the new one is in place."""
    dst, aside = tmp_path / "d", _folder(tmp_path / "d.old", "old")
    _io.swap_in(_folder(tmp_path / "new", "new"), dst, aside)
    assert (dst / "f").read_text() == "new" and not aside.exists()


def test_replace_folder(tmp_path):
    dst = _folder(tmp_path / "d", "old")
    _io.replace_folder(_folder(tmp_path / "new", "new"), dst)
    assert (dst / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    _io.replace_folder(_folder(tmp_path / "new", "newer"), tmp_path / "e")   # nothing there before
    assert (tmp_path / "e" / "f").read_text() == "newer"


# ---------------------------------------------------------------------------------------------- the folder lock

def _busy(who):
    return f"held ({who or 'nobody said'})"


def test_a_lock_held_through_another_file_is_refused_with_the_message(tmp_path):
    lock = _io.FolderLock(tmp_path, _busy)
    try:
        assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
        assert _io.lock_holder(tmp_path / ".lock") == str(os.getpid())
        with pytest.raises(UserError, match=rf"^held \({os.getpid()}\)$"):
            _io.FolderLock(tmp_path, _busy)
    finally:
        lock.close()
    assert _io.lock_holder(tmp_path / ".lock") is None
    _io.FolderLock(tmp_path, _busy).close()   # free again


def test_a_lock_held_by_another_process_is_refused(tmp_path):
    code = ("import fcntl, os, sys\nf = open(sys.argv[1], 'a+')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "f.write(f'{os.getpid()}\\n'); f.flush(); print('locked', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "x.lock")], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        assert _io.lock_holder(tmp_path / "x.lock") == str(p.pid)
        with pytest.raises(UserError, match=rf"^held \({p.pid}\)$"):
            _io.FolderLock(tmp_path, _busy, name="x.lock")
    finally:
        p.stdin.close()
        p.wait()
    assert _io.lock_holder(tmp_path / "x.lock") is None   # the system dropped it when the process ended
    _io.FolderLock(tmp_path, _busy, name="x.lock").close()


def test_a_lock_file_left_by_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / ".lock").write_text(f"{_dead_pid()}\n")   # the file stays, its flock went with the process
    assert _io.lock_holder(tmp_path / ".lock") is None
    lock = _io.FolderLock(tmp_path, _busy)
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    lock.close()


def test_no_lock_file_no_holder_and_an_unopenable_lock_is_the_callers_oserror(tmp_path):
    assert _io.lock_holder(tmp_path / ".lock") is None
    assert _io.lock_holder(tmp_path / "missing" / ".lock") is None
    with pytest.raises(OSError):
        _io.FolderLock(tmp_path / "missing", _busy)


def test_the_study_lock_names_an_owner_that_has_exited(tmp_path):
    """Workers inherit the study's locked file: it can stay held after the pid written in it exited."""
    from mxtrain.study.workers import _study_lock
    from mxtrain.train.run_folder import _run_lock
    lock = _study_lock(tmp_path)
    try:
        with pytest.raises(UserError, match=rf"in use by another mxtrain study \(pid {os.getpid()}\)"):
            _study_lock(tmp_path)
        dead = _dead_pid()
        (tmp_path / ".lock").write_text(f"{dead}\n")
        with pytest.raises(UserError, match=rf"\(the worker processes of pid {dead}, which has exited; they stop"):
            _study_lock(tmp_path)
        with pytest.raises(UserError, match=rf"^output folder {tmp_path} is in use by another mxtrain run "
                                            rf"\(pid {dead}\); wait for it to finish or choose another --out$"):
            _run_lock(tmp_path)
    finally:
        lock.close()
    with pytest.raises(UserError, match=r"^cannot write to study folder .*missing: No such file or directory$"):
        _study_lock(tmp_path / "missing")


def test_a_lock_of_its_own_is_deleted_on_close_and_taken_again_when_its_file_was_replaced(tmp_path, monkeypatch):
    """``remove=True`` (an export's ``.DIR.lock`` beside a folder not made yet): the file goes with the lock; a
    lock taken on a file its previous owner deleted after it was opened here is taken again on the file now at
    the path (else two owners: this one on the deleted file, another on the new one)."""
    with _io.FolderLock(tmp_path, _busy, name=".x.lock", remove=True):
        assert _io.lock_holder(tmp_path / ".x.lock") == str(os.getpid())
        with pytest.raises(UserError, match=rf"^held \({os.getpid()}\)$"):
            _io.FolderLock(tmp_path, _busy, name=".x.lock", remove=True)
    assert list(tmp_path.iterdir()) == []
    real, calls = _io._same_file, []

    def replaced_once(f, path):
        if not calls:   # its owner deleted it meanwhile, and another made it again
            path.unlink()
            path.write_text("")
        calls.append(path)
        return real(f, path)

    monkeypatch.setattr(_io, "_same_file", replaced_once)
    lock = _io.FolderLock(tmp_path, _busy, name=".x.lock", remove=True)
    assert len(calls) == 2 and _io.lock_holder(tmp_path / ".x.lock") == str(os.getpid())
    lock.close()
    assert list(tmp_path.iterdir()) == []


def test_the_package_writes_its_records_whole():
    """Every file mxtrain writes in place goes through ``write_atomic`` (a kill mid-write leaves the previous
    file whole): a direct ``Path.write_text`` / ``write_bytes`` / ``open(..., "w")`` only where listed here,
    with why (by file and innermost function)."""
    import ast
    from pathlib import Path
    allowed = {   # (file, function): why a direct write is whole enough there
        ("train/run_folder.py", "_make_out"): "an empty probe file",
        ("cli/study.py", "report_main"): "an empty probe file",
        ("study/workers.py", "_run_study_locked"): "an empty probe file",
        ("train/trainer.py", "__init__"): "an empty metrics file, before the first step",
        ("study/workers.py", "_run_workers"): "a worker's log, streamed",
        ("data/prepare.py", "_open"): "shards, streamed into a temporary folder renamed whole",
        ("data/prepare.py", "_prepare"): "meta.json, in a temporary folder renamed whole",
        ("data/tokenizer.py", "save"): "a copy into a temporary folder (prepare, export) renamed whole",
        ("data/corpus.py", "_assemble_domain"): "temporary files, renamed whole",
        ("interop/export.py", "_write_json"): "an export's files, in a temporary folder renamed whole",
    }

    class Writes(ast.NodeVisitor):
        def __init__(self, rel):
            self.rel, self.fn = rel, None

        def visit_FunctionDef(self, node):
            outer, self.fn = self.fn, node.name
            self.generic_visit(node)
            self.fn = outer
        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Call(self, c):
            direct = isinstance(c.func, ast.Attribute) and c.func.attr in ("write_text", "write_bytes")
            mode = c.args[1] if len(c.args) > 1 else next((k.value for k in c.keywords if k.arg == "mode"), None)
            opened = (isinstance(c.func, ast.Name) and c.func.id == "open" and isinstance(mode, ast.Constant)
                      and isinstance(mode.value, str) and "w" in mode.value)
            if direct or opened:
                found.add((self.rel, self.fn))
            self.generic_visit(c)

    root = Path(__file__).resolve().parents[1] / "mxtrain"
    found = set()
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        if rel != "_io.py":
            Writes(rel).visit(ast.parse(f.read_text()))
    assert found <= set(allowed), sorted(found - set(allowed))


def test_pid_alive():
    assert _io.pid_alive(os.getpid())
    assert not _io.pid_alive(_dead_pid())
