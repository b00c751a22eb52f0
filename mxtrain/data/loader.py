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
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError
from .prepare import FORMAT


class TokenData:
    """A prepared folder (``meta.json`` + shards), memory-mapped."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        meta_path = self.folder / "meta.json"
        if not meta_path.is_file():
            raise UserError(f"{self.folder} is not a prepared data folder (no meta.json); "
                            f"run: mxtrain data prepare SOURCES --out {self.folder}")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{meta_path}: unreadable ({e})") from None
        if self.meta.get("format") != FORMAT:
            raise UserError(f"{meta_path}: unknown format {self.meta.get('format')!r} (expected {FORMAT})")
        self.dtype = np.dtype(self.meta["dtype"])
        self.vocab_size = int(self.meta["vocab_size"])
        self.eot_id = int(self.meta["eot_id"])
        self.train = [self._map(s) for s in self.meta["train"]]
        self.val = [self._map(s) for s in self.meta["val"]]

    def _map(self, shard: dict) -> np.ndarray:
        p = self.folder / shard["file"]
        want = int(shard["tokens"]) * self.dtype.itemsize
        if not p.is_file() or p.stat().st_size != want:
            raise UserError(f"{p}: missing or truncated shard (expected {want} bytes); prepare the data again")
        if want == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(p, dtype=self.dtype, mode="r")

    def tokenizer_path(self) -> Path:
        return self.folder / self.meta["tokenizer"]


class _Windows:
    """Index of (shard, start) windows of length seq_len + 1."""

    def __init__(self, shards: list[np.ndarray], seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.offsets = np.cumsum([0] + counts)
        self.n = int(self.offsets[-1])

    def get(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self.offsets, i, side="right") - 1)
        start = (i - int(self.offsets[s])) * self.seq_len
        return self.shards[s][start:start + self.seq_len + 1]


class Loader:
    """Deterministic training batches. ``next() -> (x, y)`` int64 tensors of shape (micro_batch, seq_len)."""

    def __init__(self, data: TokenData, seq_len: int, micro_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.data, self.seq_len, self.micro_batch, self.seed = data, seq_len, micro_batch, seed
        self.rank, self.world_size = rank, world_size
        self.windows = _Windows(data.train, seq_len)
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
        rows = []
        for i in idx:
            epoch, j = divmod(i, self.windows.n)
            rows.append(self.windows.get(int(self._order(epoch)[j])))
        self.pos += g
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))
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


def val_batches(data: TokenData, seq_len: int, batch: int, max_tokens: int, rank: int = 0, world_size: int = 1):
    """The fixed validation set: the first ``max_tokens // seq_len`` windows of the validation split, in order;
    rank ``r`` gets windows ``r, r + world_size, ...``. Yields (x, y) batches."""
    w = _Windows(data.val, seq_len)
    n = min(w.n, max(1, max_tokens // seq_len))
    if w.n == 0:
        raise UserError(f"validation split has fewer than {seq_len + 1} tokens; use a smaller --seq-len")
    mine = list(range(rank, n, world_size))
    for i in range(0, len(mine), batch):
        buf = torch.from_numpy(np.stack([w.get(j) for j in mine[i:i + batch]]).astype(np.int64))
        yield buf[:, :-1], buf[:, 1:]
