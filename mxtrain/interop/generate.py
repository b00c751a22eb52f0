"""Sampling from a run's model, and its loss on held-out text.

``load(run_dir)`` rebuilds a run's model from its checkpoint, by default with the run's recipe (``convert``:
the forward pass through the same MX-quantized GEMMs as in training, in the training's working precision),
or in high precision (``precision="bf16"``: bf16 autocast, or ``"fp32"``), with the run's tokenizer.

``generate(model, tokenizer, prompt, ...)`` samples a continuation. There is no KV cache: every new token
runs the model over the whole context again (at most the model's ``max_seq_len`` last tokens), so
``n`` new tokens after a ``p``-token prompt cost about ``n * (p + n / 2)`` tokens of forward work. That is
nothing for the small models mxtrain trains on a CPU, and the MX layers quantize every call the same way
with or without a cache; for long generations from large models, export the run (``mxtrain export``) and
use ``transformers``.

``evaluate(run_dir, data)`` is the loss and perplexity over the windows the trainer evaluates on: windows
of ``seq_len + 1`` tokens at stride ``seq_len`` (``mxtrain.data.val_batches``), over a prepared data folder's
validation split, or over text files (each document followed by the end-of-text token, as ``prepare``
writes them), tokenized with the run's tokenizer.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError, check_number
from .export import RunCheckpoint, load_run, run_tokenizer
from ..train.trainer import _resolve_device
from .. import convert, set_step
from ..data.sources import check_sources, documents, expand_sources
from ..data.tokenizer import load_tokenizer
from ..data import TokenData, val_batches, ensure_builtin

__all__ = ["load", "Loaded", "generate", "generate_ids", "evaluate", "PRECISIONS"]

PRECISIONS = ("mx", "bf16", "fp32")


@dataclass
class Loaded:
    """A run's model ready for inference (``load``)."""
    model: torch.nn.Module
    tokenizer: object | None          # mxtrain.data.Tokenizer, or None when the run's is gone
    run: RunCheckpoint
    device: torch.device
    amp_dtype: torch.dtype | None     # the autocast dtype of the forward pass (None: float32)
    precision: str                    # mx | bf16 | fp32
    vocab_limit: int                  # ids at or above this are padding rows, never sampled


def _device(name: str) -> torch.device:
    return _resolve_device(name)


def _train_amp(cfg, dev: torch.device) -> torch.dtype | None:
    """The autocast dtype the run trained with on ``dev`` (``train.dtype``)."""
    d = getattr(cfg.train, "dtype", "auto")
    if d == "bf16" or (d == "auto" and dev.type == "cuda"):
        return torch.bfloat16
    return None


def load(run_dir: str | Path, step: int | None = None, precision: str = "mx", device: str = "auto",
         need_tokenizer: bool = True) -> Loaded:
    """A run's model for inference. ``precision``: ``mx`` (the run's recipe, as in training: MX layers in
    the run's working precision, bf16 autocast on GPU and float32 on CPU unless ``train.dtype`` said
    otherwise), ``bf16`` (no quantization, bf16 autocast) or ``fp32`` (no quantization, float32).
    ``need_tokenizer``: refuse when the run's tokenizer is gone (else ``tokenizer`` is None)."""
    if precision not in PRECISIONS:
        raise UserError(f"unknown precision {precision!r}; use {', '.join(PRECISIONS)}")
    dev = _device(device)
    model, run = load_run(run_dir, step)
    tok, why = run_tokenizer(run)
    if tok is None and need_tokenizer:
        raise UserError(f"cannot use the run's tokenizer: {why}")
    amp = None
    if precision == "mx":
        recipe = run.recipe
        if recipe.quantized:
            convert(model, recipe)
            set_step(model, run.step)   # random inputs (signs, stochastic rounding) numbered as after training
        amp = _train_amp(run.config, dev)
    elif precision == "bf16":
        amp = torch.bfloat16
    model.to(dev).eval()
    limit = model.cfg.vocab_size
    if tok is not None:
        limit = min(limit, int(tok.vocab_size))
    return Loaded(model, tok, run, dev, amp, precision, limit)


def _check_sampling(max_new_tokens, temperature, top_k, seed) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UserError(f"max new tokens must be a non-negative integer, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise UserError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise UserError(f"top-k must be an integer >= 0 (0: no top-k cut), got {top_k!r}")
    check_number("seed", seed, lo=0, integer=True)


@torch.no_grad()
def generate_ids(model, ids: list[int], max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 50,
                 seed: int = 0, *, stop_id: int | None = None, vocab_limit: int | None = None,
                 amp_dtype: torch.dtype | None = None) -> list[int]:
    """The new token ids after ``ids`` (a list of ints, not empty). ``temperature`` 0 is greedy decoding;
    ``top_k`` 0 samples from the whole vocabulary; ``seed`` makes sampling reproducible (a private
    generator: the global RNG is untouched). Stops after ``stop_id`` (not returned) or ``max_new_tokens``.
    ``vocab_limit``: ids at or above it (the padding rows of an MX-padded vocab) are never chosen."""
    _check_sampling(max_new_tokens, temperature, top_k, seed)
    if not ids:
        raise UserError("generation needs at least one token of context")
    dev = next(model.parameters()).device
    V = model.cfg.vocab_size
    limit = min(V, vocab_limit or V)
    ctx_len = model.cfg.max_seq_len
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seq = list(ids)
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            x = torch.tensor([seq[-ctx_len:]], dtype=torch.long, device=dev)
            with torch.autocast(dev.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                logits = model(x)[0, -1]
            logits = logits.float().cpu()[:limit]
            if temperature == 0:
                nxt = int(torch.argmax(logits))
            else:
                # the largest logit subtracted first: a tiny temperature (1e-45) makes the others -inf, never
                # inf - inf = nan (a float32 division overflows where the float64 one need not)
                logits = (logits.double() - logits.max().double()) / temperature
                if 0 < top_k < limit:
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            if stop_id is not None and nxt == stop_id:
                break
            seq.append(nxt)
            new.append(nxt)
    finally:
        model.train(was_training)
    return new


def generate(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 50,
             seed: int = 0, *, amp_dtype: torch.dtype | None = None, stop_at_eot: bool = True,
             vocab_limit: int | None = None) -> str:
    """The text the model writes after ``prompt``. The context starts with the end-of-text token (as every
    document after the first does in training), then the prompt's tokens; generation stops at the next
    end-of-text token (``stop_at_eot``) or after ``max_new_tokens``. See ``generate_ids`` for the rest, and
    ``load`` for a run's model and tokenizer (pass ``amp_dtype=loaded.amp_dtype``)."""
    if not isinstance(prompt, str):
        raise UserError(f"the prompt must be text, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate: bytes that are not UTF-8 on the command line (#47)
        raise UserError(f"the prompt is not valid UTF-8 text (character {e.start + 1} is "
                        f"{prompt[e.start]!a}, e.g. a byte of another encoding); give UTF-8 text") from None
    ids = [tokenizer.eot_id] + list(tokenizer.encode_batch([prompt])[0])
    limit = vocab_limit if vocab_limit is not None else min(model.cfg.vocab_size, int(tokenizer.vocab_size))
    new = generate_ids(model, ids, max_new_tokens, temperature, top_k, seed,
                       stop_id=tokenizer.eot_id if stop_at_eot else None, vocab_limit=limit, amp_dtype=amp_dtype)
    return tokenizer.decode(new)


# ------------------------------------------------------------------------------------------------ eval

class _Split:
    """Tokenized text in the place of a prepared folder's validation split, for ``val_batches``."""

    def __init__(self, val: list[np.ndarray], vocab_size: int, folder: Path):
        self.val, self.vocab_size, self.folder = val, vocab_size, folder


class _Progress:
    """A tqdm bar when stderr is a terminal (and tqdm is installed), else a plain line every ~10 %."""

    def __init__(self, total: int, enabled: bool | None, desc: str = "eval"):
        self.total, self.n, self.desc = total, 0, desc
        self.bar = None
        self.on = enabled if enabled is not None else True
        self.next_line = 0
        if not self.on:
            return
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm  # optional
                self.bar = tqdm(total=total, desc=desc, unit="window", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, k: int) -> None:
        self.n += k
        if not self.on:
            return
        if self.bar is not None:
            self.bar.update(k)
        elif self.n >= self.next_line or self.n == self.total:
            sys.stderr.write(f"{self.desc}: {self.n}/{self.total} windows\n")
            sys.stderr.flush()
            self.next_line = self.n + max(1, self.total // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _text_tokens(tok, data: Path, text_field: str) -> tuple[np.ndarray, int, int]:
    """(token ids, documents, text bytes) of text sources, each document followed by the end-of-text id."""
    sources = expand_sources([str(data)])
    check_sources(sources)
    parts, ndocs, nbytes, batch = [], 0, 0, []
    eot = np.array([tok.eot_id], dtype=np.int64)

    def flush():
        for ids in tok.encode_batch(batch):
            parts.append(np.asarray(ids, dtype=np.int64))
            parts.append(eot)

    for _, text in documents(sources, text_field):
        batch.append(text)
        ndocs += 1
        nbytes += len(text.encode("utf-8", "surrogatepass"))
        if len(batch) >= 256:
            flush()
            batch = []
    if batch:
        flush()
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)), ndocs, nbytes


def _same_tokenizer(a: Path, b: Path) -> bool:
    """Do two tokenizer files tokenize alike? ``tokenizers`` files are compared by their canonical
    serialization (a file saved again is the same tokenizer), other files byte for byte."""
    if a.resolve() == b.resolve():
        return True
    try:
        ta, tb = load_tokenizer(a), load_tokenizer(b)
    except UserError:
        return a.read_bytes() == b.read_bytes()
    if ta.kind == tb.kind == "hf":
        return ta.impl.to_str() == tb.impl.to_str()
    return a.read_bytes() == b.read_bytes()


def _prepared_split(folder: Path, run: RunCheckpoint, vocab: int):
    """A prepared folder (``TokenData``: its validation split is evaluated), refused when its tokenizer is not
    the run's."""
    data = TokenData(folder)
    if data.vocab_size > vocab:
        raise UserError(f"{folder} was tokenized with a vocabulary of {data.vocab_size:,} ids, more than the model's "
                        f"{vocab:,}: it is not the run's tokenizer; prepare the text with the run's tokenizer "
                        f"(mxtrain data prepare FILES --tokenizer RUN_DATA/tokenizer.json --out NEW)")
    if run.data_dir is not None:
        mine, theirs = run.data_dir / _tokenizer_name(run.data_dir), data.tokenizer_path()
        if mine.is_file() and theirs.is_file() and not _same_tokenizer(mine, theirs):
            raise UserError(f"{folder} was tokenized with another tokenizer than the run's ({mine}); its loss would "
                            f"mean nothing: prepare the text with --tokenizer {mine}, or pass the text files")
    return data, int(data.meta.get("val_tokens", 0))


def _tokenizer_name(folder: Path) -> str:
    import json
    try:
        return str(json.loads((folder / "meta.json").read_text())["tokenizer"])
    except (OSError, ValueError, KeyError, TypeError):
        return "tokenizer.json"


@torch.no_grad()
def evaluate(run_dir: str | Path, data: str | Path, *, step: int | None = None, precision: str = "mx",
             device: str = "auto", batch_size: int | None = None, max_tokens: int | None = None,
             text_field: str = "text", progress: bool | None = None, loaded: Loaded | None = None) -> dict:
    """Loss and perplexity of a run's model on held-out data; returns a JSON-ready dict.

    ``data``: a prepared data folder (its validation split; refused when another tokenizer made it), or a
    text / JSONL / Parquet file or a folder of them (all of it, tokenized with the run's tokenizer). Windows
    are those of training's validation (``seq_len`` of the run; ``mxtrain.data.val_batches``): ``max_tokens //
    seq_len`` of them spread evenly over the split (default: all). ``batch_size``: windows per forward (default: the
    run's micro-batch size, so an MX forward pass sees the batches the trainer's evaluation saw).
    ``precision``: see ``load``. ``progress``: None shows a bar on a terminal and plain lines otherwise.
    """
    t0 = time.perf_counter()
    if str(data) != "builtin" and not Path(data).exists():
        raise UserError(f"evaluation data not found: {data}")
    if loaded is None:
        loaded = load(run_dir, step, precision, device)
    if str(data) == "builtin":   # as in training: the prepared built-in corpus (its validation split)
        data = ensure_builtin(loaded.run.config.data.vocab_size, progress=bool(progress))
    data = Path(data)
    run, model, tok = loaded.run, loaded.model, loaded.tokenizer
    seq_len = run.seq_len
    if batch_size is None:
        batch_size = run.config.train.micro_batch_size or run.config.train.batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch size must be a positive integer, got {batch_size!r}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise UserError(f"max tokens must be a positive integer, got {max_tokens!r}")
    out = {"run": str(run.run_dir), "checkpoint": str(run.path), "step": run.step, "data": str(data)}
    if data.is_dir() and (data / "meta.json").is_file():
        split, total = _prepared_split(data, run, model.cfg.vocab_size)
        out.update(kind="prepared", split="validation")
    else:
        if tok is None:
            raise UserError("evaluating text needs the run's tokenizer, which is gone (its data folder was moved "
                            "or deleted)")
        ids, ndocs, nbytes = _text_tokens(tok, data, text_field)
        total = len(ids)
        split = _Split([ids], model.cfg.vocab_size, data)
        out.update(kind="text", documents=ndocs, text_bytes=nbytes)
    windows = sum(max(0, (len(s) - 1) // seq_len) for s in split.val)
    if windows == 0:
        where = " in its validation split" if out["kind"] == "prepared" else ""
        raise UserError(f"{data} holds {total:,} tokens{where}, fewer than one window of {seq_len + 1} (the run's "
                        f"seq_len + 1); give more text")
    if max_tokens is not None:
        windows = min(windows, max(1, max_tokens // seq_len))
    limit_tokens = windows * seq_len
    bar = _Progress(windows, progress)
    dev, amp = loaded.device, loaded.amp_dtype
    loss_sum, count = 0.0, 0
    try:
        for x, y in val_batches(split, seq_len, batch_size, limit_tokens):
            x, y = x.to(dev), y.to(dev)
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = model(x, y)
            loss_sum += float(loss) * y.numel()
            count += y.numel()
            bar.update(x.shape[0])
    finally:
        bar.close()
    loss = loss_sum / count
    out.update(windows=count // seq_len, tokens=count, seq_len=seq_len, loss=loss,
               perplexity=math.exp(min(loss, 700.0)) if math.isfinite(loss) else float("nan"),
               precision=loaded.precision, recipe=run.config.recipe_name(), device=str(dev),
               seconds=round(time.perf_counter() - t0, 3))
    return out
