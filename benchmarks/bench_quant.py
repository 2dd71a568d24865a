"""Quantized tiers: per tier and precision, accuracy, bytes and latency, and which
(tier, precision) a device gets at three budgets.

Every source is exported with ``ExportOptions(precisions=("fp32", "int8", "fp16"))``:
INT8 calibrated on 256 of the run's training images, every file's accuracy measured on the
run's test split, INT8/FP16 checked against FP32 there. Then every file of the export is timed
with onnxruntime at batch 1 and 32, one thread, all files of a source in alternation
(``TierRuntime.benchmark_many``, i.e. ``nefl_zoo.timing.interleaved_median_ms``), so that load
changes on a shared machine hit them alike. The budgets are asked of ``TierRuntime.select``
(what ``nefl-zoo select --max-ms X --max-mb Y`` does, against the latency measured at export),
once over every precision and once over FP32 only.

Sources: the demo run (``make demo``: ``nefl-zoo train specs/train/digits-aligned-quick.yaml``)
and an aligned ResNet56 (``specs/resnet56/nefl-wd-aligned.yaml``) trained briefly on digits
at 3x32x32 (the config below). ``--train`` trains whichever run directory is missing, with one
thread.

    .venv/bin/python benchmarks/bench_quant.py --demo runs/demo --resnet56 runs/r56-digits [--train] [--runs 20]

Results: every table printed goes to ``benchmarks/results/quant.json`` and the figure drawn from it
to ``docs/benchmarks/img/quant.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import onnxruntime as ort

from nefl_zoo.export import CALIBRATION_IMAGES, ExportOptions, export_tiers, load_source
from nefl_zoo.manifest import Manifest
from nefl_zoo.runtime import NoTierFits, TierRuntime

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "specs" / "train" / "digits-aligned-quick.yaml"
RESNET56_CONFIG = f"""# bench_quant.py: the aligned ResNet56 trained briefly on digits (3x32x32)
name: r56-digits
method: nefl
seed: 0
rounds: 6
spec: {ROOT / "specs" / "resnet56" / "nefl-wd-aligned.yaml"}
data: {{dataset: digits, partition: iid}}
clients: {{num_clients: 10, fraction: 0.5, environment: dynamic}}
train: {{local_epochs: 2, batch_size: 32, lr: 0.05, momentum: 0.9, weight_decay: 0.0, schedule: step}}
eval: {{every: 6}}
checkpoint_every: 6
"""
BATCHES = (1, 32)
PRECISIONS = ("fp32", "int8", "fp16")


def train(config: Path, out: Path) -> None:
    """``nefl-zoo train CONFIG --out OUT --threads 1``."""
    subprocess.run([str(ROOT / ".venv" / "bin" / "nefl-zoo"), "train", str(config), "--out", str(out), "--threads", "1", "-q"],
                   check=True)


def bench_source(name: str, run_dir: Path, runs: int, workdir: Path) -> dict:
    """Export ``run_dir`` at every precision and time every file at each batch."""
    out = workdir / name
    warnings: list[str] = []
    options = ExportOptions(precisions=PRECISIONS, threads=1, latency_runs=runs, channel_align="auto")
    manifest = export_tiers(load_source(run_dir), out, options, warn=warnings.append)
    runtime = TierRuntime(out, threads=1)
    labels = [t.label for t in manifest.tiers]
    latency = {batch: runtime.benchmark_many(labels, batch, runs) for batch in BATCHES}
    return {"name": name, "run": run_dir, "manifest": manifest, "latency": latency, "warnings": warnings,
            "budgets": budgets(runtime, manifest)}


def budgets(runtime: TierRuntime, manifest: Manifest) -> list[tuple[str, str, str]]:
    """Three budgets derived from the largest FP32 file (its size and export latency) and
    the entry ``select`` picks for each, over every precision and over FP32 only."""
    largest = max((t for t in manifest.tiers if t.precision == "fp32"), key=lambda t: t.macs)
    mb, ms = largest.weights_mb, largest.latency.median_ms
    asked = [
        (f"file <= {0.35 * mb:.3g} MB (0.35x the largest FP32 file)", {"max_file_mb": 0.35 * mb}),
        (f"latency <= {0.7 * ms:.3g} ms (0.7x the largest FP32 tier's)", {"latency_ms": 0.7 * ms}),
        (f"file <= {0.6 * mb:.3g} MB and latency <= {0.9 * ms:.3g} ms", {"max_file_mb": 0.6 * mb, "latency_ms": 0.9 * ms}),
    ]
    rows = []
    for label, budget in asked:
        picks = []
        for precisions in (None, ["fp32"]):
            try:
                choice = runtime.select(**budget, precisions=precisions)
                entry = manifest.tier(choice.label)
                picks.append(f"{choice.label} ({_pct(entry.accuracy)})")
            except NoTierFits:
                picks.append("none fits")
        rows.append((label, *picks))
    return rows


def _pct(accuracy: float | None) -> str:
    return "-" if accuracy is None else f"{100 * accuracy:.2f}%"


def machine() -> str:
    """lscpu's model name and the SIMD flags that decide INT8 kernels."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        text = ""
    model = re.search(r"Model name:\s*(.+)", text)
    flags = set(re.search(r"Flags:\s*(.+)", text).group(1).split()) if "Flags:" in text else set()
    simd = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{model.group(1).strip() if model else 'unknown CPU'} ({os.cpu_count()} CPUs; flags: {', '.join(simd) or 'none of AVX2/AVX-512/VNNI'})"


def to_markdown(results: list[dict], runs: int, load_before: str, load_after: str, seconds: float) -> str:
    lines = [
        f"CPU: {machine()}; onnxruntime {ort.__version__}, CPUExecutionProvider, 1 thread; median of {runs} "
        f"interleaved rounds per file and batch. Load average (`uptime`, {os.cpu_count()} CPUs) before: "
        f"{load_before}, after: {load_after}; wall time {seconds:.0f} s.",
        "",
    ]
    for result in results:
        manifest: Manifest = result["manifest"]
        lat = result["latency"]
        fp32 = {t.name: t for t in manifest.tiers if t.precision == "fp32"}
        lines += [
            f"### {result['name']} (`{result['run']}`)",
            "",
            f"Accuracy on {manifest.tiers[0].accuracy_on or 'no test split'}; INT8 calibrated on "
            f"{CALIBRATION_IMAGES} training images.",
            "",
            "| tier | precision | accuracy | Δ vs FP32 (points) | top-1 agreement with FP32 | bytes | bytes / FP32 "
            "| ms, batch 1 | ms, batch 32 | / FP32, batch 1 | / FP32, batch 32 |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in manifest.tiers:
            ref = fp32[t.name]
            size, ref_size = round(t.weights_mb * 2**20), round(ref.weights_mb * 2**20)
            delta = "" if t.accuracy is None or ref.accuracy is None or t is ref else f"{100 * (t.accuracy - ref.accuracy):+.2f}"
            ratios = [f"{lat[b][t.label] / lat[b][ref.label]:.2f}" for b in BATCHES]
            lines.append(
                f"| {t.name} | {t.precision} | {_pct(t.accuracy)} | {delta} | "
                f"{'' if t.vs_fp32 is None else f'{t.vs_fp32.top1_agreement:.3f}'} | {size:,} | {size / ref_size:.2f} | "
                f"{lat[1][t.label]:.3f} | {lat[32][t.label]:.2f} | {ratios[0]} | {ratios[1]} |"
            )
        lines += ["", "| budget | (tier, precision) chosen | FP32 only |", "|---|---|---|"]
        lines += [f"| {b} | {a} | {f} |" for b, a, f in result["budgets"]]
        if result["warnings"]:
            lines += ["", "Dropped: " + "; ".join(result["warnings"])]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT / "runs" / "demo", help="the demo run directory")
    parser.add_argument("--resnet56", type=Path, default=ROOT / "runs" / "r56-digits", help="the ResNet56 run directory")
    parser.add_argument("--train", action="store_true", help="train the run directories that are missing")
    parser.add_argument("--runs", type=int, default=20, help="timed rounds per file and batch")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.train and not args.resnet56.exists():
            (Path(tmp) / "r56.yaml").write_text(RESNET56_CONFIG)
            train(Path(tmp) / "r56.yaml", args.resnet56)
        if args.train and not args.demo.exists():
            train(DEMO_CONFIG, args.demo)
        load_before, start = os.getloadavg(), time.time()
        results = [bench_source(name, path, args.runs, Path(tmp))
                   for name, path in (("demo run (ResNet20, digits 16x16)", args.demo),
                                      ("aligned ResNet56 (digits 3x32x32)", args.resnet56))]
        seconds, load_after = time.time() - start, os.getloadavg()
    fmt = lambda load: ", ".join(f"{x:.2f}" for x in load)  # noqa: E731
    print(to_markdown(results, args.runs, fmt(load_before), fmt(load_after), seconds))


if __name__ == "__main__":
    publish.run("quant", main)
