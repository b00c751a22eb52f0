"""Data: sources (text, JSONL, .json.gz, Parquet, built-in), encoding fallback, BPE, shards, loader."""

import gzip
import json

import numpy as np
import pytest

from mxtrain.data import Loader, TokenData, documents, load_tokenizer, prepare, val_batches
from mxtrain.data.sources import decode_bytes
from mxtrain.errors import UserError

from train_helpers import small_data, tmpdir


def test_decode_falls_back_to_cp1252_per_line():
    raw = "caf\u00e9 ok\n".encode() + b"na\xefve \x93quoted\x94\n"
    assert decode_bytes(raw) == "caf\u00e9 ok\nna\u00efve \u201cquoted\u201d\n"


def test_builtin_corpus_documents():
    n = {"sotu": 0, "wiki": 0}
    size = 0
    for src, text in documents(["builtin"]):
        n[src] += 1
        size += len(text)
    assert n["sotu"] >= 240 and n["wiki"] >= 10000
    assert size > 15_000_000


def test_builtin_corpus_asked_by_two_processes_at_once_is_prepared_once(tmp_path, monkeypatch, capsys):
    """``ensure_builtin`` from two ranks (or runs, or test workers) at once: the first prepares, the second
    says it waits and then reads the same folder; neither is refused as a concurrent ``data prepare``
    (before, the second rank of ``train --nproc 2`` without ``--data`` on a fresh machine stopped there)."""
    import importlib
    import threading
    import time

    P = importlib.import_module("mxtrain.data.prepare")   # (the package's ``prepare`` is the function)
    monkeypatch.setenv("MXTRAIN_DATA", str(tmp_path / "cache"))
    calls, started = [], threading.Event()

    def slow_prepare(sources, out, vocab_size, force, progress):   # stands in for the ~30 s preparation
        calls.append(out)
        started.set()
        time.sleep(0.5)
        out.mkdir(parents=True)
        (out / "meta.json").write_text("{}")
        return out
    monkeypatch.setattr(P, "prepare", slow_prepare)
    got, errors = [], []

    def ask():
        try:
            got.append(P.ensure_builtin(512, progress=False))
        except Exception as e:   # noqa: BLE001 - a refusal is what the test looks for
            errors.append(e)
    first = threading.Thread(target=ask)
    first.start()
    assert started.wait(10)
    ask()                                        # while the first one prepares
    first.join()
    assert not errors and len(calls) == 1 and got == [calls[0], calls[0]]
    assert "waiting for another process" in capsys.readouterr().err
    assert P.ensure_builtin(512, progress=False) == calls[0] and len(calls) == 1   # prepared: no lock needed


def test_formats(tmp_path):
    rows = [{"text": f"document number {i} " * 20, "id": i} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(tmp_path / "b.json.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), tmp_path / "c.parquet")
    for name in ("a.jsonl", "b.json.gz", "c.parquet"):
        docs = list(documents([str(tmp_path / name)]))
        assert len(docs) == 30 and docs[3][1] == rows[3]["text"], name
    assert len(list(documents([str(tmp_path)]))) == 90  # a folder: all readable files


def test_bad_inputs(tmp_path):
    with pytest.raises(UserError, match="not found"):
        list(documents([str(tmp_path / "nope.txt")]))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="empty"):
        list(documents([str(tmp_path / "empty.txt")]))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: unreadable JSON line"):
        list(documents([str(tmp_path / "bad.jsonl")]))
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match="'text' field"):
        list(documents([str(tmp_path / "nofield.jsonl")]))


def test_prepare_layout_and_tokenizer_roundtrip():
    d = small_data()
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] % 32 == 0 and meta["dtype"] == "uint16"
    assert meta["train_tokens"] > 5000 and meta["val_tokens"] > 0
    data = TokenData(d)
    tok = load_tokenizer(data.tokenizer_path())
    ids = tok.encode_batch(["The quick brown fox."])[0]
    assert tok.decode(ids) == "The quick brown fox."
    # every document ends with the end-of-text id
    assert data.eot_id in np.asarray(data.train[0][:2000])


def test_prepare_refuses_existing_and_cleans_up(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text("hello world. " * 500)
    out = prepare([str(src)], tmp_path / "p", vocab_size=512, progress=False)
    with pytest.raises(UserError, match="already exists"):
        prepare([str(src)], out, vocab_size=512, progress=False)
    with pytest.raises(UserError, match="multiple of 32"):
        prepare([str(src)], tmp_path / "q", vocab_size=500, progress=False)
    assert not any(p.name.startswith(".q") for p in tmp_path.iterdir())  # no temporary folder left


def test_truncated_shard_is_an_error(tmp_path):
    import shutil
    d = shutil.copytree(small_data(), tmp_path / "copy")
    shard = d / "train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(UserError, match="truncated"):
        TokenData(d)


def test_loader_deterministic_resumable_and_rank_split():
    data = TokenData(small_data())
    a = Loader(data, 16, 4, seed=1)
    batches = [a.next()[0] for _ in range(5)]
    b = Loader(data, 16, 4, seed=1)
    for _ in range(2):
        b.next()
    st = b.state_dict()
    c = Loader(data, 16, 4, seed=1)
    c.load_state_dict(st)
    assert all((c.next()[0] == batches[i]).all() for i in range(2, 5))
    assert not (Loader(data, 16, 4, seed=2).next()[0] == batches[0]).all()
    # two ranks with micro-batch 2 see exactly the single-process global batch of 4
    r0, r1 = Loader(data, 16, 2, seed=1, rank=0, world_size=2), Loader(data, 16, 2, seed=1, rank=1, world_size=2)
    for i in range(3):
        glob = np.concatenate([r0.next()[0].numpy(), r1.next()[0].numpy()])
        assert (glob == batches[i].numpy()).all()
    with pytest.raises(UserError, match="does not match"):
        Loader(data, 32, 4, seed=1).load_state_dict(st)


def test_val_batches_fixed():
    data = TokenData(small_data())
    v1 = [x for x, _ in val_batches(data, 16, 4, 128)]
    v2 = [x for x, _ in val_batches(data, 16, 4, 128)]
    assert len(v1) >= 1 and all((a == b).all() for a, b in zip(v1, v2))
    x, y = next(val_batches(data, 16, 4, 128))
    assert (x[:, 1:] == y[:, :-1]).all()


def test_tiktoken_file_converts(tmp_path):
    import base64
    # a toy rank file: all bytes, then merges "th", "the"
    lines = [base64.b64encode(bytes([b])).decode() + f" {b}" for b in range(256)]
    lines += [base64.b64encode(b"th").decode() + " 256", base64.b64encode(b"the").decode() + " 257"]
    p = tmp_path / "toy.tiktoken"
    p.write_text("\n".join(lines) + "\n")
    tok = load_tokenizer(p)
    ids = tok.encode_batch(["the"])[0]
    assert ids == [257]
    assert tmpdir().exists()


def test_prepare_records_the_corpus_sources_outside_the_fingerprint(tmp_path):
    """Files of a ``mxtrain data corpus`` folder (``CORPUS/train/x.jsonl`` beside ``CORPUS/manifest.json``): the
    prepared ``meta.json`` records every domain's sources with their versions (``corpus_sources``), so that two
    builds with different fingerprints say which source moved; the record is not content, so the same text
    prepared without a manifest has the same fingerprint. Files without a manifest record none."""
    from mxtrain.data.shards import fingerprint
    text = "\n".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * (i % 7 + 1)}) for i in range(300))
    corpus, plain = tmp_path / "corpus", tmp_path / "plain"
    for d in (corpus / "train", plain):
        d.mkdir(parents=True)
        (d / "docs.jsonl").write_text(text + "\n")
    srcs = [{"name": "debian:sqlite3-doc", "version": "3.40.1-2+deb12u2", "documents": 774, "bytes": 6026655,
             "license": "public domain"}]
    (corpus / "manifest.json").write_text(json.dumps({"format": 1, "domains": {"docs": {"documents": 300,
                                                                                       "sources": srcs}}}))
    a = prepare([str(corpus / "train" / "docs.jsonl")], tmp_path / "a", vocab_size=512, progress=False)
    b = prepare([str(plain / "docs.jsonl")], tmp_path / "b", vocab_size=512, progress=False)
    meta_a, meta_b = (json.loads((p / "meta.json").read_text()) for p in (a, b))
    assert meta_a["corpus_sources"] == {"docs": [{"name": "debian:sqlite3-doc", "version": "3.40.1-2+deb12u2",
                                                  "documents": 774, "bytes": 6026655}]}
    assert "corpus_sources" not in meta_b
    assert fingerprint(a) == fingerprint(b) is not None
    # a run on the folder opens it and copies the record into its run.json
    from mxtrain.cli.core import main
    run = tmp_path / "run"
    assert main(["train", "--exp", "debug", "--recipe", "bf16", "--data", str(a), "--seq-len", "32", "--batch-size",
                 "4", "--steps", "1", "--eval-tokens", "128", "--out", str(run), "--no-progress",
                 "--set", "schedule.horizon_steps=2"]) == 0
    assert json.loads((run / "run.json").read_text())["data_meta"]["corpus_sources"] == meta_a["corpus_sources"]


def test_prepare_says_how_a_corpus_build_differs_from_the_reference(tmp_path, capsys, monkeypatch):
    """After its summary line, ``prepare`` of a ``mxtrain data corpus`` folder says which sources differ from the
    build the archived studies trained on (``mxtrain.data.reference``), at that build's vocabulary (here the
    reference's vocabulary is set to the one this test's small BPE ends with); another vocabulary gets no such
    line."""
    from mxtrain.data import reference as R
    text = "\n".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * (i % 7 + 1)}) for i in range(300))
    corpus = tmp_path / "corpus"
    (corpus / "train").mkdir(parents=True)
    (corpus / "train" / "docs.jsonl").write_text(text + "\n")
    srcs = [{"name": "debian:sqlite3-doc", "version": "3.40.1-2+deb12u3", "documents": 774, "bytes": 6026655}]
    (corpus / "manifest.json").write_text(json.dumps({"format": 1, "domains": {"docs": {"documents": 300,
                                                                                       "sources": srcs}}}))
    first = prepare([str(corpus / "train" / "docs.jsonl")], tmp_path / "a0", vocab_size=512, progress=False)
    assert "archived 125m ladder" not in capsys.readouterr().out   # (the BPE's vocabulary is not the reference's)
    monkeypatch.setitem(R.REFERENCE, "vocab_size", json.loads((first / "meta.json").read_text())["tokenizer_vocab_size"])
    prepare([str(corpus / "train" / "docs.jsonl")], tmp_path / "a", vocab_size=512, progress=False)
    out = capsys.readouterr().out
    note = [x for x in out.splitlines() if x.startswith("note: ") and "archived 125m ladder" in x]
    assert len(note) == 1, out
    assert "debian:sqlite3-doc 3.40.1-2+deb12u3, not 3.40.1-2+deb12u2" in note[0]
    assert "debian:dict-gcide missing" in note[0] and "will not resume" in note[0]
    monkeypatch.setitem(R.REFERENCE, "vocab_size", 32768)
    prepare([str(corpus / "train" / "docs.jsonl")], tmp_path / "b", vocab_size=512, progress=False)
    assert "archived 125m ladder" not in capsys.readouterr().out
