"""The package's layout (README, "Map of the package"): its folders, the way imports run between them, no circles.

The import graph is built from the source with `ast`: every `import` and `from ... import`, at the top of a module or
inside a function (a lazy import is an import all the same), and every `importlib.import_module("parlab....")` with
a literal name. Its edges must run down the layers below, never up, and it must have no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "parlab"

# Lower layers first. A module may import its own layer and the layers below it, never one above.
LAYERS = ["core", "schemes", "runtime", "views", "twins", "runs", "grading", "lessons", "top"]
# What the schemes must never import, in so many words (the done-when of the layout issue).
NOT_FOR_SCHEMES = ("runtime", "views", "twins", "runs", "grading", "lessons")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "top"


def _known(name: str) -> str | None:
    """The parlab module `name` refers to (a name imported from a module is that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name if name.startswith("parlab") else None


def imports_of(module: str) -> dict[str, int]:
    """{imported parlab module: line} for every import in `module`'s source, wherever it stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            names = [f"{base}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for name in names:
            target = _known(name)
            if target and target != module and target != "parlab":
                found.setdefault(target, node.lineno)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return [
        f"{MODULES[m].relative_to(PACKAGE.parent)}:{line}: {m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in graph.items()
        for t, line in targets.items()
        if LAYERS.index(layer(t)) > LAYERS.index(layer(m))
    ]


def test_the_top_level_shows_the_split_at_a_glance():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS) - {"top"}, folders


def test_the_import_graph_has_no_circle():
    assert cycles(GRAPH) == []


def test_no_import_runs_back_up():
    assert upward_imports(GRAPH) == []


def test_no_scheme_imports_the_machinery():
    offending = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if layer(m) == "schemes"
        for t in targets
        if layer(t) in NOT_FOR_SCHEMES
    ]
    assert offending == []


def test_every_scheme_module_sits_in_the_schemes_folder():
    """A module whose docstring cites a paper's algorithm (a scheme) lives under parlab/schemes."""
    scheme_words = re.compile(r"\b(parallelism|ZeRO|Ulysses|Ring Attention|Pipeline schedules|recomputation)\b")
    outside = [
        m
        for m, p in MODULES.items()
        if layer(m) in ("core", "runtime", "views", "top")
        and scheme_words.search((ast.get_docstring(ast.parse(p.read_text())) or "").split("\n")[0])
    ]
    assert outside == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b": 1}, "b": {"a": 2}}, [["a", "b"]]),
        ({"a": {"b": 1}, "b": {"c": 2}, "c": {}}, []),
        ({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_the_layer_check_sees_an_import_that_runs_up():
    graph = {"parlab.core.comm": {"parlab.runtime.launcher": 7}, "parlab.runtime.launcher": {"parlab.core.comm": 3}}
    assert [line.split(": ", 1)[1] for line in upward_imports(graph)] == [
        "parlab.core.comm (core) imports parlab.runtime.launcher (runtime)"
    ]


def test_lazy_imports_count_too():
    """An import inside a function is in the graph (it runs when the function does)."""
    assert "parlab.runs.registry" in GRAPH["parlab"]  # parlab.live(name) imports the registry when it is called
