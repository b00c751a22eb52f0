"""Data checks: a damaged or crafted prepared folder is refused on open; a source that is not text, an absurd
or unreachable --vocab-size are refused or reported; shard ids are never wrapped into uint16."""

import json
import random
import shutil
import sys

import numpy as np
import pytest

from mxtrain.data import TokenData, prepare
from mxtrain.data.prepare import _ShardWriter, shard_dtype
from mxtrain.data.tokenizer import load_tokenizer, train_bpe
from mxtrain.errors import UserError

from train_helpers import SENTENCES, one_line_error, run_main, small_data




def _copy(tmp_path):
    return shutil.copytree(small_data(), tmp_path / "copy")


def _edit_meta(d, fn):
    meta = json.loads((d / "meta.json").read_text())
    fn(meta)
    (d / "meta.json").write_text(json.dumps(meta))


def _set(**kw):
    return lambda m: m.update(kw)


def _set_shard(split, **kw):
    return lambda m: m[split][0].update(kw)


def _outside(d):
    """A valid-looking shard outside the folder: with its name in meta.json it would load if names were not checked."""
    p = d.parent / "x.bin"
    shutil.copy(d / "train_00000.bin", p)
    return p


# (id, edit of meta.json or None, text written as meta.json or None, expected fragment of the message)
META_CASES = [
    ("not JSON", None, "{oops", "not valid JSON"),
    ("deep JSON", None, "[" * 100000, "not valid JSON"),
    ("a list", None, "[1, 2]", "expected a JSON object, found list"),
    ("not UTF-8", None, b"\xff\xfe{", "cannot read"),
    ("wrong format", _set(format="other-v9"), None, "unknown format 'other-v9'"),
    ("missing dtype", lambda m: m.pop("dtype"), None, "missing field 'dtype'"),
    ("missing train", lambda m: m.pop("train"), None, "missing field 'train'"),
    ("missing sources", lambda m: m.pop("sources"), None, "missing field 'sources'"),
    ("vocab a string", _set(vocab_size="416"), None, "field 'vocab_size' must be an integer"),
    ("vocab a bool", _set(vocab_size=True), None, "field 'vocab_size' must be an integer"),
    ("tokens a float", _set(train_tokens=1.5), None, "field 'train_tokens' must be an integer"),
    ("train a dict", _set(train={}), None, "field 'train' must be a list"),
    ("shard not an object", _set(val=["val_00000.bin"]), None, "val[0] must be an object"),
    ("shard tokens negative", _set_shard("val", tokens=-1), None, "non-negative integer"),
    ("tokens sum", _set(train_tokens=5), None, "train_tokens 5 is not the sum"),
    ("unknown dtype", _set(dtype="int64"), None, "unknown dtype 'int64'"),
    ("numpy-only dtype", _set(dtype="float32"), None, "unknown dtype 'float32'"),
    ("uint16 for a big vocab", _set(vocab_size=70016), None, "uint16 cannot hold"),
    ("vocab zero", _set(vocab_size=0), None, "vocab_size 0 is outside"),
    ("eot id outside", _set(eot_id=416), None, "eot_id 416 is not below vocab_size 416"),
    ("tokenizer vocab above vocab", _set(tokenizer_vocab_size=999), None, "tokenizer_vocab_size 999"),
    ("tokenizer path", _set(tokenizer="../tokenizer.json"), None, "not a plain file name"),
    ("shard ../x.bin", _set_shard("train", file="../x.bin"), None, "'../x.bin' is not a plain file name"),
    ("shard sub/x.bin", _set_shard("train", file="sub/x.bin"), None, "not a plain file name"),
    ("shard ..", _set_shard("val", file=".."), None, "not a plain file name"),
    ("shard absolute", "ABS", None, "is not a plain file name"),
    ("shard listed twice", _set_shard("val", file="train_00000.bin"), None, "listed twice"),
    ("shard is the tokenizer", _set_shard("val", file="tokenizer.json"), None, "listed twice"),
]


@pytest.mark.parametrize("case", META_CASES, ids=lambda c: c[0])
def test_bad_meta_refused_on_open(tmp_path, case):
    _, edit, text, fragment = case
    d = _copy(tmp_path)
    outside = _outside(d)
    if text is not None:
        (d / "meta.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    elif edit == "ABS":
        _edit_meta(d, _set_shard("train", file=str(outside)))
    else:
        _edit_meta(d, edit)
    with pytest.raises(UserError) as e:
        TokenData(d)
    msg = str(e.value)
    assert fragment in msg and "meta.json" in msg and "\n" not in msg, msg
    assert "prepare the data again" in msg


def test_token_id_outside_vocab_refused(tmp_path):
    d = _copy(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    shard = np.fromfile(d / "val_00000.bin", dtype=np.uint16)
    shard[7] = meta["vocab_size"]  # one id past the vocabulary
    shard.tofile(d / "val_00000.bin")
    with pytest.raises(UserError, match=r"val_00000.bin: holds token id 416, not below vocab_size 416"):
        TokenData(d)
    # the same with a meta.json that claims a smaller vocab than the shards use
    d2 = _copy(tmp_path / "b")
    _edit_meta(d2, _set(vocab_size=64, tokenizer_vocab_size=64))
    with pytest.raises(UserError, match=r"train_00000.bin: holds token id \d+, not below vocab_size 64"):
        TokenData(d2)


def test_shard_size_must_match_meta(tmp_path):
    d = _copy(tmp_path)
    shard = d / "train_00000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-2])  # one token short
    with pytest.raises(UserError, match=r"train_00000.bin: shard is truncated \(.*expected 11,650 tokens"):
        TokenData(d)
    shard.write_bytes(data + b"\x00\x00")
    with pytest.raises(UserError, match=r"train_00000.bin: shard is longer than meta.json says"):
        TokenData(d)
    shard.unlink()
    with pytest.raises(UserError, match=r"train_00000.bin: shard listed in meta.json is missing"):
        TokenData(d)
    shard.mkdir()
    with pytest.raises(UserError, match=r"train_00000.bin: shard listed in meta.json is missing \(or not a file\)"):
        TokenData(d)


def test_good_folder_still_opens():
    data = TokenData(small_data())
    assert data.dtype == np.uint16 and len(data.train) == 1 and data.vocab_size == 416
    assert int(np.asarray(data.train[0]).max()) < data.vocab_size


# ---- sources that are not text ------------------------------------------------------------------------------

def _text(n_paras=60):
    rnd = random.Random(1)
    return "\n\n".join(" ".join(rnd.choice(SENTENCES) for _ in range(8)) for _ in range(n_paras))


def _no_leftovers(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("kind", ["random", "nul", "utf16", "elf"])
def test_binary_source_refused_by_name(tmp_path, kind):
    good = tmp_path / "good.txt"
    good.write_text(_text())
    bad = tmp_path / "bad.txt"
    rnd = random.Random(0)
    if kind == "random":
        bad.write_bytes(rnd.randbytes(20000))
    elif kind == "nul":
        bad.write_bytes(b"hello\x00\x00\x00\x00" * 2000)
    elif kind == "utf16":
        bad.write_bytes(_text(5).encode("utf-16"))
    else:
        bad.write_bytes(b"\x7fELF\x02\x01\x01" + b"\x00" * 4000 + rnd.randbytes(4000))
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        prepare([str(good), str(bad)], out, vocab_size=512, progress=False)
    msg = str(e.value)
    assert str(bad) in msg and "\n" not in msg
    assert ("UTF-16" in msg) if kind == "utf16" else ("is not a text file" in msg and "binary file" in msg), msg
    _no_leftovers(tmp_path, out)


def test_other_binary_sources_refused(tmp_path):
    import gzip
    rnd = random.Random(0)
    junk = rnd.randbytes(5000)
    (tmp_path / "a.jsonl").write_bytes(junk)
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(junk)
    (tmp_path / "c.json.gz").write_bytes(junk)  # not gzip at all
    (tmp_path / "d.parquet").write_text("not parquet")
    for name, fragment in [("a.jsonl", "is not a text file"), ("b.jsonl.gz", "is not a text file"),
                           ("c.json.gz", "cannot read"), ("d.parquet", "is not a Parquet file")]:
        with pytest.raises(UserError, match=fragment) as e:
            prepare([str(tmp_path / name)], tmp_path / "out", vocab_size=512, progress=False)
        assert name in str(e.value)
        _no_leftovers(tmp_path, tmp_path / "out")


def test_binary_after_a_text_head_refused(tmp_path):
    # the first 64 KB are text, the rest is binary: the whole-file check on reading refuses it
    src = tmp_path / "mixed.txt"
    rnd = random.Random(0)
    head = (_text(400) * 2)[:70000].encode()
    src.write_bytes(head + rnd.randbytes(300000))
    with pytest.raises(UserError, match=r"mixed.txt is not a text file: \d+% of its characters"):
        prepare([str(src)], tmp_path / "out", vocab_size=512, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_partly_undecodable_text_warns_once_with_share(tmp_path, capsys):
    src = tmp_path / "mostly.txt"
    text = _text(200)
    src.write_bytes(text.encode() + b"\n\n\x00\x01\x02\x03 tail\n")
    out = prepare([str(src)], tmp_path / "out", vocab_size=512, progress=False)
    err = [ln for ln in capsys.readouterr().err.splitlines() if "mostly.txt" in ln]
    assert len(err) == 1, err  # once, though the file is read twice (tokenizer, then shards)
    assert err[0].startswith("mxtrain: warning: ") and "4 of its" in err[0] and "%" in err[0]
    assert TokenData(out).meta["train_tokens"] > 0


# ---- vocab sizes ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [0, -32, 500, 2**20 + 32, 2**21, 2**40, True, 512.0])
def test_absurd_vocab_refused_before_work(tmp_path, vocab, monkeypatch):
    src = tmp_path / "t.txt"
    src.write_text(_text())
    prep = sys.modules["mxtrain.data.prepare"]

    def no_training(*a, **k):
        raise AssertionError("tokenizer training started")
    monkeypatch.setattr(prep, "train_bpe", no_training)
    with pytest.raises(UserError, match="vocab size must be") as e:
        prepare([str(src)], tmp_path / "out", vocab_size=vocab, progress=False)
    assert "\n" not in str(e.value)
    _no_leftovers(tmp_path, tmp_path / "out")


def test_train_bpe_refuses_huge_vocab_before_allocating():
    def never():
        raise AssertionError("read the texts")
        yield ""
    for v in (2**30, 0, -1):
        with pytest.raises(UserError, match="vocab size must be"):
            train_bpe(never(), v)


def test_vocab_above_corpus_bytes_refused(tmp_path):
    src = tmp_path / "tiny.txt"
    src.write_text("hello world. " * 100)  # 1,300 bytes
    with pytest.raises(UserError, match=r"--vocab-size 4,096 is larger than the corpus \(1,300 bytes of text\)"):
        prepare([str(src)], tmp_path / "out", vocab_size=4096, progress=False)
    _no_leftovers(tmp_path, tmp_path / "out")
    # an error in the files comes first
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(UserError, match="bad.jsonl:2: unreadable JSON line"):
        prepare([str(bad)], tmp_path / "out", vocab_size=4096, progress=False)


def test_vocab_larger_than_corpus_supports_is_reported(tmp_path, capsys):
    src = tmp_path / "small.txt"
    src.write_text(_text(60))  # ~20 KB of five sentences: a few hundred BPE tokens at most
    out = prepare([str(src)], tmp_path / "out", vocab_size=4096, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    got = meta["tokenizer_vocab_size"]
    assert got < 4096 and meta["vocab_size"] == 32 * -(-got // 32)
    assert load_tokenizer(out / "tokenizer.json").vocab_size == got  # tokenizer and meta.json agree
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "supports only" in ln]
    assert len(warnings) == 1 and f"supports only {got:,} BPE tokens, fewer than --vocab-size 4,096" in warnings[0]
    assert warnings[0].startswith("mxtrain: warning: ")
    TokenData(out)


# ---- dtype: the tokenizer's largest id decides ---------------------------------------------------------------

def test_shard_dtype_choice():
    assert shard_dtype(512) == np.uint16 and shard_dtype(65536) == np.uint16
    assert shard_dtype(65537) == np.uint32 and shard_dtype(128256) == np.uint32 and shard_dtype(2**32) == np.uint32
    with pytest.raises(UserError, match="beyond what mxtrain stores"):
        shard_dtype(2**32 + 1)


def test_writer_never_wraps(tmp_path):
    w = _ShardWriter(tmp_path, "train", np.uint16, 100, vocab_size=70000)
    with pytest.raises(UserError, match="produced id 65,536"):
        w.write(np.array([1, 2, 65536], dtype=np.int64))
    w.close()
    w = _ShardWriter(tmp_path, "val", np.uint32, 100, vocab_size=1000)
    with pytest.raises(UserError, match="produced id 1,000, outside its vocabulary"):
        w.write(np.array([1000], dtype=np.int64))
    w.close()


def test_sparse_tokenizer_ids_get_uint32(tmp_path):
    """A tokenizer.json with 4 tokens but ids up to 70,000: uint32 shards, vocab from the largest id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tk = Tokenizer(models.WordLevel(vocab={"<|endoftext|>": 0, "[UNK]": 1, "world": 5, "hello": 70000},
                                    unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "tok.json"))
    tok = load_tokenizer(tmp_path / "tok.json")
    assert tok.vocab_size == 70001
    src = tmp_path / "t.txt"
    src.write_text("\n\n".join("hello world " * 50 for _ in range(40)))
    out = prepare([str(src)], tmp_path / "out", tokenizer=str(tmp_path / "tok.json"), progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["tokenizer_vocab_size"] == 70001 and meta["vocab_size"] == 70016
    data = TokenData(out)
    ids = np.concatenate([np.asarray(a) for a in data.train + data.val])
    assert set(np.unique(ids).tolist()) == {0, 5, 70000}  # 70000 kept, not wrapped to 4464


# ---- the command line: one error line, no traceback ----------------------------------------------------------
# (through mxtrain.cli.core.main in this process, as run_cli runs it: the refusals come before any work; a data
# refusal in a process of its own: tests/cli/test_cli.py's "unreadable JSON line", tests/data/test_prepare_force.py)

def test_cli_binary_source(tmp_path):
    bad = tmp_path / "photo.txt"
    bad.write_bytes(random.Random(0).randbytes(30000))
    p = run_main("data", "prepare", str(bad), "--out", str(tmp_path / "out"), "--vocab-size", "512", "--no-progress")
    one_line_error(p, "photo.txt is not a text file")
    assert not (tmp_path / "out").exists()


def test_cli_absurd_vocab(tmp_path):
    src = tmp_path / "t.txt"
    src.write_text(_text())
    p = run_main("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--vocab-size", "-4096", "--no-progress")
    one_line_error(p, "vocab size must be a multiple of 32 between 512 and 1,048,576", "-4096")
    assert not (tmp_path / "out").exists()


def test_cli_train_on_crafted_folder(tmp_path):
    d = _copy(tmp_path)
    _outside(d)
    _edit_meta(d, _set_shard("train", file="../x.bin"))
    p = run_main("train", "--exp", "debug", "--data", str(d), "--out", str(tmp_path / "run"), "--no-progress")
    one_line_error(p, "'../x.bin' is not a plain file name")
    assert not (tmp_path / "run").exists()


def test_validation_windows_spread_over_every_source():
    """A prepared validation split holds its sources one after another (the corpus's domains in file order), so
    evaluating its first windows measured one domain only (an H100 study on the 5-domain corpus evaluated books
    alone: training loss 5.3 against validation 6.75). The fixed windows are spread evenly over the split:
    every source contributes in proportion; all windows when the budget covers the split; the same windows at
    every call; ranks split them without overlap."""
    from mxtrain.data.loader import val_windows
    assert val_windows(10, 10 * 64, 64) == list(range(10))
    assert val_windows(10, 10**9, 64) == list(range(10))
    assert val_windows(10, 1, 64) == [0]
    w = val_windows(1000, 100 * 64, 64)
    assert len(w) == 100 and w == sorted(set(w)) and w[0] == 0 and w[-1] == 990
    # five equal sources of 200 windows each: 20 windows from each
    assert [sum(1 for i in w if 200 * d <= i < 200 * (d + 1)) for d in range(5)] == [20] * 5
    assert w == val_windows(1000, 100 * 64, 64)
