"""Aligned widths: does latency follow MACs, on onnxruntime and PyTorch eager, at batch 1 and 64?

For every tier of the aligned specs (``channel_multiple: 16``) and, beside them, the paper's
unaligned specs: the slim module (random weights, eval mode) is exported as ``nefl-zoo
export`` writes it (BatchNorm folded, dynamic batch, no channel padding) and timed with
onnxruntime, and the same module with PyTorch eager, at each batch size, one thread each. All
tiers of a spec are timed in interleaved rounds (every tier once per round, ``--reps`` rounds;
each figure the median of its rounds, each round the median of ``--runs`` calls), so a change
of machine load hits every tier alike. Ratios are against the spec's largest tier. Targets
(aligned specs): latency ratio / MACs ratio <= 1.15 for gamma >= 0.4 and <= 1.3 for
gamma >= 0.2, and latency increasing with the tier's MACs.

    .venv/bin/python benchmarks/bench_latency.py [--batches 1 64] [--reps 5] [--runs 3] [--specs ...]

Results: every table printed goes to ``benchmarks/results/latency.json`` and the figure drawn from it
to ``docs/benchmarks/img/latency.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

from nefl_zoo.export.onnx_file import INPUT_NAME, write_onnx
from nefl_zoo.export.surgery import fold_batchnorm
from nefl_zoo.profile import profile_tiers
from nefl_zoo.runtime import session_from_bytes
from nefl_zoo.slim import compile_spec
from nefl_zoo.spec import load_spec, resolve_spec_path
from nefl_zoo.timing import interleaved_median_ms

import publish  # results JSON and figure (benchmarks/publish.py)

SPECS = (
    "resnet56/nefl-wd", "resnet56/nefl-wd-aligned", "resnet110/nefl-wd", "resnet110/nefl-wd-aligned",
    "resnet18/nefl-wd", "resnet18/nefl-wd-aligned",
)


def bench_spec(name: str, batches: list[int], reps: int, runs: int, workdir: Path) -> list[dict]:
    """One row per tier and batch: MACs ratio, onnxruntime and eager latency and their ratios."""
    compiled = compile_spec(load_spec(resolve_spec_path(name)))
    profiles = {p.name: p for p in profile_tiers(compiled)}
    size = compiled.input_size
    modules, sessions = {}, {}
    for tier, ct in compiled.tiers.items():
        modules[tier] = ct.build().eval()
        path = workdir / f"{name.replace('/', '_')}_{tier}.onnx"
        write_onnx(fold_batchnorm(modules[tier]), path, size, 2, True, None)
        sessions[tier] = session_from_bytes(path.read_bytes(), str(path), threads=1)
    rows = []
    for batch in batches:
        x = torch.randn(batch, *size)
        feed = {INPUT_NAME: x.numpy()}
        fns = {}
        for tier in modules:
            fns[tier, "ort"] = functools.partial(sessions[tier].run, None, feed)
            fns[tier, "eager"] = functools.partial(modules[tier], x)
        with torch.inference_mode():
            ms = interleaved_median_ms(fns, reps, runs, warmup=1)
        largest = max(profiles.values(), key=lambda p: p.macs).name
        for tier, p in profiles.items():
            row = dict(spec=name, tier=tier, gamma=p.gamma, batch=batch, macs=p.macs, macs_ratio=p.macs_ratio)
            for rt in ("ort", "eager"):
                row[f"{rt}_ms"] = ms[tier, rt]
                row[f"{rt}_over"] = ms[tier, rt] / ms[largest, rt] / p.macs_ratio
            rows.append(row)
    return rows


def _mark(gamma: float, over: float, aligned: bool) -> str:
    if not aligned or gamma < 0.2:
        return ""
    return " ✓" if over <= (1.15 if gamma >= 0.4 else 1.3) else " ✗"


def _monotone(rows: list[dict], key: str) -> bool:
    ordered = sorted(rows, key=lambda r: r["macs"])
    return all(a[key] < b[key] for a, b in zip(ordered, ordered[1:]))


def to_markdown(rows: list[dict], reps: int, runs: int, loads: tuple[str, str], wall_s: float) -> str:
    lines = [
        "| spec | batch | tier | MACs ratio | ORT ms | ORT latency ratio / MACs ratio | eager ms | eager latency ratio / MACs ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for spec in dict.fromkeys(r["spec"] for r in rows):
        aligned = "aligned" in spec
        for batch in dict.fromkeys(r["batch"] for r in rows):
            group = [r for r in rows if r["spec"] == spec and r["batch"] == batch]
            for r in group:
                lines.append(
                    f"| {spec} | {batch} | {r['tier']} | {r['macs_ratio']:.3f} | {r['ort_ms']:.2f} "
                    f"| {r['ort_over']:.2f}{_mark(r['gamma'], r['ort_over'], aligned)} | {r['eager_ms']:.2f} "
                    f"| {r['eager_over']:.2f}{_mark(r['gamma'], r['eager_over'], aligned)} |"
                )
            checked = [r for r in group if r["gamma"] >= 0.2]
            met = {rt: sum(r[f"{rt}_over"] <= (1.15 if r["gamma"] >= 0.4 else 1.3) for r in checked) for rt in ("ort", "eager")}
            summary.append(
                f"- {spec}, batch {batch}: ratio target met by {met['ort']}/{len(checked)} tiers on onnxruntime, "
                f"{met['eager']}/{len(checked)} on eager; latency increasing with MACs: "
                f"onnxruntime {'yes' if _monotone(group, 'ort_ms') else 'no'}, eager {'yes' if _monotone(group, 'eager_ms') else 'no'}"
            )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, onnxruntime {ort.__version__}, torch {torch.__version__}, "
        f"1 thread each; load average before: {loads[0]}, after: {loads[1]}; wall time {wall_s:.0f} s"
    )
    return (
        f"Random weights, median of {reps} interleaved rounds of {runs} calls, {machine}. ✓/✗: target "
        "met or missed (aligned specs only: <= 1.15 for gamma >= 0.4, <= 1.3 for gamma 0.2).\n\n"
        + "\n".join(lines) + "\n\n" + "\n".join(summary) + "\n"
    )


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=list(SPECS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    before, start = _load(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for spec in args.specs for row in bench_spec(spec, args.batches, args.reps, args.runs, Path(tmp))]
    print(to_markdown(rows, args.reps, args.runs, (before, _load()), time.perf_counter() - start))


if __name__ == "__main__":
    publish.run("latency", main)
