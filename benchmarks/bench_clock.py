"""Devices in time (docs/benchmarks/clock.md).

Part 1, the scenario: specs/train/mnist-devices.yaml (MNIST, 1,000 clients that are low-end
phones, mid phones and laptops, a 10 s round deadline) under ``compare --preset
time-to-accuracy``: NeFL, HeteroFL, FjORD (NeFL's), DepthFL (NeFL's) with each client on the
largest tier it finishes in time, FedAvg waiting for every online client on the full model, and
FedAvg on only the clients that fit the full model. ``--jobs`` runs at a time, one torch thread
each; finished runs are reused. Writes the time-to-accuracy table and every entry's curve
(simulated time and worst-case accuracy of each evaluation) to benchmarks/results/clock.json,
with the cost measurement, and the figure drawn from it to docs/benchmarks/img/clock.png
(``--plot-only`` redraws the figure alone).

Part 2, the clock's cost: the same population with 10,000 clients (6 images each, 1% a round),
``--cost-rounds`` rounds of NeFL in one process; the time spent in the clock (who is online and
which tier fits, then the round's timing) against the whole round, and the load average.

    python benchmarks/mnist_offline.py /tmp/mnist-data
    python benchmarks/bench_clock.py --root /tmp/mnist-data --out /tmp/bench-clock
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import publish

from nefl_zoo.fl.compare import compare_methods, time_entries
from nefl_zoo.fl.config import load_config
from nefl_zoo.fl.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "specs/train/mnist-devices.yaml"


def scenario(root: Path, out: Path, rounds: int, seeds: int, jobs: int) -> dict:
    """Part 1: train every entry of the preset (reusing finished runs) and report."""
    config = load_config(CONFIG, [f"data.root={root}", f"rounds={rounds}"])
    start = time.perf_counter()
    comparison = compare_methods(config, time_entries(config), seeds, out, jobs=jobs, threads=1, reuse=True)
    print(comparison.markdown)
    found = json.loads((out / "time_to_accuracy.json").read_text())
    return {"config": str(CONFIG.relative_to(ROOT)), "rounds": rounds, "seeds": seeds, "wall_s": round(time.perf_counter() - start, 1),
            **found, "curves": curves(out, found["treatment"])}


def curves(out: Path, treatment: str) -> dict:
    """Per entry, seed 0's evaluations: simulated time (s) and worst-case accuracy (%) under ``treatment``,
    read from the runs' ``metrics.jsonl`` (the worst-case tier as ``results.json`` names it)."""
    worst = {key: runs[0]["worst_case"] for key, runs in json.loads((out / "results.json").read_text()).items()}
    found = {}
    for key, tier in worst.items():
        records = [json.loads(line) for line in (out / key / "seed0" / "metrics.jsonl").read_text().splitlines()]
        evaluated = [r for r in records if "acc" in r]
        found[key] = {"sim_time_s": [r["sim_time_s"] for r in evaluated],
                      "accuracy": [round(100 * r.get("extra", {}).get(f"{treatment}/{tier}", r["acc"][tier]), 2) for r in evaluated]}
    return found


def clock_cost(root: Path, out: Path, rounds: int, clients: int) -> dict:
    """Part 2: the clock's share of a round at ``clients`` clients."""
    torch.set_num_threads(1)
    config = load_config(CONFIG, [f"data.root={root}", f"clients.num_clients={clients}", "clients.fraction=0.01"])
    engine = Engine(config, out / f"cost-{clients}")
    engine.state = engine.strategy.init_global_state()
    spent = {"clock_s": 0.0}
    for name in ("available", "run_round"):
        method = getattr(engine.clock, name)

        def timed(*args, _method=method):
            begin = time.perf_counter()
            try:
                return _method(*args)
            finally:
                spent["clock_s"] += time.perf_counter() - begin

        setattr(engine.clock, name, timed)
    rows = []
    for r in range(rounds):
        spent["clock_s"] = 0.0
        begin = time.perf_counter()
        record = engine.run_round(r)
        engine.round += 1
        total = time.perf_counter() - begin
        rows.append({"round_s": round(total, 4), "clock_s": round(spent["clock_s"], 5), "clients": record["clients"],
                     "online": record["online"], "ratio": round(spent["clock_s"] / total, 5)})
        print(f"round {r + 1}: {total:.2f} s, clock {1000 * spent['clock_s']:.1f} ms ({100 * spent['clock_s'] / total:.2f}%), "
              f"{record['clients']} updates of {record['online']} online")
    clock_s, round_s = sum(r["clock_s"] for r in rows), sum(r["round_s"] for r in rows)
    load = os.getloadavg()
    print(f"{clients:,} clients: the clock takes {1000 * clock_s / rounds:.1f} ms of a {round_s / rounds:.2f} s round "
          f"({100 * clock_s / round_s:.2f}%); load average {load[0]:.2f} on {os.cpu_count()} cores")
    return {"clients": clients, "rounds": rows, "clock_ms_per_round": round(1000 * clock_s / rounds, 2),
            "round_s": round(round_s / rounds, 3), "ratio": round(clock_s / round_s, 5), "load_average": [round(x, 2) for x in load],
            "cores": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="folder holding MNIST/raw (benchmarks/mnist_offline.py)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-clock"), help="folder of the runs (outside the repository)")
    parser.add_argument("--rounds", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cost-rounds", type=int, default=5)
    parser.add_argument("--cost-clients", type=int, default=10_000)
    parser.add_argument("--parts", default="scenario,cost")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = ROOT / "benchmarks/results/clock.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    if "cost" in args.parts:
        results["cost"] = clock_cost(args.root.resolve(), args.out, args.cost_rounds, args.cost_clients)
    if "scenario" in args.parts:
        results["scenario"] = scenario(args.root.resolve(), args.out, args.rounds, args.seeds, args.jobs)
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {results_path.relative_to(ROOT)} and {publish.figure('clock').relative_to(ROOT)}")


if __name__ == "__main__":
    publish.run("clock", main, capture=False)
