"""The import rule: each layer imports only the layers below it, and no modules import one another.

    base (errors, registry, ...) <- families, data, parallel <- models <- io
        <- rl, rollout (siblings: neither imports the other) <- config <- train

`parallel` sits low because the model's activation constraints name logical mesh axes; it imports
nothing else of jaxloop. Config composes the lower layers' sections and nothing below `train`
imports it. Two checks: every import statement in jaxloop/ (module level and inside functions,
which are dependencies too) against the table, and each layer imported in a fresh interpreter
with no module of a higher layer loaded afterwards.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxloop"

# (layer name, rank, module prefixes); a module belongs to the longest prefix that matches it
LAYERS = [
    (
        "base",
        0,
        (
            "jaxloop",
            "jaxloop.errors",
            "jaxloop.textfile",
            "jaxloop.registry",
            "jaxloop.settings",
            "jaxloop.mathutil",
        ),
    ),
    ("families", 1, ("jaxloop.families",)),
    ("data", 1, ("jaxloop.data",)),
    ("parallel", 1, ("jaxloop.parallel",)),
    ("models", 2, ("jaxloop.models",)),
    ("io", 3, ("jaxloop.io",)),
    ("rl", 4, ("jaxloop.rl",)),
    ("rollout", 4, ("jaxloop.rollout",)),
    ("config", 5, ("jaxloop.config",)),
    (
        "train",
        6,
        (
            "jaxloop.train",
            "jaxloop.sft",
            "jaxloop.evaluate",
            "jaxloop.metrics",
            "jaxloop.summary",
            "jaxloop.plot",
            "jaxloop.launch",
            "jaxloop.checkpoint",
            "jaxloop.draft_features",
        ),
    ),
]
RANK = {name: rank for name, rank, _ in LAYERS}


def layer_of(module: str) -> str:
    best, best_len = None, -1
    for name, _, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to tests/test_layers.py"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> list[str]:
    return sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Every jaxloop module an import statement in `path` names (`from jaxloop import x` names
    jaxloop.x when x is a submodule)."""
    names = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "jaxloop")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "jaxloop":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    ROOT / Path(*sub.split("."))
                ).is_dir()
                names.add(sub if is_module else base)
    return names


def violation(importer: str, imported: str) -> str | None:
    a, b = layer_of(importer), layer_of(imported)
    if a == b:
        return None
    if RANK[b] >= RANK[a]:
        return f"{importer} ({a}) imports {imported} ({b})"
    return None


def test_every_module_has_a_layer():
    for module in all_modules():
        layer_of(module)


def test_import_statements_follow_the_layers():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported in sorted(imported_modules(path)):
            problem = violation(importer, imported)
            if problem:
                problems.append(problem)
    assert not problems, "imports against the layer rule:\n" + "\n".join(problems)


def test_the_rule_catches_an_upward_import():
    assert violation("jaxloop.rl.learner", "jaxloop.config") is not None
    assert violation("jaxloop.rl.learner", "jaxloop.rollout.types") is not None
    assert violation("jaxloop.models.looped", "jaxloop.io.hf") is not None
    assert violation("jaxloop.train.loop", "jaxloop.config") is None
    assert violation("jaxloop.rollout.producer", "jaxloop.models.looped") is None


# importing a layer in a fresh interpreter: the modules of higher layers it loaded
_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m == "jaxloop" or m.startswith("jaxloop."))))
"""


@pytest.mark.parametrize("layer", [name for name, _, _ in LAYERS])
def test_a_layer_imports_alone(layer):
    modules = [
        m
        for m in all_modules()
        if layer_of(m) == layer
        and not m.endswith("__main__")
        # the vLLM plugin's modules import vllm (a minute of CPU); their imports are checked above
        and not m.startswith("jaxloop.rollout.vllm_models")
    ]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    above = [m for m in loaded if RANK[layer_of(m)] > RANK[layer] or _sibling(layer, m)]
    assert not above, f"importing the {layer} layer loaded {above}"


def _sibling(layer: str, module: str) -> bool:
    other = layer_of(module)
    return other != layer and RANK[other] == RANK[layer]


# ---- no import cycle between modules, no module past MAX_MODULE_LINES ----
MAX_MODULE_LINES = 600


def import_graph() -> dict[str, set[str]]:
    """module -> the jaxloop modules it imports (module level and inside functions: an import
    deferred into a function to dodge a circle at import time is still a dependency)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        graph[importer] = {m for m in imported_modules(path) if m != importer}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (each a set of modules that import one another):\n" + (
        "\n".join(" <-> ".join(c) for c in cycles)
    )


def test_the_cycle_check_catches_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_short():
    long = {
        module_name(p): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) >= MAX_MODULE_LINES
    }
    assert not long, f"modules of {MAX_MODULE_LINES} lines or more (split them): {long}"
