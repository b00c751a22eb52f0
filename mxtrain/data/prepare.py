"""``prepare``: documents -> tokenized shards (raw little-endian uint16/uint32 files) + ``meta.json``.

Layout of a prepared folder::

    meta.json              format, dtype, vocab_size, eot_id, tokenizer file, shard lists, sources
    tokenizer.json         (or tokenizer.model) the tokenizer used
    train_00000.bin ...    token ids, each document followed by the end-of-text id
    val_00000.bin          the fixed validation split

The validation split is fixed by content: a document goes to validation when a hash of its text
falls below ``val_fraction``, so it does not depend on file order or on the tokenizer. The folder
is written under a temporary name and renamed at the end, so a crash never leaves a half folder.

``force`` only ever replaces a prepared folder (one holding a ``meta.json`` written here and nothing
else): an output folder that is the working folder or one of its parents, the root or the home
folder, an input or inside one or holding one, a file, or a non-empty folder prepare did not write
is refused before any work. The old folder is moved aside, the new one renamed in, and only then is
the old one deleted, so an interrupted run leaves the old folder or the new one, never neither.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .._io import FolderLock, pid_alive, swap_in, temp_path
from ..errors import UserError
from . import checked, hf
from .sources import BUILTIN, check_sources, documents, expand_sources, kind_of, note, warn
from .shards import FORMAT, fingerprint, shard_dtype
from .reference import sources_of, summary as reference_summary
from .tokenizer import check_eot_token, check_vocab_size, load_tokenizer, train_bpe
from .. import settings


def _corpus_bytes(sources: list[str]) -> int | None:
    """An upper bound on the text bytes of ``sources`` (their file sizes), or None when it is not known
    (the built-in corpus, compressed files, Parquet, datasets folders)."""
    total = 0
    for s in sources:
        if s == BUILTIN or s.endswith(".gz") or kind_of(Path(s)) in ("parquet", "hf-disk"):
            return None
        total += os.path.getsize(s)
    return total


def _is_val(text: str, fraction: float) -> bool:
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2**64


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)   # a full disk or quota, the file size limit


class _ShardWriter:
    def __init__(self, folder: Path, prefix: str, dtype, shard_tokens: int, vocab_size: int | None = None):
        self.folder, self.prefix, self.dtype, self.shard_tokens = folder, prefix, dtype, shard_tokens
        # ids must lie in [0, vocab_size) and fit the dtype: never wrapped by astype
        self.limit = min(vocab_size or np.iinfo(dtype).max + 1, np.iinfo(dtype).max + 1)
        self.shards: list[dict] = []
        self.max_ids: dict[str, int] = {}  # the largest id written to each shard (recorded as checked)
        self.f = None
        self.n = 0

    def _open(self):
        name = f"{self.prefix}_{len(self.shards):05d}.bin"
        self.f = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def write(self, ids: np.ndarray):
        if len(ids) and (int(ids.max()) >= self.limit or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= self.limit else int(ids.min())
            raise UserError(f"the tokenizer produced id {bad:,}, outside its vocabulary [0, {self.limit:,}); the "
                            f"tokenizer file is inconsistent: use another tokenizer")
        while len(ids):
            if self.f is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                if self.f:
                    self.f.close()
                self._open()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self.f.write(part.astype(self.dtype).tobytes())
            name = self.shards[-1]["file"]
            self.max_ids[name] = max(self.max_ids.get(name, 0), int(part.max()))
            self.shards[-1]["tokens"] += len(part)
            self.n += len(part)

    def close(self):
        if self.f:
            self.f.close()
            self.f = None


def _check_args(val_fraction, shard_tokens, tokenizer, vocab_size, eot_token) -> str | None:
    if not 0 < val_fraction < 0.5:
        raise UserError(f"val fraction must be in (0, 0.5), got {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"shard_tokens must be a positive integer, got {shard_tokens!r}")
    if not tokenizer:
        check_vocab_size(vocab_size)
    return check_eot_token(eot_token)


def prepare(sources: list[str], out: str | Path, *, tokenizer: str | None = None, vocab_size: int = 4096,
            val_fraction: float = 0.01, shard_tokens: int = 1 << 26, text_field: str = "text",
            tokenizer_train_bytes: int = 200_000_000, force: bool = False, progress: bool = True,
            eot_token: str | None = None, val_sources: list[str] | None = None) -> Path:
    """Tokenize ``sources`` (``"builtin"``, files, folders, datasets save_to_disk folders) into ``out``; returns
    the folder.

    **Arguments:** ``tokenizer``: a local tokenizer file to use; if None, train a byte-level BPE of
    ``vocab_size`` on (up to ``tokenizer_train_bytes`` of) the training documents.
    ``val_fraction``: share of documents held out for validation (by content hash).
    ``text_field``: the JSON field / Parquet or datasets column holding the text.
    ``eot_token``: the token that ends every document (e.g. ``"<|end_of_text|>"``); it must be in the
    tokenizer's vocabulary. None: found by name (see ``mxtrain.data.tokenizer``); a trained BPE names it
    ``<|endoftext|>``.
    ``force``: replace an existing ``out``, which must be a folder a previous prepare wrote (see above).
    ``val_sources``: fixed validation files or folders (e.g. the ``val/`` of ``mxtrain data corpus``): every
    document of them is validation and every document of ``sources`` training; ``val_fraction`` is then not
    used. None (the default): the split by content hash. A file may not be both a source and a val source.

    A folder source stands for its data files (``sources.data_files``): README, LICENSE, .md, metadata, hidden
    and other files are skipped, and one log line names them.

    Refused before any work: a source that is not text (``check_sources``), a ``vocab_size`` that is not a
    multiple of 32 in [512, 2**20] or exceeds the corpus size in bytes, an ``eot_token`` the tokenizer does not
    have. A corpus that supports fewer BPE tokens than ``vocab_size`` gives the smaller vocab (tokenizer and
    meta.json agree), with a warning that says so. Shards are uint16 when the tokenizer's largest id is below
    65,536, else uint32.
    """
    out = Path(out)
    if not sources:
        raise UserError("no data sources given (use 'builtin' or paths to .txt/.jsonl/.json.gz/.parquet files or "
                        "folders)")
    eot_token = _check_args(val_fraction, shard_tokens, tokenizer, vocab_size, eot_token)
    given = list(sources)
    sources = expand_sources(sources)
    val_expanded: list[str] = []
    if val_sources is not None:
        if isinstance(val_sources, (str, Path)) or not list(val_sources):
            raise UserError("val_sources must be a non-empty list of validation files or folders")
        given += [str(v) for v in val_sources]
        val_expanded = expand_sources([str(v) for v in val_sources])
        if BUILTIN in val_expanded:
            raise UserError("'builtin' cannot be a validation source (it has its own split); give files or folders")
        both = sorted({os.path.realpath(s) for s in sources if s != BUILTIN}
                      & {os.path.realpath(v) for v in val_expanded})
        if both:
            raise UserError(f"{both[0]} is both a training source and a validation source (--val); give each file "
                            f"once")
    # a binary file given by mistake, a missing text column or package is refused by name, before any work
    check_sources(sources + val_expanded, text_field, note_fn=note)
    if not tokenizer:
        size = _corpus_bytes(sources)
        if size is not None and vocab_size > size:
            # the files are smaller than vocab_size <= 1 MiB: read them (an error in them comes first) and count
            size = sum(len(t.encode("utf-8", "surrogatepass"))
                       for _, t in documents(sources, text_field, None, None))
            raise UserError(f"--vocab-size {vocab_size:,} is larger than the corpus ({size:,} bytes of text): a BPE "
                            f"cannot learn more tokens than its text has bytes; use a smaller --vocab-size or more text")

    def docs(warn_fn):
        return documents(sources, text_field, warn_fn, None)

    val_docs = None
    if val_expanded:
        def val_docs(warn_fn):
            return documents(val_expanded, text_field, warn_fn, None)

    return _prepare(docs, out, given + sources + val_expanded,
                    [s if s == BUILTIN else os.path.abspath(s) for s in sources], ", ".join(sources),
                    tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction,
                    shard_tokens=shard_tokens, tokenizer_train_bytes=tokenizer_train_bytes, force=force,
                    progress=progress, eot_token=eot_token, val_docs=val_docs,
                    val_meta=[os.path.abspath(v) for v in val_expanded],
                    corpus=corpus_sources([s for s in sources + val_expanded if s != BUILTIN]))


CORPUS_MANIFEST = "manifest.json"   # (what ``mxtrain data corpus`` writes beside its train/ and val/ folders)


def corpus_sources(paths: list[str]) -> dict | None:
    """What the ``mxtrain data corpus`` folders the files ``paths`` come from were built from: for each corpus
    manifest found beside a file or one folder up (``CORPUS/train/x.jsonl`` -> ``CORPUS/manifest.json``), every
    domain's sources with their versions, documents and bytes. ``meta.json`` keeps it as ``corpus_sources`` and
    runs copy it into their ``run.json``: a corpus built again from sources that moved (Debian's documentation
    packages are not pinned) gives another fingerprint, and this record says which source moved. None where no
    file has such a manifest."""
    found: dict[str, dict] = {}
    for p in paths:
        for d in (Path(p).parent, Path(p).parent.parent):
            m = d / CORPUS_MANIFEST
            key = os.path.realpath(m)
            if key in found:   # (this corpus's manifest, found through another of its files)
                break
            if not m.is_file():
                continue
            try:
                man = json.loads(m.read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(man, dict) or not isinstance(man.get("domains"), dict):
                continue
            found[key] = sources_of(man)
            break
    if not found:
        return None
    return found[next(iter(found))] if len(found) == 1 else {"manifests": list(found.values())}


def prepare_dataset(ds, out: str | Path, *, tokenizer: str | None = None, text_field: str = "text",
                    vocab_size: int = 4096, val_fraction: float = 0.01, shard_tokens: int = 1 << 26,
                    tokenizer_train_bytes: int = 200_000_000, force: bool = False, progress: bool = True,
                    eot_token: str | None = None) -> Path:
    """``prepare`` for a Hugging Face ``datasets.Dataset`` or ``IterableDataset`` held in Python: its column
    ``text_field`` is tokenized into ``out`` by the same pipeline (same validation split by content hash,
    same checks and arguments); returns the folder. A ``DatasetDict`` is refused: pass one split
    (``ds["train"]``). meta.json's ``sources`` describes the dataset (name, split, rows, fingerprint).

    An ``IterableDataset`` is iterated twice when a tokenizer is trained (once for the tokenizer, once to
    tokenize), so it must give the same rows each time (no unseeded shuffle)."""
    out = Path(out)
    datasets = hf.need_datasets("prepare_dataset")
    if isinstance(ds, datasets.DatasetDict) or isinstance(ds, getattr(datasets, "IterableDatasetDict", ())):
        raise UserError(f"prepare_dataset takes one split, not a {type(ds).__name__} (splits: "
                        f"{', '.join(map(str, ds))}); pass e.g. ds['train']")
    if not isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        raise UserError(f"prepare_dataset takes a datasets.Dataset or IterableDataset, got {type(ds).__name__}; "
                        f"for files and folders use prepare([...], out)")
    eot_token = _check_args(val_fraction, shard_tokens, tokenizer, vocab_size, eot_token)
    if not isinstance(text_field, str) or not text_field:
        raise UserError(f"text_field must be a column name, got {text_field!r}")
    name = hf.describe(ds)
    hf.check_text_column(ds, text_field, name)

    def docs(warn_fn):
        return hf.documents(ds, text_field, "dataset")

    return _prepare(docs, out, hf.cache_folders(ds), [name], name, tokenizer=tokenizer, vocab_size=vocab_size,
                    val_fraction=val_fraction, shard_tokens=shard_tokens,
                    tokenizer_train_bytes=tokenizer_train_bytes, force=force, progress=progress,
                    eot_token=eot_token, total=len(ds) if isinstance(ds, datasets.Dataset) else None)


def _prepare(docs: Callable, out: Path, inputs: list[str], meta_sources: list[str], shown: str, *,
             tokenizer, vocab_size, val_fraction, shard_tokens, tokenizer_train_bytes, force, progress,
             eot_token, total: int | None = None, val_docs: Callable | None = None,
             val_meta: list[str] | None = None, corpus: dict | None = None) -> Path:
    """The pipeline after the sources are checked: ``docs(warn_fn)`` gives the ``(name, text)`` documents (it
    is called twice when a tokenizer is trained); ``inputs``: paths --out must not overlap. ``val_docs``: the
    fixed validation documents (then every document of ``docs`` is training), or None for the hash split."""
    def is_val(text: str) -> bool:
        return val_docs is None and _is_val(text, val_fraction)

    # every check on --out comes before any work or any deletion; file operations use the resolved path
    dest = _check_out(out, inputs, force)
    # a bad tokenizer file or --eot-token is refused before writing
    tok = load_tokenizer(tokenizer, eot_token=eot_token) if tokenizer else None
    if tok is not None:
        shard_dtype(tok.vocab_size)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # one prepare at a time per output folder, refused before any work (not when its result is swapped in)
        lock = FolderLock(dest.parent, lambda who: f"output folder {out} is being prepared by another mxtrain data "
                          f"prepare{f' (pid {who})' if who else ''}; wait for it to finish or choose another --out",
                          name=f".{dest.name}.lock", remove=True)
    except OSError as e:
        if e.errno in _FULL:
            e.folder = str(out)   # (the command's one line for a full disk or quota names this folder and what to do)
            raise
        raise UserError(f"cannot write to {dest.parent}: {e.strerror or e}") from None
    with lock:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            if _clean_stale(dest):  # an old folder came back: check --out again
                dest = _check_out(out, inputs, force)
            tmp = temp_path(dest)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            raise UserError(f"cannot write to {dest.parent}: {e.strerror or e}") from None

        try:
            t0 = time.time()
            if tok is None:
                def sample():
                    n = 0
                    for _, text in docs(None):  # the pass below warns
                        if is_val(text):
                            continue
                        yield text
                        n += len(text)
                        if n >= tokenizer_train_bytes:
                            return
                if progress:
                    print(f"training a byte-level BPE tokenizer (vocab {vocab_size}) ...", flush=True)
                tok = train_bpe(sample(), vocab_size, eot_token=eot_token)
                if tok.vocab_size < vocab_size:
                    _warn_small_vocab(tok.vocab_size, vocab_size)
            dtype = shard_dtype(tok.vocab_size)  # the largest id decides: ids are never wrapped into uint16
            tok_file = tok.save(tmp)
            train_w = _ShardWriter(tmp, "train", dtype, shard_tokens, tok.vocab_size)
            val_w = _ShardWriter(tmp, "val", dtype, shard_tokens, tok.vocab_size)
            ndocs = {"train": 0, "val": 0}
            nbytes = 0
            bar = _Progress(total) if progress else None
            eot = np.array([tok.eot_id], dtype=np.int64)

            val_spans: list[dict] = []   # fixed validation files: each file's token span, in order

            def flush(batch, to_val=False, names=None):
                for j, (text, ids) in enumerate(zip(batch, tok.encode_batch(batch))):
                    arr = np.concatenate([np.asarray(ids, dtype=np.int64), eot])
                    if to_val or is_val(text):
                        val_w.write(arr)
                        ndocs["val"] += 1
                        if names is not None:
                            if val_spans and val_spans[-1]["source"] == names[j]:
                                val_spans[-1]["tokens"] += len(arr)
                            else:
                                val_spans.append({"source": names[j], "tokens": len(arr)})
                    else:
                        train_w.write(arr)
                        ndocs["train"] += 1
                if bar is not None:
                    bar.update(len(batch), nbytes, train_w.n + val_w.n)

            batch: list[str] = []
            for _, text in docs(warn):
                batch.append(text)
                nbytes += len(text.encode("utf-8", "surrogatepass"))
                if len(batch) >= 512:
                    flush(batch)
                    batch = []
            if batch:
                flush(batch)
            if val_docs is not None:
                batch, names = [], []
                for name, text in val_docs(warn):
                    batch.append(text)
                    names.append(str(name))
                    nbytes += len(text.encode("utf-8", "surrogatepass"))
                    if len(batch) >= 512:
                        flush(batch, True, names)
                        batch, names = [], []
                if batch:
                    flush(batch, True, names)
            if bar is not None:
                bar.close()
            train_w.close()
            val_w.close()
            if train_w.n == 0:
                raise UserError(f"no text found in {shown}")
            if val_w.n == 0 and val_docs is not None:
                raise UserError("the validation sources (--val) hold no text")
            if val_w.n == 0:
                _carve_val(tmp, train_w, val_w, dtype)
            meta = {
                "format": FORMAT,
                "dtype": np.dtype(dtype).name,
                "vocab_size": 32 * -(-tok.vocab_size // 32),  # padded to MX blocks of 32 (ids above are never used)
                "tokenizer_vocab_size": tok.vocab_size,
                "eot_id": tok.eot_id,
                "eot_token": tok.eot_token,
                "tokenizer": tok_file,
                "tokenizer_source": tok.source,
                "train": train_w.shards,
                "val": val_w.shards,
                "train_tokens": train_w.n,
                "val_tokens": val_w.n,
                "documents": ndocs,
                "text_bytes": nbytes,
                "sources": meta_sources,
                "val_fraction": val_fraction,
                **({"val_sources": val_meta, "val_split": "fixed files", "val_spans": val_spans}
                   if val_docs is not None else {}),
                **({"corpus_sources": corpus} if corpus else {}),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            _swap_in(tmp, dest, out, force)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in _FULL:
                e.folder = str(out)   # the folder whose disk is full, which the command may not name (train's
            raise                     # first use of the built-in corpus prepares it into the cache folder)
        # the ids were checked as they were written: opening the folder need not read the shards again
        checked.record(dest, meta["dtype"], {**train_w.max_ids, **val_w.max_ids})
        # the result, with or without progress reports
        print(f"prepared {out}: {meta['train_tokens']:,} train + {meta['val_tokens']:,} validation tokens "
              f"({ndocs['train']} + {ndocs['val']} documents, vocab {tok.vocab_size}, end of text "
              f"{tok.eot_token!r} = {tok.eot_id}) in {time.time() - t0:.1f} s; fingerprint {fingerprint(dest)} "
              f"(a study resumes only on data with the same)", flush=True)
        line = reference_summary(corpus if isinstance(corpus, dict) and "manifests" not in corpus else None,
                                 fingerprint(dest), tok.vocab_size)
        if line:
            print(line, flush=True)
        return out


class _Progress:
    """Tokenizing progress on stderr: a tqdm bar on a terminal; else (a log file, a pipe, a batch job's output)
    a plain line about every ``every`` seconds, never a carriage return."""

    def __init__(self, total: int | None, every: float = 30.0):
        self.bar, self.every, self.last, self.docs = None, every, time.time(), 0
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm  # optional
                self.bar = tqdm(desc="tokenizing", unit=" docs", dynamic_ncols=True, total=total, file=sys.stderr)
            except ImportError:
                self.bar = None

    def update(self, docs: int, nbytes: int, tokens: int) -> None:
        self.docs += docs
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix(MB=f"{nbytes / 1e6:.1f}", tokens=f"{tokens:,}")
        elif time.time() - self.last >= self.every:
            self.last = time.time()
            print(f"tokenizing: {self.docs:,} documents, {nbytes / 1e6:.1f} MB, {tokens:,} tokens so far",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _warn_small_vocab(got: int, asked: int) -> None:
    """The trained BPE stopped below the asked vocab: the data stays consistent (tokenizer and meta.json hold
    the real vocab), and the user is told."""
    fit = got // 32 * 32
    hint = f", or pass --vocab-size {fit} (what this corpus gives)" if fit >= 512 else ""
    warn(f"the corpus supports only {got:,} BPE tokens, fewer than --vocab-size {asked:,}; the tokenizer and "
         f"meta.json use the real vocab {got:,} (vocab_size {32 * -(-got // 32):,} padded to MX blocks of 32), so "
         f"the data is consistent; add text for a larger vocab{hint}")


# the keys every meta.json written by prepare has; a folder whose meta.json lacks one was not written here
_META_KEYS = ("format", "dtype", "vocab_size", "eot_id", "tokenizer", "train", "val", "train_tokens", "val_tokens")
_HINT = "choose an empty or new --out"


def _prepared_files(folder: Path) -> set[str] | None:
    """The names prepare wrote into ``folder`` (from its meta.json), or None when it is not a prepared folder."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not all(k in meta for k in _META_KEYS):
        return None
    try:
        names = {"meta.json", str(meta["tokenizer"])}
        names.update(str(sh["file"]) for sh in list(meta["train"]) + list(meta["val"]))
    except (TypeError, KeyError):
        return None
    return names


def _replace_refusal(folder: Path, shown: Path) -> str | None:
    """Why the existing non-empty ``folder`` may not be replaced, or None when it is a prepared folder that
    holds only what prepare wrote."""
    names = _prepared_files(folder)
    if names is None:
        return (f"output folder {shown} already exists, is not empty and is not a prepared data folder (no "
                f"mxtrain meta.json); --force only replaces a folder written by 'mxtrain data prepare': {_HINT}")
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in names)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        return (f"output folder {shown} is a prepared data folder but also holds files prepare did not write "
                f"({', '.join(foreign[:3])}{more}); move them out first, or {_HINT}")
    return None


def _check_out(out: Path, sources: list[str], force: bool) -> Path:
    """Refuse an output path that prepare must not write or replace; returns it resolved (symlinks followed)."""
    try:
        dest = out.resolve()
        cwd = Path.cwd().resolve()
        home = Path.home().resolve()
    except (OSError, RuntimeError) as e:
        raise UserError(f"cannot resolve --out {out}: {e}") from None
    if dest.parent == dest:
        raise UserError(f"refusing --out {out}: it is the filesystem root; {_HINT}")
    if dest == cwd or dest in cwd.parents:
        what = "the current working folder" if dest == cwd else "a parent of the current working folder"
        raise UserError(f"refusing --out {out}: it is {what}, which prepare would replace as a whole; {_HINT} "
                        f"such as data/prepared")
    if dest == home or dest in home.parents:
        what = "your home folder" if dest == home else "a parent of your home folder"
        raise UserError(f"refusing --out {out}: it is {what}; {_HINT} such as data/prepared")
    for s in sources:
        if s == BUILTIN:
            continue
        src = Path(s).resolve()
        rel = "is the input" if src == dest else "is inside the input" if src in dest.parents else \
              "contains the input" if dest in src.parents else None
        if rel:
            raise UserError(f"refusing --out {out}: it {rel} {s}; write the prepared data outside the inputs: "
                            f"{_HINT}")
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--out {out} is an existing file, not a folder; {_HINT}")
    try:
        nonempty = dest.is_dir() and any(dest.iterdir())
        why = _replace_refusal(dest, out) if nonempty else None
    except OSError as e:
        raise UserError(f"cannot read output folder {out}: {e.strerror or e}") from None
    if why:
        raise UserError(why)
    if nonempty and not force:
        raise UserError(f"output folder {out} already exists and is not empty (use --force to overwrite)")
    return dest


def _clean_stale(dest: Path) -> bool:
    """Remove the temporary folders of killed runs next to ``dest`` (``.NAME.tmp-PID`` whose process is gone).
    A moved-aside old folder (``.NAME.old-PID``) is deleted when ``dest`` exists (the swap finished), and
    renamed back when it does not (the run died between its two renames)."""
    pat = re.compile(re.escape(f".{dest.name}.") + r"(tmp|old)-(\d+)")
    restored = False
    for p in sorted(dest.parent.iterdir()):
        m = pat.fullmatch(p.name)
        if not m or p.is_symlink() or not p.is_dir():
            continue
        pid = int(m.group(2))
        if pid != os.getpid() and pid_alive(pid):   # (this process's own: left by an earlier call, stale)
            continue
        if m.group(1) == "old" and not os.path.lexists(dest) and _prepared_files(p) is not None:
            os.rename(p, dest)
            restored = True
        else:
            shutil.rmtree(p, ignore_errors=True)
    return restored


def _swap_in(tmp: Path, dest: Path, out: Path, force: bool) -> None:
    """Put the finished ``tmp`` at ``dest``. An old prepared folder is renamed aside, the new one renamed in,
    then the old one deleted; ``dest`` is checked again first, in case something was written there meanwhile."""
    try:
        old_there = dest.is_dir() and any(dest.iterdir())
    except OSError as e:
        raise UserError(f"cannot read output folder {out}: {e.strerror or e}") from None
    if not old_there:
        if dest.exists() and not dest.is_dir():
            raise UserError(f"--out {out} is an existing file, not a folder; {_HINT}")
        try:
            os.replace(tmp, dest)  # absent or an empty folder; fails (nothing lost) if files appeared meanwhile
        except OSError as e:
            raise UserError(f"cannot move the prepared data into {out}: {e.strerror or e}; {_HINT}") from None
        return
    why = _replace_refusal(dest, out)
    if why or not force:
        raise UserError(why or f"output folder {out} already exists and is not empty (use --force to overwrite)")
    swap_in(tmp, dest, dest.parent / f".{dest.name}.old-{os.getpid()}")   # (``_clean_stale`` puts back an aside)


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
    """Where ``mxtrain train`` keeps the prepared built-in corpus: ``$MXTRAIN_DATA`` (the ``data_dir`` setting,
    read now) or ~/.cache/mxtrain/data."""
    root = Path(settings.fresh().data_dir or Path.home() / ".cache" / "mxtrain" / "data")
    return root / f"builtin-bpe{vocab_size}"


def ensure_builtin(vocab_size: int, progress: bool = True) -> Path:
    """The prepared built-in corpus with a ``vocab_size`` BPE, preparing it on first use (~30 s). Processes that
    ask for it at once (the ranks of ``--nproc``, several runs started together, test workers) prepare it once:
    the first prepares it, the others say they wait (on stderr) and then read the same folder."""
    d = default_builtin_dir(vocab_size)
    if (d / "meta.json").is_file():
        return d

    def waiting(who: str) -> None:
        print(f"waiting for another process{f' (pid {who})' if who else ''} preparing the built-in corpus into "
              f"{d}", file=sys.stderr, flush=True)
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        lock = FolderLock(d.parent, lambda who: f"cannot wait for the built-in corpus in {d} to be prepared",
                          name=f".{d.name}.ensure.lock", wait=waiting)
    except OSError as e:
        raise UserError(f"cannot write the built-in corpus to {d.parent}: {e.strerror or e} (set MXTRAIN_DATA to "
                        "a writable folder, or pass --data)") from None
    with lock:
        if (d / "meta.json").is_file():   # prepared by the process this one waited for
            return d
        if progress:
            print(f"preparing the built-in corpus into {d} (first run only)", flush=True)
        return prepare([BUILTIN], d, vocab_size=vocab_size, force=True, progress=progress)
