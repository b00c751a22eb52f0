"""Files and folders written whole, and folders owned by one process: the package's one copy of each.

Layer 0: imports the standard library and ``mxtrain.errors`` only (train, study, data and the exports use it).

- ``write_atomic`` / ``write_bytes`` / ``write_text`` / ``write_json``: a file written into a temporary sibling
  (``temp_path``: ``.NAME.tmp-PID``), flushed and fsynced, then renamed over the file: a crash or a full disk
  leaves the previous file whole, and the temporary is removed whatever stopped the write.
- ``check_writable``: whether a file can be made in a folder, before the work whose result goes there.
- ``read_regular``: a regular file's content (a device or pipe refused before it is opened), with a size limit.
- ``replace_folder`` and ``swap_in``: a finished temporary folder renamed into place.
- ``FolderLock``: an exclusive ``flock`` on a folder's lock file, which holds the owner's pid; ``lock_holder``:
  who holds one (a shared, non-blocking probe). ``pid_alive``: whether a process still runs.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from .errors import UserError

# the errno of a non-blocking flock on a file another process has locked
_HELD = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)


def temp_path(path: Path) -> Path:
    """The temporary sibling a file or folder ``path`` is written as before it is renamed into place:
    ``.NAME.tmp-PID`` (hidden; the pid tells whose it is, so a dead process's can be removed)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def pid_alive(pid: int) -> bool:
    """Does process ``pid`` still run? One that exists but belongs to another user counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class _Writes:
    """The file ``write_atomic`` hands to its writer: the OSError of a write (a full disk) is kept, since a writer
    may report it as an error of its own (``torch.save`` raises a RuntimeError that does not name it)."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name):
        return getattr(self.f, name)


def write_atomic(path: Path, write: Callable, what: str = "", user_error: bool = True) -> None:
    """``write(f)`` into a temporary sibling of ``path`` (binary file), synced, then renamed over ``path``:
    a crash or a full disk leaves the previous file whole; the temporary is removed whatever stopped the write.
    An OSError (also one a writer reports as an error of its own) is one UserError, ``what`` naming the file in
    its message (e.g. "checkpoint "); with ``user_error=False`` the exception is raised as it came (for callers
    that word it themselves, or ignore it)."""
    path = Path(path)
    tmp = temp_path(path)
    w = None
    try:
        with open(tmp, "wb") as f:
            w = _Writes(f)
            write(w)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        why = e if isinstance(e, OSError) else w.error if w is not None else None
        if why is None or not user_error:
            raise
        raise UserError(f"cannot write {what}{path}: {why.strerror or why}"
                        + (" (past the file size limit, `ulimit -f`)" if why.errno == errno.EFBIG else "")
                        + ("; the previous one is intact" if path.exists() else "")) from None


def write_bytes(path: Path, data: bytes, what: str = "", user_error: bool = True) -> None:
    """``data`` into ``path`` through ``write_atomic`` (whole or not at all)."""
    write_atomic(path, lambda f: f.write(data), what, user_error)


def read_regular(path: Path, what: str = "", limit: int | None = None, encoding: str | None = "utf-8"):
    """The content of the regular file ``path`` (text in ``encoding``; bytes with ``encoding=None``), a symbolic link
    followed. A device, a pipe or a socket is a ``UserError`` before it is opened (``/dev/zero`` would be read until
    the memory is full, a pipe waited on for ever), and so is a file over ``limit`` bytes; ``what`` names the file's
    role in the message ("config file "). Other errors (a missing file, an unreadable one, bytes that are not
    ``encoding``) are raised as they come, for the caller to word."""
    import stat
    p = Path(path)
    st = os.stat(p)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(p))
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{what}{p} is not a regular file (a device, a pipe or a socket): give a file")
    if limit is not None and st.st_size > limit:
        raise UserError(f"{what}{p} is {st.st_size:,} bytes, more than such a file can be ({limit:,}); give the "
                        f"right file")
    with open(p, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:   # (it grew after the stat)
        raise UserError(f"{what}{p} is more than {limit:,} bytes, more than such a file can be; give the right file")
    return data if encoding is None else data.decode(encoding)


def check_writable(folder: Path, what: str) -> None:
    """A file can be made in ``folder`` (a read-only or full file system, a folder of another user's): asked before
    a long computation whose result goes there, not after it. Refused: a ``UserError`` naming ``what`` (e.g.
    "--json eval.json") and why. The probe is ``temp_path``'s name, removed at once."""
    probe = temp_path(Path(folder) / ".write-test")
    try:
        with open(probe, "wb"):
            pass
        probe.unlink()
    except OSError as e:
        raise UserError(f"{what}: cannot write to {folder}: {e.strerror or e}") from None


def write_text(path: Path, text: str, what: str = "", user_error: bool = True) -> None:
    """``text`` (UTF-8) into ``path`` through ``write_atomic`` (whole or not at all)."""
    write_bytes(path, text.encode(), what, user_error)


def write_json(path: Path, obj, end: str = "", user_error: bool = True, **dumps) -> None:
    """``obj`` as JSON (then ``end``, e.g. a newline) into ``path`` through ``write_atomic`` (whole or not at
    all); ``dumps``: ``json.dumps`` options. An object JSON cannot hold raises before anything is written."""
    write_text(path, json.dumps(obj, **dumps) + end, "", user_error)


def replace_folder(tmp: Path, dst: Path) -> None:
    """Put the finished folder ``tmp`` at ``dst``: ``dst`` (if any) deleted, then ``tmp`` renamed to it. For a
    folder that can be made again (a copy, a download): a crash between the two leaves no ``dst``, and ``tmp``."""
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def swap_in(tmp: Path, dst: Path, aside: Path) -> None:
    """Put the finished folder ``tmp`` at ``dst`` with a whole folder on disk at every moment: the previous
    ``dst`` (if any) is renamed to ``aside``, ``tmp`` renamed to ``dst``, then ``aside`` deleted. A crash between
    the renames leaves the previous folder at ``aside`` (the caller's readers or clean-up know the name); a
    rename that fails puts it back at ``dst`` and raises. A leftover ``aside`` of an earlier swap is deleted (once
    ``dst`` is in place, where there was no ``dst``: then it is the previous folder)."""
    dst, aside = Path(dst), Path(aside)
    if not dst.exists():
        os.rename(tmp, dst)
        if aside.exists():
            shutil.rmtree(aside)
        return
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(dst, aside)   # (each rename's target is absent: os.rename, as os.replace, on every system)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(aside, dst)
        raise
    shutil.rmtree(aside, ignore_errors=True)


class FolderLock:
    """Exclusive ownership of a folder: a non-blocking ``fcntl.flock`` on ``folder/name``, which holds the
    owner's pid. The system drops the lock when the process (and every process that inherited the locked file,
    ``fileno()`` for ``pass_fds``) ends, however it ends: a lock file left by a dead owner is simply taken
    over. Where ``fcntl`` does not exist the folder is not locked.

    Held by another process: a ``UserError`` with ``busy(who)``, ``who`` the pid written in the file ("" if
    none). Another error of ``flock``: ``refused(e)``'s message, or (``refused`` None) ``busy``'s. The file that
    cannot be opened: its OSError, for the caller to word.

    ``remove``: the lock file is the lock's own (beside a folder not made yet, e.g. ``.NAME.lock`` for an
    export's ``NAME``), deleted by ``close`` while still locked; a lock taken on a file its owner deleted in the
    meantime is taken again on the file now at the path. ``wait``: held by another process, call ``wait(who)``
    (to say so) and block until the lock is free instead of raising ``busy``'s error. A context manager:
    ``with FolderLock(...):``."""

    def __init__(self, folder: Path, busy: Callable[[str], str], name: str = ".lock",
                 refused: Callable[[OSError], str] | None = None, remove: bool = False,
                 wait: Callable[[str], None] | None = None):
        self.f, self.path, self.remove = None, Path(folder) / name, remove
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: unlocked
            return
        while True:
            f = open(self.path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                f.seek(0)
                who = f.read().strip()
                if wait is not None and e.errno in _HELD:
                    wait(who)
                    try:
                        fcntl.flock(f, fcntl.LOCK_EX)
                    except OSError:
                        f.close()
                        raise UserError(busy(who)) from None
                else:
                    f.close()
                    if refused is not None and e.errno not in _HELD:
                        raise UserError(refused(e)) from None
                    raise UserError(busy(who)) from None
            if not remove or _same_file(f, self.path):
                break
            f.close()   # its owner deleted it after it was opened here: lock the one at the path now
        # the pid is for messages only: written unbuffered, and a disk too full to hold it leaves the file empty
        # (the lock holds all the same; a buffered write would fail again when the file is closed, and a lock file
        # left behind by a constructor that raised is never removed)
        try:
            os.ftruncate(f.fileno(), 0)
            os.pwrite(f.fileno(), f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass
        self.f = f

    def fileno(self) -> int | None:
        return None if self.f is None else self.f.fileno()

    def close(self) -> None:
        if self.f is not None:
            if self.remove:
                try:
                    self.path.unlink()
                except OSError:
                    pass
            self.f.close()
            self.f = None

    def __enter__(self) -> "FolderLock":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _same_file(f, path: Path) -> bool:
    """Is the open file ``f`` the file at ``path`` (not one deleted, or deleted and made again)?"""
    try:
        a, b = os.fstat(f.fileno()), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_holder(path: Path) -> str | None:
    """What the process holding the ``FolderLock`` file ``path`` wrote in it (its pid; "" if nothing yet), or
    None when nobody holds it (or there is no such file, or no ``fcntl``). A shared non-blocking ``flock``:
    it never waits, and a probe never stops the owner from locking."""
    if not Path(path).is_file():   # (nor wait on a pipe)
        return None
    try:
        import fcntl
        with open(path, encoding="utf-8") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in _HELD:
                    return f.read().strip()
            return None
    except (ImportError, OSError, UnicodeDecodeError):
        return None
