"""The reference corpus build (``mxtrain.data.reference``): the record of the build the archived 125m ladder trained
on, and the lines ``mxtrain data corpus`` and ``mxtrain data prepare`` print about a build of one's own (that it is
that build, or which sources moved and what that means for the archived studies)."""

import copy
import json
import tarfile
from pathlib import Path

from mxtrain.data import corpus, reference as R

ARCHIVE = Path(__file__).resolve().parents[2] / "docs" / "results" / "data" / "ladder-125m-study.tgz"


def _archived(name: str) -> dict:
    with tarfile.open(ARCHIVE) as t:
        return json.load(t.extractfile(t.getmember(name)))


def test_the_reference_is_the_archived_studys_corpus():
    """The record equals what the archived study's runs recorded of their corpus (``run.json``'s ``data_meta``:
    every source's version, documents and bytes; the token counts) and the fingerprint its ``study.json`` resumes
    on; and the build's source list names exactly the sources ``mxtrain data corpus`` reads."""
    meta = _archived("./runs/bf16/seed4/run.json")["data_meta"]
    assert R.REFERENCE["sources"] == meta["corpus_sources"]
    assert (R.REFERENCE["train_tokens"], R.REFERENCE["val_tokens"]) == (meta["train_tokens"], meta["val_tokens"])
    assert R.REFERENCE["vocab_size"] == meta["vocab_size"] == 32768
    assert R.REFERENCE["fingerprint"] == _archived("./study.json")["data_fingerprint"]
    assert sorted(s["name"] for v in R.REFERENCE["sources"].values() for s in v) == sorted(
        s.name for s in corpus.SOURCES)
    assert R.differences(meta["corpus_sources"]) == []


def test_differences_name_each_moved_source():
    mine = copy.deepcopy(R.REFERENCE["sources"])
    assert R.differences(mine) == []
    mine["code"][0]["version"] = "3.12.3"                       # another Python's standard library
    git = next(s for s in mine["docs"] if s["name"] == "debian:git-doc")
    git["documents"] += 1                                        # a Debian package rebuilt, same version string
    mine["dict"] = [s for s in mine["dict"] if s["name"] != "debian:dict-devil"]
    mine["prose"].append({"name": "builtin:extra==1", "version": "1", "documents": 1, "bytes": 1})
    d = R.differences(mine)
    ref_py = R.REFERENCE["sources"]["code"][0]["version"]
    assert f"python:cpython-stdlib 3.12.3, not {ref_py}" in d
    assert any(x.startswith("debian:git-doc ") and "documents" in x for x in d)
    assert "debian:dict-devil missing" in d and "builtin:extra==1 not in the reference" in d and len(d) == 4
    assert R.differences(mine, domains=["books"]) == []          # only the domains asked about


def test_summary_lines():
    fp, ref = R.REFERENCE["fingerprint"], R.REFERENCE["sources"]
    assert "this is the archived 125m ladder study's corpus" in R.summary(ref, fp, 32768)
    assert "should have that build's fingerprint, " + fp in R.summary(ref)
    same = R.summary(ref, "0123456789abcdef", 32768)
    assert same.startswith("note: the sources match") and "will not resume" in same
    moved = copy.deepcopy(ref)
    moved["code"][0]["version"] = "3.12.3"
    line = R.summary(moved, "0123456789abcdef", 32768)
    assert line.startswith("note: 1 source(s) differ") and "python:cpython-stdlib 3.12.3" in line and fp in line
    assert R.summary(moved, "0123456789abcdef", 4096) is None    # another vocabulary: nothing to compare
    assert R.summary(None, "0123456789abcdef", 32768) is None    # no corpus record (not a `data corpus` build)
