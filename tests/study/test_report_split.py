"""The study report's error-split figure (issue #51): drawn from the ``split_*`` fields of diagnostics.jsonl rows,
left out (no error) for runs whose rows predate the split."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from mxtrain.study import report

pytest.importorskip("matplotlib")

OPS = {"fprop": ("fprop_x", "fprop_w"), "dgrad": ("dgrad_dy", "dgrad_w"), "wgrad": ("wgrad_dy", "wgrad_x")}


def _row(step: int, layer: int, gemm: str, split: bool, shrink: float) -> dict:
    ops = {}
    for o in OPS[gemm]:
        st = {"sqnr_db": 17.0, "clip_rate": 0.001, "underflow_rate": 0.01, "scale_hist": {"-3": 10, "-2": 6}}
        if split:
            st |= {"split_bias": -shrink, "split_gain_rounded": -shrink / 2, "split_flush_energy": 0.002,
                   "split_clip_energy": 0.001, "split_systematic_energy": shrink ** 2, "split_noise_energy": 0.015}
        ops[o] = st
    return {"step": step, "layer": layer, "gemm": gemm, "recipe": "r", "cos": 0.99, "rel_err": 0.1,
            "rel_bias": -0.01, "err_corr_prev": 0.1 if gemm == "wgrad" else None, "impl_rel_diff": 1e-3,
            "operands": ops}


def _run(d: Path, arm: str, split: bool, shrink: float = 0.01) -> Path:
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(1, 11):
            f.write(json.dumps({"step": i, "tokens": 100.0 * i, "loss": 3.0 - 0.1 * i}) + "\n")
            f.write(json.dumps({"step": i, "tokens": 100.0 * i, "val_loss": 3.0 - 0.1 * i}) + "\n")
    (d / "summary.json").write_text("{}")
    (d / "config.json").write_text(json.dumps({"recipe": arm, "model": {"name": "tiny"}, "train": {"steps": 10}}))
    with open(d / "diagnostics.jsonl", "w") as f:
        for step in (5, 10):
            for layer in range(2):
                for gemm in OPS:
                    f.write(json.dumps(_row(step, layer, gemm, split, shrink)) + "\n")
    return d


def test_error_split_figure_in_the_study_report(tmp_path):
    """A study whose arms logged the split gets the figure (a PNG in report_files, referenced by report.md and
    embedded in report.html); an arm from before the split is left out of it; the means are per operand."""
    _run(tmp_path / "runs" / "mxfp4-all" / "seed0", "mxfp4-all", True, 0.02)
    _run(tmp_path / "runs" / "old" / "seed0", "mxfp4-all", False)
    hp, mp = report.write_report(tmp_path)
    md, text = mp.read_text(), hp.read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("![") and "error split" in ln)
    fn = line.rsplit("(", 1)[1].rstrip(")")
    png = (tmp_path / fn).read_bytes()
    assert png.startswith(b"\x89PNG") and html.escape(report.SPLIT_CAPTION) in text
    from mxtrain.study import diagnostics as D
    data = report.split_data({a: D.aggregate(D.load(tmp_path / "runs" / a / "seed0")) for a in ("mxfp4-all", "old")})
    assert list(data) == ["mxfp4-all"]
    assert list(data["mxfp4-all"]) == ["fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"]
    assert data["mxfp4-all"]["dgrad_w"] == pytest.approx({"flush_energy": 0.002, "clip_energy": 0.001,
                                                          "systematic_energy": 4e-4, "noise_energy": 0.015,
                                                          "bias": -0.02})


def test_no_error_split_figure_without_split_fields(tmp_path):
    """Diagnostics rows from before the split: the other diagnostics figures, no split figure, no error."""
    run = _run(tmp_path / "run", "mxfp4-all", False)
    hp, mp = report.write_report(run)
    md = mp.read_text()
    assert "block-scale exponents" in md and "error split" not in md and html.escape(report.SPLIT_CAPTION) not in hp.read_text()
    assert report._split_plot({}) is None
