"""ONNX tiers: does onnxruntime latency follow the MACs of each tier, and how does it compare
with PyTorch eager on the same slim module?

For every tier of the given specs (default: resnet110 NeFL-WD and resnet56 NeFL-D), the tier
is exported with ``nefl_zoo.export.export_tiers`` (random weights, verified against PyTorch),
once plain and once with inner channels zero-padded to a multiple of ``--pad-channels``. Both
are timed with onnxruntime (``TierRuntime.benchmark``) and the slim module with PyTorch
eager, at one batch size on the CPU, with the same number of threads (default 1: on a shared
2-core machine, two spinning threads per runtime collapse as soon as another process takes a
core). Latency ratios are against the spec's largest tier; the target is a latency ratio
within 1.3x of the MACs ratio for gamma >= 0.4.

    .venv/bin/python benchmarks/bench_export.py [--batch 64] [--runs 10] [--threads 1] [--pad-channels 8]

The printed table goes to ``benchmarks/results/export.json`` and its figure to
``docs/benchmarks/img/export.png`` (:mod:`publish`; ``--plot-only`` redraws the figure alone).

Results: every table printed goes to ``benchmarks/results/export.json`` and the figure drawn from it
to ``docs/benchmarks/img/export.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

import onnxruntime as ort
import torch

from nefl_zoo.export import ExportOptions, export_tiers, load_source
from nefl_zoo.runtime import TierRuntime
from nefl_zoo.timing import median_ms

import publish  # results JSON and figure (benchmarks/publish.py)

SPECS = ("resnet110/nefl-wd", "resnet56/nefl-d")
TARGET = 1.3


def bench_spec(spec: str, batch: int, runs: int, threads: int, align: int, workdir: Path) -> list[dict]:
    """One row per tier: MACs ratio, onnxruntime latency of the plain and channel-padded
    exports, PyTorch eager latency, and the ratios."""
    source = load_source(spec)
    runtimes = {}
    for channel_align in (1, align):
        out = workdir / f"{spec.replace('/', '_')}_align{channel_align}"
        manifest = export_tiers(source, out, ExportOptions(batch=batch, latency_runs=1, channel_align=channel_align))
        runtimes[channel_align] = TierRuntime(out, threads=threads)
    x = torch.randn(batch, *source.compiled.input_size)
    rows = []
    for tier in manifest.tiers:
        module = source.compiled[tier.name].load(source.global_state).eval()
        with torch.inference_mode():
            eager_ms = median_ms(lambda: module(x), runs, warmup=2)
        ort_ms = {a: rt.benchmark(tier.name, batch, runs) for a, rt in runtimes.items()}
        rows.append(dict(spec=spec, tier=tier, ort_ms=ort_ms, eager_ms=eager_ms))
    largest = max(rows, key=lambda r: r["tier"].macs)
    for row in rows:
        row["over_macs"] = {
            a: ms / largest["ort_ms"][a] / row["tier"].macs_ratio for a, ms in row["ort_ms"].items()
        }
    return rows


def _mark(gamma: float, over_macs: float) -> str:
    return "" if gamma < 0.4 else (" ✓" if over_macs <= TARGET else " ✗")


def to_markdown(rows: list[dict], batch: int, runs: int, threads: int, align: int) -> str:
    header = (
        "| spec | tier | gamma | MACs | MACs ratio | ORT ms | latency ratio / MACs ratio "
        f"| ORT ms, channels padded to {align} | latency ratio / MACs ratio, padded "
        "| eager ms | ORT speed-up vs eager |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in rows:
        t, ort_ms, over = r["tier"], r["ort_ms"], r["over_macs"]
        gamma = t.gamma if t.gamma is not None else t.params_ratio
        lines.append(
            f"| {r['spec']} | {t.name} | {gamma:g} | {t.macs / 1e6:.1f}M | {t.macs_ratio:.3f} "
            f"| {ort_ms[1]:.1f} | {over[1]:.2f}{_mark(gamma, over[1])} "
            f"| {ort_ms[align]:.1f} | {over[align]:.2f}{_mark(gamma, over[align])} "
            f"| {r['eager_ms']:.1f} | {r['eager_ms'] / ort_ms[1]:.2f}x |"
        )
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, onnxruntime {ort.__version__}, "
        f"torch {torch.__version__}, {threads} thread(s) each"
    )
    targeted = [r for r in rows if (r["tier"].gamma if r["tier"].gamma is not None else r["tier"].params_ratio) >= 0.4]
    met = {a: sum(r["over_macs"][a] <= TARGET for r in targeted) for a in (1, align)}
    return (
        f"Batch {batch}, median of {runs} runs, random weights, {machine}. Latency ratios are "
        f"against each spec's largest tier, MACs are the tier's own (padding adds none to the "
        f"count); target: latency ratio / MACs ratio <= {TARGET} for gamma >= 0.4 (✓ met, ✗ missed). "
        "Speed-up: PyTorch eager over the plain ONNX export.\n\n" + "\n".join(lines) + "\n\n"
        f"Target met by {met[1]} of {len(targeted)} tiers with gamma >= 0.4 as exported plainly, "
        f"by {met[align]} of {len(targeted)} with `--pad-channels {align}`. Depth-only tiers follow "
        "their MACs. Width-scaled tiers have channel counts such as 13/25/50 or 15/29/57, "
        "which onnxruntime's blocked CPU convolutions run far below their MACs; the full width "
        "(16/32/64) is faster than a narrower tier in the plain export. Zero-padding inner "
        "channels to a multiple of the block (`nefl-zoo export --pad-channels N`, same outputs) "
        "recovers most of it; what remains for small gamma_w is the padding itself "
        "(13 -> 16 channels is 1.5x the MACs of a 3x3 convolution).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", nargs="+", default=list(SPECS), help="spec files or shipped spec names")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of onnxruntime and torch")
    parser.add_argument("--pad-channels", type=int, default=8, help="channel alignment of the padded exports")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for spec in args.specs for row in bench_spec(spec, args.batch, args.runs, args.threads, args.pad_channels, Path(tmp))]
    body = to_markdown(rows, args.batch, args.runs, args.threads, args.pad_channels)
    print(body)


if __name__ == "__main__":
    publish.run("export", main)
