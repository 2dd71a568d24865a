"""One-line errors with exit code 2 for bad input."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

USAGE_ERROR = 2


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` on stderr and return the exit to raise (code 2)."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(USAGE_ERROR)


def require_positive(**options: int | float | None) -> None:
    """Exit with a one-line error for the first option below 1 (``None`` means unset)."""
    for name, value in options.items():
        if value is not None and value < 1:
            raise fail(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


@contextlib.contextmanager
def user_errors(*types: type[BaseException]) -> Iterator[None]:
    """Turn the given exception types (and ``ValueError``/``KeyError``/``FileNotFoundError``)
    into a one-line error and exit code 2."""
    try:
        yield
    except (ValueError, KeyError, FileNotFoundError, *types) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise fail(str(message).splitlines()[0] if message else type(exc).__name__) from None


__all__ = ["fail", "require_positive", "user_errors", "USAGE_ERROR"]
