"""``prepare --force`` only ever replaces a folder prepare wrote: the working folder, the inputs, a file or a
foreign folder are refused before any work, and a replacement swaps the old folder out only at the end."""

import json
import os
import sys

import pytest

from mxtrain.data import TokenData, prepare
from mxtrain.errors import UserError

from train_helpers import one_line_error, run_cli, run_main

TEXT = "hello world. the quick brown fox. " * 300


def _prep(sources, out, **kw):
    return prepare([str(s) for s in sources], out, vocab_size=512, progress=False, **kw)


def _snapshot(folder):
    """Every file (and folder) under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}




@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    rows = [json.dumps({"text": f"line {i} of the corpus. " * 10}) + "\n" for i in range(40)]
    (d / "b.jsonl").write_text("".join(rows))
    (d / "notes.bin").write_bytes(b"\x00\x01 not read")
    return d


def test_cli_out_dot_force_refused_keeps_every_file(tmp_path):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "corpus.txt").write_text(TEXT)
    (work / "notes.md").write_text("my notes\n")
    (work / "sub" / "model.pt").write_bytes(b"\x00" * 100)
    before = _snapshot(work)
    p = run_cli("data", "prepare", "corpus.txt", "--out", ".", "--force", "--vocab-size", "512", "--no-progress",
                cwd=work)
    one_line_error(p, "current working folder", "choose an empty or new --out")
    assert _snapshot(work) == before


def test_cli_out_is_input_folder_refused(corpus):
    before = _snapshot(corpus)
    # (in this process: the refusal above runs in a process of its own)
    p = run_main("data", "prepare", str(corpus), "--out", str(corpus), "--force", "--vocab-size", "512",
                 "--no-progress")
    one_line_error(p, "is the input", "choose an empty or new --out")
    assert _snapshot(corpus) == before


def test_out_cwd_or_parent_refused_even_when_inputs_are_elsewhere(tmp_path, corpus, monkeypatch):
    work = tmp_path / "work" / "inner"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("keep me")
    monkeypatch.chdir(work)
    before = _snapshot(tmp_path)
    for out in (".", work, "..", os.sep, os.path.expanduser("~")):
        for force in (False, True):
            with pytest.raises(UserError, match="refusing --out") as e:
                _prep([corpus], out, force=force)
            assert "\n" not in str(e.value)
    assert _snapshot(tmp_path) == before


def test_out_and_inputs_overlap_refused(tmp_path, corpus):
    before = _snapshot(tmp_path)
    cases = [
        (corpus, [corpus], "is the input"),                      # --out corpus/ with corpus/ as input
        (tmp_path, [corpus / "a.txt"], "contains the input"),    # --out a parent of an input file
        (tmp_path, [corpus], "contains the input"),              # --out a parent of an input folder
        (corpus / "prepared", [corpus], "is inside the input"),  # --out inside an input folder (new)
        (corpus / "a.txt", [corpus / "a.txt"], "is the input"),  # --out the input file itself
    ]
    for out, sources, what in cases:
        for force in (False, True):
            with pytest.raises(UserError, match=what):
                _prep(sources, out, force=force)
    link = tmp_path / "link"
    link.symlink_to(corpus, target_is_directory=True)  # symlinks are resolved
    with pytest.raises(UserError, match="contains the input"):
        _prep([corpus / "a.txt"], link, force=True)
    link.unlink()
    assert _snapshot(tmp_path) == before
    assert not (corpus / "prepared").exists()


def test_foreign_nonempty_folder_refused_with_or_without_force(tmp_path, corpus):
    out = tmp_path / "mine"
    (out / "deep").mkdir(parents=True)
    (out / "thesis.tex").write_text("years of work")
    (out / "deep" / "data.bin").write_bytes(b"\x01\x02")
    before = _snapshot(tmp_path)
    for force in (True, False):
        with pytest.raises(UserError, match="not a prepared data folder") as e:
            _prep([corpus], out, force=force)
        assert "choose an empty or new --out" in str(e.value)
    # a meta.json that prepare did not write (not a dict, missing keys, unreadable) does not make it one
    for bad in ("[1, 2]", json.dumps({"format": "mxtrain-tokens-v1"}), "{not json"):
        (out / "meta.json").write_text(bad)
        with pytest.raises(UserError, match="not a prepared data folder"):
            _prep([corpus], out, force=True)
    (out / "meta.json").unlink()
    assert _snapshot(tmp_path) == before


def test_out_is_a_file_refused(tmp_path, corpus):
    out = tmp_path / "out.txt"
    out.write_text("a file")
    for force in (True, False):
        with pytest.raises(UserError, match="existing file, not a folder"):
            _prep([corpus], out, force=force)
    assert out.read_text() == "a file"


def test_prepared_folder_replaced_with_force(tmp_path, corpus):
    out = tmp_path / "data"
    _prep([corpus / "a.txt"], out)
    meta1 = json.loads((out / "meta.json").read_text())
    with pytest.raises(UserError, match=r"already exists and is not empty \(use --force"):
        _prep([corpus], out)
    assert json.loads((out / "meta.json").read_text()) == meta1
    # stale temporary folders of killed runs (a pid that cannot exist) are removed at start
    (tmp_path / ".data.tmp-999999999").mkdir()
    (tmp_path / ".data.tmp-999999999" / "train_00000.bin").write_bytes(b"\x00" * 8)
    _prep([corpus], out, force=True)
    meta2 = json.loads((out / "meta.json").read_text())
    assert len(meta2["sources"]) == 2 and meta2["train_tokens"] > meta1["train_tokens"]
    data = TokenData(out)
    assert data.vocab_size % 32 == 0 and len(data.train) and len(data.val)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data"]  # no .tmp / .old left
    # a prepared folder that also holds something prepare did not write is not replaced
    (out / "run1").mkdir()
    (out / "run1" / "checkpoint.pt").write_bytes(b"ckpt")
    before = _snapshot(out)
    with pytest.raises(UserError, match=r"did not write \(run1\)"):
        _prep([corpus], out, force=True)
    assert _snapshot(out) == before


def test_interrupted_swap_keeps_the_old_folder(tmp_path, corpus, monkeypatch):
    out = tmp_path / "data"
    _prep([corpus / "a.txt"], out)
    before = _snapshot(out)
    real = os.rename

    def failing(src, dst):
        if ".tmp-" in str(src):  # the new folder cannot be renamed in
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(sys.modules["mxtrain.data.prepare"].os, "rename", failing)
    with pytest.raises(KeyboardInterrupt):
        _prep([corpus], out, force=True)
    monkeypatch.undo()
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data"]
    # a run killed between its two renames left the old folder aside and none at --out: it is put back
    real(out, tmp_path / ".data.old-999999999")
    with pytest.raises(UserError, match="already exists"):
        _prep([corpus], out)
    assert _snapshot(out) == before
