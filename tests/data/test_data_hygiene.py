"""Data hygiene: a folder source reads only its data files (README, LICENSE, metadata... are skipped and named);
Parquet needs pyarrow only when read; the end-of-text token is found right (Llama 3: 128001) or named with
eot_token; a prepared folder's shards may not link outside it, and its ids are read once per shard file (a
cache outside the folder), while every batch the loader returns is still checked."""

import base64
import gzip
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from mxtrain.data import Loader, TokenData, documents, load_tokenizer, prepare, val_batches
from mxtrain.data import loader as loader_mod
from mxtrain.errors import UserError

from train_helpers import ROOT, SENTENCES, run_main, small_data


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own record of checked shards."""
    monkeypatch.setenv("MXTRAIN_CACHE", str(tmp_path / "mxcache"))


def _text(n_paras=40, seed=1):
    rnd = random.Random(seed)
    return "\n\n".join(" ".join(rnd.choice(SENTENCES) for _ in range(8)) for _ in range(n_paras))


README = "# My dataset\n\nDATASET CARD: license cc-by, do not train on this line.\n"


@pytest.fixture
def messy(tmp_path):
    """A folder as people download them: data files next to a card, a license, git files, a prepared folder."""
    d = tmp_path / "messy"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(_text(20, 1))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": f"row {i}. " + _text(1, i)}) + "\n" for i in range(30)))
    (d / "sub" / "c.txt").write_text(_text(10, 2))
    (d / "README.md").write_text(README)
    (d / "sub" / "README.txt").write_text(README)
    (d / "LICENSE").write_text("Apache License 2.0 ... DO NOT TRAIN\n")
    (d / "dataset_infos.json").write_text('{"default": {"description": "DO NOT TRAIN"}}')
    (d / "notes.bin").write_bytes(b"\x00\x01\x02")
    (d / "empty.txt").write_text("")
    (d / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (d / ".git" / "objects").mkdir(parents=True)
    (d / ".git" / "objects" / "x.txt").write_text("DO NOT TRAIN\n")
    shutil.copytree(small_data(), d / "prepared")
    return d


def _notes(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "skipped" in ln]


def test_folder_reads_only_data_files_and_names_the_rest(messy, capsys):
    docs = list(documents([str(messy)]))
    names = {n for n, _ in docs}
    assert names == {"a.txt", "b.jsonl", "c.txt"}, names
    assert not any("DO NOT TRAIN" in t or "DATASET CARD" in t for _, t in docs)
    cap = capsys.readouterr()
    notes = _notes(cap.out)
    assert len(notes) == 2, cap.out  # one line for what is not data, one for what is empty
    not_data = next(n for n in notes if "not data" in n)
    assert not_data.startswith(f"mxtrain: {messy}: skipped 8 files that are not data: ")
    for name in (".git/", ".gitattributes", "LICENSE", "README.md", "dataset_infos.json", "notes.bin",
                 "prepared/ (a prepared data folder)", "sub/README.txt"):
        assert name in not_data, (name, not_data)
    assert "skipped 1 file that is empty: empty.txt" in next(n for n in notes if "empty" in n)
    assert cap.err == ""


def test_prepare_of_a_folder_records_only_data_files(messy, tmp_path, capsys):
    out = prepare([str(messy)], tmp_path / "out", vocab_size=512, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sources"] == [str(messy / "a.txt"), str(messy / "b.jsonl"), str(messy / "sub" / "c.txt")]
    assert len(_notes(capsys.readouterr().out)) == 2  # logged once, though the sources are read twice
    # the same tokens as naming the three data files
    ref = prepare([str(messy / "a.txt"), str(messy / "b.jsonl"), str(messy / "sub" / "c.txt")], tmp_path / "ref",
                  vocab_size=512, progress=False)
    assert (out / "train_00000.bin").read_bytes() == (ref / "train_00000.bin").read_bytes()


def test_doc_file_named_explicitly_is_read(messy):
    docs = [t for _, t in documents([str(messy / "README.md")])]
    assert len(docs) == 1 and docs[0].startswith("# My dataset\n\nDATASET CARD")


def test_folder_without_data_refused_naming_what_it_holds(tmp_path):
    d = tmp_path / "card"
    d.mkdir()
    (d / "README.md").write_text(README)
    (d / "LICENSE").write_text("MIT\n")
    with pytest.raises(UserError, match=r"folder .*card holds no data files \(\.txt, .*save_to_disk folder\); "
                                        r"skipped not data: LICENSE, README.md") as e:
        prepare([str(d)], tmp_path / "out", vocab_size=512, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_compressed_data_mxtrain_cannot_read(tmp_path, capsys):
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text(_text())
    (d / "b.jsonl.zst").write_bytes(b"(\xb5/\xfd fake zstd")
    assert {n for n, _ in documents([str(d)])} == {"a.txt"}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mxtrain: warning: ")
    assert "skipped 1 compressed file(s) mxtrain cannot read: b.jsonl.zst; decompress them" in err[0]
    with pytest.raises(UserError, match=r"b.jsonl.zst: unknown file type; decompress it first"):
        list(documents([str(d / "b.jsonl.zst")]))


def test_gzipped_text_is_read(tmp_path):
    text = _text()
    (tmp_path / "a.txt").write_text(text)
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write(text)
    plain = [t for _, t in documents([str(tmp_path / "a.txt")])]
    assert [t for _, t in documents([str(tmp_path / "b.txt.gz")])] == plain and len(plain) > 1


def test_cli_logs_skipped_files(messy, tmp_path):
    p = run_main("data", "prepare", str(messy), "--out", str(tmp_path / "out"), "--vocab-size", "512",
                 "--no-progress")   # (mxtrain.cli.core.main in this process, as run_cli runs it)
    assert p.returncode == 0, p.stderr
    assert "skipped 8 files that are not data: .git/, .gitattributes, LICENSE, README.md" in p.stdout
    assert "Traceback" not in p.stderr


# ---- Parquet: pyarrow only when a Parquet file is read --------------------------------------------------------

def test_pyarrow_not_imported_for_other_sources(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(_text())
    code = ("import sys; sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None\n"
            "from mxtrain.data import prepare, TokenData, Loader\n"
            f"out = prepare([{str(src)!r}], {str(tmp_path / 'out')!r}, vocab_size=512, progress=False)\n"
            "Loader(TokenData(out), 16, 2, seed=0).next()\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().splitlines()[-1] == "ok", p.stderr   # (after prepare's summary)


def test_parquet_without_pyarrow_is_one_clear_error_before_work(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [_text(2, i) for i in range(20)]}), tmp_path / "a.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError) as e:
        prepare([str(tmp_path / "a.parquet")], tmp_path / "out", vocab_size=512, progress=False)
    from mxtrain.data import sources
    assert str(e.value) == sources.PARQUET_HINT and "pip install 'mxtrain[parquet]'" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_parquet_without_text_column_refused_before_work(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x " * 50] * 10, "id": list(range(10))}), tmp_path / "a.parquet")
    prep = sys.modules["mxtrain.data.prepare"]
    monkeypatch.setattr(prep, "train_bpe", lambda *a, **k: pytest.fail("tokenizer training started"))
    with pytest.raises(UserError, match=r"a.parquet: Parquet file has no 'text' column \(columns: body, id\); "
                                        r"choose the text column with --text-field"):
        prepare([str(tmp_path / "a.parquet")], tmp_path / "out", vocab_size=512, progress=False)


# ---- end of text ---------------------------------------------------------------------------------------------

def _wordlevel_json(path, vocab, added):
    """A tokenizer.json: a word-level model over ``vocab`` ({word: id}) plus the special tokens ``added``, which
    get the ids after the vocab, in order (as in Meta's Llama 3 file: 128,000 words, then 128000 =
    <|begin_of_text|>, 128001 = <|end_of_text|> ...)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens([AddedToken(t, special=True) for t in added])
    tk.save(str(path))
    return path


LLAMA3_ADDED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
WORDS = {"[UNK]": 0, "hello": 1, "world": 2, "fox": 3}
LLAMA3_WORDS = {**WORDS, **{f"w{i}": i for i in range(4, 128000)}}


def test_llama3_tokenizer_json_gets_end_of_text_128001(tmp_path):
    p = _wordlevel_json(tmp_path / "tokenizer.json", LLAMA3_WORDS, LLAMA3_ADDED)
    tok = load_tokenizer(p)
    assert (tok.eot_id, tok.eot_token) == (128001, "<|end_of_text|>")  # not <|begin_of_text|> = 128000
    assert tok.vocab_size == 128010
    assert load_tokenizer(p, eot_token="<|eot_id|>").eot_id == 128009
    src = tmp_path / "t.txt"
    src.write_text("\n\n".join("hello world fox " * 30 for _ in range(30)))
    out = prepare([str(src)], tmp_path / "out", tokenizer=str(p), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["eot_id"], meta["eot_token"], meta["dtype"]) == (128001, "<|end_of_text|>", "uint32")
    ids = np.concatenate([np.fromfile(out / f, dtype=np.uint32) for f in ("train_00000.bin", "val_00000.bin")])
    assert int((ids == 128001).sum()) == sum(meta["documents"].values()) and 128000 not in ids


def _llama3_like_tiktoken(path):
    """A rank file of 128,000 byte-level BPE tokens like Llama 3's (all bytes, all byte pairs, then byte
    triples), each rank an exact merge of two lower ranks; no special tokens, as in the real file."""
    toks = [bytes([b]) for b in range(256)] + [bytes(p) for p in itertools.product(range(256), repeat=2)]
    toks += [bytes(t) for t in itertools.islice(itertools.product(range(256), repeat=3), 128000 - len(toks))]
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(toks)))
    return path


def test_llama3_tiktoken_file_gets_metas_special_tokens(tmp_path):
    tok = load_tokenizer(_llama3_like_tiktoken(tmp_path / "tokenizer.model"))
    assert (tok.eot_id, tok.eot_token) == (128001, "<|end_of_text|>")
    assert tok.vocab_size == 128256  # Meta's vocab: 128,000 ranks + 256 special tokens
    hf = tok.impl
    assert [hf.token_to_id(t) for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                        "<|eot_id|>", "<|reserved_special_token_246|>")] == \
        [128000, 128006, 128007, 128009, 128255]
    assert tok.decode(tok.encode_batch(["hello world"])[0]) == "hello world"
    assert load_tokenizer(tmp_path / "tokenizer.model", eot_token="<|eot_id|>").eot_id == 128009


def test_other_tiktoken_file_appends_named_end_of_text(tmp_path):
    lines = [base64.b64encode(bytes([b])).decode() + f" {b}" for b in range(256)]
    lines += [base64.b64encode(b"th").decode() + " 256", base64.b64encode(b"the").decode() + " 257"]
    p = tmp_path / "toy.tiktoken"
    p.write_text("\n".join(lines) + "\n")
    assert (load_tokenizer(p).eot_id, load_tokenizer(p).eot_token) == (258, "<|end_of_text|>")
    assert (load_tokenizer(p, eot_token="<|doc|>").eot_id, load_tokenizer(p, eot_token="<|doc|>").eot_token) == \
        (258, "<|doc|>")


def test_tokenizer_without_end_of_text_refused_then_named(tmp_path):
    p = _wordlevel_json(tmp_path / "tok.json", WORDS, ["<pad>", "<|doc_end|>"])
    with pytest.raises(UserError) as e:
        load_tokenizer(p)
    msg = str(e.value)
    assert "no end-of-text token" in msg and "--eot-token TOKEN" in msg and "\n" not in msg
    assert "its special tokens: <|doc_end|>, <pad>" in msg  # likely end-of-text names first
    src = tmp_path / "t.txt"
    src.write_text("\n\n".join("hello world " * 30 for _ in range(30)))
    with pytest.raises(UserError, match="no end-of-text token"):
        prepare([str(src)], tmp_path / "out", tokenizer=str(p), progress=False)
    assert not (tmp_path / "out").exists()
    out = prepare([str(src)], tmp_path / "out", tokenizer=str(p), eot_token="<|doc_end|>", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["eot_id"], meta["eot_token"]) == (5, "<|doc_end|>")
    ids = np.concatenate([np.fromfile(out / f, dtype=np.uint16) for f in ("train_00000.bin", "val_00000.bin")])
    assert int((ids == 5).sum()) == meta["documents"]["train"] + meta["documents"]["val"]
    # the folder's tokenizer comes back with the end of text its meta.json names
    assert TokenData(out).tokenizer().eot_id == 5
    meta["eot_id"] = 4
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"its end-of-text id 5 is not meta.json's eot_id 4"):
        TokenData(out).tokenizer()


def test_unknown_eot_token_lists_candidates(tmp_path):
    p = _wordlevel_json(tmp_path / "tokenizer.json", LLAMA3_WORDS, LLAMA3_ADDED)
    src = tmp_path / "t.txt"
    src.write_text("hello world " * 300)
    with pytest.raises(UserError) as e:
        prepare([str(src)], tmp_path / "out", tokenizer=str(p), eot_token="<|endoftext|>", progress=False)
    msg = str(e.value)
    assert "--eot-token '<|endoftext|>' is not a token of this tokenizer" in msg
    assert "its special tokens: <|end_of_text|>, <|end_header_id|>, <|eot_id|>, <|begin_of_text|>, " in msg
    assert msg.endswith(" and 2 more") and "\n" not in msg
    assert not (tmp_path / "out").exists()
    for bad in ("", "  ", 5):
        with pytest.raises(UserError, match="--eot-token must be the text of a token"):
            prepare([str(src)], tmp_path / "out", tokenizer=str(p), eot_token=bad, progress=False)


def test_ordinary_token_as_end_of_text_warns(tmp_path, capsys):
    p = _wordlevel_json(tmp_path / "tokenizer.json", LLAMA3_WORDS, LLAMA3_ADDED)
    assert load_tokenizer(p, eot_token="fox").eot_id == 3
    err = capsys.readouterr().err
    assert "mxtrain: warning: " in err and "'fox' is an ordinary token of the vocabulary" in err


def test_trained_bpe_takes_the_eot_name(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(_text(60))
    out = prepare([str(src)], tmp_path / "out", vocab_size=512, eot_token="<|end_of_text|>", progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["eot_id"], meta["eot_token"]) == (0, "<|end_of_text|>")
    tok = load_tokenizer(out / "tokenizer.json")  # the saved file finds it by name
    assert (tok.eot_id, tok.eot_token) == (0, "<|end_of_text|>")


class _FakeSP:
    """A stand-in for sentencepiece.SentencePieceProcessor: pieces <unk>, <s>, </doc>, then words; no eos."""
    pieces = ["<unk>", "<s>", "</doc>", "hello", "world"]

    def __init__(self, model_file):
        pass

    def get_piece_size(self):
        return len(self.pieces)

    def id_to_piece(self, i):
        return self.pieces[i]

    def piece_to_id(self, piece):
        return self.pieces.index(piece) if piece in self.pieces else 0

    def is_control(self, i):
        return i in (1, 2)

    def is_unknown(self, i):
        return i == 0

    def eos_id(self):
        return -1


def test_sentencepiece_without_eos_needs_eot_token(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", types.SimpleNamespace(SentencePieceProcessor=_FakeSP))
    p = tmp_path / "sp.model"
    p.write_bytes(b"\x0a\x0bnot a real model")
    with pytest.raises(UserError, match=r"no end-of-sentence piece .* --eot-token TOKEN .*its special tokens: "
                                        r"</doc>, <unk>, <s>"):
        load_tokenizer(p)
    tok = load_tokenizer(p, eot_token="</doc>")
    assert (tok.eot_id, tok.eot_token) == (2, "</doc>")
    with pytest.raises(UserError, match="'</eos>' is not a piece of this SentencePiece model"):
        load_tokenizer(p, eot_token="</eos>")


# ---- a prepared folder: links, and ids read once ----------------------------------------------------------

def _copy(tmp_path, name="copy"):
    return shutil.copytree(small_data(), tmp_path / name)


def test_shard_linking_outside_the_folder_refused(tmp_path):
    d = _copy(tmp_path)
    outside = tmp_path / "elsewhere.bin"
    shutil.move(d / "train_00000.bin", outside)
    (d / "train_00000.bin").symlink_to(outside)
    with pytest.raises(UserError) as e:
        TokenData(d)
    msg = str(e.value)
    assert f"{d / 'train_00000.bin'}: shard is a symbolic link to {outside.resolve()}, outside the data folder" in msg
    assert "prepare the data again" in msg and "\n" not in msg
    # a link inside the folder is the folder's own file: it opens
    (d / "train_00000.bin").unlink()
    shutil.move(outside, d / "store.bin")
    (d / "train_00000.bin").symlink_to("store.bin")
    assert len(TokenData(d).train[0]) == 11650


def test_tokenizer_linking_outside_refused_and_linked_folder_opens(tmp_path):
    d = _copy(tmp_path)
    shutil.move(d / "tokenizer.json", tmp_path / "tok.json")
    (d / "tokenizer.json").symlink_to(tmp_path / "tok.json")
    with pytest.raises(UserError, match=r"tokenizer.json: the tokenizer is a symbolic link to .*tok.json, outside"):
        TokenData(d)
    # the folder itself may be reached through a link
    link = tmp_path / "link"
    link.symlink_to(small_data(), target_is_directory=True)
    assert TokenData(link).vocab_size == 416


def test_shard_that_is_another_shard_refused(tmp_path):
    d = _copy(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    n = meta["train"][0]["tokens"]
    (d / "val_00000.bin").unlink()
    os.link(d / "train_00000.bin", d / "val_00000.bin")  # the training tokens as validation
    meta["val"][0]["tokens"], meta["val_tokens"] = n, n
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"val_00000.bin: shard is the same file as train_00000.bin \(a link\)"):
        TokenData(d)


@pytest.fixture
def scans(monkeypatch):
    """Count the shard reads of the id check."""
    calls = []
    real = loader_mod._scan_ids

    def counting(arr, vocab, p):
        calls.append(p.name)
        return real(arr, vocab, p)
    monkeypatch.setattr(loader_mod, "_scan_ids", counting)
    return calls


def test_ids_read_once_per_shard_file(tmp_path, scans):
    src = tmp_path / "t.txt"
    src.write_text(_text(150))
    out = prepare([str(src)], tmp_path / "out", vocab_size=512, shard_tokens=4000, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    n_shards = len(meta["train"]) + len(meta["val"])
    assert n_shards >= 3
    before = sorted(p.name for p in out.iterdir())
    TokenData(out)
    assert scans == []  # prepare checked every id it wrote and recorded it
    d = shutil.copytree(out, tmp_path / "copy")
    TokenData(d)
    assert sorted(scans) == sorted(p.name for p in d.glob("*.bin")) and len(scans) == n_shards
    scans.clear()
    TokenData(d)
    assert scans == []  # checked before, unchanged
    # the record lives in the user's cache, not in the folder (a shared folder cannot bring its own)
    assert sorted(p.name for p in out.iterdir()) == before and sorted(p.name for p in d.iterdir()) == before
    assert list((tmp_path / "mxcache" / "checked-shards").glob("*.json"))
    # a shard written again is read again
    shard = d / "train_00001.bin"
    data = shard.read_bytes()
    shard.write_bytes(data)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    TokenData(d)
    assert scans == ["train_00001.bin"]


def test_swapped_in_shard_with_same_size_and_mtime_is_read(tmp_path, scans):
    d = _copy(tmp_path)
    TokenData(d)
    shard = d / "val_00000.bin"
    st = shard.stat()
    bad = np.fromfile(shard, dtype=np.uint16)
    bad[3] = 60000
    fake = tmp_path / "fake.bin"
    bad.tofile(fake)
    os.replace(fake, shard)  # another file (inode) of the same size, given the old modification time
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(UserError, match=r"val_00000.bin: holds token id 60,000, not below vocab_size 416 of "
                                        r"meta.json, at token 3"):
        TokenData(d)


def test_unwritable_cache_still_checks(tmp_path, monkeypatch, scans):
    monkeypatch.setenv("MXTRAIN_CACHE", "/dev/null/cannot")
    d = _copy(tmp_path)
    TokenData(d)
    TokenData(d)
    assert len(scans) == 4  # read on every open, without error
    shard = np.fromfile(d / "train_00000.bin", dtype=np.uint16)
    shard[100] = 416
    shard.tofile(d / "train_00000.bin")
    with pytest.raises(UserError, match="holds token id 416"):
        TokenData(d)


def test_batches_are_checked_after_open(tmp_path):
    d = _copy(tmp_path)
    data = TokenData(d)
    loader = Loader(data, 16, 4, seed=0)
    loader.next()
    for name in ("train_00000.bin", "val_00000.bin"):  # changed on disk while training
        m = np.memmap(d / name, dtype=np.uint16, mode="r+")
        m[:] = 500
        m.flush()
        del m
    with pytest.raises(UserError, match=r"train_00000.bin: holds token id 500, not below vocab_size 416, at token "
                                        r"[\d,]+ \(the shard changed after it was opened\?\)"):
        loader.next()
    assert loader.pos == 4  # the failed batch was not consumed
    with pytest.raises(UserError, match=r"val_00000.bin: holds token id 500, not below vocab_size 416, at token 0 "):
        next(val_batches(data, 16, 4, 128))
