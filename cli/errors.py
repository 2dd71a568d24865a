"""One-line errors with exit code 2 for bad input.

Every command is registered through :func:`guarded`, so that nothing but a one-line
``error: ...`` (exit 2) or a command's documented exit 1 reaches the user: whatever escapes a
command body (a ``ValueError`` naming a file and field, an ``OSError``, ``MemoryError``, an
unexpected exception) is printed as one line, and click's usage errors (a bad option value,
an unknown option) are turned into one line by the app's group (:func:`usage_message`). Set
``NEFL_ZOO_TRACEBACK=1`` to see the traceback of an unexpected one instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator, TypeVar

import click
import typer

USAGE_ERROR = 2
TRACEBACK_ENV = "NEFL_ZOO_TRACEBACK"
F = TypeVar("F", bound=Callable)


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` on stderr and return the exit to raise (code 2)."""
    typer.echo(f"error: {_one_line(message)}", err=True)
    return typer.Exit(USAGE_ERROR)


def _one_line(text: str) -> str:
    from nefl_zoo.userfiles import one_line

    lines = str(text).strip().splitlines()
    return one_line(lines[0]) if lines else ""


def require_positive(**options: int | float | None) -> None:
    """Exit with a one-line error for the first option below 1 (``None`` means unset)."""
    for name, value in options.items():
        if value is not None and not value >= 1:
            raise fail(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


def require_budget(**options: float | None) -> None:
    """Exit with a one-line error for the first option that is not a finite number >= 0."""
    import math

    for name, value in options.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise fail(f"--{name.replace('_', '-')}: must be a finite number >= 0, got {value:g}")


class Choice(click.Choice):
    """A choice option's type whose refusal reads like the project's other errors: ``expected
    embedded or flower, got 'ray'``. :meth:`wrapping` keeps the matching of the type typer made
    (an ``Enum`` by its value)."""

    inner: click.Choice | None = None

    @classmethod
    def wrapping(cls, inner: click.Choice) -> "Choice":
        """This type around ``inner``: ``inner`` converts, this one words the refusal."""
        choice = cls(inner.choices, inner.case_sensitive)
        choice.inner = inner
        return choice

    def convert(self, value, param, ctx):
        try:
            return (super() if self.inner is None else self.inner).convert(value, param, ctx)
        except click.BadParameter:
            self.fail(f"expected {_alternatives(self.names())}, got {value!r}", param, ctx)

    def names(self) -> list[str]:
        """The choices as a user types them (an ``Enum`` member by its value)."""
        return [str(getattr(c, "value", c)) for c in self.choices]


def _alternatives(names: list[str]) -> str:
    return " or ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} or {names[-1]}"


def usage_message(exc: click.UsageError) -> str:
    """One line for a click usage error: ``--OPTION: what is wrong`` for a bad value, else
    click's message and where the options are listed."""
    param = getattr(exc, "param", None)
    if isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter) and param is not None:
        name = param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
        return f"{name}: {_one_line(exc.message)}"
    where = f" (`{exc.ctx.command_path} --help` lists the options)" if exc.ctx is not None else ""
    return _one_line(exc.format_message()) + where


def describe(exc: BaseException) -> str:
    """One line saying what went wrong, for an exception that escaped a command."""
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "allocate" in str(exc)):
        detail = _one_line(str(exc))
        return "not enough memory" + (f" ({detail})" if detail else "") + "; use a smaller --batch or model"
    if isinstance(exc, RecursionError):
        return "input nested too deeply to process"
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or _one_line(str(exc)) or type(exc).__name__}"
    if isinstance(exc, KeyError) and exc.args:
        return _one_line(str(exc.args[0]))
    message = _one_line(str(exc))
    if isinstance(exc, ValueError):
        return message or type(exc).__name__
    return f"{type(exc).__name__}: {message} (unexpected; {TRACEBACK_ENV}=1 shows the traceback)"


def guarded(command: F) -> F:
    """``command`` with every exception but click's own (exits, aborts, usage errors) turned
    into a one-line ``error:`` and exit code 2."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (the point: nothing else reaches the user)
            # click's and typer's own exits, aborts and usage errors pass through; typer >= 0.2x
            # has its own classes (and a vendored click), so they are known by their package
            if type(exc).__module__.partition(".")[0] in ("click", "typer") or os.environ.get(TRACEBACK_ENV):
                raise
            raise fail(describe(exc)) from None

    return run  # type: ignore[return-value]


@contextlib.contextmanager
def user_errors(*types: type[BaseException]) -> Iterator[None]:
    """Turn the given exception types (and ``ValueError``/``KeyError``/``OSError``)
    into a one-line error and exit code 2."""
    try:
        yield
    except (ValueError, KeyError, OSError, *types) as exc:
        raise fail(describe(exc)) from None


__all__ = ["Choice", "fail", "guarded", "usage_message", "require_budget", "require_positive", "user_errors", "USAGE_ERROR"]
