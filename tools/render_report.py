"""Render a report page (``mxtrain report`` / ``mxtrain study``'s ``report.html``) to a PNG with headless Chromium,
as an offline reader would see it, and check that the page loads nothing from the network.

    python tools/render_report.py REPORT.html OUT.png [--width 1400] [--browser /usr/bin/chromium]

The page is opened from disk with every host name unresolvable (``--host-resolver-rules``), so a resource the
page would fetch from the network shows as missing in the picture; ``network_refs`` lists such references
from the HTML itself (``src``/``href``/``srcset`` attributes, CSS ``url(...)`` and ``@import``) and the tool
exits 1 when there are any. Chromium screenshots its window only: the window is made taller than the page
(an estimate from the page's images and tables), then the uniform margin below the content is cropped.
Exit status: 0 rendered and offline, 1 network references found (the PNG is still written), 2 an error
(no browser, no such file, Chromium failed), with one line on stderr.
"""

from __future__ import annotations

import argparse
import base64
import html.parser
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--force-device-scale-factor=1", "--host-resolver-rules=MAP * ~NOTFOUND"]
MAX_HEIGHT = 30000

_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)""", re.I)
_IMPORT = re.compile(r"""@import\s+(?:url\()?\s*['"]?([^'")\s;]+)""", re.I)
_REMOTE = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.I)   # http://, https://, ftp://, protocol-relative //


def _remote(ref: str) -> bool:
    return bool(_REMOTE.match(ref))


class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.refs: list[str] = []
        self._style = False

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if v is None:
                continue
            if k in ("src", "href", "poster", "data", "action", "background"):
                if tag == "a" and k == "href":
                    continue   # a link the reader may follow is not a resource the page loads
                if _remote(v):
                    self.refs.append(f"<{tag} {k}={v}>")
            elif k == "srcset":
                for part in v.split(","):
                    u = part.strip().split(" ")[0]
                    if _remote(u):
                        self.refs.append(f"<{tag} srcset={u}>")
            elif k == "style":
                self.refs += [f"<{tag} style url({u})>" for u in _URL.findall(v) if _remote(u)]
        self._style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style":
            self._style = False

    def handle_data(self, data):
        if self._style:
            self.refs += [f"<style> url({u})" for u in _URL.findall(data) if _remote(u)]
            self.refs += [f"<style> @import {u}" for u in _IMPORT.findall(data) if _remote(u)]


def network_refs(text: str) -> list[str]:
    """Every resource of an HTML page that would be fetched from the network (``data:`` URIs and relative
    paths are local; ``<a href>`` links are not loaded). Empty: the page renders offline."""
    p = _Refs()
    p.feed(text)
    p.close()
    return p.refs


def find_browser(given: str | None = None) -> str | None:
    if given:
        return given if (Path(given).is_file() or shutil.which(given)) else None
    for b in BROWSERS:
        w = shutil.which(b)
        if w:
            return w
    return None


def _png_size(data: bytes) -> tuple[int, int] | None:
    if data[:8] != b"\x89PNG\r\n\x1a\n" or len(data) < 24:
        return None
    return struct.unpack(">II", data[16:24])


def estimate_height(text: str, width: int) -> int:
    """A height in pixels at least that of the page at ``width``: embedded images scaled to the content
    width, plus generous room per table row, heading, paragraph and list item."""
    content = min(width, 1300) - 40
    h = 600
    for m in re.finditer(r"data:image/png;base64,([A-Za-z0-9+/=]{32,})", text):
        size = _png_size(base64.b64decode(m.group(1)[:44] + "=" * (-len(m.group(1)[:44]) % 4)))
        if size:
            w, ih = size
            h += int(ih * min(1.0, content / max(w, 1))) + 80
    low = text.lower()
    h += 45 * low.count("<tr") + 70 * low.count("<h") + 90 * low.count("<p") + 45 * low.count("<li")
    h += 30 * low.count("<details")
    return min(MAX_HEIGHT, h)


def _crop_bottom(png: Path) -> tuple[int, int]:
    """Crop the uniform rows below the content (Pillow, which matplotlib brings); returns the final size."""
    try:
        from PIL import Image
    except ImportError:
        return (0, 0)
    with Image.open(png) as im:
        im = im.convert("RGB")
        w, h = im.size
        bg = im.getpixel((w - 1, h - 1))
        from PIL import ImageChops
        diff = ImageChops.difference(im, Image.new("RGB", im.size, bg)).getbbox()
        bottom = min(h, (diff[3] if diff else 1) + 20)
        if bottom < h:
            im.crop((0, 0, w, bottom)).save(png)
            return (w, bottom)
        return (w, h)


def render(report: str | os.PathLike, out: str | os.PathLike, *, width: int = 1400, height: int | None = None,
           browser: str | None = None, timeout: float = 120.0) -> Path:
    """Screenshot ``report`` into ``out`` (PNG) with headless Chromium; returns ``out``. RuntimeError when no
    browser is found or Chromium fails."""
    report, out = Path(report).resolve(), Path(out).resolve()
    exe = find_browser(browser)
    if exe is None:
        raise RuntimeError(f"no Chromium found ({browser or ', '.join(BROWSERS)}); install one "
                           f"(Debian: apt-get install chromium) or pass --browser PATH")
    text = report.read_text(encoding="utf-8", errors="replace")
    h = height or estimate_height(text, width)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    with tempfile.TemporaryDirectory(prefix="render-report-") as prof:
        cmd = [exe, *FLAGS, f"--user-data-dir={prof}", f"--window-size={width},{h}", f"--screenshot={out}",
               report.as_uri()]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{exe} did not finish within {timeout:.0f} s") from None
    if not out.is_file() or out.stat().st_size == 0:
        tail = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1][:300]
        raise RuntimeError(f"{exe} wrote no screenshot ({tail})")
    if height is None:
        _crop_bottom(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Render a report.html to a PNG with headless Chromium, offline, and "
                                             "check that it references no network resource.")
    ap.add_argument("report", help="the HTML page (report.html of a study or a run)")
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("--width", type=int, default=1400, help="window width in pixels (default 1400)")
    ap.add_argument("--height", type=int, help="window height in pixels (default: estimated from the page, then "
                                               "the empty margin cropped)")
    ap.add_argument("--browser", help="the Chromium executable (default: the first of " + ", ".join(BROWSERS)
                                      + " on PATH)")
    a = ap.parse_args(argv)
    rp = Path(a.report)
    if not rp.is_file():
        print(f"render_report: error: {rp}: no such file", file=sys.stderr)
        return 2
    if a.width < 200 or (a.height is not None and not 200 <= a.height <= MAX_HEIGHT):
        print(f"render_report: error: --width must be >= 200 and --height from 200 to {MAX_HEIGHT}", file=sys.stderr)
        return 2
    try:
        out = render(rp, a.out, width=a.width, height=a.height, browser=a.browser)
    except (RuntimeError, OSError) as e:
        print(f"render_report: error: {e}", file=sys.stderr)
        return 2
    refs = network_refs(rp.read_text(encoding="utf-8", errors="replace"))
    print(f"wrote {out}")
    if refs:
        print(f"render_report: {rp} references {len(refs)} network resource(s): {'; '.join(refs[:5])}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
