"""The 125m ladder of issue #46 (docs/results.md, "Next experiment, planned before it runs"): its first leg is kept
in the repository (the per-seed record and the study folder without checkpoints), and the ``ladder-125m`` preset
resumes that folder, so the rest of the plan trains beside the runs already done instead of starting a new study."""

import json
import tarfile
from pathlib import Path

import pytest

from mxtrain.study import stats
from mxtrain.study.plan import PRESETS, StudySpec

DATA = Path(__file__).resolve().parents[2] / "docs" / "results" / "data"


def _archived(name: str) -> dict:
    with tarfile.open(DATA / "ladder-125m-study.tgz") as t:
        return json.load(t.extractfile(t.getmember(name)))


def test_the_preset_resumes_the_first_leg():
    """The preset's base settings (what a study folder must match to be resumed) equal the archived leg's, given
    the data path and device it ran with; its arms include the leg's, at the seeds it trained."""
    old = _archived("./study.json")
    key = old["plan_key"]
    spec = StudySpec(out="unused", data=key["train"]["data"], device=key["train"]["device"], **PRESETS["ladder-125m"])
    assert json.loads(json.dumps(spec.plan_key())) == key
    assert spec.baseline == "bf16" and spec.seeds == 5 and len(spec.arms) == 11
    seeds = _archived("./seeds.json")
    assert {a: sorted(v) for a, v in seeds["arms"].items()} == {"bf16": ["0", "1", "2"], "mxfp4-fprop": ["0", "1", "2"]}
    assert set(seeds["arms"]) <= set(spec.arms)


def test_the_quoted_contrast_comes_from_the_committed_record():
    """docs/results.md's contrast 1 (Fprop minus BF16 at 7.5e-4, full budget) is what the committed per-seed record
    gives with the project's seed-level test, and Holm over the plan's 8 tests cannot undo it (its adjusted p-value
    is at most 8 p)."""
    rec = json.loads((DATA / "ladder-125m-seeds.json").read_text())
    assert rec == _archived("./seeds.json")
    gaps = [rec["arms"]["mxfp4-fprop"][s]["cooled"]["1"]["loss"] - rec["arms"]["bf16"][s]["cooled"]["1"]["loss"]
            for s in ("0", "1", "2")]
    t = stats.paired_t(gaps)
    assert t["n"] == 3 and t["mean"] == pytest.approx(0.0901, abs=5e-5)
    assert t["ci"][0] == pytest.approx(0.0739, abs=5e-5) and t["ci"][1] == pytest.approx(0.1062, abs=5e-5)
    assert t["p"] == pytest.approx(0.0017, abs=5e-5) and 8 * t["p"] < 0.05
    for others in ([1.0] * 7, [1e-4] * 7, [0.01, 0.02, 0.03, 0.04, 0.2, 0.5, 0.9]):   # the 7 tests still to run
        assert stats.holm([t["p"]] + others)[0] <= 8 * t["p"] < 0.05
