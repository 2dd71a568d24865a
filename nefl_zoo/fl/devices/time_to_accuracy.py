"""Time to accuracy: a comparison's accuracy against simulated time (runs with ``devices:``,
:mod:`.clock`), the time each entry needs to reach a target accuracy, its table and its plot.

:mod:`.report` gathers each run's evaluated records and their accuracy (the worst-case
submodel's, the full model's, the worst device class's); the curves here are per entry, per seed:
the simulated times of the evaluations and the accuracy (%) at each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

Curve = tuple[np.ndarray, np.ndarray]  # simulated seconds of the evaluations, accuracy (%) at each


def time_to_accuracy(times: Sequence[float], accuracy: Sequence[float], target: float) -> float | None:
    """The simulated time of the first evaluation whose accuracy reaches ``target`` (``None``: none does)."""
    hit = np.flatnonzero(np.asarray(accuracy, dtype=float) >= target)
    return float(np.asarray(times, dtype=float)[hit[0]]) if hit.size else None


def default_target(curves: Mapping[str, Sequence[Curve]]) -> float:
    """The highest accuracy every entry reaches: the smallest, over entries, of the seed mean of
    each run's best accuracy."""
    return float(min(np.mean([acc.max() for _, acc in runs]) for runs in curves.values()))


def time_table(labels: Mapping[str, str], curves: Mapping[str, Sequence[Curve]], target: float,
               totals: Mapping[str, Mapping[str, float]]) -> tuple[str, dict]:
    """Markdown and JSON of the time to ``target`` per entry: the mean over the seeds that reach it
    (how many of how many do), the final accuracy and simulated time (seed means) and the entry's
    ``totals`` (e.g. dropped and lost updates, summed over rounds, seed means)."""
    extra = list(dict.fromkeys(k for t in totals.values() for k in t))
    lines = [f"| Method | Time to {target:.2f}% (s) | Seeds reaching it | Final accuracy (%) | Simulated time (s) | "
             + "".join(f"{k} | " for k in extra), "|---|---|---|---|---|" + "---|" * len(extra)]
    data = {}
    for key, runs in curves.items():
        hits = [time_to_accuracy(t, a, target) for t, a in runs]
        reached = [h for h in hits if h is not None]
        data[key] = {"label": labels[key], "target": target, "time_to_target_s": hits,
                     "mean_time_to_target_s": float(np.mean(reached)) if reached else None,
                     "final_accuracy": float(np.mean([a[-1] for _, a in runs])), "final_time_s": float(np.mean([t[-1] for t, _ in runs])),
                     **{k: float(v) for k, v in totals.get(key, {}).items()}}
        row = data[key]
        time = "–" if row["mean_time_to_target_s"] is None else f"{row['mean_time_to_target_s']:,.0f}"
        lines.append(f"| {labels[key]} | {time} | {len(reached)}/{len(hits)} | {row['final_accuracy']:.2f} | {row['final_time_s']:,.0f} | "
                     + "".join(f"{row[k]:,.0f} | " if k in row else "– | " for k in extra))
    return "\n".join(lines) + "\n", data


def plot_time(labels: Mapping[str, str], curves: Mapping[str, Sequence[Curve]], target: float, path: Path, title: str,
              measure: str = "worst-case") -> None:
    """Accuracy (of ``measure``) against simulated time (hours), every seed of an entry in its colour, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, runs in curves.items():
        color = None
        for i, (times, acc) in enumerate(runs):
            line, = ax.plot(np.asarray(times) / 3600, acc, marker=".", color=color, label=labels[key] if i == 0 else None)
            color = line.get_color()
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.2f}%")
    ax.set(xlabel="simulated time (hours)", ylabel=f"{measure} top-1 accuracy (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Points = Mapping[str, Sequence[Sequence[tuple[dict, float]]]]  # per entry, per seed: (evaluated record, accuracy %)


def _curves(points: Points) -> dict[str, list[Curve]]:
    return {k: [(np.array([r["sim_time_s"] for r, _ in p]), np.array([a for _, a in p])) for p in runs] for k, runs in points.items()}


def time_report(labels: Mapping[str, str], points: Points, dirs: Mapping[str, Sequence[Path]], treatment: str, target: float | None,
                out: Path, plot: bool, title: str, more: Mapping[str, Points] | None = None) -> str:
    """The time to ``target`` accuracy (%; none: :func:`default_target`) of every entry, from each run's
    evaluated records and worst-case accuracy (``points``) and its directory (``dirs``: dropped and lost updates
    summed over ``metrics.jsonl``): markdown, ``time_to_accuracy.json`` and (``plot``) ``.png`` in ``out``.
    ``more``: further measures by name (``full model``, ``worst device class``), each against its own
    :func:`default_target`, in ``time_to_accuracy.json`` under ``measures`` and plotted as
    ``time_to_accuracy_NAME.png`` (spaces as ``_``)."""
    curves = _curves(points)
    totals = {}
    for key, paths in dirs.items():
        records = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in paths]
        totals[key] = {k: float(np.mean([sum(r[k] for r in rs) for rs in records])) for k in ("dropped", "lost")}
    target = default_target(curves) if target is None else target
    markdown, data = time_table(labels, curves, target, totals)
    report = {"treatment": treatment, "entries": data}
    if plot:
        plot_time(labels, curves, target, out / "time_to_accuracy.png", title)
    text = (f"\nTime to {target:.2f}% worst-case accuracy (BN {treatment}) on the simulated clock, seconds; dropped and lost "
            f"updates summed over rounds (seed means):\n\n{markdown}" + ("\n![accuracy vs simulated time](time_to_accuracy.png)\n" if plot else ""))
    for measure, measured in (more or {}).items():
        curves = _curves(measured)
        goal = default_target(curves)
        markdown, data = time_table(labels, curves, goal, {})
        report.setdefault("measures", {})[measure] = {"target": goal, "entries": data}
        figure = f"time_to_accuracy_{measure.replace(' ', '_')}.png"
        if plot:
            plot_time(labels, curves, goal, out / figure, title, measure)
        text += (f"\nTime to {goal:.2f}% accuracy of the {measure} (the highest every entry reaches) on the simulated clock, "
                 f"seconds:\n\n{markdown}" + (f"\n![{measure} accuracy vs simulated time]({figure})\n" if plot else ""))
    (out / "time_to_accuracy.json").write_text(json.dumps(report, indent=2))
    return text
