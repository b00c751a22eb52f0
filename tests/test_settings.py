"""Settings (``mxtrain.settings``): one parser for every ``MXTRAIN_*`` variable, overrides that the library
reads at use time, the generated docs page, and the caches owned by objects (``kernels.CACHES``,
``fast.state``)."""

import json
import re
import threading
from pathlib import Path

import pytest
import torch

from mxtrain import settings
from mxtrain.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[1]


def test_docs_page_is_generated_from_the_dataclass():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == settings.markdown_table(), \
        "docs/settings.md is stale: python -c 'from mxtrain import settings; print(settings.markdown_table(), end=\"\")' > docs/settings.md"
    for f in Settings.__dataclass_fields__.values():
        assert f"`{f.metadata['env']}`" in page and f"`{f.name}`" in page and f.metadata["doc"] in page


def test_every_mxtrain_variable_in_the_code_is_a_setting():
    """No module reads an MXTRAIN_* variable of its own (the study's parent->worker plumbing excepted; the
    variables of removed settings are named only to refuse them)."""
    from mxtrain.settings import _REMOVED
    envs = {f.metadata["env"] for f in Settings.__dataclass_fields__.values()}
    assert len(envs) == len(Settings.__dataclass_fields__) and all(e.startswith("MXTRAIN_") for e in envs)
    assert not envs & set(_REMOVED)
    envs |= set(_REMOVED)
    for path in (ROOT / "mxtrain").rglob("*.py"):
        text = path.read_text()
        for name in set(re.findall(r"MXTRAIN_[A-Z0-9_]+", text)):
            assert name in envs or name in ("MXTRAIN_STUDY_PARENT", "MXTRAIN_STUDY_START_BY",
                                            "MXTRAIN_STUDY_ONLY_SEEDS"), (path, name)
        if path.name != "settings.py" and path.parent.name != "study":
            assert not re.search(r"environ(\.get\(|\[)\s*[\"']MXTRAIN_", text), path


def test_one_parser_for_every_variable():
    for raw, want in [("1", True), ("0", False), ("TRUE", True), ("false", False), (" Yes ", True), ("no", False),
                      ("On", True), ("OFF", False)]:
        assert Settings.from_env({"MXTRAIN_FAST": raw}).fast is want
        assert Settings.from_env({"MXTRAIN_REUSE_ACT": raw}).reuse_act is want
    s = Settings.from_env({"MXTRAIN_QDUAL": "0", "MXTRAIN_QMAXNREG": " 64 ", "MXTRAIN_WGRAD_B_GROUP": "1",
                           "MXTRAIN_GEMM_BACKEND": "DEQUANT", "MXTRAIN_QKERNEL": "tile", "MXTRAIN_GLUE": "eager",
                           "MXTRAIN_DATA": "/some/where", "MXTRAIN_FAST_LAUNCH": ""})
    assert (s.dual, s.qmaxnreg, s.wgrad_b_group, s.gemm_backend, s.qkernel, s.glue, s.data_dir, s.fast_launch) == \
        ("off", 64, 1, "dequant", "tile", "eager", "/some/where", "auto")   # empty: the default
    assert Settings.from_env({"MXTRAIN_QDUAL": "yes"}).dual == "on"
    # auto / always / off, with the booleans of earlier versions: on is the default (auto), off is off
    for var, field in (("MXTRAIN_FAST_LAUNCH", "fast_launch"), ("MXTRAIN_QSELFCHECK", "qselfcheck")):
        for raw, want in (("1", "auto"), ("0", "off"), ("Always", "always"), ("off", "off")):
            assert getattr(Settings.from_env({var: raw}), field) == want
    assert Settings().replace(fast_launch=False, qselfcheck=True).launch_key[-1] == "auto"
    assert Settings().replace(fast_launch=False).fast_launch == "off"
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize("var,value,allowed", [
    ("MXTRAIN_FAST", "2", "1, true, yes, on, 0, false, no, off"),
    ("MXTRAIN_QDUAL", "all", "auto, on, off"),
    ("MXTRAIN_GEMM_BACKEND", "cublas", "auto, fp8_carrier, native_mx, dot_scaled, dequant"),
    ("MXTRAIN_WGRAD_B_GROUP", "64", "1, 128"),
    ("MXTRAIN_QMAXNREG", "-1", "integer >= 0"),
    ("MXTRAIN_QMAXNREG", "lots", "integer >= 0"),
    ("MXTRAIN_GLUE", "fused", "auto, compiled, eager"),
])
def test_bad_values_name_the_variable_the_value_and_the_choices(var, value, allowed):
    with pytest.raises(SettingsError) as e:
        Settings.from_env({var: value})
    msg = str(e.value)
    assert var in msg and repr(value) in msg and allowed in msg


def test_override_is_read_at_use_time_nests_and_restores():
    from mxtrain.linear import fast
    from mxtrain import kernels
    from mxtrain.numerics import recipes
    from mxtrain.kernels import mxfp4 as kq
    base = settings.current()
    assert settings.current() is base   # cached: nothing parsed per call
    rec = recipes.get("mxfp4-all")
    with settings.override(qkernel="tile", gemm_backend="dequant") as s:
        assert s is settings.current() and s.qkernel == "tile"
        assert kq.kernel_for(1, 0, False) == "tile" and kernels.backend("cpu") == "dequant"
        with settings.override(fast=False, qkernel="cols"):
            assert settings.current().fast is False   # (linear.route reads it)
            assert kq.kernel_for(0, 0, False, rows_contiguous=True) == "cols"
        assert fast.supported(rec) and settings.current().qkernel == "tile"
    assert settings.current() == base and kq.kernel_for(1, 0, False) == "blocks"
    with settings.override(dual="off"):
        assert not kq.dual_applies(torch.zeros(4, 64), 0, 0)
    assert kq.dual_applies(torch.zeros(4, 64), 0, 0)


def test_override_validates_and_is_seen_by_other_threads():
    with pytest.raises(SettingsError, match="unknown setting.*no_such"):
        with settings.override(no_such=1):
            pass
    with pytest.raises(SettingsError, match="qkernel='fast'"):
        with settings.override(qkernel="fast"):
            pass
    with pytest.raises(SettingsError):
        with settings.override(qmaxnreg=True):   # a bool is not an int here
            pass
    seen = []
    with settings.override(dual=False, reuse_act="0"):   # typed values or the environment's strings
        t = threading.Thread(target=lambda: seen.append((settings.current().dual, settings.current().reuse_act)))
        t.start()
        t.join()
    assert seen == [("off", False)]


def test_configure_and_reset(monkeypatch):
    try:
        settings.configure(reuse_act=False)
        with settings.override(reuse_act=True):        # overrides win over configure
            assert settings.current().reuse_act
        assert not settings.current().reuse_act
        cap = settings.current().qmaxnreg
        monkeypatch.setenv("MXTRAIN_QMAXNREG", str(cap + 8))
        assert settings.current().qmaxnreg == cap       # the environment was read once
        settings.reset()
        assert settings.current().reuse_act and settings.current().qmaxnreg == cap + 8
    finally:
        monkeypatch.undo()
        settings.reset()
    assert settings.current() == Settings.from_env()


def test_folders_are_read_when_used(monkeypatch, tmp_path):
    from mxtrain.data import checked
    from mxtrain.data.prepare import default_builtin_dir
    monkeypatch.setenv("MXTRAIN_DATA", str(tmp_path / "d"))
    monkeypatch.setenv("MXTRAIN_CACHE", str(tmp_path / "c"))
    assert default_builtin_dir(512) == tmp_path / "d" / "builtin-bpe512"
    assert checked.cache_dir() == tmp_path / "c" / "checked-shards"
    with settings.override(cache_dir=tmp_path / "o"):
        assert checked.cache_dir() == tmp_path / "o" / "checked-shards"


def test_to_dict_for_run_folders():
    d = settings.current().to_dict()
    assert list(d) == list(Settings.__dataclass_fields__) and json.loads(json.dumps(d)) == d
    assert set(settings.current().numerics()) == set(settings.NUMERICS) == {"fast", "gemm_backend", "wgrad_b_group",
                                                                            "carrier_k", "exact_carrier", "glue",
                                                                            "fp8_fast_accum", "fp8_autocast"}
    fields = Settings.__dataclass_fields__.values()
    env = {f.metadata["env"]: str(v) for f, v in zip(fields, d.values()) if v is not None}
    assert Settings.from_env(env) == settings.current()   # what a run folder records gives the same settings


def test_lru_evicts_the_least_recently_used():
    from mxtrain.kernels.caches import LRU, KernelCaches
    c = LRU(3)
    for k in "abc":
        c[k] = k.upper()
    assert c.get("a") == "A"     # a is now the most recent
    c["d"] = None                # a plan that cannot be made is remembered as None
    assert "b" not in c and list(c) == ["c", "a", "d"] and "d" in c and c.get("d", 1) is None
    caches = KernelCaches(max_plans=2)
    caches.plans["x"] = 1
    caches.verified["v"] = True
    caches.clear()
    assert len(caches.plans) == 0 and not caches.verified


def test_fast_state_owns_activations_and_counters():
    from mxtrain.linear import fast
    st = fast.FastState()
    c = st.counter(torch.device("cpu"))
    c += 5
    assert st.inexact_blocks("cpu") == 5 and st.counter(torch.device("cpu")) is c
    st.activations["fprop_x"] = ("key", None, None)
    st.clear_activations()
    assert not st.activations and st.inexact_blocks("cpu") == 5
    st.clear()
    assert st.inexact_blocks("cpu") == 0
    assert fast.clear_caches() is None and isinstance(fast.inexact_blocks("cpu"), int)


def test_compiled_code_reads_the_settings_without_a_graph_break():
    """``current()`` is cached before any trace (``mxtrain.linear.fast`` reads it at import; every change rebuilds it
    at once), so ``torch.compile(fullgraph=True)`` of code that reads a setting traces, and recompiles when
    the setting changes."""
    with settings.override(fast=False):
        pass
    assert settings._current is not None
    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1 if settings.current().fast else x - 1, fullgraph=True)
    assert f(torch.zeros(2)).tolist() == [1, 1]
    with settings.override(fast=False):
        assert f(torch.zeros(2)).tolist() == [-1, -1]
    assert f(torch.zeros(2)).tolist() == [1, 1]


def test_run_folder_records_the_settings(tmp_path, monkeypatch):
    """run.json holds every setting (so "which backend, which group rows, fast path on" is checkable after
    the run), and a bad MXTRAIN_* variable stops the CLI with one line naming it."""
    import json

    from mxtrain.train import train

    from train_helpers import one_line_error, run_cli, tiny_run_cfg
    out = train(tiny_run_cfg(tmp_path / "run", 1))
    info = json.loads((out / "run.json").read_text())
    assert info["settings"] == settings.current().to_dict()
    assert {"fast", "gemm_backend", "wgrad_b_group"} <= set(info["settings"])
    monkeypatch.setenv("MXTRAIN_QDUAL", "sometimes")   # (run_cli passes this process's environment on)
    one_line_error(run_cli("train", "--steps", "1"), "MXTRAIN_QDUAL", "sometimes")


def test_a_removed_settings_variable_is_refused_not_ignored():
    """``MXTRAIN_MX_TRACED`` (the traced MXFP4 form, removed) set in the environment: one error that says so,
    rather than a variable the user set and nothing reads; unset or empty, nothing happens."""
    from mxtrain.settings import Settings, SettingsError
    with pytest.raises(SettingsError, match="MXTRAIN_MX_TRACED is set, but that setting was removed.*mx_compiled"):
        Settings.from_env({"MXTRAIN_MX_TRACED": "auto"})
    assert Settings.from_env({"MXTRAIN_MX_TRACED": " "}) == Settings()
    assert "mx_traced" not in Settings().to_dict()
