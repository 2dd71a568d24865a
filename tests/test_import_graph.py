"""No import cycle anywhere in nefl_zoo/.

The graph: one node per module (a package is its ``__init__``); an edge for every import
statement that names a module of the package, absolute or relative, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING``), since a function-level import that
closes a cycle still fails or half-initialises at run time. ``from PKG import NAME`` is an edge
to ``PKG.NAME`` when that is a module, else to ``PKG``. A module imported by name with a literal
name (``importlib.import_module("nefl_zoo.nesting.sources")``, ``import_module(".net", __package__)``)
is an edge too: it is an import that only hides from import statements. Names computed at run
time (the method registry's discovery, ``import_module(f"{BUILTIN}.{module}")``, and the package
root's lazy exports) are not edges: discovery is how the registry avoids depending on the
methods that depend on it."""

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "nefl_zoo"


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imported_by_name(node: ast.AST, package: str) -> list[str]:
    """The module that ``importlib.import_module("NAME")`` / ``import_module("NAME")`` (any
    alias ending in ``import_module``) imports when NAME is a literal; a relative NAME is
    resolved against ``package`` (``import_module(".x", __package__)``)."""
    if not (isinstance(node, ast.Call) and node.args):
        return []
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    name = node.args[0]
    if called != "import_module" or not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return []
    target = name.value
    if target.startswith("."):
        level = len(target) - len(target.lstrip("."))
        up = package.split(".")[: len(package.split(".")) - level + 1]
        target = ".".join(up + ([target.lstrip(".")] if target.lstrip(".") else []))
    return [target]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring)."""
    mods = modules(root)
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
            else:
                targets = imported_by_name(node, package)
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


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path / next(iter(files)).split("/")[0]


def test_a_literal_import_module_is_an_edge_and_closes_a_cycle(tmp_path):
    """A circle made with ``import_module`` is reported; a computed name is not an edge."""
    root = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "import importlib\n\ndef up():\n    return importlib.import_module('pkg.high')\n",
        "pkg/high.py": "from . import low\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/a.py": "from importlib import import_module as im\n\ndef f(n):\n"
                        "    return import_module('..sub.b', __package__), im('pkg.' + n)\n",
        "pkg/sub/b.py": "",
    })
    graph = import_graph(root)
    assert graph["pkg.low"] == {"pkg.high"} and graph["pkg.sub.a"] == {"pkg.sub.b"}
    assert cycles(graph) == [["pkg.high", "pkg.low", "pkg.high"]]


def test_the_model_registry_reaching_into_nest_by_name_is_a_cycle(tmp_path):
    """The circle this graph used to miss: ``models/registry.py`` importing ``nefl_zoo.nest``
    with ``importlib.import_module`` (it no longer does: nest registers its sources)."""
    copy = tmp_path / "nefl_zoo"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cycles(import_graph(copy)) == []
    registry = copy / "models" / "registry.py"
    registry.write_text(registry.read_text() + "\n\ndef _nest_info(name):\n"
                        "    return importlib.import_module('nefl_zoo.nesting.net').model_info(name)\n")
    found = cycles(import_graph(copy))
    assert found and all("nefl_zoo.models.registry" in c for c in found)
    assert any(m.startswith("nefl_zoo.nest") for c in found for m in c)


def test_method_files_import_only_shared_modules():
    """A method module never imports another method's module (its subpackage's own modules aside)."""
    graph = import_graph()
    methods = "nefl_zoo.fl.methods."
    for name, targets in graph.items():
        if name.startswith(methods):
            own = methods + name[len(methods):].split(".")[0]
            others = [t for t in targets if t.startswith(methods) and t != own and not t.startswith(own + ".")]
            assert not others, (name, others)
