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

    names = ["nefl_zoo.nest.x_nest__mutmut_1", "nefl_zoo.nest.xǁAutoArgsǁ__init____mutmut_2",
             "nefl_zoo.nest.channels.x_analyse__mutmut_3", "nefl_zoo.nest.channels.xǁChannelsǁnew__mutmut_4"]
    assert [n for n in names if any(fnmatch(n, p) for p in mutation.own_mutants("nefl_zoo.nest"))] == names[:2]
    assert [n for n in names if any(fnmatch(n, p) for p in mutation.own_mutants("nefl_zoo.nest.channels"))] == names[2:]
