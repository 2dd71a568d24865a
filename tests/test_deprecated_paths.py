"""The module paths that moved keep working for one release: importing an old path warns, naming
the new one, and gives the new module's objects; nothing of ours imports an old path."""

import __future__
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MOVED = {  # old path -> new path (CHANGELOG.md, "Deprecated")
    "nefl_zoo.datasets": "nefl_zoo.data.datasets",
    "nefl_zoo.fl.aggregate": "nefl_zoo.fl.aggregation.nefedavg",
    "nefl_zoo.fl.client": "nefl_zoo.fl.training.client",
    "nefl_zoo.fl.data": "nefl_zoo.data.loading",
    "nefl_zoo.fl.registry": "nefl_zoo.fl.strategy.registry",
    "nefl_zoo.fl.store": "nefl_zoo.runs.store",
    "nefl_zoo.fl.strategy_utils": "nefl_zoo.fl.methods.common",
}


def fresh_import(name: str):
    """Import ``name`` again (its module body runs, as in a new process), warnings recorded."""
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_same_objects(old):
    new = importlib.import_module(MOVED[old])
    module, caught = fresh_import(old)
    assert [str(w.message) for w in caught] == [f"{old} is deprecated: import {MOVED[old]} (the old path goes in the next release)"]
    public = getattr(new, "__all__", [name for name, value in vars(new).items()
                                      if not name.startswith("_") and not isinstance(value, __future__._Feature)])
    assert public and all(getattr(module, name) is getattr(new, name) for name in public)


def test_the_changelog_lists_every_move():
    unreleased = (ROOT / "CHANGELOG.md").read_text().split("\n## ")[1]
    assert unreleased.startswith("Unreleased")
    deprecated = unreleased.split("### Deprecated")[1].split("\n### ")[0]
    assert all(f"`{old}` -> `{new}`" in deprecated for old, new in MOVED.items())


def test_nothing_of_ours_imports_an_old_path():
    """The package, the CLI, the tests, benchmarks, examples and docs use the new paths (an old
    one is named only by its own module, this file and the changelog)."""
    old = re.compile(r"\b(" + "|".join(re.escape(m) for m in MOVED) + r")\b")
    shims = {ROOT / (m.replace(".", "/") + ".py") for m in MOVED}
    files = [p for folder in ("nefl_zoo", "cli", "tests", "benchmarks", "examples", "docs", "tools")
             for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".yaml") and "node_modules" not in p.parts]
    files += [ROOT / "README.md", ROOT / "TESTING.md", ROOT / "pyproject.toml"]
    named = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files if p not in shims and p != Path(__file__) and p.name != "changelog.md"
             for m in old.finditer(p.read_text(encoding="utf-8"))]
    assert named == []
