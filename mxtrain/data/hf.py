"""The Hugging Face ``datasets`` bridge, both ways. ``datasets`` is imported only here, and only when used.

* In: a folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``) is a data source like a
  file (``mxtrain data prepare my_saved_dataset/``), and ``prepare_dataset(ds, out)`` tokenizes a
  ``datasets.Dataset`` / ``IterableDataset`` held in Python with the same pipeline as ``prepare``.
* Out: ``as_hf_dataset(folder)`` opens a prepared folder as a ``datasets.Dataset`` of token ids: one row per
  document (zero-copy over the memory-mapped shards), or with ``seq_len`` the training windows of the loader.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator

from ..errors import UserError
from .loader import TokenData

DATASETS_HINT = "pip install datasets"
HF_META_NAMES = ("dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json")
TEXT_DTYPES = ("string", "large_string")


def need_datasets(why: str):
    """The ``datasets`` module, or a one-line error saying what needs it and how to install it."""
    try:
        import datasets  # optional
    except ImportError:
        raise UserError(f"{why} needs the Hugging Face datasets package: {DATASETS_HINT}") from None
    return datasets


def disk_kind(p: Path) -> str | None:
    """``"dataset"`` for a folder written by ``Dataset.save_to_disk`` (state.json, dataset_info.json and
    data-*.arrow files), ``"dict"`` for one written by ``DatasetDict.save_to_disk`` (dataset_dict.json and one
    such folder per split), else None. Looks at file names only."""
    try:
        if not p.is_dir():
            return None
        if (p / "dataset_dict.json").is_file():
            return "dict"
        if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
            return "dataset"
    except OSError:
        return None
    return None


def load_disk(path: Path, note_fn: Callable[[str], None] | None = None):
    """``datasets.load_from_disk(path)``; of a DatasetDict, its ``train`` split (a note names the splits left
    out, which mxtrain must not mix into training: its validation split is its own, by content hash)."""
    datasets = need_datasets(f"reading {path} (a folder written by datasets' save_to_disk)")
    quiet = not datasets.utils.are_progress_bars_disabled()
    if quiet:  # mxtrain logs its own progress; datasets' bar for many files would interleave with it
        datasets.utils.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, ArrowInvalid ...)
        raise UserError(f"{path}: cannot read this datasets save_to_disk folder ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:200]})") from None
    finally:
        if quiet:
            datasets.utils.enable_progress_bars()
    if isinstance(ds, datasets.DatasetDict):
        splits = sorted(ds)
        if "train" not in splits:
            raise UserError(f"{path} is a DatasetDict without a 'train' split (splits: {', '.join(splits)}); give "
                            f"the folder of the split to read, e.g. {path / splits[0]}")
        others = [s for s in splits if s != "train"]
        if others and note_fn is not None:
            note_fn(f"{path}: reading split 'train' of the DatasetDict, not {', '.join(others)} (give "
                    f"{path / others[0]} to read another split)")
        ds = ds["train"]
    return ds


def check_text_column(ds, text_field: str, name) -> None:
    """Refuse, before any work, a dataset without a text column ``text_field`` (string values)."""
    cols = list(getattr(ds, "column_names", None) or [])
    features = getattr(ds, "features", None)
    if not cols and features:
        cols = list(features)
    if cols and text_field not in cols:
        raise UserError(f"{name} has no {text_field!r} column (columns: {', '.join(map(str, cols))}); choose the "
                        f"text column with --text-field (text_field=)")
    feat = features.get(text_field) if features else None
    dtype = getattr(feat, "dtype", None)
    if feat is not None and dtype not in TEXT_DTYPES:
        what = dtype if isinstance(dtype, str) else type(feat).__name__
        raise UserError(f"{name}: column {text_field!r} holds {what} values, not text (columns: "
                        f"{', '.join(map(str, cols))}); choose the text column with --text-field (text_field=)")


def documents(ds, text_field: str, name: str, batch_size: int = 1024) -> Iterator[tuple[str, str]]:
    """The non-blank texts of column ``text_field`` of a ``Dataset`` or ``IterableDataset``, in row order;
    missing values (None) are skipped like blank ones, any other non-string value is refused."""
    try:  # plain Python values whatever format the dataset was set to (numpy, torch, pandas ...)
        batches = ds.select_columns([text_field]).with_format(None).iter(batch_size=batch_size)
    except (AttributeError, TypeError, ValueError):
        batches = None
    row = 0
    if batches is None:  # an object with no select_columns/iter: plain row iteration
        def rows():
            for r in ds:
                yield {text_field: [r[text_field] if isinstance(r, dict) and text_field in r else _MISSING]}
        batches = rows()
    for batch in batches:
        for text in batch[text_field]:
            row += 1
            if isinstance(text, str):
                if text.strip():
                    yield name, text
            elif text is _MISSING:
                raise UserError(f"{name}: row {row} has no {text_field!r} field; choose the text column with "
                                f"--text-field (text_field=)")
            elif text is not None:
                raise UserError(f"{name}: row {row}: {text_field!r} is a {type(text).__name__}, not text; choose "
                                f"the text column with --text-field (text_field=)")


_MISSING = object()


def describe(ds) -> str:
    """A one-line name of a dataset object for meta.json's sources: its builder name, split, rows, fingerprint."""
    info = getattr(ds, "info", None)
    parts = []
    for label, v in (("name", getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)),
                     ("config", getattr(info, "config_name", None)), ("split", getattr(ds, "split", None))):
        if v:
            parts.append(f"{label}={v}")
    try:
        parts.append(f"rows={len(ds)}")
    except TypeError:
        pass
    fp = getattr(ds, "_fingerprint", None)
    if fp:
        parts.append(f"fingerprint={fp}")
    return f"datasets.{type(ds).__name__}({', '.join(parts)})"


def cache_folders(ds) -> list[str]:
    """The folders of the Arrow files backing ``ds`` (so that --out is never one of them or inside one)."""
    out = []
    for f in getattr(ds, "cache_files", None) or []:
        name = f.get("filename") if isinstance(f, dict) else None
        if name:
            d = str(Path(name).parent)
            if d not in out:
                out.append(d)
    return out


# ---- out: a prepared folder as a datasets.Dataset ---------------------------------------------------------------

def as_hf_dataset(folder: str | Path, split: str = "train", seq_len: int | None = None):
    """A prepared folder's ``split`` (``"train"`` or ``"val"``) as a ``datasets.Dataset`` with one column,
    ``input_ids`` (the shard dtype, uint16 or uint32; ``with_format("torch")`` gives int64 tensors).

    * ``seq_len=None``: one row per document, the ids exactly as in the shards, each row ending with the
      end-of-text id (``meta.json``'s ``eot_id``), so the rows concatenated are the split's token stream. A
      document cut by a shard boundary is one row. Built without copying: the rows are views of the
      memory-mapped shards (opening reads the shards once to find the end-of-text ids).
    * ``seq_len=N``: the windows the training loader draws from, in shard order (not shuffled): ``N + 1`` ids
      at stride ``N`` inside each shard, so inputs are ``row[:-1]`` and targets ``row[1:]`` (a Hugging Face
      causal LM given ``input_ids=labels=row`` predicts the same ``N`` targets). These rows are copied into
      memory (about ``(N + 1) / N`` times the split's size).

    The folder is opened and checked as for training (``TokenData``): no id outside the vocabulary is returned.
    The dataset's ``info.description`` names the folder, split, vocab size and end-of-text id.
    """
    datasets = need_datasets("as_hf_dataset")
    import numpy as np
    import pyarrow as pa  # optional

    if split not in ("train", "val"):
        raise UserError(f"split must be 'train' or 'val', got {split!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise UserError(f"seq_len must be a positive integer or None (one row per document), got {seq_len!r}")
    data = TokenData(folder)
    shards = data.train if split == "train" else data.val
    vtype = pa.from_numpy_dtype(data.dtype)
    if seq_len is None:
        column = _document_rows(shards, data.eot_id, vtype, np, pa)
        layout = "one row per document (each ending with the end-of-text id)"
    else:
        column = _window_rows(shards, seq_len, vtype, np, pa)
        if len(column) == 0:
            raise UserError(f"the {split} split of {folder} has no window of {seq_len + 1} tokens (its shards hold "
                            f"{sum(len(s) for s in shards):,} tokens); use a smaller seq_len")
        layout = f"training windows of {seq_len + 1} ids at stride {seq_len}, in shard order"
    table = pa.Table.from_arrays([column], names=["input_ids"])
    desc = (f"mxtrain prepared folder {Path(folder).resolve()}, split {split}: {layout}; vocab_size "
            f"{data.vocab_size}, eot_id {data.eot_id}, tokenizer {data.tokenizer_path().name}")
    key = {"folder": str(Path(folder).resolve()), "split": split, "seq_len": seq_len,
           "shards": [_stat_key(data.folder / sh["file"]) for sh in data.meta[split]]}
    fingerprint = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return datasets.Dataset(table, info=datasets.DatasetInfo(description=desc), split=split,
                            fingerprint=fingerprint)


def _stat_key(p: Path) -> list:
    st = os.stat(p)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _document_rows(shards, eot: int, vtype, np, pa):
    """A chunked list column: per shard, its documents as slices of the memory map (no copy); a document
    spanning shards is joined (copied) into a chunk of its own."""
    pieces = []      # the head of a document that goes on in the next shard(s)
    chunks = []
    big = max((len(s) for s in shards), default=0) >= (1 << 31) - 1
    list_cls = pa.LargeListArray if big else pa.ListArray
    off_dtype = np.int64 if big else np.int32

    def add(values: np.ndarray, ends: np.ndarray):
        offsets = np.concatenate([[0], ends]).astype(off_dtype)
        chunks.append(list_cls.from_arrays(pa.array(offsets), pa.array(values, type=vtype)))

    for arr in shards:
        if len(arr) == 0:
            continue
        ends = np.flatnonzero(np.asarray(arr) == eot) + 1
        if len(ends) == 0:
            pieces.append(arr)
            continue
        start = 0
        if pieces:  # the document that started in an earlier shard ends here
            joined = np.concatenate([np.asarray(p) for p in pieces] + [np.asarray(arr[:ends[0]])])
            add(joined, np.array([len(joined)]))
            pieces, start, ends = [], int(ends[0]), ends[1:]
        if len(ends):
            add(arr[start:int(ends[-1])], ends - start)
            start = int(ends[-1])
        if start < len(arr):
            pieces.append(arr[start:])
    if pieces:  # a last document without an end-of-text id (the cut of a tiny corpus' validation split)
        joined = np.concatenate([np.asarray(p) for p in pieces])
        add(joined, np.array([len(joined)]))
    typ = pa.large_list(vtype) if big else pa.list_(vtype)
    return pa.chunked_array(chunks, type=typ)


def _window_rows(shards, seq_len: int, vtype, np, pa):
    """A chunked fixed-size-list column: the loader's windows (seq_len + 1 ids at stride seq_len) per shard."""
    chunks = []
    for arr in shards:
        n = max(0, (len(arr) - 1) // seq_len)
        if n == 0:
            continue
        view = np.lib.stride_tricks.sliding_window_view(np.asarray(arr[:n * seq_len + 1]), seq_len + 1)[::seq_len]
        values = np.ascontiguousarray(view).reshape(-1)
        chunks.append(pa.FixedSizeListArray.from_arrays(pa.array(values, type=vtype), seq_len + 1))
    return pa.chunked_array(chunks, type=pa.list_(vtype, seq_len + 1))
