"""The package keeps the structure declared in ``[tool.nefl-zoo.structure]`` of pyproject.toml
(``tools/structure.py``: imports go down the layers, no import cycle, no function over the
line limit outside the allow-list, a table that is one-way and still the code's), and the
check finds each of those when it is planted in a copy of the tree (tests of the test).

Everything is read with ``ast``: nothing here imports torch, and a copy reuses the parse of
every file it did not change."""

import importlib.util
import shutil
import struct
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("nefl_zoo_structure_tool", ROOT / "tools" / "structure.py")
structure = sys.modules.setdefault(SPEC.name, importlib.util.module_from_spec(SPEC))
SPEC.loader.exec_module(structure)
TABLE = "[tool.nefl-zoo.structure] of pyproject.toml"


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the checked tree: pyproject.toml, nefl_zoo/ and cli/."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in ("nefl_zoo", "cli"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def plant(path: Path, text: str) -> int:
    """Append ``text`` to ``path``; the line number its first line gets."""
    before = path.read_text()
    path.write_text(before + text)
    return before.count("\n") + 1


def edit_table(tree: Path, old: str, new: str) -> None:
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text()
    assert text.count(old) == 1, old
    pyproject.write_text(text.replace(old, new))


# ---- the code as it is --------------------------------------------------------------------------
def test_the_code_keeps_its_declared_structure():
    assert structure.findings() == []


def test_the_table_declares_every_part_lowest_first_with_its_job():
    layout = structure.read_layout(ROOT / "pyproject.toml")
    names = list(layout.parts)
    assert names[0] == "version" and names[-2:] == ["nefl_zoo", "cli"] and layout.max_function_lines == 80
    assert {"models", "spec", "slim", "nesting", "runtime", "fl", "export"} <= set(names)
    assert all(part.job and "\n" not in part.job for part in layout.parts.values())
    assert "nefl_zoo.nesting" not in layout.parts["models"].imports  # the registry is told its sources
    assert layout.part_of("nefl_zoo.fl.methods.fedlps.method") == "fl.methods" and layout.part_of("nefl_zoo_cli.zoo") == "cli"
    assert layout.part_of("nefl_zoo.fl.engine") == "fl" and layout.part_of("nefl_zoo.data.loading") == "data"
    assert layout.part_of("nefl_zoo") == "nefl_zoo" and layout.part_of("nefl_zoo.nope") is None
    # data and the run directory lie below both training and export: exporting imports no part of fl
    assert names.index("data") < names.index("fl.strategy") and names.index("runs") < names.index("fl")
    assert not [p for p in layout.parts["export"].imports if p == "fl" or p.startswith("fl.")]


def test_a_subpackage_can_be_a_part_of_its_own():
    """A module belongs to the longest part that names it, so a subpackage can become a part by
    a line of the table alone."""
    parts = {name: structure.Part(name, "", ()) for name in ("nefl_zoo", "fl", "fl.methods", "cli")}
    layout = structure.Layout(parts, 80, ())
    assert layout.part_of("nefl_zoo.fl.methods.fedlps.method") == "fl.methods" and layout.part_of("nefl_zoo.fl.methods") == "fl.methods"
    assert layout.part_of("nefl_zoo.fl.engine") == "fl" and layout.part_of("nefl_zoo.flower") is None
    assert layout.part_of("nefl_zoo_cli.app") == "cli" and layout.part_of("nefl_zoo") == "nefl_zoo"


def test_the_graph_holds_relative_and_function_level_imports():
    graph = structure.import_graph()
    assert "nefl_zoo.fl.strategy.registry" in graph["nefl_zoo.fl.methods.nefl"]
    assert "nefl_zoo.fl.methods.fedlps.costs" in graph["nefl_zoo.fl.methods.fedlps.method"]  # inside a function
    assert "nefl_zoo.fl.methods.common" in graph["nefl_zoo.fl.methods.heterofl"]  # from ..common import
    assert "nefl_zoo.plugins" in graph["nefl_zoo.models.registry"]  # from .. import plugins: the module
    assert {"nefl_zoo_cli.zoo", "nefl_zoo_cli.errors"} <= set(graph["nefl_zoo_cli.app"])  # the CLI too
    assert structure.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert structure.cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_method_files_import_only_shared_modules():
    """A method module never imports another method's module (its subpackage's own modules and
    the modules the methods share, ``common`` and ``feddyn``, aside)."""
    methods = "nefl_zoo.fl.methods."
    shared = {methods + "common", methods + "feddyn"}
    for name, targets in structure.import_graph().items():
        if name.startswith(methods):
            own = methods + name[len(methods):].split(".")[0]
            others = [t for t in targets if t.startswith(methods) and t != own and not t.startswith(own + ".") and t not in shared]
            assert not others, (name, others)


def png_text(path: Path) -> dict[str, str]:
    """The text chunks (``tEXt``) of a PNG file."""
    data, found, at = path.read_bytes(), {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        if kind == b"tEXt":
            key, _, value = data[at + 8:at + 8 + length].partition(b"\0")
            found[key.decode("latin-1")] = value.decode("latin-1")
        at += 12 + length
    return found


def test_the_architecture_figure_is_drawn_from_the_declared_table():
    """The architecture page's figure records the fingerprint of the table it was drawn from:
    a figure older than the table fails until it is drawn again."""
    layout = structure.read_layout(ROOT / "pyproject.toml")
    drawn = png_text(ROOT / "docs" / "explanations" / "img" / "architecture.png").get("nefl_zoo.layers")
    assert drawn == structure.fingerprint(layout), "draw it again: python tools/docs_figures.py architecture"
    changed = structure.Layout({**layout.parts, "cli": structure.Part("cli", "another job", layout.parts["cli"].imports)},
                               layout.max_function_lines, layout.long_functions)
    assert structure.fingerprint(changed) != drawn


# ---- tests of the test: each fault planted in a copy --------------------------------------------
def test_a_planted_climbing_import_fails(tree):
    """``data`` (a bottom layer) importing ``profile`` inside a function: one finding, naming
    the file and line, the parts, and where the layers are declared."""
    assert structure.findings(tree) == []
    line = plant(tree / "nefl_zoo" / "data" / "datasets.py", "\n\ndef _late():\n    from .. import profile\n\n    return profile\n")
    assert structure.findings(tree) == [
        f"nefl_zoo/data/datasets.py:{line + 3}: nefl_zoo.data.datasets imports nefl_zoo.profile: part 'data' may import "
        f"userfiles, not 'profile' (a lower layer never imports a higher one; the layers are {TABLE})"]


def test_a_planted_import_cycle_fails(tree):
    """Two modules of one part importing each other (no layer climbed): the cycle alone."""
    plant(tree / "nefl_zoo" / "slim" / "slicemap.py", "\n\ndef _compiler():\n    from . import compiler\n\n    return compiler\n")
    assert structure.findings(tree) == [
        "import cycle: nefl_zoo.slim.slicemap -> nefl_zoo.slim.compiler -> nefl_zoo.slim.slicemap"]


@pytest.mark.parametrize("length", [80, 81])
def test_a_planted_81_line_function_fails_and_80_lines_pass(tree, length):
    body = "def planted(x):\n" + "    x += 1\n" * (length - 2) + "    return x\n"
    line = plant(tree / "cli" / "console.py", "\n\nclass Planted:\n    " + body.replace("\n    ", "\n        "))
    assert structure.findings(tree) == ([] if length == 80 else [
        f"cli/console.py:{line + 3}: Planted.planted is 81 lines long, over 80: split it into named steps"])


def test_a_literal_import_module_climbs_and_closes_a_cycle(tree):
    """``models/registry.py`` reaching into nesting with ``importlib.import_module`` (the circle an
    import-statement graph misses): a climb and a cycle; a computed name is no edge."""
    registry = tree / "nefl_zoo" / "models" / "registry.py"
    line = plant(registry, "\n\ndef _nest_info(name):\n    importlib.import_module('nefl_zoo.' + name)\n"
                           "    return importlib.import_module('..nesting.net', __package__).model_info(name)\n")
    found = structure.findings(tree)
    assert found[0] == (f"nefl_zoo/models/registry.py:{line + 4}: nefl_zoo.models.registry imports nefl_zoo.nesting.net: "
                        f"part 'models' may import plugins, userfiles, not 'nesting' (a lower layer never imports a "
                        f"higher one; the layers are {TABLE})")
    assert len(found) > 1 and all(f.startswith("import cycle: ") and "nefl_zoo.models.registry" in f for f in found[1:])


def test_a_table_that_drifted_from_the_code_fails(tree):
    """A part listing one above it, an allowance no module uses, a part without modules, a module
    in no part, and an allow-list entry that is not long: each one finding."""
    edit_table(tree, 'spec = { job = "submodel specs and their validation", imports = ["userfiles", "models"] }\n', "")
    edit_table(tree, 'slim = { job', 'spec = { job = "specs", imports = ["userfiles", "models"] }\nslim = { job')
    edit_table(tree, 'imports = ["userfiles"] }\nruntime', 'imports = ["userfiles", "memory"] }\nruntime')
    edit_table(tree, "auto = { job", 'ghost = { job = "nothing", imports = [] }\nauto = { job')
    edit_table(tree, 'long-functions = []\n', 'long-functions = ["nefl_zoo/spec.py::parse_spec"]\n')
    edit_table(tree, 'models = { job = "the model zoo: registry, contract, families", imports = ["plugins", "userfiles"] }\n',
               'models = { job = "the model zoo", imports = ["plugins", "userfiles", "spec"] }\n')
    (tree / "nefl_zoo" / "extra.py").write_text('"""A module nobody placed."""\n')
    assert structure.findings(tree) == [
        f"nefl_zoo/extra.py: module nefl_zoo.extra is in no part: add its part to {TABLE}",
        f"{TABLE}: layers.manifest lists 'memory', which none of its modules imports: remove it",
        f"{TABLE}: layers.models lists 'spec', which is not below it: a part imports only parts listed before it",
        f"{TABLE}: layers.ghost: no module nefl_zoo.ghost (or below it): remove the part",
        f"{TABLE}: long-functions names nefl_zoo/spec.py::parse_spec, which is no longer over 80 lines "
        "(or no longer there): remove it"]


def test_a_malformed_table_names_the_field(tree):
    edit_table(tree, 'version = { job = "the package\'s version", imports = [] }', 'version = { job = "v" }')
    with pytest.raises(ValueError, match=r"pyproject.toml: tool.nefl-zoo.structure.layers.version: expected "):
        structure.findings(tree)
