"""Run several methods x seeds on one setup; tabulate worst/avg accuracy and plot it vs MACs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from typing import Callable

from .config import RunConfig
from .engine import Engine, RunObserver, RunResult
from .strategy import get_method


@dataclass
class Comparison:
    """Per method, the runs' results; plus the files written."""

    runs: dict[str, list[RunResult]]
    markdown: str
    results_md: Path
    plot: Path


def _mean_std(values: list[float]) -> str:
    a = 100 * np.asarray(values)
    return f"{a.mean():.2f} ± {a.std(ddof=1) if len(a) > 1 else 0.0:.2f}"


def results_table(config: RunConfig, runs: dict[str, list[RunResult]]) -> str:
    """A markdown table in the layout of the NeFL paper's Table 1 (worst and avg accuracy)."""
    spec = config.submodel_spec()
    seeds = len(next(iter(runs.values())))
    lines = [
        f"Top-1 accuracy (%) of the worst-case submodel and the average over submodels, mean ± std over "
        f"{seeds} seed(s); {config.data.dataset}, {config.data.partition}, {config.rounds} rounds, "
        f"{config.clients.num_clients} clients x {config.clients.fraction}.",
        "",
        "| Model | Method | Worst | Avg |",
        "|---|---|---|---|",
    ]
    for method, results in runs.items():
        lines.append(f"| {spec.model} | {get_method(method).label} | {_mean_std([r.worst for r in results])} | {_mean_std([r.avg for r in results])} |")
    lines += ["", "Per submodel (mean over seeds):", "", "| Method | " + "submodel: accuracy |", "|---|---|"]
    for method, results in runs.items():
        cells = ", ".join(f"{t}: {100 * np.mean([r.acc[t] for r in results]):.2f}" for t in results[0].acc)
        lines.append(f"| {get_method(method).label} | {cells} |")
    return "\n".join(lines) + "\n"


def _macs(config: RunConfig, method: str) -> dict[str, int]:
    """MACs of the method's submodels by name; none for a method whose evaluated models are not
    tiers of a compiled spec (FedLPS reports accuracy per task)."""
    from ..profile import profile_tiers

    compiled = getattr(config.with_method(method).build_strategy(), "compiled", None)
    return {p.name: p.macs for p in profile_tiers(compiled)} if compiled is not None else {}


def plot_accuracy_vs_macs(config: RunConfig, runs: dict[str, list[RunResult]], path: Path) -> None:
    """Accuracy of every submodel against its MACs, one line per method (mean ± std over seeds);
    methods without per-submodel MACs are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, results in runs.items():
        macs = _macs(config, method)
        tiers = sorted((t for t in results[0].acc if t in macs), key=macs.__getitem__)
        if not tiers:  # nothing to place on the MACs axis
            continue
        acc = np.array([[100 * r.acc[t] for t in tiers] for r in results])
        x = [macs[t] / 1e6 for t in tiers]
        ax.errorbar(x, acc.mean(0), yerr=acc.std(0), marker="o", capsize=3, label=get_method(method).label)
    ax.set_xlabel("MACs per image (millions)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(f"{config.submodel_spec().model} on {config.data.dataset}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_methods(
    config: RunConfig, methods: list[str], seeds: int, out: str | Path, observer: Callable[[], RunObserver] | None = None
) -> Comparison:
    """Train every method with seeds ``config.seed .. config.seed + seeds - 1`` into ``out``.

    The config's ``method_args`` apply to its own method; the other methods use their defaults.
    ``observer`` makes one observer per run (e.g. a progress bar)."""
    out = Path(out)
    runs: dict[str, list[RunResult]] = {}
    for method in methods:
        runs[method] = []
        for s in range(seeds):
            cfg = config.with_method(method, config.seed + s)
            engine = Engine(cfg, out / method / f"seed{cfg.seed}")
            runs[method].append(engine.run(overwrite=True, observer=observer() if observer else None))
    markdown = results_table(config, runs)
    results_md, plot = out / "results.md", out / "accuracy_vs_macs.png"
    results_md.write_text(f"# {config.name}: method comparison\n\n{markdown}\n![accuracy vs MACs]({plot.name})\n")
    (out / "results.json").write_text(json.dumps({m: [r.__dict__ for r in rs] for m, rs in runs.items()}, indent=2))
    plot_accuracy_vs_macs(config, runs, plot)
    return Comparison(runs, markdown, results_md, plot)
