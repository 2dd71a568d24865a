"""The rich console every command prints tables with."""

from __future__ import annotations

import sys


def console():
    """A rich ``Console``; when output is not a terminal (a pipe, a log, CI) it is wide
    enough that tables are not truncated to 80 columns."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200)
