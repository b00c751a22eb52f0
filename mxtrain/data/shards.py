"""The prepared folder's shard format, shared by the writer (``prepare``) and the reader (``loader``): the
``meta.json`` format name, the shard dtypes and which one holds a vocabulary's ids."""

from __future__ import annotations

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
