"""Which shards have had their token ids checked, so that opening a prepared folder reads every shard once,
not on every open.

The record of a folder is a small JSON file in the user's cache (``$MXTRAIN_CACHE``, the ``cache_dir``
setting, else ``$XDG_CACHE_HOME/mxtrain``, else ``~/.cache/mxtrain``; folder ``checked-shards``), never in
the data folder: a folder that was copied or shared cannot bring its own "already checked" claim. Per shard
it holds the largest id found and the shard file's identity when it was checked: device, inode, size,
modification and change times (the change time cannot be set by a user, and any write updates it). A shard
whose identity differs is read again. ``prepare`` records the shards it writes (it checked every id as it wrote them).

The cache is an optimisation: when it cannot be read or written, shards are simply checked on every open.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .._io import write_json
from .. import settings


def cache_dir() -> Path:
    root = settings.fresh().cache_dir   # MXTRAIN_CACHE, read now
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg) / "mxtrain") if xdg else str(Path.home() / ".cache" / "mxtrain")
    return Path(root) / "checked-shards"


def _record_path(folder: Path) -> Path:
    key = hashlib.blake2b(str(folder.resolve()).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return cache_dir() / f"{key}.json"


def identity(path: Path, dtype: str) -> list | None:
    """What must not change for a check to stay valid; None when the file cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [dtype, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class Record:
    """The checked shards of one folder: ``known_max(name)`` before reading a shard, ``add(name, max_id)`` after,
    ``save()`` once at the end (one small file read and written per open, whatever the number of shards)."""

    def __init__(self, folder: Path, dtype: str):
        self.folder, self.dtype = Path(folder), dtype
        self.shards = self._load()
        self.new: dict[str, int] = {}

    def _load(self) -> dict:
        try:
            rec = json.loads(_record_path(self.folder).read_text(encoding="utf-8"))
        except (OSError, RuntimeError, ValueError, UnicodeDecodeError, RecursionError):
            return {}
        if not isinstance(rec, dict) or rec.get("folder") != str(self.folder.resolve()) or not isinstance(
                rec.get("shards"), dict):
            return {}
        return rec["shards"]

    def known_max(self, name: str) -> int | None:
        """The largest id of shard ``name`` as checked before, or None when it must be read (never checked, or
        the file changed since)."""
        entry = self.shards.get(name)
        if not isinstance(entry, dict):
            return None
        ident, top = entry.get("identity"), entry.get("max_id")
        now = identity(self.folder / name, self.dtype)
        if now is None or ident != now or not isinstance(top, int) or isinstance(top, bool) or top < 0:
            return None
        return top

    def add(self, name: str, max_id: int) -> None:
        self.new[name] = int(max_id)

    def save(self) -> None:
        """Write the shards added (as they are now) into the record. Best effort: a cache that cannot be written
        is ignored."""
        if not self.new:
            return
        try:
            for name, top in self.new.items():
                ident = identity(self.folder / name, self.dtype)
                if ident is not None:
                    self.shards[name] = {"identity": ident, "max_id": top}
            path = _record_path(self.folder)
            path.parent.mkdir(parents=True, exist_ok=True)
            # atomic: ranks opening the same folder at once each write a whole file
            write_json(path, {"folder": str(self.folder.resolve()), "shards": self.shards}, user_error=False)
        except (OSError, RuntimeError):
            pass
        self.new = {}


def record(folder: Path, dtype: str, max_ids: dict[str, int]) -> None:
    """Record that the shards ``max_ids`` (name -> largest id) of ``folder`` were checked, as they are now."""
    rec = Record(folder, dtype)
    for name, top in max_ids.items():
        rec.add(name, top)
    rec.save()
