"""The package's structure, read from its source with ``ast`` (nothing is imported: no torch).

Usage: python tools/structure.py    (each finding on one line; exit status 1 when there is one)

The layers are declared in one place, ``[tool.nefl-zoo.structure]`` of ``pyproject.toml``: each
*part* (a subpackage or module of ``nefl_zoo``, the package root ``nefl_zoo`` itself, and ``cli``,
the command line) with its job and the parts it imports, lowest first. The findings:

* an import that climbs: a module imports a part that its own part does not list;
* an import cycle between modules;
* a function longer than ``max-function-lines``, unless the allow-list ``long-functions`` names
  it; an entry of that list that is no longer long, or no longer there;
* a table that is not one-way or no longer the code's: a part that lists a part not above it,
  lists a part none of its modules imports, or has no module; a module in no part.

The import graph holds every import statement that names a module of ``nefl_zoo`` or ``cli``
(installed as ``nefl_zoo_cli``), absolute or relative, wherever it stands (module level, inside
a function, under ``if TYPE_CHECKING``): a function-level import still climbs, and one that
closes a cycle still fails or half-initialises at run time. ``from PKG import NAME`` is an edge
to ``PKG.NAME`` when that is a module, else to ``PKG``. A module imported by name with a literal
name (``importlib.import_module("nefl_zoo.nesting.sources")``, ``import_module(".net",
__package__)``) is an edge too: it is an import that only hides from import statements. Names
computed at run time (the method registry's discovery, ``import_module(f"{BUILTIN}.{module}")``,
and the package root's lazy exports) are not edges: discovery is how the registry avoids
depending on the methods that depend on it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"nefl_zoo": "nefl_zoo", "nefl_zoo_cli": "cli"}  # importable name -> folder under the root
CLI = "cli"  # the command line's part (the package nefl_zoo_cli)
TABLE = "[tool.nefl-zoo.structure] of pyproject.toml"


@dataclass(frozen=True)
class Part:
    """One part of the package: its job (one line) and the parts it imports."""

    name: str
    job: str
    imports: tuple[str, ...]

    @property
    def module(self) -> str:
        """The module this part is (its submodules belong to it too, unless it is the root)."""
        if self.name == CLI:
            return "nefl_zoo_cli"
        return "nefl_zoo" if self.name == "nefl_zoo" else f"nefl_zoo.{self.name}"


@dataclass(frozen=True)
class Layout:
    """The declared structure: the parts lowest first, the longest function allowed, and the
    functions allowed to be longer for now (``path::qualified.name``)."""

    parts: dict[str, Part]
    max_function_lines: int
    long_functions: tuple[str, ...]

    def part_of(self, module: str) -> str | None:
        """The part ``module`` belongs to: the longest part that names it or a package above it
        (the root part holds only the root module)."""
        found = None
        for part in self.parts.values():
            inside = module == part.module or (part.name != "nefl_zoo" and module.startswith(part.module + "."))
            if inside and (found is None or len(part.module) > len(self.parts[found].module)):
                found = part.name
        return found


def read_layout(pyproject: Path) -> Layout:
    """The structure declared in ``pyproject``; a malformed table is a ``ValueError`` naming the
    field."""
    table = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["nefl-zoo"]["structure"]
    parts = {}
    for name, entry in table["layers"].items():
        if not (isinstance(entry, dict) and set(entry) == {"job", "imports"} and isinstance(entry["job"], str)
                and isinstance(entry["imports"], list) and all(isinstance(i, str) for i in entry["imports"])):
            raise ValueError(f"{pyproject}: tool.nefl-zoo.structure.layers.{name}: expected "
                             "{ job = \"...\", imports = [\"part\", ...] }")
        parts[name] = Part(name, entry["job"], tuple(entry["imports"]))
    return Layout(parts, int(table["max-function-lines"]), tuple(table["long-functions"]))


def fingerprint(layout: Layout) -> str:
    """The SHA-256 of the layers table (each part's name, job and imports, in order): what a
    figure drawn from the table records, so that a stale figure is found."""
    table = [[part.name, part.job, list(part.imports)] for part in layout.parts.values()]
    return hashlib.sha256(json.dumps(table).encode()).hexdigest()


# ---- what each file holds -----------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
    """What one file holds: its imports (the modules each may name, most specific first, and its
    line) and its functions (qualified name, first line, length in lines)."""

    imports: tuple[tuple[tuple[str, ...], int], ...]
    functions: tuple[tuple[str, int, int], ...]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of ``nefl_zoo`` and ``nefl_zoo_cli`` under ``root``
    (a package is its ``__init__``)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@functools.lru_cache(maxsize=None)
def facts(text: str, package: str) -> Facts:
    """The imports and functions of a file whose source is ``text``, in ``package`` (the package
    its relative imports start from). Cached by text: a copy of the tree is parsed once."""
    tree = ast.parse(text)
    imports = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports += [((alias.name,), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module or "", node.level, package)
            imports += [((f"{base}.{alias.name}", base), node.lineno) for alias in node.names]
        elif (name := _imported_by_name(node, package)) is not None:
            imports.append(((name,), node.lineno))
    return Facts(tuple(imports), tuple(_functions(tree)))


def _absolute(name: str, level: int, package: str) -> str:
    """The absolute name of an import of ``name`` ``level`` packages up from ``package``."""
    if not level:
        return name
    up = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(up + ([name] if name else []))


def _imported_by_name(node: ast.AST, package: str) -> str | None:
    """The module that ``importlib.import_module("NAME")`` / ``import_module("NAME")`` (any alias
    ending in ``import_module``) imports when NAME is a literal, a relative NAME resolved against
    ``package``; ``None`` for any other node."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    name = node.args[0]
    if called != "import_module" or not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    target = name.value
    level = len(target) - len(target.lstrip("."))
    return _absolute(target.lstrip("."), level, package)


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, first line, lines from ``def`` to the last line) of every function and
    method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.lineno, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def file_facts(root: Path = ROOT) -> dict[str, tuple[Path, Facts]]:
    """Module -> (file, its facts) for every module under ``root``."""
    out = {}
    for name, path in modules(root).items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out[name] = (path, facts(path.read_text(encoding="utf-8"), package))
    return out


def import_graph(root: Path = ROOT, found: dict[str, tuple[Path, Facts]] | None = None) -> dict[str, dict[str, int]]:
    """Module -> {each module of the packages it imports: the line of its first such import}."""
    found = file_facts(root) if found is None else found
    graph: dict[str, dict[str, int]] = {name: {} for name in found}
    for name, (_, file) in found.items():
        for candidates, line in file.imports:
            target = next((c for c in candidates if c in found), candidates[-1])
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].setdefault(target, line)
    return graph


def cycles(graph: dict[str, set[str]] | dict[str, dict[str, int]]) -> list[list[str]]:
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


# ---- the checks ---------------------------------------------------------------------------------
def climbing_imports(layout: Layout, graph: dict[str, dict[str, int]], files: dict[str, Path], root: Path) -> list[str]:
    """Each import of a part that the importing module's part does not list."""
    out = []
    for name, targets in sorted(graph.items()):
        source = layout.part_of(name)
        for target, line in sorted(targets.items()):
            part = layout.part_of(target)
            if source and part and part != source and part not in layout.parts[source].imports:
                listed = ", ".join(layout.parts[source].imports) or "nothing"
                out.append(f"{files[name].relative_to(root)}:{line}: {name} imports {target}: part {source!r} "
                           f"may import {listed}, not {part!r} (a lower layer never imports a higher one; "
                           f"the layers are {TABLE})")
    return out


def table_problems(layout: Layout, graph: dict[str, dict[str, int]], files: dict[str, Path], root: Path) -> list[str]:
    """Where the declared table is not one-way, or no longer describes the code."""
    out, below = [], []
    used: dict[str, set[str]] = {name: set() for name in layout.parts}
    for name, targets in graph.items():
        source = layout.part_of(name)
        if source is None:
            out.append(f"{files[name].relative_to(root)}: module {name} is in no part: add its part to {TABLE}")
            continue
        used[source] |= {layout.part_of(t) for t in targets} - {source, None}
    owned = {layout.part_of(name) for name in graph}
    for part in layout.parts.values():
        for target in part.imports:
            if target not in below:
                where = "is not a part" if target not in layout.parts else "is not below it"
                out.append(f"{TABLE}: layers.{part.name} lists {target!r}, which {where}: a part imports only "
                           "parts listed before it")
            elif target not in used[part.name]:
                out.append(f"{TABLE}: layers.{part.name} lists {target!r}, which none of its modules imports: "
                           "remove it")
        if part.name not in owned:
            out.append(f"{TABLE}: layers.{part.name}: no module {part.module} (or below it): remove the part")
        below.append(part.name)
    return out


def long_functions(layout: Layout, found: dict[str, tuple[Path, Facts]], root: Path) -> list[str]:
    """Each function over the limit that the allow-list does not name, and each entry of the
    allow-list that names no such function."""
    out, longest = [], layout.max_function_lines
    long = {}
    for path, file in found.values():
        for qualname, line, length in file.functions:
            if length > longest:
                long[f"{path.relative_to(root).as_posix()}::{qualname}"] = (line, length)
    for key, (line, length) in sorted(long.items()):
        if key not in layout.long_functions:
            path, _, qualname = key.partition("::")
            out.append(f"{path}:{line}: {qualname} is {length} lines long, over {longest}: split it into "
                       "named steps")
    for key in layout.long_functions:
        if key not in long:
            out.append(f"{TABLE}: long-functions names {key}, which is no longer over {longest} lines "
                       "(or no longer there): remove it")
    return out


def findings(root: Path = ROOT) -> list[str]:
    """Every finding for the tree under ``root`` (its ``pyproject.toml``, ``nefl_zoo/``, ``cli/``)."""
    layout = read_layout(root / "pyproject.toml")
    found = file_facts(root)
    graph = import_graph(root, found)
    files = {name: path for name, (path, _) in found.items()}
    return [
        *table_problems(layout, graph, files, root),
        *climbing_imports(layout, graph, files, root),
        *(f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)),
        *long_functions(layout, found, root),
    ]


def main() -> int:
    found = findings()
    print("\n".join(found) if found else "every import goes down the declared layers; no import cycle; no function over "
          "the limit outside the allow-list")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
