"""A rich progress bar and the final summary table of a training run (an engine observer)."""

from __future__ import annotations


class RichProgress:
    """Shows a progress bar while a run trains and a table of every submodel at the end.

    Use it as a context manager, so the bar is closed even when the run is interrupted."""

    bar = None
    epsilon = None  # the last round's cumulative epsilon of a private run (aggregation.dp)

    def __enter__(self) -> "RichProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, engine) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cfg = engine.config
        self.title = f"{cfg.method} {cfg.name}"
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.bar.start()
        self.task = self.bar.add_task(self.title, total=cfg.rounds, completed=engine.round)

    def round(self, record: dict, last_eval: dict) -> None:
        acc = f" worst {last_eval['worst']:.3f} avg {last_eval['avg']:.3f}" if last_eval else ""
        self.epsilon = record.get("epsilon", self.epsilon)
        eps = f" epsilon {self.epsilon:.3g}" if self.epsilon is not None else ""
        self.bar.update(self.task, advance=1, description=f"{self.title} round {record['round']} loss {record['train_loss']:.3f}{acc}{eps}")

    def end(self, engine, result) -> None:
        from rich.table import Table

        from .console import console

        self.bar.stop()
        self.bar = None
        table = Table(title=f"{engine.config.method}: {engine.config.name} after {result.rounds} rounds")
        table.add_column("submodel")
        table.add_column("elements sent", justify="right")
        table.add_column("accuracy", justify="right")
        for tier, acc in result.acc.items():
            table.add_row(tier, f"{engine.strategy.submodel_numel(tier):,}", f"{100 * acc:.2f}%")
        worst = f"worst ({result.worst_case})" if result.worst_case else "worst (minimum)"
        table.add_row(f"{worst} / avg / min", "", f"{100 * result.worst:.2f}% / {100 * result.avg:.2f}% / {100 * result.min:.2f}%")
        out = console()
        out.print(table)
        out.print(f"communication: {result.bytes_down / 1e6:.1f} MB down, {result.bytes_up / 1e6:.1f} MB up; run dir {engine.out}")
        dp = engine.config.aggregation.dp
        if dp is not None and self.epsilon is not None:
            out.print(f"privacy: ({self.epsilon:.3g}, {dp.delta:g})-DP for each client after {result.rounds} rounds "
                      f"(noise multiplier {dp.noise_multiplier:g}, sampling rate {engine.config.clients.fraction:g})")
