"""The Python API reference documents what it shows, and its examples run.

The reference pages (``docs/reference/api/*.md``) render modules with ``::: MODULE``
(mkdocstrings, from the docstrings, read by griffe with the site's options). Here the same
objects are read the same way, statically, and each public function, method and class is
checked:

* it has a docstring;
* a function or method documents every parameter in an ``Args:`` section and, unless it
  returns ``None``, what it returns (``Returns:`` or ``Yields:``);
* a class documents its constructor's parameters (``Args:`` or ``Attributes:``); a pydantic
  model, every field (a ``description`` or an ``Attributes:`` entry);
* the examples in its docstring (``>>>`` lines, doctest) give the output they show.

An object is public as the site shows it: a module's ``__all__`` where it has one, else its
names without a leading underscore; a class's own members without one.

The objects are read once, by the tests that need them (not at collection: every xdist
worker collects every file), and each test reports every object at fault.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="griffe (the docs extra) is not installed")

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "reference" / "api").glob("*.md"))
DIRECTIVE = re.compile(r"^::: ([\w.]+)", re.MULTILINE)
DOCUMENTED = {"parameters", "other parameters"}
SKIPPED_PARAMETERS = {"self", "cls"}


def _load() -> list:
    """The public objects the reference pages render, in page order."""
    extensions = griffe.load_extensions("griffe_pydantic")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], extensions=extensions,
                                 docstring_parser=griffe.Parser.google,
                                 docstring_options={"returns_multiple_items": False,
                                                    "warn_missing_types": False})
    modules = [name for page in PAGES for name in DIRECTIVE.findall(page.read_text(encoding="utf-8"))]
    for package in dict.fromkeys(name.split(".")[0] for name in modules):
        loader.load(package)  # once: loading it again drops what extensions found
    loader.resolve_aliases(implicit=True, external=False)
    found: dict[str, object] = {}
    for name in modules:
        module = loader.modules_collection[name]
        found.setdefault(module.path, module)  # its docstring's examples run too
        for member in _public(module):
            found.setdefault(member.path, member)
            if member.is_class:
                for method in _public(member):
                    found.setdefault(method.path, method)
    return list(found.values())


def _public(obj) -> list:
    out = []
    for name, member in obj.members.items():
        if name.startswith("_") or not member.is_public:
            continue
        try:
            target = member.final_target if member.is_alias else member
        except griffe.AliasResolutionError:  # a name griffe cannot follow (a, b = ...): a constant
            continue
        if target.is_module:
            continue
        if obj.is_class and (target.is_attribute or "property" in target.labels):
            continue  # fields and properties: documented as attributes
        if obj.is_module and target.is_attribute:
            continue  # module constants: documented where they are used
        out.append(target)
    return out


@pytest.fixture(scope="module")
def objects() -> list:
    return _load()


def test_the_reference_renders_the_package(objects):
    """The walk finds what the pages render (an empty walk would pass every check)."""
    paths = {obj.path for obj in objects}
    assert len(objects) > 150
    assert {"nefl_zoo.slim.compiler.compile_spec", "nefl_zoo.runtime.tiers.TierRuntime.run",
            "nefl_zoo.fl.aggregation.nefedavg.nefedavg", "nefl_zoo.export.tiers.export_tiers"} <= paths


def problems(obj) -> list[str]:
    """What the docstring of ``obj`` (a griffe function or class) leaves undocumented."""
    if obj.is_module:
        return [] if obj.docstring else ["no docstring"]
    if not obj.docstring or not obj.docstring.value.strip():
        return ["no docstring"]
    sections = obj.docstring.parse(griffe.Parser.google, returns_multiple_items=False, warn_missing_types=False)
    named = {item.name.lstrip("*") for s in sections if s.kind.value in DOCUMENTED | {"attributes"}
             for item in s.value}
    kinds = {s.kind.value for s in sections}
    if obj.is_class:
        if "pydantic-model" in obj.labels:
            return [f"field {name!r} has no description" for name, field in obj.members.items()
                    if "pydantic-field" in field.labels and not field.docstring and name not in named]
        init = obj.members.get("__init__")
        parameters = init.parameters if init is not None and init.is_function else []
    else:
        parameters = obj.parameters
    found = [f"argument {p.name!r} is not in Args" for p in parameters
             if p.name not in SKIPPED_PARAMETERS and p.name not in named]
    returns = obj.returns if obj.is_function else None
    if obj.is_function and obj.name != "__init__" and returns is not None and str(returns) != "None":
        if not kinds & {"returns", "yields"}:
            found.append(f"returns {returns} but has no Returns section")
    return found


def test_every_public_callable_documents_its_arguments_and_returns(objects):
    found = [f"{obj.path} ({obj.relative_filepath}:{obj.lineno}): " + "; ".join(problems(obj))
             for obj in objects if problems(obj)]
    assert not found, f"{len(found)} objects of the API reference are not documented:\n" + "\n".join(found)


def test_the_check_finds_what_is_missing():
    module = griffe.visit("example", filepath=Path("example.py"), code='''
def documented(a: int, *, b: str = "") -> int:
    """Sum.

    Args:
        a: the first.
        b: the second.

    Returns:
        The sum.
    """

def missing(a: int, b: int) -> int:
    """Sum.

    Args:
        a: the first.
    """

def silent(a) -> None:
    pass
''')
    assert problems(module["documented"]) == []
    assert problems(module["missing"]) == ["argument 'b' is not in Args", "returns int but has no Returns section"]
    assert problems(module["silent"]) == ["no docstring"]


def test_docstring_examples_run(objects, tmp_path_factory, monkeypatch, request):
    """Each docstring's ``>>>`` example, run by doctest in a fresh namespace, in a temporary
    working directory of its own holding the repository's ``specs/`` and, for the examples
    that read it, ``exports/tiers``: the suite's shared export of three tiers
    (``nested_export_dir``)."""
    examples = [obj for obj in objects if obj.docstring and ">>>" in obj.docstring.value]
    assert len(examples) >= 30
    report: list[str] = []
    for obj in examples:
        folder = tmp_path_factory.mktemp("example")
        monkeypatch.chdir(folder)
        (folder / "specs").symlink_to(ROOT / "specs")
        if "exports/tiers" in obj.docstring.value:
            (folder / "exports").mkdir()
            (folder / "exports" / "tiers").symlink_to(request.getfixturevalue("nested_export_dir"))
        module = importlib.import_module(obj.module.path)
        test = doctest.DocTestParser().get_doctest(obj.docstring.value, {"__name__": module.__name__}, obj.path,
                                                   str(obj.filepath), obj.docstring.lineno)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=report.append)
    assert not report, "".join(report)
