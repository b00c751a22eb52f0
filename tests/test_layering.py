"""The package's import graph, read from the source (every ``import`` statement, at module level or inside a
function): no import cycle beyond the ones already known (each to be removed, none to be added), the MX linear
stack one-way, and the numerics importing nothing above them; and every import of a package module inside a
function marked with its reason (``# startup`` or ``# optional``). Static: nothing is imported or run."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mxtrain")

# Cycles that exist today (file sets); a change may shrink or remove them, never add one or grow one.
KNOWN_CYCLES = [
]
# the MX linear package (mxtrain/linear/), bottom to top: each may import only the ones before it (and anything
# outside the list but below the package: the numerics, kernels, settings)
MX_LINEAR_STACK = ["linear._constant", "linear.context", "linear.skeleton", "linear.tensorfp8", "linear.tracedfp8", "linear.reference",
                   "linear.fast", "linear.compiledmx", "linear.experts", "linear.dispatch", "linear.ops", "linear.api",
                   "linear", "linear.moe", "linear.module", "linear.qgather"]
# the study runner (issue #49), bottom to top: each may import only the ones before it
STUDY_STACK = ["study.plan", "study.run", "study.summary", "study.workers"]
# the numerics: no import of anything but each other and the package's leaf helpers
NUMERICS = {"numerics", "numerics.formats", "numerics.quant", "numerics.hadamard", "numerics.recipe",
            "numerics.recipes", "numerics.rng", "numerics.operand"}
# layer 0 of the layered layout (issue #49): imports nothing of the package but each other
LAYER_0 = {"errors", "settings", "_io", "_experts"}


def _modules() -> dict:
    mods = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel[: -len(".__init__")] if rel.endswith("__init__") else rel] = os.path.join(d, f)
    mods[""] = mods.pop("__init__", os.path.join(ROOT, "__init__.py"))
    return mods


def _resolve(mods: dict, name: str) -> str | None:
    """The module file ``name`` (dotted, relative to the package) lives in: itself, or its package."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in mods else None


def import_graph() -> dict:
    mods = _modules()
    return {mod: _imports(mods, mod, path.endswith("__init__.py"), ast.parse(open(path, encoding="utf-8").read()))
            for mod, path in mods.items()}


def _imports(mods: dict, mod: str, is_package: bool, tree) -> set:
    """The package modules that the source ``tree`` of module ``mod`` imports, anywhere in it (module level,
    functions, classes)."""
    found = set()
    pkg = mod if is_package else (mod.rsplit(".", 1)[0] if "." in mod else "")
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name[len("mxtrain."):] for a in node.names if a.name.startswith("mxtrain.")]
            targets += ["" for a in node.names if a.name == "mxtrain"]   # (the package root)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".") if pkg else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                prefix = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "mxtrain" or node.module.startswith("mxtrain.")):
                prefix = node.module[len("mxtrain"):].lstrip(".")
            else:
                continue
            # ``from . import x``: x may be a module; ``from .m import name``: the module m
            for a in node.names:
                sub = f"{prefix}.{a.name}" if prefix else a.name
                targets.append(sub if sub in mods else prefix)
        for t in targets:
            r = _resolve(mods, t)
            if r is not None and r != mod:
                found.add(r)
    return found


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_the_reader_sees_known_imports():
    g = import_graph()
    assert "linear.fast" in g["linear.api"] and "linear.compiledmx" in g["linear.dispatch"] and "numerics.formats" in g["numerics.quant"]
    assert "kernels.mxfp4.traced" in g["linear.compiledmx"] and "linear.api" in g["linear"]


def test_no_import_cycle_beyond_the_known_ones():
    for comp in cycles(import_graph()):
        assert any(comp <= known for known in KNOWN_CYCLES), f"a new or grown import cycle: {sorted(comp)}"


def test_the_study_runner_imports_one_way():
    g = import_graph()
    for i, mod in enumerate(STUDY_STACK):
        above = set(STUDY_STACK[i + 1:]) | {"study.worker"}
        assert not g[mod] & above, f"{mod} imports {sorted(g[mod] & above)}, which sit above it"


def test_the_mx_linear_stack_imports_one_way():
    g = import_graph()
    for i, mod in enumerate(MX_LINEAR_STACK):
        above = set(MX_LINEAR_STACK[i + 1:])
        assert not g[mod] & above, f"{mod} imports {sorted(g[mod] & above)}, which sit above it"


def test_the_mx_linear_package_is_listed_whole():
    g = import_graph()
    assert {m for m in g if m == "linear" or m.startswith("linear.")} == set(MX_LINEAR_STACK)


def test_the_mx_linear_package_imports_only_downward():
    """mxtrain/linear/ reads the numerics, the kernels and layer 0; nothing of the model, data, trainer, study,
    interop, benchmarks or CLI, and neither the kernels nor the numerics import it."""
    g = import_graph()
    below = NUMERICS | LAYER_0
    for mod in MX_LINEAR_STACK:
        outside = {m for m in g[mod] if not (m == "linear" or m.startswith("linear."))}
        bad = {m for m in outside if m not in below and m != "kernels" and not m.startswith("kernels.")}
        assert not bad, f"{mod} imports {sorted(bad)}, which sit above the MX linear package"
    for mod in g:
        if mod in NUMERICS or mod == "kernels" or mod.startswith("kernels."):
            up = {m for m in g[mod] if m == "linear" or m.startswith("linear.")}
            assert not up, f"{mod} imports {sorted(up)} from the MX linear package above it"


def test_the_numerics_import_nothing_above_them():
    """mxtrain/numerics/ is the specification: it imports torch and layer 0 at most, nothing of the kernels,
    the linear layer or anything above (and today not even layer 0)."""
    g = import_graph()
    assert {m for m in g if m == "numerics" or m.startswith("numerics.")} == NUMERICS
    for mod in NUMERICS:
        assert g[mod] <= NUMERICS | LAYER_0, f"{mod} imports {sorted(g[mod] - NUMERICS - LAYER_0)}"


def test_layer_0_imports_only_layer_0():
    g = import_graph()
    for mod in LAYER_0:
        assert g[mod] <= LAYER_0, f"{mod} (layer 0) imports {sorted(g[mod] - LAYER_0)}"


def test_the_kernels_import_only_the_numerics_and_layer_0():
    """mxtrain/kernels/ (layer 2) is checked against the numerics and imports nothing else of the package."""
    g = import_graph()
    for mod in g:
        if mod == "kernels" or mod.startswith("kernels."):
            bad = {m for m in g[mod] if not (m == "kernels" or m.startswith("kernels.")) and m not in NUMERICS | LAYER_0}
            assert not bad, f"{mod} (kernels) imports {sorted(bad)}, which sit above it"


# The layers of the package (docs/architecture.md), bottom to top; a module may import its own layer and the ones
# below. The package itself (mxtrain/__init__.py: the public API) sits on the MX linear layer it re-exports.
LAYERS = [
    ("layer 0", lambda m: m in ("errors", "settings", "_io", "_child", "_launch", "_experts")),
    ("numerics", lambda m: m.split(".")[0] == "numerics"),
    ("kernels", lambda m: m.split(".")[0] == "kernels"),
    ("the MX linear layer and the public API", lambda m: m == "" or m.split(".")[0] == "linear"),
    ("model, data", lambda m: m.split(".")[0] in ("model", "data")),
    ("train", lambda m: m.split(".")[0] == "train"),
    ("study, interop, bench", lambda m: m.split(".")[0] in ("study", "interop", "bench")),
    ("cli", lambda m: m.split(".")[0] in ("cli", "__main__")),
]


def _layer(mod: str) -> int:
    hits = [i for i, (_, is_in) in enumerate(LAYERS) if is_in(mod)]
    assert len(hits) == 1, f"module {mod!r} is in {len(hits)} layers of LAYERS: place it in exactly one"
    return hits[0]


def test_every_import_goes_down_the_layers():
    """Every module of the package has a layer, and every import (module level or inside a function) goes to its
    own layer or one below: the model never imports the trainer, the trainer never the study runner or the CLI."""
    g = import_graph()
    for mod, targets in g.items():
        for t in targets:
            assert _layer(t) <= _layer(mod), (f"{mod} ({LAYERS[_layer(mod)][0]}) imports {t} "
                                              f"({LAYERS[_layer(t)][0]}), a layer above it")


# the two reasons an import may sit inside a function (issue #49), one of them on the import's (first) line
_MARKERS = ("# startup", "# optional")


def _function_imports(tree):
    """The import statements of ``tree`` that sit inside a function body (at any depth)."""
    out, stack = [], [(tree, False)]
    while stack:
        node, in_func = stack.pop()
        for ch in ast.iter_child_nodes(node):
            if in_func and isinstance(ch, (ast.Import, ast.ImportFrom)):
                out.append(ch)
            stack.append((ch, in_func or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))))
    return out


def test_every_import_inside_a_function_says_why():
    """Issue #49: an import inside a function is for start-up cost (``# startup``: importing the module at the top
    would make importing this one slow, e.g. pull in Triton or the trainer for ``mxtrain --help``) or for an
    optional dependency (``# optional``), and says which on its line (the first line of a multi-line import).
    Checked for imports of the package's own modules; any other reason (a cycle) has no place."""
    bad = []
    for mod, path in _modules().items():
        src = open(path, encoding="utf-8").read()
        lines = src.splitlines()
        for node in _function_imports(ast.parse(src)):
            if isinstance(node, ast.ImportFrom):
                own = node.level > 0 or (node.module or "").split(".")[0] == "mxtrain"
            else:
                own = any(a.name.split(".")[0] == "mxtrain" for a in node.names)
            if own and not any(m in lines[node.lineno - 1] for m in _MARKERS):
                bad.append(f"{os.path.relpath(path, os.path.dirname(ROOT))}:{node.lineno}")
    assert not bad, ("imports of mxtrain modules inside functions without '# startup' or '# optional' (hoist them "
                     "to the module's imports, or say why not): " + ", ".join(bad))


# Issue #49: the model knows no quantization and reads no setting. Besides the layer rule above (which lets layer 4
# import layers 0-3), mxtrain/model/ may import neither the settings nor the MX linear layer, nor the package's root
# (``mxtrain/__init__.py`` re-exports the linear layer); what it needs of them comes in as options from train/.
MODEL_FORBIDDEN = ("settings", "linear", "")


def _forbidden_for_model(graph: dict) -> list:
    bad = []
    for mod, targets in graph.items():
        if mod == "model" or mod.startswith("model."):
            for t in targets:
                if any(t == f or (f and t.startswith(f + ".")) for f in MODEL_FORBIDDEN):
                    bad.append(f"{mod} imports {t or 'mxtrain (the package root)'}")
    return bad


def _reaches_for_mx(tree) -> list:
    """Ways around an import statement that still tie the model to the linear layer or the settings:
    ``torch.ops.mxtrain.*`` (ops the linear layer registers), ``importlib.import_module`` / ``__import__``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "mxtrain" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "ops":
            out.append(f"line {node.lineno}: torch.ops.mxtrain")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.append(f"line {node.lineno}: {name}(...)")
    return out


def test_the_model_imports_neither_settings_nor_the_linear_layer():
    """mxtrain/model/ imports no ``mxtrain.settings``, nothing of ``mxtrain.linear`` and not the package root, at
    module level or inside a function, and reaches for neither some other way (``torch.ops.mxtrain``, dynamic
    imports): the trainer passes the glue mode, applies activation checkpointing, and ``convert`` swaps layers."""
    g = import_graph()
    assert any(m.startswith("model.") for m in g), "no model modules found"
    bad = _forbidden_for_model(g)
    assert not bad, "the model must not know quantization or settings: " + "; ".join(bad)
    mods = _modules()
    for mod in (m for m in mods if m == "model" or m.startswith("model.")):
        found = _reaches_for_mx(ast.parse(open(mods[mod], encoding="utf-8").read()))
        assert not found, f"{mod}: " + ", ".join(found)


def test_the_model_rule_catches_a_regression():
    """The check above fails on what it forbids, at module level and inside functions, relative or absolute: fed
    the imports the model had before issue #49, and each forbidden import alone."""
    mods = _modules()
    before = ("from .. import settings as _settings\nfrom ..linear import ops as _ops\n"
              "from ..linear.module import checkpoint as mx_checkpoint\n"
              "class Experts:\n    def forward(self):\n        from ..linear.moe import fused_experts  # startup\n")
    got = _imports(mods, "model.llama", False, ast.parse(before))
    assert got == {"settings", "linear.ops", "linear.module", "linear.moe"}, got
    assert len(_forbidden_for_model({"model.llama": got})) == 4
    for src in ("def f():\n    import mxtrain.settings  # startup\n", "import mxtrain\n",
                "def f():\n    from mxtrain.linear import module  # startup\n", "from .. import convert\n"):
        assert _forbidden_for_model({"model.hf_io": _imports(mods, "model.hf_io", False, ast.parse(src))}), src
    assert not _forbidden_for_model({"model.llama": {"errors", "model"}, "train.trainer": {"linear", "settings"}})
    assert _reaches_for_mx(ast.parse("def f():\n    return torch.ops.mxtrain.linear.default\n"))
    assert _reaches_for_mx(ast.parse("import importlib\nm = importlib.import_module('mxtrain.linear')\n"))
