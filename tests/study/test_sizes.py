"""Findings across model sizes (``mxtrain.study.sizes``): each size's planned contrasts Holm-adjusted as one family,
and the verdict across sizes, on the committed 125m ladder record and records made from it."""

import copy
import json
from pathlib import Path

import pytest

from mxtrain.study import sizes, stats

DATA = Path(__file__).resolve().parents[2] / "docs" / "results" / "data" / "ladder-125m-seeds.json"


def _seeds_0_to_2(rec):
    """``rec`` with seeds 0-2 only: the record as its first five legs left it, so that the figures below stay fixed
    while later legs add seeds to the committed record."""
    out = copy.deepcopy(rec)
    for a in out["arms"].values():
        for s in [s for s in a if s not in ("0", "1", "2")]:
            del a[s]
    return out


REC = _seeds_0_to_2(json.loads(DATA.read_text()))
LADDER = [("mxfp4-fprop", "bf16"), ("mxfp4-all", "mxfp4-fprop-dgrad"), ("mxfp4-all-dh16", "mxfp4-all")]


def _shifted(rec, arm, by):
    """``rec`` with ``arm``'s cooled-down losses moved by ``by`` nats at every seed and budget."""
    out = copy.deepcopy(rec)
    for s in out["arms"][arm].values():
        for c in s["cooled"].values():
            c["loss"] += by
    return out


def test_one_size_is_its_own_holm_family():
    rows = sizes.across_sizes({"125m": REC}, LADDER)
    ps = [r["sizes"]["125m"]["p"] for r in rows]
    assert [r["sizes"]["125m"]["p_holm"] for r in rows] == stats.holm(ps)
    fprop, wgrad, h16 = rows
    assert fprop["sizes"]["125m"]["mean"] == pytest.approx(0.0901, abs=5e-5)
    assert fprop["verdict"] == "resolved (higher)" and wgrad["verdict"] == h16["verdict"] == "not resolved"
    assert fprop["sizes"]["125m"]["seeds"] == ["0", "1", "2"]


def test_two_sizes_carry_disagree_or_resolve_one():
    other = _shifted(REC, "mxfp4-fprop", -0.2)              # Fprop now resolved lower at the second size
    other = _shifted(other, "mxfp4-all-dh16", -0.2)         # H16 resolved lower there, not at 125m
    rows = sizes.across_sizes({"125m": REC, "30m": other}, LADDER)
    assert [r["verdict"] for r in rows] == ["sizes disagree", "not resolved", "resolved at 30m only"]
    rows = sizes.across_sizes({"125m": REC, "30m": copy.deepcopy(REC)}, LADDER)
    assert rows[0]["verdict"] == "carried (higher)"
    text = sizes.lines(rows)
    assert text[0].startswith("mxfp4-fprop minus bf16: carried (higher); 125m: +0.0901 nats [+0.0739, +0.1062]")


def test_no_verdict_below_three_seeds_or_without_an_arm():
    two = copy.deepcopy(REC)
    for a in two["arms"].values():
        a.pop("2", None)
    del two["arms"]["mxfp4-all-dh16"]
    rows = sizes.across_sizes({"125m": REC, "30m": two}, LADDER)
    assert rows[0]["verdict"] == "no verdict (30m: 2 paired seed(s), below 3)"
    assert rows[2]["verdict"] == "no verdict (30m: no run of mxfp4-all-dh16)"
    assert rows[0]["sizes"]["30m"]["p_holm"] is None   # (left out of its size's family)


def test_the_command_prints_the_verdicts_and_writes_json(tmp_path, capsys):
    from mxtrain.cli.core import main
    other, first = tmp_path / "30m", tmp_path / "125m"
    other.mkdir()
    first.mkdir()
    (other / "seeds.json").write_text(json.dumps(_shifted(REC, "mxfp4-fprop", -0.2)))
    (first / "seeds.json").write_text(json.dumps(REC))
    import importlib.util
    plot = ["--plot", str(tmp_path / "f.png")] if importlib.util.find_spec("matplotlib") else []   # (mxtrain[plots])
    rc = main(["sizes", f"125m={first}", f"30m={other}", "--contrast", "mxfp4-fprop:bf16", "--contrast",
               "mxfp4-all-dh16:mxfp4-all", "--json", str(tmp_path / "rows.json"), *plot])
    out = capsys.readouterr().out
    assert rc == 0 and "mxfp4-fprop minus bf16: sizes disagree" in out and "mxfp4-all-dh16 minus mxfp4-all: not resolved" in out
    if plot:
        assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert rows["sizes"] == ["125m", "30m"] and [r["verdict"] for r in rows["rows"]] == ["sizes disagree", "not resolved"]


@pytest.mark.parametrize("argv,says", [
    (["125m", "--contrast", "mxfp4-fprop:bf16"], "give each study as SIZE=PATH"),
    (["125m=/no/such/folder", "--contrast", "mxfp4-fprop:bf16"], "no seeds.json"),
    ([f"125m={DATA}", "--contrast", "mxfp4-fprop-bf16"], "give ARM:REFERENCE"),
    ([f"125m={DATA}", "--contrast", "mxfp4-fprp:bf16"], "did you mean mxfp4-fprop?"),
    ([f"125m={DATA}", "--contrast", "mxfp4-fprop:bf16", "--budget", "0.75"], "no cooled-down budget 0.75 (it has 0.25, 0.5, 1)"),
    ([f"125m={DATA}", f"125m={DATA}", "--contrast", "mxfp4-fprop:bf16"], "given twice"),
])
def test_the_command_refuses_bad_input_in_one_line(argv, says, capsys):
    from mxtrain.cli.core import main
    assert main(["sizes", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and "Traceback" not in err
