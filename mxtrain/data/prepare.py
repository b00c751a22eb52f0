"""``prepare``: documents -> tokenized shards (raw little-endian uint16/uint32 files) + ``meta.json``.

Layout of a prepared folder::

    meta.json              format, dtype, vocab_size, eot_id, tokenizer file, shard lists, sources
    tokenizer.json         (or tokenizer.model) the tokenizer used
    train_00000.bin ...    token ids, each document followed by the end-of-text id
    val_00000.bin          the fixed validation split

The validation split is fixed by content: a document goes to validation when a hash of its text
falls below ``val_fraction``, so it does not depend on file order or on the tokenizer. The folder
is written under a temporary name and renamed at the end, so a crash never leaves a half folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..errors import UserError
from .sources import BUILTIN, documents, expand_sources
from .tokenizer import load_tokenizer, train_bpe

FORMAT = "mxtrain-tokens-v1"


def _is_val(text: str, fraction: float) -> bool:
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2**64


class _ShardWriter:
    def __init__(self, folder: Path, prefix: str, dtype, shard_tokens: int):
        self.folder, self.prefix, self.dtype, self.shard_tokens = folder, prefix, dtype, shard_tokens
        self.shards: list[dict] = []
        self.f = None
        self.n = 0

    def _open(self):
        name = f"{self.prefix}_{len(self.shards):05d}.bin"
        self.f = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def write(self, ids: np.ndarray):
        while len(ids):
            if self.f is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                if self.f:
                    self.f.close()
                self._open()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self.f.write(part.astype(self.dtype).tobytes())
            self.shards[-1]["tokens"] += len(part)
            self.n += len(part)

    def close(self):
        if self.f:
            self.f.close()
            self.f = None


def prepare(sources: list[str], out: str | Path, *, tokenizer: str | None = None, vocab_size: int = 4096,
            val_fraction: float = 0.01, shard_tokens: int = 1 << 26, text_field: str = "text",
            tokenizer_train_bytes: int = 200_000_000, force: bool = False, progress: bool = True) -> Path:
    """Tokenize ``sources`` (``"builtin"``, files or folders) into ``out``; returns the folder.

    **Arguments:** ``tokenizer``: a local tokenizer file to use; if None, train a byte-level BPE of
    ``vocab_size`` on (up to ``tokenizer_train_bytes`` of) the training documents.
    ``val_fraction``: share of documents held out for validation (by content hash).
    """
    out = Path(out)
    if not sources:
        raise UserError("no data sources given (use 'builtin' or paths to .txt/.jsonl/.json.gz/.parquet files)")
    if not 0 < val_fraction < 0.5:
        raise UserError(f"val fraction must be in (0, 0.5), got {val_fraction}")
    sources = expand_sources(sources)
    if out.exists() and any(out.iterdir()) if out.is_dir() else out.exists():
        if not force:
            raise UserError(f"output folder {out} already exists and is not empty (use --force to overwrite)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"cannot write to {out.parent}: {e.strerror or e}") from None

    try:
        t0 = time.time()
        if tokenizer:
            tok = load_tokenizer(tokenizer)
        else:
            def sample():
                n = 0
                for _, text in documents(sources, text_field):
                    if _is_val(text, val_fraction):
                        continue
                    yield text
                    n += len(text)
                    if n >= tokenizer_train_bytes:
                        return
            if progress:
                print(f"training a byte-level BPE tokenizer (vocab {vocab_size}) ...", flush=True)
            tok = train_bpe(sample(), vocab_size)
        dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
        tok_file = tok.save(tmp)
        train_w = _ShardWriter(tmp, "train", dtype, shard_tokens)
        val_w = _ShardWriter(tmp, "val", dtype, shard_tokens)
        ndocs = {"train": 0, "val": 0}
        nbytes = 0
        bar = None
        if progress:
            try:
                from tqdm import tqdm
                bar = tqdm(desc="tokenizing", unit=" docs", dynamic_ncols=True)
            except ImportError:
                bar = None
        eot = np.array([tok.eot_id], dtype=np.int64)

        def flush(batch):
            for text, ids in zip(batch, tok.encode_batch(batch)):
                arr = np.concatenate([np.asarray(ids, dtype=np.int64), eot])
                if _is_val(text, val_fraction):
                    val_w.write(arr)
                    ndocs["val"] += 1
                else:
                    train_w.write(arr)
                    ndocs["train"] += 1
            if bar is not None:
                bar.update(len(batch))
                bar.set_postfix(MB=f"{nbytes / 1e6:.1f}", tokens=f"{train_w.n + val_w.n:,}")

        batch: list[str] = []
        for _, text in documents(sources, text_field):
            batch.append(text)
            nbytes += len(text.encode("utf-8", "surrogatepass"))
            if len(batch) >= 512:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
        if bar is not None:
            bar.close()
        train_w.close()
        val_w.close()
        if train_w.n == 0:
            raise UserError(f"no text found in {', '.join(sources)}")
        if val_w.n == 0:
            _carve_val(tmp, train_w, val_w, dtype)
        meta = {
            "format": FORMAT,
            "dtype": np.dtype(dtype).name,
            "vocab_size": 32 * -(-tok.vocab_size // 32),  # padded to MX blocks of 32 (ids above are never used)
            "tokenizer_vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "tokenizer": tok_file,
            "tokenizer_source": tok.source,
            "train": train_w.shards,
            "val": val_w.shards,
            "train_tokens": train_w.n,
            "val_tokens": val_w.n,
            "documents": ndocs,
            "text_bytes": nbytes,
            "sources": [s if s == BUILTIN else os.path.abspath(s) for s in sources],
            "val_fraction": val_fraction,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} validation tokens "
              f"({ndocs['train']} + {ndocs['val']} documents, vocab {tok.vocab_size}) in {time.time() - t0:.1f} s",
              flush=True)
    return out


def _carve_val(folder: Path, train_w: _ShardWriter, val_w: _ShardWriter, dtype) -> None:
    """No document hashed into validation (a tiny corpus): move the tail of the last train shard there."""
    last = train_w.shards[-1]
    k = max(min(train_w.n // 10, 1 << 16), min(train_w.n // 2, 1024))
    k = min(k, last["tokens"] - 1)
    if k <= 0:
        raise UserError("corpus too small to hold out a validation split")
    path = folder / last["file"]
    arr = np.fromfile(path, dtype=dtype)
    arr[:-k].tofile(path)
    last["tokens"] -= k
    train_w.n -= k
    val_w.write(arr[-k:].astype(np.int64))
    val_w.close()


def default_builtin_dir(vocab_size: int) -> Path:
    """Where ``mxtrain train`` keeps the prepared built-in corpus: ``$MXTRAIN_DATA`` or ~/.cache/mxtrain/data."""
    root = Path(os.environ.get("MXTRAIN_DATA") or Path.home() / ".cache" / "mxtrain" / "data")
    return root / f"builtin-bpe{vocab_size}"


def ensure_builtin(vocab_size: int, progress: bool = True) -> Path:
    """The prepared built-in corpus with a ``vocab_size`` BPE, preparing it on first use (~30 s)."""
    d = default_builtin_dir(vocab_size)
    if (d / "meta.json").is_file():
        return d
    if progress:
        print(f"preparing the built-in corpus into {d} (first run only)", flush=True)
    return prepare([BUILTIN], d, vocab_size=vocab_size, force=True, progress=progress)
