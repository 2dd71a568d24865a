"""Mutation testing of the core, one module at a time (``make mutation``; see TESTING.md).

Each module in ``[tool.nefl-zoo.mutation]`` of ``pyproject.toml`` is mutated alone and its
mutants are run against that module's test files only, one at a time (``--children N``: N at once): a list of files, or a
table ``{tests = [...], timeout_constant = S}`` for files whose module-scoped fixtures take
long (mutmut's timeout counts only the test calls, so S seconds are added to each mutant's
estimate). Each mutant runs every test of each file in which mutmut saw one of its tests
(:func:`whole_files`: a module-scoped fixture's readers too), file by file in the listed order
(fastest first within a file, as mutmut does), so a mutant that the fast files kill never
starts the slow ones. mutmut
keeps one set of results, reset whenever the test selection changes, so the score and the
surviving mutants of each module are printed right after its run::

    python tools/mutation.py                          # every module
    python tools/mutation.py nefl_zoo.fl.aggregation.nefedavg    # one module
    python tools/mutation.py nefl_zoo.runtime.tiers MUTANT...   # only these mutants of it, again
    python tools/mutation.py --sample 120 nefl_zoo.fl.training.parallel   # 120 of its mutants, drawn with seed 0
    python tools/mutation.py --children 2 nefl_zoo.nesting.ids     # two mutants at once (one per core)

``--sample N [--seed S]`` scores a module whose full run would not fit in a session: N of its
mutants drawn at random (``random.Random(S)``, from the sorted names), the same N for the same
code and seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tomllib
from collections import Counter
from pathlib import Path


def modules() -> dict[str, dict]:
    """Module -> ``{"tests": [its test files], "timeout_constant": seconds or absent}``, from
    ``pyproject.toml``."""
    table = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["nefl-zoo"]["mutation"]
    return {module: entry if isinstance(entry, dict) else {"tests": entry} for module, entry in table.items()}


def in_file_order(tests: list[str], selection: list[str]) -> list[str]:
    """``tests`` (pytest node ids, already fastest first) sorted stably by the file of
    ``selection`` they are in."""
    files = [Path(f).as_posix() for f in selection]
    return sorted(tests, key=lambda t: files.index(t.split("::")[0]) if t.split("::")[0] in files else len(files))


def whole_files(tests_by_function: dict[str, set[str]], all_tests: list[str]) -> None:
    """Give each function every test of each file one of its tests is in. mutmut credits a
    function only to the tests during which it ran, so a module-scoped fixture (an export made
    once per file) is credited to the first test that asks for it, and the tests that read it
    afterwards would never run against the function's mutants."""
    by_file: dict[str, set[str]] = {}
    for test in all_tests:
        by_file.setdefault(test.split("::")[0], set()).add(test)
    for tests in tests_by_function.values():
        tests |= {t for f in {t.split("::")[0] for t in tests} for t in by_file.get(f, ())}


def drop_plain_copies() -> None:
    """Delete ``mutants/`` copies of modules to mutate that hold no mutants. mutmut copies a
    module it does not mutate with a new mtime, and later takes that copy for an up-to-date
    mutated file: a module added to ``only_mutate`` afterwards would never be mutated."""
    table = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mutmut"]["only_mutate"]
    for path in table:
        copy = Path("mutants") / path
        if copy.is_file() and "__mutmut_" not in copy.read_text():
            copy.unlink()


def own_mutants(module: str) -> list[str]:
    """mutmut's name patterns for the mutants of ``module``'s own functions and methods: a
    package's ``__init__.py`` (``nefl_zoo.nesting``) without those of its submodules."""
    return [f"{module}.x_*", f"{module}.xǁ*"]


def mutant_names(module: str) -> list[str]:
    """The sorted names of the mutants of ``module``'s own functions (generated first); none
    for a module of imports and decorated functions only."""
    from fnmatch import fnmatch

    from mutmut.__main__ import (collect_source_file_mutation_data, copy_also_copy_files, copy_src_dir,
                                 create_mutants, setup_source_paths)

    Path("mutants").mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    create_mutants(1)
    mutants, _ = collect_source_file_mutation_data(mutant_names=None)
    return sorted(name for _, name, _ in mutants if any(fnmatch(name, p) for p in own_mutants(module)))


def sample_names(names: list[str], size: int, seed: int) -> list[str]:
    """``size`` of ``names`` drawn with ``seed``."""
    return sorted(random.Random(seed).sample(names, min(size, len(names))))


def run(module: str, entry: dict, names: list[str] | None = None, sample: tuple[int, int] | None = None,
        children: int = 1) -> None:
    """Mutate ``module`` and run its mutants (or only ``names``, or a ``sample`` of (size,
    seed)) against ``entry["tests"]``, ``children`` mutants at a time; print the score and the survivors."""
    import mutmut.__main__ as mutmut_main
    import mutmut.configuration as configuration
    from mutmut.__main__ import cli, collect_source_file_mutation_data
    from mutmut.state import state
    from mutmut.runners.harness import PytestRunner
    from mutmut.stats import status_by_exit_code

    tests = list(entry["tests"])
    base = configuration._load_config()
    configuration._config = dataclasses.replace(
        base, pytest_add_cli_args_test_selection=tests,
        timeout_constant=float(entry.get("timeout_constant", base.timeout_constant)),
    )
    collect = mutmut_main.collect_or_load_stats

    def collect_whole_files(*args, **kwargs):
        collect(*args, **kwargs)
        whole_files(state().tests_by_mangled_function_name, list(state().duration_by_test))

    mutmut_main.collect_or_load_stats = collect_whole_files
    regular_args = PytestRunner._pytest_args_regular_run
    PytestRunner._pytest_args_regular_run = lambda self, ids: regular_args(self, in_file_order(list(ids), tests))
    every = mutant_names(module)
    if not every:
        print(f"\n{module}: no mutants (imports, constants and decorated functions only)")
        return
    if sample:
        names = sample_names(every, *sample)
        print(f"{module}: {len(names)} of its {len(every)} mutants drawn with seed {sample[1]}")
    try:
        cli(["run", "--max-children", str(children), *(names or own_mutants(module))], standalone_mode=False)
    except SystemExit as exc:  # mutmut exits when the clean run of the tests fails
        if exc.code:
            raise
    finally:
        PytestRunner._pytest_args_regular_run = regular_args  # the next module orders by its own files
        mutmut_main.collect_or_load_stats = collect
    mutants, _ = collect_source_file_mutation_data(mutant_names=names or own_mutants(module))
    status = {name: status_by_exit_code[result] for _, name, result in mutants}
    counts = Counter(status.values())
    killed, survived = counts["killed"], counts["survived"]
    other = "".join(f", {v} {k}" for k, v in counts.items() if k not in ("killed", "survived"))
    print(f"\n{module}: {killed} killed, {survived} survived of {len(status)} mutants{other} "
          f"({100 * killed / max(1, killed + survived):.1f}% of those run killed)")
    for name in sorted(n for n, s in status.items() if s != "killed"):
        print(f"  {status[name]}: {name}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Mutation testing, one module at a time (TESTING.md).")
    parser.add_argument("names", nargs="*", help="modules (default: every one), or one module and some of its mutants")
    parser.add_argument("--sample", type=int, help="score this many of each module's mutants, drawn at random")
    parser.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    parser.add_argument("--children", type=int, default=1,
                        help="mutants run at once (default 1; one per core at most, with OMP_NUM_THREADS=1)")
    args = parser.parse_args(argv)
    drop_plain_copies()
    table = modules()
    if args.names and any("__mutmut_" in a for a in args.names[1:]):
        run(args.names[0], table[args.names[0]], args.names[1:], children=args.children)
        return
    for module in args.names or list(table):
        run(module, table[module], sample=(args.sample, args.seed) if args.sample else None, children=args.children)


if __name__ == "__main__":
    main(sys.argv[1:])
