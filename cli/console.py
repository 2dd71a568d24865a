"""Where commands print: the rich console for tables, and one JSON document for ``--json``."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import typer


def console():
    """A rich ``Console``; when output is not a terminal (a pipe, a log, CI) it is wide
    enough that tables are not truncated to 80 columns."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)


def print_json(data: Any) -> None:
    """Print ``data`` as one JSON document on stdout (what every ``--json`` prints)."""
    import json

    typer.echo(json.dumps(data, indent=2))


@contextlib.contextmanager
def stdout_to_stderr(active: bool = True) -> Iterator[None]:
    """While active, send whatever the body prints on stdout (a library's progress or
    notices) to stderr, so that stdout holds nothing but the command's JSON."""
    if not active:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def json_option():
    """The ``--json`` option of a command that prints results."""
    return typer.Option(False, "--json", help="print the result as one JSON document on stdout, nothing else")
