"""The Hugging Face ``datasets`` bridge: a save_to_disk folder is a source; ``prepare_dataset`` tokenizes a
Dataset object with the same pipeline as ``prepare`` (same bytes); ``as_hf_dataset`` opens a prepared folder as
a Dataset of documents or of the loader's windows. Skipped when ``datasets`` is not installed."""

import json
import random
import shutil
import sys

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from mxtrain.data import TokenData, as_hf_dataset, documents, load_tokenizer, prepare, prepare_dataset  # noqa: E402
from mxtrain.data.loader import _Windows  # noqa: E402
from mxtrain.errors import UserError  # noqa: E402

from train_helpers import SENTENCES, small_data  # noqa: E402


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MXTRAIN_CACHE", str(tmp_path / "mxcache"))


def _texts(n=200, seed=0):
    rnd = random.Random(seed)
    return [f"Document {i}. " + " ".join(rnd.choice(SENTENCES) for _ in range(rnd.randint(2, 12))) for i in range(n)]


@pytest.fixture
def texts():
    return _texts()


@pytest.fixture
def saved(tmp_path, texts):
    """A Dataset with a text column among others (a blank and a missing text too), saved with save_to_disk."""
    rows = texts + ["   ", None]
    ds = datasets.Dataset.from_dict({"id": list(range(len(rows))), "text": rows, "score": [0.5] * len(rows)})
    ds.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


def _tok():
    return str(small_data() / "tokenizer.json")


def _bins(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}


def _no_out(tmp_path):
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ---- in: a save_to_disk folder is a source --------------------------------------------------------------------

def test_save_to_disk_folder_is_a_source(saved, texts, tmp_path):
    assert [t for _, t in documents([str(saved)])] == texts  # blank and missing texts skipped, order kept
    out = prepare([str(saved)], tmp_path / "out", tokenizer=_tok(), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sources"] == [str(saved)] and sum(meta["documents"].values()) == len(texts)
    # the same bytes as the same texts from a JSON Lines file
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ref = prepare([str(tmp_path / "same.jsonl")], tmp_path / "ref", tokenizer=_tok(), progress=False)
    assert _bins(out) == _bins(ref)


def test_save_to_disk_folder_inside_a_folder(saved, texts, tmp_path, capsys):
    root = tmp_path
    (root / "README.md").write_text("# card\n")
    (root / "extra.txt").write_text("An extra text file. " * 20)
    got = list(documents([str(root)]))
    assert [n for n, _ in got] == ["extra.txt"] + ["saved"] * len(texts)
    assert "skipped 1 file that is not data: README.md" in capsys.readouterr().out


def test_save_to_disk_text_column_checked_before_work(saved, tmp_path, monkeypatch):
    prep = sys.modules["mxtrain.data.prepare"]
    monkeypatch.setattr(prep, "train_bpe", lambda *a, **k: pytest.fail("tokenizer training started"))
    with pytest.raises(UserError, match=r"saved has no 'body' column \(columns: id, text, score\); choose the text "
                                        r"column with --text-field"):
        prepare([str(saved)], tmp_path / "out", vocab_size=512, text_field="body", progress=False)
    with pytest.raises(UserError, match=r"saved: column 'score' holds float64 values, not text"):
        prepare([str(saved)], tmp_path / "out", vocab_size=512, text_field="score", progress=False)
    _no_out(tmp_path)


def test_text_field_names_the_column(tmp_path, texts):
    datasets.Dataset.from_dict({"body": texts}).save_to_disk(str(tmp_path / "d"))
    assert [t for _, t in documents([str(tmp_path / "d")], text_field="body")] == texts


def test_datasetdict_folder_reads_its_train_split(tmp_path, texts, capsys):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts[:150]}),
                               "test": datasets.Dataset.from_dict({"text": ["TEST SPLIT " * 5] * 10})})
    dd.save_to_disk(str(tmp_path / "dd"))
    out = prepare([str(tmp_path / "dd")], tmp_path / "out", tokenizer=_tok(), progress=False)
    assert sum(json.loads((out / "meta.json").read_text())["documents"].values()) == 150
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "DatasetDict" in ln]
    assert len(notes) == 1 and "reading split 'train' of the DatasetDict, not test" in notes[0]
    datasets.DatasetDict({"test": dd["test"]}).save_to_disk(str(tmp_path / "only_test"))
    with pytest.raises(UserError, match=r"only_test is a DatasetDict without a 'train' split \(splits: test\); give "
                                        r"the folder of the split to read, e.g. .*only_test/test"):
        prepare([str(tmp_path / "only_test")], tmp_path / "out2", tokenizer=_tok(), progress=False)
    # a split's own folder is a Dataset folder
    assert len(list(documents([str(tmp_path / "dd" / "test")]))) == 10


def test_without_datasets_one_clear_error(saved, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError) as e:
        prepare([str(saved)], tmp_path / "out", vocab_size=512, progress=False)
    assert str(e.value) == (f"reading {saved} (a folder written by datasets' save_to_disk) needs the Hugging Face "
                            f"datasets package: pip install datasets")
    _no_out(tmp_path)
    with pytest.raises(UserError, match="as_hf_dataset needs the Hugging Face datasets package: pip install datasets"):
        as_hf_dataset(small_data())


# ---- in: a Dataset object in Python --------------------------------------------------------------------------

def test_prepare_dataset_is_prepare(texts, tmp_path):
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ds = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
    for kw in ({"tokenizer": _tok()}, {"vocab_size": 512}):  # a given tokenizer, and a trained BPE
        a = prepare_dataset(ds, tmp_path / "a", force=True, progress=False, **kw)
        b = prepare([str(tmp_path / "same.jsonl")], tmp_path / "b", force=True, progress=False, **kw)
        assert _bins(a) == _bins(b) and len(_bins(a)) >= 2
        assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
        meta_a = json.loads((a / "meta.json").read_text())
        assert meta_a["sources"] == [f"datasets.Dataset(rows={len(texts)}, fingerprint={ds._fingerprint})"]
        assert meta_a["documents"] == json.loads((b / "meta.json").read_text())["documents"]
    TokenData(tmp_path / "a")


def test_prepare_dataset_ignores_the_output_format(texts, tmp_path):
    ds = datasets.Dataset.from_dict({"text": texts})
    a = prepare_dataset(ds, tmp_path / "a", tokenizer=_tok(), progress=False)
    for fmt in ("numpy", "torch", "pandas"):
        b = prepare_dataset(ds.with_format(fmt), tmp_path / fmt, tokenizer=_tok(), progress=False)
        assert _bins(b) == _bins(a), fmt


def test_prepare_dataset_iterable_and_eot_token(texts, tmp_path):
    def gen():
        yield from ({"text": t} for t in texts)
    ids = datasets.IterableDataset.from_generator(gen)
    out = prepare_dataset(ids, tmp_path / "out", tokenizer=_tok(), eot_token="<|endoftext|>", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert sum(meta["documents"].values()) == len(texts) and meta["eot_token"] == "<|endoftext|>"


def test_prepare_dataset_refusals(texts, tmp_path, saved):
    ds = datasets.Dataset.from_dict({"text": texts})
    cases = [
        (datasets.DatasetDict({"train": ds}), r"takes one split, not a DatasetDict \(splits: train\); pass e.g. "
                                              r"ds\['train'\]"),
        (texts, r"takes a datasets.Dataset or IterableDataset, got list; for files and folders use prepare"),
        (datasets.Dataset.from_dict({"body": texts}), r"has no 'text' column \(columns: body\)"),
        (datasets.Dataset.from_dict({"text": list(range(5))}), r"column 'text' holds int64 values, not text"),
    ]
    for ds_, pattern in cases:
        with pytest.raises(UserError, match=pattern) as e:
            prepare_dataset(ds_, tmp_path / "out", vocab_size=512, progress=False)
        assert "\n" not in str(e.value)
    _no_out(tmp_path)

    def bad_rows():
        yield {"text": "fine text here"}
        yield {"text": 7}
    with pytest.raises(UserError, match=r"row 2: 'text' is a int, not text"):
        prepare_dataset(datasets.IterableDataset.from_generator(bad_rows), tmp_path / "out", tokenizer=_tok(),
                        progress=False)
    _no_out(tmp_path)
    # --out may not be where the dataset's Arrow files are
    on_disk = datasets.load_from_disk(str(saved))
    before = sorted(p.name for p in saved.iterdir())
    with pytest.raises(UserError, match="refusing --out .*saved: it is the input"):
        prepare_dataset(on_disk, saved, tokenizer=_tok(), force=True, progress=False)
    assert sorted(p.name for p in saved.iterdir()) == before


# ---- out: a prepared folder as a Dataset ---------------------------------------------------------------------

def _stream(folder, split):
    data = TokenData(folder)
    return data, np.concatenate([np.asarray(a) for a in (data.train if split == "train" else data.val)])


def test_as_hf_dataset_documents(texts, tmp_path):
    ds = datasets.Dataset.from_dict({"text": texts})
    out = prepare_dataset(ds, tmp_path / "out", tokenizer=_tok(), shard_tokens=700, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert len(meta["train"]) >= 4  # documents cross shard boundaries
    tok = load_tokenizer(out / "tokenizer.json")
    decoded = []
    for split in ("train", "val"):
        data, stream = _stream(out, split)
        h = as_hf_dataset(out, split=split)
        rows = [np.asarray(r, dtype=np.int64) for r in h["input_ids"]]
        assert len(h) == meta["documents"][split]
        assert np.array_equal(np.concatenate(rows), stream)  # lossless: the rows are the split's stream
        assert all(r[-1] == data.eot_id and (r[:-1] != data.eot_id).all() for r in rows)
        decoded += [tok.decode(r[:-1].tolist()) for r in rows]
        assert f"split {split}: one row per document" in h.info.description and h.split == split
    assert sorted(decoded) == sorted(texts)  # every document, whole, once
    t = as_hf_dataset(out).with_format("torch")[0]["input_ids"]
    assert t.dtype.is_floating_point is False and str(t.dtype) == "torch.int64"


def test_as_hf_dataset_windows_are_the_loaders():
    d = small_data()
    data = TokenData(d)
    h = as_hf_dataset(d, seq_len=16)
    w = _Windows(data.train, 16)
    assert len(h) == w.n and h.features["input_ids"].length == 17
    rows = np.asarray(h.with_format("numpy")["input_ids"])
    assert rows.shape == (w.n, 17)
    assert all(np.array_equal(rows[i], w.get(i)) for i in range(w.n))
    v = as_hf_dataset(d, split="val", seq_len=16)
    assert np.array_equal(np.asarray(v.with_format("numpy")["input_ids"])[0], _Windows(data.val, 16).get(0))


def test_as_hf_dataset_refusals(tmp_path):
    d = small_data()
    with pytest.raises(UserError, match="split must be 'train' or 'val', got 'test'"):
        as_hf_dataset(d, split="test")
    for bad in (0, -4, 2.0, True):
        with pytest.raises(UserError, match="seq_len must be a positive integer or None"):
            as_hf_dataset(d, seq_len=bad)
    with pytest.raises(UserError, match=r"the val split of .* has no window of 100001 tokens"):
        as_hf_dataset(d, split="val", seq_len=100000)
    # opened and checked as for training: an id outside the vocabulary is refused, never returned
    bad = shutil.copytree(d, tmp_path / "bad")
    shard = np.fromfile(bad / "train_00000.bin", dtype=np.uint16)
    shard[5] = 9999
    shard.tofile(bad / "train_00000.bin")
    with pytest.raises(UserError, match="train_00000.bin: holds token id 9,999, not below vocab_size 416"):
        as_hf_dataset(bad)
    with pytest.raises(UserError, match="is not a prepared data folder"):
        as_hf_dataset(tmp_path)
