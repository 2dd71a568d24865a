"""tools/mutation.py's choice of the tests each mutant runs."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("mutation_tool", Path(__file__).resolve().parents[1] / "tools" / "mutation.py")
mutation = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(mutation)


def test_a_function_runs_every_test_of_the_files_its_tests_are_in():
    every = ["tests/a.py::fixture_maker", "tests/a.py::fixture_reader", "tests/b.py::other", "tests/c.py::one", "tests/c.py::two"]
    credited = {"f": {"tests/a.py::fixture_maker"}, "g": {"tests/b.py::other", "tests/c.py::two"}, "h": set()}
    mutation.whole_files(credited, every)
    assert credited == {"f": {"tests/a.py::fixture_maker", "tests/a.py::fixture_reader"},
                        "g": {"tests/b.py::other", "tests/c.py::one", "tests/c.py::two"}, "h": set()}


def test_the_tests_run_file_by_file_in_the_selections_order():
    tests = ["tests/b.py::x", "tests/a.py::y", "tests/z.py::w", "tests/b.py::v"]
    assert mutation.in_file_order(tests, ["tests/a.py", "tests/b.py"]) == ["tests/a.py::y", "tests/b.py::x", "tests/b.py::v", "tests/z.py::w"]


def test_a_packages_own_mutants_leave_out_its_submodules():
    from fnmatch import fnmatch

    names = ["nefl_zoo.nesting.x_nest__mutmut_1", "nefl_zoo.nesting.xǁAutoArgsǁ__init____mutmut_2",
             "nefl_zoo.nesting.channels.x_analyse__mutmut_3", "nefl_zoo.nesting.channels.xǁChannelsǁnew__mutmut_4"]
    assert [n for n in names if any(fnmatch(n, p) for p in mutation.own_mutants("nefl_zoo.nesting"))] == names[:2]
    assert [n for n in names if any(fnmatch(n, p) for p in mutation.own_mutants("nefl_zoo.nesting.channels"))] == names[2:]


def test_plain_copies_of_modules_to_mutate_are_dropped_and_mutated_ones_kept(tmp_path, monkeypatch):
    """mutmut copies a module it does not mutate with a fresh mtime and later takes that copy for
    an up-to-date mutated file; such a copy of a module now in ``only_mutate`` is deleted."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nonly_mutate = ["pkg/a.py", "pkg/b.py", "pkg/c.py"]\n')
    (tmp_path / "mutants" / "pkg").mkdir(parents=True)
    (tmp_path / "mutants" / "pkg" / "a.py").write_text("def f():\n    return 1\n")  # plain copy
    (tmp_path / "mutants" / "pkg" / "b.py").write_text("def x_f__mutmut_1():\n    return 2\n")  # mutated
    (tmp_path / "mutants" / "pkg" / "d.py").write_text("def g():\n    return 3\n")  # not to mutate
    mutation.drop_plain_copies()
    assert sorted(p.name for p in (tmp_path / "mutants" / "pkg").iterdir()) == ["b.py", "d.py"]


def test_the_cli_alias_imports_the_installed_name_as_the_source_module(tmp_path, monkeypatch):
    """Under mutation ``nefl_zoo_cli.X`` is the module ``cli.X``, so that a mutant named after
    ``cli/X.py`` is switched on by its function's ``__module__``."""
    import sys

    from .support import cli_alias

    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "__init__.py").write_text("")
    (tmp_path / "cli" / "errors.py").write_text("def where():\n    return where.__module__\n")
    (tmp_path / "cli" / "app.py").write_text("from .errors import where\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = cli_alias.CliAlias()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in ("nefl_zoo_cli", "nefl_zoo_cli.app", "nefl_zoo_cli.errors", "cli", "cli.app", "cli.errors"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import nefl_zoo_cli.app as app  # noqa: E402 (the alias)
    import nefl_zoo_cli.errors as errors  # noqa: E402

    assert app.where() == "cli.errors" and errors is sys.modules["cli.errors"] and app is sys.modules["cli.app"]
    assert finder.find_spec("nefl_zoo") is None and finder.find_spec("nefl_zoo_clix") is None
    for name in ("nefl_zoo_cli", "nefl_zoo_cli.app", "nefl_zoo_cli.errors", "cli", "cli.app", "cli.errors"):
        sys.modules.pop(name, None)
