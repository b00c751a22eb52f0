"""Tokenizers: train a byte-level BPE with HF ``tokenizers``, or load a local file.

``load_tokenizer(path)`` accepts a HF ``tokenizer.json``, a SentencePiece ``.model`` (needs the
``sentencepiece`` package) or a tiktoken rank file (``.tiktoken``, or Llama 3's ``tokenizer.model``
which is the same format), which is converted to an exact HF byte-level BPE without the ``tiktoken``
package. Nothing is downloaded.

End of text: every document is followed by the tokenizer's end-of-text id. It is found by name
(``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``<|eot_id|>``, in that order; a SentencePiece
model's eos), or named with ``eot_token`` (``--eot-token``), which must be a token of the vocabulary. A tiktoken
file holds no special tokens: GPT-2's gets ``<|endoftext|>`` = 50256, a Llama 3 file (128,000 ranks) Meta's 256
special tokens (``<|begin_of_text|>`` = 128000, ``<|end_of_text|>`` = 128001, ..., vocab 128,256), any other
one ``<|end_of_text|>`` (or ``eot_token``) right after its ranks.
"""

from __future__ import annotations

import base64
import contextlib
import re
import sys
from pathlib import Path
from typing import Iterable

from ..errors import UserError
from .messages import warn

EOT = "<|endoftext|>"
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")  # looked up in this order
LLAMA3_RANKS = 128000  # a tiktoken file of this many ranks is Llama 3's (3, 3.1, 3.2, 3.3)
MIN_VOCAB, MAX_VOCAB = 512, 1 << 20  # a trained BPE's vocab: multiple of 32 (MX blocks), at least 512, at most 2**20
# GPT-2's pre-tokenizer regex, and the one of cl100k / Llama 3 (used for other tiktoken files)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def _need_tokenizers():
    try:
        import tokenizers  # optional  # noqa: F401
    except ImportError:
        raise UserError("tokenizers is not installed: pip install -e \".[data]\"") from None


@contextlib.contextmanager
def rust_calls(source):
    """Around a call into the ``tokenizers`` library: a Rust panic there (pyo3's PanicException, which is a
    BaseException: e.g. a pre-tokenizer regex that backtracks past Oniguruma's limit) is one UserError naming
    the tokenizer file, and the panic's own report, which Rust writes to file descriptor 2, is dropped;
    anything else written there meanwhile is passed on."""
    import os
    import tempfile
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):   # no file descriptor 2 to guard
        saved = None
    cap = tempfile.TemporaryFile() if saved is not None else None
    if cap is not None:
        os.dup2(cap.fileno(), 2)
    panicked = False
    try:
        yield
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        panicked = True
        msg = " ".join(str(e).split())[:200]
        raise UserError(f"{source}: the tokenizers library cannot run this tokenizer on the text ({msg}); a "
                        f"pre-tokenizer or normalizer regex it holds fails here: use another tokenizer") from None
    finally:
        if cap is not None:
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked:
                cap.seek(0)
                text = cap.read()
                if text:
                    os.write(2, text)
            cap.close()


class Tokenizer:
    """A thin wrapper: ``encode_batch(list[str]) -> list[list[int]]``, ``vocab_size``, ``eot_id``.

    ``vocab_size`` is one more than the largest id the tokenizer can produce (a tokenizer.json may number its
    tokens with gaps, so this can exceed its count of tokens); it decides the shard dtype and the model's vocab.
    """

    def __init__(self, kind: str, impl, eot_id: int, vocab_size: int, source: str, eot_token: str | None = None):
        self.kind, self.impl, self.eot_id, self.vocab_size, self.source = kind, impl, eot_id, vocab_size, source
        self.eot_token = eot_token  # the end-of-text token's text, e.g. "<|end_of_text|>"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "sentencepiece":
            return self.impl.encode(texts)
        with rust_calls(self.source):
            return [e.ids for e in self.impl.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        if self.kind == "sentencepiece":
            return self.impl.decode(ids)
        with rust_calls(self.source):
            return self.impl.decode(ids)

    def save(self, folder: Path) -> str:
        """Write the tokenizer into ``folder``; returns the file name."""
        if self.kind == "sentencepiece":
            name = "tokenizer.model"
            (folder / name).write_bytes(Path(self.source).read_bytes())
        else:
            name = "tokenizer.json"
            try:
                self.impl.save(str(folder / name))
            except Exception as e:   # the library's own error type for an OSError: "... (os error 28)"
                m = re.search(r"\(os error (\d+)\)", str(e))
                if m is None:
                    raise
                import os
                raise OSError(int(m.group(1)), os.strerror(int(m.group(1))), str(folder / name)) from None
        return name


def check_vocab_size(vocab_size) -> int:
    """Refuse a BPE vocab size that is not an integer, not a multiple of 32, below 512 or above 2**20."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise UserError(f"vocab size must be an integer, got {vocab_size!r}")
    if vocab_size % 32 or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise UserError(f"vocab size must be a multiple of 32 between {MIN_VOCAB} and {MAX_VOCAB:,} (MX blocks are "
                        f"32 wide), got {vocab_size}; e.g. 4096 (mxtrain data prepare --vocab-size, or data.vocab_size)")
    return vocab_size


def hf_id_range(tok) -> int:
    """One more than the largest id of a HF tokenizer (its vocab and added tokens), at least its vocab size."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)


def check_eot_token(eot_token) -> str | None:
    """Refuse an ``eot_token`` that is not a non-empty string (None: find the end-of-text token by name)."""
    if eot_token is None:
        return None
    if not isinstance(eot_token, str) or not eot_token.strip():
        raise UserError(f"--eot-token must be the text of a token, such as '<|end_of_text|>' or '</s>', got "
                        f"{eot_token!r}")
    return eot_token


def train_bpe(texts: Iterable[str], vocab_size: int, eot_token: str | None = None) -> Tokenizer:
    """Byte-level BPE (GPT-2 style, end-of-text special token id 0: ``eot_token``, default ``<|endoftext|>``),
    vocab a multiple of 32.

    A corpus too small for ``vocab_size`` gives a smaller vocab (the returned ``vocab_size``)."""
    check_vocab_size(vocab_size)  # before the trainer allocates anything
    eot_name = check_eot_token(eot_token) or EOT
    _need_tokenizers()
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers  # optional
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[eot_name],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer("hf", tok, tok.token_to_id(eot_name), hf_id_range(tok), "trained", eot_name)


def _hf_specials(tok) -> list[str]:
    """The special tokens of a HF tokenizer (else its added tokens), by id."""
    try:
        added = sorted(tok.get_added_tokens_decoder().items())
    except Exception:
        added = []
    return [t.content for _, t in added if getattr(t, "special", False)] or [t.content for _, t in added]


_LIKELY_EOT = re.compile(r"end|eos|eot|</|sep", re.IGNORECASE)


def _candidates(names: list[str]) -> str:
    """``its special tokens: ...``, likely end-of-text names first, at most 8 named."""
    if not names:
        return "it has no special tokens"
    names = [n for n in names if _LIKELY_EOT.search(n)] + [n for n in names if not _LIKELY_EOT.search(n)]
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return f"its special tokens: {', '.join(names[:8])}{more}"


def _hf_eot(tok, p: Path, eot_token: str | None) -> tuple[int, str]:
    """The end-of-text (id, token) of a HF tokenizer: ``eot_token`` when given (it must be in the vocabulary),
    else the first of ``EOT_CANDIDATES`` it has."""
    if eot_token is not None:
        i = tok.token_to_id(eot_token)
        if i is None:
            raise UserError(f"{p}: --eot-token {eot_token!r} is not a token of this tokenizer; "
                            f"{_candidates(_hf_specials(tok))}")
        if eot_token not in {t.content for t in tok.get_added_tokens_decoder().values()}:
            warn(f"{p}: --eot-token {eot_token!r} is an ordinary token of the vocabulary, not a special one: text "
                 f"that contains it gets the same id, so documents are not reliably separated")
        return i, eot_token
    for cand in EOT_CANDIDATES:
        i = tok.token_to_id(cand)
        if i is not None:
            return i, cand
    raise UserError(f"{p}: no end-of-text token ({', '.join(EOT_CANDIDATES)}) in the vocabulary; name the one to "
                    f"use with --eot-token TOKEN (eot_token=); {_candidates(_hf_specials(tok))}")


def load_tokenizer(path: str | Path, eot_token: str | None = None) -> Tokenizer:
    """A local tokenizer file (see the module docstring); ``eot_token`` names its end-of-text token."""
    eot_token = check_eot_token(eot_token)
    p = Path(path)
    if not p.is_file():
        raise UserError(f"tokenizer file not found: {p}")
    head = p.read_bytes()[:256]
    if p.suffix == ".json" or head.lstrip().startswith(b"{"):
        _need_tokenizers()
        from tokenizers import Tokenizer as HFTok  # optional
        try:
            with rust_calls(p):
                tok = HFTok.from_file(str(p))
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{p}: not a valid tokenizer.json ({e})") from None
        eot, name = _hf_eot(tok, p, eot_token)
        return Tokenizer("hf", tok, eot, hf_id_range(tok), str(p), name)
    if _looks_tiktoken(head):
        return _tiktoken_to_hf(p, eot_token)
    if p.suffix == ".model":
        try:
            import sentencepiece as spm  # optional
        except ImportError:
            raise UserError("loading a SentencePiece .model needs the sentencepiece package: pip install sentencepiece") from None
        try:
            sp = spm.SentencePieceProcessor(model_file=str(p))
        except Exception as e:
            raise UserError(f"{p}: not a valid SentencePiece model ({e})") from None
        eot = _sp_eot(sp, p, eot_token)
        return Tokenizer("sentencepiece", sp, eot, sp.get_piece_size(), str(p), sp.id_to_piece(eot))
    raise UserError(f"{p}: unknown tokenizer format; use a tokenizer.json, a SentencePiece .model or a tiktoken file")


def _sp_eot(sp, p: Path, eot_token: str | None) -> int:
    """The end-of-text id of a SentencePiece model: the piece ``eot_token`` when given, else its eos."""
    n = sp.get_piece_size()
    controls = [sp.id_to_piece(i) for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    if eot_token is not None:
        i = sp.piece_to_id(eot_token)
        if not 0 <= i < n or sp.id_to_piece(i) != eot_token:  # unknown pieces map to the unk id
            raise UserError(f"{p}: --eot-token {eot_token!r} is not a piece of this SentencePiece model; "
                            f"{_candidates(controls)}")
        return i
    if sp.eos_id() >= 0:
        return sp.eos_id()
    raise UserError(f"{p}: this SentencePiece model has no end-of-sentence piece (eos_id is -1); name the piece "
                    f"that ends a document with --eot-token TOKEN (eot_token=); {_candidates(controls)}")


def llama3_special_tokens() -> list[str]:
    """Meta's 256 special tokens of Llama 3.1-3.3, ids 128000-128255 (3.0 names some reserved ones differently;
    the ids of begin/end of text, header and eot agree)."""
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 5: "<|step_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>"}
    out, reserved = [], 0
    for k in range(256):
        if k in named:
            out.append(named[k])
        else:
            out.append(f"<|reserved_special_token_{reserved}|>")
            reserved += 1
    return out


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


def _tiktoken_to_hf(p: Path, eot_token: str | None = None) -> Tokenizer:
    """Exact conversion of a tiktoken rank file to a HF byte-level BPE (see shared docs/data.md)."""
    _need_tokenizers()
    from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers  # optional
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
    if gpt2:
        specials = [EOT]                       # 50256
    elif len(ranks) == LLAMA3_RANKS and max(ranks.values()) == LLAMA3_RANKS - 1:
        specials = llama3_special_tokens()     # 128000-128255: <|end_of_text|> is 128001
    else:
        specials = [eot_token or "<|end_of_text|>"]  # right after the ranks
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    if tok.token_to_id(specials[0]) != len(ranks):
        raise UserError(f"{p}: its ranks are not numbered 0..{len(ranks) - 1} (the special tokens would not get "
                        f"their ids); use a tokenizer.json instead")
    eot, name = _hf_eot(tok, p, eot_token)
    return Tokenizer("hf", tok, eot, hf_id_range(tok), str(p), name)
