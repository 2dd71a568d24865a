"""Flower benchmarks (issue: nested FL on Flower): wall time per round of the digits run on the
embedded engine, on Flower's simulation engine and on a local Flower deployment, with start-up
shown separately.

The run: ``specs/train/digits-quick.yaml`` (NeFL, ResNet20 at 16x16, 20 clients, 10 per round,
5 local epochs), ``--rounds`` rounds, evaluated once after the last. A round's time is its
``metrics.jsonl`` record's ``time_s`` (configure, deliver, train, reply, aggregate). Per round:
the median of rounds 2..R. Start-up: wall time from the start (the call, or starting the
SuperLink) to the end of round 1, minus one median round; it holds Ray's start, the nodes' set-up
and the first messages' imports and data loading.

Engines: ``embedded`` (in process; run first and again last, since the machine's load drifts,
and the ratios are to the mean of the two); ``simulation, 1 client at a time`` (Ray, one actor with
``--threads`` threads: the same resources as the embedded engine, so its ratio is the overhead);
``simulation, parallel`` (as many actors as cores allow, what ``--engine flower`` does);
``deployment`` (a SuperLink and 20 SuperNodes on 127.0.0.1, the example Flower App with
``flwr run``; Flower starts one ClientApp process per message).

Run: ``python benchmarks/bench_flower.py [--rounds 4] [--threads 1] [--engines embedded,simulation,deployment]``;
prints markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "specs" / "train" / "digits-quick.yaml"
APP = ROOT / "examples" / "flower-app"


class Clock:
    """Observer: when each round ended, from the start of the measurement."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.ends: list[float] = []

    def start(self, engine) -> None:
        pass

    def round(self, record: dict, last_eval: dict) -> None:
        self.ends.append(time.perf_counter() - self.t0)

    def end(self, engine, result) -> None:
        pass


def summary(name: str, first_round_end: float, records: list[dict], load: tuple[float, float]) -> dict:
    times = [r["time_s"] for r in records]
    per_round = statistics.median(times[1:])
    startup = max(0.0, first_round_end - per_round)  # 0 when round 1 was no slower than the median
    return {"engine": name, "per_round": per_round, "startup": startup, "rounds": times, "load": load}


def overrides(rounds: int) -> list[str]:
    return [f"rounds={rounds}", f"eval.every={rounds}", f"checkpoint_every={rounds}"]


def embedded(rounds: int, out: Path) -> dict:
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.engine import Engine

    load = os.getloadavg()[0]
    clock = Clock()
    Engine(load_config(CONFIG, overrides(rounds)), out).run(observer=clock)
    return summary("embedded", clock.ends[0], records(out), (load, os.getloadavg()[0]))


def simulation(rounds: int, out: Path, threads: int, parallel: bool) -> dict:
    from nefl_zoo.fl.config import load_config
    from nefl_zoo.fl.flower import simulate

    load = os.getloadavg()[0]
    clock = Clock()
    simulate(load_config(CONFIG, overrides(rounds)), out, observer=clock, threads=threads, cpus=None if parallel else threads)
    name = "simulation, parallel" if parallel else "simulation, 1 client at a time"
    return summary(name, clock.ends[0], records(out), (load, os.getloadavg()[0]))


def deployment(rounds: int, out: Path, threads: int) -> dict:
    from nefl_zoo.fl.config import load_config
    sys.path.insert(0, str(ROOT))  # tests/support: test-only process management, not in the package
    from tests.support.deployment import LocalDeployment

    clients = load_config(CONFIG).clients.num_clients
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with LocalDeployment(out.parent / "deployment") as dep:
        dep.start_superlink()
        for i in range(clients):
            dep.start_supernode(i, clients, threads=threads)
        run = dep.flwr_run("run", APP, {"config": str(CONFIG), "out": str(out), "overrides": "; ".join(overrides(rounds))})
        first = None
        while run.poll() is None:
            if first is None and records(out):
                first = time.perf_counter() - t0
            time.sleep(0.1)
        if run.returncode != 0:
            raise RuntimeError(f"flwr run failed: {dep.log('run')}")
    return summary(f"deployment ({clients} SuperNodes)", first, records(out), (load, os.getloadavg()[0]))


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per client (and of the embedded engine)")
    parser.add_argument("--engines", default="embedded,simulation,deployment", help="which to run (comma-separated)")
    args = parser.parse_args()
    engines = set(args.engines.split(","))
    torch.set_num_threads(args.threads)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    work = Path(tempfile.mkdtemp(prefix="bench-flower-"))
    results = [embedded(args.rounds, work / "embedded")]
    if "simulation" in engines:
        results += [simulation(args.rounds, work / "sim-serial", args.threads, parallel=False),
                    simulation(args.rounds, work / "sim-parallel", args.threads, parallel=True)]
    if "deployment" in engines:
        results.append(deployment(args.rounds, work / "deployment-run", args.threads))
    again = embedded(args.rounds, work / "embedded-again")  # the machine's load drifts: bracket the others
    results.append({**again, "engine": "embedded, again"})

    import flwr

    base = (results[0]["per_round"] + results[-1]["per_round"]) / 2  # embedded, before and after
    print(f"torch {torch.__version__}, flwr {flwr.__version__}, {args.threads} thread(s) per client, "
          f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}\n")
    print(f"### digits-quick, {args.rounds} rounds (per round: median of rounds 2..{args.rounds}; "
          f"ratio: to the mean of the two embedded runs, {base:.2f} s)\n")
    print("| engine | start-up (s) | per round (s) | ratio to embedded | rounds (s) | load avg before / after |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rounds = ", ".join(f"{t:.2f}" for t in r["rounds"])
        print(f"| {r['engine']} | {r['startup']:.1f} | {r['per_round']:.2f} | {r['per_round'] / base:.2f}x | {rounds} | "
              f"{r['load'][0]:.1f} / {r['load'][1]:.1f} |")


if __name__ == "__main__":
    main()
