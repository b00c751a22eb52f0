"""The prepared folder's shard format, shared by the writer (``prepare``) and the reader (``loader``): the
``meta.json`` format name, the shard dtypes and which one holds a vocabulary's ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import UserError

FORMAT = "mxtrain-tokens-v1"
DTYPES = ("uint16", "uint32")  # the shard dtypes prepare writes
UINT16_VOCAB = 1 << 16         # uint16 holds ids below 65,536


def shard_dtype(vocab_size: int) -> type:
    """The shard dtype for ids in ``[0, vocab_size)``: uint16 up to a vocab of 65,536, else uint32 (never wrapped)."""
    if vocab_size <= UINT16_VOCAB:
        return np.uint16
    if vocab_size <= 1 << 32:
        return np.uint32
    raise UserError(f"the tokenizer's ids go up to {vocab_size - 1:,}, beyond what mxtrain stores (uint32, below "
                    f"{1 << 32:,}); use a tokenizer with a smaller vocabulary")


# meta.json keys that do not describe the data itself: when and from which paths it was prepared
_NOT_CONTENT = ("created", "sources", "val_sources", "corpus_sources")   # (where from, not what)


def fingerprint(folder) -> str | None:
    """A short hash of what a prepared folder holds: its ``meta.json`` (every shard's name and token count, the
    vocabulary, the document and byte counts; not when or from which paths it was prepared) and its tokenizer
    file's bytes, which a BPE trained on other text changes. None when ``folder`` is not a prepared folder. Two
    folders prepared from the same text with the same options give the same fingerprint; a study uses it to
    refuse resuming its runs on other data, which would no longer pair by seed."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return None
        h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k not in _NOT_CONTENT},
                                      sort_keys=True).encode())
        tok = meta.get("tokenizer")
        if isinstance(tok, str) and (folder / tok).is_file():
            h.update((folder / tok).read_bytes())
    except (OSError, ValueError):
        return None
    return h.hexdigest()[:16]
