"""Convergent comparison on digits (docs/benchmarks/compare.md).

The NeFL paper's Table 1 rows and ablation (``compare --preset nefl-table1``: NeFL-W/D/WD with
learnable and fixed steps, HeteroFL, FjORD and DepthFL as the NeFL paper defines them, FedAvg)
on specs/train/digits-table1.yaml (ResNet20 at 8x8, 40 rounds of 5 local epochs), IID and
Dirichlet alpha 0.5, both BN treatments, every seed's runs ``--jobs`` at a time with one torch
thread each; then the compute-matched set (``--part matched``): FjORD and DepthFL as their own
papers define them against NeFL-W / NeFL-D, every entry's local epochs chosen so that its MACs per
client-round come nearest NeFL-W's at 5 epochs. Finished runs are reused (``summary.json``), so
an interrupted benchmark goes on where it stopped. Prints each part's tables, whether every curve
has flattened (its change over the last 5 rounds within the seed std or the test set's binomial
standard error, whichever is larger) and the wall time, and writes them to OUT/PART/bench.md.

FjORD (NeFL's) is NeFL-W (N/L) by construction (tests/test_methods_faithful.py checks the two
give bit-identical global states), so its row is that run, not trained twice.

    OMP_NUM_THREADS=1 python benchmarks/bench_compare.py --out /tmp/table1 --seeds 3 --parts iid,noniid,matched
    python benchmarks/bench_compare.py --out /tmp/table1 --seeds 3 --parts iid --report-only

Results: every table printed goes to ``benchmarks/results/compare.json`` and the figure drawn from it
to ``docs/benchmarks/img/compare.png`` (``--plot-only`` redraws the figure alone; see ``publish.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from nefl_zoo.fl.compare import (Entry, client_round_macs, compare_methods, curves, flatness, load_runs, nefl_table1, report,
                                 results_table, treatments)
from nefl_zoo.fl.config import load_config
from nefl_zoo.data.loading import load_data

import publish  # results JSON and figure (benchmarks/publish.py)

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "specs/train/digits-table1.yaml"
PARTS = {"iid": [], "noniid": ["data.partition=dirichlet", "data.alpha=0.5", "name=digits-table1-noniid"], "matched": []}
ALIASES = {"fjord-nefl": "nefl-w-nl"}  # identical by construction: reported from the aliased run


def entries(part: str, config) -> list[Entry]:
    """The entries of a part: the Table 1 preset, or the compute-matched set."""
    if part != "matched":
        return [e for e in nefl_table1(config) if e.key not in ALIASES]
    table = {e.key: e for e in nefl_table1(config)}
    w, d = table["nefl-w"].spec, table["nefl-d"].spec
    return [table["nefl-w"], table["nefl-d"], Entry("fjord", "fjord", w, "original", config_model_args=True, name="FjORD (its paper's)"),
            Entry("depthfl", "depthfl", d, "original", config_model_args=True, name="DepthFL (its paper's)"), table["fedavg"]]


def matched_epochs(config, rows: list[Entry], out: Path) -> dict[str, int]:
    """Per entry, the local epochs whose MACs per client-round come nearest NeFL-W's at the
    config's epochs (measured on a one-round probe run of each entry)."""
    probe = config.model_copy(update={"rounds": 1})
    compare_methods(probe, rows, 1, out / "probe", jobs=1, threads=1, reuse=True)
    macs = {e.key: client_round_macs(probe, e, [probe.seed], out / "probe") for e in rows}
    target = macs["nefl-w"]
    return {k: max(1, round(config.train.local_epochs * target / m)) for k, m in macs.items()}


def flatness_table(out: Path, config, rows: list[Entry], seeds: int) -> str:
    """Per entry and BN treatment: |change of the seed-mean worst case over the last 5 rounds| vs
    its noise (flat: the change is within the larger of the seed std at the end and the test
    set's binomial standard error)."""
    runs = load_runs(config, rows, seeds, out)
    info = config.build_strategy().info
    images = len(load_data(config.data, config.data_root(), info.input_size, config.clients.num_clients, config.seed).test)
    lines = [f"| Method | BN | worst case at the end | change over last 5 rounds (points) | seed std at the end | "
             f"noise: max(std, SE on {images} test images) | flat |", "|---|---|---|---|---|---|---|"]
    for treatment in treatments(runs):
        found = curves(out, rows, runs, [config.seed + s for s in range(seeds)], treatment)
        for e in rows:
            change, noise = flatness(found[e.key], images)
            acc = found[e.key][1][:, -1]
            std = acc.std(ddof=1) if len(acc) > 1 else 0.0
            lines.append(f"| {e.label} | {treatment} | {acc.mean():.2f} | {change:.2f} | {std:.2f} | {noise:.2f} | "
                         f"{'yes' if change <= noise else 'no'} |")
    return "\n".join(lines)


def run_part(part: str, args) -> str:
    config = load_config(CONFIG, PARTS[part])
    rows = entries(part, config)
    out = args.out / part
    start = time.perf_counter()
    if part == "matched":
        epochs = matched_epochs(config, rows, out)
        print(f"matched local epochs: {epochs}", flush=True)
        rows = [dataclasses.replace(e, key=f"{e.key}-e{epochs[e.key]}", name=f"{e.label}, E={epochs[e.key]}") for e in rows]
        configs = {e.key: config.model_copy(update={"train": config.train.model_copy(update={"local_epochs": int(e.key.rsplit("-e", 1)[1])})})
                   for e in rows}
        runs, macs = {}, {}
        for e in rows:  # one entry per call: each its own local epochs
            if not args.report_only:
                compare_methods(configs[e.key], [e], args.seeds, out, jobs=args.jobs, threads=1, reuse=True)
            runs[e.key] = load_runs(configs[e.key], [e], args.seeds, out)[e.key]
            macs[e.key] = client_round_macs(configs[e.key], e, [config.seed + s for s in range(args.seeds)], out)
        text = results_table(config, rows, runs, macs) + "\n" + flatness_table(out, config, rows, args.seeds)
    else:
        if args.report_only:
            result = report(config, rows, load_runs(config, rows, args.seeds, out), out)
        else:
            result = compare_methods(config, rows, args.seeds, out, jobs=args.jobs, threads=1, reuse=True)
        text = result.markdown + "\n" + flatness_table(out, config, rows, args.seeds)
    wall = time.perf_counter() - start
    text = f"## {part}: {len(rows)} entries x {args.seeds} seeds, wall {wall / 60:.1f} min\n\n{text}\n"
    (out / "bench.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/table1"), help="folder of the runs (outside the repository)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--parts", default="iid,noniid,matched")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--report-only", action="store_true", help="tabulate finished runs, train nothing")
    args = parser.parse_args()
    for part in args.parts.split(","):
        print(run_part(part, args), flush=True)
    print(f"per-run wall: {np.mean([p.stat().st_mtime - (p.parent / 'config.yaml').stat().st_mtime for p in args.out.glob('*/*/seed*/summary.json')]):.0f} s mean")


if __name__ == "__main__":
    publish.run("compare", main)
