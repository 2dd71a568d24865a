"""The devices' side of a comparison (``compare`` on a config with ``devices:``).

The time each entry needs to reach a target accuracy on the simulated clock (:mod:`.time_to_accuracy`),
on the worst-case submodel (the NeFL paper's "Worst"), on the full model and, where the runs score
their device classes (``eval.device_classes``, :mod:`.classes`), on the worst device class.
Then what each device class gets at the end (the last evaluation, mean ± std over seeds): its
accuracy on the tier its clients run and on the full model, the worst class and the spread; its
updates summed over the rounds (seed means); the tiers its clients run. Written to
``results.md`` (the returned markdown), ``device_classes.json`` and (``plot``) ``device_classes.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from .time_to_accuracy import Points

UPDATES = ("sampled", "arrived", "dropped", "lost")


def read_records(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def full_points(records: Sequence[dict], full: str, treatment: str) -> list[tuple[dict, float]]:
    """Every evaluated record and the full model's accuracy (%) in it under ``treatment``."""
    return [(r, 100 * r.get("extra", {}).get(f"{treatment}/{full}", r["acc"][full])) for r in records if "acc" in r]


def worst_class_points(records: Sequence[dict]) -> list[tuple[dict, float]]:
    """Every evaluated record and its worst device class's accuracy (%)."""
    return [(r, 100 * r["worst_device_class"]) for r in records if "worst_device_class" in r]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def class_summary(records: Mapping[str, Sequence[Sequence[dict]]]) -> dict:
    """Per entry, from each seed's records: every device class's accuracy (%) on its clients' tiers
    and on the full model at the last evaluation (mean, std over seeds), the worst class and the
    spread likewise, its updates summed over the rounds (seed means) and the tiers its clients run."""
    out = {}
    for key, runs in records.items():
        finals = [[r for r in rs if "device_accuracy" in r][-1] for rs in runs]
        classes = list(finals[0]["device_accuracy"])
        row = {"classes": {}}
        for name in classes:
            stats = {f: _mean_std([100 * f_["device_accuracy"][name][f] for f_ in finals]) for f in ("tier", "full")}
            updates = {k: float(np.mean([sum(r["device_classes"][name][k] for r in rs if "device_classes" in r) for rs in runs]))
                       for k in UPDATES}
            row["classes"][name] = {"tier": stats["tier"], "full": stats["full"], "tiers": finals[0]["device_accuracy"][name]["tiers"],
                                    "test_images": finals[0]["device_accuracy"][name]["test_images"], "updates": updates}
        row["worst_class"] = _mean_std([100 * f["worst_device_class"] for f in finals])
        row["spread"] = _mean_std([100 * f["device_class_spread"] for f in finals])
        out[key] = row
    return out


def _cell(stat: Sequence[float]) -> str:
    return f"{stat[0]:.2f} ± {stat[1]:.2f}"


def class_tables(labels: Mapping[str, str], summary: Mapping[str, dict], seeds: int) -> str:
    """The markdown of :func:`class_summary`: accuracy per device class, updates per class, tiers per class."""
    names = list(next(iter(summary.values()))["classes"])
    lines = [f"\nWhat each device class gets: top-1 accuracy (%) on its clients' own test splits, on the tier each client runs "
             f"and on the full model, at the last evaluation; the worst class and the spread (best minus worst) on the tiers; "
             f"mean ± std over {seeds} seed(s):", "",
             "| Method | " + " | ".join(f"{n}: its tier | {n}: full model" for n in names) + " | Worst class | Spread |",
             "|---|" + "---|---|" * len(names) + "---|---|"]
    for key, row in summary.items():
        cells = " | ".join(f"{_cell(row['classes'][n]['tier'])} | {_cell(row['classes'][n]['full'])}" for n in names)
        lines.append(f"| {labels[key]} | {cells} | {_cell(row['worst_class'])} | {_cell(row['spread'])} |")
    lines += ["", "Updates per device class, summed over the rounds (seed means): arrived, and dropped (late or out of memory) "
              "plus lost (offline), of the clients sent a model:", "",
              "| Method | " + " | ".join(f"{n}: arrived | {n}: dropped + lost" for n in names) + " |", "|---|" + "---|---|" * len(names)]
    for key, row in summary.items():
        u = {n: row["classes"][n]["updates"] for n in names}
        cells = (f"{u[n]['arrived']:,.1f} | {u[n]['dropped'] + u[n]['lost']:,.1f}" for n in names)
        lines.append(f"| {labels[key]} | " + " | ".join(cells) + " |")
    lines += ["", "The tier each device class's clients run (clients per tier; seed 0):", "",
              "| Method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key, row in summary.items():
        cells = (", ".join(f"{t}: {c}" for t, c in row["classes"][n]["tiers"].items()) for n in names)
        lines.append(f"| {labels[key]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_classes(labels: Mapping[str, str], summary: Mapping[str, dict], path: Path, title: str) -> None:
    """Per entry, each device class's accuracy on its tier (left) and on the full model (right),
    bars with the seed std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(summary.values()))["classes"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    x, width = np.arange(len(summary)), 0.8 / len(names)
    for ax, field, heading in zip(axes, ("tier", "full"), ("on the tier its clients run", "on the full model")):
        for i, name in enumerate(names):
            stats = np.array([row["classes"][name][field] for row in summary.values()])
            ax.bar(x + (i - (len(names) - 1) / 2) * width, stats[:, 0], width, yerr=stats[:, 1], capsize=2, label=name)
        ax.set_xticks(x, [labels[k] for k in summary], rotation=30, ha="right", fontsize=7)
        ax.set(title=f"each device class {heading}", ylabel="top-1 accuracy on its clients' data (%)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def devices_report(setting: str, labels: Mapping[str, str], seeds: Sequence[int], points: Points, treatment: str, out: Path,
                   plot: bool, target: float | None) -> str:
    """The time to accuracy of every entry (by key: its ``labels``; its runs in ``out/KEY/seedN``, their
    worst-case ``points`` under the BN ``treatment``) and, where the runs score device classes, what
    each class gets (see the module docstring); ``setting`` (model and dataset) titles the figures."""
    from ...spec import load_spec
    from .time_to_accuracy import time_report

    dirs = {k: [out / k / f"seed{s}" for s in seeds] for k in labels}
    records = {k: [read_records(d) for d in paths] for k, paths in dirs.items()}
    full = {k: load_spec(paths[0] / "spec.yaml").full_tier.name for k, paths in dirs.items()}  # the spec of the method's own state
    more = {"full model": {k: [full_points(rs, full[k], treatment) for rs in records[k]] for k in labels}}
    scored = all("worst_device_class" in rs[-1] for runs in records.values() for rs in runs)
    if scored:
        more["worst device class"] = {k: [worst_class_points(rs) for rs in runs] for k, runs in records.items()}
    markdown = time_report(labels, points, dirs, treatment, target, out, plot, f"{setting}: accuracy against simulated time", more)
    if not scored:
        return markdown
    summary = class_summary(records)
    (out / "device_classes.json").write_text(json.dumps({"labels": dict(labels), "entries": summary}, indent=2))
    markdown += class_tables(labels, summary, len(seeds))
    if plot:
        plot_classes(labels, summary, out / "device_classes.png", f"{setting}: what each device class gets")
        markdown += "\n![accuracy per device class](device_classes.png)\n"
    return markdown
