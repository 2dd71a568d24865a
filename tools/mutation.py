"""Mutation testing of the core, one module at a time (``make mutation``; see TESTING.md).

Each module in ``[tool.nefl-zoo.mutation]`` of ``pyproject.toml`` is mutated alone and its
mutants are run against that module's test files only, with one worker: a list of files, or a
table ``{tests = [...], timeout_constant = S}`` for files whose module-scoped fixtures take
long (mutmut's timeout counts only the test calls, so S seconds are added to each mutant's
estimate). Each mutant runs its tests file by file in the listed order (fastest first within a
file, as mutmut does), so a mutant that the fast files kill never starts the slow ones. mutmut
keeps one set of results, reset whenever the test selection changes, so the score and the
surviving mutants of each module are printed right after its run::

    python tools/mutation.py                          # every module
    python tools/mutation.py nefl_zoo.fl.aggregate    # one module
    python tools/mutation.py nefl_zoo.runtime.tiers MUTANT...   # only these mutants of it, again
"""

from __future__ import annotations

import dataclasses
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


def run(module: str, entry: dict, names: list[str] | None = None) -> None:
    """Mutate ``module`` and run its mutants (or only ``names``) against ``entry["tests"]``;
    print the score and the survivors."""
    import mutmut.configuration as configuration
    from mutmut.__main__ import cli, collect_source_file_mutation_data
    from mutmut.runners.harness import PytestRunner
    from mutmut.stats import status_by_exit_code

    tests = list(entry["tests"])
    base = configuration._load_config()
    configuration._config = dataclasses.replace(
        base, pytest_add_cli_args_test_selection=tests,
        timeout_constant=float(entry.get("timeout_constant", base.timeout_constant)),
    )
    regular_args = PytestRunner._pytest_args_regular_run
    PytestRunner._pytest_args_regular_run = lambda self, ids: regular_args(self, in_file_order(list(ids), tests))
    try:
        cli(["run", "--max-children", "1", *(names or [f"{module}.*"])], standalone_mode=False)
    except SystemExit as exc:  # mutmut exits when the clean run of the tests fails
        if exc.code:
            raise
    finally:
        PytestRunner._pytest_args_regular_run = regular_args  # the next module orders by its own files
    mutants, _ = collect_source_file_mutation_data(mutant_names=names or [f"{module}.*"])
    status = {name: status_by_exit_code[result] for _, name, result in mutants}
    counts = Counter(status.values())
    killed, survived = counts["killed"], counts["survived"]
    other = "".join(f", {v} {k}" for k, v in counts.items() if k not in ("killed", "survived"))
    print(f"\n{module}: {killed} killed, {survived} survived of {len(status)} mutants{other} "
          f"({100 * killed / max(1, killed + survived):.1f}% of those run killed)")
    for name in sorted(n for n, s in status.items() if s != "killed"):
        print(f"  {status[name]}: {name}")


def main(argv: list[str]) -> None:
    table = modules()
    if argv and any("__mutmut_" in a for a in argv[1:]):
        run(argv[0], table[argv[0]], argv[1:])
        return
    for module in argv or list(table):
        run(module, table[module])


if __name__ == "__main__":
    main(sys.argv[1:])
