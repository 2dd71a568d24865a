"""The package's version: the one place it is written (pyproject.toml reads it from here; the
package root re-exports it as ``nefl_zoo.__version__``)."""

__version__ = "0.2.0"
