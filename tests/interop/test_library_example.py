"""examples/library_example.py's arms (docs/library.md): a recipe with the mxtrain settings of its run after colons,
checked before any GPU work (the example itself needs a CUDA GPU; its timing is a benchmark, not a test)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "library_example.py"


def _example():
    spec = importlib.util.spec_from_file_location("library_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_an_arm_carries_settings_and_bad_ones_are_one_line_before_any_run():
    ex = _example()
    assert ex.parse_arm("bf16") == ("bf16", {})
    assert ex.parse_arm("mxfp4-all-dh16:mx_compiled=shared:dual=on") == (
        "mxfp4-all-dh16", {"mx_compiled": "shared", "dual": "on"})
    with pytest.raises(SystemExit, match="mx_compiled='bogus' is not a valid value"):
        ex.parse_arm("mxfp4-all-dh16:mx_compiled=bogus")
    with pytest.raises(SystemExit, match="unknown setting"):
        ex.parse_arm("mxfp4-all-dh16:no_such=1")
    with pytest.raises(SystemExit, match="key=value pairs, got 'shared'"):
        ex.parse_arm("mxfp4-all-dh16:shared")
