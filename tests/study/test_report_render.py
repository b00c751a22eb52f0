"""The report page opens offline and renders: no network resource in the HTML (checked everywhere), and a
headless-Chromium screenshot of a study report that is a real picture (where /usr/bin/chromium exists)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from mxtrain.study import metrics as M
from mxtrain.study import report

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")


def _tool():
    spec = importlib.util.spec_from_file_location("render_report", ROOT / "tools" / "render_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _study(d: Path) -> dict:
    """A synthetic study folder (bf16, fp8, mxfp4-all 20 % slower, 2 seeds, diagnostics-free) and its report."""
    toks = [1000.0 * i for i in range(1, 41)]
    for arm, c in (("bf16", 1.0), ("fp8", 1.02), ("mxfp4-all", 1.2)):
        for s in range(2):
            rd = d / "runs" / arm / f"seed{s}"
            rd.mkdir(parents=True)
            with open(rd / "metrics.jsonl", "w") as f:
                for i, t in enumerate(toks, 1):
                    v = 2.0 + 0.01 * s + 5e4 / (t / c)
                    f.write(json.dumps({"step": i, "tokens": t, "loss": v + 0.01}) + "\n")
                    f.write(json.dumps({"step": i, "tokens": t, "val_loss": v}) + "\n")
            (rd / "summary.json").write_text("{}")
            (rd / "config.json").write_text(json.dumps({"recipe": arm, "model": {"name": "tiny"},
                                                        "train": {"steps": 40}}))
    runs = M.load_study_runs(d)
    meta = {"baseline": "bf16", "references": ["fp8"], "target_frac": 0.8, "smooth_k": 2}
    summary = M.summarize(runs, "bf16", smooth_k=2)
    from mxtrain.study.summary import add_references
    add_references(summary, meta, runs)
    summary = M.sanitize(summary)
    report.write_report(d, summary)
    return summary


def test_network_refs_finds_remote_resources_only():
    refs = _tool().network_refs
    assert refs("<html><img src='data:image/png;base64,AAAA'><a href='https://example.org'>x</a>"
                "<img src='report_files/fig0.png'></html>") == []
    bad = ("<html><head><link rel='stylesheet' href='https://cdn.example/x.css'><script src='//cdn.example/a.js'>"
           "</script><style>body{background:url(http://x/y.png)} @import 'https://f/g.css';</style></head>"
           "<body><img srcset='a.png 1x, https://i/b.png 2x'><div style=\"background:url('https://z/w.png')\">"
           "</div></body></html>")
    found = refs(bad)
    assert len(found) == 6, found
    assert any("cdn.example/x.css" in r for r in found) and any("//cdn.example/a.js" in r for r in found)


def test_reports_reference_no_network_resource(tmp_path):
    summary = _study(tmp_path)
    text = (tmp_path / "report.html").read_text()
    assert _tool().network_refs(text) == []
    assert "Against fp8" in text and summary["references"]["fp8"]["arms"]["mxfp4-all"]["extra_tokens"]["state"] == "ok"
    e = summary["references"]["fp8"]["arms"]["mxfp4-all"]["extra_tokens"]["mean"]
    assert e == pytest.approx(1.2 / 1.02 - 1, abs=0.01)
    # a single run's report: no network either, and it opens with the recipe and the final loss
    run = tmp_path / "runs" / "mxfp4-all" / "seed1"
    hp, mp = report.write_report(run)
    single = hp.read_text()
    assert _tool().network_refs(single) == []
    rd = M.read_run(run)
    assert "<h2>Run</h2>" in single and "mxfp4-all: F:mxfp4; D:mxfp4; W:mxfp4" in single
    assert f"{rd.val_loss[-1]:.4f} (ppl {math.exp(rd.val_loss[-1]):.2f}) at step 40" in single
    assert "| final val loss |" in mp.read_text()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is not installed (Debian: apt-get install "
                                                  "chromium); the offline check above runs without it")
def test_study_report_renders_to_a_real_picture(tmp_path):
    from PIL import Image
    _study(tmp_path)
    out = tmp_path / "report.png"
    tool = _tool()
    assert tool.main([str(tmp_path / "report.html"), str(out), "--browser", str(CHROMIUM)]) == 0
    assert out.stat().st_size > 50_000
    with Image.open(out) as im:
        w, h = im.size
        assert w == 1400 and 1500 < h < tool.MAX_HEIGHT        # the whole page, its empty bottom cropped
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 100             # text, tables and plots: not one colour
        # the plots are there: some row far down the page holds the arms' curve colours
        px = im.convert("RGB").load()
        arm_rgb = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in report.arm_colors(["bf16", "fp8"]).values()}
        seen = {px[x, y] for y in range(h // 3, h, 7) for x in range(0, w, 3)}
        assert arm_rgb <= seen
    # a missing file and a missing browser: one line, exit 2
    assert tool.main([str(tmp_path / "nope.html"), str(out)]) == 2
    assert tool.main([str(tmp_path / "report.html"), str(out), "--browser", str(tmp_path / "no-browser")]) == 2
