"""Entry point of ``nefl-zoo``. Sub-command modules register themselves on ``app``; none of
them imports torch at module level, so ``nefl-zoo --help`` stays quick."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="nefl-zoo",
    help="Nested federated learning: model zoo, submodel specs, profiling, training and ONNX tiers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

from . import zoo  # noqa: E402  (registers models, specs, schema, build, profile)
from . import export  # noqa: E402  (registers export, select, predict, bench-tiers)
from . import train  # noqa: E402  (registers train, compare)

zoo.register(app)
export.register(app)
train.register(app)


def main() -> None:
    """Console-script entry point."""
    app()
