"""Data: prepare tokenized shards from text or a Hugging Face dataset, and load them deterministically
(see docs/data.md)."""

from .hf import as_hf_dataset as as_hf_dataset
from .loader import Loader as Loader, TokenData as TokenData, val_batches as val_batches
from .prepare import (default_builtin_dir as default_builtin_dir, ensure_builtin as ensure_builtin,
                      prepare as prepare, prepare_dataset as prepare_dataset)
from .sources import BUILTIN as BUILTIN, documents as documents
from .tokenizer import Tokenizer as Tokenizer, load_tokenizer as load_tokenizer, train_bpe as train_bpe
