"""Tokenizers: train a byte-level BPE with HF ``tokenizers``, or load a local file.

``load_tokenizer(path)`` accepts a HF ``tokenizer.json``, a SentencePiece ``.model`` (needs the
``sentencepiece`` package) or a tiktoken rank file (``.tiktoken``, or Llama 3's ``tokenizer.model``
which is the same format), which is converted to an exact HF byte-level BPE without the ``tiktoken``
package. Nothing is downloaded.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterable

from ..errors import UserError

EOT = "<|endoftext|>"
MIN_VOCAB, MAX_VOCAB = 512, 1 << 20  # a trained BPE's vocab: multiple of 32 (MX blocks), at least 512, at most 2**20
# GPT-2's pre-tokenizer regex, and the one of cl100k / Llama 3 (used for other tiktoken files)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _need_tokenizers():
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UserError("tokenizers is not installed: pip install -e \".[data]\"") from None


class Tokenizer:
    """A thin wrapper: ``encode_batch(list[str]) -> list[list[int]]``, ``vocab_size``, ``eot_id``.

    ``vocab_size`` is one more than the largest id the tokenizer can produce (a tokenizer.json may number its
    tokens with gaps, so this can exceed its count of tokens); it decides the shard dtype and the model's vocab.
    """

    def __init__(self, kind: str, impl, eot_id: int, vocab_size: int, source: str):
        self.kind, self.impl, self.eot_id, self.vocab_size, self.source = kind, impl, eot_id, vocab_size, source

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "sentencepiece":
            return self.impl.encode(texts)
        return [e.ids for e in self.impl.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids)

    def save(self, folder: Path) -> str:
        """Write the tokenizer into ``folder``; returns the file name."""
        if self.kind == "sentencepiece":
            name = "tokenizer.model"
            (folder / name).write_bytes(Path(self.source).read_bytes())
        else:
            name = "tokenizer.json"
            self.impl.save(str(folder / name))
        return name


def check_vocab_size(vocab_size) -> int:
    """Refuse a BPE vocab size that is not an integer, not a multiple of 32, below 512 or above 2**20."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise UserError(f"vocab size must be an integer, got {vocab_size!r}")
    if vocab_size % 32 or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(f"vocab size must be a multiple of 32 between {MIN_VOCAB} and {MAX_VOCAB:,} (MX blocks are "
                        f"32 wide), got {vocab_size}; use e.g. --vocab-size 4096")
    return vocab_size


def hf_id_range(tok) -> int:
    """One more than the largest id of a HF tokenizer (its vocab and added tokens), at least its vocab size."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, ``<|endoftext|>`` special token id 0), vocab a multiple of 32.

    A corpus too small for ``vocab_size`` gives a smaller vocab (the returned ``vocab_size``)."""
    check_vocab_size(vocab_size)  # before the trainer allocates anything
    _need_tokenizers()
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer("hf", tok, tok.token_to_id(EOT), hf_id_range(tok), "trained")


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"tokenizer file not found: {p}")
    head = p.read_bytes()[:256]
    if p.suffix == ".json" or head.lstrip().startswith(b"{"):
        _need_tokenizers()
        from tokenizers import Tokenizer as HFTok
        try:
            tok = HFTok.from_file(str(p))
        except Exception as e:
            raise UserError(f"{p}: not a valid tokenizer.json ({e})") from None
        eot = None
        for cand in (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>"):
            eot = tok.token_to_id(cand)
            if eot is not None:
                break
        if eot is None:
            raise UserError(f"{p}: no end-of-text token ({EOT}, <|end_of_text|> or </s>) in the vocabulary")
        return Tokenizer("hf", tok, eot, hf_id_range(tok), str(p))
    if _looks_tiktoken(head):
        return _tiktoken_to_hf(p)
    if p.suffix == ".model":
        try:
            import sentencepiece as spm
        except ImportError:
            raise UserError("loading a SentencePiece .model needs the sentencepiece package: pip install sentencepiece") from None
        try:
            sp = spm.SentencePieceProcessor(model_file=str(p))
        except Exception as e:
            raise UserError(f"{p}: not a valid SentencePiece model ({e})") from None
        eot = sp.eos_id() if sp.eos_id() >= 0 else 0
        return Tokenizer("sentencepiece", sp, eot, sp.get_piece_size(), str(p))
    raise UserError(f"{p}: unknown tokenizer format; use a tokenizer.json, a SentencePiece .model or a tiktoken file")


def _looks_tiktoken(head: bytes) -> bool:
    line = head.split(b"\n", 1)[0].split()
    if len(line) != 2 or not line[1].isdigit():
        return False
    try:
        base64.b64decode(line[0], validate=True)
        return True
    except Exception:
        return False


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    parts = [bytes([b]) for b in token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            return parts
        i = best[0]
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]


def _tiktoken_to_hf(p: Path) -> Tokenizer:
    """Exact conversion of a tiktoken rank file to a HF byte-level BPE (see shared docs/data.md)."""
    _need_tokenizers()
    from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(p.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
        except Exception:
            raise UserError(f"{p}:{lineno}: not a tiktoken rank line") from None
    b2u = _bytes_to_unicode()
    enc = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {enc(t): r for t, r in ranks.items()}
    merges = []
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) == 1:
            continue
        a, b = _bpe_split(ranks, t, r)
        merges.append((enc(a), enc(b)))
    tok = HFTok(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    gpt2 = len(ranks) == 50256
    pattern = GPT2_PATTERN if gpt2 else LLAMA3_PATTERN
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    eot_name = EOT if gpt2 else "<|end_of_text|>"
    tok.add_special_tokens([AddedToken(eot_name, special=True)])
    return Tokenizer("hf", tok, tok.token_to_id(eot_name), hf_id_range(tok), str(p))
