"""A single run's report labels its token axes so that the labels stay apart: the README's main job (100 steps of
2,048 tokens, evaluated every 25) had ten six-digit labels (40000 ... 220000) running together."""

import json
import math

import pytest

pytest.importorskip("matplotlib")

from mxtrain.study import report   # noqa: E402


def _main_job_run(d):
    d.mkdir()
    rows = []
    for s in range(1, 101):
        if s == 1 or s % 10 == 0:
            rows.append({"step": s, "tokens": 2048 * s, "loss": 6 - math.log(s), "lr": 1e-3})
        if s % 25 == 0:
            rows.append({"step": s, "tokens": 2048 * s, "val_loss": 6 - math.log(s), "val_ppl": 2.0})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text("{}")
    (d / "config.json").write_text(json.dumps({"recipe": "mxfp4-all-dh16", "model": {"name": "tiny"},
                                               "train": {"steps": 100}}))
    return d


def test_tokens_label():
    assert [report.tokens_label(v) for v in (0, 512, 51200, 204800, 1.5e6, 2e9)] == \
        ["0", "512", "51.2k", "204.8k", "1.5M", "2B"]


def test_single_run_token_labels_do_not_run_together(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    saved, savefig = [], Figure.savefig

    def keep(fig, *a, **k):
        saved.append(fig)
        return savefig(fig, *a, **k)
    monkeypatch.setattr(Figure, "savefig", keep)
    report.write_report(_main_job_run(tmp_path / "run"))
    axes = [ax for fig in saved for ax in fig.axes if ax.get_xlabel().startswith("tokens")]
    assert len(axes) == 3   # validation loss, its zoom, training loss
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    for ax in axes:
        canvas = FigureCanvasAgg(ax.figure)   # (the report closed its figures)
        canvas.draw()
        boxes = [t.get_window_extent(canvas.get_renderer()) for t in ax.get_xticklabels() if t.get_text()]
        assert len(boxes) >= 3
        assert all(a.x1 + 4 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in ax.get_xticklabels()]
