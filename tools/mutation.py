"""Mutation testing of the core, one module at a time (``make mutation``; see TESTING.md).

Each module in ``[tool.nefl-zoo.mutation]`` of ``pyproject.toml`` is mutated alone and its
mutants are run against that module's fast test files only, with one worker. mutmut keeps one
set of results, reset whenever the test selection changes, so the score and the surviving
mutants of each module are printed right after its run::

    python tools/mutation.py                          # every module
    python tools/mutation.py nefl_zoo.fl.aggregate    # one module
    python tools/mutation.py nefl_zoo.runtime MUTANT...   # only these mutants of it, again
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from collections import Counter
from pathlib import Path


def modules() -> dict[str, list[str]]:
    """Module -> its test files, from ``pyproject.toml``."""
    return tomllib.loads(Path("pyproject.toml").read_text())["tool"]["nefl-zoo"]["mutation"]


def run(module: str, tests: list[str], names: list[str] | None = None) -> None:
    """Mutate ``module`` and run its mutants (or only ``names``) against ``tests``; print the
    score and the survivors."""
    import mutmut.configuration as configuration
    from mutmut.__main__ import cli, collect_source_file_mutation_data
    from mutmut.stats import status_by_exit_code

    base = configuration._load_config()
    configuration._config = dataclasses.replace(base, pytest_add_cli_args_test_selection=list(tests))
    try:
        cli(["run", "--max-children", "1", *(names or [f"{module}.*"])], standalone_mode=False)
    except SystemExit as exc:  # mutmut exits when the clean run of the tests fails
        if exc.code:
            raise
    mutants, _ = collect_source_file_mutation_data(mutant_names=names or [f"{module}.*"])
    status = {name: status_by_exit_code[result] for _, name, result in mutants}
    counts = Counter(status.values())
    killed, survived = counts["killed"], counts["survived"]
    other = "".join(f", {v} {k}" for k, v in counts.items() if k not in ("killed", "survived"))
    print(f"\n{module}: {killed} killed, {survived} survived of {len(status)} mutants{other} "
          f"({100 * killed / max(1, killed + survived):.1f}% of those run killed)")
    for name in sorted(n for n, s in status.items() if s == "survived"):
        print(f"  survived: {name}")


def main(argv: list[str]) -> None:
    table = modules()
    if argv and any("__mutmut_" in a for a in argv[1:]):
        run(argv[0], table[argv[0]], argv[1:])
        return
    for module in argv or list(table):
        run(module, table[module])


if __name__ == "__main__":
    main(sys.argv[1:])
