"""Every link and file path in the Markdown docs points to a file of this repository.

Checked documents: README.md, BENCHMARKS.md, docs/*.md, docs/results/*.md, tools/README.md and
benchmarks/README.md. Checked references:

* relative Markdown links and images, ``[text](path)`` / ``![alt](path)`` outside code, resolved against the
  document's folder (``#anchor`` stripped; http(s) and mailto links and pure anchors skipped). A link that
  leaves the repository fails;
* file-like repository paths anywhere in the text (backticks, fenced code blocks, prose): a known top-level
  folder, then a name with an extension (``docs/numerics.md``, ``tools/step_memory.py``), resolved against the
  repository root; and the top-level documents (``BENCHMARKS.md``, ``README.md``). Placeholders such as
  ``runs/<run>/run.json`` are not paths (outside the known folders, or cut at the ``<``);
* no ``../shared/`` path at all: that folder is outside the repository, so cite such a source by name.

A dated record may still name a file that was deleted on purpose if it says so right after the name:
"removed ... git history" (BENCHMARKS.md does this for the retired tuning sweeps).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "tools" / "README.md",
               ROOT / "benchmarks" / "README.md",
               *(ROOT / "docs").glob("*.md"), *(ROOT / "docs" / "results").glob("*.md")])
FOLDERS = ("docs", "tools", "mxtrain", "examples", "tests", "benchmarks", "scripts", ".ci")

LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w\.[A-Za-z0-9]+)(?![\w/<*{-])"
                  % "|".join(re.escape(f) for f in FOLDERS))
TOP = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*\.md)(?![\w/])")
SHARED = re.compile(r"(?:\.\./)+shared/[\w./-]*\w")
REMOVED = re.compile(r"[^\n]{0,40}?\bremoved\b.{0,120}?git history", re.S)


def _inside_repo(p: Path) -> bool:
    try:
        p.resolve().relative_to(ROOT)
        return True
    except ValueError:
        return False


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _links(doc: Path, text: str):
    """(line, target, problem) for each dead relative Markdown link outside code."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    prose = SPAN.sub(lambda m: " " * len(m.group(0)) if "\n" not in m.group(0) else m.group(0), prose)
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"(?i)(https?:|mailto:|#)", target):
            continue
        rel = target.split("#", 1)[0]
        if not rel:
            continue
        p = doc.parent / rel
        if not _inside_repo(p):
            yield _line(text, m.start()), target, "points outside the repository"
        elif not p.exists():
            yield _line(text, m.start()), target, "no such file"


def _dead_paths(text: str):
    """(line, path, problem) for each repository path in the text that names no file."""
    found = [(m.end(), m.group(1)) for m in PATH.finditer(text)] + [(m.end(), m.group(1)) for m in TOP.finditer(text)]
    for end, path in sorted(found):
        if (ROOT / path).exists():
            continue
        if REMOVED.match(text, end):
            continue  # a dated record naming a file deleted on purpose
        yield _line(text, end), path, "no such file"
    for m in SHARED.finditer(text):
        yield _line(text, m.start()), m.group(0), "outside the repository: cite the source by name"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_links_and_paths_resolve(doc):
    text = doc.read_text()
    dead = [*_links(doc, text), *_dead_paths(text)]
    assert not dead, "\n".join(f"{doc.relative_to(ROOT)}:{n}: {t} ({why})" for n, t, why in dead)


def test_the_checker_sees_what_it_should():
    doc = ROOT / "docs" / "x.md"
    text = ("[a](numerics.md#x) [b](../shared/docs/y.md) [c](nowhere.md) [d](https://e.org/z.md) [e](#top)\n"
            "`tools/step_memory.py --out m.json`, `docs/nowhere.md`, `runs/<run>/run.json`, `mxtrain/<x>.py`\n"
            "```bash\npython tools/missing_tool.py\n```\n"
            "`scripts/old_sweep.py`, removed after its result became the default; see git history\n"
            "`CHANGES.md`, `BENCHMARKS.md`, (../shared/docs/papers.md, section 6)\n")
    links = [t for _, t, _ in _links(doc, text)]
    assert links == ["../shared/docs/y.md", "nowhere.md"]
    paths = [t for _, t, _ in _dead_paths(text)]
    assert sorted(paths) == ["../shared/docs/papers.md", "../shared/docs/y.md", "CHANGES.md", "docs/nowhere.md",
                             "tools/missing_tool.py"]
