"""Data: prepare tokenized shards from text, and load them deterministically (see docs/training.md)."""

from .loader import Loader as Loader, TokenData as TokenData, val_batches as val_batches
from .prepare import default_builtin_dir as default_builtin_dir, ensure_builtin as ensure_builtin, prepare as prepare
from .sources import BUILTIN as BUILTIN, documents as documents
from .tokenizer import Tokenizer as Tokenizer, load_tokenizer as load_tokenizer, train_bpe as train_bpe
