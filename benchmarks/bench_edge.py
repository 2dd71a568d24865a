"""Edge families: per shipped edge spec and tier, MACs and ONNX Runtime latency at
batch 1 and 32, one thread; do the tiers ordered by MACs run in that order?

Each spec's tiers are exported as ``nefl-zoo export SPEC`` writes them (random weights, BatchNorm
folded, dynamic batch, verified against PyTorch) and timed with ``TierRuntime.benchmark_many``:
every tier of the spec once per round (``nefl_zoo.timing.interleaved_median_ms``), ``--runs``
rounds after two untimed ones, each figure the median of its rounds, so that a change of machine
load hits every tier alike. Ratios are against the spec's largest tier. Targets: at
batch 1 the latency increases with the MACs, and latency ratio / MACs ratio <= 1.2 for
gamma >= 0.4.

    .venv/bin/python benchmarks/bench_edge.py [--specs mobilenet_v2/nefl-wd ...] [--batches 1 32] [--runs 20]

Results: every table printed goes to ``benchmarks/results/edge.json`` and the figure drawn from it
to ``docs/benchmarks/img/edge.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

from bench_latency import _load, _monotone
from nefl_zoo.export import ExportOptions, export_tiers, load_source
from nefl_zoo.runtime import TierRuntime

import publish  # results JSON and figure (benchmarks/publish.py)

SPECS = tuple(f"{family}/nefl-wd" for family in (
    "mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "efficientnet_b0", "shufflenet_v2_x1_0", "shufflenet_v2_x0_5"))
TARGET = 1.2  # latency ratio / MACs ratio, gamma >= 0.4


def bench_spec(name: str, batches: list[int], runs: int, workdir: Path) -> list[dict]:
    """One row per tier: gamma, MACs, MACs and parameter ratios, and per batch the median ms
    and latency ratio / MACs ratio."""
    manifest = export_tiers(load_source(name), workdir / name.replace("/", "_"), ExportOptions(latency_runs=1, threads=1))
    runtime = TierRuntime(workdir / name.replace("/", "_"), threads=1)
    entries = {t.name: t for t in manifest.tiers}
    largest = max(entries.values(), key=lambda t: t.macs)
    rows = {t: dict(spec=name, tier=t, gamma=e.gamma, macs=e.macs, macs_ratio=e.macs / largest.macs, params=e.params,
                    params_ratio=e.params_ratio) for t, e in entries.items()}
    for batch in batches:
        ms = runtime.benchmark_many(list(entries), batch, runs=runs)
        for t, row in rows.items():
            row[f"ms_{batch}"] = ms[t]
            row[f"over_{batch}"] = ms[t] / ms[largest.name] / row["macs_ratio"]
    return list(rows.values())


def to_markdown(rows: list[dict], batches: list[int], runs: int, loads: tuple[str, str], wall_s: float) -> str:
    """The table, one line per spec on the targets, and the machine."""
    head = "| spec | tier | params | params ratio | MACs | MACs ratio | " + " | ".join(
        f"batch {b} ms | batch {b} latency ratio / MACs ratio" for b in batches) + " |"
    lines = [head, "|" + "---|" * (6 + 2 * len(batches))]
    summary = []
    for spec in dict.fromkeys(r["spec"] for r in rows):
        group = sorted((r for r in rows if r["spec"] == spec), key=lambda r: r["macs"])
        for r in group:
            cells = " | ".join(f"{r[f'ms_{b}']:.2f} | {r[f'over_{b}']:.2f}" for b in batches)
            lines.append(f"| {spec} | {r['tier']} | {r['params']:,} | {r['params_ratio']:.3f} | {r['macs'] / 1e6:.1f}M | "
                         f"{r['macs_ratio']:.3f} | {cells} |")
        checked = [r for r in group if r["gamma"] is not None and r["gamma"] >= 0.4]
        summary.append(
            f"- {spec}: latency increasing with MACs: "
            + ", ".join(f"batch {b} {'yes' if _monotone(group, f'ms_{b}') else 'no'}" for b in batches)
            + f"; latency ratio / MACs ratio <= {TARGET} (gamma >= 0.4): "
            + ", ".join(f"batch {b} {sum(r[f'over_{b}'] <= TARGET for r in checked)}/{len(checked)} tiers" for b in batches)
        )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, onnxruntime {ort.__version__}, 1 thread; "
        f"load average before: {loads[0]}, after: {loads[1]}; wall time {wall_s:.0f} s"
    )
    return (f"Random weights, median of {runs} interleaved rounds, {machine}.\n\n"
            + "\n".join(lines) + "\n\n" + "\n".join(summary) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=list(SPECS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before, start = _load(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for spec in args.specs for row in bench_spec(spec, args.batches, args.runs, Path(tmp))]
    print(to_markdown(rows, args.batches, args.runs, (before, _load()), time.perf_counter() - start))


if __name__ == "__main__":
    publish.run("edge", main)
