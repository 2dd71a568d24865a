"""Method comparison on digits ("Method comparison on digits" in benchmarks/README.md).

NeFL-W, NeFL-D and NeFL-WD (specs/resnet20/nefl-*.yaml) against FjORD, HeteroFL, DepthFL and
FedAvg, IID (specs/train/digits-compare.yaml) and Dirichlet alpha 0.5
(specs/train/digits-compare-noniid.yaml), every seed's runs two at a time with one torch thread
each. Prints each partition's tables (both BN treatments, NeFL's paired differences), whether
every curve has flattened (the seed-mean worst-case accuracy moved less over the last 5 rounds
than its seed std at the end) and the wall time; copies the plots to benchmarks/plots/.

    python benchmarks/bench_compare.py --out /tmp/cmp8 --seeds 5 --partitions iid,noniid
    python benchmarks/bench_compare.py --out /tmp/cmp8 --seeds 3 --partitions noniid --report-only
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

from nefl_zoo.fl.compare import compare_methods, curves, flatness, load_runs, parse_entry, report, treatments
from nefl_zoo.fl.config import load_config

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ["nefl=resnet20/nefl-w", "nefl=resnet20/nefl-d", "nefl=resnet20/nefl-wd", "fjord", "heterofl", "depthfl", "fedavg"]
CONFIGS = {"iid": "specs/train/digits-compare.yaml", "noniid": "specs/train/digits-compare-noniid.yaml"}


def flatness_table(out: Path, config, seeds: int) -> str:
    """Per entry and BN treatment: |change over the last 5 rounds| vs seed std at the end."""
    entries = [parse_entry(m) for m in ENTRIES]
    runs = load_runs(config, ENTRIES, seeds, out)
    lines = ["| Method | BN | change over last 5 rounds (points) | seed std at the end | flat |", "|---|---|---|---|---|"]
    for treatment in treatments(runs):
        found = curves(out, entries, [config.seed + s for s in range(seeds)], treatment)
        for e in entries:
            change, std = flatness(found[e.key])
            lines.append(f"| {e.label} | {treatment} | {change:.2f} | {std:.2f} | {'yes' if change < std else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/cmp8"), help="folder of the runs (outside the repository)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--partitions", default="iid,noniid")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--report-only", action="store_true", help="tabulate finished runs, train nothing")
    args = parser.parse_args()
    plots = ROOT / "benchmarks" / "plots"
    plots.mkdir(exist_ok=True)
    for part in args.partitions.split(","):
        config = load_config(ROOT / CONFIGS[part])
        out = args.out / part
        start = time.perf_counter()
        if args.report_only:
            entries = [parse_entry(m) for m in ENTRIES]
            result = report(config, entries, load_runs(config, ENTRIES, args.seeds, out), out)
        else:
            result = compare_methods(config, ENTRIES, args.seeds, out, jobs=args.jobs, threads=1)
        wall = time.perf_counter() - start
        print(f"## {part}: {len(ENTRIES)} methods x {args.seeds} seeds, wall {wall / 60:.1f} min\n")
        print(result.markdown)
        print(flatness_table(out, config, args.seeds))
        shutil.copy(result.plot, plots / f"digits-compare-{part}.png")
        print(f"\nplot: benchmarks/plots/digits-compare-{part}.png; per-run wall: "
              f"{np.mean([float(p.stat().st_mtime - (p.parent / 'config.yaml').stat().st_mtime) for p in out.glob('*/seed*/summary.json')]):.0f} s mean\n")


if __name__ == "__main__":
    main()
