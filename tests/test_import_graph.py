"""No import cycle anywhere in nefl_zoo/.

The graph: one node per module (a package is its ``__init__``); an edge for every import
statement that names a module of the package, absolute or relative, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING``), since a function-level import that
closes a cycle still fails or half-initialises at run time. ``from PKG import NAME`` is an edge
to ``PKG.NAME`` when that is a module, else to ``PKG``. Modules imported by name
(``importlib.import_module``, the method registry's discovery) are not edges: discovery is how
the registry avoids depending on the methods that depend on it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nefl_zoo"


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods] or [base]
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through every back edge of a depth-first search (empty: the graph is acyclic)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "nefl_zoo.fl.methods.fedlps.method" in graph and "nefl_zoo.fl.registry" in graph["nefl_zoo.fl.methods.nefl"]
    assert cycles(graph) == []


def test_the_graph_holds_relative_and_function_level_imports_and_the_finder_reports_a_cycle():
    graph = import_graph()
    assert "nefl_zoo.fl.methods.fedlps.costs" in graph["nefl_zoo.fl.methods.fedlps.method"]  # inside a function
    assert "nefl_zoo.fl.strategy_utils" in graph["nefl_zoo.fl.methods.heterofl"]  # from ..strategy_utils import
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_method_files_import_only_shared_modules():
    """A method module never imports another method's module (its subpackage's own modules aside)."""
    graph = import_graph()
    methods = "nefl_zoo.fl.methods."
    for name, targets in graph.items():
        if name.startswith(methods):
            own = methods + name[len(methods):].split(".")[0]
            others = [t for t in targets if t.startswith(methods) and t != own and not t.startswith(own + ".")]
            assert not others, (name, others)
