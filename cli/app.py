"""Entry point of ``nefl-zoo``. Sub-command modules register themselves on ``app``; none of
them imports torch at module level, so ``nefl-zoo --help`` stays quick."""

from __future__ import annotations

import click
import typer
from typer.core import TyperGroup

from .errors import Choice, fail, usage_message


class Commands(TyperGroup):
    """The command group: every choice option refuses a bad value as ``expected A or B, got
    'C'``, and every usage error (a bad value, a missing or unknown option) is one line
    ``error: ...`` on stderr with exit code 2, like every other bad input."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for command in self.commands.values():
            for param in command.params:
                if isinstance(param.type, click.Choice) and not isinstance(param.type, Choice):
                    param.type = Choice.wrapping(param.type)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise fail(usage_message(exc)) from None


def _version(shown: bool) -> None:
    if shown:
        from nefl_zoo import __version__

        typer.echo(f"nefl-zoo {__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="nefl-zoo",
    cls=Commands,
    help="Nested federated learning: model zoo, submodel specs, profiling, training and ONNX tiers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
) -> None:
    """Nested federated learning: model zoo, submodel specs, profiling, training and ONNX tiers."""


from . import zoo  # noqa: E402  (registers models, specs, schema, build, profile)
from . import export  # noqa: E402  (registers export, select, predict, bench-tiers)
from . import train  # noqa: E402  (registers train, compare, methods)
from . import serve  # noqa: E402  (registers serve)

zoo.register(app)
export.register(app)
train.register(app)
serve.register(app)


def main() -> None:
    """Console-script entry point."""
    app()
