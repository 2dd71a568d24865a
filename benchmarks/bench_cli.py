"""CLI wall time: `nefl-zoo build` and `profile` against a bare `python -c "import torch"`.

Each command runs as a whole process, paired with the baseline (A B A B ..., one warm-up pair
first) so that a drift of machine speed hits both alike; the figure is the median of the
per-pair ratios. "cold": every run gets a new, empty MACs cache (``NEFL_ZOO_CACHE_DIR``), so
fvcore traces every model; "warm": a cache filled by the warm-up run. Targets: build <= 1.5x
and profile <= 2.5x with the cache warm.

    .venv/bin/python benchmarks/bench_cli.py [--pairs 7]

Results: every table printed goes to ``benchmarks/results/cli.json`` and the figure drawn from it
to ``docs/benchmarks/img/cli.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import publish  # results JSON and figure (benchmarks/publish.py)

BIN = Path(sys.executable).parent
BASELINE = [sys.executable, "-c", "import torch"]
COMMANDS = {
    "build resnet110 --gamma 0.2": ([str(BIN / "nefl-zoo"), "build", "resnet110", "--gamma", "0.2"], 1.5),
    "profile resnet110/nefl-wd": ([str(BIN / "nefl-zoo"), "profile", "resnet110/nefl-wd"], 2.5),
}


def _wall(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def paired(cmd: list[str], pairs: int, cold: bool) -> tuple[float, float, float]:
    """Median seconds of ``cmd``, of the baseline, and median of the per-pair ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NEFL_ZOO_CACHE_DIR=str(Path(tmp) / "warm"), OMP_NUM_THREADS="1")
        a, b = [], []
        for i in range(pairs + 1):
            if cold:
                env["NEFL_ZOO_CACHE_DIR"] = str(Path(tmp) / f"cold{i}")
            ta, tb = _wall(cmd, env), _wall(BASELINE, env)
            if i:  # the first pair warms the file cache (and, warm, the MACs cache)
                a.append(ta)
                b.append(tb)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.split("load average:")[-1].strip()
    print(f"{args.pairs} pairs each after one warm-up pair, OMP_NUM_THREADS=1; load average at start {load}\n")
    print("| command | MACs cache | command s | `python -c \"import torch\"` s | ratio (median of pairs) | target |")
    print("|---|---|---|---|---|---|")
    for label, (cmd, target) in COMMANDS.items():
        for cold in (True, False):
            a, b, ratio = paired(cmd, args.pairs, cold)
            met = "" if cold else (" ✓" if ratio <= target else " ✗")
            print(f"| `nefl-zoo {label}` | {'cold' if cold else 'warm'} | {a:.2f} | {b:.2f} | {ratio:.2f}{met} | <= {target} warm |")


if __name__ == "__main__":
    publish.run("cli", main)
