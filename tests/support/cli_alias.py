"""A pytest plugin for mutation runs only (``pytest_add_cli_args`` in pyproject.toml): the CLI
package is installed as ``nefl_zoo_cli`` but lives in ``cli/``, and mutmut names its mutants after
the file path (``cli.errors.x_...``) while a mutant is switched on by the running function's
``__module__``. Here ``nefl_zoo_cli.X`` is the module ``cli.X`` (the copy mutmut mutated), so the
two names agree and the CLI's mutants can be run."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

INSTALLED, SOURCE = "nefl_zoo_cli", "cli"


class CliAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``nefl_zoo_cli[.X]`` as the already named module ``cli[.X]``."""

    def find_spec(self, name, path=None, target=None):
        if name == INSTALLED or name.startswith(INSTALLED + "."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(SOURCE + spec.name[len(INSTALLED):])

    def exec_module(self, module):
        """Nothing: the module was executed when ``cli.X`` was imported."""


def pytest_configure(config) -> None:
    """Put the alias first on ``sys.meta_path`` (once), before any test file is imported."""
    if not any(isinstance(finder, CliAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, CliAlias())
