"""Memory-mapped token shards and a deterministic, rank-aware, resumable batch loader.

Training samples are windows of ``seq_len + 1`` tokens at stride ``seq_len`` inside each shard.
Each epoch visits every window once in an order fixed by ``(seed, epoch)``. The loader's position
is one integer, the number of windows consumed globally, so it is saved and restored exactly.

Multi-GPU: every rank builds the same loader with its ``rank`` and ``world_size``. Each call to
``next()`` takes the next ``micro_batch * world_size`` windows of the global order and returns the
rank's contiguous slice, so the global batch is the same whatever the world size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from . import checked
from .shards import DTYPES, FORMAT, UINT16_VOCAB
from .tokenizer import load_tokenizer


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def bare_name(name) -> bool:
    """A plain file name inside the folder: no path separator, not ``.``/``..``, not absolute, no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name and not os.path.isabs(name) and Path(name).name == name)


class TokenData:
    """A prepared folder (``meta.json`` + shards), memory-mapped.

    Checked on open, so a damaged or crafted folder is one clear error instead of wrong training: meta.json is
    a JSON object with the fields and types prepare writes; shard and tokenizer names are plain file names in
    the folder, and a shard (or the tokenizer) that is a symbolic link must point inside the folder (nothing
    outside it is read); the dtype is one prepare writes (uint16 only for a vocab of at most 65,536); each shard
    has exactly the bytes its token count in meta.json says; and every id is below ``vocab_size``.

    The ids are read once per shard file, not on every open: the largest id of a checked shard is kept in the
    user's cache with the file's identity (``mxtrain.data.checked``; prepare records the shards it writes), and
    a shard is read again when it changed. The loader also checks the ids of every batch it returns, so an id
    outside the vocabulary never reaches the model, even from a shard changed after it was opened.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        if not meta_path.is_file():
            raise UserError(f"{self.folder} is not a prepared data folder (no meta.json); "
                            f"run: mxtrain data prepare SOURCES --out {self.folder}")
        try:
            text = meta_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{meta_path}: cannot read ({getattr(e, 'strerror', None) or e}); {_AGAIN}") from None
        try:
            self.meta = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise UserError(f"{meta_path}: not valid JSON ({e}); {_AGAIN}") from None
        _check_meta(self.meta, meta_path)
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_id = int(self.meta["eot_id"])
        try:
            self._real = self.folder.resolve()
        except (OSError, RuntimeError) as e:
            raise UserError(f"cannot resolve data folder {self.folder}: {e}") from None
        _inside(self._real, self.folder / self.meta["tokenizer"], "the tokenizer")
        seen: dict[tuple[int, int], str] = {}
        for split in ("train", "val"):  # cheap checks of every shard first: one bad shard fails before any read
            for sh in self.meta[split]:
                self._check_shard(sh)
                st = os.stat(self.folder / sh["file"])
                other = seen.setdefault((st.st_dev, st.st_ino), sh["file"])
                if other != sh["file"]:  # a link: the same tokens twice, or in both train and validation
                    raise UserError(f"{self.folder / sh['file']}: shard is the same file as {other} (a link); "
                                    f"{_AGAIN}")
        self.train_files = [sh["file"] for sh in self.meta["train"]]
        self.val_files = [sh["file"] for sh in self.meta["val"]]
        record = checked.Record(self.folder, self.dtype.name)
        self.train = [self._map(s, record) for s in self.meta["train"]]
        self.val = [self._map(s, record) for s in self.meta["val"]]
        record.save()

    def _check_shard(self, shard: dict) -> None:
        p = self.folder / shard["file"]
        _inside(self._real, p, "shard")
        want = int(shard["tokens"]) * self.dtype.itemsize
        try:
            size = p.stat().st_size if p.is_file() else None
        except OSError:
            size = None
        if size is None:
            raise UserError(f"{p}: shard listed in meta.json is missing (or not a file); {_AGAIN}")
        if size != want:
            what = "truncated" if size < want else "longer than meta.json says"
            raise UserError(f"{p}: shard is {what} ({size:,} bytes, expected {shard['tokens']:,} tokens = {want:,} "
                            f"bytes); {_AGAIN}")

    def _map(self, shard: dict, record: checked.Record) -> np.ndarray:
        p = self.folder / shard["file"]
        if int(shard["tokens"]) == 0:
            return np.zeros(0, dtype=self.dtype)
        arr = np.memmap(p, dtype=self.dtype, mode="r")
        if self.vocab_size < np.iinfo(self.dtype).max + 1:  # otherwise every value the dtype holds is an id
            top = record.known_max(shard["file"])
            if top is None:
                try:
                    top = _scan_ids(arr, self.vocab_size, p)
                except UserError:
                    record.save()  # the shards found good so far stay checked
                    raise
                record.add(shard["file"], top)
            if top >= self.vocab_size:
                raise UserError(f"{p}: holds token id {top:,}, not below vocab_size {self.vocab_size:,} of meta.json "
                                f"(a damaged shard or meta.json); {_AGAIN}")
        return arr

    def tokenizer_path(self) -> Path:
        return self.folder / self.meta["tokenizer"]

    def tokenizer(self):
        """The folder's tokenizer (``mxtrain.data.Tokenizer``), with the end-of-text token meta.json records
        (``--eot-token`` may have named one that the tokenizer file alone does not identify)."""
        _inside(self._real, self.tokenizer_path(), "the tokenizer")
        tok = load_tokenizer(self.tokenizer_path(), eot_token=self.meta.get("eot_token"))
        if tok.eot_id != self.eot_id:
            raise UserError(f"{self.tokenizer_path()}: its end-of-text id {tok.eot_id} is not meta.json's eot_id "
                            f"{self.eot_id} (a damaged or replaced tokenizer file); {_AGAIN}")
        return tok


SCAN_CHUNK = 1 << 24  # ids read per step when a shard is checked (bounded memory for the comparison)


def _scan_ids(arr: np.ndarray, vocab_size: int, p: Path) -> int:
    """The largest id of ``arr``, read in chunks; the first id not below ``vocab_size`` is an error that says
    where it is."""
    top = 0
    for i in range(0, len(arr), SCAN_CHUNK):
        chunk = np.asarray(arr[i:i + SCAN_CHUNK])
        m = int(chunk.max())
        if m >= vocab_size:
            j = int(np.argmax(chunk >= vocab_size))
            raise UserError(f"{p}: holds token id {int(chunk[j]):,}, not below vocab_size {vocab_size:,} of "
                            f"meta.json, at token {i + j:,} (a damaged shard or meta.json); {_AGAIN}")
        top = max(top, m)
    return top


def _inside(real_folder: Path, p: Path, what: str) -> None:
    """Refuse a symbolic link ``p`` whose target lies outside the (resolved) folder."""
    if not p.is_symlink():
        return
    try:
        target = p.resolve()
    except (OSError, RuntimeError) as e:
        raise UserError(f"{p}: {what} is a symbolic link that cannot be resolved ({e}); {_AGAIN}") from None
    if real_folder not in target.parents:
        raise UserError(f"{p}: {what} is a symbolic link to {target}, outside the data folder; a prepared folder "
                        f"must hold its own files: replace the link by a copy of the file if you trust it, or "
                        f"{_AGAIN}")


_AGAIN = "prepare the data again (mxtrain data prepare SOURCES --out NEW_FOLDER)"
_MAX_VOCAB = 1 << 32


def _check_meta(meta, meta_path: Path) -> None:
    """Refuse a meta.json that prepare would not have written (see ``TokenData``); one line per problem."""
    def bad(what: str):
        raise UserError(f"{meta_path}: {what}; {_AGAIN}")

    if not isinstance(meta, dict):
        bad(f"expected a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise UserError(f"{meta_path}: unknown format {meta.get('format')!r} (expected {FORMAT}); {_AGAIN}")
    for key in ("dtype", "vocab_size", "eot_id", "tokenizer", "train", "val", "train_tokens", "val_tokens",
                "sources"):
        if key not in meta:
            bad(f"missing field {key!r}")
    types = {"dtype": (str, "a string"), "vocab_size": (int, "an integer"), "eot_id": (int, "an integer"),
             "tokenizer": (str, "a string"), "train": (list, "a list"), "val": (list, "a list"),
             "train_tokens": (int, "an integer"), "val_tokens": (int, "an integer"), "sources": (list, "a list"),
             "tokenizer_vocab_size": (int, "an integer"), "eot_token": (str, "a string")}
    for key, (t, name) in types.items():
        if key in meta and not (_is_int(meta[key]) if t is int else isinstance(meta[key], t)):
            bad(f"field {key!r} must be {name}, found {json.dumps(meta[key])[:40]}")
    dtype, vocab = meta["dtype"], meta["vocab_size"]
    if dtype not in DTYPES:
        bad(f"unknown dtype {dtype!r} (prepare writes {' or '.join(DTYPES)})")
    if not 1 <= vocab <= _MAX_VOCAB:
        bad(f"vocab_size {vocab} is outside [1, {_MAX_VOCAB:,}]")
    if dtype == "uint16" and vocab > UINT16_VOCAB:
        bad(f"dtype uint16 cannot hold the ids of vocab_size {vocab:,} (above {UINT16_VOCAB:,} needs uint32)")
    tvs = meta.get("tokenizer_vocab_size")
    if tvs is not None and not 1 <= tvs <= vocab:
        bad(f"tokenizer_vocab_size {tvs} is outside [1, vocab_size {vocab}]")
    if not 0 <= meta["eot_id"] < vocab:
        bad(f"eot_id {meta['eot_id']} is not below vocab_size {vocab}")
    if not bare_name(meta["tokenizer"]):
        bad(f"tokenizer {meta['tokenizer']!r} is not a plain file name inside the folder")
    if not all(isinstance(s, str) for s in meta["sources"]):
        bad("field 'sources' must be a list of strings")
    seen = {meta["tokenizer"], "meta.json"}
    for split in ("train", "val"):
        total = 0
        for i, sh in enumerate(meta[split]):
            if not isinstance(sh, dict) or "file" not in sh or "tokens" not in sh:
                bad(f"{split}[{i}] must be an object with 'file' and 'tokens'")
            name, n = sh["file"], sh["tokens"]
            if not bare_name(name):
                bad(f"{split} shard name {name!r} is not a plain file name inside the folder (no path separators, "
                    f"'..' or absolute paths)")
            if not _is_int(n) or n < 0:
                bad(f"{split} shard {name}: 'tokens' must be a non-negative integer, found {json.dumps(n)[:40]}")
            if name in seen:
                bad(f"{split} shard {name} is listed twice (or is another file of the folder)")
            seen.add(name)
            total += n
        if total != meta[f"{split}_tokens"]:
            bad(f"{split}_tokens {meta[split + '_tokens']:,} is not the sum of the {split} shards' tokens ({total:,})")


class _Windows:
    """Index of (shard, start) windows of length seq_len + 1."""

    def __init__(self, shards: list[np.ndarray], seq_len: int, names: list[str] | None = None):
        self.shards, self.seq_len = shards, seq_len
        self.names = names or [f"shard {i}" for i in range(len(shards))]
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.offsets = np.cumsum([0] + counts)
        self.n = int(self.offsets[-1])

    def where(self, i: int) -> tuple[int, int]:
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return s, (i - int(self.offsets[s])) * self.seq_len

    def get(self, i: int) -> np.ndarray:
        s, start = self.where(i)
        return self.shards[s][start:start + self.seq_len + 1]


def _batch(data: "TokenData", w: _Windows, idx: list[int]) -> torch.Tensor:
    """The windows ``idx`` stacked as int64, after checking that every id is below the vocabulary (a shard
    changed on disk after it was opened is an error here, never an out-of-range embedding lookup)."""
    rows = np.stack([w.get(i) for i in idx])
    if data.vocab_size < np.iinfo(rows.dtype).max + 1 and rows.size and int(rows.max()) >= data.vocab_size:
        r = int(np.argmax(rows.max(axis=1) >= data.vocab_size))
        s, start = w.where(idx[r])
        j = int(np.argmax(rows[r] >= data.vocab_size))
        raise UserError(f"{data.folder / w.names[s]}: holds token id {int(rows[r, j]):,}, not below vocab_size "
                        f"{data.vocab_size:,}, at token {start + j:,} (the shard changed after it was opened?); "
                        f"{_AGAIN}")
    return torch.from_numpy(rows.astype(np.int64))


class Loader:
    """Deterministic training batches. ``next() -> (x, y)`` int64 tensors of shape (micro_batch, seq_len)."""

    def __init__(self, data: TokenData, seq_len: int, micro_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.data, self.seq_len, self.micro_batch, self.seed = data, seq_len, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.windows = _Windows(data.train, seq_len, getattr(data, "train_files", None))
        if self.windows.n < micro_batch * world_size:
            raise UserError(f"training split has only {self.windows.n} windows of {seq_len + 1} tokens, fewer than one "
                            f"batch ({micro_batch * world_size}); use a smaller --seq-len/--batch-size or more data")
        self.pos = 0
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows.n)
            self._epoch = epoch
        return self._perm

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.micro_batch * self.world_size
        idx = range(self.pos + self.rank * self.micro_batch, self.pos + (self.rank + 1) * self.micro_batch)
        wins = []
        for i in idx:
            epoch, j = divmod(i, self.windows.n)
            wins.append(int(self._order(epoch)[j]))
        buf = _batch(self.data, self.windows, wins)
        self.pos += g
        return buf[:, :-1], buf[:, 1:]

    @property
    def epoch(self) -> float:
        return self.pos / self.windows.n

    def state_dict(self) -> dict:
        return {"pos": self.pos, "seed": self.seed, "seq_len": self.seq_len, "num_windows": self.windows.n}

    def load_state_dict(self, st: dict) -> None:
        if st["seed"] != self.seed or st["seq_len"] != self.seq_len or st["num_windows"] != self.windows.n:
            raise UserError(f"checkpoint's data position does not match this data/config (checkpoint: seed {st['seed']}, "
                            f"seq_len {st['seq_len']}, {st['num_windows']} windows; now: seed {self.seed}, seq_len "
                            f"{self.seq_len}, {self.windows.n} windows)")
        self.pos = int(st["pos"])


def val_windows(n_windows: int, max_tokens: int, seq_len: int) -> list[int]:
    """The fixed validation windows: ``n = min(n_windows, max_tokens // seq_len)`` (at least 1) of the
    split's ``n_windows``, spread evenly over all of it (window ``floor(i * n_windows / n)`` for ``i < n``), in
    order. A prepared split holds its sources one after another (a corpus's domains, files), so its first
    windows would all come from the first source; spread, a partial validation set samples every part in
    proportion. With ``n == n_windows`` it is every window."""
    n = min(n_windows, max(1, max_tokens // seq_len))
    return [(i * n_windows) // n for i in range(n)]


def val_window_sources(data: TokenData, seq_len: int, max_tokens: int) -> list[str] | None:
    """The validation source (a fixed validation file of ``prepare --val``, e.g. a corpus domain) of each window
    ``val_batches`` evaluates, in its order: the file holding the window's first token, from meta.json's
    ``val_spans``; None for a folder without them (older folders, or a validation split drawn by hash)."""
    spans = data.meta.get("val_spans")
    if not isinstance(spans, list) or not spans:
        return None
    try:
        names = [str(sp["source"]) for sp in spans]
        ends = np.cumsum([int(sp["tokens"]) for sp in spans])
    except (KeyError, TypeError, ValueError):
        return None
    if int(ends[-1]) != int(data.meta.get("val_tokens", -1)):
        return None   # spans that do not cover the split exactly say nothing reliable
    w = _Windows(data.val, seq_len, getattr(data, "val_files", None))
    if w.n == 0:
        return None
    shard_start = np.cumsum([0] + [len(v) for v in data.val])
    out = []
    for i in val_windows(w.n, max_tokens, seq_len):
        s, start = w.where(i)
        pos = int(shard_start[s]) + start
        out.append(names[int(np.searchsorted(ends, pos, side="right"))])
    return out


def val_batches(data: TokenData, seq_len: int, batch: int, max_tokens: int, rank: int = 0, world_size: int = 1):
    """The fixed validation set: ``max_tokens // seq_len`` windows spread evenly over the validation split
    (``val_windows``), in order; rank ``r`` gets the ``r``-th, ``r + world_size``-th, ... of them. Yields
    (x, y) batches."""
    w = _Windows(data.val, seq_len, getattr(data, "val_files", None))
    if w.n == 0:
        raise UserError(f"validation split has fewer than {seq_len + 1} tokens; use a smaller --seq-len")
    mine = val_windows(w.n, max_tokens, seq_len)[rank::world_size]
    for i in range(0, len(mine), batch):
        buf = _batch(data, w, mine[i:i + batch])
        yield buf[:, :-1], buf[:, 1:]
